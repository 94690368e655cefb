"""Stack aggregation on real dumps: four real processes in a real gloo group, three blocked
inside all_reduce and one asleep before it, dumped with py-spy (JSON and text) and with the
client's SIGUSR1 faulthandler files; the sleeper and its parallel group are named. Then the
sleeper is killed and its peers' real gloo error is classified (one job, to keep the test
time small)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from robust_helpers import GUARD, scenario_argv, scenario_env

from bootseer.robust.classify import classify, tail_lines
from bootseer.robust.remote import dump_ranks, native_dump
from bootseer.robust.stacks import (
    ProcessStacks,
    is_native_frame,
    localize,
    normalize_frame,
    parse_dump,
    pyspy_dump,
    read_stack_files,
)
from bootseer.testing.servers import free_port

WORLD, LATE = 4, 3
NODES = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
LAYOUT = {"dp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]}


PLACES = (
    "all_reduce (torch/distributed/distributed_c10d.py)",
    "sleep_before_all_reduce (robust_helpers.py)",
)


def wait_in_place(pids: dict[int, int], deadline: float) -> None:
    """Until every rank's main thread is inside all_reduce or the sleep (a rank between
    its ready file and there would be dumped elsewhere)."""
    while True:
        tops = [pyspy_dump(pid, rank=r).threads[0][0] for r, pid in pids.items()]
        if all(top in PLACES for top in tops):
            return
        assert time.monotonic() < deadline, f"ranks never settled: {tops}"
        time.sleep(0.1)


def settled_stack_files(trace: Path, deadline: float) -> list[ProcessStacks]:
    """The client's files once all ranks wrote theirs and they stopped changing."""
    last = None
    while True:
        found = read_stack_files(trace)
        if len(found) == WORLD and found == last:
            return found
        assert time.monotonic() < deadline, f"stack files never settled: {len(found)}"
        last = found
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stuck_job(tmp_path_factory):
    """{rank: pid} of a 4-rank gloo job where rank 3 sleeps before its second all_reduce;
    the trace directory gets the client's stack files."""
    root = tmp_path_factory.mktemp("stuck")
    ready, trace, control = root / "ready", root / "trace", root / "control"
    for d in (ready, trace, control):
        d.mkdir()
    port = free_port()
    logs = [open(root / f"rank{rank}.log", "wb") for rank in range(WORLD)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            scenario_argv("gloo-one-late", rank, WORLD, port, LATE, ready),
            env=scenario_env(
                {
                    "BOOTSEER_CONTROL_DIR": str(control),
                    "BOOTSEER_TRACE_DIR": str(trace),
                    "BOOTSEER_NODE": NODES[rank],
                    "RANK": str(rank),
                }
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for rank, log in enumerate(logs)
    ]
    try:
        deadline = time.monotonic() + GUARD
        while len(list(ready.iterdir())) < WORLD:
            assert time.monotonic() < deadline, "the gloo job never reached its second step"
            assert all(p.poll() is None for p in procs), "a rank of the gloo job died"
            time.sleep(0.1)
        wait_in_place({rank: p.pid for rank, p in enumerate(procs)}, deadline)
        yield {rank: p.pid for rank, p in enumerate(procs)}, trace, procs, root
    finally:
        for p, log in zip(procs, logs, strict=True):
            p.kill()
            p.wait()
            log.close()


def test_pyspy_json_dumps_name_the_stuck_rank_and_its_group(stuck_job):
    pids = stuck_job[0]
    dumps = [pyspy_dump(pid, rank=rank, node=NODES[rank]) for rank, pid in pids.items()]
    found = localize(dumps, LAYOUT)
    assert found.suspects == (LATE,) and found.suspect_nodes == ("node-b",)
    assert (found.domain, found.domain_ranks, found.domain_nodes) == ("dp[1]", (2, 3), ("node-b",))
    healthy, stuck = found.groups
    assert healthy.ranks == (0, 1, 2) and stuck.ranks == (3,)
    assert healthy.signature[0][0] == PLACES[0]
    assert stuck.signature[0][0] == PLACES[1]
    assert found.evidence["groups"][1]["ranks"] == [3]


def test_pyspy_text_and_faulthandler_files_agree(stuck_job):
    pids, trace = stuck_job[:2]
    py_spy = Path(sys.executable).parent / "py-spy"
    texts = {
        rank: subprocess.run(
            [str(py_spy), "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            check=True,
            timeout=GUARD,
        ).stdout
        for rank, pid in pids.items()
    }
    from_text = [ProcessStacks.from_text(t, rank=r, node=NODES[r]) for r, t in texts.items()]
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)  # the client's faulthandler dump
    from_files = settled_stack_files(trace, time.monotonic() + GUARD)
    assert sorted((p.rank, p.node, p.pid) for p in from_files) == sorted(
        (r, NODES[r], pid) for r, pid in pids.items()
    )
    for found in (localize(from_text, LAYOUT), localize(from_files, LAYOUT)):
        assert (found.suspects, found.domain, found.domain_ranks) == ((LATE,), "dp[1]", (2, 3))
    # the same place gives the same signature whichever tool dumped it
    by_rank = {p.rank: p.signature for p in from_files}
    assert all(by_rank[p.rank] == p.signature for p in from_text)


def test_native_dumps_name_the_same_rank_and_show_where_in_compiled_code(stuck_job):
    """The agents' second dump of an incident: every rank's tree at once, with py-spy's native
    frames. The signature is the Python one (the same groups as without them); the evidence
    shows where each group waits inside compiled code."""
    pids = stuck_job[0]
    answered, failed = dump_ranks(pids, node="node-x", dump=native_dump)
    assert failed == []
    native = [
        ProcessStacks.from_text(
            p["text"], rank=p["rank"], node=NODES[p["rank"]], pid=p["pid"], role=p["role"]
        )
        for p in answered
    ]
    python_only = [pyspy_dump(pid, rank=rank, node=NODES[rank]) for rank, pid in pids.items()]
    by_rank = {p.rank: p.signature for p in python_only}
    assert all(p.signature == by_rank[p.rank] for p in native if p.role == "main")
    found = localize(native, LAYOUT)
    assert (found.suspects, found.domain, found.domain_ranks) == ((LATE,), "dp[1]", (2, 3))
    healthy, stuck = found.evidence["groups"][:2]
    frames = {
        g["ranks"][0]: [f for t in g["native"]["stacks"] for f in t] for g in (healthy, stuck)
    }
    assert any(f.startswith("c10d::") for f in frames[healthy["ranks"][0]]), frames
    assert any(is_native_frame(f) and "sleep" in f for f in frames[LATE]), frames[LATE]
    assert all(len(f) < 400 for fs in frames.values() for f in fs)  # C++ symbols shortened


def test_killing_the_stuck_rank_gives_its_peers_a_gloo_error(stuck_job):
    """Last in this module: the sleeper is killed; its peers' real error is classified."""
    _, _, procs, root = stuck_job
    procs[LATE].kill()
    for rank, p in enumerate(procs):
        code = p.wait(timeout=GUARD)
        if rank == LATE:
            continue
        got = classify(code, tail_lines(root / f"rank{rank}.log"))
        assert (got.failure_class, got.rule, got.detail["exception"]) == (
            "gloo_error",
            "gloo",
            "RuntimeError",
        ), got
        assert "third_party/gloo/" in got.lines[0]


def stacks(rank, *frames, role="main", node=None):
    return ProcessStacks(rank, (tuple(frames),), node=node, role=role)


def test_no_common_group_evicts_the_smallest_union_and_ties_give_no_verdict():
    wait, odd = "wait (c10d.py)", "load (data.py)"
    procs = [stacks(r, odd if r in (1, 6) else wait) for r in range(8)]
    layout = {"dp": [[0, 1, 2, 3], [4, 5, 6, 7]], "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    found = localize(procs, layout)
    assert (found.suspects, found.domain, found.domain_ranks) == ((1, 6), "tp[0,3]", (0, 1, 6, 7))
    tie = localize([stacks(0, wait), stacks(1, odd)], {"dp": [[0, 1]]})
    assert tie.suspects == () and tie.domain is None
    assert "no dominant stack group among main" in tie.reason


def test_ranks_started_ahead_or_afresh_have_one_signature():
    """The soak's false eviction: a replacement node's ranks start from a fresh torchrun, the
    survivors' from the interpreter `bootseer run --preload` started ahead (runpy and
    bootseer/prestart.py below torchrun's frames); in one all_reduce they are one group."""
    job = (
        "all_reduce (torch/distributed/distributed_c10d.py)",
        "train (robust_job.py)",
        "<module> (torch/distributed/run.py)",
    )
    afresh = (*job, "_run_code (<frozen runpy>)", "_run_module_as_main (<frozen runpy>)")
    ahead = (
        *job,
        "_run_code (<frozen runpy>)",
        "_run_module_code (<frozen runpy>)",
        "run_module (<frozen runpy>)",
        "main (bootseer/prestart.py)",
        "<module> (bootseer/prestart.py)",
        "_run_code (<frozen runpy>)",
        "_run_module_as_main (<frozen runpy>)",
    )
    procs = [stacks(r, *(afresh if r >= 6 else ahead), node=f"n{r // 2}") for r in range(8)]
    assert len({p.signature for p in procs}) == 1
    found = localize(procs, {"dp": [list(range(8))]})
    assert found.suspects == ()
    stuck = [
        *procs[:7],
        stacks(7, "hang_before_all_reduce (robust_job.py)", *afresh[1:], node="n3"),
    ]
    assert localize(stuck, {"dp": [list(range(8))]}).suspects == (7,)


def test_roles_are_compared_among_themselves():
    """Eight idle dataloader workers must not make the four trainers look like outliers."""
    trainers = [stacks(r, "all_reduce (c10d.py)") for r in range(4)]
    workers = [stacks(r, "get (queues.py)", role="worker") for r in range(4) for _ in (0, 1)]
    stuck_worker = stacks(2, "read (shard.py)", role="worker")
    found = localize([*trainers, *workers, stuck_worker], {"dp": [[0, 1], [2, 3]]})
    assert (found.suspects, found.domain) == ((2,), "dp[1]")


def test_native_frames_are_evidence_not_signature():
    """Two healthy ranks waiting at different instructions inside gloo are one group."""
    text = (
        'Thread 11 (idle): "MainThread"\n'
        "    0x7f7f4e21de62 (libgomp.so.1)\n"
        "    gloo::transport::tcp::UnboundBuffer::waitRecv(int*, std::chrono::duration<long,"
        " std::ratio<1l, 1000l> >) (libtorch_cpu.so)\n"
        "    all_reduce (torch/distributed/distributed_c10d.py:2950)\n"
        "    train (job.py:12)\n"
        'Thread 12 (idle): "omp"\n'
        "    {} (libgomp.so.1)\n"
    )
    a = ProcessStacks.from_text(text.format("gomp_barrier_wait"), rank=0)
    b = ProcessStacks.from_text(
        text.replace("waitRecv", "waitSend").format("gomp_team_start"), rank=1
    )
    assert (
        a.signature
        == b.signature
        == (("all_reduce (torch/distributed/distributed_c10d.py)", "train (job.py)"),)
    )
    assert a.threads[0][1] == "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)"
    assert a.threads[0][0] == "? (libgomp.so.1)" and is_native_frame(a.threads[0][0])
    assert not is_native_frame("<module> (<string>)")
    found = localize([a, b], {"dp": [[0, 1]]})
    assert found.suspects == () and found.evidence["groups"][0]["native"]["rank"] == 0


def test_normalization_drops_lines_addresses_and_install_paths():
    a = normalize_frame(
        "_exception_logger.<locals>.wrapper",
        "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py",
    )
    b = normalize_frame(
        "wrapper", "/opt/conda/lib/python3.10/site-packages/torch/distributed/c10d_logger.py"
    )
    assert a == b == "wrapper (torch/distributed/c10d_logger.py)"
    dump = (
        "Thread 0x00007f84a65c16c0 (most recent call first):\n"
        '  File "/srv/job/train.py", line 4 in step\n\n'
        "Current thread 0x00007f84a71fbb80 (most recent call first):\n"
        '  File "/srv/job/train.py", line 7 in main\n'
        "Thread 0x00007f84a65c16c0 (most recent call first):\n"  # a second SIGUSR1
        '  File "/srv/job/train.py", line 5 in save\n'
    )
    assert parse_dump(dump) == [("save (train.py)",)]


def test_a_failed_pyspy_dump_names_the_pid_and_rank():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    with pytest.raises(RuntimeError, match=f"py-spy dump of pid {gone.pid} \\(rank 7\\) failed"):
        pyspy_dump(gone.pid, rank=7)
