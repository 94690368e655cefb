"""Worker code for the multi-process ckpt tests (importable; also a script).

Two kinds of workers live here:

* torch.distributed ranks (gloo over 127.0.0.1) started with
  ``torch.multiprocessing.start_processes(..., start_method="spawn")`` by :func:`run_group`:
  each rank builds a training-like state (replicated plain tensors, DTensors on 1-D and 2-D
  meshes, uneven FlatShards, PerRank values, objects) and runs a list of actions (save,
  load and check, partial-read measurement, mismatch) against local and S3 checkpoints;
  it writes what it saw to ``rank-<r>.json`` for the test to assert on.
* a fork server for the SIGKILL trials (``python tests/ckpt_workers.py fork-server``): it
  imports torch and ckpt once, then forks fresh rank processes per trial (no
  torch.distributed: ckpt itself uses no collectives), so that 20+ trials fit in CI time.

Everything a rank saves is a pure function of a seed, so the parent regenerates the
expected content bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

STRIPE = 64 * 1024  # small stripes: partial reads and many-stripe saves are measurable
CONCURRENCY = 4

# -- helpers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bit_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, same shape, same bytes (so -0.0 != 0.0 and NaN payloads count)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    a = got.detach().reshape(-1).contiguous().view(torch.uint8)
    b = want.detach().reshape(-1).contiguous().view(torch.uint8)
    return torch.equal(a, b) and torch.equal(got, want)


def set_in(state: dict, key: str, value: Any) -> None:
    *parents, last = key.split("/")
    node = state
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def get_in(state: dict, key: str) -> Any:
    node: Any = state
    for p in key.split("/"):
        node = node[p]
    return node


def describe_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    diff = got.reshape(-1).view(torch.uint8) != want.reshape(-1).view(torch.uint8)
    return f"{int(diff.sum())} differing bytes of {diff.numel()}"


# -- the distributed state -------------------------------------------------------------------

PLAIN_KEYS = (
    "model/embed",
    "model/l0.w",
    "model/l0.b",
    "model/l1.w",
    "model/l2.w",
    "model/l3.w",
    "model/pos",
    "model/mask",
    "model/scale",
    "model/count",
    "model/empty",
)
ROW_KEY = "dt/row"  # Shard(0) on every 1-D mesh: the partial-read measurement uses it
ROW_SHAPE = (2048, 256)  # 2 MiB of float32
FLAT_SHAPES = {"flat/p0": (37, 53), "flat/p1": (300,)}
# Uneven element boundaries of the flat parameters, per world size (empty pieces included).
FLAT_BOUNDS = {
    "flat/p0": {1: [0, 1961], 2: [0, 1000, 1961], 4: [0, 97, 1000, 1001, 1961]},
    "flat/p1": {1: [0, 300], 2: [0, 250, 300], 4: [0, 0, 130, 130, 300]},
}


def global_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the distributed test state, as a full global tensor."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype)

    return {
        "model/embed": randn(512, 128),  # 256 KiB
        "model/l0.w": randn(256, 256, dtype=torch.bfloat16),
        "model/l0.b": randn(256, dtype=torch.float16),
        "model/l1.w": randn(192, 256),
        "model/l2.w": randn(128, 256),
        "model/l3.w": randn(64, 256),
        "model/pos": torch.randint(-(2**40), 2**40, (64, 3), generator=g),
        "model/mask": torch.rand(31, 17, generator=g) > 0.5,
        "model/scale": torch.tensor(seed + 0.125, dtype=torch.float64),  # 0-d
        "model/count": torch.randint(0, 1000, (7,), generator=g, dtype=torch.int32),
        "model/empty": torch.empty(0, 4),
        ROW_KEY: randn(*ROW_SHAPE),
        "dt/col": randn(37, 102),  # Shard(1): 102 columns over 4 ranks is uneven
        "dt/rep": randn(50, 20, dtype=torch.bfloat16),
        "dt/uneven": randn(5, 33),  # Shard(0) over 4 ranks: 2, 2, 1, 0 rows
        "dt/mesh_sr": randn(66, 40),
        "dt/mesh_ss": randn(30, 44, dtype=torch.float64),
        "flat/p0": randn(37 * 53),
        "flat/p1": randn(300, dtype=torch.bfloat16),
    }


def dtensor_specs(world: int) -> dict[str, tuple[tuple[int, ...], list[Any]] | None]:
    """key -> (mesh shape, placements) for this world size; ``None``: a plain tensor."""
    from torch.distributed.tensor import Replicate, Shard

    one = (world,)
    specs: dict[str, tuple[tuple[int, ...], list[Any]] | None] = {
        ROW_KEY: (one, [Shard(0)]),
        "dt/col": (one, [Shard(1)]),
        "dt/rep": (one, [Replicate()]),
        "dt/uneven": (one, [Shard(0)]),
    }
    if world == 4:
        specs["dt/mesh_sr"] = ((2, 2), [Shard(0), Replicate()])
        specs["dt/mesh_ss"] = ((2, 2), [Shard(0), Shard(1)])
    elif world == 2:
        specs["dt/mesh_sr"] = (one, [Shard(0)])
        specs["dt/mesh_ss"] = (one, [Shard(1)])
    else:  # one process: a Replicate DTensor and a plain tensor (DTensor <-> plain reshards)
        specs["dt/mesh_sr"] = (one, [Replicate()])
        specs["dt/mesh_ss"] = None
    return specs


def meta_objects(seed: int) -> dict[str, Any]:
    return {
        "step": seed * 10 + 3,
        "epoch": seed % 7,
        "sched": {"lr": 1e-4 * (1 + seed % 5), "betas": [0.9, 0.999], "name": f"cos-{seed}"},
    }


def per_rank_value(seed: int, rank: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "seed": seed,
        "rng": torch.arange(6, dtype=torch.int64) * (rank + 1) + seed,
    }


class Meshes:
    """Device meshes of this process group, created once (all ranks, same order)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._meshes: dict[tuple[int, ...], Any] = {}

    def get(self, shape: tuple[int, ...]) -> Any:
        if shape not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[shape] = init_device_mesh("cpu", shape)
        return self._meshes[shape]


def build_state(meshes: Meshes, rank: int, seed: int) -> dict[str, Any]:
    """This rank's state holding the values of ``seed`` (a different seed: a load target)."""
    from torch.distributed.tensor import distribute_tensor

    from ckpt import FlatShard, PerRank

    world = meshes.world
    specs = dtensor_specs(world)
    state: dict[str, Any] = {}
    for key, full in global_tensors(seed).items():
        if key in FLAT_SHAPES:
            lo, hi = FLAT_BOUNDS[key][world][rank : rank + 2]
            leaf: Any = FlatShard(
                full.reshape(-1)[lo:hi].clone(), lo, full.numel(), FLAT_SHAPES[key]
            )
        elif specs.get(key) is not None:
            shape, placements = specs[key]  # type: ignore[misc]
            leaf = distribute_tensor(full, meshes.get(shape), placements, src_data_rank=None)
        else:
            leaf = full.clone()
        set_in(state, key, leaf)
    state["meta"] = meta_objects(seed)
    state["rng"] = PerRank(per_rank_value(seed, rank))
    return state


def scribble(state: dict[str, Any]) -> None:
    """Overwrite every tensor in place (training goes on while the save persists)."""
    from torch.distributed.tensor import DTensor

    from ckpt import FlatShard

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                visit(v)
        elif isinstance(node, FlatShard):
            node.local.fill_(7)
        elif isinstance(node, DTensor):
            node.to_local().fill_(7)
        elif isinstance(node, torch.Tensor):
            node.fill_(7)

    visit(state)


def check_state(
    state: dict[str, Any], rank: int, seed: int, saved_world: int, skip: tuple[str, ...] = ()
) -> list[str]:
    """Every tensor equals its expected global slice bit for bit; objects and PerRank back."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ckpt import FlatShard, PerRank

    problems = []
    for key, full in global_tensors(seed).items():
        if key in skip:
            continue
        leaf = get_in(state, key)
        if isinstance(leaf, FlatShard):
            got = leaf.local
            want = full.reshape(-1)[leaf.offset : leaf.offset + got.numel()]
        elif isinstance(leaf, DTensor):
            got = leaf.to_local()
            want = distribute_tensor(
                full, leaf.device_mesh, leaf.placements, src_data_rank=None
            ).to_local()
        else:
            got, want = leaf, full
        if not bit_equal(got, want):
            problems.append(f"{key} on rank {rank}: {describe_mismatch(got, want)}")
    if state["meta"] != meta_objects(seed):
        problems.append(f"objects on rank {rank}: {state['meta']} != {meta_objects(seed)}")
    per = state["rng"]
    owner = rank if rank < saved_world else 0  # ranks the save did not have get rank 0's
    want_per = per_rank_value(seed, owner)
    if (
        not isinstance(per, PerRank)
        or per.value.keys() != want_per.keys()
        or any(
            not (bit_equal(per.value[k], v) if isinstance(v, torch.Tensor) else per.value[k] == v)
            for k, v in want_per.items()
        )
    ):
        problems.append(f"PerRank on rank {rank}: {per!r}, expected {want_per!r}")
    return problems


# -- actions of a distributed rank -------------------------------------------------------------


def _manager(action: dict[str, Any], rank: int, world: int) -> Any:
    from ckpt import CheckpointManager

    return CheckpointManager(
        action["url"],
        rank=rank,
        world_size=world,
        storage_options=action.get("storage_options"),
        stripe_size=STRIPE,
        concurrency=CONCURRENCY,
    )


def act_save(meshes: Meshes, rank: int, action: dict[str, Any]) -> dict[str, Any]:
    state = build_state(meshes, rank, action["seed"])
    mgr = _manager(action, rank, meshes.world)
    try:
        handle = mgr.save(action["step"], state)
        scribble(state)  # the staged copy is what gets written, whatever happens after
        result = handle.wait()
    finally:
        mgr.close()
    return {"bytes_written": result.bytes_written, "committed": result.committed}


def act_load(meshes: Meshes, rank: int, action: dict[str, Any]) -> dict[str, Any]:
    target = build_state(meshes, rank, action["seed"] + 7919)  # different values everywhere
    mgr = _manager(action, rank, meshes.world)
    try:
        latest = mgr.latest()
        report = mgr.load_with_report(target)
    finally:
        mgr.close()
    problems = check_state(target, rank, action["seed"], action["saved_world"])
    if report.step != action["step"] or latest != action["step"]:
        problems.append(
            f"rank {rank}: loaded step {report.step}, latest {latest}, expected {action['step']}"
        )
    return {"problems": problems, "bytes_read": report.bytes_read, "loaded": len(report.loaded)}


def act_partial_read(meshes: Meshes, rank: int, action: dict[str, Any]) -> dict[str, Any]:
    """Load only the Shard(0) key into this rank's slice and count the bytes fetched."""
    from torch.distributed.tensor import Shard, distribute_tensor

    world, saved_world = meshes.world, action["saved_world"]
    garbage = torch.full(ROW_SHAPE, -1.0)
    dt = distribute_tensor(garbage, meshes.get((world,)), [Shard(0)], src_data_rank=None)
    state = {"dt": {"row": dt}}
    mgr = _manager(action, rank, world)
    try:
        report = mgr.load_with_report(state, strict=False)
    finally:
        mgr.close()
    want = global_tensors(action["seed"])[ROW_KEY]
    local = dt.to_local()
    rows = ROW_SHAPE[0]
    mine = torch.chunk(torch.arange(rows), world)[rank]  # torch's Shard(0) split, not ckpt's
    lo, hi = int(mine[0]), int(mine[-1]) + 1
    per_src = rows // saved_world
    sources = sum(1 for r in range(saved_world) if r * per_src < hi and lo < (r + 1) * per_src)
    return {
        "bytes_read": report.bytes_read,
        "slice_bytes": local.numel() * local.element_size(),
        "whole_bytes": want.numel() * want.element_size(),
        "source_chunks": sources,
        "equal": bit_equal(local, want[lo:hi]),
        "loaded": report.loaded,
        "unexpected": len(report.unexpected),
    }


def act_mismatch(meshes: Meshes, rank: int, action: dict[str, Any]) -> dict[str, Any]:
    """A key the checkpoint lacks, one it has that the state lacks, and a wrong shape."""
    from ckpt import StateMismatchError

    def target() -> dict[str, Any]:
        state = build_state(meshes, rank, action["seed"] + 104729)
        state["model"]["new_head"] = torch.full((4, 4), 5.0)  # missing from the checkpoint
        state["model"]["embed"] = torch.full((500, 128), 3.0)  # checkpoint: [512, 128]
        del state["model"]["count"]  # unexpected in the checkpoint
        return state

    mgr = _manager(action, rank, meshes.world)
    out: dict[str, Any] = {}
    try:
        try:
            mgr.load(target())
            out["strict_error"] = None
        except StateMismatchError as exc:
            out["strict_error"] = {"problems": exc.problems, "step": exc.step}
        state = target()
        report = mgr.load_with_report(state, strict=False)
    finally:
        mgr.close()
    problems = check_state(
        state, rank, action["seed"], action["saved_world"], skip=("model/embed", "model/count")
    )
    if not torch.equal(state["model"]["embed"], torch.full((500, 128), 3.0)):
        problems.append("model/embed (shape mismatch) was written by a non-strict load")
    if not torch.equal(state["model"]["new_head"], torch.full((4, 4), 5.0)):
        problems.append("model/new_head (not in the checkpoint) was changed")
    out.update(
        problems=problems,
        missing=report.missing,
        unexpected=report.unexpected,
        mismatched=report.mismatched,
    )
    return out


# -- agreement: every rank loads the same step ----------------------------------------------------

AGREE_N = 147_456  # elements of the flat parameter "w": 576 KiB, several stripes per rank


def agree_bounds(world: int, rank: int) -> tuple[int, int]:
    return rank * AGREE_N // world, (rank + 1) * AGREE_N // world


def agree_global(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(AGREE_N, generator=g), "bias": torch.randn(300, generator=g)}


def agree_state(step: int, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: its own piece of "w" (first in its data file, read by
    it alone at the saved world size), "bias" (replicated: written by one rank, read by all),
    a per-rank value and an object."""
    from ckpt import FlatShard, PerRank

    full = agree_global(step)
    lo, hi = agree_bounds(world, rank)
    return {
        "w": FlatShard(full["w"][lo:hi].clone(), lo, AGREE_N),
        "bias": full["bias"].clone(),
        "rng": PerRank(torch.full((4,), step * 100 + rank)),
        "step": step,
    }


def agree_blank(rank: int, world: int) -> dict[str, Any]:
    from ckpt import FlatShard, PerRank

    lo, hi = agree_bounds(world, rank)
    return {
        "w": FlatShard(torch.zeros(hi - lo), lo, AGREE_N),
        "bias": torch.zeros(300),
        "rng": PerRank(None),
        "step": None,
    }


def agree_problems(
    state: dict[str, Any], step: int, rank: int, world: int, saved_world: int
) -> list[str]:
    """How ``state`` differs from ``step``'s values for this rank (bit for bit)."""
    want = agree_state(step, rank, world)
    problems = []
    if not bit_equal(state["w"].local, want["w"].local):
        problems.append(f"w on rank {rank} is not step {step}'s")
    if not bit_equal(state["bias"], want["bias"]):
        problems.append(f"bias on rank {rank} is not step {step}'s")
    owner = rank if rank < saved_world else 0
    if state["step"] != step or not bit_equal(
        state["rng"].value, torch.full((4,), step * 100 + owner)
    ):
        problems.append(f"objects on rank {rank}: step {state['step']}, rng {state['rng'].value}")
    return problems


def save_agree_steps(url: str, world: int, steps: list[int]) -> None:
    """Save ``steps`` of the agreement state as ``world`` ranks from this one process (ranks
    W-1 .. 1 first, then rank 0, which commits)."""
    from ckpt import CheckpointManager

    for step in steps:
        for rank in reversed(range(world)):
            with CheckpointManager(
                url, rank=rank, world_size=world, stripe_size=STRIPE, cache_dir=False
            ) as mgr:
                mgr.save(step, agree_state(step, rank, world), block=True)


def flip_chunk_byte(
    url: str,
    step: int,
    rank: int,
    key: str | None = None,
    *,
    at: str = "middle",
    kind: str | None = None,
) -> str:
    """Flip one byte inside a chunk of rank ``rank``'s data file of ``step`` (in its stripe,
    so the stripe fails its checksum); the chunk is ``key``'s, else the largest of ``kind``,
    else the first. Returns the data file's path."""
    from ckpt.layout import RankIndex, data_name, index_name, step_dir
    from striped_fs.layout import Manifest as StripeManifest
    from striped_fs.layout import stripe_path
    from striped_fs.urls import url_to_fs

    fs, root = url_to_fs(url)
    directory = step_dir(root, step)
    index = RankIndex.from_json(fs.cat_file(f"{directory}/{index_name(rank)}"), path="index")
    chunks = [
        c
        for c in index.chunks
        if c.nbytes and (key is None or c.key == key) and (kind is None or c.kind == kind)
    ]
    chunk = (
        max(chunks, key=lambda c: c.nbytes) if kind else min(chunks, key=lambda c: c.byte_offset)
    )
    offset = chunk.byte_offset + (chunk.nbytes // 2 if at == "middle" else chunk.nbytes - 100)
    path = f"{directory}/{data_name(rank)}"
    manifest = StripeManifest.from_bytes(fs.target.cat_file(path), path=path)
    victim = stripe_path(path, manifest.version, offset // manifest.stripe_size)
    raw = bytearray(fs.target.cat_file(victim))
    raw[offset % manifest.stripe_size] ^= 0x01
    fs.target.pipe_file(victim, bytes(raw))
    return path


class Captured(logging.Handler):
    """The warnings of the ``ckpt`` logger while it is installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Captured:
        logging.getLogger("ckpt").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("ckpt").removeHandler(self)


class CollectiveCount:
    """Counts the collectives a load runs (the real ones still run)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.calls = dist, {"all_reduce": 0, "all_gather_object": 0}
        self.saved = {name: getattr(dist, name) for name in self.calls}

    def __enter__(self) -> CollectiveCount:
        for name, fn in self.saved.items():

            def counted(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
                self.calls[_name] += 1
                return _fn(*args, **kwargs)

            setattr(self.dist, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def act_agree_load(meshes: Meshes, rank: int, action: dict[str, Any]) -> dict[str, Any]:
    """Load the agreement state (``step``: an explicit step); report the step, whether the
    state is that step's bit for bit, the warnings, and the collectives the load ran."""
    from ckpt import CheckpointManager

    world = meshes.world
    state = agree_blank(rank, world)
    if rank in action.get("extra_key_on", ()):
        state["not_in_checkpoint"] = torch.zeros(3)
    url = action.get("urls", {}).get(str(rank), action["url"])  # a rank may see another copy
    mgr = CheckpointManager(
        url,
        rank=rank,
        world_size=world,
        stripe_size=STRIPE,
        concurrency=CONCURRENCY,
        cache_dir=False,
    )
    out: dict[str, Any] = {}
    with Captured() as captured, CollectiveCount() as count:
        try:
            report = mgr.load_with_report(state, action.get("step"))
            out.update(
                step=report.step,
                skipped=getattr(report, "skipped", None),
                problems=agree_problems(state, report.step, rank, world, action["saved_world"]),
            )
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            out.update(raised=type(exc).__name__, message=str(exc))
        finally:
            mgr.close()
    out.update(warnings=captured.lines, collectives=count.calls)
    return out


def act_fsdp2(meshes: Meshes, rank: int, action: dict[str, Any]) -> dict[str, Any]:
    """The issue's case: FSDP2 on 2 ranks saves steps 1 and 2; one byte of rank 1's data file
    of step 2 flipped; fresh models load. Reports the step each rank loaded and whether the
    gathered (full) model and optimizer state equal step 1's bit for bit."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from ckpt import init_optimizer_state

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
        )
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(8, 64, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def gathered(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in model.named_parameters():  # full_tensor: a collective, same order
            out[name] = p.full_tensor().clone()
            for k, v in sorted(opt.state[p].items()):
                out[f"{name}/{k}"] = (
                    v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                )
        return out

    mgr = _manager(action, rank, meshes.world)
    model, opt = build()
    saved = {}
    for step in (1, 2):
        train(model, opt, step)
        msd, osd = get_state_dict(model, opt)
        mgr.save(step, {"model": msd, "optim": osd}, block=True)
        saved[step] = gathered(model, opt)
        dist.barrier()  # rank 0 returned from a blocking save: the step is committed
    if rank == 0:
        flip_chunk_byte(action["url"], 2, 1, kind="dtensor")
    dist.barrier()
    fresh, fresh_opt = build()
    init_optimizer_state(fresh_opt)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    with Captured() as captured:
        step = mgr.load(state)
    mgr.close()
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    got = gathered(fresh, fresh_opt)
    return {
        "step": step,
        "warnings": captured.lines,
        "differ_from_step1": sorted(k for k in saved[1] if not bit_equal(got[k], saved[1][k])),
        "keys": len(got),
        "differs_from_step2": any(not bit_equal(got[k], saved[2][k]) for k in saved[2]),
    }


ACTIONS = {
    "save": act_save,
    "load": act_load,
    "partial_read": act_partial_read,
    "mismatch": act_mismatch,
    "agree_load": act_agree_load,
    "fsdp2": act_fsdp2,
}


def rank_main(
    rank: int, world: int, port: int, actions: list[dict[str, Any]], out_dir: str
) -> None:
    """Entry point of one spawned rank (``start_processes`` passes the rank first)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    results: dict[str, Any] = {}
    try:
        meshes = Meshes(world)
        meshes.get((world,))
        if world == 4:
            meshes.get((2, 2))
        for action in actions:
            started = time.perf_counter()
            try:
                results[action["tag"]] = ACTIONS[action["op"]](meshes, rank, action)
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                results[action["tag"]] = {"error": traceback.format_exc()}
            results[action["tag"]]["seconds"] = time.perf_counter() - started
            dist.barrier()  # a save is committed (rank 0) before anyone loads it
    finally:
        Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def run_group(
    world: int, actions: list[dict[str, Any]], out_dir: str | os.PathLike[str]
) -> dict[str, dict[int, dict[str, Any]]]:
    """Run ``actions`` on ``world`` spawned gloo ranks; ``{tag: {rank: result}}``."""
    import torch.multiprocessing as mp

    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(
        rank_main,
        args=(world, free_port(), actions, out_dir),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for rank in range(world):
        for tag, payload in json.loads(Path(out_dir, f"rank-{rank}.json").read_text()).items():
            results.setdefault(tag, {})[rank] = payload
    return results


# -- SIGKILL trials: state and fork server ---------------------------------------------------

KILL_WORLD = 2
KILL_SPLIT = 0.45  # rank 0 holds 45 % of the flat parameter, rank 1 the rest (uneven)


def kill_flat_bounds(mb: float) -> list[int]:
    numel = int(mb * 2 * 2**20) // 4  # about ``mb`` MB of float32 per rank
    return [0, int(numel * KILL_SPLIT), numel]


def kill_piece(seed: int, rank: int, mb: float) -> torch.Tensor:
    lo, hi = kill_flat_bounds(mb)[rank : rank + 2]
    g = torch.Generator().manual_seed(seed * 2 + rank)
    return torch.rand(hi - lo, generator=g)


def kill_replicated(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 2 + 1_000_003)
    return {
        "emb": torch.rand(512, 512, generator=g),  # 1 MiB
        "head": torch.rand(256, 512, generator=g).to(torch.bfloat16),
        "bias": torch.rand(1000, generator=g).to(torch.float16),
        "idx": torch.randint(0, 2**62, (333,), generator=g),
        "flag": torch.tensor(seed % 2 == 0),
    }


def kill_expected(seed: int, mb: float) -> dict[str, Any]:
    """The whole content of a kill-trial checkpoint, as rank 0 of one process loads it."""
    model: dict[str, Any] = dict(kill_replicated(seed))
    model["flat"] = torch.cat([kill_piece(seed, r, mb) for r in range(KILL_WORLD)])
    return {
        "model": model,
        "meta": {"step": seed, "tag": f"seed-{seed}"},
        "rng": per_rank_value(seed, 0),
    }


def kill_state(seed: int, rank: int, mb: float) -> dict[str, Any]:
    from ckpt import FlatShard, PerRank

    bounds = kill_flat_bounds(mb)
    offset, numel = bounds[rank], bounds[-1]
    model: dict[str, Any] = dict(kill_replicated(seed))
    model["flat"] = FlatShard(kill_piece(seed, rank, mb), offset, numel)
    return {
        "model": model,
        "meta": {"step": seed, "tag": f"seed-{seed}"},
        "rng": PerRank(per_rank_value(seed, rank)),
    }


def kill_rank_main(cfg: dict[str, Any], rank: int) -> int:
    """One rank of a kill trial: save, wait, exit. 0: saved (rank 0: committed); 3: the
    save failed (rank 0's commit timed out waiting for a killed rank 1); 4: anything else."""
    from ckpt import CheckpointManager, CheckpointSaveError

    state = kill_state(cfg["seed"], rank, cfg["mb"])
    mgr = CheckpointManager(
        cfg["url"],
        rank=rank,
        world_size=KILL_WORLD,
        storage_options=cfg.get("storage_options"),
        keep=cfg.get("keep"),
        stripe_size=cfg["stripe"],
        concurrency=CONCURRENCY,
        commit_timeout_s=cfg["commit_timeout_s"],
    )
    mgr.save(cfg["step"], state)
    try:
        result = mgr.wait()
    except CheckpointSaveError as exc:
        print(f"rank {rank} step {cfg['step']}: {exc}", file=sys.stderr, flush=True)
        return 3
    if result is None or (rank == 0 and not result.committed):
        return 4
    return 0


def fork_server_main() -> None:
    """Read one JSON trial per line; fork ``world`` fresh rank processes; print their pids;
    wait for "reap"; print their exit codes (negative: killed by that signal)."""
    import torch.distributed.tensor  # noqa: F401 - imported once here, not in every child

    import ckpt  # noqa: F401

    try:
        import s3fs  # noqa: F401
    except ImportError:  # pragma: no cover - S3 trials skip without it
        pass
    torch.set_num_threads(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    print("READY", flush=True)
    while line := sys.stdin.readline():
        cfg = json.loads(line)
        if cfg.get("op") == "exit":
            break
        started = time.monotonic()
        pids = []
        for rank in range(cfg.get("world", KILL_WORLD)):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # a fresh rank process: never returns into the server loop
                code = 4
                try:
                    os.dup2(devnull, 0)
                    os.dup2(2, 1)
                    code = kill_rank_main(cfg, rank)
                except BaseException:  # noqa: BLE001 - reported by the exit code
                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        sys.stdin.readline()  # "reap": children stay zombies (pids not reused) until then
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps({"codes": codes, "elapsed": time.monotonic() - started}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["fork-server"]:
        fork_server_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} fork-server")
