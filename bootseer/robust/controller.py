"""``bootseer controller``: one per job, on a stable host. It watches the events the nodes'
agents publish in the job's c10d store, and on a crash, a hang, a NaN or a slow node it
localizes before anything is killed: every node is ordered to dump at once, the dumps of all
ranks of all nodes are aggregated (:mod:`.stacks`), and a verdict (:mod:`.policy`) naming the
suspect ranks and the nodes to evict is written to the store, where the agents wait for it
before they stop their processes.

Why stateless: everything it knows is in the store (:mod:`.wire`: the nodes, their event
cursors, the incident in progress, the verdicts), so a controller killed at any point is
replaced by starting another one, which carries on from there. The store itself is the one
piece that must live; :mod:`.store_host` runs it in a process of its own, which outlives a
controller.

Usage::

    store = wire.connect("10.0.0.5:29400")
    ctl = Controller(store, job="job", trace_path="trace/controller.jsonl",
                     exclusion="excluded.json")
    while True:
        verdict = ctl.step()      # None, or the verdict of an incident just localized
        time.sleep(0.25)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import wire
from .events import Event, Verdict, write_record
from .policy import ExclusionList, decide
from .stacks import Localization, ProcessStacks, _domain, localize
from .standby import exclusion_record, publish_exclusions, read_exclusions

__all__ = ["ACTIONABLE", "SECONDARY", "Controller"]

#: event kinds that open an incident (a spike is recorded only; a health event ends a start)
ACTIONABLE = ("crash", "hang", "nonfinite", "fail_slow")
#: crash classes that follow another rank's failure: the root cause is elsewhere
SECONDARY = ("gloo_error", "nccl_error")
HISTORY = 50  # earlier verdicts read back for the repeat rules


def _say(line: str) -> None:
    print(f"bootseer controller: {line}", file=sys.stderr, flush=True)


class Controller:
    """One job's controller over a store client (see the module docstring)."""

    def __init__(self, store: Any, *, job: str = "job", trace_path: str | os.PathLike | None
                 = None, exclusion: str | os.PathLike | None = None,
                 layout: Mapping[str, Sequence[Sequence[int]]] | None = None,
                 dump_wait_s: float = 10.0, settle_s: float = 1.0,
                 log: Callable[[str], None] = _say, clock: Callable[[], float] = time.time
                 ) -> None:
        self.store = store
        self.job = job
        self.keys = wire.Keys(job)
        self.trace_path = Path(trace_path) if trace_path else None
        self.exclusion = ExclusionList(exclusion) if exclusion else None
        self.layout = layout
        self.dump_wait_s = dump_wait_s
        self.settle_s = settle_s
        self.log = log
        self.clock = clock
        self.warnings: list[str] = []
        self._cursors: dict[str, int] = {}  # moved once the events are held (see _flush)

    # -- what the store says -------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Registered nodes, in order of registration (names that are not valid skipped)."""
        raw = wire.get(self.store, self.keys.nodes) or b""
        names: list[str] = []
        for line in raw.decode(errors="replace").splitlines()[:wire.MAX_NODES]:
            if wire.valid_node(line) and line not in names:
                names.append(line)
        return names

    def excluded(self) -> list[str]:
        doc = self._read(self.keys.excluded)
        return [n for n in (doc or {}).get("nodes", []) if wire.valid_node(n)]

    def verdicts(self) -> list[Verdict]:
        """The verdicts written so far (the newest :data:`HISTORY`)."""
        last = self._read(self.keys.verdict_last)
        top = int(last["incident"]) if last else 0
        found = []
        for k in range(max(1, top - HISTORY + 1), top + 1):
            doc = self._read(self.keys.verdict(k))
            if doc is not None:
                found.append(Verdict.from_doc(doc))
        return found

    def _read(self, key: str, node: str | None = None,
              limit: int = wire.MAX_RECORD_BYTES) -> dict[str, Any] | None:
        data = wire.get(self.store, key)
        if data is None:
            return None
        try:
            return wire.decode(data, key=key, node=node, limit=limit)
        except wire.WireError as exc:
            self._warn(str(exc))
            return None

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            self.log(f"warning: {message}")

    def _new_events(self, node: str) -> tuple[list[Event], int]:
        """Events of ``node`` past the controller's cursor, and the new cursor."""
        seen = int(self.store.add(self.keys.seen(node), 0))
        count = int(self.store.add(self.keys.node(node, "events"), 0))
        events = []
        for i in range(seen + 1, count + 1):
            key = self.keys.event(node, i)
            doc = self._read(key, node)
            if doc is None:
                if wire.get(self.store, key) is None:  # counted, not written yet: next pass
                    return events, i - 1
                continue  # refused (warned): skipped for good
            try:
                events.append(Event.from_doc(doc))
            except (KeyError, TypeError, ValueError) as exc:
                self._warn(f"{key}: not an event ({exc})")
        return events, count

    # -- one pass --------------------------------------------------------------------------
    def step(self) -> Verdict | None:
        """Read new events, open an incident or finish the one in progress."""
        excluded = set(self.excluded())
        last = self._read(self.keys.verdict_last)
        closed_at = float(last["time"]) if last else float("-inf")
        fresh: list[Event] = []
        for node in self.nodes():
            events, cursor = self._new_events(node)
            if node in excluded:
                events = []
            for event in events:
                if event.time <= closed_at:  # before the last verdict: that incident's
                    self.log(f"{node}: {event.kind} {event.failure_class} came after the "
                             "verdict of its incident: recorded, no new incident")
                    self._write(dataclasses.replace(event, evidence={
                        **event.evidence, "late": True}))
                    continue
                fresh.append(event)
            self._cursors[node] = cursor
        opened = self._read(self.keys.open)
        if opened is None:
            actionable = [e for e in fresh if e.kind in ACTIONABLE]
            for event in fresh:
                if event.kind not in ACTIONABLE:
                    self._write(event)
            if not actionable:
                self._flush_cursors()
                return None
            opened = self._open(actionable)
        elif fresh:
            opened["events"] += [_doc(e) for e in fresh]
            self.store.set(self.keys.open, wire.encode(opened, wire.MAX_DUMP_BYTES))
        return self._maybe_close(opened, excluded)

    def _flush_cursors(self) -> None:
        """Cursors move only once the events are held by the open incident (or were not
        actionable): a controller killed between the two reads them again."""
        for node, cursor in self._cursors.items():
            now = int(self.store.add(self.keys.seen(node), 0))
            if cursor > now:
                self.store.add(self.keys.seen(node), cursor - now)
        self._cursors = {}

    def _open(self, events: list[Event]) -> dict[str, Any]:
        incident = int(self.store.add(self.keys.incident, 1))
        now = self.clock()
        first = min(events, key=lambda e: e.time)
        reason = f"{first.kind} {first.failure_class} on {first.node}" + (
            f" rank {first.rank}" if first.rank is not None else "")
        opened = {"incident": incident, "time": now, "reason": reason,
                  "events": [_doc(e) for e in events]}
        self.store.set(self.keys.open, wire.encode(opened, wire.MAX_DUMP_BYTES))
        self._flush_cursors()
        self.store.set(self.keys.dump_request, wire.encode(
            {"incident": incident, "time": now, "reason": reason}))
        self.log(f"incident {incident}: {reason}; every node ordered to dump its stacks")
        for event in events:
            self._write(event)
        return opened

    def _maybe_close(self, opened: dict[str, Any], excluded: set[str]) -> Verdict | None:
        self._flush_cursors()
        incident = int(opened["incident"])
        waited = self.clock() - float(opened["time"])
        expected = [n for n in self.nodes() if n not in excluded]
        answers = {n: self._read(self.keys.dump(n, incident), n, wire.MAX_DUMP_BYTES)
                   for n in expected}
        missing = [n for n, a in answers.items() if a is None]
        if waited < self.settle_s or (missing and waited < self.dump_wait_s):
            return None
        if not missing and "answered_at" not in opened:
            # one more pass: an event a node published just before its answer is read first
            opened["answered_at"] = self.clock()
            self.store.set(self.keys.open, wire.encode(opened, wire.MAX_DUMP_BYTES))
            return None
        return self._close(opened, {n: a for n, a in answers.items() if a}, missing)

    # -- the verdict -----------------------------------------------------------------------
    def _close(self, opened: dict[str, Any], answers: dict[str, dict[str, Any]],
               missing: list[str]) -> Verdict:
        incident = int(opened["incident"])
        events = [Event.from_doc(d) for d in opened["events"]]
        processes, dumps = _processes(answers)
        found = _break_tie(localize(processes, self.layout), processes, self.layout)
        primary = min(events, key=lambda e: (_rank_of_cause(e), e.time))
        history = self.verdicts()
        if primary.kind in ("hang", "fail_slow"):  # every rank may look hung: stacks decide
            anonymous = dataclasses.replace(primary, node=None, rank=None)
            verdict = decide(anonymous, suspect_nodes=found.domain_nodes or found.suspect_nodes,
                             suspect_ranks=found.domain_ranks or found.suspects,
                             history=history)
        else:
            verdict = decide(primary, history=history)
        evidence = {**verdict.evidence, "incident": incident, "reason": opened["reason"],
                    "events": opened["events"], "primary": _doc(primary),
                    "localization": {"suspects": list(found.suspects),
                                     "suspect_nodes": list(found.suspect_nodes),
                                     "domain": found.domain, "reason": found.reason,
                                     **found.evidence},
                    "dumps": dumps, "missing_dumps": missing, "controller_pid": os.getpid()}
        verdict = dataclasses.replace(verdict, time=self.clock(), evidence=evidence)
        data = wire.encode(_verdict_doc(verdict), wire.MAX_DUMP_BYTES)
        self.store.set(self.keys.verdict(incident), data)
        if verdict.action == "replace_and_restart" and verdict.nodes:
            self._exclude(verdict)
        self.store.set(self.keys.verdict_last, wire.encode(
            {"incident": incident, "time": verdict.time}))
        self.store.delete_key(self.keys.open)
        self._write(verdict)
        self.log(f"incident {incident}: verdict {verdict.action} ({verdict.failure_class})"
                 + (f" nodes {', '.join(verdict.nodes)}" if verdict.nodes else "")
                 + (f" ranks {', '.join(map(str, verdict.ranks))}" if verdict.ranks else "")
                 + f": {verdict.reason}; {found.reason}")
        return verdict

    def _exclude(self, verdict: Verdict) -> None:
        if self.exclusion is not None:
            self.exclusion.add(verdict.nodes, verdict.reason,
                               failure_class=verdict.failure_class)
            publish_exclusions(self.store, self.exclusion, self.job)
            return
        doc = read_exclusions(self.store, self.job)
        reasons = {**doc.get("reasons", {}), **dict.fromkeys(verdict.nodes, verdict.reason)}
        self.store.set(self.keys.excluded, exclusion_record(
            [*doc["nodes"], *verdict.nodes], reasons=reasons, source=doc.get("list")))

    def publish_exclusions(self) -> list[str]:
        """The exclusion file's nodes into the store, where nodes and standbys read them
        (called when the controller starts: a node evicted earlier stays out)."""
        if self.exclusion is None:
            return self.excluded()
        return publish_exclusions(self.store, self.exclusion, self.job)

    def _write(self, record: Event | Verdict) -> None:
        if self.trace_path is None:
            return
        try:
            write_record(self.trace_path, record)
        except OSError as exc:
            self._warn(f"cannot write the trace {self.trace_path}: {exc}")

    # -- the loop --------------------------------------------------------------------------
    def run(self, stop: threading.Event, interval_s: float = 0.25) -> None:
        """:meth:`step` every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            self.step()
            stop.wait(interval_s)


#: a frame inside torch's collectives (a rank waiting there waits for the others)
_COLLECTIVE_FILE = "torch/distributed/distributed_c10d.py"


def _break_tie(found: Localization, processes: list[ProcessStacks],
               layout: Mapping[str, Sequence[Sequence[int]]] | None) -> Localization:
    """With no dominant stack group (two ranks: 1:1), the trainers outside every collective
    are the suspects when the others all wait inside one: they are who the others wait for.
    Anything else stays without a verdict from stacks."""
    if found.suspects:
        return found
    main = [g for g in found.groups if g.role == "main"]
    inside = [g for g in main if any(_COLLECTIVE_FILE in f for t in g.signature for f in t)]
    outside = [g for g in main if g not in inside]
    if len(main) < 2 or not inside or not outside:
        return found
    waiting = sorted(r for g in inside for r in g.ranks)
    suspects = {r for g in outside for r in g.ranks}
    domain, ranks = _domain(suspects, layout or {})
    node_of = {p.rank: p.node for p in processes if p.node}
    why = (f"no dominant stack group; rank(s) {', '.join(map(str, sorted(suspects)))} outside "
           f"every collective while rank(s) {', '.join(map(str, waiting))} waits inside a "
           "collective")
    return Localization(tuple(sorted(suspects)),
                        tuple(sorted({node_of[r] for r in suspects if r in node_of})),
                        domain if layout else None, ranks,
                        tuple(sorted({node_of[r] for r in ranks if r in node_of})),
                        found.groups, why, found.evidence)


def _rank_of_cause(event: Event) -> int:
    """Which event of an incident is its cause: a crash of its own (0) before a NaN (1),
    before a hang or a slow node (2: others stall when a peer dies), before a collective
    error (3: the peer died first)."""
    if event.failure_class in SECONDARY:
        return 3
    return {"crash": 0, "nonfinite": 1}.get(event.kind, 2)


def _doc(event: Event) -> dict[str, Any]:
    return json.loads(event.to_json())


def _verdict_doc(verdict: Verdict) -> dict[str, Any]:
    return json.loads(verdict.to_json())


def _processes(answers: dict[str, dict[str, Any]]
               ) -> tuple[list[ProcessStacks], dict[str, dict[str, Any]]]:
    """The processes of every node's dump answer (the node is the key's, never the record's
    word), and a summary per node for the evidence."""
    processes: list[ProcessStacks] = []
    summary: dict[str, dict[str, Any]] = {}
    for node, answer in sorted(answers.items()):
        items = answer.get("processes")
        items = items if isinstance(items, list) else []
        sources: set[str] = set()
        ranks: set[int] = set()
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("rank"), int):
                continue
            text = str(item.get("text", ""))[:wire.MAX_STACK_CHARS]
            pid = item.get("pid") if isinstance(item.get("pid"), int) else None
            role = str(item.get("role") or "main")[:32]
            stacks = ProcessStacks.from_text(text, rank=item["rank"], node=node, pid=pid,
                                             role=role)
            if stacks.threads:
                processes.append(stacks)
                sources.add(str(item.get("source", "?"))[:32])
                ranks.add(item["rank"])
        summary[node] = {"processes": len(items), "ranks": sorted(ranks),
                         "sources": sorted(sources), "files": answer.get("files", [])[:64]}
    return processes, summary
