"""What the multi-node restart measured, as trace spans for ``bootseer report``, and the
figures drawn from its report (``bench_e2e_nodes.py``).

Why spans: ``bootseer report`` already lines nodes up per incident (critical path, stragglers
by median + 3 MAD, bytes per node and remote). The harness knows what no ``bootseer run``
trace holds (when the node was lost and replaced, the image pull, the survivors' wait in the
rendezvous, each rank's milestones from ``e2e_train.py``'s events), so it writes them as spans
and lets the report do the aggregation.

Each node's spans keep that node's own attempt number, as ``bootseer run`` counts them: a
replacement node's first attempt is 0 (its ``bootseer run`` spans are taken as they are), a
survivor's restarted workers and a node restarted in place are at 1. ``bootseer report``
groups them into the job's restart by time (``report_nodes.job_attempts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bootseer.report import percentile
from bootseer.report_nodes import positioned_segments, split_by_phase
from bootseer.trace import Span, read_traces

# the breakdown's order (the report orders its own phases; these are the harness's)
PHASE_ORDER = [
    "node_replace",
    "restart",
    "image_pull",
    "checkpoint_copy",
    "container_start",
    "environment",
    "checkpoint_prefetch",
    "command_start",
    "rendezvous",
    "launch",
    "process_group_init",
    "model_build",
    "checkpoint_load",
    "first_step",
]
RUN_PHASES = ("environment", "checkpoint_prefetch", "command_start")  # from bootseer run's trace
SERVICES = ("registry", "s3", "index")


@dataclass
class NodeRun:
    """What the harness measured around one restart (wall clock, epoch seconds)."""

    method: str
    kill_t: float  # the loss: the clock's start
    replaced_t: float | None  # the fresh node up (None: in place, or before the clock)
    lost: str  # the lost (and replaced, or restarted in place) node's name
    pull: tuple[float, float] | None  # the fresh node's image pull (None: none on the clock)
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> service -> bytes
    trace_dir: Path | None = None  # the lost node's ``bootseer run`` trace (None: baselines)
    in_place: bool = False  # the node's processes died, the node restarted them
    restart_t: float | None = None  # in place, baselines: the container run again
    copy: tuple[float, float, int] | None = None  # diy: rclone's start, end and bytes
    ended: set[str] = field(default_factory=set)  # containers the loss ended (harness keys)
    fresh_nodes: set[str] = field(default_factory=set)  # nodes whose byte counters are new

    def attempt(self, node: str) -> int:
        """``node``'s own attempt number for the restart: a replacement starts at 0."""
        return 0 if node == self.lost and not self.in_place else 1


@dataclass
class RankRun:
    node: str
    rank: int
    events: dict[str, dict[str, Any]]  # the restarted worker's milestones by name

    def t(self, name: str) -> float:
        if name not in self.events:
            raise ValueError(
                f"{self.node} rank {self.rank}: no '{name}' milestone after the "
                "loss (see the job's events.jsonl)"
            )
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
        mine = {
            e["event"]: e
            for e in events
            if e.get("node", "") == node and e["pid"] == pid and e["t"] >= start["t"]
        }
        rank = int(mine.get("verified", mine.get("first_step", start))["rank"])
        runs[(node, rank)] = RankRun(node, rank, mine)  # a later worker of a rank wins
    return sorted(runs.values(), key=lambda r: r.rank)


def harness_spans(run: NodeRun, events: list[dict[str, Any]]) -> list[Span]:
    """The restart as spans (each node's own attempt number, :meth:`NodeRun.attempt`), plus
    the loss as a ``failure`` point of the lost node's attempt 0."""
    spans = [
        Span(
            run.lost,
            None,
            "failure",
            run.kill_t,
            run.kill_t,
            attempt=0,
            detail={
                "what": "SIGKILL to the node's job processes, restarted in place"
                if run.in_place
                else "node lost: SIGKILL to every process"
            },
        )
    ]
    ranks = restarted_ranks(events, run.kill_t)
    nodes = sorted({r.node for r in ranks} | {run.lost})
    after = [e for e in events if e["t"] > run.kill_t]
    for node in nodes:
        mine = [r for r in ranks if r.node == node]
        if not mine:
            raise ValueError(f"{node}: no worker started after the loss")
        attempt = run.attempt(node)
        own: list[Span] = []
        if node == run.lost:
            launched = _lost_node(own, run, [e for e in after if e.get("node") == node])
            own.append(
                Span(
                    node,
                    None,
                    "rendezvous",
                    launched,
                    min(r.t("process_start") for r in mine),
                    attempt=attempt,
                )
            )
        else:
            own.append(
                Span(
                    node,
                    None,
                    "rendezvous",
                    run.kill_t,
                    min(r.t("process_start") for r in mine),
                    attempt=attempt,
                    detail={"why": "workers failed; waiting for the lost node in the rendezvous"},
                )
            )
        remotes = {k: v for k, v in run.bytes.get(node, {}).items() if v}
        if remotes:  # the fixture's counters: the node's bytes over the whole restart
            first = min((s for s in own if s.rank is None), key=lambda s: s.start)
            first.bytes_by_remote = remotes
        spans += own
        for r in mine:
            loading = r.t("load_start")
            if "copy_ready" in r.events:  # diy: the rank waited for the copy before loading
                loading = r.t("copy_ready") - float(r.events["copy_ready"].get("waited", 0.0))
            spans += _worker_start(r, loading, attempt)
            spans += [
                Span(
                    node,
                    r.rank,
                    "checkpoint_load",
                    r.t("load_start"),
                    r.t("load_end"),
                    attempt=attempt,
                    bytes=int(r.events["load_end"].get("bytes", 0)),
                ),
                Span(node, r.rank, "first_step", r.t("load_end"), r.ready_t, attempt=attempt),
            ]
    return spans


def _worker_start(r: RankRun, loading: float, attempt: int) -> list[Span]:
    """A restarted worker from its start to its load (or its wait for diy's copy): ``launch``
    (the interpreter and ``import torch``), ``process_group_init`` (``init_process_group``:
    the job's store and gloo's connections to every rank) and ``model_build`` (model, FSDP,
    optimizer, the checkpoint store), or one ``launch`` when the job logged no
    ``pg_init_*`` milestones (an image built before them)."""
    node, start = r.node, r.t("process_start")
    if "pg_init_start" not in r.events or "pg_init_end" not in r.events:
        return [
            Span(
                node,
                r.rank,
                "launch",
                start,
                loading,
                attempt=attempt,
                detail={"what": "import torch, init, model"},
            )
        ]
    return [
        Span(
            node,
            r.rank,
            "launch",
            start,
            r.t("pg_init_start"),
            attempt=attempt,
            detail={"what": "the interpreter, import torch"},
        ),
        Span(
            node,
            r.rank,
            "process_group_init",
            r.t("pg_init_start"),
            r.t("pg_init_end"),
            attempt=attempt,
            detail={"what": "init_process_group('gloo')"},
        ),
        Span(
            node,
            r.rank,
            "model_build",
            r.t("pg_init_end"),
            loading,
            attempt=attempt,
            detail={"what": "model, FSDP, optimizer, checkpoint store"},
        ),
    ]


def _lost_node(spans: list[Span], run: NodeRun, events: list[dict[str, Any]]) -> float:
    """The lost node's own phases until its torchrun started (returned): replaced (node up,
    image pull, container start) or restarted in place, then ``bootseer run``'s trace or the
    entrypoint's milestones, and diy's copy."""
    node, attempt = run.lost, run.attempt(run.lost)
    if run.replaced_t is not None:
        spans.append(
            Span(
                node,
                None,
                "node_replace",
                run.kill_t,
                run.replaced_t,
                attempt=attempt,
                detail={"what": "the fixture provisions a fresh, empty node"},
            )
        )
    if run.pull is not None:
        spans.append(Span(node, None, "image_pull", run.pull[0], run.pull[1], attempt=attempt))
    if run.copy is not None:
        spans.append(
            Span(
                node,
                None,
                "checkpoint_copy",
                run.copy[0],
                run.copy[1],
                attempt=attempt,
                bytes=run.copy[2],
                detail={"tool": "rclone"},
            )
        )
    if run.in_place and run.restart_t is not None:
        spans.append(
            Span(
                node,
                None,
                "restart",
                run.kill_t,
                run.restart_t,
                attempt=attempt,
                detail={"what": "the container ended; run again on the node"},
            )
        )
    begun = run.restart_t if run.in_place else (run.pull[1] if run.pull else run.kill_t)
    if run.trace_dir is not None:  # bootseer run's own spans, with its own attempt numbers
        found, _ = read_traces([run.trace_dir])
        want = ("restart", *RUN_PHASES) if run.in_place else RUN_PHASES
        own = [
            replace(s, bytes_by_remote={})
            for s in found
            if s.rank is None and s.phase in want and s.attempt == attempt
        ]
        if not own or not any(s.phase == "command_start" for s in own):
            raise ValueError(
                f"{node}: no bootseer run spans of attempt {attempt} in {run.trace_dir}"
            )
        if not run.in_place:
            spans.append(
                Span(
                    node, None, "container_start", begun, min(s.start for s in own), attempt=attempt
                )
            )
        spans.extend(own)
        return max(s.end for s in own if s.phase == "command_start")
    by = {e["event"]: e for e in events}
    for name in ("entry", "env_ready", "command_start"):
        if name not in by:
            raise ValueError(f"{node}: no '{name}' milestone after the loss")
    spans += [
        Span(node, None, "container_start", begun, by["entry"]["t"], attempt=attempt),
        Span(
            node,
            None,
            "environment",
            by["entry"]["t"],
            by["env_ready"]["t"],
            attempt=attempt,
            detail={"installer": by["env_ready"].get("installer")},
        ),
        Span(
            node,
            None,
            "command_start",
            by["env_ready"]["t"],
            by["command_start"]["t"],
            attempt=attempt,
        ),
    ]
    return float(by["command_start"]["t"])


def rank_totals(run: NodeRun, events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds from the loss to each rank's first step (``NODE/rRANK``)."""
    return {
        f"{r.node}/r{r.rank}": r.ready_t - run.kill_t for r in restarted_ranks(events, run.kill_t)
    }


def check_identical(events: list[dict[str, Any]], kill_t: float) -> dict[str, Any]:
    """Every restarted rank loaded the state that rank saved at that step, byte for byte
    (sha256 of its shard of every tensor)."""
    saved = {
        (e["step"], e["rank"]): e["digest"]
        for e in events
        if e["event"] == "saved" and e["t"] < kill_t
    }
    ranks = restarted_ranks(events, kill_t)
    loaded = [(r.node, r.rank, r.events.get("verified")) for r in ranks]
    bad = [
        f"{n}/r{k}" for n, k, v in loaded if v is None or saved.get((v["step"], k)) != v["digest"]
    ]
    steps = sorted({v["step"] for _, _, v in loaded if v is not None})
    out: dict[str, Any] = {
        "ok": bool(loaded) and not bad,
        "ranks": len(loaded),
        "steps": steps,
        "differ": bad,
    }
    if bad:  # every rank's figures, the good ones too: they tell where the bad one went apart
        out["why"] = {f"{r.node}/r{r.rank}": _why_differs(r, saved) for r in ranks}
    return out


def _why_differs(run: RankRun, saved: dict[tuple[int, int], str]) -> dict[str, Any]:
    """What a failed bit-identity check needs to be told apart: a worker that never
    verified (killed by a later rendezvous round) from wrong bytes, and where they came from."""
    v, load = run.events.get("verified"), run.events.get("load_end", {})
    return {
        "pid": run.events.get("process_start", {}).get("pid"),
        "events": sorted(run.events),
        "step": None if v is None else v["step"],
        "loaded": None if v is None else v["digest"][:16],
        "saved": None if v is None else (saved.get((v["step"], run.rank)) or "none")[:16],
        "load": {k: load.get(k) for k in ("bytes", "cached_bytes", "step", "source")},
    }


def node_phases(spans: list[Span], node: str, origin: float) -> dict[str, float]:
    """The node's time from ``origin`` to its slowest rank's first step, split by phase the
    way the report splits the critical path (each stretch to the phase that ended it)."""
    mine = [s for s in spans if s.node == node and s.phase != "failure"]  # the restart's
    ready = {s.rank: s.end for s in mine if s.phase == "first_step"}
    if not ready:
        return {}
    rank = max(ready, key=lambda r: ready[r])
    row = [s for s in mine if s.rank is None or s.rank == rank]
    return split_by_phase(positioned_segments(row, origin, until=ready[rank]))


AFTER_RENDEZVOUS = (
    "rendezvous",
    "launch",
    "process_group_init",
    "model_build",
    "checkpoint_load",
    "first_step",
    "untraced",
)


def paced_by(per_node: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The node the others waited for, and its phases before the rendezvous. Ranks of a
    synchronous job finish their first step together (it is a collective), so the critical
    path ends on any rank; the node that set the pace is the one that waited least in the
    rendezvous (it arrived last)."""
    node = min(per_node, key=lambda n: per_node[n]["phases"].get("rendezvous", 0.0))
    before = sorted(
        (
            (p, s)
            for p, s in per_node[node]["phases"].items()
            if p not in AFTER_RENDEZVOUS and s >= 0.05
        ),
        key=lambda kv: -kv[1],
    )
    return node, ", ".join(f"{p} {s:.1f} s" for p, s in before[:3])


def role(run: NodeRun, node: str) -> str:
    """``fresh`` (the replacement of the lost node), ``in_place`` (the lost node, its processes
    restarted on it) or ``survivor`` (its workers restarted by its torchrun agent)."""
    if node != run.lost:
        return "survivor"
    return "in_place" if run.in_place else "fresh"


def restart_segments(run: NodeRun, spans: list[Span]) -> dict[str, Any]:
    """The loss to the last rank's first step as a chain of job-level segments that add up to
    it (the scale model's inputs, ``startup_model.py``), and each rank's own share:

    * ``fresh_path_s``: the loss to the lost node's torchrun start (its replacement, pull,
      container, environment: the path the others wait for);
    * ``rendezvous_s``: that torchrun start to the last worker's start (torchrun's own start,
      the c10d round on the controller's store, the workers spawned);
    * ``import_s``: to the last rank's ``init_process_group`` call (the interpreter, ``import
      torch``);
    * ``process_group_init_s``: to the last rank's return from it (the job's store, gloo's
      connections);
    * ``load_s``: to the last rank's end of its checkpoint load (model, FSDP, optimizer, the
      store opened, the load; diy's fresh ranks: their wait for the copy too);
    * ``first_step_s``: to the last rank's first step (a collective: every rank finishes it
      together; the digest after the load left out, as in the totals).

    ``import_s``, ``process_group_init_s``, ``load_s`` and ``first_step_s`` are None (and
    ``workers_s``, the four together, is given alone) when the job logged no ``pg_init_*``
    milestones."""
    lost = [s for s in spans if s.node == run.lost and s.rank is None and s.phase == "rendezvous"]
    if not lost:
        raise ValueError(f"{run.lost}: no rendezvous span (torchrun never started?)")
    launched = lost[0].start
    starts: dict[str, float] = {}
    pg: dict[str, tuple[float, float]] = {}
    loaded: dict[str, float] = {}
    ready: dict[str, float] = {}
    for s in spans:
        if s.rank is None:
            continue
        key = f"{s.node}/r{s.rank}"
        if s.phase == "launch":
            starts[key] = min(starts.get(key, s.start), s.start)
        elif s.phase == "process_group_init":
            pg[key] = (s.start, s.end)
        elif s.phase == "checkpoint_load":
            loaded[key] = s.end
        elif s.phase == "first_step":
            ready[key] = s.end
    if not ready or set(starts) != set(ready):
        raise ValueError(
            f"ranks with a start but no first step, or the reverse: "
            f"{sorted(set(starts) ^ set(ready))}"
        )
    last_start, last_ready = max(starts.values()), max(ready.values())
    out: dict[str, Any] = {
        "fresh_path_s": launched - run.kill_t,
        "rendezvous_s": last_start - launched,
        "workers_s": last_ready - last_start,
        "import_s": None,
        "process_group_init_s": None,
        "load_s": None,
        "first_step_s": None,
        "ranks": len(ready),
        "per_rank": {},
    }
    if set(pg) == set(ready) == set(loaded):
        pg_start = max(a for a, _ in pg.values())
        pg_end = max(b for _, b in pg.values())
        last_loaded = max(loaded.values())
        out.update(
            import_s=pg_start - last_start,
            process_group_init_s=pg_end - pg_start,
            load_s=last_loaded - pg_end,
            first_step_s=last_ready - last_loaded,
        )
        keys = sorted(pg)
        out["per_rank"] = {
            "import_s": {k: pg[k][0] - starts[k] for k in keys},
            "process_group_init_s": {k: pg[k][1] - pg[k][0] for k in keys},
            "load_s": {k: loaded[k] - pg[k][1] for k in keys},
            "first_step_s": {k: ready[k] - loaded[k] for k in keys},
        }
    return out


def summarize(
    report: dict[str, Any], run: NodeRun, totals: dict[str, float], spans: list[Span]
) -> dict[str, Any]:
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
        per_node[line["node"]] = {
            "first_step_s": line["first_step_s"],
            "role": role(run, line["node"]),
            "phases": node_phases(spans, line["node"], run.kill_t),
            "bytes": run.bytes.get(line["node"], {}),
        }
    total = {s: sum(b.get(s, 0) for b in run.bytes.values()) for s in SERVICES}
    pace, pace_why = paced_by(per_node)
    return {
        "summary": {
            "p50_s": percentile(values, 50),
            "p90_s": percentile(values, 90),
            "p99_s": percentile(values, 99),
            "max_s": max(values),
            "job_back_s": incident["wall_s"],
            "straggler": straggler,
            "why": why,
            "paced_by": pace,
            "paced_why": pace_why,
            "node_stragglers": report["node_stragglers"],
        },
        "ranks": totals,
        "per_node": per_node,
        "cost": dict(cost),
        "segments": restart_segments(run, spans),
        "bytes_total": total,
        "bytes_per_node": run.bytes,
    }
