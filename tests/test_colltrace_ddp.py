"""DDP under the tracer: its gradient all_reduces are in the ring, the trained parameters are
bit-identical to an untraced run, and a script's own communication hook still runs, whether
registered before the first forward or after it (a built-in one as torch's Python hook).

Each case is a real job: 3 gloo ranks forked on loopback (a world that is not a power of two,
where dividing instead of multiplying by 1/3 would change the last bits), a small model, 3 SGD
steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bootseer.colltrace.ring import read_rings

_JOB = r"""
import os, sys, torch, torch.distributed as dist
import bootseer.colltrace as colltrace
root = sys.argv[1]

def counting_hook(state, bucket):  # the script's own: an all_reduce of the mean, counted
    state["calls"] += 1
    t = bucket.buffer().mul_(1.0 / dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

def rank_main(rank, out, mode):
    if mode != "off":
        colltrace.enable(os.path.join(out, "rings"))
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank,
                            world_size=3)  # a file store: no port to race for
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = {"calls": 0}
    if mode == "hook-first":
        ddp.register_comm_hook(state, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.001)
    data = torch.Generator().manual_seed(rank + 1)
    for step in range(3):
        opt.zero_grad()
        ddp(torch.randn(16, 64, generator=data)).pow(2).sum().backward()
        opt.step()
        if step == 0 and mode == "hook-late":
            ddp.register_comm_hook(state, counting_hook)
        if step == 0 and mode == "builtin-late":
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    if rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "calls": state["calls"]}, os.path.join(out, "rank0.pt"))
    dist.destroy_process_group()

for mode in sys.argv[2:]:  # torch imported once, forked per job
    out = os.path.join(root, mode)
    os.makedirs(out)
    pids = []
    for rank in range(3):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank, out, mode)
            except BaseException as exc:
                print(f"{mode} rank {rank}: {type(exc).__name__}: {exc}", flush=True)
                code = 1
            os._exit(code)
        pids.append(pid)
    if max(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids):
        sys.exit(1)
"""
MODES = ("off", "traced", "hook-first", "hook-late", "builtin-late")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every mode's job, one after the other in one process (torch imported once)."""
    root = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(
        [sys.executable, "-c", _JOB, str(root), *MODES],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return root


def _result(jobs: Path, mode: str) -> tuple[dict, Path]:
    return torch.load(jobs / mode / "rank0.pt"), jobs / mode / "rings"


@pytest.fixture(scope="module")
def untraced(jobs: Path) -> dict:
    return _result(jobs, "off")[0]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_ddp_gradients_are_recorded_and_training_is_bit_identical(
    jobs: Path, untraced: dict
) -> None:
    traced, rings = _result(jobs, "traced")
    assert _equal(traced["params"], untraced["params"])  # 1/3 multiplied, as DDP does it
    snaps = read_rings(rings)
    assert [s.rank for s in snaps] == [0, 1, 2]
    params = 64 * 64 + 64 + 64 * 8 + 8
    for snap in snaps:
        grads = [o for o in snap.ops if o.op == "all_reduce" and o.dtype == "float32"]
        # every step's buckets together hold every parameter's gradient once
        assert sum(o.numel for o in grads) == 3 * params, [(o.seq, o.numel) for o in grads]
        assert all(o.t_done is not None and o.t_done >= o.t_issue and not o.failed for o in grads)
    # every rank issued the same sequence in the same group
    assert (
        len(
            {tuple((o.group, o.seq, o.numel) for o in s.ops if o.op == "all_reduce") for s in snaps}
        )
        == 1
    )


@pytest.mark.parametrize("mode", ["hook-first", "hook-late"])
def test_a_scripts_own_hook_still_runs(jobs: Path, untraced: dict, mode: str) -> None:
    """First: the tracer leaves the module alone (the hook's dist.all_reduce is recorded
    anyway). Late (after the first forward, when the tracer's hook is in place): DDP would
    refuse a second hook; the tracer's runs the script's from then on."""
    traced, rings = _result(jobs, mode)
    steps_with_hook = 3 if mode == "hook-first" else 2
    assert traced["calls"] >= steps_with_hook  # a bucket or more in each of those steps
    assert _equal(traced["params"], untraced["params"])  # the hook computes the same mean
    params = 64 * 64 + 64 + 64 * 8 + 8
    for snap in read_rings(rings):
        grads = [o for o in snap.ops if o.op == "all_reduce" and o.dtype == "float32"]
        assert sum(o.numel for o in grads) == 3 * params


def test_a_builtin_hook_registered_late_runs_as_torchs_python_equivalent(jobs: Path) -> None:
    """FP16_COMPRESS after the first forward: from the second step the gradients go out as
    float16 (torch's fp16_compress_hook), every bucket of it recorded."""
    _, rings = _result(jobs, "builtin-late")
    params = 64 * 64 + 64 + 64 * 8 + 8
    for snap in read_rings(rings):
        grads = [o for o in snap.ops if o.op == "all_reduce"]
        assert sum(o.numel for o in grads if o.dtype == "float32") == params  # step 1
        assert sum(o.numel for o in grads if o.dtype == "float16") == 2 * params  # steps 2, 3
