"""``bootseer bench``: run the benchmark suite in ``benchmarks/`` of a source checkout."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

SUITES = ("striped", "ckpt", "snapshot", "prefetch", "containerd")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (results: docs/benchmarks.md)")
    p.add_argument("suites", nargs="*", choices=[*SUITES, []], default=[],
                   help=f"which suites (default all: {', '.join(SUITES)})")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--results", default="bench-results", help="directory for JSON results")
    p.set_defaults(func=run)


def benchmarks_dir() -> Path:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "benchmarks").is_dir():
            return base / "benchmarks"
    raise FileNotFoundError("benchmarks/ not found: run `bootseer bench` from a source checkout")


def run(args: argparse.Namespace) -> int:
    directory = benchmarks_dir()
    os.makedirs(args.results, exist_ok=True)
    for suite in args.suites or SUITES:
        script = directory / f"bench_{suite}.py"
        argv = [str(script), "--results", args.results] + (["--quick"] if args.quick else [])
        saved = sys.argv
        sys.argv = argv
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:
            if exc.code:
                return int(exc.code) if isinstance(exc.code, int) else 1
        finally:
            sys.argv = saved
    return 0
