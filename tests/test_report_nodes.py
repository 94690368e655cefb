"""``bootseer report`` across nodes: incidents and their critical path, the restart's cost
split by phase, straggling nodes, bytes per remote per node, the timeline chart and the v2
JSON, over traces with known numbers written by the real TraceWriter, a synthetic 1000-node
job and real ``bootseer run`` traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import bootseer_cli
from run_helpers import child, run_wrapper

from bootseer.progress import human_bytes
from bootseer.report import READABLE_VERSIONS, REPORT_VERSION, Report, build_report, load_report
from bootseer.report_chart import chart_size, render_timeline, timeline_figure, timeline_rows
from bootseer.report_nodes import Segment, positioned_segments
from bootseer.trace import Span, TraceWriter

T0 = 1763700000.0
NODES, RANKS = 6, 2
SLOW = "node-4"
FAIL = T0 + 100.0  # node-1 fails at attempt 0; every node restarts 0.5 s later
RESTART = FAIL + 0.5
ENV_S3, IMAGE_REGISTRY = 100_000, 5_000_000


def ckpt_bytes(n: int, attempt: int) -> int:
    return 1_000_000 + 1_000 * n + attempt


def ckpt_s(n: int, attempt: int) -> float:
    return 10.0 if (attempt, f"node-{n}") == (1, SLOW) else 2.0 + 0.001 * n


def write_job(trace_dir: Path) -> None:
    """6 nodes x 2 ranks. Warmup fills the image from the registry; attempt 0 starts cold
    at T0, node-1 reports a failure at FAIL, every node restarts (attempt 1) at RESTART and
    node-4 reads its checkpoint 5x slower."""
    for n in range(NODES):
        node = f"node-{n}"
        w = TraceWriter(trace_dir, node=node)  # node-level spans, as bootseer run writes them
        w.record(
            "image_prefetch",
            T0 - 60,
            T0 - 50,
            bytes=IMAGE_REGISTRY,
            warmup=True,
            bytes_by_remote={"registry": IMAGE_REGISTRY},
        )
        for attempt, t in ((0, T0), (1, RESTART)):
            if attempt:
                w.record("restart", t, t + 1.0, attempt=1, reason="crash")
                t += 1.0
            env, ck = 1.0, ckpt_s(n, attempt)
            w.record("environment", t, t + env, attempt=attempt, bytes_by_remote={"s3": ENV_S3})
            w.record(
                "checkpoint_prefetch",
                t,
                t + ck,
                attempt=attempt,
                bytes=ckpt_bytes(n, attempt),
                bytes_by_remote={"s3": ckpt_bytes(n, attempt)},
            )
            ready = t + max(env, ck)
            w.record("command_start", ready, ready + 0.1, attempt=attempt)
            for r in range(RANKS):
                rw = TraceWriter(trace_dir, node=node, rank=n * RANKS + r)
                rw.record("first_step", t, ready + 0.1 + 1.0 + 0.01 * r, attempt=attempt)
        if n == 1:
            w.record("failure", FAIL, FAIL, outcome="failed", reason="exit_code=1")


@pytest.fixture
def report(tmp_path: Path) -> Report:
    write_job(tmp_path / "traces")
    return load_report([tmp_path / "traces"])


def test_the_restart_cost_is_the_slow_nodes_critical_path(report: Report) -> None:
    assert [i.attempt for i in report.incidents] == [0, 1]
    inc = report.incident()
    assert (inc.kind, inc.start_at, inc.start_from) == ("restart", FAIL, "failure")
    # the job's first step waits for node-4's second rank: restart, 10 s of checkpoint
    first_step_at = RESTART + 1.0 + 10.0 + 0.1 + 1.01
    assert inc.first_step_at == pytest.approx(first_step_at)
    assert inc.wall_s == pytest.approx(first_step_at - FAIL)
    assert (inc.critical_node, inc.critical_rank, inc.nodes, inc.ready_nodes) == (
        SLOW,
        9,
        NODES,
        NODES,
    )
    got = [(s.phase, round(s.start, 6), round(s.end, 6)) for s in inc.critical_path]
    assert got == [
        ("untraced", 0.0, 0.5),
        ("restart", 0.5, 1.5),
        ("environment", 1.5, 2.5),
        ("checkpoint_prefetch", 2.5, 11.5),
        ("command_start", 11.5, 11.6),
        ("first_step", 11.6, 12.61),
    ]
    assert sum(inc.cost.values()) == pytest.approx(inc.wall_s, abs=1e-9)
    assert inc.cost["checkpoint_prefetch"] == pytest.approx(9.0)
    # the cold start: from the first span, node-5 (slowest checkpoint by 1 ms) decides it
    cold = report.incident(0)
    assert (cold.kind, cold.start_from, cold.start_at) == ("start", "first_span", T0)
    assert (cold.critical_node, cold.critical_rank) == ("node-5", 11)
    assert cold.wall_s == pytest.approx(2.005 + 0.1 + 1.01)
    assert sum(cold.cost.values()) == pytest.approx(cold.wall_s, abs=1e-9)


def test_the_timeline_keeps_every_nodes_phases_in_time_order(report: Report) -> None:
    inc = report.incident(1)
    assert [t.node for t in inc.timeline] == [f"node-{n}" for n in range(NODES)]
    for t in inc.timeline:
        starts = [s.start for s in t.segments]
        assert starts == sorted(starts) and t.segments[0] == Segment("restart", 0.5, 1.5)
        assert t.first_step_s == pytest.approx(t.segments[-1].end)  # the last rank's
    assert inc.timeline[0].first_step_s == pytest.approx(0.5 + 1.0 + 2.0 + 0.1 + 1.01)


def test_a_gap_is_left_out_of_the_timeline_and_untraced_on_the_path() -> None:
    spans = [Span("n", None, "a", 10.0, 11.0), Span("n", None, "b", 12.0, 13.0)]
    assert positioned_segments(spans, 9.0, gap=None) == [
        Segment("a", 1.0, 2.0),
        Segment("b", 3.0, 4.0),
    ]
    assert positioned_segments(spans, 9.0, until=12.5) == [
        Segment("untraced", 0.0, 1.0),
        Segment("a", 1.0, 2.0),
        Segment("untraced", 2.0, 3.0),
        Segment("b", 3.0, 3.5),
    ]


def test_straggling_nodes_by_phase(report: Report) -> None:
    got = {(s.phase, s.node, s.attempt) for s in report.node_stragglers}
    assert got == {("checkpoint_prefetch", SLOW, 1), ("first_step", SLOW, 1)}
    [ck] = [s for s in report.node_stragglers if s.phase == "checkpoint_prefetch"]
    assert ck.seconds == pytest.approx(10.0) and ck.median == pytest.approx(2.0025)


def test_bytes_from_each_remote_per_node_and_in_total(report: Report) -> None:
    assert [n.node for n in report.bytes_by_node] == [f"node-{n}" for n in range(NODES)]
    for n, row in enumerate(report.bytes_by_node):
        s3 = 2 * ENV_S3 + ckpt_bytes(n, 0) + ckpt_bytes(n, 1)
        assert row.remotes == {"registry": IMAGE_REGISTRY, "s3": s3}
        assert row.total == IMAGE_REGISTRY + s3
    assert report.bytes_by_remote == {
        "registry": NODES * IMAGE_REGISTRY,
        "s3": sum(2 * ENV_S3 + ckpt_bytes(n, 0) + ckpt_bytes(n, 1) for n in range(NODES)),
    }


def test_warmup_spans_are_in_no_incident(report: Report) -> None:
    for inc in report.incidents:
        assert all(s.phase != "image_prefetch" for t in inc.timeline for s in t.segments)


def test_a_bad_bytes_by_remote_line_is_a_warning_naming_it(tmp_path: Path) -> None:
    write_job(tmp_path)
    with open(tmp_path / "node-0.jsonl", "a", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "node": "node-0",
                    "phase": "environment",
                    "start": T0,
                    "end": T0,
                    "bytes_by_remote": {"s3": -1},
                }
            )
            + "\n"
        )
    rep = load_report([tmp_path])
    assert len(rep.warnings) == 1 and "bytes_by_remote" in rep.warnings[0]
    assert "node-0.jsonl" in rep.warnings[0]


def test_the_timeline_chart_has_a_bar_per_node_and_marks_the_critical_path(
    report: Report, tmp_path: Path
) -> None:
    import matplotlib.image
    import matplotlib.pyplot as plt

    inc = report.incident()
    fig = timeline_figure(report)
    try:
        [ax] = [a for a in fig.axes if a.get_yticklabels()]
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == [
            f"node-{n}" + (" (critical path)" if f"node-{n}" == SLOW else "") for n in range(NODES)
        ]
        by_gid: dict[str, list] = {}
        for patch in ax.patches:
            by_gid.setdefault(patch.get_gid(), []).append(patch)
        n_segments = sum(len(t.segments) for t in inc.timeline)
        assert sum(len(v) for k, v in by_gid.items() if k.startswith("phase:")) == n_segments
        assert len(by_gid["phase:checkpoint_prefetch"]) == NODES
        critical = by_gid["critical"]
        assert [(p.get_x(), p.get_x() + p.get_width()) for p in critical] == [
            (s.start, s.end) for s in inc.critical_path
        ]
        assert {p.get_y() + p.get_height() / 2 for p in critical} == {
            labels.index(f"{SLOW} (critical path)")
        }
        [line] = [ln for ln in ax.lines if ln.get_gid() == "first_step"]
        assert list(line.get_xdata()) == [inc.wall_s, inc.wall_s]
    finally:
        plt.close(fig)
    out = render_timeline(report, tmp_path / "t.png", attempt=0)
    assert matplotlib.image.imread(out).shape[:2] == chart_size(NODES)[::-1]
    with pytest.raises(ValueError, match="no incident 7"):
        timeline_figure(report, 7)


def synthetic_job(nodes: int, slow: int) -> list[Span]:
    """``nodes`` nodes restarted at t=0; node ``slow`` loads its checkpoint in 30 s, the
    others in 3 s give or take 1%."""
    spans = []
    for n in range(nodes):
        node = f"node-{n}"
        ck = 30.0 if n == slow else 3.0 * (1 + (n % 7) / 700)
        spans += [
            Span(node, None, "restart", 0.0, 1.0, attempt=1),
            Span(
                node,
                None,
                "checkpoint_prefetch",
                1.0,
                1.0 + ck,
                attempt=1,
                bytes_by_remote={"s3": 1000},
            ),
            Span(node, n, "first_step", 1.0, 2.0 + ck, attempt=1),
        ]
    return spans


@pytest.mark.parametrize("nodes", [8, 1000])
def test_many_nodes(nodes: int, tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    slow = nodes - 3
    rep = build_report(synthetic_job(nodes, slow))
    inc = rep.incident()
    assert (inc.nodes, inc.ready_nodes, inc.critical_node) == (nodes, nodes, f"node-{slow}")
    assert inc.wall_s == pytest.approx(32.0) and inc.cost["checkpoint_prefetch"] == 30.0
    assert {(s.phase, s.node) for s in rep.node_stragglers} == {
        ("checkpoint_prefetch", f"node-{slow}"),
        ("first_step", f"node-{slow}"),
    }
    assert rep.bytes_by_remote == {"s3": 1000 * nodes} and len(rep.bytes_by_node) == nodes
    rows, total = timeline_rows(inc, max_bars=60)
    assert total == nodes and len(rows) == min(nodes, 60)
    assert (rows if nodes <= 60 else rows[:1])[slow if nodes <= 60 else 0].node == f"node-{slow}"
    fig = timeline_figure(rep)
    try:
        assert len(fig.axes[0].get_yticklabels()) == min(nodes, 60)
    finally:
        plt.close(fig)


def test_json_v3_schema_is_pinned_and_round_trips(report: Report) -> None:
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["version"] == REPORT_VERSION == 3
    inc = doc["incidents"][1]
    assert {k: type(v).__name__ for k, v in inc.items()} == {
        "attempt": "int",
        "kind": "str",
        "start_at": "float",
        "start_from": "str",
        "first_step_at": "float",
        "wall_s": "float",
        "nodes": "int",
        "ready_nodes": "int",
        "critical_node": "str",
        "critical_rank": "int",
        "critical_path": "list",
        "cost": "dict",
        "timeline": "list",
        "node_attempts": "dict",
    }
    assert inc["node_attempts"] == {f"node-{n}": [1] for n in range(NODES)}
    assert set(inc["critical_path"][0]) == {"phase", "start", "end"}
    assert set(inc["timeline"][0]) == {"node", "segments", "first_step_s"}
    assert {k: type(v).__name__ for k, v in doc["node_stragglers"][0].items()} == {
        "phase": "str",
        "node": "str",
        "attempt": "int",
        "seconds": "float",
        "median": "float",
        "mad": "float",
        "threshold": "float",
    }
    assert set(doc["bytes_by_remote"]) == {"total", "nodes"}
    assert {k: type(v).__name__ for k, v in doc["bytes_by_remote"]["nodes"][0].items()} == {
        "node": "str",
        "remotes": "dict",
        "total": "int",
    }
    assert Report.from_dict(doc) == report
    assert Report.from_dict(doc).to_dict() == doc


def test_a_v1_report_still_reads(report: Report) -> None:
    doc = report.to_dict()
    v1 = {
        k: v for k, v in doc.items() if k not in ("incidents", "node_stragglers", "bytes_by_remote")
    }
    v1["version"] = 1
    assert 1 in READABLE_VERSIONS
    old = Report.from_dict(v1)
    assert old.incidents == [] and old.bytes_by_remote == {} and old.phases == report.phases
    with pytest.raises(ValueError, match="version 4 is not one of"):
        Report.from_dict({**doc, "version": 4})


def test_a_v2_report_still_reads(report: Report) -> None:
    """v2 incidents lack ``node_attempts``: they read back empty, the rest equal."""
    doc = json.loads(json.dumps(report.to_dict()))
    for inc in doc["incidents"]:
        del inc["node_attempts"]
    old = Report.from_dict({**doc, "version": 2})
    assert [i.node_attempts for i in old.incidents] == [{}] * len(report.incidents)
    assert [i.wall_s for i in old.incidents] == [i.wall_s for i in report.incidents]


def test_cli_prints_the_node_views_and_writes_the_timeline(tmp_path: Path) -> None:
    write_job(tmp_path / "traces")
    out = bootseer_cli("report", str(tmp_path / "traces"), "--out", str(tmp_path / "o")).stdout
    assert f"timeline: {tmp_path / 'o' / 'timeline.png'}" in out
    [row] = [line for line in out.splitlines() if line.startswith("1        restart")]
    assert "node-4/r9" in row and "checkpoint_prefetch 9.00" in row and "12.61" in row
    [total] = [line for line in out.splitlines() if line.startswith("all nodes")]
    s3 = sum(2 * ENV_S3 + ckpt_bytes(n, 0) + ckpt_bytes(n, 1) for n in range(NODES))
    assert total.split() == [
        "all",
        "nodes",
        *human_bytes(NODES * IMAGE_REGISTRY).split(),
        *human_bytes(s3).split(),
        *human_bytes(NODES * IMAGE_REGISTRY + s3).split(),
    ]
    assert (tmp_path / "o" / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_real_run_traces_have_their_incidents(tmp_path: Path) -> None:
    """``bootseer run`` crashes its command once and restarts it: two incidents, the second
    from the restart span to the first step, its cost adding up to its wall time."""
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace, "--max-restarts", "2", command=child("crash-once", tmp_path / "count")
    )
    assert proc.returncode == 0, proc.stderr
    rep = load_report([trace])
    cold, restart = rep.incidents
    assert (cold.attempt, cold.ready_nodes, cold.wall_s, cold.critical_node) == (0, 0, None, None)
    assert (restart.kind, restart.start_from, restart.ready_nodes) == ("restart", "restart", 1)
    assert (restart.critical_node, restart.critical_rank) == ("testnode", 0)
    assert restart.wall_s == pytest.approx(restart.first_step_at - restart.start_at)
    assert sum(restart.cost.values()) == pytest.approx(restart.wall_s, abs=1e-9)
    assert {"restart", "first_step"} <= set(restart.cost)
    assert Report.from_dict(json.loads(json.dumps(rep.to_dict()))) == rep


def test_spans_carry_bytes_by_remote_through_the_writer(tmp_path: Path) -> None:
    from bootseer.trace import read_traces, remote_of

    assert [remote_of(u) for u in ("striped::s3://b/x", "s3://b", "/data/ckpt", "hdfs://nn/x")] == [
        "s3",
        "s3",
        "file",
        "hdfs",
    ]
    w = TraceWriter(tmp_path, node="n")
    with w.span("checkpoint_prefetch") as info:
        info["bytes_by_remote"] = {"s3": 7}
    w.record("environment", T0, T0 + 1)
    with pytest.raises(ValueError, match="bytes_by_remote: 's3': expected an integer >= 0"):
        w.record("environment", T0, T0 + 1, bytes_by_remote={"s3": 1.5})
    spans, warnings = read_traces([tmp_path])
    assert [s.bytes_by_remote for s in spans] == [{"s3": 7}, {}] and not warnings
