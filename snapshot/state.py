"""bootseer's own state inside a tree of content: ``<root>/.bootseer`` (marker, verification TOC).

The tree around the state is content: a snapshot's members, or whatever an install command
made, and content may hold links. So state is written only through descriptors: the root is
opened with ``O_NOFOLLOW``, the state directory is created (``mkdirat``) or, when a real
directory is already there (the state of an earlier run: an installed prefix published later),
reused, and opened with ``O_NOFOLLOW``: a link there is refused. Each file is created under a
temporary name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and renamed over its final name within
that descriptor, so a link planted at the final name is replaced, never written through. Reads
take the same way, so a marker reached through a link is no marker.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Mapping

from .errors import SnapshotError, UnsafeMemberError
from .safety import STATE_DIR

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
PLANTED_RULE = (
    f"reserved: {STATE_DIR!r} holds bootseer's own state; a symlink or a "
    f"non-directory is there (a snapshot member, or made by the install), and state "
    f"is never written through it"
)


def open_in(
    stack: contextlib.ExitStack,
    path: str | os.PathLike,
    flags: int,
    dir_fd: int | None = None,
    mode: int = 0o777,
) -> int:
    """``os.open``, closed when ``stack`` closes."""
    fd = os.open(path, flags, mode, dir_fd=dir_fd)
    stack.callback(os.close, fd)
    return fd


def write_new(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Create the file ``name`` in ``dir_fd`` (``O_EXCL | O_NOFOLLOW``: never an existing
    file, never through a link) holding ``data``."""
    fd = os.open(name, NEW_FILE, mode, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def replace_file(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """``name`` in ``dir_fd`` now holds ``data``, atomically: written under a new temporary
    name (:func:`write_new`) and renamed over ``name``, which replaces a link there instead of
    following it. A directory at ``name`` is an error (``IsADirectoryError``)."""
    tmp = f".{name}.{os.getpid()}-{os.urandom(4).hex()}.tmp"
    write_new(dir_fd, tmp, data, mode)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _open_root(stack: contextlib.ExitStack, root: str | os.PathLike) -> int:
    try:
        return open_in(stack, root, DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SnapshotError(
                f"{root} is a symlink or not a directory; bootseer's state is "
                f"never written through one"
            ) from None
        raise


def write_state(root: str | os.PathLike, files: Mapping[str, bytes]) -> None:
    """``root/.bootseer`` holds ``files`` (name: content); see the module docstring. A failure
    removes what this call wrote (and the directory, when this call created it)."""
    with contextlib.ExitStack() as stack:
        root_fd = _open_root(stack, root)
        created = True
        written: list[str] = []
        try:
            os.mkdir(STATE_DIR, 0o755, dir_fd=root_fd)
        except FileExistsError:
            created = False
        try:
            try:
                state_fd = open_in(stack, STATE_DIR, DIR_FLAGS, root_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeMemberError(STATE_DIR, PLANTED_RULE) from None
                raise
            for name, data in files.items():
                try:
                    replace_file(state_fd, name, data)
                except IsADirectoryError:
                    raise UnsafeMemberError(f"{STATE_DIR}/{name}", PLANTED_RULE) from None
                written.append(name)
        except BaseException:
            _remove_state(root_fd, written, remove_dir=created)
            raise


def _remove_state(root_fd: int, names: list[str], *, remove_dir: bool) -> None:
    """Undo a failed :func:`write_state`: the files it wrote, and the directory if it made
    it; nothing else."""
    with contextlib.suppress(OSError), contextlib.ExitStack() as stack:
        state_fd = open_in(stack, STATE_DIR, DIR_FLAGS, root_fd)
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=state_fd)
        if remove_dir:
            os.rmdir(STATE_DIR, dir_fd=root_fd)


def read_state(root: str | os.PathLike, name: str, limit: int) -> bytes | None:
    """The state file ``name`` of ``root``; None when it is absent, reached through a link,
    not a regular file, or larger than ``limit`` bytes."""
    try:
        with contextlib.ExitStack() as stack:
            state_fd = open_in(stack, STATE_DIR, DIR_FLAGS, open_in(stack, root, DIR_FLAGS))
            fd = open_in(stack, name, _READ_FILE, state_fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                return None
            return _read_at_most(fd, st.st_size, limit)
    except OSError:
        return None


def has_state(root: str | os.PathLike, name: str) -> bool:
    """Whether ``root``'s state file ``name`` is there, a regular file reached through no
    link (one ``fstat``: the O(1) part of a start's check)."""
    try:
        with contextlib.ExitStack() as stack:
            state_fd = open_in(stack, STATE_DIR, DIR_FLAGS, open_in(stack, root, DIR_FLAGS))
            return stat.S_ISREG(os.fstat(open_in(stack, name, _READ_FILE, state_fd)).st_mode)
    except OSError:
        return False


def state_not_private(root: str | os.PathLike, names: tuple[str, ...]) -> str | None:
    """Why ``root``'s state directory or its files ``names`` could have been written by
    someone else (an owner other than this user or root, write permission for group or
    others), or None when they are private. bootseer makes them 0755/0644 under any umask;
    a start trusts the marker without checking the files only when this is None."""
    allowed = {os.geteuid(), 0}
    try:
        with contextlib.ExitStack() as stack:
            state_fd = open_in(stack, STATE_DIR, DIR_FLAGS, open_in(stack, root, DIR_FLAGS))
            fds = [(STATE_DIR, state_fd)]
            fds += [(f"{STATE_DIR}/{n}", open_in(stack, n, _READ_FILE, state_fd)) for n in names]
            for what, fd in fds:
                st = os.fstat(fd)
                if st.st_uid not in allowed:
                    return f"{what} is owned by uid {st.st_uid}"
                if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    return f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    except OSError as exc:
        return f"{STATE_DIR} cannot be opened ({exc.strerror})"
    return None


def _read_at_most(fd: int, expected: int, limit: int) -> bytes | None:
    """The file's bytes (``expected`` of them, as fstat said), None past ``limit``."""
    pieces = []
    total = 0
    while piece := os.read(fd, min(max(expected - total, 0), 1 << 30) + 1):
        pieces.append(piece)
        total += len(piece)
        if total > limit:
            return None
    return b"".join(pieces)
