"""A client of torch's c10d TCPStore server in plain Python, for the agent and the controller.

Why not torch's own client: the agent and the controller talk to the job's store and nothing
else of torch, yet ``from torch.distributed import TCPStore`` costs about 1.7 s of CPU per
process (all of ``import torch``), paid by every node's agent at every start, beside the
ranks' own ``import torch`` on the same cores. The protocol is small and stable (the C++
client in ``torch/csrc/distributed/c10d/TCPStore.cpp``): one query byte, native-endian
integers, strings and values as a ``uint64`` length and the bytes. This client speaks the
subset the job's channels use, to the same server (torch's, libuv or not, hosted by
:mod:`.store_host` or by torchrun), so ranks, torchrun and bootseer still share one store.

It also bounds what it reads: the store is untrusted input (DESIGN.md, "The job's own
channels"), and a length the server sends is checked against ``max_value_bytes`` before a
byte is allocated, where torch's client would try to allocate whatever it is told. Every
failure is a :class:`StoreError` (a ``RuntimeError``, as torch's are), naming the store, the
operation and the key. A connection that failed mid-reply is dropped, never read on out of
step; the next call connects once more (a restarted store host is reached again).

Usage::

    from bootseer.robust.store_client import StoreClient

    store = StoreClient("10.0.0.5", 29400, timeout_s=30)
    store.set("bootseer/job/node/n0/info", b"{...}")
    if store.check(["bootseer/job/verdict/last"]):
        data = store.get("bootseer/job/verdict/last")
    seen = store.add("bootseer/job/incident", 1)
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Iterable

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "StoreClient", "StoreError", "StoreTimeout"]

DEFAULT_MAX_VALUE_BYTES = 16 << 20  # twice what torch's libuv server accepts in a value (8 MiB)

_VALIDATION_MAGIC = 0x3C85F7CE
# torch/csrc/distributed/c10d/TCPStoreBackend.hpp, QueryType (uint8): the order is the wire.
_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = 0, 1, 2, 3, 4, 5, 6
_GETNUMKEYS, _DELETE_KEY, _APPEND, _PING = 7, 8, 9, 13
_READY, _NOT_READY = 0, 1  # CheckResponseType
_STOP_WAITING, _WAIT_CANCELED = 0, 1  # WaitResponseType
_KEY_PREFIX = "/"  # what torch's C++ client puts before every key


class StoreError(RuntimeError):
    """A store operation that failed: unreachable, closed, timed out or a malformed reply."""


class StoreTimeout(StoreError):
    """A key did not appear (or the server did not answer) within the client's timeout."""


def _encode(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _pack_string(value: str | bytes) -> bytes:
    data = _encode(value)
    return struct.pack("=Q", len(data)) + data


class StoreClient:
    """One connection to a c10d store; thread-safe (one query at a time, as torch's)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float = 30.0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    ) -> None:
        self.host = host
        self.port = int(port)
        self.timeout_s = float(timeout_s)
        self.max_value_bytes = int(max_value_bytes)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        with self._lock:
            self._connect(retry_until=time.monotonic() + self.timeout_s)

    # -- the operations torch's Python Store offers, by the same names ------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key`` (no reply: torch's server sends none)."""
        with self._lock:
            self._send(bytes([_SET]) + _pack_string(self._key(key)) + _pack_string(value))

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to ``key``'s value (created when missing; no reply)."""
        with self._lock:
            self._send(bytes([_APPEND]) + _pack_string(self._key(key)) + _pack_string(value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and ``expected``
        is empty); the value it holds afterwards."""
        query = _pack_string(self._key(key)) + _pack_string(expected) + _pack_string(desired)
        with self._lock:
            self._send(bytes([_COMPARE_SET]) + query)
            return self._read_value("compare_set", key)

    def get(self, key: str) -> bytes:
        """``key``'s value, waiting up to the timeout for it to be set (as torch's get)."""
        with self._lock:
            self._wait_locked([key], self.timeout_s, "get")
            self._send(bytes([_GET]) + _pack_string(self._key(key)))
            return self._read_value("get", key)

    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to the counter under ``key`` (0 when missing); the new value."""
        with self._lock:
            self._send(bytes([_ADD]) + _pack_string(self._key(key)) + struct.pack("=q", delta))
            return self._read_struct("=q", "add", key)

    def check(self, keys: Iterable[str]) -> bool:
        """Whether every key is set, without waiting."""
        names = list(keys)
        label = ",".join(names)
        query = bytes([_CHECK]) + struct.pack("=Q", len(names))
        query += b"".join(_pack_string(self._key(k)) for k in names)
        with self._lock:
            self._send(query)
            answer = self._read_struct("=B", "check", label)
            if answer not in (_READY, _NOT_READY):
                self._drop()
                raise self._error("check", label, f"reply {answer} is neither ready nor not")
        return answer == _READY

    def wait(self, keys: Iterable[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key is set (:class:`StoreTimeout` after ``timeout``)."""
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        with self._lock:
            self._wait_locked(list(keys), seconds, "wait")

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        with self._lock:
            self._send(bytes([_DELETE_KEY]) + _pack_string(self._key(key)))
            return self._read_struct("=q", "delete_key", key) == 1

    def num_keys(self) -> int:
        """How many keys the server holds (all jobs', torch's own included)."""
        with self._lock:
            self._send(bytes([_GETNUMKEYS]))
            return self._read_struct("=q", "num_keys", "")

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The timeout of every later operation."""
        self.timeout_s = timeout.total_seconds()

    def close(self) -> None:
        """Drop the connection (a later call connects again)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreClient({self.host}:{self.port})"

    # -- the connection -------------------------------------------------------------------

    @staticmethod
    def _key(key: str) -> str:
        return _KEY_PREFIX + key

    def _error(self, op: str, key: str, why: str) -> StoreError:
        where = f" {key!r}" if key else ""
        return StoreError(f"store {self.host}:{self.port}: {op}{where}: {why}")

    def _connect(self, retry_until: float) -> None:
        """Connect, validate and ping, retrying refused connections until ``retry_until``
        (a store that is still starting), as torch's client does."""
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            except OSError as exc:
                if time.monotonic() + delay >= retry_until:
                    raise StoreError(
                        f"store {self.host}:{self.port}: cannot connect ({exc}); is the store "
                        "(bootseer controller --port, or torchrun's host) running there?"
                    ) from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
                continue
            break
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        nonce = os.getpid() & 0xFFFFFFFF
        try:
            self._send(
                struct.pack("=BI", _VALIDATE, _VALIDATION_MAGIC) + struct.pack("=BI", _PING, nonce)
            )
            answer = self._read_struct("=I", "ping", "")
        except StoreError:
            self._drop()
            raise
        if answer != nonce:
            self._drop()
            raise self._error("ping", "", f"answered {answer}, expected {nonce}: not a c10d store?")

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _ensure(self) -> socket.socket:
        if self._sock is None:  # dropped after a failure: one more try, no waiting
            self._connect(retry_until=time.monotonic())
        assert self._sock is not None
        return self._sock

    def _send(self, data: bytes) -> None:
        try:
            self._ensure().sendall(data)
        except OSError as exc:
            self._drop()
            raise StoreError(f"store {self.host}:{self.port}: send failed ({exc})") from None

    def _read_exact(self, size: int, op: str, key: str) -> bytes:
        sock = self._ensure()
        chunks = bytearray()
        try:
            while len(chunks) < size:
                chunk = sock.recv(min(size - len(chunks), 1 << 20))
                if not chunk:
                    raise ConnectionError("the store closed the connection")
                chunks += chunk
        except TimeoutError:
            self._drop()
            raise StoreTimeout(
                f"store {self.host}:{self.port}: {op} {key!r}: no answer in {self.timeout_s:g} s"
            ) from None
        except OSError as exc:
            self._drop()
            raise self._error(op, key, f"receive failed ({exc})") from None
        return bytes(chunks)

    def _read_struct(self, fmt: str, op: str, key: str) -> int:
        (value,) = struct.unpack(fmt, self._read_exact(struct.calcsize(fmt), op, key))
        return int(value)

    def _read_value(self, op: str, key: str) -> bytes:
        size = self._read_struct("=Q", op, key)
        if size > self.max_value_bytes:
            self._drop()  # the rest of the stream is that value: never read on out of step
            raise self._error(
                op,
                key,
                f"the store announced a {size}-byte value, over the "
                f"{self.max_value_bytes}-byte limit: refused (a forged or corrupt reply)",
            )
        return self._read_exact(size, op, key)

    def _wait_locked(self, keys: list[str], seconds: float, op: str) -> None:
        query = bytes([_WAIT]) + struct.pack("=Q", len(keys))
        query += b"".join(_pack_string(self._key(k)) for k in keys)
        self._send(query)
        sock = self._ensure()
        label = ",".join(keys)
        sock.settimeout(max(seconds, 0.001))
        try:
            answer = self._read_struct("=B", op, label)
        except StoreTimeout:
            raise StoreTimeout(
                f"store {self.host}:{self.port}: {op} {label!r}: not set within {seconds:g} s"
            ) from None
        finally:
            if self._sock is not None:
                self._sock.settimeout(self.timeout_s)
        if answer != _STOP_WAITING:
            self._drop()
            raise self._error(op, label, f"wait answered {answer}, expected stop-waiting")
