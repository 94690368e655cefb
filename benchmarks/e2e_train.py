"""The training job of the end-to-end scenario (``bench_e2e.py``); it runs in the container.

Two subcommands:

* ``launch``: the container command of the baseline and of the do-it-yourself methods. With
  ``--requirements`` it installs them with ``pip`` (the way a Dockerfile-less job does on every
  start), without it the dependencies are baked into the image; then it starts ``torchrun``.
  It imports nothing heavy: torch does not exist yet when it starts.
* ``train``: one rank (started by ``torchrun``). A transformer-shaped model (token embedding,
  pre-norm blocks, tied head) wrapped in FSDP2 (``fully_shard``) over gloo: each rank holds its
  half of every parameter and of the AdamW state. It resumes from the newest committed
  checkpoint, trains on deterministic batches (the batch of step ``s`` depends only on ``s`` and
  the rank), and saves asynchronously, through bootseer's ``CheckpointManager`` (``--mode
  bootseer``) or through ``torch.distributed.checkpoint.async_save`` on s3fs (``--mode dcp``).

Every milestone is one JSON line in ``RESULTS/events.jsonl`` (wall clock, the host's clock too):
``process_start``, ``pg_init_start``/``pg_init_end`` (``init_process_group``: the job's
store and gloo's connections, after ``import torch``), ``model_built``, ``copy_ready`` (how long the rank waited for the local
copy), ``load_start``/``load_end``, ``verified`` (the sha256 of the
rank's state right after a load: the harness compares it with the one written at the save of
that step), ``first_step``, ``step``, ``saved`` (digest of the state saved), ``done``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

COPY_TIMEOUT_S = 1200.0
SIZES = {
    # vocab, width, blocks, sequence length: full = 96 M parameters, 1.15 GB of fp32 state
    # (parameters + AdamW's two moments); quick = 21 M parameters, 0.25 GB.
    "full": {"vocab": 32000, "d": 1024, "layers": 5, "seq": 128},
    "quick": {"vocab": 16000, "d": 512, "layers": 4, "seq": 128},
    # the multi-node scenario's quick form (8 ranks on a 2-core machine): 0.66 M parameters
    "tiny": {"vocab": 2048, "d": 128, "layers": 2, "seq": 64},
}


def event(results: str, name: str, **detail: Any) -> None:
    """Append one milestone (O_APPEND: lines of concurrent ranks never interleave)."""
    line = json.dumps(
        {
            "event": name,
            "t": time.time(),
            "pid": os.getpid(),
            "rank": int(os.environ.get("RANK", "-1")),
            "attempt": int(os.environ.get("BOOTSEER_ATTEMPT", "0")),
            "node": os.environ.get("BOOTSEER_E2E_NODE", ""),
            **detail,
        }
    )
    fd = os.open(
        os.path.join(results, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


# -- launch (baseline) ---------------------------------------------------------------------------


def launch(args: argparse.Namespace, rest: list[str]) -> int:
    event(args.results, "entry")
    t = time.time()
    if args.requirements:
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--break-system-packages",
            "--root-user-action=ignore",
            "-q",
            "-r",
            args.requirements,
        ]
        subprocess.run(pip, check=True)
    event(
        args.results,
        "env_ready",
        seconds=time.time() - t,
        installer="pip" if args.requirements else "baked into the image",
    )
    # BOOTSEER_E2E_TORCHRUN (a JSON list): torchrun's options for a job across nodes
    options = json.loads(os.environ.get("BOOTSEER_E2E_TORCHRUN") or "null") or [
        "--standalone",
        f"--nproc-per-node={args.nproc}",
    ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *options,
        os.path.abspath(__file__),
        "train",
        *rest,
    ]
    event(args.results, "command_start")
    os.execv(sys.executable, torchrun)
    return 0  # not reached


# -- train (one rank) ----------------------------------------------------------------------------


def build(cfg: dict[str, int]) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(cfg["vocab"], cfg["d"])
            torch.nn.init.normal_(self.emb.weight, std=0.02)  # tied head: small logits
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    cfg["d"],
                    cfg["d"] // 64,
                    4 * cfg["d"],
                    dropout=0.0,
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(cfg["layers"])
            )

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            return torch.nn.functional.linear(x, self.emb.weight)

    torch.manual_seed(1234)  # every rank builds the same initial model before sharding
    model = Model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, opt


def init_optimizer(model: Any, opt: Any) -> None:
    """AdamW creates its state at the first step; a load needs tensors to load into."""
    import torch

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()  # lr 0 and zero gradients: the moments are zeros, the weights unchanged
    for g, value in zip(opt.param_groups, lr, strict=True):
        g["lr"] = value
    for st in opt.state.values():
        st["step"].zero_()
    opt.zero_grad(set_to_none=True)


def train_step(model: Any, opt: Any, cfg: dict[str, int], step: int, rank: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, cfg["vocab"], (1, cfg["seq"] + 1), generator=gen)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def state_of(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def digest(state: dict[str, Any]) -> str:
    """sha256 over this rank's bytes of every tensor, in key order: equal means bit-identical."""
    import hashlib

    import torch
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}/{k}", value[k])
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            h.update(prefix.encode())
            h.update(
                local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                if local.numel()
                else b""
            )
        else:
            h.update(f"{prefix}={value!r}".encode())

    walk("", state)
    return h.hexdigest()


def dcp_latest(fs: Any, root: str) -> int | None:
    """The newest ``step-N`` directory under ``root`` holding DCP's ``.metadata`` (written
    last, once every rank's data is in: the baseline's notion of committed)."""
    try:
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False, refresh=True)]
    except FileNotFoundError:
        return None
    for step in sorted((int(n[5:]) for n in names if n.startswith("step-")), reverse=True):
        if fs.exists(f"{root}/step-{step:08d}/.metadata"):
            return step
    return None


class BootseerCheckpoints:
    def __init__(self, url: str, rank: int, world: int) -> None:
        from ckpt import CheckpointManager

        options = json.loads(os.environ.get("BOOTSEER_STORAGE_OPTIONS") or "{}")
        self.mgr = CheckpointManager(url, rank=rank, world_size=world, storage_options=options)

    def latest(self) -> int | None:
        return self.mgr.latest()

    def load(self, state: dict[str, Any]) -> dict[str, Any]:
        report = self.mgr.load_with_report(state)
        return {
            "step": report.step,
            "bytes": report.bytes_read,
            "cached_bytes": report.cached_bytes,
            "cache_wait_s": report.cache_wait_s,
        }

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.mgr.save(step, state)

    def close(self) -> None:
        self.mgr.close()


COPY_STATUS = ".copy-status.json"  # written (atomically) by the copy tool's wrapper when it ends


def wait_for_copy(directory: str, timeout: float, poll: float = 0.05) -> dict[str, Any]:
    """Block until the copy tool's status file appears in ``directory``; its content (``ok``,
    ``step``, ``error``). A failed or missing copy raises: a rank must never load a partial
    checkpoint, nor start from scratch as if there were none."""
    path = os.path.join(directory, COPY_STATUS)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the checkpoint copy into {directory} did not finish within "
                f"{timeout:.0f} s (no {COPY_STATUS}): check the copy tool's log"
            )
        time.sleep(poll)
    with open(path) as f:
        status = json.load(f)
    if not status.get("ok"):
        raise RuntimeError(
            f"the checkpoint copy into {directory} failed: "
            f"{status.get('error', 'no reason given')}; the job cannot resume "
            "from it (rerun the copy, or load from the store)"
        )
    return status


class DcpCheckpoints:
    """DCP the documented way: ``async_save`` with ``FsspecWriter`` (s3fs), one directory per
    step; a step counts once its ``.metadata`` exists (DCP writes it last). With ``local``, the
    load reads a local copy of the newest step instead (``FileSystemReader``), once the copy
    tool says it is complete."""

    def __init__(
        self, url: str, rank: int, world: int, local: str | None = None, results: str | None = None
    ) -> None:
        import fsspec
        import torch.distributed as dist

        # The background save's collectives get their own group, as DCP's docs advise: on
        # the training group they would interleave with FSDP's and hang both.
        self.group = dist.new_group(backend="gloo")
        options = json.loads(os.environ.get("BOOTSEER_STORAGE_OPTIONS") or "{}")
        self.url = url.rstrip("/")
        self.options = options.get("s3", options)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.options)
        self.pending: Any = None
        self.local, self.results = local, results
        self.copied: int | None = None

    def latest(self) -> int | None:
        if self.local is None:
            return dcp_latest(self.fs, self.root)
        if self.copied is None:
            t = time.time()
            status = wait_for_copy(self.local, timeout=COPY_TIMEOUT_S)
            self.copied = int(status["step"])
            if self.results:
                event(self.results, "copy_ready", waited=time.time() - t, step=self.copied)
        return self.copied

    def load(self, state: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        step = self.latest()
        if self.local is not None:
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(os.path.join(self.local, f"step-{step:08d}")),
                process_group=self.group,
            )
            return {"step": step}
        dcp.load(
            state,
            storage_reader=FsspecReader(f"{self.url}/step-{step:08d}", **self.options),
            process_group=self.group,
        )
        return {"step": step}

    def save(self, step: int, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if self.pending is not None:
            self.pending.result()
        self.pending = dcp.async_save(
            state,
            storage_writer=FsspecWriter(
                f"{self.url}/step-{step:08d}", sync_files=False, **self.options
            ),
            process_group=self.group,
        )

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()


def train(args: argparse.Namespace) -> int:
    results = args.results
    event(results, "process_start")
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict

    torch.set_num_threads(1)
    event(results, "pg_init_start")  # the job's store and gloo's full mesh: the scale model's
    dist.init_process_group("gloo")
    event(results, "pg_init_end")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SIZES[args.size]
    model, opt = build(cfg)
    init_optimizer(model, opt)
    if args.mode == "bootseer":
        store: Any = BootseerCheckpoints(args.ckpt, rank, world)
    else:
        store = DcpCheckpoints(args.ckpt, rank, world, local=args.local_copy, results=results)
    event(results, "model_built")
    start = 0
    if store.latest() is not None:
        state = state_of(model, opt)
        event(results, "load_start")
        info = store.load(state)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        event(results, "load_end", **info)
        t = time.time()
        event(
            results,
            "verified",
            step=info["step"],
            digest=digest(state_of(model, opt)),
            seconds=time.time() - t,
        )
        start = info["step"]
    stop = start + args.steps_after_resume if start else args.steps
    client = None
    if os.environ.get("BOOTSEER_CONTROL_DIR"):
        import bootseer as client
    for step in range(start + 1, stop + 1):
        loss = train_step(model, opt, cfg, step, rank)
        if step == start + 1:
            event(results, "first_step", step=step, loss=loss)
            if client is not None:
                client.ready()
        event(results, "step", step=step, loss=loss)
        if client is not None:
            client.heartbeat(step)
        if args.save_every and step % args.save_every == 0 and start == 0:
            state = state_of(model, opt)
            store.save(step, state)
            event(results, "saved", step=step, digest=digest(state))
    if client is not None:
        client.finishing(stop)
    store.close()
    event(results, "done", step=stop)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="e2e_train.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("launch")
    lp.add_argument(
        "--requirements",
        default=None,
        help="pip install these first (absent: the dependencies are in the image)",
    )
    lp.add_argument("--nproc", type=int, default=2)
    lp.add_argument("--results", required=True)
    tp = sub.add_parser("train")
    tp.add_argument("--mode", choices=("bootseer", "dcp"), required=True)
    tp.add_argument("--ckpt", required=True)
    tp.add_argument("--size", choices=tuple(SIZES), default="full")
    tp.add_argument("--steps", type=int, default=1000)
    tp.add_argument("--save-every", type=int, default=0)
    tp.add_argument("--steps-after-resume", type=int, default=2)
    tp.add_argument(
        "--local-copy",
        default=None,
        help="load (DCP) from this local copy, once the copy tool finished it",
    )
    tp.add_argument("--results", required=True)
    if argv[:1] == ["launch"]:
        split = argv.index("--") if "--" in argv else len(argv)
        args = p.parse_args(argv[:split])
        return launch(args, argv[split + 1 :])
    return train(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
