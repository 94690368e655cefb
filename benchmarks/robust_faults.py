"""The soak's faults: a seeded schedule, and each fault injected the most real way we have.

Why a schedule object: the bootseer run and the peer's must meet the same faults at the same
offsets on the same ranks, and a reader must be able to replay it (it is printed and kept in
the results). Each class is injected where it really happens:

| class | how |
| --- | --- |
| ``sigkill`` | the harness sends SIGKILL to the rank's pid (``<out>/pid-<rank>``) |
| ``exception``, ``collective_hang``, ``dataloader_hang``, ``nan``, ``slow`` | a fault file the job's rank claims at its next step (``robust_job.py``) |
| ``node_lost`` | ``Cluster.kill_node`` (every process of the node at once); the operator replaces it |
| ``disk_full`` | ``Cluster.fill_disk``: the node's disk, where the job writes every step |
| ``store_down`` | ``Cluster.service_down("s3")`` for ``STORE_DOWN_S``: every node's S3 connections reset and refused |
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CLASSES = (
    "sigkill",
    "exception",
    "collective_hang",
    "dataloader_hang",
    "nan",
    "slow",
    "node_lost",
    "disk_full",
    "store_down",
)
JOB_SIDE = ("exception", "collective_hang", "dataloader_hang", "nan", "slow")
NODE_SIDE = ("node_lost", "disk_full")
STORE_DOWN_S = 30.0
DISK_HOLD_S = 60.0  # a full disk not cured by a replacement is freed by the operator after this
SLOW_S, SLOW_EXTRA_S = 60.0, 1.0  # a slow rank: every step 1 s longer for 60 s


@dataclass
class Fault:
    """One planned fault: ``at_s`` after the job's first step; ``rank`` (rank-side classes)
    or ``node`` (node-side classes), chosen by the seed."""

    id: str
    kind: str
    at_s: float
    rank: int | None = None
    node: int | None = None
    injected: dict[str, Any] = field(default_factory=dict)  # filled when injected

    def describe(self) -> str:
        where = (
            f"rank {self.rank}"
            if self.rank is not None
            else (f"node{self.node}" if self.node is not None else "every node")
        )
        return f"{self.id} {self.kind:<16} at +{self.at_s:6.1f} s on {where}"


def schedule(
    seed: int,
    minutes: float,
    interval_s: float,
    nodes: int,
    nproc: int,
    classes: tuple[str, ...] = CLASSES,
) -> list[Fault]:
    """Faults at random offsets (``interval_s`` x uniform(0.5, 1.5) apart, the first after one
    interval's half) on random ranks or nodes, over ``minutes``; the classes come in a seeded
    shuffled order, each once before any repeats."""
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        raise ValueError(f"unknown fault class(es) {unknown}: choose from {', '.join(CLASSES)}")
    rng = random.Random(seed)
    order: list[str] = []
    faults: list[Fault] = []
    at = interval_s * 0.5
    while at < minutes * 60 - interval_s * 0.25:
        if not order:
            order = list(classes)
            rng.shuffle(order)
        kind = order.pop(0)
        fault = Fault(f"f{len(faults) + 1:02d}", kind, round(at, 1))
        if kind in NODE_SIDE:
            fault.node = rng.randrange(nodes)
        elif kind != "store_down":
            fault.rank = rng.randrange(nodes * nproc)
        faults.append(fault)
        at += interval_s * rng.uniform(0.5, 1.5)
    return faults


def ranks_on(out: Path, host: str) -> list[int]:
    """The ranks whose newest process runs on ``host`` (the job's ``pid-<rank>`` files)."""
    found = []
    for path in out.glob("pid-*"):
        try:
            if json.loads(path.read_text())["host"] == host:
                found.append(int(path.name.split("-")[1]))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(found)


class Injector:
    """Injects faults into a :class:`robust_cluster.SoakJob` and undoes the timed ones (the
    store back up, a full disk freed by the operator) on :meth:`tick`."""

    def __init__(self, job: Any, log: Any = print) -> None:
        self.job, self.log = job, log
        self._undo: list[tuple[float, str, Any]] = []

    def inject(self, fault: Fault) -> dict[str, Any]:
        job, now = self.job, time.time()
        info: dict[str, Any] = {"time": now, "kind": fault.kind}
        if fault.kind == "sigkill":
            rec = json.loads((job.out / f"pid-{fault.rank}").read_text())
            os.kill(rec["pid"], signal.SIGKILL)
            info.update(pid=rec["pid"], host=rec["host"], rank=fault.rank)
        elif fault.kind in JOB_SIDE:
            spec = {
                "id": fault.id,
                "kind": fault.kind,
                "rank": fault.rank,
                "seconds": SLOW_S,
                "slow_s": SLOW_EXTRA_S,
            }
            tmp = job.out / "faults" / f".{fault.id}.tmp"
            tmp.write_text(json.dumps(spec))
            os.replace(tmp, job.out / "faults" / f"{fault.id}.json")
            info.update(rank=fault.rank)
        elif fault.kind in NODE_SIDE:
            # the node running job node k's first rank now (a spare may have taken its place)
            index = job.node_of_rank(fault.node * job.nproc) if job.spares else fault.node
            node = job.c.nodes[index]
            info.update(
                host=node.name, agent=job.agent_names[index], ranks=ranks_on(job.out, node.name)
            )
            if fault.kind == "node_lost":
                job.lose_node(index)
            else:
                job.c.fill_disk(index)
                self._undo.append((now + DISK_HOLD_S, "free_disk", (index, node)))
        elif fault.kind == "store_down":
            job.service_down("s3")
            self._undo.append((now + STORE_DOWN_S, "store_up", None))
        fault.injected = info
        self.log(f"inject: {fault.describe()} {json.dumps(info)}")
        return info

    def tick(self) -> None:
        """Undo what is due: the store back up; a full disk freed when its node is still the
        same machine (a replacement came with an empty disk)."""
        now = time.time()
        for item in [u for u in self._undo if u[0] <= now]:
            self._undo.remove(item)
            _, what, arg = item
            if what == "store_up":
                self.job.service_down("s3", False)
                self.log("operator: the checkpoint store is back")
            elif what == "free_disk":
                index, node = arg
                if self.job.c.nodes[index] is node and node.alive:
                    node.free_disk()
                    self.log(f"operator: freed {node.name}'s disk")

    def finish(self) -> None:
        """Undo everything still pending (the run is over)."""
        self._undo = [(0.0, what, arg) for _, what, arg in self._undo]
        self.tick()

    def store_is_down(self) -> bool:
        return any(what == "store_up" for _, what, _ in self._undo)


def taken(out: Path, fault: Fault) -> dict[str, Any] | None:
    """What the job wrote when its rank claimed ``fault`` (None: never claimed)."""
    try:
        return json.loads((out / "faults" / f"{fault.id}.taken").read_text())
    except (OSError, ValueError):
        return None


def as_dicts(faults: list[Fault]) -> list[dict[str, Any]]:
    return [asdict(f) for f in faults]
