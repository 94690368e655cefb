"""A small gloo job for the controller tests (modelled on ``cluster_job.py``, without
checkpoints): one rank per node under torchrun inside ``bootseer run``, a gradient all-reduced
per step, heartbeats through ``bootseer.heartbeat``.

Faults, injected in the first attempt only (``BOOTSEER_ATTEMPT`` 0):

* ``--hang-rank R --hang-when FILE``: once FILE exists, rank R stops before its all_reduce
  (in :func:`hang_before_all_reduce`, the frame a dump must name) while the others wait
  inside theirs;
* ``--crash-rank R --crash-at S``: rank R raises ``ValueError`` at step S (``--linger``:
  while a leftover non-daemon thread keeps its process, and its gloo connections, alive, so
  the other ranks wait inside their all_reduce instead of failing);
* ``--slow-rank R --slow-s X [--slow-after-s T]``: rank R spends X more seconds in each step
  before its all_reduce (in :func:`slow_step`) while the others wait inside theirs (a
  fail-slow rank), from T seconds after its first step on (a slowdown, against the job's
  own step time until then);
* ``--nan-rank R --nan-at S``: rank R reports a NaN loss at step S;
* ``--mismatch-rank R --mismatch-at S``: rank R all_reduces 16 elements at step S where the
  others reduce 8 (a code fault: gloo aborts a rank on it).

Writes ``--out``/``running-R`` after its third step and ``done-R-A.json`` at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import bootseer


def hang_before_all_reduce() -> None:
    while True:
        time.sleep(0.2)


def slow_step(seconds: float) -> None:
    time.sleep(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-when", default="")
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--linger", action="store_true")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--slow-after-s", type=float, default=0.0)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--mismatch-rank", type=int, default=-1)
    parser.add_argument("--mismatch-at", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    first = os.environ.get("BOOTSEER_ATTEMPT", "0") == "0"
    out = Path(args.out)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    weights = torch.zeros(8)
    step = 0
    started = time.monotonic()
    while step < args.steps or (args.hang_when and first):
        grad = torch.full((8,), float(rank + step))
        if first and rank == args.crash_rank and step == args.crash_at:
            if args.linger:
                threading.Thread(target=time.sleep, args=(600,), name="leftover").start()
            raise ValueError(f"injected fault on rank {rank} at step {step}")
        if first and rank == args.hang_rank and os.path.exists(args.hang_when):
            hang_before_all_reduce()
        if first and rank == args.slow_rank and time.monotonic() - started >= args.slow_after_s:
            slow_step(args.slow_s)
        if first and rank == args.mismatch_rank and step == args.mismatch_at:
            grad = torch.ones(16)  # the others reduce 8
        dist.all_reduce(grad)
        weights -= 0.01 * grad[:8]
        if step == 0:
            bootseer.ready()
        nan = first and rank == args.nan_rank and step == args.nan_at
        bootseer.heartbeat(step, loss=float("nan") if nan else float(weights.sum()))
        if step == 2:
            (out / f"running-{rank}").write_text(str(os.getpid()))
        time.sleep(args.step_time)
        step += 1
    bootseer.finishing(step)
    (out / f"done-{rank}-{os.environ.get('BOOTSEER_ATTEMPT')}.json").write_text(
        json.dumps({"steps": step, "weights": weights.tolist()})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
