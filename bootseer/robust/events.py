"""The records detectors emit and the trace keeps: an :class:`Event` (something was seen)
and a :class:`Verdict` (what is done about it, and why).

Both are one JSON object per line in the node's trace file, beside the spans of
:mod:`bootseer.trace` (whose reader passes them over); the ``record`` key tells them apart::

    {"record": "event", "kind": "crash", "class": "gpu_oom", "node": "node-3", "rank": 5,
     "step": 1200, "time": 1763700000.5, "evidence": {"exit_code": 1, "rule": "gpu_oom",
     "lines": ["torch.OutOfMemoryError: CUDA out of memory. ..."]}}
    {"record": "verdict", "action": "replace_and_restart", "class": "gpu_oom",
     "nodes": ["node-3"], "ranks": [4, 5], "reason": "...", "time": 1763700001.0,
     "evidence": {...}}

``kind`` is one of :data:`KINDS`; ``class`` is a failure class (:mod:`.classify`'s classes,
or ``hang``, ``nonfinite``, ``spike``, ``fail_slow``); ``evidence`` is free-form JSON that
says why (the matched rule and log lines, the stack groups with their ranks, the numbers).
An ``update`` event (class ``version``) is no failure: the version a node started an attempt
on (:mod:`.update`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from striped_fs import open_append

from ..trace import trace_lines

__all__ = ["KINDS", "Event", "Verdict", "metric", "parse_record", "read_records", "write_record"]

KINDS = ("crash", "hang", "nonfinite", "spike", "fail_slow", "health", "update")


def metric(value: Any) -> float | None:
    """A heartbeat metric as a float: numbers, and the strings ``"nan"``, ``"inf"``,
    ``"-inf"`` the client writes for non-finite values; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _finite_or_text(value: Any) -> Any:
    """JSON has no NaN: evidence numbers that are not finite become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite_or_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_text(v) for v in value]
    return value


@dataclass(frozen=True)
class Event:
    """Something a detector saw on a node (or a rank of it)."""

    kind: str
    failure_class: str
    node: str | None = None
    rank: int | None = None
    step: int | None = None
    time: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}: use one of {', '.join(KINDS)}")

    def to_json(self) -> str:
        doc = {
            "record": "event",
            "kind": self.kind,
            "class": self.failure_class,
            "node": self.node,
            "rank": self.rank,
            "step": self.step,
            "time": self.time,
            "evidence": _finite_or_text(self.evidence),
        }
        return json.dumps(doc, separators=(",", ":"), default=str)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Event:
        return cls(
            kind=str(doc["kind"]),
            failure_class=str(doc["class"]),
            node=doc.get("node"),
            rank=doc.get("rank"),
            step=doc.get("step"),
            time=float(doc.get("time", 0)),
            evidence=dict(doc.get("evidence") or {}),
        )


@dataclass(frozen=True)
class Verdict:
    """A decision: the action for a failure class, whom it targets, and the evidence."""

    action: str
    failure_class: str
    nodes: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    reason: str = ""
    time: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {
            "record": "verdict",
            "action": self.action,
            "class": self.failure_class,
            "nodes": list(self.nodes),
            "ranks": list(self.ranks),
            "reason": self.reason,
            "time": self.time,
            "evidence": _finite_or_text(self.evidence),
        }
        return json.dumps(doc, separators=(",", ":"), default=str)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Verdict:
        return cls(
            action=str(doc["action"]),
            failure_class=str(doc["class"]),
            nodes=tuple(doc.get("nodes") or ()),
            ranks=tuple(doc.get("ranks") or ()),
            reason=str(doc.get("reason", "")),
            time=float(doc.get("time", 0)),
            evidence=dict(doc.get("evidence") or {}),
        )


def parse_record(line: str) -> Event | Verdict:
    """One trace line that holds an event or a verdict (ValueError otherwise)."""
    doc = json.loads(line)
    if not isinstance(doc, dict) or doc.get("record") not in ("event", "verdict"):
        raise ValueError("not an event or verdict record")
    try:
        return (Event if doc["record"] == "event" else Verdict).from_doc(doc)
    except KeyError as exc:
        raise ValueError(f"{doc['record']} record lacks {exc.args[0]}") from None


def write_record(path: str | os.PathLike, record: Event | Verdict) -> None:
    """Append one record to a trace file (one line, flushed: a kill loses at most it)."""
    path = Path(path)
    with open_append(path.parent, path.name) as f:  # made 0700 or checked, no link followed
        f.write(record.to_json() + "\n")


def read_records(paths: list[str | os.PathLike]) -> tuple[list[Event | Verdict], list[str]]:
    """The events and verdicts under these trace files or directories, in file order, and
    a warning per record line that could not be read."""
    records: list[Event | Verdict] = []
    warnings: list[str] = []
    for file, n, line in trace_lines(paths):
        if not line.startswith('{"record":'):
            continue
        try:
            records.append(parse_record(line))
        except (ValueError, TypeError) as exc:
            warnings.append(f"{file}:{n}: skipped ({exc})")
    return records, warnings
