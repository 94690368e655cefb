"""The incident of an attempt while its launcher runs on: a rank's death seen at once (its
pidfd), or a hang whose ranks were killed. The launcher decides what follows (torchrun may
restart its ranks and wait in the rendezvous for a replacement node), so the incident is
held here until new rank processes end it (a ``relaunch`` span), the launcher's exit refines
its class, or the controller's order takes it with the dumps.

Cut out of ``bootseer.supervise`` (docs/decisions.md, "supervise: cut at its seams"): the
supervisor's watch loop reads :attr:`Incident.event`; the hang handling (:mod:`.hangs`) and
the controller dialogue (:mod:`.dialogue`) begin and refine it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..process import alive, exit_code, since_boot, started_at
from .seams import AgentSeam, Processes, Record, RemoteSeam

if TYPE_CHECKING:
    from ..tee import OutputTail
    from .events import Event
    from .progress import Progress
    from .ranks import RankWatch

__all__ = ["Incident"]


class Incident:
    """``event``: the attempt's incident (None: none open); ``at`` (monotonic), ``wall`` and
    ``boot`` (seconds since boot: rank processes started later are a relaunch) say when its
    first death came. The agent is needed for every incident: only it watches the ranks."""

    def __init__(
        self,
        agent: AgentSeam | None,
        remote: RemoteSeam | None,
        procs: Processes,
        tail: OutputTail | None,
        crash_grace_s: float,
        record: Record,
        log: Callable[[str], None],
    ) -> None:
        self.agent = agent
        self.remote = remote
        self.procs = procs
        self.tail = tail
        self.crash_grace_s = crash_grace_s  # a rank died: the launcher's time to end
        self.record = record
        self.log = log
        self.event: Event | None = None
        self.at = 0.0
        self.wall = 0.0
        self.boot = 0.0
        self._lingering: dict[int, tuple[int, float]] = {}  # pid -> (rank, since): raised,
        # still alive

    def reset(self) -> None:
        """A new attempt: no incident, no rank waited for."""
        self.event = None
        self._lingering.clear()

    def begin(self, event: Event) -> None:
        """``event`` is the attempt's incident from now (a hang, its ranks killed)."""
        self.event = event
        self.at, self.wall = time.monotonic(), time.time()
        self.boot = since_boot()

    def _agent(self) -> AgentSeam:
        assert self.agent is not None, "an incident needs the agent (it watches the ranks)"
        return self.agent

    def rank_ends(self, ranks: RankWatch, attempt: int, pid: int, watch: Progress) -> None:
        """A rank that died while the command runs: the crash event at once (the trace, the
        controller), classified from what the rank left; a primary failure seen after a
        communication error is published too.

        The death is an incident to report, never on its own a reason to end the launcher:
        torchrun may restart its workers (``--max-restarts``) and wait in the rendezvous for
        a replacement node for as long as that node takes to come. The attempt ends when the
        launcher ends it (its exit: its own verdict) or on the controller's verdict. What
        bounds the wait: a rank whose exception is recorded while its process lives on (a
        thread holds it) is killed alone after ``crash_grace_s``, so its launcher sees it
        end; a launcher that neither restarts its ranks nor exits within the start
        allowance is a hang (the supervisor's watch). New rank processes after the death
        mean the launcher restarted them: a ``relaunch`` span, and the detectors start
        afresh."""
        from .classify import SECONDARY

        agent = self._agent()
        ends = ranks.poll()
        event = agent.rank_crash(ends)
        while ranks.ended_normally:
            agent.finish_rank(ranks.ended_normally.pop())
        for end in ends:
            if end.how == "exception" and alive(end.pid):
                self._lingering.setdefault(end.pid, (end.rank, time.monotonic()))
        first = self.event
        if event is not None and (
            first is None
            or (first.failure_class in SECONDARY and event.failure_class not in SECONDARY)
        ):
            if first is None:
                self.begin(event)
            else:
                self.event = event
            agent.write(event)
            what = (
                event.evidence.get("exception")
                or event.evidence.get("signal")
                or ("gone without a record" if event.evidence.get("provisional") else "")
            )
            self.log(
                f"crash: rank {event.rank} (pid {event.evidence.get('pid')}) "
                f"{event.failure_class}"
                + (f" ({what})" if what else "")
                + f" while the command runs (attempt {attempt}); its launcher decides"
            )
            if self.remote is not None:
                self.remote.publish(event)
        self._kill_lingering()
        newcomers, ranks.started = ranks.started, []
        born = [t for _, p, _ in newcomers if (t := started_at(p)) is not None]
        if (early := self.event) is not None and (new := [t for t in born if t > self.boot]):
            # the new ranks' start on the wall clock
            self._relaunched(early, attempt, pid, watch, time.time() - (since_boot() - min(new)))

    def _kill_lingering(self) -> None:
        """A rank that raised but whose process lives on past ``crash_grace_s`` gets SIGKILL,
        alone: its launcher, which sees only processes, then sees it end and decides."""
        now = time.monotonic()
        for rank_pid, (rank, since) in list(self._lingering.items()):
            if not alive(rank_pid):
                del self._lingering[rank_pid]
            elif now - since >= self.crash_grace_s:
                del self._lingering[rank_pid]
                self.log(
                    f"rank {rank} (pid {rank_pid}) raised {self.crash_grace_s:g}s ago and "
                    "its process still runs (a thread keeps it): killing that process, "
                    "so that its launcher sees its end"
                )
                try:
                    os.kill(rank_pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _relaunched(
        self, early: Event, attempt: int, pid: int, watch: Progress, began: float
    ) -> None:
        """The launcher started new ranks after a crash: the incident is over without a
        restart of the command (a ``relaunch`` span from the death to the new ranks, the
        unit of ETTR's accounting inside an attempt); hang and metric detection start afresh,
        with the start allowance, and the new ranks' first steps are recorded."""
        watch.relaunched(self.wall, began)
        self._agent().relaunched()
        now = min(began, time.time())
        self.log(
            f"the launcher restarted its ranks {now - self.wall:.1f}s after rank "
            f"{early.rank}'s crash ({early.failure_class}): recovered without a restart "
            f"of the command (attempt {attempt}, launch {watch.generation})"
        )
        reason = "hang" if early.kind == "hang" else "crash"
        self.record(
            "relaunch",
            self.wall,
            now,
            attempt=attempt,
            reason=reason,
            exited_at=self.wall,
            generation=watch.generation,
            pid=pid,
            failed_rank=early.rank,
            failure_class=early.failure_class,
        )
        self.event = None

    def refine(self) -> None:
        """Under an order: a crash seen at a rank's death with no class of its own (gone
        without a record) waits up to ``crash_grace_s`` for the launcher's summary, so the
        controller gets the refined class with the dumps; a communication error (another
        node's failure, most likely) is refined only if the launcher already ended; a rank
        killed by a signal is refined from the lines so far (a rank that aborted said why
        before it died: gloo's "collective mismatch"), with its own exit code while the
        launcher runs."""
        from .classify import SECONDARY

        early = self.event
        if early is None:
            return
        provisional = bool(early.evidence.get("provisional"))
        signalled = early.failure_class == "killed_by_signal" and not provisional
        if not (provisional or signalled or early.failure_class in SECONDARY):
            return
        ended = self.procs.wait_child(self.crash_grace_s if provisional else 0.0)
        if not ended and not signalled:
            return
        if self.tail is not None and ended:
            self.tail.drain(2.0)
        status = self.procs.status
        code = (
            exit_code(status) if ended and status is not None else early.evidence.get("exit_code")
        )
        lines = self.tail.lines() if self.tail else []
        self.take_refined(self._agent().refine(early, code, lines))

    def take_refined(self, better: Event | None) -> None:
        """The incident's event refined by the launcher's account (same detection time):
        kept, written to the trace and published (None: nothing better)."""
        if better is None:
            return
        self.event = better
        self._agent().write(better)
        if self.remote is not None:
            self.remote.publish(better)
