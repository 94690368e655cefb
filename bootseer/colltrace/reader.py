"""The node's reader: maps every rank's ring, runs the analysis, keeps the verdicts.

``bootseer run`` (its agent) holds one :class:`Watch` when ``[colltrace] enabled``: it gives
each attempt its own ring directory (``BOOTSEER_COLLTRACE_DIR`` for the command), polls the
rings every ``poll_s`` (the agent's watch loop calls :meth:`Watch.poll` four times a second;
the pass runs at most once per ``poll_s``), writes each new verdict and the grid of ranks x
groups into ``<trace dir>/colltrace-<node>.ndjson`` and says the verdict in one line. A rank
that never issued the op is asked for its stack (SIGUSR1, only when its stack file shows the
``bootseer.client`` handler is installed: without one the signal would kill it).

Usage outside ``bootseer run``::

    watch = Watch("/dev/shm/rings", trace_dir="trace/")
    while job_runs:
        for finding in watch.poll():
            print(finding.line)
        time.sleep(1)
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from striped_fs import PrivateDir, UnsafePath, open_append

from .analyze import Analyzer, Finding
from .ring import RING_DIR_WHAT, Refusals, RingReader, RingSnapshot, newest_per_rank, scan_rings

__all__ = ["Watch", "read_verdicts", "stack_of", "verdict_docs"]

RECORD_FILE = "colltrace-{node}.ndjson"


def _say(line: str) -> None:
    print(f"bootseer: colltrace: {line}", file=sys.stderr, flush=True)


class Watch:
    """Rings of one node's ranks -> findings, written to the trace (see the module doc)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        analyzer: Analyzer | None = None,
        trace_dir: str | os.PathLike | None = None,
        node: str = "",
        poll_s: float = 1.0,
        stack_wait_s: float = 2.0,
        log: Callable[[str], None] = _say,
    ) -> None:
        self.base = Path(directory)
        self.directory = self.base
        self.analyzer = analyzer or Analyzer(node=node or None)
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.node = node or os.uname().nodename
        self.poll_s = poll_s
        self.stack_wait_s = stack_wait_s
        self.log = log
        self.attempt = 0
        self._readers: dict[str, RingReader] = {}
        self._last = float("-inf")
        self._refused: str | None = None  # the refusal last logged (said once)
        # a ring skipped (malformed, another user's, a link): said once per file and reason
        self.refusals = Refusals(lambda line: self.log(line))

    # -- attempts --------------------------------------------------------------------------
    def child_env(self, attempt: int) -> dict[str, str]:
        """What the command of ``attempt`` needs to record into this watch's directory."""
        return {
            "BOOTSEER_COLLTRACE_ENABLED": "1",
            "BOOTSEER_COLLTRACE_DIR": str(self.base / f"attempt-{attempt}"),
        }

    def start(self, attempt: int) -> None:
        """A fresh analysis and ring directory for ``attempt``; older attempts' rings go."""
        self.close()
        self.attempt = attempt
        self.directory = self.base / f"attempt-{attempt}"
        a = self.analyzer
        self.analyzer = Analyzer(
            stuck_s=a.stuck_s, floor_s=a.floor_s, k=a.k, straggler_s=a.straggler_s, node=a.node
        )
        # the attempt's directory is made here, 0700, before the command starts; older
        # attempts' go (removed through the base's descriptor, links never followed)
        try:
            with PrivateDir.open(self.base, what=RING_DIR_WHAT) as base:
                for old in base.names():
                    if re.fullmatch(r"attempt-\d+", old) and old != self.directory.name:
                        base.remove_tree(old)
                base.subdir(self.directory.name).close()
        except OSError as exc:  # the ranks' Ring refuses it too; the job runs untraced
            self._refuse(exc)
        self._last = float("-inf")

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    # -- reading ---------------------------------------------------------------------------
    def snapshots(self) -> list[RingSnapshot]:
        """The newest ring of every rank in the directory (mapped once, re-read each call);
        a ring that fails its checks (:mod:`.validate`) is said once and skipped."""
        try:  # checked on every pass: this user's, 0700, not a link (striped_fs.privdir)
            where = PrivateDir.open(self.directory, create=False, what=RING_DIR_WHAT)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._refuse(exc)
            return []
        with where:
            return newest_per_rank(scan_rings(where, self.refusals, self._readers))

    def _refuse(self, exc: OSError) -> None:
        """A directory or ring another user could control: said once, never read."""
        line = (
            f"refused: {exc}"
            if isinstance(exc, UnsafePath)
            else f"cannot use the ring directory {self.directory}: {exc}"
        )
        if line != self._refused:
            self._refused = line
            self.log(line)

    def poll(self, now: float | None = None, *, force: bool = False) -> list[Finding]:
        """One pass when ``poll_s`` has passed since the last (always with ``force``)."""
        mono = time.monotonic()
        if not force and mono - self._last < self.poll_s:
            return []
        self._last = mono
        snaps = self.snapshots()
        if not snaps:
            return []
        try:
            found = self.analyzer.analyze(snaps, now)
        except Exception as exc:  # noqa: BLE001 - the rings are checked (.validate); a
            # combination of their values the analysis did not foresee costs this pass, never
            # the agent or the job
            self.refusals.say(
                "#analysis",
                f"warning: the analysis failed on these rings "
                f"({type(exc).__name__}: {exc}): this pass skipped",
                type(exc).__name__,
            )
            return []
        by_rank = {s.rank: s for s in snaps}
        for f in found:
            if f.kind == "never_issued" and self.trace_dir is not None:
                stacks = {
                    str(r): s
                    for r in f.ranks
                    if r in by_rank
                    and (s := stack_of(by_rank[r], self.trace_dir, self.stack_wait_s))
                }
                if stacks:
                    f.evidence["stacks"] = stacks
                    first = next(iter(stacks.values())).splitlines()
                    f.line += f"; stack: {' <- '.join(first[:3])}"
            self.log(f.line)
        if found:
            self._write(verdict_docs(found, self.analyzer.grid, self.node, self.attempt))
        return found

    def window(self) -> dict[str, Any]:
        """This node's recent ring window for the controller (:mod:`.ship`)."""
        from .ship import window

        snaps = self.snapshots()
        try:
            return window(snaps, node=self.node, attempt=self.attempt)
        except Exception as exc:  # noqa: BLE001 - as in poll: never the agent's end
            self.refusals.say(
                "#window",
                f"warning: cannot make the ring window "
                f"({type(exc).__name__}: {exc}): none shipped this pass",
                type(exc).__name__,
            )
            return window([], node=self.node, attempt=self.attempt)

    def lines(self) -> list[str]:
        return [f.line for f in self.analyzer.findings]

    def _write(self, docs: list[dict[str, Any]]) -> None:
        if self.trace_dir is None:
            return
        try:
            path = self.trace_dir / RECORD_FILE.format(node=self.node)
            with open_append(self.trace_dir, path.name) as f:
                f.write("".join(json.dumps(d, default=str) + "\n" for d in docs))
        except OSError as exc:  # a full trace disk must not cost the job
            self.log(f"warning: cannot write the colltrace record: {exc}")


def verdict_docs(
    found: list[Finding], grid: dict[str, dict[int, str]], node: str, attempt: int
) -> list[dict[str, Any]]:
    """The records of a pass's findings and its grid, as ``colltrace-<node>.ndjson`` holds
    them (:func:`read_verdicts` reads them back; ``bootseer report`` shows them)."""
    return [
        {"colltrace": "verdict", "node": node, "attempt": attempt, **f.to_doc()} for f in found
    ] + [
        {
            "colltrace": "grid",
            "node": node,
            "attempt": attempt,
            "time": found[-1].time,
            "grid": _grid_doc(grid),
        }
    ]


def _grid_doc(grid: dict[str, dict[int, str]]) -> dict[str, dict[str, str]]:
    return {g: {str(r): s for r, s in states.items()} for g, states in grid.items()}


def stack_of(snap: RingSnapshot, dump_dir: Path, wait_s: float) -> str:
    """The Python stack of a ring's process, from the robust dump: ask it (SIGUSR1) when
    its dump file exists (the handler is installed), read what it adds; '' when none."""
    if snap.pid <= 1 or "/" in snap.node or snap.node in (".", ".."):
        return ""  # never signal a process group or init, never a path outside dump_dir
    path = dump_dir / f"stacks-{snap.node}-rank{snap.rank}-{snap.pid}.txt"
    try:
        before = path.stat().st_size
    except OSError:
        return ""
    try:
        os.kill(snap.pid, signal.SIGUSR1)
    except OSError:
        return _tail_dump(path, 0)
    deadline = time.monotonic() + wait_s
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now_size = path.stat().st_size
        except OSError:
            break
        if now_size > before and now_size == size:
            break  # grown, and no longer growing
        size = now_size
    return _tail_dump(path, before) or _tail_dump(path, 0)


def _tail_dump(path: Path, offset: int) -> str:
    """The main thread's frames of the dump written from ``offset`` (innermost first)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        return ""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    main = [b for b in blocks if "<module>" in b] or blocks
    frames = [ln.strip() for ln in main[-1].splitlines()[1:] if ln.strip().startswith("File")]
    return "\n".join(frames[:20])


def read_verdicts(
    paths: list[str | os.PathLike],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The colltrace verdicts and grids under these trace files or directories."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("colltrace-*.ndjson"))
        elif p.name.startswith("colltrace-") and p.suffix == ".ndjson":
            files.append(p)
    verdicts: list[dict[str, Any]] = []
    grids: list[dict[str, Any]] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                (
                    verdicts
                    if doc.get("colltrace") == "verdict"
                    else grids
                    if doc.get("colltrace") == "grid"
                    else []
                ).append(doc)
    verdicts.sort(key=lambda d: d.get("time") or 0)
    grids.sort(key=lambda d: d.get("time") or 0)
    return verdicts, grids
