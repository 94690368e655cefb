"""The node-level views of ``bootseer report``: incidents, timelines, critical path, bytes.

A training job's first step waits for its slowest rank, so a restart costs the time from the
failure to the moment the *last* node reached ``bootseer.ready()``. This module lines the nodes
up per incident and says which node, and which of its phases, decided that time.

* **Job attempt** (:func:`job_attempts`): ``bootseer run`` counts attempts per node, so a
  node that replaced a lost one starts at 0 while the survivors are at 1, and survivors whose
  workers torchrun restarted stay where they were. The report therefore numbers the job's
  starts itself, by time: a node's attempt is one *run* (split where a ``failure`` point of
  that node and attempt is followed by spans that start after it: a replacement of the same
  name starting over), and runs in start order join the job's current attempt unless their
  node is in it already, the job reached its first step before they started, or one of its
  nodes failed before they started; else they open the next job attempt. A job whose nodes
  all restart together gets the per-node numbers back. A launcher's own restart of its ranks
  inside an attempt (torchrun's: the agent's ``relaunch`` span, ``generation`` on the new
  ranks' spans) is a start of its own, split off as ETTR splits it
  (:func:`bootseer.robust.ettr.job_launches`): the report's incidents are ETTR's launches.
* **Incident** ``k``: every node's spans of job attempt ``k``. It starts at the failure: the
  earliest ``failure`` event of job attempt ``k - 1`` (a point span, :data:`FAILURE_PHASE`),
  else the earliest ``restart`` span of job attempt ``k``, else (the cold start) the earliest
  span. It ends at the job's first step: the latest ``first_step`` end of that attempt.
  ``node_attempts`` says which of each node's own attempts it holds.
* **Critical path**: the node/rank whose first step ended last; its spans from the incident's
  start to its first step, each stretch of wall time given to the phase that ended it
  (:func:`positioned_segments`), stretches where none of its phases ran as ``untraced``. Its
  parts add up to the incident's wall time: the restart's **cost split by phase**.
* **Timeline**: per node, its spans of the incident (all ranks) as positioned segments, seconds
  since the incident's start; gaps where nothing ran are left out, so a chart shows them.
* **Node stragglers**: per phase and job attempt, a node's time in the phase (first start to last
  end over its ranks) against the other nodes', median + 3 MAD as for spans.
* **Bytes by remote**: the spans' ``bytes_by_remote`` (see :mod:`bootseer.trace`) summed per node
  and over the job, every attempt and warmup included: what each node asked of each service.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from .report_order import phase_key, straggler_threshold, worker_key
from .trace import Span

#: A point event (start == end) a producer may write when it detects a failure, in the failed
#: attempt: the incident of the next attempt starts there, not at the restart's backoff.
FAILURE_PHASE = "failure"
UNTRACED = "untraced"


@dataclass
class Segment:
    """A stretch of wall time given to one phase; seconds since the incident's start."""

    phase: str
    start: float
    end: float


@dataclass
class NodeTimeline:
    node: str
    segments: list[Segment]
    first_step_s: float | None  # when the node's last rank was ready; None: none was


@dataclass
class Incident:
    """One start or restart of the job, from the failure to its first step."""

    attempt: int  # the job attempt (:func:`job_attempts`), not a node's own number
    kind: str  # "start" (attempt 0) or "restart"
    start_at: float  # epoch seconds of the failure (or the start)
    start_from: str  # what set it: "failure", "restart" or "first_span"
    first_step_at: float | None  # epoch seconds of the job's first step; None: not reached
    wall_s: float | None  # first_step_at - start_at
    nodes: int
    ready_nodes: int  # nodes whose every rank reached its first step
    critical_node: str | None
    critical_rank: int | None
    critical_path: list[Segment]
    cost: dict[str, float]  # wall_s split by phase along the critical path; sums to wall_s
    timeline: list[NodeTimeline]
    # v3: each node's own attempt numbers grouped into this job attempt ({} when read from v2)
    node_attempts: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class NodeBytes:
    node: str
    remotes: dict[str, int]  # remote -> bytes received
    total: int


@dataclass
class NodeStraggler:
    phase: str
    node: str
    attempt: int
    seconds: float  # the node's time in the phase: its ranks' first start to last end
    median: float
    mad: float
    threshold: float


@dataclass
class NodeViews:
    incidents: list[Incident] = field(default_factory=list)
    node_stragglers: list[NodeStraggler] = field(default_factory=list)
    bytes_by_node: list[NodeBytes] = field(default_factory=list)
    bytes_by_remote: dict[str, int] = field(default_factory=dict)  # the job's totals


def positioned_segments(
    spans: Iterable[Span],
    origin: float | None = None,
    until: float | None = None,
    gap: str | None = UNTRACED,
) -> list[Segment]:
    """The wall time from ``origin`` (default: the first start) to the last end (at most
    ``until``) as segments in time order: each stretch goes to the phase that ends it (the one
    the time was waiting for), a stretch where no span ran to ``gap`` (left out when None).
    Times are seconds since ``origin``; adjacent stretches of one phase are merged."""
    ordered = sorted(spans, key=lambda s: (s.end, s.start))
    if not ordered:
        return []
    zero = min(s.start for s in ordered) if origin is None else origin
    covered = zero
    out: list[Segment] = []

    def add(phase: str, start: float, end: float) -> None:
        if out and out[-1].phase == phase and out[-1].end == start - zero:
            out[-1].end = end - zero
        else:
            out.append(Segment(phase, start - zero, end - zero))

    for s in ordered:
        end = s.end if until is None else min(s.end, until)
        if end <= covered:
            continue
        if s.start > covered:
            if gap is not None:
                add(gap, covered, s.start)
            covered = s.start
        add(s.phase, covered, end)
        covered = end
    return out


def split_by_phase(segments: Iterable[Segment]) -> dict[str, float]:
    """Seconds per phase of positioned segments."""
    out: dict[str, float] = defaultdict(float)
    for seg in segments:
        out[seg.phase] += seg.end - seg.start
    return dict(out)


def _incident_start(attempt: int, spans: list[Span], failures: list[Span]) -> tuple[float, str]:
    failed = [f.start for f in failures if f.attempt == attempt - 1]
    if attempt > 0 and failed:
        return min(failed), "failure"
    restarts = [s.start for s in spans if s.phase == "restart"]
    if restarts:
        return min(restarts), "restart"
    return min(s.start for s in spans), "first_span"


def _incident(attempt: int, spans: list[Span], failures: list[Span]) -> Incident:
    start_at, start_from = _incident_start(attempt, spans, failures)
    by_node: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_node[s.node].append(s)
    ready: dict[tuple[str, int | None], float] = {}  # (node, rank) -> its first step's end
    ranks: dict[str, set[int | None]] = defaultdict(set)  # ranks that started a first step
    for s in spans:
        if s.phase == "first_step":
            ranks[s.node].add(s.rank)
            if s.outcome == "ok":
                key = (s.node, s.rank)
                ready[key] = max(ready.get(key, s.end), s.end)
    ends: dict[str, list[float]] = defaultdict(list)
    for (node, _), end in ready.items():
        ends[node].append(end)
    timeline = []
    for node in sorted(by_node, key=lambda n: worker_key(n, None)):
        # a node is ready when every rank that started a first step reached it
        done = ends.get(node, [])
        node_ready = max(done) if done and len(done) == len(ranks[node]) else None
        timeline.append(
            NodeTimeline(
                node,
                positioned_segments(by_node[node], start_at, gap=None),
                None if node_ready is None else node_ready - start_at,
            )
        )
    if not ready:
        return Incident(
            attempt,
            "start" if attempt == 0 else "restart",
            start_at,
            start_from,
            None,
            None,
            len(by_node),
            0,
            None,
            None,
            [],
            {},
            timeline,
        )
    (node, rank), first_step_at = max(ready.items(), key=lambda kv: kv[1])
    row = [s for s in by_node[node] if s.rank is None or s.rank == rank]
    path = positioned_segments(row, start_at, until=first_step_at)
    return Incident(
        attempt,
        "start" if attempt == 0 else "restart",
        start_at,
        start_from,
        first_step_at,
        first_step_at - start_at,
        len(by_node),
        sum(t.first_step_s is not None for t in timeline),
        node,
        rank,
        path,
        split_by_phase(path),
        timeline,
    )


def find_node_stragglers(spans: Iterable[Span], skip: Iterable[str] = ()) -> list[NodeStraggler]:
    """Nodes whose time in a phase (per attempt) exceeds median + 3 MAD of all nodes'."""
    skip = frozenset(skip)
    window: dict[tuple[str, int, str], list[float]] = {}
    for s in spans:
        if s.outcome != "ok" or s.phase in skip:
            continue
        w = window.setdefault((s.phase, s.attempt, s.node), [s.start, s.end])
        w[0], w[1] = min(w[0], s.start), max(w[1], s.end)
    groups: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for (phase, attempt, node), (lo, hi) in window.items():
        groups[(phase, attempt)][node] = hi - lo
    found = []
    for (phase, attempt), per_node in groups.items():
        if len(per_node) < 3:
            continue
        m, d, threshold = straggler_threshold(list(per_node.values()))
        found += [
            NodeStraggler(phase, node, attempt, sec, m, d, threshold)
            for node, sec in per_node.items()
            if sec > threshold
        ]
    found.sort(key=lambda x: (phase_key(x.phase), x.attempt, -x.seconds, worker_key(x.node, None)))
    return found


def remote_totals(spans: Iterable[Span]) -> tuple[list[NodeBytes], dict[str, int]]:
    """Bytes received per node and remote, and the job's totals per remote."""
    per_node: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    total: dict[str, int] = defaultdict(int)
    for s in spans:
        for remote, n in s.bytes_by_remote.items():
            per_node[s.node][remote] += n
            total[remote] += n
    nodes = [
        NodeBytes(node, dict(sorted(r.items())), sum(r.values()))
        for node, r in sorted(per_node.items(), key=lambda kv: worker_key(kv[0], None))
    ]
    return nodes, dict(sorted(total.items()))


@dataclass
class _Run:
    """One node's spans of one of its attempts (a replacement's restart split off)."""

    node: str
    attempt: int
    part: int  # 0, or 1+ after a failure point of the same node and attempt
    spans: list[int] = field(default_factory=list)  # indices into the spans

    def bounds(self, spans: Sequence[Span]) -> tuple[float, float | None, float | None]:
        """(start, first failure, last ok first step) of the run."""
        mine = [spans[i] for i in self.spans]
        failed = [s.start for s in mine if s.phase == FAILURE_PHASE]
        ready = [s.end for s in mine if s.phase == "first_step" and s.outcome == "ok"]
        return (
            min(s.start for s in mine),
            min(failed) if failed else None,
            max(ready) if ready else None,
        )


def _runs(spans: Sequence[Span]) -> list[_Run]:
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, s in enumerate(spans):
        groups[(s.node, s.attempt)].append(i)
    runs: dict[tuple[str, int, int], _Run] = {}
    for (node, attempt), idx in groups.items():
        failed = sorted(spans[i].start for i in idx if spans[i].phase == FAILURE_PHASE)
        for i in idx:  # a failure point closes its run; what starts at or after it is new
            s = spans[i]
            part = (
                sum(f < s.start for f in failed)
                if s.phase == FAILURE_PHASE
                else sum(f <= s.start for f in failed)
            )
            runs.setdefault((node, attempt, part), _Run(node, attempt, part)).spans.append(i)
    return list(runs.values())


def job_attempts(spans: Sequence[Span]) -> tuple[list[int], list[dict[str, list[int]]]]:
    """The job attempt of every span (in order) and, per job attempt, each node's own attempt
    numbers in it; how runs are grouped is in the module docstring."""
    runs = _runs(spans)
    bounds = {id(r): r.bounds(spans) for r in runs}
    runs.sort(key=lambda r: (bounds[id(r)][0], r.attempt, r.part, worker_key(r.node, None)))
    of = [0] * len(spans)
    members: list[dict[str, list[int]]] = []
    ready: float | None = None
    failed: float | None = None
    for r in runs:
        start, fail, done = bounds[id(r)]
        current = members[-1] if members else None
        if (
            current is None
            or r.node in current
            or (ready is not None and start >= ready)
            or (failed is not None and start >= failed)
        ):
            current, ready, failed = {}, None, None
            members.append(current)
        current[r.node] = sorted({*current.get(r.node, []), r.attempt})
        if done is not None:
            ready = done if ready is None else max(ready, done)
        if fail is not None:
            failed = fail if failed is None else min(failed, fail)
        for i in r.spans:
            of[i] = len(members) - 1
    return of, members


def _launches(spans: list[Span]) -> tuple[list[Span], list[int]]:
    """The spans with a launcher's restarts of its ranks split off (ETTR's launches: each
    relaunch a ``restart`` span, the attempt ``(attempt, launch)``), and each span's own
    attempt number; the spans as they are when no launcher restarted its ranks."""
    own = [s.attempt for s in spans]
    if not any(s.phase == "relaunch" for s in spans):
        return spans, own
    from .robust.ettr import job_launches

    return job_launches(spans), own


def node_views(spans: Sequence[Span], skip_stragglers: Iterable[str] = ()) -> NodeViews:
    """Every node-level view of these (clean) spans; warmup spans count for bytes only."""
    job, own = _launches([s for s in spans if not s.detail.get("warmup")])
    of, members = job_attempts(job)
    if job and isinstance(job[0].attempt, tuple):  # the nodes' own numbers, as without
        runs = [dict[str, set[int]]() for _ in members]
        for s, a, mine in zip(job, of, own, strict=True):
            runs[a].setdefault(s.node, set()).add(mine)
        members = [{n: sorted(v) for n, v in m.items()} for m in runs]
    job = [s if s.attempt == a else replace(s, attempt=a) for s, a in zip(job, of, strict=True)]
    failures = [s for s in job if s.phase == FAILURE_PHASE]
    by_attempt: dict[int, list[Span]] = defaultdict(list)
    for s in job:
        if s.phase != FAILURE_PHASE:
            by_attempt[s.attempt].append(s)
    nodes, total = remote_totals(spans)
    return NodeViews(
        incidents=[
            replace(_incident(a, by_attempt[a], failures), node_attempts=members[a])
            for a in sorted(by_attempt)
        ],
        node_stragglers=find_node_stragglers(job, {*skip_stragglers, FAILURE_PHASE}),
        bytes_by_node=nodes,
        bytes_by_remote=total,
    )
