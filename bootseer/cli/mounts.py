"""Start a FUSE mount in a background process and wait for it (``bootseer fs mount``,
``bootseer image mount``): the mount outlives the command, so its log goes to a file.

The log is private: a new directory with a name no one can guess (``mkdtemp``, 0700) in the
temporary directory, and in it a file created 0600, exclusively, never through a symlink.
A fixed name in a shared directory (``/tmp``) would let another user plant a symlink there
and have the mount, often run as root, append to a file of their choosing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile

from striped_fs import create_private

from .errors import CliError


def open_log(kind: str, mountpoint: str) -> tuple[str, int]:
    """(path, write descriptor) of a new private log file for a ``kind`` mount."""
    directory = tempfile.mkdtemp(prefix=f"bootseer-{kind}-mount-")
    name = os.path.basename(os.path.abspath(mountpoint)) or "root"
    path = os.path.join(directory, f"{name}.log")
    return path, create_private(path, os.O_WRONLY | os.O_APPEND)


def start_background_mount(
    argv: list[str],
    mountpoint: str,
    *,
    timeout: float,
    what: str,
    kind: str,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``argv`` (a foreground mount command, with ``env``) detached; return once
    ``mountpoint`` is mounted, or raise CliError with the tail of its log."""
    from striped_fs import fuse

    log_path, log_fd = open_log(kind, mountpoint)
    with os.fdopen(log_fd, "ab") as log_file:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            start_new_session=True,
            env=env,
        )
    try:
        fuse.wait_mounted(mountpoint, timeout=timeout, proc=proc)
    except fuse.MountError as exc:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with open(log_path, errors="replace") as f:
            raise CliError(f"{exc}\n{f.read()[-4000:]}") from None
    print(
        f"mounted {what} at {mountpoint} (pid {proc.pid}, log {log_path}); "
        f"unmount with: bootseer {kind} umount {mountpoint}"
    )
    return 0
