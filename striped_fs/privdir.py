"""Directories the tool owns under shared paths (DESIGN.md, "The job's own channels are
untrusted input too"): ``/dev/shm``, ``/tmp``, a directory the user names.

    d = PrivateDir.open("/dev/shm/job")       # made 0700, or checked: ours, <= 0700, no link
    fd = d.create("rank0.ring", os.O_RDWR)    # O_EXCL | O_NOFOLLOW, relative to d's descriptor
    fd = d.open_owned("rank0.ring")           # a reader: a regular file of this user, or refused
    job = PrivateDir.new("/dev/shm", "bootseer-colltrace-")   # a name nobody can guess

Why descriptors: a check by path (``stat``, then ``open``) leaves a window in which a user
who can write the parent swaps the directory for a link. Here each component of the path is
opened in turn from ``/`` without following links (a link is followed only when it belongs to
root or to this user, in a directory that passed the check below), every check is an
``fstat`` of the descriptor that is then used, and every file is opened relative to the
directory's descriptor with ``O_NOFOLLOW``.

The rules: an existing ancestor belongs to root or to this user and is writable by nobody
else unless sticky (``/tmp``, ``/dev/shm``: there others cannot rename what is ours); the
directory itself, and every directory this module creates, belongs to this user with mode
0700 or less and is not a link (:func:`PrivateDir.open` with ``readable=True`` allows group
and other read and search, for a trace that others read, never write). A refusal is an
:class:`UnsafePath` (a ``PermissionError``) naming the path, the owner and mode found, and
what to do.

It lives in striped_fs, the lowest package that ckpt and bootseer both import.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from typing import IO

from .errors import UnsafePath

__all__ = ["TRACE_WHAT", "PrivateDir", "UnsafePath", "open_append", "open_owned", "owned_file"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40
TRACE_WHAT = "the trace directory (run.trace_dir, BOOTSEER_TRACE_DIR)"
_WHAT_TO_DO = (
    "another user may have made it to plant links or forged files there: remove "
    "it (or, if it is yours and meant to be, chmod 700 it), or name another "
    "directory"
)


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _found(st: os.stat_result) -> str:
    return f"owned by {_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def _label(what: str) -> str:
    return f"{what}: " if what else ""


def _check_ancestor(st: os.stat_result, path: str, what: str) -> None:
    """A directory above ours: root's or ours, and nobody else may rename in it (or sticky)."""
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{_label(what)}not a directory", path)
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePath(
            f"{_label(what)}{path} is {_found(st)}: a directory on the way to "
            f"bootseer's own must belong to root or to {_owner(os.geteuid())}; " + _WHAT_TO_DO
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            f"{_label(what)}{path} is {_found(st)}: writable by other users "
            "without the sticky bit, so they could swap what is in it; " + _WHAT_TO_DO
        )


def _check_own(st: os.stat_result, path: str, what: str, readable: bool) -> None:
    """The directory itself: this user's, no wider than 0700 (0755 when ``readable``)."""
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{_label(what)}not a directory", path)
    wider = st.st_mode & (0o022 if readable else 0o077)
    if st.st_uid != os.geteuid() or wider:
        limit = "0755" if readable else "0700"
        raise UnsafePath(
            f"{_label(what)}{path} is {_found(st)}: bootseer writes only into "
            f"a directory of its own (owner {_owner(os.geteuid())}, mode "
            f"{limit} or less, not a link); " + _WHAT_TO_DO
        )


def _made(name: str, parent_fd: int) -> None:
    """``name`` just made by us in ``parent_fd``: exactly 0700 whatever the umask (nobody else
    can swap it: the parent passed the ancestor check)."""
    os.chmod(name, 0o700, dir_fd=parent_fd)


def _walk(path: str | os.PathLike[str], *, create: bool, what: str) -> tuple[int, str, bool]:
    """``(descriptor, real path, made)`` of the directory ``path`` (``O_PATH``), every
    existing component checked as an ancestor, each missing one made 0700 when ``create``."""
    pending = [p for p in os.path.abspath(os.fspath(path)).split("/") if p]
    fd = os.open("/", _PATH_FLAGS | os.O_DIRECTORY)
    real, made, links = "/", False, 0
    try:
        _check_ancestor(os.fstat(fd), "/", what)
        while pending:
            name = pending.pop(0)
            here = os.path.join(real, name)
            try:
                nfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(
                        errno.ENOENT, f"{_label(what)}no such directory", here
                    ) from None
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    _made(name, fd)
                    made = True
                except FileExistsError:
                    made = False
                nfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            else:
                made = False
            st = os.fstat(nfd)
            if stat.S_ISLNK(st.st_mode):
                os.close(nfd)
                if st.st_uid not in (0, os.geteuid()):
                    raise UnsafePath(
                        f"{_label(what)}{here} is a link {_found(st)}: only a "
                        f"link of root or {_owner(os.geteuid())} is followed; " + _WHAT_TO_DO
                    )
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, f"{_label(what)}too many links", os.fspath(path))
                target = os.readlink(name, dir_fd=fd)
                restart = os.path.normpath(os.path.join(real, target))
                pending = [p for p in restart.split("/") if p] + pending
                os.close(fd)
                fd = os.open("/", _PATH_FLAGS | os.O_DIRECTORY)
                real = "/"
                continue
            if made:
                _check_own(st, here, what, readable=False)
            else:
                _check_ancestor(st, here, what)
            os.close(fd)
            fd, real = nfd, here
        return fd, real, made
    except BaseException:
        os.close(fd)
        raise


def _name(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a file name (one component, no '/')")
    return name


def owned_file(fd: int, where: str, *, uid: int | None = None) -> int:
    """``fd`` when it is a regular file of ``uid`` (default: this process's user) with one
    link; else it is closed and :class:`UnsafePath` raised naming ``where``."""
    st = os.fstat(fd)
    want = os.geteuid() if uid is None else uid
    if stat.S_ISREG(st.st_mode) and st.st_uid == want and st.st_nlink == 1:
        return fd
    os.close(fd)
    kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
    raise UnsafePath(
        f"{where} is {kind} {_found(st)} with {st.st_nlink} link(s): bootseer "
        f"reads and writes only regular files of {_owner(want)} with one link "
        "here; another user may have planted it: remove it"
    )


def open_owned(
    name: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    *,
    dir_fd: int | None = None,
    uid: int | None = None,
    where: str = "",
) -> int:
    """Open an existing file without following a link (relative to ``dir_fd`` when given)
    and return its descriptor only when :func:`owned_file` holds. ``O_TRUNC`` is applied
    after the check, never to someone else's file."""
    trunc = flags & os.O_TRUNC
    flags = (flags & ~os.O_TRUNC & ~os.O_CREAT) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(
                f"{where or os.fspath(name)} is a link: bootseer never follows "
                "one here; another user may have planted it: remove it"
            ) from None
        raise
    fd = owned_file(fd, where or os.fspath(name), uid=uid)
    os.set_blocking(fd, True)
    if trunc:
        os.ftruncate(fd, 0)
    return fd


class PrivateDir:
    """An open directory of this process's user (see the module doc); files in it are opened
    through its descriptor, never by a path that could be swapped."""

    def __init__(self, path: str, fd: int, *, made: bool = False) -> None:
        self.path, self.fd, self.made = path, fd, made

    # -- getting one -------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        what: str = "",
        readable: bool = False,
    ) -> PrivateDir:
        """``path``, made 0700 (with any missing parent) when absent and ``create``, else
        checked: this user's, no wider than 0700 (0755 with ``readable``), not a link."""
        path = os.path.abspath(os.fspath(path))
        parent, name = os.path.split(path)
        if not name:
            raise UnsafePath(f"{_label(what)}{path}: the root directory is not bootseer's own")
        pfd, real, _ = _walk(parent, create=create, what=what)
        try:
            return cls._child(
                pfd,
                os.path.join(real, name),
                name,
                create=create,
                what=what,
                readable=readable,
                shown=path,
            )
        finally:
            os.close(pfd)

    @classmethod
    def new(cls, parent: str | os.PathLike[str], prefix: str, *, what: str = "") -> PrivateDir:
        """A fresh directory with an unguessable name (``prefix`` + 16 hex digits) in
        ``parent`` (made 0700 when missing; an existing one may be shared and sticky, as
        ``/dev/shm``), created exclusively, mode 0700."""
        pfd, real, _ = _walk(parent, create=True, what=what)
        try:
            while True:
                name = prefix + secrets.token_hex(8)
                try:
                    os.mkdir(name, 0o700, dir_fd=pfd)
                except FileExistsError:
                    continue
                _made(name, pfd)
                fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
                d = cls(os.path.join(real, name), fd, made=True)
                _check_own(os.fstat(fd), d.path, what, readable=False)
                return d
        finally:
            os.close(pfd)

    @classmethod
    def _child(
        cls, pfd: int, path: str, name: str, *, create: bool, what: str, readable: bool, shown: str
    ) -> PrivateDir:
        made = False
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
                _made(name, pfd)
                made = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"{_label(what)}no such directory", shown
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise UnsafePath(
                f"{_label(what)}{shown} is {kind} ({_found(st)}): bootseer "
                "writes only into a directory of its own, never through a "
                "link; " + _WHAT_TO_DO
            ) from None
        try:
            _check_own(os.fstat(fd), shown, what, readable)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, made=made)

    def subdir(self, name: str, *, create: bool = True, what: str = "") -> PrivateDir:
        """A directory in this one, made 0700 or checked as :meth:`open` does."""
        return self._child(
            self.fd,
            os.path.join(self.path, _name(name)),
            name,
            create=create,
            what=what,
            readable=False,
            shown=os.path.join(self.path, name),
        )

    # -- files in it -------------------------------------------------------------------------
    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def create(self, name: str, flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
        """A new file, exclusively (an existing name, a planted link: an error), 0600."""
        return os.open(
            _name(name),
            flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            mode,
            dir_fd=self.fd,
        )

    def open_owned(self, name: str, flags: int = os.O_RDONLY, *, uid: int | None = None) -> int:
        """An existing regular file of ``uid`` (default: this user) in this directory."""
        return open_owned(_name(name), flags, dir_fd=self.fd, uid=uid, where=self.where(name))

    def open_or_create(self, name: str, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
        """An existing file of this user (checked), else a new one (``O_EXCL``)."""
        while True:
            try:
                return self.create(name, flags & ~os.O_TRUNC, mode)
            except FileExistsError:
                pass
            try:
                return self.open_owned(name, flags)
            except FileNotFoundError:
                continue  # removed in between: create it

    def write_atomic(self, name: str, data: bytes) -> None:
        """``name`` replaced whole by ``data`` (a new temporary file, then a rename within
        this directory): a reader sees the old bytes or the new, nothing through a link."""
        tmp = f".{_name(name)}.{secrets.token_hex(4)}.tmp"
        fd = self.create(tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.unlink(tmp)
            raise

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def unlink(self, name: str) -> None:
        try:
            os.unlink(_name(name), dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def remove_tree(self, name: str) -> None:
        """A directory in this one, with everything in it (links removed, never followed)."""
        try:
            shutil.rmtree(_name(name), dir_fd=self.fd)
        except FileNotFoundError:
            pass

    # -- lifetime ----------------------------------------------------------------------------
    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PrivateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PrivateDir({self.path!r})"


def open_append(directory: str | os.PathLike[str], name: str, *, what: str = TRACE_WHAT) -> IO[str]:
    """``name`` in ``directory`` opened for appending text: the directory made 0700 or
    checked as a readable one (this user's, written by nobody else: a trace others may read),
    the file this user's regular file or a new one, never through a link."""
    with PrivateDir.open(directory, what=what, readable=True) as d:
        fd = d.open_or_create(name, os.O_WRONLY | os.O_APPEND)
    return os.fdopen(fd, "a", encoding="utf-8")
