"""Shaping TCP proxy: puts a loopback "remote" server behind a link of known latency and bandwidth.

Why: striped reads, lazy image pulls and checkpoint uploads only show their worth on a link that
is slower than memory. Tests and benchmarks start their real servers (moto, nginx, registry) on
127.0.0.1 and point clients at a :class:`Shaper` in front of them instead.

Model of the link, per direction: data is read in chunks, pays a per-connection and a shared
total token bucket (burst: 10 ms worth), then waits ``latency_s`` in a
timestamped queue before it is written on. The queue holds up to 8 MiB, so latency delays data
without cutting throughput (bandwidth x delay up to 8 MiB per connection and direction).

:class:`Shaper` runs on its own event loop in a daemon thread and offers fault injection
(``drop_after``, ``drop_active``, ``set_refuse``). :class:`ShaperProcess` runs the same proxy as
``python -m bootseer.testing.shaper`` so that, in benchmarks, its CPU does not share the client's GIL.

Measured throughput, unshaped, one connection, loopback, on the project's shared 2-core machine
(Python 3.11, 1 GB through, plain-socket source and sink): 1.0-1.3 GB/s with an in-process Shaper
and 1.1-1.6 GB/s with ShaperProcess at 0-1 ms latency; about 680 MB/s at 10 ms, where the 8 MiB
latency queue (8 MiB / 10 ms) is the bound.

Only loopback addresses are accepted, for both ends, and the addresses of the cluster fixture's
private namespaces (:data:`CLUSTER_NETWORK`, the RFC 2544 benchmarking range, never routed).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from .process_server import ProcessServer

MAX_CHUNK = 256 * 1024  # largest read; unshaped links move data in these
MIN_CHUNK = 8 * 1024  # smallest read on a slow link, to keep per-chunk overhead bounded
# Bucket burst, in time at the cap. It bounds the overshoot (1 % of a one-second figure) and is
# also the slack for the proxy waking late: a 64 KiB burst gave 0.4 ms of slack at 160 MB/s and
# cost 5 % of a 100 MB/s cap on this machine, so the burst is not capped in bytes.
BURST_SECONDS = 0.01
QUEUE_BYTES = 8 * 1024 * 1024  # latency queue per connection and direction
STREAM_LIMIT = 1024 * 1024  # StreamReader buffer; reading pauses at twice this

# bootseer.testing.cluster's nodes and services live in network namespaces of their own on this
# range (RFC 2544: reserved for benchmarking, never routed), so a shaper may listen on it or
# forward to it without ever reaching a real network.
CLUSTER_NETWORK = ipaddress.ip_network("198.18.0.0/15")

_EOF = object()  # queue marker: peer closed its sending side
_CUT = object()  # queue marker: drop_after threshold reached


@dataclasses.dataclass(frozen=True)
class ShaperSettings:
    """Link parameters. Frozen so that ``Shaper.update`` swaps them atomically."""

    latency_s: float = 0.0  # one-way delay added in each direction
    per_conn_bps: float | None = None  # bytes/s per connection and direction
    total_bps: float | None = None  # bytes/s over all connections, per direction

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        for name in ("per_conn_bps", "total_bps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")

    @classmethod
    def from_mb(
        cls,
        latency_ms: float = 0.0,
        per_conn_mbps: float | None = None,
        total_mbps: float | None = None,
    ) -> ShaperSettings:
        """Build from milliseconds and MB/s (MB = 10**6 bytes), the units benchmarks report."""
        return cls(
            latency_s=latency_ms / 1e3,
            per_conn_bps=None if per_conn_mbps is None else per_conn_mbps * 1e6,
            total_bps=None if total_mbps is None else total_mbps * 1e6,
        )

    def describe(self) -> str:
        """Human summary for benchmark output, e.g. 'latency 1.0 ms, 10 MB/s per connection'."""
        parts = [f"latency {self.latency_s * 1e3:.1f} ms"]
        if self.per_conn_bps is not None:
            parts.append(f"{self.per_conn_bps / 1e6:g} MB/s per connection")
        if self.total_bps is not None:
            parts.append(f"{self.total_bps / 1e6:g} MB/s total")
        if self.per_conn_bps is None and self.total_bps is None:
            parts.append("unlimited bandwidth")
        return ", ".join(parts)


def _check_loopback(host: str) -> str:
    """Return ``host`` without brackets; raise ValueError unless it is a loopback address or
    one of the cluster fixture's private addresses (:data:`CLUSTER_NETWORK`)."""
    bare = host.strip("[]")
    if bare == "localhost":
        return bare
    try:
        address = ipaddress.ip_address(bare)
        ok = address.is_loopback or address in CLUSTER_NETWORK
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"shaper only works on loopback: {host!r} is not in 127.0.0.0/8, ::1, 'localhost' "
            f"or the cluster fixture's {CLUSTER_NETWORK}"
        )
    return bare


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(hostport: str) -> tuple[str, int]:
    """Parse 'HOST:PORT' or '[V6]:PORT'."""
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {hostport!r}")
    return host.strip("[]"), int(port)


def _chunk_size(settings: ShaperSettings) -> int:
    """Read size: about 10 ms at the tightest cap, so a chunk never is a long burst."""
    caps = [c for c in (settings.per_conn_bps, settings.total_bps) if c is not None]
    if not caps:
        return MAX_CHUNK
    return int(min(MAX_CHUNK, max(MIN_CHUNK, min(caps) * BURST_SECONDS)))


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close abruptly: SO_LINGER 0 makes the kernel send RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Bucket:
    """Token bucket kept as 'the time it runs empty'; callers reserve bytes, then sleep the debt.

    Reservations queue up in call order, so connections sharing one bucket take turns chunk by
    chunk: that is what shares the total cap fairly.
    """

    __slots__ = ("_empty_at",)

    def __init__(self) -> None:
        self._empty_at = 0.0

    def delay(self, nbytes: int, rate: float, now: float) -> float:
        self._empty_at = max(self._empty_at, now - BURST_SECONDS) + nbytes / rate
        return self._empty_at - now


class _Pipe:
    """One direction of a connection: shaped chunks waiting out their latency."""

    __slots__ = ("down", "bucket", "queue", "queued", "room")

    def __init__(self, down: bool) -> None:
        self.down = down  # server -> client
        self.bucket = _Bucket()  # per-connection cap
        self.queue: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()
        self.queued = 0  # bytes in queue
        self.room = asyncio.Event()
        self.room.set()


class _Conn:
    """Both sockets and the four tasks of one proxied connection."""

    def __init__(self, client: asyncio.StreamWriter, drop_left: int | None) -> None:
        self.writers = [client]
        self.tasks: list[asyncio.Task[Any]] = []
        self.drop_left = drop_left  # downstream bytes still allowed before the cut
        self.closed = False

    def abort(self) -> None:
        """Reset both sockets and stop the tasks; safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        for writer in self.writers:
            _reset(writer)
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()


class Shaper:
    """In-process shaping proxy in front of ``upstream_host:upstream_port``.

    Counters and fault injection are for tests; every public method may be called from any
    thread. Counters are updated on the proxy's loop and read without locking.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        settings: ShaperSettings | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.upstream = (_check_loopback(upstream_host), int(upstream_port))
        listen_host = _check_loopback(listen_host)
        # 'localhost' could bind two sockets on two different ports: pin it to IPv4.
        self.host = "127.0.0.1" if listen_host == "localhost" else listen_host
        self.port = int(listen_port)  # the real port once started
        self.settings = settings if settings is not None else ShaperSettings()
        self.bytes_down = 0  # server -> client, forwarded
        self.bytes_up = 0  # client -> server, forwarded
        self.connections_total = 0  # accepted, refused ones included
        self.connections_active = 0
        self._lock = threading.Lock()
        self._drop_plan: list[int] = []
        self._refuse = False
        self._totals = {True: _Bucket(), False: _Bucket()}  # keyed by direction (down?)
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """'127.0.0.1:PORT', what clients connect to."""
        return _join(self.host, self.port)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Start listening on a private event loop in a daemon thread; return once bound."""
        if self._thread is not None:
            raise RuntimeError("shaper already started")
        loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:  # report bind errors to start()
                ready.set_exception(exc)
                loop.close()
                return
            ready.set_result(None)
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._close())
                leftover = asyncio.all_tasks(loop)
                for task in leftover:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="bootseer-shaper", daemon=True)
        self._thread.start()
        try:
            ready.result(timeout=30)
        except BaseException:
            self._thread = None
            self._loop = None
            raise
        return self

    def stop(self) -> None:
        """Close the listener and reset every connection; idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        self._thread = None
        self._loop = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- runtime control ---------------------------------------------------------------------

    def update(self, settings: ShaperSettings) -> None:
        """Change the link; applies to the next chunk of every connection."""
        if not isinstance(settings, ShaperSettings):
            raise TypeError("update() takes a ShaperSettings")
        self.settings = settings

    def drop_after(self, nbytes: int, count: int = 1) -> None:
        """Cut the next ``count`` new connections after ``nbytes`` went server -> client."""
        if nbytes < 0 or count < 0:
            raise ValueError("nbytes and count must be >= 0")
        with self._lock:
            self._drop_plan = [int(nbytes)] * count

    def drop_active(self) -> None:
        """Reset every open connection now (both sockets, RST)."""
        self._on_loop(self._abort_all)

    def set_refuse(self, flag: bool) -> None:
        """While set, new connections are accepted and reset at once, as a dying server does."""
        self._refuse = bool(flag)

    # -- internals ---------------------------------------------------------------------------

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the proxy's loop and wait for it, from whichever thread."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                fn()
                return

        async def call() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=30)

    def _abort_all(self) -> None:
        for conn in list(self._conns):
            conn.abort()

    def _next_drop(self) -> int | None:
        with self._lock:
            return self._drop_plan.pop(0) if self._drop_plan else None

    async def _open(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, limit=STREAM_LIMIT
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._abort_all()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=5)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections_total += 1
        self.connections_active += 1
        conn = _Conn(writer, None)
        graceful = False
        try:
            if self._refuse:
                return
            conn.drop_left = self._next_drop()
            self._conns.add(conn)
            _nodelay(writer)
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    *self.upstream, limit=STREAM_LIMIT
                )
            except OSError:
                return
            conn.writers.append(up_writer)
            if conn.closed:  # dropped while connecting
                _reset(up_writer)
                return
            _nodelay(up_writer)
            up, down = _Pipe(down=False), _Pipe(down=True)
            conn.tasks = [
                asyncio.create_task(self._feed(conn, up, reader)),
                asyncio.create_task(self._deliver(conn, up, up_writer)),
                asyncio.create_task(self._feed(conn, down, up_reader)),
                asyncio.create_task(self._deliver(conn, down, writer)),
            ]
            results = await asyncio.gather(*conn.tasks, return_exceptions=True)
            graceful = results[1] is True and results[3] is True and not conn.closed
        except asyncio.CancelledError:
            pass  # stop(): end quietly, asyncio logs an error for a cancelled handler
        finally:
            self._conns.discard(conn)
            if graceful:
                for w in conn.writers:
                    w.close()
            else:
                conn.abort()
            self.connections_active -= 1
            self._handlers.discard(task)

    async def _feed(self, conn: _Conn, pipe: _Pipe, reader: asyncio.StreamReader) -> None:
        """Read, pay the buckets, stamp with the delivery time, queue."""
        loop = asyncio.get_running_loop()
        total = self._totals[pipe.down]
        try:
            while True:
                settings = self.settings
                if pipe.down and conn.drop_left == 0:
                    pipe.queue.put_nowait((loop.time() + settings.latency_s, _CUT))
                    return
                data = await reader.read(_chunk_size(settings))
                if not data:
                    pipe.queue.put_nowait((loop.time() + settings.latency_s, _EOF))
                    return
                if pipe.down and conn.drop_left is not None:
                    data = data[: conn.drop_left]
                    conn.drop_left -= len(data)
                settings = self.settings
                now = loop.time()
                for bucket, rate in (
                    (pipe.bucket, settings.per_conn_bps),
                    (total, settings.total_bps),
                ):
                    if rate is not None:
                        wait = bucket.delay(len(data), rate, now)
                        if wait > 0:
                            await asyncio.sleep(wait)
                            now = loop.time()
                pipe.queue.put_nowait((now + settings.latency_s, data))
                pipe.queued += len(data)
                while pipe.queued >= QUEUE_BYTES:
                    pipe.room.clear()
                    await pipe.room.wait()
        except OSError:
            conn.abort()

    async def _deliver(self, conn: _Conn, pipe: _Pipe, writer: asyncio.StreamWriter) -> bool:
        """Write queued chunks once their time has come; True when the stream ended cleanly."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await pipe.queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is _EOF:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return True
                if data is _CUT:
                    writer.transport.set_write_buffer_limits(high=0)
                    await writer.drain()  # all of nbytes reach the kernel before the reset
                    conn.abort()
                    return False
                pipe.queued -= len(data)
                if pipe.queued < QUEUE_BYTES:
                    pipe.room.set()
                writer.write(data)
                if pipe.down:
                    self.bytes_down += len(data)
                else:
                    self.bytes_up += len(data)
                await writer.drain()
        except OSError:
            conn.abort()
            return False


# -- subprocess mode ---------------------------------------------------------------------------


class ShaperProcess(ProcessServer):
    """The same proxy in a child process (``python -m bootseer.testing.shaper``), on the
    common base (:class:`~bootseer.testing.process_server.ProcessServer`): a free port chosen
    here (``listen_port=0``; moved when the child logs it taken), its stdout and stderr in a
    private log, ready at its ``LISTENING`` line, stopped by pid, SIGKILL after the grace.

    Why a child: in benchmarks the client is Python too; an in-process proxy would take GIL
    time from the very code being measured. No counters or fault injection here: use
    :class:`Shaper`. Its stdin is a lifeline (``--exit-on-stdin-eof``): the child exits when
    this process dies, even by SIGKILL. ``host`` is the listen host and ``address``
    ``HOST:PORT``, as on :class:`Shaper`; no probe connection is made (it would reach the
    upstream).
    """

    stdin_lifeline = True

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        settings: ShaperSettings | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        start_timeout: float = 30.0,
    ) -> None:
        self.upstream = (_check_loopback(upstream_host), int(upstream_port))
        self.listen_host = _check_loopback(listen_host)
        self.settings = settings if settings is not None else ShaperSettings()
        super().__init__(
            name="shaper",
            port=int(listen_port) or None,
            start_timeout=start_timeout,
        )

    @property
    def host(self) -> str:
        """The listen host (as on :class:`Shaper`; the base's ``host`` is ``HOST:PORT``)."""
        return self.listen_host

    @property
    def address(self) -> str:
        """'127.0.0.1:PORT', what clients connect to."""
        return _join(self.listen_host, self.port)

    @property
    def url(self) -> str:
        """``http://ADDRESS``, for an HTTP server behind the link."""
        return f"http://{self.address}"

    def command(self) -> list[str]:
        """The child's command line (the port final once started)."""
        s = self.settings
        cmd = [
            sys.executable, "-m", "bootseer.testing.shaper",
            "--upstream", _join(*self.upstream),
            "--listen", self.address,
            "--latency-ms", repr(s.latency_s * 1e3),
            "--exit-on-stdin-eof",
        ]  # fmt: skip
        if s.per_conn_bps is not None:
            cmd += ["--per-conn-mbps", repr(s.per_conn_bps / 1e6)]
        if s.total_bps is not None:
            cmd += ["--total-mbps", repr(s.total_bps / 1e6)]
        return cmd

    def argv(self) -> list[str]:
        return self.command()

    def popen_env(self) -> dict[str, str]:
        """This process's environment, this very package first on PYTHONPATH."""
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return env

    def is_ready(self) -> bool:
        """The child printed ``LISTENING HOST:PORT`` for this very port."""
        return f"LISTENING {self.address}\n" in self.log_tail(1 << 16) + "\n"


async def _serve(shaper: Shaper, watch_stdin: bool) -> None:
    """Run ``shaper`` on the current loop until SIGTERM/SIGINT (or stdin EOF)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if watch_stdin:
        fd = sys.stdin.fileno()

        def on_stdin() -> None:
            if not os.read(fd, 65536):
                loop.remove_reader(fd)
                stop.set()

        loop.add_reader(fd, on_stdin)
    shaper._loop = loop
    await shaper._open()
    print(f"LISTENING {shaper.address}", flush=True)
    try:
        await stop.wait()
    finally:
        await shaper._close()


def main(argv: list[str] | None = None) -> int:
    """Command line: serve a shaped link in front of --upstream until signalled."""
    parser = argparse.ArgumentParser(
        prog="python -m bootseer.testing.shaper",
        description="Shaping TCP proxy for loopback tests and benchmarks.",
    )
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the server behind the link")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way added delay")
    parser.add_argument("--per-conn-mbps", type=float, help="MB/s cap per connection")
    parser.add_argument("--total-mbps", type=float, help="MB/s cap over all connections")
    parser.add_argument(
        "--exit-on-stdin-eof", action="store_true", help="also stop when stdin closes"
    )
    args = parser.parse_args(argv)
    try:
        settings = ShaperSettings.from_mb(args.latency_ms, args.per_conn_mbps, args.total_mbps)
        up_host, up_port = _split(args.upstream)
        host, port = _split(args.listen)
        shaper = Shaper(up_host, up_port, settings, host, port)
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(_serve(shaper, args.exit_on_stdin_eof))
    return 0


if __name__ == "__main__":
    sys.exit(main())
