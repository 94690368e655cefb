"""The ``bootseer report`` section of the collective tracer: the latest grid of ranks x
groups (each cell the rank's state in that group: idle, in_op, stuck, behind, failed, dead,
unseen, root = the verdict's rank) and the history of verdicts, from the trace's
``colltrace-<node>.ndjson`` files.

Why a section of its own: the verdicts name a rank and a collective, which the startup and
robust sections have no column for; the grid shows at a glance which ranks hold which group.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .reader import read_verdicts

__all__ = ["GRID_TITLE", "STATE_STYLES", "colltrace_section", "colltrace_tables"]

GRID_TITLE = "collectives: ranks x groups at the last verdict"
HISTORY_TITLE = "collectives: verdicts"
#: rich styles of the grid's states (the terminal rendering colours cells by them)
STATE_STYLES = {
    "root": "bold white on red",
    "stuck": "yellow",
    "dead": "bold red",
    "failed": "red",
    "behind": "magenta",
    "in_op": "cyan",
    "idle": "green",
    "unseen": "dim",
}


def colltrace_section(paths: list[str | os.PathLike]) -> dict[str, Any]:
    """{"verdicts": [...], "grid": {...}} from the trace paths; {} when the tracer wrote none."""
    verdicts, grids = read_verdicts(paths)
    if not verdicts and not grids:
        return {}
    last = grids[-1] if grids else {}
    return {
        "verdicts": verdicts,
        "grid": last.get("grid", {}),
        "grid_node": last.get("node"),
        "grid_time": last.get("time"),
    }


def _rank_key(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (1 << 30, text)


def colltrace_tables(section: dict[str, Any]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The grid and the verdict history as (header, rows) tables."""
    tables: dict[str, tuple[list[str], list[list[str]]]] = {}
    grid: dict[str, dict[str, str]] = section.get("grid") or {}
    if grid:
        groups = sorted(grid)
        ranks = sorted({r for states in grid.values() for r in states}, key=_rank_key)
        tables[GRID_TITLE] = (
            ["rank", *groups],
            [[r, *(grid[g].get(r, "-") for g in groups)] for r in ranks],
        )
    rows = []
    for v in section.get("verdicts") or []:
        when = time.strftime("%H:%M:%S", time.gmtime(v.get("time") or 0))
        rows.append(
            [
                when,
                str(v.get("node") or "-"),
                str(v.get("attempt", "-")),
                str(v.get("kind")),
                ", ".join(map(str, v.get("ranks") or [])) or "-",
                str(v.get("line")),
            ]
        )
    if rows:
        tables[HISTORY_TITLE] = (
            ["time (UTC)", "node", "attempt", "kind", "ranks", "verdict"],
            rows,
        )
    return tables
