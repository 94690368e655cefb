"""The checkpoint checks of ``gpu_check.py``: ``ckpt`` (CheckpointManager's save stall with
pinned staging, beside a plain ``.cpu()`` copy and DCP ``async_save``; its D2H bandwidth
beside the device's pinned copy floor; durable; load into device tensors) and ``memory`` (the
memory tier's every-step checkpoints in a GPU training loop, beside an A/A control).

On CPU the same code paths run on CPU tensors with small sizes; what needs CUDA (device-to-host
bandwidth, pinned memory) is skipped with one line.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

from _gpu_check_common import (
    GB,
    Check,
    MiB,
    free_gpu_memory,
    main,
    med,
    overhead_verdict,
    verdict,
)

ALIGN = 64  # offsets in the floor's buffer, as ckpt's layout aligns chunks
STALL_FACTOR = 1.3  # bench_ckpt's target: the stall within 1.3x one copy into a buffer
OVERHEAD_TARGET = 0.01


def _state(chk: Check, nbytes: int) -> dict[str, Any]:
    """A model-shaped state of about ``nbytes`` on the device: 16 large float32 matrices (the
    weights and optimizer moments) and 16 small vectors (norms), random, reproducible."""
    import torch

    gen = torch.Generator(device=chk.device).manual_seed(20260101)
    cols = 1024
    rows = max(1, int(nbytes * 0.999) // 16 // 4 // cols)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(16):
        tensors[f"layers.{i}.weight"] = torch.randn(rows, cols, device=chk.device, generator=gen)
        tensors[f"layers.{i}.norm"] = torch.randn(4096, device=chk.device, generator=gen)
    return tensors


def _nbytes(tensors: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in tensors.values())


class Floors:
    """The device's copy floors, measured with one preallocated (pinned on CUDA) buffer: the
    state's tensors copied into it one by one (what staging does, at its best), and the same
    bytes back into device tensors."""

    def __init__(self, chk: Check, tensors: dict[str, Any]) -> None:
        import torch

        self.chk, self.tensors = chk, tensors
        self.places, off = [], 0
        for v in tensors.values():
            self.places.append(off)
            off = -(-(off + v.numel() * v.element_size()) // ALIGN) * ALIGN
        self.buffer = torch.empty(off, dtype=torch.uint8, pin_memory=chk.cuda)

    def _views(self) -> list[tuple[Any, Any]]:
        return [
            (self.buffer[at : at + v.numel() * v.element_size()].view(v.dtype).view(v.shape), v)
            for at, v in zip(self.places, self.tensors.values(), strict=True)
        ]

    def d2h(self, runs: int = 3) -> dict[str, Any]:
        pairs = self._views()

        def copy() -> None:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=self.chk.cuda)

        times = [self.chk.timed(copy) for _ in range(runs)]
        return {"wall_s": [w for w, _ in times], "device_s": [g for _, g in times]}

    def h2d(self, targets: dict[str, Any], runs: int = 3) -> dict[str, Any]:
        pairs = [(targets[k], src) for k, (src, _) in zip(self.tensors, self._views(), strict=True)]

        def copy() -> None:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=self.chk.cuda)

        times = [self.chk.timed(copy) for _ in range(runs)]
        return {"wall_s": [w for w, _ in times], "device_s": [g for _, g in times]}


def _dcp_stager(cuda: bool) -> tuple[Any, str]:
    """DCP at its best here: a cached stager, pinned on CUDA, staging off the training thread."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None, "no DefaultStager in this torch: DCP's default staging"
    opts = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=cuda,
    )
    return DefaultStager(opts), (
        f"DefaultStager (cached{', pinned, non-blocking' if cuda else ''}"
        ", async staging), thread checkpointer"
    )


def _init_world_of_one(store: Path) -> None:
    """DCP's async_save wants a CPU-capable process group: gloo, one rank, a file store."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def check_ckpt(chk: Check) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt import CheckpointManager

    cuda = chk.cuda
    want = int(float(chk.cfg.get("state_gb") or (4.0 if cuda else 0.032)) * GB)
    saves = int(chk.cfg.get("saves") or (3 if cuda else 2))
    tensors = _state(chk, want)
    total = chk.figure("state_bytes", _nbytes(tensors))
    work, where = chk.work_dir(3 * total + (1 << 30))
    work.mkdir(parents=True, exist_ok=True)
    chk.figure("destination", where)
    chk.note(
        f"state {total / GB:.2f} GB in {len(tensors)} tensors on {chk.describe()}; files on {where}"
    )

    floors = Floors(chk, tensors)
    d2h = chk.figure("floor_d2h", floors.d2h())
    floor_s = min(d2h["wall_s"][1:] or d2h["wall_s"])

    # -- bootseer: save (the stall: staging) and until durable ---------------------------------
    state = {"model": tensors, "step": 0}
    mgr = CheckpointManager(
        str(work / "ours"),
        rank=0,
        world_size=1,
        keep=1,
        cache_dir=False,
        memory=False,
        process_group=False,
    )
    stalls, stage_device, durable = [], [], []
    for i in range(saves):
        state["step"] = i
        holder: dict[str, Any] = {}
        wall, dev = chk.timed(lambda i=i, holder=holder: holder.update(h=mgr.save(i, state)))
        stalls.append(wall)
        stage_device.append(dev)
        t = time.perf_counter()
        holder["h"].wait()
        durable.append(wall + time.perf_counter() - t)
        chk.figure(
            "ours", {"stall_s": stalls, "stall_device_s": stage_device, "durable_s": durable}
        )
    pinned = bool(mgr._pool._buffer is not None and mgr._pool._buffer.is_pinned())  # noqa: SLF001
    chk.figure("staging_pinned", pinned)

    # -- the plain synchronous copy ---------------------------------------------------------
    def plain() -> None:
        copies = {k: (v.cpu() if cuda else v.clone()) for k, v in tensors.items()}
        del copies

    plain_s = [chk.timed(plain)[0] for _ in range(saves)]
    chk.figure("plain_copy_s", plain_s)

    # -- DCP async_save ----------------------------------------------------------------------
    _init_world_of_one(work / "store")
    stager, stager_text = _dcp_stager(cuda)
    chk.figure("dcp_stager", stager_text)
    dcp_runs, last_dcp = [], None
    for i in range(saves):
        target = work / f"dcp-{i}"
        chk.sync()
        t = time.perf_counter()
        resp = dcp.async_save(
            {"model": tensors, "step": i},
            storage_writer=dcp.FileSystemWriter(str(target)),
            **({"async_stager": stager} if stager is not None else {}),
        )
        returned = time.perf_counter() - t
        staging = getattr(resp, "staging_completion", None)
        if staging is not None:
            staging.result()
        safe = time.perf_counter() - t
        getattr(resp, "upload_completion", resp).result()
        dcp_runs.append(
            {"return_s": returned, "safe_s": safe, "durable_s": time.perf_counter() - t}
        )
        if last_dcp is not None:
            shutil.rmtree(last_dcp, ignore_errors=True)
        last_dcp = target
        chk.figure("dcp_async", dcp_runs)
    if stager is not None:
        stager.close()

    # -- loads into device tensors ------------------------------------------------------------
    targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
    tstate = {"model": targets, "step": -1}
    ours_load, _ = chk.timed(lambda: mgr.load(tstate))
    ours_equal = (
        all(torch.equal(targets[k], v) for k, v in tensors.items()) and tstate["step"] == saves - 1
    )
    for v in targets.values():
        v.zero_()
    dcp_load, _ = chk.timed(lambda: dcp.load({"model": targets}, checkpoint_id=str(last_dcp)))
    dcp_equal = all(torch.equal(targets[k], v) for k, v in tensors.items())
    h2d = floors.h2d(targets)
    mgr.close()
    chk.figure(
        "load",
        {
            "ours_s": ours_load,
            "ours_equal": ours_equal,
            "dcp_s": dcp_load,
            "dcp_equal": dcp_equal,
            "floor_h2d": h2d,
        },
    )
    import torch.distributed as dist

    dist.destroy_process_group()
    _ckpt_rows(
        chk,
        total,
        {
            "stalls": stalls,
            "stage_device": stage_device,
            "durable": durable,
            "plain": plain_s,
            "dcp": dcp_runs,
            "d2h": d2h,
            "floor_s": floor_s,
            "pinned": pinned,
            "where": where,
            "load": (ours_load, ours_equal, dcp_load, dcp_equal, h2d),
        },
    )
    shutil.rmtree(work, ignore_errors=True)


def _steady(xs: list[float]) -> float:
    """The median after the first (it pays the one-time allocations)."""
    return med(xs[1:] or xs)


def _ckpt_rows(chk: Check, total: int, m: dict[str, Any]) -> None:
    """The table's rows from the measurements ``m`` (see :func:`check_ckpt`)."""
    cuda = chk.cuda
    stalls, stage_device, durable = m["stalls"], m["stage_device"], m["durable"]
    plain_s, dcp_runs, d2h, floor_s = m["plain"], m["dcp"], m["d2h"], m["floor_s"]
    pinned, where = m["pinned"], m["where"]
    stall = _steady(stalls)
    safe = _steady([r["safe_s"] for r in dcp_runs])
    ret = _steady([r["return_s"] for r in dcp_runs])
    plain = _steady(plain_s)
    peer = (
        f"{'.cpu()' if cuda else '.clone()'} {plain:.3f} s; DCP async_save safe {safe:.3f} s "
        f"(returns {ret:.3f} s)"
    )
    what = "one pinned D2H copy_ per tensor" if cuda else "one copy into a preallocated buffer"
    chk.row(
        "save stall (steady, per save)",
        f"{stall:.3f} s",
        peer,
        f"<= {STALL_FACTOR}x floor ({what}) {floor_s:.3f} s (got {stall / floor_s:.2f}x)",
        verdict(stall <= STALL_FACTOR * floor_s),
    )
    chk.row(
        "first save (allocates the staging pool)",
        f"{stalls[0]:.3f} s",
        f"DCP first async_save safe {dcp_runs[0]['safe_s']:.3f} s",
        "info",
        "info",
    )
    if cuda:
        dev = [g for g in d2h["device_s"][1:] if g] or [g for g in d2h["device_s"] if g]
        floor_bw = total / min(dev)
        ours_bw = total / stall
        chk.figure("d2h_gb_s", {"ours": ours_bw / GB, "floor": floor_bw / GB})
        staged = [g for g in stage_device[1:] if g] or [g for g in stage_device if g]
        chk.row(
            "D2H bandwidth while staging",
            f"{ours_bw / GB:.1f} GB/s (device time "
            f"{total / med(staged) / GB:.1f} GB/s; pool pinned: {'yes' if pinned else 'NO'})",
            f".cpu() {total / plain / GB:.1f} GB/s",
            f">= 75% of the pinned copy floor {floor_bw / GB:.1f} GB/s (got "
            f"{ours_bw / floor_bw:.0%})",
            verdict(pinned and ours_bw >= 0.75 * floor_bw),
        )
    else:
        chk.skip(
            "D2H bandwidth and pinned staging need CUDA: the CPU form staged CPU tensors "
            f"({total / MiB:.0f} MiB)"
        )
    chk.row(
        "save until durable",
        f"{_steady(durable):.2f} s",
        f"DCP async_save durable {_steady([r['durable_s'] for r in dcp_runs]):.2f} s",
        f"info (files on {where})",
        "info",
    )
    ours_load, ours_equal, dcp_load, dcp_equal, h2d = m["load"]
    floor_load = min(h2d["wall_s"])
    chk.row(
        "load into device tensors" if cuda else "load into CPU tensors",
        f"{ours_load:.2f} s ({'bitwise equal' if ours_equal else 'NOT EQUAL'})",
        f"DCP load {dcp_load:.2f} s ({'bitwise equal' if dcp_equal else 'NOT EQUAL'})",
        f"bitwise equal; floor: {'H2D from pinned memory' if cuda else 'one copy'} "
        f"{floor_load:.3f} s ({total / floor_load / GB:.1f} GB/s); info: files on {where}",
        verdict(ours_equal),
    )


# -- the memory tier ----------------------------------------------------------------------------


class Trainer:
    """An MLP trained with AdamW (bf16 autocast on CUDA); a step is ``accum`` micro-batches,
    then the optimizer, then ``loss.item()`` (the loop's own synchronize, as logging does)."""

    def __init__(self, chk: Check, d: int, layers: int, micro: int) -> None:
        import torch

        from ckpt import init_optimizer_state

        torch.manual_seed(7)
        self.chk = chk
        mods: list[Any] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(d, d), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*mods).to(chk.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        init_optimizer_state(self.opt)
        self.x = torch.randn(micro, d, device=chk.device)
        self.accum = 1

    def tensors(self) -> dict[str, Any]:
        names = {p: n for n, p in self.model.named_parameters()}
        out = {f"model/{n}": p.detach() for n, p in self.model.named_parameters()}
        for p, st in self.opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{names[p]}/{k}"] = st[k]
        return out

    def step(self) -> float:
        import torch

        for _ in range(self.accum):
            with torch.autocast(self.chk.device.type, dtype=torch.bfloat16, enabled=self.chk.cuda):
                loss = self.model(self.x).float().pow(2).mean()
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return loss.item()


def check_memory(chk: Check) -> None:
    import torch

    from ckpt import CheckpointManager
    from ckpt.memory import MemoryConfig

    cuda = chk.cuda
    d, layers, micro = (4096, 8, 16384) if cuda else (128, 2, 32)
    target_step = float(chk.cfg.get("memory_step_s") or (0.5 if cuda else 0.0))
    rounds, block = (6, 4) if cuda else (2, 2)
    tr = Trainer(chk, d, layers, micro)
    for _ in range(3):
        tr.step()
    micro_s = min(chk.timed(tr.step)[0] for _ in range(3))
    tr.accum = max(1, math.ceil(target_step / micro_s))  # a step of about the target's length
    flat = tr.tensors()
    total = chk.figure("state_bytes", _nbytes(flat))
    chk.figure(
        "model",
        {
            "d": d,
            "layers": layers,
            "micro_batch": micro,
            "accum": tr.accum,
            "micro_step_s": micro_s,
        },
    )
    work, where = chk.work_dir(4 * total + (1 << 30))
    tier_dir = work / "tier"
    tier_dir.mkdir(parents=True, mode=0o700)
    chk.note(
        f"state {total / MiB:.1f} MiB; step = {tr.accum} micro-batches of {micro} x {d} "
        f"(target {target_step} s); tier in {where}"
    )
    mgr = CheckpointManager(
        str(work / "durable"),
        rank=0,
        world_size=1,
        cache_dir=False,
        process_group=False,
        memory=MemoryConfig(str(tier_dir), durable_every=10**9, check_durable=False),
    )
    state: dict[str, Any] = {"t": flat, "step": 0}
    floors = Floors(chk, flat)
    gstep = 0
    stalls: list[float] = []

    def run(label: str) -> float:
        nonlocal gstep
        gstep += 1
        t = time.perf_counter()
        tr.step()
        if label == "on":
            state["step"] = gstep
            stalls.append(mgr.save(gstep, state).stage_s)
        return time.perf_counter() - t

    for _ in range(3 if cuda else 2):  # warm-up: both slots made, mapped, registered with CUDA
        run("on")
    run("off")
    if mgr.memory is None or not mgr.memory.enabled:
        raise RuntimeError(
            f"the memory tier turned itself off (state {total / MiB:.0f} MiB, "
            f"directory {tier_dir}): see its log line above"
        )
    stalls.clear()
    times: dict[str, list[float]] = {"off": [], "on": [], "control": []}
    floor_runs: list[float] = []
    for r in range(rounds):
        order = ["off", "on", "control"] if r % 2 == 0 else ["control", "on", "off"]
        for label in order:
            times[label] += [run(label) for _ in range(block)]
        floor_runs.append(floors.d2h(runs=1)["wall_s"][0])
        chk.figure("steps_s", times)
    chk.figure("stall_s", stalls)
    chk.figure("floor_s", floor_runs)

    # the copy in memory, loaded into fresh device tensors, against the state it was taken of
    run("off")
    state["step"] = gstep
    mgr.save(gstep, state)
    mgr.wait()
    targets = {k: torch.zeros_like(v) for k, v in flat.items()}
    tstate = {"t": targets, "step": -1}
    load_s, _ = chk.timed(lambda: mgr.load(tstate))
    equal = all(torch.equal(targets[k], v) for k, v in flat.items()) and tstate["step"] == gstep
    chk.figure("load", {"seconds": load_s, "equal": equal, "step": tstate["step"]})
    mgr.close()
    free_gpu_memory()

    base, on, ctl = med(times["off"]), med(times["on"]), med(times["control"])
    over, control = on / base - 1, ctl / base - 1
    floor = med(floor_runs)
    chk.figure("overhead", {"overhead": over, "control": control, "floor_fraction": floor / base})
    chk.row(
        "per-step overhead, memory checkpoint every step",
        f"{over:+.2%} (step {on * 1e3:.1f} ms)",
        f"tier off {base * 1e3:.1f} ms; A/A control (off vs off) {control:+.2%}",
        f"<= {OVERHEAD_TARGET:.0%}; floor: one {'pinned D2H ' if cuda else ''}copy of the "
        f"state {floor * 1e3:.1f} ms = {floor / base:.1%} of a step",
        overhead_verdict(over, control, OVERHEAD_TARGET),
    )
    stall = med(stalls)
    chk.row(
        "save stall per step",
        f"{stall * 1e3:.1f} ms ({total / stall / GB:.1f} GB/s)",
        f"floor {floor * 1e3:.1f} ms ({total / floor / GB:.1f} GB/s)",
        f"info ({total / MiB:.1f} MiB; {rounds * block} steps each way)",
        "info",
    )
    chk.row(
        "load from the memory tier into " + ("device tensors" if cuda else "CPU tensors"),
        f"{load_s:.3f} s ({'bitwise equal' if equal else 'NOT EQUAL'}, step {tstate['step']})",
        "-",
        "bitwise equal to the state saved",
        verdict(equal),
    )
    if not cuda:
        chk.skip(
            "the tier's D2H copy into registered shared memory needs CUDA: the CPU form "
            "copied CPU tensors"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import sys

    sys.exit(main({"ckpt": check_ckpt, "memory": check_memory}))
