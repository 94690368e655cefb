"""Snapshotter restart benchmark: how long readers of the lazy mount wait while the snapshotter
restarts (docs/containerd.md, "Restarts and upgrades").

One node-like set-up, no registry or containerd needed: ``bootseer snapshotter`` on a private
root (it mounts ``ROOT/lazy`` and starts its FUSE holder), then per round: the snapshotter is
stopped (``SIGTERM`` or ``SIGKILL``), a reader lists ``ROOT/lazy`` (the mount's root is never
cached by the kernel, so the listing waits for a server), a new snapshotter is started on the
same root and takes the connection over from the holder. Measured per round:

* ``gap``: from the signal to the reader's listing returning (what a running container sees);
* ``start``: from the new process's start to its socket answering a gRPC ``List`` (what
  containerd sees);
* whether the new process took the connection over (its log says so) and the reader's listing
  equals the one before the stop.

A restart of containerd's own snapshotters is not comparable (they keep no FUSE connection), so
the figure beside them is the floor measured in the same run: a bare ``bootseer snapshotter``
started on an empty root of its own (it mounts anew and starts its holder), to the same gRPC
answer, ``--repeat`` times.

``python benchmarks/bench_restart.py --results DIR [--quick] [--repeat 5]`` or ``bootseer bench
restart [--quick]``; writes ``DIR/restart.json`` and ``DIR/restart.md`` (medians and p90, the
load average before and after: two busy CPUs make every figure higher). ``--quick``: 2 repeats.
Needs root (FUSE). The work directory is made under ``~/.cache/bootseer-bench``
(``BOOTSEER_BENCH_CACHE``); it, the mounts, the snapshotters and their holders are removed on
exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_smoke_flag,
    code_env,
    command_line,
    final_table,
    log,
    run_bench,
    smoke_implies_quick,
    source_state,
    verdict,
    work_dir,
)

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
FULL_REPEAT, QUICK_REPEAT = 5, 2
START_TIMEOUT_S = 120.0
WORK_PREFIX = "restart-run-"
TAKEOVER_LINE = "taking over the lazy mount"


def _serving(address: str, deadline: float) -> bool:
    """Whether the snapshotter on ``address`` answers a gRPC ``List`` before ``deadline``."""
    import grpc

    from prefetch.containerd.api.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc

    with grpc.insecure_channel(f"unix://{address}") as channel:
        stub = snapshots_pb2_grpc.SnapshotsStub(channel)
        try:
            list(
                stub.List(
                    snapshots_pb2.ListSnapshotsRequest(snapshotter="bootseer"),
                    timeout=max(0.1, deadline - time.monotonic()),
                    wait_for_ready=True,
                )
            )
        except grpc.RpcError:
            return False
    return True


class Node:
    """One snapshotter root: its processes one after the other, each with a log of its own."""

    def __init__(self, base: Path) -> None:
        self.root = base / "root"
        self.address = str(base / "run" / "sn.sock")
        self.base = base
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[Path] = []

    def start(self) -> float:
        """Start a snapshotter; seconds from its start until it answers gRPC."""
        log_file = self.base / f"sn-{len(self.logs)}.log"
        self.logs.append(log_file)
        started = time.monotonic()
        with open(log_file, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "snapshotter",
                    "--root",
                    str(self.root),
                    "--address",
                    self.address,
                    "--no-push-profiles",
                    "--no-prefetch",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=code_env(),
                cwd=self.base,
                start_new_session=True,
            )
        deadline = started + START_TIMEOUT_S
        while not os.path.exists(self.address):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the snapshotter on {self.root} did not start "
                    f"(exit {self.proc.poll()}):\n{log_file.read_text()[-3000:]}"
                )
            time.sleep(0.005)
        if not _serving(self.address, deadline):
            raise RuntimeError(
                f"the snapshotter on {self.root} does not answer gRPC List "
                f"within {START_TIMEOUT_S:.0f} s:\n{log_file.read_text()[-3000:]}"
            )
        return time.monotonic() - started

    def took_over(self) -> bool:
        return TAKEOVER_LINE in self.logs[-1].read_text()

    def restart(self, sig: int) -> dict[str, Any]:
        """Stop the running snapshotter with ``sig`` while a reader lists the lazy mount, start
        the next; the reader's gap, the new process's start, and what the reader saw."""
        assert self.proc is not None
        lazy = self.root / "lazy"
        before = sorted(os.listdir(lazy))
        seen: list[tuple[float, list[str]]] = []
        stopped = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        if os.path.exists(self.address):  # a killed process leaves its socket behind
            os.unlink(self.address)

        def read() -> None:
            names = sorted(os.listdir(lazy))  # waits for a server; the clock is read after
            seen.append((time.monotonic(), names))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        start_s = self.start()
        reader.join(timeout=START_TIMEOUT_S)
        if not seen:
            raise RuntimeError(
                f"the reader of {lazy} never got an answer:\n{self.logs[-1].read_text()[-3000:]}"
            )
        return {
            "gap_s": round(seen[0][0] - stopped, 4),
            "start_s": round(start_s, 4),
            "took_over": self.took_over(),
            "listing_equal": seen[0][1] == before,
        }

    def stop(self) -> None:
        """Stop the snapshotter and unmount the lazy mount (its holder then exits, idle)."""
        from striped_fs.fuse import is_mounted, unmount

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if is_mounted(self.root / "lazy"):
            unmount(self.root / "lazy", lazy=True)
        holder = str(self.base / "run" / "fuse-holder.sock")  # started by the first snapshotter
        left = _processes_with(holder, wait_s=30.0)
        if left:
            raise RuntimeError(
                f"the FUSE holder of {self.root} (pids {left}) did not exit "
                "after the unmount: kill them and report a bug"
            )


def _secs(stats: dict[str, Any]) -> str:
    return f"{stats['median']:.3f} s (p90 {stats['p90']:.3f} s)"


def _processes_with(text: str, *, wait_s: float) -> list[int]:
    """The processes whose command line holds ``text``, after waiting up to ``wait_s`` for
    them to exit (an idle holder exits when its connection ends)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _stats(values: list[float]) -> dict[str, Any]:
    """Median and p90 (inclusive; the value itself for one sample) of ``values``."""
    p90 = (
        statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]
    )
    return {"median": round(statistics.median(values), 4), "p90": round(p90, 4), "all": values}


class Bench:
    """One run: the floor, then the restarts (``run_bench``'s protocol)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke = smoke_implies_quick(args)
        self.quick = bool(args.quick)
        self.repeat = args.repeat or (QUICK_REPEAT if self.quick else FULL_REPEAT)
        self.results_dir = Path(args.results)
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.R: dict[str, Any] = {
            "suite": "restart",
            "quick": self.quick,
            "smoke": self.smoke,
            "command": command_line("bench_restart.py"),
            "source": source_state(
                ["prefetch/containerd", "bootseer/cli", "benchmarks/bench_restart.py"]
            ),
            "pythonpath": os.environ.get("PYTHONPATH", ""),
            "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
            "config": {"repeat": self.repeat},
            "signals": {},
            "errors": self.errors,
        }

    def run(self) -> None:
        work = work_dir(WORK_PREFIX, self.stack)  # a file at the cache: FileExistsError, exit 1
        log(
            f"bench restart: {'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run; {self.repeat} repeat(s) "
            f"of each signal; work {work}"
        )
        floor: list[float] = []
        for i in range(self.repeat):  # a fresh empty root each time: mount anew, new holder
            bare = Node(work / f"floor-{i}")
            bare.base.mkdir()
            self.stack.callback(bare.stop)
            floor.append(round(bare.start(), 4))
            bare.stop()
        self.R["floor_start_s"] = _stats(floor)
        log(f"floor: a bare snapshotter on an empty root serves after {floor} s")

        node = Node(work / "node")
        node.base.mkdir()
        self.stack.callback(node.stop)
        self.R["first_start_s"] = round(node.start(), 4)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SIGNALS}
        for i in range(self.repeat):
            for name, sig in SIGNALS.items():
                rounds[name].append(node.restart(sig))
                log(f"round {i + 1} {name}: {rounds[name][-1]}")
        for name, rs in rounds.items():
            self.R["signals"][name] = {
                "gap_s": _stats([r["gap_s"] for r in rs]),
                "start_s": _stats([r["start_s"] for r in rs]),
                "rounds": rs,
            }
        every = [r for rs in rounds.values() for r in rs]
        self.R["takeovers"] = {
            "rounds": len(every),
            "succeeded": sum(r["took_over"] for r in every),
            "listing_equal": sum(r["listing_equal"] for r in every),
        }
        self.R["machine"]["load_after"] = os.getloadavg()

    def rows(self) -> list[list[str]]:
        floor = self.R["floor_start_s"]
        peer = f"floor: bare start {_secs(floor)}"
        out: list[list[str]] = []
        for name, r in self.R["signals"].items():
            gap, start = r["gap_s"], r["start_s"]
            out += [
                [f"{name}: reader waited (signal to listing)", _secs(gap), peer, "-", "info"],
                [f"{name}: new process serving gRPC after", _secs(start), peer, "-", "info"],
            ]
        t = self.R["takeovers"]
        out += [
            [
                "takeovers of the held connection",
                f"{t['succeeded']} of {t['rounds']}",
                "-",
                "every one",
                verdict(t["succeeded"] == t["rounds"]),
            ],
            [
                "reader's listing equals the one before the stop",
                f"{t['listing_equal']} of {t['rounds']}",
                "-",
                "every one",
                verdict(t["listing_equal"] == t["rounds"]),
            ],
        ]
        return out

    def report(self) -> None:
        table = final_table(self.R, self.rows())
        t = self.R["takeovers"]
        if t["succeeded"] != t["rounds"] or t["listing_equal"] != t["rounds"]:
            self.errors.append(
                f"{t['rounds'] - t['succeeded']} takeover(s) failed and "
                f"{t['rounds'] - t['listing_equal']} listing(s) differed: see "
                "the rounds in restart.json and the snapshotter logs"
            )
        if self.quick:
            self.R.setdefault("warnings", []).append(
                f"--quick: {self.repeat} repeats: a smoke test, not the figures"
            )
        self.write_files(table)

    def write_files(self, table: list[str] | None = None) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        (self.results_dir / "restart.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )
        src, m = self.R["source"], self.R["machine"]
        load = ", ".join(f"{x:.2f}" for x in m["load_before"])
        if "load_after" in m:
            load += f" before, {', '.join(f'{x:.2f}' for x in m['load_after'])} after"
        md = [
            f"# Snapshotter restart benchmark ({'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run)",
            "",
            f"- command: `{self.R['command']}` ({self.R['finished']})",
            f"- commit {src.get('commit', '?')[:12]}"
            + (
                f", local changes in {', '.join(src['local_changes'])}"
                if src.get("local_changes")
                else ""
            ),
            f"- {self.repeat} round(s) per signal, medians and p90; load average (1, 5, 15 "
            f"min) {load} on {m['cpus']} CPUs",
            "- peer: none comparable (containerd's own snapshotters keep no FUSE connection); "
            "the floor is a bare `bootseer snapshotter` on an empty root, to its first gRPC "
            "answer, in the same run",
            "",
            *(table or ["(no results: the run failed before its report)"]),
        ]
        if "first_start_s" in self.R:
            md.append(f"\nFirst start of the node (mounts anew): {self.R['first_start_s']:.3f} s.")
        md += [f"- WARNING: {w}" for w in self.R.get("warnings", [])]
        md += [f"- ERROR: {e}" for e in self.errors]
        (self.results_dir / "restart.md").write_text("\n".join(md) + "\n")
        log(f"wrote {self.results_dir / 'restart.json'} and {self.results_dir / 'restart.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_restart.py", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench-results", help="directory for restart.json/.md")
    parser.add_argument("--quick", action="store_true", help="2 repeats: a smoke run")
    parser.add_argument(
        "--repeat", type=int, help=f"rounds per signal ({FULL_REPEAT}; quick {QUICK_REPEAT})"
    )
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give at least 1 round per signal")
    return run_bench(Bench(args), done_key="final_table", report_inside=False, log_fn=log)


if __name__ == "__main__":
    sys.exit(main())
