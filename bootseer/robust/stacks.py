"""Stack aggregation: which ranks are stuck somewhere else, and which failure domain to evict.

Dumps come from ``faulthandler`` (the client's SIGUSR1 files,
``stacks-<node>-rank<r>-<pid>.txt``) or from ``py-spy dump`` (text or ``--json``). Each is
normalized, so the same place gives the same signature on every node: line numbers,
addresses, thread ids, thread names and pids dropped, the frames of how the process was
started dropped (runpy's, and those of an interpreter started ahead by ``bootseer run
--preload``), a file reduced to its path below
``site-packages/`` (else its base name), a function to its last name (faulthandler prints
``wrapper`` where py-spy prints ``_exception_logger.<locals>.wrapper``). A process's
signature is the sorted tuple of its threads' stacks. (A relative path, py-spy's short form,
is kept as it is.) Native frames (``py-spy dump --native``: compiled code, a frame whose file is
a shared object or the interpreter) are kept with the process and shown in the evidence, but
are not part of the signature: where a healthy rank waits inside gloo or OpenMP differs from
rank to rank at the instruction level, so they would split the healthy group; a thread with
no Python frame left is dropped from the signature for the same reason.

Processes of one role (``main``: the rank's trainer; others, e.g. ``worker``, compared among
themselves) are grouped by signature; the largest group is healthy, every other group is a
suspect (ByteRobust's rule); with no single largest group there is no verdict. Suspect ranks
are mapped on the job's parallel layout (``{"dp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]}``,
e.g. from a device mesh) and the smallest group that holds all of them is the failure domain
to evict; when no group holds them all, the smallest union of one dimension's groups.

Usage::

    from bootseer.robust.stacks import localize, pyspy_dump

    dumps = [pyspy_dump(pid, rank=r, node="node-1") for r, pid in enumerate(rank_pids)]
    found = localize(dumps, layout={"dp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]})
    found.suspects, found.domain, found.domain_ranks   # (3,), "dp[1]", (2, 3)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Localization",
    "ProcessStacks",
    "StackGroup",
    "group_stacks",
    "localize",
    "is_native_frame",
    "native_evidence",
    "normalize_frame",
    "parse_dump",
    "pyspy_dump",
    "read_stack_files",
]

Frame = str  # "function (file)"
Thread = tuple[Frame, ...]  # most recent call first

_FAULTHANDLER_THREAD = re.compile(
    r"^(?:Current thread|Thread) (?P<id>0x[0-9a-f]+) \(most recent call first\):"
)
_FAULTHANDLER_ANY = re.compile(_FAULTHANDLER_THREAD.pattern, re.MULTILINE)
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line \d+ in (?P<name>.+)$')
_PYSPY_THREAD = re.compile(r"^Thread (?P<id>0x[0-9A-Fa-f]+|\d+)")
_PYSPY_FRAME = re.compile(r"^\s+(?P<name>\S.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
_ADDRESS = re.compile(r"0x[0-9A-Fa-f]+")
#: frames of how the process was started, not of where it is: runpy, and the interpreter
#: `bootseer run --preload` started ahead (a restarted node's ranks have them, a fresh node's
#: do not; the 20-minute soak evicted a fresh node as a stack outlier for this alone)
_LAUNCH_FRAME = re.compile(r" \((<frozen runpy>|runpy\.py|prestart\.py|bootseer/prestart\.py)\)$")
_PYTHON_FILE = re.compile(r"(\.pyw?|^<[^>]*>)$")
_TEMPLATE_ARGS = re.compile(r"<[^<>]*>")
_PARAMETERS = re.compile(r"\((?!anonymous namespace\))[^()]*\)")
_STACK_FILE = re.compile(r"^stacks-(?P<node>.+)-rank(?P<rank>-?\d+)-(?P<pid>\d+)\.txt$")


def _short_native(name: str) -> str:
    """A C++ symbol without its template arguments and parameter lists (evidence stays
    readable: torch's dispatcher frames run to 700 characters)."""
    for pattern in (_TEMPLATE_ARGS, _PARAMETERS):
        while (shorter := pattern.sub("", name)) != name:
            name = shorter
    return name


def normalize_frame(name: str, file: str) -> Frame:
    """One frame as the signature keeps it (see the module docstring). A relative file is
    already short (py-spy's text form) and kept."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in file:
            file = file.rsplit(marker, 1)[1]
            break
    else:
        if os.path.isabs(file):
            file = os.path.basename(file)
    file = _ADDRESS.sub("", file)
    name = _ADDRESS.sub("", name).strip() or "?"
    if _PYTHON_FILE.search(file):
        return f"{name.rsplit('.', 1)[-1]} ({file})"
    return f"{_short_native(name)} ({file})"


def is_native_frame(frame: Frame) -> bool:
    """Whether a normalized frame is compiled code (py-spy ``--native``), not Python."""
    return not _PYTHON_FILE.search(frame.rsplit(" (", 1)[-1].removesuffix(")"))


def _faulthandler(text: str) -> list[Thread]:
    """The last dump of a faulthandler file (a file holds one dump per SIGUSR1: a thread
    id seen twice starts the next)."""
    dumps: list[dict[str, list[Frame]]] = [{}]
    current: list[Frame] | None = None
    for line in text.splitlines():
        if m := _FAULTHANDLER_THREAD.match(line):
            if m["id"] in dumps[-1]:
                dumps.append({})
            current = dumps[-1].setdefault(m["id"], [])
        elif current is not None and (f := _FAULTHANDLER_FRAME.match(line)):
            current.append(normalize_frame(f["name"], f["file"]))
    return [tuple(frames) for frames in dumps[-1].values()]


def _pyspy_text(text: str) -> list[Thread]:
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _PYSPY_THREAD.match(line):
            threads.append([])
        elif threads and (f := _PYSPY_FRAME.match(line)):
            threads[-1].append(normalize_frame(f["name"], f["file"]))
    return [tuple(t) for t in threads]


def _pyspy_json(doc: Any) -> list[Thread]:
    if isinstance(doc, dict):  # one process's dump in a wrapper object
        doc = doc.get("threads", [doc])
    return [
        tuple(
            normalize_frame(
                str(f.get("name", "?")), str(f.get("filename") or f.get("short_filename") or "")
            )
            for f in thread.get("frames", [])
        )
        for thread in doc
        if isinstance(thread, dict)
    ]


def parse_dump(text: str) -> list[Thread]:
    """The normalized thread stacks of one process's dump, in any of the three formats."""
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            return _pyspy_json(json.loads(stripped))
        except ValueError:
            pass
    if _FAULTHANDLER_ANY.search(text):
        return _faulthandler(text)
    return _pyspy_text(text)


@dataclass(frozen=True)
class ProcessStacks:
    """One process's normalized stacks, and where it runs."""

    rank: int
    threads: tuple[Thread, ...]
    node: str | None = None
    pid: int | None = None
    role: str = "main"

    @property
    def signature(self) -> tuple[Thread, ...]:
        """The threads' Python stacks, sorted, without the launch's frames."""
        kept = (
            tuple(f for f in thread if not _LAUNCH_FRAME.search(f) and not is_native_frame(f))
            for thread in self.threads
        )
        return tuple(sorted(thread for thread in kept if thread))

    @property
    def has_native(self) -> bool:
        return any(is_native_frame(f) for thread in self.threads for f in thread)

    @classmethod
    def from_text(
        cls,
        text: str,
        *,
        rank: int,
        node: str | None = None,
        pid: int | None = None,
        role: str = "main",
    ) -> ProcessStacks:
        return cls(rank, tuple(parse_dump(text)), node, pid, role)


def pyspy_dump(
    pid: int,
    *,
    rank: int,
    node: str | None = None,
    role: str = "main",
    native: bool = False,
    timeout_s: float = 30.0,
) -> ProcessStacks:
    """Dumps a live process with ``py-spy dump --json`` (root, or ptrace allowed)."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        raise FileNotFoundError(
            "py-spy is not installed: pip install py-spy (a dependency "
            "of bootseer), or dump with SIGUSR1 through bootseer.client"
        )
    argv = [exe, "dump", "--json", "--pid", str(pid), *(["--native"] if native else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"py-spy dump of pid {pid} (rank {rank}) failed: "
            f"{done.stderr.strip() or done.stdout.strip()}"
        )
    return ProcessStacks.from_text(done.stdout, rank=rank, node=node, pid=pid, role=role)


def read_stack_files(trace_dir: str | os.PathLike) -> list[ProcessStacks]:
    """The client's SIGUSR1 dumps in a trace directory (empty files are skipped)."""
    found = []
    for path in sorted(Path(trace_dir).glob("stacks-*.txt")):
        m = _STACK_FILE.match(path.name)
        text = path.read_text(encoding="utf-8", errors="replace") if m else ""
        if m and text.strip():
            found.append(
                ProcessStacks.from_text(
                    text, rank=int(m["rank"]), node=m["node"], pid=int(m["pid"])
                )
            )
    return found


@dataclass(frozen=True)
class StackGroup:
    """Processes of one role with the same signature."""

    role: str
    signature: tuple[Thread, ...]
    members: tuple[ProcessStacks, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({p.rank for p in self.members}))

    def evidence(self) -> dict[str, Any]:
        """Ranks, nodes and the signature; with native frames, the first member's whole
        stacks too (``native``: where inside compiled code it is)."""
        found: dict[str, Any] = {
            "role": self.role,
            "ranks": list(self.ranks),
            "nodes": sorted({p.node for p in self.members if p.node}),
            "stacks": [list(t) for t in self.signature],
        }
        first = next((p for p in self.members if p.has_native), None)
        if first is not None:
            found["native"] = native_evidence(first)
        return found


def native_evidence(
    member: ProcessStacks, threads: Iterable[Thread] | None = None
) -> dict[str, Any]:
    """A stack group's ``native`` evidence: one member's whole stacks with native frames
    (``threads``: from its separate native dump, else its own)."""
    doc: dict[str, Any] = {"rank": member.rank, "pid": member.pid}
    if member.node:
        doc["node"] = member.node
    doc["stacks"] = [list(t) for t in (member.threads if threads is None else threads) if t]
    return doc


def group_stacks(processes: Iterable[ProcessStacks]) -> list[StackGroup]:
    """Groups by (role, signature), the largest first (ties by lowest rank)."""
    by_key: dict[tuple[str, tuple[Thread, ...]], list[ProcessStacks]] = defaultdict(list)
    for p in processes:
        by_key[(p.role, p.signature)].append(p)
    groups = [
        StackGroup(role, sig, tuple(sorted(m, key=lambda p: (p.rank, p.pid or 0))))
        for (role, sig), m in by_key.items()
    ]
    return sorted(groups, key=lambda g: (-len(g.members), g.ranks))


@dataclass(frozen=True)
class Localization:
    """Suspect ranks and nodes, the domain to evict, and the evidence (groups with ranks)."""

    suspects: tuple[int, ...]
    suspect_nodes: tuple[str, ...]
    domain: str | None
    domain_ranks: tuple[int, ...]
    domain_nodes: tuple[str, ...]
    groups: tuple[StackGroup, ...]
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


def _domain(
    suspects: set[int], layout: Mapping[str, Sequence[Sequence[int]]]
) -> tuple[str | None, tuple[int, ...]]:
    """The smallest layout group holding every suspect; else the smallest one-dimension
    union of the groups that hold any."""
    best: tuple[int, str, tuple[int, ...]] | None = None
    for dim, groups in layout.items():
        for i, group in enumerate(groups):
            if suspects <= set(group) and (best is None or len(group) < best[0]):
                best = (len(group), f"{dim}[{i}]", tuple(sorted(group)))
    if best is not None:
        return best[1], best[2]
    for dim, groups in layout.items():
        hit = [i for i, g in enumerate(groups) if suspects & set(g)]
        union = tuple(sorted({r for i in hit for r in groups[i]}))
        if best is None or len(union) < best[0]:
            best = (len(union), f"{dim}[{','.join(map(str, hit))}]", union)
    return (best[1], best[2]) if best else (None, tuple(sorted(suspects)))


def localize(
    processes: Iterable[ProcessStacks], layout: Mapping[str, Sequence[Sequence[int]]] | None = None
) -> Localization:
    """Suspects (outside each role's dominant group) and the failure domain to evict."""
    processes = list(processes)
    groups = group_stacks(processes)
    node_of = {p.rank: p.node for p in processes if p.node}
    suspects: set[int] = set()
    undecided = []
    for role in sorted({g.role for g in groups}):
        mine = [g for g in groups if g.role == role]
        if len(mine) > 1 and len(mine[0].members) == len(mine[1].members):
            undecided.append(role)
            continue
        suspects.update(r for g in mine[1:] for r in g.ranks)
    evidence = {"groups": [g.evidence() for g in groups]}
    if undecided and not suspects:
        return Localization(
            (),
            (),
            None,
            (),
            (),
            tuple(groups),
            f"no dominant stack group among {', '.join(undecided)} processes: "
            "no verdict from stacks",
            evidence,
        )
    if not suspects:
        return Localization(
            (),
            (),
            None,
            (),
            (),
            tuple(groups),
            "every process of each role has the same stacks",
            evidence,
        )
    domain, ranks = _domain(suspects, layout or {})
    if layout is None:
        domain = None
    nodes = tuple(sorted({node_of[r] for r in suspects if r in node_of}))
    domain_nodes = tuple(sorted({node_of[r] for r in ranks if r in node_of}))
    reason = f"ranks {', '.join(map(str, sorted(suspects)))} outside the dominant stack group" + (
        f"; smallest group holding them: {domain}" if domain else ""
    )
    return Localization(
        tuple(sorted(suspects)), nodes, domain, ranks, domain_nodes, tuple(groups), reason, evidence
    )
