"""The end-to-end scenario's quick form, run once a test session through ``bootseer bench e2e``.

Its job takes minutes on a CI machine: test_e2e.py asserts what happened in it, and
test_bench_harness.py that the harness left its results, from the same run (conftest's
``e2e_bench`` fixture), so ``make test`` never runs the job twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bootseer.testing.servers import fuse_available

ROOT = Path(__file__).resolve().parents[1]
E2E_ARGS = ("--quick", "--methods", "bootseer")  # in place and on a fresh node; no baseline


def missing_component() -> str | None:
    """Why the scenario cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the end-to-end scenario needs root (containerd, runc, FUSE)"
    for tool in ("containerd", "ctr", "runc", "containerd-shim-runc-v2", "docker-registry"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt: containerd runc docker-registry)"
    dpkg = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", "python3.11"],
        capture_output=True,
        text=True,
        check=False,
    )
    if not dpkg.stdout.endswith(" installed"):
        return "the image base is copied from Debian's python3.11 package, not installed here"
    return fuse_available()


@dataclass(frozen=True)
class E2ERun:
    """``bootseer bench e2e``'s exit, output and results directory."""

    run: subprocess.CompletedProcess[str]
    results: Path


def run_e2e_bench(work: Path) -> E2ERun:
    """``bootseer bench e2e --quick --methods bootseer`` with its results and a cold cache
    under ``work``."""
    results = work / "results"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "bench",
            "e2e",
            *E2E_ARGS,
            "--results",
            str(results),
            "--cache",
            str(work / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=1150,
        check=False,
        cwd=ROOT,
    )
    save_log(run, work / "bench.log")
    return E2ERun(run, results)


def save_log(run: subprocess.CompletedProcess[str], path: Path) -> None:
    """The benchmark's output (its phases, timestamped) where a CI run keeps its files: what
    the suite's own time is measured from (docs/benchmarks.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.stdout + "\n--- stderr ---\n" + run.stderr)


# -- egress (issue 29): what left the origins, what a node read --------------------------------

ORIGINS = ("registry", "s3")  # the origins the cache tier fronts


def node_reads(counters: dict[str, int]) -> int:
    """What a node read from the registry and S3, directly and through the cache tier."""
    return sum(counters.get(s, 0) + counters.get(f"{s}-cache", 0) for s in ORIGINS)


def origin_egress(per_node: dict[str, dict[str, int]], tier: dict[str, int]) -> int:
    """Bytes that left the registry and S3: what the tier fetched from them (its counting
    proxies) and what the nodes read from them directly (manifests, listings: uncached)."""
    return sum(tier.get(s, 0) for s in ORIGINS) + sum(
        b.get(s, 0) for b in per_node.values() for s in ORIGINS
    )


def survivor_allowance(files: dict[str, int], ranks: set[int]) -> int:
    """What a surviving node holding ``ranks``' files may read from the store for a load: the
    commit record and the files it does not hold (the other ranks' indexes: every rank's
    load checks every index; their data and objects it does not need)."""
    others = [
        size
        for name, size in files.items()
        if name.endswith(".index.json") and rank_of(name) not in ranks
    ]
    return files["MANIFEST.json"] + sum(others)


def rank_of(name: str) -> int:
    """The rank of a checkpoint file: ``rank-00002.index.json`` -> 2."""
    return int(name.split(".")[0].removeprefix("rank-"))


def mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"
