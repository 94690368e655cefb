"""The action table and the exclusion list."""

from __future__ import annotations

import multiprocessing

import pytest

from bootseer.robust.classify import CLASSES
from bootseer.robust.events import Event
from bootseer.robust.policy import ACTIONS, TABLE, ActionRule, ExclusionList, decide


def crash(cls, node="node-2", rank=5):
    return Event("crash", cls, node=node, rank=rank, step=100, time=50.0)


def test_the_table_covers_every_class_with_known_actions():
    classes = {r.failure_class for r in TABLE}
    assert set(CLASSES) <= classes
    assert {"hang", "nonfinite", "spike", "fail_slow"} <= classes
    for row in TABLE:
        assert {row.action, row.on_update or "stop", (row.escalate or (1, "stop"))[1]} <= set(
            ACTIONS
        ), row


def test_user_errors_stop_and_a_recent_update_is_rolled_back():
    stop = decide(crash("user_error"))
    assert (stop.action, stop.nodes, stop.ranks) == ("stop", (), (5,))
    assert "deterministic" in stop.reason
    back = decide(crash("user_error"), recent_update=True)
    assert back.action == "rollback" and "roll it back" in back.reason


def test_node_faults_replace_the_node_and_hangs_the_suspects():
    cuda = decide(crash("cuda_error"))
    assert (cuda.action, cuda.nodes) == ("replace_and_restart", ("node-2",))
    hang = decide(
        Event("hang", "hang", rank=3, time=1.0), suspect_nodes=["node-b"], suspect_ranks=[2, 3]
    )
    assert (hang.action, hang.nodes, hang.ranks) == ("replace_and_restart", ("node-b",), (2, 3))
    nobody = decide(Event("hang", "hang", time=1.0))
    assert nobody.action == "restart_in_place" and "no suspect node" in nobody.reason


def test_a_repeated_class_on_the_same_node_escalates():
    first = decide(crash("nccl_error"))
    assert (first.action, first.nodes) == ("restart_in_place", ())
    elsewhere = decide(crash("nccl_error", node="node-7"), history=[first])
    assert elsewhere.action == "restart_in_place"
    second = decide(crash("nccl_error"), history=[first])
    assert (second.action, second.nodes, second.evidence["repeats"]) == (
        "replace_and_restart",
        ("node-2",),
        2,
    )


def test_no_progress_across_restarts_stops():
    assert decide(crash("storage_error"), progress=[100, 250, 260]).action == "restart_in_place"
    stuck = decide(crash("storage_error"), progress=[100, 250, 250, 240, 250])
    assert stuck.action == "stop"
    assert stuck.reason.startswith(
        "no progress across 3 restarts (steps reached: 100, 250, 250, 240, 250)"
    )
    assert decide(crash("storage_error"), progress=[100, 250, 250, 240, 251]).action == (
        "restart_in_place"
    )


def _add_many(path, worker):
    for i in range(10):
        ExclusionList(path).add([f"node-{worker}-{i}"], f"worker {worker}", time=float(i))


def test_exclusion_list_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "excluded.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_many, args=(path, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    nodes = ExclusionList(path).nodes()
    assert len(nodes) == 40 and nodes["node-3-9"] == {"reason": "worker 3", "time": 9.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".excluded.json.lock",
        "excluded.json",
    ]  # no temp left
    ExclusionList(path).remove(["node-3-9"])
    assert "node-3-9" not in ExclusionList(path) and "node-3-8" in ExclusionList(path)


def test_an_unreadable_exclusion_list_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "excluded.json"
    path.write_text('{"nodes": ["node-1"]')
    with pytest.raises(
        ValueError, match=f"exclusion list {path} is not readable .*fix it or move it away"
    ):
        ExclusionList(path).add(["node-2"], "cuda_error")
    assert path.read_text() == '{"nodes": ["node-1"]'


def test_a_table_without_the_class_or_unknown_is_refused_by_name():
    table = (ActionRule("user_error", "stop", "deterministic"),)
    with pytest.raises(ValueError, match="no action for class 'cuda_error' and no 'unknown' row"):
        decide(crash("cuda_error"), table=table)
