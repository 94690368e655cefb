"""``bootseer report TRACE_DIR...``: startup traces of many nodes as one table, chart and JSON.

Prints per-phase p50/p90/max, time to first step, stragglers (spans and nodes), restarts,
each incident's cost along its critical path and the bytes per remote; writes
``report.json``, ``report.png`` and ``timeline.png`` into the first trace directory (or ``--out``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CliError

if TYPE_CHECKING:
    from ..report import Report

MAX_WARNINGS = 10


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``report`` subcommand."""
    p = sub.add_parser(
        "report",
        help="aggregate startup traces: phase percentiles, stragglers, restarts, "
        "the critical path of each restart",
        description="Reads the startup traces (*.jsonl) under each TRACE_DIR (or trace files) "
        "and prints per-phase p50/p90/max across nodes and ranks, time to first "
        "step, stragglers (a phase longer than median + 3 MAD of its peers) and "
        "restarts, and per incident (a start or restart) the critical path from "
        "the failure to the job's first step with its cost by phase, and the "
        "bytes each node read from each remote; writes report.json, report.png "
        "and timeline.png.",
    )
    p.add_argument(
        "trace_dirs",
        nargs="+",
        metavar="TRACE_DIR",
        help="directories of trace files (searched recursively), or trace files",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where report.json and report.png go (default: the first TRACE_DIR)",
    )
    p.add_argument("--json", dest="json_path", metavar="FILE", help="the JSON report's path")
    p.add_argument("--png", dest="png_path", metavar="FILE", help="the chart's path")
    p.add_argument(
        "--timeline-png",
        dest="timeline_path",
        metavar="FILE",
        help="the timeline's path (node x phase of the last incident; default "
        "timeline.png next to report.png)",
    )
    p.add_argument(
        "--end",
        type=float,
        metavar="EPOCH_S",
        help="the job's end for ETTR, in seconds since the epoch (default: the last "
        "time the traces hold; a job whose last attempt trained on to its "
        "end without an incident left no record there)",
    )
    p.set_defaults(func=cmd_report)


def _out_dir(args: argparse.Namespace) -> Path:
    if args.out:
        return Path(args.out)
    first = Path(args.trace_dirs[0])
    return first if first.is_dir() else first.parent


def cmd_report(args: argparse.Namespace) -> int:
    from ..report import ReportError, load_report

    try:
        report = load_report(args.trace_dirs, end=args.end)
    except (ReportError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot read traces: {exc}") from None
    for warning in report.warnings[:MAX_WARNINGS]:
        print(f"bootseer: warning: {warning}", file=sys.stderr)
    if len(report.warnings) > MAX_WARNINGS:
        print(
            f"bootseer: warning: ... and {len(report.warnings) - MAX_WARNINGS} more "
            "(all of them are in the JSON report)",
            file=sys.stderr,
        )

    print_report(report)

    out = _out_dir(args)
    json_path = Path(args.json_path) if args.json_path else out / "report.json"
    png_path = Path(args.png_path) if args.png_path else out / "report.png"
    timeline_path = (
        Path(args.timeline_path) if args.timeline_path else png_path.with_name("timeline.png")
    )
    try:
        for path in (json_path, png_path, timeline_path):
            path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_name(json_path.name + ".tmp")
        tmp.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, json_path)
    except OSError as exc:
        raise CliError(
            f"cannot write {json_path}: {exc} (choose another place with --out)"
        ) from None
    try:
        from ..report_chart import render_chart, render_timeline
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise CliError(f"the chart needs matplotlib ({exc}); pip install matplotlib") from None
    charts = [(png_path, render_chart)]
    if report.incidents:
        charts.append((timeline_path, render_timeline))
    for path, render in charts:
        try:
            render(report, path)
        except OSError as exc:
            raise CliError(
                f"cannot write {path}: {exc} (choose another place with --out)"
            ) from None
    ettr_path = None
    if report.robust.get("chart"):  # ETTR over time and each incident's split
        from ..report_chart import render_ettr

        ettr_path = png_path.with_name("ettr.png")
        try:
            render_ettr(report.robust["chart"], ettr_path)
        except OSError as exc:
            raise CliError(
                f"cannot write {ettr_path}: {exc} (choose another place with --out)"
            ) from None
    print(f"json: {json_path}")
    print(f"chart: {png_path}")
    if report.incidents:
        print(f"timeline: {timeline_path}")
    if ettr_path is not None:
        print(f"ettr chart: {ettr_path}")
    return 0


def print_report(report: Report, *, terminal: bool | None = None) -> None:
    """A rich table on a terminal, aligned plain text otherwise (pipes, logs, tests)."""
    from ..colltrace.report import GRID_TITLE, STATE_STYLES
    from ..report import format_text, summary_line, table_rows

    if not (sys.stdout.isatty() if terminal is None else terminal):
        print(format_text(report))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(summary_line(report))
    for title, (header, rows) in table_rows(report).items():
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 or not _numeric(rows, i) else "right")
        for row in rows:
            style = "bold red" if title.startswith("stragglers") else None
            if title == GRID_TITLE:  # each cell coloured by the rank's state in the group
                row = [row[0], *(f"[{STATE_STYLES.get(c, 'default')}]{c}[/]" for c in row[1:])]
            table.add_row(*row, style=style)
        console.print(table)
    if not report.stragglers:
        console.print("no stragglers")


def _numeric(rows: list[list[str]], col: int) -> bool:
    def ok(cell: str) -> bool:
        try:
            float(cell)
        except ValueError:
            return cell == "-"
        return True

    return bool(rows) and all(ok(r[col]) for r in rows)
