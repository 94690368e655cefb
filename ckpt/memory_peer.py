"""Peer replication of memory-tier copies: a TCP server in the node agent, and its client.

Why plain TCP: one copy goes one way per step, as one stream, between two agents; TCP moves it
at link speed with no extra dependency or process (gloo/NCCL would tie the copy to the
trainer's process groups, which die with the trainer; a store or S3 adds a hop). The server
writes what it receives straight into a slot file of its own (``memory_slot``), double
buffered per rank, and commits it only once every byte has arrived and checked, so a sender
lost mid-copy leaves the previous copy whole.

Every connection first proves that both ends hold the job's secret (``BOOTSEER_MEMCKPT_TOKEN``,
the same on every node): an HMAC-SHA256 challenge-response both ways, the token never on the
wire (``_authenticate``). Until it has, the server reads one small message and nothing else,
and a failed proof closes the connection: a process that can reach the port but lacks the
token can neither write into this node's memory nor read a copy. The server binds the job's
network address (a wildcard address is refused).

Messages: a 4-byte little-endian length and a JSON object, then, for ``put`` and ``get``, the
copy's bytes after its header page (data and meta)::

    server: {"hello": "bootseer-memckpt", "challenge": SN}
    client: {"op": "auth", "nonce": CN, "mac": HMAC(token, "client" SN CN)}
    server: {"ok": true, "mac": HMAC(token, "server" CN SN)} | {"ok": false, "error": ...}

    {"op": "put", "header": {...}}   + bytes  ->  {"ok": true} | {"ok": false, "error": ...}
    {"op": "list", "rank": R, "world_size": W}  ->  {"ok": true, "steps": [...]}
    {"op": "get", "rank": R, "step": S}  ->  {"ok": true, "header": {...}} + bytes

Run a server alone (tests, benchmarks): ``BOOTSEER_MEMCKPT_TOKEN=... python -m ckpt.memory_peer
DIR [HOST:PORT]``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import socketserver
import struct
import sys
import threading
from typing import Any

from striped_fs.privdir import PrivateDir

from .memory_slot import HEADER, SlotDamaged, SlotFile, SlotHeader, newest, slot_paths

PEERS_WHAT = "the memory tier's directory of peer copies"
OWN_WHAT = "the memory tier's directory (ckpt.memory_dir, BOOTSEER_MEMCKPT_DIR)"

log = logging.getLogger("ckpt")

MAX_MESSAGE = 1 << 20
MAX_HELLO = 1024  # what an unauthenticated peer may make the server read
TOKEN_ENV = "BOOTSEER_MEMCKPT_TOKEN"  # the job's secret, the same on every node
MIN_TOKEN = 16
HANDSHAKE_S = 30.0
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


def recv_msg(sock: socket.socket, limit: int = MAX_MESSAGE) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length > limit:
        raise ConnectionError(f"message of {length} bytes exceeds {limit}")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return json.loads(body)


def check_token(token: str | bytes) -> bytes:
    """The job's secret as bytes; one too short to resist guessing is refused (not shown)."""
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if len(raw) < MIN_TOKEN:
        raise ValueError(f"the memory tier's peer copies need the job's secret in {TOKEN_ENV} "
                         f"(at least {MIN_TOKEN} characters, the same on every node of the job, "
                         "e.g. from a Kubernetes Secret; make one with python -c 'import "
                         "secrets; print(secrets.token_hex(32))'), "
                         + ("which is not set" if not raw else "which is too short"))
    return raw


def _mac(token: bytes, who: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(token, b"bootseer-memckpt/1 " + who + first + second,
                    hashlib.sha256).hexdigest()


def _nonce(msg: dict[str, Any], key: str) -> bytes:
    value = msg.get(key)
    if not isinstance(value, str) or len(value) != 64:
        raise ValueError(f"no {key} in the handshake")
    return bytes.fromhex(value)


class AuthError(ConnectionError):
    """The other end did not prove it holds the job's secret."""


def serve_handshake(sock: socket.socket, token: bytes) -> None:
    """The server's side: challenge, check the client's proof, prove itself."""
    challenge = secrets.token_bytes(32)
    send_msg(sock, {"hello": "bootseer-memckpt", "challenge": challenge.hex()})
    msg = recv_msg(sock, MAX_HELLO)
    try:
        if msg.get("op") != "auth":
            raise ValueError("the first message is not auth")
        nonce = _nonce(msg, "nonce")
        ok = hmac.compare_digest(str(msg.get("mac", "")), _mac(token, b"client", challenge,
                                                                nonce))
    except ValueError as exc:
        raise AuthError(f"a malformed handshake ({exc})") from None
    if not ok:
        raise AuthError("the client does not hold the job's token")
    send_msg(sock, {"ok": True, "mac": _mac(token, b"server", nonce, challenge)})


def client_handshake(sock: socket.socket, token: bytes, address: str) -> None:
    """The client's side: answer the challenge, then check the server's proof."""
    hello = recv_msg(sock, MAX_HELLO)
    try:
        challenge = _nonce(hello, "challenge")
    except ValueError as exc:
        raise PeerError(f"memory peer {address}: not a memory peer server ({exc})") from None
    nonce = secrets.token_bytes(32)
    send_msg(sock, {"op": "auth", "nonce": nonce.hex(),
                    "mac": _mac(token, b"client", challenge, nonce)})
    reply = recv_msg(sock, MAX_HELLO)
    if not reply.get("ok"):
        raise PeerError(f"memory peer {address}: refused: {reply.get('error')}")
    if not hmac.compare_digest(str(reply.get("mac", "")), _mac(token, b"server", nonce,
                                                              challenge)):
        raise PeerError(f"memory peer {address}: the server does not hold the job's token "
                        f"({TOKEN_ENV}): not this job's peer")


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
        # made 0700 or checked (this user's, 0700, not a link); slots through its descriptor
        self._dir = PrivateDir.open(directory, what=PEERS_WHAT)
        self.directory = self._dir.path
        self._slots: dict[int, list[SlotFile]] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, rank: int) -> tuple[list[SlotFile], threading.Lock]:
        with self._guard:
            if rank not in self._slots:
                self._slots[rank] = [SlotFile(p, dir_fd=self._dir.fd) for p in
                                     slot_paths(self.directory, f"peer-rank-{rank}")]
                self._locks[rank] = threading.Lock()
            return self._slots[rank], self._locks[rank]

    def close(self) -> None:
        for slots in self._slots.values():
            for s in slots:
                s.close()
        self._dir.close()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(HANDSHAKE_S)  # an idle unauthenticated peer does not hold a thread
        try:
            serve_handshake(sock, self.server.token)
        except AuthError as exc:
            log.warning("memory peer %s: refused a connection from %s: %s (%s must be the "
                        "same on every node)", self.server.address, self.client_address[0],
                        exc, TOKEN_ENV)
            try:
                send_msg(sock, {"ok": False, "error": f"authentication failed: {exc}"})
            except OSError:
                pass
            return
        except (ConnectionError, OSError, ValueError):
            return
        sock.settimeout(None)
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

    def __init__(self, directory: str, host: str, port: int, token: bytes,
                 own: str | None = None) -> None:
        if host in ("", "0.0.0.0", "::", "[::]", "*"):
            raise ValueError(f"memory peer server: {host or '(empty)'!r} binds every "
                             "interface: give the node's address on the job's network (the "
                             "one the other nodes reach it at)")
        self.token = token
        self.ranks = _Ranks(directory)
        try:  # the node's own copies: read through its checked descriptor
            self.own = PrivateDir.open(own, create=False, what=OWN_WHAT) if own else None
        except BaseException:
            self.ranks.close()
            raise
        super().__init__((host, port), _Handler)
        self.address = f"{host}:{self.server_address[1]}"

    def _own(self, rank: int) -> list[SlotFile]:
        return _own_slots(self.own, rank)

    def serve_one(self, sock: socket.socket, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "put":
            head = SlotHeader.from_json(msg["header"], "put from the network")
            slots, lock = self.ranks.get(head.rank)
            with lock:
                target = _target(slots, head.step)
                st = os.statvfs(self.ranks.directory)
                room = st.f_bavail * st.f_frsize + target.size
                if head.total > room:  # refused before a byte is taken
                    raise ValueError(f"a copy of rank {head.rank} step {head.step} needs "
                                     f"{head.total} bytes; {self.ranks.directory} has {room}")
                receive_copy(sock, target, head)
            send_msg(sock, {"ok": True})
        elif op == "list":
            rank = int(msg["rank"])
            slots, lock = self.ranks.get(rank)
            own = self._own(rank)
            try:
                with lock:
                    steps = sorted({h.step for h, _ in newest(slots + own)
                                    if h.world_size == int(msg["world_size"])}, reverse=True)
            finally:
                for s in own:
                    s.close()
            send_msg(sock, {"ok": True, "steps": steps})
        elif op == "get":
            rank = int(msg["rank"])
            slots, lock = self.ranks.get(rank)
            own = self._own(rank)
            try:
                with lock:
                    found = [(h, s) for h, s in newest(slots + own) if h.step == int(msg["step"])]
                    if not found:
                        raise KeyError(f"rank {rank} step {msg['step']} is not held here")
                    head, slot = found[0]
                    send_msg(sock, {"ok": True, "header": head.to_json()})
                    sock.sendall(slot.view(HEADER, head.data_size + head.meta_size))
            finally:
                for s in own:
                    s.close()
        else:
            raise ValueError(f"unknown op {op!r}")


def _own_slots(directory: PrivateDir | None, rank: int) -> list[SlotFile]:
    """This node's own copies of ``rank`` (the ranks it ran), read-only and only those that
    exist: when torch renumbers the nodes, a rank can move off the node holding its newest
    copy (the soak lost 11 steps while only peer copies were served)."""
    if directory is None:
        return []
    slots = []
    for path in slot_paths(directory.path, f"rank-{rank}"):
        try:
            slots.append(SlotFile(path, readonly=True, dir_fd=directory.fd))
        except OSError:  # none yet, a link, another user's or not a file: not served
            continue
    return slots


def _target(slots: list[SlotFile], step: int) -> SlotFile:
    """The slot a copy of ``step`` goes into: one holding that step or a later one (a retry,
    or the abandoned run's copy after the job went back to an older step), else the slot
    not holding the newest copy. Either way the other slot keeps a complete copy."""
    held = newest(slots)
    stale = [slot for head, slot in held if head.step >= step]
    if stale:
        return stale[0]
    return slots[1] if held and held[0][1] is slots[0] else slots[0]


class PeerServer:
    """The agent's server of its peers' copies, in a thread; copies live in ``directory``;
    with ``own`` (the node's memory directory) also the node's own copies, read-only.

    ``token``: the job's secret (``BOOTSEER_MEMCKPT_TOKEN``; default: that variable); every
    connection must prove it holds it."""

    def __init__(self, directory: str, host: str = "127.0.0.1", port: int = 0,
                 token: str | bytes | None = None, own: str | None = None) -> None:
        secret = check_token(os.environ.get(TOKEN_ENV, "") if token is None else token)
        self._server = _Server(directory, host, port, secret, own)
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
        if self._server.own is not None:
            self._server.own.close()


class PeerClient:
    """One authenticated connection to a peer's server (``token``: the job's secret;
    default: ``BOOTSEER_MEMCKPT_TOKEN``)."""

    def __init__(self, address: str, timeout_s: float = 30.0,
                 token: str | bytes | None = None) -> None:
        self.address = address
        host, _, port = address.rpartition(":")
        try:
            secret = check_token(os.environ.get(TOKEN_ENV, "") if token is None else token)
        except ValueError as exc:
            raise PeerError(f"memory peer {address}: {exc}") from None
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            raise PeerError(f"memory peer {address}: cannot connect: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            client_handshake(self.sock, secret, address)
        except (ConnectionError, OSError, ValueError) as exc:
            self.sock.close()
            raise PeerError(f"memory peer {address}: handshake failed: {exc}") from None
        except PeerError:
            self.sock.close()
            raise

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
    """``python -m ckpt.memory_peer DIR [HOST:PORT [OWN_DIR]]``: serve until killed (the
    job's secret in ``BOOTSEER_MEMCKPT_TOKEN``); OWN_DIR: the node's own copies too."""
    if not argv:
        print("usage: python -m ckpt.memory_peer DIR [HOST:PORT [OWN_DIR]]", file=sys.stderr)
        return 2
    host, _, port = (argv[1] if len(argv) > 1 else "127.0.0.1:0").rpartition(":")
    server = PeerServer(argv[0], host, int(port), own=argv[2] if len(argv) > 2 else None)
    print(f"listening on {server.address}", flush=True)
    server._server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
