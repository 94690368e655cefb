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

The reader trusts none of it: every field goes through :mod:`.validate` before use (a bad
header refuses the ring, a bad record or group line is skipped), and the directory scan
(:func:`scan_rings`) says a refused ring once and goes on: no ring file can end the agent.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# the module itself, not ``from . import``: that would import the package, whose enable()
# imports this module (a cycle)
import bootseer.colltrace.validate as validate
from striped_fs import PrivateDir, UnsafePath, open_owned

__all__ = [
    "MAGIC",
    "OPS",
    "DTYPES",
    "Op",
    "Refusals",
    "Ring",
    "RingInvalid",
    "RingReader",
    "RingSnapshot",
    "ring_name",
    "ring_names",
    "newest_per_rank",
    "read_ring",
    "read_rings",
    "scan_rings",
]

RingInvalid = validate.RingInvalid

MAGIC = b"BSCTRING"
VERSION = 1
HEADER_SIZE = 4096
GROUPS_SIZE = 65536
_HEADER = struct.Struct("<8sIIQQiiiqI64s")  # magic .. node
_HEAD_OFFSET = 24
_GROUPS_LEN_OFFSET = struct.calcsize("<8sIIQQiiiq")
_BODY = struct.Struct(
    "<QHHHHQQQqi"
)  # begin, group, op, flags, dtype, seq, numel, nbytes, t_issue, peer
_COMMIT = struct.Struct("<Q")
_DONE = struct.Struct("<qQ")  # t_done, done
#: a record as the reader unpacks it: body, 4 bytes of padding, commit, t_done, done; and
#: the parts of it the seqlock's first and third copies are read for
_RECORD = struct.Struct("<QHHHHQQQqi4xQqQ")
_RECORD_COMMIT = struct.Struct("<56xQ16x")
_RECORD_BEGIN_DONE = struct.Struct("<Q56xq8x")  # begin, t_done
RECORD_SIZE = 80
_COMMIT_OFFSET = 56
_DONE_OFFSET = 64
FAILED = 1 << 62
FLAG_P2P = 1

#: op codes: index into this tuple (names as torch.distributed calls them)
OPS = (
    "?",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "reduce",
    "send",
    "recv",
    "recv_anysource",
)
OP_CODE = {name: i for i, name in enumerate(OPS)}
DTYPES = (
    "?",
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}
#: the format's constants, as :mod:`.validate` checks them (one definition: here)
_LAYOUT = SimpleNamespace(
    MAGIC=MAGIC,
    VERSION=VERSION,
    HEADER_SIZE=HEADER_SIZE,
    GROUPS_SIZE=GROUPS_SIZE,
    RECORD_SIZE=RECORD_SIZE,
    HEADER_STRUCT=_HEADER,
)


def ring_name(rank: int, pid: int) -> str:
    return f"rank{rank}-{pid}.ring"


RING_DIR_WHAT = "the collective-trace ring directory (BOOTSEER_COLLTRACE_DIR, colltrace.dir)"


class Ring:
    """The writer side: one per training process, created 0600 in ``directory``, which is
    made 0700 or must be this user's, 0700, not a link (``striped_fs.privdir``); the file is
    created exclusively through the directory's descriptor, never through a link."""

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        world: int,
        *,
        capacity: int = 4096,
        node: str = "",
    ) -> None:
        if not 1 <= capacity <= validate.MAX_CAPACITY:
            raise ValueError(
                f"colltrace ring capacity must be in [1, {validate.MAX_CAPACITY}]"
                f", got {capacity} (colltrace.capacity, "
                "BOOTSEER_COLLTRACE_CAPACITY)"
            )
        self._dir = PrivateDir.open(directory, what=RING_DIR_WHAT)
        name = ring_name(rank, os.getpid())
        self.path = Path(self._dir.where(name))
        self.capacity = capacity
        size = HEADER_SIZE + GROUPS_SIZE + capacity * RECORD_SIZE
        # made under a hidden name and renamed into place once sized and its header written:
        # a reader never sees a ring half made (it would refuse it, and say so)
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        fd = self._dir.create(tmp, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _HEADER.pack_into(
                self._mm,
                0,
                MAGIC,
                VERSION,
                RECORD_SIZE,
                capacity,
                0,
                rank,
                world,
                os.getpid(),
                time.time_ns(),
                0,
                node.encode()[:64],
            )
            # an earlier process's file of this pid is replaced (the directory is ours)
            os.replace(tmp, name, src_dir_fd=self._dir.fd, dst_dir_fd=self._dir.fd)
        except BaseException:
            self._dir.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self._groups_len = 0

    def add_group(self, gid: int, doc: dict[str, Any]) -> None:
        """A process group's line in the table (rare: once per group); a full table drops it."""
        line = (json.dumps({"id": gid, **doc}, separators=(",", ":")) + "\n").encode()
        start = HEADER_SIZE + self._groups_len
        if self._groups_len + len(line) > GROUPS_SIZE:
            return
        self._mm[start : start + len(line)] = line
        self._groups_len += len(line)
        struct.pack_into("<I", self._mm, _GROUPS_LEN_OFFSET, self._groups_len)

    def write(
        self,
        n: int,
        group: int,
        op: int,
        flags: int,
        dtype: int,
        seq: int,
        numel: int,
        nbytes: int,
        t_issue: int,
        peer: int,
    ) -> int:
        """Record op number ``n`` (0-based, unique per process); returns its offset for
        :meth:`complete`."""
        off = HEADER_SIZE + GROUPS_SIZE + (n % self.capacity) * RECORD_SIZE
        mm = self._mm
        _BODY.pack_into(mm, off, n + 1, group, op, flags, dtype, seq, numel, nbytes, t_issue, peer)
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
    # the records and group lines this read skipped as malformed (:mod:`.validate`)
    skips: validate.Skips = field(default_factory=validate.Skips, compare=False)


class RingReader:
    """Maps a ring read-only; :meth:`read` snapshots it (cheap enough every second).

    Only a regular file of this process's user (``uid``) is mapped, opened without following
    a link (relative to ``dir_fd`` when given: the directory a :class:`PrivateDir` checked);
    anything else is refused (:class:`striped_fs.privdir.UnsafePath`) before a byte is read.
    Every byte read is checked by :mod:`.validate` first: a header that fails refuses the
    ring (:class:`~.validate.RingInvalid`, a ``ValueError``, naming the file and the field);
    a record or group line that fails is skipped and counted in :attr:`skips`. The file is
    mapped at the exact size its header's capacity gives, and its size is checked again on
    every read: a file cut shorter meanwhile is refused, never read past its end (SIGBUS)."""

    def __init__(
        self, path: str | os.PathLike, *, dir_fd: int | None = None, uid: int | None = None
    ) -> None:
        self.path = str(path)
        fd = open_owned(
            os.path.basename(self.path) if dir_fd is not None else self.path,
            dir_fd=dir_fd,
            uid=uid,
            where=self.path,
        )
        try:
            size = os.fstat(fd).st_size
            hdr = validate.header(os.pread(fd, _HEADER.size, 0), size, self.path, layout=_LAYOUT)
            self._mm = mmap.mmap(fd, hdr.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept: the size is checked on each read (fstat)
        self.header = hdr
        self.capacity, self.rank, self.world, self.pid = hdr.capacity, hdr.rank, hdr.world, hdr.pid
        self.created = hdr.created_ns / 1e9
        self.node = hdr.node
        self.skips = validate.Skips()
        self._groups: dict[int, dict[str, Any]] = {}
        self._groups_read = 0
        self._group_skips = validate.Skips()

    def _check_size(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < self.header.size:
            raise validate.RingInvalid(
                self.path, f"cut to {size} bytes while mapped ({self.header.size} expected)"
            )

    def _read_groups(self) -> None:
        (glen,) = struct.unpack_from("<I", self._mm, _GROUPS_LEN_OFFSET)
        glen = validate.groups_len(glen, self.path, GROUPS_SIZE)
        if glen <= self._groups_read:
            return
        chunk = bytes(self._mm[HEADER_SIZE + self._groups_read : HEADER_SIZE + glen])
        for line in chunk.splitlines():
            doc = validate.group_line(line, self.world)
            if isinstance(doc, str):
                self._group_skips.add(doc)
                continue
            self._groups[doc["id"]] = doc
        self._groups_read = glen

    def _group_name(self, gid: int) -> str:
        group = self._groups.get(gid)
        if group is None:  # a group added since the last read of the table
            self._read_groups()
            group = self._groups.get(gid, {"name": f"?{gid}"})
        return group["name"]

    def read(self) -> RingSnapshot:
        self._check_size()
        (head,) = struct.unpack_from("<Q", self._mm, _HEAD_OFFSET)
        head = validate.head(head, self.path)
        self._read_groups()
        snap = RingSnapshot(
            self.path,
            self.rank,
            self.world,
            self.pid,
            self.node,
            self.created,
            head,
            {g["name"]: g for g in self._groups.values()},
        )
        skips = validate.Skips(self._group_skips.reasons.copy())
        cap = self.capacity
        # the per-record seqlock, batched: three successive copies of the slots read (the
        # commit marker from the first, the body from the second, the begin marker again
        # from the third: the order a reader of one record keeps), unpacked in C
        lo = max(0, head - cap)  # one slot past head too: a thread may have claimed it
        slots = min(cap, head + 1)
        start = HEADER_SIZE + GROUPS_SIZE
        end = start + slots * RECORD_SIZE
        mm = self._mm
        first = [c for (c,) in _RECORD_COMMIT.iter_unpack(mm[start:end])]
        body = list(_RECORD.iter_unpack(mm[start:end]))
        last = list(_RECORD_BEGIN_DONE.iter_unpack(mm[start:end]))
        snap.ops = validate.records(
            first,
            body,
            last,
            lo,
            head,
            cap,
            self.header,
            skips,
            self._group_name,
            Op,
            OPS,
            DTYPES,
            FLAG_P2P,
            FAILED,
        )
        self.skips = snap.skips = skips
        return snap

    def close(self) -> None:
        try:
            self._mm.close()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_ring(path: str | os.PathLike) -> RingSnapshot:
    """One ring file's snapshot; a ring that fails its checks raises :class:`RingInvalid`
    (a ``ValueError`` naming the file and the field), another user's or a link
    :class:`~striped_fs.privdir.UnsafePath`."""
    reader = RingReader(path)
    try:
        return reader.read()
    finally:
        reader.close()


def ring_names(directory: PrivateDir) -> list[str]:
    """The ring files' names in a checked directory."""
    return [n for n in directory.names() if n.startswith("rank") and n.endswith(".ring")]


def _say(line: str) -> None:
    print(f"bootseer: colltrace: {line}", file=sys.stderr, flush=True)


class Refusals:
    """What the reader skipped, said once: per file and kind of refusal (not a usable ring,
    another user's, unreadable, malformed entries of a kind), until the file reads whole
    again (a ring refused every pass is one line, not one a second)."""

    def __init__(self, log: Callable[[str], None] = _say) -> None:
        self.log = log
        self._said: dict[str, Any] = {}

    def say(self, key: str, line: str, sig: Any = None) -> None:
        sig = line if sig is None else sig
        if self._said.get(key) != sig:
            self._said[key] = sig
            self.log(line)

    def clear(self, key: str) -> None:
        self._said.pop(key, None)


def scan_rings(
    where: PrivateDir, refusals: Refusals, readers: dict[str, RingReader] | None = None
) -> list[RingSnapshot]:
    """Every ring file's snapshot in a checked directory (all of them: see
    :func:`newest_per_rank`), each read on its own. A file that is not a usable ring (its
    checks, another user's, a link, unreadable) is said once through ``refusals`` and
    skipped; so is anything unexpected while reading one: no ring can end the caller.
    ``readers``: mapped readers kept across calls (path -> reader), else each is closed."""
    snaps = []
    try:
        names = ring_names(where)
    except OSError as exc:
        refusals.say(where.path, f"cannot list the ring directory {where.path}: {exc}")
        return []
    for name in names:
        key = where.where(name)
        reader = readers.get(key) if readers is not None else None
        try:
            if reader is None:
                reader = RingReader(key, dir_fd=where.fd)
                if readers is not None:
                    readers[key] = reader
            snap = reader.read()
        except FileNotFoundError:  # gone between the listing and the open
            continue
        except UnsafePath as exc:  # not this user's regular file: never read
            refusals.say(key, f"refused: {exc}")
            continue
        except RingInvalid as exc:
            refusals.say(key, str(exc), "invalid")  # once, until it reads whole again
            _drop(readers, key, reader)
            continue
        except OSError as exc:
            refusals.say(key, f"cannot read the ring {key}: {exc}: skipped")
            _drop(readers, key, reader)
            continue
        except Exception as exc:  # noqa: BLE001 - a reader's bug must not end the agent
            refusals.say(
                key,
                f"{key}: unreadable ring ({type(exc).__name__}: {exc}): skipped",
                type(exc).__name__,
            )
            _drop(readers, key, reader)
            continue
        finally:
            if readers is None and reader is not None:
                reader.close()
        refusals.clear(key)
        if snap.skips:
            refusals.say(
                key + "#skips", f"{key}: {snap.skips.line()}", frozenset(snap.skips.reasons)
            )
        snaps.append(snap)
    return snaps


def _drop(readers: dict[str, RingReader] | None, key: str, reader: RingReader | None) -> None:
    """A reader whose ring failed: closed and forgotten (the file is opened afresh next
    pass: a rank may have rewritten it)."""
    if readers is not None and readers.pop(key, None) is not None and reader is not None:
        reader.close()


def read_rings(
    directory: str | os.PathLike, *, log: Callable[[str], None] = _say
) -> list[RingSnapshot]:
    """The newest ring of every rank in ``directory`` (none when it does not exist); files
    that are unreadable, not rings, malformed (:mod:`.validate`) or not this user's are said
    through ``log`` and skipped. A directory that is not this user's own (0700, not a link)
    is refused (:class:`~striped_fs.privdir.UnsafePath`): its rings could be anyone's."""
    try:
        where = PrivateDir.open(directory, create=False, what=RING_DIR_WHAT)
    except FileNotFoundError:
        return []
    with where:
        return newest_per_rank(scan_rings(where, Refusals(log)))


def newest_per_rank(snaps: list[RingSnapshot]) -> list[RingSnapshot]:
    """One ring per rank, the newest (an older process's ring of a rank is an earlier
    attempt's), in rank order."""
    newest: dict[int, RingSnapshot] = {}
    for snap in snaps:
        old = newest.get(snap.rank)
        if old is None or snap.created > old.created:
            newest[snap.rank] = snap
    return [newest[r] for r in sorted(newest)]
