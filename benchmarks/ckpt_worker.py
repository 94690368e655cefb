"""One rank of the ckpt benchmark (launched by bench_ckpt.py; not run by hand).

Each rank holds an FSDP-style half of a transformer-shaped model and its AdamW state: every
parameter and optimizer tensor is this rank's contiguous half of a flat global tensor. For
bootseer that is a ``FlatShard``; for DCP the same local tensor as a ``DTensor`` with
``Shard(0)`` on a 1-D mesh. Both therefore write exactly the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, init_device_mesh  # noqa: E402

from ckpt import CheckpointManager, FlatShard, init_optimizer_state  # noqa: E402


class Model(torch.nn.Module):
    """Embedding, N pre-norm transformer blocks, tied output head."""

    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                d, max(1, d // 64), 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.linear(x, self.emb.weight)


def build(cfg: dict[str, Any], rank: int) -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(1000 + rank)
    model = Model(cfg["vocab"], cfg["d"], cfg["layers"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    init_optimizer_state(opt)
    return model, opt


def train_step(model: Model, opt: torch.optim.Optimizer, cfg: dict[str, Any]) -> None:
    tokens = torch.randint(0, cfg["vocab"], (1, cfg["seq"]))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def tensors(
    model: Model, opt: torch.optim.Optimizer, params_only: bool = False
) -> dict[str, torch.Tensor]:
    out = {f"model/{n}": p.detach().view(-1) for n, p in model.named_parameters()}
    if not params_only:
        names = {p: n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{names[p]}/{k}"] = st[k].view(-1)
    return out


def ours_state(flat: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    return {
        "t": {k: FlatShard(v, rank * v.numel(), world * v.numel()) for k, v in flat.items()},
        "step": 0,
    }


def dcp_state(flat: dict[str, torch.Tensor], mesh) -> dict[str, Any]:
    return {
        "t": {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in flat.items()}
    }


def drop_caches(rank: int) -> None:
    dist.barrier()
    # BOOTSEER_BENCH_KEEP_CACHES (bench_ckpt --smoke): warm loads, the machine's cache kept
    if rank == 0 and os.environ.get("BOOTSEER_BENCH_KEEP_CACHES") != "1":
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)
    dist.barrier()


def rss() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def synced(fn) -> float:
    """Wall time of ``fn`` on every rank until the slowest finished (a barrier each side)."""
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def copy_into(flat: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
    off = 0
    for v in flat.values():
        n = v.numel() * v.element_size()
        buf[off : off + n].view(v.dtype).copy_(v)
        off += n


def dcp_async(state, url: str, kind: str, stager):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return dcp.async_save(
        state,
        storage_writer=FsspecWriter(url, sync_files=False)
        if url.startswith("s3")
        else dcp.FileSystemWriter(url),
        async_checkpointer_type=AsyncCheckpointerType[kind],
        async_stager=stager,
    )


def make_stager():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # DCP at its best on CPU: cached shared-memory staging buffers, staging off the
    # training thread (pinned memory only matters with CUDA).
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=torch.cuda.is_available(),
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=torch.cuda.is_available(),
        )
    )


def phase_local(cfg, rank, world, out) -> None:
    model, opt = build(cfg, rank)
    flat = tensors(model, opt)
    root = Path(cfg["dir"])
    out["state_bytes_rank"] = sum(v.numel() * v.element_size() for v in flat.values())
    out["rss_before"] = rss()
    # -- bootseer: 10 saves (RSS), stalls, durable ------------------------------------------------
    mgr = CheckpointManager(str(root / "ours"), rank=rank, world_size=world, keep=2)
    stalls, durables, floors = [], [], []
    floor_buf = torch.empty(out["state_bytes_rank"], dtype=torch.uint8)
    for step in range(cfg.get("saves", 10)):
        # the floor, measured right before each save under the same conditions: one copy of
        # this rank's tensors into a preallocated buffer
        dist.barrier()
        floors.append(timed(lambda: copy_into(flat, floor_buf)))
        dist.barrier()
        t = time.perf_counter()
        handle = mgr.save(step, ours_state(flat, rank, world))
        stalls.append(time.perf_counter() - t)
        handle.wait()
        dist.barrier()  # rank 0 committed: the checkpoint is durable for everyone
        durables.append(time.perf_counter() - t)
    floor_buf = torch.empty(0)  # the floor's buffer is not ours: release it before reading RSS
    gc.collect()
    out["rss_after_10_saves"] = rss()  # the key kept: after cfg["saves"] saves (10 unless smoke)
    out["ours_stall"] = stalls
    out["ours_durable"] = durables
    out["copy_floor_runs"] = floors
    mgr.close()
    # -- DCP save (synchronous) -------------------------------------------------------------------
    mesh = init_device_mesh("cpu", (world,))
    out["dcp_save"] = [
        synced(
            lambda i=i: dcp.save(
                dcp_state(flat, mesh),
                storage_writer=dcp.FileSystemWriter(str(root / f"dcp-sync-{i}")),
            )
        )
        for i in range(cfg.get("dcp_saves", 2))
    ]
    # -- DCP async_save, thread and process checkpointers ----------------------------------------
    for kind in ("THREAD", "PROCESS"):
        stager = make_stager()
        runs = []
        for i in range(cfg.get("dcp_async_runs", 3)):
            dist.barrier()
            t = time.perf_counter()
            resp = dcp_async(dcp_state(flat, mesh), str(root / f"dcp-{kind}-{i}"), kind, stager)
            t_return = time.perf_counter() - t
            staging = getattr(resp, "staging_completion", None)
            if staging is not None:
                staging.result()
            t_safe = time.perf_counter() - t
            (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
            dist.barrier()
            runs.append({"return": t_return, "safe": t_safe, "durable": time.perf_counter() - t})
        stager.close()
        out[f"dcp_async_{kind.lower()}"] = runs
    # -- loads, page cache dropped first; alternate to spread disk noise ------------------------
    ours_mgr = CheckpointManager(str(root / "ours"), rank=rank, world_size=world)
    target = ours_state(flat, rank, world)
    loads_ours, loads_dcp, floor_reads = [], [], []
    last = cfg.get("saves", 10) - 1
    stripes = sorted(
        str(p) for p in (root / "ours" / f"step-{last}").glob(".rank-*.data.stripes/*/*")
    )
    dcp_dir = str(root / f"dcp-sync-{cfg.get('dcp_saves', 2) - 1}")
    for _ in range(cfg.get("loads", 3)):
        # the floor: the same bytes (this checkpoint's data files) read sequentially, cold
        drop_caches(rank)
        if rank == 0:
            floor_reads.append(
                timed(
                    lambda: subprocess.run(["cat", *stripes], stdout=subprocess.DEVNULL, check=True)
                )
            )
        drop_caches(rank)
        loads_ours.append(synced(lambda: ours_mgr.load(target)))
        drop_caches(rank)
        loads_dcp.append(
            synced(
                lambda: dcp.load(
                    dcp_state(flat, mesh),
                    storage_reader=dcp.FileSystemReader(dcp_dir),
                )
            )
        )
    out["ours_load"], out["dcp_load"], out["floor_read_runs"] = loads_ours, loads_dcp, floor_reads
    ours_mgr.close()
    if rank == 0:
        numels = {k: v.numel() * world for k, v in flat.items()}
        (root / "numels.json").write_text(json.dumps(numels))


def phase_reshard(cfg, rank, world, out) -> None:
    """Load the 2-rank checkpoints at 4 ranks: each rank reads its quarter of every tensor."""
    root = Path(cfg["dir"])
    numels = json.loads((root / "numels.json").read_text())
    local = {k: torch.empty(n // world) for k, n in numels.items()}
    mesh = init_device_mesh("cpu", (world,))
    mgr = CheckpointManager(str(root / "ours"), rank=rank, world_size=world)
    ours = {
        "t": {k: FlatShard(v, rank * v.numel(), numels[k]) for k, v in local.items()},
        "step": 0,
    }
    runs_ours, runs_dcp = [], []
    dcp_dir = str(root / f"dcp-sync-{cfg.get('dcp_saves', 2) - 1}")
    for _ in range(cfg.get("reshard_runs", 2)):
        drop_caches(rank)
        runs_ours.append(synced(lambda: mgr.load(ours)))
        drop_caches(rank)
        runs_dcp.append(
            synced(
                lambda: dcp.load(
                    {
                        "t": {
                            k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False)
                            for k, v in local.items()
                        }
                    },
                    storage_reader=dcp.FileSystemReader(dcp_dir),
                )
            )
        )
    out["ours_reshard_load"], out["dcp_reshard_load"] = runs_ours, runs_dcp
    mgr.close()


def phase_train(cfg, rank, world, out) -> None:
    """The same training loop with no saves, our saves, DCP async_save and DCP save."""
    model, opt = build(cfg, rank)
    flat = tensors(model, opt)
    root = Path(cfg["dir"])
    mesh = init_device_mesh("cpu", (world,))
    steps, every = cfg["train_steps"], cfg["save_every"]
    stager = make_stager()
    mgr = CheckpointManager(str(root / "train-ours"), rank=rank, world_size=world, keep=1)
    kind = cfg.get("dcp_async_kind", "PROCESS")

    def loop(method: str) -> float:
        pending = []
        dist.barrier()
        t = time.perf_counter()
        for step in range(steps):
            train_step(model, opt, cfg)
            if method != "none" and step % every == every - 1:
                if method == "ours":
                    mgr.save(step, ours_state(flat, rank, world))
                elif method == "dcp_async":
                    for p in pending:
                        p.result()
                    resp = dcp_async(
                        dcp_state(flat, mesh), str(root / f"train-dcp-{step}"), kind, stager
                    )
                    pending = [getattr(resp, "upload_completion", resp)]
                else:
                    dcp.save(
                        dcp_state(flat, mesh),
                        storage_writer=dcp.FileSystemWriter(str(root / f"train-dcps-{step}")),
                    )
        if method == "ours":
            mgr.wait()
        for p in pending:
            p.result()
        dist.barrier()
        return time.perf_counter() - t

    loop("none")  # warm-up: first-touch of activations and optimizer buffers
    for method in ("none", "ours", "dcp_async", "dcp_save") * cfg.get("train_reps", 3):
        out.setdefault(f"train_{method}", []).append(loop(method))
    out["saves_per_loop"] = steps // every
    out["step_s"] = min(out["train_none"]) / steps
    mgr.close()
    stager.close()


def phase_s3(cfg, rank, world, out) -> None:
    """Model parameters only, through the shaped link: ours (striped) vs DCP on plain s3fs."""
    model, opt = build(cfg, rank)
    flat = tensors(model, opt, params_only=True)
    out["s3_bytes_rank"] = sum(v.numel() * v.element_size() for v in flat.values())
    mesh = init_device_mesh("cpu", (world,))
    opts = cfg["s3"]
    mgr = CheckpointManager(
        f"s3://{cfg['bucket']}/ours", rank=rank, world_size=world, storage_options={"s3": opts}
    )
    out["s3_ours_save"] = synced(lambda: mgr.save(1, ours_state(flat, rank, world), block=True))
    target = ours_state(flat, rank, world)
    out["s3_ours_load"] = synced(lambda: mgr.load(target))
    mgr.close()
    url = f"s3://{cfg['bucket']}/dcp"
    out["s3_dcp_save"] = synced(
        lambda: dcp.save(
            dcp_state(flat, mesh), storage_writer=FsspecWriter(url, sync_files=False, **opts)
        )
    )
    out["s3_dcp_load"] = synced(
        lambda: dcp.load(dcp_state(flat, mesh), storage_reader=FsspecReader(url, **opts))
    )


PHASES = {"local": phase_local, "reshard": phase_reshard, "train": phase_train, "s3": phase_s3}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", required=True, choices=sorted(PHASES))
    p.add_argument("--cfg", required=True)
    a = p.parse_args()
    cfg = json.loads(Path(a.cfg).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {"rank": rank, "world": world}
    try:
        PHASES[a.phase](cfg, rank, world, out)
        dist.barrier()  # nobody tears gloo down while another rank still uses it
    finally:
        Path(cfg["out"]).mkdir(parents=True, exist_ok=True)
        (Path(cfg["out"]) / f"{a.phase}-{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
