"""The memory tier's hand-off: the variables ``bootseer run`` sets for its command, which
:meth:`ckpt.memory.MemoryConfig.from_env` reads back, and the checks of the run's settings.

    check_memory_settings(layout, replication, listen)   # refused before anything is made
    env = memory_handoff(directory, fresh=True, server="10.0.0.5:7070", durable_every=100)

Both sides name the variables from here, so they cannot drift apart. Torch-free (json only):
the node agent imports it to start a run, before the job's torch exists (and without numpy,
which the tier's own modules load).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .memory_place import parse_layout

DIR_ENV = "BOOTSEER_MEMCKPT_DIR"  # the agent's directory of the copies
SERVER_ENV = "BOOTSEER_MEMCKPT_SERVER"  # this node's peer server, HOST:PORT
DURABLE_EVERY_ENV = "BOOTSEER_MEMCKPT_DURABLE_EVERY"  # the durable tier every N steps
LAYOUT_ENV = "BOOTSEER_MEMCKPT_LAYOUT"  # the job's parallel groups (JSON): who keeps the copy
REPLICATION_ENV = "BOOTSEER_MEMCKPT_REPLICATION"  # "sync": save returns once the peer acked
REPLICATIONS = ("async", "sync")
DURABLE_OUTAGE_ENV = "BOOTSEER_MEMCKPT_DURABLE_OUTAGE_S"  # ckpt.durable_outage_s
FRESH_ENV = "BOOTSEER_MEMCKPT_FRESH"  # "1": the directory was made empty for this run
TOKEN_ENV = "BOOTSEER_MEMCKPT_TOKEN"  # the job's secret, the same on every node


def check_memory_settings(
    layout: str = "",
    replication: str = "async",
    listen: str = "",
    environ: Mapping[str, str] | None = None,
) -> None:
    """Refuse the run's memory-tier settings (``ckpt.memory_layout``,
    ``ckpt.memory_replication``, ``ckpt.memory_listen``) with a ``ValueError`` naming the key
    and the fix, before a directory or a server exists. ``environ``: where the job's secret
    is looked for (default ``os.environ``)."""
    parse_layout(layout, where="ckpt.memory_layout")
    if replication not in REPLICATIONS:
        raise ValueError(
            f"ckpt.memory_replication {replication!r} is not one of "
            f"{', '.join(REPLICATIONS)}: 'async' (the push overlaps the next "
            "step) or 'sync' (save returns once the peer holds the step)"
        )
    host, _, port = listen.rpartition(":")
    if listen and (not host or not port.isdigit()):
        raise ValueError(
            f"ckpt.memory_listen {listen!r} is not HOST:PORT (the "
            f"address other nodes reach this one at)"
        )
    if listen and not (os.environ if environ is None else environ).get(TOKEN_ENV):
        raise ValueError(
            f"ckpt.memory_listen serves this node's peer copies to the other "
            f"nodes: set {TOKEN_ENV} to the job's secret (the same on every "
            "node, e.g. from a Kubernetes Secret; python -c 'import secrets; "
            "print(secrets.token_hex(32))' makes one)"
        )


def memory_handoff(
    directory: str,
    *,
    fresh: bool,
    server: str = "",
    durable_every: int = 0,
    durable_outage_s: float = 600.0,
    layout: str = "",
    replication: str = "async",
) -> dict[str, str]:
    """The variables that hand the tier to the command: ``fresh`` when ``directory`` was made
    empty for this run (memory is then never older than the durable tier); ``server`` this
    node's peer server; ``durable_every`` 0 for every save. The job's secret is not among
    them: the command inherits ``BOOTSEER_MEMCKPT_TOKEN`` from the agent's environment."""
    env = {DIR_ENV: directory}
    if fresh:
        env[FRESH_ENV] = "1"
    if server:
        env[SERVER_ENV] = server
    if durable_every:
        env[DURABLE_EVERY_ENV] = str(durable_every)
    env[DURABLE_OUTAGE_ENV] = repr(float(durable_outage_s))
    if layout:
        env[LAYOUT_ENV] = layout
    if replication != "async":
        env[REPLICATION_ENV] = replication
    return env
