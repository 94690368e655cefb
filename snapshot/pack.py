"""Pack a directory into a tar stream cut into independently compressed zstd chunks.

The walk is deterministic (sorted names), so the same tree gives the same stream. Chunks end
at member boundaries unless a member is larger than a chunk. Compression runs on a thread pool
(zstandard releases the GIL), and every finished chunk goes to ``sink`` as soon as it is ready,
so upload overlaps compression. Each regular file is also scanned once for the prefix it was
installed at (:func:`snapshot.relocate.classify_reference`), so that a restore to another
prefix knows which files to rewrite without reading the tree again.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from .errors import SnapshotError
from .manifest import DIR, FILE, HARDLINK, MAX_CHUNK_RAW, SYMLINK, Chunk, Member
from .relocate import classify_reference
from .safety import STATE_DIR, is_reserved

DEFAULT_CHUNK_SIZE = 2 << 20
"""2 MiB: a lazy mount fetches whole chunks, and what `import torch, numpy` reads lies in 40%
of the torch environment's 2-MiB chunks against 52% of its 8-MiB ones (docs/decisions.md)."""
DEFAULT_LEVEL = 9  # measured: 13% smaller than 3, decompression as fast (docs/decisions.md)
BLOCK = tarfile.BLOCKSIZE
READ_PIECE = 8 << 20

ChunkSink = Callable[[str, bytes], "Future[None] | None"]


@dataclass
class PackResult:
    members: list[Member]
    chunks: list[Chunk]
    stream_size: int
    files: int
    bytes: int
    prefix_refs: list[dict[str, str]] = field(default_factory=list)


@dataclass
class _Entry:
    path: str
    abspath: str
    st: os.stat_result
    kind: str
    link: str = ""


def walk(root: Path, exclude: frozenset[str] = frozenset({STATE_DIR})) -> Iterator[_Entry]:
    """Every entry under ``root`` in sorted depth-first order, never following symlinks."""
    seen_inodes: dict[tuple[int, int], str] = {}

    def visit(rel: str, abspath: str) -> Iterator[_Entry]:
        try:
            names = sorted(os.listdir(abspath))
        except OSError as exc:
            raise SnapshotError(f"cannot read directory {abspath}: {exc.strerror}") from exc
        for name in names:
            child_rel = f"{rel}/{name}" if rel else name
            if not rel and name in exclude:
                continue
            child = os.path.join(abspath, name)
            if not rel and is_reserved(name):
                raise SnapshotError(
                    f"cannot snapshot {child}: {name!r} is the same name as bootseer's state "
                    f"directory {STATE_DIR!r} on some filesystems, and a restore refuses it; "
                    f"remove it from the prefix"
                )
            st = os.lstat(child)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                yield _Entry(child_rel, child, st, DIR)
                yield from visit(child_rel, child)
            elif stat.S_ISLNK(mode):
                yield _Entry(child_rel, child, st, SYMLINK, os.readlink(child))
            elif stat.S_ISREG(mode):
                ident = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and ident in seen_inodes:
                    yield _Entry(child_rel, child, st, HARDLINK, seen_inodes[ident])
                else:
                    if st.st_nlink > 1:
                        seen_inodes[ident] = child_rel
                    yield _Entry(child_rel, child, st, FILE)
            else:
                what = (
                    "socket"
                    if stat.S_ISSOCK(mode)
                    else "FIFO"
                    if stat.S_ISFIFO(mode)
                    else "device node"
                )
                raise SnapshotError(
                    f"cannot snapshot {child}: it is a {what}, which a dependency snapshot may "
                    f"not hold; remove it from the prefix (or from the capture paths)"
                )

    yield from visit("", str(root))


def _header(entry: _Entry, size: int) -> bytes:
    info = tarfile.TarInfo(entry.path)
    info.mode = stat.S_IMODE(entry.st.st_mode)
    info.mtime = int(entry.st.st_mtime)  # exact nanoseconds live in the TOC
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.size = size
    info.type = {
        FILE: tarfile.REGTYPE,
        DIR: tarfile.DIRTYPE,
        SYMLINK: tarfile.SYMTYPE,
        HARDLINK: tarfile.LNKTYPE,
    }[entry.kind]
    info.linkname = entry.link
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class _Chunker:
    """Accumulates the tar stream; hands full chunks to the compressor pool."""

    def __init__(
        self,
        chunk_size: int,
        level: int,
        workers: int,
        sink: ChunkSink,
        publisher: str,
        on_chunk: Callable[[int, int], None] | None,
    ) -> None:
        self.chunk_size = chunk_size
        self.sink = sink
        self.publisher = publisher
        self.on_chunk = on_chunk
        self.buf = bytearray()
        self.offset = 0  # stream offset of buf[0]
        self.chunks: list[Chunk | None] = []
        self._local = threading.local()
        self._level = level
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="snapshot-pack")
        self._window = threading.BoundedSemaphore(workers * 2)
        self._pending: list[Future] = []

    @property
    def position(self) -> int:
        return self.offset + len(self.buf)

    def room(self) -> int:
        return self.chunk_size - len(self.buf)

    def add(self, data: bytes | memoryview) -> None:
        self.buf += data
        while len(self.buf) >= self.chunk_size:
            self._emit(self.chunk_size)

    def cut(self) -> None:
        """End the current chunk here (a member boundary)."""
        if self.buf:
            self._emit(len(self.buf))

    def _emit(self, n: int) -> None:
        raw = bytes(self.buf[:n])
        del self.buf[:n]
        index = len(self.chunks)
        self.chunks.append(None)
        offset = self.offset
        self.offset += n
        self._raise_failed()
        self._window.acquire()
        try:
            self._pending.append(self._pool.submit(self._compress, index, offset, raw))
        except BaseException:
            self._window.release()
            raise

    def _compress(self, index: int, offset: int, raw: bytes) -> None:
        try:
            comp = getattr(self._local, "comp", None)
            if comp is None:
                comp = self._local.comp = zstandard.ZstdCompressor(
                    level=self._level, write_content_size=True, write_checksum=True
                )
            data = comp.compress(raw)
            name = f"{self.publisher}/{index:06d}.tar.zst"
            self.chunks[index] = Chunk(
                name, offset, len(raw), len(data), hashlib.sha256(data).hexdigest()
            )
            done = self.sink(name, data)
            if done is not None:
                done.result()
            if self.on_chunk is not None:
                self.on_chunk(len(raw), len(data))
        finally:
            self._window.release()

    def _raise_failed(self) -> None:
        still = []
        for fut in self._pending:
            if fut.done():
                fut.result()  # raises a failed compression or upload in the caller
            else:
                still.append(fut)
        self._pending = still

    def finish(self) -> list[Chunk]:
        self.cut()
        try:
            for fut in self._pending:
                fut.result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
        return [c for c in self.chunks if c is not None]

    def abort(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def pack_tree(
    root: str | os.PathLike,
    sink: ChunkSink,
    *,
    publisher: str,
    prefix: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    level: int = DEFAULT_LEVEL,
    workers: int | None = None,
    paths: list[str] | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> PackResult:
    """Pack ``root`` (or only the relative ``paths`` under it, for a capture) into chunks.

    ``sink(name, data)`` stores one compressed chunk (it may return a future, waited for before
    the pack returns); ``prefix`` is the path the tree was installed at, scanned for in every
    file so that restores elsewhere know what to rewrite.
    """
    if not 0 < chunk_size <= MAX_CHUNK_RAW:
        raise ValueError(
            f"chunk_size {chunk_size} is outside 1..{MAX_CHUNK_RAW} bytes "
            f"(restores refuse larger chunks)"
        )
    root = Path(root)
    workers = workers or max(2, os.cpu_count() or 2)
    chunker = _Chunker(chunk_size, level, workers, sink, publisher, on_chunk)
    members: list[Member] = []
    refs: list[dict[str, str]] = []
    needle = prefix.encode() if prefix else None
    files = total = 0
    entries = walk(root) if paths is None else _selected(root, paths)
    try:
        for entry in entries:
            size = entry.st.st_size if entry.kind == FILE else 0
            header = _header(entry, size)
            padded = size + (-size % BLOCK)
            if chunker.buf and len(header) + padded > chunker.room():
                chunker.cut()
            chunker.add(header)
            members.append(
                Member(
                    entry.path,
                    entry.kind,
                    stat.S_IMODE(entry.st.st_mode),
                    entry.st.st_mtime_ns,
                    size,
                    chunker.position,
                    entry.link,
                )
            )
            if entry.kind == FILE:
                kind = _copy_file(entry, size, chunker, needle)
                if kind is not None:
                    refs.append({"path": entry.path, "kind": kind})
                files += 1
                total += size
        chunker.add(b"\0" * (2 * BLOCK))  # end-of-archive marker, for plain tar
        chunks = chunker.finish()
    except BaseException:
        chunker.abort()
        raise
    return PackResult(members, chunks, chunker.offset, files, total, refs)


def _copy_file(entry: _Entry, size: int, chunker: _Chunker, needle: bytes | None) -> str | None:
    """Append the file's data (padded to a block) and report how it references ``needle``."""
    kinds: set[str] = set()
    tail = b""
    got = 0
    try:
        fd = os.open(entry.abspath, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SnapshotError(f"cannot read {entry.abspath}: {exc.strerror}") from exc
    try:
        while got < size:
            piece = os.read(fd, min(READ_PIECE, size - got))
            if not piece:
                raise SnapshotError(
                    f"{entry.abspath} shrank while packing (was {size} bytes); "
                    f"do not change the prefix while a snapshot is taken"
                )
            chunker.add(piece)
            if needle is not None:
                kind = classify_reference(entry.path, tail + piece, needle)
                if kind is not None:
                    kinds.add(kind)
                elif b"\0" in piece:
                    kinds.add("nul")
                tail = piece[-len(needle) :]
            got += len(piece)
    finally:
        os.close(fd)
    chunker.add(b"\0" * (-size % BLOCK))
    refs = kinds - {"nul"}
    if not refs:
        return None
    if "pyc" in refs:
        return "pyc"
    # A file split into pieces is binary if any piece held a NUL byte.
    return "binary" if ("binary" in refs or "nul" in kinds) else "text"


def _selected(root: Path, paths: list[str]) -> Iterator[_Entry]:
    """Entries for the relative ``paths`` (a capture), with their parent directories first."""
    emitted: set[str] = set()
    seen_inodes: dict[tuple[int, int], str] = {}
    for rel in sorted(paths):
        parts = rel.split("/")
        for depth in range(1, len(parts) + 1):
            sub = "/".join(parts[:depth])
            if sub in emitted:
                continue
            abspath = os.path.join(root, sub)
            st = os.lstat(abspath)
            emitted.add(sub)
            if stat.S_ISDIR(st.st_mode):
                yield _Entry(sub, abspath, st, DIR)
            elif depth < len(parts):
                raise SnapshotError(f"{abspath} is not a directory")
            elif stat.S_ISLNK(st.st_mode):
                yield _Entry(sub, abspath, st, SYMLINK, os.readlink(abspath))
            elif stat.S_ISREG(st.st_mode):
                ident = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and ident in seen_inodes:
                    yield _Entry(sub, abspath, st, HARDLINK, seen_inodes[ident])
                else:
                    seen_inodes[ident] = sub
                    yield _Entry(sub, abspath, st, FILE)
            else:
                raise SnapshotError(f"cannot snapshot {abspath}: not a file, link or directory")
