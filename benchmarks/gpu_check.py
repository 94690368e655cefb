"""GPU check: every CUDA path of bootseer measured in one bounded run, each figure beside its
peer and its floor, into ``DIR/gpu_check.json`` and ``DIR/gpu_check.md``.

``python benchmarks/gpu_check.py --results DIR [--parts ckpt,memory,colltrace,robust]
[--budget-s 480] [--state-gb 4] [--cpu]`` or ``make gpu-check``. Checks (docs/benchmarks.md,
"GPU check"):

* ckpt: CheckpointManager's save stall (pinned staging) beside a plain ``.cpu()`` copy and
  DCP ``async_save``; its D2H bandwidth beside the device's pinned copy floor; durable; load
  into device tensors, bitwise;
* memory: the memory tier's every-step checkpoints in a GPU training loop, per-step overhead
  beside an A/A control (target <= 1%); its copy loaded back into device tensors, bitwise;
* colltrace: NCCL with two ranks on one GPU (allowed or not); the ring's completion times on
  NCCL beside CUDA events and the Flight Recorder's; the tracer's overhead beside an A/A
  control (target <= 1%); a rank that skips an all_reduce, named with its op;
* robust: the bitwise alignment check on CUDA (runs agree, a perturbed run is named); the
  health check's ``nvidia-smi`` parse beside torch; a native frame in a py-spy dump of a rank
  inside a CUDA kernel.

Each check runs in a child process of its own with a deadline (its own timeout, within what
is left of ``--budget-s``): a hang is killed with its process group and the next check runs.
Without CUDA the same code paths run on CPU tensors at small sizes, each CUDA-only
measurement skipped with one line, and the run exits 0. This process imports the standard
library only; the checks are ``gpu_check_{ckpt,colltrace,robust}.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    code_env,
    command_line,
    final_table,
    kill_group,
    log,
    md_table,
    sigterm_as_interrupt,
    source_state,
    work_dir,
)
from gpu_check_colltrace import FR_ENV  # noqa: E402 - the standard library only at its top

SUITE = "gpu_check"
GROUPS = ("ckpt", "memory", "colltrace", "robust")
MIN_LEFT_S = 20.0  # a check is not started with less of the budget left


@dataclass(frozen=True)
class Spec:
    name: str
    group: str
    script: str
    timeout_s: float
    cuda_only: bool = False
    env: dict[str, str] = field(default_factory=dict)


CHECKS = (
    Spec("ckpt", "ckpt", "gpu_check_ckpt.py", 200),
    Spec("memory", "memory", "gpu_check_ckpt.py", 150),
    Spec("nccl-ranks", "colltrace", "gpu_check_colltrace.py", 75, cuda_only=True),
    Spec("colltrace-times", "colltrace", "gpu_check_colltrace.py", 75, env=FR_ENV),
    Spec("colltrace-overhead", "colltrace", "gpu_check_colltrace.py", 100),
    Spec("colltrace-hang", "colltrace", "gpu_check_colltrace.py", 100),
    Spec(
        "alignment", "robust", "gpu_check_robust.py", 75, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    ),
    Spec("health", "robust", "gpu_check_robust.py", 45),
    Spec("stack", "robust", "gpu_check_robust.py", 75),
)
BY_NAME = {s.name: s for s in CHECKS}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="bench-results", help=f"for {SUITE}.json/.md")
    ap.add_argument(
        "--parts",
        default="",
        help=f"comma-separated groups ({', '.join(GROUPS)}) or checks "
        f"({', '.join(BY_NAME)}); default all",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="the whole run's bound in seconds (default 480: 8 minutes)",
    )
    ap.add_argument(
        "--state-gb",
        type=float,
        default=None,
        help="ckpt's state on the device in GB (default 4; CPU form 0.032)",
    )
    ap.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="CHECK=SECONDS",
        help="one check's own timeout instead of its default",
    )
    ap.add_argument(
        "--cpu", action="store_true", help="the CPU form even where a GPU is (what the tests run)"
    )
    args = ap.parse_args(argv)
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in wanted if p not in GROUPS and p not in BY_NAME]
    if bad:
        ap.error(
            f"--parts {','.join(bad)}: not a group ({', '.join(GROUPS)}) or a check "
            f"({', '.join(BY_NAME)})"
        )
    args.selected = [s for s in CHECKS if not wanted or s.group in wanted or s.name in wanted]
    args.timeouts = {}
    for item in args.timeout:
        name, _, secs = item.partition("=")
        try:
            args.timeouts[name] = float(secs)
        except ValueError:
            ap.error(f"--timeout {item}: give CHECK=SECONDS")
        if name not in BY_NAME:
            ap.error(f"--timeout {item}: no check {name} ({', '.join(BY_NAME)})")
    if args.budget_s <= 0:
        ap.error(f"--budget-s {args.budget_s}: give a positive number of seconds")
    return args


def gpus_listed() -> list[str]:
    """What ``nvidia-smi -L`` lists (empty without nvidia-smi or a driver)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    with contextlib.suppress(Exception):
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
        return [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
    return []


class Runner:
    """Runs the selected checks one after another, each with its deadline."""

    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.results = Path(args.results)
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.work = work_dir("gpu-check-", stack)
        self.shm = self._shm(stack)
        self.env = {**code_env(), "PYTHONUNBUFFERED": "1"}
        if args.cpu:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.report: dict[str, Any] = {
            "suite": SUITE,
            "command": command_line("gpu_check.py"),
            **source_state(["benchmarks", "ckpt", "bootseer/colltrace", "bootseer/robust"]),
            "budget_s": args.budget_s,
            "checks": {},
            "skipped": [],
            "errors": [],
        }
        self.child: subprocess.Popen | None = None

    @staticmethod
    def _shm(stack: contextlib.ExitStack) -> str | None:
        """A private directory in /dev/shm (staging targets, the memory tier), removed after."""
        if not os.path.isdir("/dev/shm"):
            return None
        try:
            path = tempfile.mkdtemp(prefix="bootseer-gpu-check-", dir="/dev/shm")
        except OSError:
            return None
        stack.callback(shutil.rmtree, path, True)
        return path

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def probe(self) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, str(HERE / "_gpu_check_common.py"), "--probe"],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
            timeout=max(30.0, min(120.0, self.left())),
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"the probe of this interpreter's torch failed: {out.stderr.strip()[-2000:]}"
            )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def run(self) -> int:
        env = self.report["env"] = self.probe()
        cuda = bool(env.get("cuda"))
        listed = [] if self.args.cpu else gpus_listed()
        self.report["nvidia_smi_lists"] = listed
        if listed and not cuda:
            log(
                f"gpu_check: nvidia-smi lists {len(listed)} GPU(s) but {env['executable']}'s "
                f"torch {env['torch']} has no CUDA: run it with a CUDA build of torch (on the "
                "GPU machine its own python3: make gpu-check GPU_PYTHON=python3), or pass "
                "--cpu for the CPU form"
            )
            self.report["errors"].append("torch without CUDA on a machine with a GPU")
            return 2
        self.report["form"] = "cuda" if cuda else "cpu"
        log(
            f"gpu_check: {'CUDA on ' + env.get('device', '?') if cuda else 'CPU form (no CUDA)'}"
            f"; torch {env['torch']}; budget {self.args.budget_s:.0f} s; checks "
            f"{', '.join(s.name for s in self.args.selected)}"
        )
        cfg: dict[str, Any] = {
            "work": str(self.work),
            "shm": self.shm,
            "cpu": self.args.cpu,
            "state_gb": self.args.state_gb,
            "env": env,
        }
        for spec in self.args.selected:
            self.one(spec, cfg, cuda)
            if spec.name == "nccl-ranks":
                got = self.report["checks"][spec.name].get("result", {}).get("figures", {})
                cfg["hang_backend"] = "nccl" if got.get("allowed") else "gloo"
        return 1 if self.report["errors"] else 0

    def skip(self, spec: Spec, why: str) -> None:
        line = f"skip: {spec.name}: {why}"
        print(line, flush=True)
        self.report["skipped"].append(line)
        self.report["checks"][spec.name] = {"status": "skipped", "why": why}

    def one(self, spec: Spec, cfg: dict[str, Any], cuda: bool) -> None:
        if spec.cuda_only and not cuda:
            self.skip(spec, "needs CUDA (this machine has none)")
            return
        left = self.left()
        if left < MIN_LEFT_S:
            self.skip(
                spec, f"the budget is spent ({left:.0f} s of {self.args.budget_s:.0f} s left)"
            )
            return
        timeout = min(self.args.timeouts.get(spec.name, spec.timeout_s), left)
        cfg_path = self.work / f"{spec.name}.cfg.json"
        out_path = self.work / f"{spec.name}.json"
        cfg_path.write_text(json.dumps(cfg))
        log(f"gpu_check: {spec.name} (timeout {timeout:.0f} s)")
        argv = [
            sys.executable,
            str(HERE / spec.script),
            "--check",
            spec.name,
            "--cfg",
            str(cfg_path),
            "--out",
            str(out_path),
        ]
        started = time.monotonic()
        proc = self.child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**self.env, **spec.env},
            start_new_session=True,
        )
        tail: list[str] = []
        reader = threading.Thread(target=_relay, args=(proc, spec.name, tail), daemon=True)
        reader.start()
        status = "ok"
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            kill_group(proc)  # its helpers (ranks, dump targets) with it, also after a success
            self.child = None
        reader.join(timeout=10)
        seconds = time.monotonic() - started
        entry: dict[str, Any] = {
            "status": status,
            "seconds": round(seconds, 1),
            "timeout_s": round(timeout, 1),
            "pid": proc.pid,
        }
        with contextlib.suppress(OSError, ValueError):
            entry["result"] = json.loads(out_path.read_text())
        result = entry.get("result") or {}
        if status == "ok" and (proc.returncode != 0 or not result.get("done")):
            status = entry["status"] = "failed"
        if status != "ok":
            why = (
                f"timed out after {timeout:.0f} s (killed with its process group)"
                if status == "timeout"
                else f"exit {proc.returncode}: {result.get('error') or 'no result'}"
            )
            entry["why"] = why
            entry["output_tail"] = tail[-40:]
            self.report["errors"].append(f"{spec.name}: {why}")
            log(f"gpu_check: {spec.name} {status.upper()}: {why}")
        self.report["checks"][spec.name] = entry

    # -- results ----------------------------------------------------------------------------
    def write(self) -> None:
        import datetime

        rep = self.report
        rep["seconds"] = round(time.monotonic() - self.started, 1)
        rep["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        rows: list[list[str]] = []
        skips: list[str] = list(rep["skipped"])
        notes: list[str] = []
        for name, entry in rep["checks"].items():
            result = entry.get("result") or {}
            rows += result.get("rows") or []
            skips += [f"skip: {s}" for s in result.get("skips") or []]
            notes += [f"{name}: {n}" for n in result.get("notes") or []]
            if entry["status"] in ("timeout", "failed"):
                rows.append([f"{name}: the check", entry["status"], "-", entry["why"], "FAIL"])
        rep["skips"] = skips
        table = final_table(rep, rows) if rows else ["(no figures)"]
        self.results.mkdir(parents=True, exist_ok=True)
        (self.results / f"{SUITE}.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
        (self.results / f"{SUITE}.md").write_text("\n".join(self.markdown(table, skips, notes)))

    def markdown(self, table: list[str], skips: list[str], notes: list[str]) -> list[str]:
        rep, env = self.report, self.report.get("env") or {}
        form = rep.get("form", "?")
        title = (
            f"# GPU check: {env.get('device', '?')}"
            if form == "cuda"
            else "# GPU check (CPU form: no CUDA device; not the GPU figures)"
        )
        checks = md_table(
            ["check", "status", "seconds", "timeout"],
            [
                [n, e["status"], str(e.get("seconds", "-")), str(e.get("timeout_s", "-"))]
                for n, e in rep["checks"].items()
            ],
        )
        lines = [
            title,
            "",
            f"- command: `{rep['command']}` ({rep['seconds']:.0f} s of a "
            f"{rep['budget_s']:.0f} s budget)",
            f"- commit: {rep.get('commit', '?')}"
            + (
                f" (local changes: {', '.join(rep['local_changes'])})"
                if rep.get("local_changes")
                else ""
            ),
            f"- torch {env.get('torch', '?')} (CUDA {env.get('cuda_build') or '-'}, NCCL "
            f"{env.get('nccl', '-')}), Python {env.get('python', '?')}, {env.get('cpus')} "
            f"CPUs"
            + (
                f"; {env.get('device')} ({env.get('memory_bytes', 0) / 2**30:.0f} GiB, "
                f"capability {env.get('capability')})"
                if form == "cuda"
                else ""
            ),
            "",
            *checks,
            "",
            *table,
            "",
        ]
        if skips:
            lines += ["Skipped:", "", *[f"- {s}" for s in skips], ""]
        if notes:
            lines += ["Notes:", "", *[f"- {n}" for n in notes], ""]
        return lines


def _relay(proc: subprocess.Popen, name: str, tail: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail.append(line)
        del tail[:-200]
        print(f"  [{name}] {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = 1
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        runner = Runner(args, stack)
        try:
            code = runner.run()
        except KeyboardInterrupt:
            if runner.child is not None:
                kill_group(runner.child)
            runner.report["errors"].append("interrupted")
            log("gpu_check: interrupted: the running check and its processes were stopped")
            code = 130
        except Exception as exc:  # noqa: BLE001 - recorded; what was measured is still written
            runner.report["errors"].append(f"crashed: {type(exc).__name__}: {exc}")
            log(f"gpu_check: crashed: {type(exc).__name__}: {exc}")
            code = 1
        finally:
            runner.write()
    log(f"gpu_check: wrote {Path(args.results) / SUITE}.json and .md (exit {code})")
    return code


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
