"""``bootseer.heartbeat(step, loss=, grad_norm=)``: metrics in the heartbeat file, NaN/Inf
written at once (past the rate limit) and kept, and the old call unchanged."""

from __future__ import annotations

import json

import pytest
import torch

import bootseer
from bootseer import client


@pytest.fixture
def control(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOTSEER_CONTROL_DIR", str(tmp_path))
    monkeypatch.delenv("BOOTSEER_TRACE_DIR", raising=False)  # no SIGUSR1 hook in pytest
    monkeypatch.setattr(client, "_status_pid", 0)  # nor exit hooks (the status record)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setattr(client, "_last_heartbeat", float("-inf"))
    monkeypatch.setattr(client, "_first_nonfinite", None)
    clock = [1000.0]
    monkeypatch.setattr(client, "_clock", lambda: clock[0])
    return tmp_path, clock


def beat(tmp_path):
    return json.loads((tmp_path / "heartbeat-2").read_text())


def test_metrics_are_written_with_the_step(control):
    tmp_path, _ = control
    bootseer.heartbeat(7, loss=torch.tensor(2.5), grad_norm=0.75)
    doc = beat(tmp_path)
    assert (doc["step"], doc["rank"], doc["loss"], doc["grad_norm"]) == (7, 2, 2.5, 0.75)
    assert "first_nonfinite" not in doc


def test_the_old_call_writes_no_metrics(control):
    tmp_path, _ = control
    bootseer.heartbeat(3)
    assert set(beat(tmp_path)) == {"step", "time", "pid", "rank"}


def test_nan_skips_the_rate_limit_and_stays_visible(control):
    tmp_path, clock = control
    bootseer.heartbeat(1, loss=1.0)
    bootseer.heartbeat(2, loss=1.1)  # within the second: dropped
    assert beat(tmp_path)["step"] == 1
    bootseer.heartbeat(3, loss=float("nan"), grad_norm=float("-inf"))  # at once
    doc = beat(tmp_path)
    assert (doc["step"], doc["loss"], doc["grad_norm"]) == (3, "nan", "-inf")
    json.loads((tmp_path / "heartbeat-2").read_text(), parse_constant=pytest.fail)  # strict
    clock[0] += 1.0
    bootseer.heartbeat(4, loss=0.9)
    doc = beat(tmp_path)
    assert (doc["step"], doc["loss"]) == (4, 0.9)
    assert doc["first_nonfinite"] == {"step": 3, "loss": "nan", "grad_norm": "-inf"}


def test_a_bad_metric_never_raises(control):
    tmp_path, _ = control
    bootseer.heartbeat(5, loss="not a number", grad_norm=torch.ones(3))  # not scalars
    assert set(beat(tmp_path)) == {"step", "time", "pid", "rank"}
