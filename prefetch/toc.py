"""The TOC and seek table of bootseer's seekable layer format, and the index a reader builds.

A converted layer blob (written by :mod:`prefetch.layer`) is::

    [data frame 0][data frame 1]...[data frame N-1][TOC frame][seek table frame]

* data frames: ordinary zstd frames, each compressing one contiguous range of the layer's
  uncompressed tar stream (content size and XXH64 checksum in every frame);
* TOC frame: a zstd *skippable* frame with magic ``0x184D2A5B`` (:data:`TOC_FRAME_MAGIC`).
  Skippable magics run from ``0x184D2A50`` to ``0x184D2A5F``; ``0x184D2A5E`` is the seek
  table's, ``0x184D2A50`` is the one most tools pick for their own metadata, so bootseer takes
  one of the quiet ones. Its payload is a fixed header (:data:`TOC_HEADER`: the format name
  ``bootseer-layer``, the format version, the size and SHA-256 of the TOC JSON), followed by
  the TOC JSON, zstd-compressed;
* seek table frame: exactly the zstd "seekable format" (contrib/seekable_format of the zstd
  repository, version 0.1.0): skippable magic ``0x184D2A5E``, one entry per preceding frame
  (compressed size, decompressed size, XXH64 low 32 bits; the TOC frame is listed too, with
  decompressed size 0, as the spec asks for skippable frames), and the 9-byte footer ending
  in the seekable magic ``0x8F92EAB1``.

Every decompressor skips skippable frames, so ``zstd -d`` (and containerd's pull) sees only
the data frames, whose concatenated content is the original tar stream byte for byte. A
reader needs only the blob's tail: the footer gives the number of frames, hence the seek
table's size; the seek table's last entry is the TOC frame, which ends where the seek table
starts. Two ranged reads (often one, see :data:`TAIL_GUESS`) find everything.

Untrusted input: every size and count read from a blob is checked against the bytes before
it is used (frame count against the table size and the blob size, offsets monotonic and
inside the blob, per-frame and TOC size caps, the TOC JSON's size against the bytes it came in
and the tar stream's size, entries against the 512-byte headers the tar stream could hold, TOC
JSON checked field by field, member paths checked by :mod:`prefetch.safety`). Nothing is
allocated from an unchecked length; a data frame is decompressed only when it is exactly one
zstd frame whose header declares the seek table's size, into a buffer of that size.

Trust: the index (TOC frame and seek table, ``blob[toc_offset:]``) is bound to the image by the
digest the converter records in the layer descriptor (:data:`INDEX_ANNOTATION`, in the
digest-addressed manifest); a reader given that digest refuses an index that does not match it
before decoding anything (:meth:`LayerIndex.from_tail`). Each TOC entry is then checked against
the tar header it points at when the frame holding that header is decompressed
(:meth:`LayerIndex.verify_frame`, rules in :mod:`prefetch.members`).
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import json
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zstandard

from .errors import PrefetchError
from .safety import (
    ROOT,
    UnsafeMemberError,
    check_hardlink_target,
    check_member_path,
    check_symlink_target,
)

# --- format constants -------------------------------------------------------------------------

SEEK_TABLE_MAGIC = 0x184D2A5E  # zstd seekable format: the seek table's skippable frame
SEEKABLE_MAGIC = 0x8F92EAB1  # zstd seekable format: last 4 bytes of the blob
TOC_FRAME_MAGIC = 0x184D2A5B  # bootseer's TOC skippable frame
CHECKSUM_FLAG = 0x80  # Seek_Table_Descriptor bit 7
RESERVED_BITS = 0x7C  # Seek_Table_Descriptor bits 6-2, must be zero
EMPTY_XXH64_LOW32 = 0x51D8E999  # low 32 bits of XXH64(b""): the TOC frame's seek-table checksum

SKIPPABLE_HEADER = struct.Struct("<II")  # magic, Frame_Size
SEEK_FOOTER = struct.Struct("<IBI")  # Number_Of_Frames, Seek_Table_Descriptor, magic
SEEK_ENTRY = struct.Struct("<III")  # Compressed_Size, Decompressed_Size, Checksum
SEEK_ENTRY_NO_CHECKSUM = struct.Struct("<II")
TOC_HEADER = struct.Struct("<16sIQ32s")  # format name, version, JSON size, JSON SHA-256

FORMAT_NAME = b"bootseer-layer\0\0"
FORMAT_VERSION = 1
TOC_FORMAT = "bootseer-layer-toc"

# --- caps on what a blob may declare ----------------------------------------------------------

MAX_FRAMES = 0x8000000  # the seekable format's own limit on Number_Of_Frames
MAX_FRAME_RAW = 128 << 20  # uncompressed bytes in one data frame (converter: <= 2 x 64 MiB)
MAX_TOC_FRAME = 256 << 20  # compressed TOC frame
MAX_TOC_JSON = 1 << 30  # uncompressed TOC JSON (~5M entries)
# What a TOC may declare against the bytes it came in (measured on real and extreme layers: a
# site-packages layer's TOC JSON is 10.6x its compressed bytes and holds 0.64 JSON values
# ("{", "[" and "," counted) per compressed byte; 50,000 members of one name, the most
# repetitive TOC a tar makes, 48x and 4.2 values per byte): JSON bytes at most MAX_TOC_RATIO
# times the compressed bytes (plus a slack for one long repetitive string, an xattr), values
# at most MAX_TOC_VALUES_PER_BYTE per compressed byte (what Python allocates per entry), and
# JSON bytes at most TOC_JSON_PER_TAR_BYTE per byte of the tar stream (every byte of a name,
# link or xattr comes from the tar). All checked before decompressing or parsing.
MAX_TOC_RATIO = 1024
MAX_TOC_VALUES_PER_BYTE = 32
TOC_JSON_PER_TAR_BYTE = 16
TOC_JSON_SLACK = 1 << 20
TAR_BLOCK = 512  # every member needs at least one header block of the tar stream
MAX_HEADER_CHAIN = 16 << 20  # a member's header blocks (pax, GNU long names) before its data
MAX_XATTRS = 1024  # per entry
MAX_XATTR_BYTES = 1 << 20  # per entry, names and values together
MAX_ID = 2**32 - 1  # uid, gid, devmajor, devminor
MAX_INT = 2**63 - 1
# mtimes in ns: whole seconds in Go's int64, as archive/tar (hence containerd) reads a header;
# a time past 2262 (2**63 - 1 ns) is valid there, and shown by containerd's unpack as 1970.
MAX_MTIME_NS = 2**63 * 10**9 - 1
TAIL_GUESS = 256 << 10  # a first tail read of this size holds the whole index of most layers

TYPES = ("reg", "dir", "symlink", "hardlink", "char", "block", "fifo")
CONVERT_HINT = "convert the image with `bootseer image convert SRC DST`"

# The digest of the layer's index bytes (TOC frame + seek table), on each layer descriptor of a
# converted manifest: what binds the index read from a blob's tail to the manifest's digest.
INDEX_ANNOTATION = "io.bootseer.layer.index.digest"
RULE_BOUND = f"a converted layer's index must match the {INDEX_ANNOTATION} its manifest records"
RULE_MATCH = "a TOC entry must match the tar header it points at"
RULE_COMPLETE = "the TOC must list every member of the tar stream, in order"


# --- errors -----------------------------------------------------------------------------------


class LayerFormatError(PrefetchError):
    """Base class: a layer blob cannot be used as a bootseer seekable layer."""


class NotConvertedError(LayerFormatError):
    """The blob is not in bootseer's seekable format (a plain gzip/zstd layer, a truncated or
    foreign blob)."""

    def __init__(self, digest: str | None, why: str) -> None:
        name = digest or "(unknown digest)"
        super().__init__(
            f"layer {name} is not in bootseer's seekable format ({why}): {CONVERT_HINT}"
        )
        self.digest = digest
        self.why = why


class MalformedLayerError(LayerFormatError):
    """The blob claims the format but its seek table or TOC is inconsistent."""

    def __init__(self, digest: str | None, what: str) -> None:
        name = digest or "(unknown digest)"
        super().__init__(
            f"layer {name} has a malformed bootseer index: {what}; {CONVERT_HINT} again"
        )
        self.digest = digest
        self.what = what


class UnsafeLayerError(MalformedLayerError, UnsafeMemberError):
    """A TOC entry breaks an untrusted-input rule (caught by either base class)."""

    def __init__(self, digest: str | None, member: str, rule: str) -> None:
        what = f"refused member {member!r}: {rule}"
        name = digest or "(unknown digest)"
        Exception.__init__(
            self, f"layer {name} has a malformed bootseer index: {what}; {CONVERT_HINT} again"
        )
        self.digest = digest
        self.what = what
        self.member = member
        self.rule = rule


class UnboundIndexError(LayerFormatError):
    """The layer's index is not bound to its manifest (no or a malformed index digest
    annotation) or does not match the digest the manifest records: never trusted."""

    def __init__(self, digest: str | None, what: str) -> None:
        name = digest or "(unknown digest)"
        super().__init__(
            f"layer {name}: refused: {what} (rule: {RULE_BOUND}); {CONVERT_HINT} again"
        )
        self.digest = digest
        self.what = what
        self.rule = RULE_BOUND


class TocMismatchError(LayerFormatError):
    """A TOC entry does not match the tar header it points at, or the TOC leaves a member of
    the tar stream out: the lazy view would differ from a plain unpack of the blob."""

    def __init__(self, digest: str | None, member: str, rule: str, what: str) -> None:
        name = digest or "(unknown digest)"
        super().__init__(f"layer {name}: TOC entry {member!r} refused: {what} (rule: {rule})")
        self.digest = digest
        self.member = member
        self.rule = rule
        self.what = what


class FrameVerificationError(LayerFormatError):
    """A fetched frame does not match the TOC (corruption in storage or transit)."""

    def __init__(self, digest: str | None, frame: int, what: str) -> None:
        name = digest or "(unknown digest)"
        super().__init__(f"layer {name}: frame {frame} failed verification: {what}")
        self.digest = digest
        self.frame = frame


# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    """One data frame: its compressed range in the blob and the raw (tar) range it holds."""

    index: int
    c_offset: int
    c_size: int
    u_offset: int
    u_size: int
    sha256: str  # hex digest of the compressed frame bytes
    checksum: int = 0  # seek table checksum: XXH64 low 32 bits of the content

    @property
    def c_end(self) -> int:
        return self.c_offset + self.c_size

    @property
    def u_end(self) -> int:
        return self.u_offset + self.u_size

    def to_json(self) -> list[Any]:
        return [self.c_offset, self.c_size, self.u_offset, self.u_size, self.sha256]


@dataclass(frozen=True, slots=True)
class TocEntry:
    """One tar member as the TOC records it.

    ``offset`` is where the member's data starts in the tar stream, ``header_offset`` where its
    first header block (pax/GNU extension headers included) starts. ``size`` is the file's size;
    for sparse files ``sparse`` lists the (offset in file, length) of the stored extents, which
    lie back to back from ``offset`` in the tar stream.
    """

    name: str
    type: str
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    uname: str = ""
    gname: str = ""
    size: int = 0
    mtime_ns: int = 0
    link: str = ""
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    offset: int = 0
    header_offset: int = 0
    sparse: tuple[tuple[int, int], ...] | None = None

    @property
    def stored_size(self) -> int:
        """Bytes of data the member occupies in the tar stream (padding excluded)."""
        if self.type != "reg":
            return 0
        if self.sparse is not None:
            return sum(n for _, n in self.sparse)
        return self.size

    @property
    def data_end(self) -> int:
        return self.offset + self.stored_size

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "type": self.type,
            "mode": self.mode,
            "uid": self.uid,
            "gid": self.gid,
        }
        if self.uname:
            doc["uname"] = self.uname
        if self.gname:
            doc["gname"] = self.gname
        doc["size"] = self.size
        doc["mtime"] = self.mtime_ns
        if self.link:
            doc["link"] = self.link
        if self.type in ("char", "block"):
            doc["devmajor"] = self.devmajor
            doc["devminor"] = self.devminor
        if self.xattrs:
            doc["xattrs"] = {k: base64.b64encode(v).decode("ascii") for k, v in self.xattrs.items()}
        doc["offset"] = self.offset
        doc["header"] = self.header_offset
        if self.sparse is not None:
            doc["sparse"] = [list(x) for x in self.sparse]
        return doc


# --- encoding (used by the converter, and by tests that craft blobs) --------------------------


def skippable_frame(magic: int, payload: bytes) -> bytes:
    if not 0x184D2A50 <= magic <= 0x184D2A5F:
        raise ValueError(f"{magic:#x} is not a zstd skippable frame magic")
    return SKIPPABLE_HEADER.pack(magic, len(payload)) + payload


def encode_toc_frame(toc: dict[str, Any], level: int = 9) -> bytes:
    """The TOC skippable frame for a TOC document (see :func:`toc_document`)."""
    doc = json.dumps(toc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    header = TOC_HEADER.pack(FORMAT_NAME, FORMAT_VERSION, len(doc), hashlib.sha256(doc).digest())
    compressed = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(doc)
    return skippable_frame(TOC_FRAME_MAGIC, header + compressed)


def encode_seek_table(entries: Sequence[tuple[int, int, int]]) -> bytes:
    """The seek table frame for (compressed size, decompressed size, checksum) per frame."""
    body = b"".join(SEEK_ENTRY.pack(c, d, x & 0xFFFFFFFF) for c, d, x in entries)
    footer = SEEK_FOOTER.pack(len(entries), CHECKSUM_FLAG, SEEKABLE_MAGIC)
    return skippable_frame(SEEK_TABLE_MAGIC, body + footer)


def toc_document(
    *,
    tar_size: int,
    diff_id: str,
    frames: Iterable[Frame],
    entries: Iterable[TocEntry],
    frame_size: int,
    level: int,
) -> dict[str, Any]:
    return {
        "format": TOC_FORMAT,
        "version": FORMAT_VERSION,
        "tar_size": tar_size,
        "diff_id": diff_id,
        "frame_size": frame_size,
        "level": level,
        "frames": [f.to_json() for f in frames],
        "entries": [e.to_json() for e in entries],
    }


# --- decoding ---------------------------------------------------------------------------------


def _is_int(value: Any, lo: int = 0, hi: int = MAX_INT) -> bool:
    return type(value) is int and lo <= value <= hi


class _TocChecker:
    """Checks a decoded TOC document field by field; every complaint names where it is."""

    def __init__(self, digest: str | None) -> None:
        self.digest = digest

    def fail(self, what: str) -> MalformedLayerError:
        return MalformedLayerError(self.digest, what)

    def unsafe(self, exc: UnsafeMemberError) -> UnsafeLayerError:
        return UnsafeLayerError(self.digest, exc.member, exc.rule)

    def entry(self, i: int, doc: Any, tar_size: int) -> TocEntry:
        if not isinstance(doc, dict):
            raise self.fail(f"TOC entry {i} is not an object")
        name = doc.get("name")
        if not isinstance(name, str):
            raise self.fail(f"TOC entry {i} has no name")
        where = f"TOC entry {i} ({name!r})"
        try:
            check_member_path(name)
        except UnsafeMemberError as exc:
            raise self.unsafe(exc) from None
        kind = doc.get("type")
        if kind not in TYPES:
            raise self.fail(f"{where}: unknown type {kind!r}")
        if name == ROOT and kind != "dir":
            raise self.fail(f"{where}: the root is not a directory")
        ints = {}
        for key, hi, default in (
            ("mode", 0o7777, None),
            ("uid", MAX_ID, 0),
            ("gid", MAX_ID, 0),
            ("size", MAX_INT, None),
            ("offset", tar_size, None),
            ("header", tar_size, None),
            ("devmajor", MAX_ID, 0),
            ("devminor", MAX_ID, 0),
        ):
            value = doc.get(key, default)
            if not _is_int(value, 0, hi):
                raise self.fail(f"{where}: {key} {value!r} is not an integer in [0, {hi}]")
            ints[key] = value
        mtime = doc.get("mtime", 0)
        if not _is_int(mtime, -MAX_MTIME_NS, MAX_MTIME_NS):
            raise self.fail(
                f"{where}: mtime {mtime!r} is not an integer in [-{MAX_MTIME_NS}, {MAX_MTIME_NS}]"
            )
        names = {}
        for key in ("uname", "gname", "link"):
            value = doc.get(key, "")
            if not isinstance(value, str) or len(value) > 4096:
                raise self.fail(f"{where}: {key} is not a string of at most 4096 characters")
            names[key] = value
        link = names["link"]
        try:
            if kind == "hardlink":
                link = check_hardlink_target(name, link)
            elif kind == "symlink":
                link = check_symlink_target(name, link)
            elif link:
                raise self.fail(f"{where}: a {kind} entry has a link target")
        except UnsafeMemberError as exc:
            raise self.unsafe(exc) from None
        if kind != "reg" and ints["size"] != 0:
            raise self.fail(f"{where}: a {kind} entry declares {ints['size']} bytes of data")
        if kind not in ("char", "block") and (ints["devmajor"] or ints["devminor"]):
            raise self.fail(f"{where}: a {kind} entry has device numbers")
        xattrs = self.xattrs(where, doc.get("xattrs", {}))
        sparse = self.sparse(where, doc.get("sparse"), kind, ints["size"])
        entry = TocEntry(
            name=name,
            type=kind,
            mode=ints["mode"],
            uid=ints["uid"],
            gid=ints["gid"],
            uname=names["uname"],
            gname=names["gname"],
            size=ints["size"],
            mtime_ns=mtime,
            link=link,
            devmajor=ints["devmajor"],
            devminor=ints["devminor"],
            xattrs=xattrs,
            offset=ints["offset"],
            header_offset=ints["header"],
            sparse=sparse,
        )
        if not entry.header_offset < entry.offset <= entry.header_offset + MAX_HEADER_CHAIN:
            raise self.fail(
                f"{where}: data offset {entry.offset} does not follow its header "
                f"{entry.header_offset} (1 to {MAX_HEADER_CHAIN} bytes of headers)"
            )
        if entry.data_end > tar_size:
            raise self.fail(
                f"{where}: data [{entry.offset}, {entry.data_end}) lies beyond the "
                f"tar stream ({tar_size} bytes)"
            )
        return entry

    def xattrs(self, where: str, doc: Any) -> dict[str, bytes]:
        if not isinstance(doc, dict) or len(doc) > MAX_XATTRS:
            raise self.fail(f"{where}: xattrs is not an object of at most {MAX_XATTRS} items")
        out: dict[str, bytes] = {}
        total = 0
        for key, value in doc.items():
            if not key or "\0" in key or not isinstance(value, str):
                raise self.fail(f"{where}: invalid xattr {key!r}")
            total += len(key) + len(value)
            if total > MAX_XATTR_BYTES * 2:
                raise self.fail(f"{where}: xattrs larger than {MAX_XATTR_BYTES} bytes")
            try:
                out[key] = base64.b64decode(value, validate=True)
            except ValueError:
                raise self.fail(f"{where}: xattr {key!r} is not base64") from None
        return out

    def sparse(
        self, where: str, doc: Any, kind: str, size: int
    ) -> tuple[tuple[int, int], ...] | None:
        if doc is None:
            return None
        if kind != "reg" or not isinstance(doc, list):
            raise self.fail(f"{where}: invalid sparse map")
        out = []
        end = 0
        for item in doc:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not all(_is_int(x) for x in item)
                or item[0] < end
                or item[0] + item[1] > size
            ):
                raise self.fail(
                    f"{where}: sparse extent {item!r} is out of order or beyond "
                    f"the file size {size}"
                )
            end = item[0] + item[1]
            out.append((item[0], item[1]))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class _Table:
    """The parsed seek table: entries and where the table and TOC frame lie."""

    sizes: list[tuple[int, int, int]]  # (compressed, decompressed, checksum) per frame
    table_offset: int
    toc_offset: int


class LayerIndex:
    """What a reader knows about a converted layer: its frames and its TOC entries.

    Build it from the blob's tail (:meth:`parse_tail` / :meth:`from_tail`) or through a range
    reader (:meth:`from_blob`). All ranges are half-open ``(start, end)`` byte offsets.
    """

    def __init__(
        self,
        *,
        digest: str | None,
        blob_size: int,
        tar_size: int,
        diff_id: str,
        frames: list[Frame],
        entries: list[TocEntry],
        toc_offset: int,
        table_offset: int,
        frame_size: int,
        level: int,
    ) -> None:
        self.digest = digest
        self.blob_size = blob_size
        self.tar_size = tar_size
        self.diff_id = diff_id
        self.frames = frames
        self.entries = entries
        self.toc_offset = toc_offset
        self.table_offset = table_offset
        self.frame_size = frame_size
        self.level = level
        self._u_starts = [f.u_offset for f in frames]
        self._h_starts = [e.header_offset for e in entries]
        self.verified: set[int] = set()  # frames whose entries passed verify_frame
        self.index_digest: str | None = None  # set when built against the manifest's digest
        self._by_name: dict[str, int] = {}
        for i, entry in enumerate(entries):
            self._by_name[entry.name] = i  # a later member of the same name replaces an earlier

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def parse_tail(
        cls, tail: bytes, blob_size: int, digest: str | None = None
    ) -> list[tuple[int, int]]:
        """The ranges, beyond ``tail`` (the blob's last ``len(tail)`` bytes), still needed to
        build the index; empty when ``tail`` is enough for :meth:`from_tail`.

        Call again with the longer tail: the first answer may only reach the seek table.
        """
        need = cls._parse(tail, blob_size, digest, build=False)
        assert isinstance(need, list)
        return need

    @classmethod
    def from_tail(
        cls,
        tail: bytes,
        blob_size: int,
        digest: str | None = None,
        *,
        index_digest: str | None = None,
    ) -> LayerIndex:
        """The index from a tail that :meth:`parse_tail` found sufficient.

        With ``index_digest`` (the manifest's :data:`INDEX_ANNOTATION`), the index bytes must
        hash to it, checked before the TOC is decoded (:class:`UnboundIndexError`)."""
        index = cls._parse(tail, blob_size, digest, build=True, index_digest=index_digest)
        if isinstance(index, list):
            raise ValueError(
                f"the tail ({len(tail)} bytes) does not hold the whole index; fetch {index} first"
            )
        return index

    @classmethod
    def from_blob(
        cls,
        read_range: Callable[[int, int], bytes],
        blob_size: int,
        digest: str | None = None,
        *,
        index_digest: str | None = None,
    ) -> LayerIndex:
        """The index of a blob read through ``read_range(start, end)`` (half-open)."""
        return cls.from_tail(
            cls.fetch_tail(read_range, blob_size, digest),
            blob_size,
            digest,
            index_digest=index_digest,
        )

    @classmethod
    def fetch_tail(
        cls, read_range: Callable[[int, int], bytes], blob_size: int, digest: str | None = None
    ) -> bytes:
        """The shortest tail of the blob that holds its whole index (what a node keeps to
        build the index again without the registry: :meth:`from_tail`)."""
        if not _is_int(blob_size):
            raise ValueError(f"invalid blob size {blob_size!r}")
        start = max(0, blob_size - TAIL_GUESS)
        tail = _read_exact(read_range, start, blob_size)
        for _ in range(3):
            need = cls.parse_tail(tail, blob_size, digest)
            if not need:
                return tail
            lo = min(s for s, _ in need)
            tail = _read_exact(read_range, lo, blob_size - len(tail)) + tail
        raise MalformedLayerError(digest, "the index could not be located")  # pragma: no cover

    @classmethod
    def _parse(
        cls,
        tail: bytes,
        blob_size: int,
        digest: str | None,
        *,
        build: bool,
        index_digest: str | None = None,
    ) -> LayerIndex | list[tuple[int, int]]:
        if not _is_int(blob_size) or len(tail) > blob_size:
            raise ValueError(f"tail of {len(tail)} bytes for a blob of {blob_size!r} bytes")
        held = blob_size - len(tail)  # the tail holds [held, blob_size)
        minimum = SKIPPABLE_HEADER.size + SEEK_FOOTER.size
        if blob_size < minimum:
            raise NotConvertedError(digest, f"{blob_size} bytes, too short to end in a seek table")
        if len(tail) < minimum:
            return [(max(0, blob_size - TAIL_GUESS), held)]
        table = cls._seek_table(tail, blob_size, digest)
        if isinstance(table, list):
            return table
        if table.toc_offset < held:
            return [(table.toc_offset, held)]
        if not build:
            return []
        if index_digest is not None:
            got = "sha256:" + hashlib.sha256(tail[table.toc_offset - held :]).hexdigest()
            if got != index_digest:
                raise UnboundIndexError(
                    digest,
                    f"its index (TOC and seek table, bytes {table.toc_offset}-"
                    f"{blob_size}) has digest {got}, the manifest records "
                    f"{index_digest}",
                )
        toc_bytes = tail[table.toc_offset - held : table.table_offset - held]
        tar_size = sum(d for _, d, _ in table.sizes[:-1])
        doc = _decode_toc_frame(toc_bytes, digest, tar_size=tar_size)
        index = cls._from_document(doc, table, blob_size, digest)
        index.index_digest = index_digest
        return index

    @staticmethod
    def _seek_table(
        tail: bytes, blob_size: int, digest: str | None
    ) -> _Table | list[tuple[int, int]]:
        held = blob_size - len(tail)
        count, descriptor, magic = SEEK_FOOTER.unpack_from(tail, len(tail) - SEEK_FOOTER.size)
        if magic != SEEKABLE_MAGIC:
            raise NotConvertedError(digest, "no zstd seek table at the end of the blob")
        if descriptor & RESERVED_BITS:
            raise MalformedLayerError(
                digest, f"seek table descriptor {descriptor:#04x} sets reserved bits"
            )
        if count == 0:
            raise NotConvertedError(digest, "the seek table lists no frames")
        if count > MAX_FRAMES:
            raise MalformedLayerError(
                digest,
                f"seek table declares {count} frames, more than the format's limit of {MAX_FRAMES}",
            )
        entry = SEEK_ENTRY if descriptor & CHECKSUM_FLAG else SEEK_ENTRY_NO_CHECKSUM
        table_size = SKIPPABLE_HEADER.size + count * entry.size + SEEK_FOOTER.size
        if table_size > blob_size:
            raise MalformedLayerError(
                digest,
                f"seek table declares {count} frames ({table_size} bytes of table), "
                f"more than the {blob_size}-byte blob can hold",
            )
        table_offset = blob_size - table_size
        if table_offset < held:
            return [(table_offset, held)]
        base = table_offset - held
        magic, frame_size = SKIPPABLE_HEADER.unpack_from(tail, base)
        if magic != SEEK_TABLE_MAGIC or frame_size != table_size - SKIPPABLE_HEADER.size:
            raise MalformedLayerError(
                digest,
                f"seek table footer declares {count} frames but no {table_size}-byte "
                f"seek table frame precedes it (frame count beyond the table)",
            )
        sizes: list[tuple[int, int, int]] = []
        pos = base + SKIPPABLE_HEADER.size
        total = 0
        for _ in range(count):
            fields = entry.unpack_from(tail, pos)
            pos += entry.size
            c, d = fields[0], fields[1]
            sizes.append((c, d, fields[2] if len(fields) == 3 else 0))
            total += c
        if total != table_offset:
            raise MalformedLayerError(
                digest,
                f"the seek table's frames cover {total} bytes but the seek table starts "
                f"at byte {table_offset} (frames overlap or leave gaps)",
            )
        toc_c, toc_d, _ = sizes[-1]
        if toc_d != 0:
            raise NotConvertedError(digest, "a zstd seekable blob without a bootseer TOC frame")
        if not SKIPPABLE_HEADER.size + TOC_HEADER.size < toc_c <= MAX_TOC_FRAME:
            raise MalformedLayerError(
                digest,
                f"TOC frame of {toc_c} bytes (allowed: "
                f"{SKIPPABLE_HEADER.size + TOC_HEADER.size + 1} to "
                f"{MAX_TOC_FRAME})",
            )
        return _Table(sizes=sizes, table_offset=table_offset, toc_offset=table_offset - toc_c)

    @classmethod
    def _from_document(
        cls, doc: Any, table: _Table, blob_size: int, digest: str | None
    ) -> LayerIndex:
        check = _TocChecker(digest)
        if not isinstance(doc, dict) or doc.get("format") != TOC_FORMAT:
            raise check.fail("the TOC is not a bootseer layer TOC document")
        if doc.get("version") != FORMAT_VERSION:
            raise check.fail(
                f"TOC version {doc.get('version')!r}, this bootseer reads {FORMAT_VERSION}"
            )
        tar_size = doc.get("tar_size")
        if not _is_int(tar_size):
            raise check.fail(f"tar_size {tar_size!r} is not a non-negative integer")
        diff_id = doc.get("diff_id", "")
        frame_size = doc.get("frame_size", 0)
        level = doc.get("level", 0)
        if not isinstance(diff_id, str) or not _is_int(frame_size) or not _is_int(level, -1000):
            raise check.fail("diff_id, frame_size or level has the wrong type")
        frames = cls._frames(check, doc.get("frames"), table, tar_size)
        raw_entries = doc.get("entries")
        if not isinstance(raw_entries, list):
            raise check.fail("the TOC has no entries list")
        if len(raw_entries) > tar_size // TAR_BLOCK:
            raise check.fail(
                f"the TOC declares {len(raw_entries)} entries, more than the "
                f"{tar_size // TAR_BLOCK} headers of {TAR_BLOCK} bytes a "
                f"{tar_size}-byte tar stream can hold"
            )
        entries = []
        previous_end = 0
        for i, raw in enumerate(raw_entries):
            entry = check.entry(i, raw, tar_size)
            if i == 0 and entry.header_offset != 0:
                raise check.fail(
                    f"TOC entry 0 ({entry.name!r}) starts at "
                    f"{entry.header_offset}, not at the tar stream's first byte "
                    "(members left out)"
                )
            if entry.header_offset < previous_end:
                raise check.fail(
                    f"TOC entry {i} ({entry.name!r}) starts at {entry.header_offset}"
                    f", inside the previous member (ends at {previous_end})"
                )
            previous_end = entry.data_end
            entries.append(entry)
        return cls(
            digest=digest,
            blob_size=blob_size,
            tar_size=tar_size,
            diff_id=diff_id,
            frames=frames,
            entries=entries,
            toc_offset=table.toc_offset,
            table_offset=table.table_offset,
            frame_size=frame_size,
            level=level,
        )

    @staticmethod
    def _frames(check: _TocChecker, doc: Any, table: _Table, tar_size: int) -> list[Frame]:
        data_sizes = table.sizes[:-1]
        if not isinstance(doc, list) or len(doc) != len(data_sizes):
            n = len(doc) if isinstance(doc, list) else "no"
            raise check.fail(f"the TOC lists {n} frames, the seek table {len(data_sizes)}")
        frames = []
        c_off = u_off = 0
        for i, ((c, d, checksum), item) in enumerate(zip(data_sizes, doc, strict=True)):
            if not 0 < d <= MAX_FRAME_RAW:
                raise check.fail(
                    f"frame {i} declares {d} uncompressed bytes (allowed: 1 to {MAX_FRAME_RAW})"
                )
            if not 0 < c <= _compress_bound(d):
                raise check.fail(
                    f"frame {i} declares {c} compressed bytes for {d} bytes of "
                    "content, more than zstd can produce"
                )
            if (
                not isinstance(item, list)
                or len(item) != 5
                or item[:4] != [c_off, c, u_off, d]
                or not isinstance(item[4], str)
                or len(item[4]) != 64
            ):
                raise check.fail(
                    f"frame {i}: the TOC says {item!r}, the seek table "
                    f"[{c_off}, {c}, {u_off}, {d}, <sha256>] (overlapping or "
                    "misplaced frames)"
                )
            try:
                bytes.fromhex(item[4])
            except ValueError:
                raise check.fail(f"frame {i}: sha256 {item[4]!r} is not hex") from None
            frames.append(Frame(i, c_off, c, u_off, d, item[4].lower(), checksum))
            c_off += c
            u_off += d
        if u_off != tar_size:
            raise check.fail(
                f"the frames hold {u_off} bytes of tar stream, the TOC says {tar_size}"
            )
        if c_off != table.toc_offset:
            raise check.fail(
                f"the data frames end at {c_off}, the TOC frame starts at {table.toc_offset}"
            )
        return frames

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, path: str) -> TocEntry | None:
        """The entry for ``path`` (``usr/bin/x``, ``/usr/bin/x`` or ``./usr/bin/x``); the last
        one when the layer holds the name twice, as extraction would leave it."""
        parts = [p for p in path.split("/") if p not in ("", ".")]
        i = self._by_name.get("/".join(parts) if parts else ROOT)
        return None if i is None else self.entries[i]

    def frames_for(self, raw_start: int, raw_end: int) -> range:
        """Indices of the frames holding tar bytes ``[raw_start, raw_end)``."""
        raw_start = max(0, raw_start)
        raw_end = min(raw_end, self.tar_size)
        if raw_end <= raw_start:
            return range(0)
        first = bisect.bisect_right(self._u_starts, raw_start) - 1
        last = bisect.bisect_left(self._u_starts, raw_end)
        return range(first, last)

    def frame_range(self, i: int) -> tuple[int, int]:
        """The compressed byte range ``(start, end)`` of frame ``i`` in the blob."""
        frame = self.frames[i]
        return frame.c_offset, frame.c_end

    def decompress_frame(self, i: int, data: bytes) -> bytes:
        """Frame ``i``'s content from its compressed bytes, verified (size, SHA-256, one zstd
        frame declaring the seek table's content size) before anything is decompressed."""
        frame = self.frames[i]
        if len(data) != frame.c_size:
            raise FrameVerificationError(
                self.digest,
                i,
                f"got {len(data)} bytes, expected "
                f"{frame.c_size} (blob bytes "
                f"{frame.c_offset}-{frame.c_end})",
            )
        got = hashlib.sha256(data).hexdigest()
        if got != frame.sha256:
            raise FrameVerificationError(
                self.digest,
                i,
                f"sha256 {got}, expected {frame.sha256}"
                f" (blob bytes {frame.c_offset}-"
                f"{frame.c_end})",
            )
        try:
            return decompress_bounded(data, frame.u_size)
        except ValueError as exc:
            raise FrameVerificationError(self.digest, i, str(exc)) from None

    def frame_of(self, raw_offset: int) -> int:
        """The index of the frame holding tar byte ``raw_offset`` (< tar_size)."""
        return bisect.bisect_right(self._u_starts, raw_offset) - 1

    def verify_frame(self, i: int, content: bytes, load: Callable[[int], bytes]) -> None:
        """Check every TOC entry whose header starts in frame ``i`` against the tar headers in
        ``content`` (the frame, decompressed and verified against its sha256): the member
        the header describes must be the entry (name, type, size, link target, mode, owner,
        times, xattrs, data offset) and must end where the next entry starts (or, for the last
        one, where the end-of-archive block lies), so no member is left out. ``load(j)`` gives
        another frame's content, for headers that run on into the next frame. Raises
        :class:`TocMismatchError` naming the member and the rule; a frame that passed is
        remembered (:attr:`verified`)."""
        if i in self.verified:
            return
        from .members import verify_entries  # members builds TocEntry: imported late

        frame = self.frames[i]
        lo = bisect.bisect_left(self._h_starts, frame.u_offset)
        hi = bisect.bisect_left(self._h_starts, frame.u_end)
        if lo < hi or (not self.entries and frame.u_offset == 0):
            verify_entries(self, range(lo, hi), _FrameBytes(self, i, content, load))
        self.verified.add(i)

    def _load_frame(self, read_range: Callable[[int, int], bytes], i: int) -> bytes:
        frame = self.frames[i]
        return self.decompress_frame(i, _read_exact(read_range, frame.c_offset, frame.c_end))

    def verify_header_of(self, entry: TocEntry, read_range: Callable[[int, int], bytes]) -> None:
        """Make sure ``entry`` was checked against its tar header (fetching the frame that
        holds it when it was not)."""
        if self.tar_size == 0:
            return
        self.fetch_and_verify(
            read_range, self.frame_of(min(entry.header_offset, self.tar_size - 1))
        )

    def fetch_and_verify(self, read_range: Callable[[int, int], bytes], i: int) -> None:
        """Frame ``i`` fetched, decompressed and its entries checked (:meth:`verify_frame`),
        unless that was done already."""
        if i not in self.verified:
            self.verify_frame(
                i, self._load_frame(read_range, i), lambda j: self._load_frame(read_range, j)
            )

    def read_raw(
        self, read_range: Callable[[int, int], bytes], raw_start: int, raw_end: int
    ) -> bytes:
        """Tar bytes ``[raw_start, raw_end)``, fetching exactly the frames that hold them in
        one coalesced ``read_range`` call (each frame verified, :meth:`verify_frame`)."""
        frames = self.frames_for(raw_start, raw_end)
        if not frames:
            return b""
        first, last = self.frames[frames[0]], self.frames[frames[-1]]
        blob = _read_exact(read_range, first.c_offset, last.c_end)
        parts = []
        for i in frames:
            frame = self.frames[i]
            content = self.decompress_frame(
                i, blob[frame.c_offset - first.c_offset : frame.c_end - first.c_offset]
            )
            self.verify_frame(i, content, lambda j: self._load_frame(read_range, j))
            lo = max(raw_start, frame.u_offset) - frame.u_offset
            hi = min(raw_end, frame.u_end) - frame.u_offset
            parts.append(content[lo:hi])
        return b"".join(parts)

    def read(
        self,
        entry: TocEntry | str,
        read_range: Callable[[int, int], bytes],
        offset: int = 0,
        size: int | None = None,
    ) -> bytes:
        """Bytes ``[offset, offset + size)`` of a regular file (or of a hardlink's target in this
        layer), fetching only the frames that hold them."""
        if isinstance(entry, str):
            found = self.lookup(entry)
            if found is None:
                raise FileNotFoundError(entry)
            entry = found
        if entry.type == "hardlink":
            target = self.lookup(entry.link)
            if target is None:
                raise FileNotFoundError(
                    f"{entry.name}: hardlink target {entry.link!r} is not in this layer"
                )
            entry = target
        if entry.type != "reg":
            raise IsADirectoryError(f"{entry.name} is a {entry.type}, not a regular file")
        self.verify_header_of(entry, read_range)
        offset = max(0, offset)
        end = entry.size if size is None else min(entry.size, offset + max(0, size))
        if end <= offset:
            return b""
        if entry.sparse is None:
            return self.read_raw(read_range, entry.offset + offset, entry.offset + end)
        out = bytearray(end - offset)
        stored = entry.offset
        for ext_off, ext_len in entry.sparse:
            lo, hi = max(offset, ext_off), min(end, ext_off + ext_len)
            if lo < hi:
                out[lo - offset : hi - offset] = self.read_raw(
                    read_range, stored + lo - ext_off, stored + hi - ext_off
                )
            stored += ext_len
        return bytes(out)


def _compress_bound(size: int) -> int:
    """ZSTD_COMPRESSBOUND plus room for a frame header and checksum."""
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small + 64


def _read_exact(read_range: Callable[[int, int], bytes], start: int, end: int) -> bytes:
    data = bytes(read_range(start, end)) if end > start else b""
    if len(data) != end - start:
        raise OSError(f"short read: bytes [{start}, {end}) gave {len(data)} bytes")
    return data


def _decode_toc_frame(frame: bytes, digest: str | None, *, tar_size: int | None = None) -> Any:
    """The TOC document of a TOC skippable frame; its declared JSON size is checked against
    the caps, the compressed bytes (:data:`MAX_TOC_RATIO`) and the tar stream's size (from the
    seek table) before anything is decompressed."""
    magic, size = SKIPPABLE_HEADER.unpack_from(frame, 0)
    if magic != TOC_FRAME_MAGIC:
        raise NotConvertedError(digest, "the frame before the seek table is not a bootseer TOC")
    if size != len(frame) - SKIPPABLE_HEADER.size:
        raise MalformedLayerError(
            digest,
            f"TOC frame declares {size} bytes, the seek table {len(frame) - SKIPPABLE_HEADER.size}",
        )
    name, version, json_size, sha = TOC_HEADER.unpack_from(frame, SKIPPABLE_HEADER.size)
    if name != FORMAT_NAME:
        raise NotConvertedError(digest, "the frame before the seek table is not a bootseer TOC")
    if version != FORMAT_VERSION:
        raise MalformedLayerError(
            digest, f"format version {version}, this bootseer reads {FORMAT_VERSION}"
        )
    if json_size > MAX_TOC_JSON:
        raise MalformedLayerError(
            digest, f"TOC declares {json_size} bytes, more than the {MAX_TOC_JSON} allowed"
        )
    compressed = frame[SKIPPABLE_HEADER.size + TOC_HEADER.size :]
    if json_size > MAX_TOC_RATIO * len(compressed) + TOC_JSON_SLACK:
        raise MalformedLayerError(
            digest,
            f"TOC declares {json_size} bytes of JSON from "
            f"{len(compressed)} compressed bytes (more than "
            f"{MAX_TOC_RATIO}x + {TOC_JSON_SLACK})",
        )
    if tar_size is not None and json_size > TOC_JSON_PER_TAR_BYTE * tar_size + TOC_JSON_SLACK:
        raise MalformedLayerError(
            digest,
            f"TOC declares {json_size} bytes of JSON for a "
            f"{tar_size}-byte tar stream (more than "
            f"{TOC_JSON_PER_TAR_BYTE}x + {TOC_JSON_SLACK})",
        )
    doc = _bounded_decompress(compressed, json_size, digest)
    if hashlib.sha256(doc).digest() != sha:
        raise MalformedLayerError(digest, "TOC checksum mismatch")
    values = doc.count(b"{") + doc.count(b"[") + doc.count(b",")  # an upper bound
    if values > MAX_TOC_VALUES_PER_BYTE * len(compressed) + 4096:
        raise MalformedLayerError(
            digest,
            f"TOC of {len(compressed)} compressed bytes declares "
            f"{values} JSON values (more than "
            f"{MAX_TOC_VALUES_PER_BYTE} per byte)",
        )
    try:
        return json.loads(doc)
    except (ValueError, RecursionError) as exc:
        raise MalformedLayerError(digest, f"TOC is not valid JSON ({exc})") from None


def _bounded_decompress(data: bytes, expected: int, digest: str | None) -> bytes:
    """Decompress at most ``expected`` (+1) bytes, growing the buffer with the actual output
    in bounded steps: neither the declared size nor a decompression bomb decides what is
    allocated."""
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        while len(out) <= expected:
            chunk = reader.read(min(1 << 20, expected + 1 - len(out)))
            if not chunk:
                break
            out += chunk
    except zstandard.ZstdError as exc:
        raise MalformedLayerError(digest, f"TOC does not decompress ({exc})") from None
    if len(out) != expected:
        more = "more than " if len(out) > expected else ""
        raise MalformedLayerError(
            digest, f"TOC decompresses to {more}{len(out)} bytes, its header says {expected}"
        )
    return bytes(out)


# --- data frames: bounded decompression ----------------------------------------------------------

ZSTD_MAGIC = 0xFD2FB528
_FCS_SIZES = (0, 2, 4, 8)
_DID_SIZES = (0, 1, 2, 4)
_dctx = threading.local()


def zstd_frame(data: bytes) -> tuple[int | None, int]:
    """``(declared content size or None, compressed size)`` of the zstd frame that starts
    ``data``, found by walking its header and block headers (RFC 8878), without decompressing;
    ValueError when ``data`` does not start with a whole zstd frame."""
    n = len(data)
    if n < 6 or int.from_bytes(data[:4], "little") != ZSTD_MAGIC:
        raise ValueError("not a zstd frame")
    fhd = data[4]
    if fhd & 0x08:
        raise ValueError("the zstd frame header sets its reserved bit")
    single = fhd & 0x20
    pos = 5 + (0 if single else 1) + _DID_SIZES[fhd & 3]
    fcs = _FCS_SIZES[fhd >> 6] or (1 if single else 0)
    if pos + fcs > n:
        raise ValueError("truncated zstd frame header")
    content = None
    if fcs:
        content = int.from_bytes(data[pos : pos + fcs], "little") + (256 if fcs == 2 else 0)
    pos += fcs
    while True:
        if pos + 3 > n:
            raise ValueError("truncated zstd frame (a block header is missing)")
        header = int.from_bytes(data[pos : pos + 3], "little")
        kind = (header >> 1) & 3
        if kind == 3:
            raise ValueError("a zstd block of the reserved type")
        pos += 3 + (1 if kind == 1 else header >> 3)
        if header & 1:
            break
    pos += 4 if fhd & 0x04 else 0
    if pos > n:
        raise ValueError("truncated zstd frame")
    return content, pos


def decompress_bounded(data: bytes, expected: int) -> bytes:
    """The content of ``data``, which must be exactly one zstd frame whose header declares
    ``expected`` bytes: the output buffer is ``expected`` bytes (python-zstandard sizes it from
    the header and ignores ``max_output_size`` when the header has a size, so the header is
    checked first), and a frame producing more or less is an error (ValueError)."""
    content, size = zstd_frame(data)
    if size != len(data):
        raise ValueError(
            f"{len(data)} bytes hold a {size}-byte zstd frame and more (one zstd frame expected)"
        )
    if content != expected:
        raise ValueError(
            f"the zstd frame declares {content} bytes of content, the seek table {expected}"
        )
    dctx = getattr(_dctx, "dctx", None)
    if dctx is None:
        dctx = _dctx.dctx = zstandard.ZstdDecompressor()
    try:
        out = dctx.decompress(data, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd: {exc}") from None
    if len(out) != expected:
        raise ValueError(f"decompressed to {len(out)} bytes, expected {expected}")
    return out


class _FrameBytes:
    """Tar-stream bytes around one frame being verified: that frame from its content, the
    others (a header running on into the next frame, the end-of-archive block) loaded."""

    def __init__(
        self, index: LayerIndex, i: int, content: bytes, load: Callable[[int], bytes]
    ) -> None:
        self.index = index
        self.frames = {i: content}
        self.load = load
        self.first = index.frames[i]

    def block(self, start: int) -> bytes | None:
        """The 512 bytes at ``start`` when they lie inside the first frame (the fast path)."""
        f = self.first
        if f.u_offset <= start and start + TAR_BLOCK <= f.u_end:
            lo = start - f.u_offset
            return self.frames[f.index][lo : lo + TAR_BLOCK]
        return None

    def read(self, start: int, end: int) -> bytes:
        end = min(end, self.index.tar_size)
        if end <= start:
            return b""
        parts = []
        for j in self.index.frames_for(start, end):
            content = self.frames.get(j)
            if content is None:
                content = self.frames[j] = self.load(j)
            f = self.index.frames[j]
            parts.append(
                content[max(start, f.u_offset) - f.u_offset : min(end, f.u_end) - f.u_offset]
            )
        return b"".join(parts)
