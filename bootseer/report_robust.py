"""The robust-training part of ``bootseer report``: ETTR from the traces, each incident's
unproductive time split by cause, and the agent's events and verdicts.

Why a separate module: :mod:`bootseer.report` is about startup phases; this reads the same
traces through :mod:`bootseer.robust.ettr` and only hands tables (title -> header, rows) and
a JSON-ready dict to it, so the report's own tables and JSON keep their shape. The ETTR is the project's one accounting
(:mod:`bootseer.robust.ettr`: from the job's first step to its end); the soak benchmark
prints the same.

The chart (``ettr.png``, :func:`bootseer.report_chart.render_ettr`) is drawn from
``section["chart"]`` (:func:`ettr_chart_data`), which ``report.json`` keeps: the job's wall
time from its first step cut into segments (productive, each incident's parts,
recomputation) that add up to the wall time, each incident's split, and the ETTR series (cumulative and over
the sliding hour).

Usage::

    section = robust_section(spans, records, end=None)  # {} when the trace holds no run
    for title, (header, rows) in robust_tables(section).items(): ...
    section["chart"]["segments"][0]              # {"start", "end", "category", "part", ...}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .robust.ettr import EttrReport, compute_ettr
from .robust.events import Event, Verdict
from .robust.stacks import is_native_frame
from .trace import Span

__all__ = ["CATEGORIES", "MAX_RECORD_ROWS", "ettr_chart_data", "robust_section", "robust_tables"]

MAX_RECORD_ROWS = 40
SERIES_POINTS = 300  # points of the ETTR series in the chart
_PARTS = ("detection", "localization", "teardown")
#: the chart's categories of wall time, in drawing order
CATEGORIES = (
    "productive",
    "detection",
    "localization",
    "teardown",
    "startup",
    "recomputation",
    "other",
)


def robust_section(
    spans: Sequence[Span], records: Sequence[Event | Verdict], *, end: float | None = None
) -> dict[str, Any]:
    """ETTR (cumulative and over the last hour) with its incidents, and the records, as JSON;
    ``{}`` when the spans hold no ``bootseer run`` job (warmup alone, say). ``end``: the
    job's end (default: the last time the traces hold)."""
    run = [s for s in spans if not (s.detail or {}).get("warmup")]
    if not any(s.phase == "first_step" for s in run) and not records:
        return {}
    doc: dict[str, Any] = {"records": [json.loads(r.to_json()) for r in records]}
    try:
        ettr = compute_ettr(run, records, end=end)
    except ValueError:  # records without spans: nothing to measure
        return doc
    doc["ettr"] = {**ettr.to_dict(), "last_hour": ettr.sliding(3600.0, 60.0)[-1][1]}
    doc["chart"] = ettr_chart_data(ettr)
    return doc


def _category(part: str) -> str:
    return part if part in (*_PARTS, "other") else "startup"


def ettr_chart_data(ettr: EttrReport, points: int = SERIES_POINTS) -> dict[str, Any]:
    """What the ETTR chart shows, as JSON: ``segments`` covering the job's wall time once
    (productive time, each incident's parts in order, the recomputation after it, ``other``
    for what no span covers), ``incidents`` (each one's seconds
    by category), ``series`` (time since the start, cumulative ETTR, ETTR of the sliding hour)
    and ``totals`` (seconds by category; they add up to ``wall_s``)."""
    segments: list[dict[str, Any]] = [
        {"start": a, "end": b, "category": "productive", "part": "productive", "incident": None}
        for a, b in ettr.productive
    ]
    incidents = []
    for n, inc in enumerate(ettr.incidents):
        t, by_category = inc.start, dict.fromkeys(CATEGORIES[1:], 0.0)
        for part, seconds in inc.split().items():
            end = min(t + seconds, inc.end)
            if end > t:
                segments.append(
                    {
                        "start": t,
                        "end": end,
                        "category": _category(part),
                        "part": part,
                        "incident": n,
                    }
                )
                by_category[_category(part)] += end - t
            t = end
        later = [a for a, _ in ettr.productive if a >= inc.end]
        if inc.recomputation_s and later:  # productive again after the steps are redone
            end = min(inc.end + inc.recomputation_s, min(later))
            if end > inc.end:
                segments.append(
                    {
                        "start": inc.end,
                        "end": end,
                        "category": "recomputation",
                        "part": "recomputation",
                        "incident": n,
                    }
                )
                by_category["recomputation"] = end - inc.end
        incidents.append(
            {
                "incident": n,
                "attempt": inc.attempt,
                "reason": inc.reason,
                "class": inc.failure_class,
                "start": inc.start,
                "end": inc.end,
                "seconds": by_category,
                "total_s": sum(by_category.values()),
            }
        )
    segments.sort(key=lambda g: g["start"])
    filled, t = [], ettr.start
    for seg in segments:  # what no span covers: gaps
        if seg["start"] > t:
            filled.append(
                {
                    "start": t,
                    "end": seg["start"],
                    "category": "other",
                    "part": "other",
                    "incident": None,
                }
            )
        filled.append(seg)
        t = max(t, seg["end"])
    if ettr.end > t:
        filled.append(
            {"start": t, "end": ettr.end, "category": "other", "part": "other", "incident": None}
        )
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for seg in filled:
        totals[seg["category"]] += seg["end"] - seg["start"]
    step = max(ettr.wall_s / points, 1e-3)
    hour = dict(ettr.sliding(3600.0, step))
    series = [[t - ettr.start, ettr.window(ettr.start, t), v] for t, v in sorted(hour.items())]
    return {
        "start": ettr.start,
        "end": ettr.end,
        "wall_s": ettr.wall_s,
        "productive_s": ettr.productive_s,
        "ettr": ettr.ettr,
        "segments": filled,
        "incidents": incidents,
        "totals": totals,
        "series": {"columns": ["t_s", "cumulative", "last_hour"], "points": series},
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def robust_tables(section: dict[str, Any]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The tables of :func:`robust_section`'s dict (empty when it is)."""
    tables: dict[str, tuple[list[str], list[list[str]]]] = {}
    ettr = section.get("ettr")
    if ettr:
        tables["ETTR: productive time over wall time"] = (
            ["wall s", "productive s", "ETTR", "last hour", "incidents"],
            [
                [
                    _s(ettr["wall_s"]),
                    _s(ettr["productive_s"]),
                    f"{ettr['ettr']:.1%}",
                    f"{ettr['last_hour']:.1%}",
                    str(len(ettr["incidents"])),
                ]
            ],
        )
        if ettr["incidents"]:
            rows = []
            for i in ettr["incidents"]:
                split = i["split"]
                startup = sum(v for k, v in split.items() if k not in _PARTS)
                total = i["end"] - i["start"] + (i["recomputation_s"] or 0.0)
                rows.append(
                    [
                        str(i["attempt"]),
                        i["reason"],
                        i["class"] or "-",
                        *(_s(split[k]) for k in _PARTS),
                        _s(startup),
                        _s(i["recomputation_s"]),
                        _s(total),
                    ]
                )
            tables[
                "incidents: unproductive seconds by cause (startup = backoff, phases and "
                "the way to the first step; recompute '-' = unknown)"
            ] = (["attempt", "reason", "class", *_PARTS, "startup", "recompute", "total"], rows)
    records = section.get("records") or []
    if records:
        t0 = min(r["time"] for r in records)
        shown = records[-MAX_RECORD_ROWS:]
        more = f", the last {len(shown)} of {len(records)}" if len(shown) < len(records) else ""
        tables[f"robust events and verdicts (seconds from the first{more})"] = (
            ["t", "record", "class", "node", "rank", "step", "what"],
            [
                [
                    _s(r["time"] - t0),
                    r["record"] if r["record"] == "verdict" else r["kind"],
                    r["class"],
                    str(r.get("node") or (",".join(r.get("nodes") or []) or "-")),
                    _rank(r),
                    "-" if r.get("step") is None else str(r["step"]),
                    _what(r),
                ]
                for r in shown
            ],
        )
        if groups := _group_rows(records):
            tables["stack groups the verdicts decided on (top frame; native: py-spy --native)"] = (
                ["incident", "verdict", "group", "role", "ranks", "nodes", "python", "native"],
                groups,
            )
    return tables


MAX_GROUP_VERDICTS = 10


def _top(stacks: list[list[str]], *, native: bool) -> str:
    """Where a group is: the top frame of its first thread that has one of the kind asked
    (native: the innermost named frame of compiled code; Python: the innermost frame)."""
    for thread in stacks:
        for frame in thread:
            if not native or (is_native_frame(frame) and not frame.startswith("? (")):
                return frame[:70]
    return "-"


def _group_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """One row per stack group of the last verdicts that had dumps: the evidence the
    controller decided on (which ranks were where, in Python and in compiled code)."""
    rows = []
    with_groups = [
        r
        for r in records
        if r["record"] == "verdict"
        and (r.get("evidence") or {}).get("localization", {}).get("groups")
    ]
    for r in with_groups[-MAX_GROUP_VERDICTS:]:
        loc = r["evidence"]["localization"]
        suspects = set(loc.get("suspects") or [])
        for g in loc["groups"]:
            state = "suspect" if suspects & set(g.get("ranks") or []) else "healthy"
            native = (g.get("native") or {}).get("stacks") or []
            rows.append(
                [
                    str(r["evidence"].get("incident", "-")),
                    r["action"],
                    state,
                    g.get("role", "main"),
                    ",".join(map(str, g.get("ranks") or [])),
                    ",".join(g.get("nodes") or []) or "-",
                    _top(g.get("stacks") or [], native=False),
                    _top(native, native=True),
                ]
            )
    return rows


def _rank(record: dict[str, Any]) -> str:
    if record["record"] == "verdict":
        return ",".join(map(str, record.get("ranks") or [])) or "-"
    return "-" if record.get("rank") is None else str(record["rank"])


def _what(record: dict[str, Any]) -> str:
    if record["record"] == "verdict":
        local = record.get("evidence", {}).get("local")
        here = f" (here: {local})" if local and local != record["action"] else ""
        return f"{record['action']}{here}: {record['reason']}"[:120]
    ev = record.get("evidence") or {}
    for key in ("exception", "signal", "message", "check", "metric"):
        if ev.get(key):
            return str(ev[key])[:120]
    return ", ".join(
        f"{k}={v}" for k, v in ev.items() if v is not None and not isinstance(v, list | dict)
    )[:120]
