"""A node's recent ring window, shipped to the job's controller, and the verdict over all nodes.

Why: the rings live in each node's shared memory, and a rank on one node waits for a rank on
another; only the controller sees every node. Each node agent (``bootseer run --controller``
with ``[colltrace] enabled``) writes a compact window of its ranks' rings into the job's c10d
store (``node/<n>/colltrace``): the last :data:`PER_GROUP` collective records per rank and
group, the group table, and each rank's process state read on its node (``/proc``: the
controller cannot see another host's processes). The controller turns every node's window
back into ring snapshots and runs the same :class:`~.analyze.Analyzer` over them.

Bounded: a window over ``limit`` bytes keeps fewer records per group (halved until it fits).
Times are each host's ``time.time()``: hosts must keep their clocks in step (NTP) for the
held times to mean anything across nodes.

Usage::

    doc = window(watch.snapshots(), node="node-1")           # on the node
    wire.put(link.store, key, doc, wire.MAX_DUMP_BYTES)      # sealed under the job secret
    found, grid = analyze_windows({"node-1": doc, "node-2": doc2})  # on the controller
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Collection
from typing import Any

from . import validate
from .analyze import Analyzer, Finding, proc_state
from .ring import DTYPES, OPS, Op, RingSnapshot, newest_per_rank

__all__ = ["PER_GROUP", "analyze_windows", "snapshots_of", "window"]

PER_GROUP = 96  # records per rank and group: T (3), a wait cycle, and the slowdown rule
# (5 warm-up + 30 baseline + 12 window ops every rank completed, though nodes ship apart)
VERSION = 1


def _op_row(op: Op) -> list[Any]:
    return [
        op.n,
        op.group,
        op.op,
        op.seq,
        op.numel,
        op.nbytes,
        op.dtype,
        round(op.t_issue, 6),
        None if op.t_done is None else round(op.t_done, 6),
        int(op.failed),
    ]


def window(
    snaps: list[RingSnapshot],
    *,
    node: str,
    per_group: int = PER_GROUP,
    limit: int = 400 << 10,
    attempt: int = 0,
) -> dict[str, Any]:
    """The compact window of this node's rings (JSON-ready), at most ``limit`` bytes."""
    import json

    states = {s.rank: proc_state(s.pid) for s in snaps}
    keep = per_group
    while True:
        ranks = []
        for s in snaps:
            by_group: dict[str, list[Op]] = defaultdict(list)
            for op in s.ops:
                if not op.p2p:
                    by_group[op.group].append(op)
            rows = [_op_row(o) for ops in by_group.values() for o in ops[-keep:]]
            st = states.get(s.rank)
            ranks.append(
                {
                    "rank": s.rank,
                    "world": s.world,
                    "pid": s.pid,
                    "head": s.head,
                    "created": s.created,
                    "state": st[0] if st else "",
                    "cpu_ticks": st[1] if st else None,
                    "groups": {g: e for g, e in s.groups.items() if g in by_group},
                    "ops": sorted(rows),
                }
            )
        doc = {
            "colltrace_window": VERSION,
            "node": node,
            "attempt": attempt,
            "time": time.time(),
            "per_group": keep,
            "ranks": ranks,
        }
        if keep <= 4 or len(json.dumps(doc)) <= limit:
            return doc
        keep //= 2


def snapshots_of(doc: dict[str, Any], node: str) -> list[RingSnapshot]:
    """Ring snapshots from a node's window; the node is the caller's (the key's), never the
    record's word. Every entry is checked as a ring's are (:mod:`.validate`: bounded counts,
    finite times, known op and dtype names, ranks within the world): a malformed rank entry
    is skipped, a malformed op row too (the rest of its rank kept)."""
    snaps = []
    ranks = doc.get("ranks") if isinstance(doc, dict) else None
    for r in ranks if isinstance(ranks, list) else []:
        got = validate.window_rank(r)
        if isinstance(got, str):
            continue
        rank, world, pid, created, head, groups = got
        ops = []
        for row in r["ops"]:
            op = validate.window_op(row, ops=OPS, dtypes=DTYPES)
            if isinstance(op, str):
                continue
            n, g, name, seq, numel, nbytes, dtype, t0, t1, failed = op
            ops.append(Op(rank, n, g, name, seq, numel, nbytes, dtype, t0, t1, failed, False, -1))
        snaps.append(
            RingSnapshot(f"{node}/rank{rank}", rank, world, pid, node, created, head, groups, ops)
        )
    return snaps


def analyze_windows(
    docs: dict[str, dict[str, Any]],
    *,
    now: float | None = None,
    analyzer: Analyzer | None = None,
    current: Collection[str] = (),
) -> tuple[list[Finding], dict[str, dict[int, str]]]:
    """The tracer's findings over every node's window (``docs``: node -> window), and the
    grid of ranks x groups. A rank's liveness and state are what its own node read (a zombie
    or a vanished pid: dead). ``analyzer``: one kept across calls (its baselines learned
    once, a candidate confirmed by later windows, a finding said once), as a node's Watch
    keeps its own; none: a fresh one, which sees only what one look shows. ``current``: the
    nodes whose window came with their answer to the incident being judged, read as of
    ``now`` (the verdict is about the state their dumps show, taken with that window): only
    a node that did not answer can be one whose progress is unknown ("unseen")."""
    snaps: list[RingSnapshot] = []
    states: dict[tuple[str, int], tuple[str, int] | None] = {}
    # a rank is known up to its window's shipping (its node's clock): a node that stopped
    # shipping (its link, its agent) is not read as a rank that never issued the next op
    seen_until: dict[int, float] = {}
    for node, doc in sorted(docs.items()):
        if not isinstance(doc, dict):
            continue
        got = snapshots_of(doc, node)
        snaps += got
        shipped = validate.finite_time(doc.get("time"))
        if node in current and shipped is not None and now is not None:
            shipped = max(shipped, now)
        kept = {s.rank for s in got}
        for r in doc.get("ranks") if isinstance(doc.get("ranks"), list) else []:
            if isinstance(r, dict) and r.get("rank") in kept:
                if shipped is not None:  # a rank moved: the newest's
                    seen_until[r["rank"]] = max(shipped, seen_until.get(r["rank"], float("-inf")))
                st = r.get("state")
                st = st if isinstance(st, str) and len(st) == 1 else ""
                ticks = r.get("cpu_ticks")
                ticks = ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else 0
                states[(node, r["rank"])] = (st, ticks) if st else None

    def state(snap: RingSnapshot) -> tuple[str, int] | None:
        return states.get((snap.node, snap.rank))

    def alive(snap: RingSnapshot) -> bool | None:
        if (snap.node, snap.rank) not in states:
            return None
        st = states[(snap.node, snap.rank)]
        return st is not None and st[0] not in ("Z", "X")

    if analyzer is None:
        analyzer = Analyzer(node="controller")
    analyzer.alive, analyzer.state = alive, state  # this call's windows say them
    analyzer.seen_until = seen_until
    try:
        found = analyzer.analyze(newest_per_rank(snaps), now)  # a rank moved: its newest ring
    except Exception as exc:  # noqa: BLE001 - the windows are checked (.validate); values
        # the analysis did not foresee cost this verdict's colltrace part, never the caller
        print(
            f"bootseer: colltrace: warning: the analysis of the shipped windows failed "
            f"({type(exc).__name__}: {exc}): no colltrace verdict this time",
            file=sys.stderr,
            flush=True,
        )
        return [], {}
    return found, analyzer.grid
