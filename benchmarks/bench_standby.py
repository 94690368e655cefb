"""Warm standby benchmark: from a lost node to the first training step on every rank, with a
warm standby parked at the rendezvous against a fresh cold node that replaces the lost one
(docs/robust.md, "Warm standby and elastic membership").

The cluster fixture (bootseer.testing.cluster), one rank per node, the cluster tests' job
(tests/cluster_job.py: AdamW over gloo, checkpoints to S3 every 3 steps through
``CheckpointManager``) with a wide hidden layer so that each rank's state is ``--width`` x
~252 bytes. Two nodes train at ``--nnodes 2:2`` and hold after committing step 8; then:

* ``standby``: a third node ran ``bootseer warmup --self-check`` (the newest checkpoint's
  shards of both ranks) and parked with ``bootseer run -- torchrun --nnodes 2:2`` (torch's
  redundancy list) before the loss; node1 is killed;
* ``cold``: node1 is killed and replaced by a fresh, empty node (the fixture's
  ``replace_node``), which starts ``bootseer run -- torchrun`` at once (its startup prefetches
  rank 1's shards, the lost node's).

Measured: from the kill to the first step finished after it, on every rank (the slower
rank's), when each rank's load was done, and the bytes the new node took from S3 after the
kill. The cold figure leaves out
the fixture's own node creation (namespaces, tmpfs: reported apart); a real cold node adds its
scheduling, boot and image pull on top, which a standby also saves and this does not measure.

``python benchmarks/bench_standby.py --results DIR [--quick]``; writes ``DIR/standby.json`` and
``DIR/standby.md``. Needs root (the cluster). Not a ``bootseer bench`` suite (yet): the
harness runs every suite's quick form in CI, and two cluster jobs would cost minutes there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, final_table, log, md_table, verdict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "cluster_job.py"
BOOTSEER = [sys.executable, "-m", "bootseer"]
#: keep-alive 1 s x 10: with the fixture's x 3, a live node that misses three beats on a
#: loaded machine is sanitized out and the parked standby takes its place (docs/robust.md)
PATIENT = {"keep_alive_max_attempt": 10}


def _wait(what: str, ready: Any, procs: dict[str, subprocess.Popen], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} in {timeout_s} s")
        time.sleep(0.2)
    return got


def _parked(c: Any, address: str) -> bool:
    from torch.distributed import TCPStore

    from bootseer.robust.standby import rendezvous_members

    with c.services.entered():
        store = TCPStore("127.0.0.1", 29400, is_master=False, timeout=timedelta(seconds=20))
        state = rendezvous_members(store, "bench")
    return bool(state) and address in state["redundancy"]


def scenario(method: str, width: int, rate: str, work: Path) -> dict[str, Any]:
    """One run of ``method`` (standby | cold) in a cluster of its own."""
    from bootseer.testing.cluster import Cluster, Link

    out = work / method
    out.mkdir(parents=True)
    nodes = 3 if method == "standby" else 2
    with Cluster(nodes, link=Link(rate=rate), services=("s3", "rendezvous")) as c:
        c.services.create_bucket("bench")
        opts = json.dumps({"s3": c.services.storage_options()})
        script = [
            str(JOB),
            "--ckpt",
            "s3://bench/run",
            "--out",
            str(out),
            "--storage-options",
            opts,
            "--steps",
            "12",
            "--save-every",
            "3",
            "--hold-at",
            "9",
            "--width",
            str(width),
        ]

        def launch(node: Any, argv: list[str]) -> subprocess.Popen:
            with open(out / f"{node.name}.{node.generation}.log", "w") as f:
                return node.popen(argv, stdout=f, stderr=subprocess.STDOUT)

        def bootseer_run(node: Any, ranks: str) -> list[str]:
            return [
                "--node",
                node.name,
                "--state-dir",
                str(node.dirs.work / "state"),
                "--trace-dir",
                str(out / "trace"),
                "--ckpt-url",
                "s3://bench/run",
                "--storage-options",
                opts,
                "--ranks",
                ranks,
                "--min-free-disk",
                "1MiB",
                "--min-free-memory",
                "1MiB",
            ]

        def job(node: Any, ranks: str) -> list[str]:
            return [
                *BOOTSEER,
                "run",
                *bootseer_run(node, ranks),
                "--hang-timeout",
                "0",
                "--",
                *node.torchrun(script, nnodes="2:2", rdzv_id="bench", rdzv_conf=PATIENT),
            ]

        procs = {
            n.name: launch(n, n.torchrun(script, nnodes="2:2", rdzv_id="bench", rdzv_conf=PATIENT))
            for n in c.nodes[:2]
        }
        try:
            _wait(
                "both ranks holding",
                lambda: all((out / f"holding-{r}").exists() for r in (0, 1)),
                procs,
                600,
            )
            result: dict[str, Any] = {"method": method}
            if method == "standby":
                spare = c.nodes[2]
                started = time.monotonic()
                spare.run([*BOOTSEER, "warmup", "--self-check", *bootseer_run(spare, "0-1")])
                procs["node2"] = launch(spare, job(spare, "0-1"))
                _wait("the standby parked", lambda: _parked(c, spare.address), procs, 300)
                result["standby_ready_s"] = time.monotonic() - started
                new = spare
            s3_before = c.nodes[2].bytes_from("s3") if method == "standby" else 0
            lost_at = time.time()
            c.kill_node(1)
            procs.pop("node1").wait(timeout=30)
            if method == "cold":
                made = time.monotonic()
                new = c.replace_node(1)
                result["node_creation_s"] = time.monotonic() - made
                procs["node1"] = launch(new, job(new, "1"))
            for name, proc in procs.items():
                if proc.wait(timeout=600) != 0:
                    raise RuntimeError(f"{name} exited {proc.returncode}: see {out}")
            result["new_node_s3_bytes_after_loss"] = new.bytes_from("s3") - s3_before
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
    firsts = {p.name: json.loads(p.read_text()) for p in out.glob("stepped-*.json")}
    after = {n: d["time"] - lost_at for n, d in firsts.items() if d["time"] > lost_at}
    if len(after) != 2:
        raise RuntimeError(f"expected a first step after the loss on 2 ranks, got {after}")
    result["first_step_after_loss_s"] = after
    # the load done (each rank's record of it): what came before is the rendezvous, the new
    # worker processes and init_process_group; after it, one training step
    result["loaded_after_loss_s"] = {
        p.name: p.stat().st_mtime - lost_at for p in out.glob("loaded-*.json")
    }
    loss_to_step = max(after.values())
    if method == "cold":
        loss_to_step -= result["node_creation_s"]
    result["loss_to_first_step_s"] = loss_to_step
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="hidden width: ~252 bytes of state per unit per rank "
        "(default 200000, ~50 MB; --quick 20000)",
    )
    parser.add_argument("--rate", default="200mbit", help="each node's link (tc rate)")
    args = parser.parse_args()
    width = args.width or (20_000 if args.quick else 200_000)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    work = results / f"standby-work-{os.getpid()}"
    report: dict[str, Any] = {
        "command": command_line("bench_standby.py"),
        "width": width,
        "rate": args.rate,
        "quick": args.quick,
        "load_before": os.getloadavg(),
    }
    for method in ("standby", "cold"):
        log(f"standby: {method} ...")
        report[method] = scenario(method, width, args.rate, work)
        log(
            f"standby: {method}: loss -> first step on every rank "
            f"{report[method]['loss_to_first_step_s']:.2f} s"
        )
    report["load_after"] = os.getloadavg()
    warm, cold = report["standby"]["loss_to_first_step_s"], report["cold"]["loss_to_first_step_s"]
    rows = [
        [
            "loss -> first step, every rank (s)",
            f"{warm:.2f} (warm standby)",
            f"{cold:.2f} (cold node)",
            "standby < cold",
            verdict(warm < cold),
        ],
        [
            "new node's S3 bytes after the loss",
            str(report["standby"]["new_node_s3_bytes_after_loss"]),
            str(report["cold"]["new_node_s3_bytes_after_loss"]),
            "-",
            "-",
        ],
    ]
    table = final_table(report, rows)
    (results / "standby.json").write_text(json.dumps(report, indent=1))
    (results / "standby.md").write_text(
        "\n".join(
            [
                f"# standby ({'quick' if args.quick else 'full'}), width {width}, {args.rate}",
                "",
                *table,
                "",
                *md_table(
                    ["load before", "load after"],
                    [[str(report["load_before"]), str(report["load_after"])]],
                ),
            ]
        )
        + "\n"
    )
    import shutil

    if work.name.startswith("standby-work-"):  # only the directory made above
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
