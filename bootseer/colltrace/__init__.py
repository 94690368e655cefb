"""Collective tracing: which rank and which collective a hang or a slowdown started from.

In the training script (or ``[colltrace] enabled = true`` under ``bootseer run``)::

    import bootseer.colltrace
    bootseer.colltrace.enable()        # before or after init_process_group

Every ``torch.distributed`` collective and point-to-point op of the process then goes into a
ring in shared memory (:mod:`.ring`); the node agent reads the rings (:mod:`.reader`), and
:mod:`.analyze` turns them into a verdict ("rank 5 (node-2) never issued all_reduce #812 in
group dp-1; 3 ranks wait in it since 12.4 s"). docs/colltrace.md has the whole story.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DIR_ENV", "ENABLED_ENV", "default_dir", "disable", "enable", "enable_from_env"]

DIR_ENV = "BOOTSEER_COLLTRACE_DIR"
ENABLED_ENV = "BOOTSEER_COLLTRACE_ENABLED"
CAPACITY_ENV = "BOOTSEER_COLLTRACE_CAPACITY"
_TRUE = {"1", "true", "yes", "on"}


def default_dir(node: str | None = None) -> Path:
    """Where rings go when nothing says and no ``bootseer run`` hands a directory down: a
    tmpfs directory per user and node, made 0700 by the first rank, refused when another
    user made it first (its name is predictable: ``bootseer run`` gives each job one that is
    not, and so can ``BOOTSEER_COLLTRACE_DIR``)."""
    import socket

    node = node or os.environ.get("BOOTSEER_NODE") or socket.gethostname()
    return Path("/dev/shm") / f"bootseer-colltrace-{os.geteuid()}" / node


def enable(directory: str | os.PathLike | None = None, *, capacity: int | None = None) -> Path:
    """Start recording this process's collectives (idempotent); returns the ring directory.

    ``directory`` defaults to ``$BOOTSEER_COLLTRACE_DIR`` (set by ``bootseer run``), else
    :func:`default_dir`; ``capacity`` (records kept) to ``$BOOTSEER_COLLTRACE_CAPACITY`` or
    4096. The ring file appears at the first collective (its rank is known then). The
    directory is made 0700, or must be this user's, 0700 and not a link: another user's is
    refused here (:class:`striped_fs.privdir.UnsafePath`, naming what was found)."""
    from . import recorder

    with recorder._lock:
        if recorder._active is not None:
            return recorder._active.directory
        where = Path(directory or os.environ.get(DIR_ENV) or default_dir())
        if capacity is None:
            text = os.environ.get(CAPACITY_ENV, "4096")
            try:
                capacity = int(text)
            except ValueError:
                raise ValueError(
                    f"{CAPACITY_ENV}={text!r} is not a record count: set it to an "
                    "integer >= 1 (or [colltrace] capacity)"
                ) from None
        from striped_fs import PrivateDir

        from .ring import RING_DIR_WHAT

        # made 0700 or checked now (this user's, 0700, not a link), so that a refusal is
        # said here, not at the first collective (where it would leave the job untraced)
        PrivateDir.open(where, what=RING_DIR_WHAT).close()
        rec = recorder.Recorder(where, capacity=capacity)
        rec.install()
        recorder._active = rec
        return where


def disable() -> None:
    """Stop recording and give the ProcessGroup methods back (the ring file stays)."""
    from . import recorder

    with recorder._lock:
        if recorder._active is not None:
            recorder._active.uninstall()
            recorder._active = None


def enable_from_env() -> bool:
    """:func:`enable` when ``BOOTSEER_COLLTRACE_ENABLED`` says so (``bootseer run`` with
    ``[colltrace] enabled``); never raises into training. True when recording."""
    if os.environ.get(ENABLED_ENV, "").strip().lower() not in _TRUE:
        return False
    try:
        enable()
        return True
    except Exception as exc:  # noqa: BLE001 - tracing must never stop training
        import sys

        print(f"bootseer: colltrace not enabled: {exc}", file=sys.stderr, flush=True)
        return False
