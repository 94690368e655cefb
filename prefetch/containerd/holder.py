"""The FUSE holder: a small process that keeps the snapshotter's ``/dev/fuse`` descriptors
open, so its lazy mount survives a restart, a ``kill -9`` or an upgrade of the snapshotter.

A FUSE connection ends when the last descriptor of it is closed; then every container reading
through it gets ENOTCONN (or SIGBUS on a mapped page). The snapshotter mounts, deposits a
duplicate of the descriptor here (``put``), and serves it; its successor takes it back
(``take``) and goes on serving the same connection (fuseserver.py). Each side holds the
connection while the other restarts: a holder that restarts while the snapshotter runs gets
the descriptor deposited again. Only both gone at once ends the connection.

It does nothing else: standard library only, no registry, no parsing of anything a registry
serves, so it seldom needs an upgrade. Protocol: one JSON object per SOCK_SEQPACKET message,
descriptors as SCM_RIGHTS; only root (the holder's own uid) may connect, on a 0600 socket.

* ``{"op": "take", "name": N}``: claim ``N`` (the lazy mount's path) for this connection;
  the answer carries the descriptor and its ``meta`` when one is held. A name claimed by
  another live connection is refused: one snapshotter per root.
* ``{"op": "put", "name": N, "meta": {...}}`` + 1 descriptor: hold it (replacing the old).
* ``{"op": "drop", "name": N}``: close it.  ``{"op": "list"}``: what is held, by whom.

A held connection that ends (its mount was unmounted) is closed by the holder. Started by the
snapshotter (when none runs) it exits once it holds nothing and nobody is connected.

    python -m prefetch.containerd.holder --address /run/bootseer/fuse-holder.sock
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import PrefetchError
from .unixsock import private_socket

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 16


class HolderError(PrefetchError, RuntimeError):
    """The holder refused a request, or none could be reached."""


def _send(sock: socket.socket, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(doc).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message, or (None, []) when the peer is gone."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 4, socket.MSG_CMSG_CLOEXEC)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ValueError("message too long")
    return json.loads(data), fds


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return pid, uid


@dataclass
class _Held:
    fd: int
    meta: dict[str, Any]


class Holder:
    """The holder's event loop (one thread, ``poll``)."""

    def __init__(self, address: str, *, exit_when_idle: bool = False) -> None:
        self.address = address
        self.exit_when_idle = exit_when_idle
        self._held: dict[str, _Held] = {}
        self._owners: dict[str, int] = {}  # name -> client socket fd
        self._clients: dict[int, tuple[socket.socket, int]] = {}  # fd -> (socket, pid)
        self._poll = select.poll()
        self._stop = False

    def serve(self) -> int:
        os.umask(0o077)
        os.makedirs(os.path.dirname(os.path.abspath(self.address)), 0o700, exist_ok=True)
        lock_fd = os.open(self.address + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            log.error("another FUSE holder serves %s: not starting a second one", self.address)
            return 1
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        with private_socket(self.address) as bound:
            listener.bind(bound)
        listener.listen(16)
        bound_ino = os.stat(self.address).st_ino
        wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._poll.register(listener, select.POLLIN)
        self._poll.register(wake_r, select.POLLIN)
        log.info("FUSE holder serving %s (pid %d)", self.address, os.getpid())
        try:
            while not self._stop:
                for fd, events in self._poll.poll():
                    if fd == listener.fileno():
                        self._accept(listener)
                    elif fd in self._clients:
                        self._from_client(fd, events)
                    elif fd == wake_r:
                        _drain(wake_r)
                    else:
                        self._check_held(fd, events)
                if self.exit_when_idle and not self._held and not self._clients:
                    log.info("FUSE holder: nothing held and nobody connected: exiting")
                    break
        finally:
            if _inode(self.address) == bound_ino:  # not a successor's socket
                os.unlink(self.address)
            listener.close()
            unserved = [n for n in self._held if n not in self._owners]
            if unserved:
                log.warning(
                    "FUSE holder stopping: the connections of %s end now (nobody else "
                    "holds them); containers reading them get ENOTCONN",
                    ", ".join(unserved),
                )
            os.close(lock_fd)
        return 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop = True

    def _accept(self, listener: socket.socket) -> None:
        sock, _ = listener.accept()
        pid, uid = _peer(sock)
        if uid != os.geteuid():
            log.warning("FUSE holder: refused a connection of pid %d (uid %d)", pid, uid)
            sock.close()
            return
        self._clients[sock.fileno()] = (sock, pid)
        self._poll.register(sock, select.POLLIN)

    def _from_client(self, fd: int, events: int) -> None:
        sock, pid = self._clients[fd]
        try:
            doc, fds = _recv(sock) if events & select.POLLIN else (None, [])
        except (OSError, ValueError) as exc:
            log.warning("FUSE holder: bad message from pid %d: %s", pid, exc)
            doc, fds = None, []
        if doc is None:
            self._disconnect(fd)
            return
        try:
            answer, out = self._request(fd, pid, doc, fds)
        except (KeyError, TypeError, ValueError) as exc:
            for extra in fds:
                os.close(extra)
            answer, out = {"ok": False, "error": f"malformed request: {exc}"}, []
        try:
            _send(sock, answer, out)
        except OSError:
            self._disconnect(fd)

    def _request(
        self, client: int, pid: int, doc: dict[str, Any], fds: list[int]
    ) -> tuple[dict[str, Any], list[int]]:
        op, name = doc["op"], doc.get("name")
        if op == "list":
            return {
                "ok": True,
                "held": {
                    n: {"meta": h.meta, "owner": self._owner_pid(n)} for n, h in self._held.items()
                },
            }, []
        if not isinstance(name, str):
            raise ValueError("no name")
        owner = self._owners.get(name)
        if owner is not None and owner != client:
            for extra in fds:
                os.close(extra)
            return {
                "ok": False,
                "error": f"{name} is served by pid {self._owner_pid(name)}: "
                "one snapshotter per root",
            }, []
        self._owners[name] = client
        held = self._held.get(name)
        if op == "take":
            if held is None:
                return {"ok": True, "meta": None}, []
            return {"ok": True, "meta": held.meta}, [held.fd]
        if op == "put":
            if len(fds) != 1 or not isinstance(doc.get("meta"), dict):
                raise ValueError("put takes one descriptor and a meta object")
            self._release(name)
            self._held[name] = _Held(fds[0], doc["meta"])
            self._poll.register(fds[0], 0)  # only POLLERR: the connection ended
            log.info("FUSE holder: holding %s for pid %d", name, pid)
            return {"ok": True}, []
        if op == "drop":
            self._release(name)
            return {"ok": True}, []
        raise ValueError(f"unknown op {op!r}")

    def _owner_pid(self, name: str) -> int | None:
        owner = self._owners.get(name)
        return self._clients[owner][1] if owner in self._clients else None

    def _release(self, name: str) -> None:
        held = self._held.pop(name, None)
        if held is not None:
            self._poll.unregister(held.fd)
            os.close(held.fd)

    def _check_held(self, fd: int, events: int) -> None:
        for name, held in list(self._held.items()):
            if held.fd == fd and events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                log.info("FUSE holder: the connection of %s ended (unmounted)", name)
                self._release(name)

    def _disconnect(self, fd: int) -> None:
        sock, _ = self._clients.pop(fd)
        self._poll.unregister(fd)
        for name in [n for n, o in self._owners.items() if o == fd]:
            del self._owners[name]
        sock.close()


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


class HolderClient:
    """The snapshotter's side: one connection to the holder at ``address``, started when none
    runs (``spawn``; a node runs it as a service instead, and then a restarting holder is
    waited for). What it :meth:`keep`\\ s is deposited again when the holder restarts
    (:meth:`watch`)."""

    def __init__(self, address: str, *, spawn: bool = True, timeout_s: float = 10.0) -> None:
        self.address = address
        self.spawn = spawn
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()
        self._kept: dict[str, tuple[int, dict[str, Any]]] = {}
        self._closed = False
        self._child: subprocess.Popen[bytes] | None = None

    def connect(self) -> None:
        """Connect, starting a holder when none runs (``spawn``) or waiting up to
        ``timeout_s`` for one (a holder service restarting)."""
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            started = False
            while True:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                try:
                    sock.connect(self.address)
                    self._sock = sock
                    return
                except (FileNotFoundError, ConnectionRefusedError) as exc:
                    sock.close()
                    if self.spawn and (
                        not started or (self._child and self._child.poll() is not None)
                    ):
                        self._start_holder()
                        started = True
                    if time.monotonic() > deadline:
                        raise HolderError(
                            f"no FUSE holder at {self.address} ({exc}) after "
                            f"{self.timeout_s:.0f} s: start `bootseer fuse-holder --address "
                            f"{self.address}` (deploy/ runs it as its own service)"
                        ) from None
                    time.sleep(0.05)

    def _start_holder(self) -> None:
        self._child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefetch.containerd.holder",
                "--address",
                self.address,
                "--exit-when-idle",
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.warning(
            "no FUSE holder at %s: started one (pid %d); run `bootseer fuse-holder` as "
            "its own service (deploy/) so that it outlives this one's restarts",
            self.address,
            self._child.pid,
        )

    def _call(
        self, doc: dict[str, Any], fds: list[int] | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            for _attempt in range(3):
                if self._sock is None:
                    self.connect()
                assert self._sock is not None
                try:
                    _send(self._sock, doc, fds)
                    answer, got = _recv(self._sock)
                except (ConnectionResetError, BrokenPipeError):
                    answer, got = None, []
                if answer is not None:
                    break
                self._sock.close()  # an idle holder exited as we came: start again
                self._sock = None
            else:
                raise HolderError(f"the FUSE holder at {self.address} keeps closing the connection")
        if not answer.get("ok"):
            for fd in got:
                os.close(fd)
            raise HolderError(str(answer.get("error")))
        return answer, got

    def take(self, name: str, wait_s: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        """Claim ``name``; its held descriptor (a duplicate: the holder keeps its own) and
        meta, or None when nothing is held. A name another process holds is waited for up
        to ``wait_s`` (a predecessor still stopping), then refused (HolderError)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                answer, fds = self._call({"op": "take", "name": name})
                break
            except HolderError as exc:
                if "is served by" not in str(exc) or time.monotonic() > deadline:
                    raise
                log.info("%s; waiting for it to stop", exc)
                time.sleep(0.2)
        if not fds:
            return None
        return fds[0], answer["meta"]

    def put(self, name: str, fd: int, meta: dict[str, Any]) -> None:
        self._call({"op": "put", "name": name, "meta": meta}, [fd])

    def keep(self, name: str, fd: int, meta: dict[str, Any], *, deposit: bool = True) -> None:
        """Deposit ``fd`` (unless the holder has it already) and deposit it again whenever
        the holder restarts."""
        if deposit:
            self.put(name, fd, meta)
        with self._lock:
            self._kept[name] = (fd, meta)

    def drop(self, name: str) -> None:
        with self._lock:
            self._kept.pop(name, None)
        self._call({"op": "drop", "name": name})

    def held(self) -> dict[str, Any]:
        return self._call({"op": "list"})[0]["held"]

    def watch(self) -> threading.Thread:
        """A thread that notices the holder going away and deposits what is kept with its
        successor (started here when none comes)."""
        thread = threading.Thread(target=self._watch, name="fuse-holder-watch", daemon=True)
        thread.start()
        return thread

    def _watch(self) -> None:
        while not self._closed:
            with self._lock:
                sock = self._sock
            if sock is None:
                self._redeposit()
                continue
            poller = select.poll()
            poller.register(sock, select.POLLRDHUP)
            try:
                events = poller.poll(1000)
            except (OSError, ValueError):
                continue  # closed meanwhile
            if events and not self._closed:
                with self._lock:
                    if self._sock is sock:
                        sock.close()
                        self._sock = None
                log.warning(
                    "the FUSE holder at %s went away: depositing the lazy mount's "
                    "connection with a new one",
                    self.address,
                )

    def _redeposit(self) -> None:
        try:
            with self._lock:
                for name, (fd, meta) in self._kept.items():
                    self.take(name)
                    self.put(name, fd, meta)
                    log.info("the FUSE holder holds %s again", name)
                if self._sock is None:
                    self.connect()
        except (HolderError, OSError) as exc:
            log.error(
                "cannot reach a FUSE holder at %s (%s); retrying: a restart of this "
                "process now would end the lazy mount",
                self.address,
                exc,
            )
            time.sleep(1.0)

    def close(self) -> None:
        """Leave: the holder keeps what was deposited; the claims end."""
        self._closed = True
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bootseer fuse-holder",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args.address, exit_when_idle=args.exit_when_idle)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default="/run/bootseer/fuse-holder.sock",
        help="its unix socket, created 0600 (default %(default)s); the snapshotter's --holder",
    )
    parser.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit once nothing is held and nobody is connected (how the "
        "snapshotter starts one when none runs)",
    )


def run(address: str, *, exit_when_idle: bool = False) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
    try:
        return Holder(address, exit_when_idle=exit_when_idle).serve()
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG or "AF_UNIX path too long" in str(exc):
            log.error("%s: a unix socket path has at most 107 bytes", address)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
