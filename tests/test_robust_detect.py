"""Detection from heartbeats: constructed beats and times (deterministic, no sleeps), and
the files real processes write through bootseer.heartbeat."""

from __future__ import annotations

import subprocess

import pytest
from robust_helpers import GUARD, scenario_argv, scenario_env

from bootseer.robust.detect import (
    Beat,
    FailSlowDetector,
    HangDetector,
    MetricDetector,
    read_heartbeats,
)


def feed(detector, beats):
    return [e for b in beats for e in detector.observe(b)]


def test_hang_threshold_is_learned_from_step_times_without_warmup():
    hangs = HangDetector(k=5.0, floor_s=3.0, warmup_steps=2, initial_s=600.0)
    assert hangs.threshold() == (600.0, "initial")
    # steps 0->1->2 are the warm-up (compile, first collectives: 20 s each), then 1 s a step
    times = [0.0, 20.0, 40.0, 41.0, 42.0, 43.0, 44.0]
    for step, t in enumerate(times):
        hangs.observe(Beat(rank=0, step=step, time=t))
        hangs.observe(Beat(rank=1, step=step, time=t))
    hangs.observe(Beat(rank=1, step=7, time=45.0))  # rank 0 stalls at step 6 (t=44)
    assert hangs.threshold() == (5.0, "learned")  # 5 x median 1 s, not 5 x 20 s
    assert hangs.check(now=48.9) == []
    [hang] = hangs.check(now=49.5)
    assert (hang.kind, hang.rank, hang.step) == ("hang", 0, 6)
    assert hang.evidence == {
        "silent_s": 5.5,
        "threshold_s": 5.0,
        "threshold_from": "learned",
        "last_step": 6,
    }
    [rank1] = hangs.check(now=60.0)  # rank 0 once per stall; rank 1 silent too by now
    assert (rank1.rank, rank1.step) == (1, 7)
    hangs.observe(Beat(rank=0, step=7, time=61.0))  # progress ends rank 0's stall
    assert hangs.check(now=65.0) == []
    assert [e.rank for e in hangs.check(now=66.5)] == [0]


def test_a_rank_that_is_finishing_or_ended_normally_is_never_a_hang():
    hangs = HangDetector(timeout_s=5.0)
    for rank in (0, 1, 2):
        hangs.observe(Beat(rank=rank, step=10, time=100.0))
    hangs.observe(Beat(rank=1, step=11, time=101.0, finishing=True))  # left its loop
    hangs.finish(2)  # its process ended with status 0
    assert [e.rank for e in hangs.check(200.0)] == [0]
    assert Beat.from_doc({"rank": 3, "step": 4, "time": 1.0, "finishing": True}).finishing


def test_hang_floor_and_configured_timeout():
    hangs = HangDetector(k=5.0, floor_s=30.0, warmup_steps=0)
    for step in range(5):
        hangs.observe(Beat(rank=0, step=step, time=step * 0.1))
    assert hangs.threshold() == (30.0, "learned")  # 5 x 0.1 s is below the floor
    fixed = HangDetector(timeout_s=7.0)
    fixed.observe(Beat(rank=2, step=None, time=100.0))  # ready, no step yet
    assert fixed.check(106.9) == []
    assert [e.rank for e in fixed.check(107.0)] == [2]
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        HangDetector(timeout_s=0)


def test_nan_and_inf_are_reported_at_their_step():
    metrics = MetricDetector()
    events = feed(
        metrics,
        [
            Beat(0, 1, 1.0, loss=2.0),
            Beat(0, 2, 2.0, loss=float("nan")),
            Beat(0, 3, 3.0, grad_norm=float("inf")),
        ],
    )
    [nan] = events
    assert (nan.kind, nan.rank, nan.step, nan.evidence) == ("nonfinite", 0, 2, {"loss": "nan"})


def test_a_missed_nan_is_found_through_first_nonfinite():
    metrics = MetricDetector()
    [nan] = metrics.observe(
        Beat(1, 9, 5.0, loss=1.0, first_nonfinite={"step": 7, "grad_norm": "inf"})
    )
    assert (nan.rank, nan.step, nan.evidence) == (1, 7, {"grad_norm": "inf"})


def test_a_missed_nan_is_dated_at_its_first_step_even_when_the_beat_read_is_bad_too():
    """Found by the soak: a NaN gradient at step 3 makes step 4's loss NaN; a reader that
    polled past step 3 must still say 3."""
    metrics = MetricDetector()
    [nan] = metrics.observe(
        Beat(
            0,
            4,
            5.0,
            loss=float("nan"),
            grad_norm=float("nan"),
            first_nonfinite={"step": 3, "grad_norm": "nan"},
        )
    )
    assert (nan.step, nan.evidence) == (3, {"grad_norm": "nan"})


def test_a_5x_jump_over_the_recent_median():
    metrics = MetricDetector(factor=5.0, window=20, min_history=5)
    losses = [2.0, 2.1, 1.9, 2.0, 2.2, 9.9, 11.0]
    events = feed(
        metrics, [Beat(0, s, float(s), loss=v, grad_norm=1.0) for s, v in enumerate(losses)]
    )
    [spike] = events  # 9.9 < 5 x 2.0; 11.0 >= 5 x 2.05 (the median with 9.9 in it)
    assert (spike.kind, spike.step) == ("spike", 6)
    assert spike.evidence == {"metric": "loss", "value": 11.0, "median": 2.05, "factor": 5.0}
    assert metrics.observe(Beat(0, 6, 6.0, loss=11.0, grad_norm=1.0)) == []  # a re-read


def test_fail_slow_rank_and_node_after_three_rounds():
    slow = FailSlowDetector(factor=1.5, rounds=3)
    nodes = {0: "n0", 1: "n0", 2: "n1", 3: "n1"}
    normal = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.6}
    assert slow.round(normal, 10.0, nodes) == []
    assert slow.round({**normal, 3: 1.0}, 20.0, nodes) == []  # recovered: the run restarts
    assert slow.round(normal, 30.0, nodes) == []
    assert slow.round(normal, 40.0, nodes) == []
    [rank] = slow.round(normal, 50.0, nodes)
    assert (rank.rank, rank.node, rank.evidence["ratio"]) == (3, "n1", 1.6)
    both = {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0, 4: 1.0, 5: 1.1}  # a whole node slow
    nodes = {**nodes, 4: "n2", 5: "n2"}
    fresh = FailSlowDetector()
    events = [e for t in (1, 2, 3) for e in fresh.round(both, t, nodes)]
    assert sorted((e.rank, e.node) for e in events if e.rank is not None) == [(2, "n1"), (3, "n1")]
    [node] = [e for e in events if e.rank is None]
    assert (node.node, node.evidence["scope"], node.evidence["ratio"]) == ("n1", "node", 1.905)


def test_real_heartbeat_files_from_real_processes(tmp_path):
    """Two ranks train through bootseer.heartbeat; rank 1's loss is NaN at step 3."""
    procs = [
        subprocess.Popen(
            scenario_argv("heartbeats", 8, 0.02, 3 if rank else -1),
            env=scenario_env({"BOOTSEER_CONTROL_DIR": str(tmp_path), "RANK": str(rank)}),
        )
        for rank in (0, 1)
    ]
    for p in procs:
        assert p.wait(timeout=GUARD) == 0
    beats = read_heartbeats(tmp_path, node="n0")
    assert [b.rank for b in beats] == [0, 1]
    events = feed(MetricDetector(), beats)
    [nan] = events
    assert (nan.rank, nan.node, nan.evidence) == (1, "n0", {"loss": "nan"})
    assert nan.step == 3  # written past the rate limit, at its step
    assert (beats[0].step, beats[0].loss, beats[0].grad_norm) == (0, 2.0, 1.0)
    hangs = HangDetector(timeout_s=10.0)
    feed(hangs, beats)
    assert hangs.check(min(b.time for b in beats) + 9.99) == []
    now = beats[0].time + 10.0
    expected = [0] + ([1] if beats[1].time <= beats[0].time else [])
    assert [e.rank for e in hangs.check(now)] == expected


def test_torn_and_foreign_files_in_the_control_dir_are_skipped(tmp_path):
    (tmp_path / "heartbeat-0").write_text('{"step": 4, "time": 10.0, "rank": 0, "loss": 1.5}')
    (tmp_path / "heartbeat-1").write_text('{"step": 4, "ti')  # torn (not the client's)
    (tmp_path / "heartbeat-2").write_text('{"step": 4}')  # no time
    (tmp_path / "ready-0").write_text('{"step": null, "time": 9.0, "rank": 0}')
    assert read_heartbeats(tmp_path) == [Beat(rank=0, step=4, time=10.0, loss=1.5)]
