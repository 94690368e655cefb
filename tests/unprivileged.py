"""Probing the node as a user who is not root: ``nobody`` (via ``setpriv``) tries to stat,
list, open, connect to and execute paths, and says what worked.

    found = probe([root, *tree(root)])       # {path: {"lstat": "EACCES"}, ...}
    assert not reached(found)                # nothing worked

A test that says "no user of the node reaches X" must show the paths exist (they are listed
as root first) and that each failed for want of permission (EACCES), not for a typo.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from conftest import need

NOBODY = ("--reuid=nobody", "--regid=nogroup", "--clear-groups")

# Run by nobody, with no import of the project: every operation a user could try on each path
# (read from stdin as JSON), each answered "ok", "ran: <stdout>" or the errno's name.
_PROBE = r"""
import errno, json, os, socket, stat, subprocess, sys

def attempt(fn):
    try:
        result = fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return result if isinstance(result, str) else "ok"

def opened(path):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.read(fd, 1)
    finally:
        os.close(fd)

def connect(path):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)

def execute(path):
    r = subprocess.run([path, "-u"], capture_output=True, text=True, timeout=10)
    return "ran: " + r.stdout.strip()

out = {}
for path in json.load(sys.stdin):
    tried = out[path] = {}
    try:
        st = os.lstat(path)
    except OSError as exc:
        tried["lstat"] = errno.errorcode.get(exc.errno, str(exc.errno))
        continue
    tried["lstat"] = "ok"
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        tried["list"] = attempt(lambda: os.listdir(path))
    elif stat.S_ISSOCK(mode):
        tried["connect"] = attempt(lambda: connect(path))
    elif not stat.S_ISLNK(mode):
        tried["open"] = attempt(lambda: opened(path))
    if stat.S_ISREG(mode) and mode & 0o111:
        tried["exec"] = attempt(lambda: execute(path))
json.dump(out, sys.stdout)
"""


def need_setpriv() -> None:
    """Skip (fail under BOOTSEER_REQUIRE_SYSTEM=1) without root and setpriv."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        need("needs root and setpriv (util-linux) to act as nobody")


def as_nobody(*argv: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """``argv`` run as nobody:nogroup without supplementary groups."""
    return subprocess.run(
        ["setpriv", *NOBODY, *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd="/",
    )


def probe(paths: Iterable[str | os.PathLike]) -> dict[str, dict[str, str]]:
    """What nobody could do with each path: ``{path: {operation: outcome}}``."""
    listed = [os.fspath(p) for p in paths]
    proc = as_nobody(sys.executable, "-I", "-c", _PROBE, stdin=json.dumps(listed))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def reached(
    found: dict[str, dict[str, str]], *, allowed: Iterable[tuple[str, str]] = ()
) -> list[str]:
    """Each (path, operation) that worked, but those ``allowed``."""
    allow = {(os.fspath(p), op) for p, op in allowed}
    return [
        f"{path}: {op} -> {outcome}"
        for path, ops in found.items()
        for op, outcome in ops.items()
        if not _refused(outcome) and (path, op) not in allow
    ]


def _refused(outcome: str) -> bool:
    return outcome != "ok" and not outcome.startswith("ran:")


def tree(root: str | os.PathLike) -> list[Path]:
    """Every path under ``root`` (not ``root`` itself), as root sees them; links not followed,
    mounts inside included."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        found += [Path(dirpath, name) for name in dirnames + filenames]
    return found


def mode(path: str | os.PathLike) -> int:
    """The permission bits of ``path`` itself (not followed)."""
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    """This process's umask set to ``value`` for the block."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)
