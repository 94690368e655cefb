"""Warm standby: spare nodes filled ahead and parked at the job's rendezvous, and the gate
that keeps an evicted node out of the job.

Why: a lost node replaced by a cold one pays the whole start-up bill (image, environment,
checkpoint) while every other node waits. A standby pays it before the loss: ``bootseer
warmup --self-check`` fills it (image hot frames, environment, the newest checkpoint's
shards) and runs the node's health checks, then it starts the same launcher as the job's
nodes. torch's c10d rendezvous (torch 2.13, ``dynamic_rendezvous.py``) parks a node that
arrives at a complete round of ``max_nodes`` in its *redundancy list*: no join timeout, not
counted by ``num_nodes_waiting`` (so the running job is not restarted for it). When a
participant is lost the standby moves to the wait list and joins the next round, which the
survivors start as soon as their collectives fail. Nothing of bootseer sits in that path.

What bootseer adds is the gate: a node that a verdict evicted must not come back as a
standby. The controller publishes its exclusion list (the file, :class:`ExclusionList`) to
the store's ``excluded`` key when it starts and at every eviction; ``bootseer warmup
--self-check`` and ``bootseer run`` (at registration) refuse an excluded node by name.

Usage::

    from bootseer.robust.standby import check_admission, pool_size, publish_exclusions

    publish_exclusions(store, ExclusionList("/var/lib/bootseer/excluded.json"), job="job")
    check_admission(store, "node-7", job="job", where="10.0.0.5:29400")  # ExcludedNode
    pool_size(1024, 0.001)     # spares for 1,024 nodes at 0.1 % loss each: P99 of losses
    rendezvous_members(store, "job")   # {"participants": [...], "redundancy": [...], ...}
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterable
from typing import Any

from . import wire
from .policy import ExclusionList

__all__ = [
    "ExcludedNode",
    "check_admission",
    "exclusion_record",
    "pool_size",
    "publish_exclusions",
    "read_exclusions",
    "rendezvous_members",
]


class ExcludedNode(RuntimeError):
    """This node is on the job's exclusion list: it must not join (nor wait as a standby)."""


def exclusion_record(
    nodes: Iterable[str], *, reasons: dict[str, str] | None = None, source: str | None = None
) -> dict[str, Any]:
    """The store's ``excluded`` record (sealed by :func:`.wire.put`): the nodes, why each
    went there, and the file they came from (so a refused node's error can name the list)."""
    doc: dict[str, Any] = {"nodes": sorted(set(nodes))}
    if reasons:
        doc["reasons"] = {n: str(r)[:200] for n, r in sorted(reasons.items()) if n in doc["nodes"]}
    if source:
        doc["list"] = source
    return doc


def read_exclusions(
    store: Any, job: str = "job", log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The store's ``excluded`` document (``{"nodes": []}`` when nobody was evicted, or when
    the record is not sealed under the job's secret or not valid: said through ``log``; a
    forged list must not keep a node out any more than it may put one in)."""
    key = wire.Keys(job).excluded
    try:
        doc = wire.read(store, key)
    except wire.WireError as exc:
        if log is not None:
            log(f"warning: {exc}")
        return {"nodes": []}
    return doc if doc is not None else {"nodes": []}


def publish_exclusions(store: Any, exclusion: ExclusionList, job: str = "job") -> list[str]:
    """Write the file's evicted nodes to the store's ``excluded`` key (what nodes read): the
    file is the list (every eviction goes into it first), so a node evicted in an earlier run
    of the job, or by an operator, is refused too, and one removed from the file after a
    repair is admitted again. Returns the nodes now excluded."""
    listed = exclusion.nodes()
    wire.put(
        store,
        wire.Keys(job).excluded,
        exclusion_record(
            listed,
            reasons={n: str(e.get("reason", "")) for n, e in listed.items()},
            source=str(exclusion.path),
        ),
    )
    return sorted(listed)


def check_admission(
    store: Any,
    node: str,
    *,
    job: str = "job",
    where: str = "",
    log: Callable[[str], None] | None = None,
) -> None:
    """Raise :class:`ExcludedNode` when ``node`` is on job ``job``'s exclusion list; the
    message names the node, the list (the store key, its address and the controller's file)
    and the reason, and says what to do."""
    doc = read_exclusions(store, job, log)
    if node not in doc["nodes"]:
        return
    key = wire.Keys(job).excluded
    place = f"store key {key}" + (f" at {where}" if where else "")
    if doc.get("list"):
        place += f", from the controller's file {doc['list']}"
    reason = doc.get("reasons", {}).get(node)
    raise ExcludedNode(
        f"node {node} is on job {job}'s exclusion list ({place})"
        + (f": evicted for {reason!r}" if reason else ": a verdict evicted it")
        + "; it must not join the job, nor wait as a standby: use another node, or repair it, "
        "remove it from the controller's file (ExclusionList.remove) and restart the "
        "controller"
    )


def pool_size(nodes: int, p_loss: float, quantile: float = 0.99) -> int:
    """Standby nodes to keep for a job of ``nodes`` nodes when each is lost with probability
    ``p_loss`` within one replacement period: the ``quantile`` of the binomial number of
    losses (ByteRobust's rule: 4 spares for 1,024 machines)."""
    if nodes < 1 or not 0 <= p_loss <= 1 or not 0 < quantile < 1:
        raise ValueError(
            f"pool_size needs nodes >= 1, 0 <= p_loss <= 1 and 0 < quantile < 1 "
            f"(got {nodes}, {p_loss}, {quantile})"
        )
    total = 0.0
    for k in range(nodes + 1):
        total += math.comb(nodes, k) * p_loss**k * (1 - p_loss) ** (nodes - k)
        if total >= quantile:
            return k
    return nodes


def rendezvous_members(store: Any, run_id: str) -> dict[str, Any] | None:
    """Who is where in torch's c10d rendezvous ``run_id`` (None before its first node):
    ``participants``, ``waiting`` (the next round's), ``redundancy`` (parked standbys), as
    node addresses, with ``round`` and ``complete``. Reads the state torch's backend keeps
    in the store; torch unpickles the same bytes in every agent, so this trusts the store
    exactly as much as torchrun does (the store must be reachable from the job only)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    got = C10dRendezvousBackend(store, run_id).get_state()
    if got is None:
        return None
    state = pickle.loads(got[0])  # noqa: S301 - torch's own format, see above

    def addresses(nodes: Iterable[Any]) -> list[str]:
        return sorted(n.addr for n in nodes)

    return {
        "round": state.round,
        "complete": state.complete,
        "participants": addresses(state.participants),
        "waiting": addresses(state.wait_list),
        "redundancy": addresses(state.redundancy_list),
    }
