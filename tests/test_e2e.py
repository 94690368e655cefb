"""The end-to-end scenario, bootseer's path, for real (quick form): a training job in a container
that containerd started from the training image, rank 1 killed with SIGKILL after a commit,
restarted by ``bootseer run`` in place and then on a fresh node (``bootseer bench e2e``, run
once a session: conftest's ``e2e_bench``). Asserts what happened and the
resumed state (bit-identical to the saved one); the times are the benchmark's business
(``bootseer bench e2e``), not this test's."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import E2ERun
from test_bench_harness import check_quick_results


@pytest.mark.timeout(1200)
def test_a_killed_rank_resumes_bit_identical_in_place_and_on_a_fresh_node(
        e2e_bench: E2ERun) -> None:
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
    assert inplace["detail"]["checkpoint_prefetch"]["bytes"] < \
        fresh["detail"]["checkpoint_prefetch"]["bytes"]
    # The fresh node's snapshotter found the profile the first start recorded.
    assert fresh["prefetch_log"]

    assert (results / "e2e.png").stat().st_size > 0
    assert "bootseer" in (results / "e2e.md").read_text()


@pytest.mark.timeout(1200)
def test_the_quick_form_leaves_its_results_through_bootseer_bench(e2e_bench: E2ERun) -> None:
    """The harness's check of every suite (test_bench_harness.py), on the same run."""
    check_quick_results("e2e", e2e_bench.run, e2e_bench.results,
                        e2e_bench.results.parent / "cache")
