"""The short forms of the soak's fault classes (``bootseer bench robust``) that no other test
injects: a hang in a dataloader worker, NaN in one rank's gradient, a full disk on a node, the
checkpoint store down (ridden out behind the memory tier); and a warm spare under the
controller's verdicts. One job (the soak's ``benchmarks/robust_job.py``, 2 nodes x 1 rank,
``bootseer run --controller`` on each, a third node parked at the rendezvous as a warm spare
with ``--standby``, ``bootseer controller``) runs on one cluster for the whole module; the
tests inject into it in order (a hang, which the spare takes over; a rank killed, restarted in
place with the spare parked; the store down while the job trains; a full disk; a node lost,
which the next spare replaces at once; the NaN last, after which the new spare parks again), waiting for the
job to step again only where the next test needs it: every restart costs tens of seconds on a
loaded 2-core machine. docs/robust.md lists which test covers which class.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from robust_cluster import SoakJob, read_records  # noqa: E402
from robust_faults import Fault, Injector, taken  # noqa: E402
from robust_measure import node_events, steps  # noqa: E402

pytestmark = pytest.mark.slow  # restarts of a 2-node job: minutes on a loaded 2-core machine

WAIT_S = 300.0  # a shared 2-core machine: restarts import torch on both nodes at once
# The hang threshold (20 s) is above the client's retries against the stopped store: a save
# stalled on it would otherwise read as a hang. (It no longer has to exceed torchrun's exit
# time: a rank's crash is published when the rank dies; docs/robust.md, "The soak benchmark".)


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SoakJob, Injector]]:
    from conftest import require_component

    from bootseer.testing.cluster import Cluster
    from bootseer.testing.servers import ComponentUnavailable

    out = tmp_path_factory.mktemp("soak")
    cluster = Cluster(3, services=("s3", "rendezvous"), disk_size="64m")
    try:
        cluster.start()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    job = SoakJob(
        cluster,
        out,
        "bootseer",
        nproc=1,
        hang_timeout_s=20.0,
        step_time_s=0.2,
        save_every=10,
        dump_wait_s=10.0,
        spares=1,
        log=lambda _: None,
    )
    try:
        job.start()
        yield job, Injector(job, log=lambda _: None)
    finally:
        job.close()
        cluster.close()


def _until(what: str, ready: Callable[[], Any], job: SoakJob, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-2000:] for p in (job.out / "logs").glob("*.log")}
            raise AssertionError(f"no {what} in {timeout_s:.0f} s: {logs}")
        job.tend()
        time.sleep(0.3)
    return got


def _stepping_after(job: SoakJob, since: float, n: int = 3) -> None:
    """Rank 0 of a process started after ``since`` finished ``n`` steps (the job is back)."""

    def back() -> bool:
        fresh = {s["pid"] for s in read_records(job.out / "starts.jsonl") if s["time"] > since}
        return len([s for s in steps(job.out) if s["pid"] in fresh]) >= n

    _until(f"{n} steps of a process started after {since:.1f}", back, job)


def _inject(inj: Injector, kind: str, *, rank: int | None = None, node: int | None = None) -> Fault:
    fault = Fault(f"t-{kind}", kind, 0.0, rank=rank, node=node)
    inj.inject(fault)
    return fault


def _verdict_after(job: SoakJob, since: float, failure_class: str) -> dict[str, Any]:
    return _until(
        f"{failure_class} verdict",
        lambda: [v for v in job.verdicts() if v["time"] >= since and v["class"] == failure_class],
        job,
    )[0]


def test_a_dataloader_worker_hang_is_localized_to_its_rank(soak) -> None:
    job, inj = soak
    _stepping_after(job, 0.0)
    fault = _inject(inj, "dataloader_hang", rank=1)
    claimed = _until("claim", lambda: taken(job.out, fault), job)
    verdict = _verdict_after(job, claimed["time"], "hang")
    assert (verdict["class"], verdict["action"]) == ("hang", "replace_and_restart"), verdict
    assert verdict["ranks"] == [1], verdict
    assert verdict["nodes"] == [claimed["host"]]  # the hung rank's node, and no other
    # the worker's dump names the frame it hangs in; rank 0's trainer waits in all_reduce
    incident = verdict["evidence"]["incident"]
    dumps = {p.name: p.read_text() for p in (job.out / "trace").glob(f"dump-*-i{incident}-*")}
    assert any("rank1" in n and "hang_in_dataloader_worker" in t for n, t in dumps.items())
    assert not any("rank0" in n and "hang_in_dataloader_worker" in t for n, t in dumps.items())
    assert any("rank0" in n and "all_reduce" in t for n, t in dumps.items()), list(dumps)
    _stepping_after(job, verdict["time"])  # the evicted node replaced, the job back
    assert any(r["why"] == "evicted" for r in job.relaunches)
    # the warm spare (node2, parked since the start) took the evicted node's place at once: it
    # joined the new rendezvous without waiting (torch numbers the round's nodes afresh), and
    # the evicted node's replacement started as a spare
    spare = job.c.nodes[2].name
    hosts = {json.loads((job.out / f"pid-{r}").read_text())["host"] for r in range(job.world)}
    assert hosts == {job.c.nodes[0].name, spare}, hosts
    assert "joining the new rendezvous at once" in _log(job, spare)
    assert "hang" not in {e["kind"] for e in node_events(job.out) if e["node"] == spare}
    assert {1, 2} <= job.spare_ids  # node1's replacement is the next spare


def test_a_killed_rank_restarts_in_place_and_the_spare_stays_parked(soak) -> None:
    """A rank killed with SIGKILL under the controller: the death is seen at once, the
    controller's verdict restarts the job in place (nobody is evicted for a kill from
    outside), and the warm spare does not take a healthy node's place."""
    job, inj = soak
    _stepping_after(job, 0.0)
    hosts = {json.loads((job.out / f"pid-{r}").read_text())["host"] for r in range(job.world)}
    fault = _inject(inj, "sigkill", rank=1)
    killed = fault.injected["time"]
    crash = _until(
        "the crash event",
        lambda: [
            e
            for e in node_events(job.out)
            if e["kind"] == "crash" and e["time"] >= killed and e.get("rank") == 1
        ],
        job,
    )[0]
    assert crash["class"] == "killed_by_signal", crash
    assert crash["time"] - killed < 2.0  # seen at the rank's death, not at torchrun's exit
    verdict = _verdict_after(job, killed, "killed_by_signal")
    assert (verdict["action"], verdict["nodes"]) == ("restart_in_place", []), verdict
    _stepping_after(job, verdict["time"])
    assert hosts == {
        json.loads((job.out / f"pid-{r}").read_text())["host"] for r in range(job.world)
    }  # the spare took nobody's place
    assert not [r for r in job.relaunches if r["time"] >= killed and r["why"] == "evicted"]


def _logs(job: SoakJob) -> str:
    return "".join(p.read_text(errors="replace") for p in (job.out / "logs").glob("node*.log"))


def _log(job: SoakJob, agent: str) -> str:
    return (job.out / "logs" / f"{agent}.log").read_text(errors="replace")


def test_the_checkpoint_store_down_is_ridden_out_behind_the_memory_tier(soak) -> None:
    job, inj = soak
    _stepping_after(job, 0.0)
    fault = _inject(inj, "store_down")
    down_at = fault.injected["time"]
    try:  # every node's S3 connections refused: durable saves fail, the memory tier holds
        _until("a failed durable save ridden out", lambda: "training goes on" in _logs(job), job)
        _until("10 s of the store down", lambda: time.time() - down_at >= 10.0, job)
    finally:  # the store comes back whatever happened: the tests after this one need it
        job.service_down("s3", False)
    up_at = time.time()
    # the job trained through: the same rank-0 process stepped all along, nothing crashed,
    # no incident was opened
    during = [s for s in steps(job.out) if down_at <= s["time"] <= up_at]
    before = [s for s in steps(job.out) if s["time"] < down_at]
    assert len(during) >= 10, during  # 0.2 s steps: 50 in 10 s on a quiet machine
    assert {s["pid"] for s in during} == {before[-1]["pid"]}, during
    # once the store is back a durable save commits again, and says so
    _until("a durable save after the store came back", lambda: "is back: step" in _logs(job), job)
    assert not [e for e in node_events(job.out) if e["time"] >= down_at], node_events(job.out)
    assert not [v for v in job.verdicts() if v["time"] >= down_at], job.verdicts()


def test_a_full_disk_is_classified_and_its_node_named(soak) -> None:
    job, inj = soak
    fault = _inject(inj, "disk_full", node=0)  # the job steps: the store test waited for it
    host, agent = fault.injected["host"], fault.injected["agent"]
    crash = _until(
        "disk_full crash",
        lambda: [
            e
            for e in node_events(job.out)
            if e["kind"] == "crash"
            and e["time"] >= fault.injected["time"]
            and e.get("class") == "disk_full"
        ],
        job,
    )[0]
    assert crash["node"] == agent and crash["evidence"]["rule"] == "enospc"
    verdict = _verdict_after(job, fault.injected["time"], "disk_full")
    assert (verdict["class"], verdict["action"]) == ("disk_full", "replace_and_restart")
    assert verdict["nodes"] == [agent], (verdict, host)
    excluded = json.loads((job.out / "excluded.json").read_text())["nodes"]
    assert excluded[agent]["class"] == "disk_full"


def test_a_lost_node_is_replaced_by_the_warm_spare_at_once(soak) -> None:
    """A job node lost under the controller (every process on it killed at once): the
    survivor's rank dies of the gloo error, the controller's verdict names the lost node
    (node_lost, replaced) without its dumps, and the parked spare (the full disk's node's replacement) joins the
    new rendezvous at once; the job trains again on the survivor and the spare."""
    job, inj = soak
    _stepping_after(job, max([v["time"] for v in job.verdicts()], default=0.0))
    fault = _inject(inj, "node_lost", node=1)
    lost_at, lost = fault.injected["time"], fault.injected["agent"]
    verdict = _until(
        "a verdict after the loss", lambda: [v for v in job.verdicts() if v["time"] >= lost_at], job
    )[0]
    # the lost node is the verdict's subject, not the survivor whose rank saw it die
    assert (verdict["class"], verdict["action"], verdict["nodes"]) == (
        "node_lost",
        "replace_and_restart",
        [lost],
    ), verdict
    assert verdict["evidence"]["lost"] == [lost]
    _stepping_after(job, verdict["time"])
    hosts = {json.loads((job.out / f"pid-{r}").read_text())["host"] for r in range(job.world)}
    assert fault.injected["host"] not in hosts or any(
        r["why"] == "lost" for r in job.relaunches if r["time"] >= lost_at
    ), hosts
    spare_logs = [
        _log(job, job.agent_names[i])
        for i in range(len(job.c.nodes))
        if job.c.nodes[i].name in hosts
    ]
    assert any("joining the new rendezvous at once" in text for text in spare_logs)


def test_nan_in_one_ranks_gradient_is_detected_at_its_step(soak) -> None:
    job, inj = soak
    fault = _inject(inj, "nan", rank=0)
    claimed = _until("claim", lambda: taken(job.out, fault), job)
    _until(
        "nonfinite event",
        lambda: [
            e
            for e in node_events(job.out)
            if e["kind"] == "nonfinite" and e["time"] >= claimed["time"] - 1
        ],
        job,
    )
    time.sleep(1.0)  # the other rank's NaN (its next step, after the all-reduce) may be read
    seen = [
        e
        for e in node_events(job.out)
        if e["kind"] == "nonfinite"  # first by its agent
        and e["time"] >= claimed["time"] - 1
    ]
    nan = min(seen, key=lambda e: (e["step"], e["time"]))  # the earliest step: its cause
    assert nan["rank"] == 0 and nan["step"] == claimed["step"], (nan, claimed)
    assert nan["evidence"] == {"grad_norm": "nan"}  # the loss of that step was still finite
    # under a controller the NaN is the controller's to decide: it stops the job, runs the
    # stop-time checks on both nodes (collective self-test, bitwise alignment), and with no
    # node failing them restarts in place, evicting nobody
    verdict = _until(
        "the controller's verdict on the NaN",
        lambda: [
            v for v in job.verdicts() if v["class"] == "nonfinite" and v["time"] >= nan["time"]
        ],
        job,
    )[0]
    check = verdict["evidence"]["check"]
    failed = {f["node"] for f in check["failed"]}
    if verdict["action"] == "restart_in_place":
        assert verdict["nodes"] == [] and not failed, verdict
        # nobody gone: the parked spare (the full disk's node's replacement) waits for the
        # job's nodes to form the new rendezvous and parks behind them, taking no rank
        hosts = {json.loads((job.out / f"pid-{r}").read_text())["host"] for r in range(job.world)}
        [parked] = [i for i, n in enumerate(job.c.nodes) if n.name not in hosts]
        spare = job.agent_names[parked]
        _until(
            "the spare parked again",
            lambda: _log(job, spare).count("parking behind them") >= 2,
            job,
        )  # at its start, and after this verdict
        _until(
            "every rank started again",
            lambda: (
                {
                    s["rank"]
                    for s in read_records(job.out / "starts.jsonl")
                    if s["time"] > verdict["time"]
                }
                == set(range(job.world))
            ),
            job,
        )
        assert hosts == {
            json.loads((job.out / f"pid-{r}").read_text())["host"] for r in range(job.world)
        }  # nobody moved
    else:  # an eviction only for a node that failed a check, and only that node
        assert verdict["action"] == "replace_and_restart" and set(verdict["nodes"]) == failed, (
            verdict
        )
    # last in the module: the soak found that a job restarted after a NaN under the controller
    # can NaN again (docs/robust.md, known gaps); the tests before it need a job that steps
