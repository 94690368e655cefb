"""The snapshot format: a manifest (the commit point), a table of contents, and chunks.

A snapshot of a directory is one tar stream (POSIX/pax, readable by any tar) cut into chunks
that are compressed independently with zstd. Chunks end at member boundaries where they can; a
member larger than a chunk spans several. Concatenating the chunk objects gives one valid zstd
stream of the whole tar, so a person without bootseer can still restore it::

    cat <publisher>/*.tar.zst | zstd -d | tar -x -C /opt/venv

The table of contents (TOC) lists every member with its exact mtime in nanoseconds and the
offset of its data in the tar stream; restore extracts from the TOC (no header parsing, any
chunk in any order), and it is untrusted input like everything else here: every field is
checked before use (:func:`Manifest.from_json`, :mod:`snapshot.safety`).
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from . import FORMAT_VERSION
from .errors import CorruptSnapshotError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "bootseer-env-snapshot"
MAX_CHUNK_RAW = 64 << 20
"""Largest decompressed chunk a restore will allocate for, whatever a manifest declares: 32x
the packer's default chunk (8x the 8 MiB default of older snapshots), and with the restore's
fetches in flight (16) a hostile manifest within the caps still asks for at most 1 GiB."""
MAX_TOC_RAW = 1 << 30


def zstd_bound(raw_size: int) -> int:
    """The most bytes zstd compresses ``raw_size`` bytes to (``ZSTD_COMPRESSBOUND``)."""
    margin = ((128 << 10) - raw_size) >> 11 if raw_size < 128 << 10 else 0
    return raw_size + (raw_size >> 8) + margin


MAX_CHUNK_SIZE = zstd_bound(MAX_CHUNK_RAW)
"""Largest compressed chunk a restore will fetch: only that many bytes are ever read."""
MAX_TOC_SIZE = zstd_bound(MAX_TOC_RAW)

_CHUNK_NAME = re.compile(r"^[0-9a-f]{32}/[0-9]{6}\.tar\.zst$")
_TOC_NAME = re.compile(r"^[0-9a-f]{32}/toc\.json\.zst$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# TOC member kinds.
FILE, DIR, SYMLINK, HARDLINK = "f", "d", "l", "h"
KINDS = (FILE, DIR, SYMLINK, HARDLINK, "c", "b", "p")  # devices/FIFOs: parsed, then refused


@dataclass(frozen=True)
class Member:
    """One TOC entry. ``offset`` is where a file's data starts in the tar stream; ``link`` is a
    symlink's target (any string) or a hardlink's target member (a path inside the root)."""

    path: str
    kind: str
    mode: int
    mtime_ns: int
    size: int = 0
    offset: int = 0
    link: str = ""

    def to_row(self) -> list[Any]:
        return [self.path, self.kind, self.mode, self.mtime_ns, self.size, self.offset, self.link]

    @classmethod
    def from_row(cls, row: Any) -> Member:
        try:
            path, kind, mode, mtime_ns, size, offset, link = row
        except (TypeError, ValueError):
            raise CorruptSnapshotError(f"malformed TOC entry {str(row)[:200]!r}") from None
        if not (
            isinstance(path, str)
            and kind in KINDS
            and isinstance(link, str)
            and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for v in (mode, mtime_ns, size, offset)
            )
        ):
            raise CorruptSnapshotError(f"malformed TOC entry {str(row)[:200]!r}")
        return cls(path, kind, mode, mtime_ns, size, offset, link)


@dataclass(frozen=True)
class Chunk:
    """One compressed piece of the tar stream: raw bytes ``[offset, offset + raw_size)``."""

    name: str
    offset: int
    raw_size: int
    size: int
    sha256: str


@dataclass
class Manifest:
    """What a published snapshot holds; written last, so its presence means complete."""

    key: str
    kind: str  # "prefix" (a directory such as a venv) or "capture" (changes under paths)
    prefix: str  # the directory as packed: the venv prefix, or "/" for a capture
    chunks: list[Chunk]
    toc: dict[str, Any]  # {"name", "sha256", "size", "raw_size"}
    stream_size: int
    files: int
    bytes: int
    publisher: str
    created: float
    host: str = ""
    installer: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)
    prefix_refs: list[dict[str, str]] = field(default_factory=list)
    capture: dict[str, Any] = field(default_factory=dict)  # {"roots": [...], "deleted": [...]}
    format_version: int = FORMAT_VERSION

    @property
    def compressed_size(self) -> int:
        return sum(c.size for c in self.chunks) + int(self.toc.get("size", 0))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = FORMAT_NAME
        return data

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str) -> Manifest:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptSnapshotError(f"{where}: manifest is not JSON ({exc})") from None
        return cls.from_json(data, where=where)

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> Manifest:
        """Parse and check an untrusted manifest: names, sizes, offsets and digests."""

        def bad(why: str) -> CorruptSnapshotError:
            return CorruptSnapshotError(f"{where}: invalid snapshot manifest: {why}")

        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise bad("not a bootseer snapshot manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise bad(
                f"format version {data.get('format_version')!r}; this bootseer reads "
                f"version {FORMAT_VERSION} (upgrade bootseer, or rebuild the snapshot)"
            )
        try:
            chunks = [Chunk(**c) for c in data["chunks"]]
            manifest = cls(
                **{k: v for k, v in data.items() if k not in ("format", "chunks")}, chunks=chunks
            )
        except (KeyError, TypeError) as exc:
            raise bad(f"missing or unexpected field ({exc})") from None
        if manifest.kind not in ("prefix", "capture"):
            raise bad(f"unknown kind {manifest.kind!r}")
        expected = 0
        for i, chunk in enumerate(manifest.chunks):
            if not (isinstance(chunk.name, str) and _CHUNK_NAME.match(chunk.name)):
                raise bad(f"chunk {i} has an invalid name {chunk.name!r}")
            if not (isinstance(chunk.sha256, str) and _SHA256.match(chunk.sha256)):
                raise bad(f"chunk {chunk.name} has an invalid sha256")
            for value in (chunk.offset, chunk.raw_size, chunk.size):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise bad(f"chunk {chunk.name} has an invalid size or offset")
            if chunk.offset != expected:
                raise bad(f"chunk {chunk.name} starts at {chunk.offset}, expected {expected}")
            if chunk.raw_size > MAX_CHUNK_RAW or chunk.size > MAX_CHUNK_SIZE:
                raise bad(
                    f"chunk {chunk.name} declares {chunk.raw_size} bytes, "
                    f"{chunk.size} compressed (limits {MAX_CHUNK_RAW}, {MAX_CHUNK_SIZE})"
                )
            expected += chunk.raw_size
        if manifest.stream_size != expected:
            raise bad(f"stream size {manifest.stream_size} != sum of chunks {expected}")
        toc = manifest.toc
        if not (
            isinstance(toc, dict)
            and isinstance(toc.get("name"), str)
            and _TOC_NAME.match(toc["name"])
            and isinstance(toc.get("sha256"), str)
            and _SHA256.match(toc["sha256"])
            and _is_size(toc.get("raw_size"), MAX_TOC_RAW)
            and _is_size(toc.get("size"), MAX_TOC_SIZE)
        ):
            raise bad("the TOC reference is invalid")
        if not isinstance(manifest.prefix, str) or not manifest.prefix.startswith("/"):
            raise bad(f"prefix {manifest.prefix!r} is not an absolute path")
        return manifest


def _is_size(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def encode_toc(members: list[Member]) -> bytes:
    return json.dumps([m.to_row() for m in members], separators=(",", ":")).encode()


def decode_toc(raw: bytes, *, where: str) -> list[Member]:
    try:
        rows = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptSnapshotError(f"{where}: TOC is not JSON ({exc})") from None
    if not isinstance(rows, list):
        raise CorruptSnapshotError(f"{where}: TOC is not a list")
    return [Member.from_row(row) for row in rows]


def iter_chunk_spans(
    chunks: list[Chunk], start: int, end: int, offsets: list[int] | None = None
) -> Iterator[tuple[int, int, int]]:
    """(chunk index, start in chunk, end in chunk) pieces covering stream bytes [start, end);
    ``offsets`` (the chunks' start offsets) saves rebuilding them on every call."""
    if offsets is None:
        offsets = [c.offset for c in chunks]
    i = max(bisect.bisect_right(offsets, start) - 1, 0)
    while start < end and i < len(chunks):
        chunk = chunks[i]
        stop = min(end, chunk.offset + chunk.raw_size)
        if stop > start:
            yield i, start - chunk.offset, stop - chunk.offset
            start = stop
        i += 1
