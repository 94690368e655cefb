"""torch's Flight Recorder as a second source: its buffer, read in the process, as a
:class:`~.ring.RingSnapshot` the analysis takes like a ring.

What works here (torch 2.13, CPU build, gloo): with ``TORCH_FR_BUFFER_SIZE`` set before the
process group is made, ``torch._C._distributed_c10d._dump_fr_trace_json`` returns every op of
the process, functional collectives included (they reach the C++ process group without
Python, which the ring's recorder cannot see). On gloo every entry's ``state`` stays
``"scheduled"`` and ``time_discovered_completed_ns`` stays 0, so completion comes from
``retired`` and from ``pg_status.last_completed_collective``; the completion time is unknown
(set to the issue time). The dump is the process's own memory: only the process can take it
(no reader outside can), so it is no help for a hung or killed rank; :func:`write_dump` puts
it beside the rings for the reader when the process can still run code.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from striped_fs import PrivateDir

from .ring import RING_DIR_WHAT, Op, RingSnapshot

__all__ = ["dump", "snapshot", "write_dump"]

_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}
_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_single",
    "_reduce_scatter_base": "reduce_scatter_single",
    "alltoall_base": "all_to_all_single",
    "alltoall": "all_to_all",
}
_SIZES = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def dump() -> dict[str, Any] | None:
    """This process's Flight Recorder buffer (parsed JSON), or None when the build lacks it."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return None
    try:
        return json.loads(_dump_fr_trace_json(includeCollectives=True))
    except (RuntimeError, ValueError):
        return None


def write_dump(directory: str | os.PathLike, rank: int) -> Path | None:
    """The buffer as ``fr-rank<r>-<pid>.json`` in ``directory`` (atomic, through the
    directory's descriptor: made 0700 or checked as the rings' is), or None."""
    doc = dump()
    if doc is None:
        return None
    name = f"fr-rank{rank}-{os.getpid()}.json"
    with PrivateDir.open(directory, what=RING_DIR_WHAT) as where:
        where.write_atomic(name, json.dumps(doc).encode())
        return Path(where.where(name))


def snapshot(doc: dict[str, Any], rank: int, *, node: str = "", pid: int = 0) -> RingSnapshot:
    """A Flight Recorder dump as the analysis's input (collectives and p2p, per group)."""
    status = doc.get("pg_status") or {}
    snap = RingSnapshot(
        path="flight-recorder",
        rank=rank,
        world=0,
        pid=pid,
        node=node,
        created=time.time(),
        head=len(doc.get("entries") or []),
    )
    for n, e in enumerate(doc.get("entries") or []):
        name, desc = (list(e.get("process_group") or ["?", ""]) + [""])[:2]
        snap.groups.setdefault(name, {"name": name, "desc": desc, "ranks": [], "rank": -1})
        raw = str(e.get("profiling_name", "?")).split(":", 1)[-1]
        op = _NAMES.get(raw, raw)
        dtype = _DTYPES.get((e.get("input_dtypes") or ["?"])[0], "?")
        numel = sum(math.prod(s) for s in e.get("input_sizes") or [])
        p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id") if p2p else e.get("collective_seq_id") or 0)
        last_done = int(
            (status.get(str(e.get("pg_id"))) or {}).get("last_completed_collective", -1)
        )
        issued = int(e.get("time_created_ns") or 0) / 1e9
        found = int(e.get("time_discovered_completed_ns") or 0) / 1e9
        done = (
            e.get("state") == "completed"
            or bool(e.get("retired"))
            or (not p2p and seq <= last_done)
        )
        snap.ops.append(
            Op(
                rank,
                n,
                name,
                op,
                seq,
                numel,
                numel * _SIZES.get(dtype, 0),
                dtype,
                issued,
                (found or issued) if done else None,
                False,
                p2p,
                -1,
            )
        )
    return snap
