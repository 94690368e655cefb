"""Convert an image layer into bootseer's seekable zstd format (layout: :mod:`prefetch.toc`).

The verbatim-tar property
    The data frames hold the layer's uncompressed tar stream byte for byte, cut into ranges;
    nothing is re-encoded. ``zstd -d`` of the blob gives the original tar, so the layer's
    diff_id (SHA-256 of the uncompressed tar) and the image config stay as they were; only the
    layer descriptor (digest, size, media type ``tar+zstd``) changes. A plain ``zstd -d | tar x``
    or containerd pull unpacks it as usual, skipping the TOC and seek-table skippable frames.

Where frames end
    A frame grows member by member and ends at a member boundary (the start of the next
    member's first header block) before it would pass the target size, so a small file is
    read with one frame. A member larger than the target starts its own frame and is cut inside
    its data at multiples of the target from the data start (the target is a multiple of 4 KiB,
    so a page of the file never straddles two frames); its last piece is shared with the members
    that follow. A member whose headers push it just past the target is not cut at all (its
    frame holds up to twice the target), nor is the last one before the end-of-archive blocks.
    For a sparse file the pages are those of its stored data (its extents, back to back).
    Tar headers travel with the data after them. Frames never exceed twice the target (a giant
    pax header is cut like data, before the data starts). The converter streams: it reads the tar once,
    never seeks, and holds the open frame plus at most ``2 x workers`` frames in flight.

Frame size: 1 MiB (measured)
    On a 535 MB site-packages tar (17,545 members: numpy, pyarrow, grpc, botocore, sympy, pip,
    cryptography, networkx, aiohttp, pygments, moto, torch/nn, torch/_inductor, and the
    30 MB libtorch_python.so), zstd level 9, 2 cores; one zstd frame of the whole tar at the
    same level is 140.7 MB. "Small file": compressed bytes fetched to read one whole file
    under 64 KiB (mean of 14,026; none ever needs two frames). "Page" / "128 KiB": bytes
    fetched for a random 4 KiB page / a 128 KiB read (FUSE's largest) of a file over 8 MiB.
    "Imports": the 956 files that importing numpy, pyarrow, sympy, botocore, grpc,
    cryptography, networkx, aiohttp and pygments opens (25.6 MB), as frames and MB fetched.

    ======  ======  =========  =======  =======  ========  ==============  ==========
    target  frames  vs 1 frm   small    page     128 KiB   imports         dec.+sha
    ======  ======  =========  =======  =======  ========  ==============  ==========
    256 K     2202  +12.2 %     71 KiB   76 KiB   112 KiB  206 / 13.6 MB   0.19 ms
    512 K     1086  +10.7 %    145 KiB  151 KiB   186 KiB  139 / 17.8 MB   0.36 ms
    1 MiB      536   +7.5 %    290 KiB  295 KiB   327 KiB   93 / 23.7 MB   0.69 ms
    2 MiB      271   +4.6 %    567 KiB  580 KiB   606 KiB   59 / 28.6 MB   1.29 ms
    4 MiB      138   +2.6 %   1133 KiB 1152 KiB  1173 KiB   37 / 37.8 MB   2.69 ms
    ======  ======  =========  =======  =======  ========  ==============  ==========

    Smaller frames fetch less per access but cost size and requests; larger ones the reverse.
    1 MiB is the knee: a cold small-file read is one request of ~0.3 MB (a few ms at
    100 MB/s, so the round trip still dominates), a startup's working set needs 2.3x fewer
    requests than at 256 KiB for 1.7x the bytes, and the blob is 7.5 % above a single frame
    (4 MiB would save 5 % of the blob but fetch 4x the bytes on every cold page fault).

Level 9, not 3 (measured, 1 MiB frames, same tar): level 3 makes an 8 % larger blob
    (163.3 MB vs 151.3 MB; working set 25.9 vs 23.7 MB) and converts at 311 MB/s instead of
    146 MB/s; decompression costs the same (0.70 ms per frame). Conversion runs once per
    image, fetching on every node of every start, so level 9 (the snapshot layer's choice too).

Untrusted input: the converter applies :mod:`prefetch.safety` to every member and refuses the
layer (naming the member) when one breaks a rule, and it insists that the tar stream ends
properly (a corrupt header mid-stream is an error, not a silent end of the member list). It
derives every TOC entry from the tar stream itself (:func:`prefetch.members.tar_entry`, the
mapping the lazy read path checks entries against), never from a TOC it was given; a member's
``header`` offset is where its whole header chain starts, so members tile the stream, and a
global pax header that would change later members is refused. The result carries the digest of
the index bytes (TOC frame + seek table), which the image's manifest records.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import io
import os
import tarfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import zstandard

from .members import ENCODING, ERRORS, ConvertError, global_header_problem, tar_entry
from .safety import UnsafeMemberError
from .toc import (
    EMPTY_XXH64_LOW32,
    MAX_FRAME_RAW,
    Frame,
    FrameVerificationError,
    LayerFormatError,
    LayerIndex,
    MalformedLayerError,
    NotConvertedError,
    TocEntry,
    UnsafeLayerError,
    encode_seek_table,
    encode_toc_frame,
    toc_document,
)

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "DEFAULT_LEVEL",
    "MEDIA_TYPE_TAR",
    "MEDIA_TYPE_TAR_GZIP",
    "MEDIA_TYPE_TAR_ZSTD",
    "ConvertError",
    "ConvertResult",
    "FrameVerificationError",
    "LayerFormatError",
    "LayerIndex",
    "MalformedLayerError",
    "NotConvertedError",
    "TocEntry",
    "UnsafeLayerError",
    "UnsafeMemberError",
    "convert_layer",
    "convert_layer_blob",
    "open_layer_stream",
]

DEFAULT_FRAME_SIZE = 1 << 20
DEFAULT_LEVEL = 9
MIN_FRAME_SIZE = 64 << 10
MAX_FRAME_SIZE = MAX_FRAME_RAW // 2  # frames reach at most twice the target
PAGE = 4096
BLOCK = tarfile.BLOCKSIZE

MEDIA_TYPE_TAR = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPE_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_TYPE_TAR_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
_GZIP_TYPES = {
    MEDIA_TYPE_TAR_GZIP,
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
}
_ZSTD_TYPES = {MEDIA_TYPE_TAR_ZSTD, "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"}
_TAR_TYPES = {
    MEDIA_TYPE_TAR,
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.docker.image.rootfs.diff.tar",
}


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_layer` wrote: the new descriptor's facts and the layer's diff_id."""

    digest: str  # "sha256:..." of the blob written
    size: int  # bytes written
    diff_id: str  # "sha256:..." of the uncompressed tar (unchanged by conversion)
    tar_size: int
    frames: int  # data frames
    entries: int  # TOC entries
    toc_offset: int  # where the TOC skippable frame starts in the blob
    table_offset: int  # where the seek table starts
    index_digest: str  # "sha256:..." of the index bytes (TOC frame + seek table): the
    # io.bootseer.layer.index.digest annotation that binds them to the manifest
    media_type: str = MEDIA_TYPE_TAR_ZSTD


# --- decompressing readers --------------------------------------------------------------------


class _Prefixed(io.RawIOBase):
    """``prefix`` then the rest of ``src``: lets :func:`open_layer_stream` sniff the magic."""

    def __init__(self, prefix: bytes, src: IO[bytes]) -> None:
        self._prefix = prefix
        self._src = src

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._prefix:
            if n is None or n < 0:
                out, self._prefix = self._prefix + self._src.read(), b""
                return out
            out, self._prefix = self._prefix[:n], self._prefix[n:]
            return out
        return self._src.read(n)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def open_layer_stream(fileobj: IO[bytes], media_type: str | None = None) -> IO[bytes]:
    """A reader of the uncompressed tar stream of a layer blob read from ``fileobj``.

    ``media_type`` is the layer descriptor's (OCI or Docker, gzip, zstd or uncompressed); with
    ``None`` the compression is sniffed from the first bytes. zstd blobs are read across frames
    and skippable frames, so a blob already in bootseer's format reads back as its tar.
    """
    if media_type is None:
        head = b""
        while len(head) < 4:
            more = fileobj.read(4 - len(head))
            if not more:
                break
            head += more
        fileobj = _Prefixed(head, fileobj)  # type: ignore[assignment]
        if head[:2] == b"\x1f\x8b":
            media_type = MEDIA_TYPE_TAR_GZIP
        elif head == b"\x28\xb5\x2f\xfd" or (
            len(head) == 4 and head[0] & 0xF0 == 0x50 and head[1:] == b"\x2a\x4d\x18"
        ):
            media_type = MEDIA_TYPE_TAR_ZSTD
        else:
            media_type = MEDIA_TYPE_TAR
    if media_type in _GZIP_TYPES:
        return gzip.GzipFile(fileobj=fileobj, mode="rb")  # type: ignore[return-value]
    if media_type in _ZSTD_TYPES:
        return zstandard.ZstdDecompressor().stream_reader(  # type: ignore[return-value]
            fileobj, read_across_frames=True, closefd=False
        )
    if media_type in _TAR_TYPES:
        return fileobj
    raise ConvertError(f"unsupported layer media type {media_type!r}")


# --- the converter ----------------------------------------------------------------------------


class _FrameWriter:
    """Compresses frames on a thread pool (zstandard releases the GIL) and writes them in
    order; at most ``2 x workers`` frames are in flight."""

    def __init__(self, out: IO[bytes], level: int, workers: int) -> None:
        self.out = out
        self.level = level
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bootseer-zstd")
        self.pending: collections.deque[tuple[int, int, Future[tuple[bytes, str]]]] = (
            collections.deque()
        )
        self.max_pending = 2 * workers
        self.local = threading.local()
        self.frames: list[Frame] = []
        self.sha = hashlib.sha256()
        self.size = 0

    def _compress(self, data: bytes) -> tuple[bytes, str]:
        cctx = getattr(self.local, "cctx", None)
        if cctx is None:
            cctx = zstandard.ZstdCompressor(
                level=self.level, write_content_size=True, write_checksum=True
            )
            self.local.cctx = cctx
        compressed = cctx.compress(data)
        return compressed, hashlib.sha256(compressed).hexdigest()

    def submit(self, u_offset: int, data: bytes) -> None:
        self.pending.append((u_offset, len(data), self.pool.submit(self._compress, data)))
        while len(self.pending) > self.max_pending:
            self._write_next()

    def _write_next(self) -> None:
        u_offset, u_size, future = self.pending.popleft()
        compressed, sha = future.result()
        checksum = int.from_bytes(compressed[-4:], "little")  # the frame's XXH64 low 32 bits
        self.frames.append(
            Frame(len(self.frames), self.size, len(compressed), u_offset, u_size, sha, checksum)
        )
        self.write(compressed)

    def drain(self) -> None:
        while self.pending:
            self._write_next()

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.sha.update(data)
        self.size += len(data)

    def close(self) -> None:
        for _, _, future in self.pending:
            future.cancel()
        self.pool.shutdown(wait=True)


class _Cutter:
    """Holds the bytes of the open frame and cuts frames at the positions planned from the
    member list (:meth:`member`) as soon as the bytes have arrived."""

    def __init__(self, target: int, emit: Callable[[int, bytes], None]) -> None:
        self.target = target
        self.emit = emit
        self.buf = bytearray()
        self.start = 0  # tar offset of buf[0]: the open frame's start
        self.cuts: collections.deque[int] = collections.deque()
        self.planned = 0  # start of the frame being planned (>= start)
        self.members_end = 0  # where the last member seen ends
        self.tail = False  # past the member list: cut every `target` bytes

    @property
    def end(self) -> int:
        return self.start + len(self.buf)

    def feed(self, data: bytes) -> None:
        self.buf += data
        while self.cuts and self.cuts[0] <= self.end:
            self._emit(self.cuts.popleft() - self.start)
        if self.tail and not self.cuts:
            while len(self.buf) > self.target:
                # the frame holding the last member ends with it (never inside its data)
                held = self.members_end - self.start
                self._emit(held if held > 0 else self.target)
                self.planned = self.start

    def _emit(self, n: int) -> None:
        if n <= 0:
            return
        with memoryview(self.buf) as view:
            chunk = bytes(view[:n])
        del self.buf[:n]
        self.emit(self.start, chunk)
        self.start += n

    def _cut(self, pos: int) -> None:
        self.cuts.append(pos)
        self.planned = pos

    def member(self, header: int, data: int, end: int) -> None:
        """Plan cuts for a member occupying tar bytes ``[header, end)``, data from ``data``."""
        target = self.target
        self.members_end = end
        if end - self.planned <= target:
            return  # it fits in the open frame
        if header > self.planned:
            self._cut(header)  # end the frame at the member boundary
        while end - self.planned > target:  # a big member: cut inside its data
            p = self.planned
            if p < data:
                cut = data + target  # the first piece carries the headers
            else:
                cut = data + ((p - data) // target + 1) * target
            if cut - p > 2 * target:
                cut = p + target  # giant headers: cut them like data, before the data
            elif cut >= end:
                break  # headers + data fit in one frame of at most twice the target
            self._cut(cut)
        self.feed(b"")

    def finish(self) -> None:
        self.tail = True
        self.feed(b"")
        self._emit(len(self.buf))


class _Tee(io.RawIOBase):
    """What tarfile reads, also fed to the cutter and the diff_id hash."""

    def __init__(self, src: IO[bytes], cutter: _Cutter) -> None:
        self.src = src
        self.cutter = cutter
        self.sha = hashlib.sha256()
        self.total = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        if data:
            data = bytes(data)
            self.sha.update(data)
            self.total += len(data)
            self.cutter.feed(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def convert_layer(
    tar_stream: IO[bytes],
    out: IO[bytes],
    *,
    frame_size: int = DEFAULT_FRAME_SIZE,
    level: int = DEFAULT_LEVEL,
    workers: int | None = None,
) -> ConvertResult:
    """Write the seekable blob for the uncompressed tar read from ``tar_stream`` to ``out``.

    Streams both ways (``out`` is only written, in order). Raises :class:`UnsafeMemberError`
    (naming the member) for a layer that breaks the untrusted-input rules and
    :class:`ConvertError` for a stream that is not a well-formed tar. ``out`` may hold a
    partial blob after an error; the caller discards it.
    """
    if frame_size % PAGE or not MIN_FRAME_SIZE <= frame_size <= MAX_FRAME_SIZE:
        raise ValueError(
            f"frame_size must be a multiple of {PAGE} in [{MIN_FRAME_SIZE}, "
            f"{MAX_FRAME_SIZE}], not {frame_size}"
        )
    workers = workers or min(32, os.cpu_count() or 1)
    writer = _FrameWriter(out, level, workers)
    try:
        cutter = _Cutter(frame_size, writer.submit)
        tee = _Tee(tar_stream, cutter)
        entries = _scan(tee, cutter)
        cutter.tail = True
        while tee.read(1 << 20):  # whatever follows the end-of-archive blocks, verbatim
            pass
        cutter.finish()
        writer.drain()
        diff_id = "sha256:" + tee.sha.hexdigest()
        toc_offset = writer.size
        doc = toc_document(
            tar_size=tee.total,
            diff_id=diff_id,
            frames=writer.frames,
            entries=entries,
            frame_size=frame_size,
            level=level,
        )
        toc_frame = encode_toc_frame(doc, level)
        writer.write(toc_frame)
        table_offset = writer.size
        sizes = [(f.c_size, f.u_size, f.checksum) for f in writer.frames]
        sizes.append((len(toc_frame), 0, EMPTY_XXH64_LOW32))
        seek_table = encode_seek_table(sizes)
        writer.write(seek_table)
        index_digest = "sha256:" + hashlib.sha256(toc_frame + seek_table).hexdigest()
    finally:
        writer.close()
    return ConvertResult(
        digest="sha256:" + writer.sha.hexdigest(),
        size=writer.size,
        diff_id=diff_id,
        tar_size=tee.total,
        frames=len(writer.frames),
        entries=len(entries),
        toc_offset=toc_offset,
        table_offset=table_offset,
        index_digest=index_digest,
    )


def convert_layer_blob(
    blob: IO[bytes], media_type: str | None, out: IO[bytes], **options: Any
) -> ConvertResult:
    """:func:`convert_layer` of a registry blob (gzip, zstd or plain tar, see
    :func:`open_layer_stream`)."""
    return convert_layer(open_layer_stream(blob, media_type), out, **options)


def _scan(tee: _Tee, cutter: _Cutter) -> list[TocEntry]:
    """Read the member list through ``tee``, planning frame cuts; checks that the stream ends
    with an end-of-archive block (or exactly at a member boundary)."""
    entries: list[TocEntry] = []
    try:
        tf = tarfile.open(fileobj=tee, mode="r|", encoding=ENCODING, errors=ERRORS)
    except tarfile.ReadError as exc:
        if tee.total == 0:
            return entries  # an empty stream: no members, nothing to cut
        raise ConvertError(f"not a tar stream: {exc}") from None
    start = 0  # where the next member's headers (a global pax header included) start
    try:
        while True:
            try:
                info = tf.next()
            except tarfile.TarError as exc:
                raise ConvertError(f"corrupt tar stream after byte {tf.offset}: {exc}") from None
            if info is None:
                break
            tf.members.clear()  # stream mode keeps every TarInfo otherwise
            problem = global_header_problem(tf.pax_headers)
            if problem is not None:
                raise ConvertError(f"layer member {info.name!r}: {problem}")
            end = tf.offset
            entries.append(tar_entry(info, start, end))
            cutter.member(start, info.offset_data, end)
            start = end
    finally:
        tf.close()
    _check_end(tee, cutter, tf.offset)
    return entries


def _check_end(tee: _Tee, cutter: _Cutter, pos: int) -> None:
    """tarfile ends its member list quietly at a bad or truncated header; a converter must
    not (the members after it would vanish from the TOC while ``tar`` reports an error)."""
    if tee.total == pos:
        return  # ends exactly after the last member (no end-of-archive blocks): accepted
    lo = pos - cutter.start
    block = bytes(cutter.buf[lo : lo + BLOCK]) if lo >= 0 else b""
    if len(block) < BLOCK:
        raise ConvertError(f"tar stream truncated at byte {pos} (a partial header block)")
    if block.count(0) != BLOCK:
        raise ConvertError(f"corrupt tar stream: invalid header at byte {pos}")
