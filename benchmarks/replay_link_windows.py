"""Replay the windows a controller-link trial kept through the tracer's analysis, offline.

``python benchmarks/replay_link_windows.py RESULTS/colltrace-link.json`` (written by
``bench_colltrace.py --only-cluster``, which keeps every shipped window under
``ctl-link-<i>-windows.ndjson``): for each trial, a look every ``--every`` seconds (the
controller's ``LINK_CHECK_S``) from 10 s before the fault to the end, over the newest window
of each node read by then, two ways: ``fresh``, a new analysis per look (the controller before
the fix), and ``kept``, one analysis kept across the looks (a node's ``Watch``; the controller
after). Per look: each group's complete ops, its interval and throughput against the
baseline the look used, and what each way said. Why: a silent trial must say which rule
stayed silent, from the same bytes the controller read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load(path: Path) -> list[dict[str, Any]]:
    """The kept windows, oldest read first."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return sorted(rows, key=lambda r: r["read"])


def look_docs(rows: list[dict[str, Any]], t: float) -> dict[str, dict[str, Any]]:
    """Each node's newest window read by ``t`` (what a look at ``t`` analysed)."""
    docs: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["read"] <= t:
            docs[r["node"]] = r["doc"]
    return docs


def groups_state(docs: dict[str, dict[str, Any]], an: Any) -> dict[str, dict[str, Any]]:
    """Per group: complete ops, the newest complete sequence, every node's newest op (and
    when it shipped), and the interval and throughput of the last window against the
    baseline (the analyzer's own, else the one a fresh look takes)."""
    from bootseer.colltrace.analyze import _complete, _rate, group_views
    from bootseer.colltrace.ship import snapshots_of

    snaps = [s for n, d in sorted(docs.items()) for s in snapshots_of(d, n)]
    out: dict[str, dict[str, Any]] = {}
    for view in group_views(snaps).values():
        complete = _complete(view)
        row: dict[str, Any] = {
            "complete": len(complete),
            "last_complete": complete[-1] if complete else None,
            "newest": {str(r): max(ops) for r, ops in view.ops.items()},
        }
        if len(complete) >= an.warmup_ops + an.baseline_ops:
            starts = {s: max(view.ops[r][s].t_issue for r in view.ops) for s in complete}
            nbytes = {s: max(view.ops[r][s].nbytes for r in view.ops) for s in complete}
            base = an._baseline.get(view.name) or _rate(
                complete[an.warmup_ops : an.warmup_ops + an.baseline_ops], starts, nbytes
            )
            interval, tput = _rate(complete[-an.window_ops :], starts, nbytes)
            row.update(
                interval_ratio=round(interval / base[0], 2) if base[0] else None,
                tput_ratio=round(tput / base[1], 2) if base[1] else None,
                baseline_from=complete[an.warmup_ops],
                recent_from=complete[-an.window_ops],
            )
        out[view.display] = row
    return out


def replay(
    rows: list[dict[str, Any]], injected: float, *, every: float = 2.0, end_s: float = 120.0
) -> dict[str, Any]:
    """Both ways over the kept windows: per look the state and the findings; first
    suspicion after the fault (the controller's rule, :func:`~bootseer.robust.controller.
    link_suspects`), per way."""
    from bootseer.colltrace.analyze import Analyzer
    from bootseer.colltrace.ship import analyze_windows
    from bootseer.robust.controller import link_suspects

    kept = Analyzer(node="controller")
    looks, first = [], {"fresh": None, "kept": None}
    t = injected - 10.0
    while t <= min(injected + end_s, rows[-1]["read"] + every) if rows else False:
        docs = look_docs(rows, t)
        if len(docs) >= 2:
            fresh, _ = analyze_windows(docs, now=t)
            kept_found, _ = analyze_windows(docs, now=t, analyzer=kept)
            look = {
                "t": round(t - injected, 1),
                "shipped_ago": {n: round(t - d["time"], 1) for n, d in docs.items()},
                "groups": groups_state(docs, Analyzer()),
                "fresh": [f.line for f in fresh],
                "kept": [f.line for f in kept_found],
            }
            looks.append(look)
            for way, found in (("fresh", fresh), ("kept", kept_found)):
                if first[way] is None and t >= injected and link_suspects(found)[0]:
                    first[way] = round(t - injected, 1)
        t += every
    return {"first_suspicion_s": first, "looks": looks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replay_link_windows.py", description=__doc__.split("\n")[0])
    p.add_argument("result", help="colltrace-link.json of a bench_colltrace.py --only-cluster run")
    p.add_argument("--every", type=float, default=2.0, help="seconds between looks")
    p.add_argument("--looks", action="store_true", help="print every look, not only a summary")
    args = p.parse_args(argv)
    doc = json.loads(Path(args.result).read_text())
    for i, trial in enumerate(doc["link"]["trials"]):
        path = trial.get("windows")
        if not path or not Path(path).is_file():
            print(f"trial {i}: no windows kept")
            continue
        got = replay(load(Path(path)), trial["injected"], every=args.every)
        print(
            f"trial {i}: the controller suspected at {trial['suspected_s']} s; replayed: "
            f"fresh analysis per look {got['first_suspicion_s']['fresh']} s, kept across "
            f"looks {got['first_suspicion_s']['kept']} s"
        )
        for look in got["looks"] if args.looks else []:
            print(f"  {look['t']:+6.1f} s shipped_ago={look['shipped_ago']}")
            for g, st in look["groups"].items():
                print(f"      {g}: {st}")
            for way in ("fresh", "kept"):
                for line in look[way]:
                    print(f"      {way}: {line}")
        ago = [max(look["shipped_ago"].values()) for look in got["looks"]]
        if ago:
            print(
                f"  oldest window at a look: median {statistics.median(ago):.1f} s, "
                f"max {max(ago):.1f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
