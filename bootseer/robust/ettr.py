"""ETTR (effective training time ratio): productive time over wall time, cumulative and over
a sliding hour, and for every incident where the unproductive time went. The one accounting
of the project: ``bootseer report`` prints it, and the soak benchmark calls this module for
its figures (docs/robust.md, "ETTR").

The window: from the job's first step (every rank of its first launch past its first step)
to the end of the job (``end``; by default the last time the traces hold: a job whose last
launch trained on without an incident leaves no record at its end, so give it). Why from the
first step: it is the one instant every input knows exactly (the traces, and a job's own
step log where bootseer did not supervise it: :func:`ettr_from_steps`), and the cold start
before it is the start-up report's, phase by phase; ETTR is what failures cost.

Productive time, per launch: from its first step, after the steps it redid (the
recomputation), to its last progress. From the traces that is the model below; from a
step log (:func:`ettr_from_steps`) each step that advances the highest step ever finished
counts the time since its process's previous step, which is the same model measured step by
step (the redone steps are known exactly, not estimated from a checkpoint step).

Read: the spans of :mod:`bootseer.trace` that ``bootseer run`` writes (``first_step`` per
rank and attempt, the startup phases, ``hang`` with ``detected_at``/``dumped_at``,
``restart`` with ``exited_at``), and the records of :mod:`.events` (an incident's event may
carry ``step`` and, in its evidence, ``checkpoint_step`` and ``step_time_s``: the steps
redone after the restart).

The model, per attempt ``a`` (all nodes and ranks together):

* productive from its first step (the last rank's ``first_step`` end) plus the
  recomputation (steps since the last checkpoint, redone), to its failure: the last progress
  for a hang (the ``hang`` span's start), the exit for a crash (``exited_at``), or the end
  of the job;
* an incident runs from that failure to the next attempt's first step, split into
  ``detection`` (hang: the silence until it was seen; a crash is seen at its exit),
  ``localization`` (the stack dumps), ``teardown`` (kill and cleanup, until the backoff),
  ``restart`` (the backoff), each startup phase of the next attempt (``environment``,
  ``checkpoint_prefetch``, ``image_prefetch``, ``command_start``, and ``first_step``: the
  rest until the first step), ``failed_attempt`` (an attempt that failed before its first
  step) and ``other`` (gaps no span covers), which add up to the incident exactly; plus
  ``recomputation`` after it (None when the trace does not say).

Usage::

    from bootseer.robust.ettr import compute_ettr, read_ettr

    report = read_ettr(["traces/"], end=time.time())
    report.ettr, report.sliding(window_s=3600)[-1], report.incidents[0].split()
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..trace import Span, read_traces
from .events import Event, Verdict, read_records

__all__ = [
    "STARTUP_PHASES",
    "EttrReport",
    "Incident",
    "compute_ettr",
    "ettr_from_steps",
    "job_attempts",
    "job_launches",
    "read_ettr",
]

STARTUP_PHASES = ("environment", "checkpoint_prefetch", "image_prefetch", "command_start")


@dataclass(frozen=True)
class Incident:
    """One failure and the way back to training."""

    attempt: int  # the attempt that failed
    reason: str  # crash or hang (the restart span's)
    failure_class: str | None
    start: float  # the end of productive time
    end: float  # the next attempt's first step
    detection_s: float
    localization_s: float
    teardown_s: float
    startup_s: dict[str, float] = field(default_factory=dict)  # restart, phases, first_step
    failed_attempt_s: float = 0.0
    other_s: float = 0.0
    recomputation_s: float | None = None
    generation: int = 0  # the launch of the ranks that failed (the launcher's restarts)

    def split(self) -> dict[str, float]:
        """Seconds per part, in order; they add up to ``end - start``."""
        return {
            "detection": self.detection_s,
            "localization": self.localization_s,
            "teardown": self.teardown_s,
            **self.startup_s,
            "failed_attempt": self.failed_attempt_s,
            "other": self.other_s,
        }

    @property
    def unproductive_s(self) -> float:
        return self.end - self.start + (self.recomputation_s or 0.0)


@dataclass(frozen=True)
class EttrReport:
    start: float
    end: float
    productive: tuple[tuple[float, float], ...]  # intervals of productive time
    incidents: tuple[Incident, ...]

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def productive_s(self) -> float:
        return sum(b - a for a, b in self.productive)

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def window(self, start: float, end: float) -> float:
        """ETTR over ``[start, end]`` (clipped to the job)."""
        start, end = max(start, self.start), min(end, self.end)
        if end <= start:
            return 0.0
        inside = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.productive)
        return inside / (end - start)

    def sliding(self, window_s: float = 3600.0, step_s: float = 60.0) -> list[tuple[float, float]]:
        """(time, ETTR of the window ending then) every ``step_s`` and at the end; a window
        starts no earlier than the job."""
        points, t = [], self.start + step_s
        while t < self.end:
            points.append((t, self.window(t - window_s, t)))
            t += step_s
        points.append((self.end, self.window(self.end - window_s, self.end)))
        return points

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "wall_s": self.wall_s,
            "productive_s": self.productive_s,
            "ettr": self.ettr,
            "incidents": [
                {
                    "attempt": i.attempt,
                    "generation": i.generation,
                    "reason": i.reason,
                    "class": i.failure_class,
                    "start": i.start,
                    "end": i.end,
                    "split": i.split(),
                    "recomputation_s": i.recomputation_s,
                }
                for i in self.incidents
            ],
        }


def _incident_event(records: Sequence[Event | Verdict], start: float, end: float) -> Event | None:
    """The first detector event of an attempt's life (between its start and its restart);
    without one, the controller's verdict that stopped it (a slow node or a hang elsewhere
    is the controller's finding: the node's trace holds only the verdict)."""
    events = [
        r
        for r in records
        if isinstance(r, Event)
        and start <= r.time <= end
        and r.kind in ("crash", "hang", "nonfinite", "spike", "fail_slow", "health")
    ]
    if events:
        return min(events, key=lambda e: e.time)
    verdicts = [
        r
        for r in records
        if isinstance(r, Verdict)
        and start <= r.time <= end
        and r.evidence.get("from") == "controller"
    ]
    first = min(verdicts, key=lambda v: v.time, default=None)
    return (
        None
        if first is None
        else Event(
            first.failure_class
            if first.failure_class in ("fail_slow", "hang", "spike", "nonfinite")
            else "crash",
            first.failure_class,
            time=first.time,
            evidence={"from": "controller"},
        )
    )


def _recomputation(event: Event | None) -> float | None:
    if event is None or event.step is None:
        return None
    ckpt, step_time = event.evidence.get("checkpoint_step"), event.evidence.get("step_time_s")
    if not isinstance(ckpt, int | float) or not isinstance(step_time, int | float):
        return None
    return max(0.0, (event.step - ckpt) * step_time)


def job_attempts(spans: Iterable[Span]) -> list[Span]:
    """The spans with each node's attempt number replaced by the job's.

    Nodes count attempts on their own: a node that replaced a lost one starts at attempt 0
    while the survivors are at attempt 5, and a node whose launcher failed once is one ahead
    of the others. Under a controller, ``command_start`` carries the epoch (the newest
    incident, the same on every node after a verdict); a node's spans of that attempt are
    moved to the job attempt ``epoch * 1000 + k`` (``k``: the node's earlier attempts in the
    same epoch, restarts it made alone). Spans of a node without epochs keep their numbers."""
    spans = list(spans)
    epoch_of: dict[tuple[str, int], int] = {}
    for s in sorted(
        (
            s
            for s in spans
            if s.phase == "command_start" and isinstance((s.detail or {}).get("epoch"), int)
        ),
        key=lambda s: (s.node, s.attempt),
    ):
        epoch = int(s.detail["epoch"])
        same = sum(
            1 for (node, _), key in epoch_of.items() if node == s.node and key // 1000 == epoch
        )
        epoch_of.setdefault((s.node, s.attempt), epoch * 1000 + same)
    if not epoch_of:
        return spans
    return [
        dataclasses.replace(s, attempt=epoch_of[(s.node, s.attempt)])
        if (s.node, s.attempt) in epoch_of
        else s
        for s in spans
    ]


def job_launches(spans: Sequence[Span]) -> list[Span]:
    """The spans keyed by (job attempt, job launch), ``relaunch`` spans renamed ``restart``.

    A launcher that restarted its ranks inside an attempt (torchrun's own restart: the
    agent's ``relaunch`` spans, and ``generation`` on the new ranks' spans) splits it into
    launches, each accounted like an attempt. Nodes count launches and attempts on their own
    (a fresh node starts at 0, a replacement reuses the lost node's name: its spans are told
    apart by the command's pid). So the job's launches come from time: each restart of a node
    (its ``relaunch``, and without a controller's epochs its ``restart`` too) runs from its
    failure (``exited_at``) to its end, the restarts of one failure overlap (no node has its
    new ranks before the rendezvous round that all of them join), and the job's launch ``k``
    is the k-th group of overlapping restarts; a node's run belongs to the newest group that
    began before it (a replacement node joins the round of the loss it replaces). Under a
    controller the job attempt is the epoch's (:func:`job_attempts`), launches within it."""
    spans = list(spans)
    epochs = any(
        isinstance((s.detail or {}).get("epoch"), int) for s in spans if s.phase == "command_start"
    )
    bounds = sorted(
        (_failed_at(s), s.end, s.phase == "restart")
        for s in spans
        if s.phase == "relaunch" or (s.phase == "restart" and not epochs)
    )
    groups: list[list[Any]] = []  # [start, end, a command restarted] of each group
    for lo, hi, restarted in bounds:
        if groups and lo <= groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], hi)
            groups[-1][2] = groups[-1][2] or restarted
        else:
            groups.append([lo, hi, restarted])
    # each group's (attempt, launch): a group where a command was restarted opens the next
    # job attempt (without epochs), one of relaunches only the next launch within it
    keys, attempt, launch = [(0, 0)], 0, 0
    for g in groups:
        attempt, launch = (attempt + 1, 0) if g[2] else (attempt, launch + 1)
        keys.append((attempt, launch))

    def group_of(when: float) -> int:  # the group of a node's launch begun at `when`
        return sum(1 for g in groups if g[0] <= when)

    runs = _node_runs(spans)
    begins: dict[tuple[Any, ...], float] = {}  # a node run's first launch: its start
    for s, run in zip(spans, runs, strict=True):
        if s.phase != "relaunch":
            begins[run] = min(begins.get(run, s.start), s.start)
    launch_of = {
        (run, _generation(s)): group_of(_failed_at(s))
        for s, run in zip(spans, runs, strict=True)
        if s.phase == "relaunch"
    }

    def key(s: Span, run: tuple[Any, ...]) -> tuple[int, int]:
        gen = _generation(s)
        group = launch_of.get((run, gen), 0) if gen else group_of(begins.get(run, s.start))
        if not epochs:
            return keys[group]
        # under epochs only relaunches are grouped: the launch within the epoch's attempt
        within = [g for g in groups[:group] if g[0] >= begins.get(run, s.start)] if gen else []
        return (s.attempt, len(within))

    return [
        dataclasses.replace(
            s, phase="restart" if s.phase == "relaunch" else s.phase, attempt=key(s, run)
        )
        for s, run in zip(spans, runs, strict=True)
    ]


def _failed_at(span: Span) -> float:
    exited = (span.detail or {}).get("exited_at")
    return float(exited) if isinstance(exited, int | float) and exited <= span.start else span.start


def _node_runs(spans: Sequence[Span]) -> list[tuple[Any, ...]]:
    """Each span's run of ``bootseer run``'s command: (node, attempt, the command's pid).
    A span without the pid (the startup phases, the backoff) is the next command start's of
    its node and attempt (the last one's when none follows)."""
    starts: dict[tuple[Any, int], list[tuple[float, Any]]] = defaultdict(list)
    for s in spans:
        if s.phase == "command_start":
            starts[(s.node, s.attempt)].append((s.start, (s.detail or {}).get("pid")))
    for found in starts.values():
        found.sort(key=lambda x: x[0])
    runs = []
    for s in spans:
        pid = (s.detail or {}).get("pid")
        found = starts.get((s.node, s.attempt), [])
        if pid is None or s.phase not in _WITH_COMMAND_PID:
            later = [p for t, p in found if t >= s.start - 1e-3]
            pid = later[0] if later else (found[-1][1] if found else None)
        runs.append((s.node, s.attempt, pid))
    return runs


#: spans whose ``pid`` is the command's (the run they belong to)
_WITH_COMMAND_PID = ("command_start", "first_step", "hang", "relaunch", "controller_stop")


def _generation(span: Span) -> int:
    gen = (span.detail or {}).get("generation")
    return gen if isinstance(gen, int) and gen > 0 else 0


def compute_ettr(
    spans: Iterable[Span],
    records: Sequence[Event | Verdict] = (),
    *,
    start: float | None = None,
    end: float | None = None,
) -> EttrReport:
    """The report of one job from its spans (every node's, attempts aligned by
    :func:`job_attempts`; a warmup's are not the job's) and event records. ``end``: the end
    of the job (default: the last time the trace holds); ``start``: where the window opens
    (default: the job's first step, see the module docstring); an incident that ended
    before it (the cold start failing) is left out."""
    spans = job_launches(job_attempts(s for s in spans if not (s.detail or {}).get("warmup")))
    by = defaultdict(list)
    for s in spans:
        by[(s.phase, s.attempt)].append(s)
    attempts = sorted({s.attempt for s in spans})
    if not attempts:
        raise ValueError("the trace holds no spans of bootseer run: nothing to measure")
    following = dict(zip(attempts, attempts[1:], strict=False))  # attempt -> the next one

    def attempt_start(a: int) -> float:
        first = by.get(("first_step", a))
        if first:
            return min(s.start for s in first)
        own = [s.start for s in spans if s.attempt == a and s.phase != "restart"]
        # a launch that never stepped and left no other span: from its relaunch's end
        return min(own) if own else max(s.end for s in by[("restart", a)])

    def ready(a: int) -> float | None:
        first = by.get(("first_step", a))
        return max(s.end for s in first) if first else None

    first_ready = min((r for a in attempts if (r := ready(a)) is not None), default=None)
    job_start = (
        start
        if start is not None
        else (first_ready if first_ready is not None else attempt_start(attempts[0]))
    )
    job_end = end if end is not None else max([s.end for s in spans] + [r.time for r in records])

    # the failure of each failed attempt: when productive time ended, and how it was seen
    failures: dict[int, dict[str, Any]] = {}
    for a in attempts:
        restarts = by.get(("restart", following.get(a)))
        if not restarts:
            continue
        restart = min(restarts, key=lambda s: s.start)
        hangs = by.get(("hang", a))
        exited = restart.detail.get("exited_at", restart.start)
        event = _incident_event(records, attempt_start(a), restart.start)
        info: dict[str, Any] = {
            "restart": restart,
            "event": event,
            "reason": restart.detail.get("reason", "crash"),
        }
        if hangs:
            hang = min(hangs, key=lambda s: s.start)
            detected = float(
                hang.detail.get("detected_at", hang.start + float(hang.detail.get("silent_s", 0.0)))
            )
            dumped = float(hang.detail.get("dumped_at", detected))
            # the last heartbeat can precede the attempt's ready mark (a step's beat written
            # just before it): productive time ends no earlier than it began
            fail = max(hang.start, ready(a) or hang.start)
            # nodes' clocks of one hang: another node's restart may begin before this dump
            # ended (its own threshold passed first); the parts stay in order
            dumped = min(dumped, restart.start)
            detected = min(max(detected, fail), dumped)
            info.update(
                fail=fail,
                detection=detected - fail,
                localization=dumped - detected,
                teardown=restart.start - dumped,
                cls=event.failure_class if event else "hang",
            )
        else:
            info.update(
                fail=float(exited),
                detection=0.0,
                localization=0.0,
                teardown=restart.start - float(exited),
                cls=event.failure_class if event else None,
            )
        if ready(a) is None:  # failed before its first step: all of it was unproductive
            info["failed_attempt"] = info["fail"] - attempt_start(a)
            info["fail"] = attempt_start(a)
        failures[a] = info

    incidents, productive = [], []
    recompute_before: dict[int, float] = {}
    for a in attempts:
        if a not in failures:
            continue
        f = failures[a]
        nxt = following[a]
        restart: Span = f["restart"]
        r_next = ready(nxt)
        if r_next is None or nxt in failures and failures[nxt]["fail"] < r_next:
            inc_end = failures[nxt]["fail"] if nxt in failures else job_end
            r_next = None
        else:
            inc_end = r_next
        if inc_end <= job_start:
            continue  # the cold start failing, before the window: the start-up report's
        # a replacement node's start overlaps the others' restart (they wait for it in the
        # rendezvous): the restart ends where the next attempt's first node began
        waited = (
            restart.seconds
            if r_next is None
            else max(0.0, min(restart.seconds, attempt_start(nxt) - restart.start))
        )
        startup = {"restart": waited}
        covered = f["detection"] + f["localization"] + f["teardown"] + waited
        if r_next is not None:
            t0 = max(attempt_start(nxt), restart.start)
            for phase in STARTUP_PHASES:
                found = [s for s in by.get((phase, nxt), []) if t0 <= s.start <= r_next]
                if found:
                    startup[phase] = max(s.seconds for s in found)  # nodes work in parallel
            named = sum(v for k, v in startup.items() if k != "restart")
            startup["first_step"] = max(0.0, (r_next - t0) - named)
            covered += r_next - t0
        failed = f.get("failed_attempt", 0.0)
        covered += failed
        recompute = _recomputation(f["event"])
        if recompute is not None and r_next is not None:
            recompute_before[nxt] = recompute
        incidents.append(
            Incident(
                attempt=a[0],
                generation=a[1],
                reason=f["reason"],
                failure_class=f["cls"],
                start=f["fail"],
                end=inc_end,
                detection_s=f["detection"],
                localization_s=f["localization"],
                teardown_s=f["teardown"],
                startup_s=startup,
                failed_attempt_s=failed,
                other_s=max(0.0, (inc_end - f["fail"]) - covered),
                recomputation_s=recompute,
            )
        )
    for a in attempts:
        r = ready(a)
        if r is None:
            continue
        stop = min(failures[a]["fail"] if a in failures else job_end, job_end)
        begin = max(min(r + recompute_before.get(a, 0.0), stop), job_start)
        if stop > begin:
            productive.append((begin, stop))
    return EttrReport(job_start, job_end, tuple(productive), tuple(incidents))


def ettr_from_steps(
    steps: Iterable[tuple[float, int, Any]], *, end: float, start: float | None = None
) -> EttrReport:
    """The same accounting from a job's own step log, where no ``bootseer run`` trace exists
    (the benchmark's torchrun-only peer) or to check the traces' estimate: ``steps`` are
    (time the step finished, the step, the process that ran it), e.g. rank 0's. A step that
    advances the highest step ever finished is productive for the time since its process's
    previous step; a process's first step has no such time (its start is the launch's way
    back, not training); a step redone after a restart is not productive. ``start``: where
    the window opens (default: the first step); ``end``: the end of the job."""
    ordered = sorted(steps, key=lambda s: s[0])
    if not ordered:
        raise ValueError("the step log holds no step: nothing to measure")
    job_start = ordered[0][0] if start is None else start
    best, prev, productive = -1, {}, []
    for when, step, proc in ordered:
        if when > end:
            break
        if step > best and proc in prev and when > max(prev[proc], job_start):
            productive.append((max(prev[proc], job_start), when))
        best = max(best, step)
        prev[proc] = when
    merged: list[tuple[float, float]] = []
    for a, b in productive:  # consecutive steps of one process: one interval
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return EttrReport(job_start, end, tuple(merged), ())


def read_ettr(
    paths: Sequence[str | os.PathLike], *, start: float | None = None, end: float | None = None
) -> EttrReport:
    """:func:`compute_ettr` over trace files or directories: what ``bootseer report
    [--end END] PATHS`` prints."""
    spans, _ = read_traces(paths)
    records, _ = read_records(list(paths))
    return compute_ettr(spans, records, start=start, end=end)
