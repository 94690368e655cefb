"""Which node keeps a rank's peer copy: one that shares none of the rank's parallel groups.

Why: a failure is isolated by evicting the failure domain, often a whole parallel group
(ByteRobust evicts the PP/DP/TP group the suspects share). A copy kept on a node that hosts
another rank of the same group would be evicted with it; a node outside every group of the
rank survives that eviction. With no such node (one group spanning the job, or no layout
given) the copy goes to the neighbouring node, which survives the loss of the rank's own node.

The layout is the one ``bootseer controller --layout`` takes: ``{"dp": [[0, 1], [2, 3]],
"tp": [[0, 2], [1, 3]]}``, each dimension a list of groups of global ranks::

    servers = ["a:1", "a:1", "b:1", "b:1", "c:1", "c:1", "d:1", "d:1"]  # by rank: 4 nodes
    layout = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]],   # within a node
              "pp": [[0, 2], [1, 3], [4, 6], [5, 7]], "dp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    choose_peer(0, servers, layout)   # "d:1": a (tp), b (pp) and c (dp) share its groups
    choose_peer(0, servers, None)     # "b:1": the neighbouring node
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

Layout = Mapping[str, Sequence[Sequence[int]]]


def parse_layout(
    raw: Any, world_size: int | None = None, where: str = "the layout"
) -> dict[str, list[list[int]]] | None:
    """A checked layout from JSON text or a mapping (``""``/``None``: none); a layout that
    is not groups of ranks below ``world_size`` raises ``ValueError`` naming ``where``."""
    if raw in (None, "", {}):
        return None
    example = ' e.g. \'{"dp": [[0, 1], [2, 3]], "tp": [[0, 2], [1, 3]]}\''
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(
                f"{where} {raw!r} is not JSON ({exc}): give the job's parallel "
                f"groups as a JSON object,{example}"
            ) from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} is not a JSON object of parallel groups:{example}")
    out: dict[str, list[list[int]]] = {}
    for dim, groups in raw.items():
        if not isinstance(groups, list) or not all(
            isinstance(g, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in g)
            for g in groups
        ):
            raise ValueError(
                f"{where}: dimension {dim!r} is not a list of lists of ranks:{example}"
            )
        for g in groups:
            bad = [r for r in g if r < 0 or (world_size is not None and r >= world_size)]
            if bad:
                raise ValueError(
                    f"{where}: dimension {dim!r} names rank(s) {bad}, outside "
                    f"0..{'' if world_size is None else world_size - 1} (the "
                    f"job's world size {world_size}): give the job's own layout"
                )
        out[str(dim)] = [list(g) for g in groups]
    return out


def nodes_in_order(servers: Sequence[str]) -> list[str]:
    """The distinct node servers, in the order of their lowest rank."""
    order: list[str] = []
    for addr in servers:
        if addr and addr not in order:
            order.append(addr)
    return order


def choose_peer(rank: int, servers: Sequence[str], layout: Layout | None = None) -> str:
    """The server of the node that keeps ``rank``'s copy (``""``: no other node).

    ``servers[r]`` is the node server of rank ``r``. The first node after the rank's own (in
    node order, wrapping) that hosts no rank sharing a parallel group with ``rank``; else the
    next node."""
    mine = servers[rank] if rank < len(servers) else ""
    nodes = nodes_in_order(servers)
    if not mine or len(nodes) < 2:
        return ""
    at = nodes.index(mine)
    after = nodes[at + 1 :] + nodes[:at]
    if layout:
        partners = {r for groups in layout.values() for g in groups if rank in g for r in g}
        busy = {servers[r] for r in partners if r < len(servers)}
        for node in after:
            if node not in busy:
                return node
    return after[0]
