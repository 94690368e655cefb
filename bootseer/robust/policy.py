"""What to do about a failure: a fixed table from failure class to action, and the list of
evicted nodes.

The table (:data:`TABLE`, shown in docs/robust.md) is data: one row per class, an action, the
action instead when a code or environment update came shortly before (``on_update``: the
update is the likely cause, so roll it back), and an escalation when the same class came
back on the same node (``escalate``: ``(times, action)``). Around the table, two rules:

* ``replace_and_restart`` needs someone to replace: with no suspect node it becomes
  ``restart_in_place``;
* no progress across ``max_no_progress`` restarts (none of the last attempts got past the
  step reached before them) stops the job, whatever the class: restarts that change nothing
  only burn time.

Usage::

    from bootseer.robust.policy import ExclusionList, decide

    verdict = decide(event, suspect_nodes=("node-3",), progress=[1200, 1350])
    if verdict.action == "replace_and_restart":
        ExclusionList("/var/lib/bootseer/excluded.json").add(verdict.nodes, verdict.reason)
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from time import time as _now
from typing import Any

from striped_fs import open_append

from .events import Event, Verdict

__all__ = ["ACTIONS", "TABLE", "ActionRule", "ExclusionList", "decide"]

ACTIONS = ("replace_and_restart", "restart_in_place", "rollback", "stop", "continue")


@dataclass(frozen=True)
class ActionRule:
    """One row of the action table."""

    failure_class: str
    action: str
    why: str
    on_update: str | None = None
    escalate: tuple[int, str] | None = None


TABLE: tuple[ActionRule, ...] = (
    ActionRule(
        "user_error",
        "stop",
        "deterministic: the same code fails the same way",
        on_update="rollback",
    ),
    ActionRule("cuda_error", "replace_and_restart", "a GPU or driver fault stays with the node"),
    ActionRule("disk_full", "replace_and_restart", "the node's disk is full"),
    ActionRule(
        "nccl_error",
        "restart_in_place",
        "often a transient network fault",
        escalate=(2, "replace_and_restart"),
    ),
    ActionRule(
        "gloo_error",
        "restart_in_place",
        "a peer died: the cause is elsewhere",
        escalate=(3, "replace_and_restart"),
    ),
    ActionRule(
        "collective_mismatch",
        "stop",
        "ranks called mismatched collectives: a code fault that every restart repeats",
        on_update="rollback",
    ),
    ActionRule(
        "node_lost",
        "replace_and_restart",
        "the node stopped answering (no dump, no "
        "acknowledgement, no heartbeat): its ranks are gone with it",
    ),
    ActionRule(
        "gpu_oom",
        "restart_in_place",
        "fragmentation or a rare batch",
        on_update="rollback",
        escalate=(2, "stop"),
    ),
    ActionRule(
        "cpu_oom",
        "restart_in_place",
        "a leak or a rare batch",
        on_update="rollback",
        escalate=(2, "replace_and_restart"),
    ),
    ActionRule(
        "storage_error",
        "restart_in_place",
        "the store is shared: a new node would not help; restart with backoff",
    ),
    ActionRule(
        "killed_by_signal",
        "restart_in_place",
        "killed from outside (preemption, an operator)",
        escalate=(3, "replace_and_restart"),
    ),
    ActionRule(
        "python_exception",
        "restart_in_place",
        "may be transient",
        on_update="rollback",
        escalate=(3, "stop"),
    ),
    ActionRule("hang", "replace_and_restart", "evict the stack outliers' group"),
    ActionRule("fail_slow", "replace_and_restart", "evict the slow node"),
    ActionRule(
        "nonfinite",
        "restart_in_place",
        "resume from the last checkpoint",
        on_update="rollback",
        escalate=(2, "replace_and_restart"),
    ),
    ActionRule("spike", "continue", "recorded; a NaN or a hang follows if it matters"),
    ActionRule(
        "unknown",
        "restart_in_place",
        "nothing known: try once more",
        escalate=(3, "replace_and_restart"),
    ),
)


def _rule(failure_class: str, table: Sequence[ActionRule]) -> ActionRule:
    for row in table:
        if row.failure_class == failure_class:
            return row
    for row in table:
        if row.failure_class == "unknown":
            return row
    raise ValueError(f"no action for class {failure_class!r} and no 'unknown' row")


def _no_progress(progress: Sequence[int | None], n: int) -> bool:
    """The last ``n`` attempts never got past the step reached before them."""
    if n <= 0 or len(progress) <= n:
        return False
    before = max((p for p in progress[:-n] if p is not None), default=None)
    recent = max((p for p in progress[-n:] if p is not None), default=None)
    return recent is None or (before is not None and recent <= before)


def decide(
    event: Event,
    *,
    suspect_nodes: Iterable[str] = (),
    suspect_ranks: Iterable[int] = (),
    recent_update: bool = False,
    history: Sequence[Verdict] = (),
    progress: Sequence[int | None] = (),
    max_no_progress: int = 3,
    table: Sequence[ActionRule] = TABLE,
) -> Verdict:
    """The verdict for ``event``: the table's action, after ``recent_update``, repeats of the
    class on the event's node in ``history``, the suspects, and ``progress`` (the highest
    step of each attempt so far, oldest first)."""
    row = _rule(event.failure_class, table)
    nodes = tuple(sorted(set(suspect_nodes) or ({event.node} if event.node else set())))
    ranks = tuple(sorted(set(suspect_ranks) or ({event.rank} if event.rank is not None else set())))
    evidence: dict[str, Any] = {"event": json.loads(event.to_json()), "rule": row.failure_class}
    action, reason = row.action, row.why
    if recent_update and row.on_update:
        action = row.on_update
        reason = f"{row.why}; a code or environment update came just before: roll it back"
    elif row.escalate:
        times, stronger = row.escalate
        seen = 1 + sum(
            1
            for v in history
            if v.failure_class == event.failure_class
            and (not nodes or set(v.evidence.get("on_nodes", ())) & set(nodes))
        )
        if seen >= times:
            action = stronger
            reason = f"{row.why}; seen {seen} times on {', '.join(nodes) or 'the job'}"
            evidence["repeats"] = seen
    if action == "replace_and_restart" and not nodes:
        action, reason = "restart_in_place", f"{reason}; no suspect node to replace"
    if _no_progress(progress, max_no_progress):
        action = "stop"
        reason = (
            f"no progress across {max_no_progress} restarts (steps reached: "
            f"{', '.join(map(str, progress))}); last failure: {event.failure_class}"
        )
        evidence["progress"] = list(progress)
    evidence["on_nodes"] = list(nodes)  # where it happened, for the next repeat count
    return Verdict(
        action,
        event.failure_class,
        nodes=nodes if action == "replace_and_restart" else (),
        ranks=ranks,
        reason=reason,
        time=event.time,
        evidence=evidence,
    )


class ExclusionList:
    """Evicted nodes, in a JSON file (``{"version": 1, "nodes": {NAME: {"reason", "time"}}}``)
    that every change rewrites atomically (temporary file, fsync, rename, under a lock), so
    a crash leaves the old list or the new one, never half of one. A file that cannot be
    read is refused, never overwritten: fix or remove it (the error names it)."""

    VERSION = 1

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The evicted nodes and why."""
        return self._read()

    def __contains__(self, node: object) -> bool:
        return node in self._read()

    def add(
        self,
        nodes: Iterable[str],
        reason: str,
        *,
        time: float | None = None,
        failure_class: str | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Evicts ``nodes`` (a node already there gets the new reason)."""
        entry = {
            "reason": reason,
            "time": _now() if time is None else time,
            **({"class": failure_class} if failure_class else {}),
        }
        with self._locked():
            current = self._read()
            current.update({n: dict(entry) for n in nodes})
            self._write(current)
            return current

    def remove(self, nodes: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Back in service (a repaired node)."""
        with self._locked():
            current = self._read()
            for n in nodes:
                current.pop(n, None)
            self._write(current)
            return current

    @contextmanager
    def _locked(self):
        # the directory made 0700 or checked, the lock file never opened through a link
        with open_append(
            self.path.parent,
            f".{self.path.name}.lock",
            what="the controller's exclusion list directory",
        ) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            doc = json.loads(text)
            if doc.get("version") != self.VERSION or not isinstance(doc.get("nodes"), dict):
                raise ValueError(f"expected version {self.VERSION} with a 'nodes' object")
            return {str(k): dict(v) for k, v in doc["nodes"].items()}
        except (ValueError, AttributeError, TypeError) as exc:
            raise ValueError(
                f"exclusion list {self.path} is not readable ({exc}); it was "
                "left as it is: fix it or move it away"
            ) from None

    def _write(self, nodes: dict[str, dict[str, Any]]) -> None:
        doc = json.dumps({"version": self.VERSION, "nodes": nodes}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(doc + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def nonfinite_step(verdict: Verdict) -> int | None:
    """The first non-finite step a verdict is about (its event's, or any of its incident's
    events'), or None: the restart after it must not resume from a checkpoint saved from that
    step on by the attempt that hit it (``ckpt/skip.py``)."""
    ev = verdict.evidence
    docs = [ev.get("event"), ev.get("primary"), *(ev.get("events") or [])]
    steps = [
        d["step"]
        for d in docs
        if isinstance(d, dict)
        and d.get("kind") == "nonfinite"
        and isinstance(d.get("step"), int)
        and not isinstance(d.get("step"), bool)
    ]
    return min(steps, default=None)
