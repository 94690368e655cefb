"""``bootseer check``: 3 real gloo processes under torchrun agree bit for bit; with one rank's
weights one ulp off and another's reduced sum corrupted, exactly those ranks are named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bootseer.robust.check import CheckReport, RankResult, parse_faults, reference_step
from bootseer.robust.events import Event, Verdict, read_records
from bootseer.testing.servers import free_port

ROOT = str(Path(__file__).resolve().parent.parent)
GUARD = 240


def env(**extra: str) -> dict[str, str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("BOOTSEER_")
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    return {**base, "PYTHONPATH": ROOT, "BOOTSEER_NODE": "checknode", **extra}


def test_three_torchrun_ranks_agree_bit_for_bit(tmp_path):
    trace = tmp_path / "trace"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "bootseer",
            "check",
            "--mib",
            "1",
            "--trace-dir",
            str(trace),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "check: 3 ranks over gloo" in out
    assert "sums exact on all 3 ranks" in out
    assert "alignment: all 3 ranks bit-identical" in out
    assert "verdict: ok" in out
    assert out.count("verdict:") == 1  # rank 0 speaks for all
    records, _ = read_records([trace])
    [verdict] = records
    assert (verdict.action, verdict.failure_class, verdict.ranks) == ("continue", "check", ())
    results = verdict.evidence["results"]
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert len({(r["output_hash"], r["grad_hash"]) for r in results}) == 1
    assert {r["sum_errors"] for r in results} == {0}
    assert verdict.evidence["bandwidth"]["busbw_bytes_s"] > 0
    assert results[0]["output_hash"] == reference_step()[0]  # the same bits in this process


def test_the_deviating_rank_and_the_corrupted_sum_are_named(tmp_path):
    trace = tmp_path / "trace"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "check",
            "--nproc",
            "3",
            "--mib",
            "1",
            "--trace-dir",
            str(trace),
        ],
        env=env(BOOTSEER_CHECK_FAULT="alignment:1,sum:2"),
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "sums WRONG on rank 2 (node checknode)" in proc.stdout
    assert "alignment: rank 1 (node checknode) differs from the majority" in proc.stdout
    assert "verdict: FAILED: evict rank 1 (node checknode), rank 2 (node checknode)" in proc.stdout
    records, _ = read_records([trace])
    events = [r for r in records if isinstance(r, Event)]
    assert [(e.failure_class, e.rank) for e in events] == [
        ("collective_error", 2),
        ("alignment_mismatch", 1),
    ]
    assert events[0].evidence["wrong_elements"] == 1
    [verdict] = [r for r in records if isinstance(r, Verdict)]
    assert (verdict.action, verdict.ranks, verdict.nodes) == (
        "replace_and_restart",
        (1, 2),
        ("checknode",),
    )


def test_one_ulp_changes_the_hashes_and_the_majority_names_it():
    good, bad = reference_step(), reference_step(perturb=True)
    assert good == reference_step() and good[0] != bad[0] and good[1] != bad[1]
    results = [RankResult(r, "n", 0, *(bad if r == 3 else good), 0.01, 1024) for r in range(4)]
    report = CheckReport.from_results(results)
    assert (report.alignment_suspects, report.ok) == ((3,), False)
    tie = CheckReport.from_results(results[2:])  # one good, one bad: no majority
    assert tie.no_majority and not tie.ok and tie.alignment_suspects == ()


def test_a_bad_fault_spec_is_refused_by_name():
    with pytest.raises(ValueError, match="alignment:RANK or sum:RANK"):
        parse_faults("alignment:one")
    proc = subprocess.run(
        [sys.executable, "-m", "bootseer", "check", "--nproc", "1"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    assert proc.returncode == 2
    assert "--nproc 1: a check between processes needs at least 2" in proc.stderr


def test_ring_neighbours_are_measured_in_rounds_of_disjoint_pairs():
    from bootseer.robust.check import ring_edges

    assert ring_edges(1) == [] and ring_edges(2) == [[(0, 1)]]
    for world in range(3, 10):
        rounds = ring_edges(world)
        edges = [pair for r in rounds for pair in r]
        assert sorted(edges) == sorted((i, (i + 1) % world) for i in range(world))
        for r in rounds:  # nobody in two pairs of one round
            members = [rank for pair in r for rank in pair]
            assert len(members) == len(set(members))
        assert len(rounds) == (2 if world % 2 == 0 else 3)


def test_the_node_whose_every_link_is_slow_is_named_and_noise_is_not():
    from bootseer.robust.check import link_suspects

    def result(rank, links):
        return RankResult(rank, f"node{rank}", 0, "o", "g", 0.1, 1 << 20, links)

    slow_1 = [
        result(0, {"0-1": 0.40, "3-0": 0.004}),
        result(1, {"0-1": 0.41, "1-2": 0.39}),
        result(2, {"1-2": 0.38, "2-3": 0.005}),
        result(3, {"2-3": 0.004, "3-0": 0.003}),
    ]
    report = CheckReport.from_results(slow_1)
    assert report.link_suspects == (1,) and report.suspects == (1,) and not report.ok
    assert report.links["0-1"] == 0.41  # the slower end's reading
    assert "SLOW on every link of rank 1 (node node1)" in report.text()
    [event] = [r for r in report.records() if isinstance(r, Event)]
    assert (event.failure_class, event.node, event.evidence["check"]) == (
        "slow_link",
        "node1",
        "link_bandwidth",
    )
    # one slow link alone (two ends to blame), all slow (the fabric), or within the noise
    # floor: nobody is named
    one = [
        result(0, {"0-1": 0.4, "2-0": 0.004}),
        result(1, {"0-1": 0.4, "1-2": 0.004}),
        result(2, {"1-2": 0.004, "2-0": 0.004}),
    ]
    assert link_suspects(one)[0] == ()
    assert (
        link_suspects([result(r, {"0-1": 0.4, "1-2": 0.4, "2-0": 0.4}) for r in range(3)])[0] == ()
    )
    noise = [
        result(0, {"0-1": 0.02, "2-0": 0.001}),
        result(1, {"0-1": 0.02, "1-2": 0.02}),
        result(2, {"1-2": 0.02, "2-0": 0.001}),
    ]
    assert link_suspects(noise)[0] == ()
    assert link_suspects(slow_1[:2])[0] == ()  # two ranks: one link, no culprit


def test_the_cpu_reference_step_does_not_load_torch_s_compiler() -> None:
    """The deterministic switch imports torch._inductor and torch._dynamo (1.6 s of CPU per
    rank in torch 2.13); on one CPU thread the step is deterministic without it."""
    from conftest import modules_loaded_by

    code = (
        "from bootseer.robust.check import reference_step\n"
        "a = reference_step()\nassert a == reference_step(), a"
    )
    assert modules_loaded_by(code, ("torch", "torch._inductor", "torch._dynamo")) == ["torch"]
