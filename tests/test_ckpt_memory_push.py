"""The memory tier's push to the peer, as the caller sees it: ``CheckpointManager.wait()``
returns once the peer holds the last step (its bytes the ones saved) and says what the peer
acked; a push that fails or hangs is raised there, naming the peer, bounded in time; the
node's own copy stays loadable."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from test_ckpt_memory import TOKEN

from ckpt import CheckpointManager
from ckpt.memory import MemoryConfig, MemoryPushError, load_slot
from ckpt.memory_peer import PeerClient, PeerServer
from ckpt.memory_slot import SlotFile


def state_at(step: int) -> dict:
    return {"w": torch.arange(400_000, dtype=torch.float32) * step, "step": step}


def test_wait_returns_once_the_peer_holds_the_last_step(tmp_path: Path) -> None:
    shm, peer_dir = tmp_path / "shm", tmp_path / "peer"
    shm.mkdir(mode=0o700)
    peer_dir.mkdir()
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
        cfg = MemoryConfig(str(shm), peer=address, durable_every=100, token=TOKEN,
                           peer_timeout_s=2.0)
        url = f"file://{tmp_path}/durable"
        with CheckpointManager(url, memory=cfg) as mgr:
            mgr.save(1, state_at(1))
            with pytest.raises(MemoryPushError, match=f"step 1 to its peer {address} has not "
                               "finished after 0.2 s"):
                mgr.memory.wait(timeout_s=0.2)
            with pytest.raises(MemoryPushError, match=f"could not copy step 1 to its peer "
                               f"{address}: .*handshake failed"):
                mgr.wait()
            mgr.wait()  # raised once
        with CheckpointManager(url, memory=MemoryConfig(str(shm))) as mgr:
            got = {"w": torch.zeros(400_000), "step": -1}
            assert mgr.load(got) == 1 and torch.equal(got["w"], state_at(1)["w"])
    finally:
        hung.close()
