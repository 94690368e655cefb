"""Linux namespaces for the cluster fixture: network and UTS namespaces, entered from a thread
or by a child process, and found again when something outlived its owner.

Why two ways in: a child process (``nsenter_argv``) is how a node runs its programs; a thread
of this process (``entered``) is how a test reaches a service from Python, or starts an
in-process proxy whose sockets must live on a node (a socket belongs to the namespace of the
thread that created it, and threads inherit their creator's namespaces).

Network namespaces are named (``ip netns add``: ``/run/netns/NAME``); a UTS namespace (the
host name) is kept alive by a bind mount on a file of the caller's private directory
(``unshare --uts=FILE``), so that every program of a node sees the same host name.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = [
    "NETNS_DIR",
    "create_netns",
    "create_uts",
    "delete_netns",
    "entered",
    "ip",
    "mounts_under",
    "ns_inode",
    "nsenter_argv",
    "processes_in",
    "release_uts",
]

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000

_libc = ctypes.CDLL(None, use_errno=True)


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``ip [-n NETNS] ARGS``; a failure raises with ip's own message."""
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_path(name: str) -> Path:
    return NETNS_DIR / name


def create_netns(name: str) -> Path:
    """A new named network namespace with its loopback up; returns its ``/run/netns`` path."""
    ip("netns", "add", name)
    ip("link", "set", "lo", "up", netns=name)
    return netns_path(name)


def delete_netns(name: str) -> None:
    """Remove a named network namespace (its interfaces, veth peers included, go with it once
    no process holds it); no-op when it is gone."""
    if netns_path(name).exists():
        ip("netns", "delete", name, check=False)


def create_uts(path: Path, hostname: str) -> Path:
    """A new UTS namespace named ``hostname``, kept alive by a bind mount on ``path``."""
    path.touch()
    subprocess.run(
        ["unshare", f"--uts={path}", "hostname", hostname], check=True, capture_output=True
    )
    return path


def release_uts(path: Path) -> None:
    """Drop the bind mount that keeps a UTS namespace alive (no-op when not mounted)."""
    if mounts_under(path):
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def nsenter_argv(netns: Path, uts: Path | None = None) -> list[str]:
    """The prefix that runs a program in these namespaces (mounts stay the host's, so every
    program of a node sees the FUSE and overlay mounts the others made)."""
    return ["nsenter", f"--net={netns}", *([f"--uts={uts}"] if uts else []), "--"]


def _setns(fd: int, kind: int) -> None:
    if _libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(netns: Path, uts: Path | None = None) -> Iterator[None]:
    """Run the body with the calling thread in these namespaces, then go back.

    Sockets created inside stay in ``netns`` for their whole life; threads and processes
    started inside inherit the namespaces. Other threads are not affected."""
    kinds = [(netns, CLONE_NEWNET, "net")] + ([(uts, CLONE_NEWUTS, "uts")] if uts else [])
    own = {kind: os.open(f"/proc/thread-self/ns/{name}", os.O_RDONLY) for _, kind, name in kinds}
    entered_kinds: list[int] = []
    try:
        for path, kind, _ in kinds:
            fd = os.open(path, os.O_RDONLY)
            try:
                _setns(fd, kind)
            finally:
                os.close(fd)
            entered_kinds.append(kind)
        yield
    finally:
        for kind in entered_kinds:
            _setns(own[kind], kind)
        for fd in own.values():
            os.close(fd)


def ns_inode(path: Path | str) -> int:
    """The inode that identifies a namespace (``/proc/PID/ns/net``, ``/run/netns/NAME``...)."""
    return os.stat(path).st_ino


def processes_in(inodes: Iterable[int], kinds: Iterable[str] = ("net", "uts")) -> list[int]:
    """Pids of the processes in any of these namespaces (by inode): what a node left behind,
    even a process that escaped its cgroup (a container that runc moved)."""
    wanted = set(inodes)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for kind in kinds:
            try:
                if os.stat(f"/proc/{entry.name}/ns/{kind}").st_ino in wanted:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return found


_ESCAPE = re.compile(r"\\([0-7]{3})")


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below ``root`` in this mount namespace, deepest first (the order to
    unmount them in)."""
    root = Path(os.path.realpath(root))
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            point = Path(_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ", 5)[4]))
            if point == root or root in point.parents:
                found.append(point)
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)
