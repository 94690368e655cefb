"""The PNG of ``bootseer report``: a stacked bar per node/rank of its last attempt's phases.

matplotlib is imported here, lazily and with the Agg backend, so that the CLI's other commands
(and a headless node) never pay for it or need a display.

Each bar is the last attempt's wall time, backoff included, split between its phases: a stretch
goes to the phase that ended it (:func:`bootseer.report.wall_segments`). The startup phases
overlap (environment and checkpoint prefetch run concurrently), so stacking their durations
would count time twice and make the bar longer than the start-up; this way a bar that reaches
the first step is exactly the time to first step, and the slowest phase on the way owns most of
it. The full durations of each phase are in the table and the JSON.

The timeline (:func:`render_timeline`) is the node-level view of one incident (a start or a
restart, :mod:`bootseer.report_nodes`): x is the time since the failure, one bar per node, its
phases as segments in time order with the gaps where nothing ran left empty; the node that
decided the job's first step is outlined in black with its label marked, and a dashed line
marks the first step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .report import Report, WorkerPhases, worker_label
from .report_nodes import Incident, NodeTimeline
from .report_order import PHASE_ORDER, phase_key

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_BARS = 60
WIDTH_IN = 10.0
DPI = 100


def chart_size(bars: int) -> tuple[int, int]:
    """(width, height) in pixels of a chart of this many bars."""
    return int(WIDTH_IN * DPI), int(_height_in(bars) * DPI)


def _height_in(bars: int) -> float:
    return max(3.0, 1.6 + 0.28 * bars)


def chart_rows(report: Report, max_bars: int = MAX_BARS) -> tuple[list[WorkerPhases], int]:
    """The rows drawn (all of them in node order, or the slowest ``max_bars``), and how many
    there were."""
    rows = list(report.last_attempt)
    if len(rows) <= max_bars:
        return rows, len(rows)
    return sorted(rows, key=lambda r: sum(r.wall.values()), reverse=True)[:max_bars], len(rows)


def _pyplot():
    import logging

    import matplotlib

    matplotlib.use("Agg", force=True)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # no font-cache chatter
    import matplotlib.pyplot as plt

    return plt


def _colors(plt, phases: list[str]) -> dict[str, Any]:
    """One colour per phase, the same in both charts (PHASE_ORDER first)."""
    cmap = plt.get_cmap("tab10")
    extra = [p for p in phases if p not in PHASE_ORDER and p != "untraced"]
    colors = {
        p: cmap(
            PHASE_ORDER.index(p) if p in PHASE_ORDER else (len(PHASE_ORDER) + extra.index(p)) % 10
        )
        for p in phases
        if p != "untraced"
    }
    colors["untraced"] = "lightgrey"
    return colors


def timeline_rows(incident: Incident, max_bars: int = MAX_BARS) -> tuple[list[NodeTimeline], int]:
    """The nodes drawn: all in node order, or the ``max_bars`` last ready (not ready first),
    the critical node always among them; and how many there were."""
    rows = list(incident.timeline)
    if len(rows) <= max_bars:
        return rows, len(rows)
    late = sorted(rows, key=lambda t: (t.first_step_s is not None, -(t.first_step_s or 0.0)))
    return late[:max_bars], len(rows)


def timeline_figure(
    report: Report, attempt: int | None = None, *, max_bars: int = MAX_BARS
) -> Figure:
    """The timeline of one incident (default: the last) as a matplotlib Figure: the caller
    saves or inspects it and closes it. Raises ValueError when there is no such incident."""
    incident = report.incident(attempt)
    if incident is None:
        raise ValueError(
            f"no incident {'at all' if attempt is None else attempt} in the "
            f"report (incidents: {[i.attempt for i in report.incidents]})"
        )
    plt = _pyplot()
    rows, total = timeline_rows(incident, max_bars)
    phases = sorted({seg.phase for r in rows for seg in r.segments}, key=phase_key)
    colors = _colors(plt, phases)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, _height_in(len(rows))), dpi=DPI)
    ys = {r.node: y for y, r in enumerate(rows)}
    for phase in phases:
        segs = [(ys[r.node], seg) for r in rows for seg in r.segments if seg.phase == phase]
        ax.barh(
            [y for y, _ in segs],
            [seg.end - seg.start for _, seg in segs],
            left=[seg.start for _, seg in segs],
            color=colors[phase],
            label=phase,
            height=0.7,
            gid=f"phase:{phase}",
        )
    if incident.critical_node in ys:
        y = ys[incident.critical_node]
        for i, seg in enumerate(incident.critical_path):
            ax.barh(
                [y],
                [seg.end - seg.start],
                left=[seg.start],
                height=0.7,
                fill=False,
                edgecolor="black",
                linewidth=1.6,
                gid="critical",
                label="critical path" if i == 0 else None,
            )
    if incident.wall_s is not None:
        ax.axvline(
            incident.wall_s,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"first step ({incident.wall_s:.2f} s)",
            gid="first_step",
        )
    labels = [
        r.node + (" (critical path)" if r.node == incident.critical_node else "") for r in rows
    ]
    ax.set_yticks(list(range(len(rows))), labels, fontsize=8)
    ax.invert_yaxis()
    since = "the failure" if incident.kind == "restart" else "the start"
    ax.set_xlabel(f"seconds since {since}; each stretch given to the phase that ended it")
    ax.set_ylabel("node")
    shown = f"last ready {len(rows)} of {total}" if len(rows) < total else f"{total}"
    ax.set_title(
        f"{incident.kind} (attempt {incident.attempt}): nodes' phases ({shown}), "
        f"critical path: {incident.critical_node or 'none reached the first step'}",
        fontsize=9,
    )
    if rows:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(
        left=0.2,
        right=0.75,
        top=1 - 0.5 / _height_in(len(rows)),
        bottom=0.6 / _height_in(len(rows)),
    )
    return fig


def render_timeline(
    report: Report, path: str | os.PathLike, attempt: int | None = None, *, max_bars: int = MAX_BARS
) -> Path:
    """Writes the timeline PNG of one incident (default: the last) and returns its path."""
    fig = timeline_figure(report, attempt, max_bars=max_bars)
    try:
        out = Path(path)
        fig.savefig(out, format="png")
    finally:
        _pyplot().close(fig)
    return out


def render_chart(report: Report, path: str | os.PathLike, *, max_bars: int = MAX_BARS) -> Path:
    """Writes the PNG and returns its path."""
    plt = _pyplot()
    rows, total = chart_rows(report, max_bars)
    phases = sorted({p for r in rows for p in r.wall}, key=phase_key)
    colors = _colors(plt, phases)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, _height_in(len(rows))), dpi=DPI)
    try:
        labels = [
            worker_label(r.node, r.rank) + (f" (attempt {r.attempt})" if r.attempt else "")
            for r in rows
        ]
        ys = list(range(len(rows)))
        left = [0.0] * len(rows)
        for phase in phases:
            widths = [r.wall.get(phase, 0.0) for r in rows]
            label = "first_step (command\nuntil ready)" if phase == "first_step" else phase
            ax.barh(ys, widths, left=left, color=colors[phase], label=label, height=0.7)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_yticks(ys, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds of wall time, each stretch given to the phase that ended it")
        ax.set_ylabel("node/rank")
        shown = f"slowest {len(rows)} of {total}" if len(rows) < total else f"{total}"
        ax.set_title(f"Startup phases of the last attempt, per node/rank ({shown})")
        if rows:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        fig.subplots_adjust(
            left=0.17,
            right=0.75,
            top=1 - 0.5 / _height_in(len(rows)),
            bottom=0.6 / _height_in(len(rows)),
        )
        out = Path(path)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out


#: colours of the ETTR chart's categories (report_robust.CATEGORIES)
ETTR_COLORS = {
    "productive": "tab:green",
    "detection": "tab:red",
    "localization": "tab:orange",
    "teardown": "tab:purple",
    "startup": "tab:blue",
    "recomputation": "tab:brown",
    "other": "lightgrey",
}


def render_ettr(data: dict[str, Any], path: str | os.PathLike) -> Path:
    """Writes the ETTR chart of ``bootseer report`` (``robust.chart`` of report.json,
    :func:`bootseer.report_robust.ettr_chart_data`): the job's wall time as one bar of
    productive and unproductive stretches, each incident's seconds by cause, and ETTR over
    time (cumulative and over the sliding hour)."""
    plt = _pyplot()
    incidents = data["incidents"]
    fig, (top, mid, low) = plt.subplots(
        3,
        1,
        figsize=(WIDTH_IN, 3.2 + 0.3 * max(len(incidents), 1)),
        dpi=DPI,
        gridspec_kw={"height_ratios": [1, max(len(incidents), 1) * 0.6 + 0.6, 2]},
    )
    try:
        t0 = data["start"]
        seen: set[str] = set()
        for seg in data["segments"]:
            cat = seg["category"]
            top.barh(
                [0],
                [seg["end"] - seg["start"]],
                left=[seg["start"] - t0],
                height=0.6,
                color=ETTR_COLORS.get(cat, "black"),
                label=None if cat in seen else cat,
                gid=f"segment:{cat}",
            )
            seen.add(cat)
        top.set_yticks([])
        top.set_xlim(0, max(data["wall_s"], 1e-9))
        top.set_title(
            f"ETTR {data['ettr']:.1%}: productive {data['productive_s']:.1f} s of "
            f"{data['wall_s']:.1f} s wall time, {len(incidents)} incident(s)",
            fontsize=9,
        )
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.3), fontsize=7)
        ys = list(range(len(incidents)))
        left = [0.0] * len(incidents)
        for cat in (c for c in ETTR_COLORS if c != "productive"):
            widths = [i["seconds"].get(cat, 0.0) for i in incidents]
            mid.barh(
                ys, widths, left=left, color=ETTR_COLORS[cat], height=0.6, gid=f"incident:{cat}"
            )
            left = [a + b for a, b in zip(left, widths, strict=True)]
        mid.set_yticks(
            ys,
            [f"{i['attempt']}: {i['reason']} ({i['class'] or '-'})" for i in incidents],
            fontsize=7,
        )
        mid.invert_yaxis()
        mid.set_xlabel("unproductive seconds per incident (failed attempt)", fontsize=8)
        points = data["series"]["points"]
        low.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            color="black",
            label="cumulative",
            gid="series:cumulative",
        )
        low.plot(
            [p[0] for p in points],
            [p[2] for p in points],
            color="tab:green",
            linestyle="--",
            label="last hour (sliding)",
            gid="series:last_hour",
        )
        low.set_ylim(0, 1.05)
        low.set_xlim(0, max(data["wall_s"], 1e-9))
        low.set_xlabel("seconds since the start of the job")
        low.set_ylabel("ETTR")
        low.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        for ax in (top, mid, low):
            ax.grid(axis="x", alpha=0.3)
        fig.subplots_adjust(left=0.2, right=0.78, hspace=0.6)
        out = Path(path)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
