"""SIGKILL of ranks during a checkpoint save, at random points: never a torn checkpoint.

Two ranks save (ckpt uses no collectives, so no process group is needed); one or both are
killed with SIGKILL after a random delay within a typical save's duration. Afterwards
``latest()`` is the previous committed step or the new one, its content is bit-exact
with what was saved for that step, and it verifies. Rank processes are forked fresh for
every trial by a fork server that has imported torch once (``ckpt_workers.py fork-server``),
which keeps 30 trials within CI time on 2 cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ckpt_workers as W
import pytest
import torch

from ckpt import CheckpointManager, CheckpointSaveError, FlatShard, PerRank

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("CKPT_KILL_SEED", "20240917"))
LOCAL_TRIALS, S3_TRIALS = 24, 6  # with SIGKILLs, after CALIBRATION whole saves
CALIBRATION = 2
KEEP = 3


class ForkServer:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(W.__file__)), "fork-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=Path(W.__file__).resolve().parent.parent,
        )
        if self._line() != "READY":
            raise RuntimeError(f"fork server did not start:\n{self.log()}")

    def _line(self) -> str:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"fork server exited:\n{self.log()}")
        return line.strip()

    def _send(self, message: str) -> None:
        self.proc.stdin.write(message + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def run(self, cfg: dict[str, Any], kills: dict[int, float]) -> tuple[list[int], float]:
        """Fork the ranks, SIGKILL rank r ``kills[r]`` seconds later; their exit codes."""
        self._send(json.dumps(cfg))
        pids = json.loads(self._line())["pids"]
        started = time.monotonic()
        for at, rank in sorted((at, rank) for rank, at in kills.items()):
            time.sleep(max(0.0, started + at - time.monotonic()))
            os.kill(pids[rank], signal.SIGKILL)  # not reaped yet: the pid is still this child
        self._send("reap")
        done = json.loads(self._line())
        return done["codes"], done["elapsed"]

    def close(self) -> None:
        try:
            self._send(json.dumps({"op": "exit"}))
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory: pytest.TempPathFactory):
    server = ForkServer(tmp_path_factory.mktemp("kill-logs") / "fork-server.log")
    try:
        yield server
    finally:
        server.close()


def blank(expected: dict[str, Any]) -> dict[str, Any]:
    """A state shaped like ``expected`` holding other values, to load into."""
    model = {}
    for k, t in expected["model"].items():
        model[k] = (
            torch.full_like(t, float("nan"))
            if t.is_floating_point()
            else torch.full_like(t, True if t.dtype == torch.bool else -1)
        )
    return {"model": model, "meta": {"step": -1, "tag": ""}, "rng": PerRank(None)}


def check_content(mgr: CheckpointManager, step: int, seed: int, mb: float) -> None:
    expected = W.kill_expected(seed, mb)
    state = blank(expected)
    assert mgr.load(state, step=step) == step
    for key, want in expected["model"].items():
        got = state["model"][key]
        assert W.bit_equal(got, want), f"step {step}: model/{key}: {W.describe_mismatch(got, want)}"
    assert state["meta"] == expected["meta"], f"step {step}: objects {state['meta']}"
    got_rng, want_rng = state["rng"].value, expected["rng"]
    assert got_rng["seed"] == want_rng["seed"] and got_rng["rank"] == 0
    assert torch.equal(got_rng["rng"], want_rng["rng"])
    report = mgr.verify(step)
    assert report.ok, f"step {step} fails verification: {report.problems}"


def run_trials(
    server: ForkServer,
    url: str,
    options: dict[str, Any] | None,
    *,
    trials: int,
    mb: float,
    label: str,
    rng: random.Random,
) -> dict[str, int]:
    """Step 1 and CALIBRATION more steps saved whole (their durations set the kill window),
    then ``trials`` saves with SIGKILLs, each followed by the checks."""
    reader = CheckpointManager(url, storage_options=options, stripe_size=W.STRIPE)
    base = {
        "url": url,
        "storage_options": options,
        "stripe": W.STRIPE,
        "mb": mb,
        "keep": KEEP,
        "world": W.KILL_WORLD,
    }
    seeds: dict[int, int] = {}
    durations = []
    for step in range(1, 2 + CALIBRATION):  # trials 0..CALIBRATION-1 kill nobody
        seeds[step] = rng.randrange(1 << 30)
        codes, elapsed = server.run(
            {**base, "step": step, "seed": seeds[step], "commit_timeout_s": 60}, {}
        )
        assert codes == [0, 0], f"[{label}] save of step {step} failed ({codes}):\n{server.log()}"
        assert reader.latest() == step
        check_content(reader, step, seeds[step], mb)
        durations.append(elapsed)
    typical = sorted(durations)[len(durations) // 2]
    commit_timeout = max(1.5, 2.0 * typical)
    print(
        f"[{label}] whole saves took {', '.join(f'{d:.2f}' for d in durations)} s; kill "
        f"delays in [0, {typical:.2f}] s; commit timeout {commit_timeout:.1f} s"
    )

    outcomes = {"committed": 0, "not committed": 0, "killed": 0}
    for trial in range(CALIBRATION, CALIBRATION + trials):
        step = trial + 2
        seeds[step] = rng.randrange(1 << 30)
        victims = rng.choice([[0], [1], [0, 1]])
        # uniform over the save, or (one trial in three) over its late part: index files,
        # the commit and retention are short and would rarely be hit otherwise
        low = rng.choice([0.0, 0.0, 0.6])
        kills = {r: typical * rng.uniform(low, 1.0) for r in victims}
        previous = reader.latest()
        started = time.monotonic()
        codes, elapsed = server.run(
            {**base, "step": step, "seed": seeds[step], "commit_timeout_s": commit_timeout}, kills
        )
        latest = reader.latest()
        print(
            f"[{label}] trial {trial:2d} step {step:2d}: SIGKILL "
            + ", ".join(f"rank {r} at {d * 1000:4.0f} ms" for r, d in sorted(kills.items()))
            + f" -> exit codes {codes}, latest {latest} (ranks ran {elapsed:.2f} s, trial "
            f"{time.monotonic() - started:.2f} s)"
        )
        context = f"[{label}] step {step}, codes {codes}, latest {latest}\n{server.log()}"
        assert codes[0] in (0, 3, -signal.SIGKILL), context
        assert codes[1] in (0, -signal.SIGKILL), context
        assert latest in (previous, step), context
        if codes[0] == 0:  # rank 0 returned from wait(): it committed
            assert latest == step, context
        if codes[0] == 3:  # rank 0's commit timed out: rank 1 died before its index
            assert latest == previous and codes[1] == -signal.SIGKILL, context
        outcomes["killed"] += -signal.SIGKILL in codes
        outcomes["committed" if latest == step else "not committed"] += 1
        check_content(reader, latest, seeds[latest], mb)  # bit-exact, verified

    # Every checkpoint still listed (retention keeps KEEP) is intact.
    listed = [info.step for info in reader.list()]
    assert listed and listed[-1] == reader.latest()
    for step in listed:
        check_content(reader, step, seeds[step], mb)
    print(f"[{label}] {outcomes}; committed steps kept: {listed}")
    return outcomes


def test_sigkill_during_save_local(fork_server: ForkServer, tmp_path: Path) -> None:
    outcomes = run_trials(
        fork_server,
        str(tmp_path / "ckpt"),
        None,
        trials=LOCAL_TRIALS,
        mb=10,
        label="local",
        rng=random.Random(SEED),
    )
    # kills landed mid-save (how many depends on the machine's speed: 4 of 24 under load in a
    # full run, a third on a quiet one); every trial's content is checked above either way
    assert outcomes["killed"] >= 3, outcomes
    assert outcomes["not committed"] > 0, outcomes


def test_sigkill_during_save_s3(fork_server: ForkServer, s3_server_factory) -> None:
    """moto in a process of its own, not a thread of this one: the ranks' saves and this
    process's loads and verifications then no longer share one interpreter lock (this test,
    2026-12-03, 2 cores: 36.7 and 38.3 s in a thread, 32.9 and 35.8 s in a process, runs
    interleaved at load 3.3 to 3.5). Its bucket goes with it."""
    server = s3_server_factory(in_process=False)
    bucket = server.create_bucket("bootseer-kill-s3")
    outcomes = run_trials(
        fork_server,
        f"s3://{bucket}/ckpt",
        {"s3": server.storage_options()},
        trials=S3_TRIALS,
        mb=2,
        label="s3",
        rng=random.Random(SEED + 1),
    )
    assert outcomes["killed"] > 0, outcomes


def test_resaving_a_killed_step_does_not_commit_its_stale_shards(tmp_path: Path) -> None:
    """Attempt A of step 2: rank 1's shard became durable, rank 0 was killed before the
    commit. The job restarts from step 1 and saves step 2 again; rank 0 gets there first.
    Rank 1 has written nothing of attempt B, so step 2 must not be committed yet."""
    root = str(tmp_path / "ckpt")

    def state(rank: int, value: float) -> dict[str, Any]:
        return {"p": FlatShard(torch.full((4,), value), 4 * rank, 8)}

    first = [
        CheckpointManager(root, rank=r, world_size=2, commit_timeout_s=1.0, attempt="A")
        for r in range(2)
    ]
    for r in (1, 0):
        first[r].save(1, state(r, 1.0))
        first[r].wait()
    first[1].save(2, state(1, 20.0))  # attempt A: rank 0 never commits it (killed)
    first[1].wait()
    for mgr in first:
        mgr.close()
    # the job restarts: a new attempt id, as a launcher gives every rank of the new run
    ranks = [
        CheckpointManager(root, rank=r, world_size=2, commit_timeout_s=1.0, attempt="B")
        for r in range(2)
    ]
    assert ranks[0].latest() == 1
    ranks[0].save(2, state(0, 21.0))  # attempt B, rank 0 alone so far
    try:
        ranks[0].wait()
    except CheckpointSaveError:
        pass  # the commit timed out waiting for rank 1: what should happen
    finally:
        for mgr in ranks:
            mgr.close()
    reader = CheckpointManager(root)
    latest = reader.latest()
    loaded = {"p": torch.zeros(8)}
    reader.load(loaded, step=latest)
    assert latest == 1, f"step 2 committed without rank 1's new shard: {loaded['p'].tolist()}"
    # rank 1 of attempt B arrives: its stale index is replaced and step 2 commits whole
    ranks = [
        CheckpointManager(root, rank=r, world_size=2, commit_timeout_s=10.0, attempt="B")
        for r in range(2)
    ]
    ranks[0].save(2, state(0, 21.0))
    ranks[1].save(2, state(1, 22.0), block=True)
    ranks[0].wait()
    reader.load(loaded)
    assert reader.latest() == 2 and loaded["p"].tolist() == [21.0] * 4 + [22.0] * 4
