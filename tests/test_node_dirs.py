"""Directories the tool owns under shared paths (DESIGN.md, "The job's own channels are
untrusted input too"; issue 27, point 2): a local user who gets there first takes nothing.

The attacker is a real unprivileged user (``nobody``, through ``setpriv``) with a directory
that stands in for ``/dev/shm``: world-writable and sticky, in ``/dev/shm`` itself. It makes
the directory that root is about to use (mode 0777, its own), plants links to a file of
root's outside it, and swaps in forged rings and memory copies that the test crafted (real
rings and copies, written as root elsewhere, their bytes handed over). Root's code then
refuses the directory with an error naming the path, the owner and mode found and what to
do; root's file is unchanged and the forged data is never read. Each of these ran through
the attacker's directory before the fix (the ring, the memory copy, the stamp, the trace).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from unprivileged import as_nobody, need_setpriv

from striped_fs.privdir import PrivateDir, UnsafePath

ROOT = Path(__file__).resolve().parent.parent
VICTIM = b"root's own file: never written by bootseer\n"
NOBODY_UID = 65534

# Run by nobody: make each directory (0777, whatever the umask), then each link and file
# (JSON on stdin: {"dirs": [...], "links": {path: target}, "files": {path: base64}}).
_ATTACK = r"""
import base64, json, os, sys
plan = json.load(sys.stdin)
os.umask(0)
for d in plan.get("dirs", []):
    os.makedirs(d, 0o777, exist_ok=True)
for path, target in plan.get("links", {}).items():
    os.symlink(target, path)
for path, data in plan.get("files", {}).items():
    with open(path, "wb") as f:
        f.write(base64.b64decode(data))
    os.chmod(path, 0o666)
print("planted")
"""


def attack(**plan: object) -> None:
    """What nobody does before root comes (see ``_ATTACK``)."""
    proc = as_nobody(sys.executable, "-I", "-c", _ATTACK, stdin=json.dumps(plan))
    assert proc.returncode == 0 and "planted" in proc.stdout, proc.stderr


@pytest.fixture
def shared() -> Iterator[Path]:
    """A stand-in for /dev/shm: in /dev/shm, mode 1777 (every user writes, none renames
    another's entries)."""
    need_setpriv()
    d = Path(tempfile.mkdtemp(prefix="bootseer-test-shared-", dir="/dev/shm"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of root's outside the shared directory, 0600."""
    path = tmp_path / "victim"
    path.write_bytes(VICTIM)
    path.chmod(0o600)
    return path


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), out.get("PYTHONPATH")]))
    return out


def assert_refused(text: str, path: Path) -> None:
    """The refusal names the path, the owner and mode found, and what to do."""
    assert str(path) in text and "uid 65534 (nobody), mode 0777" in text, text
    assert "remove it" in text and "name another directory" in text, text


def listing(d: Path) -> dict[str, tuple[int, int, str]]:
    """Everything under ``d`` (the attacker's): owner, mode, link target or content digest."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        what = (
            os.readlink(p)
            if p.is_symlink()
            else p.read_bytes().hex()[:64]
            if p.is_file()
            else "dir"
        )
        out[str(p.relative_to(d))] = (st.st_uid, stat.S_IMODE(st.st_mode), what)
    return out


# -- the collective-trace rings ------------------------------------------------------------

_RANK = r"""
import os, sys
import torch
import torch.distributed as dist
import bootseer.colltrace as colltrace
sys.stdin.readline()  # the attacker has planted its links by now
try:
    colltrace.enable(sys.argv[1])
except PermissionError as exc:
    print("REFUSED", exc, flush=True)
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
t = torch.ones(4)
dist.all_reduce(t)
print("SUM", t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_ring_directory_made_first_by_another_user_is_refused(
    shared: Path, victim: Path, tmp_path: Path
) -> None:
    """``colltrace.enable()`` into a ring directory nobody made first, with
    ``rank0-<pid>.ring`` linked to root's file: refused, naming it; the training's
    collective still runs; root's file keeps its bytes (it became a 397 KB ring before)."""
    rings = shared / "bootseer-colltrace-0" / "node-x"
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK, str(rings), str(tmp_path / "pg")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    attack(dirs=[str(rings)], links={str(rings / f"rank0-{rank.pid}.ring"): str(victim)})
    before = listing(shared)
    out, err = rank.communicate("go\n", timeout=180)
    assert rank.returncode == 0, err
    assert victim.read_bytes() == VICTIM, f"root's file became {victim.stat().st_size} bytes"
    assert listing(shared) == before  # nothing written, created or moved there
    assert "SUM [1.0, 1.0, 1.0, 1.0]" in out, out + err
    refusal = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert_refused(refusal, shared / "bootseer-colltrace-0")


def _forged_rings(where: Path) -> dict[str, bytes]:
    """Two real rings (written as root in a directory of root's): ranks 0 and 1 of group
    grp-a ran all_reduce #1 together; rank 0 issued #2 100 s ago and waits. Read as they
    are, they say "rank 1 never issued all_reduce #2"."""
    from bootseer.colltrace.ring import OP_CODE, Ring

    t = time.time_ns() - 200 * 10**9
    rings = {}
    for rank in (0, 1):
        ring = Ring(where, rank=rank, world=2, capacity=16, node="node-x")
        ring.add_group(1, {"name": "7", "desc": "grp-a", "ranks": [0, 1], "rank": rank})
        off = ring.write(0, 1, OP_CODE["all_reduce"], 0, 1, 1, 4, 16, t, -1)
        ring.complete(off, 0, t + 10**7)
        if rank == 0:
            ring.write(1, 1, OP_CODE["all_reduce"], 0, 1, 2, 4, 16, t + 10**11, -1)
        rings[ring.path.name] = ring.path.read_bytes()
        ring.close(unlink=True)
    return rings


def _watch(directory: Path, said: list[str]):
    from bootseer.colltrace.analyze import Analyzer
    from bootseer.colltrace.reader import Watch

    return Watch(directory, analyzer=Analyzer(alive=lambda snap: True), log=said.append)


def test_forged_rings_in_another_users_directory_are_never_read(
    shared: Path, tmp_path: Path
) -> None:
    """The reader over a ring directory that nobody owns, holding forged rings: refused
    (once, naming it), no verdict; ``read_rings`` refuses it too. The same bytes in a
    directory of root's would name rank 1 (the control: the forgery is a working one); a
    forged ring of nobody's there, beside root's own, is skipped."""
    from bootseer.colltrace.ring import read_rings

    forged = _forged_rings(tmp_path / "craft")
    control = tmp_path / "control"
    control.mkdir(mode=0o700)
    for name, data in forged.items():
        (control / name).write_bytes(data)
    said: list[str] = []
    found = _watch(control, said).poll(force=True)
    assert [(f.kind, f.ranks, f.seq) for f in found] == [("never_issued", (1,), 2)], said
    # the attacker's directory
    rings = shared / "rings"
    attack(
        dirs=[str(rings)],
        files={str(rings / n): base64.b64encode(d).decode() for n, d in forged.items()},
    )
    said = []
    watch = _watch(rings, said)
    assert watch.poll(force=True) == [] and watch.poll(force=True) == []
    assert len(said) == 1 and said[0].startswith("refused: "), said
    assert_refused(said[0], rings)
    with pytest.raises(UnsafePath) as refused:
        read_rings(rings)
    assert_refused(str(refused.value), rings)
    # a forged ring of nobody's inside root's own directory (rank 1's, swapped in): skipped
    (control / next(n for n in forged if n.startswith("rank1"))).unlink()
    fake = control / "rank1-1.ring"
    fake.write_bytes(forged[next(n for n in forged if n.startswith("rank1"))])
    os.chown(fake, NOBODY_UID, NOBODY_UID)
    said = []
    assert [s.rank for s in _watch(control, said).snapshots()] == [0]  # rank 0's alone
    assert [s.rank for s in read_rings(control)] == [0]
    assert any(f"{fake} is a regular file owned by uid 65534" in s for s in said), said


def _bootseer_run(tmp_path: Path, *flags: str, probe: str = "pass") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--state-dir",
            str(tmp_path / "state"),
            "--node",
            "node-x",
            "--min-free-disk",
            "0",
            "--min-free-memory",
            "0",
            "--max-restarts",
            "0",
            *flags,
            "--",
            sys.executable,
            "-c",
            probe,
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("flag", ["--colltrace-dir", "--ckpt-memory-dir", "--trace-dir"])
def test_bootseer_run_refuses_a_directory_another_user_made(
    flag: str, shared: Path, victim: Path, tmp_path: Path
) -> None:
    """``bootseer run`` naming a ring parent, memory or trace directory that nobody made
    first (0777, links to root's file under every name root would write: rings, copies,
    stamps, the trace): exit 2 before the command runs, naming the path, owner and mode;
    nothing written there, root's file unchanged."""
    planted = shared / "job"
    names = [
        "attempt-0",
        "rank-0.0",
        "rank-0.1",
        "rank-0.0.stamp",
        "peers",
        "node-x.jsonl",
        "colltrace-node-x.ndjson",
    ]
    attack(dirs=[str(planted)], links={str(planted / n): str(victim) for n in names})
    before = listing(shared)
    extra = {
        "--colltrace-dir": ("--colltrace",),
        "--ckpt-memory-dir": ("--ckpt-memory",),
        "--trace-dir": (),
    }[flag]
    trace = () if flag == "--trace-dir" else ("--trace-dir", str(tmp_path / "trace"))
    proc = _bootseer_run(tmp_path, *extra, *trace, flag, str(planted), probe="print('RAN')")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "RAN" not in proc.stdout
    assert_refused(proc.stderr, planted)
    assert victim.read_bytes() == VICTIM
    assert listing(shared) == before


def test_bootseer_run_gives_each_job_an_unguessable_ring_directory(tmp_path: Path) -> None:
    """Without colltrace.dir: a directory of the job's own in /dev/shm, 0700, its name not
    the same twice (it was /dev/shm/bootseer-colltrace-<uid>/<node>/attempt-N, which another
    user could make first), handed to the ranks, gone when the run ends."""
    need_setpriv()
    probe = (
        "import os,stat; d=os.environ['BOOTSEER_COLLTRACE_DIR']; p=os.path.dirname(d); "
        "print('DIR', d, oct(stat.S_IMODE(os.stat(p).st_mode)), os.stat(p).st_uid, "
        "oct(stat.S_IMODE(os.stat(d).st_mode)))"
    )
    seen = []
    for _ in range(2):
        proc = _bootseer_run(
            tmp_path, "--colltrace", "--trace-dir", str(tmp_path / "trace"), probe=probe
        )
        assert proc.returncode == 0, proc.stderr
        _, d, parent_mode, uid, mode = next(
            x for x in proc.stdout.splitlines() if x.startswith("DIR ")
        ).split()
        assert (parent_mode, uid, mode) == ("0o700", str(os.geteuid()), "0o700")
        parent = Path(d).parent
        assert (
            parent.parent == Path("/dev/shm")
            and parent.name.startswith("bootseer-colltrace-")
            and Path(d).name == "attempt-0"
        )
        assert len(parent.name) >= len("bootseer-colltrace-") + 16
        assert not parent.exists()
        seen.append(parent)
    assert seen[0] != seen[1]


# -- the memory tier ---------------------------------------------------------------------


def _crafted_copy(where: Path) -> dict[str, bytes]:
    """A real copy of step 50 holding chosen values (written as root in a directory of
    root's): its checksums are right, so a check of its bytes alone passes it."""
    import torch

    from ckpt.memory import MemoryConfig, MemoryTier

    where.mkdir(mode=0o700)
    tier = MemoryTier(MemoryConfig(str(where)), rank=0, world_size=1)
    tier.save(50, {"w": torch.full((64,), 666.0)})
    tier.wait()
    tier.close()
    return {p.name: p.read_bytes() for p in where.iterdir() if p.name.startswith("rank-0.")}


def test_memory_copies_in_another_users_directory_are_never_loaded_nor_stamped(
    shared: Path, victim: Path, tmp_path: Path
) -> None:
    """A memory directory nobody made first, holding a crafted copy of step 50 (its own
    0666 files) and a link where the agent writes its stamp's temporary file: the trainer's
    tier and the agent's check refuse the directory, naming it; the state keeps its values,
    the agent never writes through the link (it replaced root's file before)."""
    import torch

    from ckpt.errors import CheckpointError
    from ckpt.memory import MemoryConfig, MemoryTier
    from ckpt.memory_verify import verify_copies

    copy = _crafted_copy(tmp_path / "craft")
    memdir = shared / "mem"
    links = {str(memdir / f"rank-0.{k}.stamp.{os.getpid()}.tmp"): str(victim) for k in (0, 1)}
    links[str(memdir / "rank-0.0.stamp")] = str(victim)
    attack(
        dirs=[str(memdir)],
        links=links,
        files={str(memdir / n): base64.b64encode(d).decode() for n, d in copy.items()},
    )
    before = listing(shared)
    try:  # the agent's check beside the launch
        verify_copies(str(memdir))
    except UnsafePath as exc:
        refusal = str(exc)
    else:
        refusal = "not refused"
    assert victim.read_bytes() == VICTIM, f"root's file now holds {victim.read_bytes()[:60]!r}"
    assert_refused(refusal, memdir)
    with pytest.raises(CheckpointError) as refused:
        MemoryTier(MemoryConfig(str(memdir)), rank=0, world_size=1)
    assert_refused(str(refused.value), memdir)
    from bootseer.robust.memtier import NodeMemory

    with pytest.raises(UnsafePath) as refused:
        NodeMemory(str(memdir))
    assert_refused(str(refused.value), memdir)
    assert victim.read_bytes() == VICTIM
    assert listing(shared) == before
    # the control: the same copy in a directory of root's loads step 50 (a working forgery)
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    for name, data in copy.items():
        (own / name).write_bytes(data)
    state = {"w": torch.zeros(64)}
    tier = MemoryTier(MemoryConfig(str(own), check_durable=False), rank=0, world_size=1)
    assert tier.load(state).step == 50 and torch.equal(state["w"], torch.full((64,), 666.0))
    tier.close()


def test_a_copy_or_stamp_of_another_user_in_roots_directory_is_never_used(
    tmp_path: Path, victim: Path
) -> None:
    """Inside a directory of root's: a slot file owned by another user (or a link) is never
    mapped, a stamp that is not root's regular file never read, and the agent's stamp goes
    through the directory's descriptor to a fresh file (a link at the old temporary name is
    not followed)."""
    import torch

    from ckpt.memory import MemoryConfig, MemoryTier
    from ckpt.memory_slot import SlotFile
    from ckpt.memory_verify import stamp_for, verify_copies

    copy = _crafted_copy(tmp_path / "craft")
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    name = next(n for n in copy if n in ("rank-0.0", "rank-0.1"))
    (own / name).write_bytes(copy[name])
    os.chown(own / name, NOBODY_UID, NOBODY_UID)
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        SlotFile(str(own / name))
    (verdict,) = verify_copies(str(own))
    assert not verdict.ok and "refused: " in verdict.message and "uid 65534" in verdict.message
    assert not (own / f"{name}.stamp").exists()
    # root's own copy; a link where the old code put its stamp's temporary file
    os.unlink(own / name)
    (own / name).write_bytes(copy[name])
    (own / f"{name}.stamp.{os.getpid()}.tmp").symlink_to(victim)
    (verdict,) = verify_copies(str(own))
    assert verdict.ok and verdict.step == 50
    assert victim.read_bytes() == VICTIM
    assert json.loads((own / f"{name}.stamp").read_text())["ok"] is True
    # a stamp that is not root's file is not read: the copy is hashed as if unstamped
    stamp = own / f"{name}.stamp"
    os.chown(stamp, NOBODY_UID, NOBODY_UID)
    slot = SlotFile(str(own / name), readonly=True)
    from ckpt.memory_slot import newest

    head = newest([slot])[0][0]
    assert stamp_for(slot, head) is None
    slot.close()
    state = {"w": torch.zeros(64)}
    tier = MemoryTier(MemoryConfig(str(own), check_durable=False), rank=0, world_size=1)
    report = tier.load(state)
    assert report.step == 50 and report.verified == "hashed"  # type: ignore[attr-defined]
    tier.close()


# -- the helper itself -----------------------------------------------------------------------


def test_private_dir_rules(shared: Path, tmp_path: Path) -> None:
    """Made 0700 whatever the umask; an ancestor of nobody's, a non-sticky world-writable
    ancestor, a link of nobody's on the way, a link as the directory itself: refused, each
    naming what it found. Files: created exclusively, never through a link; only this user's
    regular files are opened, and O_TRUNC never reaches another user's."""
    old = os.umask(0)
    try:
        d = PrivateDir.open(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == 0o700
    attack(
        dirs=[str(shared / "theirs"), str(shared / "theirs" / "inner")],
        links={str(shared / "link"): str(tmp_path / "a")},
    )
    with pytest.raises(UnsafePath, match="a directory on the way to bootseer's own"):
        PrivateDir.open(shared / "theirs" / "mine")
    with pytest.raises(UnsafePath, match="is a link owned by uid 65534"):
        PrivateDir.open(shared / "link" / "b")
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(UnsafePath, match="without the sticky bit"):
        PrivateDir.open(tmp_path / "open" / "x")
    (tmp_path / "leaf").symlink_to(tmp_path / "a" / "b")
    with pytest.raises(UnsafePath, match="is a link"):
        PrivateDir.open(tmp_path / "leaf")
    fd = d.create("f", os.O_WRONLY)
    os.write(fd, b"mine")
    os.close(fd)
    with pytest.raises(FileExistsError):
        d.create("f")
    os.symlink("/etc/hostname", d.where("l"))
    with pytest.raises(FileExistsError):
        d.create("l")
    with pytest.raises(UnsafePath, match="is a link"):
        d.open_owned("l")
    os.chown(d.where("f"), NOBODY_UID, NOBODY_UID)
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        d.open_owned("f", os.O_WRONLY | os.O_TRUNC)
    assert Path(d.where("f")).read_bytes() == b"mine"
    d.close()
