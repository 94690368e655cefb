"""The memory tier on one node: owned by ``bootseer run``, it outlives a SIGKILLed trainer.

Two ranks on gloo (``memckpt_worker.py``) save every step into the node's memory through
``CheckpointManager`` (the durable tier every 100 steps: only step 0). Rank 1 SIGKILLs itself
half-way through copying step 3; ``bootseer run`` restarts the job, which loads step 2 (the
newest step complete on both ranks, never the torn copy) from memory, bit for bit, and
trains on. A byte flipped in rank 1's newest copy is then refused, and both ranks fall back
to the step before.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.memory_slot import HEADER, SlotFile, newest

WORKER = str(Path(__file__).resolve().parent / "memckpt_worker.py")
ROOT = Path(__file__).resolve().parent.parent
NUMEL = 300_000  # floats per rank: data spans several checksum blocks
TOKEN = secrets.token_hex(16)  # the job's secret for peer connections (never logged)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["BOOTSEER_MEMCKPT_TOKEN"] = TOKEN
    env.update(extra or {})
    return env


def results(path: Path) -> dict[int, dict]:
    out = {}
    for f in sorted(path.glob("rank-*.json")):
        r = json.loads(f.read_text())
        out[r["rank"]] = r
    return out


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``bootseer run`` over the job; attempt 0 loses rank 1 mid-copy of step 3."""
    base = tmp_path_factory.mktemp("memckpt")
    memdir, res = base / "shm", base / "results"
    res.mkdir(mode=0o700)
    spec = {
        "world": 2,
        "numel": NUMEL,
        "steps": 5,
        "results": str(res),
        "durable": f"file://{base}/durable",
        "durable_every": 100,
        "die_at": [1, 3],
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--trace-dir",
            str(base / "trace"),
            "--backoff",
            "0",
            "--max-restarts",
            "1",
            "--ckpt-memory",
            "--ckpt-memory-dir",
            str(memdir),
            "--",
            sys.executable,
            WORKER,
            "launch",
            json.dumps(spec),
        ],
        env=worker_env({"BOOTSEER_NODE": "testnode"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {"proc": proc, "memdir": memdir, "results": res, "spec": spec, "base": base}


def test_sigkill_mid_copy_restart_loads_previous_complete_step(killed_job: dict) -> None:
    proc = killed_job["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attempt 1" in proc.stderr  # the agent restarted the job after the SIGKILL
    # before the restart the agent checked each rank's newest copy beside the launch
    # (ckpt.memory_verify): rank 1's is step 2, its step 3 torn
    assert re.search(r"memory tier: rank-1\.[01] step 2: good", proc.stderr), proc.stderr[-3000:]
    got = results(killed_job["results"])
    assert sorted(got) == [0, 1]
    for rank, r in got.items():
        # step 2: the newest complete on both ranks (rank 1's step 3 was torn; the durable
        # tier holds only step 0), from this node's memory, every byte as it was saved
        assert (r["loaded"], r["source"], r["problems"]) == (2, "local", []), (rank, r)
        assert r["last"] == 4
    mode = stat.S_IMODE(os.stat(killed_job["memdir"]).st_mode)
    assert mode == 0o700
    for rank in (0, 1):  # the newest two steps of the restarted run, committed
        slots = [SlotFile(str(killed_job["memdir"] / f"rank-{rank}.{k}")) for k in (0, 1)]
        assert sorted(h.step for h, _ in newest(slots)) == [3, 4]
        for s in slots:
            assert stat.S_IMODE(os.fstat(s.fd).st_mode) == 0o600
            s.close()


def test_flipped_byte_in_memory_copy_is_refused(killed_job: dict) -> None:
    memdir, spec = killed_job["memdir"], dict(killed_job["spec"])
    slots = [SlotFile(str(memdir / f"rank-1.{k}")) for k in (0, 1)]
    head, slot = newest(slots)[0]
    assert head.step == 4
    slot.map[HEADER + head.data_size // 2] ^= 0x10  # one bit, in the middle of the data
    for s in slots:
        s.close()
    res = killed_job["base"] / "results-flip"
    res.mkdir(mode=0o700)
    spec.update(results=str(res), die_at=None, steps=5)
    proc = subprocess.run(
        [sys.executable, WORKER, "launch", json.dumps(spec)],
        env=worker_env({"BOOTSEER_MEMCKPT_DIR": str(memdir)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = results(res)
    for rank, r in got.items():
        assert (r["loaded"], r["source"], r["problems"]) == (3, "local", []), (rank, r)
    # every rank says which rank refused which step, and why
    assert "step 4 from local cannot be loaded by rank 1" in proc.stderr
    assert "fails its checksum" in proc.stderr


def test_agent_owns_and_removes_its_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ckpt.memory_dir: a private directory in /dev/shm, gone when the run ends; the
    layout (ckpt.memory_layout) is handed to the job, a bad one refused before it starts. The
    agent's peer server answers the job's token (inherited by the job) and refuses another;
    the token appears in no output and no trace; without a token the agent does not start."""
    probe = (
        "import os,stat,sys; d=os.environ['BOOTSEER_MEMCKPT_DIR']; "
        "print('DIR', d, oct(stat.S_IMODE(os.stat(d).st_mode))); "
        "print('LAYOUT', os.environ['BOOTSEER_MEMCKPT_LAYOUT'])\n"
        "from ckpt.memory_peer import PeerClient, PeerError\n"
        "addr = os.environ['BOOTSEER_MEMCKPT_SERVER']\n"
        "with PeerClient(addr) as c: print('LIST', c.listing(0, 1))\n"
        "try: PeerClient(addr, token='w' * 32)\n"
        "except PeerError as e: print('REFUSED', e)"
    )
    layout = '{"tp": [[0, 1]], "dp": [[0], [1]]}'
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--trace-dir",
            str(tmp_path / "trace"),
            "--ckpt-memory",
            "--ckpt-memory-layout",
            layout,
            "--ckpt-memory-listen",
            "127.0.0.1:0",
            "--",
            sys.executable,
            "-c",
            probe,
        ],
        env=worker_env({"BOOTSEER_NODE": "testnode"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DIR "))
    _, directory, mode = line.split()
    assert directory.startswith("/dev/shm/bootseer-memckpt-") and mode == "0o700"
    assert not os.path.exists(directory)
    assert "memory tier: copies in" in proc.stderr
    assert f"LAYOUT {layout}" in proc.stdout
    assert "LIST []" in proc.stdout  # the job's token opens the agent's server
    assert "REFUSED" in proc.stdout and "authentication failed" in proc.stdout
    assert "refused a connection from 127.0.0.1" in proc.stderr
    traced = "".join(
        f.read_text(errors="replace") for f in (tmp_path / "trace").rglob("*") if f.is_file()
    )
    assert traced and TOKEN not in proc.stdout + proc.stderr + traced
    # refused before anything is made (bootseer run turns these into an error, exit 2)
    from bootseer.robust.memtier import NodeMemory

    kept = tmp_path / "kept"
    with pytest.raises(ValueError, match="ckpt.memory_layout: dimension 'tp'"):
        NodeMemory(str(kept), layout='{"tp": 3}')
    monkeypatch.delenv("BOOTSEER_MEMCKPT_TOKEN", raising=False)
    with pytest.raises(ValueError, match="set BOOTSEER_MEMCKPT_TOKEN"):
        NodeMemory(str(kept), listen="127.0.0.1:0")
    assert not kept.exists()


def test_state_that_does_not_fit_turns_the_tier_off_naming_sizes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4 MiB tmpfs cannot hold 4x a 2 MB state: said at the first save, the durable tier
    goes on; a state whose shapes differ from the memory copy loads from the durable tier."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.memory import MemoryConfig

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir(mode=0o700)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(small)], check=True
    )
    try:
        mgr = CheckpointManager(f"file://{tmp_path}/durable", memory=MemoryConfig(str(small)))
        state = {"w": torch.arange(500_000, dtype=torch.float32)}
        with caplog.at_level("ERROR", logger="ckpt"):
            handle = mgr.save(0, state)
        assert handle.wait().committed  # the durable tier took the save
        assert not mgr.memory.enabled
        assert "memory tier: off" in caplog.text and "1.9 MiB" in caplog.text
        assert str(small) in caplog.text and "MiB free" in caplog.text
        mgr.close()
    finally:
        if subprocess.run(["umount", str(small)]).returncode:
            subprocess.run(["umount", "-l", str(small)], check=True)

    roomy = tmp_path / "roomy"
    roomy.mkdir(mode=0o700)
    with CheckpointManager(
        f"file://{tmp_path}/durable", memory=MemoryConfig(str(roomy), durable_every=100)
    ) as mgr:
        mgr.save(1, {"w": torch.full((10,), 1.0)})  # memory only: a different shape
    with CheckpointManager(f"file://{tmp_path}/durable", memory=MemoryConfig(str(roomy))) as mgr:
        state = {"w": torch.zeros(500_000)}
        with caplog.at_level("WARNING", logger="ckpt"):
            assert mgr.load(state) == 0  # the durable step 0, all of it
        assert torch.equal(state["w"], torch.arange(500_000, dtype=torch.float32))
        assert "does not match the state" in caplog.text and "w: copy float32 [10]" in caplog.text


def test_a_newer_durable_commit_wins_over_older_copies_in_memory(tmp_path: Path) -> None:
    """A kept directory may hold copies older than the durable tier's newest commit: the
    durable step loads; the job's next copy in memory then wins again."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.memory import MemoryConfig

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    url = f"file://{tmp_path}/durable"
    with CheckpointManager(url, memory=MemoryConfig(str(shm), durable_every=100)) as mgr:
        mgr.save(5, {"w": torch.full((1000,), 5.0)})  # memory only
    with CheckpointManager(url, memory=False) as mgr:
        mgr.save(7, {"w": torch.full((1000,), 7.0)}, block=True)
    with CheckpointManager(url, memory=MemoryConfig(str(shm))) as mgr:
        state = {"w": torch.zeros(1000)}
        assert mgr.load(state) == 7 and torch.equal(state["w"], torch.full((1000,), 7.0))
        mgr.save(8, {"w": torch.full((1000,), 8.0)})
    with CheckpointManager(url, memory=MemoryConfig(str(shm))) as mgr:
        state = {"w": torch.zeros(1000)}
        report = mgr.load_with_report(state)
        assert (report.step, report.source) == (8, "local")  # type: ignore[attr-defined]
        assert torch.equal(state["w"], torch.full((1000,), 8.0))


def test_a_copy_damaged_mid_load_with_nothing_else_is_an_error_not_a_fresh_start(
    tmp_path: Path,
) -> None:
    """A block that fails its sum after earlier blocks were copied leaves the state partly
    overwritten: with no other copy and no durable checkpoint, ``load`` must not say "no
    checkpoint" (the caller would train on from step 0 with a torn state). It raises,
    naming the copy, and drops it, so that the restart starts clean."""
    import torch

    from ckpt import CheckpointError, CheckpointManager, CheckpointNotFound
    from ckpt.memory import MemoryConfig
    from ckpt.memory_slot import BLOCK

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    url = f"file://{tmp_path}/durable"
    saved = torch.arange(600_000, dtype=torch.float32)  # 2.4 MB: three checksum blocks
    with CheckpointManager(url, memory=MemoryConfig(str(shm), durable_every=100)) as mgr:
        mgr.save(5, {"w": saved})  # memory only
    slots = [SlotFile(str(shm / f"rank-0.{k}")) for k in (0, 1)]
    head, slot = newest(slots)[0]
    assert head.step == 5
    slot.map[HEADER + BLOCK + 12345] ^= 0x01  # block 1: block 0 is copied before the check
    for s in slots:
        s.close()
    with CheckpointManager(url, memory=MemoryConfig(str(shm))) as mgr:
        state = {"w": torch.zeros(600_000)}
        with pytest.raises(CheckpointError, match="partly overwritten") as err:
            mgr.load(state)
        assert not isinstance(err.value, CheckpointNotFound)
        assert "step 5" in str(err.value) and "fails its checksum" in str(err.value)
        assert torch.equal(state["w"][:1000], saved[:1000])  # what made it an error
    with CheckpointManager(url, memory=MemoryConfig(str(shm))) as mgr:  # the restart
        with pytest.raises(CheckpointNotFound):
            mgr.load({"w": torch.zeros(600_000)})


def test_swapped_words_in_a_copy_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two 8-byte words of the newest copy swapped (a word sum would not see it: the test
    shows that): the load refuses that copy, naming it, and takes the step before; a peer
    refuses the same copy on receipt."""
    import numpy as np
    import torch

    from ckpt.memory import MemoryConfig, MemoryTier
    from ckpt.memory_peer import PeerClient, PeerError, PeerServer

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    tier = MemoryTier(MemoryConfig(str(shm)), rank=0, world_size=1)
    for step in (1, 2):
        tier.save(step, {"w": torch.arange(300_000, dtype=torch.float64) + step})
    tier.close()
    slots = [SlotFile(str(shm / f"rank-0.{k}")) for k in (0, 1)]
    head, slot = newest(slots)[0]
    assert head.step == 2
    words = np.frombuffer(slot.map, dtype="<u8", count=head.data_size // 8, offset=HEADER)
    before = int(words[: 1 << 17].sum(dtype=np.uint64))  # block 0's 64-bit word sum
    a, b = words[10].copy(), words[5000].copy()
    assert a != b
    words[10], words[5000] = b, a
    assert int(words[: 1 << 17].sum(dtype=np.uint64)) == before  # what word sums missed
    del words
    (tmp_path / "peer").mkdir(mode=0o700)
    server = PeerServer(str(tmp_path / "peer"), token=TOKEN).start()
    try:
        with (
            PeerClient(server.address, token=TOKEN) as client,
            pytest.raises(PeerError, match="data block 0 .* fails its checksum"),
        ):
            client.push(slot, head)
    finally:
        server.close()
    damaged = slot.path
    for s in slots:
        s.close()
    state = {"w": torch.zeros(300_000, dtype=torch.float64)}
    tier = MemoryTier(MemoryConfig(str(shm)), rank=0, world_size=1)
    with caplog.at_level("WARNING", logger="ckpt"):
        report = tier.load(state)
    tier.close()
    assert report is not None and report.step == 1
    assert torch.equal(state["w"], torch.arange(300_000, dtype=torch.float64) + 1)
    assert "step 2 from local cannot be loaded by rank 0" in caplog.text
    assert f"{damaged}: step 2: data block 0" in caplog.text
