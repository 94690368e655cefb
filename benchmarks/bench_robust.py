"""Robust training soak: the same seeded fault schedule under bootseer and under plain torchrun.

A cluster of network namespaces (``bootseer.testing.cluster``: 4 nodes x 2 ranks by default,
S3 and the controller's c10d store on the services host) runs ``robust_job.py`` for
``--minutes`` of training: under ``bootseer run --controller`` with ``bootseer controller``,
then, on a fresh identical cluster, under ``torchrun --max-restarts N`` alone (the peer).
Faults (``robust_faults.CLASSES``: SIGKILL, an exception, a hang in a collective, a hang in a
dataloader worker, NaN in a gradient, a slow rank, a lost node, a full disk, the checkpoint
store down for 30 s) come at seeded random offsets on seeded random ranks; the schedule is
printed. A fault waits while the job is still recovering from the previous one (the offsets
actually used are kept). The operator's part (replace a lost or evicted node, free a full
disk after a minute, restart an exited launcher) is the same in both runs.

Per class and mode (``robust_measure``): detection latency p50/p90, whether the injected
rank's group was named, nodes evicted, restart to first step, steps recomputed; ETTR by the
project's one accounting (``bootseer.robust.ettr``): bootseer's from the agents' traces, as
``bootseer report --end`` prints it, the peer's from its step log (no trace exists).

``python benchmarks/bench_robust.py --results DIR [--quick] [--minutes M] [--interval S]
[--seed N] [--classes sigkill,exception]`` or ``bootseer bench robust [--quick] [--minutes M]``; writes ``DIR/robust.json``
and ``DIR/robust.md``. Default 20 minutes per mode, a fault every 180 s on average; ``--quick``:
5 minutes per mode, a fault every 30 s. Needs root (namespaces, cgroups, tmpfs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, log, md_table, source_state, work_dir  # noqa: E402
from robust_cluster import SoakJob  # noqa: E402
from robust_faults import CLASSES, Fault, Injector, as_dicts, schedule  # noqa: E402
from robust_measure import dump, measure, steps  # noqa: E402

FIRST_STEP_TIMEOUT_S = 600.0
HEALTHY_AFTER_S = 5.0  # a fault waits until the job stepped this long after the last one
TARGETS = {"crash_detection_s": 2.0, "named_share": 0.95, "ettr": 0.90}


def last_good_step_time(out: Path) -> float:
    """When rank 0 last finished a step with a finite loss (a NaN's steps do not count as
    recovered: after the all-reduce every rank trains on NaN until it is stopped)."""
    log0 = steps(out)
    if not log0 or not math.isfinite(log0[-1]["loss"]):
        return 0.0
    return log0[-1]["time"]


def soak(
    cluster: Any, out: Path, mode: str, faults: list[Fault], args: argparse.Namespace
) -> dict[str, Any]:
    """One mode's run on ``cluster``: start, inject on schedule, tend, measure."""
    job = SoakJob(
        cluster,
        out,
        mode,
        nproc=args.nproc,
        hang_timeout_s=args.hang_timeout,
        pg_timeout_s=args.pg_timeout,
        launch=args.launch,
        memory=args.memory,
        preload=args.preload,
        spares=args.spares,
        log=log,
    )
    inj = Injector(job, log=log)
    job.start()
    log(
        f"{mode}: {args.nodes} nodes x {args.nproc} ranks started"
        + (f", {args.spares} warm spare(s) parked" if args.spares else "")
        + "; waiting for the first step"
    )
    deadline = time.monotonic() + FIRST_STEP_TIMEOUT_S
    while not steps(out):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mode}: no step in {FIRST_STEP_TIMEOUT_S:.0f} s; see {out}/logs")
        job.tend()
        time.sleep(1)
    t_start = steps(out)[0]["time"]
    t_end = t_start + args.minutes * 60
    pending = list(faults)
    last_fault = 0.0
    next_report = time.time() + 30
    try:
        while time.time() < t_end:
            job.tend()
            inj.tick()
            now = time.time()
            last = last_good_step_time(out)
            healthy = (
                last > last_fault + HEALTHY_AFTER_S and now - last < 5 and not inj.store_is_down()
            )
            if pending and now - t_start >= pending[0].at_s and healthy:
                fault = pending.pop(0)
                inj.inject(fault)
                fault.injected["offset_s"] = round(fault.injected["time"] - t_start, 1)
                last_fault = fault.injected["time"]
            if now >= next_report:
                log(
                    f"{mode}: +{now - t_start:.0f} s of {args.minutes * 60:.0f} s, step "
                    f"{(steps(out) or [{'step': -1}])[-1]['step']}, {len(faults) - len(pending)}"
                    f" fault(s) injected"
                )
                next_report = now + 30
            time.sleep(0.5)
    finally:
        inj.finish()
        end = time.time()
        job.close()
    result = measure(out, mode, faults, end, args.hang_timeout)
    result["not_injected"] = [f.id for f in pending]
    result["relaunches"] = job.relaunches
    return result


def _s(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}"


def class_rows(report: dict[str, Any], hang_timeout: float) -> list[list[str]]:
    rows = []
    target = {
        "sigkill": "<= 2 s",
        "exception": "<= 2 s",
        "collective_hang": f"<= {hang_timeout + 5:g} s",
        "dataloader_hang": f"<= {hang_timeout + 5:g} s",
        "nan": "at its step",
    }
    for kind in CLASSES:
        cells = [kind, target.get(kind, "-")]
        for mode in ("bootseer", "peer"):
            c = report.get(mode, {}).get("classes", {}).get(kind)
            if not c:
                cells += ["-", "-", "-", "-"]
                continue
            cells += [
                f"{_s(c['detection_p50_s'])} / {_s(c['detection_p90_s'])} "
                f"({c['detected']}/{c['fired']})",
                f"{c['named']}/{c['fired']}, {c['evicted_nodes']} evicted",
                _s(c["restart_p50_s"]),
                "-" if c["recomputed_p50"] is None else str(c["recomputed_p50"]),
            ]
        rows.append(cells)
    return rows


def write(results: Path, report: dict[str, Any], hang_timeout: float) -> None:
    results.mkdir(parents=True, exist_ok=True)
    dump(results / "robust.json", report)
    head = [
        "class",
        "detection target",
        "bootseer detect p50/p90 s",
        "bootseer named",
        "bootseer restart s",
        "bootseer recomputed",
        "peer detect p50/p90 s",
        "peer named",
        "peer restart s",
        "peer recomputed",
    ]
    lines = [
        "# robust: training soak, bootseer against plain torchrun",
        "",
        f"- command: `{report['command']}`",
        f"- {report['nodes']} nodes x {report['nproc']} ranks, {report['minutes']} min per "
        f"mode, a fault every {report['interval_s']:g} s on average, seed {report['seed']}, "
        f"hang threshold {hang_timeout:g} s, collective timeout {report['pg_timeout_s']:g} s",
        f"- workers started by `{report.get('launch', 'exec')}` in both modes; bootseer's "
        f"memory tier {'on' if report.get('memory_tier') else 'off'}, --preload "
        f"{'on' if report.get('preload') else 'off'}; warm spares parked at the "
        f"rendezvous: {report.get('spares', 0)} (in both modes; a lost or evicted node's "
        "replacement starts as a spare)",
        f"- load average before {report['machine']['load_before']}, after "
        f"{report['machine'].get('load_after')} on {report['machine']['cpus']} CPUs",
        "",
        *md_table(head, class_rows(report, hang_timeout)),
        "",
    ]
    erows, commands = [], []
    for mode in ("bootseer", "peer"):
        r = report.get(mode)
        if not r:
            continue
        e = r["ettr"]
        erows.append(
            [
                mode,
                "-" if e.get("ettr") is None else f"{e['ettr']:.1%}",
                f"{e.get('productive_s', 0.0):.0f} / {e.get('wall_s', 0.0):.0f}",
                e["input"],
                str(len([f for f in r["faults"] if f.get("fired")])),
            ]
        )
        if e.get("report_command"):
            keep = Path(results) / f"robust-{mode}" / "trace"
            commands.append(e["report_command"].rsplit(" ", 1)[0] + f" {keep}")
    lines += [
        "ETTR (bootseer.robust.ettr, from the job's first step to the end of the run; "
        "target >= 90% with a fault every 180 s, and above the peer's):",
        "",
        *md_table(["mode", "ETTR", "productive / wall s", "from", "faults fired"], erows),
        "",
        *(f"- the same figure: `{c}`" for c in commands),
        "",
    ]
    lines += [
        "Schedule (offsets from the first step; actual offsets in robust.json):",
        "",
        "```",
        *report["schedule_text"],
        "```",
        "",
    ]
    (results / "robust.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {results / 'robust.json'} and {results / 'robust.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_robust.py", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="5 minutes, a fault every 30 s")
    parser.add_argument("--minutes", type=float, help="training minutes per mode (20; quick 5)")
    parser.add_argument(
        "--interval", type=float, help="mean seconds between faults (180; quick 30)"
    )
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--modes", default="bootseer,peer")
    parser.add_argument(
        "--launch",
        choices=("fork", "exec"),
        default="fork",
        help="how torchrun starts the workers, in both modes: fork them from "
        "torchrun with torch imported (--run-path --start-method fork), "
        "or exec a fresh interpreter per rank (torchrun's default)",
    )
    parser.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="bootseer without its memory tier (every save to S3 only)",
    )
    parser.add_argument(
        "--no-preload",
        dest="preload",
        action="store_false",
        help="bootseer without --preload (each restart imports afresh)",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="warm spare nodes beside --nodes, parked at the rendezvous in both "
        "modes (bootseer run --standby; torchrun alone: the same launcher "
        "in torch's redundancy list); a replacement node starts as one",
    )
    parser.add_argument(
        "--classes",
        default=",".join(CLASSES),
        help=f"fault classes, comma-separated, of {', '.join(CLASSES)} "
        "(default all; sigkill,exception: the crash detection latency)",
    )
    args = parser.parse_args(argv)
    args.minutes = args.minutes or (5.0 if args.quick else 20.0)
    args.interval = args.interval or (30.0 if args.quick else 180.0)
    if args.minutes <= 0 or args.interval <= 0:
        parser.error("--minutes and --interval must be positive")
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in ("bootseer", "peer")]:
        parser.error(f"--modes {bad}: choose from bootseer, peer")
    classes = tuple(c for c in args.classes.split(",") if c)
    if not classes or (bad := [c for c in classes if c not in CLASSES]):
        parser.error(f"--classes {args.classes!r}: choose from {', '.join(CLASSES)}")
    from bootseer.testing.cluster import Cluster

    plan = schedule(args.seed, args.minutes, args.interval, args.nodes, args.nproc, classes)
    text = [f.describe() for f in plan]
    joined = "\n  ".join(text)
    log(f"fault schedule (seed {args.seed}):\n  {joined}")
    report: dict[str, Any] = {
        "suite": "robust",
        "command": command_line("bench_robust.py"),
        "quick": args.quick,
        "minutes": args.minutes,
        "interval_s": args.interval,
        "seed": args.seed,
        "nodes": args.nodes,
        "nproc": args.nproc,
        "hang_timeout_s": args.hang_timeout,
        "pg_timeout_s": args.pg_timeout,
        "classes": list(classes),
        "targets": TARGETS,
        "launch": args.launch,
        "memory_tier": args.memory,
        "preload": args.preload,
        "spares": args.spares,
        "schedule": as_dicts(plan),
        "schedule_text": text,
        "source": source_state(["benchmarks", "bootseer"]),
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
    }
    with contextlib.ExitStack() as stack:
        work = work_dir("robust-run-", stack)
        for mode in modes:
            faults = schedule(
                args.seed, args.minutes, args.interval, args.nodes, args.nproc, classes
            )
            out = work / mode
            out.mkdir()
            try:
                with Cluster(
                    args.nodes + args.spares,
                    services=("s3", "rendezvous"),
                    disk_size="64m",
                    workdir=work,
                ) as cluster:
                    report[mode] = soak(cluster, out, mode, faults, args)
                    report[mode]["schedule"] = as_dicts(faults)
            finally:  # the logs and traces, for a reader of the results (also of a failure)
                keep = Path(args.results) / f"robust-{mode}"
                for sub in ("logs", "trace", "ctl"):
                    with contextlib.suppress(OSError):
                        shutil.copytree(out / sub, keep / sub, dirs_exist_ok=True)
            report["machine"]["load_after"] = os.getloadavg()
            write(Path(args.results), report, args.hang_timeout)
    print("\n".join(json.dumps(report.get(m, {}).get("ettr")) for m in modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
