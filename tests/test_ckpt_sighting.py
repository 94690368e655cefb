"""A node's ranks of one torchrun launch look at the store once (ckpt/sighting.py): the newest
committed step and its commit record, read by the first rank, taken by the others and by a
rank's own ``load()`` after its ``latest()``; over moto's real HTTP, counting bytes, and with
sightings the test damages itself (issue 29: survivors read nothing twice)."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import s3_through_a_counter
from test_ckpt_cache import WIDE, save_wide, wide_state

from ckpt import CheckpointManager
from ckpt.cache import CACHE_ENV, store_key
from ckpt.sighting import NodeSighting, launch_token


@pytest.fixture(autouse=True)
def a_torchrun_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables torchrun gives its workers (this process's parent plays its agent)."""
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")


def restart(
    url: str, ranks: tuple[int, ...], cache: Path, options: dict[str, Any] | None = None
) -> list[int]:
    """The node's ranks restarted together: each ``latest()`` then ``load()``, as a training
    script does; their states checked against what was saved."""
    start = threading.Barrier(len(ranks))

    def one(rank: int) -> int:
        with CheckpointManager(
            url, rank=rank, world_size=WIDE, storage_options=options, cache_dir=cache
        ) as mgr:
            start.wait()
            newest = mgr.latest()
            assert newest is not None
            target = wide_state(0, rank)
            assert mgr.load(target) == newest
            want = wide_state(newest, rank)
            assert all(torch.equal(target[k].local, want[k].local) for k in want if k != "step")
            return newest

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(one, ranks))


def test_the_node_reads_the_commit_once_for_its_ranks_of_one_launch(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, options = s3_bucket
    url = f"s3://{bucket}/sight"
    here, there = tmp_path / "here", tmp_path / "there"
    save_wide(url, 5, {0: here, 1: here, 2: there, 3: there}, {"s3": options})
    with s3_through_a_counter(options) as (node, proxy):
        with CheckpointManager(
            url, rank=0, world_size=WIDE, storage_options={"s3": node}, cache_dir=False
        ) as plain:
            assert plain._look_at_store()[0] == 5
        look = proxy.bytes_down  # one listing, one existence check, one commit record
    read = {}
    for case in ("no launch", "torchrun", "torchrun again"):
        if case == "no launch":
            monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
        else:
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1" if case == "torchrun" else "2")
        with s3_through_a_counter(options) as (node, proxy):
            assert restart(url, (0, 1), here, {"s3": node}) == [5, 5]
            read[case] = proxy.bytes_down
    # The rest is the same in every case (the other node's indexes from the node cache after
    # the first, and what a load without a process group checks of the others' data).
    # Without a launch each rank looks twice (latest, then load): four looks; with one, the
    # node looks once: three fewer.
    assert read["no launch"] - read["torchrun"] > 2.5 * look, (read, look)
    # the next restart (torchrun's count moved on) is a new launch: it looks once again
    assert abs(read["torchrun again"] - read["torchrun"]) < 0.5 * look, (read, look)
    assert len(list((here / store_key(url)).glob("SIGHT-*.json"))) == 4  # 2 launches, 2 files


def test_a_manager_asks_the_store_again_once_its_load_returned(tmp_path: Path) -> None:
    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    with CheckpointManager(store, rank=0, world_size=WIDE, cache_dir=here) as mgr:
        assert mgr.latest() == 5
        save_wide(store, 6, {0: tmp_path / "a", 1: tmp_path / "a", 2: there, 3: there})
        assert mgr.latest() == 5  # the node's look of this launch, seconds old
        target = wide_state(0, 0)
        assert mgr.load(target) == 5
        assert mgr.latest() == 6  # after its first load: the store, every time
    # and the node's other rank of the same launch, starting late, still agrees on 5 with it
    with CheckpointManager(store, rank=1, world_size=WIDE, cache_dir=here) as mgr:
        assert mgr.latest() == 5


def sighting_of(cache: Path, store: str) -> NodeSighting:
    token = launch_token()
    assert token is not None
    return NodeSighting(cache / store_key(store), token)


@pytest.mark.parametrize(
    "damage",
    [
        "garbage",
        "commit record altered",
        "commit record gone",
        "step not a number",
        "a bool",
        "too old",
    ],
)
def test_a_sighting_that_is_not_sound_is_ignored(tmp_path: Path, damage: str) -> None:
    """Bytes this test writes over the node's sighting: the rank looks at the store itself
    and loads the newest step (the sighting said 5, the store holds 6)."""
    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    assert restart(store, (0,), here) == [5]
    save_wide(store, 6, {0: here, 1: here, 2: there, 3: there})
    sight = sighting_of(here, store)
    doc = json.loads(sight.doc_path.read_text())
    assert doc["newest"] == 5
    if damage == "garbage":
        sight.doc_path.write_bytes(b"\x00{not json")
    elif damage == "commit record altered":
        sight.manifest_path.write_bytes(sight.manifest_path.read_bytes().replace(b"5", b"6", 1))
    elif damage == "commit record gone":
        sight.manifest_path.unlink()
    elif damage == "step not a number":
        sight.doc_path.write_text(json.dumps({**doc, "newest": "../../6"}))
    elif damage == "a bool":
        sight.doc_path.write_text(json.dumps({**doc, "newest": True}))
    else:
        sight.doc_path.write_text(json.dumps({**doc, "time": time.time() - 3600}))
    assert restart(store, (1,), here) == [6]


def test_outside_torchrun_there_is_no_sighting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert launch_token() is None
    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    assert restart(store, (0, 1), here) == [5, 5]
    assert not list((here / store_key(store)).glob("SIGHT-*"))


def test_a_sighting_is_its_owners_alone(tmp_path: Path) -> None:
    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    old = os.umask(0)
    try:
        assert restart(store, (0,), here) == [5]
    finally:
        os.umask(old)
    sight = sighting_of(here, store)
    for path in (sight.doc_path, sight.manifest_path):
        assert path.stat().st_mode & 0o777 == 0o600, path


def test_a_looker_stuck_on_the_store_holds_up_the_node_only_so_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's sighting lock held by a rank stuck on the store (here: by this test): the
    next rank waits at most the bound, then looks at the store itself."""
    import ckpt.sighting
    from ckpt.cache import lock_within

    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    monkeypatch.setattr(ckpt.sighting, "_LOCK_WAIT_S", 0.3)
    held = lock_within(here / store_key(store) / ".sight.lock", 1.0)
    assert held is not None
    try:
        started = time.monotonic()
        assert restart(store, (0,), here) == [5]
        assert 0.3 <= time.monotonic() - started < 20
    finally:
        os.close(held)


def test_sightings_of_earlier_launches_are_removed_at_the_next_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, here, there = str(tmp_path / "store"), tmp_path / "here", tmp_path / "there"
    save_wide(store, 5, {0: here, 1: here, 2: there, 3: there})
    assert restart(store, (0,), here) == [5]
    old = sighting_of(here, store)
    hour_ago = time.time() - 3600
    for path in (old.doc_path, old.manifest_path):
        os.utime(path, (hour_ago, hour_ago))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # the next launch looks again
    assert restart(store, (0,), here) == [5]
    new = sighting_of(here, store)
    assert new.doc_path.exists() and new.manifest_path.exists()
    assert not old.doc_path.exists() and not old.manifest_path.exists()
