"""What each injected fault cost, from the run's own records, the same way for both modes.

Why from records: the agents' traces, the controller's verdicts, torchrun's time-stamped
output and the job's step log are what an operator has; nothing here asks the processes.

Per fault (its window runs to the next fault's injection or the end of the run):

* ``fired``: when the fault took effect (the rank's claim for a job-side fault, else the
  harness's action);
* ``detected``: bootseer, the first event (``crash``, ``hang``, ``nonfinite``, ``health``,
  ``fail_slow``) of any agent in the window; the peer, the first torchrun line that notices
  (:data:`PEER_NOTICE`);
* ``named``: bootseer, whether the first verdict's ranks hold the injected rank or its nodes
  (or, for a lost node, the nodes that never answered the dump) hold the injected node (for
  the store down: the verdict's class is ``storage_error`` and it evicts nobody, or, ridden
  out behind the memory tier, no incident at all and no new process: ``trained_through``); the
  peer, whether the first worker torchrun reports failed is the injected rank (or on the
  injected node); ``evicted``: the nodes the window's verdicts evicted (torchrun evicts none);
* ``restart_s``: from detection to the job's first step by a new process of rank 0;
* ``recomputed``: the steps done before the failure that the restarted job did again.

ETTR: the project's one accounting (``bootseer.robust.ettr``, docs/robust.md "ETTR"), never
derived here. bootseer's run: the agents' traces, as ``bootseer report --end END TRACE_DIR``
prints it (the command is kept with the figure); the peer (torchrun alone, no trace): the
same accounting on its step log (rank 0's steps, ``ettr_from_steps``). bootseer's step log
through the same function is kept beside, as a check of the traces' estimates (recomputation,
the partial step at a failure), not as a second ETTR.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from robust_cluster import read_records
from robust_faults import JOB_SIDE, NODE_SIDE, Fault, taken

DETECTING = ("crash", "hang", "nonfinite", "health", "fail_slow")
PEER_NOTICE = re.compile(
    r"failed \(exitcode|Worker group (?:FAILED|UNHEALTHY)|will restart "
    r"worker group|Rendezvous'ing worker group|RendezvousClosedError|"
    r"Closing signal|closing signal"
)
PEER_FAILED = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) "
    r"\(pid: (?P<pid>\d+)\)"
)
CRASHES = ("sigkill", "exception")
HANGS = ("collective_hang", "dataloader_hang")


def _host(agent: str) -> str:
    """node1-g2 (an agent on node1's replacement) -> node1."""
    return agent.split("-g")[0]


def steps(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    return read_records(out / f"steps-{rank}.jsonl")


def log_lines(out: Path) -> list[tuple[float, str, str]]:
    """Every launcher's output line: (time, launcher, text), in time order."""
    lines = []
    for path in (out / "logs").glob("*.log"):
        if path.name == "controller.log":
            continue
        for raw in path.read_text(errors="replace").splitlines():
            stamp, _, text = raw.partition(" ")
            try:
                lines.append((float(stamp), path.stem, text))
            except ValueError:
                continue
    return sorted(lines)


def pid_ranks(out: Path) -> dict[int, int]:
    return {int(s["pid"]): int(s["rank"]) for s in read_records(out / "starts.jsonl")}


def node_events(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in (out / "trace").glob("*.jsonl"):
        events += [e for e in read_records(path, "event") if e.get("kind") in DETECTING]
    return sorted(events, key=lambda e: e.get("time") or 0)


def fired_at(out: Path, fault: Fault) -> tuple[float | None, int | None]:
    """When the fault took effect and at which step (None: a job-side fault never claimed)."""
    if fault.kind in JOB_SIDE:
        got = taken(out, fault)
        return (got["time"], got["step"]) if got else (None, None)
    return fault.injected.get("time"), None


def measure_fault(
    out: Path,
    mode: str,
    fault: Fault,
    end: float,
    hang_timeout_s: float,
    lines: list[tuple[float, str, str]],
    events: list[dict[str, Any]],
    verdicts: list[dict[str, Any]],
    log0: list[dict[str, Any]],
    pids: dict[int, int],
) -> dict[str, Any]:
    t0, step = fired_at(out, fault)
    row: dict[str, Any] = {
        "id": fault.id,
        "class": fault.kind,
        "rank": fault.rank,
        "node": fault.injected.get("host"),
        "fired": t0,
        "fired_step": step,
    }
    if t0 is None:
        row["note"] = "never claimed (the rank did not step before the window closed)"
        return row
    host = fault.injected.get("host") or (taken(out, fault) or {}).get("host")
    row["node"] = host
    target_ranks = (
        {fault.rank} if fault.rank is not None else set(fault.injected.get("ranks") or [])
    )
    detected = None
    if mode == "bootseer":
        mine = [e for e in events if t0 - 1.0 <= (e.get("time") or 0) < end]
        if mine:
            first = mine[0]
            detected = first["time"]
            row["event"] = {
                "kind": first["kind"],
                "class": first.get("class"),
                "rank": first.get("rank"),
                "node": first.get("node"),
                "step": first.get("step"),
            }
            if fault.kind == "nan":
                nan = [e for e in mine if e["kind"] == "nonfinite"]
                row["nan_step"] = nan[0].get("step") if nan else None
        window = [v for v in verdicts if t0 <= v.get("time", 0) < end]
        if window:
            v = window[0]
            ev = v.get("evidence") or {}
            hosts = {_host(n) for n in v.get("nodes", [])}
            if fault.kind == "node_lost":
                hosts |= {_host(n) for n in ev.get("missing_dumps", [])}
            row["verdict"] = {
                "action": v.get("action"),
                "class": v.get("class"),
                "nodes": v.get("nodes"),
                "ranks": v.get("ranks"),
                "time": v.get("time"),
            }
            row["named"] = bool(target_ranks & set(v.get("ranks") or [])) or host in hosts
            if fault.kind == "store_down":  # the store is everyone's: its class, nobody evicted
                row["named"] = v.get("class") == "storage_error" and not v.get("nodes")
            row["localized_s"] = v["time"] - t0
        elif fault.kind == "store_down" and not mine:
            # the memory tier rides the outage out (docs/ckpt.md): nothing to name, and the
            # row says whether the job trained through it (no new process below)
            row["named"] = True
            row["note"] = "no incident: the durable saves failed behind the memory tier"
        elif fault.kind == "nan" and row.get("nan_step") is not None:
            nan = next(e for e in mine if e["kind"] == "nonfinite")
            row["named"] = nan.get("rank") in target_ranks  # handled on its node
        row["evicted"] = sorted({n for v in window for n in v.get("nodes", [])})
    else:
        mine = [(t, who, text) for t, who, text in lines if t0 - 1.0 <= t < end]
        notice = [x for x in mine if PEER_NOTICE.search(x[2])]
        if notice:
            detected = notice[0][0]
            row["event"] = {"line": notice[0][2][-200:], "launcher": notice[0][1]}
        failed = [(who, m) for _, who, text in mine if (m := PEER_FAILED.search(text))]
        if failed:
            who, m = failed[0]
            rank = pids.get(int(m["pid"]))
            row["peer_failed"] = {"launcher": who, "rank": rank, "exitcode": int(m["code"])}
            row["named"] = rank in target_ranks or (fault.kind in NODE_SIDE and _host(who) == host)
        else:
            row["named"] = False
        row["evicted"] = []
    row["detected"] = detected
    row["detection_s"] = None if detected is None else max(0.0, detected - t0)
    before = [s for s in log0 if s["time"] < t0]
    old_pid = before[-1]["pid"] if before else None
    after = [
        s for s in log0 if s["time"] >= (detected or t0) and s["time"] < end and s["pid"] != old_pid
    ]
    if after:
        row["first_step_time"] = after[0]["time"]
        row["restart_s"] = after[0]["time"] - (detected or t0)
        done = max((s["step"] for s in log0 if s["time"] < after[0]["time"]), default=-1)
        row["resumed_step"] = after[0]["step"]
        row["recomputed"] = max(0, done - after[0]["step"] + 1)
    elif fault.kind == "store_down" and mode == "bootseer" and detected is None:
        row["trained_through"] = True
        row["restart_s"], row["recomputed"] = 0.0, 0
    row["targets"] = targets(fault.kind, row, hang_timeout_s)
    return row


def targets(kind: str, row: dict[str, Any], hang_timeout_s: float) -> dict[str, Any]:
    """The targets of issue 17 that this fault's row can be held to (None: not met or n/a)."""
    got: dict[str, Any] = {}
    d = row.get("detection_s")
    if kind in CRASHES:
        got["detected_within_2s"] = d is not None and d <= 2.0
    if kind in HANGS:
        got[f"detected_within_{hang_timeout_s + 5:g}s"] = d is not None and d <= hang_timeout_s + 5
    if kind == "nan":
        got["nan_at_its_step"] = row.get("nan_step") is not None and row.get("nan_step") == row.get(
            "fired_step"
        )
    if kind != "slow":
        host = row.get("node")
        got["named"] = bool(row.get("named"))
        got["evicted_only_its_group"] = all(_host(n) == host for n in row.get("evicted", []))
    return got


def ettr_of_steps(log0: list[dict[str, Any]], end: float) -> dict[str, Any]:
    """``bootseer.robust.ettr.ettr_from_steps`` on rank 0's step log."""
    from bootseer.robust.ettr import ettr_from_steps

    if not log0:
        return {"ettr": None, "productive_s": 0.0, "wall_s": 0.0, "input": "step log"}
    report = ettr_from_steps(((s["time"], s["step"], s["pid"]) for s in log0), end=end)
    return {
        "ettr": report.ettr if report.wall_s > 0 else None,
        "productive_s": report.productive_s,
        "wall_s": report.wall_s,
        "steps": max(s["step"] for s in log0 if s["time"] <= end) + 1,
        "input": "step log",
    }


def measure(
    out: Path, mode: str, faults: list[Fault], end: float, hang_timeout_s: float
) -> dict[str, Any]:
    """Every fault's row, the per-class summary and ETTR of one mode's run."""
    lines, events = log_lines(out), node_events(out)
    verdicts = read_records(out / "ctl" / "controller.jsonl", "verdict")
    log0, pids = steps(out), pid_ranks(out)
    fired = sorted((f for f in faults if f.injected), key=lambda f: f.injected["time"])
    rows = []
    for i, fault in enumerate(fired):
        until = fired[i + 1].injected["time"] if i + 1 < len(fired) else end
        rows.append(
            measure_fault(
                out, mode, fault, until, hang_timeout_s, lines, events, verdicts, log0, pids
            )
        )
    result: dict[str, Any] = {"faults": rows, "classes": summarize(rows)}
    if mode == "bootseer":
        result["ettr"] = ettr_of_traces(out / "trace", end)
        result["ettr_step_log_check"] = ettr_of_steps(log0, end)
    else:
        result["ettr"] = ettr_of_steps(log0, end)
    return result


def ettr_of_traces(trace: Path, end: float) -> dict[str, Any]:
    """``bootseer.robust.ettr`` on the agents' traces: what ``bootseer report --end END
    TRACE`` prints (``report_command``, with the directory the results keep)."""
    from bootseer.report_robust import robust_section
    from bootseer.robust.events import read_records
    from bootseer.trace import read_traces

    command = f"bootseer report --end {end:.3f} {trace}"
    try:
        spans, _ = read_traces([trace])
        records, _ = read_records([trace])
        ettr = robust_section(spans, records, end=end).get("ettr")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal to the run's figures
        return {
            "ettr": None,
            "error": f"{type(exc).__name__}: {exc}",
            "input": "traces",
            "report_command": command,
        }
    if not ettr:
        return {
            "ettr": None,
            "error": "no bootseer run in the traces",
            "input": "traces",
            "report_command": command,
        }
    return {
        "ettr": ettr["ettr"],
        "productive_s": ettr["productive_s"],
        "wall_s": ettr["wall_s"],
        "incidents": len(ettr["incidents"]),
        "input": "traces",
        "report_command": command,
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per class: trials, detection p50/p90, named share, evictions, restart and recompute
    medians."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["class"], []).append(r)
    out = {}
    for kind, rs in by.items():
        fired = [r for r in rs if r.get("fired") is not None]
        det = [r["detection_s"] for r in fired if r.get("detection_s") is not None]
        restart = [r["restart_s"] for r in fired if r.get("restart_s") is not None]
        rec = [r["recomputed"] for r in fired if r.get("recomputed") is not None]
        out[kind] = {
            "trials": len(rs),
            "fired": len(fired),
            "detected": len(det),
            "detection_p50_s": _pct(det, 0.5),
            "detection_p90_s": _pct(det, 0.9),
            "named": sum(bool(r.get("named")) for r in fired),
            "evicted_nodes": sum(len(r.get("evicted", [])) for r in fired),
            "restart_p50_s": _pct(restart, 0.5),
            "recomputed_p50": _pct(rec, 0.5),
            "targets_met": {
                k: sum(bool(r["targets"].get(k)) for r in fired)
                for k in (fired[0]["targets"] if fired and "targets" in fired[0] else {})
            },
        }
    return out


def dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
