"""Crash classification on the real output of real failures: each process below is driven
into its failure here and its own exit code and last lines are classified (the gloo error of
a killed peer: test_robust_stacks.py, on its real gloo job). CUDA, Xid and
NCCL lines (no GPU here) are quoted from real logs, each with its source."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import boto3
import pytest
from conftest import require_component
from robust_helpers import run_scenario, tiny_disk  # noqa: F401 - a fixture

from bootseer.robust.classify import (
    CLASSES,
    RULES,
    Rule,
    classify,
    memory_cgroup,
    oom_kills,
    tail_lines,
)


def test_a_python_exception_names_its_type():
    code, lines = run_scenario("exception")
    got = classify(code, lines)
    assert (got.failure_class, got.detail["exception"], got.exit_code) == (
        "python_exception",
        "KeyError",
        1,
    )
    assert got.lines == ("KeyError: 'missing-key'",)


def test_sigkill_is_killed_by_signal():
    code, lines = run_scenario("sigkill")
    got = classify(code, lines)
    assert (got.failure_class, got.signal, got.rule) == ("killed_by_signal", "SIGKILL", "signal")
    assert classify(128 + 9, lines).signal == "SIGKILL"  # the supervisor's form, same class


def test_memory_error_under_rlimit_as_is_cpu_oom():
    code, lines = run_scenario("memory-error", 400)
    got = classify(code, lines)
    assert (got.failure_class, got.rule, got.detail["exception"]) == (
        "cpu_oom",
        "python_memory_error",
        "MemoryError",
    )


@pytest.fixture
def child_memory_cgroup():
    """A memory cgroup of 64 MiB below this process's own (v1 or v2), removed afterwards."""
    parent = memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        require_component("no writable memory cgroup")
    path = Path(tempfile.mkdtemp(prefix="bootseer-test-oom-", dir=parent))
    try:
        limit = str(64 * 2**20)
        v2 = (path / "memory.max").exists()
        (path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(limit)
        swap = path / ("memory.swap.max" if v2 else "memory.memsw.limit_in_bytes")
        if swap.exists():
            swap.write_text("0" if v2 else limit)
    except OSError as exc:
        path.rmdir()
        require_component(f"cannot limit a memory cgroup: {exc}")
    try:
        yield path
    finally:
        if path.name.startswith("bootseer-test-oom-") and path.parent == Path(parent):
            path.rmdir()  # its only process is gone: an empty cgroup is removed by rmdir


def test_kernel_oom_kill_in_a_cgroup_is_cpu_oom(child_memory_cgroup):
    procs = str(child_memory_cgroup / "cgroup.procs")
    before = oom_kills(child_memory_cgroup)

    def enter() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    code, lines = run_scenario("allocate", 300, preexec_fn=enter)
    assert code == -9
    killed = oom_kills(child_memory_cgroup) > before
    assert killed
    got = classify(code, lines, oom_killed=killed)
    assert (got.failure_class, got.rule, got.signal) == ("cpu_oom", "cgroup_oom_kill", "SIGKILL")
    assert classify(code, lines).failure_class == "killed_by_signal"  # without the count


def test_enospc_on_a_full_tmpfs_is_disk_full(tiny_disk):  # noqa: F811 - the fixture
    code, lines = run_scenario("write", tiny_disk / "shard-0.bin", 1)
    got = classify(code, lines)
    assert (got.failure_class, got.detail["exception"]) == ("disk_full", "OSError")
    assert "[Errno 28] No space left on device" in got.lines[0]


def test_botocore_against_a_stopped_moto_server_is_storage_error(s3_server_factory):
    server = s3_server_factory()
    boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="ckpt-store-down")
    server.stop()
    code, lines = run_scenario("s3-put", server.endpoint_url, "ckpt-store-down")
    got = classify(code, lines)
    assert (got.failure_class, got.detail["exception"]) == (
        "storage_error",
        "botocore.exceptions.EndpointConnectionError",
    )


def test_a_syntax_error_is_a_user_error(tmp_path):
    train = tmp_path / "train.py"
    train.write_text("for step in range(10)\n    pass\n")
    proc = subprocess.run([sys.executable, str(train)], capture_output=True, text=True)
    log = tmp_path / "rank0.log"
    log.write_text("a long log\n" * 5000 + proc.stderr)
    got = classify(proc.returncode, tail_lines(log, 50))
    assert (got.failure_class, got.detail["exception"]) == ("user_error", "SyntaxError")


def test_a_missing_module_is_a_user_error():
    proc = subprocess.run(
        [sys.executable, "-c", "import bootseer_no_such_module"], capture_output=True, text=True
    )
    got = classify(proc.returncode, proc.stderr.splitlines())
    assert (got.failure_class, got.detail["exception"]) == ("user_error", "ModuleNotFoundError")


# Quoted from public logs (no GPU here): GitHub issue threads, as written there.
QUOTED = {
    # pytorch/pytorch#16417 (comment of 2024-03-13): torch's CUDA caching allocator
    "gpu_oom": [
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 "
        "has a total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch "
        "memory, this process has 23.60 GiB memory in use."
    ],
    # NVIDIA/TensorRT#3491 and hpcaitech/Open-Sora#694: an asynchronous CUDA fault
    "cuda_error": [
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
    ],
    # zai-org/CogVLM2#178: NCCL through torch.distributed
    "nccl_error": [
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:1691, unhandled system error (run with NCCL_DEBUG=INFO for "
        "details), NCCL version 2.19.3"
    ],
    # XPixelGroup/BasicSR#737: the NCCL watchdog, with torch's [rankN]: prefix
    "nccl_timeout": [
        "[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, "
        "NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds "
        "before timing out."
    ],
    # NVIDIA/NVSentinel#155: the kernel log line of Xid 79 (a node check reads dmesg)
    "xid": ["NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"],
}


@pytest.mark.parametrize(
    ("quoted", "cls", "detail"),
    [
        ("gpu_oom", "gpu_oom", {"exception": "torch.cuda.OutOfMemoryError"}),
        ("cuda_error", "cuda_error", {"exception": "RuntimeError"}),
        ("nccl_error", "nccl_error", {"exception": "torch.distributed.DistBackendError"}),
        ("nccl_timeout", "nccl_error", {}),
        ("xid", "cuda_error", {"xid": 79}),
    ],
)
def test_quoted_gpu_lines(quoted, cls, detail):
    got = classify(
        1,
        ["Traceback (most recent call last):", '  File "train.py", line 9', *QUOTED[quoted]]
        if detail.get("exception")
        else QUOTED[quoted],
    )
    assert (got.failure_class, got.detail) == (cls, detail)


def test_the_table_is_ordered_data_and_ends_in_unknown():
    assert {r.failure_class for r in RULES} == set(CLASSES)
    assert RULES[-1].failure_class == "unknown" and RULES[-1].pattern is None
    assert classify(None, ["nothing known"]).failure_class == "unknown"
    # a clean exit is no failure, whatever its log says (a caught OOM, a retried S3 error)
    clean = classify(0, QUOTED["gpu_oom"])
    assert (clean.failure_class, clean.rule) == ("unknown", "fallback")
    # first match wins: an OOM inside an NCCL call is an OOM, not a network fault
    got = classify(1, ["ProcessGroupNCCL.cpp:1000 ...", *QUOTED["gpu_oom"]])
    assert got.failure_class == "gpu_oom"


def test_a_rule_with_a_bad_exit_condition_is_named():
    bad = (Rule("mine", "unknown", exit="nonzero"),)
    with pytest.raises(
        ValueError,
        match="rule mine: exit must be signal, sigkill, error, always or None, not 'nonzero'",
    ):
        classify(1, [], rules=bad)


def test_under_torchrun_the_ranks_exception_wins_over_its_mates_gloo_error(tmp_path):
    """torchrun ends with its own ChildFailedError traceback, and rank 0, waiting inside
    all_reduce, fails with gloo's "Connection closed by peer" once rank 1 raised: the class
    and the exception are rank 1's (the gloo error is its consequence), whichever rank
    torchrun observed first, and the rank comes from torchrun's summary."""
    from robust_helpers import scenario_argv, scenario_env

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "2",
            *scenario_argv("rank-fault", "exception", tmp_path)[1:],
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=scenario_env(),
    )
    lines = (done.stdout + done.stderr).splitlines()
    assert any("ChildFailedError" in line for line in lines)  # the launcher's own traceback
    assert any(line.startswith("[rank0]:") and "gloo" in line for line in lines)  # the mate's
    got = classify(done.returncode, lines)
    assert (got.failure_class, got.detail["exception"], got.detail["rank"]) == (
        "python_exception",
        "ValueError",
        1,
    )
    assert got.lines == ("ValueError: injected on rank 1",)


def test_gloos_abort_on_a_mismatched_collective_is_a_code_fault(tmp_path):
    """Rank 1 all_reduces 8 floats, rank 0 4: gloo aborts rank 0 (torchrun: exitcode -6)
    with its enforce message ("... third_party/gloo/... Received data size doesn't match
    expected size. Is there a distributed collective mismatch in your code?"), rank 1 fails
    with the reset. Before, the gloo rule read it as gloo_error (a peer's death); it is
    collective_mismatch, a code fault."""
    from robust_helpers import scenario_argv, scenario_env

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "1",
            *scenario_argv("rank-fault", "mismatch", tmp_path)[1:],
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=scenario_env(),
    )
    lines = (done.stdout + done.stderr).splitlines()
    got = classify(done.returncode, lines)
    assert (got.failure_class, got.rule, got.signal) == (
        "collective_mismatch",
        "collective_mismatch",
        "SIGABRT",
    )
    assert "third_party/gloo" in got.lines[0] and "collective mismatch" in got.lines[0]


# torchrun's summary when it observed rank 0's gloo error first while rank 1 had been killed
# (the order it gives when both are dead at its look: seen with rank-fault sigkill and
# --monitor-interval 5). Assembled from one such run's lines, cut short.
_GLOO_FIRST = """\
[rank0]: Traceback (most recent call last):
[rank0]:     work.wait()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] \
Connection closed by peer [127.0.0.1]:25985. This is typically caused by a remote worker crashing.
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
[1]:
  time      : 2026-11-24_05:09:41
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 31723)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 31723
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_05:09:41
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 31722)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_killed_rank_wins_over_the_gloo_error_torchrun_saw_first():
    got = classify(1, _GLOO_FIRST.splitlines())
    assert (got.failure_class, got.signal, got.detail["rank"], got.detail["secondary"]) == (
        "killed_by_signal",
        "SIGKILL",
        1,
        "gloo_error",
    )
