"""Trigger and root cause from every rank's ring.

The reader calls :meth:`Analyzer.analyze` with the rings' snapshots at least every 2 s. A
pass does two things:

* trigger: an op in progress on some rank for longer than T (``stuck_s``, or learned: ``k``
  times the median duration of that op in that group, at least ``floor_s``); an op that
  failed (a peer died); a group whose op interval doubled or whose throughput halved against
  its own baseline (the median over its first ops after a warm-up);
* root cause, per process group: the rank(s) with the least progress. A rank that never
  issued the op everyone else waits in (attach its stack where the robust dump has one); a
  rank whose process died in the op (it never completed, or its pid is gone); an op issued
  everywhere and completed nowhere (transport or peer); a rank still inside an op that a
  peer completed, having issued nothing since (stalled: named in that group and op, also
  when ranks of another group wait on it); a rank that starts more than
  ``straggler_s`` after all the others (straggler). Across groups: a rank missing from one
  group's op while it waits in another group's is followed to the group that blocks it; a
  cycle of such waits is a deadlock. The same sequence number with a different op, dtype or
  (where sizes must agree) element count is a mismatch, named as such.

Each finding is new once (its key is remembered): the caller writes it and says its line.
Why in the reader and not in the ranks: a hung rank cannot report itself, and only the
reader sees every rank at once.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..process import pid_alive, proc_state
from .ring import Op, RingSnapshot

__all__ = ["Analyzer", "Finding", "GroupView", "pid_alive", "proc_state", "SIZED_OPS"]

#: ops whose element count must be the same on every rank (others may differ: gather, a2a)
SIZED_OPS = {
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce_coalesced",
    "barrier",
    "monitored_barrier",
}


@dataclass
class Finding:
    """A verdict of the tracer: the kind, the root-cause rank(s), one line, the evidence."""

    kind: str  # never_issued | died | transport | stalled | straggler | mismatch | deadlock
    #          | slow | unseen (ranks wait on ranks whose ring was last read before the op)
    group: str  # the group's display name
    ranks: tuple[int, ...]
    op: str
    seq: int
    line: str
    time: float
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "group": self.group,
            "ranks": list(self.ranks),
            "op": self.op,
            "seq": self.seq,
            "line": self.line,
            "time": self.time,
            "evidence": self.evidence,
        }


@dataclass
class GroupView:
    """One process group across the rings: every member's collective ops by sequence."""

    name: str
    display: str
    members: list[int]
    ops: dict[int, dict[int, Op]] = field(default_factory=dict)  # rank -> seq -> op

    def last_issued(self, rank: int) -> int:
        by_seq = self.ops.get(rank)
        return max(by_seq) if by_seq else 0

    def in_progress(self, rank: int) -> Op | None:
        """The oldest op of ``rank`` in this group that has not completed."""
        open_ops = [o for o in self.ops.get(rank, {}).values() if o.t_done is None]
        return min(open_ops, key=lambda o: o.seq) if open_ops else None


def _display(entry: dict[str, Any]) -> str:
    desc = str(entry.get("desc") or "")
    return desc if desc and desc != "undefined" else f"pg{entry.get('name')}"


def group_views(snaps: Iterable[RingSnapshot]) -> dict[str, GroupView]:
    """Per group (torch's name, the same on every rank): members and collective ops."""
    views: dict[str, GroupView] = {}
    for snap in snaps:
        for name, entry in snap.groups.items():
            view = views.setdefault(name, GroupView(name, _display(entry), []))
            if entry.get("ranks") and not view.members:
                view.members = [int(r) for r in entry["ranks"]]
        for op in snap.ops:
            if op.p2p:
                continue
            view = views.setdefault(op.group, GroupView(op.group, f"pg{op.group}", []))
            view.ops.setdefault(snap.rank, {})[op.seq] = op
    for view in views.values():
        if not view.members:
            view.members = sorted(view.ops)
    return views


#: A group's first ops are not judged for stragglers: the ranks' first steps pay their own
#: start (lazy init, allocator growth, page faults), and on a loaded machine one rank's 6th op
#: came 1.1 s after the others' with nothing wrong (a CI run, 2026-11-24; it was 5 then).
STRAGGLER_WARMUP_OPS = 10


@dataclass
class _StuckCase:
    """One group's stuck op and what the rules of :attr:`Analyzer.STUCK_RULES` read of it."""

    view: GroupView
    seq: int
    since: float  # its first issue
    src: str  # where its T came from ("failed": stuck because it failed)
    op: str
    t_op: float  # its T
    waiting: list[int]  # members inside it
    missing: list[int]  # members that never issued it
    elsewhere: dict[int, tuple[str, int]]  # missing members inside another group's op
    views: dict[str, GroupView]
    stuck: dict[str, tuple[int, float, str]]  # every group's stuck op: (seq, since, src)
    by_rank: dict[int, RingSnapshot]
    now: float


class Analyzer:
    """Stateful across passes: the learned baselines and the findings already said."""

    def __init__(
        self,
        *,
        stuck_s: float = 0.0,
        floor_s: float = 2.0,
        k: float = 10.0,
        straggler_s: float = 1.0,
        min_growth_s: float = 0.005,
        warmup_ops: int = 5,
        baseline_ops: int = 30,
        window_ops: int = 12,
        alive: Callable[[RingSnapshot], bool | None] | None = None,
        node: str | None = None,
        state: Callable[[RingSnapshot], tuple[str, int] | None] | None = None,
        stuck_cap_s: float = 0.0,
    ) -> None:
        self.stuck_s, self.floor_s, self.k = stuck_s, floor_s, k
        # T at most this (0: no cap). A hang verdict's: the heartbeats already said the job is
        # stuck, so an op held past the floor is stuck there, however slow the learned T
        self.stuck_cap_s = stuck_cap_s
        self.straggler_s, self.min_growth_s = straggler_s, min_growth_s
        self.warmup_ops, self.baseline_ops, self.window_ops = warmup_ops, baseline_ops, window_ops
        self.node = node or os.environ.get("BOOTSEER_NODE") or os.uname().nodename
        self.alive = alive or self._same_node_alive
        self.state = state or self._same_node_state
        self.said: set[tuple[Any, ...]] = set()
        self.findings: list[Finding] = []
        self._baseline: dict[str, tuple[float, float]] = {}  # group -> (interval, bytes/s)
        self._slow: dict[str, bool] = {}  # group in a slow episode -> a rank was named
        self._candidate: dict[str, LagGrowth] = {}  # slowed group -> the rank to confirm
        self._wire_base: dict[str, float] = {}  # group -> an op's baseline time on the wire
        self._mismatched: dict[str, int] = {}  # group -> the first mismatched sequence
        self.grid: dict[str, dict[int, str]] = {}  # group display -> rank -> state
        # rank -> the time its ring was read (a shipped window's): what it did after that is
        # unknown, so it is not "never issued" an op the others issued after (:mod:`.ship`)
        self.seen_until: dict[int, float] = {}

    # -- one pass --------------------------------------------------------------------------
    def analyze(self, snaps: list[RingSnapshot], now: float | None = None) -> list[Finding]:
        """New findings from these snapshots (also kept in :attr:`findings`)."""
        now = time.time() if now is None else now
        by_rank = {s.rank: s for s in snaps}
        views = group_views(snaps)
        new: list[Finding] = []
        self.grid = {}
        for view in views.values():
            self.grid[view.display] = self._states(view, by_rank, now)
            new += self._mismatches(view, by_rank, now)
            new += self._stragglers(view, by_rank, now)
        new += self._stuck(views, by_rank, now)
        slow = [f for view in views.values() for f in self._slowdown(view, views, by_rank, now)]
        if any(f.ranks for f in slow):  # a group slowed by a rank slows the groups after it:
            slow = [f for f in slow if f.ranks]  # those issue together, the cause is named
        new += slow
        for f in new:
            for r in f.ranks:
                for g in [f.group] if f.group in self.grid else []:
                    self.grid[g][r] = "root"
        self.findings += new
        return new

    def threshold(self, view: GroupView, op: str) -> tuple[float, str]:
        """T for ``op`` in this group and where it comes from."""
        if self.stuck_s > 0:
            return self.stuck_s, "configured"
        t, src = self._unconfigured_threshold(view, op)
        if 0 < self.stuck_cap_s < t:
            return self.stuck_cap_s, "incident"
        return t, src

    def _unconfigured_threshold(self, view: GroupView, op: str) -> tuple[float, str]:
        durations = [
            o.t_done - o.t_issue
            for ops in view.ops.values()
            for o in ops.values()
            if o.op == op and o.t_done is not None and not o.failed
        ]
        if len(durations) < 3:
            return self.floor_s * 5, "initial"
        return max(self.k * statistics.median(durations), self.floor_s), "learned"

    # -- states for the grid ---------------------------------------------------------------
    def _same_node_alive(self, snap: RingSnapshot) -> bool | None:
        """Liveness of a ring's process when it runs on this node (else unknown)."""
        if snap.node and snap.node != self.node:
            return None
        return pid_alive(snap.pid)

    def _same_node_state(self, snap: RingSnapshot) -> tuple[str, int] | None:
        """The process state of a ring's rank when it runs on this node (else unknown)."""
        if snap.node and snap.node != self.node:
            return None
        return proc_state(snap.pid)

    def _states(
        self, view: GroupView, by_rank: dict[int, RingSnapshot], now: float
    ) -> dict[int, str]:
        top = max((view.last_issued(r) for r in view.members), default=0)
        states: dict[int, str] = {}
        for r in view.members:
            snap = by_rank.get(r)
            if snap is None:
                states[r] = "unseen"
                continue
            o = view.in_progress(r)
            last = view.ops.get(r, {}).get(view.last_issued(r))
            if o is not None:
                t, _ = self.threshold(view, o.op)
                state = "stuck" if now - o.t_issue > t else "in_op"
                if self.alive(snap) is False:
                    state = "dead"
            elif last is not None and last.failed:
                state = "failed"
            elif view.last_issued(r) < top:
                state = "behind"
            else:
                state = "idle"
            states[r] = state
        return states

    # -- findings --------------------------------------------------------------------------
    def _new(self, key: tuple[Any, ...], finding: Finding) -> list[Finding]:
        if key in self.said:
            return []
        self.said.add(key)
        return [finding]

    def _where(self, rank: int, by_rank: dict[int, RingSnapshot]) -> str:
        snap = by_rank.get(rank)
        return f"rank {rank} ({snap.node})" if snap is not None and snap.node else f"rank {rank}"

    def _mismatches(
        self, view: GroupView, by_rank: dict[int, RingSnapshot], now: float
    ) -> list[Finding]:
        found: list[Finding] = []
        seqs = sorted({s for ops in view.ops.values() for s in ops})[-64:]
        for seq in seqs:
            sigs = {r: _signature(ops[seq]) for r, ops in view.ops.items() if seq in ops}
            if len(sigs) < 2 or len(set(sigs.values())) == 1:
                continue
            if not _one_run(view, seq, list(sigs), by_rank):
                continue  # a relaunched rank's new ring beside a dead one's: not one run
            count = Counter(sigs.values())
            (major, n_major), *rest = count.most_common()
            tie = bool(rest) and rest[0][1] == n_major
            everyone = len(sigs) == len(view.members)
            if not everyone and (
                tie or now - min(view.ops[r][seq].t_issue for r in sigs) < 2 * self.straggler_s
            ):
                continue  # wait for the others: the one still to come may break the tie
            if tie:  # everyone issued it and no side is the odd one out: all named
                odd = tuple(sorted(sigs))
            else:
                odd = tuple(sorted(r for r, s in sigs.items() if s != major))
            desc = "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: {_sig_text(sig)}"
                for sig, rs in _by_value(sigs).items()
            )
            who = ", ".join(self._where(r, by_rank) for r in odd)
            line = (
                f"mismatched collectives at #{seq} in group {view.display}: {who} differ ({desc})"
            )
            self._mismatched.setdefault(view.name, seq)
            found += self._new(
                ("mismatch", view.name, seq),
                Finding(
                    "mismatch",
                    view.display,
                    odd,
                    sigs[odd[0]][0],
                    seq,
                    line,
                    now,
                    {"signatures": {str(r): _sig_text(s) for r, s in sigs.items()}},
                ),
            )
            break  # the first mismatch is the cause; later sequence numbers follow from it
        return found

    def _stragglers(
        self, view: GroupView, by_rank: dict[int, RingSnapshot], now: float
    ) -> list[Finding]:
        if len(view.members) < 3:
            return []  # with two ranks "the others" is one rank: a wait is not a straggler
        found: list[Finding] = []
        seqs = sorted({s for ops in view.ops.values() for s in ops})[-64:]
        for seq in seqs:
            if seq <= STRAGGLER_WARMUP_OPS:
                continue  # the first ops follow the group's creation: uneven by nature
            issued = {
                r: view.ops[r][seq].t_issue for r in view.members if seq in view.ops.get(r, {})
            }
            if len(issued) < len(view.members):
                continue
            order = sorted(issued, key=issued.get)
            lag = issued[order[-1]] - issued[order[-2]]
            if lag <= self.straggler_s:
                continue
            r = order[-1]
            op = view.ops[r][seq].op
            line = (
                f"{self._where(r, by_rank)} started {op} #{seq} in group {view.display} "
                f"{lag:.1f} s after the others (straggler)"
            )
            found += self._new(
                ("straggler", view.name, seq),
                Finding(
                    "straggler",
                    view.display,
                    (r,),
                    op,
                    seq,
                    line,
                    now,
                    {"lag_s": round(lag, 3), "issued": {str(k): v for k, v in issued.items()}},
                ),
            )
        return found

    def _stuck(
        self, views: dict[str, GroupView], by_rank: dict[int, RingSnapshot], now: float
    ) -> list[Finding]:
        """Stuck ops (past T, or failed) and their root cause, following waits across groups:
        a deadlock among the waits is the verdict; else each group's stuck op goes through
        :attr:`STUCK_RULES` in order, and the first rule that answers says what it is."""
        stuck = self._stuck_ops(views, now)
        if not stuck:
            return []
        waits, inside = self._waits(views, stuck)
        cycle = _cycle({r: set(e) for r, e in waits.items()})
        if cycle and any(
            waits[a][b] == (name, stuck[name][0])
            for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)
            for name in stuck
        ):
            return self._deadlock(cycle, waits, views, by_rank, now)
        found: list[Finding] = []
        for name, (seq, since, src) in stuck.items():
            case = self._stuck_case(views, stuck, inside, name, seq, since, src, by_rank, now)
            for _, rule in self.STUCK_RULES:
                said = rule(self, case)
                if said is not None:
                    found += said
                    break
        return found

    def _stuck_ops(
        self, views: dict[str, GroupView], now: float
    ) -> dict[str, tuple[int, float, str]]:
        """Per group, its oldest op past T (or failed): (seq, since, where T came from)."""
        stuck: dict[str, tuple[int, float, str]] = {}  # group -> (seq, since, threshold from)
        for view in views.values():
            for r in view.members:
                o = view.in_progress(r)
                if o is not None:
                    t, src = self.threshold(view, o.op)
                    # held as long as it was seen in progress: a window shipped before the op
                    # could pass T (its node stopped shipping) does not make it stuck, and
                    # must not hide the op the others are stuck in after it
                    if min(now, self.seen_until.get(r, now)) - o.t_issue > t:
                        old = stuck.get(view.name)
                        if old is None or o.seq < old[0]:
                            stuck[view.name] = (
                                o.seq,
                                min(o.t_issue, old[1]) if old else o.t_issue,
                                src,
                            )
            failed = [o for ops in view.ops.values() for o in ops.values() if o.failed]
            if failed and view.name not in stuck:
                first = min(failed, key=lambda o: o.seq)
                stuck[view.name] = (first.seq, first.t_issue, "failed")
        return stuck

    @staticmethod
    def _waits(
        views: dict[str, GroupView], stuck: dict[str, tuple[int, float, str]]
    ) -> tuple[dict[int, dict[int, tuple[str, int]]], dict[int, tuple[str, int]]]:
        """Wait-for edges over every op in progress, stuck or not yet: a rank inside an op ->
        the members that never issued it; and per rank the oldest op it waits in. Why not
        only the stuck ops: the two sides of a deadlock pass T at different times, and a rank
        waiting in the other side's op is blocked, not the cause (not "never issued")."""
        waits: dict[int, dict[int, tuple[str, int]]] = defaultdict(dict)
        inside: dict[int, tuple[str, int]] = {}  # rank -> the oldest op it waits in
        for view in views.values():
            for r in view.members:
                o = view.in_progress(r)
                seq = o.seq if o is not None else None
                if (
                    view.name in stuck
                    and stuck[view.name][0] in view.ops.get(r, {})
                    and view.ops[r][stuck[view.name][0]].failed
                ):
                    seq = stuck[view.name][0]  # failed in the stuck op: waited there
                if seq is None:
                    continue
                t = view.ops[r][seq].t_issue
                if r not in inside or t < views[inside[r][0]].ops[r][inside[r][1]].t_issue:
                    inside[r] = (view.name, seq)
                for m in view.members:
                    if view.last_issued(m) < seq:
                        waits[r].setdefault(m, (view.name, seq))
        return waits, inside

    def _stuck_case(
        self,
        views: dict[str, GroupView],
        stuck: dict[str, tuple[int, float, str]],
        inside: dict[int, tuple[str, int]],
        name: str,
        seq: int,
        since: float,
        src: str,
        by_rank: dict[int, RingSnapshot],
        now: float,
    ) -> _StuckCase:
        view = views[name]
        missing = [m for m in view.members if view.last_issued(m) < seq]
        op = next(o.op for ops in view.ops.values() for s, o in ops.items() if s == seq)
        return _StuckCase(
            view=view,
            seq=seq,
            since=since,
            src=src,
            op=op,
            t_op=self.threshold(view, op)[0],
            waiting=[
                r
                for r in view.members
                if seq in view.ops.get(r, {}) and view.ops[r][seq].t_done is None
            ],
            missing=missing,
            # a missing rank inside another group's op is blocked there
            elsewhere={m: inside[m] for m in missing if m in inside and inside[m][0] != name},
            views=views,
            stuck=stuck,
            by_rank=by_rank,
            now=now,
        )

    # -- the rules for one stuck op, in the order of STUCK_RULES ---------------------------
    # Each returns None when it does not apply (the next rule is asked), else what it says
    # (an empty list: nothing, and no later rule is asked).

    def _after_a_mismatch(self, c: _StuckCase) -> list[Finding] | None:
        """A mismatch in the group before this op: said, and the cause of what follows."""
        return [] if self._mismatched.get(c.view.name, c.seq + 1) <= c.seq else None

    def _missing_unseen(self, c: _StuckCase) -> list[Finding] | None:
        """A missing rank whose ring was last read before the op could pass T after its first
        issue (a window its node stopped shipping): its progress is unknown, not "never
        issued"; what is known is said, naming nobody."""
        unseen = [
            m for m in c.missing if m in self.seen_until and self.seen_until[m] < c.since + c.t_op
        ]
        if unseen and c.now - c.since > c.t_op:
            return self._unseen(c.view, c.seq, c.op, c.since, c.waiting, unseen, c.by_rank, c.now)
        return None

    def _missing_stalled_elsewhere(self, c: _StuckCase) -> list[Finding] | None:
        """A missing rank still inside an op of another group its peers completed, having
        issued nothing since: stalled there, and named there (that group and op) once held
        past the shorter of the two ops' T, whether or not that op passed its own T yet."""
        views = c.views
        stalls = {
            m: h
            for m, (g, q) in c.elsewhere.items()
            if (h := self._stall_held(views[g], m, q, c.by_rank, c.now)) is not None
        }
        if not stalls:
            return None
        found: list[Finding] = []
        for m, h in stalls.items():
            g, q = c.elsewhere[m]
            t_g = self.threshold(views[g], views[g].ops[m][q].op)[0]
            if h > min(c.t_op, t_g):
                found += self._stall(
                    views[g], q, [m], h, c.by_rank, c.now, blocked=(c.view, c.seq, c.waiting)
                )
        return found

    def _missing_blocked_elsewhere(self, c: _StuckCase) -> list[Finding] | None:
        """A missing rank inside another group's op is blocked there: the cause is said in
        that group once its op passes T; said here only with that context, and only if that
        op stays short of T for long (2 x this op's T)."""
        if c.elsewhere and (
            any(g in c.stuck for g, _ in c.elsewhere.values()) or c.now - c.since < 2 * c.t_op
        ):
            return []
        return None

    def _never_issued(self, c: _StuckCase) -> list[Finding] | None:
        """Members that never issued the op the others wait in. Stuck only because the op
        failed (a member died in it) and not yet held past T: a member that has not issued it
        yet is not late; who died in it comes first, and once that is said, members arriving
        late to a failed op are not the cause."""
        view, seq, op, missing, by_rank = c.view, c.seq, c.op, c.missing, c.by_rank
        held = c.now - c.since
        late = c.src != "failed" or held > c.t_op
        if not (missing and late and ("died", view.name, seq) not in self.said):
            return None
        gone = [m for m in missing if m in by_rank and self.alive(by_rank[m]) is False]
        why = {
            m: (
                "its process is gone"
                if m in gone
                else "no ring from it"
                if m not in by_rank
                else "busy outside collectives"
            )
            for m in missing
        }
        line = (
            f"{', '.join(self._where(m, by_rank) for m in missing)} never issued "
            f"{op} #{seq} in group {view.display}; {len(c.waiting)} rank"
            f"{'s' if len(c.waiting) != 1 else ''} wait in it since {held:.1f} s"
        )
        if gone:
            line += f" ({_ranks(gone)}: process gone)"
        for m, (g, q) in c.elsewhere.items():
            why[m] = f"inside {c.views[g].ops[m][q].op} #{q} of group {c.views[g].display}"
            line += f" ({_ranks([m])}: {why[m]})"
        return self._new(
            ("never_issued", view.name, seq, tuple(missing)),
            Finding(
                "never_issued",
                view.display,
                tuple(missing),
                op,
                seq,
                line,
                c.now,
                {
                    "waiting": c.waiting,
                    "since": c.since,
                    "held_s": round(held, 3),
                    "threshold_from": c.src,
                    "why": {str(k): v for k, v in why.items()},
                    "pids": {str(m): by_rank[m].pid for m in missing if m in by_rank},
                },
            ),
        )

    def _issued_not_done(self, c: _StuckCase) -> list[Finding] | None:
        """Everyone needed issued it and it never completed: a member that died in it (its
        process gone, or never completing while others failed), else one stalled in it past
        T, else, when nobody completed it at all, the transport between them."""
        view, seq, op, by_rank, now = c.view, c.seq, c.op, c.by_rank, c.now
        issued = {r: view.ops[r][seq] for r in view.members if seq in view.ops.get(r, {})}
        never_done = [r for r, o in issued.items() if o.t_done is None]
        failed = [r for r, o in issued.items() if o.failed]
        dead = [r for r in never_done if r in by_rank and self.alive(by_rank[r]) is False]
        culprits = dead or (never_done if failed and never_done else [])
        stalls = {
            r: h
            for r in never_done
            if not culprits
            and (h := self._stall_held(view, r, seq, by_rank, now)) is not None
            and h > c.t_op
        }
        if culprits:
            line = (
                f"{', '.join(self._where(r, by_rank) for r in culprits)} died in {op} "
                f"#{seq} in group {view.display} (issued, never completed"
                f"{', process gone' if dead else ''}); {len(failed)} rank"
                f"{'s' if len(failed) != 1 else ''} failed in it"
            )
            return self._new(
                ("died", view.name, seq),
                Finding(
                    "died",
                    view.display,
                    tuple(culprits),
                    op,
                    seq,
                    line,
                    now,
                    {
                        "failed": failed,
                        "never_completed": never_done,
                        "since": c.since,
                        "pids": {str(r): by_rank[r].pid for r in culprits if r in by_rank},
                    },
                ),
            )
        if stalls:
            return self._stall(view, seq, list(stalls), max(stalls.values()), by_rank, now)
        if not c.missing and len(never_done) == len(view.members):
            return self._transport(view, seq, op, c.since, never_done, by_rank, now)
        return []

    #: What a stuck op is, asked in this order; the first rule that answers decides.
    STUCK_RULES: tuple[tuple[str, Callable[[Analyzer, _StuckCase], list[Finding] | None]], ...] = (
        ("after_a_mismatch", _after_a_mismatch),
        ("missing_unseen", _missing_unseen),
        ("missing_stalled_elsewhere", _missing_stalled_elsewhere),
        ("missing_blocked_elsewhere", _missing_blocked_elsewhere),
        ("never_issued", _never_issued),
        ("issued_not_done", _issued_not_done),
    )

    def _stall_held(
        self, view: GroupView, rank: int, seq: int, by_rank: dict[int, RingSnapshot], now: float
    ) -> float | None:
        """How long ``rank`` has been inside op ``seq`` of this group since the last of its
        peers that completed it did (as of its ring's last reading), when it has issued
        nothing after it in any group; None when no peer completed it, or the rank went on.
        Why: a gloo all_reduce of two ranks can complete on the peer whose data all arrived
        while the other was stopped inside it; that peer then waits in its next op (another
        group's), for a rank that is nowhere "never issued" and in no op issued everywhere
        and completed nowhere (2 of 23 trials got no verdict before this)."""
        mine = view.ops.get(rank, {}).get(seq)
        snap = by_rank.get(rank)
        if mine is None or mine.t_done is not None or snap is None:
            return None
        done = [
            o.t_done
            for m in view.members
            if m != rank
            and (o := view.ops.get(m, {}).get(seq)) is not None
            and o.t_done is not None
            and not o.failed
        ]
        if not done or any(o.t_issue > mine.t_issue for o in snap.ops if o is not mine):
            return None
        return min(now, self.seen_until.get(rank, now)) - max(done)

    def _stall(
        self,
        view: GroupView,
        seq: int,
        ranks: list[int],
        held: float,
        by_rank: dict[int, RingSnapshot],
        now: float,
        blocked: tuple[GroupView, int, list[int]] | None = None,
    ) -> list[Finding]:
        """Ranks still inside op ``seq`` of this group ``held`` seconds after their peers
        completed it, having issued nothing since: the cause, named in this group and op
        (with their process state where their node read it, and the op of another group
        whose ranks wait on them, ``blocked``)."""
        o = view.ops[ranks[0]][seq]
        done = sorted(
            m
            for m in view.members
            if m not in ranks
            and (p := view.ops.get(m, {}).get(seq)) is not None
            and p.t_done is not None
            and not p.failed
        )
        procs = {r: st for r in ranks if r in by_rank and (st := self.state(by_rank[r]))}
        frozen = [r for r in ranks if r in procs and procs[r][0] in ("T", "t", "D")]
        if frozen and len(frozen) < len(ranks):
            ranks = frozen  # the others inside it with them are waiting, not frozen
        line = (
            f"{', '.join(self._where(r, by_rank) for r in ranks)} still inside {o.op} "
            f"#{seq} of group {view.display} {held:.1f} s after rank"
            f"{'s' if len(done) != 1 else ''} {_ranks(done)} completed it, and issued "
            "nothing since"
        )
        for r in ranks:
            if r in procs and procs[r][0] in _STATE_TEXT:
                line += f" ({r}: {_STATE_TEXT[procs[r][0]]}, state {procs[r][0]})"
        ev: dict[str, Any] = {
            "completed": done,
            "held_s": round(held, 3),
            "proc": {str(r): {"state": st, "cpu_ticks": cpu} for r, (st, cpu) in procs.items()},
        }
        if blocked is not None:
            other, other_seq, waiting = blocked
            line += (
                f"; {len(waiting)} rank{'s' if len(waiting) != 1 else ''} wait on it in "
                f"{other.ops[waiting[0]][other_seq].op} #{other_seq} of group "
                f"{other.display}"
                if waiting
                else ""
            )
            ev["blocks"] = {"group": other.display, "seq": other_seq, "waiting": waiting}
        return self._new(
            ("stalled", view.name, seq, tuple(ranks)),
            Finding("stalled", view.display, tuple(ranks), o.op, seq, line, now, ev),
        )

    def _unseen(
        self,
        view: GroupView,
        seq: int,
        op: str,
        since: float,
        waiting: list[int],
        unseen: list[int],
        by_rank: dict[int, RingSnapshot],
        now: float,
    ) -> list[Finding]:
        """Ranks wait in an op that others were last seen before: their window stopped
        coming (their node's link, or its agent). Nobody is named: the controller's link
        probe tells a slow link from a busy agent."""
        held = now - since
        nodes = {str(m): by_rank[m].node if m in by_rank else "" for m in unseen}
        ages = {str(m): round(now - self.seen_until[m], 1) for m in unseen}
        who = ", ".join(
            f"{self._where(m, by_rank)} (last seen {ages[str(m)]:.1f} s ago)" for m in unseen
        )
        line = (
            f"{op} #{seq} in group {view.display}: {len(waiting)} rank"
            f"{'s' if len(waiting) != 1 else ''} wait in it since {held:.1f} s; no ring "
            f"of {who} read since before it: progress unknown (its node's link or agent)"
        )
        return self._new(
            ("unseen", view.name, seq, tuple(unseen)),
            Finding(
                "unseen",
                view.display,
                (),
                op,
                seq,
                line,
                now,
                {
                    "waiting": waiting,
                    "since": since,
                    "held_s": round(held, 3),
                    "nodes": nodes,
                    "seen_ago_s": ages,
                },
            ),
        )

    def _transport(
        self,
        view: GroupView,
        seq: int,
        op: str,
        since: float,
        never_done: list[int],
        by_rank: dict[int, RingSnapshot],
        now: float,
    ) -> list[Finding]:
        """Issued everywhere, completed nowhere: the transport or a peer. A rank whose process
        is stopped (T, t) or in uninterruptible sleep (D) while the others are not is the
        likely peer, named; else none (gloo shows no per-peer progress)."""
        held = now - since
        procs = {
            r: st for r in never_done if r in by_rank and (st := self.state(by_rank[r])) is not None
        }
        frozen = sorted(r for r, (st, _) in procs.items() if st in ("T", "t", "D"))
        if len(frozen) == len(never_done):
            frozen = []  # all of them: nothing tells one apart
        line = (
            f"{op} #{seq} in group {view.display} issued by all {len(never_done)} ranks, "
            f"completed by none for {held:.1f} s: "
        )
        if frozen:
            line += ", ".join(
                f"{self._where(r, by_rank)} is "
                f"{_STATE_TEXT.get(procs[r][0], procs[r][0])} (state "
                f"{procs[r][0]}) while the others wait: the likely peer"
                for r in frozen
            )
        else:
            line += "transport or peer"
        return self._new(
            ("transport", view.name, seq, tuple(frozen)),
            Finding(
                "transport",
                view.display,
                tuple(frozen),
                op,
                seq,
                line,
                now,
                {
                    "since": since,
                    "held_s": round(held, 3),
                    "proc": {
                        str(r): {"state": st, "cpu_ticks": cpu} for r, (st, cpu) in procs.items()
                    },
                },
            ),
        )

    def _deadlock(
        self,
        cycle: list[int],
        waits: dict[int, dict[int, tuple[str, int]]],
        views: dict[str, GroupView],
        by_rank: dict[int, RingSnapshot],
        now: float,
    ) -> list[Finding]:
        """Ranks wait in each other's groups: each side's op, and who never issued it. The
        named rank(s): the smallest side (the odd order), all of them on a tie."""
        sides: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            name, seq = waits[a][b]
            view = views[name]
            waiting = sorted(
                m
                for m in view.members
                if seq in view.ops.get(m, {})
                and (view.ops[m][seq].t_done is None or view.ops[m][seq].failed)
            )
            missing = sorted(m for m in view.members if view.last_issued(m) < seq)
            sides[(name, seq)] = (waiting, missing)
        parts = []
        for (name, seq), (waiting, missing) in sides.items():
            op = views[name].ops[waiting[0]][seq].op
            parts.append(
                f"{', '.join(self._where(r, by_rank) for r in waiting)} wait"
                f"{'s' if len(waiting) == 1 else ''} in {op} #{seq} of group "
                f"{views[name].display}, which {_ranks(missing)} never issued"
            )
        smallest = min(len(m) for _, m in sides.values())
        named = sorted({r for _, m in sides.values() if len(m) == smallest for r in m})
        (name, seq), (waiting, _) = next(iter(sides.items()))
        line = "deadlock: " + "; ".join(parts)
        return self._new(
            ("deadlock", tuple(sorted(sides))),
            Finding(
                "deadlock",
                views[name].display,
                tuple(named),
                views[name].ops[waiting[0]][seq].op,
                seq,
                line,
                now,
                {
                    "sides": {
                        f"{views[n].display}#{q}": {"waiting": w, "missing": m}
                        for (n, q), (w, m) in sides.items()
                    }
                },
            ),
        )

    def _slowdown(
        self,
        view: GroupView,
        views: dict[str, GroupView],
        by_rank: dict[int, RingSnapshot],
        now: float,
    ) -> list[Finding]:
        """Interval doubled or throughput halved against the group's baseline. Named: the rank
        whose lag behind each op's first issue grew past its own baseline lag and well past
        the others' growth, in this group or another group of its members (ops right after a
        slowed rank's op issue together: the lag shows in the first). Why per rank against
        its own baseline: a rank that habitually issues late is not a straggler, and on a
        loaded machine one rank's CPU hog slows every rank. Else none: "load on all ranks"
        (the time between ops grew) or "transport (link) or peer" (an op's time once all
        issued it grew, or throughput halved with the interval kept)."""
        complete = _complete(view)
        if len(complete) < self.warmup_ops + self.baseline_ops:
            return []
        starts = {s: max(view.ops[r][s].t_issue for r in view.ops) for s in complete}
        nbytes = {s: max(view.ops[r][s].nbytes for r in view.ops) for s in complete}
        if view.name not in self._baseline:
            base = complete[self.warmup_ops : self.warmup_ops + self.baseline_ops]
            self._baseline[view.name] = _rate(base, starts, nbytes)
            self._wire_base[view.name] = _wire(view, base)
        interval0, tput0 = self._baseline[view.name]
        recent = complete[-self.window_ops :]
        if recent[0] <= complete[self.warmup_ops + self.baseline_ops - 1]:
            return []
        interval, tput = _rate(recent, starts, nbytes)
        slow = interval > 2 * interval0 or (tput0 > 0 and tput < tput0 / 2)
        if not slow:
            if interval < 1.5 * interval0:
                self._slow.pop(view.name, None)
            self._candidate.pop(view.name, None)
            return []
        if self._slow.get(view.name):
            return []  # said, with its rank, in this slow episode
        members = set(view.members)
        growths = [
            (g, other)
            for other in views.values()
            if set(other.members) == members and (g := self._lag_growth(other)) is not None
        ]
        # the group where one rank's lag grew the most past the others' (ops right after a
        # slowed rank's op issue together: its lag shows in the first group of the step)
        g, where = max(growths, key=lambda x: x[0].margin) if growths else (None, view)
        added = interval - interval0
        # a rank is named only when the ops really come slower (the interval up by half at
        # least), its own lag grew past its baseline by at least half of the added time and
        # by twice the most any other rank's grew: a rank that habitually issues late (its
        # place in the pipeline, a slower node) keeps its baseline lag; load on the machine
        # slows every rank alike. A throughput drop with the interval kept is the transport's
        passes = (
            g is not None
            and interval > 1.5 * interval0
            and g.growth > 0.5 * added
            and g.growth > max(2 * g.others, self.min_growth_s)
        )
        # and only when the ops issued since it passed confirm it (its lag, against the same
        # baseline, the largest and over twice the others'): a slowdown that starts on every
        # rank (a hog takes a core of two) must not blame a lag that the machine gave another
        # rank in the ops just before it
        cand = self._candidate.pop(view.name, None)
        named = False
        if passes and g is not None:
            if cand is None or cand.rank != g.rank or cand.group != g.group:
                cand = g
            else:
                confirmed = self._confirmed(cand, views[cand.group])
                named = confirmed is True
                if confirmed is False:
                    cand = g  # not borne out: what passes now is the one to confirm
            if not named:
                self._candidate[view.name] = cand
        pending = passes and not named  # a rank to confirm: the slowdown is said, no rank
        ev = {
            "interval_s": round(interval, 4),
            "baseline_interval_s": round(interval0, 4),
            "bytes_per_s": round(tput),
            "baseline_bytes_per_s": round(tput0),
            "window_ops": len(recent),
            "lagging": {} if g is None else {**g.doc(), "group": where.display},
        }
        ratio = interval / interval0 if interval0 > 0 else float("inf")
        op = next(iter(view.ops.values()))[recent[-1]].op
        said = self._slow.get(view.name)
        self._slow[view.name] = named
        if said is not None and not named:
            return []  # said already in this episode (naming nobody); a rank may still follow
        if named and g is not None:
            line = (
                f"{self._where(g.rank, by_rank)} slows group {view.display}: its lag behind "
                f"the first issue"
                + (f" in group {where.display}" if where is not view else "")
                + f" grew from {g.base * 1e3:.0f} ms (its baseline) to "
                f"{g.recent * 1e3:.0f} ms over the last {g.window} ops, the others' by "
                f"{max(g.others, 0.0) * 1e3:.0f} ms at most; op interval {ratio:.1f}x its "
                f"baseline"
            )
            return [Finding("slow", view.display, (g.rank,), op, recent[-1], line, now, ev)]
        wire0, wire = self._wire_base[view.name], _wire(view, recent)
        ev["wire_s"], ev["baseline_wire_s"] = round(wire, 4), round(wire0, 4)
        if pending and g is not None:  # (one pass of a fresh analyzer, as the controller's
            ev["cause"] = "unconfirmed"  # is, never confirms: its suspicion is this line)
            line = (
                f"group {view.display} slowed: op interval {ratio:.1f}x its baseline; "
                f"{self._where(g.rank, by_rank)}'s lag grew, not yet borne out by the "
                f"ops after it: no rank named yet"
            )
        elif wire - wire0 > 0.5 * max(added, 0.0) or interval <= 1.5 * interval0:
            ev["cause"] = "transport"
            line = (
                f"group {view.display} slowed: op interval {ratio:.1f}x its baseline, ops "
                f"issued together by all ranks: transport (link) or peer"
            )
        else:
            ev["cause"] = "load"
            line = (
                f"group {view.display} slowed: op interval {ratio:.1f}x its baseline, no "
                f"rank's lag grew past the others': load on all ranks (or a link)"
            )
        return [Finding("slow", view.display, (), op, recent[-1], line, now, ev)]

    def _lag_growth(self, view: GroupView) -> LagGrowth | None:
        """Per rank, its lag behind the group's first issue of each op: the median over the
        last ``window_ops`` complete ops against the median over the ``baseline_ops`` before
        them (its recent baseline, after the warm-up: a rank the machine made late before
        the slowdown keeps that lag in its baseline); the rank whose lag grew most, and the
        most any other rank's grew. None before the window is past the first baseline."""
        complete = _complete(view)
        if (
            len(complete) < self.warmup_ops + self.baseline_ops + self.window_ops
            or len(view.ops) < 2
        ):
            return None
        recent = complete[-self.window_ops :]
        base = _lags(view, complete[-self.window_ops - self.baseline_ops : -self.window_ops])
        now_lags = _lags(view, recent)
        growth = {r: now_lags[r] - base.get(r, 0.0) for r in now_lags}
        rank = max(growth, key=growth.__getitem__)
        others = max((v for r, v in growth.items() if r != rank), default=0.0)
        return LagGrowth(
            rank,
            growth[rank],
            others,
            base.get(rank, 0.0),
            now_lags[rank],
            len(recent),
            view.name,
            recent[-1],
            base,
        )

    def _confirmed(self, cand: LagGrowth, view: GroupView) -> bool | None:
        """Whether the ops after ``cand``'s window bear it out (None: too few yet, a quarter
        of a window): its lag over them against its baseline grew the most, past the floor
        and past twice any other rank's growth."""
        new = [s for s in _complete(view) if s > cand.last]
        if len(new) < max(2, self.window_ops // 4):
            return None
        lags = _lags(view, new)
        growth = {r: v - cand.base_all.get(r, 0.0) for r, v in lags.items()}
        others = max((v for r, v in growth.items() if r != cand.rank), default=0.0)
        return growth.get(cand.rank, 0.0) > max(2 * others, self.min_growth_s)


@dataclass
class LagGrowth:
    """One group's per-rank lag growth: the rank whose lag grew most, by how much, and the
    most any other rank's lag grew (negative when theirs shrank)."""

    rank: int
    growth: float
    others: float
    base: float
    recent: float
    window: int
    group: str = ""  # the group's torch name
    last: int = 0  # the window's last sequence number
    base_all: dict[int, float] = field(default_factory=dict)  # every rank's baseline lag

    @property
    def margin(self) -> float:
        return self.growth - max(self.others, 0.0)

    def doc(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "lag_s": round(self.recent, 4),
            "baseline_lag_s": round(self.base, 4),
            "growth_s": round(self.growth, 4),
            "others_growth_s": round(self.others, 4),
            "of": self.window,
        }


def _lags(view: GroupView, seqs: list[int]) -> dict[int, float]:
    """Per rank, the median of its issue time after the group's first issue, over ``seqs``."""
    lags: dict[int, list[float]] = defaultdict(list)
    for s in seqs:
        first = min(view.ops[r][s].t_issue for r in view.ops)
        for r in view.ops:
            lags[r].append(view.ops[r][s].t_issue - first)
    return {r: statistics.median(v) for r, v in lags.items()}


def _wire(view: GroupView, seqs: list[int]) -> float:
    """The median time an op takes once its last rank issued it (the transport's part)."""
    if not seqs:
        return 0.0
    return statistics.median(
        statistics.median(view.ops[r][s].t_done for r in view.ops)  # type: ignore[type-var]
        - max(view.ops[r][s].t_issue for r in view.ops)
        for s in seqs
    )


_STATE_TEXT = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible sleep"}


def _complete(view: GroupView) -> list[int]:
    """The sequence numbers every member issued and completed, in order."""
    if not view.ops or not set(view.ops) >= set(view.members):
        return []
    return sorted(
        s
        for s in set.intersection(*(set(o) for o in view.ops.values()))
        if all(view.ops[r][s].t_done is not None for r in view.ops)
    )


def _rate(seqs: list[int], starts: dict[int, float], nbytes: dict[int, int]) -> tuple[float, float]:
    gaps = [starts[b] - starts[a] for a, b in zip(seqs, seqs[1:], strict=False)]
    span = starts[seqs[-1]] - starts[seqs[0]]
    interval = statistics.median(gaps) if gaps else 0.0
    return interval, (sum(nbytes[s] for s in seqs[1:]) / span if span > 0 else 0.0)


#: clock skew allowed between hosts when ops are placed against another rank's ring's birth
RUN_SKEW_S = 1.0


def _one_run(view: GroupView, seq: int, ranks: list[int], by_rank: dict[int, RingSnapshot]) -> bool:
    """Whether these ranks' ops ``seq`` belong to one run of the group: each was issued
    after every other one's ring was made. Why: after a launcher restarted its ranks, the
    newest ring of a rank that has not started again is the dead process's, whose sequence
    numbers are another run's (a mismatch there would stop a healthy job); its ops all
    precede the new process's ring. Rings of unknown birth (0) are not judged."""
    born = [c for r in ranks if r in by_rank and (c := by_rank[r].created) > 0]
    if not born:
        return True
    return min(view.ops[r][seq].t_issue for r in ranks) >= max(born) - RUN_SKEW_S


def _signature(op: Op) -> tuple[str, str, int]:
    return (op.op, op.dtype, op.numel if op.op in SIZED_OPS else -1)


def _sig_text(sig: tuple[str, str, int]) -> str:
    op, dtype, numel = sig
    return f"{op} {dtype}" + (f" x{numel}" if numel >= 0 else "")


def _by_value(sigs: dict[int, Any]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = defaultdict(list)
    for r, s in sorted(sigs.items()):
        out[s].append(r)
    return out


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _cycle(waits: dict[int, set[int]]) -> list[int]:
    """A cycle in the wait-for graph (ranks in order), or []."""
    for start in sorted(waits):
        path, seen = [start], {start}
        node = start
        while True:
            nxt = sorted(n for n in waits.get(node, ()) if n in waits)
            if not nxt:
                break
            node = nxt[0]
            if node in seen:
                return path[path.index(node) :]
            path.append(node)
            seen.add(node)
    return []
