"""A lazy layer written out as containerd's overlayfs snapshotter unpacks it: a complete
directory that reads nothing from the registry again.

The snapshotter does this for a lazy snapshot that an image pulled the normal way comes to
stand on (docs/decisions.md, "An unconverted image never reads the registry after its
pull"). The layer's tree is the one-layer overlay tree of :func:`prefetch.merge.merge_layers`
(``overlay=True``, whiteouts kept): a whiteout is a 0:0 character device, an opaque directory
carries ``trusted.overlay.opaque=y``, a parent the layer only implies takes the attributes of
the directory below it (``below``), times outside [1970, 2262] are 0, as containerd's applier
writes them.

Every frame is read once in stream order before anything is written, and the sha256 of the
whole tar stream must give the snapshot's chain ID with its parent's: exactly the check
containerd makes on a layer it unpacks (its diff ID, from the image config). A converted image
whose layer is not the tar its config names cannot, so, put other bytes under a chain ID an
unconverted image shares. Then the files: contents (holes kept as holes), owners, modes (after
the owner: a chown clears setuid bits), xattrs, times; hardlinks once every file exists; the
directories' attributes last, deepest first, so no later creation moves their mtime.

Everything is created under ``target``, a new directory in the snapshotter's private root,
with ``O_EXCL``/``O_NOFOLLOW`` and by ``mkdir``: a directory of the tree is one this module
made, never a symlink, so no write leaves ``target``. The caller renames it into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..lazyfs import LazyImage
from ..merge import Node, unpack_time
from .errors import FailedPreconditionError

_CHUNK = 4 << 20  # bytes of a file read and written at once
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
OVERLAY_OPAQUE = "trusted.overlay.opaque"


@dataclass
class Materialized:
    """What writing one layer took."""

    files: int = 0
    bytes_written: int = 0
    frames: int = 0
    seconds: float = 0.0


def chain_id(parent: str, diff_id: str) -> str:
    """The OCI chain ID of a layer with ``diff_id`` on ``parent`` ("" for none)."""
    if not parent:
        return diff_id
    return "sha256:" + hashlib.sha256(f"{parent} {diff_id}".encode()).hexdigest()


def check_diff_id(image: LazyImage, expected_chain: str, parent_chain: str) -> int:
    """Read every frame of the image's one layer in stream order (fetched over the fetcher's
    connections at once; not recorded in any profile) and check that the tar stream's sha256,
    on ``parent_chain``, gives ``expected_chain``. Returns the frame count; raises
    FailedPreconditionError naming the layer when it does not."""
    (layer,) = image.layers
    blob, frames = layer.blob, layer.blob.frames
    image.fetcher.prefetch([(blob, i) for i in range(len(frames))])
    digest = hashlib.sha256()
    for i in range(len(frames)):
        digest.update(image.fetcher.frame(blob, i, record=False))
    diff_id = "sha256:" + digest.hexdigest()
    if chain_id(parent_chain, diff_id) != expected_chain:
        raise FailedPreconditionError(
            f"layer {blob.digest} unpacks to {diff_id}, which does not give its snapshot "
            f"{expected_chain}: the converted image's config names another layer (the image "
            "is corrupt or was tampered with); remove it from this node"
        )
    return len(frames)


def _name(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def _set_attrs(path: bytes, node: Node, *, fd: int | None = None) -> None:
    """Owner, mode, xattrs and mtime of ``node``'s inode on ``path`` (or ``fd``)."""
    meta = node.meta
    kind = stat.S_IFMT(node.mode())
    target: Any = fd if fd is not None else path
    link = kind == stat.S_IFLNK
    nofollow = {} if fd is not None else {"follow_symlinks": False}
    if meta is not None:
        os.chown(target, meta.uid, meta.gid, **nofollow)
    if not link:
        os.chmod(target, stat.S_IMODE(node.mode()), **nofollow)
    xattrs = dict(getattr(meta, "xattrs", None) or {})
    if node.opaque:
        xattrs[OVERLAY_OPAQUE] = b"y"
    for key, value in xattrs.items():
        try:
            os.setxattr(target, key, value, **nofollow)
        except OSError:
            if not link:  # Linux refuses user.* xattrs on symlinks; containerd goes on too
                raise
    if meta is not None:
        t = unpack_time(meta.mtime_ns)
        os.utime(target, ns=(t, t), **nofollow)


def _write_file(image: LazyImage, node: Node, path: bytes) -> int:
    entry = node.data.entry
    fd = os.open(path, _FILE_FLAGS, 0o600)
    written = 0
    try:
        extents = getattr(entry, "sparse", None) or [(0, entry.size)]
        for ext_offset, length in extents:
            for off in range(ext_offset, ext_offset + length, _CHUNK):
                data = image.read(node, off, min(_CHUNK, ext_offset + length - off), record=False)
                os.pwrite(fd, data, off)
                written += len(data)
        os.ftruncate(fd, entry.size)  # holes after the last extent
        _set_attrs(path, node, fd=fd)
    finally:
        os.close(fd)
    return written


def write_tree(image: LazyImage, target: Path) -> Materialized:
    """Write ``image.tree`` (one layer's overlay tree) into the empty directory ``target``
    (see the module docstring); ``syncfs`` before returning, so a caller that records the
    directory complete never records a half-written one."""
    started = time.perf_counter()
    done = Materialized()
    root = bytes(target)
    dirs: list[tuple[bytes, Node]] = []
    first_path: dict[int, bytes] = {}  # id(data node) -> the path that holds the inode
    links: list[tuple[bytes, bytes]] = []
    for rel, node in image.tree.walk():
        path = os.path.join(root, _name(rel)) if rel else root
        if not rel:
            continue  # the layer directory itself is the snapshotter's (0755, root)
        data = node.data
        if id(data) in first_path:
            links.append((first_path[id(data)], path))
            continue
        kind = stat.S_IFMT(node.mode())
        if node.is_dir:
            os.mkdir(path, 0o700)
            dirs.append((path, node))
            continue
        first_path[id(data)] = path
        if kind == stat.S_IFREG:
            done.bytes_written += _write_file(image, node, path)
            done.files += 1
            continue
        entry = data.entry
        if kind == stat.S_IFLNK:
            os.symlink(_name(entry.link), path)
        elif kind in (stat.S_IFCHR, stat.S_IFBLK):
            os.mknod(path, kind | 0o600, os.makedev(entry.devmajor, entry.devminor))
        elif kind == stat.S_IFIFO:
            os.mkfifo(path, 0o600)
        else:
            raise FailedPreconditionError(f"{rel!r}: cannot write a file of type {kind:o}")
        _set_attrs(path, node)
        done.files += 1
    for source, path in links:
        os.link(source, path, follow_symlinks=False)
    for path, node in reversed(dirs):
        _set_attrs(path, node)
    _syncfs(root)
    done.seconds = time.perf_counter() - started
    return done


def _syncfs(path: bytes) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path!r}: {os.strerror(err)}")
    finally:
        os.close(fd)
