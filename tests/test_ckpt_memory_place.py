"""Which node keeps a rank's peer copy: one outside the rank's parallel groups.

The choice (``ckpt.memory_place.choose_peer``) on the usual layouts, and one job of three
ranks on three "nodes" (their own memory directories and peer servers) whose copies land
where the layout says, not on the neighbouring node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ckpt_memory import TOKEN, results
from test_ckpt_memory_peer import held, run_job

from ckpt import CheckpointError
from ckpt.memory import DIR_ENV, LAYOUT_ENV, MemoryConfig, MemoryTier
from ckpt.memory_peer import PeerServer
from ckpt.memory_place import choose_peer, parse_layout

EIGHT = ["a:1", "a:1", "b:1", "b:1", "c:1", "c:1", "d:1", "d:1"]  # 4 nodes, 2 ranks each


def test_dp_by_tp_copies_leave_every_group() -> None:
    """tp within a node, dp across: a node hosting none of the rank's dp partners."""
    layout = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2, 4], [1, 3, 5], [6], [7]]}
    got = [choose_peer(r, EIGHT, layout) for r in range(8)]
    # rank 0 shares tp with 1 (node a) and dp with 2 (b) and 4 (c): node d
    assert got == ["d:1", "d:1", "d:1", "d:1", "d:1", "d:1", "a:1", "a:1"]
    for r, peer in enumerate(got):
        partners = {p for g in layout["tp"] + layout["dp"] if r in g for p in g}
        assert peer not in {EIGHT[p] for p in partners}
    assert [choose_peer(r, EIGHT, None) for r in (0, 2, 7)] == ["b:1", "c:1", "a:1"]


def test_pipeline_and_data_parallel_skip_the_stage_neighbours() -> None:
    """pp stages on consecutive nodes: the next node is the next stage, so it is skipped."""
    layout = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }
    assert [choose_peer(r, EIGHT, layout) for r in range(8)] == [
        "d:1",
        "d:1",
        "c:1",
        "c:1",
        "b:1",
        "b:1",
        "a:1",
        "a:1",
    ]


def test_one_group_or_no_other_node_falls_back_to_the_neighbour() -> None:
    one = {"dp": [list(range(8))]}  # every node shares the group: the neighbouring node
    assert [choose_peer(r, EIGHT, one) for r in (0, 3, 6)] == ["b:1", "c:1", "a:1"]
    assert choose_peer(0, ["a:1", "a:1"], {"dp": [[0, 1]]}) == ""  # one node: no peer
    assert choose_peer(1, ["a:1", ""], None) == ""  # the rank serves nothing


def test_a_bad_layout_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ckpt.memory_layout .* is not JSON"):
        parse_layout("{dp: 1}", where="ckpt.memory_layout")
    with pytest.raises(ValueError, match=r"dimension 'dp' names rank\(s\) \[4\]"):
        parse_layout({"dp": [[0, 4]]}, 4)
    with pytest.raises(CheckpointError, match=LAYOUT_ENV):
        MemoryConfig.from_env({DIR_ENV: str(tmp_path), LAYOUT_ENV: '{"tp": [0, 1]}'})
    assert MemoryConfig.from_env(
        {DIR_ENV: str(tmp_path), LAYOUT_ENV: '{"tp": [[0, 1]]}'}
    ).layout == {"tp": [[0, 1]]}
    with pytest.raises(CheckpointError, match="outside"):
        MemoryTier(MemoryConfig(str(tmp_path), layout={"tp": [[0, 5]]}), rank=0, world_size=2)


def test_copies_land_on_the_node_the_layout_chooses(tmp_path: Path) -> None:
    """Ranks 0 and 1 share a tp group and live on nodes 0 and 1: both copy to node 2 (not
    rank 0's neighbour, node 1); rank 2, in no group with them, copies to node 0."""
    dirs = [tmp_path / f"node-{i}" for i in range(3)]
    servers = []
    for d in dirs:
        servers.append(PeerServer(str(d / "peers"), token=TOKEN).start())  # both made 0700
    try:
        spec = {
            "world": 3,
            "numel": 1000,
            "steps": 2,
            "durable": f"file://{tmp_path}/durable",
            "durable_every": 100,
            "layout": {"tp": [[0, 1], [2]]},
        }
        job = run_job(
            spec,
            [{"dir": str(d), "server": s.address} for d, s in zip(dirs, servers, strict=True)],
            tmp_path / "res",
        )
        assert job.returncode == 0, job.stderr[-3000:]
        got = results(tmp_path / "res")
        assert [got[r]["push"]["peer"] for r in range(3)] == [
            servers[2].address,
            servers[2].address,
            servers[0].address,
        ]
        assert all(got[r]["push"]["ok"] for r in range(3))
        peers = [d / "peers" for d in dirs]
        assert held(peers[2], 0) == held(peers[2], 1) == [0, 1]
        assert held(peers[0], 2) == [0, 1]
        assert held(peers[1], 0) == held(peers[1], 1) == held(peers[1], 2) == []
    finally:
        for s in servers:
            s.close()
