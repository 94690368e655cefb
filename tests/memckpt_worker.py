"""A small training job for the memory-tier tests (and ``bootseer bench memckpt``).

``python memckpt_worker.py launch SPEC_JSON``: a launcher (as torchrun is) that starts
``spec["world"]`` rank processes on gloo over loopback, waits, and kills the rest with
SIGKILL when one fails (exit 1). Each rank loads (memory tier first, through
``CheckpointManager``), checks the loaded state bit for bit against what that step's state
is, trains to ``spec["steps"]`` (one all_reduce and one ``save`` a step) and writes
``<results>/rank-<r>.json``.

``python memckpt_worker.py peer DIR DIE_AT_PUT [MAX_CONNECTIONS HANDSHAKE_S]``: a peer server
(``ckpt.memory_peer``) that SIGKILLs itself half-way through receiving its ``DIE_AT_PUT``-th
copy (0: never), serving at most MAX_CONNECTIONS at once with hellos bounded by HANDSHAKE_S.

Faults are injected here, never in the library: ``spec["die_at"] = [rank, step]`` makes that
rank SIGKILL itself half-way through copying that step into memory (first attempt only);
``spec["kill_after_save"] = [rank, step]``: the moment that step's ``save`` returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def state_at(step: int, rank: int, world: int, numel: int) -> dict[str, Any]:
    import torch

    from ckpt import FlatShard, PerRank

    full = torch.arange(numel * world, dtype=torch.float32) * 1e-3 + step
    n = numel
    return {
        "model": {
            "shard": FlatShard(full[rank * n : (rank + 1) * n].clone(), rank * n, n * world),
            "bias": torch.full((7,), float(step), dtype=torch.bfloat16),
        },
        "opt": {"step": step, "moments": [torch.full((3, 5), step * 0.5), torch.tensor(step)]},
        "rng": PerRank({"rank": rank, "step": step}),
    }


def fill(state: dict[str, Any], step: int, rank: int, world: int, numel: int) -> None:
    """Training: the state becomes ``state_at(step)`` in place."""
    want = state_at(step, rank, world, numel)
    state["model"]["shard"].local.copy_(want["model"]["shard"].local)
    state["model"]["bias"].copy_(want["model"]["bias"])
    state["opt"]["step"] = step
    for a, b in zip(state["opt"]["moments"], want["opt"]["moments"], strict=True):
        a.copy_(b)
    state["rng"].value = want["rng"].value


def exact(state: dict[str, Any], step: int, rank: int, world: int, numel: int) -> list[str]:
    """What differs from ``state_at(step)``, bit for bit."""
    import torch

    want = state_at(step, rank, world, numel)
    bad = []
    if not torch.equal(state["model"]["shard"].local, want["model"]["shard"].local):
        bad.append("model/shard")
    if not torch.equal(state["model"]["bias"], want["model"]["bias"]):
        bad.append("model/bias")
    if state["opt"]["step"] != step:
        bad.append("opt/step")
    for i, (a, b) in enumerate(zip(state["opt"]["moments"], want["opt"]["moments"], strict=True)):
        if not torch.equal(a, b):
            bad.append(f"opt/moments/{i}")
    if state["rng"].value != want["rng"].value:
        bad.append("rng")
    return bad


def die_mid_copy() -> None:
    """The next memory-tier copy stops half-way with SIGKILL."""
    from ckpt.memory import MemoryTier

    original = MemoryTier._copy_in

    def half(self: Any, placed: list[Any], data: Any) -> None:
        original(self, placed[: max(1, len(placed) // 2)], data)
        os.kill(os.getpid(), signal.SIGKILL)

    MemoryTier._copy_in = half  # type: ignore[method-assign]


def rank_main(spec: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    from ckpt import CheckpointManager, CheckpointNotFound
    from ckpt.memory import MemoryConfig

    rank, world, numel = int(os.environ["RANK"]), spec["world"], spec["numel"]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    node = spec.get("nodes", [{}] * world)[rank]
    memory = MemoryConfig.from_env()
    if node.get("dir"):
        memory = MemoryConfig(node["dir"], server=node.get("server", ""), layout=spec.get("layout"))
    if memory is not None:
        memory.durable_every = spec.get("durable_every") or None
        memory.peer = node.get("peer", memory.peer)  # a fixed peer (a one-rank job)
    mgr = CheckpointManager(spec["durable"], rank=rank, world_size=world, memory=memory)
    state = state_at(0, rank, world, numel)
    for t in (state["model"]["shard"].local, state["model"]["bias"], *state["opt"]["moments"]):
        t.fill_(-7)  # nothing of step 0 left: a load must write every byte
    result: dict[str, Any] = {"rank": rank, "loaded": None}
    started = time.perf_counter()
    try:
        report = mgr.load_with_report(state)
        result.update(
            loaded=report.step,
            source=getattr(report, "source", "durable"),
            verified=getattr(report, "verified", None),
            load_s=time.perf_counter() - started,
            problems=exact(state, report.step, rank, world, numel),
        )
        start = report.step + 1
    except CheckpointNotFound:
        start = 0
    attempt = os.environ.get("BOOTSEER_ATTEMPT", "0")
    die = spec.get("die_at")
    step_s = []
    for step in range(start, spec["steps"]):
        t0 = time.perf_counter()
        fill(state, step, rank, world, numel)
        dist.all_reduce(torch.ones(1))  # the step's collective: ranks stay in step
        if die == [rank, step] and attempt == "0":
            die_mid_copy()
        mgr.save(step, state)
        if spec.get("kill_after_save") == [rank, step]:  # the node lost as save returns
            os.kill(os.getpid(), signal.SIGKILL)
        step_s.append(time.perf_counter() - t0)
    mgr.close()
    result.update(
        last=spec["steps"] - 1, push=mgr.memory.last_push if mgr.memory else {}, step_s=step_s
    )
    with open(os.path.join(spec["results"], f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


def launch(spec: dict[str, Any]) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(spec["world"]):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(spec["world"]),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(spec["world"]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen([sys.executable, __file__, "rank", json.dumps(spec)], env=env)
        )
    code = 0
    while procs:
        for p in list(procs):
            if p.poll() is None:
                continue
            procs.remove(p)
            if p.returncode != 0:
                code = 1
                for q in procs:
                    q.kill()
        time.sleep(0.05)
    return code


def peer(directory: str, die_at_put: int, limits: list[str]) -> int:
    """``limits``: the server's MAX_CONNECTIONS and HANDSHAKE_S, when given."""
    from ckpt import memory_peer

    original = memory_peer.receive_copy
    puts = [0]

    def receive(chan: Any, slot: Any, head: Any) -> None:
        puts[0] += 1
        if puts[0] != die_at_put:
            return original(chan, slot, head)
        slot.ensure(head.total)
        slot.invalidate()
        half = (head.data_size + head.meta_size) // 2
        memory_peer.recv_exact(chan.sock, slot.view(memory_peer.HEADER, half))
        os.kill(os.getpid(), signal.SIGKILL)

    memory_peer.receive_copy = receive
    if limits:
        memory_peer.MAX_CONNECTIONS, memory_peer.HANDSHAKE_S = int(limits[0]), float(limits[1])
    # as bootseer run's server: the node's own copies (the directory above "peers") too
    own = [os.path.dirname(directory)] if os.path.basename(directory) == "peers" else []
    return memory_peer.main([directory, "127.0.0.1:0", *own])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "peer":
        sys.exit(peer(sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
    spec = json.loads(sys.argv[2])
    sys.exit(launch(spec) if mode == "launch" else rank_main(spec))
