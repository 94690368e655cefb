"""The end-to-end scenario, bootseer's path, for real (quick form): a training job in a container
that containerd started from the training image, rank 1 killed with SIGKILL after a commit,
restarted by ``bootseer run`` in place and then on a fresh node. Asserts what happened and the
resumed state (bit-identical to the saved one); the times are the benchmark's business
(``bootseer bench e2e``), not this test's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need

from bootseer.testing.servers import fuse_available

ROOT = Path(__file__).resolve().parents[1]


def missing_component() -> str | None:
    if os.geteuid() != 0:
        return "the end-to-end scenario needs root (containerd, runc, FUSE)"
    for tool in ("containerd", "ctr", "runc", "containerd-shim-runc-v2", "docker-registry"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt: containerd runc docker-registry)"
    dpkg = subprocess.run(["dpkg-query", "-W", "-f=${Status}", "python3.11"],
                          capture_output=True, text=True, check=False)
    if not dpkg.stdout.endswith(" installed"):
        return "the image base is copied from Debian's python3.11 package, not installed here"
    return fuse_available()


@pytest.mark.timeout(1200)
def test_a_killed_rank_resumes_bit_identical_in_place_and_on_a_fresh_node(tmp_path: Path) -> None:
    need(missing_component())
    results = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--quick", "--methods",
         "bootseer", "--results", str(results), "--cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=1150, check=False, cwd=ROOT)
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
    # The fresh node's snapshotter found the profile the first start recorded.
    assert fresh["prefetch_log"]

    assert (results / "e2e.png").stat().st_size > 0
    assert "bootseer" in (results / "e2e.md").read_text()
