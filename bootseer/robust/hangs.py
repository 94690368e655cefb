"""A hang of ``bootseer run``'s command, handled: the stacks dumped (the controller's order
first, under one), then the hung processes killed. Under a launcher that started the ranks
(torchrun) only the ranks are killed and the launcher decides, as for a crash: the hang is
the attempt's :class:`.incident.Incident` until it restarts them or exits. A launcher that
hangs itself (it neither restarted its ranks nor exited) is killed with its command.

Cut out of ``bootseer.supervise`` (docs/decisions.md, "supervise: cut at its seams"): the
supervisor's watch loop finds the silence (or the agent's detector does) and calls
:meth:`Hangs.handle`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .dialogue import ControllerDialogue
from .dumps import StackDumps
from .incident import Incident
from .seams import AgentSeam, AttemptEnd, Processes, Record

if TYPE_CHECKING:
    from .events import Event
    from .progress import Progress
    from .ranks import RankWatch

__all__ = ["Hangs"]


class Hangs:
    """``timeout_s`` (``hang.timeout_s``) goes into the hang's span and event; ``dialogue``
    is None without a controller (the node acts alone), ``agent`` None without the agent
    (no verdict: the restart policy decides)."""

    def __init__(
        self,
        *,
        node: str,
        timeout_s: float,
        dump_dir: Path | None,
        agent: AgentSeam | None,
        dialogue: ControllerDialogue | None,
        procs: Processes,
        dumps: StackDumps,
        incident: Incident,
        record: Record,
        log: Callable[[str], None],
    ) -> None:
        self.node = node
        self.timeout_s = timeout_s
        self.dump_dir = dump_dir
        self.agent = agent
        self.dialogue = dialogue
        self.procs = procs
        self.dumps = dumps
        self.incident = incident
        self.record = record
        self.log = log

    def handle(
        self,
        attempt: int,
        pid: int,
        watch: Progress,
        silent: float,
        ranks: RankWatch | None,
        event: Event | None = None,
        *,
        launcher: bool = False,
    ) -> AttemptEnd | None:
        """A hang, ``silent`` seconds long: stacks dumped, then the ranks (``ranks``: the
        watched rank processes, None: not watched) or the command killed. None: only the
        ranks were killed, the launcher decides. ``launcher``: the launcher itself hangs."""
        before = (
            "before its first heartbeat"
            if watch.last_change is None
            else (f"after step {watch.last_step}" if watch.last_step is not None else "after ready")
        )
        live = {} if launcher or ranks is None else ranks.live()
        what = (
            (
                f"ranks {', '.join(map(str, sorted(set(live.values()))))} (their launcher "
                "then decides)"
            )
            if live
            else "the command"
        )
        self.log(
            f"hang: no heartbeat for {silent:.1f}s {before}; dumping stacks to "
            f"{self.dump_dir} and killing {what}"
        )
        hang_start = time.time() - silent
        detected = time.time()
        if self.dialogue is not None:  # the controller localizes across nodes first
            event = event or watch.hang_event(self.node, silent, detected, self.timeout_s)
            if end := self.dialogue.hang(event, attempt, pid, watch, hang_start, detected):
                return end
        # a signal to everyone only when everyone is killed next: SIGUSR1 ends a launcher
        sizes = self.dumps.request(pid, everyone=not live)
        grown = self.dumps.wait(sizes)
        dumped = time.time()
        if live:
            self._ranks_killed(
                attempt, pid, watch, live, silent, hang_start, detected, dumped, grown, event
            )
            return None
        code = self.procs.kill(pid)
        self.record(
            "hang",
            hang_start,
            attempt=attempt,
            outcome="killed",
            timeout_s=self.timeout_s,
            silent_s=round(silent, 3),
            last_step=watch.last_step,
            pid=pid,
            stacks=sorted(p.name for p in grown),
            detected_at=detected,
            dumped_at=dumped,
        )
        if grown:
            self.log(f"stacks: {', '.join(str(p) for p in sorted(grown))}")
        else:
            self.log("no stack dump arrived (does the command import bootseer?)")
        detail: dict[str, Any] = {"stacks": sorted(map(str, grown)), "exited_at": time.time()}
        if self.agent is not None:
            event = event or watch.hang_event(self.node, silent, detected, self.timeout_s)
            event = dataclasses.replace(
                event, evidence={**event.evidence, "stacks": sorted(p.name for p in grown)}
            )
            detail["verdict"] = self.agent.judge(event)
        return AttemptEnd(attempt, code, "hang", pid, detail)

    def _ranks_killed(
        self,
        attempt: int,
        pid: int,
        watch: Progress,
        ranks: dict[int, int],
        silent: float,
        hang_start: float,
        detected: float,
        dumped: float,
        grown: set[Path],
        event: Event | None,
    ) -> None:
        """The hung ranks' processes get SIGKILL, the launcher lives: the hang becomes the
        attempt's incident, ended by the launcher's restart of its ranks or by its exit."""
        self.procs.kill_processes(pid, ranks)
        self.record(
            "hang",
            hang_start,
            attempt=attempt,
            outcome="ranks_killed",
            timeout_s=self.timeout_s,
            silent_s=round(silent, 3),
            last_step=watch.last_step,
            pid=pid,
            stacks=sorted(p.name for p in grown),
            detected_at=detected,
            dumped_at=dumped,
            ranks=sorted(set(ranks.values())),
            generation=watch.generation,
        )
        if grown:
            self.log(f"stacks: {', '.join(str(p) for p in sorted(grown))}")
        event = event or watch.hang_event(self.node, silent, detected, self.timeout_s)
        event = dataclasses.replace(
            event,
            evidence={**event.evidence, "stacks": sorted(p.name for p in grown), "killed": "ranks"},
        )
        if self.agent is not None:
            self.agent.write(event)
        self.incident.begin(event)
