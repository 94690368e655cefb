"""The seams of ``bootseer run``'s supervisor: what it uses of the agent, of the controller's
link and of the node's versions, and what its pieces (:mod:`.dumps`, :mod:`.dialogue`,
:mod:`.hangs`, :mod:`.incident`) use of the command's processes, as ``typing.Protocol``s.

Why protocols: the supervisor takes these objects as arguments and uses a few methods of
each; naming exactly those methods tells a reader what it depends on, lets mypy check every
call through them, and lets the pieces be built and read without the supervisor
(``bootseer.supervise`` is above this package: nothing here imports it). The real classes
(:class:`.agent.Agent`, :class:`.remote.ControllerLink`, :class:`.update.NodeVersions`,
:class:`bootseer.command.Processes`) are checked against them by mypy (:func:`_fits`, and
the supervisor's calls).

:class:`AttemptEnd`, how an attempt ended, is here too: the pieces return it, and
``bootseer.supervise`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..process import signal_name

if TYPE_CHECKING:
    from .detect import Beat
    from .events import Event, Verdict
    from .ranks import RankEnd
    from .update import Pin, Version

__all__ = ["AgentSeam", "AttemptEnd", "Processes", "Record", "RemoteSeam", "VersionsSeam"]


@dataclass
class AttemptEnd:
    """How an attempt ended: ``reason`` is exited, signaled, hang, nonfinite (a NaN/Inf
    heartbeat), stopped (a stop signal came), update (stopped for a version update),
    crashed (killed: it still ran long after one of its ranks died), check-failed (a check
    beside the command failed: the environment's files) or not-started (the command could
    not be executed)."""

    attempt: int
    code: int
    reason: str
    pid: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.reason == "hang":
            return "a hang"
        if self.reason == "nonfinite":
            return "a NaN/Inf"
        if self.reason == "update":
            return "a restart for a version update"
        if self.reason == "crashed":
            return "a rank's crash (the command killed after it)"
        if self.code > 128 and self.reason in ("signaled", "stopped"):
            return f"signal {signal_name(self.code - 128)}"
        return f"exit code {self.code}"


class AgentSeam(Protocol):
    """The node's agent (:class:`.agent.Agent`): detectors, classification, verdicts, the
    trace's records."""

    def start_attempt(self, attempt: int) -> None: ...
    def relaunched(self) -> None: ...
    def observe(self, beat: Beat) -> Verdict | None: ...
    def metric_events(self, beat: Beat) -> list[Event]: ...
    def finish_rank(self, rank: int) -> None: ...
    def check_hang(self, now: float) -> Event | None: ...
    def judge_crash(self, exit_code: int, lines: list[str]) -> Verdict: ...
    def crash_event(self, exit_code: int | None, lines: list[str]) -> Event: ...
    def rank_crash(self, ends: list[RankEnd]) -> Event | None: ...
    def refine(self, early: Event, exit_code: int | None, lines: list[str]) -> Event | None: ...
    def judge(self, event: Event, *, written: bool = False) -> Verdict: ...
    def local_action(self, verdict: Verdict) -> str: ...
    def write(self, record: Event | Verdict) -> None: ...


class RemoteSeam(Protocol):
    """The node's link to the job's controller (:class:`.remote.ControllerLink`)."""

    answered: int  # the newest incident this node dumped for: the epoch
    store: Any  # the controller's c10d store (torch's rendezvous state is read from it)
    poll_s: float
    dump_tool: Callable[[int], str]  # pid -> its stacks
    native_tool: Callable[[int], str]  # pid -> its stacks with native frames

    def publish(self, event: Event) -> int: ...
    def beat(self, attempt: int, ranks: Mapping[int, Mapping[str, Any]]) -> None: ...
    def dump_order(self, *, force: bool = False) -> dict[str, Any] | None: ...
    def answer(
        self, incident: int, processes: list[dict[str, Any]], files: list[str] = ...
    ) -> None: ...
    def answer_native(self, incident: int, processes: list[dict[str, Any]]) -> None: ...
    def wait_verdict(
        self,
        incident: int,
        timeout_s: float,
        pause: Callable[[float], bool] | None = None,
        stop: Callable[[], None] | None = None,
    ) -> Verdict | None: ...
    def local_action(self, verdict: Verdict) -> str: ...
    def prepare_check(self) -> None: ...
    def close(self) -> None: ...


class VersionsSeam(Protocol):
    """The node's side of code versions (:class:`.update.NodeVersions`)."""

    def resolve(self, epoch: int) -> tuple[Version, Pin]: ...


class Processes(Protocol):
    """The supervised command's processes (:class:`bootseer.command.Processes`): the waits
    that answer signals, the signals to its groups, its kill."""

    @property
    def status(self) -> int | None:
        """The command's wait status once reaped, else None."""

    @property
    def stopping(self) -> int | None:
        """The stop signal that came (the job ends after this attempt), else None."""

    def reap(self) -> bool: ...
    def pause(self, timeout: float) -> bool: ...
    def signal_group(self, pid: int, sig: int) -> None: ...
    def wait_child(self, timeout: float) -> bool: ...
    def kill(self, pid: int) -> int: ...
    def kill_processes(self, pid: int, ranks: Mapping[int, int]) -> None: ...


class Record(Protocol):
    """A span of the node's trace (``Supervisor._record``: never raises)."""

    def __call__(
        self,
        phase: str,
        start: float,
        end: float | None = None,
        *,
        rank: int | None = None,
        attempt: int = 0,
        outcome: str = "ok",
        **detail: Any,
    ) -> None: ...


if TYPE_CHECKING:  # mypy checks here that the real classes fit their seams
    from .agent import Agent
    from .remote import ControllerLink
    from .update import NodeVersions

    def _fits(
        agent: Agent, remote: ControllerLink, versions: NodeVersions
    ) -> tuple[AgentSeam, RemoteSeam, VersionsSeam]:
        return agent, remote, versions
