"""Peer replication of memory-tier copies: a TCP server in the node agent, and its client.

Why plain TCP: one copy goes one way per step, as one stream, between two agents; TCP moves it
at link speed with no extra dependency or process (gloo/NCCL would tie the copy to the
trainer's process groups, which die with the trainer; a store or S3 adds a hop). The server
writes what it receives straight into a slot file of its own (``memory_slot``), double
buffered per rank, and commits it only once every byte has arrived and checked, so a sender
lost mid-copy leaves the previous copy whole.

Every connection first proves that both ends hold the job's secret (``BOOTSEER_MEMCKPT_TOKEN``,
the same on every node): an HMAC-SHA256 challenge-response both ways, the token never on the
wire, which also derives the session's keys (``memory_wire``). After it every message and
every chunk of a copy carries a MAC under those keys and a per-direction sequence number,
checked before anything is acted on, allocated or committed, so a relay that passes the
handshake through can change nothing after it. Until the proof the server reads one small
message, and the hello and the request must both arrive within ``HANDSHAKE_S`` of the
connection (a deadline, not a per-``recv`` timeout). Each connection carries one request and
is closed after it, the server serves at most ``MAX_CONNECTIONS`` at once (others are told it
is busy and try again), a ``list`` or ``get`` never creates a file, and every message is
parsed by a typed spec: a bad one is refused with a log line. The server binds the job's
network address (a wildcard address is refused).

Messages (JSON objects; a copy's bytes follow ``put`` and the ``get`` reply, in tagged
chunks)::

    server: {"hello": "bootseer-memckpt", "version": 2, "challenge": SN}
    client: {"op": "auth", "nonce": CN, "mac": HMAC(token, "client" SN CN)}
    server: {"ok": true, "mac": HMAC(token, "server" CN SN)} | {"ok": false, "error": ...}
    ... then one of, each message tagged:
    {"op": "put", "header": {...}}   + bytes  ->  {"ok": true} | {"ok": false, "error": ...}
    {"op": "list", "rank": R, "world_size": W}  ->  {"ok": true, "steps": [...]}
    {"op": "get", "rank": R, "step": S}  ->  {"ok": true, "header": {...}} + bytes

Run a server alone (tests, benchmarks): ``BOOTSEER_MEMCKPT_TOKEN=... python -m ckpt.memory_peer
DIR [HOST:PORT]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from striped_fs import PrivateDir

from .memory_env import TOKEN_ENV  # the job's secret, the same on every node
from .memory_slot import HEADER, SlotDamaged, SlotFile, SlotHeader, newest, slot_paths
from .memory_wire import (
    MAX_HELLO,
    MAX_MESSAGE,
    AuthError,
    BadMessage,
    Busy,
    Channel,
    Const,
    Deadline,
    Int,
    List,
    Num,
    Obj,
    Str,
    client_handshake,
    kind_of,
    recv_exact,
    recv_msg,
    send_msg,
    serve_handshake,
)

__all__ = [
    "MAX_HELLO",
    "MAX_MESSAGE",
    "PeerClient",
    "PeerError",
    "PeerServer",
    "check_token",
    "recv_exact",
    "recv_msg",
    "send_msg",
]

PEERS_WHAT = "the memory tier's directory of peer copies"
OWN_WHAT = "the memory tier's directory (ckpt.memory_dir, BOOTSEER_MEMCKPT_DIR)"

log = logging.getLogger("ckpt")

MIN_TOKEN = 16
HANDSHAKE_S = 30.0  # from the connection to its request, whole (the hello included)
PROGRESS_S = 30.0  # a copy's bytes: at most this long without one arriving
MAX_CONNECTIONS = 64  # served at once; more are told "busy" and retry
MAX_WORLD = 1 << 20
MAX_META = 256 << 20  # a copy's meta: its tensors' entries, block sums, pickled objects
MAX_DATA = 1 << 48  # a hard cap before the room is asked; the room is the real bound
FRESH_S = 5.0  # a client's first connection is used for its first request only this soon
_HEADER = Obj(
    {
        "version": Int(),
        "step": Int(),
        "rank": Int(hi=MAX_WORLD - 1),
        "world_size": Int(1, MAX_WORLD),
        "data_size": Int(hi=MAX_DATA),
        "meta_size": Int(4, MAX_META),
        "meta_crc32": Int(hi=(1 << 32) - 1),
        "created": Num(),
        "job": Str(),
    }
)
_REQUESTS = {
    "put": Obj({"op": Const("put"), "header": _HEADER}),
    "list": Obj(
        {"op": Const("list"), "rank": Int(hi=MAX_WORLD - 1), "world_size": Int(1, MAX_WORLD)}
    ),
    "get": Obj({"op": Const("get"), "rank": Int(hi=MAX_WORLD - 1), "step": Int()}),
}
_REFUSAL = Obj({"ok": Const(False), "error": Str(4096)})
_PUT_OK = Obj({"ok": Const(True)})
_LIST_OK = Obj({"ok": Const(True), "steps": List(Int(), 64)})
_GET_OK = Obj({"ok": Const(True), "header": _HEADER})


class PeerError(Exception):
    """The peer refused or failed a request; the message names the peer and why."""


def parse_request(raw: Any) -> dict[str, Any]:
    """A request checked by its op's spec (:class:`BadMessage` otherwise)."""
    if type(raw) is not dict:
        raise BadMessage(f"the request: a JSON {kind_of(raw)}, not an object")
    op = raw.get("op")
    spec = _REQUESTS.get(op) if type(op) is str else None
    if spec is None:
        raise BadMessage(f"the request: op {str(op)[:40]!r} is not one of {', '.join(_REQUESTS)}")
    req = spec(raw, f"the {op} request")
    rank, world = (
        (req["header"]["rank"], req["header"]["world_size"])
        if op == "put"
        else (req["rank"], req.get("world_size", MAX_WORLD))
    )
    if rank >= world:
        raise BadMessage(f"the {op} request: rank {rank} of a world of {world}")
    return req


def check_token(token: str | bytes) -> bytes:
    """The job's secret as bytes; one too short to resist guessing is refused (not shown)."""
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if len(raw) < MIN_TOKEN:
        raise ValueError(
            f"the memory tier's peer copies need the job's secret in {TOKEN_ENV} "
            f"(at least {MIN_TOKEN} characters, the same on every node of the job, "
            "e.g. from a Kubernetes Secret; make one with python -c 'import "
            "secrets; print(secrets.token_hex(32))'), "
            + ("which is not set" if not raw else "which is too short")
        )
    return raw


def receive_copy(chan: Channel, slot: SlotFile, head: SlotHeader) -> None:
    """Receive a copy's bytes into ``slot``, each chunk's MAC checked as it arrives, check
    every block, then commit it. ``head`` has been checked against what may be received."""
    slot.ensure(head.total)
    slot.invalidate()
    chan.recv_bulk(slot.view(HEADER, head.data_size + head.meta_size))
    meta, _ = slot.meta(head)
    slot.check_data(head, meta["sums"])
    slot.commit(head)


def room_for(head: SlotHeader, slot: SlotFile, directory: str, where: str) -> None:
    """Refuse a copy bigger than ``directory`` can take (its free space and what ``slot``
    already holds), before a byte is allocated."""
    st = os.statvfs(directory)
    room = st.f_bavail * st.f_frsize + slot.size
    if head.total > room:
        raise ValueError(
            f"{where}: a copy of rank {head.rank} step {head.step} needs "
            f"{head.total} bytes; {directory} has {room}"
        )


class _Ranks:
    """The replicas a server holds: two slot files per rank, one lock per rank."""

    def __init__(self, directory: str) -> None:
        # made 0700 or checked (this user's, 0700, not a link); slots through its descriptor
        self._dir = PrivateDir.open(directory, what=PEERS_WHAT)
        self.directory = self._dir.path
        self._slots: dict[int, list[SlotFile]] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def held(self, rank: int) -> tuple[list[SlotFile], threading.Lock] | None:
        """The slots of a rank that has copies here (put by this server, or files from
        before it started); ``None`` when it has none: a list or get creates no file and
        keeps nothing open (1,200 lists of new ranks had made 2,400 files, kept open)."""
        with self._guard:
            cached = rank in self._slots
        if cached or any(
            self._exists(os.path.basename(p))
            for p in slot_paths(self.directory, f"peer-rank-{rank}")
        ):
            return self.get(rank)
        return None

    def _exists(self, name: str) -> bool:
        try:  # through the directory's descriptor, a link not followed
            os.stat(name, dir_fd=self._dir.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def get(self, rank: int) -> tuple[list[SlotFile], threading.Lock]:
        with self._guard:
            if rank not in self._slots:
                self._slots[rank] = [
                    SlotFile(p, dir_fd=self._dir.fd)
                    for p in slot_paths(self.directory, f"peer-rank-{rank}")
                ]
                self._locks[rank] = threading.Lock()
            return self._slots[rank], self._locks[rank]

    def close(self) -> None:
        for slots in self._slots.values():
            for s in slots:
                s.close()
        self._dir.close()


class _Handler(socketserver.BaseRequestHandler):
    """One connection: the handshake and one request, within ``handshake_s`` of the
    connection; then the connection is closed (``socketserver`` closes it)."""

    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer, address = self.client_address[0], self.server.address
        deadline = Deadline(self.server.handshake_s)  # the whole hello, not each recv
        try:
            chan = serve_handshake(sock, self.server.token, deadline)
        except AuthError as exc:
            log.warning(
                "memory peer %s: refused a connection from %s: %s (%s must be the "
                "same on every node)",
                address,
                peer,
                exc,
                TOKEN_ENV,
            )
            with contextlib.suppress(OSError):
                send_msg(sock, {"ok": False, "error": f"authentication failed: {exc}"})
            return
        except TimeoutError as exc:
            log.warning(
                "memory peer %s: closed a connection from %s: its handshake was %s",
                address,
                peer,
                exc,
            )
            return
        except (OSError, BadMessage) as exc:
            log.info(
                "memory peer %s: a connection from %s ended in the handshake: %s",
                address,
                peer,
                exc,
            )
            return
        op = "request"
        try:
            req = parse_request(chan.recv(deadline=deadline))
            op = req["op"]
            sock.settimeout(self.server.progress_s)
            self.server.serve_one(chan, req)
        except (SlotDamaged, BadMessage, OSError, ValueError) as exc:
            log.warning("memory peer %s: refused a %s from %s: %s", address, op, peer, exc)
            with contextlib.suppress(OSError, ValueError):
                chan.send({"ok": False, "error": str(exc)[:4000]})


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        directory: str,
        host: str,
        port: int,
        token: bytes,
        own: str | None = None,
        max_connections: int | None = None,
        handshake_s: float | None = None,
    ) -> None:
        if host in ("", "0.0.0.0", "::", "[::]", "*"):
            raise ValueError(
                f"memory peer server: {host or '(empty)'!r} binds every "
                "interface: give the node's address on the job's network (the "
                "one the other nodes reach it at)"
            )
        self.handshake_s = HANDSHAKE_S if handshake_s is None else handshake_s
        self.progress_s = PROGRESS_S
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self._open = threading.BoundedSemaphore(self.max_connections)
        self._busy_said = 0.0
        self.token = token
        self.ranks = _Ranks(directory)
        try:  # the node's own copies: read through its checked descriptor
            self.own = PrivateDir.open(own, create=False, what=OWN_WHAT) if own else None
        except BaseException:
            self.ranks.close()
            raise
        super().__init__((host, port), _Handler)
        self.address = f"{host}:{self.server_address[1]}"

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, at most ``max_connections`` at once: beyond that the
        connection is told "busy" (the client tries again) and closed at once."""
        if not self._open.acquire(blocking=False):
            self._refuse_busy(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._open.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._open.release()

    def _refuse_busy(self, request: socket.socket, client_address: Any) -> None:
        with contextlib.suppress(OSError):
            request.setblocking(False)  # the accepting thread never waits on a client
            send_msg(request, {"hello": "bootseer-memckpt", "busy": True})
        self.shutdown_request(request)
        now = time.monotonic()
        if now - self._busy_said > 60:
            self._busy_said = now
            log.warning(
                "memory peer %s: %d connections open, the most it serves at once: "
                "told %s to try again (said once a minute)",
                self.address,
                self.max_connections,
                client_address[0],
            )

    def handle_error(self, request: Any, client_address: Any) -> None:
        """What a handler did not expect is a log line, never a traceback on stderr."""
        exc = sys.exc_info()[1]
        log.warning(
            "memory peer %s: a connection from %s failed: %s: %s",
            self.address,
            client_address[0],
            type(exc).__name__,
            exc,
        )

    def _own(self, rank: int) -> list[SlotFile]:
        return _own_slots(self.own, rank)

    @contextlib.contextmanager
    def _copies(self, rank: int) -> Iterator[list[SlotFile]]:
        """Every slot holding ``rank``'s copies here (under its lock); files opened for the
        request are closed after it."""
        held = self.ranks.held(rank)
        own = self._own(rank)
        try:
            if held is None:
                yield own
            else:
                with held[1]:
                    yield held[0] + own
        finally:
            for s in own:
                s.close()

    def serve_one(self, chan: Channel, req: dict[str, Any]) -> None:
        """One request, parsed by its spec (``parse_request``)."""
        op = req["op"]
        if op == "put":
            head = SlotHeader.from_json(req["header"], "a put from the network")
            slots, lock = self.ranks.get(head.rank)
            with lock:
                target = _target(slots, head.step)
                room_for(head, target, self.ranks.directory, "memory peer")  # before a byte
                receive_copy(chan, target, head)
            chan.send({"ok": True})
        elif op == "list":
            with self._copies(req["rank"]) as slots:
                steps = sorted(
                    {h.step for h, _ in newest(slots) if h.world_size == req["world_size"]},
                    reverse=True,
                )
            chan.send({"ok": True, "steps": steps[:64]})
        else:
            with self._copies(req["rank"]) as slots:
                found = [(h, s) for h, s in newest(slots) if h.step == req["step"]]
                if not found:
                    raise ValueError(f"rank {req['rank']} step {req['step']} is not held here")
                head, slot = found[0]
                chan.send({"ok": True, "header": head.to_json()})
                chan.send_bulk(slot.view(HEADER, head.data_size + head.meta_size))


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
    connection must prove it holds it. ``max_connections`` (default ``MAX_CONNECTIONS``):
    served at once; ``handshake_s`` (default ``HANDSHAKE_S``): from a connection to its
    request, whole."""

    def __init__(
        self,
        directory: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | bytes | None = None,
        own: str | None = None,
        max_connections: int | None = None,
        handshake_s: float | None = None,
    ) -> None:
        secret = check_token(os.environ.get(TOKEN_ENV, "") if token is None else token)
        self._server = _Server(directory, host, port, secret, own, max_connections, handshake_s)
        self.address = self._server.address
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="memckpt-peer", daemon=True
        )

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
    """Requests to a peer's server, each on a connection of its own that proves the job's
    secret both ways (``token``; default: ``BOOTSEER_MEMCKPT_TOKEN``) and is closed after
    it. The first connection is made here, so a server that is away or does not hold the
    token is named at once; ``timeout_s`` bounds the handshake (whole) and each wait for
    bytes after it."""

    def __init__(
        self, address: str, timeout_s: float = 30.0, token: str | bytes | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        host, _, port = address.rpartition(":")
        try:
            self._secret = check_token(os.environ.get(TOKEN_ENV, "") if token is None else token)
            self._target = (host, int(port))
        except ValueError as exc:
            raise PeerError(f"memory peer {address}: {exc}") from None
        self._fresh: tuple[Channel, float] | None = (self._connect(), time.monotonic())

    def _connect(self) -> Channel:
        """A new authenticated session; a busy server is asked again (at most
        ``timeout_s``)."""
        deadline = Deadline(self.timeout_s)
        pause = 0.02
        while True:
            try:
                sock = socket.create_connection(
                    self._target, timeout=max(0.01, deadline.at - time.monotonic())
                )
            except OSError as exc:
                raise PeerError(f"memory peer {self.address}: cannot connect: {exc}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                chan = client_handshake(sock, self._secret, deadline)
                sock.settimeout(self.timeout_s)
                return chan
            except Busy:
                sock.close()
                left = deadline.at - time.monotonic()
                if left <= 0:
                    raise PeerError(
                        f"memory peer {self.address}: busy (it serves at most "
                        f"its max_connections at once) for {self.timeout_s:g} s"
                    ) from None
                time.sleep(min(left, pause * random.uniform(0.5, 1.5)))
                pause = min(pause * 2, 1.0)
            except AuthError as exc:
                sock.close()
                raise PeerError(
                    f"memory peer {self.address}: {exc}"
                    + (
                        f" ({TOKEN_ENV}): not this job's peer"
                        if "does not hold" in str(exc)
                        else ""
                    )
                ) from None
            except (OSError, BadMessage) as exc:
                sock.close()
                raise PeerError(f"memory peer {self.address}: handshake failed: {exc}") from None

    def _session(self) -> Channel:
        fresh, self._fresh = self._fresh, None
        if fresh is not None and time.monotonic() - fresh[1] < FRESH_S:
            return fresh[0]
        if fresh is not None:  # the server may have given up on it: a new one
            fresh[0].close()
        return self._connect()

    def _reply(self, chan: Channel, spec: Obj) -> dict[str, Any]:
        """The reply, its MAC and then its spec checked; a refusal raises, naming why."""
        where = f"memory peer {self.address}"
        try:
            raw = chan.recv()
            if type(raw) is dict and raw.get("ok") is False:
                raise PeerError(f"{where}: {_REFUSAL(raw, 'its refusal')['error']}")
            return spec(raw, f"{where}'s reply")
        except (OSError, BadMessage) as exc:
            raise PeerError(f"{where}: {exc}") from None

    def push(self, slot: SlotFile, head: SlotHeader) -> None:
        """Send a committed copy; returns once the peer has checked and committed it."""
        chan = self._session()
        try:
            try:
                chan.send({"op": "put", "header": head.to_json()})
                chan.send_bulk(slot.view(HEADER, head.data_size + head.meta_size))
            except OSError as exc:
                try:  # a refusal says why before the peer closes
                    self._reply(chan, _PUT_OK)
                except PeerError as refusal:
                    raise refusal from None
                raise PeerError(f"memory peer {self.address}: {exc}") from None
            self._reply(chan, _PUT_OK)
        finally:
            chan.close()

    def listing(self, rank: int, world_size: int) -> list[int]:
        chan = self._session()
        try:
            chan.send({"op": "list", "rank": rank, "world_size": world_size})
            return self._reply(chan, _LIST_OK)["steps"]
        finally:
            chan.close()

    def fetch(
        self,
        rank: int,
        step: int,
        into: SlotFile,
        *,
        data_size: int | None = None,
        world_size: int | None = None,
    ) -> SlotHeader:
        """The peer's copy of ``rank`` at ``step``, received into ``into`` and checked. Its
        header is checked before ``into`` is grown: the rank and step asked, ``world_size``
        and ``data_size`` when given (the caller's state's geometry), a meta of at most
        ``MAX_META`` bytes, and room in ``into``'s directory."""
        where = f"memory peer {self.address}"
        chan = self._session()
        try:
            chan.send({"op": "get", "rank": rank, "step": step})
            raw = self._reply(chan, _GET_OK)["header"]
            try:
                head = SlotHeader.from_json(raw, where)
                want = {
                    "rank": rank,
                    "step": step,
                    "world_size": world_size,
                    "data_size": data_size,
                }
                wrong = [
                    f"{k} {getattr(head, k)} (asked {v})"
                    for k, v in want.items()
                    if v is not None and getattr(head, k) != v
                ]
                if wrong:
                    raise PeerError(
                        f"{where}: asked rank {rank} step {step}, its copy has "
                        + ", ".join(wrong)
                        + ": refused before a byte is taken"
                    )
                room_for(head, into, os.path.dirname(into.path) or ".", where)
            except (SlotDamaged, ValueError) as exc:
                raise PeerError(str(exc)) from None
            try:
                receive_copy(chan, into, head)
            except OSError as exc:
                raise PeerError(f"{where}: {exc}") from None
            return head
        finally:
            chan.close()

    def close(self) -> None:
        if self._fresh is not None:
            self._fresh[0].close()
            self._fresh = None

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
