"""One FUSE mount holding every lazy snapshot of the snapshotter, one directory each.

``<root>/lazy/<id>/`` is the root filesystem that the lazy layers of snapshot ``id`` and its
lazy parents form together (merged by prefetch.merge, as ``bootseer image mount`` does), and
it is the single overlayfs lowerdir a container gets for them: a path lookup is one FUSE
call, not one per layer, and a read goes straight to the layer and frames that hold it. Above
a normally unpacked layer the tree keeps deletions the overlayfs way (whiteouts, opaque
directories, each listed with its type: overlayfs recognizes a whiteout in a lower layer's
listing by it), so the kernel stacks it correctly on what lies below; a directory the lazy
layers only imply there takes the mode, owner and xattrs of the unpacked directory below it
(:func:`lower_dirs`), as containerd's own unpack gives the directory it creates.

A tree is built on its first access, from layer indexes already on disk; a restart of the
snapshotter serves the same mount again (fuseserver.py, holder.py) with every snapshot it had,
and the node ids the kernel holds stay valid (nodeids.py). Each tree also shows
``/.bootseer/ready``: a container that opens it tells the snapshotter its start is over (the
end of a profile recording).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..lazyfs import FuseOSError, LazyImage, LazyOperations, Operations
from ..merge import LowerDir
from .nodeids import ViewNodeIds, view_of

log = logging.getLogger(__name__)

CONTROL_DIR = ".bootseer"
READY_FILE = "ready"
_INO_SHIFT = 40  # st_ino = view id << 40 | node inode: unique across the mount


class ViewOperations(Operations):  # type: ignore[misc,valid-type]
    """fusepy operations dispatching ``/<id>/...`` to the lazy tree of snapshot ``id``."""

    use_ns = True

    def __init__(self, *, on_ready: Callable[[int], None] | None = None) -> None:
        self._builders: dict[int, Callable[[], LazyImage]] = {}
        self._views: dict[int, LazyOperations] = {}
        self._ids: dict[int, ViewNodeIds] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._on_ready = on_ready
        self.mounted_at = time.time_ns()  # the mount's: the service sets it from the connection

    # -- the snapshotter's side --------------------------------------------------------------
    def register(self, view_id: int, builder: Callable[[], LazyImage]) -> None:
        with self._lock:
            self._builders[view_id] = builder
            self._locks.setdefault(view_id, threading.Lock())

    def unregister(self, view_id: int) -> None:
        with self._lock:
            self._builders.pop(view_id, None)
            self._views.pop(view_id, None)
            self._ids.pop(view_id, None)
            self._locks.pop(view_id, None)

    def view(self, view_id: int) -> LazyOperations:
        """The operations of one view, building its tree on first use."""
        with self._lock:
            ops = self._views.get(view_id)
            if ops is not None:
                return ops
            builder, lock = self._builders.get(view_id), self._locks.get(view_id)
        if builder is None or lock is None:
            raise FuseOSError(errno.ENOENT)
        with lock:
            with self._lock:
                ops = self._views.get(view_id)
            if ops is None:
                started = time.perf_counter()
                try:
                    ops = LazyOperations(builder(), ino_base=view_id << _INO_SHIFT)
                    ops.mounted_at = self.mounted_at  # the same times after a restart
                    ids = ViewNodeIds(view_id, lambda: _view_paths(ops))
                except Exception as exc:  # noqa: BLE001 - the mount must keep serving
                    log.error("lazy snapshot %d cannot be built: %s", view_id, exc)
                    raise FuseOSError(errno.EIO) from None
                with self._lock:
                    if view_id not in self._builders:
                        raise FuseOSError(errno.ENOENT)
                    self._views[view_id] = ops
                    self._ids[view_id] = ids
                log.info(
                    "lazy snapshot %d: tree of %d nodes built in %.3f s",
                    view_id,
                    len(ops.image.tree.inodes),
                    time.perf_counter() - started,
                )
        return ops

    # -- node ids (fuseserver.TreeOperations) ------------------------------------------------
    def nodeid(self, path: str) -> int:
        view_id, rest = self._split(path)
        if view_id is None:
            return 1
        self.view(view_id)
        with self._lock:
            ids = self._ids.get(view_id)
        if ids is None:
            raise FuseOSError(errno.ENOENT)
        return ids.nodeid(rest)

    def path_of(self, nodeid: int) -> str | None:
        if nodeid == 1:
            return "/"
        view_id = view_of(nodeid)
        try:
            self.view(view_id)
        except FuseOSError as exc:
            if exc.errno == errno.ENOENT:
                return None  # a removed snapshot
            raise
        with self._lock:
            ids = self._ids.get(view_id)
        rest = ids.path_of(nodeid) if ids is not None else None
        if rest is None:
            return None
        return f"/{view_id}" + ("" if rest == "/" else rest)

    # -- fusepy ------------------------------------------------------------------------------
    def _split(self, path: str) -> tuple[int | None, str]:
        parts = path.strip("/").split("/", 1)
        if not parts[0]:
            return None, "/"
        try:
            view_id = int(parts[0])
        except ValueError:
            raise FuseOSError(errno.ENOENT) from None
        return view_id, "/" + (parts[1] if len(parts) > 1 else "")

    def _control(self, rest: str) -> str | None:
        if rest == f"/{CONTROL_DIR}":
            return "dir"
        if rest == f"/{CONTROL_DIR}/{READY_FILE}":
            return "ready"
        return None

    def _dir_stat(self, ino: int, mode: int = 0o755) -> dict[str, Any]:
        t = self.mounted_at
        return {
            "st_mode": stat.S_IFDIR | mode,
            "st_ino": ino,
            "st_nlink": 2,
            "st_uid": 0,
            "st_gid": 0,
            "st_size": 4096,
            "st_atime": t,
            "st_mtime": t,
            "st_ctime": t,
        }

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        view_id, rest = self._split(path)
        if view_id is None:  # the mount's root: root's alone, as the directory under it
            return self._dir_stat(1, 0o700)
        ops = self.view(view_id)
        control = self._control(rest)
        if control == "dir":
            return self._dir_stat((view_id << _INO_SHIFT) | ((1 << _INO_SHIFT) - 1))
        if control == "ready":
            t = self.mounted_at
            return {
                "st_mode": stat.S_IFREG | 0o444,
                "st_ino": (view_id << _INO_SHIFT) | ((1 << _INO_SHIFT) - 2),
                "st_nlink": 1,
                "st_size": 0,
                "st_atime": t,
                "st_mtime": t,
                "st_ctime": t,
            }
        return ops.getattr(rest, fh)

    def readdir(self, path: str, fh: Any) -> list[Any]:
        view_id, rest = self._split(path)
        if view_id is None:
            with self._lock:
                return [".", "..", *(str(i) for i in sorted(self._builders))]
        control = self._control(rest)
        if control == "dir":
            return [".", "..", READY_FILE]
        if control == "ready":
            raise FuseOSError(errno.ENOTDIR)
        entries = self.view(view_id).readdir(rest, fh)  # (name, type and inode, 0)
        if rest == "/" and all(name != CONTROL_DIR for name, _, _ in entries):
            entries.append((CONTROL_DIR, None, 0))
        return entries

    def open(self, path: str, flags: int) -> int:
        view_id, rest = self._split(path)
        if view_id is None:
            raise FuseOSError(errno.EISDIR)
        ops = self.view(view_id)
        if self._control(rest) == "ready":
            if self._on_ready is not None:
                self._on_ready(view_id)
            return 0
        return ops.open(rest, flags)

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        view_id, rest = self._split(path)
        if view_id is None:
            raise FuseOSError(errno.EISDIR)
        if self._control(rest) == "ready":
            return b""
        return self.view(view_id).read(rest, size, offset, fh)

    def _delegate(self, name: str, path: str, *args: Any) -> Any:
        view_id, rest = self._split(path)
        if view_id is None or self._control(rest) is not None:
            if name == "listxattr":
                return []
            if name == "access":
                return 0
            raise FuseOSError(errno.ENODATA if name == "getxattr" else errno.EINVAL)
        return getattr(self.view(view_id), name)(rest, *args)

    def readlink(self, path: str) -> str:
        return self._delegate("readlink", path)

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        return self._delegate("getxattr", path, name, position)

    def listxattr(self, path: str) -> list[str]:
        return self._delegate("listxattr", path)

    def access(self, path: str, amode: int) -> int:
        return self._delegate("access", path, amode)

    def statfs(self, path: str) -> dict[str, int]:
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": 0,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": 0,
            "f_ffree": 0,
            "f_namemax": 255,
        }


def _view_paths(ops: LazyOperations) -> list[str]:
    """Every path a view shows, its control files included."""
    paths = ["/", f"/{CONTROL_DIR}", f"/{CONTROL_DIR}/{READY_FILE}"]
    paths.extend(f"/{p}" for p, _ in ops.image.tree.walk() if p)
    return paths


def mount_views(mountpoint: str) -> Any:
    """Mount the views' FUSE filesystem at ``mountpoint`` (the connection is returned; a
    fuseserver.FuseServer serves it, this process or a successor).

    ``nodev,nosuid,default_permissions,allow_other`` (docs/decisions.md, "node: private
    directories, ..."): the kernel enforces the image's modes and owners on every access;
    device nodes and setuid bits are presented as the image says but do nothing through this
    mount. The container runtime decides on its own mount: containerd's overlay, which takes a
    view as its lowerdir, carries neither flag, so a container sees its image's setuid
    programs and devices work as with any snapshotter (a read-only container's bind mount of a
    view too: containerd remounts it ``ro``, which resets both flags). ``allow_other`` is for
    that bind mount: there a container's users other than root read through FUSE with their
    own credentials. The mount's root is 0700 and lies in the snapshotter's 0700 root, so no
    user of the node gets to it but root. The images never change under the mount: the server
    lets the kernel keep pages across opens and cache names and attributes for an hour
    (FuseServer's defaults).
    """
    from .fuseserver import mount

    return mount(
        mountpoint,
        fsname="bootseer-snapshots",
        subtype="bootseer",
        max_read=1 << 20,
        allow_other=True,
    )


def lower_dirs(dirs: Sequence[str]) -> Callable[[str], LowerDir | None]:
    """``below`` for :func:`prefetch.merge.merge_layers` over normally unpacked layer
    directories (nearest first): what the first of them holding ``path`` has there, as
    containerd's unpack copies it to a parent it creates (mode, owner, mtime, xattrs but
    ``trusted.*``); None where that is not a directory, or no layer holds the path, as
    overlayfs stacks them (a whiteout or an opaque directory of a nearer layer hides the
    farther ones): so also whether overlayfs merges a directory of a view above with one
    below.

    The path comes from a layer index: it is walked one component at a time with
    ``O_NOFOLLOW`` under each directory, so a symlink in an unpacked layer never leads out
    of it."""

    def below(path: str) -> LowerDir | None:
        parts = [p.encode("utf-8", "surrogateescape") for p in path.split("/") if p]
        for top in dirs:
            found = _lower_dir(top, parts)
            if found is not False:
                return found or None
        return None

    return below


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, "trusted.overlay.opaque") == b"y"
    except OSError:
        return False


def _lower_dir(top: str, parts: list[bytes]) -> LowerDir | None | bool:
    """The directory at ``parts`` under ``top``; None when something else is there (a file,
    a symlink, a whiteout) or an opaque directory of ``top`` hides the path; False when
    nothing is (look further down)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(top, flags)
    except OSError:
        return False
    try:
        for part in parts:
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:  # nothing here; an opaque directory hides the rest
                return None if _opaque(fd) else False
            except OSError:  # a symlink, a file, a whiteout device: not a directory
                return None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        xattrs = {
            name: os.getxattr(fd, name)
            for name in os.listxattr(fd)
            if not name.startswith("trusted.")
        }
        return LowerDir(
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            mtime_ns=st.st_mtime_ns,
            xattrs=xattrs,
        )
    except OSError as exc:
        log.warning("unpacked layer %s: cannot read %s: %s", top, b"/".join(parts), exc)
        return None
    finally:
        os.close(fd)
