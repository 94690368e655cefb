"""Start a FUSE mount in a background process and wait for it (``bootseer fs mount``,
``bootseer image mount``): the mount outlives the command, so its log goes to a file."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile

from .errors import CliError


def start_background_mount(argv: list[str], mountpoint: str, *, timeout: float, what: str,
                           kind: str, env: dict[str, str] | None = None) -> int:
    """Run ``argv`` (a foreground mount command, with ``env``) detached; return once
    ``mountpoint`` is mounted, or raise CliError with the tail of its log."""
    from striped_fs import fuse

    log_path = os.path.join(tempfile.gettempdir(), f"bootseer-{kind}-"
                            f"{os.path.basename(os.path.abspath(mountpoint))}-{os.getpid()}.log")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=log_file, start_new_session=True, env=env)
    try:
        fuse.wait_mounted(mountpoint, timeout=timeout, proc=proc)
    except fuse.MountError as exc:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with open(log_path, errors="replace") as f:
            raise CliError(f"{exc}\n{f.read()[-4000:]}") from None
    print(f"mounted {what} at {mountpoint} (pid {proc.pid}, log {log_path}); "
          f"unmount with: bootseer {kind} umount {mountpoint}")
    return 0
