"""ckpt in one process: content, staging, back-pressure, failures, retention, fallback."""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import threading
import time

import ckpt_workers as W
import pytest
import torch

from ckpt import (
    CheckpointManager,
    CheckpointSaveError,
    FlatShard,
    PerRank,
    SaveHandle,
    StateMismatchError,
    init_optimizer_state,
)
from ckpt.layout import data_name, index_name, step_dir
from ckpt.overlap import ChunkIndex, StoredChunk
from ckpt.persist import apply_retention
from ckpt.tensors import Box
from striped_fs.layout import Manifest as StripeManifest
from striped_fs.layout import stripe_path
from striped_fs.urls import url_to_fs

SMALL = {"stripe_size": "64KiB"}


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32, generator=g)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {
            "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "ints": torch.randint(0, 1000, (13,), generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(seed * 1.5),
            "empty": torch.empty(0, 3),
            "strided": torch.randn(8, 6, generator=g).t(),  # non-contiguous
            "list": [torch.full((3,), float(seed)), {"deep": torch.arange(4) + seed}],
        },
        "step": seed,
        "loader": {"epoch": seed // 10, "position": seed * 7},
        "rng": PerRank(torch.get_rng_state()),
    }


def blank_like(state: dict) -> dict:
    """A state of the same structure with different values, to load into."""

    def blank(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x) if x.dtype != torch.bool else torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: blank(v) for k, v in x.items()}
        if isinstance(x, list):
            return [blank(v) for v in x]
        if isinstance(x, PerRank):
            return PerRank(None)
        return None

    return blank(state)


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, PerRank):
        assert_same(a.value, b.value, f"{path}(PerRank)")
    else:
        assert a == b, path


def test_roundtrip_is_bit_exact(tmp_path):
    state = make_state(3)
    with CheckpointManager(str(tmp_path), storage_options={"striped": SMALL}) as mgr:
        mgr.save(3, state, block=True)
        target = blank_like(state)
        assert mgr.load(target) == 3
    assert_same(state, target)


def test_staged_data_is_immutable_after_save_returns(tmp_path):
    state = {"w": torch.arange(1_000_000, dtype=torch.float32)}
    expected = state["w"].clone()
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
        state["w"].mul_(-1)  # training mutates right after save returns
        mgr.wait()
        target = {"w": torch.zeros(1_000_000)}
        mgr.load(target)
    assert torch.equal(target["w"], expected)


def test_staging_buffer_is_allocated_once_and_reused(tmp_path):
    state = {"w": torch.randn(256, 1024)}
    with CheckpointManager(str(tmp_path), keep=2) as mgr:
        for step in range(10):
            state["w"].add_(1)
            mgr.save(step, state)
        mgr.wait()
        assert mgr._pool.allocations == 1
        target = {"w": torch.zeros(256, 1024)}
        mgr.load(target)
        assert torch.equal(target["w"], state["w"])


def test_new_save_waits_for_the_one_in_flight_and_says_so(tmp_path, caplog):
    state = {"w": torch.randn(4 << 20)}  # 16 MiB
    caplog.set_level(logging.INFO, logger="ckpt")
    with CheckpointManager(str(tmp_path), storage_options={"striped": {"concurrency": 1}}) as mgr:
        first = mgr.save(1, state)
        second = mgr.save(2, state)
        assert first.done()  # the second save did not start before the first finished
        second.wait()
    assert "save(step=2) waits for step 1" in caplog.text
    assert re.search(r"save\(step=2\) waited [0-9.]+ s for step 1", caplog.text)


def test_background_failure_is_raised_in_the_caller_naming_the_step(tmp_path):
    state = {"w": torch.randn(1000)}
    (tmp_path / "step-5").write_bytes(b"a file where the step directory must go")
    mgr = CheckpointManager(str(tmp_path))
    handle = mgr.save(5, state)  # staging succeeds; persisting fails in the background
    with pytest.raises(CheckpointSaveError, match="step 5") as err:
        mgr.save(6, state)  # the next save raises the previous failure ...
    assert err.value.step == 5
    handle6 = mgr.save(6, state)  # ... and the one after that works
    handle6.wait()
    assert handle.done() and mgr.latest() == 6
    mgr.save(5, state)
    with pytest.raises(CheckpointSaveError, match="step 5"):
        mgr.close()  # close raises a pending failure too


def test_latest_ignores_uncommitted_saves(tmp_path):
    state = {"w": torch.randn(100)}
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state, block=True)
        torn = tmp_path / "step-7"
        torn.mkdir()
        (torn / data_name(0)).write_bytes(b"half")
        assert mgr.latest() == 1
        assert [c.step for c in mgr.list()] == [1]


def test_retention_keeps_newest_and_never_the_protected(tmp_path):
    state = {"w": torch.randn(100)}
    with CheckpointManager(str(tmp_path), keep=2) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state, block=True)
        assert [c.step for c in mgr.list()] == [3, 4]
        mgr2 = CheckpointManager(str(tmp_path))
        for step in (5, 6):
            mgr2.save(step, state, block=True)
        apply_retention(mgr.fs, mgr.root, keep=1, protected={3})
        assert [c.step for c in mgr.list()] == [3, 6]


def corrupt_stripe(mgr: CheckpointManager, step: int, rank: int = 0, index: int = 0) -> str:
    path = f"{step_dir(mgr.root, step)}/{data_name(rank)}"
    manifest = StripeManifest.from_bytes(mgr.fs.target.cat_file(path), path=path)
    victim = stripe_path(path, manifest.version, index)
    raw = bytearray(mgr.fs.target.cat_file(victim))
    raw[len(raw) // 2] ^= 0x01
    mgr.fs.target.pipe_file(victim, bytes(raw))
    return path


def test_flipped_byte_fails_verify_and_load_falls_back(tmp_path, caplog):
    old, new = make_state(1), make_state(2)
    with CheckpointManager(str(tmp_path), storage_options={"striped": SMALL}) as mgr:
        mgr.save(1, old, block=True)
        mgr.save(2, new, block=True)
        path = corrupt_stripe(mgr, 2)
        report = mgr.verify(2)
        assert not report.ok and any(path in p for p in report.problems)
        assert mgr.verify(1).ok
        target = blank_like(old)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert mgr.load(target) == 1
        assert "step 2" in caplog.text and "corrupt" in caplog.text
        assert_same(old, target)


def test_damaged_index_makes_load_fall_back(tmp_path):
    old, new = make_state(1), make_state(2)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, old, block=True)
        mgr.save(2, new, block=True)
        mgr.fs.pipe_file(f"{step_dir(mgr.root, 2)}/rank-00000.index.json", b'{"format": 1}')
        target = blank_like(old)
        assert mgr.load(target) == 1
        assert_same(old, target)
        assert not mgr.verify(2).ok


def test_mismatches_are_listed_in_one_error_and_non_strict_loads_the_rest(tmp_path):
    state = {
        "a": torch.randn(4, 4),
        "b": torch.randn(3),
        "c": torch.ones(2, dtype=torch.int32),
        "gone": torch.randn(2),
        "n": 5,
    }
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state, block=True)
        target = {
            "a": torch.zeros(4, 4),
            "b": torch.zeros(4),
            "c": torch.zeros(2),
            "new": torch.zeros(1),
            "n": 0,
        }
        with pytest.raises(StateMismatchError) as err:
            mgr.load(target)
        text = str(err.value)
        for needle in (
            "shape of b",
            "dtype of c",
            "missing from checkpoint: new",
            "unexpected in checkpoint (not in state): gone",
        ):
            assert needle in text
        assert torch.count_nonzero(target["a"]) == 0  # a strict failure loads nothing
        report = mgr.load_with_report(target, strict=False)
        assert torch.equal(target["a"], state["a"]) and target["n"] == 5
        assert set(report.mismatched) == {"b", "c"} and "new" in report.missing


def test_flat_shards_and_plain_tensors_interconvert(tmp_path):
    full = torch.randn(6, 10)
    flat = full.reshape(-1)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"p": full}, block=True)
        piece = FlatShard(torch.zeros(17), offset=20, numel=60, shape=(6, 10))
        mgr.load({"p": piece})
        assert torch.equal(piece.local, flat[20:37])
    other = tmp_path / "flat"
    with CheckpointManager(str(other)) as mgr:
        mgr.save(1, {"p": FlatShard(flat.clone(), 0, 60, (6, 10))}, block=True)
        back = {"p": torch.zeros(6, 10)}
        mgr.load(back)
        assert torch.equal(back["p"], full)


def test_optimizer_state_can_be_loaded_into_a_fresh_optimizer(tmp_path):
    state = make_state(4)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(4, {"optim": state["optim"]}, block=True)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = [p.clone() for p in model.parameters()]
        init_optimizer_state(opt)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        fresh = {"optim": opt.state_dict()}
        mgr.load(fresh)
        opt.load_state_dict(fresh["optim"])
        assert_same(state["optim"]["state"], opt.state_dict()["state"])


def test_load_full_returns_plain_tensors(tmp_path):
    state = make_state(5)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(5, state, block=True)
        full = mgr.load_full()
    assert torch.equal(full["model"]["0.weight"], state["model"]["0.weight"])
    assert full["step"] == 5 and full["loader"]["position"] == 35


def test_chunk_index_matches_brute_force():
    rng = random.Random(0)
    shape = (37, 23)
    rows, cols = [0, 5, 11, 20, 37], [0, 9, 23]
    chunks = [
        StoredChunk("k", 0, Box((r0, c0), (r1 - r0, c1 - c0)), 0, 0, "float32")
        for r0, r1 in zip(rows, rows[1:], strict=False)
        for c0, c1 in zip(cols, cols[1:], strict=False)
    ]
    index = ChunkIndex(chunks, shape)
    assert index.is_grid
    for _ in range(300):
        r0, c0 = rng.randrange(37), rng.randrange(23)
        box = Box((r0, c0), (rng.randint(1, 37 - r0), rng.randint(1, 23 - c0)))
        brute = {c.box for c in chunks if c.box.intersect(box) is not None}
        assert {c.box for c in index.overlapping(box)} == brute
        assert index.covered(box) == box.numel
    skewed = [
        StoredChunk("k", 0, Box((0,), (10,)), 0, 0, "f"),
        StoredChunk("k", 1, Box((5,), (10,)), 0, 0, "f"),
    ]
    odd = ChunkIndex(skewed, (15,))
    assert not odd.is_grid
    assert len(odd.overlapping(Box((6,), (1,)))) == 2


def test_chunk_lookup_is_not_quadratic():
    """10,000 flat chunks: each query touches O(1) candidates, not all of them."""
    n = 10_000
    chunks = [StoredChunk("k", i, Box((i * 8,), (8,)), 0, 0, "f") for i in range(n)]
    index = ChunkIndex(chunks, (n * 8,))
    calls = 0
    original = Box.intersect

    def counting(self, other):
        nonlocal calls
        calls += 1
        return original(self, other)

    Box.intersect = counting
    try:
        for i in range(0, n, 7):
            assert len(index.overlapping(Box((i * 8 + 3,), (8,)))) == 2
    finally:
        Box.intersect = original
    assert calls <= 2 * 3 * (n // 7 + 1)


@pytest.fixture
def small_tmpfs(tmp_path, system):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        system(f"cannot mount a small tmpfs for the full-disk test: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_a_clear_error_and_the_previous_checkpoint_survives(small_tmpfs):
    small = {"w": torch.randn(100_000)}  # 0.4 MB
    with CheckpointManager(str(small_tmpfs), storage_options={"striped": SMALL}) as mgr:
        mgr.save(1, small, block=True)
        big = {"w": torch.randn(3_000_000)}  # 12 MB: does not fit
        mgr.save(2, big)
        with pytest.raises(CheckpointSaveError) as err:
            mgr.wait()
        assert "step 2" in str(err.value) and "No space left" in str(err.value)
        assert mgr.latest() == 1
        target = {"w": torch.zeros(100_000)}
        mgr.load(target)
        assert torch.equal(target["w"], small["w"])
        assert mgr.verify(1).ok


def test_storage_going_away_mid_save_reaches_the_caller(s3_server, s3_bucket):
    bucket, options = s3_bucket
    storage = {
        "s3": options,
        "striped": {"stripe_size": "256KiB", "retries": 2, "backoff_s": 0.05, "concurrency": 2},
    }
    state = {"w": torch.randn(2_000_000)}  # 8 MB in 32 stripes
    with CheckpointManager(f"s3://{bucket}/run", storage_options=storage) as mgr:
        mgr.save(1, state, block=True)
        state["w"].add_(1)
        handle = mgr.save(2, state)
        stopper = threading.Thread(target=s3_server.stop)
        stopper.start()
        stopper.join()
        with pytest.raises(CheckpointSaveError, match="step 2"):
            handle.wait()
        s3_server.start()
        state["w"].add_(1)
        mgr.save(3, state, block=True)
        assert mgr.latest() == 3
        target = {"w": torch.zeros(2_000_000)}
        assert mgr.load(target) == 3
        assert torch.equal(target["w"], state["w"])


def test_bad_arguments_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        CheckpointManager(str(tmp_path), rank=2, world_size=2)
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(str(tmp_path), keep=0)
    with (
        CheckpointManager(str(tmp_path)) as mgr,
        pytest.raises(FileNotFoundError, match="no committed"),
    ):
        mgr.load({"w": torch.zeros(1)})
    with CheckpointManager(str(tmp_path)) as mgr, pytest.raises(TypeError, match="dict or list"):
        mgr.save(1, torch.zeros(1))


def test_environment_has_no_leftover_workers(tmp_path):
    """close() joins the persist thread: no background thread outlives the manager."""
    before = {t.name for t in threading.enumerate()}
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"w": torch.randn(10)})
    after = {t.name for t in threading.enumerate() if t.name.startswith("ckpt-persist")}
    assert not after - before
    assert os.path.isdir(tmp_path / "step-1")


# -- save(block=True), latest() after re-saving, load_full ------------------------------------


def test_a_blocking_save_returns_its_finished_handle(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "n": 3}
    with CheckpointManager(str(tmp_path)) as mgr:
        handle = mgr.save(7, state, block=True)
        assert isinstance(handle, SaveHandle) and handle.step == 7 and handle.done()
        result = handle.wait()
        assert (result.step, result.rank, result.committed) == (7, 0, True)
        assert result.bytes_written >= 4000 and result.persist_s > 0
        assert mgr.latest() == 7


def _manager(url: str, rank: int, world: int = 2, **kwargs) -> CheckpointManager:
    return CheckpointManager(
        url, rank=rank, world_size=world, stripe_size=W.STRIPE, cache_dir=False, **kwargs
    )


def _load(url: str, rank: int, world: int = 2, step: int | None = None) -> tuple[int, dict]:
    state = W.agree_blank(rank, world)
    with _manager(url, rank, world) as mgr:
        return mgr.load(state, step), state


def test_resaving_a_committed_step_withdraws_its_commit_until_the_new_one_commits(tmp_path):
    """A restart resumed from step 1 saves step 2 again. Rank 1 is through, rank 0 not yet
    (or killed): step 2's files are no longer the ones its old manifest lists, so latest()
    must not name it. Once rank 0 commits, step 2 is the new save's."""
    url = str(tmp_path / "run")
    W.save_agree_steps(url, 2, [1, 2])
    with _manager(url, 1, attempt="restart") as rank1:
        rank1.save(2, W.agree_state(22, 1, 2), block=True)
    with _manager(url, 0) as reader:
        assert reader.latest() == 1
    assert _load(url, 0)[0] == 1
    with _manager(url, 0, attempt="restart") as rank0:
        assert rank0.save(2, W.agree_state(22, 0, 2), block=True).wait().committed
        assert rank0.latest() == 2
    for rank in (0, 1):
        step, state = _load(url, rank)
        assert step == 2 and W.agree_problems(state, 22, rank, 2, 2) == []


def _index_or_none(fs, path: str) -> bytes | None:
    """The index's bytes, or None while there is none: rank 0's save removes its earlier index
    (``persist.withdraw``) while this polls, so the file can go between any two calls (an
    ``exists`` then a ``cat_file`` raised FileNotFoundError under load, and rank 0's close
    then waited out its commit: the CommitTimeout a CI run reported)."""
    fs.invalidate_cache()
    try:
        return fs.cat_file(path)
    except FileNotFoundError:  # gone, or its stripes removed while it was read
        return None


def test_resaving_a_step_in_the_same_attempt_never_commits_the_earlier_shards(tmp_path):
    """Same attempt id (a job re-saving a step without a restart): rank 0 gets there first
    and must wait for rank 1's new index, not commit rank 1's earlier one, which is still
    in the directory."""
    url = str(tmp_path / "run")
    W.save_agree_steps(url, 2, [1, 2])
    fs, root = url_to_fs(url)
    index0 = f"{step_dir(root, 2)}/{index_name(0)}"
    before = fs.cat_file(index0)
    # a failure below leaves rank 0's commit waiting for rank 1: bounded, not the default
    # 30 minutes; the failure itself is the exception the CommitTimeout is raised beside
    with _manager(url, 0, commit_timeout_s=60) as rank0:
        handle = rank0.save(2, W.agree_state(22, 0, 2))
        while _index_or_none(fs, index0) in (None, before):  # rank 0's new shard is written
            assert not handle.done(), handle.wait()  # (rank 1 has not started)
            time.sleep(0.01)
        assert rank0.latest() == 1  # step 2 is not committed meanwhile
        with _manager(url, 1) as rank1:
            rank1.save(2, W.agree_state(22, 1, 2), block=True)
        assert handle.wait().committed
    for rank in (0, 1):
        step, state = _load(url, rank)
        assert step == 2 and W.agree_problems(state, 22, rank, 2, 2) == []


def test_latest_passes_over_a_commit_whose_files_no_longer_match(tmp_path, caplog):
    url = str(tmp_path / "run")
    W.save_agree_steps(url, 2, [1, 2])
    with _manager(url, 0) as mgr:
        mgr.fs.rm_file(f"{step_dir(mgr.root, 2)}/{index_name(1)}")
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert mgr.latest() == 1
        assert f"step 2 under {url} is committed but its commit is not valid" in caplog.text
        assert index_name(1) in caplog.text
        assert [c.step for c in mgr.list()] == [1]  # as list() always did
        report = mgr.verify()  # verify examines the newest commit, valid or not
        assert report.step == 2 and not report.ok and index_name(1) in report.problems[0]
    assert _load(url, 0)[0] == 1


def test_newer_steps_stay_when_an_older_step_is_saved_again(tmp_path):
    """Resuming from step 1 on purpose and saving step 2 again replaces step 2 only; step 3
    (of the abandoned run) stays, and latest() names it (docs/ckpt.md)."""
    url = str(tmp_path / "run")
    W.save_agree_steps(url, 1, [1, 2, 3])
    state = W.agree_blank(0, 1)
    with _manager(url, 0, 1) as mgr:
        assert mgr.load(state, step=1) == 1
        mgr.save(2, W.agree_state(22, 0, 1), block=True)
        assert mgr.latest() == 3
    step, state = _load(url, 0, 1, step=2)
    assert W.agree_problems(state, 22, 0, 1, 1) == []
    step, state = _load(url, 0, 1)
    assert step == 3 and W.agree_problems(state, 3, 0, 1, 1) == []


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(s)
        model(torch.randn(4, 32, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def test_load_full_optimizer_state_goes_into_load_state_dict_and_training_continues(tmp_path):
    """AdamW's state_dict()["state"] is keyed by integers; load_full gives it back so, and a
    fresh model and optimizer continue exactly like the run that never stopped."""
    model, opt = _adamw()
    _train(model, opt, range(3))
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": opt.state_dict()}, block=True)
        full = mgr.load_full()
    _train(model, opt, range(3, 6))  # the uninterrupted run

    resumed, resumed_opt = _adamw()
    resumed.load_state_dict(full["model"])
    resumed_opt.load_state_dict(full["optim"])
    assert sorted(full["optim"]["state"]) == [0, 1, 2, 3]
    assert full["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    _train(resumed, resumed_opt, range(3, 6))
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    assert_same(opt.state_dict()["state"], resumed_opt.state_dict()["state"])


def test_load_full_rebuilds_lists_and_dict_keys_as_saved(tmp_path):
    t = torch.arange(3.0)
    state = {
        "by_int": {0: t, 1: t + 1},
        "by_digits": {"0": t + 2, "1": t + 3},
        "gaps": {0: t, 5: t},
        "seq": [t, {"x": t}],
        "empty": [],
        "top": {"a/b": 1, "%": 2},
    }
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state, block=True)
        full = mgr.load_full()
    assert_same(state, full)
    assert type(full["seq"]) is list and list(full["by_digits"]) == ["0", "1"]
    assert list(full["by_int"]) == [0, 1] and list(full["gaps"]) == [0, 5]
