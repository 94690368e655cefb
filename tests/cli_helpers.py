"""Running the ``bootseer`` command the way a person does: a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def bootseer_cli(*args: str, env: dict | None = None, check: bool = True,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m bootseer ARGS``; with ``check`` a non-zero exit fails with its stderr."""
    proc = subprocess.run([sys.executable, "-m", "bootseer", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"bootseer {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc
