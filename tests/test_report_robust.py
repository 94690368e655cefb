"""``bootseer report`` on the trace of a real ``bootseer run`` whose command crashes, then
hangs, then finishes: the ETTR table, each incident split by cause, the events and verdicts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from robust_helpers import scenario_argv
from run_helpers import run_wrapper, wrapper_env

from bootseer.report_chart import render_ettr
from bootseer.report_robust import CATEGORIES, ettr_chart_data, robust_tables
from bootseer.robust.ettr import compute_ettr, read_ettr

PNG = b"\x89PNG\r\n\x1a\n"


def _adds_up(chart: dict) -> None:
    """The chart's segments cover the wall time once, in order, and agree with the totals,
    the incidents and ETTR."""
    segs = chart["segments"]
    assert segs[0]["start"] == chart["start"] and segs[-1]["end"] == chart["end"]
    for a, b in zip(segs, segs[1:], strict=False):
        assert a["end"] == pytest.approx(b["start"])
    assert sum(chart["totals"].values()) == pytest.approx(chart["wall_s"])
    assert chart["totals"]["productive"] == pytest.approx(chart["productive_s"])
    for inc in chart["incidents"]:
        mine = sum(s["end"] - s["start"] for s in segs if s["incident"] == inc["incident"])
        assert mine == pytest.approx(inc["total_s"])
    assert chart["series"]["points"][-1][1] == pytest.approx(chart["ettr"])


def test_report_shows_ettr_incidents_and_verdicts(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    run = run_wrapper(
        trace,
        "--hang-timeout",
        "1",
        "--dump-wait",
        "2",
        "--max-restarts",
        "2",
        command=scenario_argv("crash-hang-finish", counter),
    )
    assert run.returncode == 0, run.stderr
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bootseer", "report", str(trace), "--out", str(out_dir)],
        env=wrapper_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "ETTR: productive time over wall time" in text
    assert "incidents: unproductive seconds by cause" in text
    assert "robust events and verdicts" in text

    doc = json.loads((out_dir / "report.json").read_text())
    robust = doc["robust"]
    expected = read_ettr([trace], end=robust["ettr"]["end"])
    assert robust["ettr"]["ettr"] == pytest.approx(expected.ettr)
    crash, hang = robust["ettr"]["incidents"]
    assert (crash["attempt"], crash["reason"], crash["class"]) == (0, "crash", "unknown")
    assert (hang["attempt"], hang["reason"], hang["class"]) == (1, "hang", "hang")
    for incident in (crash, hang):  # the parts add up to the incident
        assert sum(incident["split"].values()) == pytest.approx(incident["end"] - incident["start"])
    assert hang["split"]["detection"] > 0 and hang["split"]["localization"] >= 0
    kinds = [(r["record"], r["class"], r.get("action")) for r in robust["records"]]
    assert kinds == [
        ("event", "unknown", None),
        ("verdict", "unknown", "restart_in_place"),
        ("event", "hang", None),
        ("verdict", "hang", "replace_and_restart"),
    ]
    # the table's rows say the same as the JSON
    rows = {
        line.split()[0]: line.split()
        for line in text.splitlines()
        if line.split()[:2] in (["0", "crash"], ["1", "hang"])
    }
    assert rows["1"][2] == "hang" and rows["1"][3] == f"{hang['split']['detection']:.2f}"
    assert rows["0"][2] == "unknown"
    # the ETTR chart and the JSON behind it
    assert f"ettr chart: {out_dir / 'ettr.png'}" in text
    assert (out_dir / "ettr.png").read_bytes()[:8] == PNG
    chart = robust["chart"]
    _adds_up(chart)
    assert chart["ettr"] == pytest.approx(robust["ettr"]["ettr"])
    assert [(i["reason"], i["class"]) for i in chart["incidents"]] == [
        ("crash", "unknown"),
        ("hang", "hang"),
    ]
    assert chart["incidents"][1]["seconds"]["detection"] == pytest.approx(
        hang["split"]["detection"]
    )


def test_the_ettr_chart_data_of_a_constructed_trace() -> None:
    """The constructed trace of test_robust_ettr (ETTR 3370/3600 from its first step): every
    second placed."""
    from test_robust_ettr import CRASH, SPANS

    chart = ettr_chart_data(compute_ettr(SPANS, [CRASH], end=3700.0))
    _adds_up(chart)
    assert chart["totals"] == {
        "productive": 3370.0,
        "detection": 30.0,
        "localization": 5.0,
        "teardown": 17.0,
        "startup": 128.0,
        "recomputation": 50.0,
        "other": 0.0,
    }
    assert list(chart["totals"]) == list(CATEGORIES)
    crash, hang = chart["incidents"]
    assert crash["seconds"] == {
        "detection": 0.0,
        "localization": 0.0,
        "teardown": 10.0,
        "startup": 70.0,
        "recomputation": 50.0,
        "other": 0.0,
    }
    assert (hang["seconds"]["detection"], hang["seconds"]["localization"]) == (30.0, 5.0)
    redo = [s for s in chart["segments"] if s["category"] == "recomputation"]
    assert [(s["start"], s["end"], s["incident"]) for s in redo] == [(1080.0, 1130.0, 0)]
    assert chart["start"] == 100.0  # the job's first step
    assert chart["series"]["points"][-1][2] == pytest.approx(3370 / 3600)


def test_the_ettr_chart_is_drawn(tmp_path) -> None:
    from test_robust_ettr import CRASH, SPANS

    path = render_ettr(
        ettr_chart_data(compute_ettr(SPANS, [CRASH], end=3700.0)), tmp_path / "ettr.png"
    )
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_the_report_shows_the_stack_groups_a_verdict_decided_on() -> None:
    """The evidence, not only the reason: which ranks were where, in Python and in the
    compiled code the native dump saw."""
    healthy = {
        "role": "main",
        "ranks": [0, 1, 2],
        "nodes": ["n0", "n1"],
        "stacks": [["all_reduce (torch/distributed/distributed_c10d.py)"]],
        "native": {
            "rank": 0,
            "pid": 11,
            "stacks": [
                [
                    "? (libc.so.6)",
                    "pthread_cond_wait (libc.so.6)",
                    "c10d::ProcessGroupGloo::AsyncWork::wait (libtorch_cpu.so)",
                    "all_reduce (torch/distributed/distributed_c10d.py)",
                ]
            ],
        },
    }
    stuck = {
        "role": "main",
        "ranks": [3],
        "nodes": ["n1"],
        "stacks": [["sleep_before_all_reduce (job.py)"]],
    }
    verdict = {
        "record": "verdict",
        "time": 10.0,
        "class": "hang",
        "nodes": ["n1"],
        "ranks": [2, 3],
        "action": "replace_and_restart",
        "reason": "rank 3 outside",
        "evidence": {"incident": 4, "localization": {"suspects": [3], "groups": [healthy, stuck]}},
    }
    tables = robust_tables({"records": [verdict]})
    ((header, rows),) = [v for k, v in tables.items() if k.startswith("stack groups")]
    assert header[2] == "group" and header[-1] == "native"
    assert rows == [
        [
            "4",
            "replace_and_restart",
            "healthy",
            "main",
            "0,1,2",
            "n0,n1",
            "all_reduce (torch/distributed/distributed_c10d.py)",
            "pthread_cond_wait (libc.so.6)",
        ],
        [
            "4",
            "replace_and_restart",
            "suspect",
            "main",
            "3",
            "n1",
            "sleep_before_all_reduce (job.py)",
            "-",
        ],
    ]
