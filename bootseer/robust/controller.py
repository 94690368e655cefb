"""``bootseer controller``: one per job, on a stable host. It watches the events the nodes'
agents publish in the job's c10d store, and on a crash, a hang, a NaN, a loss jump or a slow
node it localizes before anything is killed: every node is ordered to dump at once, the dumps
of all ranks of all nodes are aggregated (:mod:`.stacks`), and a verdict (:mod:`.policy`)
naming the suspect ranks and the nodes to evict is written to the store, where the agents wait
for it before they stop their processes.

Two more duties:

* fail-slow rounds (every ``failslow_interval_s``, 10 s) while no incident is open: each
  rank's step time from the nodes' beats and a stack sample of every trainer go through
  :class:`.failslow.FailSlowRounds`; the group it names opens a ``fail_slow`` incident whose
  verdict evicts that group's nodes;
* stop-time checks after a NaN, a loss jump or an unclear crash (class ``unknown``, or
  killed by a signal while every node answered, so no node was lost): once the dumps are in,
  every node is ordered to stop its command and run ``bootseer check`` with the others
  (:mod:`.check`); a node whose sums are wrong or whose bits differ from the majority is
  named in the verdict with the failing check and evicted; none failing: restart in place.

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

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from striped_fs import open_append

from . import seal, update, wire
from .check import CheckReport, RankResult
from .classify import SECONDARY  # crash classes that follow another rank's failure
from .events import Event, Verdict, write_record
from .failslow import COLLECTIVE_FILE, FailSlowRounds
from .policy import ExclusionList, decide
from .stacks import Localization, ProcessStacks, _domain, localize, native_evidence
from .standby import exclusion_record, publish_exclusions, read_exclusions

__all__ = ["ACTIONABLE", "CHECKED", "SECONDARY", "Controller", "link_suspects"]

#: event kinds that open an incident (a health event ends a start and is recorded only)
ACTIONABLE = ("crash", "hang", "nonfinite", "spike", "fail_slow")
#: crash classes with no cause named: the stop-time checks run (unless a node was lost)
CHECKED = ("unknown", "killed_by_signal")
HISTORY = 50  # earlier verdicts read back for the repeat rules
MAX_FAILED_PASSES = 3  # an incident whose passes raise this often in a row is closed
# a node that has neither acknowledged a dump order nor beaten this long after it is not
# waited for (lost with its agent); one that acknowledged is waited for the whole dump wait
ACK_WAIT_S = 3.0
LINK_CHECK_S = 2.0  # the tracer's windows are looked at this often for a slow link
LINK_WAIT_S = 10.0  # a probe order's answers are awaited this long (a slow link answers last)
LINK_QUIET_S = 30.0  # after probes that named no node, no new order for this long
#: a node whose tracer window is this old while ranks wait on its rank(s) is suspect (its
#: link may carry nothing), and its probe not answered this long after the order names it
LINK_STALE_S = 5.0


def _say(line: str) -> None:
    print(f"bootseer controller: {line}", file=sys.stderr, flush=True)


class Controller:
    """One job's controller over a store client (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        *,
        job: str = "job",
        trace_path: str | os.PathLike | None = None,
        exclusion: str | os.PathLike | None = None,
        layout: Mapping[str, Sequence[Sequence[int]]] | None = None,
        dump_wait_s: float = 10.0,
        settle_s: float = 1.0,
        crash_window_s: float = 3.0,
        failslow_interval_s: float = 10.0,
        check_wait_s: float = 180.0,
        update_recent_s: float = 3600.0,
        log: Callable[[str], None] = _say,
        clock: Callable[[], float] = time.time,
    ) -> None:
        seal.require_secret("bootseer controller")  # nothing is trusted nor written without it
        self.store = store
        self.job = job
        self.keys = wire.Keys(job)
        self._registered: set[str] = set()  # nodes whose sealed info record was read
        self._refused: set[str] = set()  # keys whose refused record was said once
        self._failing: tuple[int | None, int] = (None, 0)  # (open incident, passes failed)
        self.trace_path = Path(trace_path) if trace_path else None
        self.exclusion = ExclusionList(exclusion) if exclusion else None
        self.layout = layout
        self.dump_wait_s = dump_wait_s
        self.settle_s = settle_s
        self.crash_window_s = crash_window_s  # a hang waits this long for a crash causing it
        self.update_recent_s = update_recent_s  # a failure this soon after an update: its
        self.log = log
        self.clock = clock
        self.failslow_interval_s = failslow_interval_s
        self.check_wait_s = check_wait_s
        self.warnings: list[str] = []
        self._cursors: dict[str, int] = {}  # moved once the events are held (see _flush)
        self._last_round = float("-inf")
        self._last_link = float("-inf")  # the tracer's windows last looked at for a link
        self._link_asked: tuple[int, float] | None = None  # (probe order, when) in flight
        self._link_quiet_until = float("-inf")  # after probes that named no node
        self._link_silent: dict[str, float] = {}  # suspect node -> its window's age then
        self._gone: dict[str, float] | None = None  # node -> when it first missed a dump order

    # -- what the store says -------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Registered nodes, in order of registration: names that are not valid skipped, and
        names without a sealed ``info`` record (the list is appended to, so it cannot be
        sealed; a forged name must not be waited for, nor named lost in a verdict)."""
        raw = wire.get(self.store, self.keys.nodes) or b""
        names: list[str] = []
        for line in raw.decode(errors="replace").splitlines()[: wire.MAX_NODES]:
            if wire.valid_node(line) and line not in names and self._known(line):
                names.append(line)
        return names

    def _known(self, node: str) -> bool:
        if (
            node not in self._registered
            and self._read(self.keys.node(node, "info"), node) is not None
        ):
            self._registered.add(node)
        return node in self._registered

    def gone(self) -> set[str]:
        """Nodes that did not answer an earlier incident's dump order and have not beaten
        since: lost, not slow. torch recovers from a lost node without a verdict, so it stays
        registered, and every later incident waited the whole dump wait for it (10 s each, 4
        times in a 20-minute soak). A node that beats again is waited for again. Seeded from
        the last verdict's ``missing_dumps`` and ``not_waited_for``: a restarted controller
        keeps no state."""
        if self._gone is None:
            pointer = self._read(self.keys.verdict_last)
            last = self._read(self.keys.verdict(int(pointer["incident"]))) if pointer else None
            evidence = (last or {}).get("evidence") or {}
            when = float((last or {}).get("time") or 0.0)
            self._gone = {
                n: when
                for n in [
                    *(evidence.get("missing_dumps") or []),
                    *(evidence.get("not_waited_for") or []),
                ]
                if isinstance(n, str) and wire.valid_node(n)
            }
        for node, since in list(self._gone.items()):
            beat = self._read(self.keys.node(node, "beat"), node)
            try:
                back = beat is not None and float(beat.get("time", 0.0)) > since
            except (TypeError, ValueError):
                back = False
            if back:
                del self._gone[node]
                self.log(f"{node} beats again: waited for in the next incidents")
        return set(self._gone)

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

    def _read(
        self, key: str, node: str | None = None, limit: int = wire.MAX_RECORD_BYTES
    ) -> dict[str, Any] | None:
        """The record under ``key``, sealed and valid (:func:`.wire.decode`); else None and
        a warning naming the key, once per key (a flood of bad records is not a flood of
        lines)."""
        data = wire.get(self.store, key)
        if data is None:
            return None
        try:
            return wire.decode(data, key=key, node=node, limit=limit)
        except wire.WireError as exc:
            if key not in self._refused and len(self._refused) < 100_000:
                self._refused.add(key)
                self._warn(str(exc)[:500])
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
                    self.log(
                        f"{node}: {event.kind} {event.failure_class} came after the "
                        "verdict of its incident: recorded, no new incident"
                    )
                    self._write(
                        dataclasses.replace(event, evidence={**event.evidence, "late": True})
                    )
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
                event = self._failslow_round(excluded) or self._link_watch(excluded)
                if event is None:
                    self._force_update()
                    return None
                actionable = [event]
            opened = self._open(actionable)
        elif fresh:
            opened["events"] += [_doc(e) for e in fresh]
            wire.put(self.store, self.keys.open, opened, wire.MAX_DUMP_BYTES)
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
            f" rank {first.rank}" if first.rank is not None else ""
        )
        opened = {
            "incident": incident,
            "time": now,
            "reason": reason,
            "events": [_doc(e) for e in events],
        }
        wire.put(self.store, self.keys.open, opened, wire.MAX_DUMP_BYTES)
        self._flush_cursors()
        self._order(opened)
        self.log(f"incident {incident}: {reason}; every node ordered to dump its stacks")
        for event in events:
            self._write(event)
        return opened

    def _order(self, opened: dict[str, Any]) -> None:
        """``dump/request`` for an open incident (an update's says so: nothing to dump)."""
        order = {k: opened[k] for k in ("incident", "time", "reason", "update") if k in opened}
        wire.put(self.store, self.keys.dump_request, order)

    # -- versions (:mod:`.update`) ------------------------------------------------------------
    def _epoch(self) -> int:
        last = self._read(self.keys.verdict_last)
        return int(last["incident"]) if last else 0

    def _force_update(self) -> None:
        """A published version that is urgent or past its window, and not run yet, opens an
        update incident: every node restarts on it (the path of a verdict, without dumps)."""
        try:
            published = update.current(self.store, self.keys)
            pin = update.running(self.store, self.keys, self._epoch())
        except update.VersionError as exc:
            self._warn(str(exc))
            return
        why = published.due(self.clock()) if published else None
        if why is not None and pin is not None and published.seq < pin.seq:
            self._warn(
                f"{self.keys.version_current}: publication {published.seq} is older "
                f"than the running one ({pin.seq}): a replayed record, not applied"
            )
            return
        if why is None or published.forced is not None or pin is None or pin.id == published.id:
            return  # lazy, already ordered, nodes (re)starting, or applied
        incident = int(self.store.add(self.keys.incident, 1))
        if not update.mark_forced(self.store, self.keys, published, incident):
            return  # published again meanwhile: the next pass sees the new one
        when = (
            "published urgent"
            if why == "urgent"
            else f"not run {published.window_s:g} s after its publication"
        )
        reason = f"version {published.id} {when}: every node restarts on it (from {pin.id})"
        opened = {
            "incident": incident,
            "time": self.clock(),
            "reason": reason,
            "events": [],
            "update": published.id,
        }
        wire.put(self.store, self.keys.open, opened, wire.MAX_DUMP_BYTES)
        self._order(opened)
        self.log(f"incident {incident}: {reason}")

    def _updated_pin(self, failed_at: float) -> update.Pin | None:
        """The version the failed epoch runs when a publish brought it in (within
        ``update_recent_s``) and nothing newer was published: the one to roll back."""
        try:
            pin = update.running(self.store, self.keys, self._epoch())
            published = update.current(self.store, self.keys)
        except update.VersionError as exc:
            self._warn(str(exc))
            return None
        if (
            pin is None
            or not pin.updated
            or pin.cause != "publish"
            or published is None
            or published.id != pin.id
            or failed_at - pin.time > self.update_recent_s
        ):
            return None
        return pin

    def _maybe_close(self, opened: dict[str, Any], excluded: set[str]) -> Verdict | None:
        self._flush_cursors()
        incident = int(opened["incident"])
        waited = self.clock() - float(opened["time"])
        gone = self.gone()
        expected = [n for n in self.nodes() if n not in excluded and n not in gone]
        answers = {
            n: self._read(self.keys.dump(n, incident), n, wire.MAX_DUMP_BYTES) for n in expected
        }
        missing = [n for n, a in answers.items() if a is None]
        silent = self._silent(missing, opened, waited)
        update_only = bool(opened.get("update")) and not opened["events"]  # nothing to settle
        if (waited < self.settle_s and not update_only) or (
            set(missing) - set(silent) and waited < self.dump_wait_s
        ):
            return None
        if waited < self.crash_window_s and _hang_only(opened):  # a crash may explain it
            return None
        if not missing and not update_only and "answered_at" not in opened:
            # one more pass: an event a node published just before its answer is read first
            opened["answered_at"] = self.clock()
            wire.put(self.store, self.keys.open, opened, wire.MAX_DUMP_BYTES)
            return None
        checked = None
        # a mismatched collective in the windows is a code fault: no checks, it stops
        if (
            _needs_checks(opened, missing)
            and len(expected) >= 2
            and ("check" in opened or not self._mismatches(expected))
        ):
            checked = self._checks(opened, [n for n in expected if n not in missing])
            if checked is None:
                return None
        for node in missing:  # not waited for again until it beats
            assert self._gone is not None
            self._gone.setdefault(node, float(opened["time"]))
        if gone:
            opened["not_waited_for"] = sorted(gone)
        if silent and waited < self.dump_wait_s:
            opened["silent"] = sorted(silent)
        return self._close(opened, {n: a for n, a in answers.items() if a}, missing, checked)

    def _silent(self, missing: list[str], opened: dict[str, Any], waited: float) -> list[str]:
        """Missing nodes that, ``ACK_WAIT_S`` into the incident, have neither acknowledged the
        order nor beaten since it was placed: lost with their agent (a live agent acks
        within its poll, 0.5 s, before it dumps), so the dump wait is not spent on them (it
        cost the soak's lost node 10 s before the survivors could restart)."""
        if waited < ACK_WAIT_S or not missing:
            return []
        return self._unheard(missing, opened)

    def _unheard(self, missing: list[str], opened: dict[str, Any]) -> list[str]:
        """The missing nodes that neither acknowledged this incident's dump order nor beat
        since it was placed: lost (the node, or its agent), the verdict's subject when
        what the others saw is their loss (:func:`_lost_explains`)."""
        incident, since = int(opened["incident"]), float(opened["time"])
        silent = []
        for node in missing:
            if self._read(self.keys.dump_ack(node, incident), node) is not None:
                continue
            beat = self._read(self.keys.node(node, "beat"), node) or {}
            try:
                alive = float(beat.get("time", 0.0)) > since
            except (TypeError, ValueError):
                alive = False
            if not alive:
                silent.append(node)
        return silent

    def _ranks_of(
        self, nodes: Sequence[str], traced: dict[str, Any] | None
    ) -> dict[str, list[int]]:
        """Each node's ranks, from its last heartbeat summary and its last tracer window
        (a lost node's last words)."""
        windows = (traced or {}).get("windows") or {}
        found: dict[str, list[int]] = {}
        for node in nodes:
            beat = self._read(self.keys.node(node, "beat"), node) or {}
            ranks = {int(r) for r in windows.get(node, {}).get("ranks") or []}
            for rank in (beat.get("ranks") or {}) if isinstance(beat.get("ranks"), dict) else ():
                with contextlib.suppress(TypeError, ValueError):
                    ranks.add(int(rank))
            found[node] = sorted(ranks)
        return found

    def _mismatches(self, nodes: list[str]) -> list[Any]:
        """The tracer's mismatch findings over these nodes' windows (before the checks
        are ordered: a code fault needs none)."""
        docs = self._windows(nodes)
        if not docs:
            return []
        from ..colltrace.ship import analyze_windows

        found, _ = analyze_windows(docs, now=self.clock())
        return [f for f in found if f.kind == "mismatch"]

    # -- stop-time checks ------------------------------------------------------------------
    def _checks(self, opened: dict[str, Any], nodes: list[str]) -> dict[str, Any] | None:
        """Order the checks once, then their results; None while they are running."""
        incident = int(opened["incident"])
        if "check" not in opened:
            order = {"incident": incident, "nodes": nodes, "time": self.clock()}
            wire.put(self.store, self.keys.check_request(incident), order)
            opened["check"] = order
            wire.put(self.store, self.keys.open, opened, wire.MAX_DUMP_BYTES)
            self.log(
                f"incident {incident}: stop-time checks ordered on "
                f"{', '.join(nodes)} (collective self-test, bitwise alignment)"
            )
            return None
        nodes = list(opened["check"]["nodes"])
        results: dict[str, RankResult] = {}
        errors: dict[str, str] = {}
        for node in nodes:
            doc = self._read(self.keys.check_result(node, incident), node)
            try:
                if doc is not None and "error" in doc:
                    errors[node] = str(doc["error"])[:500]
                elif doc is not None:
                    results[node] = RankResult(**{**doc["result"], "node": node})
            except (KeyError, TypeError) as exc:
                self._warn(f"{self.keys.check_result(node, incident)}: not a check result ({exc})")
        waited = self.clock() - float(opened["check"]["time"])
        if len(results) + len(errors) < len(nodes) and waited < self.check_wait_s:
            return None
        return {**_check_evidence(results, nodes), "errors": errors}

    # -- the verdict -----------------------------------------------------------------------
    def _close(
        self,
        opened: dict[str, Any],
        answers: dict[str, dict[str, Any]],
        missing: list[str],
        checked: dict[str, Any] | None = None,
    ) -> Verdict:
        incident = int(opened["incident"])
        if opened.get("update") and not opened["events"]:
            return self._finish(
                incident,
                Verdict(
                    "restart_in_place",
                    "update",
                    reason=opened["reason"],
                    time=self.clock(),
                    evidence={
                        "incident": incident,
                        "reason": opened["reason"],
                        "update": {"version": opened["update"]},
                        "answered": sorted(answers),
                        "missing_dumps": missing,
                        "controller_pid": os.getpid(),
                    },
                ),
            )
        events = [Event.from_doc(d) for d in opened["events"]]
        processes, dumps = _processes(answers)
        found = _break_tie(localize(processes, self.layout), processes, self.layout)
        natives = self._native_dumps(list(answers), incident)
        _attach_native(found, natives)
        for node in dumps:
            dumps[node]["native"] = any(n == node for n, _ in natives)
        primary = _primary(events)
        traced = self._colltrace(
            [*answers, *missing], incident, answered=list(answers), hang=primary.kind == "hang"
        )
        history = self.verdicts()
        pin = self._updated_pin(primary.time)
        lost = self._unheard(missing, opened)
        mismatch = next(
            (f for f in (traced or {}).get("findings", []) if f["kind"] == "mismatch"), None
        )
        if checked and checked["failed"]:  # a node that fails a check is evicted
            verdict = _check_verdict(primary, checked)
        elif mismatch is not None and primary.kind in ("crash", "hang"):
            # mismatched collectives (gloo aborts a rank on them; the survivors see a peer's
            # death): a code fault, whatever the crash looked like; every restart repeats it
            of = {
                r: n for n, rs in self._ranks_of([*answers, *missing], traced).items() for r in rs
            }
            ranks = [int(r) for r in mismatch["ranks"]]
            primary = Event(
                "crash",
                "collective_mismatch",
                node=of.get(ranks[0]),
                rank=ranks[0],
                step=primary.step,
                time=primary.time,
                evidence={
                    "rule": "colltrace_mismatch",
                    "colltrace": mismatch["line"],
                    "signatures": mismatch["evidence"].get("signatures"),
                    "seen_as": _doc(primary),
                },
            )
            verdict = decide(
                primary,
                suspect_ranks=ranks,
                suspect_nodes={of[r] for r in ranks if r in of},
                history=history,
                recent_update=pin is not None,
            )
        elif lost and _lost_explains(primary):
            # the survivors saw their peers die (a communication error, a signal) or wait for
            # them (a hang): the lost node is the subject, never a survivor
            ranks_of = self._ranks_of(lost, traced)
            primary = Event(
                "crash",
                "node_lost",
                node=lost[0],
                time=primary.time,
                evidence={
                    "rule": "no_answer",
                    "lost": lost,
                    "ranks": ranks_of,
                    "seen_as": _doc(primary),
                },
            )
            verdict = decide(
                primary,
                suspect_nodes=lost,
                suspect_ranks=[r for rs in ranks_of.values() for r in rs],
                history=history,
            )
        elif primary.kind == "fail_slow" and primary.evidence.get("group_nodes"):
            ev = primary.evidence  # the rounds named the group
            verdict = decide(
                dataclasses.replace(primary, node=None, rank=None),
                suspect_nodes=tuple(ev["group_nodes"]),
                suspect_ranks=tuple(ev.get("group_ranks") or ()),
                history=history,
                recent_update=pin is not None,
            )
        elif primary.kind in ("hang", "fail_slow"):  # every rank may look hung: stacks decide
            anonymous = dataclasses.replace(primary, node=None, rank=None)
            verdict = decide(
                anonymous,
                suspect_nodes=found.domain_nodes or found.suspect_nodes,
                suspect_ranks=found.domain_ranks or found.suspects,
                history=history,
                recent_update=pin is not None,
            )
        else:
            verdict = decide(primary, history=history, recent_update=pin is not None)
            if verdict.action == "continue":  # a jump stopped the job: resume it
                verdict = dataclasses.replace(
                    verdict,
                    action="restart_in_place",
                    reason=f"{verdict.reason}; the job was stopped at the jump"
                    + (" and the checks found no faulty node" if checked else "")
                    + ": resume from the last checkpoint",
                )
        if checked is not None:
            verdict = dataclasses.replace(verdict, evidence={**verdict.evidence, "check": checked})
        if verdict.action == "rollback" and pin is not None:  # published before the verdict,
            back = update.roll_back(self.store, self.keys, pin, incident, self.clock())
            verdict = dataclasses.replace(  # so the agents restart on it
                verdict,
                reason=f"{verdict.reason}: version {pin.id} rolled back to {back.id}",
                evidence={
                    **verdict.evidence,
                    "update": {"failed": pin.id, "rolled_back_to": back.id, "epoch": pin.epoch},
                },
            )
        evidence = {
            **verdict.evidence,
            "incident": incident,
            "reason": opened["reason"],
            "events": opened["events"],
            "primary": _doc(primary),
            "localization": {
                "suspects": list(found.suspects),
                "suspect_nodes": list(found.suspect_nodes),
                "domain": found.domain,
                "reason": found.reason,
                **found.evidence,
            },
            "dumps": dumps,
            "missing_dumps": missing,
            "controller_pid": os.getpid(),
            "not_waited_for": opened.get("not_waited_for", []),
            "silent": opened.get("silent", []),
            "lost": lost,
        }
        if traced:
            evidence["colltrace"] = traced
        verdict = dataclasses.replace(verdict, time=self.clock(), evidence=evidence)
        why = (
            f"; the fail-slow rounds named {primary.evidence['group']}"
            if primary.kind == "fail_slow" and primary.evidence.get("group")
            else f"; {found.reason}"
        )
        if traced and traced["lines"]:
            why += f"; colltrace: {traced['lines'][0]}"
        return self._finish(incident, verdict, why)

    def _native_dumps(
        self, nodes: list[str], incident: int
    ) -> dict[tuple[str, int], ProcessStacks]:
        """The native dumps the nodes sent after their answers (``py-spy dump --native``),
        by (node, pid); only those already in: the verdict never waits for them."""
        found: dict[tuple[str, int], ProcessStacks] = {}
        for node in nodes:
            doc = self._read(self.keys.native_dump(node, incident), node, wire.MAX_DUMP_BYTES)
            processes, _ = _processes({node: doc} if doc else {})
            found.update({(node, p.pid): p for p in processes if p.pid is not None})
        return found

    def _colltrace(
        self, nodes: list[str], incident: int, *, answered: Sequence[str] = (), hang: bool = False
    ) -> dict[str, Any] | None:
        """The collective tracer's verdict over the ring windows the nodes shipped
        (:mod:`bootseer.colltrace.ship`): the same analysis as a node's, across nodes; also
        into ``colltrace-controller.ndjson`` beside the trace (``bootseer report``). None when
        no node ships one. The windows of the ``answered`` nodes came with their dumps: they
        count as read now (the verdict is about what those dumps show). ``hang``: the
        heartbeats already found the job stuck, so an op held past the tracer's floor is
        stuck there: a loaded machine's learned T (10 x the median op) may outlast the
        heartbeat timeout, and the verdict would come before the op counts as stuck."""
        docs = self._windows(nodes)
        if not docs:
            return None
        from ..colltrace.analyze import Analyzer
        from ..colltrace.reader import verdict_docs
        from ..colltrace.ship import analyze_windows

        analyzer = Analyzer(node="controller")
        if hang:
            analyzer.stuck_cap_s = analyzer.floor_s
        found, grid = analyze_windows(docs, now=self.clock(), analyzer=analyzer, current=answered)
        if found and self.trace_path is not None:
            path = self.trace_path.parent / "colltrace-controller.ndjson"
            try:
                with open_append(path.parent, path.name) as f:
                    f.writelines(
                        json.dumps(d, default=str) + "\n"
                        for d in verdict_docs(found, grid, "controller", incident)
                    )
            except OSError as exc:
                self._warn(f"cannot write {path}: {exc}")
        return {
            "lines": [f.line for f in found],
            "findings": [f.to_doc() for f in found],
            "windows": {
                n: {
                    "time": d.get("time"),
                    "attempt": d.get("attempt"),
                    "ranks": sorted(
                        r.get("rank")
                        for r in d.get("ranks") or []
                        if isinstance(r, dict) and isinstance(r.get("rank"), int)
                    ),
                }
                for n, d in sorted(docs.items())
            },
        }

    def _windows(self, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """The ring windows these nodes ship (:mod:`bootseer.colltrace.ship`), by node."""
        docs = {}
        for node in nodes:
            doc = self._read(self.keys.node(node, "colltrace"), node, wire.MAX_DUMP_BYTES)
            if doc and doc.get("colltrace_window"):
                docs[node] = doc
        return docs

    def _finish(self, incident: int, verdict: Verdict, why: str = "") -> Verdict:
        """The verdict into the store (the agents act on it), the trace and the log."""
        wire.put(
            self.store, self.keys.verdict(incident), _verdict_doc(verdict), wire.MAX_DUMP_BYTES
        )
        if verdict.action == "replace_and_restart" and verdict.nodes:
            self._exclude(verdict)
        wire.put(self.store, self.keys.verdict_last, {"incident": incident, "time": verdict.time})
        self.store.delete_key(self.keys.open)
        self.store.delete_key(self.keys.failslow)  # the rounds start afresh after an incident
        self._write(verdict)
        self.log(
            f"incident {incident}: verdict {verdict.action} ({verdict.failure_class})"
            + (f" nodes {', '.join(verdict.nodes)}" if verdict.nodes else "")
            + (f" ranks {', '.join(map(str, verdict.ranks))}" if verdict.ranks else "")
            + f": {verdict.reason}{why}"
        )
        return verdict

    def _exclude(self, verdict: Verdict) -> None:
        if self.exclusion is not None:
            self.exclusion.add(verdict.nodes, verdict.reason, failure_class=verdict.failure_class)
            publish_exclusions(self.store, self.exclusion, self.job)
            return
        doc = read_exclusions(self.store, self.job, self.log)
        reasons = {**doc.get("reasons", {}), **dict.fromkeys(verdict.nodes, verdict.reason)}
        wire.put(
            self.store,
            self.keys.excluded,
            exclusion_record(
                [*doc["nodes"], *verdict.nodes], reasons=reasons, source=doc.get("list")
            ),
        )

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

    # -- fail-slow rounds --------------------------------------------------------------------
    def _failslow_round(self, excluded: set[str]) -> Event | None:
        """A round when one is due: step times from the beats, the stack samples of the last
        round's order, a new order; the event of a slow group, or None."""
        now = self.clock()
        if self.failslow_interval_s <= 0 or now - self._last_round < self.failslow_interval_s:
            return None
        self._last_round = now
        doc = self._read(self.keys.failslow) or {}
        rounds = FailSlowRounds.from_doc(doc, layout=self.layout)
        asked = int(doc.get("asked", 0))
        step_times: dict[int, float] = {}
        nodes: dict[int, str] = {}
        samples: list[ProcessStacks] = []
        for node in self.nodes():
            if node in excluded:
                continue
            beat = self._read(self.keys.node(node, "beat"), node)
            fresh = beat and now - float(beat.get("time", 0)) <= max(
                3 * self.failslow_interval_s, 5.0
            )
            for rank, info in ((beat or {}).get("ranks") or {}).items() if fresh else ():
                if isinstance(info, dict) and isinstance(info.get("step_time_s"), int | float):
                    step_times[int(rank)] = float(info["step_time_s"])
                    nodes[int(rank)] = node
            if asked:
                answer = self._read(self.keys.sample(node, asked), node, wire.MAX_DUMP_BYTES)
                processes, _ = _processes({node: answer} if answer else {})
                samples += processes
                self.store.delete_key(self.keys.sample(node, asked))
        # only ranks in training (a step time known): at start-up a rank still loading while
        # others wait in init_process_group's barrier is not a straggler
        samples = [p for p in samples if p.rank in step_times]
        event = None
        if step_times or samples:
            event = rounds.round(step_times, now, nodes=nodes, samples=samples)
            flagged = rounds.history[-1] if rounds.history else {}
            if flagged:
                self.log(
                    f"fail-slow round {rounds.count}: flagged "
                    + ", ".join(f"rank {r} ({'+'.join(w)})" for r, w in sorted(flagged.items()))
                )
        asked = int(self.store.add(self.keys.sample_count, 1))  # never reused: an agent
        # answers each order once, across controller restarts and incidents
        wire.put(
            self.store, self.keys.failslow, {**rounds.to_doc(), "asked": asked}, wire.MAX_DUMP_BYTES
        )
        wire.put(self.store, self.keys.sample_request, {"round": asked, "time": now})
        return event

    def _link_watch(self, excluded: set[str]) -> Event | None:
        """A slow link, between the rounds: every ``LINK_CHECK_S`` the tracer's windows are
        analysed (:meth:`_link_suspected`); on a suspicion every node is asked at once to
        probe its own link (an order of its own, not the next round's), and the answers are
        read as they come, up to ``LINK_WAIT_S``; a node whose window had stopped coming and
        that has not answered ``LINK_STALE_S`` after the order, every other node having
        answered, counts as a probe that failed (it could not reach the store). Held in
        memory: a controller restarted meanwhile asks again on the next suspicion."""
        if self.failslow_interval_s <= 0:
            return None
        now = self.clock()
        if self._link_asked is not None:
            ident, since = self._link_asked
            live = [n for n in self.nodes() if n not in excluded]
            probes: dict[str, dict[str, Any]] = {}
            for node in live:
                answer = self._read(self.keys.link_probe(node, ident), node)
                if answer and isinstance(answer.get("probe"), dict):
                    probes[node] = answer["probe"]
            missing = [n for n in live if n not in probes]
            silent = bool(missing) and all(n in self._link_silent for n in missing)
            if missing and now - since < (LINK_STALE_S if silent else LINK_WAIT_S):
                return None
            self._link_asked = None
            for node in live:
                self.store.delete_key(self.keys.link_probe(node, ident))
            for node in missing if silent else ():  # its window stopped, and now its answer
                age = self._link_silent[node] + now - since
                probes[node] = {
                    "node": node,
                    "error": (
                        f"no answer to the probe order in {now - since:.1f} s, and no tracer "
                        f"window from it for {age:.1f} s while ranks wait on its rank(s)"
                    ),
                }
            event = self._slow_link(probes, self._rank_nodes(excluded), now)
            if event is None:
                self._link_quiet_until = now + LINK_QUIET_S
            return event
        if now - self._last_link < LINK_CHECK_S or now < self._link_quiet_until:
            return None
        self._last_link = now
        if not self._link_suspected(excluded):
            return None
        ident = int(self.store.add(self.keys.sample_count, 1))  # shared with the rounds
        wire.put(self.store, self.keys.link_request, {"id": ident, "time": time.time()})
        self._link_asked = (ident, now)
        return None

    def _rank_nodes(self, excluded: set[str]) -> dict[int, str]:
        """Each training rank's node, from the nodes' fresh beats."""
        found: dict[int, str] = {}
        for node in self.nodes():
            beat = self._read(self.keys.node(node, "beat"), node) if node not in excluded else None
            for rank in (beat or {}).get("ranks") or {}:
                with contextlib.suppress(TypeError, ValueError):
                    found[int(rank)] = node
        return found

    def _link_suspected(self, excluded: set[str]) -> bool:
        """The collective tracer, over the windows the nodes ship, sees the whole job slow
        or stuck in flight with no rank to blame ("slow"/"transport" naming nobody), or
        ranks waiting on a rank whose node's window stopped coming ``LINK_STALE_S`` ago
        ("unseen": a link that carries nothing stops its agent's shipping too): a link is
        the suspect, and every node is asked to probe its own. Such a silent node that does
        not answer the probe either, while the others do, is the one named
        (:meth:`_link_watch`)."""
        docs = self._windows([n for n in self.nodes() if n not in excluded])
        if not docs:
            return False
        from ..colltrace.ship import analyze_windows

        found, _ = analyze_windows(docs, now=self.clock())
        suspect, self._link_silent = link_suspects(found)
        if suspect:
            self.log(f"fail-slow: {suspect[0].line}: every node probes its link now")
        return bool(suspect)

    def _slow_link(
        self, probes: dict[str, dict[str, Any]], nodes: dict[int, str], now: float
    ) -> Event | None:
        """The node whose link the probes found slow (:func:`bootseer.colltrace.probe.
        slow_node`), as a ``fail_slow`` event naming that node: the link is the group."""
        from ..colltrace.probe import slow_node

        named = slow_node(probes) if len(probes) >= 3 else None  # two: no majority
        if named is None:
            if probes:
                self.log(f"fail-slow: link probes of {', '.join(sorted(probes))} name no node")
            return None
        node, why = named
        self.log(f"fail-slow: {node}'s link is slow: {why}")
        ranks = sorted(r for r, n in nodes.items() if n == node)
        return Event(
            "fail_slow",
            "fail_slow",
            node=node,
            time=now,
            evidence={
                "group": f"{node}'s link",
                "group_nodes": [node],
                "group_ranks": ranks,
                "cause": "slow_link",
                "why": why,
                "probes": probes,
            },
        )

    # -- the loop --------------------------------------------------------------------------
    def run(self, stop: threading.Event, interval_s: float = 0.25) -> None:
        """:meth:`safe_step` every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            self.safe_step()
            stop.wait(interval_s)

    def safe_step(self, give_up_after: int = MAX_FAILED_PASSES) -> Verdict | None:
        """:meth:`step`, never fatal: an exception is logged (once per message) and the
        controller goes on; an open incident whose passes failed ``give_up_after`` times in
        a row is closed with a ``restart_in_place`` verdict saying why, so the nodes waiting
        for it are answered and a poisoned incident does not block the later ones (a
        restarted controller would only die on it again)."""
        try:
            verdict = self.step()
        except Exception as exc:  # noqa: BLE001 - the controller must stay up
            return self._failed_pass(exc, give_up_after)
        self._failing = (None, 0)
        return verdict

    def _failed_pass(self, exc: Exception, give_up_after: int) -> Verdict | None:
        what = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            opened = self._read(self.keys.open)
            incident = int(opened["incident"]) if opened else None
        except Exception as again:  # noqa: BLE001 - the store itself may be unreachable
            self._warn(
                f"a pass failed ({what}), and reading the store too "
                f"({type(again).__name__}: {str(again)[:200]})"
            )
            return None
        count = self._failing[1] + 1 if self._failing[0] == incident else 1
        self._failing = (incident, count)
        self._warn("a pass failed" + (f" on incident {incident}" if incident else "") + f": {what}")
        if incident is None or count < give_up_after:
            return None
        self._failing = (None, 0)
        reason = (
            f"the controller could not localize incident {incident} ({what}) in "
            f"{count} passes: restart in place"
        )
        try:
            return self._finish(
                incident,
                Verdict(
                    "restart_in_place",
                    "unknown",
                    reason=reason,
                    time=self.clock(),
                    evidence={
                        "incident": incident,
                        "reason": str(opened.get("reason", "")),
                        "rule": "controller_error",
                        "error": what,
                        "events": opened.get("events", []),
                        "missing_dumps": [],
                        "not_waited_for": [],
                        "controller_pid": os.getpid(),
                    },
                ),
            )
        except Exception as again:  # noqa: BLE001
            self._warn(
                f"incident {incident}: cannot write its verdict "
                f"({type(again).__name__}: {str(again)[:200]})"
            )
            return None


def link_suspects(found: Sequence[Any]) -> tuple[list[Any], dict[str, float]]:
    """The tracer's findings that make a link the suspect (see
    :meth:`Controller._link_suspected`), and the silent nodes among them: node -> how old its
    window was (s). ``found``: :class:`bootseer.colltrace.analyze.Finding` s."""
    suspect = [f for f in found if f.kind in ("slow", "transport") and not f.ranks]
    silent: dict[str, float] = {}
    for f in found:  # ranks wait on a rank whose node's window stopped coming
        if f.kind != "unseen" or f.ranks:
            continue
        stale = {
            node: age
            for r, node in f.evidence["nodes"].items()
            if node and (age := f.evidence["seen_ago_s"][r]) >= LINK_STALE_S
        }
        if stale:
            silent.update(stale)
            suspect.append(f)
    return suspect, silent


def _attach_native(found: Localization, natives: dict[tuple[str, int], ProcessStacks]) -> None:
    """Each stack group's evidence gets the native stacks of its first member that has them
    (the groups themselves come from the Python dumps: a native dump is taken later, and a
    process that moved on meanwhile must not change the verdict)."""
    for group, evidence in zip(found.groups, found.evidence.get("groups", []), strict=False):
        member = next((m for m in group.members if (m.node, m.pid) in natives), None)
        if member is not None and member.node is not None and member.pid is not None:
            evidence["native"] = native_evidence(member, natives[(member.node, member.pid)].threads)


def _break_tie(
    found: Localization,
    processes: list[ProcessStacks],
    layout: Mapping[str, Sequence[Sequence[int]]] | None,
) -> Localization:
    """With no dominant stack group (two ranks: 1:1), the trainers outside every collective
    are the suspects when the others all wait inside one: they are who the others wait for.
    Anything else stays without a verdict from stacks."""
    if found.suspects:
        return found
    main = [g for g in found.groups if g.role == "main"]
    inside = [g for g in main if any(COLLECTIVE_FILE in f for t in g.signature for f in t)]
    outside = [g for g in main if g not in inside]
    if len(main) < 2 or not inside or not outside:
        return found
    waiting = sorted(r for g in inside for r in g.ranks)
    suspects = {r for g in outside for r in g.ranks}
    domain, ranks = _domain(suspects, layout or {})
    node_of = {p.rank: p.node for p in processes if p.node}
    why = (
        f"no dominant stack group; rank(s) {', '.join(map(str, sorted(suspects)))} outside "
        f"every collective while rank(s) {', '.join(map(str, waiting))} waits inside a "
        "collective"
    )
    return Localization(
        tuple(sorted(suspects)),
        tuple(sorted({node_of[r] for r in suspects if r in node_of})),
        domain if layout else None,
        ranks,
        tuple(sorted({node_of[r] for r in ranks if r in node_of})),
        found.groups,
        why,
        found.evidence,
    )


def _hang_only(opened: dict[str, Any]) -> bool:
    """An incident of hangs with no crash yet: a peer's crash that reaches the controller a
    moment later is the root cause (its ranks stall in their collectives), not the hang."""
    kinds = {e.get("kind") for e in opened["events"]}
    return "hang" in kinds and "crash" not in kinds


def _needs_checks(opened: dict[str, Any], missing: list[str]) -> bool:
    """A NaN, a jump or an unclear crash, with every node answering (no node lost)."""
    if missing or not opened["events"]:  # an update incident has no events: nothing to check
        return False
    primary = _primary([Event.from_doc(d) for d in opened["events"]])
    return primary.kind in ("nonfinite", "spike") or (
        primary.kind == "crash" and primary.failure_class in CHECKED
    )


def _check_evidence(results: dict[str, RankResult], nodes: list[str]) -> dict[str, Any]:
    """The checks' outcome: each failing node with the check it failed and the numbers."""
    failed: list[dict[str, Any]] = []
    report = None
    if len(results) >= 2:
        # ranks are the order's positions (the check's own ranks, which name its links)
        by = {nodes.index(r.node): r for r in results.values()}
        report = CheckReport.from_results(
            [dataclasses.replace(r, rank=i) for i, r in sorted(by.items())]
        )
        for i in report.sum_suspects:
            failed.append(
                {"node": by[i].node, "check": "all_reduce_sum", "wrong_elements": by[i].sum_errors}
            )
        for i in report.link_suspects:
            failed.append(
                {
                    "node": by[i].node,
                    "check": "link_bandwidth",
                    "links": {p: t for p, t in report.links.items() if i in map(int, p.split("-"))},
                }
            )
        for i in report.alignment_suspects:
            out, grad = report.alignment_majority or ("", "")
            failed.append(
                {
                    "node": by[i].node,
                    "check": "bitwise_alignment",
                    "output": by[i].output_hash,
                    "gradients": by[i].grad_hash,
                    "majority": [out, grad],
                }
            )
    return {
        "nodes": nodes,
        "missing": [n for n in nodes if n not in results],  # or errors
        "failed": failed,
        "no_majority": bool(report and report.no_majority),
        "text": report.text() if report else "fewer than two nodes answered",
        "results": {n: dataclasses.asdict(r) for n, r in sorted(results.items())},
    }


def _check_verdict(primary: Event, checked: dict[str, Any]) -> Verdict:
    nodes = tuple(sorted({f["node"] for f in checked["failed"]}))
    why = "; ".join(f"{f['node']} failed {f['check']}" for f in checked["failed"])
    return Verdict(
        "replace_and_restart",
        primary.failure_class,
        nodes=nodes,
        reason=f"stop-time check after {primary.kind} {primary.failure_class}: {why}",
        evidence={"event": _doc(primary), "rule": "stop_time_check", "on_nodes": list(nodes)},
    )


def _primary(events: list[Event]) -> Event:
    """The incident's cause among its events (see :func:`_rank_of_cause`); of a crash seen
    at a rank's death and the launcher's refinement of it (same time), the refinement."""
    return min(
        events,
        key=lambda e: (
            _rank_of_cause(e),
            e.time,
            bool(e.evidence.get("provisional")),
            not e.evidence.get("refines"),
        ),
    )


def _lost_explains(primary: Event) -> bool:
    """What the survivors see of a lost node: a hang (their ranks wait for its ranks), or
    a crash that names no cause of its own (a peer's death seen from the other side, a
    signal from their launcher tearing down, nothing)."""
    return primary.kind == "hang" or (
        primary.kind == "crash"
        and primary.failure_class in (*SECONDARY, "killed_by_signal", "unknown")
    )


def _rank_of_cause(event: Event) -> int:
    """Which event of an incident is its cause: a crash of its own (0) before a NaN or a
    jump (1), before a hang or a slow node (2: others stall when a peer dies), before a
    collective error (3: the peer died first)."""
    if event.failure_class in SECONDARY:
        return 3
    return {"crash": 0, "nonfinite": 1, "spike": 1}.get(event.kind, 2)


def _doc(event: Event) -> dict[str, Any]:
    return json.loads(event.to_json())


def _verdict_doc(verdict: Verdict) -> dict[str, Any]:
    return json.loads(verdict.to_json())


def _processes(
    answers: dict[str, dict[str, Any]],
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
            text = str(item.get("text", ""))[: wire.MAX_STACK_CHARS]
            pid = item.get("pid") if isinstance(item.get("pid"), int) else None
            role = str(item.get("role") or "main")[:32]
            stacks = ProcessStacks.from_text(text, rank=item["rank"], node=node, pid=pid, role=role)
            if stacks.threads:
                processes.append(stacks)
                sources.add(str(item.get("source", "?"))[:32])
                ranks.add(item["rank"])
        summary[node] = {
            "processes": len(items),
            "ranks": sorted(ranks),
            "sources": sorted(sources),
            "files": answer.get("files", [])[:64],
        }
    return processes, summary
