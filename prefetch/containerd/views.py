"""One FUSE mount holding every lazy snapshot of the snapshotter, one directory each.

``<root>/lazy/<id>/`` is the root filesystem that the lazy layers of snapshot ``id`` and its
lazy parents form together (merged by prefetch.merge, as ``bootseer image mount`` does), and
it is the single overlayfs lowerdir a container gets for them: a path lookup is one FUSE
call, not one per layer, and a read goes straight to the layer and frames that hold it. Above
a normally unpacked layer the tree keeps deletions the overlayfs way (whiteouts, opaque
directories), so the kernel stacks it correctly on what lies below.

A tree is built on its first access, from layer indexes already on disk; a restart of the
snapshotter serves the same mount again (fuseserver.py, holder.py) with every snapshot it had,
and the node ids the kernel holds stay valid (nodeids.py). Each tree also shows
``/.bootseer/ready``: a container that opens it tells the snapshotter its start is over (the
end of a profile recording).
"""

from __future__ import annotations

import errno
import logging
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from ..lazyfs import FuseOSError, LazyImage, LazyOperations, Operations
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
                    ops = LazyOperations(builder())
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
                log.info("lazy snapshot %d: tree of %d nodes built in %.3f s", view_id,
                         len(ops.image.tree.inodes), time.perf_counter() - started)
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
        return {"st_mode": stat.S_IFDIR | mode, "st_ino": ino, "st_nlink": 2, "st_uid": 0,
                "st_gid": 0, "st_size": 4096, "st_atime": t, "st_mtime": t, "st_ctime": t}

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
            return {"st_mode": stat.S_IFREG | 0o444, "st_ino": (view_id << _INO_SHIFT)
                    | ((1 << _INO_SHIFT) - 2), "st_nlink": 1, "st_size": 0,
                    "st_atime": t, "st_mtime": t, "st_ctime": t}
        st = ops.getattr(rest, fh)
        st["st_ino"] = (view_id << _INO_SHIFT) | st["st_ino"]
        return st

    def readdir(self, path: str, fh: Any) -> list[str]:
        view_id, rest = self._split(path)
        if view_id is None:
            with self._lock:
                return [".", "..", *(str(i) for i in sorted(self._builders))]
        control = self._control(rest)
        if control == "dir":
            return [".", "..", READY_FILE]
        if control == "ready":
            raise FuseOSError(errno.ENOTDIR)
        names = self.view(view_id).readdir(rest, fh)
        if rest == "/" and CONTROL_DIR not in names:
            names.append(CONTROL_DIR)
        return names

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
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 0, "f_bfree": 0,
                "f_bavail": 0, "f_files": 0, "f_ffree": 0, "f_namemax": 255}


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

    return mount(mountpoint, fsname="bootseer-snapshots", subtype="bootseer",
                 max_read=1 << 20, allow_other=True)
