"""A man in the middle of the memory tier's peer stream, without the job's token.

It listens on loopback, connects each client to the real server, passes the handshake
through untouched (the hello, the client's auth, the server's proof: three plain frames) and
then hands every request (client to server) and every reply (server to client) to a hook,
which returns the bytes to forward in its place. It parses the wire as an attacker would:
frames of a 4-byte length and JSON, then, when the stream has them, a tag per frame and per
chunk of a copy (``ckpt.memory_wire.TAG``, ``CHUNK``); the old stream had none, so the same
relay attacks both (the tests must fail on the code before the MACs).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt.memory_peer import recv_exact

try:
    from ckpt.memory_wire import CHUNK, TAG
except ImportError:  # the stream before every frame carried a MAC
    CHUNK, TAG = 0, 0

_LEN = struct.Struct("<I")


def read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    recv_exact(sock, memoryview(out))
    return bytes(out)


@dataclass
class Piece:
    """One request or reply as it crossed the relay: the message, its tag, and the copy that
    followed it (its bytes without the tags, and the tags)."""

    conn: int
    index: int  # its number among all requests (or replies) the relay saw
    msg: Any
    tag: bytes
    payload: bytes = b""
    tags: list[bytes] = field(default_factory=list)
    raw: bytes = b""  # exactly what arrived

    def emit(self, msg: Any = None, payload: bytes | None = None) -> bytes:
        """The bytes of this piece with ``msg`` and/or ``payload`` replaced; the original
        tags go along (the relay cannot make new ones)."""
        body = json.dumps(self.msg if msg is None else msg).encode()
        out = _LEN.pack(len(body)) + body + self.tag
        data = self.payload if payload is None else payload
        step = CHUNK or max(len(data), 1)
        for i, at in enumerate(range(0, len(data), step)):
            tag = self.tags[i] if i < len(self.tags) else b"\0" * TAG
            out += data[at : at + step] + tag
        return out


def _copy_len(msg: Any) -> int:
    head = msg.get("header") if isinstance(msg, dict) else None
    return head["data_size"] + head["meta_size"] if isinstance(head, dict) else 0


def _read_piece(sock: socket.socket, conn: int) -> Piece:
    head = read_exact(sock, 4)
    body = read_exact(sock, _LEN.unpack(head)[0])
    tag = read_exact(sock, TAG) if TAG else b""
    msg = json.loads(body)
    piece = Piece(conn, -1, msg, tag)
    raw = bytearray(head + body + tag)
    left = _copy_len(msg)
    payload = bytearray()
    while left:
        n = min(CHUNK, left) if CHUNK else left
        chunk = read_exact(sock, n)
        payload += chunk
        raw += chunk
        if TAG:
            piece.tags.append(read_exact(sock, TAG))
            raw += piece.tags[-1]
        left -= n
    piece.payload, piece.raw = bytes(payload), bytes(raw)
    return piece


Hook = Callable[[Piece], bytes]


class Relay:
    """``on_request`` / ``on_reply``: given each :class:`Piece`, the bytes to forward
    (default: what arrived). ``requests`` / ``replies``: every piece seen, in order."""

    def __init__(
        self, target: str, on_request: Hook | None = None, on_reply: Hook | None = None
    ) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.on_request = on_request or (lambda p: p.raw)
        self.on_reply = on_reply or (lambda p: p.raw)
        self.requests: list[Piece] = []
        self.replies: list[Piece] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            conn, self._conns = self._conns, self._conns + 1
            for args in (
                (client, server, conn, 1, self.requests, self.on_request),
                (server, client, conn, 2, self.replies, self.on_reply),
            ):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        conn: int,
        plain: int,
        seen: list[Piece],
        hook: Hook,
    ) -> None:
        try:
            for _ in range(plain):  # the handshake, passed through
                head = read_exact(src, 4)
                dst.sendall(head + read_exact(src, _LEN.unpack(head)[0]))
            while True:
                piece = _read_piece(src, conn)
                with self._lock:
                    piece.index = len(seen)
                    seen.append(piece)
                dst.sendall(hook(piece))
        except (OSError, ValueError):
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
