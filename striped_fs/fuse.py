"""A FUSE view (fusepy over libfuse2) of any fsspec filesystem.

Programs that only know paths (``cp``, ``dd``, a loader that insists on ``open()``) get the
same bytes the fsspec filesystem serves, including ``striped::`` readahead, without learning
fsspec. The mapping is deliberately narrow, because object stores and the striped format
cannot do more without lying:

* reads: one fsspec file object per open handle, kept open for the handle's lifetime so the
  filesystem's readahead sees a sequential stream; a read is ``seek`` (only when the offset
  moved) + ``read``, under a per-handle lock because FUSE calls in from several threads;
* writes: a new file (create, or open with ``O_TRUNC``) is one sequential ``fs.open(path,
  "wb")`` stream; a write at the current end is appended, a write past the end is preceded by
  zeros (what a sparse source reads as), anything that would rewrite bytes already written is
  refused with ``EOPNOTSUPP`` and poisons the handle;
* commit happens when the writer calls ``close()``: the kernel sends FLUSH synchronously from
  ``close(2)``, so the file is in the store when ``close`` returns, and a failed commit reaches
  ``cp`` as ``EIO`` from ``close`` (RELEASE comes later and its status is discarded by the
  kernel). A new or empty file is committed empty at its first FLUSH (``touch``); FLUSH comes
  with the close of *any* descriptor sharing the open file (``dd`` dups, then closes the
  original), so a first write after such an empty commit starts the file again, committed at
  the next FLUSH. A flush before the first byte of a write that replaces a non-empty file is
  not final: the old bytes stay until data comes (or RELEASE). Any other write after the
  commit fails with ``EIO`` (loud, never silent). A poisoned handle is discarded, never
  committed. Until its commit has landed, a file being written is answered from the handle
  (getattr, readdir), so it never looks missing in between;
* times: ``utimens`` sets the mtime (``touch -d``, ``cp -p``, ``rsync -a``) through the
  filesystem's ``set_mtime`` (striped: in the manifest) or ``os.utime`` on a local backing; on
  a file being written it is recorded with the commit. Directories without settable times
  (object-store prefixes) accept it and ignore it. Modes and owners are not stored: ``chmod``
  and ``chown`` are accepted and ignored (files show 0644, directories 0755).

Exceptions become errnos (``FileNotFoundError`` -> ``ENOENT`` ... anything unexpected -> ``EIO``
with a log line on ``striped_fs.fuse``). ``read_only=True`` turns every mutation into ``EROFS``.

:func:`mount` runs the FUSE loop (foreground by default; SIGINT/SIGTERM/SIGHUP unmount and return
cleanly). :func:`is_mounted`, :func:`wait_mounted` and :func:`unmount` help a parent process that
runs the mount as a child (``python -m striped_fs.fuse URL MOUNTPOINT``).
"""

from __future__ import annotations

import argparse
import errno
import itertools
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from fsspec.spec import AbstractBufferedFile

from .errors import MountError, MountTimeout
from .mount import (  # noqa: F401 (the mount plumbing's old home: importable from here)
    canonical_path,
    is_mounted,
    load_fusepy,
    restore_sigpipe,
    run_fuse,
    unescape_mountinfo,
    unmount,
    wait_mounted,
)
from .mtime import mtime_ns_of
from .redact import install_log_redaction

# fusepy, or the stand-in shared with prefetch.lazyfs when libfuse is missing (the operations
# stay testable); the mount table helpers (is_mounted, unmount...) never need it
_FUSE = load_fusepy()
_Operations: type = _FUSE.Operations
FuseOSError: type[OSError] = _FUSE.FuseOSError
# their names before they moved to striped_fs.mount
_canonical = canonical_path
_unescape_mountinfo = unescape_mountinfo


__all__ = [
    "FsspecOperations",
    "FuseOSError",
    "MountError",
    "MountTimeout",
    "is_mounted",
    "main",
    "mount",
    "serve",
    "unmount",
    "wait_mounted",
]

log = logging.getLogger("striped_fs.fuse")

#: Largest request libfuse2 negotiates (the kernel's 32-page default; libfuse2 cannot ask for
#: more pages), used for max_read/max_write and as st_blksize so cp/dd pick 128 KiB buffers.
IO_SIZE = 131072
#: How long an ``fs.info`` result (or a "does not exist") is reused by getattr.
INFO_TTL = 1.0
_INFO_CACHE_MAX = 65536
_ZERO_CHUNK = bytes(1 << 20)
# utimensat's special nanosecond values; libfuse2 passes them with tv_sec 0, fusepy as ns.
_UTIME_NOW = (1 << 30) - 1
_UTIME_OMIT = (1 << 30) - 2

_MUTATING = frozenset(
    {
        "chmod",
        "chown",
        "create",
        "link",
        "mkdir",
        "mknod",
        "removexattr",
        "rename",
        "rmdir",
        "setxattr",
        "symlink",
        "truncate",
        "unlink",
        "utimens",
        "write",
    }
)


def _fuse_error(err: int) -> OSError:
    return FuseOSError(err)


def _requested_mtime(times: tuple[int, int] | None) -> int | None:
    """The mtime (ns) a utimens call asks for; None when it leaves the mtime alone."""
    if times is None:
        return time.time_ns()
    mtime = int(times[1])
    if mtime == _UTIME_OMIT:
        return None
    return time.time_ns() if mtime == _UTIME_NOW else mtime


def _abandon(f: Any, path: str) -> None:
    """Drop an unfinished write so that, where the backend allows it, nothing becomes visible.

    ``discard()`` where it exists and works; otherwise ``__exit__`` with an exception, the
    context-manager way of saying "this write failed".
    """
    discard = getattr(f, "discard", None)
    if callable(discard):
        try:
            discard()
            if isinstance(f, AbstractBufferedFile) and not f.closed:
                # Its __del__ would close(), i.e. upload what discard() just dropped.
                f.closed = True
            return
        except Exception:  # noqa: BLE001 - e.g. LocalFileOpener refuses discard under autocommit
            log.debug("discard() of %s failed, falling back to __exit__", path, exc_info=True)
    exc = OSError(errno.EIO, "write abandoned by the FUSE mount", path)
    try:
        f.__exit__(OSError, exc, None)
    except Exception:  # noqa: BLE001
        log.warning("abandoning the write of %s raised", path, exc_info=True)


class _ReadHandle:
    __slots__ = ("path", "f", "lock", "pos")

    def __init__(self, path: str, f: Any) -> None:
        self.path = path
        self.f = f
        self.lock = threading.Lock()
        self.pos = 0


class _WriteHandle:
    __slots__ = (
        "path",
        "full",
        "f",
        "lock",
        "pos",
        "failed",
        "done",
        "unlinked",
        "mtime_ns",
        "mtime_set",
        "empty_ok",
    )

    def __init__(self, path: str, full: str, f: Any, empty_ok: bool) -> None:
        self.path = path
        self.full = full
        self.f = f
        self.lock = threading.Lock()
        self.pos = 0
        self.failed: str | None = None  # why the handle can no longer commit
        self.done = False  # committed or abandoned
        self.unlinked = False
        self.mtime_ns = time.time_ns()  # what getattr shows until the commit
        self.mtime_set: int | None = None  # set by utimens: recorded with the commit
        # Committing it empty hides no bytes anyone could read: a new file, or an empty one.
        self.empty_ok = empty_ok


class FsspecOperations(_Operations):  # type: ignore[misc,valid-type]
    """fusepy operations mapping ``root`` of an fsspec filesystem onto the mount.

    Only the generic fsspec API is used (info, ls, open rb/wb, rm, mv, mkdir, rmdir), so any
    ``AbstractFileSystem`` works, the ``striped`` one included.
    """

    #: fusepy: times are integer nanoseconds.
    use_ns = True
    #: libfuse2: pass utimens calls that set only one of atime/mtime (``touch -m``, rsync),
    #: with UTIME_OMIT/UTIME_NOW, instead of dropping them while answering success.
    flag_utime_omit_ok = 1

    def __init__(
        self,
        fs: Any,
        root: str = "",
        *,
        read_only: bool = False,
        info_ttl: float = INFO_TTL,
    ) -> None:
        self.fs = fs
        self.root = fs._strip_protocol(root) if root else ""
        if root.startswith("/") and not self.root.startswith("/"):
            self.root = "/" + self.root.lstrip("/")  # e.g. memory:// strips "/" to ""
        self.read_only = read_only
        self.info_ttl = info_ttl
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.mounted_at_ns = time.time_ns()
        self._handles: dict[int, _ReadHandle | _WriteHandle] = {}
        self._next_fh = itertools.count(1)
        self._writing: dict[str, _WriteHandle] = {}  # fuse path -> handle of a pending write
        self._virtual_dirs: set[str] = set()  # mkdir'ed dirs a prefix-only store cannot hold
        self._cache: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._cache_gen = 0
        self._lock = threading.Lock()  # guards the dicts above (not held during I/O)
        self._settled = threading.Condition(self._lock)  # notified when a pending write ends
        protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        backend = getattr(fs, "backend", None)  # striped_fs: the target's, local or not
        self._local = (
            "file" in protocol or "local" in protocol or getattr(backend, "is_local", False) is True
        )

    # -- dispatch ---------------------------------------------------------------------------

    def __call__(self, op: str, path: str | None, *args: Any) -> Any:
        """fusepy entry point: refuse mutations on a read-only mount, turn exceptions into errnos."""
        if self.read_only and op in _MUTATING:
            raise _fuse_error(errno.EROFS)
        method: Callable[..., Any] | None = getattr(self, op, None)
        if method is None:
            raise _fuse_error(errno.ENOSYS)
        try:
            return method(path, *args)
        except FuseOSError:
            raise
        except FileNotFoundError:
            raise _fuse_error(errno.ENOENT) from None
        except PermissionError:
            log.info("%s %s: permission denied", op, path)
            raise _fuse_error(errno.EACCES) from None
        except IsADirectoryError:
            raise _fuse_error(errno.EISDIR) from None
        except FileExistsError:
            raise _fuse_error(errno.EEXIST) from None
        except NotADirectoryError:
            raise _fuse_error(errno.ENOTDIR) from None
        except OSError as e:
            if isinstance(e.errno, int) and e.errno > 0:
                log.info("%s %s: %s", op, path, e)
                raise _fuse_error(e.errno) from None
            log.error("%s %s failed: %r", op, path, e, exc_info=True)
            raise _fuse_error(errno.EIO) from None
        except Exception as e:
            log.error("%s %s failed: %r", op, path, e, exc_info=True)
            raise _fuse_error(errno.EIO) from None

    # -- paths, info cache ------------------------------------------------------------------

    def _full(self, path: str) -> str:
        """The backing path of a mount path ("/a/b" -> "<root>/a/b")."""
        rel = path.strip("/")
        if not rel:
            return self.root
        base = self.root.rstrip("/")
        if base:
            return f"{base}/{rel}"
        return f"/{rel}" if self.root.startswith("/") else rel

    def _invalidate(self) -> None:
        """Forget every cached info: called after anything this mount changes."""
        with self._lock:
            self._cache.clear()
            self._cache_gen += 1

    def _remember(self, full: str, info: dict[str, Any] | None, gen: int) -> None:
        with self._lock:
            if gen != self._cache_gen:
                return  # an invalidation raced with this lookup; its result may be stale
            if len(self._cache) >= _INFO_CACHE_MAX:
                self._cache.clear()
            self._cache[full] = (time.monotonic() + self.info_ttl, info)

    def _info(self, full: str) -> dict[str, Any]:
        """``fs.info`` with a short TTL cache (negative results too)."""
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(full)
            gen = self._cache_gen
        if hit is not None and hit[0] > now:
            if hit[1] is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", full)
            return hit[1]
        try:
            info = self.fs.info(full)
        except FileNotFoundError:
            self._remember(full, None, gen)
            raise
        self._remember(full, info, gen)
        return info

    def _stat(self, info: dict[str, Any]) -> dict[str, Any]:
        t = mtime_ns_of(info)
        if self._local and "mtime_ns" not in info and info.get("name"):
            try:  # LocalFileSystem gives float seconds: rsync compares nanoseconds
                t = os.stat(info["name"], follow_symlinks=False).st_mtime_ns
            except OSError:
                pass
        if t is None:
            t = self.mounted_at_ns
        common = {
            "st_uid": self.uid,
            "st_gid": self.gid,
            "st_atime": t,
            "st_mtime": t,
            "st_ctime": t,
            "st_blksize": IO_SIZE,
        }
        if info.get("type") == "directory":
            return {
                "st_mode": stat.S_IFDIR | (0o555 if self.read_only else 0o755),
                "st_nlink": 2,
                "st_size": 0,
                **common,
            }
        size = int(info.get("size") or 0)
        return {
            "st_mode": stat.S_IFREG | (0o444 if self.read_only else 0o644),
            "st_nlink": 1,
            "st_size": size,
            # cp's sparse-file heuristic compares st_blocks with st_size: report the file dense.
            "st_blocks": (size + 511) // 512,
            **common,
        }

    def _dir_stat(self) -> dict[str, Any]:
        return self._stat({"type": "directory"})

    # -- metadata ---------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        """stat: from the write in progress, else from the (cached) fsspec info."""
        with self._lock:
            pending = self._writing.get(path)
        if pending is not None:
            return self._stat({"type": "file", "size": pending.pos, "mtime_ns": pending.mtime_ns})
        full = self._full(path)
        try:
            info = self._info(full)
        except FileNotFoundError:
            if path.strip("/") == "" or path in self._virtual_dirs:
                return self._dir_stat()
            raise
        if path.strip("/") == "" and info.get("type") != "directory":
            return self._dir_stat()
        return self._stat(info)

    def readdir(self, path: str, fh: int) -> Iterable[Any]:
        """List a directory; each child's info lands in the cache for the getattr storm after."""
        full = self._full(path)
        with self._lock:
            gen = self._cache_gen
        try:
            entries = self.fs.ls(full, detail=True)
        except FileNotFoundError:
            if path not in self._virtual_dirs and path.strip("/"):
                raise
            entries = []
        own = self.fs._strip_protocol(full).rstrip("/")
        prefix = path.rstrip("/") + "/"
        out: list[Any] = [".", ".."]
        seen: set[str] = set()
        for entry in entries:
            name = str(entry.get("name", "")).rstrip("/")
            if not name or self.fs._strip_protocol(name).rstrip("/") == own:
                continue  # some stores list the directory itself
            base = name.rsplit("/", 1)[-1]
            if not base or base in seen:
                continue
            seen.add(base)
            self._remember(self._full(prefix + base), entry, gen)
            out.append((base, self._stat(entry), 0))
        with self._lock:
            extra = [
                p
                for p in (*self._writing, *self._virtual_dirs)
                if p.rsplit("/", 1)[0] + "/" == prefix
            ]
        for p in extra:
            base = p.rsplit("/", 1)[-1]
            if base not in seen:
                seen.add(base)
                out.append(base)
        return out

    def access(self, path: str, amode: int) -> int:
        """Existence check; write access on a read-only mount is EROFS."""
        self.getattr(path)
        if amode & os.W_OK and self.read_only:
            raise _fuse_error(errno.EROFS)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        """Real numbers for a local backing store, large synthetic ones for remote stores."""
        if self._local:
            try:
                st = os.statvfs(self.root or "/")
                return {
                    k: getattr(st, k)
                    for k in (
                        "f_bsize",
                        "f_frsize",
                        "f_blocks",
                        "f_bfree",
                        "f_bavail",
                        "f_files",
                        "f_ffree",
                        "f_favail",
                        "f_namemax",
                    )
                }
            except OSError:
                pass
        blocks = 1 << 33  # 1 PiB of 128 KiB blocks: remote stores have no meaningful limit
        return {
            "f_bsize": IO_SIZE,
            "f_frsize": IO_SIZE,
            "f_blocks": blocks,
            "f_bfree": blocks,
            "f_bavail": blocks,
            "f_files": 1 << 32,
            "f_ffree": 1 << 32,
            "f_favail": 1 << 32,
            "f_namemax": 255,
        }

    def chmod(self, path: str, mode: int) -> int:
        """Accepted and ignored: fsspec stores carry no permission bits."""
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        """Accepted and ignored (see chmod)."""
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        """Set the mtime (the atime is not kept: it shows as the mtime).

        A file being written records it for its commit (one manifest, ``cp -p``); a committed
        one gets it through :meth:`_set_mtime`. A directory whose store keeps no times (an
        object-store prefix) accepts it and ignores it, so ``rsync -a`` can finish."""
        mtime = _requested_mtime(times)
        if mtime is None:
            return 0
        with self._lock:
            pending = self._writing.get(path)
        if pending is not None:
            with pending.lock:
                if not pending.done:
                    if not self._can_set_mtime():
                        raise _fuse_error(errno.EOPNOTSUPP)
                    pending.mtime_set = pending.mtime_ns = mtime
                    return 0
        if stat.S_ISDIR(self.getattr(path)["st_mode"]) and not self._local:
            # A prefix has no time to set, and one rsync has just made is not even in the
            # store until a file lands in it: asking the store would fail rsync with ENOENT.
            log.debug("utimens %s: this store keeps no directory times; ignored", path)
            return 0
        try:
            self._set_mtime(self._full(path), mtime)
        finally:
            self._invalidate()
        return 0

    def _can_set_mtime(self) -> bool:
        return callable(getattr(self.fs, "set_mtime", None)) or self._local

    def _set_mtime(self, full: str, mtime_ns: int) -> None:
        """The filesystem's ``set_mtime`` (striped_fs), else ``os.utime`` on a local backing."""
        setter = getattr(self.fs, "set_mtime", None)
        if callable(setter):
            setter(full, mtime_ns)
        elif self._local:
            os.utime(full, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        else:
            raise OSError(errno.EOPNOTSUPP, "this filesystem keeps no settable mtimes", full)

    def readlink(self, path: str) -> str:
        raise _fuse_error(errno.EINVAL)

    def symlink(self, target: str, source: str) -> int:
        raise _fuse_error(errno.EOPNOTSUPP)

    def link(self, target: str, source: str) -> int:
        raise _fuse_error(errno.EOPNOTSUPP)

    def mknod(self, path: str, mode: int, dev: int) -> int:
        raise _fuse_error(errno.EOPNOTSUPP)

    # ENOSYS (not ENOTSUP) makes the kernel remember that xattrs are unsupported and stop asking
    # (it asks for security.capability on every write otherwise).
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        raise _fuse_error(errno.ENOSYS)

    def listxattr(self, path: str) -> list[str]:
        raise _fuse_error(errno.ENOSYS)

    def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> int:
        raise _fuse_error(errno.ENOSYS)

    def removexattr(self, path: str, name: str) -> int:
        raise _fuse_error(errno.ENOSYS)

    # -- namespace changes ------------------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        full = self._full(path)
        try:
            self.fs.mkdir(full, create_parents=False)
        finally:
            self._invalidate()
        try:
            exists = self.fs.isdir(full)
        except Exception:  # noqa: BLE001
            exists = False
        if not exists:  # prefix-only store (s3...): remember the empty dir for this mount
            with self._lock:
                self._virtual_dirs.add(path)
        return 0

    def rmdir(self, path: str) -> int:
        full = self._full(path)
        try:
            children = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            children = None
        with self._lock:
            virtual = path in self._virtual_dirs
            has_virtual_children = any(
                p.startswith(path.rstrip("/") + "/") for p in (*self._virtual_dirs, *self._writing)
            )
        own = self.fs._strip_protocol(full).rstrip("/")
        if children is not None:
            children = [c for c in children if self.fs._strip_protocol(c).rstrip("/") != own]
        if children or has_virtual_children:
            raise _fuse_error(errno.ENOTEMPTY)
        try:
            if children is None:
                if not virtual:
                    raise FileNotFoundError(errno.ENOENT, "No such directory", full)
            else:
                if self._info(full).get("type") != "directory":
                    raise _fuse_error(errno.ENOTDIR)
                self.fs.rmdir(full)
        finally:
            with self._lock:
                self._virtual_dirs.discard(path)
            self._invalidate()
        return 0

    def unlink(self, path: str) -> int:
        """Remove a file; a write in progress on it is discarded at close instead of committed."""
        with self._lock:
            pending = self._writing.pop(path, None)
            self._settled.notify_all()
        if pending is not None:
            pending.unlinked = True
        full = self._full(path)
        try:
            self.fs.rm(full)
        except FileNotFoundError:
            if pending is None:
                raise
        finally:
            self._invalidate()
        return 0

    def _await_settled(self, *paths: str, timeout: float = 2.0) -> bool:
        """Wait (bounded) until no write is pending on ``paths``.

        RELEASE reaches us after ``close()`` has returned, so ``touch a && mv a b`` can find
        the empty ``a`` not yet committed; give the release a moment instead of failing.
        """
        with self._settled:
            return self._settled.wait_for(
                lambda: not any(p in self._writing for p in paths), timeout=timeout
            )

    def rename(self, old: str, new: str) -> int:
        """POSIX rename on top of fs.mv: an existing empty target directory is replaced."""
        if not self._await_settled(old, new):
            log.warning("rename %s -> %s refused: a write to it is in progress", old, new)
            raise _fuse_error(errno.EBUSY)
        src, dst = self._full(old), self._full(new)
        try:
            src_dir = self.getattr(old)["st_mode"] & stat.S_IFDIR == stat.S_IFDIR
            try:
                dst_info = self.fs.info(dst)
            except FileNotFoundError:
                dst_info = None
            if dst_info is not None:
                if dst_info.get("type") == "directory":
                    if not src_dir:
                        raise _fuse_error(errno.EISDIR)
                    own = self.fs._strip_protocol(dst).rstrip("/")
                    if [
                        c
                        for c in self.fs.ls(dst, detail=False)
                        if self.fs._strip_protocol(c).rstrip("/") != own
                    ]:
                        raise _fuse_error(errno.ENOTEMPTY)
                    self.fs.rmdir(dst)
                elif src_dir:
                    raise _fuse_error(errno.ENOTDIR)
            with self._lock:
                moved_virtual = old in self._virtual_dirs
            if moved_virtual and not self.fs.exists(src):
                with self._lock:
                    self._virtual_dirs.discard(old)
                    self._virtual_dirs.add(new)
            else:
                self.fs.mv(src, dst, recursive=src_dir)
        finally:
            self._invalidate()
        return 0

    # -- file handles -----------------------------------------------------------------------

    def _new_handle(self, h: _ReadHandle | _WriteHandle) -> int:
        fh = next(self._next_fh)
        with self._lock:
            self._handles[fh] = h
            if isinstance(h, _WriteHandle):
                self._writing[h.path] = h
        return fh

    def _handle(self, fh: int) -> _ReadHandle | _WriteHandle:
        h = self._handles.get(fh)
        if h is None:
            raise _fuse_error(errno.EBADF)
        return h

    def _start_write(self, path: str, empty_ok: bool) -> int:
        full = self._full(path)
        f = self.fs.open(full, "wb")
        self._invalidate()
        return self._new_handle(_WriteHandle(path, full, f, empty_ok))

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        """New file: one sequential ``fs.open(path, "wb")`` stream, committed at close."""
        return self._start_write(path, empty_ok=True)

    def open(self, path: str, flags: int) -> int:
        """O_RDONLY: a read handle. Writing: only as a new stream (O_TRUNC, or an empty file)."""
        if flags & os.O_ACCMODE == os.O_RDONLY:
            self._await_settled(path)  # read what the last close() committed, not a half
            full = self._full(path)
            return self._new_handle(_ReadHandle(path, self.fs.open(full, "rb")))
        if self.read_only:
            raise _fuse_error(errno.EROFS)
        size = self.getattr(path).get("st_size", 0)
        if size and not flags & os.O_TRUNC:
            log.warning(
                "open %s for writing without O_TRUNC refused: files here are written once, "
                "sequentially (existing size %d)",
                path,
                size,
            )
            raise _fuse_error(errno.EOPNOTSUPP)
        return self._start_write(path, empty_ok=not size)

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        """``seek`` (only when the offset moved) + ``read`` on the handle's fsspec file."""
        h = self._handle(fh)
        if not isinstance(h, _ReadHandle):
            log.warning("read of %s refused: the handle was opened for writing", h.path)
            raise _fuse_error(errno.EOPNOTSUPP)
        with h.lock:
            try:
                if offset != h.pos:
                    h.f.seek(offset)
                data = h.f.read(size)
                if len(data) < size and data:
                    parts = [data]
                    got = len(data)
                    while got < size:  # FUSE takes a short read as end of file
                        more = h.f.read(size - got)
                        if not more:
                            break
                        parts.append(more)
                        got += len(more)
                    data = b"".join(parts)
                h.pos = offset + len(data)
            except BaseException:
                h.pos = -1  # position unknown: seek before the next read
                raise
        return data

    def _append(self, h: _WriteHandle, data: bytes | memoryview) -> None:
        try:
            h.f.write(data)
        except BaseException as e:
            h.failed = f"write failed: {e!r}"
            raise
        h.pos += len(data)

    def _zero_fill(self, h: _WriteHandle, upto: int) -> None:
        """Extend a sequential stream with zeros (a sparse source's holes, ftruncate upwards)."""
        while h.pos < upto:
            n = min(upto - h.pos, len(_ZERO_CHUNK))
            self._append(h, memoryview(_ZERO_CHUNK)[:n])

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        """Append at the current end; refuse (and poison the handle) anything non-sequential."""
        h = self._handle(fh)
        if not isinstance(h, _WriteHandle):
            raise _fuse_error(errno.EBADF)
        with h.lock:
            if h.done and not h.failed and h.pos == 0 and not h.unlinked:
                self._restart(h)  # dd: committed empty at the first close of a dup
            if h.done or h.failed:
                log.warning(
                    "write to %s refused: %s",
                    h.path,
                    f"an earlier error ({h.failed})"
                    if h.failed
                    else "the handle was already committed by close()",
                )
                raise _fuse_error(errno.EIO)
            if offset < h.pos:
                h.failed = f"non-sequential write at offset {offset} (written so far: {h.pos})"
                log.warning(
                    "write to %s refused: %s; files here are written once, "
                    "sequentially; the file will not be committed",
                    h.path,
                    h.failed,
                )
                raise _fuse_error(errno.EOPNOTSUPP)
            if offset > h.pos:
                self._zero_fill(h, offset)
            self._append(h, data)
            h.mtime_set = None  # a write after utimens: the file's mtime is the commit's
        return len(data)

    def _restart(self, h: _WriteHandle) -> None:
        """A handle committed empty gets data: start the file again (the empty version stays
        visible until this one commits)."""
        h.f = self.fs.open(h.full, "wb")
        h.done = False
        h.mtime_ns = time.time_ns()
        with self._lock:
            self._writing[h.path] = h

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        """Only what a sequential stream can honour: to the current end, upwards, or to 0."""
        h: _ReadHandle | _WriteHandle | None = None
        if fh is not None:
            h = self._handles.get(fh)
        if not isinstance(h, _WriteHandle):
            with self._lock:
                h = self._writing.get(path)
        if h is not None:
            with h.lock:
                if h.done or h.failed:
                    raise _fuse_error(errno.EIO)
                if length == h.pos:
                    return 0
                if length > h.pos:
                    self._zero_fill(h, length)
                    return 0
                if length == 0:  # start over: drop what was written so far
                    _abandon(h.f, h.full)
                    try:
                        h.f = self.fs.open(h.full, "wb")
                    except BaseException as e:
                        h.failed = f"reopen after truncate failed: {e!r}"
                        raise
                    h.pos = 0
                    return 0
                log.warning(
                    "truncate of %s to %d refused while writing it (%d written)",
                    path,
                    length,
                    h.pos,
                )
                raise _fuse_error(errno.EOPNOTSUPP)
        size = self.getattr(path).get("st_size", 0)
        if length == size:
            return 0
        if length == 0:
            full = self._full(path)
            with self.fs.open(full, "wb"):
                pass
            self._invalidate()
            return 0
        log.warning(
            "truncate of %s from %d to %d refused: files here are written once, sequentially",
            path,
            size,
            length,
        )
        raise _fuse_error(errno.EOPNOTSUPP)

    def _commit(self, h: _WriteHandle) -> None:
        """Close the fsspec file (= make the file visible), once; EIO if that is not possible.

        The handle answers getattr and readdir for the path until the commit has landed (or
        failed): forgetting it before would show the file as missing in between."""
        with h.lock:
            if h.done:
                if h.failed:
                    raise _fuse_error(errno.EIO)
                return
            h.done = True
            try:
                if h.unlinked:
                    _abandon(h.f, h.full)
                    return
                if h.failed:
                    log.error("%s not committed: %s", h.path, h.failed)
                    _abandon(h.f, h.full)
                    raise _fuse_error(errno.EIO)
                self._close(h)
                if h.unlinked:  # unlinked while its commit was landing: it stays unlinked
                    try:
                        self.fs.rm(h.full)
                    except FileNotFoundError:
                        pass
            finally:
                self._invalidate()
                with self._lock:
                    if self._writing.get(h.path) is h:
                        del self._writing[h.path]
                    self._settled.notify_all()

    def _close(self, h: _WriteHandle) -> None:
        """Commit: close the file object, with the mtime utimens recorded (in the manifest
        itself where the writer takes it, else set right after)."""
        later = h.mtime_set
        if later is not None and hasattr(h.f, "mtime_ns"):
            h.f.mtime_ns = later  # striped: the commit's manifest records it
            later = None
        try:
            h.f.close()
        except Exception as e:
            h.failed = f"commit failed: {e!r}"
            log.error("commit of %s (%d bytes) failed: %r", h.path, h.pos, e, exc_info=True)
            _abandon(h.f, h.full)
            raise _fuse_error(errno.EIO) from None
        if later is not None:
            try:
                self._set_mtime(h.full, later)
            except Exception as e:
                h.failed = f"committed, but its mtime could not be set: {e!r}"
                log.error("%s: %s", h.path, h.failed)
                raise _fuse_error(errno.EIO) from None

    def flush(self, path: str | None, fh: int) -> int:
        """close(2) of a written file: commit here, where the caller still sees the error, and
        before close() returns, so the next command finds the file.

        FLUSH comes with every close of a descriptor sharing the open file, so one that comes
        before any byte was written may not be the writer's final close (``dd`` dups its
        output and closes the original first). A new or empty file is committed empty anyway
        (``touch x && cat x``; a later write starts it again); one whose old bytes an empty
        commit would hide waits for data or for release."""
        h = self._handles.get(fh)
        if isinstance(h, _WriteHandle) and (h.pos > 0 or h.failed or h.done or h.empty_ok):
            self._commit(h)
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        """Push buffered bytes down where the file object can; durability comes with close()."""
        h = self._handles.get(fh)
        if isinstance(h, _WriteHandle):
            with h.lock:
                if h.failed:
                    raise _fuse_error(errno.EIO)
                if not h.done:
                    flush = getattr(h.f, "flush", None)
                    if callable(flush):
                        flush()
        return 0

    def release(self, path: str | None, fh: int) -> int:
        """Last close: commit a write that saw no flush, drop a read's file object."""
        with self._lock:
            h = self._handles.pop(fh, None)
        if h is None:
            return 0
        if isinstance(h, _WriteHandle):
            self._commit(h)
            return 0
        try:
            h.f.close()
        except Exception:  # noqa: BLE001 - nothing was written; a close error changes nothing
            log.debug("closing read handle of %s raised", h.path, exc_info=True)
        return 0

    def destroy(self, path: str) -> None:
        """Unmount: abandon writes that never reached close(), close read handles."""
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for h in handles:
            if isinstance(h, _WriteHandle):
                with h.lock:
                    if h.done:
                        continue
                    h.done = True
                log.warning("unmounting with %s still open for writing: not committed", h.path)
                _abandon(h.f, h.full)
            else:
                try:
                    h.f.close()
                except Exception:  # noqa: BLE001
                    pass


# -- mounting -----------------------------------------------------------------------------------


def _fsname(fs: Any, root: str) -> str:
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    raw = f"{protocol}:{root or '/'}"
    # A comma would split the -o option list; keep fsname to characters /proc/mounts shows as is.
    return "".join(c if c.isalnum() or c in "._:/@+-=" else "_" for c in raw)[:200]


def mount(
    fs: Any,
    root: str,
    mountpoint: str,
    *,
    foreground: bool = True,
    read_only: bool = False,
    allow_other: bool = False,
    debug: bool = False,
) -> None:
    """Mount ``root`` of ``fs`` at ``mountpoint`` and serve until unmounted.

    Returns after SIGINT, SIGTERM or SIGHUP (libfuse's handlers unmount and end the loop) or an
    external ``fusermount -u``. ``foreground=False`` is libfuse's daemon mode: it forks, and the
    *calling* process ``_exit(0)``s once the mount is up; a parent that wants the mount in the
    background should rather start a child process (``python -m striped_fs.fuse``) and use
    :func:`wait_mounted`.

    Only the mounting user reaches the mount unless ``allow_other``; then the kernel checks
    every access against the modes presented (``default_permissions``: files 0644, directories
    0755, the mounting user's), so other users read but never change the store.
    """
    _FUSE.require()
    if not os.path.isdir(mountpoint):
        raise MountError(f"mountpoint {mountpoint!r} is not a directory")
    ops = FsspecOperations(fs, root, read_only=read_only)
    options: dict[str, Any] = {
        "foreground": foreground,
        "debug": debug,
        "nothreads": False,  # reads on different handles run concurrently
        "fsname": _fsname(fs, root),
        "subtype": "striped_fs",
        "big_writes": True,
        "max_read": IO_SIZE,
        "max_write": IO_SIZE,
        "atomic_o_trunc": True,  # O_TRUNC arrives with open(), not as a separate truncate
        "nodev": True,
        "nosuid": True,
        "default_permissions": True,  # the kernel enforces the modes presented
    }
    if read_only:
        options["ro"] = True
    if allow_other:
        options["allow_other"] = True
    log.info("mounting %s at %s (read_only=%s)", options["fsname"], mountpoint, read_only)
    run_fuse(ops, mountpoint, options)
    log.info("unmounted %s", mountpoint)


def serve(fs: Any, root: str, mountpoint: str, **kw: Any) -> int:
    """Entry point for a child process: log to stderr, mount in the foreground, return 0."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
    install_log_redaction()
    kw.setdefault("foreground", True)
    mount(fs, root, mountpoint, **kw)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m striped_fs.fuse URL MOUNTPOINT [--read-only]``: serve an fsspec URL."""
    import fsspec

    parser = argparse.ArgumentParser(prog="python -m striped_fs.fuse", description=main.__doc__)
    parser.add_argument("url", help="fsspec URL, e.g. striped::s3://bucket/ckpt or /data")
    parser.add_argument("mountpoint")
    parser.add_argument("--read-only", action="store_true")
    parser.add_argument("--allow-other", action="store_true")
    parser.add_argument("--debug", action="store_true", help="libfuse request trace on stderr")
    args = parser.parse_args(argv)
    fs, root = fsspec.core.url_to_fs(args.url)
    return serve(
        fs,
        root,
        args.mountpoint,
        read_only=args.read_only,
        allow_other=args.allow_other,
        debug=args.debug,
    )


if __name__ == "__main__":
    sys.exit(main())
