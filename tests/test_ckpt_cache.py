"""The node-local checkpoint cache: prefetch of the latest committed step for some ranks, and
``load`` reading it transparently (verified), on the local filesystem and on moto S3.

Two ranks are two managers in this process (ckpt uses no collectives: rank 1 saves first,
rank 0 then commits), as in test_ckpt_basic's retention test.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import s3_through_a_counter
from unprivileged import mode, umask

from bootseer.testing.servers import free_port
from ckpt import (
    CheckpointCorrupt,
    CheckpointManager,
    CheckpointNotFound,
    CheckpointStoreUnavailable,
    FlatShard,
    PerRank,
    prefetch_latest,
)
from ckpt.cache import CACHE_ENV, NodeCache, store_key
from ckpt.layout import MANIFEST, data_name, index_name, objects_name, step_dir
from ckpt.loader import CheckpointView, Reads, load_into
from ckpt.staging import SMALL_REPLICA_BYTES
from striped_fs.layout import Manifest as StripeManifest
from striped_fs.layout import stripe_path

SMALL = {"striped": {"stripe_size": "64KiB"}}
N = 50_000  # elements of the flat parameter: two shards of 100 KB, two stripes each


@pytest.fixture(autouse=True)
def no_cache_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)


def rank_state(seed: int, rank: int, *, replicated: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s half of a sharded state (plus, optionally, a replicated tensor)."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(N, generator=g)
    bias = torch.randn(17, generator=g)
    half = N // 2
    state: dict[str, Any] = {
        "w": FlatShard(flat[rank * half : (rank + 1) * half].clone(), rank * half, N),
        "m": FlatShard((flat * 2)[rank * half : (rank + 1) * half].clone(), rank * half, N),
        "rng": PerRank(torch.full((3,), seed * 10 + rank)),
        "step": seed,
    }
    if replicated:
        state["bias"] = bias
    return state


def blank(rank: int, *, replicated: bool = False) -> dict[str, Any]:
    half = N // 2
    state: dict[str, Any] = {
        "w": FlatShard(torch.zeros(half), rank * half, N),
        "m": FlatShard(torch.zeros(half), rank * half, N),
        "rng": PerRank(None),
        "step": None,
    }
    if replicated:
        state["bias"] = torch.zeros(17)
    return state


def assert_loaded(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["w"].local, want["w"].local)
    assert torch.equal(got["m"].local, want["m"].local)
    assert torch.equal(got["rng"].value, want["rng"].value)
    assert got["step"] == want["step"]
    if "bias" in want:
        assert torch.equal(got["bias"], want["bias"])


def save_both(
    url: str,
    step: int,
    seed: int,
    options: dict | None = None,
    *,
    replicated: bool = False,
    commit: bool = True,
) -> None:
    """Ranks 1 then 0 save ``step``; without ``commit`` only rank 1 does (a torn step)."""
    order = (1, 0) if commit else (1,)
    for rank in order:
        with CheckpointManager(
            url, rank=rank, world_size=2, storage_options=options, cache_dir=False
        ) as mgr:
            mgr.save(step, rank_state(seed, rank, replicated=replicated), block=True)


def cached_files(cache: Path) -> set[str]:
    """Every visible file under the cache, relative (``<key>/step-N/name``)."""
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def step_files(url: str, step: int, names: list[str]) -> set[str]:
    key = store_key(url)
    return {f"{key}/SOURCE"} | {f"{key}/step-{step}/{n}" for n in names}


def metadata() -> list[str]:
    return [MANIFEST, index_name(0), index_name(1)]


# -- local filesystem -------------------------------------------------------------------------


def test_prefetch_copies_exactly_the_files_of_the_requested_ranks(tmp_path: Path) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 5, seed=5, options=SMALL)
    result = prefetch_latest(store, cache, [1])
    want = metadata() + [data_name(1), objects_name(1)]
    assert cached_files(cache) == step_files(store, 5, want)
    sizes = sum((cache / store_key(store) / "step-5" / n).stat().st_size for n in want)
    assert (result.step, result.files, result.bytes, result.cached_already) == (5, 5, sizes, 0)
    assert result.path == str(cache / store_key(store) / "step-5")

    again = prefetch_latest(store, cache, [1])  # idempotent: verified, nothing copied
    assert (again.step, again.files, again.bytes, again.cached_already) == (5, 0, 0, 5)
    both = prefetch_latest(store, cache, [0, 1])  # the other rank's shards are added
    assert (both.files, both.cached_already) == (2, 5)
    assert cached_files(cache) == step_files(store, 5, want + [data_name(0), objects_name(0)])
    assert not [p for p in cache.rglob(".*")]  # no temporary left behind


def test_prefetch_runs_where_torch_is_not_installed(tmp_path: Path) -> None:
    """`bootseer run` prefetches while the environment holding torch is still being restored:
    neither the prefetch nor the startup module may import torch."""
    import json
    import sys

    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 3, seed=3, options=SMALL)
    code = (
        "import sys, json\n"
        "sys.modules['torch'] = None  # import torch now raises ImportError\n"
        "import bootseer.startup\n"
        "from ckpt import prefetch_latest\n"
        f"r = prefetch_latest({store!r}, {str(cache)!r}, [0, 1])\n"
        "print(json.dumps([r.step, r.files]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [3, 7]
    want = metadata() + [data_name(r) for r in (0, 1)] + [objects_name(r) for r in (0, 1)]
    assert cached_files(cache) == step_files(store, 3, want)


def test_a_large_replicated_tensor_brings_the_file_of_the_rank_that_wrote_it(
    tmp_path: Path,
) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    table = torch.randn(SMALL_REPLICA_BYTES // 4 + 1, generator=torch.Generator().manual_seed(3))
    for rank in (1, 0):  # "table" (past SMALL_REPLICA_BYTES) is written once, by rank 0
        with CheckpointManager(store, rank=rank, world_size=2, cache_dir=False) as mgr:
            mgr.save(1, {**rank_state(1, rank), "table": table.clone()}, block=True)
    prefetch_latest(store, cache, [1])
    assert cached_files(cache) == step_files(
        store, 1, metadata() + [data_name(0), data_name(1), objects_name(1)]
    )


def test_a_small_replicated_tensor_is_in_every_rank_s_file_and_loaded_from_its_own(
    tmp_path: Path,
) -> None:
    """A survivor's load must not read another rank's file for a few replicated scalars
    (issue 29: 4-6 MB per rank, a whole stripe of another rank's file each time): every rank
    writes its own copy of a small replicated tensor, and a load takes its own rank's."""
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 1, seed=1, replicated=True)  # "bias": 17 floats
    prefetch_latest(store, cache, [1])
    assert cached_files(cache) == step_files(store, 1, metadata() + [data_name(1), objects_name(1)])
    with CheckpointManager(store, rank=1, world_size=2, cache_dir=False) as plain:
        view = CheckpointView(plain.fs, plain.root, 1)
        target, reads = blank(1, replicated=True), Reads()
        load_into(view, target, rank=1, strict=True, concurrency=4, reads=reads)
    assert_loaded(target, rank_state(1, 1, replicated=True))
    assert set(reads.pieces) == {1}  # nothing of rank 0's data file


def test_load_reads_the_cache_and_nothing_of_the_store_for_cached_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 5, seed=5, options=SMALL)
    prefetch_latest(store, cache, [1])
    with CheckpointManager(store, rank=1, world_size=2, cache_dir=False) as plain:
        for name in (data_name(1), objects_name(1), index_name(0), index_name(1)):
            plain.fs.rm_file(f"{step_dir(plain.root, 5)}/{name}")  # only the manifest is left
        with pytest.raises(CheckpointCorrupt):
            plain.load(blank(1))  # without the cache, the step cannot be loaded any more
    monkeypatch.setenv(CACHE_ENV, str(cache))  # cache_dir=None: $BOOTSEER_CKPT_CACHE
    with CheckpointManager(store, rank=1, world_size=2) as mgr:
        target = blank(1)
        report = mgr.load_with_report(target)
    assert report.step == 5
    assert_loaded(target, rank_state(5, 1))
    assert report.cached_files == 4  # both indexes, rank 1's data and objects
    assert report.cached_bytes >= N // 2 * 4 * 2


def test_a_survivor_loads_what_its_save_wrote_through_without_a_prefetch(tmp_path: Path) -> None:
    """A restart that torchrun runs has no prefetch between the save and the load: the
    shards this node's save wrote into the cache must serve the load (issue 29, survivors
    read nothing twice), verified against the store's commit record, which the cache
    adopts; a file of another attempt of the step is refused and read from the store."""
    store, cache = str(tmp_path / "store"), tmp_path / "cache"

    def save(rank: int) -> None:  # a rank writes its cache copy after the commit: both at once
        with CheckpointManager(
            store, rank=rank, world_size=2, storage_options=SMALL, cache_dir=cache
        ) as mgr:
            mgr.save(5, rank_state(5, rank), block=True)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(save, (1, 0)))
    step = cache / store_key(store) / "step-5"
    assert not (step / MANIFEST).exists()  # written through, never prefetched
    with CheckpointManager(store, rank=1, world_size=2, cache_dir=False) as plain:
        plain.fs.rm_file(f"{step_dir(plain.root, 5)}/{data_name(1)}")  # only the node has it
    with CheckpointManager(store, rank=1, world_size=2, cache_dir=cache) as mgr:
        target = blank(1)
        report = mgr.load_with_report(target)
    assert report.step == 5
    assert_loaded(target, rank_state(5, 1))
    assert report.cached_bytes >= N // 2 * 4 * 2  # both shards of rank 1 from the node
    assert (step / MANIFEST).exists()  # the store's commit record, adopted

    # rank 0's cached index from another attempt of step 5: refused, the store's used
    other = tmp_path / "other"
    save_both(str(other), 5, seed=6, options=SMALL)
    (step / MANIFEST).unlink()
    with CheckpointManager(str(other), rank=0, world_size=2, cache_dir=False) as plain:
        foreign = plain.fs.cat_file(f"{step_dir(plain.root, 5)}/{index_name(0)}")
    (step / index_name(0)).write_bytes(foreign)
    with CheckpointManager(store, rank=0, world_size=2, cache_dir=cache) as mgr:
        target = blank(0)
        mgr.load(target)
    assert_loaded(target, rank_state(5, 0))
    assert not (step / index_name(0)).exists() or (step / index_name(0)).read_bytes() != foreign


def test_a_damaged_cached_file_is_removed_and_the_store_used(tmp_path: Path, caplog) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 5, seed=5, options=SMALL)
    prefetch_latest(store, cache, [0, 1])
    step = cache / store_key(store) / "step-5"
    for name in (data_name(1), index_name(0)):
        raw = bytearray((step / name).read_bytes())
        raw[len(raw) // 2] ^= 0x01
        (step / name).write_bytes(bytes(raw))
    with CheckpointManager(store, rank=1, world_size=2, cache_dir=cache) as mgr:
        target = blank(1)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            report = mgr.load_with_report(target)
    assert report.step == 5  # the same step, not a fallback: the store's copy is intact
    assert_loaded(target, rank_state(5, 1))
    assert report.cached_files == 2  # index 1 and objects 1; the damaged two came from the store
    assert re.search(
        rf"{re.escape(str(step / data_name(1)))} tensor [wm] fails its checksum; "
        "removed",
        caplog.text,
    )
    assert f"{step / index_name(0)} does not match the manifest's checksum; removed" in caplog.text
    assert not (step / data_name(1)).exists()
    # the index, read from the store and matching the commit record, is kept for the node's
    # other ranks in place of the damaged copy
    with CheckpointManager(store, rank=0, world_size=2, cache_dir=False) as plain:
        good = plain.fs.cat_file(f"{step_dir(plain.root, 5)}/{index_name(0)}")
    assert (step / index_name(0)).read_bytes() == good

    again = prefetch_latest(store, cache, [0, 1])  # the next prefetch puts the data back
    assert (again.files, again.cached_already) == (1, 6)


def test_a_truncated_cached_file_is_never_loaded(tmp_path: Path) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 5, seed=5)
    prefetch_latest(store, cache, [0])
    data = cache / store_key(store) / "step-5" / data_name(0)
    data.write_bytes(data.read_bytes()[:-1])
    with CheckpointManager(store, rank=0, world_size=2, cache_dir=cache) as mgr:
        target = blank(0)
        report = mgr.load_with_report(target)
    assert_loaded(target, rank_state(5, 0))
    assert report.cached_files == 3 and not data.exists()


def test_a_torn_newer_step_is_never_prefetched(tmp_path: Path) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 1, seed=1)
    save_both(store, 2, seed=2, commit=False)  # rank 1's shard only: no manifest
    assert (tmp_path / "store" / "step-2" / index_name(1)).exists()
    result = prefetch_latest(store, cache, [0, 1])
    assert result.step == 1
    assert {p.name for p in (cache / store_key(store)).iterdir()} == {"SOURCE", "step-1"}


def test_a_damaged_latest_step_falls_back_like_load(tmp_path: Path, caplog) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 1, seed=1, options=SMALL)
    save_both(store, 2, seed=2, options=SMALL)
    with CheckpointManager(store, cache_dir=False, world_size=2) as mgr:
        path = f"{step_dir(mgr.root, 2)}/{data_name(0)}"
        manifest = StripeManifest.from_bytes(mgr.fs.target.cat_file(path), path=path)
        victim = stripe_path(path, manifest.version, 0)
        raw = bytearray(mgr.fs.target.cat_file(victim))
        raw[10] ^= 0x01
        mgr.fs.target.pipe_file(victim, bytes(raw))
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        result = prefetch_latest(store, cache, [0])
    assert result.step == 1 and "step 2" in caplog.text
    assert not list((cache / store_key(store)).glob("step-2"))


def test_a_rewritten_store_never_serves_the_old_cache(tmp_path: Path, caplog) -> None:
    """Same URL, same step number, another checkpoint: the cached copy's manifest differs."""
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 3, seed=1)
    prefetch_latest(store, cache, [0])
    for p in sorted((tmp_path / "store").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    time.sleep(0.01)  # the manifest records its creation time
    save_both(store, 3, seed=2)
    with CheckpointManager(store, rank=0, world_size=2, cache_dir=cache) as mgr:
        target = blank(0)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            report = mgr.load_with_report(target)
    assert_loaded(target, rank_state(2, 0))
    assert report.cached_files == 0 and "the store was rewritten" in caplog.text


def test_an_empty_or_absent_store_has_no_step(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for store in (tmp_path / "empty", tmp_path / "absent"):
        result = prefetch_latest(str(store), tmp_path / "cache", [0])
        assert (result.step, result.files, result.cached_already) == (None, 0, 0)
    with (
        CheckpointManager(str(tmp_path / "empty"), cache_dir=tmp_path / "cache") as mgr,
        pytest.raises(CheckpointNotFound),
    ):
        mgr.load({"w": torch.zeros(1)})


def test_leftovers_of_a_killed_prefetch_are_cleared(tmp_path: Path) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 4, seed=4)
    prefetch_latest(store, cache, [0])
    step = cache / store_key(store) / "step-4"
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = step / f".{data_name(1)}.tmp-{dead.pid}-{'0' * 32}"
    leftover.write_bytes(b"half a shard")
    # another live prefetch's file (of a shard this load does not read: a load waits for a
    # file whose live writer is still at it, tests/test_early_start.py)
    ours = step / f".{data_name(0)}.tmp-{os.getpid()}-{'1' * 32}"
    ours.write_bytes(b"a prefetch of this process in flight")
    with CheckpointManager(store, rank=1, world_size=2, cache_dir=cache) as mgr:
        target = blank(1)
        assert mgr.load_with_report(target).cached_files == 2  # indexes only: no rank 1 shard
    assert_loaded(target, rank_state(4, 1))
    prefetch_latest(store, cache, [1])
    assert not leftover.exists() and ours.exists()


def test_older_cached_steps_go_when_a_newer_one_is_cached(tmp_path: Path) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 1, seed=1)
    prefetch_latest(store, cache, [0])
    save_both(store, 2, seed=2)
    assert prefetch_latest(store, cache, [0]).step == 2
    assert NodeCache(cache, store).steps() == [2]


def test_the_cache_is_private_whatever_the_umask(tmp_path: Path) -> None:
    """Under umask 000 the cache's directories (a missing parent too) are 0700 and its files
    0600: shards and indexes are no other user's to read."""
    store, cache = str(tmp_path / "store"), tmp_path / "node" / "cache"
    save_both(store, 5, seed=5, options=SMALL)
    with umask(0):
        prefetch_latest(store, cache, [0, 1])
    paths = [tmp_path / "node", *cache.rglob("*")]
    assert {mode(p) for p in paths if p.is_dir()} == {0o700}
    assert len([p for p in paths if p.is_file()]) == 8  # SOURCE, manifest, 2 indexes, 4 shards
    assert {mode(p) for p in paths if p.is_file()} == {0o600}


def test_store_keys_are_per_url() -> None:
    assert store_key("s3://b/run") == store_key("striped::s3://b/run/")
    assert store_key("/data/ckpt") == store_key("file:///data/ckpt")
    assert store_key("s3://b/run") != store_key("s3://b/run2")


# -- S3 (moto) ---------------------------------------------------------------------------------


def test_s3_prefetch_then_load_without_the_shards_in_the_store(s3_bucket, tmp_path: Path) -> None:
    bucket, options = s3_bucket
    storage = {"s3": options, **SMALL}
    url, cache = f"s3://{bucket}/run", tmp_path / "cache"
    save_both(url, 7, seed=7, options=storage)
    save_both(url, 8, seed=8, options=storage, commit=False)  # torn
    result = prefetch_latest(url, cache, [0], storage_options=storage, connections=4)
    assert (result.step, result.files) == (7, 5)
    assert cached_files(cache) == step_files(url, 7, metadata() + [data_name(0), objects_name(0)])
    with CheckpointManager(
        url, rank=0, world_size=2, storage_options=storage, cache_dir=cache
    ) as mgr:
        mgr.fs.rm_file(f"{step_dir(mgr.root, 7)}/{data_name(0)}")  # stripes and manifest
        mgr.fs.rm_file(f"{step_dir(mgr.root, 7)}/{objects_name(0)}")
        target = blank(0)
        report = mgr.load_with_report(target)
    assert report.step == 7 and report.cached_files == 4
    assert_loaded(target, rank_state(7, 0))
    again = prefetch_latest(url, cache, [0], storage_options=storage)
    assert (again.files, again.cached_already) == (0, 5)


def test_an_unreachable_store_is_its_own_error_and_quick(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    storage = {
        "s3": {
            "endpoint_url": f"http://127.0.0.1:{port}",
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        },
        "striped": {"retries": 1, "backoff_s": 0.01},
    }
    url = "s3://bucket/run"
    started = time.monotonic()
    with pytest.raises(CheckpointStoreUnavailable) as err:
        prefetch_latest(url, tmp_path / "cache", [0], storage_options=storage)
    assert time.monotonic() - started < 20
    assert not isinstance(err.value, CheckpointNotFound)
    assert err.value.url == url
    assert url in str(err.value) and "Could not connect" in str(err.value)
    assert not (tmp_path / "cache").exists()


# -- a node's ranks share what they read from the store (issue 29) ---------------------------------

WIDE = 4  # ranks: 0 and 1 on this node, 2 and 3 on another


def wide_state(seed: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s quarter of a state with many small tensors (a large index, as a
    model's: about 30 KB per rank)."""
    g = torch.Generator().manual_seed(seed)
    size = 4_000
    quarter = size // WIDE
    state: dict[str, Any] = {"step": seed}
    for i in range(160):
        flat = torch.randn(size, generator=g)
        state[f"layer{i}"] = FlatShard(
            flat[rank * quarter : (rank + 1) * quarter].clone(), rank * quarter, size
        )
    return state


def save_wide(url: str, step: int, caches: dict[int, Path], options: dict | None = None) -> None:
    """Every rank saves ``step`` through its node's cache (rank 0 last: it commits)."""
    for rank in (3, 2, 1, 0):
        with CheckpointManager(
            url, rank=rank, world_size=WIDE, storage_options=options, cache_dir=caches[rank]
        ) as mgr:
            mgr.save(step, wide_state(step, rank), block=True)


def test_a_survivor_node_s_ranks_read_the_indexes_it_lacks_once(tmp_path: Path) -> None:
    """The first rank of the node to open the step fetches the other node's indexes and
    leaves them in the node cache: the next rank finds them there (the store's copies are
    gone here, so it could not have read them)."""
    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    step = here / store_key(store) / "step-5"
    assert {index_name(2), index_name(3)}.isdisjoint(os.listdir(step))
    with CheckpointManager(store, rank=0, world_size=WIDE, cache_dir=here) as mgr:
        assert mgr.latest() == 5
    assert {index_name(r) for r in range(WIDE)} <= set(os.listdir(step))
    with CheckpointManager(store, rank=1, world_size=WIDE, cache_dir=False) as plain:
        for rank in (2, 3):
            plain.fs.rm_file(f"{step_dir(plain.root, 5)}/{index_name(rank)}")
    with CheckpointManager(store, rank=1, world_size=WIDE, cache_dir=here) as mgr:
        assert mgr.latest() == 5  # every index checked, the other node's from this node


def test_ranks_restarted_together_fetch_each_missing_index_once(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Both ranks of the node open the step at the same moment: they take turns on the
    step's fetch lock, and the node's store bytes are one copy of the two indexes it lacks
    (and the commit records), not two."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/wide"
    here, there = tmp_path / "here", tmp_path / "there"
    save_wide(url, 5, {0: here, 1: here, 2: there, 3: there}, {"s3": options})
    with CheckpointManager(
        url, rank=0, world_size=WIDE, storage_options={"s3": options}, cache_dir=False
    ) as plain:
        indexes = sum(plain.fs.size(f"{step_dir(plain.root, 5)}/{index_name(r)}") for r in (2, 3))
    with s3_through_a_counter(options) as (node, proxy):
        start = threading.Barrier(2)

        def open_step(rank: int) -> int | None:
            with CheckpointManager(
                url, rank=rank, world_size=WIDE, storage_options={"s3": node}, cache_dir=here
            ) as mgr:
                start.wait()
                return mgr.latest()

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(open_step, (0, 1))) == [5, 5]
        read = proxy.bytes_down
    assert indexes > 40_000
    assert indexes <= read < 1.5 * indexes, (read, indexes)  # not 2 x: once for the node


def test_a_fetch_lock_that_cannot_be_had_costs_only_the_sharing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock held past the stall limit (a reader stuck on the store), or one that cannot be
    opened (a directory in its place): a warning, and the rank reads the store itself."""
    import fcntl

    from ckpt.cache import FETCH_LOCK, StepCache

    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    step = here / store_key(store) / "step-5"
    monkeypatch.setattr(StepCache, "STALL_S", 0.3)
    held = os.open(step / FETCH_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another reader of the node, stuck on the store
        t = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            with CheckpointManager(store, rank=0, world_size=WIDE, cache_dir=here) as mgr:
                assert mgr.latest() == 5
        assert 0.3 <= time.monotonic() - t < 10
        assert f"held {step / FETCH_LOCK} for 0 s; reading from the store without it" in caplog.text
    finally:
        os.close(held)
    for rank in (2, 3):
        (step / index_name(rank)).unlink()
    (step / FETCH_LOCK).unlink()
    (step / FETCH_LOCK).mkdir()  # cannot be opened as a file
    caplog.clear()
    target = wide_state(0, 1)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with CheckpointManager(store, rank=1, world_size=WIDE, cache_dir=here) as mgr:
            assert mgr.load(target) == 5
    assert f"cannot lock {step / FETCH_LOCK}" in caplog.text
    want = wide_state(5, 1)
    assert all(torch.equal(target[k].local, want[k].local) for k in want if k != "step")
    assert target["step"] == 5


def test_a_load_checks_the_newest_commit_not_every_step_the_store_keeps(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    """Every rank of every restart lists the steps and checks which are committed: newest
    first, and only until it has one, so ten more steps kept cost the listing's lines, not
    ten existence checks per rank (measured in bytes over moto)."""
    bucket, options = s3_bucket
    state = {"w": torch.randn(1000), "step": 0}
    for root, steps in (("few", 2), ("many", 12)):
        with CheckpointManager(
            f"s3://{bucket}/{root}", storage_options={"s3": options}, cache_dir=False
        ) as mgr:
            for step in range(1, steps + 1):
                mgr.save(step, state, block=True)
    read = {}
    for root, newest in (("few", 2), ("many", 12)):
        with s3_through_a_counter(options) as (node, proxy):
            with CheckpointManager(
                f"s3://{bucket}/{root}", storage_options={"s3": node}, cache_dir=False
            ) as mgr:
                assert mgr.latest() == newest
                target = {"w": torch.zeros(1000), "step": None}
                assert mgr.load(target) == newest and torch.equal(target["w"], state["w"])
            read[root] = proxy.bytes_down
    # 10 more steps: their listing lines (about 100 bytes each, listed twice), where
    # checking each step (a HEAD answer is about 400 bytes) twice would cost 8 KB more
    assert read["many"] - read["few"] < 4000, read
