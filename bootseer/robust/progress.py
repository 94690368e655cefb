"""The ranks' progress as the control directory shows it: ``ready-<rank>`` and
``heartbeat-<rank>`` files (written by :func:`bootseer.ready` and :func:`bootseer.heartbeat`)
and the ready file, scanned by ``bootseer run``'s watch loop for the first steps, the newest
heartbeat of each rank, and the time of the last change (a silence past the threshold is a
hang).

Cut out of ``bootseer.supervise`` (docs/decisions.md, "supervise: cut at its seams"): a
reader of the control directory needs none of the supervisor's state.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .events import Event

__all__ = ["Progress"]


class Progress:
    """Changes of the control directory's ready/heartbeat files (and of the ready file)."""

    def __init__(self, control_dir: Path | None, ready_file: Path | None) -> None:
        self.control_dir = control_dir
        self.ready_file = ready_file
        self.seen: dict[str, tuple[int, int, int]] = {}
        self.ready_ranks: set[int] = set()
        self.last_change: float | None = None  # monotonic
        self.last_step: int | None = None
        self.ranks: dict[int, dict[str, Any]] = {}  # the newest heartbeat of each rank
        self.finishing: set[int] = set()  # ranks that left their loop (client.finishing)
        self._beats: list[dict[str, Any]] = []
        self.began = time.monotonic()  # this launch of the ranks (the command's, or the
        self.began_wall = time.time()  # launcher's restart of them)
        self.generation = 0  # the launcher's restarts of its ranks in this attempt
        self.not_before = 0.0  # files written before this wall time are a dead launch's

    def relaunched(self, since: float, began: float) -> None:
        """The launcher started new ranks: their progress starts from nothing (the start
        allowance, their own first steps). ``since``: the death (wall clock); every file is
        read again, and counts only when written after it (a new rank may have written its
        ready before its launch was known)."""
        self.seen.clear()
        self.not_before = since
        self.ready_ranks.clear()
        self.last_change = None
        self.last_step = None
        self.ranks.clear()
        self.finishing.clear()
        self._beats.clear()
        self.began = time.monotonic() - max(0.0, time.time() - began)
        self.began_wall = began
        self.generation += 1

    def all_finishing(self) -> bool:
        """Every rank that beat said it left its training loop: the silence of its final
        save and teardown is not a hang."""
        return bool(self.ranks) and set(self.ranks) <= self.finishing

    def hang_event(self, node: str, silent: float, detected: float, threshold_s: float) -> Event:
        """The hang event of the control directory's silence (a ready-only command)."""
        from .events import Event

        return Event(
            "hang",
            "hang",
            node=node,
            step=self.last_step,
            time=detected,
            evidence={
                "silent_s": round(silent, 3),
                "last_step": self.last_step,
                "threshold_s": threshold_s,
                "threshold_from": "configured",
            },
        )

    def take_beats(self) -> list[dict[str, Any]]:
        """Heartbeat documents that changed since the last call (with their rank)."""
        beats, self._beats = self._beats, []
        return beats

    def scan(self) -> list[tuple[int, float]]:
        """New ready signals since the last scan: (rank, time)."""
        entries: list[tuple[str, str]] = []
        if self.control_dir is not None:
            try:
                with os.scandir(self.control_dir) as it:
                    entries = [
                        (e.name, e.path) for e in it if e.name.startswith(("ready-", "heartbeat-"))
                    ]
            except OSError:
                pass
        if self.ready_file is not None:
            entries.append(("ready", str(self.ready_file)))
        new_ready: list[tuple[int, float]] = []
        for name, path in entries:
            try:
                st = os.stat(path)
            except OSError:
                continue
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            if self.seen.get(path) == sig:
                continue
            self.seen[path] = sig
            doc = _read_json(path)
            when = doc.get("time")
            if isinstance(when, int | float) and when < self.not_before:
                continue  # a dead launch's rank wrote it (seen again after a relaunch)
            self.last_change = time.monotonic()
            kind, _, rank_text = name.partition("-")
            try:
                rank = int(rank_text) if rank_text else int(doc.get("rank", 0))
            except (TypeError, ValueError):
                rank = 0
            if kind == "heartbeat":
                step = doc.get("step")
                if isinstance(step, int):
                    self.last_step = step
                if "time" in doc:
                    self._beats.append({**doc, "rank": rank})
                    self.ranks[rank] = doc
                if doc.get("finishing") is True:
                    self.finishing.add(rank)
            elif rank not in self.ready_ranks:
                self.ready_ranks.add(rank)
                when = doc.get("time")
                new_ready.append(
                    (rank, float(when) if isinstance(when, int | float) else st.st_mtime)
                )
        return new_ready


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read() or "{}")
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}
