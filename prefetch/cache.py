"""The node-local block cache: compressed frames on disk, decompressed frames in memory.

On disk, a frame is stored under its own sha256 (the digest the layer's TOC records for it):
content-addressed, so frames shared by images or layers are stored once, a frame is verified
against its name whenever it is read back (a damaged cache file is dropped and refetched,
never served), and the cache survives remounts and restarts with nothing to rebuild but its
size. Files are written to a temporary name and renamed, so a crash leaves no torn entry.
The cache is private to its owner whatever the umask: ``frames/`` and its directories are
0700, frames 0600 (a cache directory this creates is 0700 too; one given keeps its mode).
Eviction is least-recently-used by size, down to 90% of the limit when it is exceeded.

In memory, a small LRU of *decompressed* frames serves the many small reads a program makes
inside one frame (an import reads a .so page by page) without decompressing it each time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from striped_fs import create_private, make_dir

log = logging.getLogger(__name__)

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _check_digest(digest: str) -> str:
    digest = digest.removeprefix("sha256:")
    if not _DIGEST.match(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return digest


class BlockCache:
    """Compressed frames under ``root`` (bounded by ``max_bytes``), keyed by sha256."""

    def __init__(self, root: str | os.PathLike, max_bytes: int = 16 << 30) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        make_dir(self.root)
        self._dir = make_dir(self.root / "frames", tighten=True)
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # digest -> size, oldest first
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.dropped_corrupt = 0
        entries = []
        for sub in self._dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.name.startswith(".tmp-"):
                    path.unlink(missing_ok=True)  # a write interrupted by a crash
                    continue
                if _DIGEST.match(path.name):
                    st = path.stat()
                    entries.append((st.st_atime, path.name, st.st_size))
        for _, digest, size in sorted(entries):
            self._lru[digest] = size
            self._bytes += size

    @property
    def size(self) -> int:
        return self._bytes

    def _path(self, digest: str) -> Path:
        return self._dir / digest[:2] / digest

    def __contains__(self, digest: str) -> bool:
        return _check_digest(digest) in self._lru

    def get(self, digest: str) -> bytes | None:
        """The frame's compressed bytes, verified, or None (absent, or damaged and dropped)."""
        digest = _check_digest(digest)
        with self._lock:
            known = digest in self._lru
            if known:
                self._lru.move_to_end(digest)
        if not known:
            self.misses += 1
            return None
        try:
            data = self._path(digest).read_bytes()
        except FileNotFoundError:
            self._forget(digest)
            self.misses += 1
            return None
        if hashlib.sha256(data).hexdigest() != digest:
            log.warning(
                "block cache: frame %s is damaged on disk; dropped, will refetch", digest[:16]
            )
            self.dropped_corrupt += 1
            self._path(digest).unlink(missing_ok=True)
            self._forget(digest)
            self.misses += 1
            return None
        self.hits += 1
        return data

    def put(self, digest: str, data: bytes) -> None:
        """Store a frame whose sha256 the caller has checked (checked again here: cheap)."""
        digest = _check_digest(digest)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"frame bytes do not match sha256:{digest}")
        with self._lock:
            if digest in self._lru:
                self._lru.move_to_end(digest)
                return
        path = self._path(digest)
        make_dir(path.parent)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        with os.fdopen(create_private(tmp), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            if digest not in self._lru:
                self._lru[digest] = len(data)
                self._bytes += len(data)
            victims = self._evict_locked()
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def _forget(self, digest: str) -> None:
        with self._lock:
            size = self._lru.pop(digest, None)
            if size is not None:
                self._bytes -= size

    def _evict_locked(self) -> list[str]:
        if self._bytes <= self.max_bytes:
            return []
        goal = int(self.max_bytes * 0.9)
        victims = []
        while self._bytes > goal and self._lru:
            digest, size = self._lru.popitem(last=False)
            self._bytes -= size
            victims.append(digest)
        return victims

    def discard(self, digests: Iterable[str]) -> int:
        """Delete these frames (a removed layer's); returns how many were cached."""
        gone = 0
        for digest in digests:
            digest = _check_digest(digest)
            with self._lock:
                size = self._lru.pop(digest, None)
                if size is None:
                    continue
                self._bytes -= size
            self._path(digest).unlink(missing_ok=True)
            gone += 1
        return gone

    def clear(self) -> None:
        with self._lock:
            digests = list(self._lru)
            self._lru.clear()
            self._bytes = 0
        for digest in digests:
            self._path(digest).unlink(missing_ok=True)


class FrameMemory:
    """A bounded LRU of decompressed frames (key -> bytes), thread-safe."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._frames: OrderedDict[object, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: object) -> bytes | None:
        with self._lock:
            data = self._frames.get(key)
            if data is not None:
                self._frames.move_to_end(key)
            return data

    def put(self, key: object, data: bytes) -> None:
        with self._lock:
            old = self._frames.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._frames[key] = data
            self._bytes += len(data)
            while self._bytes > self.max_bytes and len(self._frames) > 1:
                _, dropped = self._frames.popitem(last=False)
                self._bytes -= len(dropped)
