"""The end-to-end scenario, bootseer's path, for real (quick form): a training job in a container
that containerd started from the training image, rank 1 killed with SIGKILL after a commit,
restarted by ``bootseer run`` in place and then on a fresh node (``bootseer bench e2e``, run
once a session: conftest's ``e2e_bench``). Asserts what happened and the
resumed state (bit-identical to the saved one); the times are the benchmark's business
(``bootseer bench e2e``), not this test's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e_helpers import (
    E2ERun,
    mb,
    node_reads,
    origin_egress,
    rank_of,
    save_log,
    survivor_allowance,
)
from test_bench_harness import check_quick_results


@pytest.mark.timeout(1200)
def test_a_killed_rank_resumes_bit_identical_in_place_and_on_a_fresh_node(
    e2e_bench: E2ERun,
) -> None:
    run, results = e2e_bench.run, e2e_bench.results
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    report = json.loads((results / "e2e.json").read_text())
    first = report["runs"]["bootseer-first"]
    inplace, fresh = report["runs"]["inplace"], report["runs"]["bootseer"]

    # Both restarts resumed from a committed step, with every rank's state equal to the
    # state saved at that step (sha256 of each rank's shards, taken at save and after load).
    assert inplace["loaded_step"] >= first["committed_step"] > 0
    assert fresh["loaded_step"] == inplace["loaded_step"]  # nothing saved after the resume
    assert inplace["bit_identical"] and fresh["bit_identical"]
    assert set(fresh["loaded_digests"]) == {"0", "1"}

    # The warm path in place: the environment verified, not reinstalled; the fresh node
    # restored it from the snapshot the first start published.
    assert inplace["detail"]["environment"]["outcome"] == "verified"
    assert fresh["detail"]["environment"]["outcome"] == "restored"
    # The checkpoint came through the node-local cache the prefetch filled.
    assert fresh["detail"]["checkpoint_prefetch"]["step"] == fresh["loaded_step"]
    assert fresh["detail"]["checkpoint_prefetch"]["bytes"] > 0
    assert fresh["load_cached_bytes"] > 0
    # In place, the saves had written their files into the node cache too: the restart does
    # not fetch the checkpoint again (only the commit record, unless a rank died before its
    # local copy was written; test_early_start.py asserts the exact bytes).
    assert (
        inplace["detail"]["checkpoint_prefetch"]["bytes"]
        < fresh["detail"]["checkpoint_prefetch"]["bytes"]
    )
    # The fresh node's snapshotter found the profile the first start recorded.
    assert fresh["prefetch_log"]

    assert (results / "e2e.png").stat().st_size > 0
    assert "bootseer" in (results / "e2e.md").read_text()


@pytest.mark.timeout(1200)
def test_the_quick_form_leaves_its_results_through_bootseer_bench(e2e_bench: E2ERun) -> None:
    """The harness's check of every suite (test_bench_harness.py), on the same run."""
    check_quick_results("e2e", e2e_bench.run, e2e_bench.results, e2e_bench.results.parent / "cache")


@pytest.mark.timeout(900)
def test_the_multi_node_restart_resumes_bit_identical_as_the_benchmark_runs_it(
    e2e_bench: E2ERun,
) -> None:
    """``bootseer bench e2e --nodes 2 --quick --cache-tier --methods bootseer``, exactly the
    benchmark's path (its image, job and ``bootseer run`` options: ``max_restarts = 0`` with
    torchrun restarting its workers), a node lost and replaced by a fresh one, the nodes
    reading the registry and S3 through the cluster's cache tier. The survivor's agent
    must leave the restart to torchrun: until 2026-12 it killed torchrun 15 s after its
    rank's gloo error, in the middle of the rendezvous, and the restart failed every time.
    Then the egress (issue 29): what left the origins, and what the survivors read.
    Runs after the one-node form, on its cache (the image's rootfs, its layers and their
    conversion, benchmarks/e2e_cache.py, and the torch wheels)."""
    import subprocess
    import sys

    from e2e_helpers import ROOT

    cache = e2e_bench.results.parent / "cache"
    results = e2e_bench.results.parent / "nodes"
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_e2e.py",
            "--nodes",
            "2",
            "--quick",
            "--methods",
            "bootseer",
            "--cache-tier",
            "--results",
            str(results),
            "--cache",
            str(cache),
        ],
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
        cwd=ROOT,
    )
    save_log(run, results.parent / "nodes-bench.log")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    report = json.loads((results / "e2e-nodes.json").read_text())
    assert not report["errors"], report["errors"]
    got = report["runs"]["bootseer"]
    # every rank of both nodes resumed from the same committed step with the state it saved
    assert got["bit_identical"] is True
    assert got["identical"] == {
        "ok": True,
        "ranks": 4,
        "steps": [got["committed_step"]],
        "differ": [],
    }
    assert sorted(got["ranks"]) == ["node0/r0", "node0/r1", "node1/r2", "node1/r3"]
    assert set(got["per_node"]) == {"node0", "node1"}
    check_egress(got)


def got_lost(got: dict[str, Any]) -> str:
    return next(n for n, v in got["per_node"].items() if v["role"] == "fresh")


def check_egress(got: dict[str, Any]) -> None:
    """Issue 29 on the 2-node run's counters (e2e-nodes.json): the origins send each byte
    once for the cluster, the nodes take it from the cache tier; a survivor reads from the
    store only the commit record and the files it does not hold."""
    per_node = got["per_node"]
    fresh = per_node[got_lost(got)]["bytes"]
    tier, cold = got["cache"]["origin_bytes"], got["first_start"]  # cold: printed only
    egress = origin_egress(got["bytes_per_node"], tier)
    figures = (
        f"restart: the origins sent {mb(egress)} (through the tier {tier}); per node "
        f"{got['bytes_per_node']}; cold start: the tier fetched {cold['cache_origin_bytes']}, "
        f"per node {cold['bytes_per_node']}; checkpoint {got['checkpoint']}; loads "
        f"{got['loads']}; survivors' loads {got['survivor_loads']}"
    )
    # Restart: what left the origins is at most 1.1x what the fresh node read (its image's
    # hot frames, the environment, its checkpoint share, through the tier or not).
    assert egress <= 1.1 * node_reads(fresh), figures
    # The fresh node took from the tier all that it may serve: the environment's chunks and
    # the checkpoint's stripes (S3), the image's blobs (registry); directly only manifests,
    # listings and commit records.
    assert fresh["s3"] <= 0.05 * fresh["s3-cache"], figures
    assert fresh["registry"] <= 0.05 * fresh["registry-cache"], figures
    # Every byte left the origin once for the cluster: the image and the environment came
    # from the tier's cache (the first start filled it); what the tier fetched from S3 is
    # the lost node's checkpoint share, which no node had read, and the commit record.
    files = got["checkpoint"]["files"]
    lost = {int(r.split("/r")[1]) for r in got["ranks"] if r.startswith(f"{got_lost(got)}/")}
    share = files["MANIFEST.json"] + sum(
        size for name, size in files.items() if name.startswith("rank-") and rank_of(name) in lost
    )
    assert tier["s3"] <= 1.1 * share, figures
    assert tier["registry"] <= 0.01 * fresh["registry-cache"], figures
    # Survivors read nothing twice: each rank's shard from its node's cache, and the node,
    # from its restarted workers' start to the first step (its load), read from the store
    # (directly and through the tier) the commit record and the indexes of the ranks it does
    # not hold once, not once per rank (that would be at least twice them).
    loads = got["survivor_loads"]
    assert loads["exact"], loads
    over = []
    for node, counters in loads["bytes_per_node"].items():
        ranks = {int(r.split("/r")[1]) for r in got["ranks"] if r.startswith(f"{node}/")}
        for r in ranks:
            load = got["loads"][f"r{r}"]
            assert 0 < load["bytes"] <= load["cached_bytes"], (node, r, figures)
        store = counters["s3"] + counters["s3-cache"]
        allowed = survivor_allowance(files, ranks)
        said = f"{node}'s load read {mb(store)} from the store for {mb(allowed)}: {counters}"
        assert store < 2 * allowed, f"{said}; {figures}"
        if store > 1.1 * allowed:
            over.append(said)
    if over:  # issue 29's target, not met yet: what is left is one look's protocol per node
        pytest.xfail(
            "survivors' store bytes over 1.1x the commit record and the indexes they lack "
            "(the node's one look: the listing, the existence check and the commit record's "
            f"two answers, with their headers: docs/benchmarks.md): {'; '.join(over)}"
        )
