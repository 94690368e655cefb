"""Environment variables bootseer knows that are not configuration keys.

Every ``BOOTSEER_*`` variable is either a key's (``BOOTSEER_<SECTION>_<KEY>``, see
:mod:`bootseer.config`) or listed here with its role, so that a command can refuse any other
one as a mistake and ``bootseer config show`` can list them all:

* hand-offs: set by a bootseer command for the program it starts (``bootseer run`` telling
  the job's ``CheckpointManager`` where the node's checkpoint cache is); never settings;
* credentials: secrets stay out of configuration files, as AWS's and docker's do;
* fsspec: fsspec's own per-protocol defaults, which apply to ``striped::`` like to any
  fsspec filesystem (the one place a process's stripe size can come from the environment);
* reserved: the test and benchmark harness's own;
* retired: names of earlier versions, refused with the name that replaced them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt import SKIP_ENV

__all__ = [
    "Variable",
    "VARIABLES",
    "RESERVED_PREFIXES",
    "RETIRED",
    "CKPT_CACHE_HANDOFF",
    "INCIDENT_HANDOFF",
    "VERSION_HANDOFF",
    "known_variable",
]

#: The variable `bootseer run` sets to ``ckpt.cache_dir`` for its command (read by ckpt.cache).
CKPT_CACHE_HANDOFF = "BOOTSEER_CKPT_CACHE"
#: The newest incident with a verdict, the same on every node (`bootseer run` under a
#: controller -> its command: torchrun's ``--rdzv-id``).
INCIDENT_HANDOFF = "BOOTSEER_INCIDENT"
#: The code version this attempt runs (`bootseer run` under a controller -> its command).
VERSION_HANDOFF = "BOOTSEER_VERSION"


@dataclass(frozen=True)
class Variable:
    """A variable that is not a configuration key: its role, who sets and who reads it."""

    name: str
    role: str  # hand-off | credential | fsspec | reserved
    meaning: str
    secret: bool = False


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "BOOTSEER_CONFIG", "config file", "the TOML configuration file when no --config is given"
    ),
    Variable(
        CKPT_CACHE_HANDOFF,
        "hand-off",
        "bootseer run -> its command: ckpt.cache_dir, the node-local checkpoint cache that "
        "CheckpointManager(cache_dir=None) reads",
    ),
    Variable(
        "BOOTSEER_CONTROL_DIR",
        "hand-off",
        "bootseer run -> its command: where bootseer.ready()/heartbeat() write",
    ),
    Variable(
        "BOOTSEER_READY_FILE",
        "hand-off",
        "bootseer run -> its command: run.ready_file, or <control dir>/ready",
    ),
    Variable(
        "BOOTSEER_TRACE_DIR",
        "hand-off",
        "bootseer run -> its command: run.trace_dir (stack dumps go there)",
    ),
    Variable(
        "BOOTSEER_NODE",
        "hand-off",
        "bootseer run -> its command: the node's name; also read as run.node, so a "
        "bootseer command inside the job names the same node",
    ),
    Variable(
        "BOOTSEER_ATTEMPT",
        "hand-off",
        "bootseer run -> its command: the attempt number (0 first); CheckpointManager's attempt id",
    ),
    Variable(
        "BOOTSEER_MEMCKPT_DIR",
        "hand-off",
        "bootseer run -> its command: the memory tier's directory (ckpt.memory), which "
        "CheckpointManager(memory=None) copies every save into",
    ),
    Variable(
        "BOOTSEER_MEMCKPT_SERVER",
        "hand-off",
        "bootseer run -> its command: HOST:PORT of this node's server of peer copies "
        "(ckpt.memory_listen)",
    ),
    Variable(
        "BOOTSEER_MEMCKPT_DURABLE_EVERY",
        "hand-off",
        "bootseer run -> its command: ckpt.durable_every",
    ),
    Variable(
        "BOOTSEER_MEMCKPT_DURABLE_OUTAGE_S",
        "hand-off",
        "bootseer run -> its command: ckpt.durable_outage_s",
    ),
    Variable(
        "BOOTSEER_MEMCKPT_FRESH",
        "hand-off",
        "bootseer run -> its command: '1' when the memory tier's directory was made for "
        "this run (no check of the durable tier before an in-memory load)",
    ),
    Variable(
        "BOOTSEER_MEMCKPT_LAYOUT",
        "hand-off",
        "bootseer run -> its command: ckpt.memory_layout, the job's parallel groups "
        "(JSON) that choose the node keeping each rank's copy",
    ),
    Variable(
        "BOOTSEER_MEMCKPT_REPLICATION",
        "hand-off",
        "bootseer run -> its command: ckpt.memory_replication ('sync': a save returns "
        "once the peer acked the step)",
    ),
    Variable(
        INCIDENT_HANDOFF,
        "hand-off",
        "bootseer run (under a controller) -> its command: the newest incident with a "
        "verdict, the same on every node (put it in torchrun's --rdzv-id)",
    ),
    Variable(
        VERSION_HANDOFF,
        "hand-off",
        "bootseer run (under a controller) -> its command: the id of the code version "
        "this attempt runs (bootseer controller publish)",
    ),
    Variable(
        SKIP_ENV,
        "hand-off",
        "bootseer run -> its command: the checkpoints a restart after a NaN passes over "
        "(ckpt.skip, read by CheckpointManager)",
    ),
    Variable(
        "BOOTSEER_MOUNT_LOG",
        "hand-off",
        "bootseer fs/image mount -> its background mount process: its private log, "
        "removed by it once it unmounted cleanly",
    ),
    Variable(
        "BOOTSEER_ROOTFS",
        "hand-off",
        "bootseer image record --no-chroot -> the recorded command: the image's mount",
    ),
    Variable(
        "BOOTSEER_PREFIX",
        "hand-off",
        "bootseer env ensure -- CMD -> the install command: the prefix to install into",
    ),
    Variable(
        "BOOTSEER_REGISTRY_USERNAME",
        "credential",
        "registry user for image commands and the snapshotter (else docker's config.json)",
    ),
    Variable("BOOTSEER_REGISTRY_PASSWORD", "credential", "registry password", secret=True),
    Variable(
        "BOOTSEER_MEMCKPT_TOKEN",
        "credential",
        "the job's secret that the memory tier's peer connections prove they hold "
        "(HMAC challenge-response; the same on every node; bootseer run's command "
        "inherits it)",
        secret=True,
    ),
    Variable(
        "BOOTSEER_JOB_SECRET",
        "credential",
        "the job's secret every record in the controller's store is sealed with "
        "(HMAC-SHA256): the same on bootseer controller, every bootseer run (and warmup) "
        "--controller and bootseer controller publish; without it they refuse to start "
        "(bootseer run's command does not inherit it)",
        secret=True,
    ),
    Variable(
        "DOCKER_CONFIG", "credential", "directory of docker's config.json (registry credentials)"
    ),
    Variable(
        "FSSPEC_STRIPED_STRIPE_SIZE",
        "fsspec",
        "default stripe size of striped:// in every process (fsspec's configuration); "
        "storage options and per-call arguments win",
    ),
    Variable(
        "FSSPEC_STRIPED_CONCURRENCY",
        "fsspec",
        "default streams per striped file in every process (fsspec's configuration)",
    ),
    Variable(
        "BOOTSEER_CHECK_FAULT",
        "reserved",
        "tests: faults bootseer check injects, e.g. 'alignment:1,sum:2' (rank 1's "
        "reference weights one ulp off, rank 2's reduced sum off by one)",
    ),
    Variable(
        "BOOTSEER_REQUIRE_SYSTEM",
        "reserved",
        "tests: a missing system component fails instead of skipping",
    ),
)

#: Prefixes of the benchmark harness's own variables.
RESERVED_PREFIXES: tuple[str, ...] = ("BOOTSEER_BENCH_", "BOOTSEER_E2E_")

#: Names earlier versions read -> what replaced them.
RETIRED: dict[str, str] = {
    "BOOTSEER_STRIPE_SIZE": "FSSPEC_STRIPED_STRIPE_SIZE (fsspec's default for striped://), or "
    'the storage option {"striped": {"stripe_size": ...}}',
    "BOOTSEER_STRIPE_CONCURRENCY": "FSSPEC_STRIPED_CONCURRENCY (fsspec's default for "
    'striped://), or the storage option {"striped": '
    '{"concurrency": ...}}',
    "BOOTSEER_BASE_IMAGE": "BOOTSEER_ENV_BASE_IMAGE (key env.base_image)",
    "BOOTSEER_UV": "BOOTSEER_ENV_UV (key env.uv)",
}

_BY_NAME = {v.name: v for v in VARIABLES}


def known_variable(name: str) -> Variable | None:
    """The registered variable ``name`` (reserved prefixes included), or None."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    if name.startswith(RESERVED_PREFIXES):
        return Variable(name, "reserved", "benchmark harness")
    return None
