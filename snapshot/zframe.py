"""Bounded zstd decompression of untrusted objects: snapshot chunks, TOCs, verification TOCs.

A frame header's content size is the publisher's word. python-zstandard's one-shot
``decompress`` allocates what the header declares and then ignores ``max_output_size``, so it
is never used here. Instead a frame's size is checked before anything is allocated: declared
in the header, equal to what the manifest declares, under a limit, and possible for the bytes
at hand (zstd cannot expand more than 32768:1: a block yields at most 128 KiB and costs at
least 4 bytes). The frame is then streamed into a buffer of exactly that size, and one byte
more is asked for: a frame, or a frame after it, that yields more than declared is refused
having produced no more than the buffer holds.
"""

from __future__ import annotations

import zstandard

from .errors import CorruptSnapshotError

MAX_RATIO = (128 << 10) // 4
"""The most a zstd frame can expand: a 128 KiB block from a 3-byte header and 1 byte."""


def _corrupt(what: str, chunk: str | None, rule: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"{what}: {rule}", chunk=chunk, rule=rule)


def frame_size(
    data: bytes, what: str, *, declared: int | None, limit: int, chunk: str | None = None
) -> int:
    """The content size of the zstd frame ``data``, checked (see the module docstring)
    against ``declared`` (the manifest's, when there is one), ``limit`` and ``len(data)``."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise _corrupt(what, chunk, f"not a zstd frame ({exc})") from None
    if size < 0:
        raise _corrupt(what, chunk, "the zstd frame declares no content size in its header")
    if declared is not None and size != declared:
        raise _corrupt(
            what, chunk, f"frame declares {size} bytes in its header, the manifest {declared}"
        )
    if size > limit:
        raise _corrupt(what, chunk, f"frame declares {size} bytes, more than the limit {limit}")
    if size > len(data) * MAX_RATIO:
        raise _corrupt(
            what,
            chunk,
            f"{size} bytes declared from {len(data)} compressed bytes: "
            f"more than zstd can expand (at most {MAX_RATIO}:1)",
        )
    return size


def inflate_into(
    decomp: zstandard.ZstdDecompressor,
    data: bytes,
    out: memoryview,
    what: str,
    *,
    chunk: str | None = None,
) -> None:
    """Decompress ``data`` into ``out``, which it must fill exactly: a stream that ends short
    or goes on (in this frame or a next one) is refused, and nothing beyond ``out`` is kept."""
    want = len(out)
    got = 0
    try:
        reader = decomp.stream_reader(data, read_across_frames=True)
        while got < want:
            n = reader.readinto(out[got:])
            if not n:
                break
            got += n
        more = reader.read(1)
    except zstandard.ZstdError as exc:
        raise _corrupt(
            what, chunk, f"does not decompress to exactly its declared {want} bytes (zstd: {exc})"
        ) from None
    if got != want or more:
        detail = "more follows" if more else f"it ends after {got}"
        raise _corrupt(
            what, chunk, f"does not decompress to exactly its declared {want} bytes ({detail})"
        )


def inflate(
    data: bytes, what: str, *, declared: int | None, limit: int, chunk: str | None = None
) -> bytearray:
    """``data`` decompressed, into a buffer allocated only once its size passed the checks."""
    out = bytearray(frame_size(data, what, declared=declared, limit=limit, chunk=chunk))
    inflate_into(zstandard.ZstdDecompressor(), data, memoryview(out), what, chunk=chunk)
    return out
