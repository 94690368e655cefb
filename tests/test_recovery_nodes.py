"""Recovery on many nodes, the way each restart authority the docs allow runs it: a rank
killed, a node lost and replaced, and a rank hung, one after the other in one job on the
cluster fixture (2 network-namespace nodes, one rank each, checkpoints to S3 over HTTP).

Both restart authorities of a job without a controller at once: ``bootseer run
--max-restarts 1 -- torchrun --max-restarts 5``, the multi-node restart of ``bootseer bench e2e
--nodes N``. The agent must report each death at once and leave the restart to torchrun,
which restarts its workers and waits in the rendezvous for the replacement node (until
2026-12 the agent killed torchrun 15 s after a rank's death, and the restart failed every
time). A hang is the agent's to see (torchrun sees no hang): it dumps the stacks and kills
the ranks, and torchrun restarts them. When the launcher itself dies (killed with its ranks,
``bootseer run`` kept), ``bootseer run`` restarts it in place and it rejoins the rendezvous.
The controller's restarts and the warm spare are test_robust_faults.py's (one soak job).

Each resume is checked bit for bit: every rank loads the state it saved at the committed
step, and the final state equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bootseer.testing.links import Link

JOB = Path(__file__).resolve().parent / "cluster_job.py"
STEPS = 30
HOLDS = (10, 16, 26)  # a rank killed at the first, the node lost at the second, node0's
# launcher killed at the third (bootseer run restarts it in place)
HANG_AT = 22  # rank 1 stops for good before step 22, once
GRACE_S = 2.0  # --crash-grace: the old code killed torchrun this long after the death


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _wait(
    what: str, ready, procs: dict[str, subprocess.Popen], out: Path, timeout_s: float = 180
) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        ended = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if ended or time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-2500:] for p in out.glob("*.log")}
            raise AssertionError(
                f"no {what} ({'ended: ' + str(ended) if ended else 'timeout'}): {logs}"
            )
        time.sleep(0.2)
    return got


def _records(trace: Path, node: str) -> list[dict[str, Any]]:
    path = trace / f"{node}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reference(steps: int) -> str:
    return subprocess.run(
        [sys.executable, str(JOB), "--reference", "--steps", str(steps)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.timeout(600)
def test_torchrun_restarts_a_killed_rank_a_lost_node_and_a_hung_rank(
    cluster_factory, tmp_path: Path
) -> None:
    c = cluster_factory(2, link=Link(rate="1gbit"), services=("s3", "rendezvous"))
    c.services.create_bucket("ckpt")
    out, trace = tmp_path / "out", tmp_path / "trace"
    out.mkdir()
    trace.mkdir()
    script = [
        str(JOB),
        "--ckpt",
        "s3://ckpt/run",
        "--out",
        str(out),
        "--storage-options",
        json.dumps({"s3": c.services.storage_options()}),
        "--steps",
        str(STEPS),
        "--save-every",
        "3",
        "--hold-at",
        "-1",
        "--holds",
        ",".join(map(str, HOLDS)),
        "--hang-at",
        str(HANG_AT),
        "--hang-rank",
        "1",
    ]

    def launch(node) -> subprocess.Popen:
        argv = [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--node",
            node.name,
            "--max-restarts",
            "1",
            "--backoff",
            "0.5",
            "--hang-timeout",
            "10",
            "--dump-wait",
            "2",
            "--crash-grace",
            str(GRACE_S),
            "--trace-dir",
            str(trace),
            "--state-dir",
            str(out / f"state-{node.name}-{node.generation}"),
            "--min-free-disk",
            "0",
            "--min-free-memory",
            "0",
            "--",
            *node.torchrun(script, nnodes="2:2", max_restarts=5),
        ]
        log = open(out / f"{node.name}.{node.generation}.log", "w")  # noqa: SIM115
        with log:
            return node.popen(argv, stdout=log, stderr=subprocess.STDOUT)

    procs = {n.name: launch(n) for n in c.nodes}
    holding = lambda step: [out / f"holding-{step}-{r}" for r in (0, 1)]  # noqa: E731

    # 1. a rank killed: rank 1's process alone gets SIGKILL; both torchruns restart their
    # workers, which resume from step 8
    _wait("the first hold", lambda: all(p.exists() for p in holding(HOLDS[0])), procs, out)
    os.kill(_read(out / f"holding-{HOLDS[0]}-1")["pid"], signal.SIGKILL)
    killed_at = time.time()

    # 2. node1 lost once the job is back (and past the old code's grace): the survivor's
    # torchrun restarts its worker and waits in the rendezvous; a fresh node1 joins later
    _wait("the second hold", lambda: all(p.exists() for p in holding(HOLDS[1])), procs, out)
    time.sleep(max(0.0, killed_at + GRACE_S + 1 - time.time()))
    lost_at = time.time()  # before the kill: the survivor's rank may die before wait() returns
    c.kill_node(1)
    assert procs["node1"].wait(timeout=10) == -signal.SIGKILL
    _wait(
        "the survivor's worker gone",
        lambda: _died_after(trace, "node0", lost_at),
        {"node0": procs["node0"]},
        out,
    )
    time.sleep(GRACE_S + 1)  # the old agent killed torchrun here: no replacement yet
    procs["node1"] = launch(c.replace_node(1))

    # 3. rank 1 hangs before step 22 (the fresh node's): both agents see the silence, dump
    # and kill their ranks; the torchruns restart them, and the job goes on to its third hold
    # 4. node0's torchrun and rank get SIGKILL, its bootseer run stays: bootseer run restarts
    # torchrun (its max_restarts), which rejoins the rendezvous; node1's torchrun restarts
    # its worker; the job runs to its end
    _wait(
        "the third hold",
        lambda: all(p.exists() for p in holding(HOLDS[2])),
        procs,
        out,
        timeout_s=240,
    )
    launcher = _children(procs["node0"].pid)
    assert launcher, "no launcher under node0's bootseer run"
    for pid in [*launcher, *(d for p in launcher for d in _descendants(p))]:
        os.kill(pid, signal.SIGKILL)
    for proc in procs.values():
        code = proc.wait(timeout=240)
        assert code == 0, {p.name: p.read_text()[-3000:] for p in out.glob("*.log")}
    assert (out / "hung-1").exists()

    # every resume loaded what was saved at the committed step, on both ranks
    loaded = sorted(out.glob("loaded-*.json"))
    steps = sorted({_read(p)["step"] for p in loaded})
    assert steps == [8, 14, 20, 23], [p.name for p in loaded]
    for path in loaded:
        rank, got = path.name.split("-")[1], _read(path)
        assert got["world"] == 2
        assert got["digest"] == _read(out / f"saved-{rank}-{got['step']}.json")["digest"]
    assert _read(out / "saved-0-8.json")["digest"] == _reference(9)
    final = _reference(STEPS)
    for rank in (0, 1):
        assert _read(out / f"final-{rank}.json") == {"digest": final, "world": 2}

    # the survivor's agent restarted its command only when the launcher itself was killed:
    # torchrun restarted the workers three times before (relaunch spans); each death was
    # reported as it happened
    node0 = _records(trace, "node0")
    phases = [r.get("phase") for r in node0]
    assert phases.count("restart") == 1 and phases.count("command_start") == 2
    relaunches = [r for r in node0 if r.get("phase") == "relaunch"]
    assert [(r["attempt"], r["detail"]["generation"]) for r in relaunches] == [
        (0, 1),
        (0, 2),
        (0, 3),
    ]
    crashes = [r for r in node0 if r.get("record") == "event" and r["kind"] == "crash"]
    assert len(crashes) >= 2  # its rank's gloo error after rank 1's kill, and after the loss
    # the hang: whichever agent saw the silence first dumped and killed its ranks only (the
    # other node's rank then died of the gloo error); torchrun restarted them on both nodes
    node1 = _records(trace, "node1")
    hangs = [r for r in node0 + node1 if r.get("phase") == "hang"]
    assert hangs and all(r["outcome"] == "ranks_killed" for r in hangs), hangs
    assert any(
        r.get("phase") == "relaunch" and r["start"] >= hangs[0]["detail"]["detected_at"]
        for r in node1
    )
    log0 = (out / f"node0.{c.nodes[0].generation}.log").read_text()
    assert "killing it" not in log0 and "no restarts left" not in log0
    assert "restart 1/1" in log0  # the launcher's death: bootseer run's own restart
    # ETTR counts each launch torchrun restarted as its own incident, across both nodes (the
    # replacement's first launch joins the round of the loss), and each split adds up
    from bootseer.robust.ettr import read_ettr

    report = read_ettr([trace])
    assert [(i.attempt, i.generation, i.reason) for i in report.incidents] == [
        (0, 0, "crash"),
        (0, 1, "crash"),
        (0, 2, "hang"),
        (0, 3, "crash"),
    ], report.to_dict()
    for incident in report.incidents:
        assert sum(incident.split().values()) == pytest.approx(incident.end - incident.start)
        assert all(v >= -1e-6 for v in incident.split().values()), incident.split()
    # the hang threshold (10 s), counted by the agent from the last beat it read; the
    # incident starts at the rank's last step record, written a moment after that beat
    assert report.incidents[2].detection_s >= 10 - 0.5
    # the killed rank's own node reported its signal at once
    signalled = [
        r
        for r in node1
        if r.get("record") == "event"
        and r["kind"] == "crash"
        and r["evidence"].get("detected_by") in ("rank_signal", "rank_vanished")
    ]
    assert signalled and signalled[0]["time"] - killed_at < 5


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        kids += [int(k) for k in task.read_text().split()]
    return kids


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for kid in _children(todo.pop()):
            found.append(kid)
            todo.append(kid)
    return found


def _died_after(trace: Path, node: str, when: float) -> bool:
    return any(
        r.get("record") == "event" and r["kind"] == "crash" and r["time"] >= when
        for r in _records(trace, node)
    )
