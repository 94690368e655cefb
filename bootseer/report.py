"""``bootseer report``'s analysis: startup traces of many nodes in, one :class:`Report` out.

Pure functions over :class:`~bootseer.trace.Span` lists (no I/O beyond :func:`load_report`), so
the same report can be built in tests, by the CLI, or from a notebook.

What it computes, and over what:

* **Phase statistics** (``phases``): for each phase, p50/p90/max/mean of the span durations of
  every node, rank and attempt whose outcome is ``ok`` (a ``skipped`` span lasts nothing and a
  ``killed`` one was cut short; they are counted in ``outcomes`` instead). Percentiles are
  linearly interpolated between closest ranks (numpy's default), so they can be checked by hand.
* **Stragglers**: within one phase and one attempt number (a warm restart is never compared with
  cold starts), a span is a straggler when ``seconds > median + 3 * max(MAD, 1% of the median,
  10 ms)``, MAD being the median absolute deviation of that group (of at least 3 spans). The
  floor keeps identical durations (MAD 0) from flagging noise of a few milliseconds.
  ``restart`` (the backoff) and ``hang`` (the hang timeout) last what the policy says, so they
  are not checked.
* **Rows** (``workers``): one per node and rank. ``bootseer run`` writes every phase but
  ``first_step`` once per node (rank null): those rank-less spans are folded into each of the
  node's ranks (attempts, outcomes, last attempt). A node without any ranked span (warmup, or a
  run that never reached ``bootseer.ready()``) is one rank-less row.
* **Restarts**: per row, the attempts seen and how each ended: ``hang`` (a hang span),
  ``crash`` (the command failed before ``bootseer.ready()``, or a later attempt followed with
  no hang or failed phase recorded: it died after its first step), ``failed:<phase>`` /
  ``killed:<phase>`` (a startup phase failed), ``ready`` (reached the first step) or
  ``incomplete`` (the last attempt has not reached it: still starting, or the trace was cut).
  The ``restart`` span before the next attempt may carry the cause in its detail (``reason``,
  ``exit_code``, ``returncode``, ``signal``). A node's ranks restart together, so the total
  (``Report.total_restarts``) counts each node once: the most restarts of any of its rows.
* **Time to first step**: per node/rank, the ``first_step`` span (attempt start to
  ``bootseer.ready()``) of the first attempt and of the last one, and their p50/p90/max.
* **Last attempt per node/rank** (``last_attempt``): its phase durations, and its wall time
  split between phases (:func:`wall_segments`): the chart's bars.

JSON (``Report.to_dict``; ``Report.from_dict`` reads it back): ``version``, ``sources``,
``warnings``, ``spans``, ``nodes``, ``workers``, ``phases`` (list of ``phase, count, p50, p90,
max, mean, bytes, outcomes``), ``stragglers`` (``phase, node, rank, attempt, seconds, median,
mad, threshold``), ``restarts`` (``node, rank, restarts, attempts: [{attempt, outcome,
reason}]``), ``time_to_first_step`` (``first_attempt`` and ``last_attempt``: ``count, p50, p90,
max, mean`` or null; ``workers``: ``node, rank, first_attempt, first_attempt_s, last_attempt,
last_attempt_s``), ``last_attempt`` (``node, rank, attempt, phases, first_step_s, wall``)
and, since version 2, the node-level views of :mod:`bootseer.report_nodes`: ``incidents``,
``node_stragglers`` and ``bytes_by_remote`` (since version 3 numbered by job attempt, each
incident with its ``node_attempts``). Times are seconds. Every field, with its type and
unit, is in docs/report.md (a scale model reads this file: change it only with the version).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .report_nodes import (
    FAILURE_PHASE,
    Incident,
    NodeBytes,
    NodeStraggler,
    NodeTimeline,
    Segment,
    node_views,
    positioned_segments,
    split_by_phase,
)
from .report_order import (  # noqa: F401 (re-exported: imported from here before they moved)
    MAD_FLOOR_FRACTION,
    MAD_FLOOR_S,
    MAD_K,
    PHASE_ORDER,
    mad,
    median,
    natural_key,
    percentile,
    phase_key,
    straggler_threshold,
    worker_key,
)
from .trace import Span, read_traces

REPORT_VERSION = 3
# v1 lacks the node-level views (they read back empty); v2 the incidents' node_attempts
READABLE_VERSIONS = (1, 2, 3)
# Their length is set by policy (backoff, hang timeout), not by a slow node.
NOT_STRAGGLER_PHASES = frozenset({"restart", "hang", FAILURE_PHASE})
MAX_BYTE_ROWS = 20  # the table's; the JSON has every node
_REASON_KEYS = ("reason", "exit_code", "returncode", "signal")


class ReportError(ValueError):
    """The traces cannot make a report (no spans at all); the message names the paths."""


@dataclass
class Stats:
    count: int
    p50: float
    p90: float
    max: float
    mean: float


@dataclass
class PhaseStats:
    phase: str
    count: int  # ok spans, the ones the percentiles are over
    p50: float | None
    p90: float | None
    max: float | None
    mean: float | None
    bytes: int  # total over the ok spans
    outcomes: dict[str, int] = field(default_factory=dict)  # every span, by outcome


@dataclass
class Straggler:
    phase: str
    node: str
    rank: int | None
    attempt: int
    seconds: float
    median: float
    mad: float
    threshold: float


@dataclass
class AttemptOutcome:
    attempt: int
    outcome: str
    reason: str | None = None


@dataclass
class WorkerRestarts:
    """One row's attempts (its node's rank-less spans included); ``restarts``: the last
    attempt number."""

    node: str
    rank: int | None
    restarts: int
    attempts: list[AttemptOutcome]


@dataclass
class WorkerFirstStep:
    node: str
    rank: int | None
    first_attempt: int
    first_attempt_s: float | None  # None: that attempt never reached bootseer.ready()
    last_attempt: int
    last_attempt_s: float | None


@dataclass
class WorkerPhases:
    """One bar of the chart: a node/rank's last attempt (node-level spans of the node included)."""

    node: str
    rank: int | None
    attempt: int
    phases: dict[str, float]  # seconds per phase, spans of any outcome summed
    first_step_s: float | None
    wall: dict[str, float]  # the attempt's wall time split by phase (see wall_segments)


@dataclass
class Report:
    sources: list[str]
    warnings: list[str]
    spans: int
    nodes: int
    workers: int
    phases: list[PhaseStats]
    stragglers: list[Straggler]
    restarts: list[WorkerRestarts]
    first_step: list[WorkerFirstStep]
    first_step_first: Stats | None
    first_step_last: Stats | None
    last_attempt: list[WorkerPhases]
    # v2: the node-level views (bootseer/report_nodes.py); empty when read from v1
    incidents: list[Incident] = field(default_factory=list)
    node_stragglers: list[NodeStraggler] = field(default_factory=list)
    bytes_by_node: list[NodeBytes] = field(default_factory=list)
    bytes_by_remote: dict[str, int] = field(default_factory=dict)
    # ETTR, incidents by cause, events and verdicts (bootseer/report_robust.py); {} if none
    robust: dict[str, Any] = field(default_factory=dict)
    # collective tracer's grid and verdicts (bootseer/colltrace/report.py); {} if none
    colltrace: dict[str, Any] = field(default_factory=dict)

    def phase(self, name: str) -> PhaseStats | None:
        return next((p for p in self.phases if p.phase == name), None)

    @property
    def total_restarts(self) -> int:
        """Restarts counted once per node: its ranks restart together (one restart span)."""
        per_node: dict[str, int] = {}
        for r in self.restarts:
            per_node[r.node] = max(per_node.get(r.node, 0), r.restarts)
        return sum(per_node.values())

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON shape (see the module docstring)."""
        return {
            "version": REPORT_VERSION,
            "sources": list(self.sources),
            "warnings": list(self.warnings),
            "spans": self.spans,
            "nodes": self.nodes,
            "workers": self.workers,
            "phases": [asdict(p) for p in self.phases],
            "stragglers": [asdict(s) for s in self.stragglers],
            "restarts": [asdict(r) for r in self.restarts],
            "time_to_first_step": {
                "first_attempt": asdict(self.first_step_first) if self.first_step_first else None,
                "last_attempt": asdict(self.first_step_last) if self.first_step_last else None,
                "workers": [asdict(w) for w in self.first_step],
            },
            "last_attempt": [asdict(w) for w in self.last_attempt],
            "incidents": [asdict(i) for i in self.incidents],
            "node_stragglers": [asdict(s) for s in self.node_stragglers],
            "bytes_by_remote": {
                "total": dict(self.bytes_by_remote),
                "nodes": [asdict(n) for n in self.bytes_by_node],
            },
            "robust": self.robust,
            **({"colltrace": self.colltrace} if self.colltrace else {}),  # when traced
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Report:
        """Reads this version's JSON and every earlier one (:data:`READABLE_VERSIONS`)."""
        if doc.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"report version {doc.get('version')!r} is not one of "
                f"{READABLE_VERSIONS}: a newer bootseer wrote it; read it with "
                "that version"
            )
        ttfs = doc["time_to_first_step"]
        remotes = doc.get("bytes_by_remote") or {"total": {}, "nodes": []}
        return cls(
            sources=list(doc["sources"]),
            warnings=list(doc["warnings"]),
            spans=doc["spans"],
            nodes=doc["nodes"],
            workers=doc["workers"],
            phases=[PhaseStats(**p) for p in doc["phases"]],
            stragglers=[Straggler(**s) for s in doc["stragglers"]],
            restarts=[
                WorkerRestarts(**{**r, "attempts": [AttemptOutcome(**a) for a in r["attempts"]]})
                for r in doc["restarts"]
            ],
            first_step=[WorkerFirstStep(**w) for w in ttfs["workers"]],
            first_step_first=Stats(**ttfs["first_attempt"]) if ttfs["first_attempt"] else None,
            first_step_last=Stats(**ttfs["last_attempt"]) if ttfs["last_attempt"] else None,
            last_attempt=[WorkerPhases(**w) for w in doc["last_attempt"]],
            incidents=[_incident_from_dict(i) for i in doc.get("incidents", [])],
            node_stragglers=[NodeStraggler(**s) for s in doc.get("node_stragglers", [])],
            bytes_by_node=[NodeBytes(**n) for n in remotes["nodes"]],
            bytes_by_remote=dict(remotes["total"]),
            robust=dict(doc.get("robust") or {}),
            colltrace=dict(doc.get("colltrace") or {}),
        )

    def incident(self, attempt: int | None = None) -> Incident | None:
        """The incident of this attempt number (default: the last one)."""
        if not self.incidents:
            return None
        if attempt is None:
            return self.incidents[-1]
        return next((i for i in self.incidents if i.attempt == attempt), None)


def _incident_from_dict(doc: dict[str, Any]) -> Incident:
    return Incident(
        **{
            **doc,
            "critical_path": [Segment(**s) for s in doc["critical_path"]],
            "timeline": [
                NodeTimeline(**{**t, "segments": [Segment(**s) for s in t["segments"]]})
                for t in doc["timeline"]
            ],
        }
    )


# -- statistics --------------------------------------------------------------------------------


def stats(values: Sequence[float]) -> Stats | None:
    if not values:
        return None
    return Stats(
        count=len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        max=max(values),
        mean=sum(values) / len(values),
    )


# -- grouping ----------------------------------------------------------------------------------


def worker_label(node: str, rank: int | None) -> str:
    return node if rank is None else f"{node}/r{rank}"


def worker_spans(spans: Iterable[Span]) -> dict[tuple[str, Any], list[Span]]:
    """The report's rows, in node/rank order: each rank's spans plus its node's rank-less
    ones (``bootseer run`` writes all phases but ``first_step`` per node); a node with no
    ranked span is one rank-less row."""
    ranked: dict[tuple[str, Any], list[Span]] = defaultdict(list)
    node_level: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.rank is None:
            node_level[s.node].append(s)
        else:
            ranked[(s.node, s.rank)].append(s)
    rows = {key: own + node_level.get(key[0], []) for key, own in ranked.items()}
    ranked_nodes = {node for node, _ in ranked}
    rows.update(
        {(node, None): group for node, group in node_level.items() if node not in ranked_nodes}
    )
    return {key: rows[key] for key in sorted(rows, key=lambda k: worker_key(*k))}


def _clean(spans: Iterable[Span], warnings: list[str]) -> list[Span]:
    """Drops spans whose times cannot be used (NaN, infinite, ending before they start)."""
    kept = []
    for s in spans:
        if not (math.isfinite(s.start) and math.isfinite(s.end)) or s.end < s.start:
            warnings.append(
                f"span {s.phase} of {worker_label(s.node, s.rank)} attempt "
                f"{s.attempt} skipped (start {s.start}, end {s.end})"
            )
            continue
        kept.append(s)
    return kept


def _phase_stats(spans: list[Span]) -> list[PhaseStats]:
    by_phase: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_phase[s.phase].append(s)
    out = []
    for phase in sorted(by_phase, key=phase_key):
        group = by_phase[phase]
        ok = [s for s in group if s.outcome == "ok"]
        st = stats([s.seconds for s in ok])
        outcomes: dict[str, int] = defaultdict(int)
        for s in group:
            outcomes[s.outcome] += 1
        out.append(
            PhaseStats(
                phase=phase,
                count=len(ok),
                p50=st.p50 if st else None,
                p90=st.p90 if st else None,
                max=st.max if st else None,
                mean=st.mean if st else None,
                bytes=sum(s.bytes for s in ok),
                outcomes=dict(sorted(outcomes.items())),
            )
        )
    return out


def find_stragglers(spans: Iterable[Span]) -> list[Straggler]:
    """Spans longer than their (phase, attempt) group's median + 3 MAD (floored; see the
    module docstring). Only ``ok`` spans, and never ``restart`` or ``hang``."""
    groups: dict[tuple[str, int], list[Span]] = defaultdict(list)
    for s in spans:
        if s.outcome == "ok" and s.phase not in NOT_STRAGGLER_PHASES:
            groups[(s.phase, s.attempt)].append(s)
    found = []
    for (phase, attempt), group in groups.items():
        if len(group) < 3:  # no majority to compare with
            continue
        m, d, threshold = straggler_threshold([s.seconds for s in group])
        for s in group:
            if s.seconds > threshold:
                found.append(
                    Straggler(
                        phase=phase,
                        node=s.node,
                        rank=s.rank,
                        attempt=attempt,
                        seconds=s.seconds,
                        median=m,
                        mad=d,
                        threshold=threshold,
                    )
                )
    found.sort(
        key=lambda x: (phase_key(x.phase), x.attempt, -x.seconds, worker_key(x.node, x.rank))
    )
    return found


def _reason(span: Span | None) -> str | None:
    if span is None:
        return None
    parts = [f"{k}={span.detail[k]}" for k in _REASON_KEYS if span.detail.get(k) is not None]
    return ", ".join(parts) or None


def _attempt_outcome(spans: list[Span], has_later: bool) -> str:
    if any(s.phase == "hang" for s in spans):
        return "hang"
    first_step = [s for s in spans if s.phase == "first_step"]
    if any(s.outcome == "ok" for s in first_step):
        return "crash" if has_later else "ready"
    if any(s.outcome != "ok" for s in first_step):
        return "crash"  # the command ended before bootseer.ready()
    for bad in ("failed", "killed"):
        phases = sorted(
            {
                s.phase
                for s in spans
                if s.outcome == bad and s.phase not in ("restart", FAILURE_PHASE)
            },
            key=phase_key,
        )
        if phases:
            return f"{bad}:{phases[0]}"
    return "crash" if has_later else "incomplete"


def _latest(spans: Iterable[Span], phase: str, ok_only: bool = True) -> Span | None:
    """The last-ending span of this phase (a trace dir reused by two runs holds both)."""
    found = [s for s in spans if s.phase == phase and (s.outcome == "ok" or not ok_only)]
    return max(found, key=lambda s: s.end) if found else None


def build_report(
    spans: Sequence[Span], warnings: Sequence[str] = (), sources: Sequence[str] = ()
) -> Report:
    """The whole analysis; ``warnings`` (from :func:`read_traces`) are carried into it."""
    warns = list(warnings)
    spans = _clean(spans, warns)
    by_worker = worker_spans(spans)
    workers = list(by_worker)

    restarts: list[WorkerRestarts] = []
    first_step: list[WorkerFirstStep] = []
    for node, rank in workers:
        attempts: dict[int, list[Span]] = defaultdict(list)
        for s in by_worker[(node, rank)]:
            attempts[s.attempt].append(s)
        numbers = sorted(attempts)
        outcomes = []
        for i, a in enumerate(numbers):
            later = i + 1 < len(numbers)
            nxt = _latest(attempts[numbers[i + 1]], "restart", ok_only=False) if later else None
            outcomes.append(AttemptOutcome(a, _attempt_outcome(attempts[a], later), _reason(nxt)))
        restarts.append(WorkerRestarts(node, rank, max(numbers), outcomes))
        with_step = [a for a in numbers if any(s.phase == "first_step" for s in attempts[a])]
        if with_step:
            lo, hi = with_step[0], with_step[-1]
            first, last = _latest(attempts[lo], "first_step"), _latest(attempts[hi], "first_step")
            first_step.append(
                WorkerFirstStep(
                    node,
                    rank,
                    lo,
                    first.seconds if first else None,
                    hi,
                    last.seconds if last else None,
                )
            )

    views = node_views(spans, NOT_STRAGGLER_PHASES)
    return Report(
        sources=[str(p) for p in sources],
        warnings=warns,
        spans=len(spans),
        nodes=len({n for n, _ in workers}),
        workers=len(workers),
        phases=_phase_stats(spans),
        stragglers=find_stragglers(spans),
        restarts=restarts,
        first_step=first_step,
        first_step_first=stats(
            [w.first_attempt_s for w in first_step if w.first_attempt_s is not None]
        ),
        first_step_last=stats(
            [w.last_attempt_s for w in first_step if w.last_attempt_s is not None]
        ),
        last_attempt=_last_attempts(by_worker),
        incidents=views.incidents,
        node_stragglers=views.node_stragglers,
        bytes_by_node=views.bytes_by_node,
        bytes_by_remote=views.bytes_by_remote,
    )


def _last_attempts(by_worker: dict[tuple[str, Any], list[Span]]) -> list[WorkerPhases]:
    """Each row's last attempt (see :func:`worker_spans`: node-level spans included)."""
    out = []
    for (node, rank), row in by_worker.items():
        attempt = max(s.attempt for s in row)
        spans = [s for s in row if s.attempt == attempt]
        phases: dict[str, float] = defaultdict(float)
        for s in spans:
            phases[s.phase] += s.seconds
        step = _latest(spans, "first_step")
        out.append(
            WorkerPhases(
                node,
                rank,
                attempt,
                dict(sorted(phases.items(), key=lambda kv: phase_key(kv[0]))),
                step.seconds if step else None,
                wall_segments(spans),
            )
        )
    return out


def wall_segments(spans: Iterable[Span]) -> dict[str, float]:
    """The wall time from the first start to the last end, split between phases: each stretch
    goes to the phase that ends it (the one the start was waiting for), stretches where no
    phase ran to ``untraced``. Unlike summed durations, concurrent phases (environment and
    checkpoint prefetch) are not counted twice, so the parts add up to the elapsed time; with
    ``first_step`` (attempt start to ready) it is the time to first step, backoff included."""
    seg = split_by_phase(positioned_segments(spans))
    return dict(sorted(seg.items(), key=lambda kv: phase_key(kv[0])))


def load_report(paths: Sequence[str | os.PathLike], *, end: float | None = None) -> Report:
    """Reads the trace files or directories and builds the report (``end``: the job's end
    for ETTR; default: the last time the traces hold).

    Raises FileNotFoundError for a missing path and :class:`ReportError` when no usable span
    was found (an empty directory, or only unreadable lines); both name the paths."""
    if not paths:
        raise ReportError("no trace path given")
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"trace path {p} does not exist")
    spans, warnings = read_traces(paths)
    names = ", ".join(str(p) for p in paths)
    if not spans:
        files = [
            f for p in map(Path, paths) for f in (sorted(p.rglob("*.jsonl")) if p.is_dir() else [p])
        ]
        if not files:
            raise ReportError(f"no trace files (*.jsonl) under {names}")
        why = f" ({len(warnings)} unreadable lines, first: {warnings[0]})" if warnings else ""
        raise ReportError(f"no trace spans in {names}{why}")
    report = build_report(spans, warnings, [str(p) for p in paths])
    if not report.spans:
        raise ReportError(
            f"no usable trace spans in {names} (first problem: "
            f"{report.warnings[0] if report.warnings else 'none'})"
        )
    from .report_robust import robust_section
    from .robust.events import read_records

    records, record_warnings = read_records(list(paths))
    report.warnings += record_warnings
    report.robust = robust_section(spans, records, end=end)
    from .colltrace.report import colltrace_section

    report.colltrace = colltrace_section(list(paths))
    return report


# -- plain text --------------------------------------------------------------------------------


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table_rows(report: Report) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The tables (title -> header, rows) that the CLI prints, as strings; shared by the rich
    and the plain rendering so that both say the same."""
    from .progress import human_bytes

    tables: dict[str, tuple[list[str], list[list[str]]]] = {}
    tables["phases (seconds, ok spans over all nodes, ranks and attempts)"] = (
        ["phase", "n", "p50", "p90", "max", "bytes", "not ok"],
        [
            [
                p.phase,
                str(p.count),
                fmt_s(p.p50),
                fmt_s(p.p90),
                fmt_s(p.max),
                human_bytes(p.bytes) if p.bytes else "-",
                ", ".join(f"{k} {v}" for k, v in p.outcomes.items() if k != "ok") or "-",
            ]
            for p in report.phases
        ],
    )
    tables["time to first step (seconds, per node/rank)"] = (
        ["attempt", "n", "p50", "p90", "max"],
        [
            [
                name,
                *(
                    [str(st.count), fmt_s(st.p50), fmt_s(st.p90), fmt_s(st.max)]
                    if st
                    else ["0", "-", "-", "-"]
                ),
            ]
            for name, st in (("first", report.first_step_first), ("last", report.first_step_last))
        ],
    )
    if report.stragglers:
        tables[f"stragglers (> median + {MAD_K:g} MAD)"] = (
            ["phase", "node", "rank", "attempt", "seconds", "median", "threshold"],
            [
                [
                    s.phase,
                    s.node,
                    "-" if s.rank is None else str(s.rank),
                    str(s.attempt),
                    fmt_s(s.seconds),
                    fmt_s(s.median),
                    fmt_s(s.threshold),
                ]
                for s in report.stragglers
            ],
        )
    if report.node_stragglers:
        tables[f"straggling nodes (a node's time in a phase > median + {MAD_K:g} MAD)"] = (
            ["phase", "node", "attempt", "seconds", "median", "threshold"],
            [
                [
                    s.phase,
                    s.node,
                    str(s.attempt),
                    fmt_s(s.seconds),
                    fmt_s(s.median),
                    fmt_s(s.threshold),
                ]
                for s in report.node_stragglers
            ],
        )
    if report.incidents:
        tables["incidents: failure (or start) to the job's first step, along the critical path"] = (
            ["attempt", "kind", "wall", "critical node", "ready", "cost by phase (seconds)"],
            [
                [
                    str(i.attempt),
                    i.kind,
                    fmt_s(i.wall_s),
                    "-"
                    if i.critical_node is None
                    else worker_label(i.critical_node, i.critical_rank),
                    f"{i.ready_nodes}/{i.nodes}",
                    ", ".join(
                        f"{k} {v:.2f}"
                        for k, v in sorted(i.cost.items(), key=lambda kv: phase_key(kv[0]))
                    )
                    or "-",
                ]
                for i in report.incidents
            ],
        )
    if report.bytes_by_remote:
        remotes = sorted(report.bytes_by_remote)
        heavy = sorted(report.bytes_by_node, key=lambda n: -n.total)[:MAX_BYTE_ROWS]
        shown = (
            ""
            if len(heavy) == len(report.bytes_by_node)
            else (f", the {len(heavy)} heaviest of {len(report.bytes_by_node)} nodes")
        )
        tables[f"bytes received per remote (every attempt and warmup{shown})"] = (
            ["node", *remotes, "total"],
            [
                [n.node, *(human_bytes(n.remotes.get(r, 0)) for r in remotes), human_bytes(n.total)]
                for n in sorted(heavy, key=lambda n: worker_key(n.node, None))
            ]
            + [
                [
                    "all nodes",
                    *(human_bytes(report.bytes_by_remote[r]) for r in remotes),
                    human_bytes(sum(report.bytes_by_remote.values())),
                ]
            ],
        )
    if report.robust:
        from .report_robust import robust_tables

        tables.update(robust_tables(report.robust))
    if report.colltrace:
        from .colltrace.report import colltrace_tables

        tables.update(colltrace_tables(report.colltrace))
    restarted = [r for r in report.restarts if r.restarts]
    if restarted:
        tables[f"restarts ({report.total_restarts} in all)"] = (
            ["node", "rank", "restarts", "attempts"],
            [
                [
                    r.node,
                    "-" if r.rank is None else str(r.rank),
                    str(r.restarts),
                    ", ".join(
                        f"{a.attempt}: {a.outcome}" + (f" ({a.reason})" if a.reason else "")
                        for a in r.attempts
                    ),
                ]
                for r in restarted
            ],
        )
    return tables


def summary_line(report: Report) -> str:
    return (
        f"{report.spans} spans from {report.nodes} nodes ({report.workers} node/rank "
        f"traces); {len(report.stragglers)} stragglers; {report.total_restarts} restarts"
    )


def format_text(report: Report) -> str:
    """The report as aligned plain text (for logs and pipes)."""
    lines = [summary_line(report)]
    for title, (header, rows) in table_rows(report).items():
        widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=False)]
        lines += ["", title]
        for row in (header, *rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not report.stragglers:
        lines += ["", "no stragglers"]
    return "\n".join(lines)
