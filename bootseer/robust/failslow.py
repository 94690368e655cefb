"""Fail-slow rounds across nodes: which rank, node or parallel group slows the whole job.

Every round (the controller runs one every 10 s) gets each rank's step time from the nodes'
heartbeats and, where the nodes answered it, a stack sample of every rank. A rank is flagged
in a round when

* its step time is at least ``factor`` (1.5) x the median across ranks, or its node's (the
  median of its ranks) is at least ``factor`` x the median across nodes: a rank that runs on
  its own clock (an asynchronous job, a data or checkpoint process) shows up here; or
* its trainer is outside every collective while other ranks wait inside one, and it is not
  the majority: in a synchronous job every rank has the same step time (everyone waits for the
  slowest in the all-reduce), so the step time cannot name the straggler, but the stacks can,
  as in ByteRobust's fail-slow aggregation. Only while the job is slow: its step time (the
  median across ranks) at least ``factor`` x its own median over the last ``baseline``
  (12) rounds at its usual pace (slow rounds are not added; until 3 rounds are in, never:
  a straggler from the job's first step on is found by step times only). One sample per round finds a healthy rank
  outside the collective now and then (saving its checkpoint, arriving last): the 20-minute
  soak with every-step memory saves flagged 2 to 4 healthy ranks a round and evicted a node
  at steady step times.

A rank flagged in ``rounds`` (3) of the last ``window`` (5) rounds is slow (not necessarily in
a row: one stack sample per round catches a straggler outside the collective most of the time,
not every time). Once one is, the group flagged most over
the last ``window`` (5) rounds is named: the ranks flagged in the most rounds, mapped onto the
job's parallel layout (the smallest group holding them all, as :mod:`.stacks` does for hangs)
or, without a layout, onto their nodes. The verdict evicts that group's nodes.

Pure and serializable: fed numbers and stacks, never reading a clock; :meth:`to_doc` and
:meth:`from_doc` let a restarted controller carry on from the store.

Usage::

    rounds = FailSlowRounds(layout={"dp": [[0, 1], [2, 3]]})
    event = rounds.round({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, now, nodes={0: "n0", ...},
                         samples=[ProcessStacks.from_text(text, rank=3, node="n1")])
    event  # None, or Event("fail_slow", ..., evidence={"group", "group_ranks", ...})
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .events import Event
from .stacks import ProcessStacks, _domain

__all__ = ["COLLECTIVE_FILE", "FailSlowRounds", "outside_collectives"]

#: a frame inside torch's collectives (a rank waiting there waits for the others)
COLLECTIVE_FILE = "torch/distributed/distributed_c10d.py"


def outside_collectives(samples: Iterable[ProcessStacks]) -> tuple[set[int], set[int]]:
    """(ranks whose trainer is outside every collective, ranks waiting inside one)."""
    inside, outside = set(), set()
    for p in samples:
        if p.role != "main" or not p.threads:
            continue
        waiting = any(COLLECTIVE_FILE in f for thread in p.threads for f in thread)
        (inside if waiting else outside).add(p.rank)
    return outside - inside, inside


def _slow_members(times: Mapping[Any, float], factor: float) -> set[Any]:
    if len(times) < 2:
        return set()
    median = statistics.median(times.values())
    return {m for m, t in times.items() if median > 0 and t >= factor * median}


class FailSlowRounds:
    """The rounds of one job, from one incident to the next (see the module docstring)."""

    def __init__(
        self,
        *,
        factor: float = 1.5,
        rounds: int = 3,
        window: int = 5,
        layout: Mapping[str, Sequence[Sequence[int]]] | None = None,
        baseline: int = 12,
    ) -> None:
        if rounds < 1 or window < rounds:
            raise ValueError(
                f"fail-slow rounds={rounds}, window={window}: need 1 <= rounds <= window"
            )
        self.factor, self.rounds, self.window, self.layout = factor, rounds, window, layout
        self.count = 0
        self.history: list[dict[str, list[str]]] = []  # per round: rank -> why flagged
        self.runs: dict[int, int] = {}
        self.nodes: dict[int, str] = {}
        self.baseline = baseline
        self.job_times: list[float] = []  # the job's step time (median over ranks) per round

    # -- state in the store ------------------------------------------------------------------
    def to_doc(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "history": self.history,
            "runs": {str(r): n for r, n in self.runs.items()},
            "nodes": {str(r): n for r, n in self.nodes.items()},
            "job_times": self.job_times,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], **kwargs: Any) -> FailSlowRounds:
        rounds = cls(**kwargs)
        rounds.count = int(doc.get("count", 0))
        rounds.history = [dict(h) for h in doc.get("history", [])][-rounds.window :]
        rounds.runs = {int(r): int(n) for r, n in doc.get("runs", {}).items()}
        rounds.nodes = {int(r): str(n) for r, n in doc.get("nodes", {}).items()}
        rounds.job_times = [float(t) for t in doc.get("job_times", [])][-rounds.baseline :]
        return rounds

    # -- one round ---------------------------------------------------------------------------
    def slowed(self, step_times: Mapping[int, float]) -> bool:
        """Whether the job steps at least ``factor`` x slower than its own recent median
        (False until 3 rounds are known: a restart's first rounds, busy with imports, are no
        pace to judge by)."""
        if len(self.job_times) < 3 or not step_times:
            return False
        return statistics.median(step_times.values()) >= self.factor * statistics.median(
            self.job_times
        )

    def flags(
        self,
        step_times: Mapping[int, float],
        nodes: Mapping[int, str],
        samples: Sequence[ProcessStacks] = (),
        *,
        stacks: bool = True,
    ) -> dict[int, list[str]]:
        """This round's flagged ranks, each with the signals that flagged it (``stacks``:
        whether a rank outside the collective counts, i.e. the job is slow)."""
        why: dict[int, list[str]] = defaultdict(list)
        for rank in sorted(_slow_members(step_times, self.factor)):
            why[rank].append("step_time")
        by_node: dict[str, list[float]] = defaultdict(list)
        for rank, seconds in step_times.items():
            if rank in nodes:
                by_node[nodes[rank]].append(seconds)
        node_times = {n: statistics.median(v) for n, v in by_node.items()}
        for node in _slow_members(node_times, self.factor):
            for rank in sorted(r for r, n in nodes.items() if n == node and r in step_times):
                why[rank].append("node_step_time")
        outside, inside = outside_collectives(samples) if stacks else (set(), set())
        if outside and inside and len(outside) <= len(inside):
            for rank in sorted(outside):
                why[rank].append("outside_collective")
        return dict(why)

    def round(
        self,
        step_times: Mapping[int, float],
        now: float,
        *,
        nodes: Mapping[int, str] | None = None,
        samples: Sequence[ProcessStacks] = (),
    ) -> Event | None:
        """One round; a ``fail_slow`` event naming the group once a rank is slow."""
        nodes = dict(nodes or {})
        self.nodes.update(nodes)
        self.nodes.update({p.rank: p.node for p in samples if p.node})
        slowed = self.slowed(step_times)
        flagged = self.flags(step_times, self.nodes, samples, stacks=slowed)
        if step_times and (len(self.job_times) < 3 or not slowed):  # a slowdown is not the
            # baseline: it stays the job's pace before it (a lasting one keeps the stacks on)
            self.job_times = [*self.job_times, statistics.median(step_times.values())][
                -self.baseline :
            ]
        self.count += 1
        self.history = [*self.history, {str(r): w for r, w in flagged.items()}][-self.window :]
        self.runs = {r: self.runs.get(r, 0) + 1 for r in flagged}  # in a row, for the record
        # flagged in `rounds` of the last `window` rounds, not necessarily in a row: a stack
        # sample catches a straggler outside the collective most of the time, not every time
        # (the soak's slowed rank was flagged in rounds 21, 23, 24 and 26, never 3 in a row)
        seen: dict[int, int] = defaultdict(int)
        for past in self.history:
            for rank in past:
                seen[int(rank)] += 1
        slow = sorted(r for r, n in seen.items() if n >= self.rounds)
        if not slow or len(self.history) < self.window:
            return None
        return self._named(slow, now, step_times)

    def _named(self, slow: list[int], now: float, step_times: Mapping[int, float]) -> Event:
        counts: dict[int, int] = defaultdict(int)
        for flagged in self.history:
            for rank in flagged:
                counts[int(rank)] += 1
        top = max(counts.values())
        most = {r for r, n in counts.items() if n == top}
        if self.layout:
            group, ranks = _domain(most, self.layout)
        else:
            group_nodes = sorted({self.nodes[r] for r in most if r in self.nodes})
            group = "node " + ", ".join(group_nodes) if group_nodes else None
            ranks = tuple(sorted(r for r, n in self.nodes.items() if n in group_nodes)) or tuple(
                sorted(most)
            )
        group_nodes = sorted({self.nodes[r] for r in ranks if r in self.nodes})
        first = min(most)
        return Event(
            "fail_slow",
            "fail_slow",
            node=group_nodes[0] if len(group_nodes) == 1 else None,
            rank=first if len(most) == 1 else None,
            time=now,
            evidence={
                "rule": f"flagged in {self.rounds} of the last {self.window} "
                "rounds; the most flagged over them",
                "slow_ranks": slow,
                "most_flagged": sorted(most),
                "rounds_flagged": {str(r): n for r, n in sorted(counts.items())},
                "group": group,
                "group_ranks": list(ranks),
                "group_nodes": group_nodes,
                "rounds": self.history,
                "step_times_s": {str(r): round(t, 4) for r, t in sorted(step_times.items())},
                "factor": self.factor,
            },
        )
