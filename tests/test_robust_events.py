"""Event and verdict records: JSON round trip, kept in the trace beside the spans, which the
span reader passes over without a warning."""

from __future__ import annotations

import json

import pytest

from bootseer.robust.events import Event, Verdict, metric, read_records, write_record
from bootseer.trace import Span, TraceWriter, read_traces


def test_records_round_trip_and_share_the_trace_with_spans(tmp_path):
    trace = TraceWriter(tmp_path, node="node-1")
    trace.record("command_start", 10.0, 10.5)
    crash = Event(
        "crash",
        "python_exception",
        node="node-1",
        rank=3,
        step=120,
        time=11.0,
        evidence={"exception": "KeyError", "lines": ["KeyError: 'x'"]},
    )
    spike = Event(
        "spike",
        "spike",
        node="node-1",
        rank=0,
        step=7,
        time=11.5,
        evidence={"loss": float("inf"), "median": 2.0},
    )
    verdict = Verdict(
        "restart_in_place",
        "python_exception",
        nodes=("node-1",),
        ranks=(3,),
        reason="transient",
        time=12.0,
        evidence={"event": 0},
    )
    for record in (crash, spike, verdict):
        write_record(trace.path, record)
    with open(trace.path, "a") as f:
        f.write('{"record":"event","kind":"cra')  # a torn last line of a killed agent

    spans, span_warnings = read_traces([tmp_path])
    assert [s.phase for s in spans] == ["command_start"]
    assert span_warnings == []  # records are not spans; their reader warns about the torn one
    records, warnings = read_records([tmp_path])
    assert records[0] == crash and records[2] == verdict
    assert records[1].evidence == {"loss": "inf", "median": 2.0}  # strict JSON, read back
    assert metric(records[1].evidence["loss"]) == float("inf")
    assert len(warnings) == 1 and ":5: skipped" in warnings[0]
    line = trace.path.read_text().splitlines()[2]
    json.loads(line, parse_constant=pytest.fail)
    assert json.loads(line)["class"] == "spike"


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown event kind 'crashed': use one of crash"):
        Event("crashed", "unknown")


def test_metric_reads_numbers_and_the_clients_strings():
    assert [metric(v) for v in (1, 2.5, "-inf", "x", None, True)] == [
        1.0,
        2.5,
        float("-inf"),
        None,
        None,
        None,
    ]
    assert metric("nan") != metric("nan")  # a NaN


def test_spans_alone_still_read_as_before(tmp_path):
    (tmp_path / "n.jsonl").write_text(Span("n", 0, "first_step", 1.0, 2.0).to_json() + "\n")
    spans, warnings = read_traces([tmp_path])
    assert [(s.phase, s.seconds) for s in spans] == [("first_step", 1.0)] and warnings == []
