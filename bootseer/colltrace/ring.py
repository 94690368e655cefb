"""A fixed-size ring of collective records in a shared-memory file, one per rank.

Why a file in ``/dev/shm`` and fixed-size records: the training thread writes a record with
two ``struct.pack_into`` calls into an ``mmap`` (no I/O, no lock, nothing grows), and any
reader (the node agent) maps the same file read-only. The memory stays when the process is
SIGKILLed, so a dead rank's last operations are still readable.

Layout (little-endian)::

    header   4 KiB: magic, version, record size, capacity, head (records written), rank,
                    world, pid, created (ns), bytes used in the group table, node name
    groups  64 KiB: one JSON line per process group the rank used ({"id", "name", "desc",
                    "ranks", "rank"}), appended; the header's length covers whole lines only
    records capacity x 80 bytes

A record is a per-record seqlock: ``begin`` is written first, the body, then ``commit``; a
reader keeps a record only when both equal the op number it expects in that slot. The
completion is written later (by whichever thread completes the work) as ``t_done`` then
``done``; ``done`` equal to the op number (bit 62 set: failed) makes ``t_done`` valid. A slot
reused for a newer op carries a newer op number, so a stale completion never matches.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from striped_fs.privdir import PrivateDir, open_owned

__all__ = ["MAGIC", "OPS", "DTYPES", "Op", "Ring", "RingReader", "RingSnapshot", "ring_name",
           "ring_names", "newest_per_rank", "read_ring", "read_rings"]

MAGIC = b"BSCTRING"
VERSION = 1
HEADER_SIZE = 4096
GROUPS_SIZE = 65536
_HEADER = struct.Struct("<8sIIQQiiiqI64s")  # magic .. node
_HEAD_OFFSET = 24
_GROUPS_LEN_OFFSET = struct.calcsize("<8sIIQQiiiq")
_BODY = struct.Struct("<QHHHHQQQqi")  # begin, group, op, flags, dtype, seq, numel, nbytes, t_issue, peer
_COMMIT = struct.Struct("<Q")
_DONE = struct.Struct("<qQ")  # t_done, done
RECORD_SIZE = 80
_COMMIT_OFFSET = 56
_DONE_OFFSET = 64
FAILED = 1 << 62
FLAG_P2P = 1

#: op codes: index into this tuple (names as torch.distributed calls them)
OPS = ("?", "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_single",
       "all_gather_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter",
       "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "all_to_all",
       "all_to_all_single", "barrier", "monitored_barrier", "gather", "scatter", "reduce",
       "send", "recv", "recv_anysource")
OP_CODE = {name: i for i, name in enumerate(OPS)}
DTYPES = ("?", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}


def ring_name(rank: int, pid: int) -> str:
    return f"rank{rank}-{pid}.ring"


RING_DIR_WHAT = "the collective-trace ring directory (BOOTSEER_COLLTRACE_DIR, colltrace.dir)"


class Ring:
    """The writer side: one per training process, created 0600 in ``directory``, which is
    made 0700 or must be this user's, 0700, not a link (``striped_fs.privdir``); the file is
    created exclusively through the directory's descriptor, never through a link."""

    def __init__(self, directory: str | os.PathLike, rank: int, world: int, *,
                 capacity: int = 4096, node: str = "") -> None:
        if capacity < 1:
            raise ValueError(f"colltrace ring capacity must be >= 1, got {capacity}")
        self._dir = PrivateDir.open(directory, what=RING_DIR_WHAT)
        name = ring_name(rank, os.getpid())
        self.path = Path(self._dir.where(name))
        self.capacity = capacity
        size = HEADER_SIZE + GROUPS_SIZE + capacity * RECORD_SIZE
        try:
            fd = self._dir.create(name, os.O_RDWR)
        except FileExistsError:  # an earlier process of this pid's: ours (the directory is)
            self._dir.unlink(name)
            fd = self._dir.create(name, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._mm, 0, MAGIC, VERSION, RECORD_SIZE, capacity, 0, rank, world,
                          os.getpid(), time.time_ns(), 0, node.encode()[:64])
        self._groups_len = 0

    def add_group(self, gid: int, doc: dict[str, Any]) -> None:
        """A process group's line in the table (rare: once per group); a full table drops it."""
        line = (json.dumps({"id": gid, **doc}, separators=(",", ":")) + "\n").encode()
        start = HEADER_SIZE + self._groups_len
        if self._groups_len + len(line) > GROUPS_SIZE:
            return
        self._mm[start:start + len(line)] = line
        self._groups_len += len(line)
        struct.pack_into("<I", self._mm, _GROUPS_LEN_OFFSET, self._groups_len)

    def write(self, n: int, group: int, op: int, flags: int, dtype: int, seq: int, numel: int,
              nbytes: int, t_issue: int, peer: int) -> int:
        """Record op number ``n`` (0-based, unique per process); returns its offset for
        :meth:`complete`."""
        off = HEADER_SIZE + GROUPS_SIZE + (n % self.capacity) * RECORD_SIZE
        mm = self._mm
        _BODY.pack_into(mm, off, n + 1, group, op, flags, dtype, seq, numel, nbytes, t_issue,
                        peer)
        _COMMIT.pack_into(mm, off + _COMMIT_OFFSET, n + 1)
        _COMMIT.pack_into(mm, _HEAD_OFFSET, n + 1)
        return off

    def complete(self, off: int, n: int, t_done: int, failed: bool = False) -> None:
        _DONE.pack_into(self._mm, off + _DONE_OFFSET, t_done, (n + 1) | (FAILED if failed else 0))

    def close(self, unlink: bool = False) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
        if unlink:
            try:
                self._dir.unlink(self.path.name)
            except OSError:
                pass
        self._dir.close()


@dataclass(frozen=True)
class Op:
    """One recorded operation as a reader sees it (times in seconds since the epoch)."""

    rank: int
    n: int  # op number in the rank's process
    group: str  # the group's torch name (the same on every rank)
    op: str
    seq: int  # per group (collectives) or per group and peer (p2p), from 1
    numel: int
    nbytes: int
    dtype: str
    t_issue: float
    t_done: float | None
    failed: bool
    p2p: bool
    peer: int  # the peer's global rank for p2p, else -1


@dataclass
class RingSnapshot:
    """What one ring held when read."""

    path: str
    rank: int
    world: int
    pid: int
    node: str
    created: float
    head: int
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # torch name -> entry
    ops: list[Op] = field(default_factory=list)  # oldest first


class RingReader:
    """Maps a ring read-only; :meth:`read` snapshots it (cheap enough every second).

    Only a regular file of this process's user (``uid``) is mapped, opened without following
    a link (relative to ``dir_fd`` when given: the directory a :class:`PrivateDir` checked);
    anything else is refused (:class:`striped_fs.privdir.UnsafePath`) before a byte is read."""

    def __init__(self, path: str | os.PathLike, *, dir_fd: int | None = None,
                 uid: int | None = None) -> None:
        self.path = str(path)
        fd = open_owned(os.path.basename(self.path) if dir_fd is not None else self.path,
                        dir_fd=dir_fd, uid=uid, where=self.path)
        try:
            self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, rsize, cap, _, rank, world, pid, created, _, node = \
            _HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or version != VERSION or rsize != RECORD_SIZE:
            self._mm.close()
            raise ValueError(f"{self.path} is not a colltrace ring of version {VERSION} "
                             f"(magic {magic!r}, version {version}): remove it")
        self.capacity, self.rank, self.world, self.pid = cap, rank, world, pid
        self.created = created / 1e9
        self.node = node.rstrip(b"\0").decode(errors="replace")
        self._groups: dict[int, dict[str, Any]] = {}
        self._groups_read = 0

    def _read_groups(self) -> None:
        (glen,) = struct.unpack_from("<I", self._mm, _GROUPS_LEN_OFFSET)
        if glen <= self._groups_read:
            return
        chunk = bytes(self._mm[HEADER_SIZE + self._groups_read:HEADER_SIZE + glen])
        for line in chunk.splitlines():
            try:
                doc = json.loads(line)
                self._groups[int(doc["id"])] = doc
            except (ValueError, KeyError, TypeError):
                continue
        self._groups_read = glen

    def read(self) -> RingSnapshot:
        (head,) = struct.unpack_from("<Q", self._mm, _HEAD_OFFSET)
        self._read_groups()
        snap = RingSnapshot(self.path, self.rank, self.world, self.pid, self.node, self.created,
                            head, {g["name"]: g for g in self._groups.values()})
        mm = self._mm
        base = HEADER_SIZE + GROUPS_SIZE
        # one slot past head too: a thread may have claimed a later number first
        for n in range(max(0, head - self.capacity), head + 1):
            off = base + (n % self.capacity) * RECORD_SIZE
            (commit,) = _COMMIT.unpack_from(mm, off + _COMMIT_OFFSET)
            body = _BODY.unpack_from(mm, off)
            (again,) = _COMMIT.unpack_from(mm, off)  # begin, re-read after the body
            if not commit == body[0] == again == n + 1:
                continue  # being written, or overwritten since
            t_done, done = _DONE.unpack_from(mm, off + _DONE_OFFSET)
            _, gid, op, flags, dtype, seq, numel, nbytes, t_issue, peer = body
            group = self._groups.get(gid)
            if group is None:
                self._read_groups()
                group = self._groups.get(gid, {"name": f"?{gid}"})
            finished = (done & ~FAILED) == n + 1
            snap.ops.append(Op(self.rank, n, group["name"], OPS[op] if op < len(OPS) else "?",
                               seq, numel, nbytes, DTYPES[dtype] if dtype < len(DTYPES) else "?",
                               t_issue / 1e9, t_done / 1e9 if finished else None,
                               finished and bool(done & FAILED), bool(flags & FLAG_P2P), peer))
        return snap

    def close(self) -> None:
        self._mm.close()


def read_ring(path: str | os.PathLike) -> RingSnapshot:
    reader = RingReader(path)
    try:
        return reader.read()
    finally:
        reader.close()


def ring_names(directory: PrivateDir) -> list[str]:
    """The ring files' names in a checked directory."""
    return [n for n in directory.names() if n.startswith("rank") and n.endswith(".ring")]


def read_rings(directory: str | os.PathLike) -> list[RingSnapshot]:
    """The newest ring of every rank in ``directory`` (none when it does not exist); files
    that are unreadable, not rings, or not this user's are skipped. A directory that is not
    this user's own (0700, not a link) is refused (:class:`~striped_fs.privdir.UnsafePath`):
    its rings could be anyone's."""
    try:
        where = PrivateDir.open(directory, create=False, what=RING_DIR_WHAT)
    except FileNotFoundError:
        return []
    snaps = []
    with where:
        for name in ring_names(where):
            try:
                reader = RingReader(where.where(name), dir_fd=where.fd)
            except (OSError, ValueError):
                continue
            try:
                snaps.append(reader.read())
            except (OSError, ValueError):
                pass
            finally:
                reader.close()
    return newest_per_rank(snaps)


def newest_per_rank(snaps: list[RingSnapshot]) -> list[RingSnapshot]:
    """One ring per rank, the newest (an older process's ring of a rank is an earlier
    attempt's), in rank order."""
    newest: dict[int, RingSnapshot] = {}
    for snap in snaps:
        old = newest.get(snap.rank)
        if old is None or snap.created > old.created:
            newest[snap.rank] = snap
    return [newest[r] for r in sorted(newest)]
