"""Hand-made layer blobs for the trust-boundary tests, written byte by byte: zstd frames from the
zstandard module (or block by block), a TOC JSON written here with its header, and the seek
table, following docs/prefetch.md ("Layer format") and not the project's own writers (which
refuse to write what these tests need: a TOC that lies, a frame that is a bomb)."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zstandard

TOC_MAGIC = 0x184D2A5B
SEEK_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
ZSTD_MAGIC = 0xFD2FB528
EMPTY_XXH64_LOW32 = 0x51D8E999
TYPES = {
    tarfile.REGTYPE: "reg",
    tarfile.AREGTYPE: "reg",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char",
    tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_of(
    members: Iterable[tuple[str, bytes | None]], *, fmt: int = tarfile.PAX_FORMAT, **attrs: Any
) -> bytes:
    """A plain tar stream (what ``zstd -d`` of the blob gives and what a scanner reads):
    ``(name, data)`` members, ``data`` None for a directory, ``b"->target"`` for a symlink."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime, info.mode = 1_700_000_000, 0o644
            for key, value in attrs.items():
                setattr(info, key, value)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif data.startswith(b"->"):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:].decode()
            else:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if info.size else None)
    return out.getvalue()


def _normal(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return "/".join(parts) or "."


def honest_entries(tar: bytes) -> list[dict[str, Any]]:
    """The TOC entries of ``tar`` as docs/prefetch.md lays them out (names normalized, offsets
    of each member's first header block and of its data), read with tarfile."""
    entries = []
    start = 0
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf:
            kind = TYPES[m.type]
            doc: dict[str, Any] = {
                "name": _normal(m.name),
                "type": kind,
                "mode": m.mode & 0o7777,
                "uid": m.uid,
                "gid": m.gid,
                "size": m.size if kind == "reg" else 0,
                "mtime": int(m.mtime) * 10**9,
            }
            if m.uname:
                doc["uname"] = m.uname
            if m.gname:
                doc["gname"] = m.gname
            if kind == "symlink":
                doc["link"] = m.linkname
            elif kind == "hardlink":
                doc["link"] = _normal(m.linkname)
            xattrs = {
                k[len("SCHILY.xattr.") :]: base64.b64encode(v.encode()).decode()
                for k, v in m.pax_headers.items()
                if k.startswith("SCHILY.xattr.")
            }
            if xattrs:
                doc["xattrs"] = xattrs
            doc["offset"], doc["header"] = m.offset_data, start
            entries.append(doc)
            start = m.offset_data + (-(-m.size // 512) * 512 if m.isreg() else 0)
    return entries


def zstd_frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True).compress(
        data
    )


def rle_frame(declared: int | None, blocks: int, block_size: int = 128 << 10) -> bytes:
    """A zstd frame written block by block: ``blocks`` RLE blocks of ``block_size`` zero bytes
    (4 bytes each), its header declaring ``declared`` bytes of content (None: no size)."""
    fhd = 0xC0 if declared is not None else 0x00  # 8-byte content size field, or none
    out = struct.pack("<I", ZSTD_MAGIC) + bytes([fhd, 0x38])  # window 2**17 = 128 KiB
    if declared is not None:
        out += struct.pack("<Q", declared)
    for k in range(blocks):
        header = (1 if k == blocks - 1 else 0) | (1 << 1) | (block_size << 3)  # RLE block
        out += header.to_bytes(3, "little") + b"\0"
    return out


def raw_frame(data: bytes, block_size: int = 128 << 10) -> bytes:
    """A zstd frame of raw (stored) blocks: exactly 14 + 3 per block + len(data) bytes."""
    out = struct.pack("<I", ZSTD_MAGIC) + bytes([0xC0, 0x38]) + struct.pack("<Q", len(data))
    chunks = [data[i : i + block_size] for i in range(0, len(data), block_size)] or [b""]
    for k, chunk in enumerate(chunks):
        header = (1 if k == len(chunks) - 1 else 0) | (len(chunk) << 3)  # a raw block
        out += header.to_bytes(3, "little") + chunk
    return out


def skippable(magic: int, payload: bytes) -> bytes:
    return struct.pack("<II", magic, len(payload)) + payload


def toc_frame(
    json_bytes: bytes, *, declared: tuple[int, bytes] | None = None, compressed: bytes | None = None
) -> bytes:
    """The TOC skippable frame; ``declared`` = (JSON size, JSON sha256) for a JSON that was
    compressed as a stream (``compressed``) and never held here."""
    size, digest = declared or (len(json_bytes), hashlib.sha256(json_bytes).digest())
    header = struct.pack("<16sIQ32s", b"bootseer-layer\0\0", 1, size, digest)
    if compressed is None:
        compressed = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(
            json_bytes
        )
    return skippable(TOC_MAGIC, header + compressed)


def seek_table(rows: list[tuple[int, int, int]]) -> bytes:
    body = b"".join(struct.pack("<III", c, d, x & 0xFFFFFFFF) for c, d, x in rows)
    return skippable(SEEK_MAGIC, body + struct.pack("<IBI", len(rows), 0x80, SEEKABLE_MAGIC))


@dataclass
class Crafted:
    blob: bytes
    tar: bytes
    toc_offset: int
    frames: list[bytes]

    @property
    def digest(self) -> str:
        return sha256(self.blob)

    @property
    def index_digest(self) -> str:
        """What the manifest of an image holding this blob records for its index."""
        return sha256(self.blob[self.toc_offset :])

    def read(self, start: int, end: int) -> bytes:
        return self.blob[start:end]


def build_blob(
    tar: bytes,
    entries: list[dict[str, Any]],
    *,
    cuts: Iterable[int] = (),
    frames: list[tuple[bytes, int]] | None = None,
    toc_pad: int | None = None,
) -> Crafted:
    """A blob of ``tar`` cut into zstd frames at ``cuts`` (tar offsets), with a TOC listing
    ``entries`` (lies included) and the seek table. ``frames`` replaces the data frames by
    ``(compressed bytes, declared content size)`` pairs. ``toc_pad`` stores the TOC JSON
    uncompressed (a raw zstd frame) with that many spaces in a key readers ignore: each one
    adds exactly one byte to the blob."""
    import json

    if frames is None:
        bounds = [0, *sorted(cuts), len(tar)]
        frames = [
            (zstd_frame(tar[a:b]), b - a) for a, b in zip(bounds, bounds[1:], strict=False) if b > a
        ]
    rows, c_off, u_off = [], 0, 0
    for data, size in frames:
        rows.append([c_off, len(data), u_off, size, hashlib.sha256(data).hexdigest()])
        c_off += len(data)
        u_off += size
    doc: dict[str, Any] = {
        "format": "bootseer-layer-toc",
        "version": 1,
        "tar_size": u_off,
        "diff_id": sha256(tar),
        "frame_size": 1 << 20,
        "level": 3,
        "frames": rows,
        "entries": entries,
    }
    if toc_pad is not None:
        doc["pad"] = " " * toc_pad
    json_bytes = json.dumps(doc, separators=(",", ":")).encode()
    toc = toc_frame(json_bytes, compressed=None if toc_pad is None else raw_frame(json_bytes))
    table = seek_table(
        [(len(d), s, int.from_bytes(d[-4:], "little")) for d, s in frames]
        + [(len(toc), 0, EMPTY_XXH64_LOW32)]
    )
    data = b"".join(d for d, _ in frames)
    return Crafted(data + toc + table, tar, len(data), [d for d, _ in frames])


def padded_blob(tar: bytes, entries: list[dict[str, Any]], size: int) -> Crafted:
    """A blob of ``tar`` exactly ``size`` bytes long (an attacker's same-size replacement, so
    that only the index digest can tell): random bytes after the tar's end-of-archive blocks
    (a tar stream may carry them) in a raw zstd frame for the bulk, spaces in an uncompressed
    TOC for the last bytes (one byte each)."""
    import random

    def build(junk: int, pad: int) -> Crafted:
        tail = random.Random(junk).randbytes(junk)
        return build_blob(
            tar + tail,
            entries,
            toc_pad=pad,
            frames=[(zstd_frame(tar), len(tar)), (raw_frame(tail), junk)],
        )

    junk = size - len(build(1, 0).blob) - 1000
    for _ in range(10):
        if junk < 1:
            break
        pad = size - len(build(junk, 0).blob)
        if pad >= 0:
            crafted = build(junk, pad)
            assert len(crafted.blob) == size
            return crafted
        junk += pad - 1000
    raise AssertionError(f"cannot make a blob of {len(tar)} tar bytes {size} bytes long")
