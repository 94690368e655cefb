"""The node's agent inside ``bootseer run``: the decision libraries wired to one supervised
command. It turns what the supervisor sees (a crash with its last output lines, heartbeats,
the time) into events and verdicts, writes them into the node's trace, says each in one line,
and answers the only question the supervisor asks: stop, restart, or go on.

Why here and not in the supervisor: the supervisor owns processes and signals; which failure
deserves which action is the policy table's (:mod:`.policy`), and must stay one table for the
agent now and the controller across nodes later.

The agent acts alone on its node, so a verdict becomes a local action:

* ``stop`` (a deterministic user error, no progress across restarts): no more restarts;
* ``restart_in_place``: restart after the usual backoff;
* ``replace_and_restart``: the node cannot replace itself without a controller, so it
  restarts in place; the node check before every start (:mod:`.health`) stops a node that
  is unfit (a full disk), and the verdict stays in the trace for the controller;
* ``rollback``: nothing to roll back here (the agent passes no update): stop, saying so;
* ``continue`` (a loss spike): recorded, nothing done.

Usage::

    agent = Agent(trace, node="node-3", hang=HangDetector(timeout_s=600))
    agent.start_attempt(0)
    for beat in beats: kill = agent.observe(beat)        # a NaN: a Verdict to act on at once
    events = agent.metric_events(beat)                   # under a controller: not judged here
    hang = agent.check_hang(time.time())                 # a hang Event, or None
    early = agent.rank_crash(rank_watch.poll())          # a rank died: the event at once
    better = agent.refine(early, exit_code, tail.lines())  # the launcher's summary, later
    verdict = agent.judge_crash(exit_code, tail.lines()) # after a crash
    agent.local_action(verdict)                          # "stop" | "restart" | "continue"
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

from ..trace import TraceWriter
from .classify import SECONDARY, Classification, classify, memory_cgroup, oom_kills
from .detect import Beat, HangDetector, MetricDetector
from .events import Event, Verdict, write_record
from .policy import decide
from .ranks import RankEnd

__all__ = ["Agent", "LOCAL_ACTIONS"]

#: verdict action -> what the agent on its own node does
LOCAL_ACTIONS = {
    "stop": "stop",
    "rollback": "stop",
    "restart_in_place": "restart",
    "replace_and_restart": "restart",
    "continue": "continue",
}


def _say(line: str) -> None:
    print(f"bootseer: {line}", file=sys.stderr, flush=True)


#: what a rank killed by a signal is refined to when its lines say why it aborted itself
#: (gloo's abort on a mismatched collective, a device-side assert, the kernel's OOM kill)
SIGNAL_CAUSES = ("collective_mismatch", "cuda_error", "gpu_oom", "cpu_oom")
#: crash classes that name no cause of their own: the collective tracer's mismatch wins
UNEXPLAINED = (*SECONDARY, "killed_by_signal", "unknown")


class Agent:
    """Events and verdicts of one node's supervised command, across its attempts."""

    def __init__(
        self,
        trace: TraceWriter | None,
        node: str,
        *,
        hang: HangDetector | None = None,
        max_no_progress: int = 3,
        log: Callable[[str], None] = _say,
        colltrace: Any = None,
    ) -> None:
        self.trace = trace
        self.colltrace = colltrace  # a bootseer.colltrace.reader.Watch, or None
        self.node = node
        self._hang_template = hang
        self.max_no_progress = max_no_progress
        self.log = log
        self.verdicts: list[Verdict] = []
        self.progress: list[int | None] = []  # the highest step of each attempt
        self.attempt = -1
        self.hang: HangDetector | None = None
        self.metrics = MetricDetector()
        self._cgroup = memory_cgroup()
        self._oom_before = 0

    # -- an attempt ------------------------------------------------------------------------
    def start_attempt(self, attempt: int) -> None:
        """Fresh detectors: a NaN or a stall of the last attempt is not this one's."""
        self.attempt = attempt
        self.progress.append(None)
        self._fresh_detectors()
        self._oom_before = oom_kills(self._cgroup) if self._cgroup else 0
        if self.colltrace is not None:
            self.colltrace.start(attempt)

    def relaunched(self) -> None:
        """The launcher (torchrun) restarted its workers inside this attempt: fresh hang and
        metric detectors and collective analysis for the new ranks (a silence or a ring of
        the dead ones is not theirs), the attempt's progress kept."""
        self._fresh_detectors()
        if self.colltrace is not None:
            self.colltrace.start(self.attempt)

    def _fresh_detectors(self) -> None:
        self.metrics = MetricDetector()
        t = self._hang_template
        self.hang = (
            None
            if t is None
            else HangDetector(
                t.timeout_s,
                k=t.k,
                floor_s=t.floor_s,
                warmup_steps=t.warmup_steps,
                initial_s=t.initial_s,
            )
        )

    def observe(self, beat: Beat) -> Verdict | None:
        """A heartbeat; a verdict whose action needs the command killed now (a NaN), or None."""
        act = None
        for event in self._metrics(beat):
            verdict = self.judge(event)
            if event.kind == "nonfinite" and self.local_action(verdict) != "continue":
                act = verdict
        return act

    def metric_events(self, beat: Beat) -> list[Event]:
        """A heartbeat, under a controller: its NaN/Inf and jump events, written to the trace
        and not judged (the controller decides)."""
        events = self._metrics(beat)
        for event in events:
            self._write(event)
        return events

    def _metrics(self, beat: Beat) -> list[Event]:
        if beat.step is not None and (self.progress[-1] is None or beat.step > self.progress[-1]):
            self.progress[-1] = beat.step
        if self.hang is not None:
            self.hang.observe(beat)
        return self.metrics.observe(dataclasses.replace(beat, node=self.node))

    def finish_rank(self, rank: int) -> None:
        """A rank that ended normally or left its training loop is never a hang."""
        if self.hang is not None:
            self.hang.finish(rank)

    def check_hang(self, now: float) -> Event | None:
        """The first rank silent past the threshold (the event is written by :meth:`judge`);
        the collective rings are read here too (at most once per their poll interval)."""
        if self.colltrace is not None:
            self.colltrace.poll(now)
        if self.hang is None:
            return None
        events = self.hang.check(now)
        if not events:
            return None
        return dataclasses.replace(
            events[0], node=self.node, evidence=self._collective(events[0].evidence)
        )

    def _collective(self, evidence: dict[str, Any], *, final: bool = False) -> dict[str, Any]:
        """The evidence with the collective tracer's verdicts of this attempt, when it runs."""
        if self.colltrace is None:
            return evidence
        if final:
            self.colltrace.poll(force=True)
        lines = self.colltrace.lines()
        return {**evidence, "colltrace": lines} if lines else evidence

    def judge_crash(self, exit_code: int, lines: list[str]) -> Verdict:
        """The class of a crash from its exit code and last lines, and what to do."""
        return self.judge(self.crash_event(exit_code, lines))

    def crash_event(self, exit_code: int | None, lines: list[str]) -> Event:
        """The crash as an event (classified), for this node's policy or the controller's."""
        oom = bool(self._cgroup) and oom_kills(self._cgroup) > self._oom_before
        got = classify(exit_code, lines, oom_killed=oom)
        evidence = got.evidence()
        evidence["lines"] = lines[-20:]  # the context a reader needs, not the whole tail
        evidence["matched"] = list(got.lines)
        evidence = self._collective(evidence, final=True)  # a rank killed in a collective
        rank = got.detail.get("rank")  # under torchrun: its root-cause rank
        cls = got.failure_class
        mismatch = (
            next((f for f in self.colltrace.analyzer.findings if f.kind == "mismatch"), None)
            if self.colltrace is not None
            else None
        )
        if mismatch is not None and cls in UNEXPLAINED:  # the tracer saw the cause
            cls, rank = "collective_mismatch", mismatch.ranks[0]
            evidence.update(rule="colltrace_mismatch", classified_as=got.failure_class)
        if rank is None and self.colltrace is not None:  # else the tracer's first named rank
            rank = next((f.ranks[0] for f in self.colltrace.analyzer.findings if f.ranks), None)
        return Event(
            "crash",
            cls,
            node=self.node,
            rank=rank,
            step=self.progress[-1],
            time=time.time(),
            evidence=evidence,
        )

    def rank_crash(self, ends: list[RankEnd]) -> Event | None:
        """The crash event of ranks that just ended abnormally (:mod:`.ranks`), classified
        from what the rank itself left (its exception record, its wait status): the primary
        one of them (a communication error is a consequence: any other failure first), or
        None when there is none. Its time is the moment the death was seen; a rank gone with
        no record and no status is ``killed_by_signal``, marked ``provisional``."""
        events = [self._rank_event(end) for end in ends]
        if not events:
            return None
        return min(events, key=lambda e: (e.failure_class in SECONDARY, e.time))

    def _rank_event(self, end: RankEnd) -> Event:
        record = end.record
        lines = [str(x) for x in record.get("lines") or []]
        thread = record.get("thread_exception") or {}
        if end.how == "vanished":
            got = Classification("killed_by_signal", "vanished", None, None, {"provisional": True})
        else:
            if end.how == "signal":
                code = -int(end.status or 0)
            else:
                code = end.status if end.status not in (None, 0) else 1
            if not lines and end.how == "exit":  # an exit after a thread's exception
                lines = [str(x) for x in thread.get("lines") or []]
            oom = bool(self._cgroup) and oom_kills(self._cgroup) > self._oom_before
            got = classify(code, lines, oom_killed=oom)
        evidence = {
            **got.evidence(),
            "lines": lines[-20:],
            "matched": list(got.lines),
            "detected_by": f"rank_{end.how}",
            "pid": end.pid,
        }
        if record.get("exception"):
            evidence["exception"] = record["exception"]
            evidence["raised_at"] = record.get("time")  # the rank's clock; seen at ``time``
        return Event(
            "crash",
            got.failure_class,
            node=self.node,
            rank=end.rank,
            step=self.progress[-1] if self.progress else None,
            time=end.time,
            evidence=evidence,
        )

    def refine(self, early: Event, exit_code: int | None, lines: list[str]) -> Event | None:
        """``early`` (a rank's death, seen at once) refined by the launcher's own account
        (its exit status and last lines, seconds later), or None when that adds nothing.
        The detection time stays the first; a communication error never replaces a
        primary failure; a provisional class gives way to anything the launcher names; a
        rank killed by a signal gives way to what made it abort (:data:`SIGNAL_CAUSES`:
        gloo's abort on a mismatched collective is a SIGABRT)."""
        later = self.crash_event(exit_code, lines)
        provisional = bool(early.evidence.get("provisional"))
        signalled = early.failure_class == "killed_by_signal" and not provisional
        if not (provisional or signalled or early.failure_class in SECONDARY):
            return None  # the rank's own record is the better witness
        if later.failure_class == "unknown" or later.failure_class in SECONDARY:
            return None
        if signalled and later.failure_class not in SIGNAL_CAUSES:
            return None  # its own wait status said as much
        evidence = {
            **later.evidence,
            "detected_by": early.evidence.get("detected_by"),
            "refines": early.failure_class,
            "pid": early.evidence.get("pid"),
        }
        rank = early.rank if provisional or signalled else later.rank
        return dataclasses.replace(
            later, rank=rank if rank is not None else early.rank, time=early.time, evidence=evidence
        )

    # -- decisions -------------------------------------------------------------------------
    def judge(self, event: Event, *, written: bool = False) -> Verdict:
        """The policy's verdict on ``event``; both written to the trace (the event unless
        ``written`` already) and said in a line."""
        progress = self.progress if any(p is not None for p in self.progress) else ()
        verdict = decide(
            event, history=self.verdicts, progress=progress, max_no_progress=self.max_no_progress
        )
        local = self.local_action(verdict)
        verdict = dataclasses.replace(
            verdict, evidence={**verdict.evidence, "local": local, "attempt": self.attempt}
        )
        self.verdicts.append(verdict)
        if not written:
            self._write(event)
        self._write(verdict)
        where = f" rank {event.rank}" if event.rank is not None else ""
        at = f" at step {event.step}" if event.step is not None else ""
        detail = _detail(event)
        self.log(
            f"verdict: {event.kind} {event.failure_class}{detail}{where}{at} (attempt "
            f"{self.attempt}) -> {verdict.action}"
            + (f" (here: {local})" if local != verdict.action else "")
            + f": {verdict.reason}"
        )
        return verdict

    @staticmethod
    def local_action(verdict: Verdict) -> str:
        return LOCAL_ACTIONS.get(verdict.action, "restart")

    def write(self, record: Event | Verdict) -> None:
        """A record into the node's trace (a failed write is said, never raised)."""
        self._write(record)

    def _write(self, record: Event | Verdict) -> None:
        if self.trace is None:
            return
        try:
            write_record(self.trace.path, record)
        except OSError as exc:  # a full trace disk must not cost the job
            self.log(f"warning: cannot write the trace {self.trace.path}: {exc}")


def _detail(event: Event) -> str:
    ev: dict[str, Any] = event.evidence
    if ev.get("exception"):
        return f" ({ev['exception']})"
    if ev.get("signal"):
        return f" ({ev['signal']})"
    if event.kind == "nonfinite":
        return " (" + ", ".join(f"{k}={v}" for k, v in sorted(ev.items())) + ")"
    if event.kind == "spike":
        return f" ({ev.get('metric')} {ev.get('value')} vs median {ev.get('median')})"
    return ""
