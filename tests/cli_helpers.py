"""Running the ``bootseer`` command the way a person does: a real subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def bootseer_cli(
    *args: str, env: dict | None = None, check: bool = True, timeout: float = 120, umask: int = -1
) -> subprocess.CompletedProcess:
    """``python -m bootseer ARGS`` (under ``umask`` when given); with ``check`` a non-zero
    exit fails with its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "bootseer", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        umask=umask,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"bootseer {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
        )
    return proc


def background_log(stdout: str, kind: str) -> Path:
    """The log a background ``bootseer KIND mount`` printed; it must lie alone in a private
    directory of its own (``bootseer-KIND-mount-*`` in the temporary directory)."""
    match = re.search(r", log (\S+)\);", stdout)
    assert match, stdout
    log = Path(match.group(1))
    assert log.parent.parent == Path(tempfile.gettempdir()), log
    assert log.parent.name.startswith(f"bootseer-{kind}-mount-"), log
    return log


def log_removed(log: Path, timeout: float = 10.0) -> bool:
    """A background mount that unmounted cleanly removes its log and the log's private
    directory (bootseer.cli.mounts.remove_own_log): True once both are gone."""
    import time

    deadline = time.monotonic() + timeout
    while log.parent.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def remove_background_log(log: Path, kind: str) -> None:
    """Remove the private directory of a background mount's log, and nothing else: never a
    directory that is not that mount's own (an older version logged straight into /tmp)."""
    directory = log.parent
    if directory.parent == Path(tempfile.gettempdir()) and directory.name.startswith(
        f"bootseer-{kind}-mount-"
    ):
        shutil.rmtree(directory, ignore_errors=True)
