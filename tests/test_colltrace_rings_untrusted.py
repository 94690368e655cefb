"""Ring files are untrusted input: every shape crafted byte by byte here is refused or its bad
records skipped, said once with its path, and nothing raises out of the reader, the analysis,
the agent's watch or ``bootseer run`` (DESIGN.md, "The job's own channels are untrusted input
too"; issue 27 point 4).

The rings are crafted by this file's own packing of the format (docs/colltrace.md "The
ring"), not by the writer: a test that used the writer could only make what the writer makes.
The fuzzer starts from genuine rings of the real writer and mutates their bytes. The live test
plants two rings that used to end ``bootseer run`` (a ``ZeroDivisionError`` and a
``KeyError`` out of the reader) beside a running ``bootseer run --colltrace`` job.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bootseer.colltrace.analyze import Analyzer
from bootseer.colltrace.reader import Watch
from bootseer.colltrace.ring import (
    OP_CODE,
    Refusals,
    Ring,
    RingInvalid,
    RingReader,
    newest_per_rank,
    read_rings,
    scan_rings,
)
from bootseer.colltrace.ship import analyze_windows, snapshots_of, window
from striped_fs.privdir import PrivateDir, UnsafePath

# the format, restated here (the test's own packing, not the module's)
HDR = struct.Struct("<8sIIQQiiiqI64s")
BODY = struct.Struct("<QHHHHQQQqi")
HEADER_SIZE, GROUPS_SIZE, REC = 4096, 65536, 80
GLEN_AT = struct.calcsize("<8sIIQQiiiq")
NAN_BITS = struct.unpack("<q", struct.pack("<d", float("nan")))[0]
INF_BITS = struct.unpack("<q", struct.pack("<d", float("inf")))[0]
NOW_NS = time.time_ns()
ALL_REDUCE, SEND = OP_CODE["all_reduce"], OP_CODE["send"]
NOBODY_UID = 65534
WAIT_S = 180.0  # generous: a loaded 2-core machine


def rec(
    n: int,
    *,
    gid: int = 1,
    op: int = ALL_REDUCE,
    flags: int = 0,
    dtype: int = 1,
    seq: int | None = None,
    numel: int = 4,
    nbytes: int = 16,
    t_issue: int | None = None,
    peer: int = -1,
    t_done: int | None = None,
    failed: bool = False,
) -> dict:
    """A committed record of op number ``n`` (completed when ``t_done`` is given)."""
    return {
        "n": n,
        "gid": gid,
        "op": op,
        "flags": flags,
        "dtype": dtype,
        "seq": n + 1 if seq is None else seq,
        "numel": numel,
        "nbytes": nbytes,
        "t_issue": NOW_NS - 10**9 * (100 - n) if t_issue is None else t_issue,
        "peer": peer,
        "t_done": t_done,
        "failed": failed,
    }


def craft(
    *,
    magic: bytes = b"BSCTRING",
    version: int = 1,
    rsize: int = REC,
    cap: int = 4,
    head: int | None = None,
    rank: int = 0,
    world: int = 2,
    pid: int | None = None,
    created: int | None = None,
    glen: int | None = None,
    node: bytes = b"node-c",
    groups: bytes | None = None,
    records: list[dict] | None = None,
    size: int | None = None,
) -> bytes:
    """A ring file's bytes, field by field (defaults: a valid ring of rank 0 of 2, one group
    and two records, the second in progress)."""
    if groups is None:
        groups = b'{"id":1,"name":"0","desc":"grp-c","ranks":[0,1],"rank":0}\n'
    if records is None:
        records = [rec(0, t_done=NOW_NS - 99 * 10**9), rec(1)]
    head = len(records) if head is None else head
    size = HEADER_SIZE + GROUPS_SIZE + max(cap, 0) * REC if size is None else size
    buf = bytearray(max(size, HEADER_SIZE + GROUPS_SIZE + 4 * REC))
    HDR.pack_into(
        buf,
        0,
        magic,
        version,
        rsize,
        cap,
        head,
        rank,
        world,
        os.getpid() if pid is None else pid,
        NOW_NS - 200 * 10**9 if created is None else created,
        len(groups) if glen is None else glen,
        node,
    )
    buf[HEADER_SIZE : HEADER_SIZE + len(groups)] = groups
    for r in records:
        off = HEADER_SIZE + GROUPS_SIZE + (r["n"] % max(cap, 1)) * REC
        BODY.pack_into(
            buf,
            off,
            r["n"] + 1,
            r["gid"],
            r["op"],
            r["flags"],
            r["dtype"],
            r["seq"],
            r["numel"],
            r["nbytes"],
            r["t_issue"],
            r["peer"],
        )
        struct.pack_into("<Q", buf, off + 56, r["n"] + 1)
        if r["t_done"] is not None:
            struct.pack_into(
                "<qQ", buf, off + 64, r["t_done"], (r["n"] + 1) | ((1 << 62) if r["failed"] else 0)
            )
    return bytes(buf[:size])


def genuine(where: Path, rank: int = 1, world: int = 2) -> Path:
    """A ring of the real writer: rank ``rank``'s two all_reduces, completed (alone in
    its directory it gives no verdict)."""
    ring = Ring(where, rank=rank, world=world, capacity=8, node="node-c")
    ring.add_group(1, {"name": "0", "desc": "grp-c", "ranks": list(range(world)), "rank": rank})
    for n in range(2):
        off = ring.write(n, 1, ALL_REDUCE, 0, 1, n + 1, 4, 16, NOW_NS - (100 - n) * 10**9, -1)
        ring.complete(off, n, NOW_NS - (100 - n) * 10**9 + 10**7)
    ring.close()  # the file stays, as a killed rank's does
    return ring.path


#: shapes refused whole: (name, bytes, the words the refusal names)
REFUSED = [
    ("empty", b"", "empty file"),
    ("truncated_header", craft()[:100], "shorter than the 4096-byte header"),  # struct.error
    ("header_only", craft()[:HEADER_SIZE], "a ring of capacity 4 has"),  # was struct.error
    ("wrong_magic", craft(magic=b"NOTARING"), "magic b'NOTARING'"),
    ("wrong_version", craft(version=7), "version 7"),
    ("wrong_record_size", craft(rsize=0), "record size 0"),
    ("zero_capacity", craft(cap=0, records=[]), "capacity 0"),  # was ZeroDivisionError
    (
        "huge_capacity",
        craft(cap=2**40, size=HEADER_SIZE + GROUPS_SIZE + 4 * REC),
        f"capacity {2**40}",
    ),
    (
        "overflowing_capacity_and_head",
        craft(cap=2**63, head=2**64 - 1, size=HEADER_SIZE + GROUPS_SIZE + 4 * REC),
        f"capacity {2**63}",
    ),  # was OverflowError
    ("head_past_bound", craft(head=2**63), f"head {2**63}"),
    (
        "size_not_capacity",
        craft(size=HEADER_SIZE + GROUPS_SIZE + 3 * REC),
        "a ring of capacity 4 has",
    ),
    ("negative_world", craft(world=-5), "world -5"),
    ("rank_out_of_range", craft(rank=5), "rank 5 out of range for world 2"),
    ("negative_rank", craft(rank=-1), "rank -1 out of range"),
    ("pid_zero", craft(pid=0), "pid 0"),  # os.kill(0, ...) would signal the process group
    ("nan_created", craft(created=NAN_BITS), f"creation time {NAN_BITS} ns"),
    ("negative_created", craft(created=-1), "creation time -1 ns"),
    ("group_table_past_its_region", craft(glen=GROUPS_SIZE + 1), "group table length 65537"),
    ("node_with_a_path", craft(node=b"../../etc"), "node name '../../etc'"),
    ("node_with_control_characters", craft(node=b"a\x1b[2Jb"), "control characters"),
    ("node_with_nul_inside", craft(node=b"a\0b"), "a NUL inside the node name"),
]

#: shapes whose ring is kept with its bad entries skipped: (name, bytes, skip reason,
#: the ops (number, group) kept)
SKIPPED = [
    ("unknown_op_code", craft(records=[rec(0, op=999), rec(1)]), "unknown op code", [(1, "0")]),
    ("op_code_zero", craft(records=[rec(0, op=0), rec(1)]), "unknown op code", [(1, "0")]),
    ("unknown_dtype", craft(records=[rec(0, dtype=77), rec(1)]), "unknown dtype code", [(1, "0")]),
    ("unknown_flags", craft(records=[rec(0, flags=6), rec(1)]), "unknown flags", [(1, "0")]),
    (
        "inf_issue_time",
        craft(records=[rec(0, t_issue=INF_BITS), rec(1)]),
        "issue time out of range",
        [(1, "0")],
    ),
    (
        "nan_completion_time",
        craft(records=[rec(0, t_done=NAN_BITS), rec(1)]),
        "completion time out of range",
        [(1, "0")],
    ),
    (
        "negative_issue_time",
        craft(records=[rec(0, t_issue=-5), rec(1)]),
        "issue time out of range",
        [(1, "0")],
    ),
    (
        "zero_sequence",
        craft(records=[rec(0, seq=0), rec(1)]),
        "sequence number out of range",
        [(1, "0")],
    ),
    (
        "overflowing_count",
        craft(records=[rec(0, numel=2**64 - 1), rec(1)]),
        "element or byte count out of range",
        [(1, "0")],
    ),
    (
        "peer_out_of_range",
        craft(records=[rec(0, op=SEND, flags=1, peer=9), rec(1)]),
        "peer out of range",
        [(1, "0")],
    ),
    (
        "peer_on_a_collective",
        craft(records=[rec(0, peer=1), rec(1)]),
        "peer out of range",
        [(1, "0")],
    ),
    # the group lines: the ring is kept, its records fall back to the unnamed group
    (
        "group_line_without_name",  # was KeyError
        craft(groups=b'{"id":1,"desc":"grp-c","ranks":[0,1],"rank":0}\n'),
        "group name missing",
        [(0, "?1"), (1, "?1")],
    ),
    (
        "group_id_overflow",  # int(1e400) was OverflowError
        craft(groups=b'{"id":1e400,"name":"0","ranks":[0,1],"rank":0}\n'),
        "group id not an integer",
        [(0, "?1"), (1, "?1")],
    ),
    (
        "group_line_nested_past_the_stack",
        craft(groups=b"[" * 60000 + b"\n"),
        "group line not JSON",
        [(0, "?1"), (1, "?1")],
    ),  # was RecursionError
    (
        "group_ranks_out_of_world",
        craft(groups=b'{"id":1,"name":"0","ranks":[0,1,2,3],"rank":0}\n'),
        "group ranks not distinct integers within the world",
        [(0, "?1"), (1, "?1")],
    ),
    (
        "group_ranks_not_integers",  # was ValueError out of the analysis (int("x"))
        craft(groups=b'{"id":1,"name":"0","ranks":["x",1.5],"rank":0}\n'),
        "group ranks not distinct",
        [(0, "?1"), (1, "?1")],
    ),
    (
        "group_name_too_long",
        craft(groups=b'{"id":1,"name":"' + b"n" * 300 + b'","ranks":[0,1],"rank":0}\n'),
        "group name missing, too long",
        [(0, "?1"), (1, "?1")],
    ),
    ("group_line_cut_by_its_length", craft(glen=30), "group line not JSON", [(0, "?1"), (1, "?1")]),
    (
        "group_line_not_an_object",
        craft(groups=b"[1,2]\n"),
        "group entry not an object",
        [(0, "?1"), (1, "?1")],
    ),
]


def _dir(tmp_path: Path) -> Path:
    d = tmp_path / "rings"
    d.mkdir(mode=0o700)
    return d


def _quiet_analyzer() -> Analyzer:
    return Analyzer(alive=lambda snap: True, node="node-c")


def _check_no_escape(d: Path, said: list[str]) -> list:
    """The reader, the analysis and the agent's watch over ``d``: none raises; returns the
    snapshots ``read_rings`` gives."""
    snaps = read_rings(d, log=said.append)
    _quiet_analyzer().analyze(snaps, time.time())
    watch = Watch(d, analyzer=_quiet_analyzer(), log=said.append)
    for _ in range(3):
        watch.poll(force=True)
    window(watch.snapshots(), node="node-c")
    analyze_windows({"node-c": watch.window()}, now=time.time())
    return snaps


@pytest.mark.parametrize("name,data,words", REFUSED, ids=[s[0] for s in REFUSED])
def test_malformed_ring_is_refused_once_and_the_genuine_ring_beside_it_kept(
    tmp_path: Path, name: str, data: bytes, words: str
) -> None:
    d = _dir(tmp_path)
    real = genuine(d)
    alone = read_rings(d, log=lambda line: None)
    bad = d / "rank0-4242.ring"
    bad.write_bytes(data)
    with pytest.raises(RingInvalid) as refused:
        RingReader(bad)
    assert str(bad) in str(refused.value) and words in str(refused.value), refused.value
    said: list[str] = []
    snaps = _check_no_escape(d, said)
    assert snaps == alone and [s.path for s in snaps] == [str(real)]
    assert [s.ops for s in snaps] == [s.ops for s in alone] and len(snaps[0].ops) == 2
    # said once per reader (read_rings once, the watch once over its 3 passes), naming it
    lines = [line for line in said if str(bad) in line]
    assert len(lines) == 2 and all(words in line for line in lines), said
    assert not [line for line in said if str(bad) not in line], said


@pytest.mark.parametrize("name,data,reason,kept", SKIPPED, ids=[s[0] for s in SKIPPED])
def test_malformed_entries_are_skipped_once_and_the_rest_of_the_ring_kept(
    tmp_path: Path, name: str, data: bytes, reason: str, kept: list
) -> None:
    d = _dir(tmp_path)
    genuine(d)
    bad = d / "rank0-4242.ring"
    bad.write_bytes(data)
    reader = RingReader(bad)
    try:
        snap = reader.read()
    finally:
        reader.close()
    assert [(o.n, o.group) for o in snap.ops] == kept
    assert any(why.startswith(reason) for why in snap.skips.reasons), snap.skips.reasons
    said: list[str] = []
    snaps = _check_no_escape(d, said)
    assert [s.rank for s in snaps] == [0, 1] and [(o.n, o.group) for o in snaps[0].ops] == kept
    lines = [line for line in said if str(bad) in line]
    assert len(lines) == 2 and all("skipped" in line and reason in line for line in lines), said


def test_a_ring_of_another_user_a_link_a_fifo_and_a_directory_are_refused(tmp_path: Path) -> None:
    """Files that are not this user's regular file are refused before a byte is read (the
    owner check of striped_fs.privdir, kept), each said once naming it; the genuine ring is
    read as before."""
    d = _dir(tmp_path)
    real = genuine(d)
    alone = read_rings(d, log=lambda line: None)
    link = d / "rank0-11.ring"
    link.symlink_to(real)
    fifo = d / "rank0-12.ring"
    os.mkfifo(fifo, 0o600)
    (d / "rank0-13.ring").mkdir(mode=0o700)
    words = {link: "is a link", fifo: "not a regular file", d / "rank0-13.ring": ""}
    if os.geteuid() == 0:  # root can give a file away: a valid ring of nobody's
        theirs = d / "rank0-14.ring"
        theirs.write_bytes(craft())
        os.chown(theirs, NOBODY_UID, NOBODY_UID)
        words[theirs] = "owned by uid 65534"
        with pytest.raises(UnsafePath):
            RingReader(theirs)
    with pytest.raises(UnsafePath):
        RingReader(link)
    said: list[str] = []
    snaps = _check_no_escape(d, said)
    assert snaps == alone and [s.path for s in snaps] == [str(real)]
    for path, word in words.items():
        lines = [line for line in said if f"{path} " in line or f"{path}:" in line]
        assert len(lines) == 2 and all(word in line for line in lines), (path, said)


def test_a_ring_cut_shorter_while_mapped_is_refused_not_read_past_its_end(tmp_path: Path) -> None:
    """A ring truncated after the reader mapped it: the next read refuses it (reading the
    map past the file's end would be SIGBUS, the end of the agent); a watch holding the
    mapped reader says so once and reads it again once it is whole."""
    d = _dir(tmp_path)
    genuine(d)
    bad = d / "rank0-4242.ring"
    data = craft()
    bad.write_bytes(data)
    said: list[str] = []
    watch = Watch(d, analyzer=_quiet_analyzer(), log=said.append)
    assert [s.rank for s in watch.snapshots()] == [0, 1]
    reader = RingReader(bad)
    os.truncate(bad, 5000)
    with pytest.raises(RingInvalid, match="cut to 5000 bytes while mapped"):
        reader.read()
    reader.close()
    for _ in range(3):
        assert [s.rank for s in watch.snapshots()] == [1]
        watch.poll(force=True)
    assert len([line for line in said if str(bad) in line]) == 1, said
    with open(bad, "r+b") as f:  # the rank rewrote it whole
        f.write(data)
    assert [s.rank for s in watch.snapshots()] == [0, 1]
    watch.close()


def test_a_shipped_window_with_bad_entries_is_checked_as_a_ring(tmp_path: Path) -> None:
    """The controller's side: a node's window (JSON in the store) with NaN and infinite
    times, an overflowing count, unknown op names, a rank out of its world: the bad rows and
    ranks are skipped, the good ones analysed, nothing raises."""
    d = _dir(tmp_path)
    genuine(d, rank=1)
    (d / "rank0-4242.ring").write_bytes(craft())
    doc = window(read_rings(d), node="node-c")
    good = snapshots_of(doc, "node-c")
    assert [(s.rank, len(s.ops)) for s in good] == [(0, 2), (1, 2)]
    r0 = doc["ranks"][0]
    row = r0["ops"][0]
    r0["ops"] += [
        [*row[:7], float("nan"), *row[8:]],
        [*row[:7], row[7], float("inf"), 0],
        [*row[:4], 1e400, *row[5:]],
        [*row[:2], "rm -rf", *row[3:]],
        [1, 2],
        "x",
        [*row[:3], 0, *row[4:]],
    ]
    doc["ranks"] += [
        {**r0, "rank": 7},
        {**r0, "rank": float("inf")},
        {**r0, "world": -1},
        {**r0, "created": float("nan")},
        {**r0, "pid": 1e400},
        "x",
        None,
    ]
    doc["time"] = float("nan")
    got = snapshots_of(doc, "node-c")
    assert [(s.rank, len(s.ops)) for s in got] == [(0, 2), (1, 2)]
    assert [s.ops for s in got] == [s.ops for s in good]
    analyze_windows(
        {"node-c": doc, "node-d": {"ranks": "x"}, "node-e": []},  # type: ignore
        now=time.time(),
    )


# -- the fuzzer --------------------------------------------------------------------------
FUZZ_ITERATIONS = 400
INTERESTING = [
    0,
    1,
    -1,
    2**31 - 1,
    -(2**31),
    2**32 - 1,
    2**62,
    2**63 - 1,
    -(2**63),
    NAN_BITS,
    INF_BITS,
    4096,
    65536,
]


def _writer_rings(d: Path) -> list[Path]:
    """Three rings of the real writer: ranks 0-2 of 3, two groups, 40 ops each into 16
    slots (wrapped), completions (one failed), a p2p send and recv, one op in progress."""
    paths = []
    t = NOW_NS - 500 * 10**9
    for rank in range(3):
        ring = Ring(d, rank=rank, world=3, capacity=16, node="node-f")
        ring.add_group(1, {"name": "0", "desc": "grp-a", "ranks": [0, 1, 2], "rank": rank})
        ring.add_group(2, {"name": "1", "desc": "grp-b", "ranks": [0, 1, 2], "rank": rank})
        for n in range(40):
            gid = 1 + n % 2
            if n == 30 and rank < 2:  # rank 0 sends to 1
                off = ring.write(
                    n,
                    1,
                    SEND if rank == 0 else OP_CODE["recv"],
                    1,
                    1,
                    1,
                    4,
                    16,
                    t + n * 10**9,
                    1 - rank,
                )
            else:
                off = ring.write(
                    n, gid, ALL_REDUCE, 0, 1, n // 2 + 1, 4, 16, t + n * 10**9 + rank * 10**6, -1
                )
            if n < 39:
                ring.complete(off, n, t + n * 10**9 + 5 * 10**7, failed=n == 37)
        ring.close()
        paths.append(ring.path)
    return paths


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One random mutation: bit flips in the parts that are read, a truncation, an
    extension, or an interesting integer over a field."""
    buf = bytearray(data)
    kind = rng.choice(["flip", "flip", "flip", "field", "field", "truncate", "extend"])
    glen = struct.unpack_from("<I", data, GLEN_AT)[0]
    regions = [
        (0, HDR.size),
        (HEADER_SIZE, HEADER_SIZE + max(glen, 1)),
        (HEADER_SIZE + GROUPS_SIZE, len(data)),
    ]
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            lo, hi = rng.choice(regions)
            at = rng.randrange(lo, hi)
            buf[at] ^= 1 << rng.randrange(8)
    elif kind == "field":
        lo, hi = rng.choice(regions)
        at = rng.randrange(lo, hi - 8) & ~3
        width = rng.choice([2, 4, 8])
        value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
        buf[at : at + width] = value.to_bytes(width, "little")
    elif kind == "truncate":
        del buf[rng.randrange(0, len(buf)) :]
    else:
        buf += rng.randbytes(rng.randint(1, 200))
    return bytes(buf)


def test_fuzzed_genuine_rings_never_raise_and_untouched_rings_read_the_same(tmp_path: Path) -> None:
    """400 mutations of rings the real writer made, one ring at a time, read in place (a
    watch's mapped readers see the file change under them, truncations included): the reader
    raises nothing but its refusal, the directory scan, the analysis, the watch and the
    window raise nothing, and the two untouched rings read exactly as before."""
    d = _dir(tmp_path)
    paths = _writer_rings(d)
    originals = {p: p.read_bytes() for p in paths}
    said: list[str] = []
    with PrivateDir.open(d, create=False) as where:
        baseline = {s.path: s for s in scan_rings(where, Refusals(said.append))}
    assert sorted(baseline) == sorted(map(str, paths)) and not said
    assert all(len(s.ops) == 16 for s in baseline.values())
    watch = Watch(d, analyzer=_quiet_analyzer(), log=said.append)
    watch.poll(force=True)
    seed = int(os.environ.get("BOOTSEER_FUZZ_SEED", "2027"))
    rng = random.Random(seed)
    refused = skipped = 0
    for i in range(FUZZ_ITERATIONS):
        target = rng.choice(paths)
        mutated = _mutate(rng, originals[target])
        with open(target, "r+b") as f:  # in place: the watch's map is of this inode
            f.write(mutated)
            f.truncate(len(mutated))
        try:
            reader = RingReader(target)
        except RingInvalid:
            refused += 1
        else:
            try:
                skipped += bool(reader.read().skips)
            except RingInvalid:
                refused += 1
            finally:
                reader.close()
        with PrivateDir.open(d, create=False) as where:
            snaps = scan_rings(where, Refusals(lambda line: None))
        by_path = {s.path: s for s in snaps}
        for p in paths:
            if p != target:
                assert by_path.get(str(p)) == baseline[str(p)], (seed, i, p)
                assert by_path[str(p)].ops == baseline[str(p)].ops, (seed, i, p)
        found = _quiet_analyzer().analyze(newest_per_rank(snaps), time.time())
        assert all(f.line for f in found)
        watch.poll(force=True)
        analyze_windows({"node-f": window(newest_per_rank(snaps), node="node-f")}, now=time.time())
        with open(target, "r+b") as f:
            f.write(originals[target])
            f.truncate(len(originals[target]))
    assert refused > 50 and skipped > 20, (refused, skipped)  # the mutations reached both
    assert not [line for line in said if "analysis failed" in line or "unreadable" in line], (
        said
    )  # nothing unforeseen: every refusal came from the validator
    watch.close()


# -- the live job ------------------------------------------------------------------------
def _wait(what: str, cond, proc: subprocess.Popen, err: Path, timeout_s: float = WAIT_S):
    """Poll ``cond`` until it gives a value; the job dying meanwhile fails with its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(
                f"bootseer run ended (rc {proc.returncode}) before {what}:\n"
                + err.read_text()[-4000:]
            )
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no {what} within {timeout_s} s:\n" + err.read_text()[-4000:])


def test_bad_rings_planted_beside_a_live_job_end_neither_the_job_nor_bootseer_run(
    tmp_path: Path,
) -> None:
    """``bootseer run --colltrace`` runs a 2-rank gloo job; once its rings are there, two
    crafted rings are planted in the attempt's ring directory: capacity 0 (the old reader's
    ZeroDivisionError) and a group line without a name (its KeyError). Each is said once
    with its path over the passes that follow, the job keeps training, and when told to stop
    it and ``bootseer run`` end with rc 0."""
    trace, rings, until = tmp_path / "trace", tmp_path / "rings", tmp_path / "stop"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    cmd = [
        sys.executable,
        "-m",
        "bootseer",
        "run",
        "--trace-dir",
        str(trace),
        "--state-dir",
        str(tmp_path / "state"),
        "--max-restarts",
        "0",
        "--colltrace",
        "--colltrace-dir",
        str(rings),
        "--colltrace-poll",
        "0.25",
        "--node",
        "node-t",
        "--min-free-disk",
        "0",
        "--",
        sys.executable,
        "-m",
        "bootseer.testing.colltrace_job",
        "--world",
        "2",
        "--dir",
        "",
        "--until",
        str(until),
        "--work-ms",
        "5",
    ]
    err = tmp_path / "stderr"
    with open(err, "w") as errf:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errf)
    try:
        ring = _wait(
            "the job's first ring",
            lambda: sorted(
                glob.glob(str(rings / "bootseer-colltrace-*" / "attempt-0" / "rank*.ring"))
            ),
            proc,
            err,
        )
        attempt = Path(ring[0]).parent
        zero = attempt / "rank0-7001.ring"
        nameless = attempt / "rank1-7002.ring"
        planted = {
            zero: craft(cap=0, records=[]),
            nameless: craft(
                rank=1, created=10**9, groups=b'{"id":1,"desc":"grp-c","ranks":[0,1],"rank":1}\n'
            ),
        }
        for path, data in planted.items():  # whole, as a rank's ring appears (a rename)
            tmp = attempt / f".{path.name}.tmp"
            tmp.write_bytes(data)
            tmp.chmod(0o600)
            os.replace(tmp, path)
        _wait(
            "both planted rings said",
            lambda: all(str(p) in err.read_text() for p in planted),
            proc,
            err,
        )

        def ops_done() -> int:
            return sum(s.head for s in read_rings(attempt, log=lambda line: None))

        # the job trains on beside them, the reader passing over them meanwhile (every
        # 0.25 s): 200 more ops recorded by its ranks
        before = ops_done()
        _wait("the job's progress", lambda: ops_done() > before + 200, proc, err)
        until.write_text("stop")
        rc = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text()
    assert rc == 0, text[-4000:]
    zero_lines = [ln for ln in text.splitlines() if str(zero) in ln]
    nameless_lines = [ln for ln in text.splitlines() if str(nameless) in ln]
    assert len(zero_lines) == 1 and "capacity 0" in zero_lines[0], text[-4000:]
    assert len(nameless_lines) == 1 and "group name missing" in nameless_lines[0], text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    shutil.rmtree(rings, ignore_errors=True)
