"""The memory tier's peer stream: frames, the handshake, and a MAC on every message and copy.

Why a MAC on everything, not only the handshake: a relay without the job's secret can pass a
challenge-response through untouched and then rewrite what follows (a ``put`` made the
server commit a copy the relay chose; a ``get`` reply's size grew the fetching rank's slot
file to 3 GiB). So the handshake also derives a key per session and direction from the token
and both sides' nonces (:func:`session_keys`), and after it every frame carries a tag under
that key and a per-direction sequence number (:class:`Channel`): a frame changed, replayed
from this or another connection, reordered or reflected back fails its tag and is refused
before anything is acted on, allocated or committed.

The tag is AES-256-GCM's over the bytes as associated data (GMAC, the ``cryptography``
package): a copy is tagged chunk by chunk as it goes and checked as it arrives, at 6.5 GB/s on
one core where HMAC-SHA256 ran at 0.55 GB/s on the same loaded machine (docs/decisions.md).
The copies stay unencrypted (docs/security.md).

Frames: a 4-byte little-endian length, a JSON object and, after the handshake, a 16-byte tag
over the length and the body; a copy follows its message in chunks of ``CHUNK`` bytes, each
followed by its tag. Every message is parsed by a typed, bounded spec (:class:`Obj`,
:class:`Int`, ...) before use: a JSON array, a string for a number or a size out of bounds is
a :class:`BadMessage`, never a traceback.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAX_MESSAGE = 1 << 20  # one message (a copy's bytes travel after it, not in it)
MAX_HELLO = 1024  # what an unauthenticated peer may make the server read
TAG = 16
CHUNK = 1 << 20  # a copy's bytes go in chunks of this, each with its tag
HELLO = "bootseer-memckpt"
VERSION = 2  # 2: every frame after the handshake carries a tag (1: the handshake only)
_LEN = struct.Struct("<I")
_MSG, _BULK = b"msg\0", b"blk\0"  # in the nonce: a message never passes for a copy's chunk


class WireError(ConnectionError):
    """The stream cannot go on: a frame that fails its tag, is too long, or is cut short."""


class AuthError(WireError):
    """The other end did not prove it holds the job's secret."""


class Busy(WireError):
    """The server holds as many connections as it serves at once: try again shortly."""


class BadMessage(ValueError):
    """A message that is not what the protocol says (its type, keys, types or bounds)."""


# -- typed, bounded specs ---------------------------------------------------------------------
def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def kind_of(value: Any) -> str:
    """What a JSON value is, in JSON's words (an array, a string, ...)."""
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Int:
    """An integer in [lo, hi] (a boolean is not one)."""

    lo: int = 0
    hi: int = (1 << 63) - 1

    def __call__(self, value: Any, where: str) -> int:
        if type(value) is not int or not self.lo <= value <= self.hi:
            raise BadMessage(f"{where}: {_show(value)} is not an integer in [{self.lo}, {self.hi}]")
        return value


@dataclass(frozen=True)
class Num:
    """A finite number (an integer or a float, not a boolean)."""

    def __call__(self, value: Any, where: str) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise BadMessage(f"{where}: {_show(value)} is not a finite number")
        return value


@dataclass(frozen=True)
class Str:
    """A string of at most ``max_len`` characters."""

    max_len: int = 256

    def __call__(self, value: Any, where: str) -> str:
        if type(value) is not str or len(value) > self.max_len:
            raise BadMessage(
                f"{where}: {_show(value)} is not a string of at most {self.max_len} characters"
            )
        return value


@dataclass(frozen=True)
class Const:
    """Exactly ``value`` (``True``, an op's name)."""

    value: Any

    def __call__(self, value: Any, where: str) -> Any:
        if type(value) is not type(self.value) or value != self.value:
            raise BadMessage(f"{where}: {_show(value)}, expected {self.value!r}")
        return value


@dataclass(frozen=True)
class Hex:
    """``size`` bytes written as hex."""

    size: int

    def __call__(self, value: Any, where: str) -> bytes:
        if type(value) is not str or len(value) != 2 * self.size:
            raise BadMessage(f"{where}: not {self.size} bytes in hex")
        try:
            return bytes.fromhex(value)
        except ValueError:
            raise BadMessage(f"{where}: not {self.size} bytes in hex") from None


@dataclass(frozen=True)
class List:
    """An array of at most ``max_len`` items, each checked by ``item``."""

    item: Any
    max_len: int

    def __call__(self, value: Any, where: str) -> list[Any]:
        if type(value) is not list or len(value) > self.max_len:
            raise BadMessage(
                f"{where}: a JSON {kind_of(value)}, not an array of at most {self.max_len} items"
            )
        return [self.item(v, f"{where}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class Obj:
    """A JSON object with exactly these keys (``optional`` ones may be absent), each checked."""

    fields: dict[str, Any]
    optional: dict[str, Any] = field(default_factory=dict)

    def __call__(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict:
            raise BadMessage(f"{where}: a JSON {kind_of(value)}, not an object")
        missing = sorted(set(self.fields) - value.keys())
        extra = sorted(value.keys() - self.fields.keys() - self.optional.keys())
        if missing or extra:
            raise BadMessage(
                f"{where}: "
                + "; ".join(
                    ([f"lacks {', '.join(missing)}"] if missing else [])
                    + ([f"has unknown keys {_show(extra)}"] if extra else [])
                )
            )
        specs = {**self.fields, **self.optional}
        return {k: specs[k](v, f"{where}.{k}") for k, v in value.items()}


# -- frames -----------------------------------------------------------------------------------
class Deadline:
    """A bound on a whole exchange (the hello, a request), not on each ``recv``: a peer that
    drips one byte at a time is cut off when it expires."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"not done within {self.seconds:g} s")
        return left


def recv_exact(sock: socket.socket, view: memoryview, deadline: Deadline | None = None) -> None:
    """Fill ``view`` from ``sock``; with ``deadline`` every byte by then (else the socket's
    own timeout, per ``recv``)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            sock.settimeout(deadline.left())
        try:
            n = sock.recv_into(view[got:], min(len(view) - got, 4 << 20))
        except TimeoutError:
            if deadline is not None:
                deadline.left()  # says which bound ran out
            raise
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Send buffers back to back in as few calls as the kernel takes (no small trailing write
    for Nagle to hold)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = sock.sendmsg(views)
        while n and views:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0], n = views[0][n:], 0


def _encode(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise BadMessage(f"a message of {len(body)} bytes is over {MAX_MESSAGE}")
    return body


def _decode(body: bytes | bytearray) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise BadMessage("a message that is not JSON") from None


def _recv_body(
    sock: socket.socket, limit: int, deadline: Deadline | None, extra: int = 0
) -> tuple[bytes, bytearray]:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head), deadline)
    (length,) = _LEN.unpack(head)
    if length > limit:  # refused before anything is allocated
        raise WireError(f"a message of {length} bytes is over {limit}")
    rest = bytearray(length + extra)
    recv_exact(sock, memoryview(rest), deadline)
    return bytes(head), rest


def send_msg(sock: socket.socket, obj: Any) -> None:
    """A plain frame: the handshake's, before there is a session key."""
    body = _encode(obj)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_msg(
    sock: socket.socket, limit: int = MAX_MESSAGE, deadline: Deadline | None = None
) -> dict[str, Any]:
    """A plain frame's JSON object (anything else is a :class:`BadMessage`)."""
    _, body = _recv_body(sock, limit, deadline)
    value = _decode(body)
    if type(value) is not dict:
        raise BadMessage(f"a JSON {kind_of(value)} where an object was expected")
    return value


def _nonce(seq: int, kind: bytes) -> bytes:
    return seq.to_bytes(8, "little") + kind


class Channel:
    """One session over a connected socket: every frame sent is tagged under this side's key
    and the next sequence number, every frame received is checked against the other side's
    key and the sequence number expected next, before its bytes are used."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._out, self._in = AESGCM(send_key), AESGCM(recv_key)
        self._sent = self._got = 0

    def _tag(self, kind: bytes, data: Any) -> bytes:
        nonce = _nonce(self._sent, kind)
        self._sent += 1
        return self._out.encrypt(nonce, b"", data)

    def _check(self, kind: bytes, data: Any, tag: bytes, what: str) -> None:
        seq = self._got
        self._got += 1
        try:
            self._in.decrypt(_nonce(seq, kind), tag, data)
        except InvalidTag:
            raise WireError(
                f"{what} {seq} fails its MAC: changed, replayed, reordered or "
                "reflected on the way, or not from this job's peer"
            ) from None

    def send(self, obj: Any) -> None:
        body = _encode(obj)
        head = _LEN.pack(len(body))
        self.sock.sendall(head + body + self._tag(_MSG, head + body))

    def recv(self, limit: int = MAX_MESSAGE, deadline: Deadline | None = None) -> Any:
        """The next message's JSON value, its tag checked (any JSON: the caller's spec says
        what it must be)."""
        head, rest = _recv_body(self.sock, limit, deadline, TAG)
        body = bytes(rest[:-TAG])
        self._check(_MSG, head + body, bytes(rest[-TAG:]), "message")
        return _decode(body)

    def send_bulk(self, view: memoryview) -> None:
        """A copy's bytes, chunk by chunk, each followed by its tag."""
        for at in range(0, len(view), CHUNK):
            chunk = view[at : at + CHUNK]
            send_parts(self.sock, [chunk, self._tag(_BULK, chunk)])

    def recv_bulk(self, view: memoryview) -> None:
        """Fill ``view`` with a copy's bytes, each chunk's tag checked as it arrives: a
        changed chunk stops the copy there (the caller commits only after the last)."""
        tag = bytearray(TAG)
        for at in range(0, len(view), CHUNK):
            chunk = view[at : at + CHUNK]
            recv_exact(self.sock, chunk)
            recv_exact(self.sock, memoryview(tag))
            self._check(_BULK, chunk, bytes(tag), "copy chunk")

    def close(self) -> None:
        self.sock.close()


# -- the handshake ----------------------------------------------------------------------------
def _mac(token: bytes, who: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(
        token, f"{HELLO}/{VERSION} ".encode() + who + first + second, hashlib.sha256
    ).hexdigest()


def session_keys(token: bytes, challenge: bytes, nonce: bytes) -> tuple[bytes, bytes]:
    """(client to server, server to client): fresh for every connection (both sides' nonces),
    one per direction, so that a frame reflected back is refused."""
    prk = hmac.new(
        token, f"{HELLO}/{VERSION} session ".encode() + challenge + nonce, hashlib.sha256
    ).digest()
    return (
        hmac.new(prk, b"client to server", hashlib.sha256).digest(),
        hmac.new(prk, b"server to client", hashlib.sha256).digest(),
    )


_AUTH = Obj({"op": Const("auth"), "nonce": Hex(32), "mac": Hex(32)})
_HELLO = Obj({"hello": Const(HELLO), "version": Int(), "challenge": Hex(32)})
_PROOF = Obj({"ok": Const(True), "mac": Hex(32)})
_REFUSED = Obj({"ok": Const(False), "error": Str(4096)})


def serve_handshake(sock: socket.socket, token: bytes, deadline: Deadline) -> Channel:
    """The server's side: challenge, check the client's proof, prove itself; the session."""
    challenge = secrets.token_bytes(32)
    send_msg(sock, {"hello": HELLO, "version": VERSION, "challenge": challenge.hex()})
    try:
        msg = _AUTH(recv_msg(sock, MAX_HELLO, deadline), "the auth message")
    except BadMessage as exc:
        raise AuthError(f"a malformed handshake ({exc})") from None
    nonce = msg["nonce"]
    if not hmac.compare_digest(msg["mac"].hex(), _mac(token, b"client", challenge, nonce)):
        raise AuthError("the client does not hold the job's token")
    send_msg(sock, {"ok": True, "mac": _mac(token, b"server", nonce, challenge)})
    c2s, s2c = session_keys(token, challenge, nonce)
    return Channel(sock, send_key=s2c, recv_key=c2s)


def client_handshake(sock: socket.socket, token: bytes, deadline: Deadline) -> Channel:
    """The client's side: answer the challenge, check the server's proof; the session.
    Raises :class:`Busy`, :class:`AuthError` (refused, or the server lacks the token),
    :class:`BadMessage` (not a memory peer server) or :class:`OSError`."""
    raw = recv_msg(sock, MAX_HELLO, deadline)
    if raw.get("busy") is True:
        raise Busy("the server is busy")
    if raw.get("hello") == HELLO and raw.get("version") != VERSION:
        raise BadMessage(
            f"it speaks protocol version {_show(raw.get('version'))}, this "
            f"client {VERSION}: run the same bootseer on every node"
        )
    hello = _HELLO(raw, "its hello")
    challenge = hello["challenge"]
    nonce = secrets.token_bytes(32)
    send_msg(
        sock, {"op": "auth", "nonce": nonce.hex(), "mac": _mac(token, b"client", challenge, nonce)}
    )
    reply = recv_msg(sock, MAX_HELLO, deadline)
    if reply.get("ok") is False:
        raise AuthError(f"refused: {_REFUSED(reply, 'its refusal')['error']}")
    proof = _PROOF(reply, "its proof")
    if not hmac.compare_digest(proof["mac"].hex(), _mac(token, b"server", nonce, challenge)):
        raise AuthError("the server does not hold the job's token")
    c2s, s2c = session_keys(token, challenge, nonce)
    return Channel(sock, send_key=c2s, recv_key=s2c)
