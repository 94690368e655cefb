"""The robust-training checks of ``gpu_check.py``.

* ``alignment``: ``bootseer.robust.check``'s reference step on the device: two runs in this
  process and one in another agree bit for bit, and a run with one weight one ulp off is the
  rank the check names (``CheckReport``'s majority vote).
* ``health``: ``bootseer.robust.health.check_gpu`` against the real ``nvidia-smi``, its
  parse beside what torch reports of the same GPUs.
* ``stack``: a native frame from ``py-spy dump --native`` (``bootseer.robust.remote
  .dump_ranks`` with ``native_dump``) of a rank inside a CUDA kernel (``torch.cuda._sleep``,
  its thread in the synchronize); on CPU a rank inside a long matmul.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

from _gpu_check_common import Check, MiB, main, verdict

#: where a rank waiting on its GPU sits in compiled code: the CUDA runtime or driver, or
#: torch's CUDA library
CUDA_FRAME = re.compile(
    r"libcuda|libcudart|libtorch_cuda|libc10_cuda|cudaDeviceSynchronize|"
    r"cudaStreamSynchronize|cuda[A-Z]\w*Synchronize",
    re.I,
)


def _device_name(chk: Check) -> str:
    return "cuda" if chk.cuda else "cpu"


# -- alignment --------------------------------------------------------------------------------


def role_align(args: Any) -> int:
    """The reference step in a process of its own (another rank, on the same device)."""
    from bootseer.robust.check import reference_step

    print("ALIGN " + json.dumps(reference_step(device=args.kv["device"])), flush=True)
    return 0


def check_alignment(chk: Check) -> None:
    from bootseer.robust.check import CheckReport, RankResult, reference_step

    dev = _device_name(chk)
    t = time.perf_counter()
    first = reference_step(device=dev)
    took = time.perf_counter() - t
    second = reference_step(device=dev)
    other = subprocess.run(
        [sys.executable, __file__, "--role", "align", "--arg", f"device={dev}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    line = next((ln for ln in other.stdout.splitlines() if ln.startswith("ALIGN ")), None)
    if line is None:
        raise RuntimeError(f"the reference step in another process failed: {other.stderr[-2000:]}")
    another = tuple(json.loads(line[6:]))
    perturbed = reference_step(perturb=True, device=dev)
    runs = {"run 1": first, "run 2": second, "another process": another, "perturbed": perturbed}
    report = CheckReport.from_results(
        [
            RankResult(i, name, 0, out, grad, 0.0, 0)
            for i, (name, (out, grad)) in enumerate(runs.items())
        ]
    )
    identical = first == second == another
    caught = report.alignment_suspects == (3,)
    chk.figure("hashes", {k: list(v) for k, v in runs.items()})
    chk.figure("suspects", list(report.alignment_suspects))
    chk.figure("identical", identical)
    chk.figure("perturbed_caught", caught)
    chk.figure("step_s", took)
    cpu_note = ""
    if chk.cuda:
        cpu = reference_step(device="cpu")
        chk.figure("cuda_equals_cpu", cpu == first)
        cpu_note = f"; CPU's bits {'the same' if cpu == first else 'differ (expected)'}"
    chk.row(
        f"bitwise alignment on {chk.describe()}",
        f"2 runs + another process {'identical' if identical else 'DIFFER'} "
        f"(output {first[0][:12]}){cpu_note}",
        f"one weight 1 ulp off: {'named (rank 3)' if caught else 'NOT named'} "
        f"{report.alignment_suspects}",
        "identical, and the perturbed run the only suspect",
        verdict(identical and caught),
    )
    if not chk.cuda:
        chk.skip("the alignment step on CUDA needs CUDA: the CPU form ran it on CPU")


# -- health -----------------------------------------------------------------------------------


def check_health(chk: Check) -> None:
    from bootseer.robust.health import check_gpu

    t = time.perf_counter()
    res = check_gpu()
    took = time.perf_counter() - t
    chk.figure("result", {"ok": res.ok, "message": res.message, "evidence": res.evidence})
    if res.ok is None:
        chk.skip(f"{res.message} (the health check's nvidia-smi parse needs a GPU machine)")
        return
    lines = res.evidence.get("output") or []
    parsed = [[c.strip() for c in line.split(",")] for line in lines]
    chk.figure("parsed", parsed)
    smi_names = [cells[1] for cells in parsed if len(cells) > 4]
    smi_mib = [int(re.sub(r"\D", "", cells[4]) or 0) for cells in parsed if len(cells) > 4]
    ecc = [cells[-1] for cells in parsed]
    peer, same = "torch sees no CUDA device", False
    if chk.cuda:
        import torch

        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        mib = [
            torch.cuda.get_device_properties(i).total_memory // MiB
            for i in range(torch.cuda.device_count())
        ]
        peer = f"torch: {len(names)} x {names[0]}, {mib[0]} MiB"
        same = (
            len(names) == len(parsed)
            and names == smi_names
            and all(abs(a - b) <= 0.05 * b for a, b in zip(mib, smi_mib, strict=True))
        )
        chk.figure("torch", {"names": names, "mib": mib})
    ours = (
        f"{res.message}: {len(parsed)} x {smi_names[0] if smi_names else '?'}, "
        f"{smi_mib[0] if smi_mib else '?'} MiB, ECC {ecc[0] if ecc else '?'}; "
        f"{took:.2f} s"
    )
    chk.row(
        "health check's nvidia-smi parse",
        ours,
        peer,
        "ok, and the same GPUs, names and memory (within 5%) as torch",
        verdict(bool(res.ok) and same),
    )


# -- stack ------------------------------------------------------------------------------------


def role_stack_target(args: Any) -> int:
    """A rank inside a CUDA kernel (its thread waits in the synchronize), or in a matmul."""
    import torch

    if args.kv["device"] == "cuda":
        torch.cuda.set_device(0)
        torch.cuda._sleep(1 << 20)
        torch.cuda.synchronize()
        print("STACK ready", flush=True)
        while True:
            _kernel_loop(torch)
    torch.set_num_threads(1)
    a = torch.randn(1024, 1024)
    out = torch.empty_like(a)
    print("STACK ready", flush=True)
    while True:
        _matmul_loop(torch, a, out)


def _kernel_loop(torch: Any) -> None:
    torch.cuda._sleep(1 << 31)  # about a second of one spinning kernel
    torch.cuda.synchronize()


def _matmul_loop(torch: Any, a: Any, out: Any) -> None:
    for _ in range(100):
        torch.mm(a, a, out=out)


def check_stack(chk: Check) -> None:
    from bootseer.robust.remote import dump_ranks, native_dump
    from bootseer.robust.stacks import ProcessStacks, is_native_frame

    probe = chk.cfg.get("env") or {}
    if not probe.get("py_spy"):
        chk.skip("py-spy is not installed (carry its wheel: docs/benchmarks.md, GPU check)")
        return
    dev = _device_name(chk)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", "stack-target", "--arg", f"device={dev}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if "STACK ready" not in ready:
            raise RuntimeError(f"the stack target did not start: {ready!r}")
        time.sleep(0.5)
        want = CUDA_FRAME if chk.cuda else None
        tries: list[dict[str, Any]] = []
        for _ in range(3):  # the thread may be between two calls: dump again
            t = time.perf_counter()
            answered, failed = dump_ranks({0: proc.pid}, node="gpu-check", dump=native_dump)
            took = time.perf_counter() - t
            if failed or not answered:
                tries.append({"failed": True, "seconds": took})
                continue
            main_proc = next(p for p in answered if p["role"] == "main")
            stacks = ProcessStacks.from_text(main_proc["text"], rank=0, pid=proc.pid)
            loop = "_kernel_loop" if chk.cuda else "_matmul_loop"
            thread = next((th for th in stacks.threads if any(loop in f for f in th)), ())
            native = [f for f in thread if is_native_frame(f)]
            hits = [f for f in native if want.search(f)] if want else native
            tries.append(
                {
                    "seconds": took,
                    "native": native[:12],
                    "hits": hits[:4],
                    "python": [f for f in thread if not is_native_frame(f)][:6],
                }
            )
            if hits:
                break
            time.sleep(0.3)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    chk.figure("dumps", tries)
    last = tries[-1]
    hit = (last.get("hits") or [""])[0]
    chk.row(
        f"native frame of a rank {'inside a CUDA kernel' if chk.cuda else 'in a matmul'} "
        "(py-spy --native via dump_ranks)",
        f"'{hit}'" if hit else f"none ({len(last.get('native') or [])} native frames)",
        f"Python frames: {' <- '.join(last.get('python') or []) or '-'}",
        "a frame of the CUDA runtime or driver under the loop"
        if chk.cuda
        else "a compiled frame under the loop",
        verdict(bool(hit)),
    )
    chk.figure("dump_s", last.get("seconds"))
    if not chk.cuda:
        chk.skip("a rank inside a CUDA kernel needs CUDA: the CPU form dumped one in a matmul")


if __name__ == "__main__":
    sys.exit(
        main(
            {"alignment": check_alignment, "health": check_health, "stack": check_stack},
            {"align": role_align, "stack-target": role_stack_target},
        )
    )
