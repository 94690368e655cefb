"""``bootseer report``: statistics checked by hand, the straggler rule, restarts, the JSON, the
PNG and the command, over traces written by the real TraceWriter."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import bootseer_cli
from run_helpers import child, run_wrapper

from bootseer.report import (
    Report,
    build_report,
    load_report,
    mad,
    percentile,
    straggler_threshold,
    wall_segments,
)
from bootseer.report_chart import chart_rows, chart_size, render_chart
from bootseer.trace import Span, TraceWriter, read_traces

T0 = 1763700000.0
NODES, RANKS = 8, 2
SLOW = ("node-5", 1)


def _jitter(n: int, r: int, k: int) -> float:
    """Deterministic spread of a few percent, so MAD is not zero."""
    return ((n * 7 + r * 3 + k * 5) % 11) / 100.0


def ckpt_seconds(n: int, r: int) -> float:
    base = 3.0 * (1 + _jitter(n, r, 1))
    return base * 5 if (f"node-{n}", r) == SLOW else base


def write_job(trace_dir: Path, *, hang_node: int | None = 2) -> None:
    """8 nodes x 2 ranks; node-5 rank 1 prefetches its checkpoint 5x slower; ``hang_node``
    hangs after its first step and restarts (attempt 1)."""
    for n in range(NODES):
        for r in range(RANKS):
            w = TraceWriter(trace_dir, node=f"node-{n}", rank=r)
            t = T0
            env = 2.0 * (1 + _jitter(n, r, 0))
            ck = ckpt_seconds(n, r)
            w.record("environment", t, t + env, bytes=100_000_000, outcome="ok")
            w.record("checkpoint_prefetch", t, t + ck, bytes=2_000_000_000)
            ready = t + max(env, ck)
            w.record("command_start", ready, ready + 0.1)
            w.record("first_step", t, ready + 4.0)
            if n == hang_node:
                w.record("hang", ready + 4.0, ready + 34.0, outcome="failed")
                t = ready + 35.0
                w.record("restart", t, t + 1.0, attempt=1, reason="hang")
                t += 1.0
                w.record("environment", t, t + 0.2, attempt=1)
                w.record("checkpoint_prefetch", t, t + 1.0, attempt=1)
                w.record("command_start", t + 1.0, t + 1.1, attempt=1)
                w.record("first_step", t, t + 3.0, attempt=1)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    write_job(tmp_path / "traces")
    return tmp_path / "traces"


@pytest.fixture
def report(job: Path) -> Report:
    return load_report([job])


def test_percentile_matches_numpy_and_by_hand() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # 3 + 0.7 * (4 - 3)
    assert percentile([5.0], 90) == 5.0
    values = [0.3, 9.1, 2.2, 4.4, 4.5, 7.0, 1.0]
    for q in (0, 10, 50, 90, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert mad([1, 2, 3, 4, 100]) == 1.0  # |x - 3| = 2 1 0 1 97 -> median 1


def test_the_slow_rank_is_the_only_straggler(report: Report) -> None:
    assert {(s.node, s.rank) for s in report.stragglers} == {SLOW}
    ck = [s for s in report.stragglers if s.phase == "checkpoint_prefetch"]
    assert len(ck) == 1 and ck[0].attempt == 0
    # the rule, by hand, over the attempt-0 checkpoint prefetches of all 16 ranks
    values = [ckpt_seconds(n, r) for n in range(NODES) for r in range(RANKS)]
    med = statistics.median(values)
    dev = statistics.median(abs(v - med) for v in values)
    assert ck[0].median == pytest.approx(med)
    assert ck[0].mad == pytest.approx(dev)
    assert ck[0].threshold == pytest.approx(med + 3 * max(dev, 0.01 * med, 0.010))
    assert ck[0].seconds == pytest.approx(ckpt_seconds(5, 1))
    # its first step is late for the same reason; no other phase of it, nobody else
    assert {s.phase for s in report.stragglers} <= {"checkpoint_prefetch", "first_step"}


def test_both_ranks_of_a_slow_node_are_named(tmp_path: Path) -> None:
    spans = [
        Span(
            f"node-{n}",
            r,
            "checkpoint_prefetch",
            T0,
            T0 + (15.0 if n == 3 else 3.0 + 0.01 * n + 0.001 * r),
        )
        for n in range(NODES)
        for r in range(RANKS)
    ]
    assert {(s.node, s.rank) for s in build_report(spans).stragglers} == {
        ("node-3", 0),
        ("node-3", 1),
    }


def test_identical_durations_do_not_flag_noise() -> None:
    # MAD is 0 here: without the floor, 3 ms over the median would be a straggler
    spans = [Span(f"n{i}", 0, "environment", T0, T0 + 2.0) for i in range(10)]
    spans.append(Span("n10", 0, "environment", T0, T0 + 2.003))
    assert build_report(spans).stragglers == []
    assert straggler_threshold([2.0] * 10)[2] == pytest.approx(2.0 + 3 * 0.02)
    spans.append(Span("n11", 0, "environment", T0, T0 + 4.0))
    assert [(s.node, s.mad) for s in build_report(spans).stragglers] == [("n11", 0.0)]


def test_restart_backoff_hang_and_warm_restarts_are_not_compared_with_cold_starts() -> None:
    cold = [Span(f"n{i}", 0, "environment", T0, T0 + 20.0 + 0.1 * i) for i in range(6)]
    warm = [Span(f"n{i}", 0, "environment", T0, T0 + 0.5, attempt=1) for i in range(3)]
    backoff = [
        Span(f"n{i}", 0, "restart", T0, T0 + (60.0 if i == 0 else 1.0), attempt=1) for i in range(6)
    ]
    assert build_report(cold + warm + backoff).stragglers == []


def test_phase_statistics_by_hand(report: Report) -> None:
    assert report.nodes == NODES and report.workers == NODES * RANKS
    ck = report.phase("checkpoint_prefetch")
    values = [ckpt_seconds(n, r) for n in range(NODES) for r in range(RANKS)] + [1.0, 1.0]
    assert ck.count == len(values) == 18  # node-2's two ranks restarted once
    assert ck.p50 == pytest.approx(statistics.median(values))
    assert ck.p90 == pytest.approx(float(np.percentile(values, 90)))
    assert ck.max == pytest.approx(max(values))
    assert ck.bytes == 16 * 2_000_000_000
    hang = report.phase("hang")
    assert hang.count == 0 and hang.p50 is None and hang.outcomes == {"failed": 2}
    assert [p.phase for p in report.phases] == [
        "restart",
        "environment",
        "checkpoint_prefetch",
        "command_start",
        "first_step",
        "hang",
    ]


def test_restarts_and_time_to_first_step(report: Report) -> None:
    restarted = [r for r in report.restarts if r.restarts]
    assert [(r.node, r.rank) for r in restarted] == [("node-2", 0), ("node-2", 1)]
    assert report.total_restarts == 1  # the node restarted once, both ranks with it
    a0, a1 = restarted[0].attempts
    assert (a0.attempt, a0.outcome, a0.reason) == (0, "hang", "reason=hang")
    assert (a1.attempt, a1.outcome) == (1, "ready")
    others = [r for r in report.restarts if not r.restarts]
    assert len(others) == 14 and all(r.attempts[0].outcome == "ready" for r in others)

    by = {(w.node, w.rank): w for w in report.first_step}
    w = by[("node-2", 0)]
    assert (w.first_attempt, w.last_attempt, w.last_attempt_s) == (0, 1, pytest.approx(3.0))
    slow = by[SLOW]
    assert slow.first_attempt_s == slow.last_attempt_s == pytest.approx(ckpt_seconds(5, 1) + 4)
    lasts = [x.last_attempt_s for x in report.first_step]
    assert report.first_step_last.count == 16
    assert report.first_step_last.p50 == pytest.approx(statistics.median(lasts))
    assert report.first_step_last.p90 == pytest.approx(float(np.percentile(lasts, 90)))
    assert report.first_step_last.max == pytest.approx(max(lasts))
    assert report.first_step_first.max == pytest.approx(ckpt_seconds(5, 1) + 4)


def test_crash_before_ready_and_failed_phase_outcomes() -> None:
    spans = [
        Span("a", 0, "environment", T0, T0 + 1),
        Span("a", 0, "first_step", T0, T0 + 5, outcome="failed"),
        Span("a", 0, "restart", T0 + 5, T0 + 6, attempt=1, detail={"exit_code": 1}),
        Span("a", 0, "environment", T0 + 6, T0 + 7, attempt=1, outcome="failed"),
        Span("a", 0, "restart", T0 + 7, T0 + 9, attempt=2),
        Span("a", 0, "environment", T0 + 9, T0 + 10, attempt=2),
    ]
    (r,) = build_report(spans).restarts
    assert r.restarts == 2
    assert [(a.outcome, a.reason) for a in r.attempts] == [
        ("crash", "exit_code=1"),
        ("failed:environment", None),
        ("incomplete", None),
    ]


def test_wall_segments_add_up_to_time_to_first_step(report: Report) -> None:
    # environment and checkpoint prefetch overlap: counted once; the stack ends at ready
    spans = [
        Span("a", 0, "environment", 0, 2),
        Span("a", 0, "checkpoint_prefetch", 0, 3),
        Span("a", 0, "command_start", 3, 3.1),
        Span("a", 0, "first_step", 0, 7.1),
    ]
    seg = wall_segments(spans)
    assert seg == pytest.approx(
        {"environment": 2, "checkpoint_prefetch": 1, "command_start": 0.1, "first_step": 4}
    )
    assert wall_segments(
        [Span("a", 0, "restart", 0, 1), Span("a", 0, "environment", 3, 4)]
    ) == pytest.approx({"restart": 1, "environment": 1, "untraced": 2})
    for row in report.last_attempt:
        assert sum(row.wall.values()) == pytest.approx(
            row.first_step_s + row.phases.get("restart", 0.0)
        )


def test_node_level_spans_join_their_ranks_bars() -> None:
    spans = [
        Span("n1", None, "environment", T0, T0 + 2),
        Span("n1", 0, "first_step", T0, T0 + 5),
        Span("n1", 1, "first_step", T0, T0 + 6),
        Span("n2", None, "environment", T0, T0 + 3),
    ]
    rows = build_report(spans).last_attempt
    assert [(r.node, r.rank, sorted(r.phases)) for r in rows] == [
        ("n1", 0, ["environment", "first_step"]),
        ("n1", 1, ["environment", "first_step"]),
        ("n2", None, ["environment"]),
    ]


def test_node_level_spans_decide_each_ranks_attempts() -> None:
    """As ``bootseer run`` writes them: everything but first_step once per node (rank null)."""
    spans = [
        Span("n1", None, "command_start", T0, T0 + 0.1),
        Span("n1", 0, "first_step", T0, T0 + 2),
        Span("n1", 1, "first_step", T0, T0 + 3),
        Span("n1", None, "hang", T0 + 4, T0 + 9, outcome="killed"),
        Span("n1", None, "restart", T0 + 9, T0 + 10, attempt=1, detail={"reason": "hang"}),
        Span("n1", None, "command_start", T0 + 10, T0 + 10.1, attempt=1),
        Span("n1", 0, "first_step", T0 + 9, T0 + 12, attempt=1),
        Span("n1", 1, "first_step", T0 + 9, T0 + 13, attempt=1),
        Span("n2", None, "command_start", T0, T0 + 0.1),  # crashed before any ready
        Span("n2", None, "restart", T0 + 1, T0 + 2, attempt=1, detail={"exit_code": 3}),
        Span("n2", None, "command_start", T0 + 2, T0 + 2.1, attempt=1),
    ]
    rep = build_report(spans)
    assert (rep.nodes, rep.workers) == (2, 3)
    assert [
        (r.node, r.rank, r.restarts, [(a.attempt, a.outcome, a.reason) for a in r.attempts])
        for r in rep.restarts
    ] == [
        ("n1", 0, 1, [(0, "hang", "reason=hang"), (1, "ready", None)]),
        ("n1", 1, 1, [(0, "hang", "reason=hang"), (1, "ready", None)]),
        ("n2", None, 1, [(0, "crash", "exit_code=3"), (1, "incomplete", None)]),
    ]
    assert rep.total_restarts == 2  # once per node
    assert [(r.node, r.rank, r.attempt, sorted(r.phases)) for r in rep.last_attempt] == [
        ("n1", 0, 1, ["command_start", "first_step", "restart"]),
        ("n1", 1, 1, ["command_start", "first_step", "restart"]),
        ("n2", None, 1, ["command_start", "restart"]),
    ]


@pytest.fixture(scope="module")
def hang_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ``bootseer run`` trace: the command is ready, heartbeats, hangs on attempt 0 and
    succeeds on attempt 1."""
    tmp = tmp_path_factory.mktemp("hang")
    proc = run_wrapper(
        tmp / "trace",
        "--hang-timeout",
        "1",
        "--dump-wait",
        "1",
        "--max-restarts",
        "2",
        command=child("hang-once", tmp / "count"),
    )
    assert proc.returncode == 0, proc.stderr
    return tmp / "trace"


def test_a_real_hang_then_restart(hang_trace: Path) -> None:
    spans, _ = read_traces([hang_trace])
    assert {s.rank for s in spans if s.phase in ("hang", "restart")} == {None}  # node-level
    rep = load_report([hang_trace])
    assert (rep.nodes, rep.workers, rep.total_restarts) == (1, 1, 1)
    [r] = rep.restarts
    assert (r.node, r.rank, r.restarts) == ("testnode", 0, 1)
    assert [(a.attempt, a.outcome) for a in r.attempts] == [(0, "hang"), (1, "ready")]
    assert "reason=hang" in r.attempts[0].reason
    [w] = rep.first_step
    assert (w.first_attempt, w.last_attempt) == (0, 1)
    assert w.first_attempt_s is not None and w.first_attempt_s > 0
    assert w.last_attempt_s is not None and w.last_attempt_s > 0
    [row] = rep.last_attempt
    assert (row.rank, row.attempt) == (0, 1)
    assert {"restart", "command_start", "first_step"} <= set(row.phases)


def test_a_real_crash_then_restart(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace, "--max-restarts", "2", command=child("crash-once", tmp_path / "count")
    )
    assert proc.returncode == 0, proc.stderr
    rep = load_report([trace])
    assert (rep.nodes, rep.workers, rep.total_restarts) == (1, 1, 1)
    [r] = rep.restarts
    assert [(a.attempt, a.outcome, a.reason) for a in r.attempts] == [
        (0, "crash", "reason=crash, exit_code=5"),
        (1, "ready", None),
    ]


def test_cli_on_a_real_hang_trace(hang_trace: Path, tmp_path: Path) -> None:
    out = bootseer_cli("report", str(hang_trace), "--out", str(tmp_path)).stdout
    assert out.splitlines()[0].endswith("(1 node/rank traces); 0 stragglers; 1 restarts")
    assert "restarts (1 in all)" in out
    [row] = [line for line in out.splitlines() if line.startswith("testnode")]
    assert row.split()[:4] == ["testnode", "0", "1", "0:"]
    assert "0: hang (reason=hang" in row and row.endswith("1: ready")


def test_json_round_trips_with_the_documented_keys(report: Report) -> None:
    doc = json.loads(json.dumps(report.to_dict()))
    assert set(doc) == {
        "version",
        "sources",
        "warnings",
        "spans",
        "nodes",
        "workers",
        "phases",
        "stragglers",
        "restarts",
        "time_to_first_step",
        "last_attempt",
        "incidents",
        "node_stragglers",
        "bytes_by_remote",
        "robust",
    }  # v2:
    # see test_report_nodes.py for those three, test_report_robust.py for "robust"
    assert set(doc["phases"][0]) == {
        "phase",
        "count",
        "p50",
        "p90",
        "max",
        "mean",
        "bytes",
        "outcomes",
    }
    assert set(doc["stragglers"][0]) == {
        "phase",
        "node",
        "rank",
        "attempt",
        "seconds",
        "median",
        "mad",
        "threshold",
    }
    assert set(doc["restarts"][0]) == {"node", "rank", "restarts", "attempts"}
    assert set(doc["time_to_first_step"]) == {"first_attempt", "last_attempt", "workers"}
    assert set(doc["time_to_first_step"]["last_attempt"]) == {"count", "p50", "p90", "max", "mean"}
    assert set(doc["last_attempt"][0]) == {
        "node",
        "rank",
        "attempt",
        "phases",
        "first_step_s",
        "wall",
    }
    assert Report.from_dict(doc) == report
    assert Report.from_dict(doc).to_dict() == doc


def test_png_is_a_readable_chart_of_the_right_size(report: Report, tmp_path: Path) -> None:
    import matplotlib.image

    out = render_chart(report, tmp_path / "chart.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(out)
    width, height = chart_size(16)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05  # something was drawn


def test_a_huge_job_shows_its_slowest_bars(report: Report, tmp_path: Path) -> None:
    rows, total = chart_rows(report, max_bars=3)
    assert total == 16 and len(rows) == 3
    assert (rows[0].node, rows[0].rank) == SLOW
    out = render_chart(report, tmp_path / "few.png", max_bars=3)
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == chart_size(3)[::-1]


def test_torn_last_line_is_a_warning(job: Path) -> None:
    torn = job / "node-7-rank1.jsonl"
    with open(torn, "a", encoding="utf-8") as f:
        f.write('{"node": "node-7", "rank": 1, "pha')
    spans, warnings = read_traces([job])
    rep = load_report([job])
    assert rep.spans == len(spans) and len(rep.warnings) == 1
    assert str(torn) in rep.warnings[0]


def test_plain_and_rich_tables(report: Report, capsys: pytest.CaptureFixture[str]) -> None:
    from bootseer.cli.report import print_report

    print_report(report, terminal=False)
    plain = capsys.readouterr().out
    assert "checkpoint_prefetch" in plain and "node-5" in plain and "0: hang" in plain
    print_report(report, terminal=True)
    rich = capsys.readouterr().out
    assert "stragglers" in rich and "node-5" in rich and rich != plain


def test_cli_prints_the_table_and_writes_json_and_png(job: Path, tmp_path: Path) -> None:
    with open(job / "node-0-rank0.jsonl", "a", encoding="utf-8") as f:
        f.write('{"node": "node-0", "ra')  # a killed writer's torn line
    proc = bootseer_cli("report", str(job))
    out = proc.stdout
    assert "phases" in out and "p50" in out and "p90" in out and "time to first step" in out
    straggler_lines = [
        line.split()[:4]
        for line in out.splitlines()
        if line.startswith("checkpoint_prefetch  node-5")
    ]
    # the span (rank 1, attempt 0), then the node (attempt 0) in the node-level table
    assert straggler_lines == [
        ["checkpoint_prefetch", "node-5", "1", "0"],
        ["checkpoint_prefetch", "node-5", "0", "16.50"],
    ]
    assert "restarts (1 in all)" in out
    assert f"chart: {job / 'report.png'}" in out
    assert "skipped" in proc.stderr and "Traceback" not in proc.stderr
    doc = json.loads((job / "report.json").read_text())
    assert {(s["node"], s["rank"]) for s in doc["stragglers"]} == {SLOW}
    assert (job / "report.png").read_bytes()[:4] == b"\x89PNG"

    elsewhere = tmp_path / "out"
    proc = bootseer_cli(
        "report", str(job), "--out", str(elsewhere), "--png", str(tmp_path / "c.png")
    )
    assert (elsewhere / "report.json").exists() and (tmp_path / "c.png").exists()
    assert f"chart: {tmp_path / 'c.png'}" in proc.stdout


@pytest.mark.parametrize("case", ["empty", "missing", "garbage"])
def test_cli_bad_trace_dirs_exit_2_naming_the_path(tmp_path: Path, case: str) -> None:
    path = tmp_path / "traces"
    if case != "missing":
        path.mkdir()
    if case == "garbage":
        (path / "node-0.jsonl").write_text("not json\n")
    proc = bootseer_cli("report", str(path), check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("bootseer: error:") and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr
