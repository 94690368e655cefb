"""Ranks whose agents counted restarts differently still save one attempt together.

torchelastic's restart count (and ``bootseer run``'s attempt) is each node's own: a node that
replaced a lost one starts again at 0 while the survivors are at 1. Found on the cluster
fixture: the ranks wrote different attempts and rank 0's commit waited for an index that never
came (the job hung at its first save after the replacement)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bootseer.testing.servers import free_port

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from ckpt import CheckpointManager

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mgr = CheckpointManager(sys.argv[1], rank=rank, world_size=world, commit_timeout_s=20)
state = {"w": torch.arange(8, dtype=torch.float32) + rank}
mgr.save(1, state, block=True)
dist.barrier()
out = {"attempt": mgr.attempt, "latest": mgr.latest()}
mgr.close()
dist.destroy_process_group()
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""


def _run_job(tmp: Path, ckpt: str, restart_counts: list[str], name: str) -> list[dict]:
    # Not beside the store: the script's folder leads sys.path, and a folder there named
    # ``ckpt`` (the store) would shadow the package as a namespace package.
    (tmp / "bin").mkdir(exist_ok=True)
    script = tmp / "bin" / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs, outs = [], []
    for rank, count in enumerate(restart_counts):
        out = tmp / f"{name}-{rank}.json"
        outs.append(out)
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(len(restart_counts)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "job",
            "TORCHELASTIC_RESTART_COUNT": count,
        }
        env.pop("BOOTSEER_ATTEMPT", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), ckpt, str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    return [json.loads(p.read_text()) for p in outs]


def test_ranks_with_different_restart_counts_save_and_commit_one_attempt(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = _run_job(tmp_path, ckpt, ["1", "0"], "replaced")  # rank 1's node is new
    assert first[0]["attempt"] == first[1]["attempt"]
    assert first[0]["attempt"].startswith("job:1:")  # rank 0's id, made unique to this run
    assert first[0]["latest"] == first[1]["latest"] == 1
    # rank 0's node replaced in turn: its count starts again, yet the id is not the first run's
    second = _run_job(tmp_path, ckpt, ["0", "0"], "again")
    assert second[0]["attempt"] == second[1]["attempt"] != first[0]["attempt"]
    assert second[0]["latest"] == 1


def test_an_attempt_given_by_the_caller_is_used_as_it_is(tmp_path: Path) -> None:
    from ckpt import CheckpointManager

    mgr = CheckpointManager(str(tmp_path / "c"), attempt="mine")
    mgr.save(1, {"x": 1}, block=True)
    assert mgr.attempt == "mine"
    mgr.close()
