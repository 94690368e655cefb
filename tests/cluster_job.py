"""A small training job for the cluster tests: one rank per node under torchrun, gloo,
gradients all-reduced by hand, AdamW, checkpoints through ``CheckpointManager`` to S3.

Everything a test checks is written to ``--out`` (a directory every node can write):
``saved-R-S.json`` (the state's digest when rank R saved step S), ``loaded-R-A.json`` (what
rank R loaded in attempt A), ``holding-R`` (rank R waits at ``--hold-at``), ``final-R.json``.
The batch of step S on rank R depends only on S and R, so an uninterrupted run computes the
same bits: ``--reference`` computes them in one process (world of 2) and prints the digest.

On a first start (nothing to load) the job stops before step ``--hold-at`` and keeps running
collectives there, so that a test can kill a node at a known point: the survivors' next
collective fails and torchrun restarts them.
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
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, with optimizer state allocated (a step at lr 0: the
    checkpoint has every tensor from the start), the same in the job and the reference."""
    from ckpt import init_optimizer_state

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
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


def reference(steps: int, world: int) -> str:
    """The uninterrupted run, in one process: each rank's gradients summed, then averaged,
    as the all-reduce does (two terms: the same bits in any order)."""
    model, opt = build()
    for step in range(steps):
        per_rank = [grads(model, step, r) for r in range(world)]
        for p, *gs in zip(model.parameters(), *per_rank, strict=True):
            total = gs[0].clone()
            for g in gs[1:]:
                total += g
            p.grad = total / world
        opt.step()
    return digest(model, opt)


def agreed_attempt() -> str:
    """One attempt id for every rank of this round, chosen by rank 0.

    Why not ckpt's default (torchelastic's run id and restart count): the restart count is
    each agent's own, so a replaced node starts again at 0 while the survivors are at 1; the
    ranks then write different attempts and rank 0's commit waits for an index that never
    comes (seen on this cluster: the job hangs at its first save after the replacement)."""
    import torch.distributed as dist

    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from ckpt import CheckpointManager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out = Path(args.out)
    model, opt = build()
    mgr = CheckpointManager(args.ckpt, rank=rank, world_size=world, attempt=agreed_attempt(),
                            storage_options=json.loads(args.storage_options),
                            commit_timeout_s=60)
    start, loaded = 0, False
    if mgr.latest() is not None:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": -1}
        step = mgr.load(state)
        opt.load_state_dict(state["optim"])
        write_json(out / f"loaded-{rank}-{socket.gethostname()}-{attempt}.json",
                   {"step": step, "digest": digest(model, opt), "world": world})
        start, loaded = step + 1, True
    for step in range(start, args.steps):
        if step == args.hold_at and not loaded:
            mgr.wait()  # the last save is durable (on rank 0: committed)
            (out / f"holding-{rank}").write_text(str(step))
            beat = torch.zeros(1)
            while True:  # until a peer is lost: then this collective fails
                dist.all_reduce(beat)
                time.sleep(0.1)
        for p, g in zip(model.parameters(), grads(model, step, rank), strict=True):
            dist.all_reduce(g)
            p.grad = g / world
        opt.step()
        if (step + 1) % args.save_every == 0:
            write_json(out / f"saved-{rank}-{step}.json", {"digest": digest(model, opt)})
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                            "step": step})
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
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # a test that sees a hang asks for the stacks
    torch.set_num_threads(1)
    if args.reference:
        print(reference(args.steps, 2))
    else:
        train(args)


if __name__ == "__main__":
    main()
