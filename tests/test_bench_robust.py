"""The soak benchmark's own logic on constructed records (no cluster): the seeded schedule,
ETTR from a step log, and how the peer's detection and localization are read from torchrun's
time-stamped output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from robust_faults import CLASSES, NODE_SIDE, Fault, schedule  # noqa: E402
from robust_measure import ettr_of_steps, measure  # noqa: E402


def test_the_schedule_is_seeded_and_meets_every_class_before_a_repeat() -> None:
    a = schedule(17, 60, 180, 4, 2)
    assert [(f.kind, f.at_s, f.rank, f.node) for f in a] == [
        (f.kind, f.at_s, f.rank, f.node) for f in schedule(17, 60, 180, 4, 2)
    ]
    assert [f.kind for f in a] != [f.kind for f in schedule(18, 60, 180, 4, 2)]
    assert sorted(f.kind for f in a[: len(CLASSES)]) == sorted(CLASSES)
    assert all(0 <= f.rank < 8 for f in a if f.rank is not None)
    assert all(f.node is not None and f.rank is None for f in a if f.kind in NODE_SIDE)
    gaps = [b.at_s - x.at_s for x, b in zip(a, a[1:], strict=False)]
    assert all(90 <= g <= 270 for g in gaps) and a[-1].at_s < 60 * 60
    with pytest.raises(ValueError, match=r"unknown fault class\(es\) \['meteor'\]"):
        schedule(1, 5, 30, 4, 2, classes=("sigkill", "meteor"))
    crashes = schedule(17, 10, 30, 4, 2, classes=("sigkill", "exception"))
    assert {f.kind for f in crashes} == {"sigkill", "exception"}


def test_bench_robust_refuses_an_unknown_class_before_starting_anything(capsys) -> None:
    import bench_robust

    with pytest.raises(SystemExit) as done:
        bench_robust.main(["--classes", "sigkill,meteor"])
    assert done.value.code == 2
    assert "--classes 'sigkill,meteor': choose from sigkill, exception" in capsys.readouterr().err


def _steps(out: Path, records: list[tuple[int, float, int]]) -> list[dict]:
    rows = [{"step": s, "time": t, "pid": p, "loss": 0.0, "attempt": "0"} for s, t, p in records]
    (out / "steps-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_ettr_from_the_step_log_counts_only_new_steps(tmp_path: Path) -> None:
    # pid 1 steps 0..5 at 1 s each (t 10..15); killed; pid 2 resumes at step 4 at t 30 and
    # steps to 7 at t 33: steps 4 and 5 are recomputed, 6 and 7 new (the first step of a
    # process has no gap, so it is not counted)
    log0 = _steps(
        tmp_path, [(s, 10.0 + s, 1) for s in range(6)] + [(4 + i, 30.0 + i, 2) for i in range(4)]
    )
    got = ettr_of_steps(log0, end=35.0)  # bootseer.robust.ettr.ettr_from_steps
    assert got["productive_s"] == pytest.approx(5.0 + 2.0)
    assert got["wall_s"] == pytest.approx(25.0)
    assert got["ettr"] == pytest.approx(7.0 / 25.0) and got["steps"] == 8


def test_the_benchmarks_ettr_is_bootseer_reports(tmp_path: Path) -> None:
    """One accounting: the soak's figure for bootseer's run is what ``bootseer report --end
    END TRACE`` prints for its traces, and its result names that command. Before, the
    benchmark read the traces from rank 0's first step while the report counted from the
    first command's start (and had no --end): 90.4% against 88.4% for one soak run."""
    import subprocess

    from test_robust_ettr import CRASH, SPANS

    from bootseer.robust.events import write_record

    (tmp_path / "trace").mkdir()
    trace = tmp_path / "trace" / "node-1.jsonl"
    trace.write_text("".join(s.to_json() + "\n" for s in SPANS))
    write_record(trace, CRASH)
    _steps(tmp_path, [(s, 100.0 + s, 1) for s in range(900)])
    got = measure(tmp_path, "bootseer", [], end=3700.0, hang_timeout_s=10)["ettr"]
    assert got["ettr"] == pytest.approx(3370 / 3600) and got["input"] == "traces"
    assert got["report_command"] == f"bootseer report --end 3700.000 {tmp_path / 'trace'}"
    out = tmp_path / "report"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "report",
            "--end",
            "3700",
            str(tmp_path / "trace"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads((out / "report.json").read_text())["robust"]["ettr"]
    assert printed["ettr"] == pytest.approx(got["ettr"])
    assert "93.6%" in done.stdout  # the ETTR table: 3370 of 3600 s
    peer = measure(tmp_path, "peer", [], end=1100.0, hang_timeout_s=10)["ettr"]
    assert (peer["input"], peer["wall_s"], peer["productive_s"]) == ("step log", 1000.0, 899.0)


def test_the_peer_is_detected_when_torchrun_notices_and_named_by_the_failed_pid(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "faults").mkdir()
    _steps(
        tmp_path,
        [(s, 100.0 + s, 11) for s in range(5)] + [(3 + i, 140.0 + i, 21) for i in range(3)],
    )
    (tmp_path / "starts.jsonl").write_text(
        "".join(
            json.dumps({"rank": r, "pid": p, "time": 90.0}) + "\n"
            for r, p in ((0, 11), (3, 13), (0, 21))
        )
    )
    (tmp_path / "logs" / "node1.log").write_text(
        "103.000 [rank3]: step 3\n"
        "104.750 E1124 torch/distributed/elastic/multiprocessing/api.py:1003] failed "
        "(exitcode: -9) local_rank: 1 (pid: 13) of binary: python\n"
    )
    fault = Fault("f01", "sigkill", 3.0, rank=3)
    fault.injected = {"time": 104.2, "kind": "sigkill", "host": "node1", "rank": 3}
    got = measure(tmp_path, "peer", [fault], end=200.0, hang_timeout_s=10)
    row = got["faults"][0]
    assert row["detection_s"] == pytest.approx(0.55)
    assert row["named"] is True and row["peer_failed"] == {
        "launcher": "node1",
        "rank": 3,
        "exitcode": -9,
    }
    assert row["evicted"] == [] and row["restart_s"] == pytest.approx(140.0 - 104.75)
    assert row["resumed_step"] == 3 and row["recomputed"] == 2  # steps 3 and 4 again
    assert row["targets"] == {
        "detected_within_2s": True,
        "named": True,
        "evicted_only_its_group": True,
    }
    assert got["classes"]["sigkill"]["detection_p50_s"] == pytest.approx(0.55)
