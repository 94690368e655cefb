"""The rank processes of a supervised command, watched directly: a rank's death is seen the
moment it happens, not when its launcher (torchrun) exits seconds later, after it has torn
the other workers down.

Why here and how: the agent knows each rank's pid from the status record the client writes
(``status-<rank>`` in the control directory, :mod:`bootseer.client`). Every pid gets a
``pidfd`` (``os.pidfd_open``), which becomes readable when the process exits; the supervisor
waits on those descriptors with its signal pipe, so a death wakes it at once. A rank is not
the agent's child (the launcher's), so its exit status comes from ``/proc/<pid>/stat`` while
it is a zombie (the kernel keeps the wait status there until the launcher reaps it); when the
launcher reaped it first the status is unknown. An uncaught exception is in the rank's record
before the process is gone, and counts as its end even when a leftover thread keeps the
process alive.

A normal end is not a crash: exit status 0, or the record's ``"exited"`` (the interpreter
ran its ``atexit`` hooks) with no status known. Only processes below ``root`` (the command the
supervisor started) count: a rank of an earlier attempt that outlived its launcher (reparented
to the supervisor, which is a subreaper) may still write its record into the control
directory, and its death is not this attempt's crash.

Usage::

    watch = RankWatch(control_dir, root=child.pid, skip_pids={child.pid})
    select.select([signal_pipe, *watch.fds()], [], [], 0.25)
    for end in watch.poll():        # RankEnd(rank=1, pid=..., how="signal", status=9, ...)
        ...
"""

from __future__ import annotations

import json
import os
import select
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RankEnd", "RankWatch", "descends", "zombie_status"]


@dataclass(frozen=True)
class RankEnd:
    """One rank's abnormal end, seen at ``time``. ``how``: ``"exception"`` (the record names
    it; the rank's own time of it is the record's ``time``), ``"signal"``
    or ``"exit"`` (the wait status was read: ``status`` is the signal or the exit code),
    ``"vanished"`` (gone with no record of an end and no status)."""

    rank: int
    pid: int
    how: str
    time: float
    status: int | None = None
    record: dict[str, Any] = field(default_factory=dict)


def zombie_status(pid: int) -> int | None:
    """The wait status of an exited, not yet reaped process (``/proc/<pid>/stat`` field 52,
    Linux >= 3.5), or None while it runs, once it is reaped, or when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not fields or fields[0] not in (b"Z", b"X") or len(fields) < 50:
        return None
    try:
        return int(fields[-1])  # exit_code: the last field
    except ValueError:
        return None


def descends(pid: int, root: int) -> bool:
    """Whether ``root`` is an ancestor of ``pid`` (its ``/proc`` parents; a zombie keeps its
    parent); False when that cannot be read."""
    for _ in range(64):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            pid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == root:
            return True
        if pid <= 1:
            return False
    return False


def _record(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


class RankWatch:
    """The ranks of one attempt (see the module docstring). ``root``: only processes below it
    count (None: any); ``skip_pids``: processes whose end the supervisor sees itself (the
    command it spawned, when the command is the rank)."""

    def __init__(
        self,
        control_dir: str | os.PathLike,
        *,
        root: int | None = None,
        skip_pids: Collection[int] = (),
    ) -> None:
        self.control_dir = Path(control_dir)
        self.root = root
        self.skip_pids = set(skip_pids)
        self._fds: dict[int, tuple[int, int]] = {}  # pid -> (pidfd, rank)
        self._done: set[int] = set()  # pids already reported or ended normally
        self._seen: dict[str, tuple[int, int]] = {}  # record file -> (mtime_ns, size)
        self._records: dict[int, dict[str, Any]] = {}  # pid -> its newest record
        self.ended_normally: list[int] = []  # ranks whose process ended normally (drained
        # by the caller: the agent stops counting their silence as a hang)
        self.started: list[tuple[int, int, float]] = []  # (rank, pid, time) of each rank
        # process first seen (drained by the caller: a launcher that restarted its workers)

    def fds(self) -> list[int]:
        """Descriptors that become readable when a watched rank exits."""
        return [fd for fd, _ in self._fds.values()]

    def _scan(self) -> None:
        try:
            with os.scandir(self.control_dir) as it:
                paths = [Path(e.path) for e in it if e.name.startswith("status-")]
        except OSError:
            return
        for path in paths:
            try:
                st = path.stat()
            except OSError:
                continue
            if self._seen.get(path.name) == (st.st_mtime_ns, st.st_size):
                continue
            self._seen[path.name] = (st.st_mtime_ns, st.st_size)
            doc = _record(path)
            pid, rank = doc.get("pid"), doc.get("rank")
            if not isinstance(pid, int) or not isinstance(rank, int) or pid in self.skip_pids:
                continue
            if pid in self._done:
                continue
            if pid not in self._fds and self.root is not None and not descends(pid, self.root):
                self._done.add(pid)  # an earlier attempt's rank, or a stranger's record
                continue
            self._records[pid] = doc
            if pid not in self._fds:
                self.started.append((rank, pid, time.time()))
                try:
                    self._fds[pid] = (os.pidfd_open(pid), rank)
                except OSError:  # already gone: its status (or its absence) says how
                    self._fds[pid] = (-1, rank)

    def poll(self) -> list[RankEnd]:
        """Ranks that ended abnormally since the last call (each once), oldest first."""
        self._scan()
        ends: list[RankEnd] = []
        now = time.time()
        for pid, (fd, rank) in list(self._fds.items()):
            record = self._records.get(pid, {})
            exited = fd < 0 or bool(select.select([fd], [], [], 0)[0])
            if not exited and record.get("state") != "exception":
                continue
            status = zombie_status(pid) if exited else None
            self._forget(pid)
            end = _end(rank, pid, record, status, exited, now)
            if end is not None:
                ends.append(end)
            elif exited:
                self.ended_normally.append(rank)
        return sorted(ends, key=lambda e: e.time)

    def _forget(self, pid: int) -> None:
        fd, _ = self._fds.pop(pid)
        self._done.add(pid)
        if fd >= 0:
            os.close(fd)

    def live(self) -> dict[int, int]:
        """The watched rank processes still running: pid -> rank."""
        return {
            pid: rank
            for pid, (fd, rank) in self._fds.items()
            if fd >= 0 and not select.select([fd], [], [], 0)[0]
        }

    def close(self) -> None:
        for pid in list(self._fds):
            self._forget(pid)


def _end(
    rank: int, pid: int, record: dict[str, Any], status: int | None, exited: bool, now: float
) -> RankEnd | None:
    """How a rank ended, or None for a normal end."""
    if record.get("state") == "exception":  # the rank's own word (its time: "raised_at")
        return RankEnd(
            rank, pid, "exception", now, None if status is None else _code(status), record
        )
    if status is not None:
        if os.WIFSIGNALED(status):
            return RankEnd(rank, pid, "signal", now, os.WTERMSIG(status), record)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        return None if code == 0 else RankEnd(rank, pid, "exit", now, code, record)
    if record.get("state") == "exited" or not exited:
        return None
    return RankEnd(rank, pid, "vanished", now, None, record)


def _code(status: int) -> int:
    """A wait status as a Popen return code (-N for signal N)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
