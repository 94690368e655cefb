"""The supervised command's processes, as ``bootseer run`` holds them: the wrapper's signals
on a pipe, the command's exit reaped (and every orphan the subreaper inherits), signals to
its process group and its descendants' groups, its kill, and the cleanup of what it left.

Cut out of :mod:`bootseer.supervise` (docs/decisions.md, "supervise: cut at its seams"): the
supervisor and its pieces in :mod:`bootseer.robust` (typed there as
:class:`bootseer.robust.seams.Processes`) wait, signal and kill through one object, so that
every wait of an attempt answers a stop signal the same way.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .process import exit_code, group_pids

__all__ = ["FORWARD_SIGNALS", "HANDLED", "STOP_SIGNALS", "Processes", "Signals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
FORWARD_SIGNALS = (signal.SIGUSR2, signal.SIGWINCH)
HANDLED = (*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGUSR1, signal.SIGCHLD)


class Signals:
    """Signals as bytes on a pipe (``signal.set_wakeup_fd``): the main loop waits on it with
    ``select`` and handles them in order, never inside a handler."""

    def __init__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the supervisor must run in the main thread (it owns signals)")
        self.rfd, self.wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_fd = signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._noop) for s in HANDLED}

    @staticmethod
    def _noop(signum: int, frame: Any) -> None:
        """The byte on the pipe is the event; the handler only keeps the default away."""

    def wake(self) -> None:
        """Ends a wait early (a byte 0, which is no signal)."""
        try:
            os.write(self.wfd, b"\0")
        except OSError:
            pass

    def wait(self, timeout: float, wake: Sequence[int] = ()) -> list[int]:
        """Signals that arrived, waiting up to ``timeout`` seconds for the first, or for one
        of the ``wake`` descriptors to become readable (a rank's pidfd: it exited)."""
        try:
            ready, _, _ = select.select([self.rfd, *wake], [], [], max(timeout, 0.0))
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            ready = [self.rfd]
        if not ready:
            return []
        if self.rfd not in ready:
            return []
        try:
            data = os.read(self.rfd, 512)
        except BlockingIOError:
            return []
        return [sig for sig in data if sig]

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.rfd)
        os.close(self.wfd)


class Processes:
    """The running command (``child``; its wait ``status`` once reaped) and the first stop
    signal that came (``stopping``: the job ends after this attempt). ``signals`` is the
    run's pipe, set while the supervisor runs."""

    def __init__(self, kill_grace_s: float, log: Callable[[str], None]) -> None:
        self.kill_grace_s = kill_grace_s
        self.log = log
        self.signals: Signals | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.status: int | None = None
        self.stopping: int | None = None

    def signal_group(self, pid: int, sig: int) -> None:
        """``sig`` to the command's process group; a SIGKILL or SIGTERM also to the groups of
        its descendants, found first: torchrun starts each worker in a session of its own,
        so a SIGKILL to torchrun's group alone would leave its ranks running, orphaned."""
        from .robust.remote import descendants

        groups = [pid]
        if sig in (signal.SIGKILL, signal.SIGTERM):
            for child in descendants(pid):
                try:
                    groups.append(os.getpgid(child))
                except ProcessLookupError:
                    continue
        for group in dict.fromkeys(groups):
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self, pid: int) -> int:
        """SIGKILL to the command's groups and its end reaped (5 s at most): its exit code,
        128 + SIGKILL when it was not reaped by then."""
        self.signal_group(pid, signal.SIGKILL)
        self.wait_child(5.0)
        return exit_code(self.status) if self.status is not None else 128 + signal.SIGKILL

    def kill_processes(self, pid: int, ranks: Mapping[int, int]) -> None:
        """SIGKILL to each rank's process group (torchrun starts each worker in a session of
        its own: its dataloader workers go with it), or to the rank and its descendants when
        it shares the command's group (forked workers). ``ranks``: pid -> rank."""
        from .robust.remote import descendants

        try:
            own = os.getpgid(pid)
        except ProcessLookupError:
            own = pid
        for rank_pid in ranks:
            try:
                group = os.getpgid(rank_pid)
            except ProcessLookupError:
                continue
            try:
                if group != own:
                    os.killpg(group, signal.SIGKILL)
                else:
                    for target in (rank_pid, *descendants(rank_pid)):
                        os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def reap(self) -> bool:
        """Reap every child that has exited; True once the command itself has."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if self.child is not None and pid == self.child.pid:
                self.status = status
        return self.status is not None

    def wait_child(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.reap() and time.monotonic() < deadline:
            self.pause(0.02)
        return self.status is not None

    def pause(self, timeout: float) -> bool:
        """Wait while the command is being killed; True when a stop signal arrived (the job
        then ends after this attempt: no restart)."""
        assert self.signals is not None, "the signals are the supervisor's run's"
        stop = False
        for sig in self.signals.wait(timeout):
            if sig in STOP_SIGNALS:
                stop = True
                if self.stopping is None:
                    self.stopping = sig
        self.reap()
        return stop

    def cleanup_group(self, pgid: int) -> None:
        """What the command left running in its group is stopped: SIGTERM, a grace period,
        SIGKILL (a leftover worker would hold its GPU and ports across a restart)."""
        if not self.group_alive(pgid):
            return
        self.signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        while time.monotonic() < deadline:
            if self.pause(0.05):
                break
            if not self.group_alive(pgid):
                return
        self.log(f"killing what the command left running (process group {pgid})")
        self.signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while self.group_alive(pgid) and time.monotonic() < deadline:
            self.pause(0.02)

    def group_alive(self, pgid: int) -> bool:
        self.reap()
        try:
            os.killpg(pgid, 0)  # the cheap answer first: nobody at all
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return bool(group_pids(pgid))
