"""ckpt benchmark: bootseer checkpoints against torch.distributed.checkpoint, one run.

Two ranks (gloo) each hold an FSDP-style half of a transformer-shaped model with AdamW
state (2.3 GB in all; ``--quick``: a few MB). Printed and recorded (``DIR/ckpt.json``,
``DIR/ckpt.md``):

* stalls, two per async method: until ``save`` returns, and until training may mutate the
  state (staging done): bootseer vs DCP ``async_save`` (thread and process checkpointers,
  cached shared-memory staging) vs DCP ``save``; floor: one copy into a preallocated buffer;
* overhead per save inside a real CPU training loop (forward, backward, AdamW step), the
  loop without saves subtracted;
* save until durable and committed, and load after dropping the page cache: bootseer vs DCP
  vs the floor (``dd`` of the same number of bytes, write with fsync / cold read);
* a resharded load: the 2-rank checkpoints loaded by 4 ranks, each reading its quarter;
* through moto S3 behind the shaping proxy: bootseer (striped) vs DCP's FsspecWriter/Reader
  on plain s3fs (model parameters only, to keep the single-stream peer's run short);
* RSS of a rank after 10 saves.

``python benchmarks/bench_ckpt.py --results DIR [--quick | --smoke]`` or ``bootseer bench ckpt``
(``--smoke``: the test's form, smaller than quick, page cache kept).
Everything listens on 127.0.0.1; the page cache is dropped through /proc/sys/vm/drop_caches
(root), and data goes under ``~/.cache/bootseer-bench/ckpt-run`` (removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    KEEP_CACHES_ENV,
    add_smoke_flag,
    command_line,
    sigterm_as_interrupt,
    smoke_implies_quick,
)

from bootseer.testing.servers import MotoS3Server  # noqa: E402
from bootseer.testing.shaper import ShaperProcess, ShaperSettings  # noqa: E402

WORKER = Path(__file__).with_name("ckpt_worker.py")
FULL = {"vocab": 32768, "d": 1024, "layers": 5, "seq": 64, "train_steps": 12, "save_every": 4}
QUICK = {"vocab": 2048, "d": 128, "layers": 2, "seq": 16, "train_steps": 4, "save_every": 2}
# --smoke (tests/test_bench_harness.py): every phase and method once or twice, the quick model
# smaller still; its figures mean nothing (the counts' defaults, in ckpt_worker, are the runs')
SMOKE = {
    **QUICK,
    "vocab": 512,
    "d": 64,
    "layers": 1,
    "seq": 8,
    "train_steps": 2,
    "save_every": 1,
    "train_reps": 1,
    "saves": 2,
    "dcp_saves": 1,
    "dcp_async_runs": 1,
    "loads": 1,
    "reshard_runs": 1,
    "dcp_async_kind": "THREAD",  # in the training loop: no second checkpoint process to start
}
S3_LINK = ShaperSettings.from_mb(latency_ms=1.0, per_conn_mbps=10.0, total_mbps=100.0)
MB = 1e6


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TRIES = 3  # a free port can be taken by another process before rank 0 binds it


def launch(phase: str, world: int, cfg: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Run ``phase`` on ``world`` ranks; their results. A rank that fails stops the others (they
    would wait for it for torch's 30-minute rendezvous timeout); a rendezvous port taken
    meanwhile (EADDRINUSE) is retried on another port."""
    cfg_path = out / f"cfg-{phase}.json"
    cfg_path.write_text(json.dumps(cfg))
    for attempt in range(1, PORT_TRIES + 1):
        codes, errors = run_ranks(phase, world, cfg_path, out, free_port())
        if not any(codes):
            return [
                json.loads((Path(cfg["out"]) / f"{phase}-{r}.json").read_text())
                for r in range(world)
            ]
        taken = "EADDRINUSE" in errors[0]
        if not (taken and attempt < PORT_TRIES):
            why = "its rendezvous port was taken each time" if taken else "see the output above"
            raise RuntimeError(f"phase {phase}: rank exit codes {codes} ({why})")
        log(f"  phase {phase}: the rendezvous port was taken meanwhile; again on another port")
    raise AssertionError("unreachable")


def run_ranks(
    phase: str, world: int, cfg_path: Path, out: Path, port: int
) -> tuple[list[int | None], list[str]]:
    """The ranks' exit codes (None: stopped because another failed) and their stderr, which is
    also copied to ours."""
    procs, logs = [], []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world)),
        }
        logs.append(out / f"{phase}-{rank}.stderr")
        with open(logs[-1], "wb") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), "--phase", phase, "--cfg", str(cfg_path)],
                    env=env,
                    stderr=err,
                )
            )
    try:
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            time.sleep(0.2)
    finally:
        codes: list[int | None] = [p.poll() for p in procs]
        for p in procs:  # a rank failed (or we were interrupted): the rest wait for it forever
            if p.poll() is None:
                p.kill()
            p.wait()
        errors = [path.read_text(errors="replace") for path in logs]
        for text in errors:
            sys.stderr.write(text)
        sys.stderr.flush()
    return codes, errors


def drop_caches() -> None:
    if os.environ.get(KEEP_CACHES_ENV) == "1":  # --smoke: warm, and the machine's cache kept
        return
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)


def dd_floors(work: Path, nbytes: int) -> dict[str, float]:
    """The same number of bytes written sequentially with fsync, and read back cold."""
    src, dst = work / "floor-src.bin", work / "floor-dst.bin"
    with open(src, "wb") as f:
        left = nbytes
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n
    writes, reads = [], []
    for _ in range(2):
        subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)  # source cached
        t = time.perf_counter()
        subprocess.run(
            ["dd", f"if={src}", f"of={dst}", "bs=8M", "conv=fsync", "status=none"], check=True
        )
        writes.append(time.perf_counter() - t)
        drop_caches()
        t = time.perf_counter()
        subprocess.run(["dd", f"if={dst}", "of=/dev/null", "bs=8M", "status=none"], check=True)
        reads.append(time.perf_counter() - t)
    src.unlink()
    dst.unlink()
    return {"write": min(writes), "read": min(reads), "write_runs": writes, "read_runs": reads}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="bench-results")
    ap.add_argument("--quick", action="store_true")
    add_smoke_flag(ap)
    args = ap.parse_args()
    smoke_implies_quick(args)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("BOOTSEER_BENCH_CACHE", Path.home() / ".cache" / "bootseer-bench"))
    work = cache / "ckpt-run"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.time()
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    cfg = {**sizes, "dir": str(work), "out": str(work / "out")}
    r: dict[str, Any] = {
        "suite": "ckpt",
        "quick": bool(args.quick),
        "smoke": args.smoke,
        "command": command_line("bench_ckpt.py"),
        "config": cfg,
        "machine": {"cpus": os.cpu_count()},
    }
    saves = cfg.get("saves", 10)
    try:
        log(
            f"phase local (2 ranks): {saves} bootseer saves, DCP save, DCP async_save x2 kinds, loads"
        )
        local = launch("local", 2, cfg, work)
        total = sum(x["state_bytes_rank"] for x in local)
        r["state_bytes"] = total
        log(
            f"  state: {total / MB:.0f} MB in all, {local[0]['state_bytes_rank'] / MB:.0f} MB per rank"
        )
        log("phase reshard (4 ranks load the 2-rank checkpoints)")
        reshard = launch("reshard", 4, cfg, work)
        log("floors: dd write+fsync and cold read of the same bytes")
        floors = dd_floors(work, total)
        log("phase train (2 ranks): loops without saves, with bootseer, DCP async_save, DCP save")
        train = launch("train", 2, cfg, work)
        log(f"phase s3 (2 ranks) through the shaper ({S3_LINK.describe()})")
        with (
            MotoS3Server(in_process=False) as server,
            ShaperProcess("127.0.0.1", server.port, S3_LINK) as shaper,
        ):
            server.create_bucket("ckpt-bench")
            s3cfg = {
                **cfg,
                "bucket": "ckpt-bench",
                "s3": server.storage_options(endpoint_url=f"http://{shaper.address}"),
            }
            s3 = launch("s3", 2, s3cfg, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    worst = lambda rows, key: [max(x[key][i] for x in rows) for i in range(len(rows[0][key]))]  # noqa: E731
    steady = lambda xs: xs[1:] if len(xs) > 1 else xs  # noqa: E731
    stall = med(steady(worst(local, "ours_stall")))
    floor_copy = med(steady(worst(local, "copy_floor_runs")))
    dcp_async = {}
    for kind in ("thread", "process"):
        n = len(local[0][f"dcp_async_{kind}"])
        runs = [max(x[f"dcp_async_{kind}"][i]["return"] for x in local) for i in range(n)]
        safe = [max(x[f"dcp_async_{kind}"][i]["safe"] for x in local) for i in range(n)]
        durable = [max(x[f"dcp_async_{kind}"][i]["durable"] for x in local) for i in range(n)]
        dcp_async[kind] = {
            "return": med(steady(runs)),
            "safe": med(steady(safe)),
            "durable": med(steady(durable)),
        }
    best_kind = min(dcp_async, key=lambda k: dcp_async[k]["safe"])
    durable_ours = med(steady(worst(local, "ours_durable")))
    dcp_save = min(local[0]["dcp_save"])
    load_ours, load_dcp = med(local[0]["ours_load"]), med(local[0]["dcp_load"])
    floor_read = med(local[0]["floor_read_runs"])
    t = train[0]
    saves = t["saves_per_loop"]
    base = med(t["train_none"])
    over = {m: (med(t[f"train_{m}"]) - base) / saves for m in ("ours", "dcp_async", "dcp_save")}
    rss_max = max(x["rss_after_10_saves"]["VmRSS"] for x in local)
    rss_limit = 1.2 * total / 2**20 + 300
    s3_bytes = sum(x["s3_bytes_rank"] for x in s3)
    s3r = {k: s3[0][k] for k in ("s3_ours_save", "s3_ours_load", "s3_dcp_save", "s3_dcp_load")}
    r.update(floors=floors, dcp_async=dcp_async, local=local, reshard=reshard, train=train, s3=s3)

    def row(metric, ours, peer, limit, ok):
        return (
            metric,
            ours,
            peer,
            limit,
            "PASS" if ok is True else "FAIL" if ok is False else "info",
        )

    rows = [
        row(
            "stall until safe to mutate (per save)",
            f"{stall:.3f} s",
            f"DCP async_save ({best_kind}) {dcp_async[best_kind]['safe']:.3f} s",
            f"<= 1.3x copy floor {floor_copy:.3f} s (got {stall / floor_copy:.2f}x)",
            stall <= 1.3 * floor_copy,
        ),
        row(
            "stall until save returns",
            f"{stall:.3f} s",
            f"DCP async_save ({best_kind}) {dcp_async[best_kind]['return']:.3f} s",
            "info (bootseer returns when staging is done)",
            None,
        ),
        row(
            "training-loop overhead per save",
            f"{over['ours']:.2f} s",
            f"DCP async_save {over['dcp_async']:.2f} s; DCP save {over['dcp_save']:.2f} s",
            f"<= 0.5x DCP async_save (got {over['ours'] / max(over['dcp_async'], 1e-9):.2f}x)",
            over["ours"] <= 0.5 * over["dcp_async"],
        ),
        row(
            "save until durable, local disk",
            f"{durable_ours:.2f} s",
            f"DCP save {dcp_save:.2f} s",
            f"<= 1.25x dd floor {floors['write']:.2f} s (got {durable_ours / floors['write']:.2f}x); >= 1.5x faster than DCP (got {dcp_save / durable_ours:.2f}x)",
            durable_ours <= 1.25 * floors["write"] and dcp_save >= 1.5 * durable_ours,
        ),
        row(
            "load, page cache dropped",
            f"{load_ours:.2f} s",
            f"DCP load {load_dcp:.2f} s",
            f"<= 1.25x floor {floor_read:.2f} s (got {load_ours / floor_read:.2f}x); >= 1.5x faster than DCP (got {load_dcp / load_ours:.2f}x)",
            load_ours <= 1.25 * floor_read and load_dcp >= 1.5 * load_ours,
        ),
        row(
            "resharded load 2 -> 4 ranks",
            f"{med(reshard[0]['ours_reshard_load']):.2f} s",
            f"DCP {med(reshard[0]['dcp_reshard_load']):.2f} s",
            "info",
            None,
        ),
        row(
            f"S3 behind shaper: save ({s3_bytes / MB:.0f} MB)",
            f"{s3r['s3_ours_save']:.1f} s",
            f"DCP FsspecWriter/s3fs {s3r['s3_dcp_save']:.1f} s",
            f">= 5x faster (got {s3r['s3_dcp_save'] / s3r['s3_ours_save']:.1f}x)",
            s3r["s3_dcp_save"] >= 5 * s3r["s3_ours_save"],
        ),
        row(
            f"S3 behind shaper: load ({s3_bytes / MB:.0f} MB)",
            f"{s3r['s3_ours_load']:.1f} s",
            f"DCP FsspecReader/s3fs {s3r['s3_dcp_load']:.1f} s",
            f">= 5x faster (got {s3r['s3_dcp_load'] / s3r['s3_ours_load']:.1f}x)",
            s3r["s3_dcp_load"] >= 5 * s3r["s3_ours_load"],
        ),
        row(
            f"RSS of a rank after {saves} saves",
            f"{rss_max:.0f} MiB",
            f"state {local[0]['state_bytes_rank'] / 2**20:.0f} MiB per rank, {total / 2**20:.0f} MiB in all",
            f"<= 1.2x state + 300 MiB = {rss_limit:.0f} MiB",
            rss_max <= rss_limit,
        ),
    ]
    head = ("metric", "bootseer", "peer", "floor / target", "result")
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(5)]
    lines = [
        "| " + " | ".join(str(c).ljust(w) for c, w in zip(x, widths, strict=True)) + " |"
        for x in [head, *rows]
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    md = "\n".join(
        [
            f"# ckpt benchmark{' (quick, smoke)' if args.smoke else ' (quick)' if args.quick else ''}",
            "",
            f"- command: `{r['command']}` ({time.time() - started:.0f} s)",
            f"- state: {total / MB:.0f} MB over 2 ranks (FSDP-style halves of a {cfg['layers'] * 2}-layer d={cfg['d']} transformer + AdamW); training step {t['step_s']:.2f} s",
            f"- stall and copy floor: medians of saves 2-{saves}, each floor copy measured right before its save on both ranks",
            f"- training loop: {cfg['train_steps']} steps, a save every {cfg['save_every']}, methods interleaved x{cfg.get('train_reps', 3)}; loop medians: "
            + ", ".join(
                f"{m} {med(t[f'train_{m}']):.1f} s"
                for m in ("none", "ours", "dcp_async", "dcp_save")
            ),
            "- DCP async_save: DefaultStager (shared memory, cached, async staging); kinds: "
            + ", ".join(
                f"{k}: return {v['return']:.3f} s / safe {v['safe']:.3f} s / durable {v['durable']:.2f} s"
                for k, v in dcp_async.items()
            ),
            f"- write floor: dd of the same byte count with fsync, runs {[round(x, 2) for x in floors['write_runs']]} s (best taken)",
            f"- read floor: `cat` of this checkpoint's data files (the same bytes), sequential, page cache dropped, next to each load: runs {[round(x, 2) for x in local[0]['floor_read_runs']]} s; "
            f"dd of a fresh file of the same size: {[round(x, 2) for x in floors['read_runs']]} s (for reference)",
            f"- loads ({len(local[0]['ours_load'])} interleaved run(s), page cache dropped before each): bootseer {[round(x, 2) for x in local[0]['ours_load']]} s, DCP {[round(x, 2) for x in local[0]['dcp_load']]} s",
            f"- S3 link: {S3_LINK.describe()}",
            *(["- --smoke: the page cache is kept (every load and read is warm)"] * args.smoke),
            "",
            *lines,
            "",
        ]
    )
    print(md)
    (results / "ckpt.md").write_text(md)
    (results / "ckpt.json").write_text(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    with sigterm_as_interrupt():  # SIGTERM (``bootseer bench`` stopping it) runs the clean-up
        sys.exit(main())
