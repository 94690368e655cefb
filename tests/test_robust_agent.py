"""The agent inside ``bootseer run``: real commands crash, print, report NaN and spikes; the
class and the verdict land in the trace and decide whether the command runs again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from robust_helpers import scenario_argv
from run_helpers import run_wrapper, spans

from bootseer.robust.events import Event, Verdict, read_records
from bootseer.tee import OutputTail


def records(trace: Path) -> tuple[list[Event], list[Verdict]]:
    got, warnings = read_records([trace])
    assert not warnings
    return ([r for r in got if isinstance(r, Event)], [r for r in got if isinstance(r, Verdict)])


def starts(trace: Path) -> list[int]:
    return [s["attempt"] for s in spans(trace) if s.get("phase") == "command_start"]


def test_a_syntax_error_stops_after_one_attempt(tmp_path):
    bad = tmp_path / "train.py"
    bad.write_text("def train(:\n    pass\n")
    trace = tmp_path / "trace"
    proc = run_wrapper(trace, "--max-restarts", "3", command=[sys.executable, str(bad)])
    assert proc.returncode == 1, proc.stderr
    assert starts(trace) == [0]  # no restart burnt
    [event], [verdict] = records(trace)
    assert (event.kind, event.failure_class, event.evidence["rule"]) == (
        "crash",
        "user_error",
        "deterministic_exception",
    )
    assert event.evidence["exception"] == "SyntaxError"
    assert any("SyntaxError" in line for line in event.evidence["lines"])
    assert (verdict.action, verdict.failure_class, verdict.evidence["local"]) == (
        "stop",
        "user_error",
        "stop",
    )
    assert "verdict: crash user_error (SyntaxError)" in proc.stderr
    assert "-> stop" in proc.stderr
    assert "SyntaxError: " in proc.stderr  # the command's own output still came through


def test_a_sigkill_restarts_in_place(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(trace, "--max-restarts", "3", command=scenario_argv("sigkill-once", counter))
    assert proc.returncode == 0, proc.stderr
    assert starts(trace) == [0, 1]
    [event], [verdict] = records(trace)
    assert (event.failure_class, event.evidence["signal"], event.evidence["exit_code"]) == (
        "killed_by_signal",
        "SIGKILL",
        137,
    )
    assert (verdict.action, verdict.evidence["local"]) == ("restart_in_place", "restart")
    assert proc.stdout == "step 1\n"  # the tee passed the command's output on


def test_no_progress_across_restarts_stops(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(
        trace,
        "--max-restarts",
        "10",
        "--max-no-progress",
        "2",
        command=scenario_argv("steps-then-raise", counter, 5),
    )
    assert proc.returncode == 1, proc.stderr
    assert counter.read_text() == "3"  # step 5 reached three times: 2 restarts, no progress
    events, verdicts = records(trace)
    assert [e.failure_class for e in events] == ["python_exception"] * 3
    assert [e.step for e in events] == [5, 5, 5]
    assert [v.action for v in verdicts] == ["restart_in_place", "restart_in_place", "stop"]
    assert verdicts[-1].evidence["progress"] == [5, 5, 5]
    assert "no progress across 2 restarts" in verdicts[-1].reason
    assert "stopping after exit code 1 (attempt 2)" in proc.stderr


def test_a_nan_kills_the_command_at_its_step_and_restarts(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(trace, "--max-restarts", "2", command=scenario_argv("nan-once", counter, 3))
    assert proc.returncode == 0, proc.stderr
    assert counter.read_text() == "2"
    [event], [verdict] = records(trace)
    assert (event.kind, event.failure_class, event.step, event.evidence) == (
        "nonfinite",
        "nonfinite",
        3,
        {"loss": "nan"},
    )
    assert (verdict.action, verdict.evidence["local"]) == ("restart_in_place", "restart")
    [restart] = [s for s in spans(trace) if s.get("phase") == "restart"]
    assert (restart["attempt"], restart["detail"]["reason"]) == (1, "nonfinite")
    assert "killing the command at step 3 (attempt 0): nonfinite" in proc.stderr


def test_a_restart_after_a_nan_skips_the_checkpoints_saved_after_it(tmp_path):
    """The soak's NaN loop: the attempt that hit the NaN saved it (steps 3, 4, ...) before
    the kill; resuming from the newest checkpoint NaNs again, forever. The restart passes
    over them and resumes from step 2, and the job ends; the poisoned steps stay in the store
    as evidence (fails on the code before ckpt/skip.py: every restart NaNs)."""
    from ckpt import CheckpointManager

    trace, out, store = tmp_path / "trace", tmp_path / "attempts.jsonl", tmp_path / "ckpt"
    proc = run_wrapper(
        trace, "--max-restarts", "2", command=scenario_argv("nan-then-checkpoint", store, out, 3, 8)
    )
    assert proc.returncode == 0, proc.stderr
    attempts = [json.loads(line) for line in out.read_text().splitlines()]
    assert attempts[0] == {"attempt": 0, "resumed": 0, "finite": True}
    assert attempts[1] == {"attempt": 1, "resumed": 3, "finite": True}, attempts  # step 2's
    assert len(attempts) == 2
    events, verdicts = records(trace)
    assert [(e.kind, e.step) for e in events] == [("nonfinite", 3)]  # no second NaN
    assert "checkpoints saved from step 3 on by the failed attempt" in proc.stderr
    assert "was saved after a non-finite value at step 3" in proc.stderr  # said by the load
    state = {"w": __import__("torch").zeros(4), "step": -1}
    assert CheckpointManager(str(store)).load(state) == 7  # the new attempt's own saves
    assert state["w"].tolist() == [8.0] * 4  # 3 steps before the NaN, 5 after the restart


def test_a_loss_spike_is_an_event_and_the_job_goes_on(tmp_path):
    trace = tmp_path / "trace"
    proc = run_wrapper(trace, command=scenario_argv("spike", 8, 6))
    assert proc.returncode == 0, proc.stderr
    assert starts(trace) == [0]
    [event], [verdict] = records(trace)
    assert (
        event.kind,
        event.step,
        event.evidence["metric"],
        event.evidence["value"],
        event.evidence["median"],
    ) == ("spike", 6, "loss", 10.0, 1.0)
    assert (verdict.action, verdict.evidence["local"]) == ("continue", "continue")


def test_a_hang_writes_its_event_and_verdict(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(
        trace,
        "--hang-timeout",
        "1",
        "--max-restarts",
        "1",
        command=[
            sys.executable,
            str(Path(__file__).parent / "run_helpers.py"),
            "hang-once",
            str(counter),
        ],
    )
    assert proc.returncode == 0, proc.stderr
    [event], [verdict] = records(trace)
    assert (event.kind, event.rank, event.step, event.evidence["threshold_from"]) == (
        "hang",
        0,
        1,
        "configured",
    )
    assert event.evidence["stacks"]  # the dump of the hung process is named
    # the policy evicts a hung node; alone, the agent restarts it in place
    assert (verdict.action, verdict.nodes, verdict.evidence["local"]) == (
        "replace_and_restart",
        ("testnode",),
        "restart",
    )


def test_output_passes_unchanged_and_only_the_tail_is_kept(tmp_path):
    trace = tmp_path / "trace"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--trace-dir",
            str(trace),
            "--backoff",
            "0",
            "--max-restarts",
            "0",
            "--log-tail-lines",
            "50",
            "--",
            *scenario_argv("output", 5000),
        ],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")},
            "BOOTSEER_NODE": "testnode",
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        },
        capture_output=True,
        timeout=120,
    )
    expected = "".join(f"line {i}\n" for i in range(5000)) + "no newline at the end"
    assert proc.stdout.decode() == expected  # byte for byte
    [event], _ = records(trace)
    assert (event.failure_class, event.evidence["exception"]) == ("python_exception", "ValueError")
    # stdout's last lines first, stderr's last: the traceback ends the evidence (its last 20)
    lines = event.evidence["lines"]
    assert lines[-1] == "ValueError: the last words" and "line 0" not in lines
    assert lines[: lines.index("no newline at the end")][-2:] == ["line 4998", "line 4999"]


def test_the_tail_is_bounded_per_stream_and_stderr_comes_last():
    tail = OutputTail(lines=3, line_bytes=8)
    (r1, w1), (r2, w2) = os.pipe(), os.pipe()
    (out1_r, out1_w), (out2_r, out2_w) = os.pipe(), os.pipe()
    tail.attach(r1, out1_w)
    tail.attach(r2, out2_w)
    os.write(w2, b"Traceback\nKeyError: 'x'\n")  # stderr's lines arrive first
    os.write(w1, b"one\ntwo\nthree\nfour\n" + b"x" * 100 + b"\nlast")
    os.close(w1)
    os.close(w2)
    assert tail.drain(10.0)
    os.close(out1_w)
    os.close(out2_w)
    with os.fdopen(out1_r, "rb") as f1, os.fdopen(out2_r, "rb") as f2:
        assert f1.read() == b"one\ntwo\nthree\nfour\n" + b"x" * 100 + b"\nlast"
        assert f2.read() == b"Traceback\nKeyError: 'x'\n"
    assert tail.lines() == ["four", "x" * 8, "last", "Tracebac", "KeyError"]  # cut at 8 B


def test_verdicts_are_json_lines_in_the_nodes_trace(tmp_path):
    bad = tmp_path / "train.py"
    bad.write_text("import bootseer_no_such_module\n")
    trace = tmp_path / "trace"
    proc = run_wrapper(trace, "--max-restarts", "2", command=[sys.executable, str(bad)])
    assert proc.returncode == 1
    lines = [json.loads(x) for x in (trace / "testnode.jsonl").read_text().splitlines()]
    kinds = [(d.get("record"), d.get("class")) for d in lines if "record" in d]
    assert kinds == [("event", "user_error"), ("verdict", "user_error")]
    assert lines[-1]["evidence"]["event"]["evidence"]["exception"] == "ModuleNotFoundError"


def test_a_learned_hang_threshold_catches_a_stall(tmp_path):
    """hang.timeout_s 0 with a learned threshold: steady 0.2 s steps, then silence."""
    trace = tmp_path / "trace"
    proc = subprocess.run(
        scenario_argv("supervise-learned", trace, 8, 0.2),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 128 + 9, proc.stderr  # killed as hung, no restart allowed
    [event], [verdict] = records(trace)
    assert (event.kind, event.rank, event.step, event.evidence["threshold_from"]) == (
        "hang",
        0,
        7,
        "learned",
    )
    # the threshold came from the steps: max(2 x median step time, 0.5 s)
    assert event.evidence["threshold_s"] >= 0.5
    assert verdict.failure_class == "hang"
