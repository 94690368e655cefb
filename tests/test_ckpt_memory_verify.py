"""The node agent's check of the memory tier's copies (``ckpt.memory_verify``).

The agent hashes each rank's newest copy beside the launch and stamps it; the trainer's load
of a copy stamped good is a plain copy, bit for bit; a copy the agent found damaged is never
loaded (the load falls back to the step before, naming the damage); a stamp binds one copy:
moved to another copy, or left on a copy rewritten after the check, it validates nothing and
the load hashes again (and refuses a flipped byte).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckpt.memory import MemoryConfig, MemoryTier
from ckpt.memory_slot import BLOCK, HEADER, SlotFile, newest
from ckpt.memory_verify import stamp_for, stamp_path, verify_copies

NUMEL = 700_000  # float32: 2.8 MB, three checksum blocks


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(NUMEL, generator=g),
        "b": torch.randn(3, 5, generator=g).double(),
        "step": step,
    }


def zeros() -> dict:
    return {"w": torch.zeros(NUMEL), "b": torch.zeros(3, 5, dtype=torch.float64), "step": -1}


@pytest.fixture()
def two_steps(tmp_path: Path) -> Path:
    """Rank 0 of a 1-rank job saved steps 1 and 2 in ``tmp_path/shm``."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    tier = MemoryTier(MemoryConfig(str(shm)), rank=0, world_size=1)
    for step in (1, 2):
        tier.save(step, state_at(step))
    tier.close()
    return shm


def slots_of(shm: Path) -> list[SlotFile]:
    return [SlotFile(str(shm / f"rank-0.{k}")) for k in (0, 1)]


def load(shm: Path) -> tuple[object, dict]:
    tier = MemoryTier(MemoryConfig(str(shm)), rank=0, world_size=1)
    try:
        state = zeros()
        return tier.load(state), state
    finally:
        tier.close()


def assert_equal(state: dict, step: int) -> None:
    want = state_at(step)
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"])
    assert state["step"] == step


def test_a_stamped_copy_loads_bit_exact_without_hashing(two_steps: Path) -> None:
    verdicts = verify_copies(str(two_steps))
    assert [(Path(v.path).parent, v.step, v.ok) for v in verdicts] == [(two_steps, 2, True)]
    report, state = load(two_steps)
    assert (report.step, report.source, report.verified) == (2, "local", "agent")
    assert_equal(state, 2)


def test_a_byte_the_agent_finds_flipped_is_never_loaded(
    two_steps: Path, caplog: pytest.LogCaptureFixture
) -> None:
    slots = slots_of(two_steps)
    head, slot = newest(slots)[0]
    slot.map[HEADER + BLOCK + 777] ^= 0x04  # block 1 of step 2
    for s in slots:
        s.close()
    (verdict,) = verify_copies(str(two_steps))
    assert (verdict.step, verdict.ok) == (2, False)
    assert "data block 1" in verdict.message and "fails its checksum" in verdict.message
    with caplog.at_level("WARNING", logger="ckpt"):
        report, state = load(two_steps)
    assert (report.step, report.source) == (1, "local")  # the step before, never step 2
    assert_equal(state, 1)
    assert "step 2 from local cannot be loaded by rank 0" in caplog.text
    assert (
        "found damaged by the node agent's check" in caplog.text and "data block 1" in caplog.text
    )


def test_a_stamp_validates_only_the_copy_it_was_made_for(two_steps: Path) -> None:
    verify_copies(str(two_steps))
    slots = slots_of(two_steps)
    (h2, s2), (h1, s1) = newest(slots)
    assert (h2.step, h1.step) == (2, 1) and stamp_for(s2, h2)["ok"] is True
    # the stamp of step 2's copy, moved onto step 1's copy (even with its step edited)
    forged = json.loads(Path(stamp_path(s2.path)).read_text())
    forged["step"] = 1
    Path(stamp_path(s1.path)).write_text(json.dumps(forged))
    assert stamp_for(s1, h1) is None
    # step 2's copy rewritten after the check (a flipped byte, committed again): the old
    # stamp does not apply, the load hashes the copy, refuses it and takes step 1
    s2.invalidate()
    assert not Path(stamp_path(s2.path)).exists()  # the writer removes the old verdict
    # step 2's own stamp put back, as if the agent wrote it late: it must not apply either
    Path(stamp_path(s2.path)).write_text(json.dumps({**forged, "step": 2}))
    s2.map[HEADER + 4242] ^= 0x80
    h2.created += 1.0
    s2.commit(h2)
    assert stamp_for(s2, h2) is None
    for s in slots:
        s.close()
    report, state = load(two_steps)
    assert (report.step, report.verified) == (1, "hashed")
    assert_equal(state, 1)


def test_a_copy_rewritten_alike_after_the_stamp_is_hashed_again(tmp_path: Path) -> None:
    """The same step saved again over a stamped copy (a restarted job) is a new copy."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    tier = MemoryTier(MemoryConfig(str(shm)), rank=0, world_size=1)
    tier.save(4, state_at(4))
    tier.wait()
    verify_copies(str(shm))
    kept = tmp_path / "stamp"
    slot0 = shm / "rank-0.0"
    shutil.copy(stamp_path(str(slot0)), kept)
    tier.resume_from(None)  # the job starts over: step 4 is saved again into slot 0
    tier.save(4, state_at(4))
    tier.close()
    shutil.copy(kept, stamp_path(str(slot0)))  # the old stamp back beside the new copy
    report, state = load(shm)
    assert (report.step, report.verified) == (4, "hashed")
    assert_equal(state, 4)
