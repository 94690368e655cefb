"""The command starts before the checkpoint prefetch ends: a load waits only for the files it
needs, never reads a partial one, falls back to the store when the prefetch dies mid-file,
and an in-place restart does not fetch again what its node saved.

Two ranks are two managers in this process (ckpt uses no collectives), as in
test_ckpt_cache.py; the prefetch runs in a thread, or in a process killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from run_helpers import child, run_wrapper, spans, wait_for

from bootseer.testing.shaper import Shaper, ShaperSettings
from ckpt import CheckpointManager, FlatShard, PerRank, prefetch_latest
from ckpt.cache import CACHE_ENV, store_key
from ckpt.layout import MANIFEST, data_name, step_dir

N = 250_000  # elements of the flat parameter: 1 MB of data file per rank (w and m halves)
SMALL = {"striped": {"stripe_size": "64KiB"}}
GUARD = 120  # seconds: only a guard against a load that never returns


@pytest.fixture(autouse=True)
def no_cache_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)


def rank_state(seed: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(N, generator=g)
    half = N // 2
    return {
        "w": FlatShard(flat[rank * half : (rank + 1) * half].clone(), rank * half, N),
        "m": FlatShard((flat * 3)[rank * half : (rank + 1) * half].clone(), rank * half, N),
        "rng": PerRank(torch.full((3,), seed * 10 + rank)),
        "step": seed,
    }


def blank(rank: int) -> dict[str, Any]:
    half = N // 2
    return {
        "w": FlatShard(torch.zeros(half), rank * half, N),
        "m": FlatShard(torch.zeros(half), rank * half, N),
        "rng": PerRank(None),
        "step": None,
    }


def assert_loaded(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["w"].local, want["w"].local)
    assert torch.equal(got["m"].local, want["m"].local)
    assert torch.equal(got["rng"].value, want["rng"].value)
    assert got["step"] == want["step"]


def save_both(url: str, step: int, options: dict | None = None, cache: Path | bool = False) -> None:
    for rank in (1, 0):  # rank 0 commits once rank 1's shard is durable
        with CheckpointManager(
            url, rank=rank, world_size=2, storage_options=options, cache_dir=cache
        ) as mgr:
            mgr.save(step, rank_state(step, rank), block=True)


@contextlib.contextmanager
def slow_store(
    s3_server: Any, s3_bucket: tuple[str, dict], step: int, per_conn_bps: float
) -> Iterator[tuple[str, dict[str, Any], Shaper]]:
    """Step ``step`` saved to a fresh bucket, then (url, storage options reaching it through
    a shaping proxy at ``per_conn_bps`` per connection and twice that in all, the proxy)."""
    bucket, direct = s3_bucket
    url = f"s3://{bucket}/run"
    save_both(url, step, {"s3": direct, **SMALL})
    shaper = Shaper(
        "127.0.0.1",
        s3_server.port,
        ShaperSettings(per_conn_bps=per_conn_bps, total_bps=2 * per_conn_bps),
    ).start()
    try:
        yield (
            url,
            {"s3": s3_server.storage_options(endpoint_url=f"http://{shaper.address}")},
            shaper,
        )
    finally:
        shaper.stop()


class Loader(threading.Thread):
    """Rank ``rank``'s load in a thread (the command that started beside the prefetch)."""

    def __init__(self, url: str, rank: int, cache: Path, options: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.rank, self.cache, self.options = url, rank, cache, options
        self.target = blank(rank)
        self.report: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with CheckpointManager(
                self.url,
                rank=self.rank,
                world_size=2,
                cache_dir=self.cache,
                storage_options=self.options,
            ) as mgr:
                self.report = mgr.load_with_report(self.target)
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            self.error = exc

    def result(self) -> Any:
        self.join(GUARD)
        assert not self.is_alive(), "the load did not return"
        if self.error is not None:
            raise self.error
        return self.report


def test_a_load_racing_the_prefetch_waits_for_its_file_and_gets_identical_tensors(
    tmp_path: Path,
) -> None:
    store, cache = str(tmp_path / "store"), tmp_path / "cache"
    save_both(store, 4, SMALL)
    data = cache / store_key(store) / "step-4" / data_name(1)
    planned, go = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def on_planned(step: int | None) -> None:  # the prefetch's thread, before any data copy
        seen.update(
            step=step,
            data_there=data.exists(),
            reserved=[n for n in os.listdir(data.parent) if ".tmp-" in n],
        )
        planned.set()
        assert go.wait(GUARD)  # the copy is held here until the load runs

    done: dict[str, Any] = {}
    prefetch = threading.Thread(
        target=lambda: done.update(r=prefetch_latest(store, cache, [1], on_planned=on_planned)),
        daemon=True,
    )
    prefetch.start()
    assert planned.wait(GUARD)
    assert seen["step"] == 4 and not seen["data_there"]
    assert seen["reserved"] and all(n.startswith(f".{data_name(1)}.tmp-") for n in seen["reserved"])
    load = Loader(store, 1, cache)
    load.start()
    load.join(3.0)
    assert load.is_alive(), "the load did not wait for the file the prefetch is copying"
    go.set()
    report = load.result()
    prefetch.join(GUARD)
    assert_loaded(load.target, rank_state(4, 1))
    assert report.cache_wait_s > 0
    assert report.cached_files == 4  # both indexes, rank 1's objects and its data file
    assert report.cached_bytes >= N // 2 * 4 * 2  # the data came from the cache, whole
    assert done["r"].step == 4 and done["r"].files == 5  # manifest, 2 indexes, objects, data


def test_a_prefetch_killed_mid_file_makes_the_load_read_the_store(
    s3_server, s3_bucket, tmp_path: Path
) -> None:
    """SIGKILL to the prefetch while its temporary data file is half written: the load that
    waits on it reads the store, never the partial file, and gets the saved tensors."""
    cache = tmp_path / "cache"
    with slow_store(s3_server, s3_bucket, 6, 50_000) as (url, options, shaper):
        options["striped"] = {"retries": 0}
        step = cache / store_key(url) / "step-6"
        work = tmp_path / "prefetch-cwd"  # nothing beside it shadows a package
        work.mkdir()
        code = (
            "import json, sys; from ckpt import prefetch_latest; "
            "prefetch_latest(sys.argv[1], sys.argv[2], [1], connections=2, "
            "storage_options=json.loads(sys.argv[3]))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, url, str(cache), json.dumps(options)], cwd=work
        )
        try:

            def half_written() -> list[Path]:
                if not step.exists():
                    return []
                return [
                    step / n
                    for n in os.listdir(step)
                    if n.startswith(f".{data_name(1)}.tmp-") and os.stat(step / n).st_blocks > 0
                ]

            [partial] = wait_for(half_written, "a partly written data file", timeout=GUARD)
            load = Loader(url, 1, cache, options)
            load.start()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(GUARD)
        shaper.update(ShaperSettings())  # the store at full speed again
        report = load.result()
    assert_loaded(load.target, rank_state(6, 1))
    assert not (step / data_name(1)).exists()  # never renamed into place
    # the partial file has the data file's full size: a size check alone would take it
    assert partial.exists() and partial.stat().st_size >= N // 2 * 4 * 2
    assert report.cached_bytes < N // 2 * 4  # only metadata came from the cache


def test_an_inplace_restart_fetches_only_the_commit_record_of_what_it_saved(tmp_path: Path) -> None:
    """``bootseer run``: attempt 0 saves (its files written into the node cache too) and
    crashes; the restart's prefetch finds every file of the step there and fetches only
    the store's commit record, and the resumed tensors are the saved ones."""
    store, cache, out = tmp_path / "store", tmp_path / "cache", tmp_path / "out.json"
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace,
        "--ckpt-url",
        str(store),
        "--ckpt-cache-dir",
        str(cache),
        "--ranks",
        "0",
        "--max-restarts",
        "1",
        command=child("ckpt-save-crash-load", store, out),
        timeout=GUARD,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    assert (seen["step"], seen["equal"]) == (3, True)
    assert seen["cached_bytes"] >= 250_000 * 4  # the data came from the node cache
    prefetches = {s["attempt"]: s for s in spans(trace) if s["phase"] == "checkpoint_prefetch"}
    assert prefetches[0]["detail"]["step"] is None  # the first start: nothing saved yet
    again = prefetches[1]
    with CheckpointManager(str(store), cache_dir=False) as mgr:
        manifest = len(mgr.fs.cat_file(f"{step_dir(mgr.root, 3)}/{MANIFEST}"))
    assert again["detail"]["step"] == 3
    assert (again["bytes"], again["detail"]["files"]) == (manifest, 1)
    assert again["detail"]["cached_already"] >= 2  # the index and the data file
    starts = {s["attempt"]: s for s in spans(trace) if s["phase"] == "command_start"}
    assert starts[1]["start"] >= again["start"] + again["detail"]["ready_s"] - 0.001


def test_the_startup_returns_while_the_prefetch_still_copies_and_the_load_waits(
    s3_server, s3_bucket, tmp_path: Path
) -> None:
    """``run_startup`` hands the command its variables once the copy is planned, not when it
    ends (the store behind a slow link); the prefetch's span comes later, and the command's
    load gets the saved tensors from the cache."""
    from bootseer.startup import StartupPlan, run_startup
    from bootseer.trace import TraceWriter

    cache = tmp_path / "cache"
    with slow_store(s3_server, s3_bucket, 2, 200_000) as (url, options, _):
        trace = TraceWriter(tmp_path / "trace", node="n0")
        plan = StartupPlan(
            ckpt_url=url,
            ckpt_cache_dir=str(cache),
            ranks=[1],
            ckpt_connections=2,
            storage_options=options,
        )
        env = run_startup(plan, trace=trace, say=lambda line: None)
        data = cache / store_key(url) / "step-2" / data_name(1)
        assert env == {CACHE_ENV: str(cache)}
        assert not data.exists()  # 1 MB at 400 kB/s: still on its way
        assert not [s for s in spans(trace.dir) if s["phase"] == "checkpoint_prefetch"]
        load = Loader(url, 1, cache, options)  # the command's load
        load.start()
        report = load.result()
        wait_for(
            lambda: [s for s in spans(trace.dir) if s["phase"] == "checkpoint_prefetch"],
            "the prefetch's span",
            timeout=GUARD,
        )
    assert_loaded(load.target, rank_state(2, 1))
    assert report.cached_bytes >= N // 2 * 4 * 2 and report.cache_wait_s > 0
    [span] = [s for s in spans(trace.dir) if s["phase"] == "checkpoint_prefetch"]
    assert span["outcome"] == "ok" and span["detail"]["step"] == 2
    assert 0 < span["detail"]["ready_s"] < span["end"] - span["start"]
