"""``bootseer bench``: run the benchmark suite in ``benchmarks/`` of a source checkout."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

SUITES = ("striped", "ckpt", "snapshot", "prefetch", "containerd", "e2e")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (results: docs/benchmarks.md)")
    p.add_argument("suites", nargs="*", choices=[*SUITES, []], default=[],
                   help=f"which suites (default all: {', '.join(SUITES)})")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--results", default="bench-results",
                   help="directory for the results: JSON, markdown tables, PNG charts")
    p.set_defaults(func=run)


def benchmarks_dir() -> Path:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "benchmarks").is_dir():
            return base / "benchmarks"
    raise FileNotFoundError("benchmarks/ not found: run `bootseer bench` from a source checkout")


def run_script(script: Path, argv: list[str]) -> int:
    """Run one benchmark script as ``__main__``; its exit status."""
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            return int(exc.code) if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    return 0


def run(args: argparse.Namespace) -> int:
    directory = benchmarks_dir()
    os.makedirs(args.results, exist_ok=True)
    worst = 0
    done = []
    for suite in args.suites or SUITES:
        code = run_script(directory / f"bench_{suite}.py",
                          ["--results", args.results] + (["--quick"] if args.quick else []))
        worst = worst or code
        done.append(suite)
    write_summary(Path(args.results), done)
    return worst


def write_summary(results: Path, suites: list[str]) -> None:
    """``summary.md``: every suite's markdown report, in the order run, and the charts."""
    parts = ["# bootseer bench results", ""]
    for suite in suites:
        md = results / f"{suite}.md"
        parts.append(md.read_text() if md.exists() else f"## {suite}: no results (failed early)\n")
        chart = results / f"{suite}.png"
        if chart.exists():
            parts.append(f"![{suite}]({chart.name})\n")
    (results / "summary.md").write_text("\n".join(parts))
    print(f"results: {results.resolve()} (summary.md, <suite>.json, <suite>.md, charts)")
