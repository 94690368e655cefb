"""The one typed validator of everything read from a ring file or a shipped ring window.

Why: a ring is the job's own channel (DESIGN.md, "The job's own channels are untrusted input
too"). Its directory is private and its file the user's own (:mod:`striped_fs.privdir`), but
any process of the user can write into it: a rank's bug, a stale ring of another version, a
planted file. Before this module the reader unpacked the header and records as they came, and
15 crafted rings showed the cost: 8 raised out of the reader (``struct.error`` on a short
header, ``ZeroDivisionError`` on capacity 0, ``KeyError`` on a group line without a name,
``OverflowError`` on offsets past the map), and two of them beside a live job ended
``bootseer run`` and its trainer.

So every field is checked here before any other code sees it: the header (magic, version,
record size, capacity bounded and matching the file's size exactly, head, rank within world,
pid, creation time, the group table's length within its region, the node name), each group
line (JSON object of known keys and types, bounded strings, ranks within world) and each
record (known op and dtype codes, known flags, a peer only for p2p and within world, counts
bounded, times within [1970, 2100)). A ring whose header fails is refused whole
(:class:`RingInvalid`, naming the file and the field); a record or group line that fails is
skipped and counted (:class:`Skips`), the rest of the ring is kept. Nothing here raises
anything but :class:`RingInvalid`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GROUP_KEYS",
    "MAX_CAPACITY",
    "MAX_COUNT",
    "MAX_GROUP_LINE",
    "MAX_NAME",
    "MAX_OP_NUMBER",
    "MAX_TIME_NS",
    "MAX_WORLD",
    "Header",
    "RingInvalid",
    "Skips",
    "finite_time",
    "group_entry",
    "group_line",
    "groups_len",
    "head",
    "header",
    "records",
    "window_op",
    "window_rank",
]

#: records a ring may hold: 4 Mi x 80 bytes = 320 MiB (the writer refuses more, too)
MAX_CAPACITY = 1 << 22
#: ranks in a job (torch's world sizes are far below)
MAX_WORLD = 1 << 20
#: op numbers (the head): far past any run, and so (n + 1) | FAILED never overflows 64 bits
MAX_OP_NUMBER = (1 << 62) - 1
#: element and byte counts, sequence numbers: what a signed 64-bit field holds
MAX_COUNT = (1 << 63) - 1
#: times in ns since the epoch: before 2100-01-01 (a NaN's or an inf's bits read as an int64
#: are past it, a negative time before 1970)
MAX_TIME_NS = 4_102_444_800 * 10**9
MAX_TIME_S = MAX_TIME_NS / 1e9
#: a group's name and description, a node's name (characters)
MAX_NAME = 256
#: one line of the group table (bytes): a group of MAX_WORLD ranks does not fit the table
#: anyway (64 KiB in all)
MAX_GROUP_LINE = 65536
GROUP_KEYS = ("id", "name", "desc", "ranks", "rank")


class RingInvalid(ValueError):
    """A ring (or a window's rank) that cannot be used: the message names the file, the
    field and what was found. The reader logs it once and skips the ring."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"{path}: not a usable colltrace ring ({reason}): skipped; remove it "
            "(a rank of this job rewrites its own)"
        )
        self.path, self.reason = path, reason


@dataclass
class Skips:
    """Records and group lines of one read that failed their check: counted by reason."""

    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, reason: str) -> None:
        self.reasons[reason] += 1

    def __bool__(self) -> bool:
        return bool(self.reasons)

    def line(self) -> str:
        total = sum(self.reasons.values())
        first = ", ".join(f"{n} {why}" for why, n in self.reasons.most_common(3))
        return f"{total} malformed entr{'y' if total == 1 else 'ies'} skipped ({first})"


@dataclass(frozen=True)
class Header:
    """A ring's header, every field checked (see :func:`header`)."""

    capacity: int
    head: int
    rank: int
    world: int
    pid: int
    created_ns: int
    groups_len: int
    node: str
    size: int  # the file's exact size for this capacity


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _name_ok(text: str, *, empty: bool = True) -> bool:
    """A name the reader may put in a line or a file name: bounded, printable, no '/'."""
    return (
        len(text) <= MAX_NAME
        and (empty or bool(text))
        and text.isprintable()
        and "/" not in text
        and text not in (".", "..")
    )


def header(raw: bytes, size: int, path: str, *, layout: Any) -> Header:
    """The header of a ring file of ``size`` bytes (``raw``: its first bytes), or
    :class:`RingInvalid`. ``layout``: the ring module (its constants), passed in to keep one
    definition of the format."""
    if size == 0:
        raise RingInvalid(path, "empty file")
    hs = layout.HEADER_STRUCT
    if size < layout.HEADER_SIZE or len(raw) < hs.size:
        raise RingInvalid(path, f"{size} bytes: shorter than the {layout.HEADER_SIZE}-byte header")
    magic, version, rsize, cap, head, rank, world, pid, created, glen, node = hs.unpack_from(raw, 0)
    if magic != layout.MAGIC:
        raise RingInvalid(path, f"magic {magic!r}, not {layout.MAGIC!r}")
    if version != layout.VERSION:
        raise RingInvalid(path, f"version {version}, this reader reads {layout.VERSION}")
    if rsize != layout.RECORD_SIZE:
        raise RingInvalid(path, f"record size {rsize}, not {layout.RECORD_SIZE}")
    if not 1 <= cap <= MAX_CAPACITY:
        raise RingInvalid(path, f"capacity {cap}, not in [1, {MAX_CAPACITY}]")
    want = layout.HEADER_SIZE + layout.GROUPS_SIZE + cap * layout.RECORD_SIZE
    if size != want:
        raise RingInvalid(path, f"{size} bytes, a ring of capacity {cap} has {want}")
    if head > MAX_OP_NUMBER:
        raise RingInvalid(path, f"head {head} past {MAX_OP_NUMBER}")
    if not 1 <= world <= MAX_WORLD:
        raise RingInvalid(path, f"world {world}, not in [1, {MAX_WORLD}]")
    if not 0 <= rank < world:
        raise RingInvalid(path, f"rank {rank} out of range for world {world}")
    if pid <= 1:  # 0 and -1 would signal a process group, 1 is init: never a rank
        raise RingInvalid(path, f"pid {pid}")
    if not 0 <= created < MAX_TIME_NS:
        raise RingInvalid(path, f"creation time {created} ns, not in [1970, 2100)")
    if glen > layout.GROUPS_SIZE:
        raise RingInvalid(path, f"group table length {glen} past its {layout.GROUPS_SIZE} bytes")
    name = node.rstrip(b"\0")
    if b"\0" in name:
        raise RingInvalid(path, "a NUL inside the node name")
    # the writer cuts the name at 64 bytes, maybe inside a character: replaced, not refused
    text = name.decode("utf-8", errors="replace")
    if not _name_ok(text):
        raise RingInvalid(path, f"node name {text[:80]!r}: control characters or '/'")
    return Header(cap, head, rank, world, pid, created, glen, text, want)


def head(value: int, path: str) -> int:
    """The head re-read on a later pass (the writer moves it)."""
    if value > MAX_OP_NUMBER:
        raise RingInvalid(path, f"head {value} past {MAX_OP_NUMBER}")
    return value


def groups_len(value: int, path: str, limit: int) -> int:
    """The group table's used length re-read on a later pass."""
    if value > limit:
        raise RingInvalid(path, f"group table length {value} past its {limit} bytes")
    return value


def group_entry(doc: Any, world: int | None, *, need_id: bool = True) -> dict[str, Any] | str:
    """A group table entry ({"id", "name", "desc", "ranks", "rank"}) with its types checked
    (ranks within ``world`` when known), or the reason it is refused. Only the known keys are
    kept: the analysis and the report see nothing else."""
    if not isinstance(doc, dict):
        return "group entry not an object"
    gid, name = doc.get("id", None if need_id else 0), doc.get("name")
    desc, ranks, grank = doc.get("desc", ""), doc.get("ranks", []), doc.get("rank", -1)
    limit = MAX_WORLD if world is None else world
    if not _int(gid) or not 0 <= gid <= 0xFFFF:
        return "group id not an integer in [0, 65535]"
    if not isinstance(name, str) or not _name_ok(name, empty=False):
        return "group name missing, too long or not printable"
    if not isinstance(desc, str) or len(desc) > MAX_NAME or not desc.isprintable():
        return "group description too long or not printable"
    if (
        not isinstance(ranks, list)
        or len(ranks) > limit
        or not all(_int(r) and 0 <= r < limit for r in ranks)
        or len(set(ranks)) != len(ranks)
    ):
        return "group ranks not distinct integers within the world"
    if not _int(grank) or not -1 <= grank < limit:
        return "group rank out of range"
    return {"id": gid, "name": name, "desc": desc, "ranks": list(ranks), "rank": grank}


def group_line(line: bytes, world: int) -> dict[str, Any] | str:
    """One line of a ring's group table, parsed and checked, or the reason it is refused."""
    if len(line) > MAX_GROUP_LINE:
        return "group line too long"
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the stack
        return "group line not JSON"
    return group_entry(doc, world)


def records(
    first: list[int],
    body: list[tuple[int, ...]],
    last: list[tuple[int, int]],
    lo: int,
    head: int,
    cap: int,
    hdr: Header,
    skips: Skips,
    group_name: Callable[[int], str],
    make: Callable[..., Any],
    ops: tuple[str, ...],
    dtypes: tuple[str, ...],
    p2p_flag: int,
    failed_bit: int,
) -> list[Any]:
    """The records of op numbers ``lo`` .. ``head`` that are committed and pass their
    checks, made by ``make`` (:class:`~.ring.Op`: rank, n, group name, op name, seq, numel,
    nbytes, dtype name, issue time, completion time or None, failed, p2p, peer), oldest
    first; each one that fails is counted in ``skips``.

    From three successive copies of the slots: ``first`` each slot's commit marker, ``body``
    its fields (begin, group, op, flags, dtype, seq, numel, nbytes, t_issue, peer, commit,
    t_done, done), ``last`` its begin marker and completion time. A record counts when the
    first copy's commit marker and the second's and third's begin markers all equal
    ``n + 1``: written completely before the first copy, not overwritten before the third
    (the seqlock's order, batched). Its completion counts when the second copy's done marker
    matches, with the third's completion time (written before that marker). One function
    for every record with the bounds as locals: it runs over 4096 records a second per
    rank."""
    out: list[Any] = []
    rank, world, max_t, max_c = hdr.rank, hdr.world, MAX_TIME_NS, MAX_COUNT
    n_ops, n_dtypes, not_flags, not_failed = len(ops), len(dtypes), ~p2p_flag, ~failed_bit
    slots = len(body)
    for n in range(lo, head + 1):
        i = n % cap
        want = n + 1
        if i >= slots or first[i] != want:
            continue  # being written, or overwritten since
        b = body[i]
        begin, t_done = last[i]
        if b[0] != want or begin != want:
            continue
        _, gid, op, flags, dtype, seq, numel, nbytes, t_issue, peer, _, _, done = b
        finished = (done & not_failed) == want
        if not 1 <= op < n_ops:
            skips.add("unknown op code")
        elif dtype >= n_dtypes:
            skips.add("unknown dtype code")
        elif flags & not_flags:
            skips.add("unknown flags")
        elif not 1 <= seq <= max_c:
            skips.add("sequence number out of range")
        elif numel > max_c or nbytes > max_c:
            skips.add("element or byte count out of range")
        elif not 0 <= t_issue < max_t:
            skips.add("issue time out of range")
        elif peer != -1 and not (flags & p2p_flag and 0 <= peer < world):
            skips.add("peer out of range")
        elif finished and not 0 <= t_done < max_t:
            skips.add("completion time out of range")
        else:
            out.append(
                make(
                    rank,
                    n,
                    group_name(gid),
                    ops[op],
                    seq,
                    numel,
                    nbytes,
                    dtypes[dtype],
                    t_issue / 1e9,
                    t_done / 1e9 if finished else None,
                    finished and bool(done & failed_bit),
                    bool(flags & p2p_flag),
                    peer,
                )
            )
    return out


def finite_time(value: Any) -> float | None:
    """A time in seconds since the epoch: a finite number in [1970, 2100), else None."""
    return _time(value)


def _time(value: Any) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    t = float(value)
    return t if math.isfinite(t) and 0.0 <= t < MAX_TIME_S else None


def _count(value: Any, lo: int = 0) -> bool:
    return _int(value) and lo <= value <= MAX_COUNT


def window_rank(r: Any) -> tuple[int, int, int, float, int, dict[str, dict[str, Any]]] | str:
    """A shipped window's rank entry (:mod:`.ship`): (rank, world, pid, created, head,
    groups) checked, or the reason it is refused."""
    if not isinstance(r, dict):
        return "rank entry not an object"
    rank, world, pid = r.get("rank"), r.get("world"), r.get("pid")
    created, hd = r.get("created") or 0, r.get("head") or 0
    if not _int(world) or not 1 <= world <= MAX_WORLD:
        return "world out of range"
    if not _int(rank) or not 0 <= rank < world:
        return "rank out of range"
    if not _int(pid) or not 0 <= pid < 1 << 31:
        return "pid out of range"
    when = _time(created)
    if when is None:
        return "creation time not finite or out of range"
    if not _count(hd):
        return "head out of range"
    groups = r.get("groups") or {}
    if not isinstance(groups, dict) or len(groups) > 0xFFFF:
        return "groups not an object"
    checked: dict[str, dict[str, Any]] = {}
    for name, entry in groups.items():
        got = group_entry(entry, world, need_id=False)  # a window's entries may lack ids
        if isinstance(got, str) or got["name"] != name:
            continue  # one bad group: its ops still count (as an unnamed group's)
        checked[name] = got
    if not isinstance(r.get("ops"), list):
        return "ops not a list"
    return rank, world, pid, when, hd, checked


def window_op(
    row: Any, *, ops: tuple[str, ...], dtypes: tuple[str, ...]
) -> tuple[int, str, str, int, int, int, str, float, float | None, bool] | str:
    """One op row of a shipped window, checked, or the reason it is refused."""
    if not isinstance(row, list) or len(row) != 10:
        return "op row not a list of 10"
    n, group, name, seq, numel, nbytes, dtype, t0, t1, failed = row
    if not _count(n) or not _count(seq, 1) or not _count(numel) or not _count(nbytes):
        return "count out of range"
    if not isinstance(group, str) or not _name_ok(group, empty=False):
        return "group name not printable"
    if name not in ops[1:] or dtype not in dtypes:
        return "unknown op or dtype"
    issued = _time(t0)
    done = None if t1 is None else _time(t1)
    if issued is None or (t1 is not None and done is None):
        return "time not finite or out of range"
    if not isinstance(failed, int) or failed not in (0, 1):
        return "failed not 0 or 1"
    return n, group, name, seq, numel, nbytes, dtype, issued, done, bool(failed)
