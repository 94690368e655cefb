"""A read-only FUSE mount served on a ``/dev/fuse`` connection that outlives the process
serving it (the wire protocol: fuseproto.py).

A FUSE mount lives as long as some process holds its ``/dev/fuse`` descriptor; requests wait
in the kernel while nobody reads them. So the snapshotter mounts once, leaves a duplicate of
the descriptor with a small holder process (holder.py), and a successor (after a restart, a
``kill -9`` or an upgrade) takes the descriptor back and goes on serving the same connection:
containers reading through it block for the gap and never see an error.

What makes that possible:

* **Stable node ids.** The kernel names files by the node ids it got from LOOKUP. They come
  from the filesystem (``ops.nodeid(path)``), computed from the path alone, so a successor
  resolves an id it never handed out (``ops.path_of(nodeid)``) with no state passed on.
* **No INIT needed.** The INIT handshake happens once, at mount (:func:`mount`); what it
  agreed is kept with the descriptor, and a successor serves at once.
* **Nothing lost in flight.** A request a killed predecessor had read but not answered is
  queued again by the kernel when the successor asks (``FUSE_NOTIFY_RESEND``, Linux 6.9);
  a stopping server finishes the requests it has read and reads no more (each worker waits in
  ``epoll`` with ``EPOLLEXCLUSIVE``, so it can be stopped between requests).
* **Stateless handles.** Files are opened with handle 0; a directory handle is only a cache
  key checked against its node id, so a handle from a predecessor just misses the cache.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import select
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import fuseproto as fp

log = logging.getLogger(__name__)

# What a successor must agree on to serve a predecessor's connection: the INIT agreement kept
# in Connection.meta, node ids from the tree (nodeids.py), stateless handles. Another value
# means: mount anew.
HANDOFF_VERSION = 1
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MAX_WRITE = 128 << 10  # nothing is written; the kernel wants at least 4 KiB
BUFSIZE = MAX_WRITE + 4096  # what the kernel requires of a read buffer


class TreeOperations(Protocol):
    """What :class:`FuseServer` serves: fusepy's path-based calls (times in ns), plus the
    stable node ids of the tree."""

    def nodeid(self, path: str) -> int: ...
    def path_of(self, nodeid: int) -> str | None: ...
    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]: ...
    def readdir(self, path: str, fh: Any) -> list[Any]: ...  # names or (name, st, 0)
    def open(self, path: str, flags: int) -> int: ...
    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes: ...
    def readlink(self, path: str) -> str: ...
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes: ...
    def listxattr(self, path: str) -> list[str]: ...
    def access(self, path: str, amode: int) -> int: ...
    def statfs(self, path: str) -> dict[str, int]: ...


@dataclass
class Connection:
    """A mounted FUSE connection: its device descriptor and what a server must know about it
    (``meta``: the INIT agreement, the mount's device number, when it was mounted)."""

    fd: int
    mountpoint: str
    meta: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mount_device(mountpoint: str) -> str | None:
    """The ``major:minor`` of what is mounted at ``mountpoint`` (from mountinfo: nothing on
    the mount itself is touched, which would block on a connection nobody serves)."""
    from striped_fs import canonical_path, unescape_mountinfo

    target, found = canonical_path(mountpoint), None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ", 5)
            if len(fields) > 4 and unescape_mountinfo(fields[4]) == target:
                found = fields[2]  # the last one is on top
    return found


def alive(fd: int) -> bool:
    """Whether the FUSE connection behind ``fd`` still exists (the kernel reports POLLERR
    once it is unmounted or aborted)."""
    poller = select.poll()
    poller.register(fd, 0)
    return not any(
        ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in poller.poll(0)
    )


def mount(
    mountpoint: str, *, fsname: str, subtype: str, max_read: int = 1 << 20, allow_other: bool = True
) -> Connection:
    """Mount an empty FUSE filesystem at ``mountpoint`` (``ro,nodev,nosuid``,
    ``default_permissions``) and answer the kernel's INIT; root only. The caller serves the
    returned connection (:class:`FuseServer`)."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        rootmode = stat.S_IFMT(os.stat(mountpoint).st_mode)
        data = (
            f"fd={fd},rootmode={rootmode:o},user_id={os.getuid()},group_id={os.getgid()},"
            f"default_permissions,max_read={max_read}" + (",allow_other" if allow_other else "")
        )
        libc = ctypes.CDLL(None, use_errno=True)
        if (
            libc.mount(
                fsname.encode(),
                os.fsencode(mountpoint),
                f"fuse.{subtype}".encode(),
                ctypes.c_ulong(MS_RDONLY | MS_NOSUID | MS_NODEV),
                data.encode(),
            )
            != 0
        ):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount FUSE at {mountpoint}: {os.strerror(err)}")
        try:
            meta = _handshake(fd, max_read)
        except BaseException:
            libc.umount2(os.fsencode(mountpoint), 2)  # MNT_DETACH
            raise
        meta.update(dev=mount_device(mountpoint), mounted_at=time.time_ns())
        return Connection(fd, mountpoint, meta)
    except BaseException:
        os.close(fd)
        raise


def _handshake(fd: int, max_read: int) -> dict[str, Any]:
    buf = bytearray(max(BUFSIZE, 1 << 16))
    n = os.readv(fd, [buf])
    request = fp.Request(memoryview(buf)[:n])
    if request.opcode != fp.INIT:
        raise OSError(f"FUSE: expected INIT from the kernel, got opcode {request.opcode}")
    try:
        payload, meta = fp.init_reply(
            request, max_write=MAX_WRITE, max_pages=max(1, max_read // 4096)
        )
    except OSError:
        os.writev(fd, fp.reply(request.unique, error=errno.EPROTO))
        raise
    os.writev(fd, fp.reply(request.unique, payload))
    return meta


class FuseServer:
    """Serves ``ops`` on ``conn`` with ``threads`` workers until :meth:`stop` or the end of
    the connection (an unmount: :attr:`ended` is set).

    Timeouts as libfuse's options of the same names; the root's entries (the views, which come
    and go) are never cached by name."""

    def __init__(
        self,
        ops: TreeOperations,
        conn: Connection,
        *,
        threads: int = 16,
        entry_timeout: float = 3600.0,
        attr_timeout: float = 3600.0,
        negative_timeout: float = 3600.0,
        keep_cache: bool = True,
    ) -> None:
        self.ops = ops
        self.conn = conn
        self.threads = threads
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.negative_timeout = negative_timeout
        self.open_flags = fp.FOPEN_KEEP_CACHE if keep_cache else 0
        self.ended = threading.Event()
        self.resent = 0  # requests a predecessor had read and never answered
        self._paths: dict[int, str] = {fp.ROOT_ID: "/"}
        self._dirs: dict[int, tuple[int, list[Any]]] = {}  # fh -> (nodeid, entries)
        self._dir_handles = itertools.count(1)
        self._lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._workers: list[threading.Thread] = []
        self._handlers: dict[int, Callable[[fp.Request], bytes]] = {
            fp.LOOKUP: self._lookup,
            fp.GETATTR: self._getattr,
            fp.READLINK: self._readlink,
            fp.OPEN: self._open,
            fp.READ: self._read,
            fp.RELEASE: _empty,
            fp.FLUSH: _empty,
            fp.STATFS: self._statfs,
            fp.GETXATTR: self._getxattr,
            fp.LISTXATTR: self._listxattr,
            fp.ACCESS: self._access,
            fp.OPENDIR: self._opendir,
            fp.READDIR: self._readdir,
            fp.RELEASEDIR: self._releasedir,
            fp.DESTROY: self._destroy,
        }

    # -- lifecycle ---------------------------------------------------------------------------
    def resend(self) -> bool:
        """Have the kernel queue again what a predecessor read and never answered (before
        :meth:`start`: what this server reads is never in that queue). False where the
        kernel cannot (before Linux 6.9)."""
        try:
            os.write(self.conn.fd, fp.notify_resend())
        except OSError as exc:
            log.warning(
                "the kernel cannot resend requests a killed predecessor left "
                "unanswered (%s; Linux 6.9 can): their callers wait until killed",
                exc,
            )
            return False
        return True

    def start(self) -> None:
        flags = os.get_blocking(self.conn.fd)
        if flags:  # shared with every holder of this open file: they never read it
            os.set_blocking(self.conn.fd, False)
        for i in range(self.threads):
            worker = threading.Thread(target=self._work, name=f"fuse-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop reading; the requests already read are answered first. True when every
        worker finished within ``timeout``."""
        try:
            os.write(self._stop_w, b"x")
        except BlockingIOError:
            pass
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        return not any(w.is_alive() for w in self._workers)

    def close(self) -> None:
        os.close(self._stop_r)
        os.close(self._stop_w)

    # -- the loop ----------------------------------------------------------------------------
    def _work(self) -> None:
        fd = self.conn.fd
        ep = select.epoll()
        ep.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
        ep.register(self._stop_r, select.EPOLLIN)
        buf = bytearray(BUFSIZE)
        view = memoryview(buf)
        try:
            while True:
                if any(f == self._stop_r for f, _ in ep.poll()):
                    return
                try:
                    n = os.readv(fd, [buf])
                except (BlockingIOError, InterruptedError):
                    continue  # another worker took it
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        continue  # interrupted before it was read
                    if exc.errno != errno.ENODEV:
                        log.error("reading the FUSE device failed: %s", exc)
                    self._end()
                    return
                self._handle(fp.Request(view[:n]))
        finally:
            ep.close()

    def _end(self) -> None:
        self.ended.set()
        try:
            os.write(self._stop_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _handle(self, req: fp.Request) -> None:
        if req.opcode in fp.NO_REPLY:
            return
        if req.unique & fp.UNIQUE_RESEND:
            with self._lock:
                self.resent += 1
                first = self.resent == 1
            if first:
                log.info(
                    "answering requests a predecessor had read and left unanswered "
                    "(queued again by the kernel)"
                )
        handler = self._handlers.get(req.opcode)
        try:
            if handler is None:
                raise OSError(errno.EROFS if req.opcode in fp.WRITES else errno.ENOSYS, "")
            out = fp.reply(req.unique, handler(req))
        except OSError as exc:
            out = fp.reply(req.unique, error=exc.errno or errno.EIO)
        except Exception:  # noqa: BLE001 - the kernel must get an answer
            log.exception("FUSE request %d on node %d failed", req.opcode, req.nodeid)
            out = fp.reply(req.unique, error=errno.EIO)
        try:
            os.writev(self.conn.fd, out)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                self._end()
            elif exc.errno != errno.ENOENT:  # ENOENT: the caller was interrupted meanwhile
                log.error("answering FUSE request %d failed: %s", req.opcode, exc)

    # -- node ids ----------------------------------------------------------------------------
    def _path(self, nodeid: int) -> str:
        path = self._paths.get(nodeid)
        if path is None:
            path = self.ops.path_of(nodeid)  # handed out by a predecessor
            if path is None:
                raise OSError(errno.ESTALE, "")
            with self._lock:
                self._paths[nodeid] = path
        return path

    # -- requests ----------------------------------------------------------------------------
    def _lookup(self, req: fp.Request) -> bytes:
        parent = self._path(req.nodeid)
        path = ("" if parent == "/" else parent) + "/" + req.name()
        top = parent == "/"
        try:
            st = self.ops.getattr(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT and not top and self.negative_timeout > 0:
                return fp.entry_out(0, None, self.negative_timeout, 0)
            raise
        nodeid = self.ops.nodeid(path)
        with self._lock:
            known = self._paths.setdefault(nodeid, path)
        if known != path:
            log.error("node id %#x of %s is also that of %s: refused", nodeid, path, known)
            raise OSError(errno.EIO, "")
        return fp.entry_out(nodeid, st, 0.0 if top else self.entry_timeout, self.attr_timeout)

    def _getattr(self, req: fp.Request) -> bytes:
        return fp.attr_out(self.ops.getattr(self._path(req.nodeid)), req.nodeid, self.attr_timeout)

    def _readlink(self, req: fp.Request) -> bytes:
        return fp.encode_name(self.ops.readlink(self._path(req.nodeid)))

    def _open(self, req: fp.Request) -> bytes:
        flags = struct.unpack_from("<I", req.body)[0]
        fh = self.ops.open(self._path(req.nodeid), flags)
        return fp.open_out(int(fh or 0), self.open_flags)

    def _read(self, req: fp.Request) -> bytes:
        fh, offset, size = fp.READ_IN.unpack_from(req.body)
        return bytes(self.ops.read(self._path(req.nodeid), size, offset, fh))

    def _statfs(self, req: fp.Request) -> bytes:
        return fp.statfs_out(self.ops.statfs(self._path(req.nodeid)))

    def _sized(self, data: bytes, size: int) -> bytes:
        if size == 0:
            return fp.GETXATTR_OUT.pack(len(data))
        if len(data) > size:
            raise OSError(errno.ERANGE, "")
        return data

    def _getxattr(self, req: fp.Request) -> bytes:
        size = fp.GETXATTR_IN.unpack_from(req.body)[0]
        value = self.ops.getxattr(self._path(req.nodeid), req.name(fp.GETXATTR_IN.size))
        return self._sized(bytes(value), size)

    def _listxattr(self, req: fp.Request) -> bytes:
        size = fp.GETXATTR_IN.unpack_from(req.body)[0]
        names = self.ops.listxattr(self._path(req.nodeid))
        return self._sized(b"".join(fp.encode_name(n) + b"\0" for n in names), size)

    def _access(self, req: fp.Request) -> bytes:
        self.ops.access(self._path(req.nodeid), struct.unpack_from("<I", req.body)[0])
        return b""

    def _opendir(self, req: fp.Request) -> bytes:
        names = self.ops.readdir(self._path(req.nodeid), 0)
        fh = next(self._dir_handles)
        with self._lock:
            self._dirs[fh] = (req.nodeid, list(names))
        return fp.open_out(fh, 0)

    def _readdir(self, req: fp.Request) -> bytes:
        fh, offset, size = fp.READ_IN.unpack_from(req.body)
        with self._lock:
            cached = self._dirs.get(fh)
        if cached is None or cached[0] != req.nodeid:  # a predecessor's handle
            names = list(self.ops.readdir(self._path(req.nodeid), fh))
        else:
            names = cached[1]
        return fp.dirents(names, offset, size)

    def _releasedir(self, req: fp.Request) -> bytes:
        fh = fp.READ_IN.unpack_from(req.body)[0]
        with self._lock:
            cached = self._dirs.get(fh)
            if cached is not None and cached[0] == req.nodeid:
                del self._dirs[fh]
        return b""

    def _destroy(self, req: fp.Request) -> bytes:
        self._end()
        return b""


def _empty(req: fp.Request) -> bytes:
    return b""
