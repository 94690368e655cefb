"""The node-local chunk cache of lazy environments: compressed chunks on disk, by sha256.

A chunk is stored under the sha256 the manifest records for it (``chunks/ab/abcd...``):
content-addressed, so the same chunk in two snapshots is stored once, and verified against its
name every time it is read back: a damaged file is deleted and fetched again, never served.
Files are written under a temporary name (0600, ``O_EXCL | O_NOFOLLOW``) and renamed, so a
node killed mid-write leaves no torn entry (temporary names are removed at the next open).
The cache's directories are 0700 whatever the umask: what a job imports is its owner's.
There is no eviction: an environment is finite and the node ends with all of it (remove the
directory, or ``env.cache``, to reclaim the space).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from striped_fs import make_dir, write_private

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ChunkCache:
    """Compressed snapshot chunks under ``root``, keyed by their sha256."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = make_dir(root)
        self._dir = make_dir(self.root / "chunks", tighten=True)
        self.dropped_corrupt = 0
        for sub in self._dir.iterdir():
            if sub.is_dir() and not sub.is_symlink():
                for path in sub.iterdir():
                    if path.name.startswith(".tmp-"):
                        path.unlink(missing_ok=True)  # a write cut short by a crash

    def _path(self, sha256: str) -> Path:
        if not _SHA256.match(sha256):
            raise ValueError(f"not a sha256 digest: {sha256!r}")
        return self._dir / sha256[:2] / sha256

    def __contains__(self, sha256: str) -> bool:
        return self._path(sha256).is_file()

    def get(self, sha256: str) -> bytes | None:
        """The chunk's bytes, verified against ``sha256``; None when absent or damaged (a
        damaged file is removed: the caller fetches the chunk again)."""
        path = self._path(sha256)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, OSError):
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != sha256:
            log.warning("env cache: chunk %s is damaged on disk; removed, fetching again", sha256)
            self.dropped_corrupt += 1
            path.unlink(missing_ok=True)
            return None
        return data

    def put(self, sha256: str, data: bytes) -> None:
        """Store a chunk (checked against ``sha256`` here too: nothing unverified lands)."""
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError(f"chunk bytes do not match sha256 {sha256}")
        path = self._path(sha256)
        if path.is_file():
            return
        make_dir(path.parent)
        write_private(path, data)

    def size(self) -> int:
        """Bytes held (a walk: for reports, not for every read)."""
        return sum(p.stat().st_size for p in self._dir.glob("??/*") if p.is_file())
