"""Peer replication of memory-tier copies: a TCP server in the node agent, and its client.

Why plain TCP: one copy goes one way per step, as one stream, between two agents; TCP moves it
at link speed with no extra dependency or process (gloo/NCCL would tie the copy to the
trainer's process groups, which die with the trainer; a store or S3 adds a hop). The server
writes what it receives straight into a slot file of its own (``memory_slot``), double
buffered per rank, and commits it only once every byte has arrived and checked, so a sender
lost mid-copy leaves the previous copy whole.

Messages: a 4-byte little-endian length and a JSON object, then, for ``put`` and ``get``, the
copy's bytes after its header page (data and meta)::

    {"op": "put", "header": {...}}   + bytes  ->  {"ok": true} | {"ok": false, "error": ...}
    {"op": "list", "rank": R, "world_size": W}  ->  {"ok": true, "steps": [...]}
    {"op": "get", "rank": R, "step": S}  ->  {"ok": true, "header": {...}} + bytes

Run a server alone (tests, benchmarks): ``python -m ckpt.memory_peer DIR [HOST:PORT]``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import struct
import sys
import threading
from typing import Any

from .memory_slot import HEADER, SlotDamaged, SlotFile, SlotHeader, newest, slot_paths

log = logging.getLogger("ckpt")

MAX_MESSAGE = 1 << 20
_LEN = struct.Struct("<I")


class PeerError(Exception):
    """The peer refused or failed a request; the message names the peer and why."""


def send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, 4 << 20))
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length > MAX_MESSAGE:
        raise ConnectionError(f"message of {length} bytes exceeds {MAX_MESSAGE}")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return json.loads(body)


def receive_copy(sock: socket.socket, slot: SlotFile, head: SlotHeader) -> None:
    """Receive a copy's bytes into ``slot``, check every byte, then commit it."""
    slot.ensure(head.total)
    slot.invalidate()
    recv_exact(sock, slot.view(HEADER, head.data_size + head.meta_size))
    meta, _ = slot.meta(head)
    slot.check_data(head, meta["sums"])
    slot.commit(head)


class _Ranks:
    """The replicas a server holds: two slot files per rank, one lock per rank."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._slots: dict[int, list[SlotFile]] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, rank: int) -> tuple[list[SlotFile], threading.Lock]:
        with self._guard:
            if rank not in self._slots:
                self._slots[rank] = [SlotFile(p) for p in
                                     slot_paths(self.directory, f"peer-rank-{rank}")]
                self._locks[rank] = threading.Lock()
            return self._slots[rank], self._locks[rank]

    def close(self) -> None:
        for slots in self._slots.values():
            for s in slots:
                s.close()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        while True:
            try:
                msg = recv_msg(sock)
            except (ConnectionError, OSError, ValueError):
                return
            try:
                self.server.serve_one(sock, msg)
            except (SlotDamaged, ConnectionError, OSError, ValueError, KeyError) as exc:
                log.warning("memory peer %s: %s from %s failed: %s", self.server.address,
                            msg.get("op"), self.client_address[0], exc)
                try:  # then close: after a failed op the stream's position is unknown
                    send_msg(sock, {"ok": False, "error": str(exc)})
                except OSError:
                    pass
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, directory: str, host: str, port: int) -> None:
        self.ranks = _Ranks(directory)
        super().__init__((host, port), _Handler)
        self.address = f"{host}:{self.server_address[1]}"

    def serve_one(self, sock: socket.socket, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "put":
            head = SlotHeader.from_json(msg["header"], "put from the network")
            slots, lock = self.ranks.get(head.rank)
            with lock:
                held = newest(slots)
                target = slots[1] if held and held[0][1] is slots[0] else slots[0]
                st = os.statvfs(self.ranks.directory)
                room = st.f_bavail * st.f_frsize + target.size
                if head.total > room:  # refused before a byte is taken
                    raise ValueError(f"a copy of rank {head.rank} step {head.step} needs "
                                     f"{head.total} bytes; {self.ranks.directory} has {room}")
                receive_copy(sock, target, head)
            send_msg(sock, {"ok": True})
        elif op == "list":
            slots, lock = self.ranks.get(int(msg["rank"]))
            with lock:
                steps = [h.step for h, _ in newest(slots)
                         if h.world_size == int(msg["world_size"])]
            send_msg(sock, {"ok": True, "steps": steps})
        elif op == "get":
            slots, lock = self.ranks.get(int(msg["rank"]))
            with lock:
                found = [(h, s) for h, s in newest(slots) if h.step == int(msg["step"])]
                if not found:
                    raise KeyError(f"rank {msg['rank']} step {msg['step']} is not held here")
                head, slot = found[0]
                send_msg(sock, {"ok": True, "header": head.to_json()})
                sock.sendall(slot.view(HEADER, head.data_size + head.meta_size))
        else:
            raise ValueError(f"unknown op {op!r}")


class PeerServer:
    """The agent's server of its peers' copies, in a thread; copies live in ``directory``."""

    def __init__(self, directory: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server(directory, host, port)
        self.address = self._server.address
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="memckpt-peer", daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._server.ranks.close()


class PeerClient:
    """One connection to a peer's server."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        host, _, port = address.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            raise PeerError(f"memory peer {address}: cannot connect: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _reply(self) -> dict[str, Any]:
        try:
            reply = recv_msg(self.sock)
        except (ConnectionError, OSError) as exc:
            raise PeerError(f"memory peer {self.address}: {exc}") from None
        if not reply.get("ok"):
            raise PeerError(f"memory peer {self.address}: {reply.get('error')}")
        return reply

    def push(self, slot: SlotFile, head: SlotHeader) -> None:
        """Send a committed copy; returns once the peer has checked and committed it."""
        try:
            send_msg(self.sock, {"op": "put", "header": head.to_json()})
            self.sock.sendall(slot.view(HEADER, head.data_size + head.meta_size))
        except OSError as exc:
            try:  # a refusal says why before the peer closes
                reply = recv_msg(self.sock)
            except (ConnectionError, OSError, ValueError):
                reply = {"error": str(exc)}
            raise PeerError(f"memory peer {self.address}: {reply.get('error')}") from None
        self._reply()

    def listing(self, rank: int, world_size: int) -> list[int]:
        send_msg(self.sock, {"op": "list", "rank": rank, "world_size": world_size})
        return [int(s) for s in self._reply()["steps"]]

    def fetch(self, rank: int, step: int, into: SlotFile) -> SlotHeader:
        """The peer's copy of ``rank`` at ``step``, received into ``into`` and checked."""
        send_msg(self.sock, {"op": "get", "rank": rank, "step": step})
        head = SlotHeader.from_json(self._reply()["header"], f"memory peer {self.address}")
        if (head.rank, head.step) != (rank, step):
            raise PeerError(f"memory peer {self.address}: asked rank {rank} step {step}, got "
                            f"rank {head.rank} step {head.step}")
        try:
            receive_copy(self.sock, into, head)
        except (ConnectionError, OSError) as exc:
            raise PeerError(f"memory peer {self.address}: {exc}") from None
        return head

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def main(argv: list[str]) -> int:
    """``python -m ckpt.memory_peer DIR [HOST:PORT]``: serve until killed."""
    if not argv:
        print("usage: python -m ckpt.memory_peer DIR [HOST:PORT]", file=sys.stderr)
        return 2
    os.makedirs(argv[0], mode=0o700, exist_ok=True)
    host, _, port = (argv[1] if len(argv) > 1 else "127.0.0.1:0").rpartition(":")
    server = PeerServer(argv[0], host, int(port))
    print(f"listening on {server.address}", flush=True)
    server._server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
