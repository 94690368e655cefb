"""``bootseer bench model``: the startup model (``startup_model.py``) of the node sweep whose
results are in ``--results`` (``DIR/e2e-sweep.json``, from ``bootseer bench e2e --sweep
2,4,8``); it writes ``DIR/startup-model.json``, ``.md`` and ``.png``. Not one of the suites
``bootseer bench`` runs by default: it measures nothing, and needs a sweep first.

``python benchmarks/bench_model.py --results DIR [startup_model.py's options]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import startup_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="bench_model.py", add_help=False)
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true")  # the sweep says whether it was quick
    args, rest = parser.parse_known_args(argv)
    sweep = Path(args.results) / "e2e-sweep.json"
    return startup_model.main(["--sweep", str(sweep), "--results", args.results, *rest])


if __name__ == "__main__":
    sys.exit(main())
