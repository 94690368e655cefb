"""The node's dialogue with the job's controller inside ``bootseer run``: an incident is
published, the controller's order to dump is followed (every process of this node's ranks,
py-spy, else the client's stack files), the dumps are answered, and the command is killed
only once the verdict came (or ``wait_s`` passed), or when the controller orders the
stop-time checks (they need the node), or at once for a NaN. An update incident stops the
command at its next step instead.

Cut out of ``bootseer.supervise`` (docs/decisions.md, "supervise: cut at its seams"): the
supervisor builds one :class:`ControllerDialogue` when it has a controller link, and its
watch loop, its hang handling (:mod:`.hangs`) and its judgement after an attempt call it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .dumps import NATIVE_GRACE_S, StackDumps
from .incident import Incident
from .seams import AgentSeam, AttemptEnd, Processes, Record, RemoteSeam

if TYPE_CHECKING:
    from .detect import Beat
    from .events import Event, Verdict
    from .progress import Progress

__all__ = ["ControllerDialogue"]


class ControllerDialogue:
    """One node's side of every incident under a controller (``remote``): ``wait_s`` is
    ``controller.wait_s``, each wait for an order or a verdict; ``hang_timeout_s`` goes into
    a hang event of the node's own."""

    def __init__(
        self,
        remote: RemoteSeam,
        agent: AgentSeam,
        *,
        node: str,
        wait_s: float,
        hang_timeout_s: float,
        procs: Processes,
        dumps: StackDumps,
        incident: Incident,
        record: Record,
        log: Callable[[str], None],
    ) -> None:
        self.remote = remote
        self.agent = agent
        self.node = node
        self.wait_s = wait_s
        self.hang_timeout_s = hang_timeout_s
        self.procs = procs
        self.dumps = dumps
        self.incident = incident
        self.record = record
        self.log = log

    def poll(self, attempt: int, pid: int, watch: Progress) -> AttemptEnd | None:
        """A turn of the watch loop: the ranks' newest beats to the controller, and its
        order, when one came, followed."""
        self.remote.beat(attempt, watch.ranks)
        if order := self.remote.dump_order():
            return self.on_order(attempt, pid, watch, order)
        return None

    def wait_order(self) -> dict[str, Any] | None:
        """The controller's order to dump, within ``wait_s``."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            if (order := self.remote.dump_order(force=True)) is not None:
                return order
            if self.procs.pause(self.remote.poll_s):
                return None
        return None

    def hang(
        self, event: Event, attempt: int, pid: int, watch: Progress, since: float, detected: float
    ) -> AttemptEnd | None:
        """A hang, published: the controller localizes across nodes first, and its order is
        followed. None: no order came (or it ended nothing), the node acts alone."""
        self.remote.publish(event)
        self.agent.write(event)
        order = self.wait_order()
        if order is not None and (
            end := self.on_order(
                attempt, pid, watch, order, event=event, since=since, detected=detected
            )
        ):
            return end
        self.log("the controller ordered no dump: the node acts alone")
        return None

    def verdict(self, event: Event, attempt: int, published: bool = False) -> Verdict | None:
        """After a crash: the event to the controller, an empty dump when ordered (nothing
        runs any more), and its verdict (None: no answer in ``wait_s``)."""
        if not published:
            self.remote.publish(event)
            self.agent.write(event)
        order = self.wait_order()
        if order is None:
            self.log("no order from the controller: the node decides alone")
            return None
        self.remote.answer(int(order["incident"]), [])
        verdict = self.remote.wait_verdict(int(order["incident"]), self.wait_s, self.procs.pause)
        if verdict is not None:
            self.note_verdict(verdict, attempt)
        return verdict

    def note_verdict(self, verdict: Verdict, attempt: int) -> None:
        local = self.remote.local_action(verdict)
        verdict = dataclasses.replace(
            verdict,
            evidence={
                "incident": verdict.evidence.get("incident"),
                "local": local,
                "attempt": attempt,
                "from": "controller",
            },
        )
        self.agent.write(verdict)
        evicted = self.node in verdict.nodes and verdict.action == "replace_and_restart"
        self.log(
            f"controller verdict: {verdict.action} ({verdict.failure_class})"
            + (f" ranks {', '.join(map(str, verdict.ranks))}" if verdict.ranks else "")
            + (f" nodes {', '.join(verdict.nodes)}" if verdict.nodes else "")
            + f" -> here: {local}"
            + (" (this node is evicted)" if evicted else "")
        )

    def metrics(self, attempt: int, pid: int, beat: Beat) -> AttemptEnd | None:
        """A NaN/Inf or a jump goes to the controller. A NaN kills the command at once (no
        checkpoint of the damaged state), then the verdict (after the controller's checks)
        decides; a jump is published and the controller's order stops the job."""
        for event in self.agent.metric_events(beat):
            self.remote.publish(event)
            if event.kind != "nonfinite" or self.procs.stopping is not None:
                continue
            self.log(
                f"killing the command at step {beat.step} (attempt {attempt}): "
                f"{event.failure_class}; the controller decides"
            )
            code = self.procs.kill(pid)
            exited = time.time()
            verdict = self.verdict(event, attempt, published=True)
            if verdict is None:
                return AttemptEnd(
                    attempt,
                    code,
                    "nonfinite",
                    pid,
                    {"verdict": self.agent.judge(event), "exited_at": exited},
                )
            return AttemptEnd(
                attempt,
                code,
                "nonfinite",
                pid,
                {"verdict": verdict, "remote": True, "exited_at": exited},
            )
        return None

    def on_order(
        self,
        attempt: int,
        pid: int,
        watch: Progress,
        order: dict[str, Any],
        *,
        event: Event | None = None,
        since: float | None = None,
        detected: float | None = None,
    ) -> AttemptEnd | None:
        """Dump every process of this node's ranks (py-spy; else SIGUSR1 stack files), hand
        them to the controller, wait for its verdict, and only then kill the command."""
        from .remote import dump_ranks

        if order.get("update"):
            return self._on_update(attempt, pid, watch, order)

        incident = int(order["incident"])
        detected = detected or time.time()
        self.log(f"controller: incident {incident} ({order.get('reason')}): dumping stacks")
        rank_pids = {
            r: int(v["pid"]) for r, v in watch.ranks.items() if isinstance(v.get("pid"), int)
        }
        processes, failed = dump_ranks(rank_pids, node=self.node, dump=self.remote.dump_tool)
        if failed or not rank_pids:  # the client's faulthandler files instead
            processes.extend(self.dumps.faulthandler(pid, failed, rank_pids))
        files = self.dumps.keep(processes, incident)
        self.incident.refine()  # before the answer: the controller reads it with the dumps
        self.remote.answer(incident, processes, [p.name for p in files])
        dumped = time.time()
        native = self.dumps.native(
            self.remote,
            incident,
            {
                p["rank"]: p["pid"]
                for p in processes
                if p["role"] == "main" and p["source"] == "py-spy"
            },
        )
        killed_for_check: list[float] = []

        def stop() -> None:  # the stop-time checks need the node: the command goes first
            native.join(NATIVE_GRACE_S)
            self.procs.kill(pid)
            killed_for_check.append(time.time())

        verdict = self.remote.wait_verdict(incident, self.wait_s, self.procs.pause, stop)
        decided = time.time()
        native.join(NATIVE_GRACE_S)
        code = self.procs.kill(pid)
        killed = killed_for_check[0] if killed_for_check else time.time()
        hang = (verdict.failure_class if verdict else (event.kind if event else "")) == "hang"
        self.record(
            "hang" if hang else "controller_stop",
            since or detected,
            attempt=attempt,
            outcome="killed",
            incident=incident,
            last_step=watch.last_step,
            pid=pid,
            stacks=[p.name for p in files],
            detected_at=detected,
            dumped_at=dumped,
            decided_at=decided,
            killed_at=killed,
        )
        detail: dict[str, Any] = {"stacks": [str(p) for p in files], "exited_at": killed}
        if verdict is None:  # no verdict in time: the node's own policy
            self.log(
                f"no verdict for incident {incident} in {self.wait_s:.0f}s: the node decides alone"
            )
            detail["verdict"] = self.agent.judge(
                event
                or watch.hang_event(
                    self.node, time.time() - (since or detected), detected, self.hang_timeout_s
                )
            )
        else:
            self.note_verdict(verdict, attempt)
            detail.update(verdict=verdict, remote=True)
        return AttemptEnd(attempt, code, "hang" if hang else "verdict", pid, detail)

    def _on_update(
        self, attempt: int, pid: int, watch: Progress, order: dict[str, Any]
    ) -> AttemptEnd | None:
        """An update incident: nothing to dump; after its verdict the command is stopped at
        a step boundary (its next heartbeat, at most ``wait_s`` away) and restarted on the
        new version. No verdict: it runs on, on the version it has (never mixed)."""
        incident = int(order["incident"])
        self.log(f"controller: incident {incident}: {order.get('reason')}")
        self.remote.answer(incident, [])
        verdict = self.remote.wait_verdict(incident, self.wait_s, self.procs.pause)
        if verdict is None:
            self.log(f"no verdict for incident {incident}: the command runs on")
            return None
        decided, step = time.time(), watch.last_step
        deadline = time.monotonic() + self.wait_s
        while watch.last_step == step and time.monotonic() < deadline:
            if self.procs.pause(0.05) or self.procs.reap():
                break
            watch.scan()
        code = self.procs.kill(pid)
        killed = time.time()
        self.record(
            "controller_stop",
            decided,
            killed,
            attempt=attempt,
            outcome="killed",
            incident=incident,
            update=order["update"],
            last_step=watch.last_step,
            step_before=step,
            pid=pid,
            decided_at=decided,
            killed_at=killed,
        )
        self.note_verdict(verdict, attempt)
        return AttemptEnd(
            attempt, code, "update", pid, {"verdict": verdict, "remote": True, "exited_at": killed}
        )
