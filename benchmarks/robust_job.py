"""The soak's training job: gloo, gradients all-reduced by hand (DDP's arithmetic), AdamW,
``CheckpointManager`` to S3 every ``--save-every`` steps, ``bootseer.heartbeat`` every step,
batches from a ``DataLoader`` worker. Run by torchrun on every node of the cluster, under
``bootseer run`` (bootseer) or alone (the peer).

Why the faults live here: a crash, a hang or a NaN is most real when the job itself does it,
at a step it chose, in the frame a dump will show. The harness (``robust_faults.py``) asks
for one by writing ``<out>/faults/<id>.json`` (``{"id", "kind", "rank", "seconds"}``); the
targeted rank claims it once (``<id>.taken``, created exclusively, holding the step, the time,
the pid and the attempt) and then:

* ``exception``: raises ``RuntimeError``;
* ``collective_hang``: stops before its ``all_reduce`` (:func:`hang_before_all_reduce`) while
  the others wait inside theirs;
* ``dataloader_hang``: its DataLoader worker stops in :func:`hang_in_dataloader_worker`, so
  the trainer waits for a batch that never comes;
* ``nan``: its local gradient becomes NaN before the all-reduce (its heartbeat's grad norm is
  NaN at that step);
* ``slow``: every step takes ``slow_s`` longer for ``seconds``.

SIGKILL, a lost node, a full disk and the store down are the harness's (signals and cluster
operations). Every step appends ``{"step", "time", "loss", "pid", "attempt"}`` to
``<out>/steps-<rank>.jsonl`` (the peer's ETTR comes from it) and writes a small file under
``--local-dir`` (the node's disk: a full disk fails the step with ENOSPC).

``--nan-guard``: raise ``FloatingPointError`` on a non-finite loss or gradient norm, as a
careful torchrun user's loop does (the peer runs with it: torchrun itself sees no NaN).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import math
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import bootseer

MAIN_FAULTS = ("exception", "collective_hang", "nan", "slow")
WORKER_FAULTS = ("dataloader_hang",)


def claim(out: Path, rank: int, kinds: tuple[str, ...], step: int) -> dict[str, Any] | None:
    """The first fault for ``rank`` of one of ``kinds`` not claimed yet; claimed now (once,
    whatever attempt or process asks again)."""
    faults = out / "faults"
    try:
        names = sorted(os.listdir(faults))
    except FileNotFoundError:
        return None
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            fault = json.loads((faults / name).read_text())
        except (OSError, ValueError):
            continue  # being written
        if fault.get("rank") != rank or fault.get("kind") not in kinds:
            continue
        try:
            fd = os.open(faults / f"{fault['id']}.taken", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            continue
        taken = {
            "time": time.time(),
            "step": step,
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "attempt": os.environ.get("BOOTSEER_ATTEMPT"),
        }
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(taken))
        return fault
    return None


def hang_before_all_reduce() -> None:
    while True:
        time.sleep(0.5)


def hang_in_dataloader_worker() -> None:
    while True:
        time.sleep(0.5)


class Batches(Dataset):
    """Batch ``step`` of ``rank``: depends on the two only (a restart recomputes the same)."""

    def __init__(self, rank: int, out: Path) -> None:
        self.rank, self.out = rank, out

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, step: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        if claim(self.out, self.rank, WORKER_FAULTS, step) is not None:
            hang_in_dataloader_worker()
        gen = torch.Generator().manual_seed(step * 1000 + self.rank)
        return step, torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    from ckpt import init_optimizer_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_optimizer_state(opt)
    return model, opt


def append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train(args: argparse.Namespace) -> None:
    from ckpt import CheckpointManager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("BOOTSEER_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT")
    out = Path(args.out)
    local = Path(args.local_dir)
    local.mkdir(parents=True, exist_ok=True)
    (out / f"pid-{rank}").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    say = print if int(os.environ.get("LOCAL_RANK", "0")) == 0 else (lambda *_a, **_k: None)
    say(f"job: rank {rank} (pid {os.getpid()}, attempt {attempt}) started", flush=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    say(f"job: rank {rank}: process group ready", flush=True)
    model, opt = build()
    mgr = CheckpointManager(
        args.ckpt,
        rank=rank,
        world_size=world,
        keep=2,
        storage_options=json.loads(args.storage_options),
        commit_timeout_s=60,
    )
    start = 0
    if mgr.latest() is not None:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": -1}
        start = mgr.load(state) + 1
        opt.load_state_dict(state["optim"])
    say(f"job: rank {rank}: resumes at step {start}", flush=True)
    append(
        out / "starts.jsonl",
        {
            "rank": rank,
            "pid": os.getpid(),
            "time": time.time(),
            "resume": start,
            "attempt": attempt,
        },
    )
    loader = DataLoader(
        Batches(rank, out),
        batch_size=None,
        num_workers=1,
        prefetch_factor=1,
        sampler=range(start, args.steps),
    )
    slow_until, slow_s = 0.0, 0.0
    steps_log = out / f"steps-{rank}.jsonl"
    for step, x, y in loader:
        fault = claim(out, rank, MAIN_FAULTS, step)
        kind = fault["kind"] if fault else None
        if kind == "exception":
            raise RuntimeError(f"injected fault {fault['id']}: rank {rank} at step {step}")
        if kind == "slow":
            slow_until, slow_s = time.time() + fault["seconds"], fault.get("slow_s", 1.0)
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        if kind == "nan":
            grads[0].fill_(float("nan"))
        norm = float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        )
        if args.nan_guard and not (math.isfinite(norm) and math.isfinite(float(loss.detach()))):
            raise FloatingPointError(
                f"non-finite gradient norm {norm} on rank {rank} at step {step}"
            )
        if kind == "collective_hang":
            hang_before_all_reduce()
        for g in grads:
            dist.all_reduce(g)
            g /= world
        opt.step()
        mark = local / f"rank{rank}.{step}"  # a new file each step: ENOSPC once the disk is full
        mark.write_text(json.dumps({"step": step}))
        (local / f"rank{rank}.{step - 1}").unlink(missing_ok=True)
        if step == start:
            bootseer.ready()
        bootseer.heartbeat(step, loss=float(loss.detach()), grad_norm=norm)
        append(
            steps_log,
            {
                "step": step,
                "time": time.time(),
                "loss": float(loss.detach()),
                "pid": os.getpid(),
                "attempt": attempt,
            },
        )
        if (step + 1) % args.save_every == 0:
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
        time.sleep(args.step_time + (slow_s if time.time() < slow_until else 0.0))
    bootseer.finishing()  # the final flush and teardown are not a hang
    mgr.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--local-dir", required=True, help="a directory on the node's disk")
    parser.add_argument("--steps", type=int, default=1 << 30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.3)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--nan-guard", action="store_true")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)
    torch.set_num_threads(1)
    train(args)


if __name__ == "__main__":
    main()
