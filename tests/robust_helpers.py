"""Real processes driven into real failures, for the robust-training tests.

As a script: ``python robust_helpers.py SCENARIO ARGS...``; imported: :func:`run_scenario`
(runs one, returns its exit code and its output lines) and :func:`scenario_argv`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HELPERS = str(Path(__file__).resolve())
ROOT = str(Path(__file__).resolve().parent.parent)
GUARD = 120  # seconds: only a guard against a scenario that never ends


def scenario_argv(scenario: str, *args: object) -> list[str]:
    return [sys.executable, HELPERS, scenario, *map(str, args)]


def scenario_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    if "BOOTSEER_JOB_SECRET" in os.environ:  # conftest's: the store's records are sealed
        env["BOOTSEER_JOB_SECRET"] = os.environ["BOOTSEER_JOB_SECRET"]
    env.update(extra or {})
    return env


def run_scenario(
    scenario: str, *args: object, env: dict[str, str] | None = None, preexec_fn=None
) -> tuple[int, list[str]]:
    """(return code as Popen gives it, stdout+stderr lines)."""
    proc = subprocess.run(
        scenario_argv(scenario, *args),
        env=scenario_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=GUARD,
        preexec_fn=preexec_fn,
    )
    return proc.returncode, proc.stdout.splitlines()


def run_solo(
    store,
    tmp_path: Path,
    argv: list[str],
    link,
    *,
    restarts: int = 0,
    hang_s: float = 0.0,
    dump_wait_s: float = 5.0,
    agent_hang_s: float | None = None,
    **controller: object,
):
    """One node's ``bootseer run`` machinery (agent, ``link``, supervisor) in this process
    with the controller (``controller`` its options) on a thread, writing ``ctl.jsonl`` and
    ``trace/`` under ``tmp_path``: the agent's side of an incident. Returns (code, sup)."""
    import datetime
    import threading

    from torch.distributed import TCPStore

    from bootseer.robust.agent import Agent
    from bootseer.robust.controller import Controller
    from bootseer.robust.detect import HangDetector
    from bootseer.supervise import HangPolicy, RestartPolicy, Supervisor
    from bootseer.trace import TraceWriter

    ctl_store = TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    ctl = Controller(
        ctl_store,
        trace_path=tmp_path / "ctl.jsonl",
        **{"settle_s": 0.2, "log": lambda _: None, **controller},
    )
    stop = threading.Event()
    watcher = threading.Thread(target=ctl.run, args=(stop, 0.1), daemon=True)
    watcher.start()
    trace = TraceWriter(tmp_path / "trace", link.node)
    agent = Agent(
        trace,
        link.node,
        **({"hang": HangDetector(agent_hang_s)} if agent_hang_s is not None else {}),
    )
    sup = Supervisor(
        argv,
        env=scenario_env(),
        trace=trace,
        restart=RestartPolicy(restarts, backoff_s=0.1),
        hang=HangPolicy(hang_s, dump_wait_s),
        agent=agent,
        remote=link,
        remote_wait_s=20,
    )
    try:
        code = sup.run()
    finally:
        stop.set()
        watcher.join(10)
    return code, sup


@pytest.fixture
def tiny_disk():
    """A 256 KiB tmpfs mounted on a private directory, unmounted and removed afterwards."""
    from conftest import require_component

    path = Path(tempfile.mkdtemp(prefix="bootseer-test-enospc-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        path.rmdir()
        require_component(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
        if path.name.startswith("bootseer-test-enospc-"):
            path.rmdir()


# -- the scenarios (the child side) ------------------------------------------------------------


def exception() -> None:
    print("step 1")
    {}["missing-key"]


def sigkill() -> None:
    print("step 1", flush=True)
    os.kill(os.getpid(), 9)


def memory_error(limit_mb: str) -> None:
    import resource

    limit = int(limit_mb) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    blocks = [bytearray(2**20) for _ in range(int(limit_mb) * 2)]
    print(len(blocks))


def allocate(mb: str) -> None:
    data = bytearray(int(mb) * 2**20)
    for i in range(0, len(data), 4096):  # touch every page: the cgroup charges them
        data[i] = 1
    print(len(data))


def write(path: str, mb: str) -> None:
    with open(path, "wb") as f:
        for _ in range(int(mb)):
            f.write(os.urandom(2**20))
        f.flush()
        os.fsync(f.fileno())


def s3_put(endpoint: str, bucket: str) -> None:
    import boto3
    from botocore.config import Config

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(
            retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2, read_timeout=2
        ),
    )
    s3.put_object(Bucket=bucket, Key="ckpt/step-10/shard-0", Body=b"x" * 1024)


def gloo_one_late(rank: str, world: str, port: str, late: str, ready_dir: str) -> None:
    """Every rank loops over all_reduce; rank ``late`` sleeps before its second one, so the
    others block inside all_reduce. Each writes ``ready_dir/<rank>`` once it is in place."""
    import torch
    import torch.distributed as dist

    import bootseer.client  # noqa: F401 - under BOOTSEER_CONTROL_DIR: the SIGUSR1 dump

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world)
    )
    t = torch.ones(4)
    dist.all_reduce(t)
    Path(ready_dir, rank).write_text(str(os.getpid()))
    if rank == late:
        sleep_before_all_reduce()
    dist.all_reduce(t)


def sleep_before_all_reduce() -> None:
    time.sleep(GUARD)


def heartbeats(steps: str, step_s: str, nan_at: str) -> None:
    """A training loop that reports through bootseer.heartbeat (loss NaN at ``nan_at``)."""
    import bootseer

    for step in range(int(steps)):
        time.sleep(float(step_s))
        loss = float("nan") if step == int(nan_at) else 2.0 / (step + 1)
        if step == 0:
            bootseer.ready()
        bootseer.heartbeat(step, loss=loss, grad_norm=1.0)


def crash_hang_finish(counter: str) -> None:
    """Under ``bootseer run``: attempt 0 crashes, attempt 1 hangs, attempt 2 finishes."""
    import bootseer

    path = Path(counter)
    attempt = int(path.read_text()) if path.exists() else 0
    path.write_text(str(attempt + 1))
    bootseer.ready()
    bootseer.heartbeat(1, loss=1.0)
    time.sleep(0.2)
    if attempt == 0:
        sys.exit(3)
    if attempt == 1:
        sleep_before_all_reduce()


def _count(path: str) -> int:
    """How many times this ran before (a file counter across attempts)."""
    p = Path(path)
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    return n


def sigkill_once(counter: str) -> None:
    if _count(counter) == 0:
        print("step 1", flush=True)
        os.kill(os.getpid(), 9)


def steps_then_raise(counter: str, steps: str) -> None:
    """Reaches ``steps`` heartbeats on every attempt, then fails with a RuntimeError."""
    import bootseer

    _count(counter)
    bootseer.ready()
    bootseer.heartbeat(int(steps), loss=1.0)
    time.sleep(0.3)  # the wrapper polls every 0.25 s: it sees the step
    raise RuntimeError("the same failure at the same step")


def nan_once(counter: str, nan_at: str) -> None:
    """Attempt 0: heartbeats, a NaN loss at ``nan_at``, then it would go on forever; the
    next attempt finishes."""
    import bootseer

    first = _count(counter) == 0
    bootseer.ready()
    for step in range(int(nan_at) + 1):
        nan = first and step == int(nan_at)
        bootseer.heartbeat(step, loss=float("nan") if nan else 1.0)
    if first:
        sleep_before_all_reduce()


def nan_then_checkpoint(ckpt_dir: str, out: str, nan_at: str, steps: str) -> None:
    """A job that checkpoints every step after its heartbeat (blocking), and whose first
    attempt's weights become NaN at ``nan_at`` and are saved before the agent's kill lands:
    the poisoned checkpoint the soak's NaN loop resumed from. Each attempt appends
    ``{"attempt", "resumed", "finite"}`` to ``out`` (finite: the loaded weights)."""
    import json

    import torch

    import bootseer
    from ckpt import CheckpointManager, CheckpointNotFound

    attempt = int(os.environ.get("BOOTSEER_ATTEMPT", "0"))
    weights = torch.zeros(4)
    mgr = CheckpointManager(ckpt_dir)
    state = {"w": weights, "step": -1}
    try:
        start = mgr.load(state) + 1
    except CheckpointNotFound:
        start = 0
    with open(out, "a") as f:
        f.write(
            json.dumps(
                {
                    "attempt": attempt,
                    "resumed": start,
                    "finite": bool(torch.isfinite(weights).all()),
                }
            )
            + "\n"
        )
    bootseer.ready()
    for step in range(start, int(steps)):
        weights += 1.0
        if attempt == 0 and step == int(nan_at):
            weights.fill_(float("nan"))  # the optimizer step that took the NaN gradient
        bootseer.heartbeat(step, loss=float(weights.sum()))
        mgr.save(step, {"w": weights, "step": step}, block=True)
        if attempt == 0 and step >= int(nan_at):
            time.sleep(0.3)  # later steps, saved too, until the kill lands
    mgr.close()


def spike(steps: str, at: str) -> None:
    """Loss 1.0, then 10.0 at step ``at`` (a 10x jump); every beat written (no rate limit)
    and held long enough for the wrapper's 0.25 s poll to see each."""
    import bootseer
    import bootseer.client

    bootseer.client.HEARTBEAT_INTERVAL_S = 0.0
    bootseer.ready()
    for step in range(int(steps)):
        bootseer.heartbeat(step, loss=10.0 if step == int(at) else 1.0)
        time.sleep(0.35)


def output(n: str) -> None:
    """``n`` numbered lines on stdout, a partial line, then a ValueError (stderr)."""
    for i in range(int(n)):
        sys.stdout.write(f"line {i}\n")
    sys.stdout.write("no newline at the end")
    sys.stdout.flush()
    raise ValueError("the last words")


def steady_then_stall(steps: str, step_s: str) -> None:
    """``steps`` heartbeats ``step_s`` apart (every one written), then silence."""
    import bootseer
    import bootseer.client

    bootseer.client.HEARTBEAT_INTERVAL_S = 0.0
    bootseer.ready()
    for step in range(int(steps)):
        bootseer.heartbeat(step, loss=1.0)
        time.sleep(float(step_s))
    sleep_before_all_reduce()


def supervise_learned(trace_dir: str, steps: str, step_s: str) -> None:
    """A Supervisor whose agent learns the hang threshold (k=2, floor 0.5 s: the defaults'
    30 s floor is too long for a test) over ``steady-then-stall``; exits with its code."""
    from bootseer.robust.agent import Agent
    from bootseer.robust.detect import HangDetector
    from bootseer.supervise import HangPolicy, RestartPolicy, Supervisor
    from bootseer.trace import TraceWriter

    trace = TraceWriter(trace_dir, "learnnode")
    agent = Agent(trace, "learnnode", hang=HangDetector(None, k=2.0, floor_s=0.5))
    sup = Supervisor(
        scenario_argv("steady-then-stall", steps, step_s),
        trace=trace,
        restart=RestartPolicy(0),
        hang=HangPolicy(0.0, dump_wait_s=2.0),
        agent=agent,
    )
    sys.exit(sup.run())


def rank_fault(fault: str, out: str) -> None:
    """A rank under torchrun (gloo): an all_reduce, a heartbeat, then rank 1 fails with
    ``fault`` (``sigkill``: kills itself; ``exception``: raises ValueError; ``linger``:
    raises ValueError while a leftover non-daemon thread keeps its process alive;
    ``mismatch``: all_reduces 8 elements where the others reduce 4, and gloo aborts a rank)
    while the others wait inside their next all_reduce. Each rank writes
    ``out/pid-<rank>``."""
    import threading

    import torch
    import torch.distributed as dist

    import bootseer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    bootseer.ready()
    bootseer.heartbeat(0, loss=1.0)
    Path(out, f"pid-{rank}").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(0.5)  # the others are inside their all_reduce
        if fault == "sigkill":
            os.kill(os.getpid(), 9)
        if fault == "linger":
            threading.Thread(target=time.sleep, args=(GUARD,), name="leftover").start()
        if fault == "mismatch":
            dist.all_reduce(torch.ones(8))
            time.sleep(GUARD)
        raise ValueError(f"injected on rank {rank}")
    dist.all_reduce(t)
    time.sleep(GUARD)


if __name__ == "__main__":
    globals()[sys.argv[1].replace("-", "_")](*sys.argv[2:])
