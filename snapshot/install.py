"""Run the install (or setup) command of a missing environment, keeping the tail of its output.

The default install makes a venv at the prefix and installs the spec files into it with uv
when uv is available (much faster, and ``--compile-bytecode`` so the snapshot carries the
``.pyc`` files a first import would otherwise write), else with pip. Index options belong in
the requirements file (``--index-url`` lines), where they are part of the key.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import InstallError, SnapshotError

log = logging.getLogger(__name__)

TAIL_LINES = 40
INSTALLERS = ("auto", "uv", "pip")


@dataclass(frozen=True)
class InstallResult:
    installer: str  # "uv 0.13.8", "pip", or "custom"
    command: list[str]
    seconds: float


def find_uv(explicit: str | os.PathLike | None = None) -> str | None:
    """The uv binary: ``explicit`` (key env.uv), the ``uv`` package's binary, or ``uv`` on
    PATH."""
    if explicit:
        return os.fspath(explicit)
    try:
        import uv  # type: ignore[import-not-found]

        path = uv.find_uv_bin()
        if path and os.access(path, os.X_OK):
            return path
    except (ImportError, FileNotFoundError):
        pass
    return shutil.which("uv")


def default_commands(
    spec_files: Sequence[str | os.PathLike],
    prefix: Path,
    *,
    python: str | None = None,
    installer: str = "auto",
    uv: str | os.PathLike | None = None,
) -> tuple[str, list[list[str]]]:
    """(installer name, commands) that create a venv at ``prefix`` and install the specs."""
    if installer not in INSTALLERS:
        raise SnapshotError(f"unknown installer {installer!r}; use one of {', '.join(INSTALLERS)}")
    python = python or sys.executable
    uv = find_uv(uv) if installer in ("auto", "uv") else None
    if installer == "uv" and uv is None:
        raise SnapshotError(
            "installer uv requested but not found: `pip install uv`, or give "
            "its path (env.uv, BOOTSEER_ENV_UV, --env-uv)"
        )
    requirements: list[str] = []
    for spec in spec_files:
        path = Path(spec)
        if path.name == "uv.lock":
            raise SnapshotError(
                f"{spec}: the default install cannot install a uv.lock; pass the command, e.g. "
                f"`-- uv sync --frozen --project DIR` with UV_PROJECT_ENVIRONMENT={{prefix}}"
            )
        requirements += ["-r", str(path.resolve())]
    venv_python = str(prefix / "bin" / "python")
    if uv is not None:
        return "uv", [
            [uv, "venv", "--quiet", "--python", python, str(prefix)],
            *(
                [
                    [
                        uv,
                        "pip",
                        "install",
                        "--python",
                        venv_python,
                        "--compile-bytecode",
                        *requirements,
                    ]
                ]
                if requirements
                else []
            ),
        ]
    return "pip", [
        [python, "-m", "venv", str(prefix)],
        *(
            [
                [
                    venv_python,
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    "--no-input",
                    *requirements,
                ]
            ]
            if requirements
            else []
        ),
    ]


def run_command(
    command: Sequence[str],
    *,
    prefix: Path,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> None:
    """Run one install step; stream its output to the log; InstallError with the tail."""
    argv = [arg.replace("{prefix}", str(prefix)) for arg in command]
    run_env = dict(os.environ if env is None else env)
    run_env["BOOTSEER_PREFIX"] = str(prefix)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    log.info("running: %s", " ".join(argv))
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=run_env,
            cwd=cwd,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise InstallError(argv, 127, f"cannot start {argv[0]}: {exc.strerror}") from exc
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        log.debug("| %s", line.rstrip())
    code = proc.wait()
    if code != 0:
        raise InstallError(argv, code, "".join(tail))


def installer_version(name: str, commands: list[list[str]]) -> str:
    if name != "uv":
        return name
    try:
        out = subprocess.run(
            [commands[0][0], "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return out.split(" (")[0] or name  # "uv 0.13.8 (x86_64-...)" -> "uv 0.13.8"
    except (OSError, subprocess.SubprocessError):
        return name
