"""The controller's fail-slow rounds, its reaction to a NaN or a loss jump, and the stop-time
checks it orders after a NaN or an unclear crash: the round logic on constructed stacks, the
controller on a real TCPStore in this process (check results from the real reference step),
and two jobs on the cluster fixture (a slowed rank; a NaN with one node computing wrong
bits)."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path

import pytest
import test_robust_controller
from test_robust_controller import _agent, _job, _records, _wait

from bootseer.robust import wire
from bootseer.robust.check import RankResult, reference_step
from bootseer.robust.controller import Controller
from bootseer.robust.events import Event
from bootseer.robust.failslow import FailSlowRounds
from bootseer.robust.remote import ControllerLink
from bootseer.robust.stacks import ProcessStacks

WAITING = (
    'Thread 7 (idle): "MainThread"\n'
    "    all_reduce (torch/distributed/distributed_c10d.py:3252)\n"
    "    main (controller_job.py:58)\n"
)
WORKING = (
    'Thread 8 (active): "MainThread"\n'
    "    slow_step (controller_job.py:34)\n"
    "    main (controller_job.py:57)\n"
)


store = test_robust_controller.store  # the fixture: a TCPStore in this process


def _samples(outside: set[int], ranks: int = 4) -> list[ProcessStacks]:
    return [
        ProcessStacks.from_text(WORKING if r in outside else WAITING, rank=r, node=f"n{r // 2}")
        for r in range(ranks)
    ]


# -- the rounds, on constructed records -------------------------------------------------------


def test_the_rank_outside_the_collective_names_its_group_after_five_rounds() -> None:
    """A synchronous job: every rank has the same step time, the stacks name the straggler.
    The job steps at 1.0 s for 3 rounds, then at 2.0 s (everyone waits for rank 3): rank 3
    outside the collective in 3 of 5 rounds names its group."""
    layout = {"dp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]}
    rounds = FailSlowRounds(layout=layout)
    for t in range(3):  # the job's own pace, nobody outside
        assert rounds.round(dict.fromkeys(range(4), 1.0), float(t), samples=_samples(set())) is None
    slow = dict.fromkeys(range(4), 2.0)
    seen = [
        rounds.round(slow, float(t), samples=_samples({3} if t != 4 else {0})) for t in range(3, 7)
    ]
    assert seen[:3] == [None] * 3  # rank 3 flagged at 3 and 5, rank 0 at 4
    event = seen[3]
    assert event is not None and (event.kind, event.failure_class) == ("fail_slow", "fail_slow")
    ev = event.evidence
    assert ev["slow_ranks"] == [3] and ev["most_flagged"] == [3]
    assert ev["rounds_flagged"] == {"0": 1, "3": 3}
    assert ev["group"] == "dp[1]" and ev["group_ranks"] == [2, 3] and ev["group_nodes"] == ["n1"]
    assert ev["rounds"][-1] == {"3": ["outside_collective"]}
    assert rounds.job_times == [1.0, 1.0, 1.0]  # the slow rounds are not the baseline
    # a restarted controller carries on from the stored doc
    again = FailSlowRounds.from_doc(json.loads(json.dumps(rounds.to_doc())), layout=layout)
    assert again.runs == rounds.runs and again.history == rounds.history
    assert again.job_times == rounds.job_times and again.slowed(slow)


def test_a_healthy_rank_sampled_outside_the_collective_at_a_steady_pace_is_not_slow() -> None:
    """The 20-minute soak's false eviction: with a save every step, one stack sample a round
    finds 1 to 4 healthy ranks outside the collective now and then (here rank 1 in 4 of 5
    rounds) while the job steps at its usual pace: nobody is slow. Once the job slows to
    1.5x its pace, the same samples name rank 1."""
    rounds = FailSlowRounds()
    steady = dict.fromkeys(range(4), 0.3)
    for t in range(12):
        outside = {1, 2} if t % 5 else set()
        assert rounds.round(steady, float(t), samples=_samples(outside)) is None, t
        assert rounds.history[-1] == {}, t  # (the first 3 rounds learn the pace)
    slowed = dict.fromkeys(range(4), 0.45)
    seen = [rounds.round(slowed, float(t), samples=_samples({1})) for t in range(12, 15)]
    assert seen[:2] == [None, None] and seen[2] is not None
    assert seen[2].evidence["slow_ranks"] == [1]


def test_a_slow_node_by_step_time_and_no_verdict_under_three_of_five_rounds() -> None:
    nodes = {0: "n0", 1: "n0", 2: "n1", 3: "n1", 4: "n2", 5: "n2"}
    slow = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.9, 5: 2.0}
    rounds = FailSlowRounds()
    for t in range(4):  # flagged, not, flagged, flagged: 3 flagged, but 5 rounds not in yet
        assert rounds.round(slow if t != 1 else dict.fromkeys(nodes, 1.0), t, nodes=nodes) is None
    event = rounds.round(slow, 4.0, nodes=nodes)
    assert event is not None
    assert event.evidence["group_nodes"] == ["n2"] and event.evidence["group_ranks"] == [4, 5]
    assert event.node == "n2"
    assert set(event.evidence["rounds"][-1]["5"]) == {"step_time", "node_step_time"}
    assert FailSlowRounds().flags({0: 1.0, 1: 1.4}, {}) == {}  # under 1.5x: not slow
    # 3 of the last 5, not in a row (the soak's straggler: flagged in rounds 21, 23, 24, 26)
    gaps = FailSlowRounds()
    seen = [
        gaps.round(slow if t % 2 == 0 else dict.fromkeys(nodes, 1.0), t, nodes=nodes)
        for t in range(5)
    ]
    assert seen[:4] == [None] * 4 and seen[4] is not None
    assert seen[4].evidence["group_nodes"] == ["n2"]
    twice = FailSlowRounds()
    assert all(
        twice.round(slow if t in (1, 3) else dict.fromkeys(nodes, 1.0), t, nodes=nodes) is None
        for t in range(6)
    )  # 2 of 5: nobody
    with pytest.raises(ValueError, match="need 1 <= rounds <= window"):
        FailSlowRounds(rounds=6, window=5)


# -- the controller on a real store in this process -------------------------------------------


def _result(node: str, index: int, perturb: bool = False) -> dict:
    out, grad = reference_step(perturb=perturb)
    return dataclasses.asdict(RankResult(index, node, 0, out, grad, 0.01, 1 << 20))


def _incident(store, event: Event, answering=("n0", "n1", "n2")):
    now = [100.0]
    links = {n: ControllerLink(store, n) for n in ("n0", "n1", "n2")}
    for link in links.values():
        link.register()
    links[event.node].publish(event)
    ctl = Controller(
        store,
        settle_s=0,
        failslow_interval_s=0,
        check_wait_s=30,
        clock=lambda: now[0],
        log=lambda _: None,
    )
    assert ctl.step() is None  # opened, the dump ordered
    for n in answering:
        links[n].answer(1, [])
    assert ctl.step() is None  # every answer in: one more pass
    return ctl, links, now


def test_an_unclear_crash_orders_the_checks_and_evicts_the_node_whose_bits_differ(store) -> None:
    crash = Event(
        "crash", "killed_by_signal", node="n0", time=100.0, evidence={"signal": "SIGKILL"}
    )
    ctl, links, _ = _incident(store, crash)
    assert ctl.step() is None  # the checks are ordered, nothing decided yet
    order = links["n2"].check_order(1)
    assert order is not None and order["nodes"] == ["n0", "n1", "n2"]
    assert links["n0"].check_order(2) is None
    for i, n in enumerate(("n0", "n1", "n2")):
        assert ctl.step() is None  # still waiting for the others' results
        links[n].answer_check(1, _result(n, i, perturb=n == "n1"))
    verdict = ctl.step()
    assert verdict is not None
    assert (verdict.action, verdict.failure_class, verdict.nodes) == (
        "replace_and_restart",
        "killed_by_signal",
        ("n1",),
    )
    check = verdict.evidence["check"]
    assert [(f["node"], f["check"]) for f in check["failed"]] == [("n1", "bitwise_alignment")]
    out, grad = reference_step()
    assert check["failed"][0]["majority"] == [out, grad]
    assert check["failed"][0]["output"] != out
    assert "n1 failed bitwise_alignment" in verdict.reason
    assert links["n1"].local_action(verdict) == "stop"
    assert links["n0"].local_action(verdict) == "restart"


def test_a_jump_stops_the_job_and_clean_checks_restart_it_in_place(store) -> None:
    spike = Event(
        "spike",
        "spike",
        node="n2",
        rank=2,
        step=40,
        time=100.0,
        evidence={"metric": "loss", "value": 50.0, "median": 2.0, "factor": 5.0},
    )
    ctl, links, _ = _incident(store, spike)
    assert ctl.step() is None
    for i, n in enumerate(("n0", "n1", "n2")):
        links[n].answer_check(1, _result(n, i))
    verdict = ctl.step()
    assert verdict is not None and verdict.action == "restart_in_place"
    assert verdict.evidence["check"]["failed"] == [] and verdict.nodes == ()
    assert "checks found no faulty node" in verdict.reason


def test_a_check_that_cannot_run_is_reported_and_not_waited_for(store) -> None:
    crash = Event("crash", "unknown", node="n1", time=100.0)
    ctl, links, _ = _incident(store, crash)
    assert ctl.step() is None
    links["n0"].answer_check(1, _result("n0", 0))
    links["n1"].answer_check(1, _result("n1", 1))
    links["n2"]._check_failed(1, 2)  # its `bootseer check` exited with 2, no result
    verdict = ctl.step()  # at once: --check-wait (30 s here) is not waited out
    assert verdict is not None and verdict.action == "restart_in_place" and verdict.nodes == ()
    check = verdict.evidence["check"]
    assert check["errors"] == {"n2": "bootseer check on n2 exited with 2 without a result"}
    assert check["missing"] == ["n2"] and check["failed"] == []
    assert "alignment: all 2 ranks bit-identical" in check["text"]  # n0 and n1 compared


def test_a_lost_node_is_no_unclear_crash_no_checks(store) -> None:
    crash = Event("crash", "killed_by_signal", node="n0", time=100.0)
    ctl, links, now = _incident(store, crash, answering=("n0", "n1"))  # n2 is gone
    now[0] += 11  # past --dump-wait
    verdict = ctl.step()
    assert verdict is not None and verdict.evidence["missing_dumps"] == ["n2"]
    assert "check" not in verdict.evidence
    assert wire.get(store, wire.Keys().check_request(1)) is None


def test_a_round_reads_step_times_and_samples_from_the_nodes(store) -> None:
    """The controller's side of a round: beats with step times, the sample order answered
    by each node's link (its dump tool standing in for py-spy), the flags in the store. The
    job steps every 0.5 s for 4 rounds with every rank in the collective, then every 2 s with
    n1's rank outside it (everyone waits for it): n1 is named once 3 slow rounds are in."""
    now = [0.0]
    links = [ControllerLink(store, f"n{i}") for i in range(3)]
    slow = [False]
    for i, link in enumerate(links):
        link.register()
        link.sample_tool = lambda pid, i=i: WORKING if i == 1 and slow[0] else WAITING
    ctl = Controller(store, failslow_interval_s=1.0, clock=lambda: now[0], log=lambda _: None)
    stamp = time.time()
    for t in range(10):
        now[0] = float(t)
        slow[0] = t >= 4
        dt = 2.0 if slow[0] else 0.5
        for i, link in enumerate(links):  # two heartbeats a round, dt apart
            link._note_step(i, 2 * t, stamp)
            link._last_beat = float("-inf")
            link.beat(0, {i: {"step": 2 * t + 1, "time": stamp + dt, "pid": 100 + i}})
            if link._sampler is not None:
                link._sampler.join(10)
        stamp += 2 * dt
        assert ctl.step() is None  # the incident opens in the round that names n1
        if store.check([wire.Keys().open]):
            break
    opened = wire.read(store, wire.Keys().open)
    event = opened["events"][0]
    assert (event["kind"], event["node"]) == ("fail_slow", "n1")
    assert event["evidence"]["group_nodes"] == ["n1"] and event["evidence"]["slow_ranks"] == [1]
    rounds = event["evidence"]["rounds"]
    assert sum(r == {"1": ["outside_collective"]} for r in rounds) == 3
    assert all(r in ({}, {"1": ["outside_collective"]}) for r in rounds)
    assert wire.read(store, wire.Keys().dump_request)["incident"] == 1
    times = event["evidence"]["step_times_s"]
    assert sorted(times) == ["0", "1", "2"] and len(set(times.values())) == 1
    assert times["1"] > 0.75  # 1.5x the job's pace of 0.5 s


def test_a_link_the_tracer_suspects_is_probed_and_its_node_evicted(store) -> None:
    """The rings the nodes ship show all_reduce #21 issued by every rank and completed by
    none, nobody stopped ('transport', no rank to blame): the controller asks every node at
    once to probe its own link to the store (an order of its own, not the next round's). n1
    reaches the store through a shaping proxy (1 MB/s, 20 ms each way), n0 and n2 directly;
    once every answer is in, n1's link is named, and the fail_slow incident it opens evicts
    n1 alone."""
    from bootseer.testing.shaper import Shaper, ShaperSettings

    keys = wire.Keys()
    now = [103.0]
    said: list[str] = []
    shaper = Shaper(
        "127.0.0.1", store.port, ShaperSettings.from_mb(latency_ms=20, per_conn_mbps=1.0)
    ).start()
    try:
        links = _link_job(store, dict.fromkeys(range(3), 103.0), {1: shaper.address})
        ctl = Controller(store, failslow_interval_s=1.0, clock=lambda: now[0], log=said.append)
        assert ctl.step() is None  # the suspicion, an order to probe
        order = wire.read(store, keys.link_request)
        assert any("every node probes its link now" in line for line in said), said
        base = time.time()
        for i, link in enumerate(links[:2]):
            link.beat(0, {i: {"step": 3, "time": base, "pid": 100 + i}})
            assert link._prober is not None
            link._prober.join(60)
        now[0] += 0.25
        assert ctl.step() is None and not store.check([keys.open])  # n2's answer awaited
        links[2].beat(0, {2: {"step": 3, "time": base, "pid": 102}})
        links[2]._prober.join(60)
        assert store.check([keys.link_probe("n2", order["id"])])
        now[0] += 0.25
        assert ctl.step() is None  # every answer in: the incident opens
        opened = wire.read(store, keys.open)
        [event] = opened["events"]
        assert (event["kind"], event["node"]) == ("fail_slow", "n1")
        ev = event["evidence"]
        assert (ev["cause"], ev["group_nodes"]) == ("slow_link", ["n1"])
        probes = ev["probes"]
        assert sorted(probes) == ["n0", "n1", "n2"]
        assert probes["n1"]["mbps"] < 10 < min(probes["n0"]["mbps"], probes["n2"]["mbps"])
        assert "n1's link is slow" in "\n".join(said)
        for link in links:
            link.answer(1, [])
        verdict = None
        for _ in range(10):  # past the controller's settle time
            now[0] += 1.0
            if (verdict := ctl.step()) is not None:
                break
        assert verdict is not None, said
        assert (verdict.action, verdict.failure_class, verdict.nodes) == (
            "replace_and_restart",
            "fail_slow",
            ("n1",),
        )
    finally:
        shaper.stop()


def _link_job(
    store,
    shipped: dict[int, float],
    via: dict[int, str] | None = None,
    wait: tuple[int, ...] = (0, 1, 2),
) -> list[ControllerLink]:
    """Nodes n0..n2 with a rank each, linked to the controller's store (node i through
    ``via[i]``, a shaping proxy); each ships its window at ``shipped[i]``: 20 ops of grp-a,
    and the ranks in ``wait`` issued #21 at t=100 and wait in it, alive."""
    from test_colltrace import _history, _windows

    plan = {r: {"grp-a": [*_history(), *([(100.0, None)] if r in wait else [])]} for r in range(3)}
    docs = _windows(plan, shipped, name="n")
    links = []
    for i in range(3):
        link = ControllerLink(store, f"n{i}", address=(via or {}).get(i, f"127.0.0.1:{store.port}"))
        link.register()
        link.sample_tool = lambda pid: WAITING
        wire.put(store, wire.Keys().node(f"n{i}", "colltrace"), docs[f"n{i}"], wire.MAX_DUMP_BYTES)
        links.append(link)
    return links


def _probe(links: list[ControllerLink]) -> None:
    """Each of ``links`` answers the probe order (its beat reads it; the probe's thread)."""
    for i, link in enumerate(links):
        link._last_link_poll = float("-inf")
        link.beat(0, {i: {"step": 3, "time": time.time(), "pid": 100 + i}})
        assert link._prober is not None
        link._prober.join(60)


def test_a_node_silent_since_the_slowdown_is_named_when_it_cannot_answer_its_probe(store) -> None:
    """node1's link carries nothing (the benchmark's tc link stuck): its agent shipped its
    last window at t=99.6, before ranks 0 and 2 issued grp-a #21 (t=100), and answers no
    probe order. Once its window is LINK_STALE_S old the controller suspects it and orders
    the probes; n0 and n2 answer at once, n1 never: LINK_STALE_S after the order n1 is named
    as a probe that failed, and the fail_slow incident evicts it alone. The old controller
    read n1's window as "rank 1 never issued #21" and said nothing."""
    from bootseer.robust.controller import LINK_STALE_S

    keys = wire.Keys()
    now = [102.5]
    said: list[str] = []
    n0, _, n2 = _link_job(store, {0: 102.5, 1: 99.6, 2: 102.5}, wait=(0, 2))
    ctl = Controller(store, failslow_interval_s=1.0, clock=lambda: now[0], log=said.append)
    assert ctl.step() is None and not store.check([keys.link_request])  # 2.9 s: not yet
    now[0] = 99.6 + LINK_STALE_S + 0.1
    assert ctl.step() is None
    assert any(
        "no ring of rank 1 (n1)" in ln and "every node probes its link now" in ln for ln in said
    ), said
    _probe([n0, n2])
    now[0] += LINK_STALE_S - 1.0
    assert ctl.step() is None and not store.check([keys.open])  # n1's answer still awaited
    now[0] += 1.01
    assert ctl.step() is None
    [event] = wire.read(store, keys.open)["events"]
    assert (event["kind"], event["node"]) == ("fail_slow", "n1")
    ev = event["evidence"]
    assert (ev["cause"], ev["group_nodes"]) == ("slow_link", ["n1"])
    assert sorted(ev["probes"]) == ["n0", "n1", "n2"]
    assert ev["probes"]["n1"]["error"].startswith(
        f"no answer to the probe order in {LINK_STALE_S:.1f} s"
    )
    assert min(ev["probes"]["n0"]["mbps"], ev["probes"]["n2"]["mbps"]) > 0
    assert ev["why"].startswith("could not measure its link to the store: no answer")


def test_probes_that_name_nobody_open_nothing_and_pause_the_orders(store) -> None:
    """Every rank waits in #21 ('transport', no rank): the three nodes' probe answers are
    alike (written as an agent writes them: measured figures on a loaded loopback vary
    3x), so nobody is named and no incident opens; the windows still say the same, but
    no new order comes for LINK_QUIET_S; after it, one does."""
    from bootseer.robust.controller import LINK_QUIET_S

    keys = wire.Keys()
    now = [103.0]
    said: list[str] = []
    _link_job(store, dict.fromkeys(range(3), 103.0))
    ctl = Controller(store, failslow_interval_s=1.0, clock=lambda: now[0], log=said.append)
    assert ctl.step() is None
    first = wire.read(store, keys.link_request)["id"]
    for n in ("n0", "n1", "n2"):
        wire.put(
            store,
            keys.link_probe(n, first),
            {
                "node": n,
                "id": first,
                "probe": {
                    "node": n,
                    "rtt_ms": 0.2,
                    "mbps": 300.0,
                    "up_mbps": 300.0,
                    "down_mbps": 310.0,
                },
            },
        )
    now[0] += 0.25
    assert ctl.step() is None and not store.check([keys.open])
    assert any("link probes of n0, n1, n2 name no node" in ln for ln in said), said
    end = now[0] + LINK_QUIET_S
    while now[0] + 5.0 < end:  # a look every 5 s (past LINK_CHECK_S): each one quiet
        now[0] += 5.0
        assert ctl.step() is None
        assert wire.read(store, keys.link_request)["id"] == first
    now[0] = end
    assert ctl.step() is None and not store.check([keys.open])
    assert wire.read(store, keys.link_request)["id"] > first


def _solo(store, tmp_path: Path, argv: list[str], restarts: int):
    """One node's ``bootseer run`` machinery (agent, link, supervisor) in this process with
    the controller in a thread: the agent's side of a NaN or a jump under a controller."""
    from robust_helpers import run_solo

    link = ControllerLink(store, "solo")
    link.register()
    code, sup = run_solo(store, tmp_path, argv, link, restarts=restarts, failslow_interval_s=0)
    return (
        code,
        _records(tmp_path / "ctl.jsonl", "event"),
        _records(tmp_path / "ctl.jsonl", "verdict"),
        sup,
    )


def test_a_jump_goes_to_the_controller_which_stops_the_job(store, tmp_path: Path) -> None:
    from robust_helpers import scenario_argv

    code, events, verdicts, sup = _solo(store, tmp_path, scenario_argv("spike", 60, 8), 0)
    assert code == 128 + signal.SIGKILL  # stopped on the verdict (no restarts allowed)
    assert [(e["kind"], e["step"], e["evidence"]["value"]) for e in events] == [("spike", 8, 10.0)]
    assert [(v["class"], v["action"]) for v in verdicts] == [("spike", "restart_in_place")]
    assert "stopped at the jump: resume from the last checkpoint" in verdicts[0]["reason"]
    assert sup.attempts[0].reason == "verdict"  # not a crash: the controller's order
    dumps = verdicts[0]["evidence"]["dumps"]["solo"]
    assert dumps["sources"] == ["py-spy"] and dumps["ranks"] == [0]  # dumped alive


def test_a_nan_goes_to_the_controller_and_its_verdict_restarts(store, tmp_path: Path) -> None:
    from robust_helpers import scenario_argv

    argv = scenario_argv("nan-once", tmp_path / "count", 4)
    code, events, verdicts, sup = _solo(store, tmp_path, argv, 1)
    assert code == 0  # the second attempt finished
    assert [(e["kind"], e["step"], e["evidence"]) for e in events] == [
        ("nonfinite", 4, {"loss": "nan"})
    ]
    assert [(v["class"], v["action"]) for v in verdicts] == [("nonfinite", "restart_in_place")]
    assert [(a.reason, a.code) for a in sup.attempts] == [
        ("nonfinite", 128 + signal.SIGKILL),
        ("exited", 0),
    ]
    mine = _records(tmp_path / "trace" / "solo.jsonl", "verdict")
    assert [(v["action"], v["evidence"].get("from")) for v in mine] == [
        ("restart_in_place", "controller")
    ]  # the node's own policy did not decide


# -- on the cluster ---------------------------------------------------------------------------


def test_a_slowed_rank_is_found_by_the_rounds_and_only_its_node_evicted(
    cluster_factory, tmp_path: Path
) -> None:
    c, out, ctl = _job(cluster_factory, 3, tmp_path, "--failslow-interval", "1")
    # the job steps at its own pace for 6 s (the rounds learn it), then rank 1 slows down
    script = [
        "--slow-rank",
        "1",
        "--slow-s",
        "0.4",
        "--slow-after-s",
        "6",
        "--step-time",
        "0.02",
        "--steps",
        "100000",
    ]
    procs = {n.name: _agent(c, n, out, script, nnodes=3, max_restarts=0) for n in c.nodes}
    verdicts = _wait(
        "verdict",
        lambda: _records(out / "ctl" / "controller.jsonl", "verdict"),
        procs,
        out,
        timeout_s=180,
    )
    verdict = verdicts[0]
    assert (verdict["action"], verdict["class"]) == ("replace_and_restart", "fail_slow")
    assert verdict["nodes"] == ["node1"], verdict
    primary = verdict["evidence"]["primary"]["evidence"]
    assert primary["group_nodes"] == ["node1"] and primary["slow_ranks"] == [1]
    assert max(primary["rounds_flagged"], key=primary["rounds_flagged"].get) == "1"
    assert "outside_collective" in primary["rounds"][-1]["1"]
    assert list(json.loads((out / "excluded.json").read_text())["nodes"]) == ["node1"]
    for name, proc in procs.items():  # no restarts allowed: every agent ends on the verdict
        assert proc.wait(timeout=60) != 0, name
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(timeout=30) == 0


def test_a_nan_stops_the_job_and_the_checks_name_the_node_with_wrong_bits(
    cluster_factory, tmp_path: Path
) -> None:
    """node2 computes wrong bits and node1's link is slow (tc, 50 Mbit/s): the checks after
    the NaN name both, each with the check it failed (node1 by its neighbour links: a
    job-wide collective only shows that some link is slow)."""
    c, out, ctl = _job(cluster_factory, 3, tmp_path, "--failslow-interval", "0")
    c.slow_link(1, rate="50mbit")
    script = ["--nan-rank", "0", "--nan-at", "6", "--step-time", "0.1", "--steps", "100000"]
    procs = {
        n.name: _agent(
            c,
            n,
            out,
            script,
            nnodes=3,
            max_restarts=0,
            env={"BOOTSEER_CHECK_FAULT": "alignment:*"} if n.name == "node2" else None,
        )
        for n in c.nodes
    }
    verdicts = _wait(
        "verdict",
        lambda: _records(out / "ctl" / "controller.jsonl", "verdict"),
        procs,
        out,
        timeout_s=240,
    )
    verdict = verdicts[0]
    assert (verdict["action"], verdict["class"]) == ("replace_and_restart", "nonfinite")
    assert verdict["nodes"] == ["node1", "node2"], verdict
    ev = verdict["evidence"]
    primary = ev["primary"]
    assert (primary["node"], primary["rank"], primary["step"]) == ("node0", 0, 6)
    assert primary["evidence"] == {"loss": "nan"}
    check = ev["check"]
    assert sorted(check["nodes"]) == ["node0", "node1", "node2"] and check["missing"] == []
    assert [(f["node"], f["check"]) for f in check["failed"]] == [
        ("node1", "link_bandwidth"),
        ("node2", "bitwise_alignment"),
    ]
    links = check["failed"][0]["links"]  # node1's two ring links, by the check's ranks
    me, n = check["nodes"].index("node1"), 3
    assert sorted(links) == sorted([f"{(me - 1) % n}-{me}", f"{me}-{(me + 1) % n}"])
    fast = min(
        t for r in check["results"].values() for pair, t in r["links"].items() if pair not in links
    )
    assert min(links.values()) > 4 * fast, (links, fast)
    hashes = {n: (r["output_hash"], r["grad_hash"]) for n, r in check["results"].items()}
    assert hashes["node0"] == hashes["node1"] == reference_step() != hashes["node2"]
    assert all(r["sum_errors"] == 0 for r in check["results"].values())
    for name, proc in procs.items():
        assert proc.wait(timeout=60) != 0, name
    # each node stopped its command before its check and wrote the controller's verdict
    for node in ("node0", "node1", "node2"):
        mine = [
            v
            for v in _records(out / "trace" / f"{node}.jsonl", "verdict")
            if v["evidence"].get("from") == "controller"
        ]
        assert [v["action"] for v in mine] == ["replace_and_restart"], node
        assert "running the stop-time checks" in (out / f"{node}.log").read_text()
    assert list(json.loads((out / "excluded.json").read_text())["nodes"]) == ["node1", "node2"]
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(timeout=30) == 0
