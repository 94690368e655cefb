"""One rank of the memory-tier benchmark's job (``bench_memckpt.py`` starts two).

A DDP MLP trained on gloo, its state (parameters and AdamW moments) saved through
``CheckpointManager``:

* ``train``: each of ``variants`` in turn, in the same job: none (no checkpoints), durable (async durable saves every
  ``interval`` steps), memory-only (every step into memory and to the peer) or memory (that,
  and durable every ``interval``); per-step seconds; with ``kill_at`` every rank SIGKILLs itself in that step,
  after the optimizer step and before its save (the step in progress is lost);
* ``train`` with ``rounds``, first: one model, blocks of ``block`` steps without checkpoints, with a memory
  checkpoint every step (async) and with one replicated synchronously (``sync``), in turns (``rounds`` of each, the order alternating), per-step
  seconds of each kind, and one memcpy of the state (the floor), timed between blocks;
* ``load``: a restarted rank loads the newest state (memory tier first) and reports the
  seconds to load, the step, where from, and one memcpy of the same state (the floor).

``python memckpt_train.py SPEC_JSON`` with RANK, WORLD_SIZE, MASTER_ADDR/PORT set.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt import CheckpointManager, CheckpointNotFound, init_optimizer_state  # noqa: E402
from ckpt.memory import MemoryConfig, load_slot  # noqa: E402
from ckpt.memory_slot import newest  # noqa: E402


def build(spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(spec["layers"]):
        layers += [torch.nn.Linear(spec["d"], spec["d"]), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.module.state_dict(), "optim": opt.state_dict()}


def fingerprint(model: torch.nn.Module) -> float:
    """A cheap signature of the parameters (one small tensor's sum): equal after a load."""
    last = list(model.module.parameters())[-1]
    return float(last.detach().double().sum())


def manager(spec: dict[str, Any], rank: int, world: int, memory: bool) -> CheckpointManager:
    config: Any = False
    if memory and spec.get("from_env"):  # under bootseer run --ckpt-memory (the cluster)
        config = MemoryConfig.from_env()
        config.durable_every = spec["interval"]
        config.check_durable = False  # the directory holds this job's copies only
    elif memory:
        node = spec["nodes"][rank]
        config = MemoryConfig(
            node["dir"], server=node["server"], durable_every=spec["interval"], check_durable=False
        )  # as bootseer run's own directory
    return CheckpointManager(
        spec["durable"],
        rank=rank,
        world_size=world,
        storage_options=spec["storage_options"],
        memory=config,
    )


def train_all(spec: dict[str, Any], rank: int, world: int) -> None:
    """With ``rounds``: the interleaved overhead first (``overhead-<rank>.json``, its copies
    in a directory of their own); then every variant in turn, in this one job (the killed
    one last), each from a fresh model; ``train-<variant>-<rank>.json`` each."""
    if spec.get("rounds"):
        out = {"rank": rank, "phase": "overhead"}
        overhead(spec, rank, world, out)
        Path(spec["out_dir"], f"overhead-{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    for variant in spec["variants"]:
        out: dict[str, Any] = {"rank": rank, "phase": f"train-{variant}"}
        train(
            {
                **spec,
                "variant": variant,
                "durable": f"{spec['durable']}/{variant}",
                "kill_at": spec["kill_at"] if variant == "memory" else None,
                "out": str(Path(spec["out_dir"]) / f"train-{variant}-{rank}.json"),
            },
            rank,
            world,
            out,
        )
        Path(spec["out_dir"], f"train-{variant}-{rank}.json").write_text(json.dumps(out))
        dist.barrier()


def train(spec: dict[str, Any], rank: int, world: int, out: dict[str, Any]) -> None:
    model, opt = build(spec)
    variant = spec["variant"]
    memory = variant.startswith("memory")
    mgr = manager(spec, rank, world, memory) if variant != "none" else None
    if variant == "memory-only":  # durable only at step 0 (the memory tier's cost alone)
        mgr.memory.config.durable_every = 1 << 30
    out.update(step_s=[], stall_s=[], saved=[], prints={})
    path = Path(spec["out"])
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        train_step(model, opt, spec, step, rank)
        if step == spec.get("kill_at"):
            if mgr is not None and mgr.memory is not None:  # what the peer held at the kill
                out.update(
                    killed_at=time.time(),
                    pushes=list(mgr.memory.push_log),
                    push_state=mgr.memory.push_state(),
                    push_wait_s=mgr.memory.push_wait_s,
                )
            path.write_text(json.dumps(out))
            os.kill(os.getpid(), signal.SIGKILL)
        if mgr is not None and (memory or step % spec["interval"] == 0):
            handle = mgr.save(step, state_of(model, opt))
            out["stall_s"].append(handle.stage_s)
            out["saved"].append(step)
        out["step_s"].append(time.perf_counter() - t0)
        out.setdefault("step_end", []).append(time.time())
        out["prints"][str(step)] = fingerprint(model)
    if mgr is not None:
        mgr.close()


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, spec: dict[str, Any], step: int, rank: int
) -> None:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(spec["batch"], spec["d"], generator=g)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def memcpy_s(state: dict[str, Any], copies: list[torch.Tensor] | None = None) -> float:
    """One copy of every tensor of ``state`` into preallocated tensors (the floor)."""
    tensors = _tensors(state)
    copies = copies or [torch.empty_like(t) for t in tensors]
    t0 = time.perf_counter()
    for dst, src in zip(copies, tensors, strict=True):
        dst.copy_(src)
    return time.perf_counter() - t0


def overhead(spec: dict[str, Any], rank: int, world: int, out: dict[str, Any]) -> None:
    """Steps without and with a memory checkpoint, in interleaved blocks of one job."""
    model, opt = build(spec)
    init_optimizer_state(opt)
    if not spec.get("from_env"):  # its own copies: the variants' recoveries never meet them
        node = spec["nodes"][rank]
        own = Path(node["dir"]) / "overhead"
        own.mkdir(mode=0o700, exist_ok=True)
        spec = {**spec, "nodes": {rank: {**node, "dir": str(own)}}}
    mgr = manager(spec, rank, world, True)
    mgr.memory.config.durable_every = 1 << 30  # memory only (step 0 is not saved here)
    state = state_of(model, opt)
    copies = [torch.empty_like(t) for t in _tensors(state)]
    times: dict[str, list[float]] = {"none": [], "memory": [], "sync": []}
    floor: list[float] = []
    step = 1
    train_step(model, opt, spec, step, rank)  # warm-up: first touch, the servers' exchange
    mgr.save(step, state_of(model, opt))
    mgr.memory.wait()
    for r in range(spec["rounds"]):
        kinds = ("none", "memory", "sync")
        for kind in kinds[r % 3 :] + kinds[: r % 3]:  # each kind first in turn
            mgr.memory.sync = kind == "sync"  # replication "sync": save waits for the ack
            for _ in range(spec["block"]):
                step += 1
                t0 = time.perf_counter()
                train_step(model, opt, spec, step, rank)
                if kind != "none":
                    mgr.save(step, state_of(model, opt))
                times[kind].append(time.perf_counter() - t0)
            mgr.memory.wait()  # the last copy's commit and push do not spill into the next block
            dist.barrier()
            floor.append(memcpy_s(state, copies))
    mgr.close()
    out.update(
        step_s=times,
        memcpy_s=floor,
        last_push=mgr.memory.last_push,
        state_bytes=sum(t.numel() * t.element_size() for t in _tensors(state)),
    )


def load(spec: dict[str, Any], rank: int, world: int, out: dict[str, Any]) -> None:
    model, opt = build(spec)
    init_optimizer_state(opt)
    state = state_of(model, opt)
    mgr = manager(spec, rank, world, True)
    dist.barrier()
    t0 = time.perf_counter()
    try:
        report = mgr.load_with_report(state)
    except CheckpointNotFound:
        out.update(step=None)
        return
    out.update(
        load_s=time.perf_counter() - t0,
        loaded_at=time.time(),
        step=report.step,
        copy_s=report.seconds,
        phases=getattr(report, "phases", {}),
        source=getattr(report, "source", "durable"),
        print=fingerprint(model),
    )
    tensors = [t for t in _tensors(state)]
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    copies = [torch.empty_like(t) for t in tensors]
    floor = []
    for _ in range(3):  # one memcpy of the state into preallocated memory
        t1 = time.perf_counter()
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)
        floor.append(time.perf_counter() - t1)
    out["memcpy_s"] = min(floor)
    out["verified"] = getattr(report, "verified", None)  # "agent": the stamped fast path
    if out["source"] == "local":  # the same load again, best of 3, beside the floor: as the
        runs: dict[bool, list[float]] = {True: [], False: []}  # trainer makes it (the agent's
        head, slot = next((h, s) for h, s in newest(mgr.memory.slots) if h.step == out["step"])
        for _ in range(3):  # stamp honoured when there is one) and hashed, interleaved
            for stamped in (True, False):
                t1 = time.perf_counter()
                load_slot(slot, head, state, use_stamp=stamped)
                runs[stamped].append(time.perf_counter() - t1)
        out["copy_best_s"] = min(runs[True])
        out["copy_hashed_best_s"] = min(runs[False])
    mgr.close()


def _tensors(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, list | tuple):
        return [t for v in node for t in _tensors(v)]
    return []


def main() -> int:
    spec = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if spec["mode"] == "train":
        train_all(spec, rank, world)
    else:
        out: dict[str, Any] = {"rank": rank, "phase": spec["phase"]}
        load(spec, rank, world, out)
        Path(spec["out_dir"], f"{spec['phase']}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
