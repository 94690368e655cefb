"""The multi-node restart benchmark's accounting (benchmarks/e2e_nodes_spans.py): the events a
restart writes become spans that ``bootseer report`` lines up across nodes, and the figures the
benchmark prints come out of that report. The scenario itself is a benchmark
(``bootseer bench e2e --nodes 4``), not a test: it takes minutes on this machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from e2e_nodes_spans import (  # noqa: E402
    NodeRun,
    check_identical,
    harness_spans,
    node_phases,
    rank_totals,
    summarize,
)

from bootseer.report import load_report  # noqa: E402
from bootseer.trace import TraceWriter  # noqa: E402

KILL = 1000.0


def _ev(name: str, t: float, node: str, rank: int, pid: int, **kw: Any) -> dict[str, Any]:
    return {"event": name, "t": t, "node": node, "rank": rank, "pid": pid, "attempt": 0, **kw}


def _worker(
    node: str, rank: int, pid: int, start: float, step: int = 3, digest: str | None = None
) -> list[dict[str, Any]]:
    """A restarted worker's milestones: 1 s launch, 0.5 s load, 0.2 s digest, 0.3 s step."""
    return [
        _ev("process_start", start, node, rank, pid),
        _ev("load_start", start + 1.0, node, rank, pid),
        _ev("load_end", start + 1.5, node, rank, pid, bytes=100),
        _ev(
            "verified",
            start + 1.7,
            node,
            rank,
            pid,
            step=step,
            digest=digest or f"d{rank}",
            seconds=0.2,
        ),
        _ev("first_step", start + 2.0, node, rank, pid, step=step + 1),
    ]


def _restart(fresh_rank1_digest: str | None = None) -> list[dict[str, Any]]:
    """2 nodes x 2 ranks: node1 lost at KILL and replaced (a baseline-style start: pip), node0
    survives; both ranks saved step 3 before the loss."""
    saved = [
        _ev("saved", KILL - 5, n, r, 10 + r, step=3, digest=f"d{r}")
        for n, r in (("node0", 0), ("node0", 1), ("node1", 2), ("node1", 3))
    ]
    fresh = [
        _ev("entry", KILL + 6.0, "node1", -1, 7),
        _ev("env_ready", KILL + 16.0, "node1", -1, 7),
        _ev("command_start", KILL + 16.5, "node1", -1, 7),
    ]
    return [
        *saved,
        *fresh,
        *_worker("node0", 0, 50, KILL + 19.0),
        *_worker("node0", 1, 51, KILL + 19.0),
        *_worker("node1", 2, 60, KILL + 18.0),
        *_worker("node1", 3, 61, KILL + 18.5, digest=fresh_rank1_digest),
    ]


def _run(**kw: Any) -> NodeRun:
    return NodeRun(
        **{
            "method": "baseline",
            "kill_t": KILL,
            "replaced_t": KILL + 2.0,
            "lost": "node1",
            "pull": (KILL + 2.0, KILL + 5.0),
            "bytes": {
                "node0": {"registry": 0, "s3": 300, "index": 0},
                "node1": {"registry": 5000, "s3": 200, "index": 9000},
            },
            **kw,
        }
    )


def _report(tmp_path: Path, run: NodeRun, events: list[dict[str, Any]]) -> dict[str, Any]:
    (tmp_path / "t").mkdir(exist_ok=True)
    with open(tmp_path / "t" / "harness.jsonl", "w") as f:
        f.writelines(s.to_json() + "\n" for s in harness_spans(run, events))
    return load_report([tmp_path / "t"]).to_dict()


def test_the_report_finds_the_restart_its_straggler_and_every_node_s_phases(tmp_path: Path) -> None:
    events, run = _restart(), _run()
    report = _report(tmp_path, run, events)
    out = summarize(report, run, rank_totals(run, events), harness_spans(run, events))
    s = out["summary"]
    # every rank's time from the loss to its first step (minus the digest): 20.8, 20.8, 19.8, 20.3
    assert out["ranks"] == pytest.approx(
        {"node0/r0": 20.8, "node0/r1": 20.8, "node1/r2": 19.8, "node1/r3": 20.3}
    )
    assert s["max_s"] == pytest.approx(20.8) and s["job_back_s"] == pytest.approx(20.8)
    assert s["p50_s"] == pytest.approx(20.55) and s["p90_s"] == pytest.approx(20.8)
    # the survivors are last: they waited in the rendezvous for the fresh node
    assert s["straggler"] in ("node0/r0", "node0/r1")
    assert s["why"].startswith("rendezvous 19.0 s")
    # ...for node1, the fresh node: its replacement, pull, pip and start set the pace
    assert s["paced_by"] == "node1"
    assert s["paced_why"] == "environment 10.0 s, image_pull 3.0 s, node_replace 2.0 s"
    node1 = out["per_node"]["node1"]
    assert node1["first_step_s"] == pytest.approx(20.3)
    assert node1["phases"] == pytest.approx(
        {
            "node_replace": 2.0,
            "image_pull": 3.0,
            "container_start": 1.0,
            "environment": 10.0,
            "command_start": 0.5,
            "rendezvous": 1.5,
            "untraced": 0.5,
            "launch": 1.0,
            "checkpoint_load": 0.5,
            "first_step": 0.3,
        }
    )  # along node1's slowest rank (r3)
    assert sum(node1["phases"].values()) == pytest.approx(node1["first_step_s"])
    assert out["bytes_total"] == {"registry": 5000, "s3": 500, "index": 9000}
    # the report counts the same bytes per node (the harness put the fixture's counts there)
    per_node = {n["node"]: n["remotes"] for n in report["bytes_by_remote"]["nodes"]}
    assert per_node == {"node0": {"s3": 300}, "node1": {"index": 9000, "registry": 5000, "s3": 200}}


def test_a_replacement_node_s_bootseer_run_spans_join_the_restart(tmp_path: Path) -> None:
    """bootseer run on the fresh node counts from attempt 0; its spans keep that number
    (without their own byte counts: the fixture's are the measure), and the report puts them
    in the job's restart beside the survivor's attempt 1."""
    trace = tmp_path / "fresh"
    w = TraceWriter(trace, node="node1")
    w.record("environment", KILL + 6.0, KILL + 9.0, bytes_by_remote={"s3": 7})
    w.record("checkpoint_prefetch", KILL + 6.0, KILL + 10.0)
    w.record("command_start", KILL + 10.0, KILL + 10.2)
    w.record("first_step", KILL + 10.0, KILL + 25.0, rank=0)  # the supervisor's: not used
    events = [e for e in _restart() if e["event"] not in ("entry", "env_ready", "command_start")]
    run = _run(trace_dir=trace)
    spans = harness_spans(run, events)
    own = [
        s
        for s in spans
        if s.node == "node1" and s.phase in ("environment", "checkpoint_prefetch", "command_start")
    ]
    assert sorted(s.phase for s in own) == ["checkpoint_prefetch", "command_start", "environment"]
    assert all(s.attempt == 0 and s.bytes_by_remote == {} for s in own)
    start = next(s for s in spans if s.node == "node1" and s.phase == "container_start")
    assert (start.start, start.end) == (KILL + 5.0, KILL + 6.0)
    rdzv = next(s for s in spans if s.node == "node1" and s.phase == "rendezvous")
    assert (rdzv.start, rdzv.end) == (KILL + 10.2, KILL + 18.0)
    assert not [s for s in spans if s.phase == "first_step" and s.end == KILL + 25.0]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "h.jsonl").write_text("".join(s.to_json() + "\n" for s in spans))
    [incident] = load_report([tmp_path / "t"]).incidents  # the loss alone is no incident
    assert (incident.attempt, incident.start_at, incident.start_from) == (1, KILL, "failure")
    assert incident.node_attempts == {"node0": [1], "node1": [0]}
    assert incident.ready_nodes == 2 and incident.wall_s == pytest.approx(20.8)


def test_a_rank_that_resumed_other_bytes_is_named() -> None:
    good = check_identical(_restart(), KILL)
    assert good == {"ok": True, "ranks": 4, "steps": [3], "differ": []}
    bad = check_identical(_restart(fresh_rank1_digest="other"), KILL)
    assert bad["ok"] is False and bad["differ"] == ["node1/r3"]
    # what tells wrong bytes from a worker that never verified: both digests, the worker
    why = bad["why"]["node1/r3"]
    assert (why["step"], why["loaded"], why["saved"], why["pid"]) == (3, "other", "d3", 61)
    assert why["load"]["bytes"] is not None and "verified" in why["events"]


def test_a_missing_milestone_is_named_with_its_node_and_rank() -> None:
    events = [e for e in _restart() if not (e["event"] == "load_end" and e["rank"] == 2)]
    with pytest.raises(ValueError, match="node1 rank 2: no 'load_end' milestone"):
        harness_spans(_run(), events)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "1"], "--nodes 1: the scenario needs 2 to 8 nodes"),
        (["--nodes", "4", "--lose", "4"], "--lose 4: choose a node from 0 to 3"),
        (["--nodes", "4", "--methods", "diy,warm"], "--methods: unknown warm"),
        # the sweep (bench_e2e_sweep.py)
        (["--sweep", "2,16"], "--sweep '2,16': 16 nodes: each count must be 2 to 8"),
        (["--sweep", "4"], "give two node counts or more"),
        (["--sweep", "2,four"], "'four' is not a node count"),
        (["--sweep", "2,4,2"], "a node count is given twice"),
        (["--sweep", "2,4", "--methods", "baseline,warm"], "--methods: unknown warm"),
        (["--sweep", "2,4", "--ranks-per-node", "0"], "--ranks-per-node 0: give 1 to 8"),
        (["--sweep", "2,4", "--lose", "3"], "--lose 3: choose a node from 0 to 1"),
        (["--sweep", "2,4", "--nodes", "4"], "--sweep and --nodes: give one"),
        (["--sweep", "2,4", "--probe-mib", "-1"], "--probe-mib -1: give 0 (no probe) or more"),
        (["--ranks-per-node", "1"], "--ranks-per-node: only with --nodes or --sweep"),
    ],
)
def test_bad_arguments_are_refused_by_name(args: list[str], message: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_e2e.py"), "--results", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_bootseer_bench_passes_nodes_to_the_e2e_suite(tmp_path: Path) -> None:
    """``bootseer bench e2e --nodes N`` reaches the multi-node scenario (here refused by name:
    one node cannot lose one) and the suite's failure is reported as such."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "bench",
            "e2e",
            "--nodes",
            "1",
            "--results",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "benchmarks/bench_e2e.py --results" in r.stdout and "--nodes 1" in r.stdout
    assert "--nodes 1: the scenario needs 2 to 8 nodes" in r.stderr
    assert "e2e FAILED: exit 2" in r.stderr


def test_diy_s_copy_is_the_fresh_node_s_phase_while_its_ranks_wait() -> None:
    """diy: rclone's copy (on the fresh node, from its start to its end) and each rank's wait
    for it: launch ends where the wait began, the stretch to the load goes to the copy."""
    events = _restart()
    for e in list(events):  # node1's ranks waited 0.5 s for the copy, then loaded
        if e["event"] == "load_start" and e["node"] == "node1":
            events.append(_ev("copy_ready", e["t"], "node1", e["rank"], e["pid"], waited=0.5))
    run = _run(copy=(KILL + 2.5, KILL + 19.5, 8_000_000))  # ends as r3 loads
    spans = harness_spans(run, events)
    [copy] = [s for s in spans if s.phase == "checkpoint_copy"]
    assert (copy.node, copy.rank, copy.start, copy.end, copy.bytes) == (
        "node1",
        None,
        KILL + 2.5,
        KILL + 19.5,
        8_000_000,
    )
    launch = {s.rank: (s.start, s.end) for s in spans if s.phase == "launch"}
    assert launch[2] == (KILL + 18.0, KILL + 18.5) and launch[0] == (KILL + 19.0, KILL + 20.0)
    phases = node_phases(spans, "node1", KILL)  # along r3: launch 18.5-19.0, waits to 19.5
    assert phases["launch"] == pytest.approx(0.5) and phases["checkpoint_copy"] == pytest.approx(
        0.5
    )
    assert sum(phases.values()) == pytest.approx(20.3)


def test_a_node_restarted_in_place_keeps_its_node_and_its_attempt_1(tmp_path: Path) -> None:
    """Baseline in place: the node's container killed and run again on the same node: no
    replacement, no pull; the restart (kill to the new ``ctr run``) and the new container's
    start are its phases, at the node's attempt 1, in the report's restart with the
    survivor's."""
    run = _run(replaced_t=None, pull=None, in_place=True, restart_t=KILL + 1.0)
    run.bytes = {"node0": {"s3": 300}, "node1": {"s3": 200}}
    spans = harness_spans(run, _restart())
    node1 = [s for s in spans if s.node == "node1" and s.rank is None]
    assert [(s.phase, s.start, s.end, s.attempt) for s in node1] == [
        ("failure", KILL, KILL, 0),
        ("restart", KILL, KILL + 1.0, 1),
        ("container_start", KILL + 1.0, KILL + 6.0, 1),
        ("environment", KILL + 6.0, KILL + 16.0, 1),
        ("command_start", KILL + 16.0, KILL + 16.5, 1),
        ("rendezvous", KILL + 16.5, KILL + 18.0, 1),
    ]
    assert all(s.attempt == 1 for s in spans if s.phase != "failure")
    report = _report(tmp_path, run, _restart())
    [incident] = report["incidents"]
    assert incident["attempt"] == 1 and incident["node_attempts"] == {"node0": [1], "node1": [1]}
    assert incident["start_from"] == "failure" and incident["ready_nodes"] == 2


def test_bootseer_in_place_takes_its_restart_attempt_from_bootseer_run_s_trace(
    tmp_path: Path,
) -> None:
    """bootseer in place: ``bootseer run`` restarted torchrun (its attempt 1: backoff,
    environment verified, checkpoint prefetched); the cold start's attempt 0 is left out."""
    trace = tmp_path / "node1"
    w = TraceWriter(trace, node="node1")
    w.record("environment", KILL - 90.0, KILL - 60.0)  # the cold start
    w.record("command_start", KILL - 60.0, KILL - 59.9)
    w.record("restart", KILL + 0.5, KILL + 1.5, attempt=1, reason="returncode=-9")
    w.record("environment", KILL + 1.5, KILL + 2.0, attempt=1)
    w.record("checkpoint_prefetch", KILL + 1.5, KILL + 3.0, attempt=1)
    w.record("command_start", KILL + 3.0, KILL + 3.2, attempt=1)
    events = [e for e in _restart() if e["event"] not in ("entry", "env_ready", "command_start")]
    run = _run(replaced_t=None, pull=None, in_place=True, trace_dir=trace)
    spans = harness_spans(run, events)
    own = [(s.phase, s.start, s.attempt) for s in spans if s.node == "node1" and s.rank is None]
    assert own == [
        ("failure", KILL, 0),
        ("restart", KILL + 0.5, 1),
        ("environment", KILL + 1.5, 1),
        ("checkpoint_prefetch", KILL + 1.5, 1),
        ("command_start", KILL + 3.0, 1),
        ("rendezvous", KILL + 3.2, 1),
    ]
    phases = node_phases(spans, "node1", KILL)
    assert phases["untraced"] == pytest.approx(0.5 + 0.5)  # kill to backoff; to the 2nd worker


def test_the_markdown_names_every_method_and_compares_bootseer_with_each(tmp_path: Path) -> None:
    """``render`` (the report a run prints, and ``--render`` from its JSON): a row per method
    in the report's order, bootseer against every fresh-node method, the in-place line."""
    from bench_e2e_nodes import LABELS, render

    events = _restart()
    runs = {}
    for method, shift in (("baseline", 10.0), ("bootseer", 0.0), ("diy", 5.0), ("inplace", 0.0)):
        run = _run(method=method)
        moved = [{**e, "t": e["t"] + shift} if e["event"] in ("first_step",) else e for e in events]
        (tmp_path / method).mkdir()
        out = summarize(
            _report(tmp_path / method, run, moved),
            run,
            rank_totals(run, moved),
            harness_spans(run, moved),
        )
        out.update(
            bit_identical=True,
            report_dir=str(tmp_path / method),
            loadavg_1m={"before": 9.0, "after": 10.0},
        )
        runs[method] = out
    R = {
        "runs": runs,
        "quick": True,
        "nodes": 2,
        "model": "tiny",
        "lost_node": "node1",  # noqa: N806
        "command": "bench_e2e.py --nodes 2",
        "machine": {"cpus": 2, "ram_bytes": 2**33, "containerd": "containerd 1.6"},
        "warnings": [],
        "errors": [],
    }
    text = "\n".join(render(R))
    rows = [line for line in text.splitlines() if line.startswith("| ") and " s |" in line]
    assert [r.split("|")[1].strip() for r in rows] == [
        LABELS[m] for m in ("baseline", "diy", "bootseer", "inplace")
    ]
    assert (
        "- bootseer vs baseline: job back 20.8 s vs 30.8 s after the loss, 1.48x (32% less)" in text
    )
    assert "- bootseer vs diy: job back 20.8 s vs 25.8 s" in text
    assert "- in place (the node kept): bootseer 20.8 s" in text
    assert R["reduction"] == pytest.approx(1 - 20.8 / 30.8)


def test_the_loaded_step_s_files_are_listed_with_their_stored_bytes(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    """What a survivor may read (issue 29) is priced from these: a striped file's manifest
    object and its stripes count as one file, and the files are the step's."""
    import s3fs
    import torch
    from bench_e2e_nodes import step_files

    from ckpt import CheckpointManager

    bucket, opts = s3_bucket
    state = {"w": torch.randn(300_000), "step": 3}
    with CheckpointManager(f"s3://{bucket}/ckpt", storage_options={"s3": opts}) as mgr:
        mgr.save(3, state, block=True)
        mgr.save(6, state, block=True)
    files = step_files(f"{bucket}/ckpt", 6, {"s3": opts})
    assert set(files) == {
        "MANIFEST.json",
        "rank-00000.data",
        "rank-00000.index.json",
        "rank-00000.objects",
    }
    target = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    stored = target.du(f"{bucket}/ckpt/step-6", total=True)
    assert sum(files.values()) == stored
    assert 300_000 * 4 <= files["rank-00000.data"] < 300_000 * 4 + 4096  # its stripes and manifest
