"""Memory-tier benchmark: every-step in-memory checkpoints, their cost and their recoveries.

One run, one job (2 ranks, DDP on gloo, an MLP with AdamW: ``memckpt_train.py``), each rank
its own "node" with its own shared-memory directory and peer server (the agents' part, here
threads of this process), and a durable store: moto S3 behind the shaping proxy (the same
link as ``bench_ckpt.py``). Printed and recorded (``DIR/memckpt.json``, ``DIR/memckpt.md``):

* time per training step without checkpoints, with ckpt's durable async save every
  ``interval`` steps, and with memory checkpoints every step (plus the durable save every
  ``interval``), the same job in the same run; the floor: one memcpy of the state;
* per-step overhead measured again with many interleaved repetitions (``overhead``, first in
  the train job): blocks of
  ``block`` steps without checkpoints, with a memory checkpoint every step and with one
  replicated synchronously (``replication="sync"``: save waits for the peer's ack), in turns
  (``rounds`` of each, the order alternating) within one job; medians of per-step times,
  against one memcpy of the state timed between blocks (the floor), with the load average;
* the block checksum's speed (``checksums``): XXH3-64, which the tier uses, against the 64-bit
  word sums it replaced and CRC-32, alone and fused with the load's copy block by block, over
  a buffer of the state's size, against one memcpy (medians of interleaved repetitions);
* the same three recoveries on the cluster fixture (``memckpt_cluster.py``; full run only): two nodes as
  network namespaces, real ``bootseer run --ckpt-memory`` agents with their peer servers on
  the nodes' addresses, torchrun across the nodes, nodes replaced by empty ones;
* the job SIGKILLed in a step, then restarted three ways (agents as threads of this harness,
  on loopback): in place (each rank's own
  memory), rank 1's node replaced (its state from the peer's memory), both nodes' memory
  lost (the durable tier over the shaped S3 link): seconds to load, from process start to
  state loaded, and the steps lost beyond the one in progress; the loaded parameters are
  checked against their fingerprint at that step.

``python benchmarks/bench_memckpt.py --results DIR [--quick | --smoke]`` or ``bootseer bench memckpt``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
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

from bootseer.testing.servers import MotoS3Server  # noqa: E402
from bootseer.testing.shaper import ShaperProcess, ShaperSettings  # noqa: E402
from ckpt.memory_peer import TOKEN_ENV, PeerServer  # noqa: E402
from ckpt.memory_verify import verify_copies  # noqa: E402

WORKER = Path(__file__).with_name("memckpt_train.py")
FULL = {"d": 2048, "layers": 4, "batch": 8, "steps": 24, "interval": 10, "rounds": 8, "block": 5}
QUICK = {"d": 256, "layers": 2, "batch": 16, "steps": 4, "interval": 2, "rounds": 2, "block": 3}
# --smoke (tests/test_bench_harness.py): the quick run's steps (a durable save before the kill,
# newer memory copies to load), one overhead round, a smaller model
SMOKE = {**QUICK, "d": 128, "layers": 1, "batch": 4, "rounds": 1, "block": 2}
S3_LINK = ShaperSettings.from_mb(latency_ms=1.0, per_conn_mbps=10.0, total_mbps=100.0)
SHM_PREFIX = "bootseer-memckpt-bench-"
TARGET_LOCAL, TARGET_PEER = 1.2, 5.0
TOKEN = secrets.token_hex(32)  # the job's secret for the peer port (ranks get it by env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checksum_speeds(nbytes: int, reps: int = 7) -> dict[str, float]:
    """Seconds (median of ``reps``, methods interleaved) of one memcpy of ``nbytes`` and of
    each block checksum over them, alone and fused with a block-by-block copy (the load)."""
    import numpy as np

    from ckpt.memory_slot import BLOCK, block_hash

    nbytes = max(BLOCK, nbytes // BLOCK * BLOCK)
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    words, view = src.view("<u8"), memoryview(src)
    sums = {
        "xxh3_64": lambda i: block_hash(view[i : i + BLOCK]),
        "word sums": lambda i: int(words[i // 8 : (i + BLOCK) // 8].sum(dtype=np.uint64)),
        "crc32": lambda i: zlib.crc32(view[i : i + BLOCK]),
    }

    def alone(f: Any) -> None:
        for i in range(0, nbytes, BLOCK):
            f(i)

    def fused(f: Any) -> None:
        for i in range(0, nbytes, BLOCK):
            f(i)
            dst[i : i + BLOCK] = src[i : i + BLOCK]

    trials: dict[str, Any] = {"memcpy": lambda: np.copyto(dst, src)}
    for name, f in sums.items():
        trials[name] = lambda f=f: alone(f)
        trials[f"{name} + copy"] = lambda f=f: fused(f)
    times: dict[str, list[float]] = {k: [] for k in trials}
    for _ in range(reps):
        for name, run in trials.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}}


class Node:
    """One node's memory directory and its agent's peer server; ``replace`` loses both."""

    def __init__(self, shm: Path, name: str) -> None:
        self.shm, self.name, self.server = shm, name, None
        self.start()

    def start(self) -> None:
        self.dir = self.shm / self.name
        # Both 0700: the node's directory is its memory tier's (privdir refuses a wider one);
        # mkdir(parents=True, mode=) would give the mode to the leaf alone.
        self.dir.mkdir(mode=0o700)
        (self.dir / "peers").mkdir(mode=0o700)
        self.server = PeerServer(str(self.dir / "peers"), token=TOKEN).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def replace(self) -> None:
        self.stop()
        shutil.rmtree(self.dir)
        self.name += "-new"
        self.start()

    def spec(self) -> dict[str, str]:
        return {"dir": str(self.dir), "server": self.server.address if self.server else ""}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke = smoke_implies_quick(args)
        self.quick = bool(args.quick)
        self.cfg = dict(SMOKE if self.smoke else QUICK if self.quick else FULL)
        self.results_dir = Path(args.results)
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.R: dict[str, Any] = {
            "suite": "memckpt",
            "quick": self.quick,
            "smoke": self.smoke,
            "command": command_line("bench_memckpt.py"),
            "source": source_state(
                ["ckpt", "benchmarks/bench_memckpt.py", "benchmarks/memckpt_train.py"]
            ),
            "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
            "config": self.cfg,
            "errors": self.errors,
        }

    def form(self) -> str:
        return "quick, smoke" if self.smoke else "quick" if self.quick else "full"

    def _launch(self, phase: str, spec: dict[str, Any], names: list[str] | None = None) -> Any:
        """Run one job of 2 ranks; the results it wrote under ``names`` (default: the
        phase's), each a list by rank."""
        spec = {**self.cfg, **spec, "phase": phase, "out_dir": str(self.out)}
        port = _free_port()
        started = time.time()
        procs = []
        for rank in range(2):
            env = {
                **code_env(),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                TOKEN_ENV: TOKEN,
            }
            procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env))
        codes = [p.wait(1800) for p in procs]
        got: dict[str, list[dict[str, Any]]] = {}
        for name in names or [phase]:
            got[name] = []
            for rank in range(2):
                path = self.out / f"{name}-{rank}.json"
                if not path.exists():
                    raise RuntimeError(f"{name}: rank {rank} exited {codes[rank]} without results")
                r = json.loads(path.read_text())
                r["started"] = started
                got[name].append(r)
        return got if names else got[phase]

    def run(self) -> None:
        work = work_dir("memckpt-run-", self.stack)
        self.out = work
        shm = Path(tempfile.mkdtemp(prefix=SHM_PREFIX, dir="/dev/shm"))

        def remove_shm() -> None:
            if shm.parent == Path("/dev/shm") and shm.name.startswith(SHM_PREFIX):
                shutil.rmtree(shm, ignore_errors=True)

        self.stack.callback(remove_shm)
        nodes = [Node(shm, "node-0"), Node(shm, "node-1")]
        for n in nodes:
            self.stack.callback(n.stop)
        server = self.stack.enter_context(MotoS3Server(in_process=False))
        shaper = self.stack.enter_context(ShaperProcess("127.0.0.1", server.port, S3_LINK))
        server.create_bucket("memckpt-bench")
        opts = {"s3": server.storage_options(endpoint_url=f"http://{shaper.address}")}
        steps, interval = self.cfg["steps"], self.cfg["interval"]
        kill_at = steps - 1
        base = {"storage_options": opts, "nodes": [n.spec() for n in nodes]}
        log(
            f"bench memckpt: {self.form()} run, {self.cfg}; S3 link "
            f"{S3_LINK.describe()}; memory in {shm}"
        )
        variants = ["none", "durable", "memory-only", "memory"]
        log(
            f"phase train: {steps} steps of each of {', '.join(variants)} in one job, "
            f"SIGKILL in step {kill_at} of the last"
        )
        log(
            f"  first the overhead: {self.cfg['rounds']} rounds of {self.cfg['block']} steps "
            "without, with memory checkpoints and with them replicated sync, in turns"
        )
        self.R["overhead_load_before"] = os.getloadavg()
        got = self._launch(
            "train",
            {
                **base,
                "mode": "train",
                "variants": variants,
                "durable": "striped::s3://memckpt-bench",
                "kill_at": kill_at,
            },
            names=["overhead"] + [f"train-{v}" for v in variants],
        )
        runs = {v: got[f"train-{v}"] for v in variants}
        self.R["train"] = runs
        self.R["overhead"] = got["overhead"]
        loads = {}
        spec = {**base, "mode": "load", "durable": "striped::s3://memckpt-bench/memory"}
        log("phase load-local: in-place restart, each rank's own memory")
        # the agent's part (bootseer run does it beside the launch): check and stamp each
        # rank's newest copy (ckpt.memory_verify)
        checked = time.perf_counter()
        self.R["agent_check"] = [vars(v) for n in nodes for v in verify_copies(str(n.dir))]
        self.R["agent_check_s"] = time.perf_counter() - checked
        loads["local"] = self._launch("load-local", spec)
        log("phase load-peer: rank 1's node replaced (empty memory), its state from the peer")
        nodes[1].replace()
        loads["peer"] = self._launch("load-peer", {**spec, "nodes": [n.spec() for n in nodes]})
        log("phase load-durable: both nodes' memory lost, the durable tier over the S3 link")
        nodes[0].replace()
        nodes[1].replace()
        loads["durable"] = self._launch(
            "load-durable", {**spec, "nodes": [n.spec() for n in nodes]}
        )
        self.R["load"] = loads
        if self.quick:  # a smoke run: the cluster's four jobs cost minutes (CI runs it)
            self.R["cluster"] = None
        elif os.geteuid() == 0:
            from memckpt_cluster import cluster_trials

            log("phase cluster: the recoveries again on the cluster fixture")
            self.R["cluster_load_before"] = os.getloadavg()
            try:
                self.R["cluster"] = cluster_trials(self.cfg, work / "cluster", log)
            except Exception as exc:  # noqa: BLE001 - the loopback figures stand; say why
                self.errors.append(f"cluster trials: {type(exc).__name__}: {exc}"[:4000])
        else:
            self.errors.append("cluster trials not run (needs root for the cluster fixture)")
        log("phase checksums: XXH3-64 against word sums and CRC-32, over the state's size")
        self.R["checksums"] = checksum_speeds(loads["local"][0]["state_bytes"])
        self.R["kill_at"] = kill_at
        self.R["last_durable"] = max(s for s in range(kill_at) if s % interval == 0)
        self.R["machine"]["load_after"] = os.getloadavg()

    def rows(self) -> list[list[str]]:
        runs, loads, kill_at = self.R["train"], self.R["load"], self.R["kill_at"]

        def per_step(variant: str) -> float:
            # the slower rank's median step, the first step (warm-up, first touch) left out
            return max(statistics.median(r["step_s"][1:]) for r in runs[variant])

        none, durable = per_step("none"), per_step("durable")
        alone, memory = per_step("memory-only"), per_step("memory")
        stall = max(statistics.median(r["stall_s"][1:]) for r in runs["memory-only"])
        memcpy = max(r["memcpy_s"] for r in loads["local"])
        state_mb = loads["local"][0]["state_bytes"] / 1e6
        every = self.cfg["interval"]

        def more(x: float) -> str:
            return f"{x * 1e3:.1f} ms (+{(x / none - 1) * 100:.1f}%)"

        rows = [
            ["state per rank", f"{state_mb:.0f} MB", "-", "-", "info"],
            ["step, no checkpoint", f"{none * 1e3:.1f} ms", "-", "-", "info"],
            [f"step, ckpt durable async save every {every}", "-", more(durable), "-", "info"],
            [
                "step, memory every step (to the peer too)",
                more(alone),
                "-",
                f"floor +{memcpy / none * 100:.1f}% (one memcpy, {memcpy * 1e3:.1f} ms); "
                "GPU target <= 1%",
                "info (CPU)",
            ],
            [
                f"step, memory every step + durable every {every}",
                more(memory),
                more(durable),
                "-",
                "info",
            ],
            [
                "training thread's stall per memory save",
                f"{stall * 1e3:.1f} ms",
                "-",
                f"memcpy {memcpy * 1e3:.1f} ms",
                "info",
            ],
        ]
        lost_ok = True
        for where in ("local", "peer", "durable"):
            rs = loads[where]
            load_s = max(r["load_s"] for r in rs)
            total = max(r["loaded_at"] - r["started"] for r in rs)
            step = rs[0]["step"]
            same = all(r["step"] == step for r in rs)
            prints_ok = all(
                abs(r["print"] - runs["memory"][r["rank"]]["prints"][str(step)]) <= 0 for r in rs
            )
            lost = kill_at - 1 - step
            sources = ",".join(sorted({r["source"].split(":")[0] for r in rs}))
            if where != "durable":
                lost_ok &= lost == 0
            rows.append(
                [
                    f"recovery {where} ({sources}): load / restart to loaded",
                    f"{load_s:.3f} s / {total:.2f} s",
                    f"step {step}, {lost} step(s) lost "
                    "beyond the one in progress"
                    + ("" if same and prints_ok else " (STATE MISMATCH)"),
                    "0 steps lost" if where != "durable" else "-",
                    verdict(same and prints_ok and (lost == 0 or where == "durable")),
                ]
            )
        local = max(r["copy_best_s"] for r in loads["local"])
        first = max(r["copy_s"] for r in loads["local"])
        call = max(r["load_s"] for r in loads["local"])
        peer = max(r["load_s"] for r in loads["peer"])
        dur = max(r["load_s"] for r in loads["durable"])
        hashed = max(r.get("copy_hashed_best_s", 0.0) for r in loads["local"])
        how = ",".join(sorted({str(r.get("verified")) for r in loads["local"]}))
        rows += [
            [
                "local load (copy; the copy stamped good by the agent's check) / memcpy of "
                "the state",
                f"{local / memcpy:.2f}x",
                f"memcpy {memcpy:.3f} s (both best of 3); the first load {first:.3f} s "
                f"({how}), the whole load call {call:.3f} s (agreement, the durable tier's "
                f"listing); the agent's check of both ranks' copies beside the launch "
                f"{self.R['agent_check_s']:.3f} s",
                f"<= {TARGET_LOCAL}x",
                verdict(local / memcpy <= TARGET_LOCAL),
            ],
            [
                "local load, hashed by the trainer (no stamp) / memcpy",
                f"{hashed / memcpy:.2f}x",
                f"copy + XXH3-64 checks {hashed:.3f} s",
                "-",
                "info",
            ],
            [
                "durable load / peer load (both timed in the load call)",
                f"{dur / peer:.1f}x",
                f"durable {dur:.2f} s, peer {peer:.3f} s",
                f">= {TARGET_PEER}x",
                verdict(dur / peer >= TARGET_PEER),
            ],
            [
                "steps lost beyond the one in progress (memory)",
                "0" if lost_ok else ">0",
                "-",
                "0",
                verdict(lost_ok),
            ],
        ]
        oh = self.R.get("overhead")
        if oh:
            med = {
                k: max(statistics.median(r["step_s"][k]) for r in oh)
                for k in ("none", "memory", "sync")
                if k in oh[0]["step_s"]
            }
            floor = max(statistics.median(r["memcpy_s"]) for r in oh)
            n = len(oh[0]["step_s"]["none"])
            la = ", ".join(f"{x:.1f}" for x in self.R["overhead_load_before"])
            rows += [
                [
                    "step, interleaved blocks: memory every step / none (medians)",
                    f"{med['memory'] * 1e3:.1f} ms / {med['none'] * 1e3:.1f} ms "
                    f"(+{(med['memory'] / med['none'] - 1) * 100:.1f}%)",
                    f"{n} steps of each, {self.cfg['rounds']} blocks of {self.cfg['block']}; "
                    f"load average {la} before",
                    f"floor +{floor / med['none'] * 100:.1f}% (one memcpy, "
                    f"{floor * 1e3:.1f} ms); GPU target <= 1%",
                    "info (CPU)",
                ]
            ]
            if "sync" in med:
                rows += [
                    [
                        "step, interleaved blocks: memory every step, replication sync / "
                        "none (medians)",
                        f"{med['sync'] * 1e3:.1f} ms / "
                        f"{med['none'] * 1e3:.1f} ms ({(med['sync'] / med['none'] - 1) * 100:+.1f}%)",
                        f"async in the same blocks: {(med['memory'] / med['none'] - 1) * 100:+.1f}%",
                        "the push time on every step (the price of 0 steps lost)",
                        "info (CPU)",
                    ]
                ]
        from memckpt_cluster import push_rows

        rows += push_rows([{**r, "kill_at": kill_at} for r in runs["memory"]], "loopback")
        if self.R.get("cluster"):
            from memckpt_cluster import cluster_rows

            rows += cluster_rows(self.R["cluster"], verdict, TARGET_PEER)
        c = self.R.get("checksums")
        if c:

            def speed(k: str) -> str:
                return f"{c['bytes'] / c[k] / 1e9:.1f} GB/s ({c[k] / c['memcpy']:.2f}x memcpy)"

            rows += [
                [
                    "block checksum XXH3-64 (used) alone / fused with the load's copy",
                    f"{speed('xxh3_64')} / {speed('xxh3_64 + copy')}",
                    f"word sums {speed('word sums')} / {speed('word sums + copy')}; CRC-32 "
                    f"{speed('crc32')} / {speed('crc32 + copy')}",
                    f"memcpy {c['bytes'] / c['memcpy'] / 1e9:.1f} GB/s",
                    "info",
                ]
            ]
        return rows

    def report(self) -> None:
        table = final_table(self.R, self.rows())
        self.write_files(table)

    def write_files(self, table: list[str] | None = None) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        (self.results_dir / "memckpt.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )
        m = self.R["machine"]
        load = ", ".join(f"{x:.2f}" for x in m["load_before"])
        if "load_after" in m:
            load += f" before, {', '.join(f'{x:.2f}' for x in m['load_after'])} after"
        md = [
            f"# Memory-tier benchmark ({self.form()} run)",
            "",
            f"- command: `{self.R['command']}` ({self.R['finished']})",
            f"- config {self.cfg}; S3 link {S3_LINK.describe()}",
            f"- load average (1, 5, 15 min) {load} on {m['cpus']} CPUs",
            "",
            *(table or ["(no results: the run failed before its report)"]),
        ]
        md += [f"- ERROR: {e}" for e in self.errors]
        (self.results_dir / "memckpt.md").write_text("\n".join(md) + "\n")
        log(f"wrote {self.results_dir / 'memckpt.json'} and {self.results_dir / 'memckpt.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_memckpt.py", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="a small model: a smoke run")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    return run_bench(Bench(args), done_key="final_table", report_inside=True, log_fn=log)


if __name__ == "__main__":
    sys.exit(main())
