"""The multi-node restart for several node counts in one command, and what the scale model
needs from it (issue 29; ``bootseer bench e2e --sweep 2,4,8``).

For each N of ``--sweep`` (in increasing order) the scenario of ``bench_e2e_nodes.py`` runs
on a cluster of N nodes: the methods of ``--methods`` (default ``baseline,diy,bootseer``),
``--ranks-per-node`` ranks on every node (default 1: 8 nodes x 1 rank are 8 ranks on this
machine's 2 cores, as the 4-node form's 4 x 2), a node lost and replaced by a fresh one. Each
N's own results stay where ``--nodes N`` writes them, under ``DIR/e2e-sweep-nN/``
(``e2e-nodes.json``, ``e2e-nodes.md``, ``bootseer report``'s directory per method:
``e2e-nodes-report/METHOD/``, with ``timeline.png``). Then the origins' serve rates are
measured on a cluster of each N (``e2e_sweep_probe.py``: every node reads one object from the
registry, S3 and the package index at once; ``--probe-mib``, 0 to skip).

``DIR/e2e-sweep.json`` and ``DIR/e2e-sweep.md`` then hold, per N and method: time to the first
step over the ranks (p50, p90, p99, max), the node that set the pace with its role and phases,
every node's bytes from each origin (and through the cache tier, ``through_cache``: null until
the scenario runs with one), the restart as job-level segments that add up to the max
(``segments``: the fresh node's path, the c10d rendezvous, ``import torch``, gloo's
``init_process_group``, model + load, the first step; ``e2e_nodes_spans.restart_segments``),
each rank's share of those, the torch figures (``torch``: rendezvous and process-group init),
and the report directory; beside them the links, the machine and the serve rates.
``startup_model.py`` reads this file.

``python benchmarks/bench_e2e.py --sweep 2,4,8 [--quick] [--methods ...] [--results DIR]``;
root and what ``--nodes`` needs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e_nodes  # noqa: E402
from _common import command_line, log, md_table  # noqa: E402
from bench_e2e_nodes import ResultFiles  # noqa: E402

SUITE = "e2e-sweep"
DEFAULT_METHODS = ("baseline", "diy", "bootseer")
DEFAULT_RANKS_PER_NODE = 1
MAX_NODES = 8  # the cluster fixture's
PROBE_MIB = 32
SEGMENTS = (
    "fresh_path_s",
    "rendezvous_s",
    "import_s",
    "process_group_init_s",
    "load_s",
    "first_step_s",
)
SERVICES = ("registry", "s3", "index")


def parse_sweep(text: str) -> list[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]``: at least two node counts, each 2 to 8, no repeats."""
    counts = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise ValueError(
                f"--sweep {text!r}: {item!r} is not a node count (give counts like 2,4,8)"
            )
        counts.append(int(item))
    if len(counts) < 2:
        raise ValueError(
            f"--sweep {text!r}: give two node counts or more (the model fits "
            "a growth over them); for one, use --nodes N"
        )
    if len(set(counts)) != len(counts):
        raise ValueError(f"--sweep {text!r}: a node count is given twice")
    bad = [n for n in counts if not 2 <= n <= MAX_NODES]
    if bad:
        raise ValueError(
            f"--sweep {text!r}: {bad[0]} nodes: each count must be 2 to "
            f"{MAX_NODES} (a node is lost and the others wait for its "
            "replacement; the cluster fixture has at most 8)"
        )
    return sorted(counts)


class SweepBench(ResultFiles):
    """One ``bench_e2e_nodes.NodesBench`` per N, then the probe; the results in ``R``."""

    suite = SUITE

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.counts = parse_sweep(args.sweep)
        self.results_dir = Path(args.results).resolve()
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.benches = {}
        for n in self.counts:  # every N's arguments checked before anything starts
            sub = argparse.Namespace(
                **{**vars(args), "nodes": n, "results": str(self.results_dir / f"{SUITE}-n{n}")}
            )
            self.benches[n] = bench_e2e_nodes.NodesBench(sub)
        first = self.benches[self.counts[0]]
        self.R: dict[str, Any] = {
            "suite": SUITE,
            "quick": first.quick,
            "sweep": self.counts,
            "ranks_per_node": first.ranks_per_node,
            "model": first.model,
            "methods": first.methods,
            "lost_node": "the last node of each N" if args.lose is None else f"node{args.lose}",
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": command_line("bench_e2e.py"),
            "machine": first.R["machine"],
            "links": first.R["links"],
            "runs": {},
            "serve_rates": {},
            "warnings": [],
            "errors": self.errors,
        }

    def run(self) -> None:
        for n, bench in self.benches.items():
            log(
                f"sweep: {n} nodes x {bench.ranks_per_node} ranks, methods "
                f"{', '.join(bench.methods)}"
            )
            try:
                with bench.stack:
                    bench.run()
                    bench.report()  # DIR/e2e-sweep-nN/e2e-nodes.{json,md}
            except Exception as exc:  # noqa: BLE001 - the other counts still run
                self.errors.append(f"N={n}: {type(exc).__name__}: {exc}")
            self.errors += [f"N={n}: {e}" for e in bench.errors]
            try:
                self.R["runs"][str(n)] = sweep_runs(bench.R, str(bench.results_dir))
            except (KeyError, TypeError, ValueError) as exc:  # that N's results stay as written
                self.errors.append(f"N={n}: its results could not be summed up: {exc!r}")
            self.write_files()  # what was measured survives a later crash
        if self.args.probe_mib:
            self.probe()

    def probe(self) -> None:
        from e2e_sweep_probe import measure

        from bootseer.testing.cluster import Link

        for n in self.counts:
            log(f"sweep: the origins' serve rates to {n} nodes ({self.args.probe_mib} MiB each)")
            try:
                self.R["serve_rates"][str(n)] = measure(
                    n,
                    self.args.probe_mib << 20,
                    self.benches[n].cache,
                    node_link=Link(
                        rate=bench_e2e_nodes.NODE_LINK[0], delay_ms=bench_e2e_nodes.NODE_LINK[1]
                    ),
                    service_link=Link(rate=bench_e2e_nodes.SERVICE_LINK),
                )
            except Exception as exc:  # noqa: BLE001 - the runs are kept; the model falls back
                self.errors.append(f"probe N={n}: {type(exc).__name__}: {exc}")

    def render(self) -> list[str]:
        return render(self.R)


# -- from one N's e2e-nodes results to the sweep's entries ---------------------------------------
def sweep_runs(nodes_R: dict[str, Any], results_dir: str) -> dict[str, Any]:  # noqa: N803
    """One N: every method's :func:`sweep_entry`, and where that N's own results are."""
    return {
        "nodes": nodes_R["nodes"],
        "results_dir": results_dir,
        "methods": {m: sweep_entry(r) for m, r in nodes_R["runs"].items()},
    }


def sweep_entry(run: dict[str, Any]) -> dict[str, Any]:
    """One method at one N, from its ``e2e-nodes.json`` run: what the sweep reports and the
    model reads."""
    from bootseer.report import percentile

    s, seg = run["summary"], run["segments"]
    values = list(run["ranks"].values())
    per_node = {}
    for node, v in run["per_node"].items():
        cached = {
            k.removesuffix("-cache"): b for k, b in v["bytes"].items() if k.endswith("-cache")
        }
        per_node[node] = {
            "role": v.get("role"),
            "first_step_s": v["first_step_s"],
            "phases": v["phases"],
            "bytes": {k: int(v["bytes"].get(k, 0)) for k in SERVICES},
            "through_cache": cached or None,
        }
    pace = s["paced_by"]
    pg = list(seg["per_rank"].get("process_group_init_s", {}).values())
    report_dir = run.get("report_dir")
    return {
        "ttfs": {
            "p50_s": percentile(values, 50),
            "p90_s": percentile(values, 90),
            "p99_s": percentile(values, 99),
            "max_s": max(values),
        },
        "ranks": run["ranks"],
        "paced_by": {
            "node": pace,
            "role": per_node.get(pace, {}).get("role"),
            "why": s["paced_why"],
            "phases": per_node.get(pace, {}).get("phases", {}),
        },
        "critical_path": {"ends_on": s["straggler"], "why": s["why"]},
        "per_node": per_node,
        "bytes_total": run["bytes_total"],
        "cache": run.get("cache"),  # the tier's origin bytes; None: the run had no tier
        "segments": {k: seg[k] for k in SEGMENTS} | {"workers_s": seg["workers_s"]},
        "per_rank": seg["per_rank"],
        "torch": {
            "rendezvous_s": seg["rendezvous_s"],
            "process_group_init_s": seg["process_group_init_s"],
            "process_group_init_rank_p50_s": percentile(pg, 50) if pg else None,
            "process_group_init_rank_max_s": max(pg) if pg else None,
        },
        "report_dir": report_dir,
        "timeline": str(Path(report_dir) / "timeline.png") if report_dir else None,
        "bit_identical": run.get("bit_identical"),
        "loadavg_1m": run.get("loadavg_1m"),
    }


# -- the report ------------------------------------------------------------------------------------
def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def render(R: dict[str, Any]) -> list[str]:  # noqa: N803 - the results, as in e2e-sweep.json
    """The markdown report of a sweep (``--render FILE`` redoes it from the JSON)."""
    size = "quick" if R["quick"] else "full"
    m = R["machine"]
    lines = [
        f"# end-to-end restart, node sweep {','.join(map(str, R['sweep']))} ({size} scenario)",
        "",
        f"- command: `{R['command']}`",
        f"- machine: {m['cpus']} CPUs, {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"{m.get('containerd', '?')}; every node and its ranks share these CPUs",
        f"- job: FSDP2 over gloo, N nodes x {R['ranks_per_node']} rank(s), model "
        f"`{R['model']}`; {R['lost_node']} lost after a commit, a fresh node in its place",
        f"- links: each node {R['links']['node']['rate']} "
        f"({R['links']['node']['delay_ms']:g} ms to the services), the services host "
        f"{R['links']['services']['rate']} shared",
        "",
    ]
    head = [
        "N",
        "method",
        "p50",
        "p90",
        "p99",
        "max (job back)",
        "paced by",
        "its phases",
        "fresh node: registry / S3 / index MB",
        "a survivor: registry / S3 / index MB",
        "through the cache MB",
        "bit-identical",
    ]
    rows, torch_rows, seg_rows, node_rows, dirs = [], [], [], [], []
    for n, entry in sorted(R["runs"].items(), key=lambda kv: int(kv[0])):
        dirs.append(f"- N={n}: {entry['results_dir']}")
        for method, e in entry["methods"].items():
            t, p = e["ttfs"], e["paced_by"]
            fresh = [v for v in e["per_node"].values() if v["role"] != "survivor"]
            surv = [v for v in e["per_node"].values() if v["role"] == "survivor"]
            cached = [
                sum(v["through_cache"].values())
                for v in e["per_node"].values()
                if v["through_cache"]
            ]
            rows.append(
                [
                    n,
                    method,
                    *[f"{t[k]:.1f} s" for k in ("p50_s", "p90_s", "p99_s", "max_s")],
                    f"{p['node']} ({p['role']})",
                    p["why"],
                    " / ".join(_mb(fresh[0]["bytes"][k]) if fresh else "-" for k in SERVICES),
                    " / ".join(
                        _mb(sum(v["bytes"][k] for v in surv) // len(surv)) if surv else "-"
                        for k in SERVICES
                    ),
                    _mb(sum(cached)) if cached else "no cache tier",
                    "yes" if e["bit_identical"] else "NO",
                ]
            )
            tr = e["torch"]
            torch_rows.append(
                [
                    n,
                    method,
                    _s(tr["rendezvous_s"]),
                    _s(tr["process_group_init_s"]),
                    _s(tr["process_group_init_rank_p50_s"]),
                    _s(tr["process_group_init_rank_max_s"]),
                ]
            )
            sg = e["segments"]
            seg_rows.append(
                [
                    n,
                    method,
                    *[_s(sg[k]) for k in SEGMENTS],
                    _s(sum(sg[k] or 0.0 for k in SEGMENTS)),
                    f"{t['max_s']:.1f}",
                ]
            )
            node_rows += [
                [
                    n,
                    method,
                    node,
                    v["role"],
                    f"{v['first_step_s']:.1f}",
                    *[_mb(v["bytes"][k]) for k in SERVICES],
                    " / ".join(f"{k} {_mb(b)}" for k, b in v["through_cache"].items())
                    if v["through_cache"]
                    else "-",
                ]
                for node, v in e["per_node"].items()
            ]
    lines += [
        "## time to the first step after the loss, over the ranks",
        "",
        *md_table(head, rows),
        "",
        "## what the model needs from torch (seconds)",
        "",
        "rendezvous: the fresh node's torchrun start to the last worker's start (torchrun's "
        "own start, the c10d round, the workers spawned); process-group init: the last "
        "rank's `init_process_group` call to the last return (the job), and each rank's "
        "own call (p50, max over the ranks)",
        "",
        *md_table(
            [
                "N",
                "method",
                "c10d rendezvous",
                "gloo init (job)",
                "gloo init p50 (rank)",
                "gloo init max (rank)",
            ],
            torch_rows,
        ),
        "",
        "## the restart as job-level segments (seconds; they add up to the max)",
        "",
        *md_table(
            [
                "N",
                "method",
                "fresh node's path",
                "rendezvous",
                "import torch",
                "process-group init",
                "model + load",
                "first step",
                "sum",
                "max",
            ],
            seg_rows,
        ),
        "",
        "## per node",
        "",
        *md_table(
            [
                "N",
                "method",
                "node",
                "role",
                "back at (s)",
                "registry MB",
                "S3 MB",
                "index MB",
                "through the cache",
            ],
            node_rows,
        ),
        "",
    ]
    rates = R.get("serve_rates") or {}
    if rates:
        lines += [
            "## the origins' serve rates (every node reads one object at once)",
            "",
            *md_table(
                ["N", *[f"{o} MB/s" for o in SERVICES]],
                [
                    [n, *[f"{r[o]['rate_Bps'] / 1e6:.1f}" if o in r else "-" for o in SERVICES]]
                    for n, r in sorted(rates.items(), key=lambda kv: int(kv[0]))
                ],
            ),
            "",
        ]
    lines += [
        "## each N's own results (`bootseer report` per method under "
        "`e2e-nodes-report/METHOD/`, with its timeline.png)",
        "",
        *dirs,
        "",
    ]
    lines += [f"- WARNING: {w}" for w in R.get("warnings", [])]
    lines += [f"- ERROR: {e}" for e in R.get("errors", [])]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:
        print("\n".join(render(json.loads(Path(argv[1]).read_text()))))
        return 0
    parser = argparse.ArgumentParser(
        prog="bench_e2e.py --sweep N,N,...", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sweep", required=True, help="node counts, e.g. 2,4,8")
    bench_e2e_nodes.add_scenario_arguments(
        parser, methods=",".join(DEFAULT_METHODS), ranks_per_node=DEFAULT_RANKS_PER_NODE
    )
    parser.add_argument(
        "--probe-mib",
        type=int,
        default=PROBE_MIB,
        help=f"MiB each node reads from each origin (default {PROBE_MIB}; 0: "
        "no probe, the model then takes the services link's rate)",
    )
    parser.add_argument("--nodes", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nodes is not None:
        parser.error("--sweep and --nodes: give one (--sweep runs --nodes for each count)")
    if args.probe_mib < 0:
        parser.error(f"--probe-mib {args.probe_mib}: give 0 (no probe) or more")
    return bench_e2e_nodes.run_checked(parser, args, SweepBench)


if __name__ == "__main__":
    sys.exit(main())
