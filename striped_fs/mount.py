"""FUSE mount plumbing, for the processes that serve a mount and for those that wait on one.

What is here: the mount table read (:func:`is_mounted`, :func:`wait_mounted`, with
:func:`canonical_path` and :func:`unescape_mountinfo`), :func:`unmount`, fusepy loaded once with
one stand-in when libfuse is missing (:func:`load_fusepy`), and :func:`run_fuse`, the signal
handling every bootseer mount needs around fusepy's loop.

Why apart from :mod:`striped_fs.fuse` (which re-exports these) and :mod:`prefetch.lazyfs`: a
process that only waits for or removes a mount must not load fusepy and libfuse (a benchmark
measures cold imports; a parent process has no use for them), and the two FUSE servers had
each their own stand-in for fusepy. Nothing here touches the mounted path itself: a FUSE mount
whose server is gone or stopped fails or blocks every ``stat``, so the mount table is read.
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from .errors import MountError, MountTimeout

__all__ = [
    "FuseLibrary",
    "canonical_path",
    "is_mounted",
    "load_fusepy",
    "restore_sigpipe",
    "run_fuse",
    "unescape_mountinfo",
    "unmount",
    "wait_mounted",
]


class _StandInFuseOSError(OSError):
    """fusepy's FuseOSError when fusepy cannot be loaded: the operations stay testable (they
    raise it with an errno) without libfuse."""

    def __init__(self, err: int) -> None:
        super().__init__(err, os.strerror(err))


@dataclass(frozen=True)
class FuseLibrary:
    """fusepy, or its stand-in: ``Operations`` to subclass and ``FuseOSError`` to raise are
    there either way; ``module`` is None (and ``error`` says why) when libfuse is missing."""

    module: Any
    Operations: type
    FuseOSError: type[OSError]
    error: str | None = None

    def require(self) -> Any:
        """fusepy itself, or :class:`MountError` saying why it cannot be had."""
        if self.module is None:
            raise MountError(f"FUSE is unavailable: {self.error}")
        return self.module


@functools.cache
def load_fusepy() -> FuseLibrary:
    """fusepy, imported on the first call (it loads libfuse2 at import, and raises OSError when
    that is not found), else the stand-in."""
    try:
        import fuse
    except (ImportError, OSError) as exc:
        return FuseLibrary(None, object, _StandInFuseOSError, str(exc))
    return FuseLibrary(fuse, fuse.Operations, fuse.FuseOSError)


# -- serving -------------------------------------------------------------------------------------


def restore_sigpipe() -> None:
    """Put SIGPIPE back to "ignore" after a FUSE session.

    libfuse2 ignores SIGPIPE while it serves and, when it removes its handlers, resets SIGPIPE
    to the default (terminate) - even though Python had it ignored. The next write to a closed
    socket would then kill the whole process (a test run died with status 141 that way). This
    goes through libc, so it works from the thread that served the mount, too."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signal.SIGPIPE, ctypes.c_void_p(1))  # SIG_IGN == (void (*)(int)) 1
    except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
        pass


def run_fuse(ops: Any, mountpoint: str, options: dict[str, Any]) -> None:
    """Serve ``ops`` at ``mountpoint`` with fusepy until unmounted; the signal handling every
    bootseer mount needs: SIGTERM and SIGHUP unmount cleanly (libfuse installs its handlers
    only where a signal's disposition is the default; fusepy resets SIGINT itself, this does
    the same for SIGTERM and SIGHUP), and SIGPIPE is ignored again after."""
    fusepy = load_fusepy().require()
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            saved[sig] = signal.signal(sig, signal.SIG_DFL)
    try:
        fusepy.FUSE(ops, mountpoint, **options)
    except RuntimeError as e:
        raise MountError(
            f"libfuse failed to mount or serve {mountpoint!r} (code {e}); "
            "libfuse's own message is on stderr"
        ) from None
    finally:
        restore_sigpipe()
        for number, handler in saved.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


# -- the mount table, for a parent process -------------------------------------------------


def unescape_mountinfo(field: str) -> str:
    r"""mountinfo escapes space, tab, newline and backslash as \ooo."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def canonical_path(path: str | os.PathLike[str]) -> str:
    """``path`` absolute, its parent's links resolved: the form mountinfo lists it in. The
    path itself is never resolved: stat-ing a dead FUSE mountpoint fails with ENOTCONN, and
    one nobody serves blocks."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path.rstrip("/") or "/")
    return os.path.join(os.path.realpath(parent), name) if name else "/"


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a mount point, dead FUSE mounts (ENOTCONN) included."""
    target = canonical_path(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split(" ", 5)
                if len(fields) > 4 and unescape_mountinfo(fields[4]) == target:
                    return True
        return False
    except OSError:
        return os.path.ismount(target)


def _child_stderr(proc: subprocess.Popen[Any]) -> str:
    if proc.stderr is None:
        return "(stderr not captured)"
    try:
        _, err = proc.communicate(timeout=2)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return "(stderr unavailable)"
    if isinstance(err, bytes):
        err = err.decode("utf-8", "replace")
    err = (err or "").strip()
    return err[-4000:] if err else "(empty stderr)"


def wait_mounted(
    path: str | os.PathLike[str],
    timeout: float,
    proc: subprocess.Popen[Any] | None = None,
) -> None:
    """Block until ``path`` is mounted; fail fast, with its stderr, if ``proc`` exits first.

    Sleeps in ``poll()`` on /proc/self/mountinfo, which wakes on every mount-table change.
    """
    deadline = time.monotonic() + timeout
    poller = None
    mi = None
    try:
        try:
            mi = open("/proc/self/mountinfo", "rb")  # noqa: SIM115 - closed in finally
            poller = select.poll()
            poller.register(mi, select.POLLPRI | select.POLLERR)
        except OSError:
            poller = None
        while True:
            if is_mounted(path):
                return
            if proc is not None and proc.poll() is not None:
                raise MountError(
                    f"mount process for {os.fspath(path)!r} exited with code {proc.returncode} "
                    f"before the mount appeared; its stderr:\n{_child_stderr(proc)}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MountTimeout(f"{os.fspath(path)!r} not mounted after {timeout:.1f}s")
            step = min(remaining, 0.1)
            if poller is not None:
                poller.poll(step * 1000)
            elif proc is not None:
                try:
                    proc.wait(timeout=step)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(step)
    finally:
        if mi is not None:
            mi.close()


def unmount(path: str | os.PathLike[str], lazy: bool = False, timeout: float = 30.0) -> None:
    """Unmount with ``fusermount -u`` (then ``fusermount3 -u``, then ``umount``); no-op if not
    mounted. ``lazy`` detaches even while files are open (and clears dead mounts)."""
    target = canonical_path(path)
    if not is_mounted(target):
        return
    candidates = [
        ["fusermount", "-u", *(["-z"] if lazy else []), target],
        ["fusermount3", "-u", *(["-z"] if lazy else []), target],
        ["umount", *(["-l"] if lazy else []), target],
    ]
    errors = []
    for cmd in candidates:
        if shutil.which(cmd[0]) is None:
            continue
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            errors.append(f"{cmd[0]}: timed out after {timeout}s")
            continue
        if r.returncode == 0 or not is_mounted(target):
            return
        errors.append(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    if is_mounted(target) and os.geteuid() == 0 and _umount2(target, lazy, errors):
        return
    if is_mounted(target):
        raise MountError(f"could not unmount {target!r}: " + "; ".join(errors or ["no tool found"]))


def _umount2(target: str, lazy: bool, errors: list[str]) -> bool:
    """The system call itself, for root where neither tool exists (a minimal container image
    with CAP_SYS_ADMIN): True when ``target`` is no longer mounted."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(target), 2 if lazy else 0) != 0:  # MNT_DETACH
        errors.append(f"umount2: {os.strerror(ctypes.get_errno())}")
        return False
    return not is_mounted(target)
