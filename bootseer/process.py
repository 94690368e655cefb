"""Processes, process groups and signals, read from the kernel (``/proc``, ``kill(pid, 0)``).

Why one module: the supervisor, the crash classifier and the collective-trace analyzer all ask
the same questions (is this pid alive, who is in this process group, what is signal 9 called,
when did this process start) and each had its own copy of the answer; the copies drifted (a
zombie alive in one, dead in another). Here each question has one answer, named for what it
means. It imports nothing of bootseer, so any module may use it without a cycle.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from striped_fs import pid_exists

__all__ = [
    "PR_SET_CHILD_SUBREAPER",
    "alive",
    "become_subreaper",
    "exit_code",
    "group_pids",
    "pid_alive",
    "proc_state",
    "signal_name",
    "since_boot",
    "started_at",
]

PR_SET_CHILD_SUBREAPER = 36


def exit_code(status: int) -> int:
    """A ``waitpid`` status as a shell would report it: the code, or 128+signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 128 + os.WSTOPSIG(status) if os.WIFSTOPPED(status) else 1


def become_subreaper() -> bool:
    """Orphans of the command become the wrapper's children (and are reaped by it). PID 1
    is one already."""
    if os.getpid() == 1:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # not Linux
        return False


def group_pids(pgid: int) -> set[int]:
    """Live processes of a process group (from /proc; zombies left out)."""
    found: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        # fields[0] is the state, [1] the parent, [2] the process group
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            found.add(int(name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` exists (``kill(pid, 0)``): a zombie, not yet reaped, still does, and so
    does a process of another user. Use :func:`pid_alive` when a zombie must count as gone."""
    return pid_exists(pid)


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, CPU ticks used) of a process of this pid namespace, None when gone.
    Why: a rank stopped (T), in uninterruptible sleep (D) or a zombie (Z) while its peers
    wait is the likely peer of an op issued everywhere and completed nowhere."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state, utime + stime
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """A process of this pid namespace that still runs (a zombie counts as dead)."""
    st = proc_state(pid)
    return st is not None and st[0] not in ("Z", "X")


def since_boot() -> float:
    """Seconds since boot, on the clock of ``/proc/<pid>/stat``'s start times."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def started_at(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since boot (:func:`since_boot`):
    ``/proc/<pid>/stat``'s start time in clock ticks; None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2 :].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15; the number itself for one Python has no name for."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
