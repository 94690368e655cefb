"""The lazy root filesystem of an image, as one read-only FUSE mount.

A read of ``[offset, offset + size)`` of a file maps to ``[entry.offset + offset, ...)`` of its
layer's tar stream, then to the frames that hold those bytes; the fetcher serves each frame
from memory, the block cache, or the registry (on demand, ahead of any prefetch). No byte of a
file is served before its TOC entry was checked against its tar header (the frame holding the
header is fetched first when a read starts elsewhere in the file), and every frame's entries
are checked when it is decompressed (:meth:`prefetch.toc.LayerIndex.verify_frame`): a
mismatch is EIO, never the wrong bytes. Metadata
(``stat``, ``readdir``, ``readlink``, xattrs) comes from the TOCs alone: listing a tree or
stat-ing every file fetches nothing. The mount is read-only, ``nodev`` and ``nosuid``
unless the caller decides otherwise, and ``default_permissions``: the kernel checks every
access against the modes and owners the image gives (a 0600 file stays its owner's); device
nodes and setuid bits are presented as the image says. Names and link targets are bytes, as
on any Linux file system (:data:`FS_ENCODING`: one that is not UTF-8 is listed and opened like
any other). ``readdir`` gives each entry's type with its name: overlayfs, which stacks a view
over normally unpacked layers, recognizes a whiteout only by the character-device type its
listing reports. Generic FUSE plumbing (wait for a mount, unmount) comes from
striped_fs.mount.
"""

from __future__ import annotations

import codecs
import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from striped_fs import MountError, load_fusepy, run_fuse

from .fetcher import Blob, FrameFetcher
from .merge import LowerDir, MergedTree, Node, merge_layers, unpack_time

log = logging.getLogger(__name__)

OVERLAY_OPAQUE = "trusted.overlay.opaque"
#: How fusepy turns the kernel's path bytes into the TOC's names and back: UTF-8 with
#: surrogate escapes, Python's own file-system encoding (os.fsdecode), under a codec name
#: fusepy can be given (it takes an encoding name, not an error handler).
FS_ENCODING = "bootseer-fs-names"


def _find_codec(name: str) -> codecs.CodecInfo | None:
    if name != FS_ENCODING.replace("-", "_"):
        return None
    return codecs.CodecInfo(
        name=FS_ENCODING,
        encode=lambda text, errors="strict": codecs.utf_8_encode(text, "surrogateescape"),
        decode=lambda data, errors="strict": codecs.utf_8_decode(data, "surrogateescape", True),
    )


codecs.register(_find_codec)


def _name_bytes(name: str) -> bytes:
    """A TOC name or link target as the bytes the file system shows."""
    return name.encode("utf-8", "surrogateescape")


# fusepy, or striped_fs's stand-in when libfuse is missing (the operations stay testable)
_FUSE = load_fusepy()
Operations: type = _FUSE.Operations
FuseOSError: type[OSError] = _FUSE.FuseOSError


@dataclass(eq=False)
class Layer:
    """One layer of the image: its index (frames + TOC entries) and the blob the fetcher
    reads them from."""

    index: Any  # prefetch.toc.LayerIndex
    blob: Blob

    def __post_init__(self) -> None:
        if self.blob.check is None:  # every frame served through this layer is checked
            self.blob.check = self.index.verify_frame

    def require_header(self, fetcher: FrameFetcher, entry: Any) -> None:
        """Make sure ``entry`` was checked against its tar header before its bytes are
        served: fetch the frame that holds the header when it was not verified yet."""
        verified = getattr(self.index, "verified", None)
        if verified is None or not self.index.tar_size:
            return
        h = self.index.frame_of(min(entry.header_offset, self.index.tar_size - 1))
        if h not in verified:
            fetcher.frame(self.blob, h)

    @property
    def entries(self) -> Sequence[Any]:
        return self.index.entries

    def frames_for(self, start: int, end: int) -> range:
        """Indices of the frames holding tar-stream bytes ``[start, end)``."""
        return self.index.frames_for(start, end)


class LazyImage:
    """The merged tree of an image's layers, and reads through a frame fetcher."""

    def __init__(
        self,
        layers: Sequence[Layer],
        fetcher: FrameFetcher,
        *,
        overlay: bool = False,
        below: Callable[[str], LowerDir | None] | None = None,
        keep_whiteouts: bool = False,
    ) -> None:
        self.layers = list(layers)
        self.fetcher = fetcher
        self.tree: MergedTree = merge_layers(
            (layer.entries for layer in self.layers),
            overlay=overlay,
            below=below,
            keep_whiteouts=keep_whiteouts,
        )
        for problem in self.tree.problems:  # left out of the view; the rest is served
            log.error("%s (containerd's own unpack refuses such a layer)", problem)

    def read(self, node: Node, offset: int, size: int, *, record: bool = True) -> bytes:
        """``size`` bytes of ``node``'s file from ``offset`` (``record``: see
        :meth:`FrameFetcher.frame`)."""
        data_node = node.data
        entry = data_node.entry
        if entry is None or entry.type not in ("reg", "hardlink"):
            raise FuseOSError(errno.EISDIR if node.is_dir else errno.EINVAL)
        size = max(0, min(size, entry.size - offset))
        if size == 0:
            return b""
        self.layers[data_node.layer].require_header(self.fetcher, entry)
        if getattr(entry, "sparse", None):
            return self._read_sparse(data_node, entry, offset, size, record)
        return self._read_stream(data_node.layer, entry.offset + offset, size, record)

    def _read_stream(self, layer_index: int, start: int, size: int, record: bool = True) -> bytes:
        layer = self.layers[layer_index]
        end = start + size
        parts = []
        for i in layer.frames_for(start, end):
            frame = layer.blob.frames[i]
            raw = self.fetcher.frame(layer.blob, i, record=record)
            lo = max(start, frame.u_offset) - frame.u_offset
            hi = min(end, frame.u_offset + frame.u_size) - frame.u_offset
            parts.append(raw[lo:hi])
        data = b"".join(parts)
        if len(data) != size:
            raise FuseOSError(errno.EIO)
        return data

    def _read_sparse(self, node: Node, entry: Any, offset: int, size: int, record: bool) -> bytes:
        out = bytearray(size)  # holes read as zeros
        stored = entry.offset
        for ext_offset, length in entry.sparse:
            lo, hi = max(offset, ext_offset), min(offset + size, ext_offset + length)
            if lo < hi:
                out[lo - offset : hi - offset] = self._read_stream(
                    node.layer, stored + (lo - ext_offset), hi - lo, record
                )
            stored += length
        return bytes(out)


class LazyOperations(Operations):  # type: ignore[misc,valid-type]
    """fusepy operations over a :class:`LazyImage` (path-based, read-only: fusepy's own
    defaults answer every write with EROFS)."""

    use_ns = True  # times in integer nanoseconds (the TOC's precision)

    def __init__(self, image: LazyImage, *, ino_base: int = 0) -> None:
        self.image = image
        self.ino_base = ino_base  # ORed into every inode number (views share one mount)
        self.mounted_at = time.time_ns()

    def _node(self, path: str) -> Node:
        node = self.image.tree.lookup(path)
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        node = self._node(path)
        entry, meta = node.data.entry, node.meta
        # An implied directory has no time of its own (containerd's is the unpack's).
        mtime = unpack_time(meta.mtime_ns) if meta is not None else self.mounted_at
        st: dict[str, Any] = {
            "st_mode": node.mode(),
            "st_ino": self.ino_base | node.ino,
            "st_nlink": node.data.nlink,
            "st_uid": meta.uid if meta is not None else 0,
            "st_gid": meta.gid if meta is not None else 0,
            "st_atime": mtime,
            "st_mtime": mtime,
            "st_ctime": mtime,
        }
        if node.is_dir:
            st["st_nlink"] = 2 + sum(1 for c in node.children.values() if c.is_dir)
            st["st_size"] = 4096
        elif entry is not None:
            st["st_size"] = len(_name_bytes(entry.link)) if entry.type == "symlink" else entry.size
            if entry.type in ("char", "block"):
                st["st_rdev"] = os.makedev(entry.devmajor, entry.devminor)
        st["st_blocks"] = (st.get("st_size", 0) + 511) // 512
        return st

    def readdir(self, path: str, fh: Any) -> list[tuple[str, dict[str, int] | None, int]]:
        """Names with their type and inode (a listing's ``d_type``, ``d_ino``)."""
        node = self._node(path)
        if not node.is_dir:
            raise FuseOSError(errno.ENOTDIR)
        base = self.ino_base
        return [
            (".", None, 0),
            ("..", None, 0),
            *(
                (name, {"st_mode": child.mode(), "st_ino": base | child.ino}, 0)
                for name, child in sorted(node.children.items())
            ),
        ]

    def readlink(self, path: str) -> str:
        entry = self._node(path).data.entry  # a hardlink to a symlink is that symlink
        if entry is None or entry.type != "symlink":
            raise FuseOSError(errno.EINVAL)
        return entry.link

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise FuseOSError(errno.EROFS)
        self._node(path)
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        try:
            return self.image.read(self._node(path), offset, size)
        except FuseOSError:
            raise
        except OSError as exc:
            log.error("read %s [%d, +%d) failed: %s", path, offset, size, exc)
            raise FuseOSError(errno.EIO) from None

    def _xattrs(self, path: str) -> dict[str, bytes]:
        node = self._node(path)
        xattrs = getattr(node.meta, "xattrs", None) or {}
        if node.opaque:  # an overlay tree (merge_layers(overlay=True)): see merge.py
            xattrs = {**xattrs, OVERLAY_OPAQUE: b"y"}
        return xattrs

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        xattrs = self._xattrs(path)
        if name not in xattrs:
            raise FuseOSError(errno.ENODATA)
        return xattrs[name]

    def listxattr(self, path: str) -> list[str]:
        return sorted(self._xattrs(path))

    def access(self, path: str, amode: int) -> int:
        self._node(path)
        if amode & os.W_OK:
            raise FuseOSError(errno.EROFS)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": 0,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": len(self.image.tree.inodes),
            "f_ffree": 0,
            "f_namemax": 255,
        }


def mount(
    image: LazyImage,
    mountpoint: str,
    *,
    foreground: bool = True,
    allow_other: bool = False,
    dev_suid: bool = False,
) -> None:
    """Serve ``image`` at ``mountpoint`` until unmounted (SIGINT/SIGTERM unmount cleanly).
    Only the mounting user reaches it unless ``allow_other``; ``dev_suid`` (a chroot that
    must run the image's setuid programs) lifts ``nodev,nosuid``."""
    _FUSE.require()
    if not os.path.isdir(mountpoint):
        raise MountError(f"mountpoint {mountpoint!r} is not a directory")
    options: dict[str, Any] = {
        "foreground": foreground,
        "nothreads": False,
        "ro": True,
        "encoding": FS_ENCODING,
        "fsname": "bootseer-image",
        "subtype": "bootseer",
        "use_ino": True,  # hardlinks share an inode number
        "max_read": 1 << 20,
        # the kernel enforces the image's modes and owners
        "default_permissions": True,
        # The image never changes under the mount: the kernel may keep
        # file pages across opens and cache lookups and attributes.
        "kernel_cache": True,
        "entry_timeout": 3600.0,
        "attr_timeout": 3600.0,
        "negative_timeout": 3600.0,
    }
    if dev_suid:  # libfuse mounts nodev,nosuid unless told otherwise
        options.update(dev=True, suid=True)
    else:
        options.update(nodev=True, nosuid=True)
    if allow_other:
        options["allow_other"] = True
    run_fuse(LazyOperations(image), mountpoint, options)
