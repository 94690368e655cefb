"""Crash classification: (exit code or signal, the last log lines, the cgroup's OOM kill
count) -> a failure class, by a fixed, ordered rule table. The first rule that matches wins.

Why a table and not code paths: the classes decide the action (:mod:`.policy`), so the
mapping must be readable, reviewable and testable row by row; no model, no network. The
table, as docs/robust.md shows it, is :data:`RULES`; each row names the facts it needs:

* ``exit``: ``"signal"`` (killed by a signal: a negative return code, or 128+N),
  ``"sigkill"`` (by SIGKILL), ``"error"`` (exited with a non-zero code of its own), None
  (any failure: not a clean exit 0) or ``"always"`` (the fallback row, even for exit 0);
* ``oom_kill``: True when the row needs the cgroup's ``memory.events`` ``oom_kill`` count to
  have grown (:func:`oom_kills`);
* ``pattern``: a regular expression searched in the last lines (``[rank3]:`` and
  ``[default0]:`` prefixes of torch's and torchrun's logs stripped); its named groups
  (``exception``, ``xid``) become the classification's detail.

Usage::

    from bootseer.robust.classify import classify, tail_lines

    got = classify(proc.returncode, tail_lines("rank3.log"))
    got.failure_class      # "gpu_oom", "user_error", ...
    got.detail             # {"exception": "torch.OutOfMemoryError"}
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..process import signal_name  # the wrapper's names for signals, shared

__all__ = [
    "CLASSES",
    "RULES",
    "SECONDARY",
    "Classification",
    "Rule",
    "classify",
    "memory_cgroup",
    "oom_kills",
    "tail_lines",
]

CLASSES = (
    "killed_by_signal",
    "python_exception",
    "cuda_error",
    "gpu_oom",
    "cpu_oom",
    "nccl_error",
    "gloo_error",
    "collective_mismatch",
    "disk_full",
    "storage_error",
    "user_error",
    "unknown",
)

#: crash classes that follow another rank's failure (a peer died first): never the root cause
#: while another failure is in sight
SECONDARY = ("gloo_error", "nccl_error")

# the type of the last exception of a traceback: "pkg.mod.SomeError: message" at a line start
_EXC = r"(?P<exception>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))"
# exceptions that fail the same way on every restart: a restart cannot help
_DETERMINISTIC = (
    "SyntaxError",
    "IndentationError",
    "TabError",
    "ImportError",
    "ModuleNotFoundError",
    "NameError",
    "UnboundLocalError",
)


@dataclass(frozen=True)
class Rule:
    """One row of the table (see the module docstring)."""

    name: str
    failure_class: str
    pattern: str | None = None
    exit: str | None = None
    oom_kill: bool = False


RULES: tuple[Rule, ...] = (
    Rule("cgroup_oom_kill", "cpu_oom", exit="sigkill", oom_kill=True),
    Rule(
        "cuda_oom",
        "gpu_oom",
        r"CUDA out of memory|(?P<exception>torch\.(?:cuda\.)?OutOfMemoryError)",
    ),
    Rule("python_memory_error", "cpu_oom", r"^(?P<exception>MemoryError)\b", exit="error"),
    Rule("xid", "cuda_error", r"NVRM: Xid \([^)]*\): (?P<xid>\d+)"),
    Rule(
        "cuda_error",
        "cuda_error",
        r"CUDA error: |CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|device-side assert triggered",
    ),
    # before the communication errors: gloo aborts the rank with its own words, and torch's
    # TORCH_DISTRIBUTED_DEBUG=DETAIL check raises with its own
    Rule(
        "collective_mismatch",
        "collective_mismatch",
        r"Received data size doesn't match expected size|collective mismatch in your code"
        r"|Detected mismatch between collectives on ranks",
    ),
    Rule(
        "nccl",
        "nccl_error",
        r"NCCL error|nccl\w*Error|ProcessGroupNCCL|Watchdog caught collective operation",
    ),
    Rule("gloo", "gloo_error", r"third_party/gloo/|ProcessGroupGloo|[Gg]loo connect"),
    Rule("enospc", "disk_full", r"No space left on device|\bENOSPC\b|\[Errno 28\]"),
    Rule(
        "storage",
        "storage_error",
        r"botocore\.exceptions\.|EndpointConnectionError|NoSuchBucket"
        r"|An error occurred \(\w+\) when calling the \w+ operation"
        r"|org\.apache\.hadoop|\bHDFS\b|hdfs://",
    ),
    Rule(
        "deterministic_exception",
        "user_error",
        rf"^(?P<exception>{'|'.join(_DETERMINISTIC)})\b",
        exit="error",
    ),
    Rule("python_exception", "python_exception", rf"^{_EXC}(?::|$)", exit="error"),
    Rule("signal", "killed_by_signal", exit="signal"),
    Rule("fallback", "unknown", exit="always"),
)

_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_RANK_PREFIX = re.compile(r"^\[rank(?P<rank>\d+)\]:")  # torch's prefix on a rank's lines
#: a launcher's own traceback that wraps a rank's failure (torchrun's): not the cause
_LAUNCHER_ERROR = re.compile(
    r"^(?:torch\.distributed\.elastic\.multiprocessing\.errors\.)?ChildFailedError\b"
)
#: torchrun's summary of the first failed rank: "  rank      : 1 (local_rank: 0)"
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank")
#: and its exit code, below: "  exitcode  : -9 (pid: 1234)" (-N: killed by signal N)
_ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(?P<code>-?\d+)")


@dataclass(frozen=True)
class Classification:
    """The class, the rule that decided it, what it extracted, and the lines it matched."""

    failure_class: str
    rule: str
    exit_code: int | None = None
    signal: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    lines: tuple[str, ...] = ()

    def evidence(self) -> dict[str, Any]:
        """The form an :class:`~bootseer.robust.events.Event` keeps."""
        return {
            "rule": self.rule,
            "exit_code": self.exit_code,
            "signal": self.signal,
            **self.detail,
            "lines": list(self.lines),
        }


def _signal_of(exit_code: int | None) -> int | None:
    """A signal number from a Popen return code (-N) or a shell/supervisor code (128+N)."""
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code < 128 + 65:
        return exit_code - 128
    return None


def _exit_matches(rule: Rule, exit_code: int | None, signum: int | None) -> bool:
    if rule.exit == "always":
        return True
    if rule.exit is None:
        return exit_code != 0
    if rule.exit == "signal":
        return signum is not None
    if rule.exit == "sigkill":
        return signum == signal.SIGKILL
    if rule.exit == "error":
        return exit_code is not None and exit_code != 0 and signum is None
    raise ValueError(
        f"rule {rule.name}: exit must be signal, sigkill, error, always or None, not {rule.exit!r}"
    )


def _last_match(pattern: re.Pattern[str], lines: Sequence[str]) -> tuple[int, re.Match[str]] | None:
    for i in range(len(lines) - 1, -1, -1):
        if m := pattern.search(lines[i]):
            return i, m
    return None


_COMPILED = {r.name: re.compile(r.pattern) for r in RULES if r.pattern}


def _failures(clean: Sequence[str]) -> list[tuple[int, int | None]]:
    """torchrun's summary: (rank, exit code) of every failed rank it lists, the root cause
    (its first observed failure, printed last) last."""
    found = []
    for i, line in enumerate(clean):
        if m := _ROOT_CAUSE_RANK.search(line):
            code = next(
                (
                    int(e["code"])
                    for later in clean[i + 1 : i + 4]
                    if (e := _ROOT_CAUSE_EXIT.search(later))
                ),
                None,
            )
            found.append((int(m["rank"]), code))
    return found


def classify(
    exit_code: int | None,
    lines: Sequence[str],
    *,
    oom_killed: bool = False,
    rules: Sequence[Rule] = RULES,
) -> Classification:
    """The class of a process that ended with ``exit_code`` (None: unknown) after printing
    ``lines`` (its last ones); ``oom_killed``: the kernel's OOM killer hit its cgroup.

    Under torchrun, whose summary names the rank that failed first and its exit code: that
    rank's exit code counts (``-9``: killed by SIGKILL, whatever torchrun itself exits with),
    and of the lines torch prefixes with ``[rankN]:`` only that rank's are read. A
    communication error (:data:`SECONDARY`: a peer's death seen from the other side) loses
    to another rank's own failure in the same lines, whichever torchrun observed first."""
    raw = [line.rstrip("\n") for line in lines if not _LAUNCHER_ERROR.match(_PREFIX.sub("", line))]
    owner = [int(m["rank"]) if (m := _RANK_PREFIX.match(line)) else None for line in raw]
    clean = [_PREFIX.sub("", line) for line in raw]
    failures = _failures(clean)
    root, root_code = failures[-1] if failures else (None, None)
    if root_code is not None and root_code < 0:  # the rank's own death, not the launcher's
        exit_code = root_code
    ranks = list(dict.fromkeys(r for r in owner if r is not None))

    def of(rank: int | None) -> list[str]:
        return [line for line, r in zip(clean, owner, strict=True) if r is None or r == rank]

    got = _classify(exit_code, of(root) if root is not None and ranks else clean, oom_killed, rules)
    if root is not None:
        got.detail["rank"] = root
    if got.failure_class in SECONDARY:  # a consequence: another rank's own failure wins
        for rank in ranks:
            if rank == root:
                continue
            other = _classify(
                exit_code if exit_code not in (None, 0) else 1, of(rank), oom_killed, rules
            )
            if other.failure_class not in (*SECONDARY, "unknown", "killed_by_signal"):
                other.detail.update(rank=rank, secondary=got.failure_class)
                return other
        for rank, code in failures:  # a rank killed by a signal torchrun did not send
            if code is not None and code < 0 and -code != signal.SIGTERM and rank != root:
                other = _classify(code, [], oom_killed, rules)
                other.detail.update(rank=rank, secondary=got.failure_class)
                return other
    return got


def _classify(
    exit_code: int | None, clean: Sequence[str], oom_killed: bool, rules: Sequence[Rule]
) -> Classification:
    """The first row of ``rules`` that matches (lines already stripped of prefixes)."""
    signum = _signal_of(exit_code)
    sig = signal_name(signum) if signum is not None else None
    for rule in rules:
        if not _exit_matches(rule, exit_code, signum) or (rule.oom_kill and not oom_killed):
            continue
        detail: dict[str, Any] = {}
        matched: tuple[str, ...] = ()
        if rule.pattern:
            pattern = _COMPILED.get(rule.name) or re.compile(rule.pattern)
            found = _last_match(pattern, clean)
            if found is None:
                continue
            index, m = found
            detail = {k: v for k, v in m.groupdict().items() if v is not None}
            matched = (clean[index],)
        if "exception" not in detail and (exc := _last_match(_COMPILED["python_exception"], clean)):
            detail["exception"] = exc[1].group("exception")
        if "xid" in detail:
            detail["xid"] = int(detail["xid"])
        return Classification(rule.failure_class, rule.name, exit_code, sig, detail, matched)
    raise ValueError("the rule table has no fallback row")  # pragma: no cover - RULES has one


def tail_lines(path: str | os.PathLike, n: int = 200, *, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``n`` lines of a log file, reading at most its last ``max_bytes``."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(size - max_bytes, 0))
        data = f.read()
    return data.decode("utf-8", errors="replace").splitlines()[-n:]


def memory_cgroup(pid: int | str = "self") -> str | None:
    """The directory of a process's memory cgroup (v2 unified, or v1's memory controller),
    or None when it cannot be found."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            return os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
    for _, controllers, path in entries:
        if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            return os.path.join("/sys/fs/cgroup", path.lstrip("/"))
    return None


def oom_kills(cgroup_dir: str | os.PathLike) -> int:
    """How many processes the kernel's OOM killer ended in a memory cgroup (``oom_kill`` of
    v2's ``memory.events`` or v1's ``memory.oom_control``; 0 without either): compare it
    before and after an attempt to tell an OOM kill from another SIGKILL."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(cgroup_dir, name), encoding="ascii") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0
