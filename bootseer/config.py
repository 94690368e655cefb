"""Configuration of every ``bootseer`` command: a TOML file, environment variables and flags.

One schema (:data:`SCHEMA`) drives everything: the defaults, the TOML sections, the environment
variable of each key (``BOOTSEER_<SECTION>_<KEY>``), the command-line flag and the help text,
and every command (run, warmup, env, image, fs, ckpt, snapshotter, config show) resolves its
settings through it, so no two commands can disagree on a name or a default. Precedence,
lowest first::

    defaults < TOML file (--config, else $BOOTSEER_CONFIG) < environment < flags

The node's paths derive from one key, ``state.dir``: the checkpoint cache, the image cache, the
trace and the snapshotter's root default to directories under it, so that ``bootseer warmup``
fills exactly the caches ``bootseer run`` reads.

Every effective value remembers where it came from (:class:`Setting`), because "why does the job
use this value" is the first question when a restart misbehaves; ``bootseer config show``
prints it. A bad value is a :class:`ConfigError` that names the key, the place (file, variable
or flag) and what was expected: a container that dies at startup must say why in one line. A
``BOOTSEER_*`` variable that is neither a key's nor one of :mod:`bootseer.variables` is refused
as a mistake, and so is a retired name (the message names its replacement).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import os
import tomllib
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .variables import CKPT_CACHE_HANDOFF, RETIRED, known_variable

__all__ = [
    "SCHEMA",
    "ConfigError",
    "Config",
    "KeySpec",
    "Setting",
    "add_config_arguments",
    "check_ckpt_cache_handoff",
    "config_from_args",
    "default_state_dir",
    "load_config",
    "parse_ranks",
    "storage_options",
]

ENV_PREFIX = "BOOTSEER_"
CONFIG_ENV = "BOOTSEER_CONFIG"


class ConfigError(ValueError):
    """A bad configuration value, file or variable; the message names the key and the place."""


@dataclass(frozen=True)
class KeySpec:
    """One key of the schema: its type, default, flag, help (and env aliases)."""

    section: str
    name: str
    kind: str  # str, path, bool, int, count, float, list, ranks, table, size
    default: Any
    help: str
    flag: str
    aliases: tuple[str, ...] = ()  # further environment variables, below the canonical one
    under: str = ""  # a path key whose '' means <state.dir>/<under>

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.section}_{self.name}".upper()

    @property
    def expected(self) -> str:
        """What a valid value looks like, for error messages."""
        return _EXPECTED[self.kind]

    @property
    def flag_form(self) -> str:
        """The flag as help and ``config show`` write it (``--[no-]x`` for a switch)."""
        return f"--[no-]{self.flag[2:]}" if self.kind == "bool" else self.flag


@dataclass(frozen=True)
class Setting:
    """One effective value and where it came from."""

    key: str
    value: Any
    source: str


_EXPECTED = {
    "str": "a string",
    "path": "a path (string)",
    "bool": "true or false",
    "int": "an integer >= 0",
    "count": "an integer >= 1",
    "float": "a number >= 0",
    "list": "a list of strings",
    "ranks": "a rank list like '0-7' or '0,1,4' (or '' to derive it)",
    "table": 'a table keyed by protocol, e.g. {s3 = {endpoint_url = "http://host:9000"}} '
    '(JSON in a variable or flag: {"s3": {"endpoint_url": "http://host:9000"}})',
    "size": "a size in bytes, e.g. 68719476736, '64G' or '512MiB'",
}


def _spec(
    section: str,
    name: str,
    kind: str,
    default: Any,
    flag: str,
    help: str,
    aliases: tuple[str, ...] = (),
    under: str = "",
) -> KeySpec:
    return KeySpec(section, name, kind, default, help, flag, aliases, under)


_KEYS = [
    _spec(
        "state",
        "dir",
        "path",
        "",
        "--state-dir",
        "the node's bootseer state: the checkpoint cache, the image cache, the trace and the "
        "snapshotter's root default to directories under it, and replayed captures are "
        "recorded there; '' = /var/lib/bootseer as root, else ~/.cache/bootseer",
    ),
    _spec(
        "run",
        "trace_dir",
        "path",
        "",
        "--trace-dir",
        "where the startup trace (JSON lines) is written, by run and warmup; "
        "'' = <state.dir>/trace",
        under="trace",
    ),
    _spec(
        "run",
        "node",
        "str",
        "",
        "--node",
        "node name in the trace; '' = the hostname",
        aliases=("BOOTSEER_NODE",),
    ),
    _spec(
        "run",
        "allow_fresh_start",
        "bool",
        False,
        "--allow-fresh-start",
        "start without a checkpoint when the checkpoint store is unreachable",
    ),
    _spec(
        "run",
        "ready_file",
        "path",
        "",
        "--ready-file",
        "file the training process touches when ready; '' = automatic (the wrapper's control dir)",
    ),
    _spec(
        "run",
        "preload",
        "str",
        "",
        "--preload",
        "modules (comma-separated) a Python command's next attempt has imported before it "
        "starts: an interpreter started ahead with them, once the running attempt has "
        "stepped (`python -m MODULE` or `python SCRIPT` commands; docs/robust.md); '' = off",
    ),
    _spec(
        "run",
        "standby",
        "bool",
        False,
        "--standby",
        "this node is a warm spare: its launcher may wait parked at the rendezvous without "
        "a rank (no hang check until a rank reports; its restarts while parked are not "
        "failures); after a verdict it rejoins behind the job's nodes unless the verdict "
        'left the job a node short (docs/robust.md, "Warm standby")',
    ),
    _spec(
        "run",
        "log_tail_lines",
        "int",
        200,
        "--log-tail-lines",
        "last lines of the command's output kept to classify a crash (the output itself "
        "passes through unchanged); 0 = not teed, a crash is classified from its exit alone",
    ),
    _spec(
        "restart",
        "max_restarts",
        "int",
        3,
        "--max-restarts",
        "restarts of a failed command before giving up",
    ),
    _spec(
        "restart",
        "backoff_s",
        "float",
        5.0,
        "--backoff",
        "seconds before the first restart; doubles per restart",
    ),
    _spec(
        "restart",
        "backoff_max_s",
        "float",
        60.0,
        "--backoff-max",
        "longest delay between restarts, in seconds",
    ),
    _spec(
        "restart",
        "max_no_progress",
        "int",
        3,
        "--max-no-progress",
        "stop when none of the last N restarts got past the step reached before them "
        "(heartbeat steps); 0 = off",
    ),
    _spec(
        "hang",
        "timeout_s",
        "float",
        0.0,
        "--hang-timeout",
        "seconds without a heartbeat (after the first heartbeat or ready) that count as a "
        "hang; 0 = hang detection off",
    ),
    _spec(
        "hang",
        "dump_wait_s",
        "float",
        5.0,
        "--dump-wait",
        "seconds to wait for the stack dump of a hung process before SIGKILL",
    ),
    _spec(
        "hang",
        "startup_s",
        "float",
        600.0,
        "--startup-allowance",
        "with timeout_s: the longest silence before the ranks' first heartbeat, and after "
        "a rank's death the longest wait for its launcher (torchrun) to restart its ranks "
        "or exit (a replacement node may take that long to join); the larger of this and "
        "timeout_s counts",
    ),
    _spec(
        "hang",
        "crash_grace_s",
        "float",
        15.0,
        "--crash-grace",
        "seconds a rank whose exception is recorded may live on (a thread keeps its "
        "process) before that process alone is killed, so its launcher sees its end",
    ),
    _spec(
        "hang",
        "learn",
        "bool",
        False,
        "--hang-learn",
        "with timeout_s 0: a rank is hung after max(5 x its job's median step time, 30 s) "
        "without a new step (warm-up steps left out; 600 s before any step time is known)",
    ),
    _spec(
        "health",
        "min_free_disk",
        "size",
        1 << 30,
        "--min-free-disk",
        "free bytes needed on the state, checkpoint cache and trace filesystems before "
        "every (re)start; 0 = not checked",
    ),
    _spec(
        "health",
        "min_free_memory",
        "size",
        256 << 20,
        "--min-free-memory",
        "available memory (MemAvailable) needed before every (re)start; 0 = not checked",
    ),
    _spec(
        "health",
        "gpu",
        "bool",
        True,
        "--gpu-check",
        "run nvidia-smi before every (re)start when it is installed (skipped without it)",
    ),
    _spec(
        "controller",
        "address",
        "str",
        "",
        "--controller",
        "HOST:PORT of the job's controller store (bootseer controller): events go there and "
        "its verdicts decide; '' = the node's agent acts alone",
    ),
    _spec(
        "controller",
        "job",
        "str",
        "job",
        "--job",
        "the job's name in the controller's store (torchrun's --rdzv-id)",
    ),
    _spec(
        "controller",
        "wait_s",
        "float",
        30.0,
        "--controller-wait",
        "seconds to wait for the controller's dump order, then for its verdict, before the "
        "node acts alone",
    ),
    _spec(
        "colltrace",
        "enabled",
        "bool",
        False,
        "--colltrace",
        "record every collective of the command's ranks into shared-memory rings and name "
        "the rank and collective a hang or slowdown started from (docs/colltrace.md)",
    ),
    _spec(
        "colltrace",
        "dir",
        "path",
        "",
        "--colltrace-dir",
        "where the rings live: each job's directory (0700, a name nobody can guess, one "
        "directory per attempt inside) is made in it and kept; '' = in /dev/shm, removed "
        "when bootseer run ends",
    ),
    _spec(
        "colltrace",
        "capacity",
        "count",
        4096,
        "--colltrace-capacity",
        "records kept per rank (80 bytes each)",
    ),
    _spec(
        "colltrace",
        "stuck_s",
        "float",
        0.0,
        "--colltrace-stuck",
        "seconds an op may stay in progress before it counts as stuck; 0 = learned: 10 x "
        "that op's median duration in its group, at least 2 s",
    ),
    _spec(
        "colltrace",
        "straggler_s",
        "float",
        1.0,
        "--colltrace-straggler",
        "a rank starting an op this many seconds after all the others is a straggler",
    ),
    _spec(
        "colltrace",
        "poll_s",
        "float",
        1.0,
        "--colltrace-poll",
        "seconds between two passes of the reader over the rings (at most 2)",
    ),
    _spec(
        "env",
        "spec",
        "list",
        [],
        "--env-spec",
        "requirement files / pyproject.toml / uv.lock of the environment (repeatable); "
        "empty = the environment phase is skipped",
    ),
    _spec("env", "prefix", "path", "", "--env-prefix", "where the environment lives (venv prefix)"),
    _spec("env", "store", "str", "", "--env-store", "snapshot store of environments (fsspec URL)"),
    _spec(
        "env",
        "base_image",
        "str",
        "",
        "--env-base-image",
        "base image digest, an input of the environment's key; '' = none",
    ),
    _spec(
        "env",
        "verify",
        "str",
        "beside",
        "--env-verify",
        "on a node that holds the environment: 'beside' = the marker checked before the "
        "command starts (O(1)), every file's type, size and mtime while it runs (a "
        "mismatch stops the job and the next start restores); 'before' = every file "
        "checked before the command starts",
    ),
    _spec(
        "env",
        "uv",
        "path",
        "",
        "--env-uv",
        "the uv binary of the default install; '' = the uv package's, else uv on PATH (else pip)",
    ),
    _spec(
        "env",
        "lazy",
        "bool",
        False,
        "--env-lazy",
        "bootseer run on a node without the environment: mount the snapshot at env.prefix and "
        "fetch its chunks as the job reads them (read profile first, then the rest) instead of "
        "restoring every file before the command starts",
    ),
    _spec(
        "env",
        "cache",
        "path",
        "",
        "--env-cache",
        "node-local chunk cache of lazily mounted environments; '' = <state.dir>/envs",
        under="envs",
    ),
    _spec(
        "ckpt",
        "url",
        "str",
        "",
        "--ckpt-url",
        "checkpoint location (fsspec URL); empty = the checkpoint phase is skipped",
    ),
    _spec(
        "ckpt",
        "cache_dir",
        "path",
        "",
        "--ckpt-cache-dir",
        "node-local checkpoint cache, filled by warmup and run, read by the job; "
        "'' = <state.dir>/ckpt",
        under="ckpt",
    ),
    _spec(
        "ckpt",
        "ranks",
        "ranks",
        "",
        "--ranks",
        "ranks of this node, '0-7' or '0,1,4'; '' = from LOCAL_WORLD_SIZE and NODE_RANK, else RANK",
    ),
    _spec(
        "ckpt",
        "connections",
        "count",
        16,
        "--ckpt-connections",
        "parallel streams of the checkpoint prefetch",
    ),
    _spec(
        "ckpt",
        "memory",
        "bool",
        False,
        "--ckpt-memory",
        "keep every save of the job's CheckpointManager in this node's shared memory too, "
        "and a copy on a peer node (docs/ckpt.md, the memory tier)",
    ),
    _spec(
        "ckpt",
        "memory_dir",
        "path",
        "",
        "--ckpt-memory-dir",
        "the memory tier's directory (kept at exit); '' = a private one under /dev/shm, "
        "removed when bootseer run ends",
    ),
    _spec(
        "ckpt",
        "memory_listen",
        "str",
        "",
        "--ckpt-memory-listen",
        "HOST:PORT where this node serves its peers' copies (HOST: the node's address the "
        "other nodes reach; never a wildcard); needs the job's secret in "
        "BOOTSEER_MEMCKPT_TOKEN; '' = no peer copies",
    ),
    _spec(
        "ckpt",
        "memory_layout",
        "str",
        "",
        "--ckpt-memory-layout",
        "the job's parallel groups as JSON, as bootseer controller --layout takes them "
        '(\'{"dp": [[0, 1], [2, 3]], "tp": [[0, 2], [1, 3]]}\'): each rank\'s copy goes to '
        "a node sharing none of its groups; '' = the next node",
    ),
    _spec(
        "ckpt",
        "memory_replication",
        "str",
        "async",
        "--ckpt-memory-replication",
        "the memory tier's copy to the peer: 'async' (overlaps the next step; a node lost "
        "within a push loses that step) or 'sync' (save returns once the peer acked the "
        "step: every step pays the push time)",
    ),
    _spec(
        "ckpt",
        "durable_every",
        "int",
        0,
        "--ckpt-durable-every",
        "with the memory tier: write the durable tier every that many steps; 0 = every save",
    ),
    _spec(
        "ckpt",
        "durable_outage_s",
        "float",
        600.0,
        "--ckpt-durable-outage",
        "with the memory tier: seconds durable saves may fail on a transient store error "
        "(the store down or unreachable) while training goes on, memory holding every step; "
        "then save raises. 0 = raise the first failure",
    ),
    _spec("image", "ref", "str", "", "--image-ref", "image reference (for warmup)"),
    _spec(
        "image",
        "cache",
        "path",
        "",
        "--image-cache",
        "node-local block cache of images; '' = <state.dir>/images",
        under="images",
    ),
    _spec(
        "image",
        "platform",
        "str",
        "linux/amd64",
        "--platform",
        "platform picked from a multi-platform image",
    ),
    _spec(
        "image",
        "connections",
        "count",
        16,
        "--connections",
        "parallel range requests to the registry",
    ),
    _spec(
        "storage",
        "options",
        "table",
        {},
        "--storage-options",
        "fsspec options of every store, keyed by protocol",
    ),
    _spec(
        "striped",
        "mirror",
        "str",
        "",
        "--striped-mirror",
        "base URL of a read-only HTTP cache of the S3 store (the cluster's nginx tier, "
        "'http://10.0.0.5:9000'): stripe reads go there first, verified, and to the store "
        "when it fails; merged into storage.options as striped.mirror; '' = none",
    ),
    _spec(
        "snapshotter",
        "root",
        "path",
        "/var/lib/containerd/io.containerd.snapshotter.v1.bootseer",
        "--root",
        "the snapshotter's metadata, snapshots and layer cache, made 0700; where containerd's "
        "CRI reports the image filesystem to the kubelet: <containerd root>/"
        "io.containerd.snapshotter.v1.<name>",
    ),
    _spec(
        "snapshotter",
        "address",
        "path",
        "/run/bootseer/snapshotter.sock",
        "--address",
        "unix socket containerd's proxy_plugins entry names, created 0600",
    ),
    _spec(
        "snapshotter",
        "cache_size",
        "size",
        64 << 30,
        "--cache-size",
        "block cache limit in bytes ('64G', '512MiB' as text)",
    ),
    _spec(
        "snapshotter",
        "record_timeout_s",
        "float",
        120.0,
        "--record-timeout",
        "seconds a first start is recorded when no ready signal comes",
    ),
    _spec(
        "snapshotter",
        "push_profiles",
        "bool",
        True,
        "--push-profiles",
        "push recorded profiles to the registry (else keep them on this node)",
    ),
    _spec(
        "snapshotter",
        "prefetch",
        "bool",
        True,
        "--prefetch",
        "prefetch the frames of stored profiles",
    ),
    _spec(
        "snapshotter",
        "registry_config_path",
        "path",
        "",
        "--registry-config-path",
        "containerd's registry hosts directory (CRI's registry.config_path, e.g. "
        "/etc/containerd/certs.d): read layers from the mirrors its hosts.toml files name; "
        "'' = the registry itself",
    ),
    _spec(
        "snapshotter",
        "holder",
        "path",
        "",
        "--holder",
        "the FUSE holder's socket (bootseer fuse-holder), which keeps the lazy mount across "
        "restarts; '' = fuse-holder.sock beside the address",
    ),
    _spec(
        "snapshotter",
        "spawn_holder",
        "bool",
        True,
        "--spawn-holder",
        "start a holder when none runs (else wait for the holder service, as deploy/ runs it)",
    ),
    _spec(
        "snapshotter",
        "takeover_wait_s",
        "float",
        30.0,
        "--takeover-wait",
        "seconds to wait for a predecessor still serving the root to stop",
    ),
]

#: section -> key name -> spec, in documentation order.
SCHEMA: dict[str, dict[str, KeySpec]] = {}
for _k in _KEYS:
    SCHEMA.setdefault(_k.section, {})[_k.name] = _k
del _k
_BY_KEY: dict[str, KeySpec] = {s.key: s for s in _KEYS}


def _copy(value: Any) -> Any:
    return copy.deepcopy(value) if isinstance(value, list | dict) else value


def default_state_dir(env: Mapping[str, str] | None = None) -> str:
    """``state.dir`` when not set: /var/lib/bootseer as root, else ~/.cache/bootseer."""
    if os.geteuid() == 0:
        return "/var/lib/bootseer"
    env = os.environ if env is None else env
    home = env.get("HOME") or str(Path.home())
    return os.path.join(home, ".cache", "bootseer")


class Config:
    """The effective configuration: ``cfg.get("restart.max_restarts")``,
    ``cfg.restart.max_restarts``, ``cfg.source(key)``; immutable once loaded."""

    def __init__(self, settings: Mapping[str, Setting], path: str | None = None) -> None:
        object.__setattr__(self, "_settings", dict(settings))
        #: the TOML file that was read, or None
        object.__setattr__(self, "path", path)

    def _spec(self, key: str) -> KeySpec:
        try:
            return _BY_KEY[key]
        except KeyError:
            raise KeyError(f"unknown configuration key {key!r}{_suggest(key, _BY_KEY)}") from None

    def get(self, key: str) -> Any:
        self._spec(key)
        return _copy(self._settings[key].value)

    def source(self, key: str) -> str:
        self._spec(key)
        return self._settings[key].source

    def describe(self, key: str) -> str:
        """``ckpt.cache_dir = '/x' (env BOOTSEER_CKPT_CACHE_DIR)``, for messages."""
        return f"{key} = {self.get(key)!r} ({self.source(key)})"

    def settings(self) -> list[Setting]:
        return [
            Setting(s.key, _copy(self._settings[s.key].value), self._settings[s.key].source)
            for s in _KEYS
        ]

    def section(self, name: str) -> types.SimpleNamespace:
        if name not in SCHEMA:
            raise KeyError(f"unknown configuration section {name!r}{_suggest(name, SCHEMA)}")
        return types.SimpleNamespace(**{k: self.get(f"{name}.{k}") for k in SCHEMA[name]})

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {sec: {k: self.get(f"{sec}.{k}") for k in keys} for sec, keys in SCHEMA.items()}

    def __getattr__(self, name: str) -> types.SimpleNamespace:
        if name.startswith("_") or name not in SCHEMA:
            raise AttributeError(name)
        return self.section(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is immutable")

    def __repr__(self) -> str:
        return f"Config(path={self.path!r}, {self.as_dict()!r})"


# --- parsing and validation -------------------------------------------------------------------


def _suggest(word: str, choices: Any, known: str | None = None) -> str:
    """`` (did you mean 'x'? known: a, b)``: the closest choice, and the list when given."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    parts = [f"did you mean {close[0]!r}?"] if close else []
    if known:
        parts.append(f"known: {known}")
    return f" ({' '.join(parts)})" if parts else ""


def _bad(spec: KeySpec, where: str, value: Any, expected: str | None = None) -> ConfigError:
    return ConfigError(
        f"{spec.key} in {where}: expected {expected or spec.expected}, got {value!r}"
    )


def _check_table(spec: KeySpec, value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in value.items()
    ):
        raise _bad(spec, where, value)
    return copy.deepcopy(value)


def _check_size(spec: KeySpec, value: Any, where: str) -> int:
    from striped_fs import OptionError, parse_size

    try:
        size = parse_size(value, name=spec.key)
    except OptionError:
        raise _bad(spec, where, value) from None
    if size < 0:
        raise _bad(spec, where, value)
    return size


def _check_number(spec: KeySpec, value: Any, where: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(spec, where, value)
    if spec.kind == "float":
        if not math.isfinite(value) or value < 0:
            raise _bad(spec, where, value)
        return float(value)
    if not isinstance(value, int) or value < (1 if spec.kind == "count" else 0):
        raise _bad(spec, where, value)
    return value


def _check(spec: KeySpec, value: Any, where: str) -> Any:
    """A typed value (from TOML or code) checked against its spec; returns the normal form."""
    kind = spec.kind
    if kind in ("str", "path", "ranks"):
        if not isinstance(value, str):
            raise _bad(spec, where, value)
        if kind == "path":
            return os.path.expanduser(value)
        if kind == "ranks" and value.strip():
            try:
                _parse_rank_list(value)
            except ValueError:
                raise _bad(spec, where, value) from None
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise _bad(spec, where, value)
        return value
    if kind in ("int", "count", "float"):
        return _check_number(spec, value, where)
    if kind == "list":
        if isinstance(value, str):  # a lone string is a one-item list: `spec = "req.txt"`
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise _bad(spec, where, value)
        return list(value)
    if kind == "table":
        return _check_table(spec, value, where)
    if kind == "size":
        return _check_size(spec, value, where)
    raise AssertionError(f"unknown kind {kind}")  # pragma: no cover


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_text(spec: KeySpec, text: str, where: str) -> Any:
    """A value given as text (an environment variable or a flag), parsed by its kind."""
    kind = spec.kind
    if kind == "bool":
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise _bad(spec, where, text, "one of 1/0/true/false/yes/no")
    if kind in ("int", "count"):
        try:
            value: Any = int(text.strip())
        except ValueError:
            raise _bad(spec, where, text) from None
        if value < (1 if kind == "count" else 0):
            raise _bad(spec, where, text)
        return value
    if kind == "float":
        try:
            value = float(text.strip())
        except ValueError:
            raise _bad(spec, where, text) from None
        if not math.isfinite(value) or value < 0:
            raise _bad(spec, where, text)
        return value
    if kind == "list":
        items = text.replace(os.pathsep, ",").split(",")
        return [item.strip() for item in items if item.strip()]
    if kind == "table":
        if not text.strip():
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{spec.key} in {where}: not valid JSON ({exc}); expected {spec.expected}"
            ) from None
        return _check_table(spec, value, where)
    if kind == "size":
        return _check_size(spec, text.strip(), where)
    return _check(spec, text, where)


def _read_file(path: str, origin: str) -> dict[str, Any]:
    label = path if origin == "" else f"{path} ({origin})"
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {label}: not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {label}: is a directory") from None
    except OSError as exc:
        raise ConfigError(f"config file {label}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {label}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {label}: invalid TOML: {exc}") from None


def _from_file(doc: dict[str, Any], path: str) -> dict[str, Any]:
    """The key -> value pairs of a parsed TOML document, every name and type checked."""
    values: dict[str, Any] = {}
    for section, table in doc.items():
        if section not in SCHEMA:
            if not isinstance(table, dict):
                homes = [s for s, keys in SCHEMA.items() if section in keys]
                hint = f"put it under [{homes[0]}]" if homes else f"known: {', '.join(_BY_KEY)}"
                raise ConfigError(
                    f"unknown key {section!r} in {path}: keys belong in a section ({hint})"
                )
            raise ConfigError(
                f"unknown section [{section}] in {path}"
                f"{_suggest(section, SCHEMA, ', '.join(SCHEMA))}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {path}: expected a table [{section}], got {table!r}")
        for name, value in table.items():
            key = f"{section}.{name}"
            spec = _BY_KEY.get(key)
            if spec is None:
                known = ", ".join(s.key for s in SCHEMA[section].values())
                raise ConfigError(f"unknown key {key!r} in {path}{_suggest(key, _BY_KEY, known)}")
            values[key] = _check(spec, value, path)
    return values


def _refuse_unknown_env(env: Mapping[str, str], names: Iterable[str]) -> None:
    """Every ``BOOTSEER_*`` variable must be a key's, an alias, or a known non-key variable;
    a retired name is refused with its replacement, anything else as a mistake."""
    keys = set(names)
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in keys or known_variable(name):
            continue
        if name in RETIRED:
            raise ConfigError(
                f"environment variable {name} is no longer read: use "
                f"{RETIRED[name]} (docs/decisions.md)"
            )
        split = _env_section(name)
        if split:
            section, key = split
            known = ", ".join(s.env for s in SCHEMA[section].values())
            raise ConfigError(
                f"unknown environment variable {name}: section [{section}] has "
                f"no key {key!r}{_suggest(name, keys, known)}"
            )
        raise ConfigError(
            f"unknown environment variable {name}{_suggest(name, keys)}: "
            "`bootseer config show` lists every variable bootseer reads"
        )


def _env_section(name: str) -> tuple[str, str] | None:
    """``BOOTSEER_RESTART_MAX_RETRIES`` -> ("restart", "max_retries") when its section exists."""
    rest = name[len(ENV_PREFIX) :].lower()
    for section in SCHEMA:
        if rest.startswith(section + "_") and len(rest) > len(section) + 1:
            return section, rest[len(section) + 1 :]
    return None


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """key -> (value, source) from ``BOOTSEER_*`` variables; an unknown one is refused."""
    values: dict[str, tuple[Any, str]] = {}
    _refuse_unknown_env(env, [s.env for s in _KEYS] + [a for s in _KEYS for a in s.aliases])
    for spec in _KEYS:
        for var in (spec.env, *spec.aliases):
            if var in env:
                where = f"env {var}"
                values[spec.key] = (_from_text(spec, env[var], where), where)
                break
    return values


def _from_override(spec: KeySpec, value: Any, where: str) -> Any:
    if isinstance(value, str) and spec.kind not in ("str", "path", "ranks"):
        return _from_text(spec, value, where)
    return _check(spec, value, where)


def _derive_paths(settings: dict[str, Setting], env: Mapping[str, str]) -> None:
    """``state.dir`` '' -> the platform's default; a path key with ``under`` left '' ->
    ``<state.dir>/<under>``, its source saying so."""
    state = settings["state.dir"]
    if not state.value:
        settings["state.dir"] = Setting(state.key, default_state_dir(env), state.source)
        state = settings["state.dir"]
    for spec in _KEYS:
        if spec.under and not settings[spec.key].value:
            source = "default" if state.source == "default" else f"state.dir ({state.source})"
            settings[spec.key] = Setting(spec.key, os.path.join(state.value, spec.under), source)


def load_config(
    path: str | os.PathLike | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    override_sources: Mapping[str, str] | None = None,
) -> Config:
    """The effective configuration: defaults < TOML file (``path``, else ``$BOOTSEER_CONFIG``)
    < environment (``env``, default ``os.environ``) < ``overrides`` (flags; a ``None`` value is
    no override). ``override_sources`` names the origin of each override ("flag --x")."""
    env = os.environ if env is None else env
    settings = {s.key: Setting(s.key, _copy(s.default), "default") for s in _KEYS}
    origin = ""
    if path is None and env.get(CONFIG_ENV):
        path, origin = env[CONFIG_ENV], f"from {CONFIG_ENV}"
    file = os.fspath(path) if path is not None else None
    if file is not None:
        for key, value in _from_file(_read_file(file, origin), file).items():
            settings[key] = Setting(key, value, f"file {file}")
    for key, (value, source) in _from_env(env).items():
        settings[key] = Setting(key, value, source)
    for key, value in (overrides or {}).items():
        spec = _BY_KEY.get(key)
        if spec is None:
            raise ConfigError(f"unknown key {key!r} in overrides{_suggest(key, _BY_KEY)}")
        if value is None:
            continue
        source = (override_sources or {}).get(key, "override")
        settings[key] = Setting(key, _from_override(spec, value, source), source)
    _derive_paths(settings, env)
    return Config(settings, file)


def storage_options(cfg: Config) -> dict[str, Any]:
    """``storage.options`` with ``striped.mirror`` merged in as ``{"striped": {"mirror":
    ...}}``: what every command hands striped_fs. The URL is checked here, so a bad one is
    refused at start naming the key; given both ways with different values, refused too."""
    from striped_fs import OptionError, check_mirror_url

    options = cfg.get("storage.options")
    mirror = cfg.get("striped.mirror")
    if not mirror:
        return options
    where = f"striped.mirror ({cfg.source('striped.mirror')})"
    try:
        mirror = check_mirror_url(mirror, name=where)
    except OptionError as exc:
        raise ConfigError(str(exc)) from None
    striped = dict(options.get("striped") or {})
    given = striped.get("mirror")
    if given and str(given).rstrip("/") != mirror:
        raise ConfigError(
            f"{where} = {mirror!r} and storage.options striped.mirror = {given!r} "
            f"({cfg.source('storage.options')}) differ: give the mirror in one place"
        )
    striped["mirror"] = mirror
    return {**options, "striped": striped}


def check_ckpt_cache_handoff(cfg: Config, env: Mapping[str, str] | None = None) -> None:
    """Refuse a ``BOOTSEER_CKPT_CACHE`` that names another directory than ``ckpt.cache_dir``:
    it is what ``bootseer run`` hands its job, not a setting (earlier versions of warmup read
    it), and a warmup filling one cache while the job reads another loses the whole warmup."""
    env = os.environ if env is None else env
    handed = env.get(CKPT_CACHE_HANDOFF, "").strip()
    if handed and os.path.abspath(handed) != os.path.abspath(cfg.ckpt.cache_dir):
        raise ConfigError(
            f"{CKPT_CACHE_HANDOFF}={handed} is what `bootseer run` hands its command, not a "
            f"setting, and this command's checkpoint cache is {cfg.describe('ckpt.cache_dir')}"
            f": set BOOTSEER_CKPT_CACHE_DIR (or [ckpt] cache_dir) to choose the cache, and "
            f"unset {CKPT_CACHE_HANDOFF}"
        )


# --- command line -----------------------------------------------------------------------------


def _dest(spec: KeySpec) -> str:
    return f"cfg_{spec.section}_{spec.name}"


def _show(spec: KeySpec) -> str:
    if spec.under:
        return f"<state.dir>/{spec.under}"
    value = spec.default
    if value == "" or value == [] or value == {}:
        return "''" if value == "" else "none"
    if spec.kind == "size" and value % (1 << 30) == 0:
        return f"{value >> 30}GiB"
    return str(value)


_METAVARS = {
    "int": "N",
    "count": "N",
    "float": "SECONDS",
    "path": "PATH",
    "table": "JSON",
    "size": "SIZE",
    "run.trace_dir": "DIR",
    "ckpt.cache_dir": "DIR",
    "image.cache": "DIR",
    "state.dir": "DIR",
    "snapshotter.root": "DIR",
    "env.store": "URL",
    "ckpt.url": "URL",
    "run.node": "NAME",
    "image.ref": "REF",
    "env.base_image": "DIGEST",
    "ckpt.ranks": "LIST",
    "env.prefix": "DIR",
    "env.cache": "DIR",
}


def _selected(keys: Iterable[str] | None) -> list[KeySpec]:
    if keys is None:
        return list(_KEYS)
    wanted = set(keys)
    unknown = wanted - set(SCHEMA) - set(_BY_KEY)
    if unknown:  # a programming error, caught by the CLI tests
        raise KeyError(f"unknown configuration keys {sorted(unknown)}")
    return [s for s in _KEYS if s.key in wanted or s.section in wanted]


def add_config_arguments(
    parser: argparse.ArgumentParser,
    keys: Iterable[str] | None = None,
    *,
    short: Mapping[str, str] | None = None,
    title: str = "configuration",
) -> None:
    """``--config FILE`` and the flag of each schema key in ``keys`` (sections or
    ``section.key``; None: every key). ``short`` gives a key a second spelling inside one
    command (``bootseer env ensure --store`` for ``--env-store``). Flags given become
    overrides in :func:`config_from_args`; the others leave the file and environment in
    charge."""
    parser.add_argument(
        "--config", metavar="FILE", default=None, help=f"TOML configuration file (env {CONFIG_ENV})"
    )
    group = parser.add_argument_group(
        title,
        "each flag overrides the config file and its BOOTSEER_* variable "
        "(`bootseer config show` prints the effective values)",
    )
    for spec in _selected(keys):
        doc = f"{spec.help} (default {_show(spec)}; env {spec.env})".replace("%", "%%")
        flags = [spec.flag] + ([short[spec.key]] if short and spec.key in short else [])
        if spec.kind == "bool":
            group.add_argument(
                *flags,
                dest=_dest(spec),
                default=None,
                action=argparse.BooleanOptionalAction,
                help=doc,
            )
        elif spec.kind == "list":
            group.add_argument(
                *flags, dest=_dest(spec), default=None, action="append", metavar="FILE", help=doc
            )
        else:
            metavar = _METAVARS.get(spec.key) or _METAVARS.get(spec.kind) or spec.name.upper()
            group.add_argument(*flags, dest=_dest(spec), default=None, metavar=metavar, help=doc)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """The configuration of a command parsed with :func:`add_config_arguments` (any other
    command: the file of ``$BOOTSEER_CONFIG`` and the environment, checked all the same)."""
    overrides: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for spec in _KEYS:
        value = getattr(args, _dest(spec), None)
        if value is None:
            continue
        overrides[spec.key] = value
        flag = spec.flag
        if spec.kind == "bool" and value is False:
            flag = "--no-" + flag[2:]
        sources[spec.key] = f"flag {flag}"
    return load_config(
        getattr(args, "config", None), env=env, overrides=overrides, override_sources=sources
    )


# --- ranks ------------------------------------------------------------------------------------


def _parse_rank_list(text: str) -> list[int]:
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise ValueError(part)
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(part)
        ranks.update(range(first, last + 1))
    return sorted(ranks)


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"env {name}: expected an integer >= {minimum}, got {text!r}")
    return value


def parse_ranks(
    text: str, env: Mapping[str, str] | None = None, *, fallback: bool = True
) -> list[int]:
    """The ranks a node serves: ``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (sorted, no duplicates).
    ``""`` derives them the way launchers describe a node: ``LOCAL_WORLD_SIZE`` ranks starting
    at ``NODE_RANK`` (or torchrun's ``GROUP_RANK``) times that, else ``[RANK]``, else ``[0]``
    (without ``fallback``: a ConfigError, for a caller that must not guess)."""
    if text.strip():
        try:
            return _parse_rank_list(text)
        except ValueError:
            raise ConfigError(
                f"bad rank list {text!r}: expected ranges and ranks like '0-7' or "
                f"'0,1,4' (ranks >= 0, ranges low-high)"
            ) from None
    env = os.environ if env is None else env
    local = _env_int(env, "LOCAL_WORLD_SIZE", 1)
    node_var = "NODE_RANK" if env.get("NODE_RANK", "").strip() else "GROUP_RANK"
    node = _env_int(env, node_var, 0)
    if local is not None and node is not None:
        return list(range(node * local, node * local + local))
    rank = _env_int(env, "RANK", 0)
    if rank is not None:
        return [rank]
    if not fallback:
        raise ConfigError(
            "ckpt.ranks is empty and no launcher variable (LOCAL_WORLD_SIZE with "
            "NODE_RANK or GROUP_RANK, or RANK) says which ranks this node serves: "
            "give them (--ranks 0-7, BOOTSEER_CKPT_RANKS, [ckpt] ranks)"
        )
    return [0]
