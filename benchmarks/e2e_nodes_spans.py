"""What the multi-node restart measured, as trace spans for ``bootseer report``, and the
figures drawn from its report (``bench_e2e_nodes.py``).

Why spans: ``bootseer report`` already lines nodes up per incident (critical path, stragglers
by median + 3 MAD, bytes per node and remote). The harness knows what no ``bootseer run``
trace holds (when the node was lost and replaced, the image pull, the survivors' wait in the
rendezvous, each rank's milestones from ``e2e_train.py``'s events), so it writes them as spans
of attempt 1 (the restart) and lets the report do the aggregation.

``bootseer run`` counts attempts per node: a replacement node's run starts at 0. Its spans are
taken as attempt 1 here, the job's restart it joined (survivors restart in torchrun, not in
``bootseer run``, so their attempt numbers do not move either).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bootseer.report import percentile
from bootseer.report_nodes import positioned_segments, split_by_phase
from bootseer.trace import Span, read_traces

# the breakdown's order (the report orders its own phases; these are the harness's)
PHASE_ORDER = ["node_replace", "image_pull", "container_start", "environment",
               "checkpoint_prefetch", "command_start", "rendezvous", "launch", "checkpoint_load",
               "first_step"]
RUN_PHASES = ("environment", "checkpoint_prefetch", "command_start")  # from bootseer run's trace
SERVICES = ("registry", "s3", "index")


@dataclass
class NodeRun:
    """What the harness measured around one restart (wall clock, epoch seconds)."""

    method: str
    kill_t: float
    replaced_t: float
    lost: str  # the lost (and replaced) node's name
    pull: tuple[float, float]  # the fresh node's image pull
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> service -> bytes
    trace_dir: Path | None = None  # the fresh node's ``bootseer run`` trace (None: baseline)


@dataclass
class RankRun:
    node: str
    rank: int
    events: dict[str, dict[str, Any]]  # the restarted worker's milestones by name

    def t(self, name: str) -> float:
        if name not in self.events:
            raise ValueError(f"{self.node} rank {self.rank}: no '{name}' milestone after the "
                             "loss (see the job's events.jsonl)")
        return float(self.events[name]["t"])

    @property
    def ready_t(self) -> float:
        """The first step's end, minus the digest taken after the load (not part of a start)."""
        return self.t("first_step") - float(self.events["verified"].get("seconds", 0.0))


def restarted_ranks(events: list[dict[str, Any]], kill_t: float) -> list[RankRun]:
    """Every worker started after the loss (one per rank), with its milestones."""
    starts = {}
    for e in events:
        if e["event"] == "process_start" and e["t"] > kill_t:
            starts[(e.get("node", ""), e["pid"])] = e
    runs: dict[tuple[str, int], RankRun] = {}
    for (node, pid), start in sorted(starts.items(), key=lambda kv: kv[1]["t"]):
        mine = {e["event"]: e for e in events
                if e.get("node", "") == node and e["pid"] == pid and e["t"] >= start["t"]}
        rank = int(mine.get("verified", mine.get("first_step", start))["rank"])
        runs[(node, rank)] = RankRun(node, rank, mine)  # a later worker of a rank wins
    return sorted(runs.values(), key=lambda r: r.rank)


def harness_spans(run: NodeRun, events: list[dict[str, Any]]) -> list[Span]:
    """The restart as spans of attempt 1, plus the loss as a ``failure`` point of attempt 0."""
    spans = [Span(run.lost, None, "failure", run.kill_t, run.kill_t, attempt=0,
                  detail={"what": "node lost: SIGKILL to every process"})]
    ranks = restarted_ranks(events, run.kill_t)
    nodes = sorted({r.node for r in ranks} | {run.lost})
    after = [e for e in events if e["t"] > run.kill_t]
    for node in nodes:
        mine = [r for r in ranks if r.node == node]
        if not mine:
            raise ValueError(f"{node}: no worker started after the loss")
        remotes = {k: v for k, v in run.bytes.get(node, {}).items() if v}
        if node == run.lost:
            launched = _fresh_node(spans, run, [e for e in after if e.get("node") == node],
                                   remotes)
        else:
            spans.append(Span(node, None, "rendezvous", run.kill_t,
                              min(r.t("process_start") for r in mine), attempt=1,
                              detail={"why": "workers failed; waiting for the lost node's "
                                             "replacement in the rendezvous"},
                              bytes_by_remote=remotes))
            launched = None
        if launched is not None:
            spans.append(Span(node, None, "rendezvous", launched,
                              min(r.t("process_start") for r in mine), attempt=1))
        for r in mine:
            spans += [Span(node, r.rank, "launch", r.t("process_start"), r.t("load_start"),
                           attempt=1, detail={"what": "import torch, init, model"}),
                      Span(node, r.rank, "checkpoint_load", r.t("load_start"), r.t("load_end"),
                           attempt=1, bytes=int(r.events["load_end"].get("bytes", 0))),
                      Span(node, r.rank, "first_step", r.t("load_end"), r.ready_t, attempt=1)]
    return spans


def _fresh_node(spans: list[Span], run: NodeRun, events: list[dict[str, Any]],
                remotes: dict[str, int]) -> float:
    """The replacement node's own phases; returns when its torchrun started."""
    node = run.lost
    spans.append(Span(node, None, "node_replace", run.kill_t, run.replaced_t, attempt=1,
                      detail={"what": "the fixture provisions a fresh, empty node"},
                      bytes_by_remote=remotes))
    spans.append(Span(node, None, "image_pull", run.pull[0], run.pull[1], attempt=1))
    if run.trace_dir is not None:  # bootseer run's own spans
        found, _ = read_traces([run.trace_dir])
        own = [replace(s, attempt=1, bytes_by_remote={}) for s in found
               if s.rank is None and s.phase in RUN_PHASES and s.attempt == 0]
        if not own:
            raise ValueError(f"{node}: no bootseer run spans in {run.trace_dir}")
        entry = min(s.start for s in own)
        spans.append(Span(node, None, "container_start", run.pull[1], entry, attempt=1))
        spans.extend(own)
        return max(s.end for s in own if s.phase == "command_start")
    by = {e["event"]: e for e in events}
    for name in ("entry", "env_ready", "command_start"):
        if name not in by:
            raise ValueError(f"{node}: no '{name}' milestone after the loss")
    spans += [Span(node, None, "container_start", run.pull[1], by["entry"]["t"], attempt=1),
              Span(node, None, "environment", by["entry"]["t"], by["env_ready"]["t"], attempt=1,
                   detail={"installer": "pip"}),
              Span(node, None, "command_start", by["env_ready"]["t"], by["command_start"]["t"],
                   attempt=1)]
    return float(by["command_start"]["t"])


def rank_totals(run: NodeRun, events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds from the loss to each rank's first step (``NODE/rRANK``)."""
    return {f"{r.node}/r{r.rank}": r.ready_t - run.kill_t
            for r in restarted_ranks(events, run.kill_t)}


def check_identical(events: list[dict[str, Any]], kill_t: float) -> dict[str, Any]:
    """Every restarted rank loaded the state that rank saved at that step, byte for byte
    (sha256 of its shard of every tensor)."""
    saved = {(e["step"], e["rank"]): e["digest"] for e in events
             if e["event"] == "saved" and e["t"] < kill_t}
    ranks = restarted_ranks(events, kill_t)
    loaded = [(r.node, r.rank, r.events.get("verified")) for r in ranks]
    bad = [f"{n}/r{k}" for n, k, v in loaded
           if v is None or saved.get((v["step"], k)) != v["digest"]]
    steps = sorted({v["step"] for _, _, v in loaded if v is not None})
    return {"ok": bool(loaded) and not bad, "ranks": len(loaded), "steps": steps,
            "differ": bad}


def node_phases(spans: list[Span], node: str, origin: float) -> dict[str, float]:
    """The node's time from ``origin`` to its slowest rank's first step, split by phase the
    way the report splits the critical path (each stretch to the phase that ended it)."""
    mine = [s for s in spans if s.node == node and s.attempt == 1]
    ready = {s.rank: s.end for s in mine if s.phase == "first_step"}
    if not ready:
        return {}
    rank = max(ready, key=lambda r: ready[r])
    row = [s for s in mine if s.rank is None or s.rank == rank]
    return split_by_phase(positioned_segments(row, origin, until=ready[rank]))


AFTER_RENDEZVOUS = ("rendezvous", "launch", "checkpoint_load", "first_step", "untraced")


def paced_by(per_node: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The node the others waited for, and its phases before the rendezvous. Ranks of a
    synchronous job finish their first step together (it is a collective), so the critical
    path ends on any rank; the node that set the pace is the one that waited least in the
    rendezvous (it arrived last)."""
    node = min(per_node, key=lambda n: per_node[n]["phases"].get("rendezvous", 0.0))
    before = sorted(((p, s) for p, s in per_node[node]["phases"].items()
                     if p not in AFTER_RENDEZVOUS and s >= 0.05), key=lambda kv: -kv[1])
    return node, ", ".join(f"{p} {s:.1f} s" for p, s in before[:3])


def summarize(report: dict[str, Any], run: NodeRun, totals: dict[str, float],
              spans: list[Span]) -> dict[str, Any]:
    """p50/p90/max over ranks, the straggler and why (the report's critical path), the per-node
    breakdown (along each node's slowest rank) and bytes (the fixture's counters)."""
    incident = next((i for i in report["incidents"] if i["attempt"] == 1), None)
    if incident is None or incident["wall_s"] is None:
        raise ValueError("the report has no finished restart (incident 1)")
    values = list(totals.values())
    cost = sorted(incident["cost"].items(), key=lambda kv: -kv[1])
    straggler = f"{incident['critical_node']}/r{incident['critical_rank']}"
    why = ", ".join(f"{p} {s:.1f} s" for p, s in cost[:3] if s >= 0.05)
    per_node = {}
    for line in incident["timeline"]:
        per_node[line["node"]] = {"first_step_s": line["first_step_s"],
                                  "phases": node_phases(spans, line["node"], run.kill_t),
                                  "bytes": run.bytes.get(line["node"], {})}
    total = {s: sum(b.get(s, 0) for b in run.bytes.values()) for s in SERVICES}
    pace, pace_why = paced_by(per_node)
    return {"summary": {"p50_s": percentile(values, 50), "p90_s": percentile(values, 90),
                        "max_s": max(values), "job_back_s": incident["wall_s"],
                        "straggler": straggler, "why": why, "paced_by": pace,
                        "paced_why": pace_why,
                        "node_stragglers": report["node_stragglers"]},
            "ranks": totals, "per_node": per_node, "cost": dict(cost),
            "bytes_total": total, "bytes_per_node": run.bytes}
