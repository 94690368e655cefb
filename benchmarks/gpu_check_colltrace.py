"""The collective-tracing checks of ``gpu_check.py``.

* ``nccl-ranks``: whether NCCL takes two ranks on one GPU (it refuses them since NCCL 2.5,
  "Duplicate GPU detected"); the answer decides the hang check's backend.
* ``colltrace-times``: on NCCL (one rank), the ring's completion time of each all_reduce
  beside the GPU's (CUDA events on the current stream, anchored to the wall clock) and the
  Flight Recorder's, read through ``bootseer.colltrace.flight`` and torch's NCCL dump.
* ``colltrace-overhead``: the tracer's per-step overhead in a GPU loop (matmuls, two
  all_reduces, ``.item()``), traced and untraced blocks in turns beside an A/A control.
* ``colltrace-hang``: three ranks, one skips an all_reduce; the reader must name that rank,
  the op and the group. On one GPU over gloo with CUDA tensors (NCCL refuses the ranks).

On CPU: gloo and CPU tensors; what needs CUDA is skipped with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _gpu_check_common import Check, main, med, overhead_verdict, p90, verdict

OVERHEAD_TARGET = 0.01
HANG_RANKS, SKIPPER, HANG_AT = 3, 1, 12
#: the Flight Recorder on, with NCCL's start events (its durations): set before torch starts
FR_ENV = {"TORCH_FR_BUFFER_SIZE": "4000", "TORCH_NCCL_ENABLE_TIMING": "1"}


def init_pg(backend: str, rank: int, world: int, store: Path, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    extra: dict[str, Any] = {}
    if backend == "nccl":  # eager: the communicator is made here, its errors raised here
        extra["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        **extra,
    )


def _spawn(
    role: str, rank: int, world: int, env: dict[str, str] | None = None, **kv: Any
) -> subprocess.Popen:
    """A helper process of this check (same process group: the harness's deadline kills it)."""
    argv = [
        sys.executable,
        __file__,
        "--role",
        role,
        "--rank",
        str(rank),
        "--world",
        str(world),
        *[x for k, v in kv.items() for x in ("--arg", f"{k}={v}")],
    ]
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


class Lines:
    """A helper's output, read on a thread (printed with its rank, kept)."""

    def __init__(self, proc: subprocess.Popen, tag: str) -> None:
        self.proc, self.tag, self.lines = proc, tag, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            print(f"  [{self.tag}] {line.rstrip()}", flush=True)

    def text(self) -> str:
        self.thread.join(timeout=5)
        return "\n".join(self.lines)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=30)


# -- nccl-ranks -------------------------------------------------------------------------------


def role_nccl_rank(args: Any) -> int:
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        init_pg("nccl", args.rank, args.world, Path(args.kv["store"]), 30)
        t = torch.full((4,), float(args.rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(f"NCCLRANK {args.rank} ok {t[0].item()}", flush=True)
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # noqa: BLE001 - the answer this probe is for
        text = " | ".join(str(exc).splitlines())
        print(f"NCCLRANK {args.rank} error {type(exc).__name__}: {text}", flush=True)
        return 3


def check_nccl_ranks(chk: Check) -> None:
    import torch

    if not chk.cuda:
        chk.skip("two NCCL ranks on one GPU need CUDA and NCCL")
        return
    work = chk.work_dir(0)[0]
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(Exception):
        chk.figure("nccl", ".".join(map(str, torch.cuda.nccl.version())))
    procs = [
        _spawn("nccl-rank", r, 2, {"NCCL_DEBUG": "WARN"}, store=work / "store") for r in range(2)
    ]
    readers = [Lines(p, f"nccl rank {r}") for r, p in enumerate(procs)]
    wait_s = float(chk.cfg.get("nccl_wait_s", 45))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):  # one refused: the other may wait
            deadline = min(deadline, time.monotonic() + 10)  # for it in the init forever
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    _stop(procs)
    texts = [r.text() for r in readers]
    ok = not hung and all(f"NCCLRANK {r} ok 3.0" in t for r, t in enumerate(texts))
    said = [
        ln
        for t in texts
        for ln in t.splitlines()
        if "Duplicate GPU" in ln or ln.startswith("NCCLRANK")
    ]
    reason = next(
        (ln for ln in said if "Duplicate GPU" in ln),
        next((ln for ln in said if " error " in ln), ""),
    )
    outcome = (
        "allowed"
        if ok
        else f"refused: {reason.strip()[:240]}"
        if reason
        else f"rank(s) {hung} hung for {wait_s:.0f} s"
        if hung
        else "failed: no answer"
    )
    chk.figure("allowed", ok)
    chk.figure("outcome", outcome)
    chk.row(
        "NCCL with two ranks on one GPU",
        outcome,
        "-",
        "info: decides the hang check's backend (refused: gloo over CUDA tensors)",
        "info",
    )


# -- colltrace-times --------------------------------------------------------------------------


def _fr_entries(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not doc:
        return []
    return [
        e
        for e in doc.get("entries") or []
        if "all_reduce" in str(e.get("profiling_name"))
        or "allreduce" in str(e.get("profiling_name"))
    ]


def _nccl_dump() -> dict[str, Any] | None:
    """torch's NCCL Flight Recorder dump (a CUDA build's own entry point), or None."""
    from torch._C import _distributed_c10d as c10d

    fn = getattr(c10d, "_dump_nccl_trace_json", None)
    if fn is None:
        return None
    try:
        try:
            raw = fn(includeCollectives=True, onlyActive=False)
        except TypeError:
            raw = fn()
        return json.loads(raw)
    except (RuntimeError, ValueError):
        return None


def check_colltrace_times(chk: Check) -> None:
    import torch
    import torch.distributed as dist

    import bootseer.colltrace as colltrace
    from bootseer.colltrace import flight
    from bootseer.colltrace.ring import read_rings

    for k, v in FR_ENV.items():  # before the process group: torch reads them at its creation
        os.environ.setdefault(k, v)
    cuda = chk.cuda
    backend = "nccl" if cuda else "gloo"
    work = chk.work_dir(0)[0]
    work.mkdir(parents=True, exist_ok=True)
    colltrace.enable(work / "rings")
    init_pg(backend, 0, 1, work / "store", 60)
    x = torch.ones(4 << 20 if cuda else 1 << 14, device=chk.device)
    busy = int(chk.cfg.get("busy_matmuls", 4))
    if cuda:
        a = torch.randn(8192, 8192, device=chk.device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
    for _ in range(5):
        dist.all_reduce(x)
    chk.sync()
    n = 30 if cuda else 10
    recs: list[dict[str, Any]] = []
    for _ in range(n):
        chk.sync()
        rec: dict[str, Any] = {}
        if cuda:  # e0 on an idle stream: its device time is t_anchor (+ a launch)
            e0, eb, ea = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            rec["t_anchor"] = time.time_ns()
            e0.record()
            for _ in range(busy):
                torch.mm(a, a, out=out)
            eb.record()
        rec["t_call"] = time.time_ns()
        dist.all_reduce(x)
        rec["t_return"] = time.time_ns()
        if cuda:
            ea.record()
        chk.sync()
        if cuda:
            rec["gpu_ready"] = rec["t_anchor"] + e0.elapsed_time(eb) * 1e6
            rec["gpu_done"] = rec["t_anchor"] + e0.elapsed_time(ea) * 1e6
            rec["event_op_ms"] = eb.elapsed_time(ea)
        recs.append(rec)
    time.sleep(1.5 if cuda else 0.2)  # the NCCL watchdog marks completions on its own pass
    snaps = read_rings(work / "rings")
    ring_ops = [o for s in snaps if s.rank == 0 for o in s.ops if o.op == "all_reduce"][-n:]
    if len(ring_ops) != n or any(o.t_done is None for o in ring_ops):
        raise RuntimeError(
            f"the ring holds {len(ring_ops)} of the {n} all_reduces traced, "
            f"{sum(o.t_done is None for o in ring_ops)} without a completion"
        )
    ours_fr = _fr_entries(flight.dump())
    nccl_fr = _fr_entries(_nccl_dump()) if cuda else []
    fr = (ours_fr or nccl_fr)[-n:]
    ring_vs = [
        (o.t_done * 1e9 - (r["gpu_done"] if cuda else r["t_return"])) / 1e6
        for o, r in zip(ring_ops, recs, strict=True)
    ]
    issue_us = [(o.t_issue * 1e9 - r["t_call"]) / 1e3 for o, r in zip(ring_ops, recs, strict=True)]
    fr_done = [
        (int(e["time_discovered_completed_ns"]) - (r["gpu_done"] if cuda else r["t_return"])) / 1e6
        for e, r in zip(fr, recs[-len(fr) :], strict=False)
        if int(e.get("time_discovered_completed_ns") or 0)
    ]
    fr_dur = [float(e["duration_ms"]) for e in fr if e.get("duration_ms") is not None]
    chk.figure("ops", n)
    chk.figure("ring_minus_gpu_ms" if cuda else "ring_minus_return_ms", ring_vs)
    chk.figure("ring_issue_minus_call_us", issue_us)
    chk.figure("fr_minus_gpu_ms" if cuda else "fr_minus_return_ms", fr_done)
    chk.figure(
        "flight_recorder",
        {
            "bootseer_flight_dump": len(ours_fr),
            "dump_nccl_trace_json": len(nccl_fr),
            "durations_ms": fr_dur,
            "states": sorted({str(e.get("state")) for e in fr}),
        },
    )
    parsed = flight.snapshot({"entries": fr}, 0) if fr else None
    chk.figure("flight_snapshot_ops", len(parsed.ops) if parsed else 0)
    dist.destroy_process_group()
    colltrace.disable()
    fr_text = (
        f"Flight Recorder - GPU {med(fr_done):+.2f} ms (p90 {p90(fr_done):+.2f})"
        if fr_done
        else "Flight Recorder: no completion times"
    )
    if cuda:
        ready = [(r["gpu_ready"] - r["t_return"]) / 1e6 for r in recs]
        chk.figure("queued_ahead_ms", ready)
        chk.row(
            "ring's completion time vs the GPU's (CUDA events), all_reduce 16 MB",
            f"ring - GPU {med(ring_vs):+.2f} ms (p90 {p90(ring_vs):+.2f})",
            fr_text,
            f"the ring's completion not before the GPU's by over 1 ms ({busy} matmuls, "
            f"{med(ready):.1f} ms, queued ahead of each op)",
            verdict(med(ring_vs) >= -1.0),
        )
        events = [r["event_op_ms"] for r in recs]
        chk.row(
            "op duration: Flight Recorder (NCCL's events) vs CUDA events around it",
            f"{med(fr_dur):.3f} ms" if fr_dur else "no duration_ms",
            f"events {med(events):.3f} ms",
            "info",
            "info",
        )
        chk.row(
            "NCCL's Flight Recorder through bootseer.colltrace.flight.dump()",
            f"{len(ours_fr)} all_reduce entries",
            f"torch _dump_nccl_trace_json: {len(nccl_fr)} entries",
            f"the {n} ops traced (and more: warm-up)",
            verdict(len(ours_fr) >= n),
        )
    else:
        chk.row(
            "ring's completion time vs the call's return (gloo, CPU)",
            f"ring - return {med(ring_vs) * 1e3:+.1f} us (p90 {p90(ring_vs) * 1e3:+.1f})",
            fr_text,
            "info (gloo completes on the calling thread)",
            "info",
        )
        chk.row(
            "Flight Recorder through bootseer.colltrace.flight.dump() (gloo)",
            f"{len(ours_fr)} all_reduce entries",
            f"{n} traced",
            f">= {n}",
            verdict(len(ours_fr) >= n),
        )
        chk.skip(
            "CUDA event times and NCCL's Flight Recorder need CUDA: the CPU form compared "
            "the ring with the call's return on gloo"
        )


# -- colltrace-overhead -----------------------------------------------------------------------


def check_colltrace_overhead(chk: Check) -> None:
    import torch
    import torch.distributed as dist

    from bootseer.colltrace.recorder import Recorder

    cuda = chk.cuda
    work = chk.work_dir(0)[0]
    work.mkdir(parents=True, exist_ok=True)
    init_pg("nccl" if cuda else "gloo", 0, 1, work / "store", 60)
    size, busy, numel = (8192, 12, 8 << 20) if cuda else (128, 10, 1 << 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(size, size, device=chk.device, dtype=dtype)
    out = torch.empty_like(a)
    g1 = torch.ones(numel, device=chk.device)
    g2 = torch.ones(numel, device=chk.device)

    def step() -> float:
        t = time.perf_counter()
        for _ in range(busy):
            torch.mm(a, a, out=out)
        dist.all_reduce(g1)
        dist.all_reduce(g2)
        g2[0].item()  # the loop's synchronize (logging a loss does one)
        return time.perf_counter() - t

    rec = Recorder(work / "rings", capacity=4096)
    rec.install()
    for _ in range(5):
        step()
    rec.uninstall(close=False)
    for _ in range(5):
        step()
    rounds, block = (8, 10) if cuda else (2, 5)
    times: dict[str, list[float]] = {"traced": [], "untraced": [], "control": []}
    for r in range(rounds):
        order = (
            ["untraced", "traced", "control"] if r % 2 == 0 else ["control", "traced", "untraced"]
        )
        for label in order:
            if label == "traced":
                rec.install()
            times[label] += [step() for _ in range(block)]
            if label == "traced":
                rec.uninstall(close=False)
        chk.figure("steps_s", times)
    rec.uninstall()
    dist.destroy_process_group()
    base, on, ctl = med(times["untraced"]), med(times["traced"]), med(times["control"])
    over, control = on / base - 1, ctl / base - 1
    chk.figure(
        "overhead", {"overhead": over, "control": control, "cost_us_per_op": (on - base) / 2 * 1e6}
    )
    chk.row(
        f"tracer per-step overhead ({'NCCL' if cuda else 'gloo'}, 2 all_reduces a step)",
        f"{over:+.2%} (step {on * 1e3:.2f} ms)",
        f"untraced {base * 1e3:.2f} ms; A/A control {control:+.2%}",
        f"<= {OVERHEAD_TARGET:.0%} ({rounds * block} steps each way, blocks of {block} in turns)",
        overhead_verdict(over, control, OVERHEAD_TARGET),
    )
    if not cuda:
        chk.skip("the tracer on NCCL needs CUDA: the CPU form traced gloo")


# -- colltrace-hang ---------------------------------------------------------------------------


def role_hang_rank(args: Any) -> int:
    """One rank of the hang: steps of matmuls and one all_reduce in group grp-a; rank
    ``skipper`` skips the all_reduce of step ``at`` and stays busy outside collectives (in a
    CUDA kernel on a GPU) while the others wait in it."""
    import torch
    import torch.distributed as dist

    import bootseer.colltrace as colltrace

    kv, rank = args.kv, args.rank
    cuda = kv["cuda"] == "1"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    colltrace.enable(kv["rings"])
    init_pg(kv["backend"], rank, args.world, Path(kv["store"]), 600)
    probe = torch.ones(4, device=dev)
    try:
        dist.all_reduce(probe)  # the world group: grp-a's sequence numbers are untouched
        where = dev.type
    except RuntimeError as exc:  # a gloo without CUDA support: the collectives on the host
        print(f"hang-rank {rank}: CUDA tensors refused ({exc}); collectives on CPU", flush=True)
        where = "cpu"
    group = dist.new_group(list(range(args.world)), group_desc="grp-a")
    t = torch.ones(1024, device=where)
    w = torch.randn(2048 if cuda else 64, 2048 if cuda else 64, device=dev)
    buf = torch.empty_like(w)
    print(f"hang-rank {rank}: collectives on {where} tensors over {kv['backend']}", flush=True)
    at, skipper = int(kv["at"]), int(kv["skipper"])
    for step in range(int(kv["steps"])):
        for _ in range(4):
            torch.mm(w, w, out=buf)
        if step == at and rank == skipper:
            print(f"injected skip rank {rank} at {time.time():.6f}", flush=True)
            while True:  # busy outside collectives: a long kernel on a GPU
                if cuda:
                    torch.cuda._sleep(1 << 30)
                    torch.cuda.synchronize()
                else:
                    time.sleep(0.1)
        dist.all_reduce(t, group=group)
        if cuda:
            torch.cuda.synchronize()
        time.sleep(0.01)
    return 0


def check_colltrace_hang(chk: Check) -> None:
    from bootseer.colltrace.reader import Watch

    cuda = chk.cuda
    backend = chk.cfg.get("hang_backend") or "gloo"
    if backend == "nccl" and not cuda:
        backend = "gloo"
    chk.figure("backend", backend)
    chk.note(
        f"{HANG_RANKS} ranks on {'one GPU' if cuda else 'CPU'} over {backend}; rank "
        f"{SKIPPER} skips grp-a's all_reduce at step {HANG_AT}"
    )
    work = chk.work_dir(0)[0]
    rings = work / "rings"
    rings.mkdir(mode=0o700, parents=True, exist_ok=True)
    rings.chmod(0o700)  # the tracer takes only a directory of its own (striped_fs.privdir)
    procs = [
        _spawn(
            "hang-rank",
            r,
            HANG_RANKS,
            backend=backend,
            store=work / "store",
            rings=rings,
            at=HANG_AT,
            skipper=SKIPPER,
            steps=10**6,
            cuda="1" if cuda else "0",
        )
        for r in range(HANG_RANKS)
    ]
    readers = [Lines(p, f"rank {r}") for r, p in enumerate(procs)]
    watch = Watch(rings, poll_s=0.25, log=lambda line: print(f"  [reader] {line}", flush=True))
    seen: list[tuple[float, Any]] = []
    injected = None
    deadline = time.monotonic() + float(chk.cfg.get("hang_wait_s", 60))
    try:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(
                    "a rank of the hang job exited: "
                    + "; ".join(r.lines[-1] if r.lines else "" for r in readers)
                )
            seen += [(time.time(), f) for f in watch.poll(force=True)]
            injected = injected or next(
                (
                    float(ln.split(" at ")[1])
                    for r in readers
                    for ln in list(r.lines)
                    if ln.startswith("injected ")
                ),
                None,
            )
            if injected and any(t >= injected and f.ranks for t, f in seen):
                break
            time.sleep(0.25)
    finally:
        _stop(procs)
        watch.close()
    where = sorted(
        {
            ln.split(" on ")[1].split(" tensors")[0]
            for r in readers
            for ln in r.lines
            if "collectives on " in ln and " tensors" in ln
        }
    )
    chk.figure("tensors_on", where)
    chk.figure("injected", injected)
    chk.figure("findings", [{"seen": t, **f.to_doc()} for t, f in seen])
    after = [(t, f) for t, f in seen if injected and t >= injected and f.ranks]
    first = after[0][1] if after else None
    wrong = [f.line for _, f in seen if f.ranks and SKIPPER not in f.ranks]
    expected_seq = HANG_AT + 1  # one grp-a all_reduce a step, from #1 at step 0
    named = bool(
        first
        and first.ranks == (SKIPPER,)
        and first.op == "all_reduce"
        and first.group == "grp-a"
        and first.seq == expected_seq
    )
    chk.figure("named", named)
    chk.figure("wrong", wrong)
    took = after[0][0] - injected if after and injected else None
    chk.figure("seconds_to_verdict", took)
    on = f"{backend} over {', '.join(where) or '?'} tensors"
    chk.row(
        f"hang: one of {HANG_RANKS} ranks skips an all_reduce ({on})",
        f"'{first.line}' after {took:.1f} s"
        if first and took is not None
        else "no verdict naming a rank",
        f"wrong verdicts: {len(wrong)}",
        f"names rank {SKIPPER}, all_reduce #{expected_seq} in grp-a; none names another",
        verdict(named and not wrong),
    )
    if cuda and backend != "nccl":
        chk.note(
            "NCCL takes one rank per GPU (nccl-ranks): this hang ran on gloo over CUDA "
            "tensors; on NCCL a rank's all_reduce returns at launch (colltrace-times), so "
            "there the waiting ranks sit in their next synchronize, not in the op"
        )
    if not cuda:
        chk.skip("the hang on CUDA tensors needs CUDA: the CPU form ran it on CPU tensors")


if __name__ == "__main__":
    sys.exit(
        main(
            {
                "nccl-ranks": check_nccl_ranks,
                "colltrace-times": check_colltrace_times,
                "colltrace-overhead": check_colltrace_overhead,
                "colltrace-hang": check_colltrace_hang,
            },
            {"nccl-rank": role_nccl_rank, "hang-rank": role_hang_rank},
        )
    )
