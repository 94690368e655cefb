"""Every rank resumes from the same step: the newest one that every rank can load.

Checkpoints of 3 steps are saved by 2 and 3 ranks (from this process), then damaged: one
flipped byte in each rank's data file in turn, in a tensor every rank reads, an index, a
missing objects or data file, two different steps. Real gloo process groups of 2 and 3 ranks
then load each one; every rank must load the same step, bit for bit that step's values, and
log a warning naming the skipped step, the rank that could not load it and the file. The
issue's own case runs too: FSDP2 on 2 ranks, one byte of rank 1's data file flipped, the
gathered model equal to the previous step's. Without a process group (ranks that cannot
talk, one process loading a multi-rank checkpoint) the step is the newest whose files all
verify.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ckpt_workers as W
import pytest

from ckpt import CheckpointManager
from ckpt.layout import MANIFEST, data_name, index_name, objects_name, step_dir
from striped_fs.urls import url_to_fs

STEPS = [1, 2, 3]


@dataclass
class Scenario:
    """A checkpoint saved by ``saved`` ranks, damaged, loaded by a group of ``world``."""

    name: str
    world: int
    damage: list[tuple[str, int, int]]  # (what, step, rank whose file)
    expect: int | None  # the step every rank loads; None: every rank raises
    failing: list[tuple[int, int, str]] = field(default_factory=list)  # (step, rank, file)
    saved: int = 0  # 0: the group's world size
    step: int | None = None  # an explicit step to load
    extra_key_on: tuple[int, ...] = ()
    behind: int | None = None  # this rank lists a copy of the store where step 3 is not committed

    def __post_init__(self) -> None:
        self.saved = self.saved or self.world

    @property
    def key(self) -> str:
        return f"w{self.world}-{self.name}"


def scenarios(world: int) -> list[Scenario]:
    last = world - 1
    out = [Scenario("clean", world, [], 3)]
    for r in range(world):  # a flipped byte in rank r's own shard: only rank r reads it
        out.append(Scenario(f"data-rank{r}", world, [("data", 3, r)], 2, [(3, r, data_name(r))]))
    out += [
        # "bias" is replicated and small: every rank writes its own copy and loads it
        # (ckpt.staging.SMALL_REPLICA_BYTES); rank 0's is damaged, so rank 0 cannot load
        # step 3 and every rank falls back
        Scenario(
            "shared-tensor",
            world,
            [("bias", 3, 0)],
            2,
            [(3, 0, data_name(0))],
        ),
        Scenario(
            "index",
            world,
            [("index", 3, last)],
            2,
            [(3, r, index_name(last)) for r in range(world)],
        ),
        Scenario(
            "missing-objects", world, [("objects", 3, last)], 2, [(3, last, objects_name(last))]
        ),
        Scenario("missing-data", world, [("rm-data", 3, last)], 2, [(3, last, data_name(last))]),
        # a commit landing between the ranks' listings: the ranks settle on the older step,
        # nothing damaged, nothing warned
        Scenario("listed-differently", world, [], 2, behind=last),
        Scenario(
            "two-steps",
            world,
            [("data", 3, 0), ("data", 2, last)],
            1,
            [(3, 0, data_name(0)), (2, last, data_name(last))],
        ),
        Scenario(
            "explicit-step", world, [("data", 3, last)], None, [(3, last, data_name(last))], step=3
        ),
        Scenario("one-rank-raises", world, [], None, extra_key_on=(last,)),
        # the error wins over damage found in the same round: rank 0 raises rank W-1's error
        Scenario("raises-beside-damage", world, [("data", 3, 0)], None, extra_key_on=(last,)),
    ]
    if world == 3:  # resharding: loader 2 reads the end of saved rank 1's shard, and loader 1
        # the same stripe for saved rank 1's copy of "bias" (a load takes its rank's copy)
        out.append(
            Scenario(
                "reshard-2to3",
                3,
                [("data-end", 3, 1)],
                2,
                [(3, 1, data_name(1)), (3, 2, data_name(1))],
                saved=2,
            )
        )
    return out


def damage(url: str, what: str, step: int, rank: int) -> None:
    fs, root = url_to_fs(url)
    directory = step_dir(root, step)
    if what == "data":
        W.flip_chunk_byte(url, step, rank, "w")
    elif what == "data-end":
        W.flip_chunk_byte(url, step, rank, "w", at="end")
    elif what == "bias":
        W.flip_chunk_byte(url, step, rank, "bias")
    elif what == "index":
        raw = bytearray(fs.cat_file(f"{directory}/{index_name(rank)}"))
        raw[raw.index(b'"data_size":') + 12] ^= 0x01  # a digit: still JSON, another checksum
        fs.pipe_file(f"{directory}/{index_name(rank)}", bytes(raw))
    elif what == "objects":
        fs.rm_file(f"{directory}/{objects_name(rank)}")
    elif what == "rm-data":
        fs.rm_file(f"{directory}/{data_name(rank)}")
    else:  # pragma: no cover
        raise ValueError(what)


ALL = [s for world in (2, 3) for s in scenarios(world)]


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    """Every scenario loaded by its group: ``{scenario key: {rank: result}}``."""
    base = tmp_path_factory.mktemp("ckpt-agree")
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for world in (2, 3):
        actions = []
        for s in (s for s in ALL if s.world == world):
            url = str(base / s.key)
            W.save_agree_steps(url, s.saved, STEPS)
            for what, step, rank in s.damage:
                damage(url, what, step, rank)
            urls = {}
            if s.behind is not None:
                shutil.copytree(url, f"{url}-behind")
                os.unlink(f"{url}-behind/step-3/{MANIFEST}")
                urls[str(s.behind)] = f"{url}-behind"
            actions.append(
                {
                    "op": "agree_load",
                    "tag": s.key,
                    "url": url,
                    "step": s.step,
                    "saved_world": s.saved,
                    "extra_key_on": list(s.extra_key_on),
                    "urls": urls,
                }
            )
        if world == 2:
            actions.append({"op": "fsdp2", "tag": "fsdp2", "url": str(base / "fsdp2")})
        started = time.perf_counter()
        results.update(W.run_group(world, actions, base / f"group-{world}"))
        print(f"{world} ranks: {len(actions)} loads in {time.perf_counter() - started:.1f} s")
    return results


def _ranks(loads: dict[str, dict[int, dict[str, Any]]], key: str, world: int) -> dict[int, dict]:
    got = loads.get(key)
    assert got is not None and sorted(got) == list(range(world)), f"{key}: {got}"
    errors = {r: v["error"] for r, v in got.items() if "error" in v}
    assert not errors, f"{key} failed:\n" + "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    return got


def _assert_warned(results: dict[int, dict], failing: list[tuple[int, int, str]]) -> None:
    """On every rank, a warning names each skipped step, the rank that could not load it,
    and the file."""
    for rank, r in sorted(results.items()):
        for step, who, name in failing:
            assert any(
                f"step {step} " in w and f"by rank {who}:" in w and name in w for w in r["warnings"]
            ), (rank, step, who, name, r["warnings"])


@pytest.mark.parametrize("s", [s for s in ALL if s.expect is not None], ids=lambda s: s.key)
def test_every_rank_loads_the_newest_step_every_rank_can_load(loads, s: Scenario) -> None:
    results = _ranks(loads, s.key, s.world)
    steps = {rank: r.get("step", r.get("raised")) for rank, r in results.items()}
    assert set(steps.values()) == {s.expect}, f"ranks loaded {steps}, expected {s.expect}"
    for rank, r in sorted(results.items()):
        assert r["problems"] == [], (rank, r["problems"])  # that step's bytes, bit for bit
    _assert_warned(results, s.failing)
    skipped = [r["skipped"] for r in results.values()]
    assert all(x == skipped[0] for x in skipped), skipped  # the same account on every rank
    assert sorted(
        (int(x.split()[1].rstrip(":")), int(x.split()[3].rstrip(":"))) for x in skipped[0]
    ) == sorted((st, who) for st, who, _ in s.failing)
    calls = [r["collectives"] for r in results.values()]
    assert all(c == calls[0] for c in calls), calls  # every rank ran the same collectives
    if s.behind is not None:  # one more round, in which the rank that held step 2 kept it
        assert calls[0] == {"all_reduce": 2, "all_gather_object": 1}
    elif not s.failing:  # nothing damaged: agreeing cost one small all_reduce
        assert calls[0] == {"all_reduce": 1, "all_gather_object": 0}


@pytest.mark.parametrize("world", [2, 3])
def test_an_explicit_step_some_rank_cannot_load_raises_on_every_rank(loads, world: int) -> None:
    s = next(x for x in ALL if x.world == world and x.name == "explicit-step")
    results = _ranks(loads, s.key, world)
    ((step, who, name),) = s.failing
    for rank, r in sorted(results.items()):
        assert r.get("raised") == "CheckpointCorrupt", (rank, r)
        assert (
            f"step {step}" in r["message"]
            and f"rank {who}" in r["message"]
            and name in r["message"]
        ), r["message"]
    _assert_warned(results, s.failing)


@pytest.mark.parametrize("name", ["one-rank-raises", "raises-beside-damage"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_raises_makes_every_rank_raise_without_a_hang(
    loads, world: int, name: str
) -> None:
    """Rank W-1's state has a key the checkpoint lacks: it raises its StateMismatchError,
    every other rank a CheckpointError naming it (also rank 0, whose own file is damaged);
    none waits in a collective for ever (the group returned)."""
    s = next(x for x in ALL if x.world == world and x.name == name)
    results = _ranks(loads, s.key, world)
    last = world - 1
    assert results[last]["raised"] == "StateMismatchError"
    assert "not_in_checkpoint" in results[last]["message"]
    for rank in range(last):
        assert results[rank]["raised"] == "CheckpointError", results[rank]
        assert f"failed on rank {last}" in results[rank]["message"]
        assert "not_in_checkpoint" in results[rank]["message"]


def test_fsdp2_two_ranks_one_flipped_byte_all_resume_from_the_previous_step(loads) -> None:
    """The issue's case: rank 1's data file of step 2 damaged. Before, rank 0 loaded step 2
    and rank 1 step 1, and the gathered model matched neither."""
    results = _ranks(loads, "fsdp2", 2)
    for rank, r in sorted(results.items()):
        assert r["step"] == 1, (rank, r["step"])
        assert r["keys"] > 4 and r["differ_from_step1"] == [], r["differ_from_step1"]
        assert r["differs_from_step2"]
    _assert_warned(results, [(2, 1, data_name(1))])


# -- without a process group -------------------------------------------------------------------


@pytest.mark.parametrize("damaged", [0, 1])
@pytest.mark.parametrize("loader", [0, 1])
def test_ranks_without_a_process_group_take_the_step_whose_files_all_verify(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damaged: int, loader: int
) -> None:
    """Two ranks that cannot talk: rank ``loader`` skips step 2 even when the damaged file
    is the other rank's, so both take step 1."""
    url = str(tmp_path / "store")
    W.save_agree_steps(url, 2, [1, 2])
    W.flip_chunk_byte(url, 2, damaged, "w")
    state = W.agree_blank(loader, 2)
    with (
        CheckpointManager(url, rank=loader, world_size=2, cache_dir=False) as mgr,
        caplog.at_level(logging.WARNING, logger="ckpt"),
    ):
        report = mgr.load_with_report(state)
    assert report.step == 1
    assert W.agree_problems(state, 1, loader, 2, 2) == []
    assert len(report.skipped) == 1 and data_name(damaged) in report.skipped[0]
    assert any(
        "step 2 " in r.message and f"rank {loader}" in r.message and data_name(damaged) in r.message
        for r in caplog.records
    ), caplog.text


def test_one_process_loading_a_multi_rank_checkpoint_takes_the_step_all_files_verify(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """World size 1 over a 2-rank checkpoint whose rank 1 objects file of step 2 is gone:
    step 1, as the 2-rank job would take."""
    url = str(tmp_path / "store")
    W.save_agree_steps(url, 2, [1, 2])
    damage(url, "objects", 2, 1)
    state = W.agree_blank(0, 1)
    with (
        CheckpointManager(url, cache_dir=False) as mgr,
        caplog.at_level(logging.WARNING, logger="ckpt"),
    ):
        assert mgr.latest() == 2  # its commit is valid; the damage is in a file's bytes
        assert mgr.load(state) == 1
    assert W.agree_problems(state, 1, 0, 1, 2) == []
    assert objects_name(1) in caplog.text and "step 2 " in caplog.text


def test_a_process_group_of_another_world_is_a_clear_error(tmp_path: Path) -> None:
    """A group whose size or rank is not the manager's cannot agree for it: said before
    any collective, naming both."""
    import torch.distributed as dist

    url = str(tmp_path / "store")
    W.save_agree_steps(url, 2, [1])
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        with CheckpointManager(
            url, rank=0, world_size=2, cache_dir=False, process_group=dist.group.WORLD
        ) as mgr:
            state = W.agree_blank(0, 2)
            with pytest.raises(
                ValueError,
                match=r"process_group has rank 0 of 1; the manager "
                r"is rank 0 of 2: pass the group of the ranks that load together",
            ):
                mgr.load(state)
            assert state["step"] is None  # nothing loaded
        with CheckpointManager(url, rank=0, world_size=2, cache_dir=False) as mgr:
            assert mgr.load(state) == 1  # the default group is not this world's: none used
    finally:
        dist.destroy_process_group()
