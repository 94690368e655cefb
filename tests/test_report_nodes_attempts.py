"""``bootseer report`` groups many nodes' restarts by job attempt, not by each node's own
attempt number: a node that replaced a lost one starts counting at 0 while the survivors are
at 1 (``report_nodes.job_attempts``). Traces written here by the real TraceWriter, with known
times."""

from __future__ import annotations

from pathlib import Path

import pytest

from bootseer.report import build_report, load_report
from bootseer.trace import Span, TraceWriter

T0 = 1763700000.0  # the cold start
LOSS = T0 + 100.0  # node3 is lost (SIGKILL to the node): its last event, a failure point
SURVIVORS = ("node0", "node1", "node2")


def attempt(
    w: TraceWriter, node: str, rank0: int, n: int, t: float, env: float, ready: float
) -> None:
    """One ``bootseer run`` attempt: environment, checkpoint prefetch, torchrun, both ranks'
    first step (a collective: every rank of the job ends it at ``ready``)."""
    w.record("environment", t, t + env, attempt=n)
    w.record("checkpoint_prefetch", t, t + 0.5, attempt=n)
    w.record("command_start", t + env, t + env + 0.1, attempt=n)
    for r in (rank0, rank0 + 1):
        TraceWriter(w.dir, node=node, rank=r).record("first_step", t, ready, attempt=n)


def write_traces(root: Path) -> None:
    """4 nodes start cold at T0 (ready T0 + 20); node3 is lost at LOSS. The survivors restart
    (their attempt 1: backoff, environment verified, 1 s); the fresh node3, in a trace
    directory of its own, starts at attempt 0 and restores its environment in 12 s. The job is
    back at LOSS + 30, when the fresh node's ranks finish the first step."""
    for i, node in enumerate(SURVIVORS):
        w = TraceWriter(root / f"{node}.g1", node=node)
        attempt(w, node, 2 * i, 0, T0, 2.0, T0 + 20.0)
        w.record("restart", LOSS + 3.0, LOSS + 4.0, attempt=1, reason="exit_code=1")
        attempt(w, node, 2 * i, 1, LOSS + 4.0, 1.0 + 0.01 * i, LOSS + 30.0)
    old = TraceWriter(root / "node3.g1", node="node3")
    attempt(old, "node3", 6, 0, T0, 2.0, T0 + 20.0)
    old.record("failure", LOSS, LOSS, outcome="failed", reason="node lost")
    fresh = TraceWriter(root / "node3.g2", node="node3")
    attempt(fresh, "node3", 6, 0, LOSS + 15.0, 12.0, LOSS + 30.0)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("attempts")
    write_traces(root)
    return root


def test_a_replacement_s_first_attempt_is_the_survivors_second(traces: Path) -> None:
    cold, restart = load_report([traces]).incidents
    assert (cold.attempt, cold.kind, cold.start_at) == (0, "start", T0)
    assert cold.node_attempts == {"node0": [0], "node1": [0], "node2": [0], "node3": [0]}
    assert cold.first_step_at == T0 + 20.0  # not the fresh node's LOSS + 30
    assert (cold.ready_nodes, cold.nodes) == (4, 4)
    assert (restart.attempt, restart.kind) == (1, "restart")
    assert restart.node_attempts == {"node0": [1], "node1": [1], "node2": [1], "node3": [0]}
    # it starts at the loss (node3's failure point of the cold start), ends when the job is back
    assert (restart.start_at, restart.start_from) == (LOSS, "failure")
    assert restart.wall_s == pytest.approx(30.0) and (restart.ready_nodes, restart.nodes) == (4, 4)
    # the fresh node's phases are the restart's, placed from the loss; not the cold start's
    [node3] = [t for t in restart.timeline if t.node == "node3"]
    assert [(s.phase, s.start, s.end) for s in node3.segments][:2] == [
        ("checkpoint_prefetch", 15.0, 15.5),
        ("environment", 15.5, 27.0),
    ]
    assert sum(restart.cost.values()) == pytest.approx(restart.wall_s)


def test_the_fresh_node_straggles_among_the_restart_s_nodes(traces: Path) -> None:
    """Node stragglers compare nodes within a job attempt: the fresh node's 12 s environment
    against the survivors' 1 s verifications of the same restart (numbered by node, its
    attempt 0 would have merged with the lost node's cold start into one 127 s window)."""
    rep = load_report([traces])
    [s] = rep.node_stragglers
    assert (s.phase, s.node, s.attempt) == ("environment", "node3", 1)
    assert s.seconds == pytest.approx(12.0) and s.median == pytest.approx(1.015, abs=1e-6)


def test_nodes_that_restart_together_keep_their_own_numbers(traces: Path) -> None:
    """Every node's bootseer run restarting (the same attempt number everywhere): the job
    attempts are the nodes' attempts, one node failing twice in a row is two attempts."""
    spans = []
    for i, node in enumerate(("a", "b", "c")):
        for n in range(3):
            t = T0 + 100.0 * n
            spans += [Span(node, None, "restart", t, t + 1, attempt=n)] if n else []
            spans += [
                Span(node, None, "environment", t + 1, t + 2, attempt=n),
                Span(node, i, "first_step", t + 1, t + 10, attempt=n),
            ]
    spans.append(Span("b", None, "failure", T0 + 50, T0 + 50, attempt=0, outcome="failed"))
    rep = build_report(spans)
    assert [(i.attempt, i.node_attempts, i.start_from) for i in rep.incidents] == [
        (0, {"a": [0], "b": [0], "c": [0]}, "first_span"),
        (1, {"a": [1], "b": [1], "c": [1]}, "failure"),
        (2, {"a": [2], "b": [2], "c": [2]}, "restart"),
    ]
    assert rep.incidents[1].start_at == T0 + 50


def test_a_launchers_restart_of_its_ranks_is_an_incident_of_its_own(tmp_path: Path) -> None:
    """torchrun restarted its workers inside attempt 0 (a rank killed at T0 + 50): the
    agents wrote ``relaunch`` spans and the new ranks' first steps (``generation`` 1). The
    report's incidents are ETTR's launches: the cold start ready at T0 + 10, the relaunch
    from the death to T0 + 60. Before, both launches were one run of attempt 0: one
    incident whose first step was the relaunch's (T0 + 60), the cold start's 10 s lost."""
    from bootseer.robust.ettr import compute_ettr
    from bootseer.trace import read_traces

    for i, node in enumerate(("node0", "node1")):
        w = TraceWriter(tmp_path / node, node=node)
        pid = {"pid": 100 + i}
        w.record("command_start", T0, T0 + 1.0, attempt=0, **pid)
        TraceWriter(w.dir, node=node, rank=i).record("first_step", T0, T0 + 10.0, attempt=0, **pid)
        w.record(
            "relaunch",
            T0 + 50.0,
            T0 + 54.0 + i,
            attempt=0,
            reason="crash",
            exited_at=T0 + 50.0,
            generation=1,
            failed_rank=1,
            **pid,
        )
        TraceWriter(w.dir, node=node, rank=i).record(
            "first_step", T0 + 54.0 + i, T0 + 60.0, attempt=0, generation=1, **pid
        )
    cold, again = load_report([tmp_path]).incidents
    assert (cold.kind, cold.first_step_at, cold.wall_s) == ("start", T0 + 10.0, 10.0)
    assert (again.kind, again.start_at, again.start_from, again.first_step_at) == (
        "restart",
        T0 + 50.0,
        "restart",
        T0 + 60.0,
    )
    assert again.node_attempts == {"node0": [0], "node1": [0]}  # the nodes' own attempt
    assert sum(again.cost.values()) == pytest.approx(again.wall_s)
    spans, _ = read_traces([tmp_path])
    [incident] = compute_ettr(spans, end=T0 + 100.0).incidents  # the same launches
    assert (incident.start, incident.end) == (again.start_at, again.first_step_at)
