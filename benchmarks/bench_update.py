"""Hot update benchmark: how long an urgent version update takes to reach every node, in
place, against restarting the job's entrypoints on the new code (docs/robust.md, "Lazy hot
update and rollback").

Two ``bootseer run`` agents on loopback (one TCPStore hosted by ``bootseer controller
--port``, the controller beside it), each running a small training loop that heartbeats
every 0.1 s. Measured per round: the job's **downtime**, from the last step of the old code
on any node to the first step of the new code on every node (what the update costs the job:
it trains on while the operator's command runs), and, for the in-place path, the time from
the operator's command to the first step on every node:

* ``bootseer``: ``bootseer controller publish --urgent`` of a new code directory; the
  controller's update incident, each agent stopping its command after its next heartbeat and
  starting it again on the new version (the publish command's own start is included);
* peer (what a job without hot update does): SIGTERM to every ``bootseer run`` (no
  controller), then both started again in the new code directory;
* floor: the training script alone started on a node, to its first step (no agent at all).

Not modelled: a real requeue also waits for the scheduler, pods and images (ByteRobust
measured 454-768 s for that against 46-65 s in place); here the peer pays only the agents'
start, so the ratio is a lower bound of what in-place saves.

``python benchmarks/bench_update.py --results DIR [--quick] [--repeat N]`` or ``bootseer
bench update [--quick]``; writes ``DIR/update.json`` and ``DIR/update.md`` (medians and the
slowest round, the load average before and after). The work directory is made under
``~/.cache/bootseer-bench`` (``BOOTSEER_BENCH_CACHE``) and removed on exit; every process
started is stopped, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    code_env,
    command_line,
    final_table,
    kill_group,
    load_text,
    log,
    repeat_args,
    run_bench,
    source_state,
    verdict,
    work_dir,
    write_report_json,
)

NODES = ("node0", "node1")
JOB = "bench"
FULL_REPEAT, QUICK_REPEAT = 5, 1
WAIT_S = 180.0
WORK_PREFIX = "update-run-"
LOOP = """import os, time
from pathlib import Path
import bootseer
out, node = Path(os.environ["BENCH_OUT"]), os.environ.get("BOOTSEER_NODE", "floor")
here = Path(__file__).resolve().parent.name


def mark(name):  # atomic: a kill never leaves an empty file
    tmp = out / f".{name}.{os.getpid()}"
    tmp.write_text(repr(time.time()))
    os.replace(tmp, out / name)


step = 0
while True:
    bootseer.heartbeat(step)
    if step == 0:
        mark(f"first-{node}-{here}")
    mark(f"last-{node}-{here}")
    if os.environ.get("BENCH_ONE_STEP"):
        break
    time.sleep(0.1)
    step += 1
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "all": [round(v, 3) for v in values],
    }


class Bench:
    """The floor, the in-place rounds, the peer's rounds (``run_bench``'s protocol)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.quick, self.repeat = bool(args.quick), args.repeat  # see repeat_args
        self.smoke = bool(args.smoke)  # implies quick (repeat_args)
        self.results_dir = Path(args.results)
        self.procs: list[subprocess.Popen] = []
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.R: dict[str, Any] = {
            "suite": "update",
            "quick": self.quick,
            "smoke": self.smoke,
            "command": command_line("bench_update.py"),
            "source": source_state(
                ["bootseer/robust", "bootseer/supervise.py", "benchmarks/bench_update.py"]
            ),
            "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
            "config": {"repeat": self.repeat, "nodes": len(NODES)},
            "errors": self.errors,
        }

    # -- processes ---------------------------------------------------------------------------
    def _start(self, argv: list[str], name: str, cwd: Path | None = None) -> subprocess.Popen:
        log_file = open(self.work / f"{name}.log", "a")  # noqa: SIM115
        with log_file:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**code_env(), "BENCH_OUT": str(self.out)},
            )
        self.procs.append(proc)
        return proc

    def _stop_all(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.wait()
        self.procs = []

    def _agents(self, code: Path, controller: str | None) -> list[subprocess.Popen]:
        link = ["--controller", controller, "--job", JOB] if controller else []
        return [
            self._start(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "run",
                    *link,
                    "--node",
                    node,
                    "--state-dir",
                    str(self.work / f"state-{node}"),
                    "--trace-dir",
                    str(self.work / "trace"),
                    "--min-free-disk",
                    "0",
                    "--min-free-memory",
                    "0",
                    "--max-restarts",
                    "0",
                    "--",
                    sys.executable,
                    "train.py",
                ],
                node,
                cwd=code,
            )
            for node in NODES
        ]

    def _code(self, version: str) -> Path:
        path = self.work / "code" / version
        path.mkdir(parents=True)
        (path / "train.py").write_text(LOOP)
        return path

    def _downtime(self, old: str, new: str) -> float:
        """From the old code's last step on any node to the new code's first on every node."""
        last = min(float((self.out / f"last-{n}-{old}").read_text()) for n in NODES)
        return self._first_steps(new, last)

    def _first_steps(self, version: str, since: float) -> float:
        """Seconds from ``since`` to the last node's first step on ``version``."""
        files = [self.out / f"first-{node}-{version}" for node in NODES]
        deadline = time.monotonic() + WAIT_S
        while not all(f.exists() and f.stat().st_size for f in files):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"version {version} did not reach every node in {WAIT_S:.0f}"
                    f" s: see the logs in {self.work}"
                )
            time.sleep(0.02)
        return max(float(f.read_text()) for f in files) - since

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> None:
        self.work = work_dir(WORK_PREFIX, self.stack)
        self.out = self.work / "out"
        self.out.mkdir()
        self.stack.callback(self._stop_all)
        log(
            f"bench update: {'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run; {self.repeat} round(s); "
            f"work {self.work}"
        )
        floor = []
        for i in range(self.repeat):
            code = self._code(f"floor{i}")
            t0 = time.time()
            subprocess.run(
                [sys.executable, "train.py"],
                cwd=code,
                check=True,
                env={**code_env(), "BENCH_OUT": str(self.out), "BENCH_ONE_STEP": "1"},
            )
            floor.append(float((self.out / f"first-floor-floor{i}").read_text()) - t0)
        self.R["floor_s"] = _summary(floor)
        log(f"floor: the script alone to its first step: {self.R['floor_s']}")

        port = _free_port()
        address = f"127.0.0.1:{port}"
        ctl = self._start(
            [
                sys.executable,
                "-m",
                "bootseer",
                "controller",
                "--port",
                str(port),
                "--job",
                JOB,
                "--trace-dir",
                str(self.work / "ctl"),
            ],
            "controller",
        )
        self.stack.callback(self._stop_store)
        self._agents(self._code("v0"), address)
        self._first_steps("v0", 0.0)
        inplace, published, reach = [], [], []
        for i in range(1, self.repeat + 1):
            code = self._code(f"v{i}")
            time.sleep(1.0)  # running steadily before the operator acts
            t0 = time.time()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "controller",
                    "publish",
                    "--store",
                    address,
                    "--job",
                    JOB,
                    "--id",
                    f"v{i}",
                    "--workdir",
                    str(code),
                    "--urgent",
                ],
                check=True,
                env=code_env(),
                capture_output=True,
            )
            published.append(time.time() - t0)
            reach.append(self._first_steps(f"v{i}", t0))
            inplace.append(self._downtime(f"v{i - 1}", f"v{i}"))
            log(
                f"in place, round {i}: down {inplace[-1]:.3f} s; every node on v{i} "
                f"{reach[-1]:.3f} s after the publish command started (it ran "
                f"{published[-1]:.3f} s)"
            )
        self.R["inplace_s"] = _summary(inplace)
        self.R["publish_to_every_node_s"] = _summary(reach)
        self.R["publish_command_s"] = _summary(published)
        self.R["controller_alive"] = ctl.poll() is None
        self._stop_all()

        peer = []
        self._agents(self._code("p0"), None)
        self._first_steps("p0", 0.0)
        for i in range(1, self.repeat + 1):
            code = self._code(f"p{i}")
            time.sleep(1.0)
            t0 = time.time()
            self._stop_all()
            self._agents(code, None)
            self._first_steps(f"p{i}", t0)
            peer.append(self._downtime(f"p{i - 1}", f"p{i}"))
            log(f"peer, round {i}: down {peer[-1]:.3f} s")
        self.R["peer_s"] = _summary(peer)
        self._stop_all()
        self.R["machine"]["load_after"] = os.getloadavg()

    def _stop_store(self) -> None:
        """The store that ``bootseer controller --port`` started in a session of its own."""
        for line in (self.work / "controller.log").read_text().splitlines():
            if "store started on port" in line and "(pid " in line:
                pid = int(line.split("(pid ")[1].split(")")[0])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def rows(self) -> list[list[str]]:
        ins, peer, floor = self.R["inplace_s"], self.R["peer_s"], self.R["floor_s"]

        def s(x: dict[str, Any]) -> str:
            return f"{x['median']:.2f} s (max {x['max']:.2f})"

        return [
            [
                "urgent update: the job's downtime (old code's last step to the new code's "
                "first on every node)",
                s(ins),
                f"restart every bootseer run: {s(peer)}",
                f"floor: script alone {s(floor)}",
                verdict(ins["median"] < peer["median"]),
            ],
            [
                "urgent update: from the publish command to every node's first step",
                s(self.R["publish_to_every_node_s"]),
                "-",
                "-",
                "info",
            ],
            [
                "of it: the publish command itself (python, torch's TCPStore client)",
                s(self.R["publish_command_s"]),
                "-",
                "-",
                "info",
            ],
        ]

    def report(self) -> None:
        table = final_table(self.R, self.rows())
        if self.quick:
            self.R.setdefault("warnings", []).append(
                f"--quick: {self.repeat} rounds: a smoke test, not the figures"
            )
        self.write_files(table)

    def write_files(self, table: list[str] | None = None) -> None:
        write_report_json(self.results_dir, "update", self.R)
        m = self.R["machine"]
        load = load_text(m)
        md = [
            f"# Hot update benchmark ({'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run)",
            "",
            f"- command: `{self.R['command']}` ({self.R['finished']})",
            f"- commit {self.R['source'].get('commit', '?')[:12]}",
            f"- {self.repeat} round(s), {len(NODES)} nodes on loopback; load average (1, 5, "
            f"15 min) {load} on {m['cpus']} CPUs",
            "",
            *(table or ["(no results: the run failed before its report)"]),
        ]
        md += [f"- WARNING: {w}" for w in self.R.get("warnings", [])]
        md += [f"- ERROR: {e}" for e in self.errors]
        (self.results_dir / "update.md").write_text("\n".join(md) + "\n")
        log(f"wrote {self.results_dir / 'update.json'} and {self.results_dir / 'update.md'}")


def main(argv: list[str] | None = None) -> int:
    args = repeat_args("bench_update.py", __doc__, "update", FULL_REPEAT, QUICK_REPEAT, argv)
    return run_bench(Bench(args), done_key="final_table", report_inside=False, log_fn=log)


if __name__ == "__main__":
    sys.exit(main())
