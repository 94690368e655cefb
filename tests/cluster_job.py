"""A small training job for the cluster tests: one rank per node under torchrun, gloo,
gradients all-reduced by hand, AdamW, checkpoints through ``CheckpointManager`` to S3.

Everything a test checks is written to ``--out`` (a directory every node can write):
``saved-R-S.json`` (the state's digest when rank R saved step S), ``loaded-R-HOST-A-wW-pPID.json``
(what rank R on HOST loaded in attempt A, in a world of W ranks), ``holding-R`` (rank R waits at ``--hold-at``), ``final-R.json``,
``stepped-R-HOST-A-wW.json`` (when rank R on HOST finished its first step of attempt A). A
membership change does not count as an attempt in torchrun: the world tells them apart.
The batch of step S on rank R depends only on S and R, so an uninterrupted run computes the
same bits: ``--reference`` computes them in one process (world of 2) and prints the digest.

On a first start (nothing to load) the job stops before step ``--hold-at`` and keeps running
collectives there, so that a test can kill a node at a known point: the survivors' next
collective fails and torchrun restarts them. ``--hold-again-at S --hold-again-world W`` holds
the same way before step S whenever the world has W ranks (``holding-wW-R``): an elastic job
that shrank waits there for a node to join. ``--reference-worlds 2:9,1:3,2:2`` is the
reference of a run whose world changed (9 steps of 2 ranks, 3 of 1, 2 of 2).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def build(seed: int = 0, width: int = 64) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, with optimizer state allocated (a step at lr 0: the
    checkpoint has every tensor from the start), the same in the job and the reference."""
    from ckpt import init_optimizer_state

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    init_optimizer_state(opt)
    return model, opt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every tensor of the model and the optimizer, in a fixed order."""
    h = hashlib.sha256()

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                add(f"{prefix}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                add(f"{prefix}/{i}", item)
        elif isinstance(value, torch.Tensor):
            h.update(prefix.encode())
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    add("model", model.state_dict())
    add("optim", opt.state_dict()["state"])
    return h.hexdigest()


def grads(model: nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    model.zero_grad()
    x, y = batch(step, rank)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def reference(steps: int, world: int, width: int = 64, worlds: list[int] | None = None) -> str:
    """The uninterrupted run, in one process: each rank's gradients summed, then averaged,
    as the all-reduce does (two terms: the same bits in any order). ``worlds``: the world
    size of each step, when it changed."""
    model, opt = build(width=width)
    for step in range(steps):
        world = worlds[step] if worlds else world
        per_rank = [grads(model, step, r) for r in range(world)]
        for p, *gs in zip(model.parameters(), *per_rank, strict=True):
            total = gs[0].clone()
            for g in gs[1:]:
                total += g
            p.grad = total / world
        opt.step()
    return digest(model, opt)


def hold(mgr: Any, marker: Path, step: int) -> None:
    """The last save durable, ``marker`` written (the step and this process's pid), then
    all-reduces until a peer is lost (the collective fails) or the agent restarts this worker
    (a node joined)."""
    import torch.distributed as dist

    mgr.wait()
    write_json(marker, {"step": step, "pid": os.getpid()})
    beat = torch.zeros(1)
    while True:
        dist.all_reduce(beat)
        time.sleep(0.1)


def beat(step: int, first: bool) -> None:
    """Progress for ``bootseer run`` (no-op without it): ready at the first step of a launch,
    then heartbeats; the rank's pid is watched from the first."""
    if os.environ.get("BOOTSEER_CONTROL_DIR"):
        import bootseer

        if first:
            bootseer.ready()
        bootseer.heartbeat(step)


def hang_once(out: Path, rank: int, step: int) -> None:
    """The rank stops making progress for good (a deadlock in the job's own code), the first
    time only: its peers wait in their next collective."""
    marker = out / f"hung-{rank}"
    if marker.exists():
        return
    write_json(marker, {"step": step, "pid": os.getpid()})
    while True:
        time.sleep(1)


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from ckpt import CheckpointManager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out = Path(args.out)
    model, opt = build(width=args.width)
    mgr = CheckpointManager(
        args.ckpt,
        rank=rank,
        world_size=world,
        storage_options=json.loads(args.storage_options),
        commit_timeout_s=60,
    )
    start, loaded = 0, False
    if mgr.latest() is not None:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": -1}
        step = mgr.load(state)
        opt.load_state_dict(state["optim"])
        write_json(
            out / f"loaded-{rank}-{socket.gethostname()}-{attempt}-w{world}-p{os.getpid()}.json",
            {"step": step, "digest": digest(model, opt), "world": world},
        )
        start, loaded = step + 1, True
    holds = [int(h) for h in filter(None, args.holds.split(","))]
    for step in range(start, args.steps):
        beat(step, step == start)
        if step == args.hold_again_at and world == args.hold_again_world:
            hold(mgr, out / f"holding-w{world}-{rank}", step)
        if step == args.hold_at and not loaded:
            hold(mgr, out / f"holding-{rank}", step)  # the last save durable (committed)
        if step in holds and not (out / f"holding-{step}-{rank}").exists():  # once each
            hold(mgr, out / f"holding-{step}-{rank}", step)
        if step == args.hang_at and rank == args.hang_rank:
            hang_once(out, rank, step)
        for p, g in zip(model.parameters(), grads(model, step, rank), strict=True):
            dist.all_reduce(g)
            p.grad = g / world
        opt.step()
        if step == start:
            write_json(
                out / f"stepped-{rank}-{socket.gethostname()}-{attempt}-w{world}.json",
                {"step": step, "time": time.time(), "world": world},
            )
        if (step + 1) % args.save_every == 0:
            write_json(out / f"saved-{rank}-{step}.json", {"digest": digest(model, opt)})
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
    mgr.close()
    write_json(out / f"final-{rank}.json", {"digest": digest(model, opt), "world": world})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt")
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--hold-at", type=int, default=9)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    parser.add_argument("--hold-again-at", type=int, default=-1)
    parser.add_argument("--hold-again-world", type=int, default=0)
    parser.add_argument(
        "--holds",
        default="",
        help="STEP,...: hold before each of these steps, the first time only (``holding-S-R``)",
    )
    parser.add_argument(
        "--hang-at",
        type=int,
        default=-1,
        help="rank --hang-rank stops for good before this step, once",
    )
    parser.add_argument("--hang-rank", type=int, default=1)
    parser.add_argument(
        "--reference-worlds",
        default="",
        help="WORLD:STEPS,...: the world size over the steps, in order",
    )
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # a test that sees a hang asks for the stacks
    torch.set_num_threads(1)
    if args.reference:
        worlds = [
            int(w)
            for part in filter(None, args.reference_worlds.split(","))
            for w, n in [part.split(":")]
            for _ in range(int(n))
        ]
        print(reference(len(worlds) if worlds else args.steps, 2, args.width, worlds or None))
    else:
        train(args)


if __name__ == "__main__":
    main()
