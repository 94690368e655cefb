"""The memory tier's peer stream, attacked: every message and copy after the handshake carries
a MAC, sizes are checked before a byte is allocated, hellos have a deadline, connections and
files are closed after each request, and every message is parsed by a typed spec.

The relay tests put a real man in the middle (``peer_relay``, threads on loopback) without the
job's token: it passes the handshake through and then rewrites or replays what follows, with
bytes it crafts itself. The others play a token holder whose messages are malformed, a client
that drips its hello, and one that opens many connections.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from peer_relay import Piece, Relay
from test_ckpt_memory import TOKEN
from test_ckpt_memory_peer import Peer, held

from ckpt import memory_peer
from ckpt.memory import MemoryConfig, MemoryPushError, MemoryTier
from ckpt.memory_peer import PeerClient, PeerError, PeerServer, recv_msg
from ckpt.memory_slot import SlotFile, SlotHeader, block_sums, pack_meta

N = 4096  # float32s: a 16 KiB state


def state_at(step: int) -> dict:
    return {"w": torch.arange(N, dtype=torch.float32) + step}


@pytest.fixture
def server(tmp_path: Path):
    (tmp_path / "peer").mkdir(mode=0o700)
    srv = PeerServer(str(tmp_path / "peer"), token=TOKEN).start()
    yield srv
    srv.close()


def _tier(directory: Path, peer: str) -> MemoryTier:
    directory.mkdir(mode=0o700, exist_ok=True)
    return MemoryTier(
        MemoryConfig(str(directory), peer=peer, token=TOKEN, peer_timeout_s=3), rank=0, world_size=1
    )


def _wait_for(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    """The server thread's log line (it may come just after the client's error)."""
    for _ in range(100):
        if text in caplog.text:
            return True
        time.sleep(0.05)
    return False


def test_a_relay_that_rewrites_a_put_commits_nothing(
    tmp_path: Path, server: PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay swaps the copy's tensor for its own, with block sums, meta and CRC made to
    match (what checksums alone let through: the server committed it and a fresh rank loaded
    it). Now the put fails its MAC: nothing is committed, the fresh rank finds nothing."""

    def rewrite(p: Piece) -> bytes:
        if p.msg.get("op") != "put":
            return p.raw
        head = dict(p.msg["header"])
        data = bytearray(p.payload[: head["data_size"]])
        np.frombuffer(data, dtype=np.float32)[:] = 666.0
        meta = p.payload[head["data_size"] :]
        (n,) = struct.unpack_from("<I", meta)
        doc = json.loads(meta[4 : 4 + n])
        doc["sums"] = block_sums(bytes(data))
        new_meta = pack_meta(doc, meta[4 + n :])
        head.update(meta_size=len(new_meta), meta_crc32=zlib.crc32(new_meta))
        return p.emit({"op": "put", "header": head}, bytes(data) + new_meta)

    relay = Relay(server.address, on_request=rewrite)
    tier = _tier(tmp_path / "me", relay.address)
    with caplog.at_level("WARNING", logger="ckpt"):
        tier.save(5, state_at(5))
        with pytest.raises(MemoryPushError, match=relay.address):
            tier.wait()
        tier.close()
        assert _wait_for(caplog, "fails its MAC")
    assert [p.msg["op"] for p in relay.requests] == ["put"]  # the relay did rewrite it
    assert held(tmp_path / "peer", 0) == []
    fresh = _tier(tmp_path / "fresh", server.address)
    state = {"w": torch.zeros(N)}
    assert fresh.load(state) is None and torch.equal(state["w"], torch.zeros(N))
    fresh.close()
    relay.close()


def test_a_relay_that_grows_a_get_reply_grows_no_slot(
    tmp_path: Path, server: PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay rewrites the reply's header to a 3 GiB copy (it grew the fetching rank's
    slot file in shared memory to 3.2 GB for a 16 KiB state). Now the reply fails its MAC
    before the slot is touched, and the rank falls back to the durable tier (``None``)."""
    tier = _tier(tmp_path / "me", server.address)
    tier.save(3, state_at(3))
    tier.wait()
    tier.close()

    def grow(p: Piece) -> bytes:
        if "header" not in p.msg:
            return p.raw
        return p.emit({**p.msg, "header": {**p.msg["header"], "data_size": 3 << 30}})

    relay = Relay(server.address, on_reply=grow)
    fresh = _tier(tmp_path / "fresh", relay.address)
    state = {"w": torch.zeros(N)}
    with caplog.at_level("WARNING", logger="ckpt"):
        assert fresh.load(state) is None
    fresh.close()
    assert any("header" in p.msg for p in relay.replies)  # the relay did rewrite a reply
    sizes = {f.name: f.stat().st_size for f in (tmp_path / "fresh").iterdir()}
    assert max(sizes.values(), default=0) < 1 << 20, sizes
    assert "fails its MAC" in caplog.text
    assert torch.equal(state["w"], torch.zeros(N))
    relay.close()


def test_a_relay_that_replays_an_earlier_put_gets_no_ack(
    tmp_path: Path, server: PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay replays step 5's put (header and copy, as they crossed) in place of step
    6's: the server committed step 5 again and acked, so the rank believed step 6 was on the
    peer. Now the replay fails its MAC (another session's key and sequence): step 6's push
    fails, named, and the peer holds what it acked."""
    relay: Relay

    def replay(p: Piece) -> bytes:
        return relay.requests[0].raw if p.msg.get("op") == "put" else p.raw

    relay = Relay(server.address, on_request=replay)
    tier = _tier(tmp_path / "me", relay.address)
    tier.save(5, state_at(5))
    tier.wait()
    assert held(tmp_path / "peer", 0) == [5]
    with caplog.at_level("WARNING", logger="ckpt"):
        tier.save(6, state_at(6))
        with pytest.raises(MemoryPushError, match="step 6"):
            tier.wait()
        assert _wait_for(caplog, "fails its MAC")
    tier.close()
    assert len(relay.requests) == 2  # the replay happened
    assert held(tmp_path / "peer", 0) == [5]
    relay.close()


def test_a_relay_that_sends_a_json_array_gets_a_log_line_not_a_traceback(
    server: PeerServer, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    relay = Relay(
        server.address, on_request=lambda p: p.emit([1, 2]) if p.msg.get("op") == "list" else p.raw
    )
    with caplog.at_level("WARNING", logger="ckpt"):
        with PeerClient(relay.address, token=TOKEN) as client, pytest.raises(PeerError):
            client.listing(0, 1)
        assert _wait_for(caplog, f"memory peer {server.address}: refused a request")
    assert "Traceback" not in capfd.readouterr().err
    with PeerClient(server.address, token=TOKEN) as client:  # and it serves on
        assert client.listing(0, 1) == []
    relay.close()


def test_a_hello_dripped_byte_by_byte_is_cut_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A byte every 0.3 s never lets a per-recv timeout of 1 s expire (it stayed open past
    61 s with the 30 s bound); the bound is on the whole hello, then on the request too."""
    monkeypatch.setattr(memory_peer, "HANDSHAKE_S", 1.0)
    (tmp_path / "peer").mkdir(mode=0o700)
    srv = PeerServer(str(tmp_path / "peer"), token=TOKEN).start()
    port = int(srv.address.split(":")[1])

    def dripped_until_closed(sock: socket.socket, frame: bytes) -> bool:
        for byte in frame[:40]:  # 12 s of drips at most; each frame is longer than that
            try:
                sock.send(bytes([byte]))
            except OSError:
                return True
            if select.select([sock], [], [], 0.3)[0]:
                try:
                    return sock.recv(4096) == b"" or True
                except OSError:
                    return True
        return False

    body = json.dumps({"op": "auth", "nonce": "00" * 32, "mac": "00" * 32}).encode()
    try:
        with caplog.at_level("WARNING", logger="ckpt"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                assert "challenge" in recv_msg(sock)
                assert dripped_until_closed(sock, struct.pack("<I", len(body)) + body)
            assert _wait_for(caplog, "its handshake was not done within 1 s")
            # with the token: the request after the handshake is bound by the same deadline
            from ckpt.memory_wire import Deadline, client_handshake

            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                client_handshake(sock, TOKEN.encode(), Deadline(30))
                request = json.dumps({"op": "list", "rank": 0, "world_size": 1}).encode()
                assert dripped_until_closed(sock, struct.pack("<I", len(request)) + request)
            assert _wait_for(caplog, "refused a request from 127.0.0.1: not done within 1 s")
    finally:
        srv.close()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_1200_list_requests_leave_no_file_or_descriptor_open(tmp_path: Path) -> None:
    """Lists of 1,200 ranks the server holds nothing for (they created two slot files each
    and kept them open: 2,405 descriptors): nothing is created, nothing stays open."""
    peer = Peer(tmp_path / "peers")
    try:
        with PeerClient(peer.address, token=TOKEN) as client:
            assert client.listing(0, 1) == []
        before = _fds(peer.proc.pid)
        for rank in range(1200):
            with PeerClient(peer.address, token=TOKEN) as client:
                assert client.listing(rank, 1200) == []
        after = _fds(peer.proc.pid)
        assert after <= before + 2, (before, after)  # the last connection may be closing
        assert sorted(os.listdir(tmp_path / "peers")) == []
    finally:
        peer.close()


def test_the_server_serves_a_bounded_number_of_connections(tmp_path: Path) -> None:
    """Ten idle connections to a server that serves four at once: four get a challenge, six
    are told it is busy and closed; a client that retries is served once they are gone."""
    peer = Peer(tmp_path / "peers", limits=(4, 30))
    host, _, port = peer.address.rpartition(":")
    try:
        socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(10)]
        firsts = [recv_msg(s) for s in socks]
        assert sum("challenge" in f for f in firsts) == 4
        assert sum(f.get("busy") is True for f in firsts) == 6
        for s in socks:
            s.close()
        with PeerClient(peer.address, token=TOKEN) as client:
            assert client.listing(0, 1) == []
    finally:
        peer.close()


def test_a_token_holders_malformed_requests_are_refused_with_a_log_line(
    tmp_path: Path,
    server: PeerServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from ckpt.memory_wire import Deadline, client_handshake

    good = SlotHeader(
        step=1, rank=0, world_size=1, data_size=8, meta_size=40, meta_crc32=0, created=1.0
    ).to_json()
    bad = [  # what the refusal must say, the message
        ("a JSON array", [1, 2]),
        ("a JSON string", "list"),
        ("a JSON null", None),
        ("lacks rank", {"op": "list"}),
        ("rank", {"op": "list", "rank": "0", "world_size": 1}),
        ("rank", {"op": "list", "rank": True, "world_size": 1}),
        ("rank 2 of a world of 2", {"op": "list", "rank": 2, "world_size": 2}),
        ("unknown keys", {"op": "list", "rank": 0, "world_size": 1, "more": 1}),
        ("step", {"op": "get", "rank": 0, "step": -1}),
        ("get request.step", {"op": "get", "rank": 0, "step": 1.5}),
        ("get request.rank", {"op": "get", "rank": 1 << 40, "step": 1}),
        ("header: a JSON array", {"op": "put", "header": []}),
        ("data_size", {"op": "put", "header": {**good, "data_size": 1 << 60}}),
        ("meta_size", {"op": "put", "header": {**good, "meta_size": 1 << 40}}),
        ("misaligned", {"op": "put", "header": {**good, "data_size": 12}}),
        ("version", {"op": "put", "header": {**good, "version": 1}}),
        ("job", {"op": "put", "header": {**good, "job": 5}}),
        ("op 'nope' is not one of put, list, get", {"op": "nope"}),
        ("op \"['list']\"", {"op": ["list"]}),
    ]
    port = int(server.address.split(":")[1])
    with caplog.at_level("WARNING", logger="ckpt"):
        for says, msg in bad:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                chan = client_handshake(sock, TOKEN.encode(), Deadline(30))
                chan.send(msg)
                reply = chan.recv()
            assert reply["ok"] is False and says in reply["error"], (msg, reply)
        for _ in range(100):  # each refusal is one log line, from the server's thread
            if caplog.text.count(f"memory peer {server.address}: refused a ") >= len(bad):
                break
            time.sleep(0.05)
    assert caplog.text.count(f"memory peer {server.address}: refused a ") == len(bad)
    assert "Traceback" not in capfd.readouterr().err
    assert list((tmp_path / "peer").iterdir()) == []  # no file made for any of them
    with PeerClient(server.address, token=TOKEN) as client:
        assert client.listing(0, 1) == []


def test_malformed_replies_are_refused_before_the_slot_grows(tmp_path: Path) -> None:
    """A server that holds the token (a peer with a bug, or worse) answers with arrays, wrong
    types, a 3 GiB copy of a 16 KiB state, a meta over the cap, another rank's or world's
    copy: each is a PeerError naming it, and the rank's slot file is never grown."""
    from ckpt.memory_wire import Deadline, serve_handshake

    head = SlotHeader(
        step=3, rank=0, world_size=1, data_size=N * 4, meta_size=100, meta_crc32=0, created=1.0
    ).to_json()
    replies = [
        ("list", [1], "not an object"),
        ("list", {"ok": True, "steps": ["1"]}, "steps[0]"),
        ("list", {"ok": True, "steps": [1], "more": 2}, "unknown keys"),
        ("list", {"ok": "yes", "steps": [1]}, ".ok"),
        ("get", {"ok": True, "header": {**head, "data_size": 3 << 30}}, "data_size 3221225472"),
        ("get", {"ok": True, "header": {**head, "meta_size": (256 << 20) + 1}}, "meta_size"),
        ("get", {"ok": True, "header": {**head, "world_size": 2}}, "world_size 2"),
        ("get", {"ok": True, "header": {**head, "rank": 1, "world_size": 2}}, "rank 1"),
        ("get", {"ok": True, "header": [head]}, "header"),
    ]
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for _op, reply, _says in replies:
            conn, _ = listener.accept()
            with conn:
                chan = serve_handshake(conn, TOKEN.encode(), Deadline(30))
                chan.recv()
                chan.send(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    into = SlotFile(str(tmp_path / "rank-0.0"))
    try:
        for op, _reply, says in replies:
            with PeerClient(address, token=TOKEN) as client, pytest.raises(PeerError) as err:
                if op == "list":
                    client.listing(0, 1)
                else:
                    client.fetch(0, 3, into, data_size=N * 4, world_size=1)
            assert says in str(err.value) and address in str(err.value), str(err.value)
            assert os.stat(into.path).st_size == 0
    finally:
        into.close()
        thread.join(30)
        listener.close()


def test_frames_changed_replayed_reordered_or_reflected_fail_their_mac() -> None:
    """The session's frames, crafted on the wire between two channels: a flipped bit, a
    frame replayed, two swapped, one sent back to its sender, a copy's chunk changed or
    moved: each is refused where it arrives, before its bytes are used."""
    from ckpt.memory_wire import CHUNK, TAG, Channel, WireError, session_keys

    c2s, s2c = session_keys(b"t" * 32, b"c" * 32, b"n" * 32)

    def pair() -> tuple[Channel, socket.socket, Channel, socket.socket]:
        a, a_wire = socket.socketpair()
        b, b_wire = socket.socketpair()
        return Channel(a, c2s, s2c), a_wire, Channel(b, s2c, c2s), b_wire

    def sent(chan: Channel, wire: socket.socket, do, length: int) -> bytes:
        thread = threading.Thread(target=do, daemon=True)
        thread.start()
        out = bytearray()
        while len(out) < length:
            out += wire.recv(length - len(out))
        thread.join(30)
        return bytes(out)

    def deliver(wire: socket.socket, data: bytes) -> None:
        def send() -> None:
            try:
                wire.sendall(data)
            except OSError:  # the receiver stopped at the bad frame
                pass

        threading.Thread(target=send, daemon=True).start()

    def frame(obj: dict) -> int:
        return 4 + len(json.dumps(obj, separators=(",", ":"))) + TAG

    m1, m2 = {"op": "list", "rank": 0, "world_size": 1}, {"op": "get", "rank": 0, "step": 9}
    client, a_wire, srv, b_wire = pair()
    f1 = sent(client, a_wire, lambda: client.send(m1), frame(m1))
    f2 = sent(client, a_wire, lambda: client.send(m2), frame(m2))
    deliver(b_wire, f1 + f2)
    assert srv.recv() == m1 and srv.recv() == m2  # as sent: accepted

    cases = {
        "flipped": [f1[:10] + bytes([f1[10] ^ 1]) + f1[11:]],
        "replayed": [f1, f1],
        "reordered": [f2, f1],
    }
    for name, frames in cases.items():
        _, _, srv, b_wire = pair()
        deliver(b_wire, b"".join(frames))
        if name == "replayed":
            assert srv.recv() == m1
        with pytest.raises(WireError, match="fails its MAC"):
            srv.recv()
    client, a_wire, _, _ = pair()
    deliver(a_wire, f1)  # sent back to the client that made it
    with pytest.raises(WireError, match="message 0 fails its MAC"):
        client.recv()

    data = np.random.default_rng(1).integers(0, 255, CHUNK * 5 // 2, dtype=np.uint8).tobytes()
    client, a_wire, _, _ = pair()
    wire = sent(client, a_wire, lambda: client.send_bulk(memoryview(data)), len(data) + 3 * TAG)
    one = CHUNK + TAG
    for _name, bad, where in (
        ("as sent", wire, None),
        ("flipped", wire[: 2 * one + 5] + bytes([wire[2 * one + 5] ^ 4]) + wire[2 * one + 6 :], 2),
        ("swapped", wire[one : 2 * one] + wire[:one] + wire[2 * one :], 0),
    ):
        _, _, srv, b_wire = pair()
        deliver(b_wire, bad)
        got = bytearray(len(data))
        if where is None:
            srv.recv_bulk(memoryview(got))
            assert bytes(got) == data
            continue
        with pytest.raises(WireError, match=f"copy chunk {where} fails its MAC"):
            srv.recv_bulk(memoryview(got))
