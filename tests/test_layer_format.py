"""prefetch's seekable zstd layer format: verbatim tar, TOC, seek table, untrusted input."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import shutil
import struct
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import zstandard

from prefetch import toc as tocmod
from prefetch.layer import (
    MEDIA_TYPE_TAR,
    MEDIA_TYPE_TAR_GZIP,
    MEDIA_TYPE_TAR_ZSTD,
    ConvertError,
    convert_layer,
    convert_layer_blob,
    open_layer_stream,
)
from prefetch.safety import UnsafeMemberError, normalize_member_path
from prefetch.toc import (
    FrameVerificationError,
    LayerIndex,
    MalformedLayerError,
    NotConvertedError,
    UnsafeLayerError,
)

FRAME = 64 << 10  # the smallest target: many frames from a small tar
HINT = "bootseer image convert SRC DST"
CAP = bytes([1, 0, 0, 2, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])  # a file capability


@dataclass
class Layer:
    tar: bytes
    blob: bytes
    digest: str
    diff_id: str
    contents: dict[str, bytes]  # regular file name -> data (normalized names)
    members: list[tarfile.TarInfo]

    def reader(self, log: list[tuple[int, int]] | None = None) -> Callable[[int, int], bytes]:
        def read_range(start: int, end: int) -> bytes:
            if log is not None:
                log.append((start, end))
            return self.blob[start:end]

        return read_range

    def index(self) -> LayerIndex:
        return LayerIndex.from_blob(self.reader(), len(self.blob), self.digest)


def _add(
    tf: tarfile.TarFile, name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **attrs: Any
) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0
    info.mode = attrs.pop("mode", 0o755 if kind == tarfile.DIRTYPE else 0o644)
    info.mtime = attrs.pop("mtime", 1_700_000_000)
    info.uname, info.gname = "root", "root"
    for key, value in attrs.items():
        setattr(info, key, value)
    tf.addfile(info, io.BytesIO(data) if info.size else None)


def _text(rng: random.Random, n: int) -> bytes:
    words = [b"import", b"def", b"return", b"self", b"numpy", b"torch", b"class", b"(x)", b"\n"]
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words) + b" "
    return bytes(out[:n])


def build_tar(fmt: int = tarfile.PAX_FORMAT, seed: int = 7) -> tuple[bytes, dict[str, bytes]]:
    """A small image layer with every kind of member a real one holds."""
    rng = random.Random(seed)
    buf = io.BytesIO()
    contents: dict[str, bytes] = {}
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        _add(tf, "./", tarfile.DIRTYPE)
        for d in ("usr", "usr/lib", "usr/lib/python3", "usr/bin", "etc", "dev", "var/run"):
            _add(tf, f"./{d}/", tarfile.DIRTYPE)
        for i in range(120):  # many small files of assorted sizes, compressible and not
            name = f"usr/lib/python3/mod{i:03d}.py"
            n = rng.choice([0, 1, 100, 511, 512, 513, 4096, 9000, 30_000, 70_000])
            data = _text(rng, n) if i % 3 else rng.randbytes(n)
            _add(tf, "./" + name, data=data)
            contents[name] = data
        big = rng.randbytes(200_000) + _text(rng, 300_000) + rng.randbytes(123_457)
        _add(tf, "./usr/lib/libbig.so", data=big, mode=0o755)
        contents["usr/lib/libbig.so"] = big
        _add(tf, "./usr/bin/python3", tarfile.SYMTYPE, linkname="/etc/alternatives/python3")
        _add(tf, "./usr/lib/libbig.so.1", tarfile.SYMTYPE, linkname="libbig.so")
        _add(tf, "./usr/bin/rel", tarfile.SYMTYPE, linkname="../lib/python3/mod001.py")
        _add(tf, "./usr/bin/hard", tarfile.LNKTYPE, linkname="./usr/lib/python3/mod002.py")
        long_name = "usr/lib/python3/" + "/".join(["a_rather_long_directory_name"] * 5) + "/f.py"
        assert len(long_name) > 100
        _add(tf, long_name, data=b"long name\n")
        contents[long_name] = b"long name\n"
        if fmt == tarfile.PAX_FORMAT:
            capable = "usr/bin/ping"
            pax = {
                "SCHILY.xattr.security.capability": CAP.decode("utf-8", "surrogateescape"),
                "SCHILY.xattr.user.comment": "héllo",
                "mtime": "1700000000.123456789",
            }
            _add(tf, capable, data=b"\x7fELF ping", mode=0o4755, pax_headers=pax)
            contents[capable] = b"\x7fELF ping"
        _add(tf, "etc/.wh.removed.conf", data=b"")
        contents["etc/.wh.removed.conf"] = b""
        _add(tf, "var/.wh..wh..opq", data=b"")
        contents["var/.wh..wh..opq"] = b""
        _add(tf, "dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
        _add(tf, "var/run/fifo", tarfile.FIFOTYPE)
        for i in range(30):  # small files after the big one share its last frame
            data = _text(rng, 700)
            _add(tf, f"etc/conf{i}", data=data)
            contents[f"etc/conf{i}"] = data
    return buf.getvalue(), contents


def convert(tar: bytes, **options: Any) -> tuple[bytes, Any]:
    out = io.BytesIO()
    options.setdefault("frame_size", FRAME)
    result = convert_layer(io.BytesIO(tar), out, **options)
    return out.getvalue(), result


@pytest.fixture(scope="module")
def layer() -> Layer:
    tar, contents = build_tar()
    blob, result = convert(tar, workers=3)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        members = tf.getmembers()
    return Layer(tar, blob, result.digest, result.diff_id, contents, members)


def zstd_binary() -> str:
    path = shutil.which("zstd")
    if path is None:
        pytest.skip("the zstd command is not installed")
    return path


# --- the verbatim-tar property -----------------------------------------------------------------


def test_blob_decompresses_to_the_original_tar_byte_for_byte(layer: Layer) -> None:
    reader = zstandard.ZstdDecompressor().stream_reader(layer.blob, read_across_frames=True)
    assert reader.read() == layer.tar
    cli = subprocess.run(
        [zstd_binary(), "-d", "-c"], input=layer.blob, capture_output=True, check=True
    )
    assert cli.stdout == layer.tar
    assert layer.diff_id == "sha256:" + hashlib.sha256(layer.tar).hexdigest()
    assert layer.digest == "sha256:" + hashlib.sha256(layer.blob).hexdigest()


def test_zstd_d_piped_to_tar_t_lists_every_member(layer: Layer, tmp_path: Any) -> None:
    (tmp_path / "layer.tar.zst").write_bytes(layer.blob)
    listing = subprocess.run(
        f"{zstd_binary()} -d -c layer.tar.zst | tar tf -",
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    listed = [line.rstrip("/") for line in listing.stdout.splitlines()]
    assert listed == [m.name.rstrip("/") for m in layer.members]
    assert len(listed) == len(layer.members) > 160


def test_conversion_is_deterministic_and_blob_reconverts_to_itself(layer: Layer) -> None:
    again, _ = convert(layer.tar, workers=1)
    assert again == layer.blob  # the same image converts to the same digest, any worker count
    out = io.BytesIO()
    result = convert_layer_blob(io.BytesIO(layer.blob), MEDIA_TYPE_TAR_ZSTD, out, frame_size=FRAME)
    assert out.getvalue() == layer.blob and result.diff_id == layer.diff_id


@pytest.mark.parametrize(
    "packing, media_type",
    [
        ("gzip", MEDIA_TYPE_TAR_GZIP),
        ("gzip", "application/vnd.docker.image.rootfs.diff.tar.gzip"),
        ("zstd", MEDIA_TYPE_TAR_ZSTD),
        ("tar", MEDIA_TYPE_TAR),
        ("gzip", None),
        ("zstd", None),
        ("tar", None),
    ],
)
def test_open_layer_stream_reads_any_registry_layer(
    layer: Layer, packing: str, media_type: str | None
) -> None:
    blob = {
        "gzip": lambda: gzip.compress(layer.tar, 6),
        "zstd": lambda: zstandard.ZstdCompressor(level=3).compress(layer.tar),
        "tar": lambda: layer.tar,
    }[packing]()
    assert open_layer_stream(io.BytesIO(blob), media_type).read() == layer.tar


def test_open_layer_stream_refuses_unknown_media_types() -> None:
    with pytest.raises(ConvertError, match="unsupported layer media type"):
        open_layer_stream(io.BytesIO(b""), "application/vnd.oci.image.layer.v1.tar+bzip2")


# --- the index ---------------------------------------------------------------------------------


def test_index_from_the_tail_finds_every_entry_with_its_offsets(layer: Layer) -> None:
    size = len(layer.blob)
    first_guess = (max(0, size - tocmod.TAIL_GUESS), size - 9)
    assert LayerIndex.parse_tail(layer.blob[-9:], size) == [first_guess]
    tail = layer.blob[-17:]  # the seek table's header and footer
    asked = []
    while need := LayerIndex.parse_tail(tail, size, layer.digest):
        assert len(need) == 1 and need[0][1] == size - len(tail)
        asked.append(need[0][0])
        tail = layer.blob[need[0][0] :]
    index = LayerIndex.from_tail(tail, size, layer.digest)
    assert asked == [index.table_offset, index.toc_offset]  # the seek table, then the TOC
    assert index.tar_size == len(layer.tar) and index.diff_id == layer.diff_id

    log: list[tuple[int, int]] = []
    assert LayerIndex.from_blob(layer.reader(log), size).entries == index.entries
    assert len(log) == 1  # the default tail read holds a small layer's whole index

    assert len(index.entries) == len(layer.members)
    for entry, member in zip(index.entries, layer.members, strict=True):
        assert entry.name == normalize_member_path(member.name)
        assert entry.header_offset == member.offset
        assert entry.offset == member.offset_data
        assert entry.mode == member.mode and entry.uid == member.uid
        assert entry.uname == member.uname == "root"
        if member.isreg():
            assert entry.type == "reg" and entry.size == member.size
            assert layer.tar[entry.offset : entry.data_end] == layer.contents[entry.name]
    by_name = {e.name: e for e in index.entries}
    assert by_name["."].type == "dir"
    assert by_name["usr/bin/python3"].type == "symlink"
    assert by_name["usr/bin/python3"].link == "/etc/alternatives/python3"  # kept as it is
    assert by_name["usr/bin/rel"].link == "../lib/python3/mod001.py"
    assert by_name["usr/bin/hard"].type == "hardlink"
    assert by_name["usr/bin/hard"].link == "usr/lib/python3/mod002.py"
    assert by_name["dev/null"].type == "char"
    assert (by_name["dev/null"].devmajor, by_name["dev/null"].devminor) == (1, 3)
    assert by_name["var/run/fifo"].type == "fifo"
    assert by_name["etc/.wh.removed.conf"].type == "reg"
    assert by_name["var/.wh..wh..opq"].type == "reg"
    ping = by_name["usr/bin/ping"]
    assert ping.mode == 0o4755  # setuid is presented as the image says
    assert ping.xattrs == {"security.capability": CAP, "user.comment": "héllo".encode()}
    assert ping.mtime_ns == 1_700_000_000_123_456_789
    assert by_name["etc/conf0"].mtime_ns == 1_700_000_000 * 10**9
    assert any(len(e.name) > 100 for e in index.entries)


def test_lookup_accepts_any_spelling_of_a_path(layer: Layer) -> None:
    index = layer.index()
    for spelling in ("etc/conf3", "/etc/conf3", "./etc/conf3", "etc//conf3/"):
        entry = index.lookup(spelling)
        assert entry is not None and entry.name == "etc/conf3"
    assert index.lookup("/") is index.lookup(".") is not None
    assert index.lookup("etc/missing") is None


def test_reading_any_file_through_frames_gives_its_bytes(layer: Layer) -> None:
    index = layer.index()
    read_range = layer.reader()
    for name, data in layer.contents.items():
        assert index.read(name, read_range) == data, name
    assert index.read("usr/bin/hard", read_range) == layer.contents["usr/lib/python3/mod002.py"]
    big = layer.contents["usr/lib/libbig.so"]
    for offset, size in ((0, 10), (65_530, 20), (300_001, 99_999), (len(big) - 5, 100)):
        assert (
            index.read("usr/lib/libbig.so", read_range, offset, size) == big[offset : offset + size]
        )
    with pytest.raises(IsADirectoryError):
        index.read("usr", read_range)


def test_frames_end_at_member_boundaries_and_split_big_files(layer: Layer) -> None:
    index = layer.index()
    assert len(index.frames) > 10
    for frame in index.frames:
        assert 0 < frame.u_size <= 2 * FRAME
    for entry in index.entries:
        span = index.frames_for(entry.header_offset, entry.data_end)
        if entry.data_end - entry.header_offset < FRAME:
            assert len(span) == 1, entry.name  # a small member never straddles frames
    big = index.lookup("usr/lib/libbig.so")
    assert big is not None
    starts = {f.u_offset for f in index.frames}
    assert big.header_offset in starts  # the big file starts its own frame
    cuts = range(big.offset + FRAME, big.data_end, FRAME)
    assert set(cuts) <= starts  # and is cut at page-aligned offsets of its data


@pytest.mark.parametrize("seed", range(8))
def test_frame_cutting_holds_its_invariants_on_random_layers(seed: int) -> None:
    rng = random.Random(seed)
    buf = io.BytesIO()
    contents = {}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(rng.randrange(1, 40)):
            n = rng.choice(
                [
                    0,
                    10,
                    511,
                    512,
                    FRAME - 512,
                    FRAME,
                    FRAME + 1,
                    2 * FRAME,
                    rng.randrange(5 * FRAME),
                ]
            )
            pax = (
                {"SCHILY.xattr.user.big": "x" * rng.choice([1000, 3 * FRAME])}
                if rng.random() < 0.15
                else {}
            )  # a giant pax header is cut like data
            contents[f"f{i}"] = rng.randbytes(n)
            _add(tf, f"f{i}", data=contents[f"f{i}"], pax_headers=pax)
    tar = buf.getvalue()
    target = rng.choice([FRAME, 2 * FRAME])
    blob, _ = convert(tar, frame_size=target, workers=rng.randrange(1, 4))
    assert zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read() == tar
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    assert all(0 < f.u_size <= 2 * target for f in index.frames)
    for entry in index.entries:
        assert index.read(entry, lambda s, e: blob[s:e]) == contents[entry.name]
        if entry.data_end - entry.header_offset <= target:
            span = index.frames_for(
                entry.header_offset, max(entry.data_end, entry.header_offset + 1)
            )
            assert len(span) == 1, entry.name


PAGE = 4096


def _pages_split(index: LayerIndex) -> list[str]:
    """Members with a frame boundary inside a 4 KiB page of their data."""
    starts = [f.u_offset for f in index.frames[1:]]
    return [
        f"{e.name}: boundary at data byte {b - e.offset}"
        for e in index.entries
        if e.type == "reg" and not e.sparse
        for b in starts
        if e.offset < b < e.offset + e.size and (b - e.offset) % PAGE
    ]


@pytest.mark.parametrize("seed", range(4))
def test_no_frame_boundary_falls_inside_a_page_of_a_file(seed: int) -> None:
    """docs/prefetch.md: a page of a file never spans two frames. A member just under the
    target whose headers push it past the target was cut target bytes after its *header*:
    inside its last page (data starting 512 or 1536 bytes after the frame's start)."""
    rng = random.Random(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "first", data=rng.randbytes(FRAME - 3000))  # the next one starts a frame
        for i in range(30):
            n = rng.choice(
                [
                    FRAME - 100,
                    FRAME - 511,
                    FRAME - 1,
                    FRAME,
                    FRAME + 100,
                    2 * FRAME - 700,
                    3 * FRAME + 5,
                    rng.randrange(1, 4 * FRAME),
                ]
            )
            pax = {"SCHILY.xattr.user.x": "y" * rng.randrange(600)} if rng.random() < 0.5 else {}
            _add(tf, f"f{i}", data=rng.randbytes(n), pax_headers=pax)
    blob, _ = convert(buf.getvalue(), frame_size=FRAME)
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    assert _pages_split(index) == []
    assert all(0 < f.u_size <= 2 * FRAME for f in index.frames)


def test_random_access_fetches_only_the_frames_it_needs(layer: Layer) -> None:
    index = layer.index()
    big = index.lookup("usr/lib/libbig.so")
    assert big is not None
    log: list[tuple[int, int]] = []
    offset = 5 * FRAME + 1000  # inside the file's 6th frame
    data = index.read(big, layer.reader(log), offset, 4096)
    assert data == layer.contents["usr/lib/libbig.so"][offset : offset + 4096]
    needed = index.frames_for(big.offset + offset, big.offset + offset + 4096)
    assert len(needed) == 1
    frame = index.frames[needed[0]]
    header = index.frames[index.frame_of(big.header_offset)]
    # the first read of a file also checks its tar header (once), then one frame per read
    assert log == [(header.c_offset, header.c_end), (frame.c_offset, frame.c_end)]
    log.clear()
    offset += FRAME
    index.read(big, layer.reader(log), offset, 4096)
    frame = index.frames[index.frame_of(big.offset + offset)]
    assert log == [(frame.c_offset, frame.c_end)]  # one range request, one frame
    log.clear()
    straddling = 6 * FRAME - 100  # two frames, coalesced into one request
    index.read(big, layer.reader(log), straddling, 200)
    first, second = index.frames_for(big.offset + straddling, big.offset + straddling + 200)
    assert log == [(index.frames[first].c_offset, index.frames[second].c_end)]


def test_a_corrupted_frame_is_named(layer: Layer) -> None:
    index = layer.index()
    frame = index.frames[2]
    blob = bytearray(layer.blob)
    blob[frame.c_offset + frame.c_size // 2] ^= 0x40
    with pytest.raises(FrameVerificationError, match="frame 2 failed verification: sha256") as e:
        index.decompress_frame(2, bytes(blob[frame.c_offset : frame.c_end]))
    assert e.value.frame == 2 and layer.digest in str(e.value)
    with pytest.raises(FrameVerificationError, match="frame 2 .*got 3 bytes"):
        index.decompress_frame(2, b"abc")
    corrupt = index.frames_for(frame.u_offset, frame.u_end)
    with pytest.raises(FrameVerificationError, match="frame 2"):
        index.read_raw(lambda s, e: bytes(blob[s:e]), frame.u_offset, frame.u_offset + 1)
    assert list(corrupt) == [2]


# --- blobs not in the format -------------------------------------------------------------------


def seekable_without_toc(tar: bytes) -> bytes:
    """A plain zstd seekable-format file (frames + seek table, no bootseer TOC)."""
    cctx = zstandard.ZstdCompressor(level=1, write_checksum=True)
    frames = [cctx.compress(tar[i : i + FRAME]) for i in range(0, len(tar), FRAME)]
    table = tocmod.encode_seek_table(
        [
            (len(f), len(tar[i * FRAME : (i + 1) * FRAME]), int.from_bytes(f[-4:], "little"))
            for i, f in enumerate(frames)
        ]
    )
    return b"".join(frames) + table


@pytest.mark.parametrize(
    "kind", ["truncated", "gzip", "zstd", "seekable-no-toc", "tiny", "empty", "tar"]
)
def test_unconverted_layers_say_to_convert_the_image(layer: Layer, kind: str) -> None:
    blob = {
        "truncated": lambda: layer.blob[:-1000],
        "gzip": lambda: gzip.compress(layer.tar),
        "zstd": lambda: zstandard.ZstdCompressor(level=3).compress(layer.tar),
        "seekable-no-toc": lambda: seekable_without_toc(layer.tar),
        "tiny": lambda: b"\x28\xb5\x2f\xfd",
        "empty": lambda: b"",
        "tar": lambda: layer.tar,
    }[kind]()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    with pytest.raises(NotConvertedError) as e:
        LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob), digest)
    message = str(e.value)
    assert f"layer {digest} is not in bootseer's seekable format" in message
    assert HINT in message


# --- crafted blobs -----------------------------------------------------------------------------


def rebuild(
    layer: Layer,
    *,
    doc: Callable[[dict], None] | None = None,
    sizes: Callable[[list[list[int]]], None] | None = None,
    toc_frame: Callable[[bytes], bytes] | None = None,
    table: Callable[[bytes], bytes] | None = None,
) -> bytes:
    """The layer's blob with its TOC document, seek-table sizes or raw frames altered."""
    index = layer.index()
    data = layer.blob[: index.toc_offset]
    document = tocmod._decode_toc_frame(layer.blob[index.toc_offset : index.table_offset], None)
    if doc is not None:
        doc(document)
    frame = tocmod.encode_toc_frame(document, 3)
    if toc_frame is not None:
        frame = toc_frame(frame)
    rows = [[f.c_size, f.u_size, f.checksum] for f in index.frames]
    rows.append([len(frame), 0, tocmod.EMPTY_XXH64_LOW32])
    if sizes is not None:
        sizes(rows)
    seek = tocmod.encode_seek_table([tuple(r) for r in rows])
    if table is not None:
        seek = table(seek)
    return data + frame + seek


def entry_named(name: str) -> Callable[[dict], dict]:
    def find(document: dict) -> dict:
        return next(e for e in document["entries"] if e["name"] == name)

    return find


def _set(path: Callable[[dict], dict], key: str, value: Any) -> Callable[[dict], None]:
    def mutate(document: dict) -> None:
        path(document)[key] = value

    return mutate


def _frames(mutate: Callable[[list], None]) -> Callable[[dict], None]:
    return lambda document: mutate(document["frames"])


def _shift_frame(frames: list) -> None:
    frames[1][0] -= 10  # frame 1 starts inside frame 0


def _huge_frame(rows: list[list[int]]) -> None:
    rows[0][1] = 0xFFFFFFF0


def _tile_gap(rows: list[list[int]]) -> None:
    rows[0][0] += 7


def _count_beyond(seek: bytes) -> bytes:
    count, desc, magic = struct.unpack("<IBI", seek[-9:])
    return seek[:-9] + struct.pack("<IBI", count + 5, desc, magic)


def _count_huge(seek: bytes) -> bytes:
    _, desc, magic = struct.unpack("<IBI", seek[-9:])
    return seek[:-9] + struct.pack("<IBI", 0x7FFFFFF, desc, magic)


def _reserved_bits(seek: bytes) -> bytes:
    count, desc, magic = struct.unpack("<IBI", seek[-9:])
    return seek[:-9] + struct.pack("<IBI", count, desc | 0x04, magic)


def _toc_json_size(frame: bytes) -> bytes:
    name, version, _, sha = tocmod.TOC_HEADER.unpack_from(frame, 8)
    return frame[:8] + tocmod.TOC_HEADER.pack(name, version, 1 << 40, sha) + frame[68:]


def _toc_sha(frame: bytes) -> bytes:
    name, version, size, sha = tocmod.TOC_HEADER.unpack_from(frame, 8)
    return frame[:8] + tocmod.TOC_HEADER.pack(name, version, size, bytes(32)) + frame[68:]


def _toc_version(frame: bytes) -> bytes:
    name, _, size, sha = tocmod.TOC_HEADER.unpack_from(frame, 8)
    return frame[:8] + tocmod.TOC_HEADER.pack(name, 99, size, sha) + frame[68:]


def _reorder(document: dict) -> None:
    entries = document["entries"]
    entries[5], entries[6] = entries[6], entries[5]


CONF = entry_named("etc/conf1")
CRAFTED = {
    "huge entry size": ({"doc": _set(CONF, "size", 2**62)}, "lies beyond the tar stream"),
    "entry offset beyond the tar": ({"doc": _set(CONF, "offset", 2**40)}, "offset"),
    "negative size": ({"doc": _set(CONF, "size", -1)}, "size -1 is not an integer"),
    "size as a string": ({"doc": _set(CONF, "size", "12")}, "size '12' is not an integer"),
    "unknown type": ({"doc": _set(CONF, "type", "socket")}, "unknown type 'socket'"),
    "data on a directory": ({"doc": _set(entry_named("usr"), "size", 10)}, "declares 10 bytes"),
    "members overlap": ({"doc": _reorder}, "inside the previous member"),
    "xattr not base64": ({"doc": _set(CONF, "xattrs", {"user.x": "!!"})}, "not base64"),
    "overlapping frames": ({"doc": _frames(_shift_frame)}, "overlapping or misplaced frames"),
    "frame missing from the TOC": ({"doc": _frames(lambda f: f.pop())}, "the TOC lists"),
    "huge frame in the seek table": ({"sizes": _huge_frame}, "uncompressed bytes"),
    "frames leave a gap": ({"sizes": _tile_gap}, "overlap or leave gaps"),
    "frame count beyond the table": ({"table": _count_beyond}, "frame count beyond the table"),
    "frame count beyond the blob": ({"table": _count_huge}, "more than the"),
    "reserved descriptor bits": ({"table": _reserved_bits}, "reserved bits"),
    "huge TOC size": ({"toc_frame": _toc_json_size}, "more than the"),
    "TOC checksum": ({"toc_frame": _toc_sha}, "TOC checksum mismatch"),
    "TOC version": ({"toc_frame": _toc_version}, "format version 99"),
    "wrong tar size": ({"doc": lambda d: d.update(tar_size=d["tar_size"] + 1)}, "tar stream"),
    "not a TOC document": ({"doc": lambda d: d.update(format="other")}, "not a bootseer"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_index_is_refused_before_use(layer: Layer, case: str) -> None:
    changes, expected = CRAFTED[case]
    blob = rebuild(layer, **changes)
    with pytest.raises(MalformedLayerError) as e:
        LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob), "sha256:feed")
    assert expected in str(e.value)
    assert "layer sha256:feed has a malformed bootseer index" in str(e.value)
    assert HINT in str(e.value)


@pytest.mark.parametrize(
    "field, value, member, rule",
    [
        ("name", "../x", "../x", "'..' in member path"),
        ("name", "usr/../../x", "usr/../../x", "'..' in member path"),
        ("name", "/etc/passwd", "/etc/passwd", "absolute member path"),
        ("name", "usr/./x", "usr/./x", "not normalized"),
    ],
)
def test_crafted_toc_member_paths_are_refused(
    layer: Layer, field: str, value: str, member: str, rule: str
) -> None:
    blob = rebuild(layer, doc=_set(CONF, field, value))
    with pytest.raises(UnsafeLayerError) as e:
        LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    assert e.value.member == member and rule in e.value.rule
    assert isinstance(e.value, UnsafeMemberError) and isinstance(e.value, MalformedLayerError)
    assert repr(member) in str(e.value)


@pytest.mark.parametrize("target", ["../../etc/passwd", "/etc/passwd", "usr/../.."])
def test_crafted_hardlink_out_of_the_root_is_refused(layer: Layer, target: str) -> None:
    blob = rebuild(layer, doc=_set(entry_named("usr/bin/hard"), "link", target))
    with pytest.raises(UnsafeLayerError, match="hardlink target .* lies outside the root") as e:
        LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    assert e.value.member == "usr/bin/hard"


def test_crafted_absolute_symlink_is_data(layer: Layer) -> None:
    blob = rebuild(layer, doc=_set(entry_named("usr/bin/rel"), "link", "/../../etc/shadow"))
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    entry = index.lookup("usr/bin/rel")
    assert entry is not None and entry.link == "/../../etc/shadow"


# --- conversion refuses unsafe and broken tars -------------------------------------------------


def tar_of(*members: tuple[str, bytes, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "ok.txt", data=b"fine")
        for name, kind, link in members:
            _add(tf, name, kind, data=b"x" if kind == tarfile.REGTYPE else b"", linkname=link)
    return buf.getvalue()


@pytest.mark.parametrize(
    "members, member, rule",
    [
        ([("../evil", tarfile.REGTYPE, "")], "../evil", "'..' in member path"),
        ([("a/../../evil", tarfile.DIRTYPE, "")], "a/../../evil", "'..' in member path"),
        ([("/etc/cron.d/evil", tarfile.REGTYPE, "")], "/etc/cron.d/evil", "absolute member path"),
        (
            [("passwd", tarfile.LNKTYPE, "../../etc/passwd")],
            "passwd",
            "hardlink target '../../etc/passwd' lies outside the root",
        ),
        (
            [("shadow", tarfile.LNKTYPE, "/etc/shadow")],
            "shadow",
            "hardlink target '/etc/shadow' lies outside the root",
        ),
    ],
)
def test_convert_refuses_a_layer_that_breaks_the_rules(
    members: list, member: str, rule: str
) -> None:
    with pytest.raises(UnsafeMemberError) as e:
        convert(tar_of(*members))
    assert e.value.member == member and rule in str(e.value)
    assert f"refused layer member {member!r}" in str(e.value)


def test_convert_keeps_absolute_and_escaping_symlinks() -> None:
    blob, _ = convert(
        tar_of(
            ("python", tarfile.SYMTYPE, "/usr/bin/python3.11"),
            ("up", tarfile.SYMTYPE, "../../../etc"),
        )
    )
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    assert [(e.name, e.link) for e in index.entries[1:]] == [
        ("python", "/usr/bin/python3.11"),
        ("up", "../../../etc"),
    ]


def test_convert_refuses_corrupt_and_truncated_tars(layer: Layer) -> None:
    index = layer.index()
    conf = index.lookup("etc/conf5")
    assert conf is not None
    corrupt = bytearray(layer.tar)
    corrupt[conf.header_offset + 148] ^= 0x01  # the header checksum field
    with pytest.raises(ConvertError, match=f"invalid header at byte {conf.header_offset}"):
        convert(bytes(corrupt))
    with pytest.raises(ConvertError, match="truncated|unexpected end"):
        convert(layer.tar[: conf.offset + 100])
    with pytest.raises(ConvertError, match="partial header"):
        convert(layer.tar[: conf.header_offset + 200])
    with pytest.raises(ConvertError, match="not a tar stream"):
        convert(b"this is not a tar stream" * 40)


@pytest.mark.parametrize("tar", [b"", bytes(1024), bytes(10240)])
def test_empty_layers_convert(tar: bytes) -> None:
    blob, result = convert(tar)
    assert result.entries == 0 and result.frames == (1 if tar else 0)
    assert zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read() == tar
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    assert index.entries == [] and index.tar_size == len(tar)


def test_gnu_format_long_names_and_links() -> None:
    tar, contents = build_tar(tarfile.GNU_FORMAT, seed=3)
    blob, _ = convert(tar, frame_size=128 << 10)
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    for name, data in contents.items():
        assert index.read(name, lambda s, e: blob[s:e]) == data


def test_sparse_files_read_back(tmp_path: Any) -> None:
    if (
        subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout.find("GNU tar")
        < 0
    ):
        pytest.skip("needs GNU tar to write sparse members")
    payload = b""
    with open(tmp_path / "sparse", "wb") as f:
        for offset in (0, 300_000, 1_000_000):
            f.seek(offset)
            f.write(b"data at %d " % offset * 100)
        f.truncate(1_500_000)
    payload = (tmp_path / "sparse").read_bytes()
    for fmt in ("gnu", "pax"):
        tar = subprocess.run(
            ["tar", "-c", "-S", f"--format={fmt}", "-C", str(tmp_path), "sparse"],
            capture_output=True,
            check=True,
        ).stdout
        blob, _ = convert(tar)
        index = LayerIndex.from_blob(lambda s, e, b=blob: b[s:e], len(blob))
        entry = index.lookup("sparse")
        assert entry is not None and entry.sparse and entry.size == len(payload)
        assert index.read(entry, lambda s, e, b=blob: b[s:e]) == payload, fmt
        assert (
            index.read(entry, lambda s, e, b=blob: b[s:e], 299_990, 30) == payload[299_990:300_020]
        )


def test_safety_normalizes_spellings() -> None:
    assert normalize_member_path("./usr//lib/./x/") == "usr/lib/x"
    assert normalize_member_path("./") == normalize_member_path(".") == "."
    with pytest.raises(UnsafeMemberError, match="longer than 255"):
        normalize_member_path("a/" + "b" * 256)
    with pytest.raises(UnsafeMemberError, match="NUL"):
        normalize_member_path("a\0b")


def test_toc_is_json_with_the_documented_fields(layer: Layer) -> None:
    index = layer.index()
    frame = layer.blob[index.toc_offset : index.table_offset]
    magic, size = struct.unpack_from("<II", frame)
    assert magic == 0x184D2A5B and size == len(frame) - 8
    assert frame[8:24] == b"bootseer-layer\0\0"
    document = tocmod._decode_toc_frame(frame, None)
    assert json.loads(json.dumps(document)) == document
    assert document["frame_size"] == FRAME and document["level"] == 9
    assert len(document["frames"][0]) == 5
    ping = entry_named("usr/bin/ping")(document)
    assert set(ping) >= {
        "name",
        "type",
        "mode",
        "uid",
        "gid",
        "uname",
        "gname",
        "size",
        "mtime",
        "xattrs",
        "offset",
        "header",
    }
    table = layer.blob[index.table_offset :]
    assert struct.unpack_from("<I", table)[0] == 0x184D2A5E
    assert table[-4:] == struct.pack("<I", 0x8F92EAB1)
    assert table[-5] == 0x80  # Checksum_Flag
    frame0 = layer.blob[: index.frames[0].c_end]
    checksum = struct.unpack_from("<I", table, 8 + 8)[0]
    assert checksum == struct.unpack("<I", frame0[-4:])[0]  # the frame's own XXH64 bits


# --- a real containerd unpacks the converted layer ---------------------------------------------


def _oci_archive(path: Any, layer: Layer) -> None:
    """An OCI image layout archive (what `ctr images import` reads) holding the layer."""

    def digest(data: bytes) -> str:
        return "sha256:" + hashlib.sha256(data).hexdigest()

    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [layer.diff_id]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": digest(config),
                "size": len(config),
            },
            "layers": [
                {"mediaType": MEDIA_TYPE_TAR_ZSTD, "digest": layer.digest, "size": len(layer.blob)}
            ],
        }
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": digest(manifest),
                    "size": len(manifest),
                    "annotations": {"io.containerd.image.name": "docker.io/library/seekable:test"},
                }
            ],
        }
    )
    with tarfile.open(path, "w") as tf:
        for name, data in (
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            ("index.json", index.encode()),
            *((f"blobs/sha256/{digest(b)[7:]}", b) for b in (config, manifest, layer.blob)),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_containerd_unpacks_the_converted_layer(layer: Layer, tmp_path: Any, containerd) -> None:
    """`ctr images import` runs containerd's own unpacker (zstd decompression, diff_id check,
    apply), the same one a pull uses (a pull from the registry: tests/test_cli_image.py)."""
    _oci_archive(tmp_path / "image.tar", layer)
    containerd.ctr("images", "import", "--snapshotter", "native", str(tmp_path / "image.tar"))
    snapshots = containerd.ctr("snapshots", "--snapshotter", "native", "ls").stdout
    assert layer.diff_id in snapshots  # unpacked, and the diff_id checked, by containerd
    root = next((containerd.root / "io.containerd.snapshotter.v1.native/snapshots").iterdir())
    assert (root / "usr/lib/libbig.so").read_bytes() == layer.contents["usr/lib/libbig.so"]
    assert os.readlink(root / "usr/bin/python3") == "/etc/alternatives/python3"
    for name, data in layer.contents.items():
        if ".wh." not in name:  # whiteouts are applied, not unpacked
            assert (root / name).read_bytes() == data, name
