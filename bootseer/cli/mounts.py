"""Start a FUSE mount in a background process and wait for it (``bootseer fs mount``,
``bootseer image mount``): the mount outlives the command, so its log goes to a file.

The log is private: a new directory with a name no one can guess (``mkdtemp``, 0700) in the
temporary directory, and in it a file created 0600, exclusively, never through a symlink.
A fixed name in a shared directory (``/tmp``) would let another user plant a symlink there
and have the mount, often run as root, append to a file of their choosing.

The log is for a mount that fails: one that ends cleanly (unmounted) removes its log and the
directory (:func:`remove_own_log`, told the path by :data:`LOG_ENV`), and a mount that fails
to come up has its log's tail in the error and the directory removed, so neither leaves a
``bootseer-KIND-mount-*`` directory behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile

from striped_fs import create_private

from .errors import CliError

LOG_ENV = "BOOTSEER_MOUNT_LOG"
"""The background mount's own log, in its environment: removed by it at a clean exit."""

_LOG_DIR = re.compile(r"bootseer-[a-z]+-mount-[^/]+")


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
    child_env = {**(os.environ if env is None else env), LOG_ENV: log_path}
    try:
        with os.fdopen(log_fd, "ab") as log_file:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                start_new_session=True,
                env=child_env,
            )
    except BaseException:
        shutil.rmtree(os.path.dirname(log_path), ignore_errors=True)
        raise
    try:
        fuse.wait_mounted(mountpoint, timeout=timeout, proc=proc)
    except fuse.MountError as exc:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        shutil.rmtree(os.path.dirname(log_path), ignore_errors=True)  # its tail is in the error
        raise CliError(f"{exc}\n{tail}") from None
    print(
        f"mounted {what} at {mountpoint} (pid {proc.pid}, log {log_path}); "
        f"unmount with: bootseer {kind} umount {mountpoint}"
    )
    return 0


def remove_own_log() -> None:
    """In a background mount's process, after a clean unmount: remove its log (named by
    :data:`LOG_ENV`) and the private directory it lies in. Only a file in a directory named
    as :func:`open_log` names them is touched, and the directory only when it is then empty."""
    path = os.environ.pop(LOG_ENV, None)
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not _LOG_DIR.fullmatch(os.path.basename(directory)):
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(directory)
