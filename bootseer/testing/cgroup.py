"""A cgroup v2 group per cluster host: every process of a node in one place, so that a node can
be lost at once (``cgroup.kill``: no process escapes by forking while the others die).

Works on a pure cgroup v2 machine (``/sys/fs/cgroup``) and on a hybrid one (v1 controllers,
cgroup2 at ``/sys/fs/cgroup/unified``): the group needs no controller, only the core files.
Without ``cgroup.kill`` (kernels before 5.14) the group is frozen, every process gets SIGKILL
and the group is thawed: nothing can fork while frozen, so the result is the same.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Literal

from .servers import ComponentUnavailable

__all__ = ["Cgroup", "KillMethod", "cgroup2_root", "groups_named"]

KillMethod = Literal["auto", "kill", "freeze"]


def cgroup2_root() -> Path:
    """Where the cgroup2 hierarchy is mounted; ComponentUnavailable when it is not (or when
    this process may not create groups there)."""
    with open("/proc/self/mounts", encoding="utf-8") as f:
        points = [line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]]
    for point in points:
        if os.access(point, os.W_OK):
            return Path(point)
    raise ComponentUnavailable(
        "no writable cgroup2 hierarchy (needed to kill every process of a node at once): "
        "mount one (mount -t cgroup2 none /sys/fs/cgroup/unified) and run as root"
    )


def _hierarchies() -> list[Path]:
    """Every cgroup hierarchy mounted here (v1 controllers and cgroup2)."""
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return [Path(line.split()[1]) for line in f if line.split()[2] in ("cgroup", "cgroup2")]


def groups_named(prefix: str) -> list[Path]:
    """Top-level groups whose name starts with ``prefix``, in every hierarchy: where runc puts
    a container (``/CONTAINERD-NAMESPACE/ID``), outside the group of whoever started it."""
    return sorted(
        p
        for h in _hierarchies()
        if h.is_dir()
        for p in h.iterdir()
        if p.is_dir() and p.name.startswith(prefix)
    )


class Cgroup:
    """One group, created on :meth:`create`, removed (with its children) on :meth:`remove`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def procs_file(self) -> Path:
        """Write a pid here to move that process in (``0``: the writer itself)."""
        return self.path / "cgroup.procs"

    def create(self) -> Cgroup:
        self.path.mkdir()
        return self

    def child(self, name: str) -> Cgroup:
        return Cgroup(self.path / name)

    def adopt(self, pid: int) -> None:
        """Move a running process in (its later children follow it)."""
        self.procs_file.write_text(f"{pid}\n")

    def pids(self) -> list[int]:
        """Every process in the group and its children."""
        found: list[int] = []
        for procs in sorted(self.path.rglob("cgroup.procs")):
            with contextlib.suppress(OSError):
                found += [int(line) for line in procs.read_text().split()]
        return found

    def populated(self) -> bool:
        try:
            events = (self.path / "cgroup.events").read_text()
        except FileNotFoundError:
            return False
        return "populated 1" in events

    def kill(self, method: KillMethod = "auto", timeout_s: float = 30.0) -> None:
        """SIGKILL every process of the group at once and wait until none is left."""
        if not self.path.exists():
            return
        has_kill = (self.path / "cgroup.kill").exists()
        if method == "kill" and not has_kill:
            raise ComponentUnavailable(f"{self.path}/cgroup.kill missing (Linux 5.14 or newer)")
        if method in ("auto", "kill") and has_kill:
            (self.path / "cgroup.kill").write_text("1\n")
        else:
            self._freeze_and_kill()
        deadline = time.monotonic() + timeout_s
        while self.populated():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"processes {self.pids()} of {self.path} survived SIGKILL "
                    f"for {timeout_s:.0f} s (stuck in the kernel, e.g. on a "
                    "dead FUSE mount)"
                )
            time.sleep(0.02)

    def _freeze_and_kill(self) -> None:
        freeze = self.path / "cgroup.freeze"
        freeze.write_text("1\n")
        try:
            deadline = time.monotonic() + 10
            while "frozen 1" not in (self.path / "cgroup.events").read_text():
                if time.monotonic() > deadline:
                    break  # a task in uninterruptible sleep: kill what is there anyway
                time.sleep(0.01)
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            freeze.write_text("0\n")

    def remove(self) -> None:
        """Remove the group and its children, deepest first (they must be empty)."""
        if not self.path.exists():
            return
        for sub in sorted(
            (p for p in self.path.rglob("*") if p.is_dir()),
            key=lambda p: len(p.parts),
            reverse=True,
        ):
            sub.rmdir()
        self.path.rmdir()
