"""Real FUSE mounts for tests: availability, a mount served by a child process, bounded I/O.

Every wait is bounded: commands run with subprocess timeouts, in-process I/O on a mount runs
in a thread that, on timeout, aborts the FUSE connection (which unblocks it), and
:func:`stop_mount` lazily unmounts whatever is left.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from striped_fs.fuse import MountError, is_mounted, unmount

MOUNT_TIMEOUT = 20.0
IO_TIMEOUT = 120.0


def fuse_missing() -> str | None:
    """Why a mount cannot work here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse missing (modprobe fuse, or run the container with --device /dev/fuse)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return f"/dev/fuse not readable and writable by uid {os.geteuid()}"
    if not (shutil.which("fusermount") or shutil.which("fusermount3")):
        return "fusermount not found (apt-get install fuse3)"
    if not ctypes.util.find_library("fuse"):
        return "libfuse2 not found (apt-get install libfuse2)"
    return None


def need_fuse(reason: str | None) -> None:
    if reason is None:
        return
    if os.environ.get("BOOTSEER_REQUIRE_SYSTEM") == "1":
        pytest.fail(
            f"FUSE required (BOOTSEER_REQUIRE_SYSTEM=1) but unavailable: {reason}", pytrace=False
        )
    pytest.skip(reason)


@dataclass
class Mount:
    backing: Path
    path: Path
    proc: subprocess.Popen[bytes]
    log: list[str] = field(default_factory=list)

    def stderr(self) -> str:
        """The child's stderr (only once it has exited)."""
        if self.proc.stderr is None or self.proc.poll() is None:
            return ""
        try:
            return self.proc.stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""


def mounted_in_proc_mounts(path: Path) -> bool:
    with open("/proc/mounts", encoding="utf-8") as f:
        return any(line.split()[1] == str(path) for line in f)


def stop_mount(m: Mount) -> None:
    """Unmount and reap, whatever state the mount is in; never leaves a mount behind."""
    try:
        if m.proc.poll() is None and is_mounted(m.path):
            try:
                unmount(m.path, timeout=10)
            except MountError:
                pass
        try:
            m.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait(timeout=10)
    finally:
        if is_mounted(m.path):
            subprocess.run(
                ["fusermount", "-u", "-z", str(m.path)],
                capture_output=True,
                timeout=10,
                check=False,
            )
        if is_mounted(m.path):
            subprocess.run(
                ["umount", "-l", str(m.path)], capture_output=True, timeout=10, check=False
            )
        if m.proc.stderr is not None:
            m.proc.stderr.close()


def abort_connection(path: Path) -> None:
    """Abort the FUSE connection of ``path`` so that I/O blocked on it returns ENOTCONN."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path):
                minor = fields[2].split(":")[1]
                try:
                    Path(f"/sys/fs/fuse/connections/{minor}/abort").write_text("1")
                except OSError:
                    pass


def bounded(m: Mount, fn: Callable[[], Any], timeout: float = IO_TIMEOUT) -> Any:
    """Run in-process I/O on a mount with a deadline (a hung server must not hang the test)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        abort_connection(m.path)
        t.join(10)
        pytest.fail(f"I/O on {m.path} did not finish within {timeout}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def run(*cmd: str, timeout: float = IO_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)


def errno_of(fn: Callable[[], Any]) -> int | None:
    try:
        fn()
    except OSError as e:
        return e.errno
    return None
