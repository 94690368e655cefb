"""A rank's death seen directly (``bootseer.robust.ranks``): the agent watches the ranks'
pids from their status records (``bootseer.client``) and publishes the crash the moment a
rank dies, with the class the rank itself left, not when torchrun exits after tearing the
other workers down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from robust_helpers import scenario_argv
from run_helpers import run_wrapper, wrapper_env

from bootseer.robust.agent import Agent
from bootseer.robust.classify import classify
from bootseer.robust.events import Event, read_records
from bootseer.robust.ranks import RankWatch, zombie_status


def _torchrun(fault: str, out: Path, *launch: str) -> list[str]:
    # torchrun looks at its workers every 5 s: the agent must not wait for it
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "5",
        *launch,
        *scenario_argv("rank-fault", fault, out)[1:],
    ]


def _one_crash(trace: Path) -> Event:
    """The trace's only event (a crash seen at the rank's death, not refined)."""
    got, _ = read_records([trace])
    events = [r for r in got if isinstance(r, Event)]
    assert len(events) == 1, events
    return events[0]


def test_a_rank_killed_under_torchrun_is_seen_before_torchrun_ends(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace,
        "--max-restarts",
        "0",
        "--min-free-disk",
        "0",
        "--min-free-memory",
        "0",
        command=_torchrun("sigkill", tmp_path),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    event = _one_crash(trace)
    # the rank's own death, with its wait status read from /proc while it was a zombie
    assert (event.failure_class, event.rank, event.evidence["signal"]) == (
        "killed_by_signal",
        1,
        "SIGKILL",
    )
    assert event.evidence["detected_by"] == "rank_signal"
    assert event.evidence["pid"] == int((tmp_path / "pid-1").read_text())
    said = [line for line in proc.stderr.splitlines() if line.startswith("bootseer: ")]
    crash = next(i for i, line in enumerate(said) if line.startswith("bootseer: crash: rank 1"))
    exited = next(i for i, line in enumerate(said) if "command exited with" in line)
    assert crash < exited, said  # published while torchrun still ran
    # torchrun's own account names it too (its exitcode -9), and refines a provisional one
    lines = (proc.stdout + proc.stderr).splitlines()
    assert any("exitcode  : -9" in line for line in lines)
    summary = classify(1, lines)
    assert (summary.failure_class, summary.signal, summary.detail["rank"]) == (
        "killed_by_signal",
        "SIGKILL",
        1,
    )
    agent = Agent(None, "n0", log=lambda _: None)
    agent.start_attempt(0)
    vanished = Event(
        "crash",
        "killed_by_signal",
        node="n0",
        rank=1,
        time=123.0,
        evidence={"provisional": True, "detected_by": "rank_vanished"},
    )
    better = agent.refine(vanished, 1, lines)
    assert better is not None and (better.failure_class, better.rank, better.time) == (
        "killed_by_signal",
        1,
        123.0,
    )  # the detection time stays the first
    assert better.evidence["signal"] == "SIGKILL" and better.evidence["refines"]
    assert agent.refine(event, 1, lines) is None  # the rank's own status was enough


def test_a_mismatched_collective_stops_instead_of_a_restart_in_place(tmp_path: Path) -> None:
    """Rank 1 all_reduces 8 floats where rank 0 reduces 4: gloo aborts rank 0 (SIGABRT, no
    Python record), having said why ("Is there a distributed collective mismatch in your
    code?"). Seen at the death: killed_by_signal; before, that was the class, and the agent
    restarted the command in place (the code repeats the fault on every restart). Now the
    lines refine it to collective_mismatch, and the verdict stops the job, restarts left
    or not."""
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace,
        "--max-restarts",
        "2",
        "--backoff",
        "0.1",
        "--min-free-disk",
        "0",
        "--min-free-memory",
        "0",
        command=_torchrun("mismatch", tmp_path),
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    records, _ = read_records([trace])
    events = [r for r in records if isinstance(r, Event)]
    verdicts = [r for r in records if not isinstance(r, Event)]
    assert events[0].failure_class == "killed_by_signal"  # at the death: SIGABRT
    assert events[0].evidence["signal"] == "SIGABRT"
    refined = [e for e in events if e.failure_class == "collective_mismatch"]
    assert refined and refined[0].evidence["refines"] == "killed_by_signal"
    assert refined[0].time == events[0].time  # detected at the death
    assert any("collective mismatch" in line for line in refined[0].evidence["matched"])
    assert [(v.action, v.failure_class) for v in verdicts] == [("stop", "collective_mismatch")]
    assert "restart 1/2" not in proc.stderr  # one attempt: no blind restart


def test_a_forked_ranks_exception_is_seen_at_its_death_with_its_type(tmp_path: Path) -> None:
    """torchrun ``--run-path --start-method fork`` (the ranks start from the launcher's
    imported torch, seconds sooner): the rank's exception ends it through multiprocessing,
    which runs neither ``sys.excepthook`` nor ``atexit``; its status record still names the
    exception, so the crash is classed at the rank's death, not from torchrun's summary."""
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace,
        "--max-restarts",
        "0",
        "--min-free-disk",
        "0",
        "--min-free-memory",
        "0",
        command=_torchrun("exception", tmp_path, "--run-path", "--start-method", "fork"),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    event = _one_crash(trace)
    assert (event.failure_class, event.rank, event.evidence["exception"]) == (
        "python_exception",
        1,
        "ValueError",
    )
    assert event.evidence["detected_by"] == "rank_exception"
    assert event.evidence["lines"][-1] == "ValueError: injected on rank 1"
    assert event.evidence["pid"] == int((tmp_path / "pid-1").read_text())
    said = [line for line in proc.stderr.splitlines() if line.startswith("bootseer: ")]
    crash = next(i for i, line in enumerate(said) if line.startswith("bootseer: crash: rank 1"))
    exited = next(i for i, line in enumerate(said) if "command exited with" in line)
    assert crash < exited, said  # published while torchrun still ran


_RANK = """
import sys, threading, time
import bootseer
bootseer.heartbeat(3)
mode = sys.argv[1]
if mode == "thread":
    t = threading.Thread(target=lambda: {}["gone"], name="loader")
    t.start(); t.join()
    sys.exit(0)
raise ValueError("bad batch")
"""


def test_the_status_record_names_the_exception_or_a_normal_end(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"  # tmp_path holds no directory named like a package
    script.write_text(_RANK)
    env = wrapper_env({"BOOTSEER_CONTROL_DIR": str(tmp_path), "RANK": "3"})
    docs, stderr = {}, {}
    for mode in ("raise", "thread"):
        done = subprocess.run(
            [sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == (1 if mode == "raise" else 0), done.stderr
        docs[mode] = json.loads((tmp_path / "status-3").read_text())
        stderr[mode] = done.stderr
        assert docs[mode]["pid"] > 0 and docs[mode]["rank"] == 3
    raised = docs["raise"]
    assert (raised["state"], raised["exception"], raised["message"]) == (
        "exception",
        "ValueError",
        "bad batch",
    )
    assert raised["lines"][-1] == "ValueError: bad batch"
    assert "ValueError: bad batch" in stderr["raise"]  # the previous hook still printed it
    ended = docs["thread"]
    assert ended["state"] == "exited"  # a thread's exception did not end the process
    assert ended["thread_exception"]["exception"] == "KeyError"
    assert ended["thread_exception"]["thread"] == "loader"


def test_a_watched_rank_that_exits_is_reported_once_with_its_status(tmp_path: Path) -> None:
    """Real processes that are not the watcher's children: exit 5 (a crash), exit 0 after a
    normal end (none), a SIGKILL (a signal); a record of a process outside the root is not
    watched."""
    procs = {}
    for rank, code in ((0, "exit 5"), (1, "exit 0"), (2, "kill -9 $$")):
        procs[rank] = subprocess.Popen(["sh", "-c", f"read x; {code}"], stdin=subprocess.PIPE)
        (tmp_path / f"status-{rank}").write_text(
            json.dumps({"pid": procs[rank].pid, "rank": rank, "state": "running"})
        )
    # a record of a process that is not below the root (an earlier attempt's orphaned rank)
    (tmp_path / "status-9").write_text(json.dumps({"pid": 1, "rank": 9, "state": "exception"}))
    watch = RankWatch(tmp_path, root=os.getpid())
    assert watch.poll() == [] and len(watch.fds()) == 3  # pid 1 is nobody's rank here
    for proc in procs.values():
        proc.stdin.close()  # each one ends; none is reaped yet: zombies
    deadline = time.monotonic() + 30
    while any(zombie_status(p.pid) is None for p in procs.values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert zombie_status(procs[0].pid) == 5 << 8
    ends = {e.rank: e for e in watch.poll()}
    assert sorted(ends) == [0, 2]  # rank 1 ended normally: no crash, and no hang later
    assert watch.ended_normally == [1]
    assert (ends[0].how, ends[0].status) == ("exit", 5)
    assert (ends[2].how, ends[2].status) == ("signal", 9)
    assert watch.poll() == [] and watch.fds() == []  # each once
    for proc in procs.values():
        proc.wait()


_LINGER = """
import os, sys, threading, time
import bootseer
open(sys.argv[1], "w").write(str(os.getpid()))
bootseer.heartbeat(1)
threading.Thread(target=time.sleep, args=(120,), name="leftover").start()
raise ValueError("bad batch")
"""


def test_a_rank_kept_alive_after_its_exception_is_a_crash_and_is_killed_alone(
    tmp_path: Path,
) -> None:
    """A launcher (here a shell) whose rank raised but lives on (a leftover non-daemon
    thread): no exit ever comes; the rank's record is the crash, at once, and ``crash_grace_s``
    later that rank's process alone is killed, so that its launcher sees it end and decides
    (the shell passes the rank's status on; torchrun would restart its workers). The launcher
    itself is never killed for a rank's death: that ended torchrun's own worker restart. The
    rank runs in a session of its own (as torchrun starts its workers)."""
    from robust_helpers import scenario_env

    from bootseer.robust.detect import HangDetector
    from bootseer.supervise import HangPolicy, RestartPolicy, Supervisor
    from bootseer.trace import TraceWriter

    rank = tmp_path / "rank.py"
    rank.write_text(_LINGER)
    trace = TraceWriter(tmp_path / "trace", "solo")
    logs: list[str] = []
    agent = Agent(trace, "solo", hang=HangDetector(60.0), log=logs.append)
    pid_file = tmp_path / "rank.pid"
    sup = Supervisor(
        [
            "sh",
            "-c",
            f'RANK=4 setsid "{sys.executable}" "{rank}" "{pid_file}"; '
            'code=$?; echo "launcher: rank ended $code" >&2; exit $code',
        ],
        env=scenario_env(),
        trace=trace,
        restart=RestartPolicy(0),
        hang=HangPolicy(0.0),
        agent=agent,
        crash_grace_s=1.0,
        log=logs.append,
    )
    code = sup.run()
    assert code == 128 + 9  # the launcher's own exit: its rank was killed with SIGKILL
    assert sup.attempts[0].reason == "exited"
    event = _one_crash(tmp_path / "trace")
    assert (event.failure_class, event.rank, event.evidence["exception"]) == (
        "python_exception",
        4,
        "ValueError",
    )
    assert event.evidence["detected_by"] == "rank_exception"
    assert event.evidence["lines"][-1] == "ValueError: bad batch"
    pid = int(pid_file.read_text())
    assert any(
        f"rank 4 (pid {pid}) raised 1s ago and its process still runs" in line for line in logs
    ), logs
    assert not any("killing it" in line for line in logs), logs
    assert any("verdict: crash python_exception (ValueError) rank 4" in line for line in logs)
    left = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while zombie_status(left) is None and Path(f"/proc/{left}").exists():
        assert time.monotonic() < deadline, f"rank {left} outlived its command"
        time.sleep(0.1)


_FINAL_SAVE = """
import time
import bootseer
for step in range(6):
    bootseer.heartbeat(step)
    time.sleep(0.3)
bootseer.finishing(5)
time.sleep(4)  # the final checkpoint and teardown: longer than the hang threshold
"""


def test_the_final_save_after_finishing_is_not_a_hang(tmp_path: Path) -> None:
    """A job whose teardown outlasts the hang threshold (2.5 s here) ends normally once it
    said ``finishing()``: no hang, no restart."""
    script = tmp_path / "job" / "final_save.py"
    script.parent.mkdir()
    script.write_text(_FINAL_SAVE)
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace,
        "--max-restarts",
        "1",
        "--hang-timeout",
        "2.5",
        "--min-free-disk",
        "0",
        "--min-free-memory",
        "0",
        command=[sys.executable, str(script)],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, _ = read_records([trace])
    assert [r for r in got if isinstance(r, Event)] == []
    assert "hang" not in proc.stderr
