"""ETTR from traces: a constructed trace with known answers, and the trace of a real
``bootseer run`` whose child crashes once, hangs once, then finishes."""

from __future__ import annotations

import dataclasses
import time

import pytest
from robust_helpers import scenario_argv
from run_helpers import run_wrapper

from bootseer.robust.ettr import compute_ettr, read_ettr
from bootseer.robust.events import Event, write_record
from bootseer.trace import Span, read_traces


def span(phase, start, end, attempt, rank=None, **detail):
    return Span("node-1", rank, phase, float(start), float(end), attempt=attempt, detail=detail)


SPANS = [
    span("environment", 0, 30, 0),
    span("command_start", 40, 41, 0),
    span("first_step", 0, 100, 0, rank=0),
    span("first_step", 0, 95, 0, rank=1),
    # attempt 0 crashes at 1000; cleanup until 1010; a 10 s backoff
    span("restart", 1010, 1020, 1, reason="crash", exit_code=1, exited_at=1000.0),
    span("environment", 1020, 1030, 1),
    span("command_start", 1030, 1031, 1),
    span("first_step", 1020, 1080, 1, rank=0),
    span("first_step", 1020, 1079, 1, rank=1),
    # attempt 1 stops making progress at 2000, seen at 2030, dumped by 2035, killed at 2040
    span("hang", 2000, 2040, 1, silent_s=30.0, detected_at=2030.0, dumped_at=2035.0),
    span("restart", 2042, 2044, 2, reason="hang", exited_at=2040.0),
    span("environment", 2044, 2050, 2),
    span("first_step", 2044, 2100, 2, rank=0),
]
CRASH = Event(
    "crash",
    "python_exception",
    node="node-1",
    rank=1,
    step=950,
    time=1000.5,
    evidence={"checkpoint_step": 900, "step_time_s": 1.0},
)


def test_a_constructed_trace_gives_the_known_numbers():
    report = compute_ettr(SPANS, [CRASH], end=3700.0)
    # productive: [100, 1000] + [1080 + 50 recomputed, 2000] + [2100, 3700]; the window opens
    # at the job's first step (100: both ranks past it), the cold start is the start-up's
    assert report.productive == ((100.0, 1000.0), (1130.0, 2000.0), (2100.0, 3700.0))
    assert (report.start, report.wall_s, report.productive_s) == (100.0, 3600.0, 3370.0)
    assert report.ettr == pytest.approx(3370 / 3600)
    crash, hang = report.incidents
    assert (crash.attempt, crash.reason, crash.failure_class, crash.start, crash.end) == (
        0,
        "crash",
        "python_exception",
        1000.0,
        1080.0,
    )
    assert crash.split() == {
        "detection": 0.0,
        "localization": 0.0,
        "teardown": 10.0,
        "restart": 10.0,
        "environment": 10.0,
        "command_start": 1.0,
        "first_step": 49.0,
        "failed_attempt": 0.0,
        "other": 0.0,
    }
    assert (crash.recomputation_s, crash.unproductive_s) == (50.0, 130.0)
    assert (hang.reason, hang.failure_class, hang.start, hang.end) == (
        "hang",
        "hang",
        2000.0,
        2100.0,
    )
    assert hang.split() == {
        "detection": 30.0,
        "localization": 5.0,
        "teardown": 7.0,
        "restart": 2.0,
        "environment": 6.0,
        "first_step": 50.0,
        "failed_attempt": 0.0,
        "other": 0.0,
    }
    assert hang.recomputation_s is None  # the trace does not say: unknown, not 0
    # the sliding hour: the last window is [100, 3700]; an early one holds the crash
    assert report.sliding(3600.0, 600.0)[-1] == (3700.0, pytest.approx(3370 / 3600))
    assert report.window(0, 1200) == pytest.approx((900 + 70) / 1100)  # from the first step


def test_an_attempt_that_fails_before_its_first_step():
    spans = [
        span("first_step", 0, 10, 0, rank=0),
        span("restart", 100, 101, 1, reason="crash", exited_at=100.0),
        span("environment", 101, 105, 1),  # attempt 1 dies during its startup
        span("restart", 106, 107, 2, reason="crash", exited_at=105.5),
        span("first_step", 107, 120, 2, rank=0),
    ]
    report = compute_ettr(spans, end=200.0)
    assert report.productive == ((10.0, 100.0), (120.0, 200.0))
    first, second = report.incidents
    assert (first.start, first.end, first.split()["restart"]) == (100.0, 101.0, 1.0)
    assert (second.start, second.end) == (101.0, 120.0)
    assert second.split() == {
        "detection": 0.0,
        "localization": 0.0,
        "teardown": 0.5,
        "restart": 1.0,
        "first_step": 13.0,
        "failed_attempt": 4.5,
        "other": 0.0,
    }


def test_records_and_spans_are_read_from_the_same_trace(tmp_path):
    path = tmp_path / "node-1.jsonl"
    path.write_text("".join(s.to_json() + "\n" for s in SPANS))
    write_record(path, CRASH)
    report = read_ettr([tmp_path], end=3700.0)
    assert report.productive_s == 3370.0 and report.incidents[0].recomputation_s == 50.0
    with pytest.raises(ValueError, match="no spans of bootseer run"):
        compute_ettr([])


def test_the_trace_of_a_real_bootseer_run(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(
        trace,
        "--max-restarts",
        "2",
        "--hang-timeout",
        "1",
        "--dump-wait",
        "5",
        command=scenario_argv("crash-hang-finish", counter),
    )
    end = time.time()
    assert proc.returncode == 0, proc.stderr
    spans, _ = read_traces([trace])
    report = read_ettr([trace], end=end)
    crash, hang = report.incidents
    assert (crash.attempt, crash.reason, hang.attempt, hang.reason) == (0, "crash", 1, "hang")
    [restart1] = [s for s in spans if s.phase == "restart" and s.attempt == 1]
    [hang_span] = [s for s in spans if s.phase == "hang"]
    assert crash.start == restart1.detail["exited_at"] and crash.detection_s == 0.0
    readies = {
        a: max(s.end for s in spans if s.phase == "first_step" and s.attempt == a)
        for a in (0, 1, 2)
    }
    # the last heartbeat, or the ready mark when that beat came just before it
    assert hang.start == max(hang_span.start, readies[1])
    assert hang.detection_s == pytest.approx(hang_span.detail["detected_at"] - hang.start)
    assert hang_span.detail["silent_s"] >= 1.0  # the hang threshold
    assert hang.localization_s == pytest.approx(
        hang_span.detail["dumped_at"] - hang_span.detail["detected_at"]
    )
    expected = ((readies[0], crash.start), (readies[1], hang.start), (readies[2], end))
    assert report.productive == tuple((a, b) for a, b in expected if b > a)
    for incident in report.incidents:
        assert incident.end == readies[incident.attempt + 1]
        assert sum(incident.split().values()) == pytest.approx(incident.end - incident.start)
    assert report.start == readies[0]  # the window opens at the job's first step
    assert report.productive_s + sum(i.end - i.start for i in report.incidents) == (
        pytest.approx(report.wall_s)
    )


def test_an_attempt_stopped_by_the_controller_takes_the_verdicts_class():
    """A slow node is the controller's finding: the node's trace holds only its verdict."""
    from bootseer.robust.events import Verdict

    spans = [
        span("first_step", 0, 10, 0, rank=0),
        span(
            "controller_stop",
            50,
            52,
            0,
            detected_at=50.0,
            dumped_at=50.5,
            decided_at=51.0,
            killed_at=52.0,
        ),
        span("restart", 53, 54, 1, reason="controller", exited_at=52.0),
        span("first_step", 54, 60, 1, rank=0),
    ]
    verdict = Verdict(
        "replace_and_restart",
        "fail_slow",
        nodes=("node-2",),
        time=51.0,
        evidence={"from": "controller", "local": "restart"},
    )
    (incident,) = compute_ettr(spans, [verdict], end=100.0).incidents
    assert (incident.reason, incident.failure_class, incident.start, incident.end) == (
        "controller",
        "fail_slow",
        52.0,
        60.0,
    )


def test_a_replacement_nodes_attempts_are_aligned_to_the_job_by_epoch():
    """node-2 replaced node-1 after incident 1: its attempt 0 is the survivors' attempt 1 (the
    soak's trace/step-log disagreement: node-2's late first step counted as attempt 0's)."""

    def on(node, phase, start, end, attempt, rank=None, **detail):
        return Span(node, rank, phase, float(start), float(end), attempt=attempt, detail=detail)

    spans = [
        on("node-0", "command_start", 0, 1, 0, epoch=0),
        on("node-1", "command_start", 0, 1, 0, epoch=0),
        on("node-0", "first_step", 0, 10, 0, rank=0),
        on("node-1", "first_step", 0, 12, 0, rank=1),
        # node-1 is lost at 100; node-0 restarts after the verdict with node-2, a fresh node
        on("node-0", "restart", 110, 111, 1, reason="controller", exited_at=100.0),
        on("node-0", "command_start", 111, 112, 1, epoch=1),
        on("node-2", "environment", 90, 111, 0),
        on("node-2", "command_start", 111, 112, 0, epoch=1),
        on("node-0", "first_step", 111, 120, 1, rank=0),
        on("node-2", "first_step", 111, 125, 0, rank=1),
    ]
    report = compute_ettr(spans, end=200.0)
    assert report.productive == ((12.0, 100.0), (125.0, 200.0))
    [lost] = report.incidents
    assert (lost.start, lost.end, lost.split()["teardown"]) == (100.0, 125.0, 10.0)
    # without epochs (a node alone, or an older trace) the numbers are the nodes' own
    plain = [
        dataclasses.replace(s, detail={k: v for k, v in s.detail.items() if k != "epoch"})
        for s in spans
    ]
    assert compute_ettr(plain, end=200.0).productive != report.productive


def test_the_window_opens_at_the_first_step_and_a_warmup_is_not_the_job():
    """The cold start failing once (attempt 0 dies at 30 before any step, attempt 1 steps
    from 50) and a warmup before it: neither is in the window, which runs from the job's
    first step; given a start, the window opens there."""
    spans = [
        span("environment", -100, -40, 0, warmup=True),
        span("first_step", 0, 30, 0, rank=0, warmup=True),
        span("command_start", 0, 1, 0),
        span("restart", 31, 32, 1, reason="crash", exited_at=30.0),
        span("first_step", 32, 50, 1, rank=0),
        span("restart", 301, 302, 2, reason="crash", exited_at=300.0),
        span("first_step", 302, 320, 2, rank=0),
    ]
    report = compute_ettr(spans, end=450.0)
    assert (report.start, report.end, report.productive) == (
        50.0,
        450.0,
        ((50.0, 300.0), (320.0, 450.0)),
    )
    assert [(i.start, i.end) for i in report.incidents] == [(300.0, 320.0)]
    assert report.ettr == pytest.approx(380 / 400)
    assert compute_ettr(spans, end=450.0, start=0.0).wall_s == 450.0


def test_a_step_log_gives_the_same_accounting_step_by_step():
    """The same job as its rank 0's step log would tell it: steps 0..250 at 1 s from t=50
    (pid 1), killed at 300; pid 2 resumes from the checkpoint of step 240: its first step
    (241) at 320 ends its way back, 242..250 are redone (9 s), 251.. new until the end. The
    window opens at the first step, as from the traces."""
    from bootseer.robust.ettr import ettr_from_steps

    log = [(50.0 + k, k, 1) for k in range(251)] + [(320.0 + j, 241 + j, 2) for j in range(131)]
    report = ettr_from_steps(log, end=450.0)
    assert (report.start, report.end) == (50.0, 450.0)
    assert report.productive == ((50.0, 300.0), (329.0, 450.0))
    assert report.ettr == pytest.approx((250 + 121) / 400)
    with pytest.raises(ValueError, match="no step"):
        ettr_from_steps([], end=1.0)
