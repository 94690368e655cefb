"""The memory tier across two nodes on loopback: copies on the neighbour, a node replaced.

Two agents' peer servers (``ckpt.memory_peer``, one process each) and two ranks on gloo,
one per "node" (its own memory directory). Each rank's copy goes to the other node. Node B's
server is SIGKILLed half-way through receiving rank 0's step 2: training goes on, and what B
holds for rank 0 is its last complete copy (step 1), never the torn one. Node B is then lost
and replaced by an empty one: the restarted job loads step 3 on both ranks, rank 1 from node
A's memory (its peer copy), rank 0 from its own; nothing beyond the step in progress is lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_ckpt_memory import NUMEL, TOKEN, WORKER, results, worker_env

from ckpt.memory_slot import SlotFile, newest


class Peer:
    """One node agent's server of peer copies, in a process of its own."""

    def __init__(self, directory: Path, die_at_put: int = 0, limits: tuple = ()) -> None:
        """``limits``: (MAX_CONNECTIONS, HANDSHAKE_S) for this server."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.directory = directory
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, "peer", str(directory), str(die_at_put), *map(str, limits)],
            env=worker_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("listening on "), line
        self.address = line.split()[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for p in started:
        p.close()


def held(directory: Path, rank: int) -> list[int]:
    slots = [SlotFile(str(directory / f"peer-rank-{rank}.{k}")) for k in (0, 1)]
    try:
        return sorted(h.step for h, _ in newest(slots))
    finally:
        for s in slots:
            s.close()


def run_job(spec: dict, nodes: list[dict], res: Path) -> subprocess.CompletedProcess[str]:
    res.mkdir(mode=0o700)
    spec = {**spec, "nodes": nodes, "results": str(res)}
    return subprocess.run(
        [sys.executable, WORKER, "launch", json.dumps(spec)],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_peer_lost_mid_copy_then_node_replaced(tmp_path: Path, peers: list[Peer]) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(mode=0o700)
    b_dir.mkdir(mode=0o700)
    peers.append(Peer(a_dir / "peers"))
    peers.append(Peer(b_dir / "peers", die_at_put=3))  # rank 0's step 2: steps 0, 1, 2
    a, b = peers
    spec = {
        "world": 2,
        "numel": NUMEL,
        "steps": 4,
        "durable": f"file://{tmp_path}/durable",
        "durable_every": 100,
    }
    first = run_job(
        spec,
        [{"dir": str(a_dir), "server": a.address}, {"dir": str(b_dir), "server": b.address}],
        tmp_path / "r1",
    )
    assert first.returncode == 0, first.stderr[-3000:]
    got = results(tmp_path / "r1")
    # rank 0 trained to the end although its peer died under it, and said so
    assert got[0]["last"] == 3 and got[0]["push"]["ok"] is False
    assert f"could not copy step 2 to its peer {b.address}" in first.stderr
    assert got[1]["push"] == {**got[1]["push"], "ok": True, "step": 3, "peer": a.address}
    assert b.proc.wait(30) == -9
    # the torn step 2 went into the buffer of step 0: step 1, the newest complete, is whole
    assert held(b_dir / "peers", 0) == [1]
    assert held(a_dir / "peers", 1) == [2, 3]

    # node B is lost with its memory; an empty node takes its place
    c_dir = tmp_path / "c"
    c_dir.mkdir(mode=0o700)
    peers.append(Peer(c_dir / "peers"))
    c = peers[-1]
    second = run_job(
        spec,
        [{"dir": str(a_dir), "server": a.address}, {"dir": str(c_dir), "server": c.address}],
        tmp_path / "r2",
    )
    assert second.returncode == 0, second.stderr[-3000:]
    got = results(tmp_path / "r2")
    assert (got[0]["loaded"], got[0]["source"], got[0]["problems"]) == (3, "local", [])
    assert (got[1]["loaded"], got[1]["source"], got[1]["problems"]) == (3, f"peer:{a.address}", [])


def _three_nodes_trained(tmp_path: Path, peers: list[Peer]) -> tuple[dict[str, Path], dict]:
    """Nodes a, b, c (ranks 0, 1, 2) trained to step 3, and a spare d, each with its server:
    each rank's copy in its node's memory and on the next node's (c's on a)."""
    dirs = {name: tmp_path / name for name in "abcd"}
    for d in dirs.values():
        d.mkdir(mode=0o700)
        peers.append(Peer(d / "peers"))
    spec = {
        "world": 3,
        "numel": NUMEL,
        "steps": 4,
        "durable": f"file://{tmp_path}/durable",
        "durable_every": 100,
    }
    first = run_job(
        spec,
        [{"dir": str(dirs[n]), "server": p.address} for n, p in zip("abc", peers, strict=False)],
        tmp_path / "r1",
    )
    assert first.returncode == 0, first.stderr[-3000:]
    return dirs, spec


def test_ranks_renumbered_onto_other_nodes_find_their_copies(
    tmp_path: Path, peers: list[Peer]
) -> None:
    """A spare takes an evicted node's place and torch numbers the nodes afresh (by
    address): the ranks after the evicted node move one node down, onto the node that held
    their copy for the peer, and the spare gets the last rank. Every rank still loads the
    newest step, bit for bit: from its new node's own server, or from the node holding it."""
    dirs, spec = _three_nodes_trained(tmp_path, peers)
    a, b, c, d = peers
    assert held(dirs["c"] / "peers", 1)[-1] == 3  # rank 1's copy on the next node, c
    # b evicted, the spare d last: rank 1 now runs on c, rank 2 on d
    second = run_job(
        spec,
        [
            {"dir": str(dirs["a"]), "server": a.address},
            {"dir": str(dirs["c"]), "server": c.address},
            {"dir": str(dirs["d"]), "server": d.address},
        ],
        tmp_path / "r2",
    )
    assert second.returncode == 0, second.stderr[-3000:]
    got = results(tmp_path / "r2")
    assert [(got[r]["loaded"], got[r]["problems"]) for r in range(3)] == [(3, [])] * 3
    assert got[0]["source"] == "local"
    assert got[1]["source"] == f"peer:{c.address}"  # its own node's server
    assert got[2]["source"] == f"peer:{a.address}"  # rank 2's copy went to the next node, a


def test_ranks_renumbered_the_other_way_fetch_a_node_s_own_copy(
    tmp_path: Path, peers: list[Peer]
) -> None:
    """The spare sorts before the nodes after a lost one: they move one node *up*, so a
    rank's newest copy is in the memory of the node that ran it (its own copy, not a peer
    copy), and its peer copy died with the lost node. Servers serve their node's own copies
    too, read-only: every rank still loads the newest step (the soak lost 11 steps here)."""
    dirs, spec = _three_nodes_trained(tmp_path, peers)
    a, b, c, d = peers
    c.close()  # c lost with its memory; the spare d sorts between a and b
    second = run_job(
        spec,
        [
            {"dir": str(dirs["a"]), "server": a.address},
            {"dir": str(dirs["d"]), "server": d.address},
            {"dir": str(dirs["b"]), "server": b.address},
        ],
        tmp_path / "r2",
    )
    assert second.returncode == 0, second.stderr[-3000:]
    got = results(tmp_path / "r2")
    assert [(got[r]["loaded"], got[r]["problems"]) for r in range(3)] == [(3, [])] * 3
    assert got[0]["source"] == "local"
    assert got[1]["source"] == f"peer:{b.address}"  # b's own copy of rank 1, it ran it
    assert got[2]["source"] == f"peer:{a.address}"  # rank 2's peer copy, on a


def test_peer_refuses_a_damaged_or_oversized_copy(tmp_path: Path) -> None:
    """The server checks every block before it commits, and room before it takes a byte."""
    import os

    import torch

    from ckpt.memory import MemoryConfig, MemoryTier
    from ckpt.memory_peer import PeerClient, PeerError, PeerServer
    from ckpt.memory_slot import HEADER

    (tmp_path / "peer").mkdir(mode=0o700)
    (tmp_path / "me").mkdir(mode=0o700)
    server = PeerServer(str(tmp_path / "peer"), token=TOKEN).start()
    try:
        tier = MemoryTier(MemoryConfig(str(tmp_path / "me")), rank=0, world_size=1)
        tier.save(5, {"w": torch.arange(400_000, dtype=torch.float32)})
        tier.wait()
        head, slot = newest(tier.slots)[0]
        slot.map[HEADER + 12345] ^= 0x01  # damaged after its checksums were taken
        with (
            PeerClient(server.address, token=TOKEN) as client,
            pytest.raises(PeerError, match="fails its checksum"),
        ):
            client.push(slot, head)
        assert held(tmp_path / "peer", 0) == []  # nothing committed
        small = tmp_path / "small"
        small.mkdir(mode=0o700)
        if os.geteuid() == 0:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(small)], check=True
            )
            tiny = PeerServer(str(small), token=TOKEN).start()
            try:
                with (
                    PeerClient(tiny.address, token=TOKEN) as client,
                    pytest.raises(PeerError, match="needs"),
                ):
                    client.push(slot, head)
            finally:
                tiny.close()
                if subprocess.run(["umount", str(small)]).returncode:
                    subprocess.run(["umount", "-l", str(small)], check=True)
        tier.close()
    finally:
        server.close()


def test_damaged_local_copy_loads_the_same_step_from_the_peer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest local copy has a flipped byte, the peer holds the same step whole: the
    load takes that step from the peer (no step lost), bit for bit, and names the damaged
    local file; the fetched copy replaces the damaged one, the older local copy stays."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.memory import MemoryConfig
    from ckpt.memory_peer import PeerServer
    from ckpt.memory_slot import BLOCK, HEADER

    (tmp_path / "peer").mkdir(mode=0o700)
    me = tmp_path / "me"
    me.mkdir(mode=0o700)
    url = f"file://{tmp_path}/durable"
    server = PeerServer(str(tmp_path / "peer"), token=TOKEN).start()

    def state_at(step: int) -> dict:
        return {
            "w": torch.arange(600_000, dtype=torch.float32) * 0.5 + step,
            "b": torch.full((9,), step, dtype=torch.bfloat16),
            "step": step,
        }

    try:
        config = MemoryConfig(str(me), peer=server.address, durable_every=100, token=TOKEN)
        with CheckpointManager(url, memory=config) as mgr:
            mgr.save(3, state_at(3))
            mgr.save(4, state_at(4))
            mgr.memory.wait()  # committed and pushed
            assert mgr.memory.last_push["step"] == 4 and mgr.memory.last_push["ok"]
        assert held(tmp_path / "peer", 0) == [3, 4]
        slots = [SlotFile(str(me / f"rank-0.{k}")) for k in (0, 1)]
        head, damaged = newest(slots)[0]
        assert head.step == 4
        damaged.map[HEADER + BLOCK + 4321] ^= 0x04  # block 1: block 0 is copied first
        damaged_path = damaged.path
        for s in slots:
            s.close()

        state = {"w": torch.zeros(600_000), "b": torch.zeros(9, dtype=torch.bfloat16), "step": -1}
        with (
            CheckpointManager(
                url, memory=MemoryConfig(str(me), peer=server.address, token=TOKEN)
            ) as mgr,
            caplog.at_level("WARNING", logger="ckpt"),
        ):
            report = mgr.load_with_report(state)
        assert (report.step, report.source) == (4, f"peer:{server.address}")  # type: ignore
        want = state_at(4)
        assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"])
        assert state["step"] == 4
        assert "step 4 from local cannot be loaded by rank 0" in caplog.text
        assert damaged_path in caplog.text and "fails its checksum" in caplog.text
        slots = [SlotFile(str(me / f"rank-0.{k}")) for k in (0, 1)]
        try:  # step 4 fetched into the damaged slot; step 3, the older copy, kept
            assert [(h.step, s.path) for h, s in newest(slots)] == [
                (4, damaged_path),
                (3, next(s.path for s in slots if s.path != damaged_path)),
            ]
        finally:
            for s in slots:
                s.close()
    finally:
        server.close()


def test_peer_port_refuses_connections_without_the_jobs_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A push with a wrong token, no token, or a raw ``put`` that skips the handshake writes
    nothing into the peer's memory; a server without the token is not trusted either; the
    token appears in no log line; a wildcard bind is refused."""
    import socket
    import threading

    import torch

    from ckpt.memory import MemoryConfig, MemoryPushError, MemoryTier
    from ckpt.memory_peer import PeerClient, PeerError, PeerServer, recv_msg, send_msg

    peer_dir, me = tmp_path / "peer", tmp_path / "me"
    peer_dir.mkdir(mode=0o700)
    me.mkdir(mode=0o700)
    wrong = "x" * 32
    with pytest.raises(ValueError, match="binds every interface"):
        PeerServer(str(peer_dir), "0.0.0.0", token=TOKEN)
    server = PeerServer(str(peer_dir), token=TOKEN).start()
    try:
        with caplog.at_level("DEBUG"):
            for token in (wrong, ""):
                tier = MemoryTier(
                    MemoryConfig(str(me), peer=server.address, token=token), rank=0, world_size=1
                )
                tier.save(1, {"w": torch.arange(1000, dtype=torch.float32)})
                with pytest.raises(MemoryPushError, match=server.address):
                    tier.wait()  # a failed push is raised in the caller, naming the peer
                assert tier.last_push["ok"] is False
                assert (
                    "authentication failed" if token else "BOOTSEER_MEMCKPT_TOKEN"
                ) in tier.last_push["error"]
                tier.close()
            head, slot = newest([SlotFile(str(me / f"rank-0.{k}")) for k in (0, 1)])[0]
            with socket.create_connection(
                ("127.0.0.1", int(server.address.split(":")[1])), timeout=30
            ) as raw:  # no handshake: a bare put
                assert "challenge" in recv_msg(raw)
                send_msg(raw, {"op": "put", "header": head.to_json()})
                try:
                    raw.sendall(slot.view(4096, head.data_size + head.meta_size))
                    reply = recv_msg(raw)
                except (ConnectionError, OSError):
                    reply = {"ok": False}
                assert reply.get("ok") is False
            slot.close()
            assert list(peer_dir.iterdir()) == []  # nothing written into the peer's memory
            with PeerClient(server.address, token=TOKEN) as client:  # the job's token works
                assert client.listing(0, 1) == []
        assert caplog.text.count("refused a connection from 127.0.0.1") == 2
        assert TOKEN not in caplog.text and wrong not in caplog.text
    finally:
        server.close()

    # a server that does not hold the token cannot pass for the job's peer
    fake = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = fake.accept()
        with conn:
            send_msg(conn, {"hello": "bootseer-memckpt", "version": 2, "challenge": "00" * 32})
            recv_msg(conn)
            send_msg(conn, {"ok": True, "mac": "00" * 32})

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(PeerError, match="does not hold the job's token"):
        PeerClient(f"127.0.0.1:{fake.getsockname()[1]}", token=TOKEN)
    thread.join(30)
    fake.close()


def test_peer_keeps_two_copies_of_a_job_that_went_back_to_an_older_step(tmp_path: Path) -> None:
    """After a restart from an older step (the durable tier's), the peer's copies of the
    abandoned run's later steps are overwritten first: it again holds the new run's two
    newest copies, not one of them beside a stale one."""
    import torch

    from ckpt.memory import MemoryConfig, MemoryTier
    from ckpt.memory_peer import PeerServer

    (tmp_path / "peer").mkdir(mode=0o700)
    server = PeerServer(str(tmp_path / "peer"), token=TOKEN).start()
    try:
        for run, steps in (("a", (21, 22)), ("b", (11, 12, 13))):
            (tmp_path / run).mkdir(mode=0o700)
            tier = MemoryTier(
                MemoryConfig(str(tmp_path / run), peer=server.address, token=TOKEN),
                rank=0,
                world_size=1,
            )
            for step in steps:
                tier.save(step, {"w": torch.full((1000,), float(step))})
            tier.close()
        assert held(tmp_path / "peer", 0) == [12, 13]
    finally:
        server.close()


def test_a_nodes_own_copies_are_opened_read_only_and_never_created(tmp_path: Path) -> None:
    """The peer server's view of the node's own copies: what exists, mapped read-only; a
    missing slot is not created (a race with the rank's own clean-up must not leave an empty
    file), a link is not followed."""
    from ckpt.memory_peer import _own_slots
    from striped_fs.privdir import PrivateDir

    me = tmp_path / "own"
    me.mkdir(mode=0o700)
    slot = SlotFile(str(me / "rank-3.0"))
    slot.ensure(8192)
    slot.view(4096, 8)[:] = b"12345678"
    slot.close()
    (me / "rank-3.1").symlink_to(tmp_path / "elsewhere")
    own = _own_slots(PrivateDir.open(me, create=False), 3)
    try:
        assert [s.path for s in own] == [str(me / "rank-3.0")]
        assert bytes(own[0].view(4096, 8)) == b"12345678"
        with pytest.raises(TypeError):  # the map refuses writes
            own[0].view(4096, 8)[:] = b"87654321"
    finally:
        for s in own:
            s.close()
    assert sorted(p.name for p in me.iterdir()) == ["rank-3.0", "rank-3.1"]
    assert not (tmp_path / "elsewhere").exists()
    assert _own_slots(PrivateDir.open(me, create=False), 4) == [] and not any(me.glob("rank-4*"))
