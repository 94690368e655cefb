"""What every check of ``gpu_check.py`` shares: its command line, its result file, the device
and the timers.

A check runs as ``python benchmarks/<module>.py --check NAME --cfg CFG.json --out OUT.json``
(the harness starts it, with a deadline); a process a check starts for itself (a rank, a target
to dump) runs as ``... --role ROLE [args]``. The result file is rewritten after every figure, so
a check killed at its deadline still leaves what it had measured. Timers: on CUDA, events on
the current stream for device time and the wall clock around a synchronize for what the
calling thread waits; on CPU the wall clock alone.

``python benchmarks/_gpu_check_common.py --probe`` prints what this interpreter's torch sees
(JSON): the harness's first step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Test hook: ``NAME:hang`` makes check NAME sleep instead of running (its deadline's test).
FAULT_ENV = "GPU_CHECK_FAULT"
GB = 1e9
MiB = 2**20


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def verdict(ok: bool | None) -> str:
    return "info" if ok is None else "pass" if ok else "FAIL"


def overhead_verdict(overhead: float, control: float, target: float) -> str:
    """``noise`` when the A/A control (the same loop, both halves alike) differs by more than
    the target itself: the measurement cannot tell; else pass or FAIL against the target."""
    if abs(control) > target:
        return "noise"
    return "pass" if overhead <= target else "FAIL"


class Check:
    """One check's result document and the device it runs on."""

    def __init__(self, name: str, cfg: dict[str, Any], out: Path) -> None:
        import torch

        self.name, self.cfg, self.out = name, cfg, out
        self.cuda = bool(torch.cuda.is_available() and not cfg.get("cpu"))
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(0)
        else:  # the CPU form: small sizes on a shared machine, one thread each is steadier
            torch.set_num_threads(1)
        self.doc: dict[str, Any] = {
            "check": name,
            "device": self.describe(),
            "figures": {},
            "rows": [],
            "skips": [],
            "notes": [],
            "done": False,
        }
        self.save()

    def describe(self) -> str:
        import torch

        if not self.cuda:
            return "cpu"
        return f"cuda:0 ({torch.cuda.get_device_name(0)})"

    # -- the result document ----------------------------------------------------------------
    def figure(self, key: str, value: Any) -> Any:
        self.doc["figures"][key] = value
        self.save()
        return value

    def row(self, metric: str, ours: str, peer: str, target: str, result: str) -> None:
        self.doc["rows"].append([f"{self.name}: {metric}", ours, peer, target, result])
        self.save()

    def skip(self, line: str) -> None:
        """A measurement this form cannot take, said in one line."""
        print(f"skip: {self.name}: {line}", flush=True)
        self.doc["skips"].append(f"{self.name}: {line}")
        self.save()

    def note(self, line: str) -> None:
        print(f"{self.name}: {line}", flush=True)
        self.doc["notes"].append(line)
        self.save()

    def save(self) -> None:
        tmp = self.out.with_name(f".{self.out.name}.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.out)

    # -- timing -------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> tuple[float, float | None]:
        """(wall seconds until ``fn`` and the device work it queued are done, device seconds
        between events recorded on the current stream around it; None on CPU)."""
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t, None
        import torch

        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall = time.perf_counter() - t
        return wall, start.elapsed_time(end) / 1e3

    def work_dir(self, need_bytes: int) -> tuple[Path, str]:
        """Where files go: the harness's tmpfs directory when it has room for ``need_bytes``,
        else its directory on disk; and which it is (said beside durable and load times)."""
        shm = self.cfg.get("shm")
        if shm and os.path.isdir(shm):
            st = os.statvfs(shm)
            if st.f_bavail * st.f_frsize >= need_bytes:
                return Path(shm) / self.name, f"tmpfs ({shm})"
        return Path(self.cfg["work"]) / self.name, f"disk ({self.cfg['work']})"


def free_gpu_memory() -> None:
    """Give the caching allocator's blocks back between measurements."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def probe() -> dict[str, Any]:
    """What this interpreter's torch sees: the harness's first step, and the run's header."""
    import platform
    import shutil

    import torch

    doc: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
        "nvidia_smi": shutil.which("nvidia-smi"),
        "py_spy": shutil.which("py-spy")
        or shutil.which("py-spy", path=os.path.dirname(sys.executable)),
    }
    if doc["cuda"]:
        props = torch.cuda.get_device_properties(0)
        doc.update(
            device=props.name,
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
        )
        with contextlib.suppress(Exception):
            doc["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        doc["gloo"] = dist.is_gloo_available()
        doc["nccl_available"] = dist.is_nccl_available()
    return doc


def main(
    checks: dict[str, Callable[[Check], None]],
    roles: dict[str, Callable[[argparse.Namespace], int]] | None = None,
) -> int:
    """A check (``--check``) or a helper process of one (``--role``)."""
    ap = argparse.ArgumentParser(description="one check of benchmarks/gpu_check.py")
    ap.add_argument("--check", choices=sorted(checks))
    ap.add_argument("--role", choices=sorted(roles or {}))
    ap.add_argument("--cfg")
    ap.add_argument("--out")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--arg", action="append", default=[], help="KEY=VALUE for a role")
    args = ap.parse_args()
    if args.role:
        args.kv = dict(a.split("=", 1) for a in args.arg)
        return (roles or {})[args.role](args)
    if not (args.check and args.cfg and args.out):
        ap.error("--check, --cfg and --out are needed")
    if os.environ.get(FAULT_ENV) == f"{args.check}:hang":
        print(f"{args.check}: {FAULT_ENV} says hang: sleeping", flush=True)
        time.sleep(3600)
    cfg = json.loads(Path(args.cfg).read_text())
    chk = Check(args.check, cfg, Path(args.out))
    try:
        checks[args.check](chk)
    except Exception as exc:  # noqa: BLE001 - recorded with what was measured before it
        traceback.print_exc()
        chk.doc["error"] = f"{type(exc).__name__}: {exc}"
        chk.save()
        return 1
    chk.doc["done"] = True
    chk.save()
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        print(json.dumps(probe()))
        sys.exit(0)
    sys.exit("usage: _gpu_check_common.py --probe")
