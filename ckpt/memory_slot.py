"""One in-memory checkpoint copy: a file in shared memory, with its header written last.

Layout of a slot file (docs/ckpt.md, "The memory tier")::

    [0, 4096)          header: MAGIC (8 bytes, written last: the commit flag), the length and
                       CRC-32 of a JSON header (step, rank, world size, sizes, meta CRC-32)
    [4096, +data)      the rank's tensors, raw, each at a 64-byte aligned offset
    [.., +meta)        meta: JSON (each tensor's key, dtype, shape, box, offset; the block
                       sums of the data) followed by the pickled non-tensor objects

A copy in progress has no MAGIC (it is cleared before the first byte is written), so a
reader never takes a torn copy. The data is checked in blocks of ``BLOCK`` bytes by xxHash's
XXH3-64 (``block_sums``): one pass at about memory speed that catches flipped bits, bytes or
words and reordered words alike (a word sum, as fast, misses the last); the meta (small) by
CRC-32.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from striped_fs import UnsafePath, owned_file

MAGIC = b"BSMEMCK1"
HEADER = 4096
BLOCK = 1 << 20
STAMP_SUFFIX = ".stamp"  # the node agent's verdict on a copy, beside its file (memory_verify)
VERSION = 2  # 2: block sums are XXH3-64 (1: 64-bit word sums)
_PREFIX = struct.Struct("<8sII")  # magic, json length, json crc32
_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class SlotDamaged(Exception):
    """A copy that must not be loaded; the message names the file and what is wrong."""


def pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def block_hash(data: memoryview | np.ndarray) -> int:
    """XXH3-64 of one block (a well-kept C hash at about memory speed)."""
    return xxhash.xxh3_64_intdigest(data)


def block_sums(data: memoryview | np.ndarray, block: int = BLOCK) -> list[int]:
    """The XXH3-64 of each ``block`` bytes of ``data``: a changed, moved or swapped word
    changes its block's value (a 64-bit word sum, measured as fast, missed reordering)."""
    view = memoryview(data).cast("B")
    return [block_hash(view[i : i + block]) for i in range(0, len(view), block)]


@dataclass
class SlotHeader:
    """What the JSON header says; ``total`` is the file's size."""

    step: int
    rank: int
    world_size: int
    data_size: int  # bytes of tensor data (a multiple of 8)
    meta_size: int
    meta_crc32: int
    created: float
    job: str = ""

    @property
    def total(self) -> int:
        return HEADER + self.data_size + self.meta_size

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **self.__dict__}

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> SlotHeader:
        if type(raw) is not dict:
            raise SlotDamaged(f"{where}: the header is a {type(raw).__name__}, not an object")
        if raw.get("version") != VERSION:
            raise SlotDamaged(
                f"{where}: header version {raw.get('version')!r}, this reader knows {VERSION}"
            )
        try:
            head = cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise SlotDamaged(f"{where}: header lacks {exc}") from None
        ints = (
            head.step,
            head.rank,
            head.world_size,
            head.data_size,
            head.meta_size,
            head.meta_crc32,
        )
        if (
            not all(type(x) is int and x >= 0 for x in ints)
            or head.data_size % 8
            or type(head.created) not in (int, float)
            or type(head.job) is not str
        ):
            raise SlotDamaged(
                f"{where}: header holds a negative, misaligned or mistyped field: {str(raw)[:300]}"
            )
        return head


class SlotFile:
    """One slot file, mapped shared; grown (never shrunk) to the size a copy needs.

    Opened relative to its directory's descriptor (``dir_fd``: a directory that
    ``striped_fs.privdir`` made or checked; else the path's own directory), never through a
    link, and used only when it is a regular file of this process's user with one link: a
    file another user planted or a hard link to someone else's file is refused
    (:class:`~striped_fs.privdir.UnsafePath`) before a byte is read or written. The stamp
    beside it goes through the same descriptor."""

    def __init__(self, path: str, *, readonly: bool = False, dir_fd: int | None = None) -> None:
        """``readonly``: an existing slot, mapped for reading only (a node's own copies served
        to its peers): never created, never written (FileNotFoundError when it is gone)."""
        self.path = path
        self.readonly = readonly
        self.name = os.path.basename(path)
        self.dir_fd = (
            os.dup(dir_fd)
            if dir_fd is not None
            else os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        )
        flags = os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT
        try:
            fd = os.open(
                self.name,
                flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                0o600,
                dir_fd=self.dir_fd,
            )
            self.fd = owned_file(fd, f"memory-checkpoint slot {path}")
            os.set_blocking(self.fd, True)
        except OSError as exc:
            os.close(self.dir_fd)
            if getattr(exc, "errno", None) == errno.ELOOP:
                raise UnsafePath(
                    f"memory-checkpoint slot {path} is a link: never followed; "
                    "another user may have planted it: remove it"
                ) from None
            raise
        self.map: mmap.mmap | None = None
        self.size = 0
        self._remap()

    def _remap(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != self.size or self.map is None:
            # populated: the pages are mapped in one call, not faulted in one by one
            prot = mmap.PROT_READ if self.readonly else mmap.PROT_READ | mmap.PROT_WRITE
            self.map = mmap.mmap(self.fd, size, flags=_FLAGS, prot=prot) if size else None
            self.size = size

    def ensure(self, total: int) -> None:
        """Room for ``total`` bytes; the old copy is gone once this grows the file."""
        if self.size < total:
            self.invalidate()
            os.ftruncate(self.fd, total)
            self.map = None
            self._remap()

    def view(self, start: int, length: int) -> memoryview:
        assert self.map is not None and start + length <= self.size
        return memoryview(self.map)[start : start + length]

    def invalidate(self) -> None:
        """Clear the commit flag: from here on the copy is in progress. The node agent's
        stamp of the old copy goes too (``memory_verify``; it is bound to that copy anyway,
        but a copy received again alike must not meet a stale verdict)."""
        if self.map is not None and self.size >= HEADER:
            self.map[0:8] = b"\0" * 8
        try:
            os.unlink(self.name + STAMP_SUFFIX, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass

    def commit(self, head: SlotHeader) -> None:
        """Write the JSON header, then MAGIC last."""
        assert self.map is not None
        body = json.dumps(head.to_json(), sort_keys=True).encode()
        if len(body) > HEADER - _PREFIX.size:
            raise ValueError(f"slot header of {len(body)} bytes does not fit {HEADER}")
        self.map[_PREFIX.size : _PREFIX.size + len(body)] = body
        self.map[8 : _PREFIX.size] = struct.pack("<II", len(body), zlib.crc32(body))
        self.map[0:8] = MAGIC

    def header(self) -> SlotHeader | None:
        """The committed copy's header; ``None`` when none is committed (empty or torn).

        Raises :class:`SlotDamaged` for a committed header that does not check."""
        self._remap()
        if self.map is None or self.size < HEADER:
            return None
        magic, length, crc = _PREFIX.unpack_from(self.map, 0)
        if magic != MAGIC:
            return None
        body = bytes(self.map[_PREFIX.size : _PREFIX.size + min(length, HEADER)])
        if length > HEADER - _PREFIX.size or zlib.crc32(body) != crc:
            raise SlotDamaged(f"{self.path}: header fails its CRC-32")
        head = SlotHeader.from_json(json.loads(body), self.path)
        if head.total > self.size:
            raise SlotDamaged(
                f"{self.path}: header says {head.total} bytes, the file holds {self.size}"
            )
        return head

    def meta(self, head: SlotHeader) -> tuple[dict[str, Any], bytes]:
        """The checked meta: (JSON, objects blob)."""
        raw = self.view(HEADER + head.data_size, head.meta_size)
        if zlib.crc32(raw) != head.meta_crc32:
            raise SlotDamaged(f"{self.path}: step {head.step}: meta fails its CRC-32")
        (length,) = struct.unpack_from("<I", raw, 0)
        if 4 + length > len(raw):
            raise SlotDamaged(f"{self.path}: meta length {length} exceeds {len(raw)} bytes")
        try:
            meta = json.loads(bytes(raw[4 : 4 + length]))
        except ValueError:
            raise SlotDamaged(f"{self.path}: step {head.step}: meta is not JSON") from None
        blocks = (head.data_size + BLOCK - 1) // BLOCK
        if (
            type(meta) is not dict
            or type(meta.get("sums")) is not list
            or type(meta.get("entries")) is not list
        ):
            raise SlotDamaged(
                f"{self.path}: step {head.step}: meta is not an object with entries and sums"
            )
        if len(meta["sums"]) != blocks:
            raise SlotDamaged(
                f"{self.path}: step {head.step}: {len(meta.get('sums', ()))} "
                f"block sums for {blocks} blocks"
            )
        return meta, bytes(raw[4 + length :])

    def check_data(self, head: SlotHeader, sums: list[int]) -> None:
        """Every block of the data against its sum (the whole copy, e.g. on receipt)."""
        got = block_sums(self.view(HEADER, head.data_size))
        for i, (a, b) in enumerate(zip(got, sums, strict=True)):
            if a != b:
                raise SlotDamaged(
                    f"{self.path}: step {head.step}: data block {i} (bytes "
                    f"{i * BLOCK}..) fails its checksum"
                )

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view is still exported: the mapping goes with it
                pass
            self.map = None
        os.close(self.fd)
        os.close(self.dir_fd)


def pack_meta(meta: dict[str, Any], blob: bytes) -> bytes:
    body = json.dumps(meta, separators=(",", ":")).encode()
    return struct.pack("<I", len(body)) + body + blob


def slot_paths(directory: str, name: str) -> tuple[str, str]:
    """The two files of a double buffer."""
    return (os.path.join(directory, f"{name}.0"), os.path.join(directory, f"{name}.1"))


def newest(slots: list[SlotFile]) -> list[tuple[SlotHeader, SlotFile]]:
    """Committed copies whose header checks, newest first (damaged headers are skipped)."""
    found = []
    for slot in slots:
        try:
            head = slot.header()
        except (SlotDamaged, ValueError):
            continue
        if head is not None:
            found.append((head, slot))
    return sorted(found, key=lambda x: -x[0].step)
