"""Node-local state that belongs to its owner alone, whatever the caller's umask (DESIGN.md,
"The node itself"): the directories of the node's caches and of the snapshotter, and the
files written into them.

* :func:`make_dir` creates a directory with an explicit mode (0700 unless told otherwise),
  and any missing parent 0700: ``mkdir`` then ``chmod``, so a umask of 000 gives no more than
  the mode and a umask of 077 no less. A directory that exists keeps its mode unless
  ``tighten`` says the directory is the caller's own by name (a cache's ``frames/``, the
  snapshotter's root): then its mode is set, which also fixes nodes set up by older versions.
* :func:`create_private` creates a file 0600, exclusively, never through a symlink.

It lives in striped_fs, the package that prefetch, ckpt and snapshot already import (a
downward arrow, not a sixth package).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def make_dir(
    path: str | os.PathLike[str], mode: int = PRIVATE_DIR, *, tighten: bool = False
) -> Path:
    """``path`` as a directory with ``mode`` when this call creates it (missing parents:
    0700), whatever the umask; an existing one is left as it is unless ``tighten``."""
    path = Path(path)
    try:
        os.mkdir(path, mode)
    except FileNotFoundError:
        if path.parent == path:
            raise
        make_dir(path.parent)
        return make_dir(path, mode, tighten=tighten)
    except FileExistsError:
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path)) from None
        if tighten and stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
        return path
    os.chmod(path, mode)  # the umask took bits away, or the mode asks for more than it left
    return path


def create_private(path: str | os.PathLike[str], flags: int = os.O_WRONLY) -> int:
    """A new file at ``path``, mode 0600 (less if the umask says so, never more), created
    exclusively: an existing file or a symlink planted there is an error, never followed.
    Returns its descriptor."""
    return os.open(
        path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE
    )


def write_private(path: str | os.PathLike[str], data: bytes | memoryview) -> None:
    """``data`` at ``path``, whole or not at all: written to a private temporary file beside
    it (:func:`create_private`, a unique name), then renamed over it; the temporary file goes
    on any failure. For caches whose readers must never see a partial file."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with os.fdopen(create_private(tmp), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pid_exists(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``), for the owner named in a private
    temporary file or lock: a zombie not yet reaped still does, and so does another user's
    process; 0 and negative numbers (process groups to ``kill``) never name an owner."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
