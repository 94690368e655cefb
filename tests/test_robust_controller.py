"""``bootseer controller`` on the cluster fixture: nodes' agents (``bootseer run
--controller``) publish events into the controller's c10d store; a hang or a crash on one node
makes every node dump before anything is killed, and the verdict names the culprit. Also the
wire format's refusals, on a real store in this process."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bootseer.robust import wire
from bootseer.robust.controller import Controller
from bootseer.robust.events import Event
from bootseer.robust.remote import ControllerLink, ExcludedNode
from bootseer.robust.seal import seal

HERE = Path(__file__).resolve().parent
JOB = HERE / "controller_job.py"
PORT = 29400  # the cluster's c10d store (the fixture's "rendezvous" service)


# -- the wire, on a real TCPStore in this process, through bootseer's client ------------------


@pytest.fixture()
def store(tcp_store):
    """bootseer's own client of the test's real TCPStore: what the agents and the
    controller use (:mod:`bootseer.robust.store_client`)."""
    from bootseer.robust.store_client import StoreClient

    with StoreClient("127.0.0.1", tcp_store.port, timeout_s=10) as client:
        yield client


def test_a_node_cannot_speak_for_another_and_bad_records_are_skipped(store) -> None:
    keys = wire.Keys("job")
    a, b = ControllerLink(store, "node-a"), ControllerLink(store, "node-b")
    a.register()
    b.register()
    # node-b writes, under its own key, a hang that claims to be node-a's
    forged = Event("hang", "hang", node="node-a", rank=0, time=time.time()).to_json()
    store.set(keys.event("node-b", 1), seal(keys.event("node-b", 1), forged.encode()))
    store.add(keys.node("node-b", "events"), 1)
    store.set(keys.event("node-b", 2), seal(keys.event("node-b", 2), b'["a list"]'))
    store.add(keys.node("node-b", "events"), 1)
    store.set(
        keys.event("node-b", 3), seal(keys.event("node-b", 3), b"x" * (wire.MAX_RECORD_BYTES + 1))
    )
    store.add(keys.node("node-b", "events"), 1)
    logs: list[str] = []
    ctl = Controller(store, log=logs.append)
    assert ctl.step() is None  # nothing believable: no incident
    assert wire.get(store, keys.dump_request) is None
    assert any("names node 'node-a', not 'node-b'" in w for w in ctl.warnings)
    assert any("not a JSON object" in w for w in ctl.warnings)
    assert any("over the limit" in w for w in ctl.warnings)
    assert int(store.add(keys.seen("node-b"), 0)) == 3  # skipped for good, not re-read
    # publish() puts the node's own name in, whatever the event said
    b.publish(Event("crash", "python_exception", node="node-a", time=time.time()))
    ctl.step()
    opened = wire.read(store, keys.open)
    assert [e["node"] for e in opened["events"]] == ["node-b"]
    with pytest.raises(ValueError, match="node name 'a/b'"):
        ControllerLink(store, "a/b")
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        wire.parse_address("10.0.0.5")


def test_a_restarted_controller_resumes_the_open_incident(store) -> None:
    """Killed between the dump order and the verdict: the next one finishes the incident
    from the store and neither re-opens it nor loses its events."""
    now = [1000.0]
    a, b = ControllerLink(store, "n0"), ControllerLink(store, "n1")
    a.register()
    b.register()
    b.publish(
        Event(
            "crash", "python_exception", node="n1", time=1000.0, evidence={"exception": "KeyError"}
        )
    )
    first = Controller(store, clock=lambda: now[0], log=lambda _: None)
    assert first.step() is None  # incident 1 opened, the dump ordered
    assert a.dump_order(force=True)["incident"] == 1
    del first  # "killed"
    a.answer(1, [])
    b.answer(1, [])
    now[0] += 2
    second = Controller(store, clock=lambda: now[0], log=lambda _: None)
    assert second.step() is None  # every answer in: one more pass for late events
    verdict = second.step()
    assert verdict is not None and verdict.failure_class == "python_exception"
    assert verdict.evidence["incident"] == 1 and verdict.evidence["primary"]["node"] == "n1"
    assert verdict.action == "restart_in_place" and verdict.nodes == ()  # nobody evicted
    assert second.step() is None and int(store.add(wire.Keys().incident, 0)) == 1
    assert a.verdict(1) == verdict


def test_a_node_that_never_answers_is_waited_for_then_named_missing(store) -> None:
    now = [50.0]
    links = [ControllerLink(store, n) for n in ("n0", "n1", "n2")]
    for link in links:
        link.register()
    links[0].publish(Event("crash", "killed_by_signal", node="n0", time=50.0))
    ctl = Controller(store, dump_wait_s=10, clock=lambda: now[0], log=lambda _: None)
    ctl.step()
    assert links[2].dump_order(force=True)["incident"] == 1  # n2 saw the order (its ack)...
    links[0].answer(1, [])
    links[1].answer(1, [])  # ...and is lost before it answers
    for t in (52.0, 59.0):
        now[0] = t
        assert ctl.step() is None  # still waiting for n2
    now[0] = 60.5
    verdict = ctl.step()
    assert verdict is not None and verdict.evidence["missing_dumps"] == ["n2"]
    assert sorted(verdict.evidence["dumps"]) == ["n0", "n1"]

    # the next incidents do not wait for the lost node (nor does a restarted controller)
    def verdict_within(ctl: Controller, seconds: float):
        for _ in range(int(seconds)):  # under the 10 s dump wait
            now[0] += 1.0
            if (got := ctl.step()) is not None:
                return got
        return None

    restarted = Controller(store, dump_wait_s=10, clock=lambda: now[0], log=lambda _: None)
    for incident, closing in ((2, ctl), (3, restarted)):
        now[0] += 5.0  # a crash after the last verdict: a new incident
        links[1].publish(Event("crash", "python_exception", node="n1", time=now[0]))
        assert closing.step() is None
        links[0].answer(incident, [])
        links[1].answer(incident, [])
        verdict = verdict_within(closing, 6)
        assert verdict is not None and verdict.evidence["incident"] == incident
        assert verdict.evidence["missing_dumps"] == []
        assert verdict.evidence["not_waited_for"] == ["n2"]
    # n2 is back (it beats): waited for again
    links[2].beat(1, {})
    now[0] += 5.0
    links[0].publish(Event("crash", "python_exception", node="n0", time=now[0]))
    assert restarted.step() is None
    links[0].answer(4, [])
    links[1].answer(4, [])
    assert verdict_within(restarted, 6) is None  # n2 has not answered yet
    links[2].answer(4, [])
    verdict = verdict_within(restarted, 3)
    assert verdict is not None and sorted(verdict.evidence["dumps"]) == ["n0", "n1", "n2"]


def test_a_node_lost_with_its_agent_is_not_waited_for_past_the_ack_wait(store) -> None:
    """No acknowledgement of the order and no beat since it was placed: the agent is gone
    with its node (a live one acks within its 0.5 s poll, before dumping), so the dump wait
    (10 s) is not spent on it; a node that beat since the order is waited for."""
    from bootseer.robust.controller import ACK_WAIT_S

    now = [50.0]
    keys = wire.Keys("job")
    links = [ControllerLink(store, n) for n in ("n0", "n1", "n2", "n3")]
    for link in links:
        link.register()
    wire.put(store, keys.node("n2", "beat"), {"node": "n2", "time": 49.5})  # before
    links[0].publish(Event("crash", "gloo_error", node="n0", time=50.0))
    ctl = Controller(store, dump_wait_s=10, clock=lambda: now[0], log=lambda _: None)
    assert ctl.step() is None
    links[0].answer(1, [])
    links[1].answer(1, [])
    wire.put(store, keys.node("n3", "beat"), {"node": "n3", "time": 51.0})  # after
    now[0] = 50.0 + ACK_WAIT_S - 0.1
    assert ctl.step() is None  # within the ack wait: both still waited for
    now[0] = 50.0 + ACK_WAIT_S + 0.1
    assert ctl.step() is None  # n2 silent, but n3 beat since the order: still waiting
    links[3].answer(1, [])
    verdict = ctl.step() or ctl.step()  # (one more pass for late events)
    assert verdict is not None, "closed once only the silent node is missing"
    assert verdict.evidence["missing_dumps"] == ["n2"] and verdict.evidence["silent"] == ["n2"]
    assert now[0] - 50.0 < 10.0  # well before the dump wait


def _beat(store, node: str, when: float, ranks: list[int]) -> None:
    wire.put(
        store,
        wire.Keys("job").node(node, "beat"),
        {
            "node": node,
            "time": when,
            "attempt": 0,
            "ranks": {str(r): {"step": 40, "time": when, "pid": 100 + r} for r in ranks},
        },
    )


def test_a_lost_node_is_the_verdicts_subject_not_the_survivor_that_saw_it_die(
    store, tmp_path
) -> None:
    """The cluster soak's lost node, from the records its survivors left: n1 was killed
    with its agent; the ranks of n0 and n2 failed with gloo's "Connection closed by peer"
    (their agents' crash events), their agents answered the dump order, n1 neither
    acknowledged it nor beat again. Before: class gloo_error ("a peer died: the cause is
    elsewhere"), restart in place, naming rank 0 on n0, and n1 only in the silent and
    missing lists. Now n1 is the subject: node_lost, its rank, replaced."""
    now = [50.0]
    links = {n: ControllerLink(store, n) for n in ("n0", "n1", "n2")}
    for rank, (node, link) in enumerate(links.items()):
        link.register()
        _beat(store, node, 49.0, [rank])  # before the loss: each node's last summary
    closed = (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
        "closed by peer [10.0.0.3]:40112"
    )
    for rank, node in ((0, "n0"), (2, "n2")):
        links[node].publish(
            Event(
                "crash",
                "gloo_error",
                node=node,
                rank=rank,
                time=50.0,
                evidence={"rule": "gloo", "lines": [closed], "detected_by": "rank_exception"},
            )
        )
    ctl = Controller(
        store,
        exclusion=tmp_path / "excluded.json",
        dump_wait_s=10,
        clock=lambda: now[0],
        log=lambda _: None,
    )
    assert ctl.step() is None
    for node in ("n0", "n2"):
        assert links[node].dump_order(force=True)["incident"] == 1
        links[node].answer(1, [])
        _beat(store, node, 50.5, [0 if node == "n0" else 2])
    verdict = None
    while verdict is None and now[0] < 60.0:
        now[0] += 0.5
        verdict = ctl.step()
    assert verdict is not None
    assert (verdict.action, verdict.failure_class, verdict.nodes, verdict.ranks) == (
        "replace_and_restart",
        "node_lost",
        ("n1",),
        (1,),
    )
    ev = verdict.evidence
    assert ev["lost"] == ["n1"] and ev["missing_dumps"] == ["n1"]
    assert ev["primary"]["class"] == "node_lost" and ev["primary"]["node"] == "n1"
    assert ev["primary"]["evidence"]["seen_as"]["class"] == "gloo_error"  # what n0 saw
    assert ev["primary"]["evidence"]["ranks"] == {"n1": [1]}
    assert list(json.loads((tmp_path / "excluded.json").read_text())["nodes"]) == ["n1"]
    assert now[0] - 50.0 < 10.0  # not the whole dump wait (the ack wait)


def test_a_node_that_acknowledged_but_is_slow_is_not_named_lost(store) -> None:
    """Missing its dump at the dump wait, but it acknowledged the order: alive and slow, not
    lost; the survivor's gloo error keeps its class."""
    now = [50.0]
    links = {n: ControllerLink(store, n) for n in ("n0", "n1")}
    for link in links.values():
        link.register()
    links["n0"].publish(Event("crash", "gloo_error", node="n0", rank=0, time=50.0))
    ctl = Controller(store, dump_wait_s=5, clock=lambda: now[0], log=lambda _: None)
    assert ctl.step() is None
    links["n0"].answer(1, [])
    assert links["n1"].dump_order(force=True)["incident"] == 1  # its ack
    verdict = None
    while verdict is None and now[0] < 60.0:
        now[0] += 0.5
        verdict = ctl.step()
    assert verdict is not None and verdict.evidence["missing_dumps"] == ["n1"]
    assert (verdict.failure_class, verdict.evidence["lost"]) == ("gloo_error", [])


def _mismatch_window(node: str, rank: int, numel: int) -> dict[str, Any]:
    """A node's shipped window: its rank's 20 all_reduces of 4 floats, then #21 of
    ``numel``, never completed (gloo aborted the process in it)."""
    from bootseer.colltrace.ring import Op, RingSnapshot
    from bootseer.colltrace.ship import window

    ops = [
        Op(
            rank,
            i,
            "0",
            "all_reduce",
            i + 1,
            4,
            16,
            "float32",
            50.0 + i,
            50.01 + i,
            False,
            False,
            -1,
        )
        for i in range(20)
    ]
    ops.append(
        Op(
            rank,
            20,
            "0",
            "all_reduce",
            21,
            numel,
            4 * numel,
            "float32",
            100.0,
            None,
            False,
            False,
            -1,
        )
    )
    snap = RingSnapshot(
        f"rank{rank}.ring",
        rank,
        2,
        2**22 + rank,
        node,
        40.0,
        21,
        {"0": {"name": "0", "desc": "default_pg", "ranks": [0, 1]}},
        ops,
    )
    return window([snap], node=node)


def test_a_mismatched_collective_stops_the_job_as_a_code_fault(store) -> None:
    """The cluster's size mismatch: gloo aborted rank 1 (SIGABRT, seen at its death:
    killed_by_signal), rank 0 failed with gloo's reset; the windows the nodes shipped with
    their answers show all_reduce #21 of 8 floats on rank 1 and 4 on rank 0. Before: the
    stop-time checks were ordered (an unclear signal) and the job restarted in place, the
    tracer's mismatch only in the evidence. Now: no checks, class collective_mismatch, the
    job stops (a restart repeats it). Two ranks that differ: neither is the odd one out,
    both are named."""
    keys = wire.Keys("job")
    now = [100.5]
    links = {n: ControllerLink(store, n) for n in ("n0", "n1")}
    for link in links.values():
        link.register()
    links["n1"].publish(
        Event(
            "crash",
            "killed_by_signal",
            node="n1",
            rank=1,
            time=100.2,
            evidence={
                "rule": "signal",
                "signal": "SIGABRT",
                "exit_code": -6,
                "detected_by": "rank_signal",
            },
        )
    )
    links["n0"].publish(Event("crash", "gloo_error", node="n0", rank=0, time=100.3))
    ctl = Controller(store, clock=lambda: now[0], log=lambda _: None)
    assert ctl.step() is None
    for rank, (node, link) in enumerate(links.items()):
        link.colltrace = lambda node=node, rank=rank: _mismatch_window(
            node, rank, 8 if rank == 1 else 4
        )
        link.answer(1, [])
    verdict = None
    while verdict is None and now[0] < 110.0:
        now[0] += 0.5
        verdict = ctl.step()
    assert wire.get(store, keys.check_request(1)) is None  # no stop-time checks
    assert verdict is not None
    assert (verdict.action, verdict.failure_class, verdict.ranks, verdict.nodes) == (
        "stop",
        "collective_mismatch",
        (0, 1),
        (),
    )
    primary = verdict.evidence["primary"]
    assert (primary["node"], primary["rank"]) == ("n0", 0)
    assert primary["evidence"]["signatures"] == {
        "0": "all_reduce float32 x4",
        "1": "all_reduce float32 x8",
    }
    assert primary["evidence"]["seen_as"]["evidence"]["signal"] == "SIGABRT"
    assert verdict.evidence["colltrace"]["findings"][0]["kind"] == "mismatch"


_WAITING = (
    'Thread 7 (idle): "MainThread"\n'
    "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n"
    "    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)\n"
    "    main (controller_job.py:58)\n"
)
_SLEEPING = (
    'Thread 8 (idle): "MainThread"\n'
    "    hang_before_all_reduce (controller_job.py:32)\n"
    "    main (controller_job.py:57)\n"
)


def test_two_ranks_a_tie_is_broken_by_who_waits_inside_a_collective(store) -> None:
    """2 nodes x 1 rank (the CI form): the stacks tie 1:1, but the rank outside every
    collective is the one the other waits for."""
    links = [ControllerLink(store, n) for n in ("n0", "n1")]
    for link in links:
        link.register()
        link.publish(Event("hang", "hang", node=link.node, rank=0, time=time.time()))
    ctl = Controller(store, settle_s=0, crash_window_s=0, log=lambda _: None)
    ctl.step()
    for rank, link in enumerate(links):
        link.answer(
            1,
            [
                {
                    "rank": rank,
                    "pid": 5 + rank,
                    "role": "main",
                    "source": "py-spy",
                    "text": _SLEEPING if rank == 1 else _WAITING,
                }
            ],
        )
    # n1's native dump (taken after its answer) arrives before the verdict; n0's does not
    native = _SLEEPING.replace(
        "    hang_before",
        "    clock_nanosleep (libc.so.6)\n    time_sleep (libpython3.11.so.1.0)\n    hang_before",
    )
    links[1].answer_native(
        1, [{"rank": 1, "pid": 6, "role": "main", "source": "py-spy", "text": native}]
    )
    ctl.step()
    verdict = ctl.step()
    assert verdict is not None
    assert (verdict.action, verdict.nodes, verdict.ranks) == ("replace_and_restart", ("n1",), (1,))
    localization = verdict.evidence["localization"]
    assert "waits inside a collective" in localization["reason"]
    by_rank = {tuple(g["ranks"]): g for g in localization["groups"]}
    assert by_rank[(1,)]["native"]["stacks"][0][:2] == [
        "clock_nanosleep (libc.so.6)",
        "time_sleep (libpython3.11.so.1.0)",
    ]
    assert "native" not in by_rank[(0,)]
    assert by_rank[(1,)]["stacks"] == [
        ["hang_before_all_reduce (controller_job.py)", "main (controller_job.py)"]
    ]  # grouped on Python
    assert (
        verdict.evidence["dumps"]["n0"]["native"],
        verdict.evidence["dumps"]["n1"]["native"],
    ) == (False, True)


def test_two_ranks_both_inside_collectives_is_no_verdict_from_stacks(store) -> None:
    links = [ControllerLink(store, n) for n in ("n0", "n1")]
    for link in links:
        link.register()
    links[0].publish(Event("hang", "hang", node="n0", rank=0, time=time.time()))
    ctl = Controller(store, settle_s=0, crash_window_s=0, log=lambda _: None)
    ctl.step()
    other = _WAITING.replace("all_reduce (", "broadcast (")
    for rank, link in enumerate(links):
        link.answer(
            1,
            [
                {
                    "rank": rank,
                    "pid": 5 + rank,
                    "role": "main",
                    "source": "py-spy",
                    "text": other if rank == 1 else _WAITING,
                }
            ],
        )
    ctl.step()
    verdict = ctl.step()
    assert verdict is not None and verdict.action == "restart_in_place" and verdict.nodes == ()
    assert "no verdict from stacks" in verdict.evidence["localization"]["reason"]


def test_a_crash_just_after_a_hang_is_its_root_cause(store) -> None:
    """node0's ranks wait in all_reduce for node1's rank, which raised: node0's hang
    threshold fires first, and every dump is in before node1's crash arrives. Within the
    crash window the crash is the cause: its class, its rank, nobody evicted."""
    now = [200.0]
    links = [ControllerLink(store, n) for n in ("n0", "n1")]
    for link in links:
        link.register()
    links[0].publish(Event("hang", "hang", node="n0", rank=0, time=200.0))
    ctl = Controller(
        store, settle_s=0, crash_window_s=3.0, clock=lambda: now[0], log=lambda _: None
    )
    assert ctl.step() is None  # opened on the hang, the dump ordered
    links[0].answer(
        1, [{"rank": 0, "pid": 5, "role": "main", "source": "py-spy", "text": _WAITING}]
    )
    links[1].answer(1, [])  # its rank is gone: nothing to dump
    for t in (200.5, 201.0, 202.0):
        now[0] = t
        assert ctl.step() is None  # a hang alone waits out the window
    links[1].publish(
        Event(
            "crash",
            "python_exception",
            node="n1",
            rank=1,
            time=200.2,
            evidence={"exception": "ValueError"},
        )
    )
    now[0] = 202.5
    assert ctl.step() is None  # the crash joins the incident
    now[0] = 203.5
    verdict = ctl.step()
    assert verdict is not None
    assert (verdict.action, verdict.failure_class, verdict.ranks, verdict.nodes) == (
        "restart_in_place",
        "python_exception",
        (1,),
        (),
    )
    primary = verdict.evidence["primary"]
    assert (primary["node"], primary["evidence"]["exception"]) == ("n1", "ValueError")
    assert [e["kind"] for e in verdict.evidence["events"]] == ["hang", "crash"]
    assert wire.get(store, wire.Keys().excluded) is None  # nobody evicted


def test_an_evicted_node_cannot_register_again(store, tmp_path: Path) -> None:
    a, b, c = (ControllerLink(store, n) for n in ("n0", "n1", "n2"))
    for link in (a, b, c):
        link.register()
    for link in (a, c):
        link.publish(Event("hang", "hang", node=link.node, rank=0, time=time.time()))
    ctl = Controller(
        store,
        exclusion=tmp_path / "excluded.json",
        settle_s=0,
        crash_window_s=0,
        log=lambda _: None,
    )
    ctl.step()
    sleeping = 'Thread 0x1 (idle): "MainThread"\n    hang_before_all_reduce (job.py:3)\n'
    waiting = 'Thread 0x1 (idle): "MainThread"\n    all_reduce (torch/distributed/c10d.py:9)\n'
    for rank, link in enumerate((a, b, c)):
        link.answer(
            1,
            [
                {
                    "rank": rank,
                    "pid": 10 + rank,
                    "role": "main",
                    "source": "py-spy",
                    "text": sleeping if rank == 1 else waiting,
                }
            ],
        )
    ctl.step()
    verdict = ctl.step()
    assert verdict is not None and (verdict.action, verdict.nodes, verdict.ranks) == (
        "replace_and_restart",
        ("n1",),
        (1,),
    )
    assert list(json.loads((tmp_path / "excluded.json").read_text())["nodes"]) == ["n1"]
    with pytest.raises(ExcludedNode, match="node n1 is on job job's exclusion list"):
        ControllerLink(store, "n1").register()


def test_without_py_spy_the_stacks_come_from_the_clients_faulthandler(store, tmp_path):
    """The whole agent path on one machine: a hang published, the order, py-spy failing, the
    client's SIGUSR1 file dumped instead, the verdict, and only then the kill."""
    from robust_helpers import run_solo, scenario_argv

    def no_pyspy(pid: int) -> str:
        raise RuntimeError("py-spy is not installed")

    link = ControllerLink(store, "solo")
    link.register()
    link.dump_tool = no_pyspy
    code, _ = run_solo(
        store,
        tmp_path,
        scenario_argv("steady-then-stall", 3, 0.1),
        link,
        dump_wait_s=3.0,
        agent_hang_s=1.0,
        crash_window_s=0,
    )
    assert code == 128 + signal.SIGKILL  # killed after the verdict; no restarts allowed
    dumps = sorted((tmp_path / "trace").glob("dump-solo-i1-rank0-*.txt"))
    assert len(dumps) == 1
    assert dumps[0].read_text().startswith("# faulthandler main")
    assert "sleep_before_all_reduce" in dumps[0].read_text()
    verdict = _records(tmp_path / "ctl.jsonl", "verdict")[0]
    assert verdict["evidence"]["dumps"]["solo"]["sources"] == ["faulthandler"]
    assert verdict["class"] == "hang"
    span = [
        s
        for s in map(json.loads, (tmp_path / "trace" / "solo.jsonl").read_text().splitlines())
        if s.get("phase") == "hang"
    ][0]["detail"]
    assert span["dumped_at"] <= span["decided_at"] <= span["killed_at"]


def test_the_kill_waits_for_slow_native_dumps_only_a_grace(store, tmp_path):
    """The native dumps (seconds a process under load) run beside the verdict: the command
    is killed at most NATIVE_GRACE_S after the verdict, not when a 30 s native dump ends."""
    import threading

    from robust_helpers import run_solo, scenario_argv

    from bootseer.supervise import NATIVE_GRACE_S

    released = threading.Event()

    def slow_native(pid: int) -> str:
        released.wait(30.0)
        return ""

    link = ControllerLink(store, "solo")
    link.register()
    link.dump_tool = lambda pid: _SLEEPING  # a Python dump at once
    link.native_tool = slow_native
    try:
        code, _ = run_solo(
            store,
            tmp_path,
            scenario_argv("steady-then-stall", 3, 0.1),
            link,
            dump_wait_s=3.0,
            agent_hang_s=1.0,
            crash_window_s=0,
        )
    finally:
        released.set()
    assert code == 128 + signal.SIGKILL
    span = [
        s
        for s in map(json.loads, (tmp_path / "trace" / "solo.jsonl").read_text().splitlines())
        if s.get("phase") == "hang"
    ][0]["detail"]
    assert span["killed_at"] - span["decided_at"] < NATIVE_GRACE_S + 5.0  # not 30 s
    assert not list((tmp_path / "trace").glob("dump-solo-i1-*-native.txt"))  # not in time
    verdict = _records(tmp_path / "ctl.jsonl", "verdict")[0]
    assert verdict["evidence"]["dumps"]["solo"]["native"] is False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_hosted_store_outlives_a_killed_controller(tmp_path: Path) -> None:
    """``--port``: the store starts in a session of its own; a controller killed with
    SIGKILL leaves it (and the job's state) to the next, which attaches instead."""
    from torch.distributed import TCPStore

    from bootseer.testing.cluster_host import wait_for_line

    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "bootseer",
        "controller",
        "--port",
        str(port),
        "--trace-dir",
        str(tmp_path),
    ]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store_pid = None
    try:
        wait_for_line(first, "READY", "the controller", 60)
        client = TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        ControllerLink(client, "n0").register()
        first.kill()
        started = first.communicate()[1]
        store_pid = int(started.split("(pid ")[1].split(")")[0])
        assert client.get(wire.Keys().nodes) == b"n0\n"  # the store lives on
        second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert "1 node(s) registered" in wait_for_line(second, "READY", "controller", 60)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=30) == 0
        assert "store started" not in second.communicate()[1]  # it attached
    finally:
        if first.poll() is None:
            first.kill()
        if store_pid is not None:
            os.kill(store_pid, signal.SIGTERM)
    bad = subprocess.run(
        [*argv[:4], "--store", "127.0.0.1:1", "--layout", "[1]"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--layout '[1]' is not a JSON object" in bad.stderr


# -- on the cluster ---------------------------------------------------------------------------


def _controller(c, out: Path, *extra: str) -> subprocess.Popen:
    proc = c.services.popen(
        [
            sys.executable,
            "-m",
            "bootseer",
            "controller",
            "--store",
            f"127.0.0.1:{PORT}",
            "--trace-dir",
            str(out / "ctl"),
            "--exclusion",
            str(out / "excluded.json"),
            "--dump-wait",
            "15",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=open(out / "ctl.log", "a"),
        text=True,
    )  # noqa: SIM115
    from bootseer.testing.cluster_host import wait_for_line

    proc.ready = wait_for_line(proc, "READY", "the controller", 60)  # type: ignore[attr-defined]
    return proc


def _agent(
    c,
    node,
    out: Path,
    script: list[str],
    *,
    nnodes: int,
    hang_timeout: float = 0,
    max_restarts: int = 1,
    env: dict[str, str] | None = None,
    run_args: tuple[str, ...] = (),
    name: str | None = None,
) -> subprocess.Popen:
    name = name or node.name  # the agent's name (a replacement machine's is new)
    argv = [
        sys.executable,
        "-m",
        "bootseer",
        "run",
        *run_args,
        "--controller",
        f"{c.services.controller}:{PORT}",
        "--node",
        name,
        "--hang-timeout",
        str(hang_timeout),
        "--state-dir",
        str(out / f"state-{name}"),
        "--trace-dir",
        str(out / "trace"),
        "--min-free-disk",
        "0",
        "--min-free-memory",
        "0",
        "--max-restarts",
        str(max_restarts),
        "--backoff",
        "0.5",
        "--",
        "sh",
        "-c",
        "exec " + _torchrun(node, out, script, nnodes),
    ]
    log = open(out / f"{name}.log", "w")  # noqa: SIM115
    with log:
        return node.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def _torchrun(node, out: Path, script: list[str], nnodes: int) -> str:
    """torchrun rejoins after a verdict under a fresh rendezvous id (``job-<incident>``): a
    torchrun that gave up closed the last one for good."""
    argv = node.torchrun(
        [str(JOB), "--out", str(out), *script],
        nnodes=f"{nnodes}:{nnodes}",
        max_restarts=0,
        rdzv_id="job-@INCIDENT@",
    )
    return shlex.join(argv).replace("@INCIDENT@", '"$BOOTSEER_INCIDENT"')


def _wait(
    what: str, ready, procs: dict[str, subprocess.Popen], out: Path, timeout_s: float = 120
) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-1500:] for p in out.glob("*.log")}
            raise AssertionError(f"no {what} in {timeout_s} s: {logs}")
        time.sleep(0.2)
    return got


def _records(path: Path, record: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [d for d in map(json.loads, path.read_text().splitlines()) if d.get("record") == record]


def _job(
    cluster_factory, nodes: int, tmp_path: Path, *extra: str
) -> tuple[Any, Path, subprocess.Popen]:
    """A cluster with the controller's store, the output directory, the controller (``extra``:
    more of its options)."""
    c = cluster_factory(nodes, services=("rendezvous",))
    out = tmp_path / "out"
    out.mkdir()
    return c, out, _controller(c, out, *extra)


def test_a_hang_is_localized_across_nodes_before_anything_is_killed(
    cluster_factory, tmp_path: Path
) -> None:
    c, out, ctl = _job(cluster_factory, 3, tmp_path)
    trigger = out / "hang-now"
    script = ["--hang-rank", "1", "--hang-when", str(trigger), "--step-time", "0.3"]
    # the collective tracer on, each node's rings in a directory of its own: only the windows
    # the nodes ship through the store let the controller see all three ranks
    procs = {
        n.name: _agent(
            c,
            n,
            out,
            script,
            nnodes=3,
            hang_timeout=3,
            max_restarts=0,
            run_args=("--colltrace", "--colltrace-dir", str(out / f"rings-{n.name}")),
        )
        for n in c.nodes
    }  # the restart after a verdict is the crash test's
    _wait(
        "three running ranks",
        lambda: all((out / f"running-{r}").exists() for r in range(3)),
        procs,
        out,
    )
    # the controller is killed with SIGKILL and started again: the nodes it knows and what it
    # does next come from the store
    ctl.kill()
    ctl.wait()
    ctl = _controller(c, out)
    assert "3 node(s) registered" in ctl.ready, ctl.ready
    pids = {r: int((out / f"running-{r}").read_text()) for r in range(3)}
    trigger.touch()
    verdicts = _wait(
        "verdict", lambda: _records(out / "ctl" / "controller.jsonl", "verdict"), procs, out
    )
    assert procs["node1"].wait(timeout=60) != 0  # evicted: its agent stops
    verdict = verdicts[0]
    assert (verdict["action"], verdict["class"]) == ("replace_and_restart", "hang")
    assert verdict["nodes"] == ["node1"] and verdict["ranks"] == [1]
    ev = verdict["evidence"]
    assert ev["incident"] == 1 and ev["controller_pid"] == ctl.pid  # the restarted one
    assert ev["localization"]["suspects"] == [1]
    assert sorted(ev["dumps"]) == ["node0", "node1", "node2"] and ev["missing_dumps"] == []
    groups = {tuple(g["ranks"]): g for g in ev["localization"]["groups"]}
    assert set(groups) == {(0, 2), (1,)}
    assert any("hang_before_all_reduce" in f for t in groups[(1,)]["stacks"] for f in t)
    assert any("all_reduce" in f for t in groups[(0, 2)]["stacks"] for f in t)
    # each node dumped again with native frames after its answer: in the evidence when they
    # came before the verdict (on a quiet machine they do; never waited for)
    assert all(isinstance(d["native"], bool) for d in ev["dumps"].values())
    for group in groups.values():
        if "native" in group:
            assert any(".so" in f for t in group["native"]["stacks"] for f in t), group
    assert json.loads((out / "excluded.json").read_text())["nodes"]["node1"]["class"] == "hang"
    # the tracer's verdict over the three nodes' shipped ring windows: rank 1 on node1
    # never issued the all_reduce ranks 0 and 2 wait in (each node's own rings hold one rank)
    for rank, node in enumerate(("node0", "node1", "node2")):
        assert [p.name.split("-")[0] for p in (out / f"rings-{node}").rglob("*.ring")] == [
            f"rank{rank}"
        ]
    traced = ev["colltrace"]
    assert sorted(traced["windows"]) == ["node0", "node1", "node2"]
    first = traced["findings"][0]
    assert (first["kind"], first["ranks"], first["op"]) == ("never_issued", [1], "all_reduce")
    assert sorted(first["evidence"]["waiting"]) == [0, 2]
    assert traced["lines"][0].startswith("rank 1 (node1) never issued all_reduce #")
    from bootseer.colltrace.reader import read_verdicts

    assert read_verdicts([out / "ctl"])[0][0]["line"] == traced["lines"][0]  # bootseer report
    # the dumps were taken from the live processes (py-spy of the ranks' pids), and each node
    # killed its command only after the verdict
    for rank, node in enumerate(("node0", "node1", "node2")):
        dump = out / "trace" / f"dump-{node}-i1-rank{rank}-{pids[rank]}.txt"
        text = dump.read_text()
        assert ("hang_before_all_reduce" in text) == (rank == 1), text
        assert "all_reduce" in text
        trace = out / "trace" / f"{node}.jsonl"

        def hang_spans(trace: Path = trace) -> list[dict[str, Any]]:
            lines = trace.read_text().splitlines()
            return [s for s in map(json.loads, lines) if s.get("phase") == "hang"]

        # a node writes its span once it killed its command, which may come after the
        # evicted node's agent ended (seen once in a full suite run)
        spans = _wait(f"{node}'s hang span", hang_spans, procs, out, timeout_s=60)
        d = spans[0]["detail"]
        assert d["incident"] == 1 and d["dumped_at"] <= d["decided_at"] <= d["killed_at"]
        assert d["stacks"] == [dump.name]
    assert verdict["time"] <= min(s["detail"]["killed_at"] for s in _spans(out, "hang"))
    # the evicted node cannot rejoin
    again = c.nodes[1].run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--controller",
            f"{c.services.controller}:{PORT}",
            "--node",
            "node1",
            "--",
            "true",
        ],
        check=False,
    )
    assert again.returncode == 2 and "exclusion list" in again.stderr
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(timeout=30) == 0


def _spans(out: Path, phase: str) -> list[dict[str, Any]]:
    spans = []
    for path in (out / "trace").glob("node*.jsonl"):
        spans += [
            s for s in map(json.loads, path.read_text().splitlines()) if s.get("phase") == phase
        ]
    return spans


def test_a_crash_gets_its_class_and_the_job_restarts_everywhere(
    cluster_factory, tmp_path: Path
) -> None:
    """node1's rank raises ValueError while a leftover thread keeps its process alive: torchrun
    sees nothing, node0's rank waits inside all_reduce until its hang threshold would fire
    (before: a hang verdict, node1 evicted as the rank outside every collective). The crash,
    seen from the rank's own record, is the verdict's cause. The threshold (8 s) stays above
    the job's own end (gloo and torchrun teardown read as silence on a loaded machine)."""
    c, out, ctl = _job(cluster_factory, 2, tmp_path)
    script = [
        "--crash-rank",
        "1",
        "--crash-at",
        "4",
        "--linger",
        "--steps",
        "8",
        "--step-time",
        "0.1",
    ]
    procs = {n.name: _agent(c, n, out, script, nnodes=2, hang_timeout=8) for n in c.nodes}
    for name, proc in procs.items():
        assert proc.wait(timeout=180) == 0, (out / f"{name}.log").read_text()[-3000:]
    verdicts = _records(out / "ctl" / "controller.jsonl", "verdict")
    assert len(verdicts) == 1, verdicts  # one incident, whatever each node saw
    verdict = verdicts[0]
    assert (verdict["action"], verdict["class"]) == ("restart_in_place", "python_exception")
    primary = verdict["evidence"]["primary"]
    assert primary["node"] == "node1" and primary["evidence"]["exception"] == "ValueError"
    assert primary["rank"] == 1 and verdict["ranks"] == [1]  # the rank's record named it
    assert primary["evidence"]["detected_by"] == "rank_exception"
    assert verdict["nodes"] == []  # restarted in place: nobody evicted
    assert not (out / "excluded.json").exists()
    # both nodes restarted on the verdict and finished the job in attempt 1
    for rank in (0, 1):
        assert json.loads((out / f"done-{rank}-1.json").read_text())["steps"] == 8
    for node in ("node0", "node1"):
        mine = [
            v
            for v in _records(out / "trace" / f"{node}.jsonl", "verdict")
            if v["evidence"].get("from") == "controller"
        ]
        assert [(v["action"], v["evidence"]["local"]) for v in mine] == [
            ("restart_in_place", "restart")
        ], node
        # one decision restarts every node: no backoff on top of it (the agents run with 1 s)
        lines = map(json.loads, (out / "trace" / f"{node}.jsonl").read_text().splitlines())
        restarts = [d for d in lines if d.get("phase") == "restart"]
        assert [d["detail"]["delay_s"] for d in restarts] == [0.0], (node, restarts)
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(timeout=30) == 0
    assert os.path.exists(out / "ctl" / "controller.jsonl")


def test_a_mismatched_collective_on_the_cluster_stops_with_the_tracers_evidence(
    cluster_factory, tmp_path: Path
) -> None:
    """Rank 1 all_reduces 16 floats at step 4 where rank 0 reduces 8: gloo aborts a rank
    (SIGABRT) and the other fails with the reset. Before: classed killed_by_signal, the
    stop-time checks run, restarted in place (the tracer's mismatch came in the evidence
    only, and a restart repeats the fault). Now: a code fault, the job stops, no checks, no
    restart, the mismatch's signatures in the verdict."""
    c, out, ctl = _job(cluster_factory, 2, tmp_path)
    script = ["--mismatch-rank", "1", "--mismatch-at", "4", "--steps", "8", "--step-time", "0.1"]
    procs = {
        n.name: _agent(
            c,
            n,
            out,
            script,
            nnodes=2,
            hang_timeout=8,
            run_args=("--colltrace", "--colltrace-dir", str(out / f"rings-{n.name}")),
        )
        for n in c.nodes
    }
    for name, proc in procs.items():  # stopped on the verdict, one restart left unused
        assert proc.wait(timeout=180) != 0, (out / f"{name}.log").read_text()[-3000:]
    verdicts = _records(out / "ctl" / "controller.jsonl", "verdict")
    assert len(verdicts) == 1, verdicts
    verdict = verdicts[0]
    assert (verdict["action"], verdict["class"], verdict["nodes"]) == (
        "stop",
        "collective_mismatch",
        [],
    ), verdict["reason"]
    ev = verdict["evidence"]
    assert "check" not in ev  # a code fault: no stop-time checks
    primary = ev["primary"]
    assert primary["evidence"]["signatures"] == {
        "0": "all_reduce float32 x8",
        "1": "all_reduce float32 x16",
    }
    assert verdict["ranks"] == [0, 1]  # two ranks that differ: neither is the odd one
    first = ev["colltrace"]["findings"][0]
    assert (first["kind"], first["op"]) == ("mismatch", "all_reduce")
    for node in ("node0", "node1"):
        records = _records(out / "trace" / f"{node}.jsonl", "verdict")
        assert [
            (v["action"], v["class"]) for v in records if v["evidence"].get("from") == "controller"
        ] == [("stop", "collective_mismatch")], node
        lines = map(json.loads, (out / "trace" / f"{node}.jsonl").read_text().splitlines())
        assert not [d for d in lines if d.get("phase") == "restart"], node  # no restart
    assert not list(out.glob("done-*"))
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(timeout=30) == 0


def _beat_ranks(c, node: str) -> list[str]:
    """The ranks of ``node``'s last heartbeat summary in the job's store."""
    from torch.distributed import TCPStore

    with c.services.entered():
        store = TCPStore("127.0.0.1", PORT, is_master=False, timeout=datetime.timedelta(seconds=20))
        beat = wire.read(store, wire.Keys("job").node(node, "beat"))
    return sorted((beat.get("ranks") or {}) if beat else [])


def test_a_lost_node_on_the_cluster_is_named_and_replaced(cluster_factory, tmp_path: Path) -> None:
    """node1 is lost (every process of it killed at once, its agent included): node0's rank
    sees gloo's "Connection closed by peer". Before: the verdict was gloo_error on node0's
    rank 0, restart in place, node1 only among the silent and missing dumps. Now node1 is
    the subject, replaced: a fresh node (a new name: node1 is on the exclusion list) joins
    node0's restart and the job ends."""
    c, out, ctl = _job(cluster_factory, 2, tmp_path)
    script = ["--steps", "40", "--step-time", "0.2"]
    procs = {n.name: _agent(c, n, out, script, nnodes=2, hang_timeout=20) for n in c.nodes}
    _wait(
        "two running ranks",
        lambda: all((out / f"running-{r}").exists() for r in (0, 1)),
        procs,
        out,
    )
    # node1's heartbeat summary names its rank (published at most once a second: a node
    # lost before it is named without its ranks, unless its tracer window names them)
    _wait(
        "node1's rank in its heartbeat summary",
        lambda: _beat_ranks(c, "node1") == ["1"],
        procs,
        out,
    )
    lost_at = time.time()
    c.kill_node(1)
    assert procs.pop("node1").wait(timeout=10) == -signal.SIGKILL
    verdicts = _wait(
        "verdict", lambda: _records(out / "ctl" / "controller.jsonl", "verdict"), procs, out
    )
    verdict = verdicts[0]
    assert (verdict["action"], verdict["class"], verdict["nodes"], verdict["ranks"]) == (
        "replace_and_restart",
        "node_lost",
        ["node1"],
        [1],
    ), verdict["reason"]
    ev = verdict["evidence"]
    assert ev["lost"] == ["node1"] and ev["primary"]["node"] == "node1"
    assert ev["primary"]["evidence"]["seen_as"]["node"] == "node0"  # who saw it die
    assert verdict["time"] - lost_at < 15  # the ack wait, not the 15 s dump wait
    assert json.loads((out / "excluded.json").read_text())["nodes"]["node1"]["class"] == "node_lost"
    procs["node1b"] = _agent(
        c, c.replace_node(1), out, script, nnodes=2, hang_timeout=20, name="node1b"
    )  # a new machine: node1 is excluded
    for name, proc in procs.items():
        assert proc.wait(timeout=240) == 0, (out / f"{name}.log").read_text()[-3000:]
    # node0 in its second attempt, the new node in its first
    assert [
        json.loads((out / f"done-{r}-{a}.json").read_text())["steps"] for r, a in ((0, 1), (1, 0))
    ] == [40, 40]
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(timeout=30) == 0
