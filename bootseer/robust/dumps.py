"""The stack dumps of ``bootseer run``'s command: asked for with SIGUSR1 (the client's
faulthandler files, ``stacks-<node>-rank<r>-<pid>.txt`` in the trace directory), waited for
until they stop growing, kept as files in the trace directory (py-spy's dumps for the
controller), the native ones taken on a thread after the answer, and the empty files of
ended processes removed.

Cut out of ``bootseer.supervise`` (docs/decisions.md, "supervise: cut at its seams"): the
files and their names are one job; the supervisor, the hang handling (:mod:`.hangs`) and the
controller dialogue (:mod:`.dialogue`) call it.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..process import alive, group_pids
from ..trace import write_trace_file
from .seams import Processes, RemoteSeam

__all__ = ["NATIVE_GRACE_S", "StackDumps", "last_dump"]

#: seconds the command's kill waits, after the verdict, for native dumps still being taken
NATIVE_GRACE_S = 1.0


class StackDumps:
    """This node's dumps in ``dump_dir`` (None: no dumps kept, none waited for); a wait for
    them lasts at most ``wait_s`` (``hang.dump_wait_s``) and ends at a stop signal."""

    def __init__(
        self,
        node: str,
        dump_dir: Path | None,
        wait_s: float,
        procs: Processes,
        log: Callable[[str], None],
    ) -> None:
        self.node = node
        self.dump_dir = dump_dir
        self.wait_s = wait_s
        self.procs = procs
        self.log = log

    def native(
        self, remote: RemoteSeam, incident: int, rank_pids: dict[int, int]
    ) -> threading.Thread:
        """The ranks' trees dumped again with native frames, on a thread, after the answer:
        the controller decides on the Python stacks (0.1-0.6 s a node), and the native ones
        (seconds on a loaded node) go into its evidence when they are in by its verdict. The
        command is killed no later than ``NATIVE_GRACE_S`` after the verdict, finished or not."""
        from .remote import dump_ranks

        def run() -> None:
            if not rank_pids:
                return
            try:
                processes, _ = dump_ranks(rank_pids, node=self.node, dump=remote.native_tool)
                processes = [p for p in processes if p["text"]]
                self.keep(processes, incident, suffix="-native")
                if processes:
                    remote.answer_native(incident, processes)
            except Exception as exc:  # noqa: BLE001 - evidence only: never the incident's end
                self.log(f"warning: native dumps for incident {incident}: {exc}")

        thread = threading.Thread(target=run, name="bootseer-native-dumps", daemon=True)
        thread.start()
        return thread

    def keep(self, processes: list[dict[str, Any]], incident: int, suffix: str = "") -> list[Path]:
        """Each dump also as a file in the trace directory (evidence that outlives the
        store): ``dump-<node>-i<incident>-rank<r>-<pid><suffix>.txt``."""
        if self.dump_dir is None:
            return []
        kept = []
        for item in processes:
            path = self.dump_dir / (
                f"dump-{self.node}-i{incident}-rank{item['rank']}-{item['pid']}{suffix}.txt"
            )
            try:
                write_trace_file(
                    self.dump_dir, path.name, f"# {item['source']} {item['role']}\n{item['text']}"
                )
                kept.append(path)
            except OSError as exc:
                self.log(f"warning: cannot keep the dump {path}: {exc}")
        return kept

    def files(self, pids: set[int]) -> dict[Path, int]:
        """This node's stack files of live processes of the group, with their sizes."""
        out: dict[Path, int] = {}
        if self.dump_dir is None:
            return out
        for pid in pids:
            pattern = f"stacks-{glob.escape(self.node)}-rank*-{pid}.txt"
            for path in self.dump_dir.glob(pattern):
                try:
                    out[path] = path.stat().st_size
                except OSError:
                    pass
        return out

    def request(self, pid: int, *, everyone: bool) -> dict[Path, int]:
        """SIGUSR1 to the group (``everyone``: they are about to be killed anyway) or only to
        the processes with a registered dump file; their files and sizes before."""
        members = group_pids(pid)
        files = self.files(members)
        if everyone:
            self.procs.signal_group(pid, signal.SIGUSR1)
        else:
            for path in files:
                try:
                    os.kill(int(path.stem.rsplit("-", 1)[1]), signal.SIGUSR1)
                except (ProcessLookupError, ValueError):
                    pass
        return files

    def wait(self, sizes: dict[Path, int]) -> set[Path]:
        """Until every expected file has grown and stopped growing, or ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        grown: set[Path] = set()
        last: dict[Path, int] = dict(sizes)
        steady = 0
        while sizes and time.monotonic() < deadline:
            if self.procs.pause(0.05):
                break  # stopped: the kill comes now, no restart after it
            now = {p: _size(p) for p in sizes}
            grown = {p for p, n in now.items() if n > sizes[p]}
            steady = steady + 1 if now == last else 0
            last = now
            if len(grown) == len(sizes) and steady >= 2:
                break
        return grown

    def faulthandler(
        self, pid: int, failed: list[int], rank_pids: dict[int, int]
    ) -> list[dict[str, Any]]:
        """The client's faulthandler files in place of py-spy's dumps (only the processes
        that registered one get SIGUSR1: it kills the others, and no verdict yet): of the
        ranks py-spy could not dump, or of every rank when none was known by its pid."""
        processes: list[dict[str, Any]] = []
        grown = self.wait(self.request(pid, everyone=False))
        for path in sorted(grown):
            stem = path.stem.rsplit("-", 2)
            rank = int(stem[1].removeprefix("rank")) if len(stem) == 3 else -1
            if rank in failed or not rank_pids:
                processes.append(
                    {
                        "rank": rank,
                        "pid": int(stem[-1]),
                        "role": "main",
                        "node": self.node,
                        "source": "faulthandler",
                        "text": last_dump(path),
                    }
                )
        return processes

    def remove_empty(self) -> None:
        """Every client process leaves an empty stack file; only dumps are worth keeping."""
        if self.dump_dir is None:
            return
        for path in self.dump_dir.glob(f"stacks-{glob.escape(self.node)}-rank*.txt"):
            try:
                pid = int(path.stem.rsplit("-", 1)[1])
                if path.stat().st_size == 0 and not alive(pid):
                    path.unlink()
            except (OSError, ValueError):
                pass


def last_dump(path: Path, limit: int = 32 << 10) -> str:
    """A stack file's newest dumps, at most ``limit`` characters from its end, starting at
    a thread header (the parser keeps the last dump of a file)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    starts = [i for i in (tail.find("\nThread 0x"), tail.find("\nCurrent thread 0x")) if i >= 0]
    return tail[min(starts) + 1 :] if starts else tail


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
