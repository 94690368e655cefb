"""The memory tier's push to the peer, as the caller sees it: ``CheckpointManager.wait()``
returns once the peer holds the last step (its bytes the ones saved) and says what the peer
acked; a push that fails or hangs is raised there, naming the peer, bounded in time; the
node's own copy stays loadable. With replication ``sync`` the save itself returns only once
the peer acked the step, or raises."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memckpt_worker import exact
from memckpt_worker import state_at as state_of_worker
from test_ckpt_memory import NUMEL, TOKEN, WORKER, worker_env

from ckpt import CheckpointError, CheckpointManager
from ckpt.memory import (
    DIR_ENV,
    REPLICATION_ENV,
    MemoryConfig,
    MemoryPushError,
    MemoryTier,
    load_slot,
)
from ckpt.memory_peer import PeerClient, PeerServer
from ckpt.memory_slot import SlotFile


def state_at(step: int) -> dict:
    return {"w": torch.arange(400_000, dtype=torch.float32) * step, "step": step}


def test_wait_returns_once_the_peer_holds_the_last_step(tmp_path: Path) -> None:
    shm, peer_dir = tmp_path / "shm", tmp_path / "peer"
    shm.mkdir(mode=0o700)
    peer_dir.mkdir(mode=0o700)
    server = PeerServer(str(peer_dir), token=TOKEN).start()
    try:
        cfg = MemoryConfig(str(shm), peer=server.address, durable_every=100, token=TOKEN)
        with CheckpointManager(f"file://{tmp_path}/durable", memory=cfg) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state_at(step))
            mgr.wait()
            # no sleep, no poll: wait() returned after the peer committed step 3
            with PeerClient(server.address, token=TOKEN) as client:
                assert 3 in client.listing(0, 1)
                into = SlotFile(str(tmp_path / "fetched"))
                head = client.fetch(0, 3, into)
            got = {"w": torch.zeros(400_000), "step": -1}
            load_slot(into, head, got)
            into.close()
            assert torch.equal(got["w"], state_at(3)["w"]) and got["step"] == 3
            assert mgr.memory.push_state() == {"acked": 3, "in_flight": None, "queued": None}
            log = list(mgr.memory.push_log)
            assert [(e["step"], e["ok"]) for e in log] == [(1, True), (2, True), (3, True)]
            assert all(e["committed"] <= e["start"] <= e["end"] for e in log)
    finally:
        server.close()


def test_wait_raises_a_hung_then_failed_push_naming_the_peer(tmp_path: Path) -> None:
    """A peer that accepts the connection and never answers: ``wait(timeout_s)`` gives up at
    its bound naming the peer; the push then fails at the connection's timeout and the next
    ``wait`` raises that, once; the step is still loadable from this node's memory."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(4)  # never accepted: the handshake gets no challenge
    address = f"127.0.0.1:{hung.getsockname()[1]}"
    try:
        cfg = MemoryConfig(
            str(shm), peer=address, durable_every=100, token=TOKEN, peer_timeout_s=2.0
        )
        url = f"file://{tmp_path}/durable"
        with CheckpointManager(url, memory=cfg) as mgr:
            mgr.save(1, state_at(1))
            with pytest.raises(
                MemoryPushError, match=f"step 1 to its peer {address} has not finished after 0.2 s"
            ):
                mgr.memory.wait(timeout_s=0.2)
            with pytest.raises(
                MemoryPushError,
                match=f"could not copy step 1 to its peer {address}: .*handshake failed",
            ):
                mgr.wait()
            mgr.wait()  # raised once
        with CheckpointManager(url, memory=MemoryConfig(str(shm))) as mgr:
            got = {"w": torch.zeros(400_000), "step": -1}
            assert mgr.load(got) == 1 and torch.equal(got["w"], state_at(1)["w"])
    finally:
        hung.close()


def test_sync_save_is_on_the_peer_when_the_node_is_lost_as_it_returns(tmp_path: Path) -> None:
    """Replication ``sync`` (from the environment ``bootseer run`` hands down): the trainer
    SIGKILLs itself the moment ``save(3)`` returns and its node's memory is lost; a replaced,
    empty node loads exactly step 3 from the peer, bit for bit (async would have step 2
    there at best: its push of step 3 starts after the commit, on another thread)."""
    peer_dir, node = tmp_path / "peer", tmp_path / "node"
    peer_dir.mkdir(mode=0o700)
    node.mkdir(mode=0o700)
    server = PeerServer(str(peer_dir), token=TOKEN).start()
    try:
        (tmp_path / "res").mkdir(mode=0o700)
        url = f"file://{tmp_path}/durable"
        spec = {
            "world": 1,
            "numel": NUMEL,
            "steps": 6,
            "durable": url,
            "durable_every": 100,
            "kill_after_save": [0, 3],
            "nodes": [{"peer": server.address}],
            "results": str(tmp_path / "res"),
        }
        job = subprocess.run(
            [sys.executable, WORKER, "launch", json.dumps(spec)],
            env=worker_env({DIR_ENV: str(node), REPLICATION_ENV: "sync"}),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert job.returncode == 1 and not list((tmp_path / "res").iterdir()), job.stderr[-3000:]
        shutil.rmtree(node)  # the node is lost with its memory; an empty one replaces it
        new = tmp_path / "new"
        new.mkdir(mode=0o700)
        state = state_of_worker(0, 0, 1, NUMEL)
        with CheckpointManager(
            url, memory=MemoryConfig(str(new), peer=server.address, token=TOKEN)
        ) as mgr:
            report = mgr.load_with_report(state)
        assert (report.step, report.source) == (3, f"peer:{server.address}")  # type: ignore
        assert exact(state, 3, 0, 1, NUMEL) == []
    finally:
        server.close()


def test_sync_save_raises_naming_a_peer_that_does_not_answer(tmp_path: Path) -> None:
    """A sync save to a hung peer raises at ``push_wait_s``, to a refused one at once, each
    naming the peer and the step; the durable save due at that step is not lost and the
    step loads from this node's memory."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(4)  # never accepted
    address = f"127.0.0.1:{hung.getsockname()[1]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{s.getsockname()[1]}"  # closed: nobody listens there
    url = f"file://{tmp_path}/durable"
    try:
        cfg = MemoryConfig(
            str(shm),
            peer=address,
            durable_every=100,
            token=TOKEN,
            peer_timeout_s=5.0,
            push_wait_s=0.5,
            replication="sync",
        )
        with CheckpointManager(url, memory=cfg) as mgr:
            with pytest.raises(
                MemoryPushError, match=f"step 1 to its peer {address} has not finished after 0.5 s"
            ):
                mgr.save(1, state_at(1))
            hung.close()  # the push in flight fails now, and close() only logs it
    finally:
        hung.close()
    cfg = MemoryConfig(str(shm), peer=refused, durable_every=1, token=TOKEN, replication="sync")
    with CheckpointManager(url, memory=cfg) as mgr:
        with pytest.raises(
            MemoryPushError, match=f"could not copy step 2 to its peer {refused}: .*refused"
        ):
            mgr.save(2, state_at(2))
        assert mgr.wait().committed  # the durable save of step 2 went on; raised once
    with CheckpointManager(url, memory=MemoryConfig(str(shm))) as mgr:
        got = {"w": torch.zeros(400_000), "step": -1}
        assert mgr.load_with_report(got).source == "local"  # type: ignore[attr-defined]
        assert got["step"] == 2 and torch.equal(got["w"], state_at(2)["w"])


def test_replication_is_checked_and_handed_down(tmp_path: Path) -> None:
    """``ckpt.memory_replication`` reaches the job through the agent's environment; a value
    that is neither mode is refused naming the key, before anything is made."""
    from bootseer.robust.memtier import NodeMemory

    with pytest.raises(
        ValueError, match="ckpt.memory_replication 'fast' is not one of async, sync"
    ):
        NodeMemory(str(tmp_path / "never"), replication="fast")
    assert not (tmp_path / "never").exists()
    agent = NodeMemory(str(tmp_path / "mem"), replication="sync")
    try:
        assert MemoryConfig.from_env(agent.env).replication == "sync"  # type: ignore[union-attr]
    finally:
        agent.close()
    with pytest.raises(CheckpointError, match="replication 'fast' is not one of async, sync"):
        MemoryTier(MemoryConfig(str(tmp_path / "mem"), replication="fast"), rank=0, world_size=1)


def test_a_state_the_node_cannot_hold_turns_the_tier_off_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up budget: a node whose ranks' copies do not fit says so, naming the sizes
    and that it assumes equal shards, and the durable tier goes on alone."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    url = f"file://{tmp_path}/durable"
    with CheckpointManager(url, memory=False) as mgr:  # the manager, its tier replaced
        mgr.memory = MemoryTier(
            MemoryConfig(str(shm)), rank=0, world_size=1, local_world_size=1 << 40
        )  # more ranks than any disk holds
        with caplog.at_level("ERROR", logger="ckpt"):
            mgr.save(1, state_at(1))
        assert mgr.wait().committed and mgr.memory.enabled is False
    assert "memory tier: off. rank 0's state is 1.5 MiB" in caplog.text
    assert "assuming every rank of the node holds as much as this one: equal shards" in caplog.text
    assert list(shm.iterdir()) == [] or all(p.stat().st_size == 0 for p in shm.iterdir())
    with CheckpointManager(url, memory=False) as mgr:
        got = {"w": torch.zeros(400_000), "step": -1}
        assert mgr.load(got) == 1 and torch.equal(got["w"], state_at(1)["w"])
