"""Detection from heartbeats: hangs, NaN/Inf, loss or grad-norm jumps, and fail-slow ranks
and nodes. Pure: fed :class:`Beat` records and the time, never reading a clock or sleeping,
so a controller can run them on live files and a test on constructed ones.

Usage::

    from bootseer.robust.detect import HangDetector, MetricDetector, read_heartbeats

    hangs, metrics = HangDetector(), MetricDetector()
    for beat in read_heartbeats(control_dir, node="node-3"):   # the client's files
        events = metrics.observe(beat) + hangs.observe(beat)   # NaN/Inf, 5x jumps at once
    events += hangs.check(now=time.time())                     # silent ranks

* **Hang**: no step progress from a rank for ``timeout_s`` (configured), or by default for
  ``max(k x median step time, floor_s)`` learned from the step times of all ranks with each
  rank's first ``warmup_steps`` steps left out (compilation, first collectives); before any
  step time is known, ``initial_s``. A rank is reported once per stall.
* **NaN/Inf** in loss or grad norm: at the beat that carries it (the client writes it past
  its rate limit, and keeps ``first_nonfinite`` in later beats for slow readers).
* **Jump**: a finite loss or grad norm above ``factor`` (5) x the median of the rank's last
  ``window`` values, once ``min_history`` are known.
* **Fail-slow**: per round (a controller runs one every 10 s), a rank whose step time is at
  least 1.5x the median across ranks, for 3 consecutive rounds; the same for a node (its
  ranks' median against the median across nodes).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .events import Event, metric

__all__ = ["Beat", "FailSlowDetector", "HangDetector", "MetricDetector", "read_heartbeats"]


@dataclass(frozen=True)
class Beat:
    """One heartbeat of a rank (the client's ``heartbeat-<rank>`` JSON)."""

    rank: int
    step: int | None
    time: float
    loss: float | None = None
    grad_norm: float | None = None
    node: str | None = None
    first_nonfinite: dict[str, Any] | None = None
    finishing: bool = False  # the rank left its training loop (``client.finishing()``)

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], node: str | None = None) -> Beat:
        step = doc.get("step")
        first = doc.get("first_nonfinite")
        return cls(
            rank=int(doc.get("rank", 0)),
            step=step if isinstance(step, int) else None,
            time=float(doc["time"]),
            loss=metric(doc.get("loss")),
            grad_norm=metric(doc.get("grad_norm")),
            node=node,
            first_nonfinite=dict(first) if isinstance(first, dict) else None,
            finishing=doc.get("finishing") is True,
        )


def read_heartbeats(control_dir: str | os.PathLike, node: str | None = None) -> list[Beat]:
    """The current heartbeat of every rank in a control directory (unreadable or half
    files are skipped: the client replaces them atomically, so a retry sees a whole one)."""
    beats = []
    with os.scandir(control_dir) as entries:
        for entry in entries:
            if not entry.name.startswith("heartbeat-"):
                continue
            try:
                with open(entry.path, encoding="utf-8") as f:
                    beats.append(Beat.from_doc(json.load(f), node))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return sorted(beats, key=lambda b: b.rank)


@dataclass
class _Rank:
    step: int | None = None
    time: float | None = None  # when the step last changed
    first_step: int | None = None
    reported: bool = False
    node: str | None = None
    finished: bool = False  # said it is finishing, or its process ended normally


class HangDetector:
    """No progress from a rank for the threshold (see the module docstring)."""

    def __init__(
        self,
        timeout_s: float | None = None,
        *,
        k: float = 5.0,
        floor_s: float = 30.0,
        warmup_steps: int = 2,
        initial_s: float = 600.0,
        window: int = 200,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(
                f"hang timeout_s must be positive (got {timeout_s}); "
                "leave it unset to learn it from the step times"
            )
        self.timeout_s = timeout_s
        self.k, self.floor_s, self.initial_s = k, floor_s, initial_s
        self.warmup_steps = warmup_steps
        self._ranks: dict[int, _Rank] = defaultdict(_Rank)
        self._step_times: deque[float] = deque(maxlen=window)

    def observe(self, beat: Beat) -> list[Event]:
        """Records progress; a hang is only found by :meth:`check`."""
        r = self._ranks[beat.rank]
        r.node = beat.node or r.node
        if beat.finishing:
            r.finished = True
        if beat.step is None or beat.step == r.step:
            if r.time is None:
                r.time = beat.time  # a first report without a step (ready) starts the clock
            return []
        if r.first_step is None:
            r.first_step = beat.step
        if (
            r.step is not None
            and r.time is not None
            and beat.step > r.step
            and r.step >= r.first_step + self.warmup_steps
        ):
            self._step_times.append((beat.time - r.time) / (beat.step - r.step))
        r.step, r.time, r.reported = beat.step, beat.time, False
        return []

    def finish(self, rank: int) -> None:
        """No hang from this rank any more in this attempt: it left its training loop (its
        teardown and final save may take longer than any step) or its process ended
        normally (the launcher's exit ends the attempt)."""
        self._ranks[rank].finished = True

    def threshold(self) -> tuple[float, str]:
        """Seconds of silence that make a hang, and where the number came from."""
        if self.timeout_s is not None:
            return self.timeout_s, "configured"
        if not self._step_times:
            return self.initial_s, "initial"
        return max(self.k * statistics.median(self._step_times), self.floor_s), "learned"

    def check(self, now: float) -> list[Event]:
        threshold, source = self.threshold()
        events = []
        for rank, r in sorted(self._ranks.items()):
            if r.time is None or r.reported or r.finished or now - r.time < threshold:
                continue
            r.reported = True
            events.append(
                Event(
                    "hang",
                    "hang",
                    node=r.node,
                    rank=rank,
                    step=r.step,
                    time=now,
                    evidence={
                        "silent_s": round(now - r.time, 3),
                        "threshold_s": round(threshold, 3),
                        "threshold_from": source,
                        "last_step": r.step,
                    },
                )
            )
        return events


class MetricDetector:
    """NaN/Inf and ``factor`` x jumps of loss and grad norm, per rank."""

    METRICS = ("loss", "grad_norm")

    def __init__(self, *, factor: float = 5.0, window: int = 20, min_history: int = 5) -> None:
        self.factor, self.min_history = factor, min_history
        self._history: dict[tuple[int, str], deque[float]] = defaultdict(
            lambda: deque(maxlen=window)
        )
        self._last: dict[int, tuple[int | None, float]] = {}
        self._nonfinite_told: set[int] = set()

    def observe(self, beat: Beat) -> list[Event]:
        if self._last.get(beat.rank) == (beat.step, beat.time):
            return []  # the same file read again
        self._last[beat.rank] = (beat.step, beat.time)
        events = []
        values = {m: getattr(beat, m) for m in self.METRICS}
        if beat.rank not in self._nonfinite_told:
            bad = {m: str(v) for m, v in values.items() if v is not None and not math.isfinite(v)}
            first = beat.first_nonfinite or {}
            if bad or first:  # this beat, or an earlier one this reader missed
                self._nonfinite_told.add(beat.rank)
                # the first one wins: a reader that missed it may see a later bad beat (a NaN
                # gradient makes the next step's loss NaN too)
                step = first.get("step", beat.step) if first else beat.step
                shown = {
                    m: first[m]
                    for m in self.METRICS
                    if (v := metric(first.get(m))) is not None and not math.isfinite(v)
                } or bad
                events.append(
                    Event(
                        "nonfinite",
                        "nonfinite",
                        node=beat.node,
                        rank=beat.rank,
                        step=step,
                        time=beat.time,
                        evidence=shown,
                    )
                )
        for name, value in values.items():
            if value is None or not math.isfinite(value):
                continue
            history = self._history[(beat.rank, name)]
            if len(history) >= self.min_history:
                median = statistics.median(history)
                if median > 0 and value >= self.factor * median:
                    events.append(
                        Event(
                            "spike",
                            "spike",
                            node=beat.node,
                            rank=beat.rank,
                            step=beat.step,
                            time=beat.time,
                            evidence={
                                "metric": name,
                                "value": value,
                                "median": median,
                                "factor": self.factor,
                            },
                        )
                    )
            history.append(value)
        return events


@dataclass
class FailSlowDetector:
    """Ranks (and nodes) at ``factor`` x the median step time for ``rounds`` rounds in a row."""

    factor: float = 1.5
    rounds: int = 3
    _rank_runs: dict[int, int] = field(default_factory=dict)
    _node_runs: dict[str, int] = field(default_factory=dict)

    def round(
        self, step_times: Mapping[int, float], now: float, nodes: Mapping[int, str] | None = None
    ) -> list[Event]:
        """One round: each rank's current step time (seconds), and which node holds it."""
        nodes = nodes or {}
        events = [
            Event(
                "fail_slow",
                "fail_slow",
                node=nodes.get(rank),
                rank=rank,
                time=now,
                evidence=evidence,
            )
            for rank, evidence in _flag(step_times, self.factor, self.rounds, self._rank_runs)
        ]
        by_node: dict[str, list[float]] = defaultdict(list)
        for rank, seconds in step_times.items():
            if rank in nodes:
                by_node[nodes[rank]].append(seconds)
        if len(by_node) > 1:
            node_times = {n: statistics.median(v) for n, v in by_node.items()}
            events += [
                Event(
                    "fail_slow",
                    "fail_slow",
                    node=node,
                    time=now,
                    evidence={**evidence, "scope": "node"},
                )
                for node, evidence in _flag(node_times, self.factor, self.rounds, self._node_runs)
            ]
        return events


def _flag(
    times: Mapping[Any, float], factor: float, rounds: int, runs: dict[Any, int]
) -> Iterable[tuple[Any, dict[str, Any]]]:
    """Members at ``factor`` x the median this round; those whose run reaches ``rounds``
    (reported once per run)."""
    if len(times) < 2:
        return []
    median = statistics.median(times.values())
    flagged = []
    for member, seconds in sorted(times.items()):
        if median > 0 and seconds >= factor * median:
            runs[member] = runs.get(member, 0) + 1
            if runs[member] == rounds:
                flagged.append(
                    (
                        member,
                        {
                            "step_time_s": seconds,
                            "median_s": median,
                            "ratio": round(seconds / median, 3),
                            "rounds": rounds,
                        },
                    )
                )
        else:
            runs.pop(member, None)
    return flagged
