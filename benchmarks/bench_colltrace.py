"""Collective tracing: its overhead, and how fast and how right its verdicts are per fault.

``python benchmarks/bench_colltrace.py --results DIR [--quick] [--trials N]`` or
``bootseer bench colltrace``. Writes ``colltrace.json`` and ``colltrace.md``.

* cost per op: a world-1 gloo group in one process, ``all_reduce`` of 4 floats, traced and
  untraced in alternating blocks (the tracer's own cost, without any peer's wait), and the
  Python objects allocated per traced op (tracemalloc);
* overhead: iteration time of a 3-rank gloo job (20 ms of Python compute, two all_reduces
  per step) with and without the tracer, alternated, several repeats (target <= 1%), and
  rank 0's CPU time per step; and inside one job, blocks of 10 steps traced and untraced in
  turns (both halves see the same machine load: the figure a loaded machine can give);
* ring memory: the ring file's size before and after the job (fixed by its capacity);
* faults (``bootseer.testing.colltrace_job``, 3 ranks on loopback): a rank sleeps before a
  collective, a rank slowed by a CPU hog in its process, a rank SIGKILLed in a collective, a
  rank SIGSTOPped in a collective every rank issued (transport or peer), a mismatched
  collective, two groups deadlocked; the injected rank varies per trial. Per fault:
  injection to the first verdict that names a rank (p50, p90), named (it names the injected
  rank), wrong (any verdict of the trial names another), within 15 s; verdicts naming no
  rank before it (a slowdown seen as "transport") are kept in the JSON. Targets: named
  within 15 s in >= 90% of trials, no wrong rank.
* ``--only sleep,slow,...``: those fault classes alone (into ``colltrace-only.json``/``.md``);
  ``--background-load N``: N busy processes outside the job for the whole run (a loaded
  machine: every rank slowed alike), stopped at the end; each trial's load average is kept;
* with ``--cluster`` (root, tc): one node's link slowed on the cluster fixture
  (``--only-cluster``: that alone, into ``colltrace-link.json``). ``--link-path controller``
  (the default): ``bootseer controller`` and ``bootseer run --controller --colltrace`` on 3
  nodes of one rank each; the controller (a look every 2 s) suspects a link from the shipped
  windows, orders every agent to probe its own, and names the node: suspicion and node
  named, from ``slow_link`` returning. Every window the store held, the agents' and the
  controller's lines and node1's egress qdisc are kept per trial beside the results
  (``ctl-link-<i>-*``; ``benchmarks/replay_link_windows.py`` replays the windows).
  ``--link-path command``: a 2-node x 2-rank torchrun job read by one Watch, the store probe
  run per node after the first verdict.
* with ``--cluster``, and alone with ``--only-cluster-overhead`` (``colltrace-overhead.json``):
  the overhead on the cluster fixture, a 2-node torchrun job (``--overhead-nproc`` ranks a
  node, default 2) in blocks of ``--overhead-block`` steps (default 10) traced and untraced in
  turns, ``--jobs`` jobs (default 10) beside as many A/A controls
  (the tracer never installed); the figure is the difference of the two series' means with
  its 95% interval, met when the interval's top is at most 1%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    add_smoke_flag,
    command_line,
    md_table,
    sigterm_as_interrupt,
    smoke_implies_quick,
    source_state,
    work_dir,
)

TARGET_OVERHEAD = 0.01
TARGET_S = 15.0
TARGET_NAMED = 0.90
FAULTS = ("sleep", "slow", "kill", "stop", "mismatch", "deadlock")


def log(msg: str) -> None:
    print(f"[colltrace] {msg}", flush=True)


_MICRO = r"""
import os, sys, time, tracemalloc, torch, torch.distributed as dist
import bootseer.colltrace as ct
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
t = torch.ones(4)
n = %d
def block():
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / n
for _ in range(200): dist.all_reduce(t)
off, on = [], []
for i in range(%d):
    off.append(block())
    ct.enable(sys.argv[1])
    on.append(block())
    ct.disable()
ct.enable(sys.argv[1])
for _ in range(100): dist.all_reduce(t)
tracemalloc.start()
s0 = tracemalloc.take_snapshot()
for _ in range(1000): dist.all_reduce(t)
s1 = tracemalloc.take_snapshot()
grown = sum(st.size_diff for st in s1.compare_to(s0, "filename"))
live = sum(st.count_diff for st in s1.compare_to(s0, "filename"))
print("MICRO", sorted(off)[len(off)//2], sorted(on)[len(on)//2], grown / 1000, live / 1000)
"""


def micro(work: Path, repeats: int, per_block: int) -> dict[str, Any]:
    port = _port()
    out = subprocess.run(
        [sys.executable, "-c", _MICRO % (port, per_block, repeats), str(work / "micro")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MICRO")), None)
    if line is None:
        raise RuntimeError(f"micro benchmark failed: {out.stderr[-2000:]}")
    _, off, on, grown, live = line.split()
    return {
        "op_us_untraced": float(off) * 1e6,
        "op_us_traced": float(on) * 1e6,
        "cost_us_per_op": (float(on) - float(off)) * 1e6,
        "bytes_retained_per_op": float(grown),
        "objects_retained_per_op": float(live),
    }


def overhead(work: Path, repeats: int, steps: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    ring_sizes: list[int] = []
    for i in range(repeats):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            rings = work / f"ovh-{i}-{mode}"
            cmd = [
                sys.executable,
                "-m",
                "bootseer.testing.colltrace_job",
                "--world",
                "3",
                "--dir",
                str(rings),
                "--steps",
                str(steps),
                *(["--no-trace"] if mode == "off" else []),
            ]
            code, stdout = _run_job(cmd, 900)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("iter_ms")), None)
            if code != 0 or line is None:
                raise RuntimeError(f"overhead job failed: {stdout[-1000:]}")
            runs[mode].append(float(line.split()[1]))
            cpu[mode].append(float(line.split()[5]))
            if mode == "on":
                ring_sizes += [p.stat().st_size for p in rings.glob("*.ring")]
            shutil.rmtree(rings, ignore_errors=True)
            log(
                f"overhead repeat {i} {mode}: {runs[mode][-1]:.3f} ms per step, "
                f"{cpu[mode][-1]:.3f} ms CPU of rank 0 per step"
            )
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    coff, con = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    return {
        "iter_ms_off": off,
        "iter_ms_on": on,
        "overhead": (on - off) / off,
        "cpu_ms_off": coff,
        "cpu_ms_on": con,
        "cpu_overhead": (con - coff) / coff,
        "runs": runs,
        "cpu_runs": cpu,
        "ring_bytes": sorted(set(ring_sizes)),
        "steps": steps,
    }


def _run_job(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """A job in a session of its own: (exit code, output); its ranks are killed with it,
    also when we are interrupted."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, stdout


def alternating(
    work: Path, repeats: int, steps: int, block: int, control: bool = False
) -> dict[str, Any]:
    """The overhead inside one job: blocks of ``block`` steps traced and untraced in turns
    (every rank switches at the same step), so both see the same machine load. ``control``:
    the same jobs with the tracer never installed (A/A), whose spread is the method's noise:
    one job's figure moves by about 1% with no tracer at all (2026-11-24)."""
    rows = []
    for i in range(repeats):
        cmd = [
            sys.executable,
            "-m",
            "bootseer.testing.colltrace_job",
            "--world",
            "3",
            "--dir",
            str(work / f"alt-{'c' if control else ''}{i}"),
            "--steps",
            str(steps),
            "--alternate",
            str(block),
            "--no-trace",
            *(["--alternate-control"] if control else []),
        ]
        code, stdout = _run_job(cmd, 1200)
        line = next((ln for ln in stdout.splitlines() if ln.startswith("alt_ms")), None)
        if code != 0 or line is None:
            raise RuntimeError(f"alternating job failed: {stdout[-1000:]}")
        f = line.split()
        rows.append(
            {
                "on_ms": float(f[2]),
                "off_ms": float(f[4]),
                "cpu_on_ms": float(f[6]),
                "cpu_off_ms": float(f[8]),
            }
        )
        log(
            f"alternating{' (control)' if control else ''} {i}: step {rows[-1]['off_ms']:.3f} -> {rows[-1]['on_ms']:.3f} ms, "
            f"CPU {rows[-1]['cpu_off_ms']:.3f} -> {rows[-1]['cpu_on_ms']:.3f} ms"
        )
    on = statistics.median(r["on_ms"] for r in rows)
    off = statistics.median(r["off_ms"] for r in rows)
    con = statistics.median(r["cpu_on_ms"] for r in rows)
    coff = statistics.median(r["cpu_off_ms"] for r in rows)
    per_job = [(r["on_ms"] - r["off_ms"]) / r["off_ms"] for r in rows]
    return {
        "runs": rows,
        "on_ms": on,
        "off_ms": off,
        "overhead": (on - off) / off,
        "per_job_median": statistics.median(per_job),
        "per_job_sd": statistics.stdev(per_job) if len(per_job) > 1 else 0.0,
        "cpu_on_ms": con,
        "cpu_off_ms": coff,
        "cpu_overhead": (con - coff) / coff,
        "steps": steps,
        "block": block,
    }


def faults(
    work: Path, trials: int, timeout_s: float, which: tuple[str, ...] = FAULTS
) -> dict[str, Any]:
    from bootseer.colltrace.reader import Watch
    from bootseer.testing.colltrace_job import Trial

    results: dict[str, Any] = {}
    for fault in which:
        rows = []
        for i in range(trials):
            rank = i % 3
            rings = work / f"{fault}-{i}"
            trial = Trial(fault, str(rings), world=3, rank=rank, at=60 if fault == "slow" else 20)
            watch = Watch(rings, log=lambda line: None)
            found: list[Any] = []
            try:
                found = trial.watch(watch, timeout_s, poll_s=0.25, until=lambda f: bool(f.ranks))
            finally:
                trial.stop()
                watch.close()
                shutil.rmtree(rings, ignore_errors=True)
            after = found  # passes ended after the injection (earlier: trial.before)
            first = next((f for f in after if f.ranks), None)  # the first verdict naming a rank
            named = [r for f in found for r in f.ranks]
            row = {
                "rank": rank,
                "injected": trial.injected,
                "verdict_s": None
                if first is None or trial.injected is None
                else round(first.time - trial.injected, 3),
                "kind": first.kind if first else None,
                "line": first.line if first else None,
                "named": bool(first and rank in first.ranks),
                "wrong": sorted({r for r in named if r != rank}),
                "false_alarms_before": [f.line for f in trial.before],
                "load": _load(),
                "unnamed_before": [f.line for f in after[: after.index(first)]]
                if first in after
                else [f.line for f in after],
            }
            rows.append(row)
            log(
                f"{fault} trial {i} rank {rank}: {row['verdict_s']} s, {row['kind']}, "
                f"named {row['named']}, wrong {row['wrong']}: {row['line']}"
            )
        times = [r["verdict_s"] for r in rows if r["verdict_s"] is not None and r["named"]]
        ok = [
            r
            for r in rows
            if r["named"] and r["verdict_s"] is not None and r["verdict_s"] <= TARGET_S
        ]
        results[fault] = {
            "trials": rows,
            "p50_s": _pct(times, 50),
            "p90_s": _pct(times, 90),
            "named": sum(r["named"] for r in rows),
            "n": len(rows),
            "wrong": sum(bool(r["wrong"]) for r in rows),
            "no_verdict": sum(r["verdict_s"] is None for r in rows),
            "within_target": len(ok) / len(rows) if rows else 0.0,
        }
    return results


def cluster_link(work: Path, trials: int, timeout_s: float) -> dict[str, Any]:
    """One node's link slowed (tc) under a 2-node x 2-rank torchrun job on the cluster
    fixture: the rings of both nodes in one directory (the nodes share the host's files), read
    by one Watch; injection = the moment ``slow_link`` returns. A first verdict naming no rank
    (transport or link) is followed by the link probe (:mod:`bootseer.colltrace.probe`) on
    each node against the job's store: the node it names, and when."""
    from bootseer.colltrace.probe import slow_node
    from bootseer.colltrace.reader import Watch
    from bootseer.colltrace.ring import read_rings
    from bootseer.testing.cluster import Cluster, Link
    from bootseer.testing.colltrace_job import Probes

    rows = []
    for i in range(trials):
        rings = work / f"link-{i}"
        rings.mkdir(parents=True, mode=0o700)
        with Cluster(2, link=Link(rate="200mbit"), services=("rendezvous",), workdir=work) as c:
            job = [
                "-m",
                "bootseer.testing.colltrace_job",
                "--torchrun",
                "--dir",
                str(rings),
                "--numel",
                "262144",
                "--work-ms",
                "20",
                "--steps",
                "100000",
            ]
            procs = [
                n.popen(
                    n.torchrun(job, nnodes=2, nproc_per_node=2, max_restarts=0),
                    env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for n in c.nodes
            ]
            watch = Watch(rings, log=lambda line: None)
            probes = Probes(c.nodes, c.services.rendezvous_endpoint)  # connected, waiting
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # a baseline first: 80 ops in every group
                snaps = read_rings(rings)
                if len(snaps) == 4 and min(len(s.ops) for s in snaps) >= 170:
                    break
                time.sleep(1)
            watch.poll(force=True)
            c.slow_link(1, rate="20mbit")
            injected = time.time()
            found: list[Any] = []
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and not found:
                found += watch.poll(force=True)
                time.sleep(0.25)
            watch.close()
            first = found[0] if found else None
            probe, slow, probed = {}, None, None
            if first is not None and not first.ranks:  # no rank: which node's link?
                t0 = time.time()
                probe = probes.measure()
                slow, probed = slow_node(probe), time.time()
                log(
                    f"probe: {probed - t0:.1f} s in all, of which connect and measure "
                    + ", ".join(
                        f"{n} {m.get('took_s', 0):.1f} s (connect {m.get('connect_s', 0):.1f} s)"
                        for n, m in probe.items()
                    )
                    + " (the rest: the order reaching the waiting probes, their output)"
                )
            probes.close()
            for proc in procs:
                proc.kill()
        node1 = {s.rank for s in read_rings(rings) if s.node == "node1"}
        row = {
            "verdict_s": None if first is None else round(first.time - injected, 3),
            "kind": first.kind if first else None,
            "line": first.line if first else None,
            "named": bool(first and first.ranks and set(first.ranks) <= node1),
            "wrong": sorted({r for f in found for r in f.ranks} - node1),
            "node1_ranks": sorted(node1),
            "probe": probe,
            "link_node": slow[0] if slow else None,
            "link_why": slow[1] if slow else None,
            "node_s": None if probed is None or not slow else round(probed - injected, 3),
            "node_named": bool(slow and slow[0] == "node1"),
            "node_wrong": bool(slow and slow[0] != "node1"),
        }
        rows.append(row)
        log(
            f"link trial {i}: {row['verdict_s']} s: {row['line']}; probe: "
            f"{row['link_node']} at {row['node_s']} s ({row['link_why']})"
        )
        shutil.rmtree(rings, ignore_errors=True)
    times = [r["verdict_s"] for r in rows if r["verdict_s"] is not None]
    node_times = [r["node_s"] for r in rows if r["node_named"]]
    return {
        "trials": rows,
        "p50_s": _pct(times, 50),
        "p90_s": _pct(times, 90),
        "node_named": sum(r["node_named"] for r in rows),
        "node_wrong": sum(r["node_wrong"] for r in rows),
        "node_p50_s": _pct(node_times, 50),
        "node_p90_s": _pct(node_times, 90),
        "named": sum(r["named"] for r in rows),
        "n": len(rows),
        "wrong": sum(bool(r["wrong"]) for r in rows),
        "within_target": sum(
            1
            for r in rows
            if r["named"] and r["verdict_s"] is not None and r["verdict_s"] <= TARGET_S
        )
        / max(1, len(rows)),
        "detected": sum(r["verdict_s"] is not None for r in rows),
    }


def cluster_overhead(
    work: Path, jobs: int, steps: int, block: int, numel: int = 16384, nproc: int = 2
) -> dict[str, Any]:
    """The tracer's cost on the cluster fixture: a 2-node x ``nproc``-rank gloo job under torchrun
    (each node a network namespace, the ranks' traffic over the nodes' veth links), steps of
    20 ms of compute and two all_reduces of ``numel`` floats, blocks of ``block`` steps traced
    and untraced in turns (every rank switches at the same step). ``jobs`` jobs with the
    tracer and as many A/A controls (the same alternation, the tracer never installed),
    interleaved on one cluster; the figure is the difference of the two series' means, with
    its 95% interval (the control's spread is the method's own noise)."""
    from bootseer.testing.cluster import Cluster

    rows: dict[str, list[dict[str, float]]] = {"tracer": [], "control": []}
    order = [
        kind
        for i in range(jobs)
        for kind in (("tracer", "control") if i % 2 == 0 else ("control", "tracer"))
    ]
    with Cluster(2, services=("rendezvous",), workdir=work) as c:
        for i, kind in enumerate(order):
            rings = work / f"ovh-cluster-{i}"
            rings.mkdir(parents=True, mode=0o700)
            job = [
                "-m",
                "bootseer.testing.colltrace_job",
                "--torchrun",
                "--dir",
                str(rings),
                "--numel",
                str(numel),
                "--work-ms",
                "20",
                "--steps",
                str(steps),
                "--alternate",
                str(block),
                "--no-trace",
                *(["--alternate-control"] if kind == "control" else []),
            ]
            procs = [
                n.popen(
                    n.torchrun(
                        job, nnodes=2, nproc_per_node=nproc, max_restarts=0, rdzv_id=f"ovh-{i}"
                    ),
                    env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for n in c.nodes
            ]
            outputs = []
            try:
                for proc in procs:
                    outputs.append(proc.communicate(timeout=900)[0])
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
            line = next(
                (ln for out in outputs for ln in out.splitlines() if ln.startswith("alt_ms")), None
            )
            if any(proc.returncode for proc in procs) or line is None:
                raise RuntimeError(
                    f"cluster overhead job {i} ({kind}) failed: "
                    + " | ".join(out[-1500:] for out in outputs)
                )
            f = line.split()
            row = {
                "on_ms": float(f[2]),
                "off_ms": float(f[4]),
                "cpu_on_ms": float(f[6]),
                "cpu_off_ms": float(f[8]),
            }
            row["step"] = (row["on_ms"] - row["off_ms"]) / row["off_ms"]
            row["cpu"] = (row["cpu_on_ms"] - row["cpu_off_ms"]) / row["cpu_off_ms"]
            rows[kind].append(row)
            shutil.rmtree(rings, ignore_errors=True)
            log(
                f"cluster overhead job {i} ({kind}): step {row['off_ms']:.3f} -> "
                f"{row['on_ms']:.3f} ms ({row['step'] * 100:+.2f}%), CPU "
                f"{row['cpu'] * 100:+.2f}%; load {_load()}"
            )
    out: dict[str, Any] = {
        "jobs": rows,
        "steps": steps,
        "block": block,
        "numel": numel,
        "ranks": 2 * nproc,
        "nodes": 2,
        "nproc": nproc,
    }
    for metric in ("step", "cpu"):
        t = [r[metric] for r in rows["tracer"]]
        a = [r[metric] for r in rows["control"]]
        diff = statistics.mean(t) - statistics.mean(a)
        se = (
            (statistics.variance(t) / len(t) + statistics.variance(a) / len(a)) ** 0.5
            if len(t) > 1 and len(a) > 1
            else float("nan")
        )
        out[metric] = {
            "tracer_mean": statistics.mean(t),
            "tracer_median": statistics.median(t),
            "tracer_sd": statistics.stdev(t) if len(t) > 1 else 0.0,
            "control_mean": statistics.mean(a),
            "control_median": statistics.median(a),
            "control_sd": statistics.stdev(a) if len(a) > 1 else 0.0,
            "overhead": diff,
            "ci95": [diff - 1.96 * se, diff + 1.96 * se],
        }
    return out


def _cluster_overhead(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """:func:`cluster_overhead` with the command line's jobs, steps, block and ranks."""
    return cluster_overhead(
        work,
        jobs=args.jobs or (1 if args.quick else 10),
        steps=args.overhead_steps or (40 if args.quick else 400),
        block=args.overhead_block,
        nproc=args.overhead_nproc,
    )


def _overhead_md(o: dict[str, Any]) -> list[str]:
    rows = []
    for metric, name in (
        ("step", "step time (rank 0, median per mode)"),
        ("cpu", "rank 0's CPU time per step"),
    ):
        m = o[metric]
        rows.append(
            [
                name,
                f"{m['tracer_mean'] * 100:+.2f}% (sd {m['tracer_sd'] * 100:.2f}%)",
                f"{m['control_mean'] * 100:+.2f}% (sd {m['control_sd'] * 100:.2f}%)",
                f"**{m['overhead'] * 100:+.2f}%** [{m['ci95'][0] * 100:+.2f}%, "
                f"{m['ci95'][1] * 100:+.2f}%]",
                f"<= {TARGET_OVERHEAD * 100:.0f}%: "
                + ("met" if m["ci95"][1] <= TARGET_OVERHEAD else "not shown"),
            ]
        )
    return [
        f"overhead on the cluster fixture ({o['nodes']} nodes x {o.get('nproc', 2)} "
        f"ranks under torchrun, "
        f"20 ms compute + 2 all_reduces of {o['numel']} floats per step, {o['steps']} "
        f"steps in blocks of {o['block']}, {len(o['jobs']['tracer'])} jobs with the tracer "
        f"and {len(o['jobs']['control'])} A/A controls, interleaved):",
        "",
        *md_table(
            [
                "measure",
                "tracer on vs off, mean of jobs",
                "A/A control, mean of jobs",
                "overhead: tracer - control [95%]",
                "target",
            ],
            rows,
        ),
    ]


@contextlib.contextmanager
def background_load(n: int) -> Any:
    """``n`` busy processes outside the job (a loaded machine), each killed by its pid at the
    end, also when the run is interrupted."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(n)
    ]
    if procs:
        log(f"background load: {n} busy processes {[p.pid for p in procs]}")
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


#: on the services host: every node's shipped window, each time it changes, as the store
#: holds it (what the controller reads every LINK_CHECK_S), one JSON line each, until killed
_TAP = r"""
import json, sys, time
from bootseer.robust import wire
store = wire.connect(sys.argv[1], 30.0)
keys = wire.Keys("job")
seen = {}
with open(sys.argv[2], "a", encoding="utf-8") as out:
    while True:
        nodes = (wire.get(store, keys.nodes) or b"").decode().split()
        for n in nodes:
            data = wire.get(store, keys.node(n, "colltrace"))
            if data is not None and data != seen.get(n):
                seen[n] = data
                out.write(json.dumps({"read": time.time(), "node": n,
                                      "doc": wire.decode(data, key=keys.node(n, "colltrace"),
                                                         limit=wire.MAX_DUMP_BYTES)}) + "\n")
                out.flush()
        time.sleep(0.5)
"""


def controller_link(
    work: Path,
    trials: int,
    timeout_s: float,
    failslow_s: float = 10.0,
    log_to: Any = None,
    keep: Path | None = None,
) -> dict[str, Any]:
    """One node's link slowed (tc) under the real path: ``bootseer controller`` on the
    controller host and ``bootseer run --controller --colltrace`` on each of 3 nodes around a
    1-rank-per-node torchrun job. The agents ship their ring windows; on the tracer's
    suspicion (a slowdown or a stuck op naming no rank) a fail-slow round orders every agent
    to probe its link, and the next round names the node. Injection = ``slow_link``
    returning; the times are the controller's log lines' arrival."""
    import shlex
    import threading

    from bootseer.testing.cluster import Cluster, Link
    from bootseer.testing.cluster_host import wait_for_line

    repo = str(Path(__file__).resolve().parents[1])
    rows = []
    for i in range(trials):
        out = work / f"ctl-link-{i}"
        out.mkdir(parents=True)
        lines: list[tuple[float, str]] = []
        with (
            contextlib.ExitStack() as stack,
            Cluster(3, link=Link(rate="200mbit"), services=("rendezvous",), workdir=work) as c,
        ):
            port = c.services.rendezvous_endpoint.rsplit(":", 1)[1]
            ctl = c.services.popen(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "controller",
                    "--store",
                    f"127.0.0.1:{port}",
                    "--trace-dir",
                    str(out / "ctl"),
                    "--exclusion",
                    str(out / "excluded.json"),
                    "--failslow-interval",
                    str(failslow_s),
                ],
                env={"PYTHONPATH": repo},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            # its log lines on stderr, READY alone on stdout (a warning and READY in one read
            # would leave READY in the buffer, unselected)
            threading.Thread(target=_stamped, args=(ctl.stderr, lines), daemon=True).start()
            wait_for_line(ctl, "READY", "the controller", 180)
            windows = None
            if keep is not None:  # the windows kept for an offline replay (replay_windows)
                keep.mkdir(parents=True, exist_ok=True)
                windows = keep / f"ctl-link-{i}-windows.ndjson"
                windows.unlink(missing_ok=True)
                c.services.popen(
                    [sys.executable, "-c", _TAP, f"127.0.0.1:{port}", str(windows)],
                    env={"PYTHONPATH": repo},
                    stdout=subprocess.DEVNULL,
                )
            agents = []
            for n in c.nodes:
                job = n.torchrun(
                    [
                        "-m",
                        "bootseer.testing.colltrace_job",
                        "--torchrun",
                        "--dir",
                        "@DIR@",
                        "--numel",
                        "262144",
                        "--work-ms",
                        "20",
                        "--steps",
                        "100000",
                    ],
                    nnodes=3,
                    nproc_per_node=1,
                    max_restarts=0,
                )
                line = shlex.join(job).replace("@DIR@", '"$BOOTSEER_COLLTRACE_DIR"')
                argv = [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "run",
                    "--controller",
                    c.services.rendezvous_endpoint,
                    "--node",
                    n.name,
                    "--colltrace",
                    "--colltrace-dir",
                    str(out / f"rings-{n.name}"),
                    "--colltrace-poll",
                    "0.5",
                    "--state-dir",
                    str(out / f"state-{n.name}"),
                    "--trace-dir",
                    str(out / f"trace-{n.name}"),
                    "--min-free-disk",
                    "0",
                    "--min-free-memory",
                    "0",
                    "--max-restarts",
                    "0",
                    "--",
                    "sh",
                    "-c",
                    "exec " + line,
                ]
                agents.append(
                    n.popen(
                        argv,
                        env={"PYTHONPATH": repo},
                        stdout=subprocess.DEVNULL,
                        stderr=stack.enter_context(open(out / f"agent-{n.name}.err", "ab")),
                    )
                )
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # a baseline first: 80 ops in every group
                counts = [
                    max(
                        (
                            len(s.ops)
                            for d in (out / f"rings-{n.name}").glob("*/attempt-*")
                            for s in read_rings_safe(d)
                        ),
                        default=0,
                    )
                    for n in c.nodes
                ]
                if min(counts) >= 170:
                    break
                time.sleep(1)
            started = len(lines)
            c.slow_link(1, rate="20mbit")
            injected = time.time()
            suspected = named_at = None
            node = None
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and node is None:
                for t, ln in lines[started:]:
                    if suspected is None and "every node probes its link" in ln:
                        suspected = t
                    if "'s link is slow" in ln:
                        node, named_at = ln.split("fail-slow: ", 1)[1].split("'s link")[0], t
                        break
                time.sleep(0.25)
            egress = subprocess.run(  # a tbf stuck on a packet over its burst sends nothing
                ["tc", "-n", c.nodes[1].netns, "-s", "qdisc", "show", "dev", "eth0"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
            for proc in agents:
                proc.terminate()
            for proc in agents:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
            ctl.kill()
        said = [ln for _, ln in lines[started:] if "fail-slow" in ln]
        row = {
            "suspected_s": None if suspected is None else round(suspected - injected, 3),
            "node": node,
            "node_s": None if named_at is None else round(named_at - injected, 3),
            "node_named": node == "node1",
            "node_wrong": node is not None and node != "node1",
            "lines": said[:12],
            "controller_tail": [ln for _, ln in lines[-15:]],
            "load": _load(),
            "injected": injected,
            "node1_egress_tc": egress,
            "windows": str(windows) if windows else None,
            "node1_windows_after": None
            if windows is None
            else _shipped_after(windows, "node1", injected),
        }
        rows.append(row)
        (log_to or log)(
            f"controller link trial {i}: suspected at {row['suspected_s']} s, "
            f"node {node} at {row['node_s']} s; node1's windows after the fault: "
            f"{row['node1_windows_after']}; {said[:3]}"
        )
        if keep is not None:  # the agents' own lines and the controller's, with the windows
            for err in out.glob("agent-*.err"):
                shutil.copyfile(err, keep / f"ctl-link-{i}-{err.name}")
            (keep / f"ctl-link-{i}-controller.log").write_text(
                "".join(f"{t:.3f} {ln}\n" for t, ln in lines)
            )
        shutil.rmtree(out, ignore_errors=True)
    times = [r["node_s"] for r in rows if r["node_named"]]
    return {
        "trials": rows,
        "n": len(rows),
        "node_named": sum(r["node_named"] for r in rows),
        "node_wrong": sum(r["node_wrong"] for r in rows),
        "no_verdict": sum(r["node"] is None for r in rows),
        "node_p50_s": _pct(times, 50),
        "node_p90_s": _pct(times, 90),
        "suspected_p50_s": _pct(
            [r["suspected_s"] for r in rows if r["suspected_s"] is not None], 50
        ),
        # the fault table's columns: the node named is the verdict here
        "named": sum(r["node_named"] for r in rows),
        "wrong": sum(r["node_wrong"] for r in rows),
        "p50_s": _pct(times, 50),
        "p90_s": _pct(times, 90),
        "within_target": sum(1 for t in times if t <= TARGET_S) / max(1, len(rows)),
    }


def _shipped_after(path: Path, node: str, t: float) -> int:
    """How many windows ``node`` shipped after ``t`` (0: its agent could not reach the store)."""
    try:
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    except (OSError, ValueError):
        return 0
    return sum(1 for r in rows if r["node"] == node and r["doc"].get("time", 0) > t)


def _stamped(stream: Any, into: list[tuple[float, str]]) -> None:
    """Each line of ``stream`` with its arrival time, into ``into``."""
    for raw in iter(stream.readline, b""):
        into.append((time.time(), raw.decode("utf-8", "replace").rstrip()))


def read_rings_safe(directory: Path) -> list[Any]:
    """The rings of ``directory``; none while it is being made."""
    from bootseer.colltrace.ring import read_rings

    try:
        return read_rings(directory)
    except (OSError, ValueError):
        return []


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_colltrace.py", description=__doc__.split("\n")[0])
    p.add_argument("--results", default="bench-results")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 trial of sleep and kill, one short overhead pair",
    )
    p.add_argument("--trials", type=int, default=None, help="trials per fault (default 10)")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="also the slowed-link fault on the cluster fixture (root, tc)",
    )
    p.add_argument(
        "--only-cluster",
        action="store_true",
        help="only the slowed-link fault (its results: colltrace-link.json/.md)",
    )
    p.add_argument(
        "--only-cluster-overhead",
        action="store_true",
        help="only the tracer's overhead on the cluster fixture (root): "
        "colltrace-overhead.json/.md",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="cluster overhead: jobs with the tracer, and as many A/A controls "
        "(default 10; --quick 1)",
    )
    p.add_argument(
        "--overhead-steps",
        type=int,
        default=None,
        help="cluster overhead: steps per job (default 400; --quick 40)",
    )
    p.add_argument(
        "--overhead-block",
        type=int,
        default=10,
        help="cluster overhead: steps per block traced or not (default 10)",
    )
    p.add_argument(
        "--overhead-nproc", type=int, default=2, help="cluster overhead: ranks per node (default 2)"
    )
    p.add_argument(
        "--link-path",
        choices=("controller", "command"),
        default="controller",
        help="the slowed-link trial: the controller and its agents on the cluster "
        "(default), or the store probe run as a command per node",
    )
    p.add_argument(
        "--only",
        default="",
        help=f"only these fault classes, comma-separated ({','.join(FAULTS)}): "
        "colltrace-only.json/.md",
    )
    p.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes outside the job for the whole run",
    )
    add_smoke_flag(p)
    args = p.parse_args(argv)
    smoke_implies_quick(args)
    only = tuple(f for f in args.only.split(",") if f)
    if bad := [f for f in only if f not in FAULTS]:
        p.error(f"--only: unknown fault class {', '.join(bad)}; known: {', '.join(FAULTS)}")
    if args.background_load < 0:
        p.error("--background-load: a number of processes, 0 or more")
    trials = args.trials or (1 if args.quick else 10)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:  # the run's own directory under the suites' cache
        work = work_dir("bench-colltrace-", stack)  # (a file there: FileExistsError, exit 1)
        stack.enter_context(background_load(args.background_load))
        if only:
            return _only(args, only, work, results, trials)
        if args.only_cluster_overhead:
            o = _cluster_overhead(args, work)
            md = [
                "# colltrace overhead on the cluster fixture",
                "",
                f"command: `{command_line('bench_colltrace.py')}`; load {_load()}",
                "",
                *_overhead_md(o),
            ]
            (results / "colltrace-overhead.json").write_text(
                json.dumps(
                    {
                        "command": command_line("bench_colltrace.py"),
                        "load": _load(),
                        "overhead": o,
                        **source_state(["bootseer/colltrace", "bootseer/testing/colltrace_job.py"]),
                    },
                    indent=2,
                )
            )
            (results / "colltrace-overhead.md").write_text("\n".join(md) + "\n")
            print("\n".join(md))
            return 0
        if args.only_cluster:
            link = (
                controller_link(work, trials, timeout_s=120.0, keep=results)
                if args.link_path == "controller"
                else cluster_link(work, trials, timeout_s=60.0)
            )
            (results / "colltrace-link.json").write_text(
                json.dumps(
                    {"command": command_line("bench_colltrace.py"), "load": _load(), "link": link},
                    indent=2,
                )
            )
            print(json.dumps({k: v for k, v in link.items() if k != "trials"}))
            return 0
        return _full(args, work, results, trials)


def _only(
    args: argparse.Namespace, only: tuple[str, ...], work: Path, results: Path, trials: int
) -> int:
    """Only the fault classes asked for: colltrace-only.json and colltrace-only.md."""
    load_before = _load()
    started = time.time()
    f = faults(work, trials, timeout_s=60.0, which=only)
    doc = {
        "command": command_line("bench_colltrace.py"),
        "load_before": load_before,
        "load_after": _load(),
        "background_load": args.background_load,
        "seconds": round(time.time() - started, 1),
        "faults": f,
        **source_state(["bootseer/colltrace", "bootseer/testing/colltrace_job.py"]),
    }
    (results / "colltrace-only.json").write_text(json.dumps(doc, indent=2))
    md = [
        f"# colltrace ({', '.join(only)})",
        "",
        f"command: `{doc['command']}`; background load {args.background_load} busy "
        f"processes; load {load_before} -> {doc['load_after']}",
        "",
        *md_table(
            [
                "fault",
                "trials",
                "named",
                "wrong",
                "no verdict",
                "p50",
                "p90",
                f"named <= {TARGET_S:.0f} s",
            ],
            _fault_rows(f, no_verdict=True),
        ),
    ]
    (results / "colltrace-only.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def _fault_rows(f: dict[str, Any], no_verdict: bool = False) -> list[list[str]]:
    return [
        [
            k,
            str(v["n"]),
            f"{v['named']}/{v['n']}",
            str(v["wrong"]),
            *([str(v.get("no_verdict", "-"))] if no_verdict else []),
            "-" if v["p50_s"] is None else f"{v['p50_s']:.2f} s",
            "-" if v["p90_s"] is None else f"{v['p90_s']:.2f} s",
            f"{v['within_target'] * 100:.0f}%",
        ]
        for k, v in f.items()
    ]


def _full(args: argparse.Namespace, work: Path, results: Path, trials: int) -> int:
    """Every measure but the slowed link alone: colltrace.json and colltrace.md."""
    load_before = _load()
    started = time.time()
    log(f"load {load_before}; micro cost per op")
    m = micro(work, repeats=3 if args.quick else 11, per_block=300 if args.quick else 2000)
    log(f"per op: {m['op_us_untraced']:.1f} us untraced, {m['op_us_traced']:.1f} us traced")
    o = overhead(work, repeats=1 if args.quick else 3, steps=30 if args.quick else 150)
    alt_args = {"repeats": 1 if args.quick else 6, "steps": 40 if args.quick else 400, "block": 10}
    alt = alternating(work, **alt_args)
    ctl = alternating(work, **alt_args, control=True)
    log(
        f"alternating: {alt['overhead'] * 100:+.2f}% step, "
        f"{alt['cpu_overhead'] * 100:+.2f}% CPU; the A/A control: "
        f"{ctl['overhead'] * 100:+.2f}% step"
    )
    log(
        f"overhead: {o['overhead'] * 100:+.2f}% ({o['iter_ms_off']:.3f} -> "
        f"{o['iter_ms_on']:.3f} ms per step)"
    )
    f = faults(work, trials, timeout_s=60.0, which=("sleep", "kill") if args.quick else FAULTS)
    co = None
    if args.cluster:
        co = _cluster_overhead(args, work)
        f["link"] = (
            controller_link(work, trials, timeout_s=120.0)
            if args.link_path == "controller"
            else cluster_link(work, trials, timeout_s=60.0)
        )
    doc = {
        "command": command_line("bench_colltrace.py"),
        "quick": args.quick,
        "smoke": args.smoke,
        "load_before": load_before,
        "load_after": _load(),
        "seconds": round(time.time() - started, 1),
        "micro": m,
        "overhead": o,
        "alternating": alt,
        "alternating_control": ctl,
        "cluster_overhead": co,
        "faults": f,
        "not_run": []
        if args.cluster
        else ["link slowed on one node and the overhead on the cluster fixture (need --cluster)"],
        **source_state(["bootseer/colltrace", "bootseer/testing/colltrace_job.py"]),
    }
    (results / "colltrace.json").write_text(json.dumps(doc, indent=2))
    rows = _fault_rows(f)
    md = [
        f"# colltrace ({'quick, smoke' if args.smoke else 'quick' if args.quick else 'full'})",
        "",
        f"command: `{doc['command']}`; load {load_before} -> {doc['load_after']}",
        "",
        f"cost per op (world-1 gloo all_reduce of 4 floats): {m['op_us_untraced']:.1f} us "
        f"untraced, {m['op_us_traced']:.1f} us traced ({m['cost_us_per_op']:+.1f} us); "
        f"retained per op: {m['bytes_retained_per_op']:.1f} bytes, "
        f"{m['objects_retained_per_op']:.3f} objects",
        "",
        f"overhead (3 gloo ranks, 20 ms compute + 2 all_reduce per step, median step): "
        f"{o['iter_ms_off']:.3f} ms untraced, {o['iter_ms_on']:.3f} ms traced: "
        f"{o['overhead'] * 100:+.2f}% (target <= {TARGET_OVERHEAD * 100:.0f}%); rank 0's CPU "
        f"time per step {o['cpu_ms_off']:.3f} ms -> {o['cpu_ms_on']:.3f} ms "
        f"({o['cpu_overhead'] * 100:+.2f}%); ring file "
        f"{o['ring_bytes']} bytes per rank (fixed by capacity)",
        "",
        f"overhead inside one job (blocks of {alt['block']} steps traced and untraced in "
        f"turns, {alt['steps']} steps, median of {len(alt['runs'])} jobs): step "
        f"{alt['off_ms']:.3f} -> {alt['on_ms']:.3f} ms ({alt['overhead'] * 100:+.2f}%), "
        f"rank 0's CPU {alt['cpu_off_ms']:.3f} -> {alt['cpu_on_ms']:.3f} ms "
        f"({alt['cpu_overhead'] * 100:+.2f}%); per job: median "
        f"{alt['per_job_median'] * 100:+.2f}%, sd {alt['per_job_sd'] * 100:.2f}% "
        f"(target <= {TARGET_OVERHEAD * 100:.0f}%); the same jobs with the tracer never "
        f"installed (A/A control): {ctl['overhead'] * 100:+.2f}%, per job median "
        f"{ctl['per_job_median'] * 100:+.2f}%, sd {ctl['per_job_sd'] * 100:.2f}%",
        "",
        *(_overhead_md(co) + [""] if co else []),
        *md_table(
            ["fault", "trials", "named", "wrong", "p50", "p90", f"named <= {TARGET_S:.0f} s"], rows
        ),
        "",
        "not run: " + ("; ".join(doc["not_run"]) or "-"),
    ]
    (results / "colltrace.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    with sigterm_as_interrupt():  # a stopped run still removes its work directory
        sys.exit(main())
