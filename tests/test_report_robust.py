"""``bootseer report`` on the trace of a real ``bootseer run`` whose command crashes, then
hangs, then finishes: the ETTR table, each incident split by cause, the events and verdicts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from robust_helpers import scenario_argv
from run_helpers import run_wrapper, wrapper_env

from bootseer.robust.ettr import read_ettr


def test_report_shows_ettr_incidents_and_verdicts(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    run = run_wrapper(trace, "--hang-timeout", "1", "--dump-wait", "2", "--max-restarts", "2",
                      command=scenario_argv("crash-hang-finish", counter))
    assert run.returncode == 0, run.stderr
    out_dir = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bootseer", "report", str(trace), "--out",
                           str(out_dir)], env=wrapper_env(), capture_output=True, text=True,
                          timeout=120)
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
        assert sum(incident["split"].values()) == pytest.approx(incident["end"] -
                                                                incident["start"])
    assert hang["split"]["detection"] > 0 and hang["split"]["localization"] >= 0
    kinds = [(r["record"], r["class"], r.get("action")) for r in robust["records"]]
    assert kinds == [("event", "unknown", None), ("verdict", "unknown", "restart_in_place"),
                     ("event", "hang", None), ("verdict", "hang", "replace_and_restart")]
    # the table's rows say the same as the JSON
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split()[:2] in (["0", "crash"], ["1", "hang"])}
    assert rows["1"][2] == "hang" and rows["1"][3] == f"{hang['split']['detection']:.2f}"
    assert rows["0"][2] == "unknown"
