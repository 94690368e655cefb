"""One way to run a test server as a child process: a free loopback port, a log file, a bounded
wait for readiness, a stop by pid.

Why one base: moto's subprocess mode, nginx, the CNCF registry and containerd each had their own
start, wait and stop loop, each with its own gaps (a port taken between choosing and binding,
a child that ignores SIGTERM, a failure message without the log). :class:`ProcessServer` does
it once:

- the port is chosen free on 127.0.0.1; when the child's log says the address is in use (another
  process took it meanwhile), the first start moves to another free port (up to 5 tries);
  a fixed port, or a restart, keeps its port;
- stdout and stderr go to a log file (a private temporary one unless given);
- readiness is a callable polled until a deadline (:func:`tcp_ready`, :func:`http_ready`);
  a child that exits first, or is not ready in time, is stopped and
  :class:`ServerStartFailed` (a :class:`ComponentUnavailable`) names the command and holds the
  log's tail;
- ``stop()`` signals the child (SIGTERM; its process group by default), SIGKILLs it after
  ``stop_grace`` seconds, and leaves no process of the group behind; a dropped server object
  is stopped by a finalizer;
- with ``stdin_lifeline``, the child's stdin is a pipe this process holds: a child that exits
  at EOF on stdin (the shaper's ``--exit-on-stdin-eof``) dies with this process even when it is
  SIGKILLed, when no finalizer runs.

This module must not import pytest: the benchmarks use it too.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "LOOPBACK",
    "ComponentUnavailable",
    "PortBusy",
    "ProcessServer",
    "Readiness",
    "ServerStartFailed",
    "file_tail",
    "free_port",
    "http_get",
    "http_ready",
    "on_a_free_port",
    "stop_process",
    "tcp_ready",
]

LOOPBACK = "127.0.0.1"
"""The only address any component here ever binds or connects to."""

PORT_ATTEMPTS = 5
"""How many free ports the first start of a server tries before giving up."""

BUSY_MARKER = "address already in use"
"""What nginx, werkzeug, Python and Go servers log (any case) when their port is taken."""

Readiness = Callable[[int], bool]
"""Given the server's port, True once it serves; must return within a few seconds."""


class ComponentUnavailable(RuntimeError):
    """A real component (binary, device, Python package) is missing; the message says how to
    install it. Tests skip on it, or fail when ``BOOTSEER_REQUIRE_SYSTEM=1``."""


class ServerStartFailed(ComponentUnavailable):
    """A server's process exited at start, or was not ready by its deadline (and was killed).
    ``log_tail`` is the end of its log, ``returncode`` its exit status (None: it was killed at
    the deadline, and ``ProcessServer.returncode`` says how it ended)."""

    def __init__(self, message: str, *, log_tail: str, returncode: int | None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.returncode = returncode


class PortBusy(Exception):
    """The chosen port was taken by someone else between :func:`free_port` and the bind."""


# -- ports and probes ------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read, close).

    Another process may grab it before the caller binds it: :func:`on_a_free_port` retries."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def on_a_free_port(start_at: Callable[[int], None], port: int, *, may_move: bool, what: str) -> int:
    """``start_at(port)``; when it raises :class:`PortBusy` and ``may_move``, again on a fresh
    :func:`free_port` (up to :data:`PORT_ATTEMPTS` ports). Returns the port that worked.

    ``may_move=False`` for a port the caller fixed or a restart (clients hold the address)."""
    attempts = PORT_ATTEMPTS if may_move else 1
    for attempt in range(attempts):
        try:
            start_at(port)
            return port
        except PortBusy as exc:
            if attempt + 1 == attempts:
                tried = f" (tried {attempts} ports)" if attempts > 1 else ""
                raise ComponentUnavailable(
                    f"{what} could not bind {LOOPBACK}:{port}{tried}: {exc}; "
                    "free the port or choose another"
                ) from exc
            port = free_port()
    raise AssertionError("unreachable")  # pragma: no cover


def tcp_ready(port: int) -> bool:
    """Readiness: something accepts a TCP connection on 127.0.0.1:port."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1.0):
            return True
    except OSError:
        return False


def http_get(port: int, path: str = "/", timeout: float = 2.0) -> http.client.HTTPResponse | None:
    """One GET on 127.0.0.1:port (http.client: never goes through an HTTP proxy from the
    environment). Returns the response (body read) or None when nothing answers."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read()
        return resp
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def http_ready(
    path: str = "/",
    *,
    status: int | None = None,
    header: str | None = None,
    header_prefix: str = "",
) -> Readiness:
    """Readiness: a GET of ``path`` answers; with ``status``, with that status; with
    ``header``, carrying that header (its value starting with ``header_prefix``). A header
    check tells the server apart from whatever else might answer on a reused port."""

    def ready(port: int) -> bool:
        resp = http_get(port, path, timeout=1.0)
        if resp is None or (status is not None and resp.status != status):
            return False
        if header is None:
            return True
        value = resp.getheader(header)
        return value is not None and value.startswith(header_prefix)

    return ready


def file_tail(path: str | os.PathLike[str] | None, limit: int = 2000, offset: int = 0) -> str:
    """The last ``limit`` bytes of a file from ``offset`` on, for error messages ("" if none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - limit))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", "replace").strip()


# -- stopping by pid -------------------------------------------------------------------------


def _exit_status(proc: subprocess.Popen[bytes]) -> int | None:
    """``proc``'s exit status (negative: the signal), None while it runs, without reaping it:
    while the zombie is unreaped its pid, and so its process-group id, cannot be reused, so a
    later killpg hits only its own group."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped by someone else
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    return _exit_status(proc) is not None


def _wait_exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _exited(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _signal(proc: subprocess.Popen[bytes], sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        elif not _exited(proc):
            os.kill(proc.pid, sig)


def stop_process(
    proc: subprocess.Popen[bytes],
    *,
    sig: int = signal.SIGTERM,
    grace: float = 10.0,
    group: bool = True,
    what: str = "server",
) -> None:
    """Stop ``proc`` by pid: ``sig``, then SIGKILL after ``grace`` seconds; with ``group``
    (a child started in its own session) to its whole process group, and a last SIGKILL to
    the group once the leader has exited, so no worker outlives it. That last one is sent
    before the leader is reaped: its zombie keeps the group id from being reused. Idempotent;
    raises only if the process is still there 10 s after SIGKILL (stuck in the kernel)."""
    if proc.returncode is not None:
        return  # reaped: its pid, and so its group id, may belong to someone else now
    if not _exited(proc):
        _signal(proc, sig, group)
        if not _wait_exited(proc, grace):
            _signal(proc, signal.SIGKILL, group)
            if not _wait_exited(proc, 10.0):
                raise RuntimeError(
                    f"{what} (pid {proc.pid}) is still there 10 s after SIGKILL "
                    "(stuck in the kernel, e.g. on a hung FUSE mount)"
                )
    if group:
        # Workers whose leader died abruptly keep serving: none is left after this.
        _signal(proc, signal.SIGKILL, True)
    proc.wait()


# -- the base --------------------------------------------------------------------------------


class ProcessServer:
    """A child process serving on a free 127.0.0.1 port, stopped by pid.

    Use it directly with ``command`` (the port in, the argv out) and ``ready``, or subclass it
    and override :meth:`argv`, :meth:`is_ready`, :meth:`prepare` (before each launch: config
    files that name the port), :meth:`cleanup` (after each stop), :meth:`popen_env`.
    ``start()`` again after ``stop()`` keeps the port. ``close()`` also removes the private
    log directory. A server that listens on no TCP port (containerd: a unix socket) sets
    ``listens_on_tcp = False``: no port is chosen and ``port`` is 0. A child that exits when
    its stdin closes sets ``stdin_lifeline = True``: stdin is a pipe held open until ``stop()``.
    """

    listens_on_tcp = True
    stdin_lifeline = False

    def __init__(
        self,
        command: Callable[[int], Sequence[str | os.PathLike[str]]] | None = None,
        *,
        port: int | None = None,
        ready: Readiness | None = None,
        name: str = "server",
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        start_timeout: float = 30.0,
        stop_grace: float = 10.0,
        stop_signal: int = signal.SIGTERM,
        process_group: bool = True,
        poll_interval: float = 0.05,
    ) -> None:
        self.name = name
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.stop_signal = stop_signal
        self.process_group = process_group
        self.poll_interval = poll_interval
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        """Where the child's stdout and stderr go (appended); a private file if not given."""
        self._command = command
        self._ready = ready
        self._fixed_port = port is not None or not self.listens_on_tcp
        self._port = port if port is not None else free_port() if self.listens_on_tcp else 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[..., ProcessServer] | None = None
        self._started_once = False
        self._log_offset = 0
        self._log_dir: Path | None = None
        self._returncode: int | None = None

    # -- hooks ------------------------------------------------------------------------------

    def argv(self) -> list[str]:
        """The command line for the current port (``command(port)`` unless overridden)."""
        if self._command is None:
            raise NotImplementedError(f"{type(self).__name__}: give command= or define argv()")
        return [os.fspath(a) for a in self._command(self._port)]

    def is_ready(self) -> bool:
        """Whether the child serves yet (``ready(port)``, by default a TCP connect)."""
        return (self._ready or tcp_ready)(self._port)

    def prepare(self) -> None:
        """Before each launch, with :attr:`port` final for it (write config files here)."""

    def cleanup(self) -> None:
        """After each stop (remove per-launch files here); must be idempotent."""

    def popen_env(self) -> dict[str, str] | None:
        """The child's environment (None: this process's)."""
        return self.env

    # -- properties -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port; fixed for the life of the object once started (0: no TCP port)."""
        return self._port

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"{LOOPBACK}:{self._port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}"

    @property
    def running(self) -> bool:
        """Whether the child is started and has not exited."""
        return self._proc is not None and not _exited(self._proc)

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs."""
        return self._proc.pid if self._proc is not None and self.running else None

    @property
    def returncode(self) -> int | None:
        """How the last run ended (negative: the signal that ended it); None while running or
        before the first start."""
        if self._proc is not None:
            return _exit_status(self._proc)
        return self._returncode

    def log_tail(self, limit: int = 2000) -> str:
        """The end of the log written since the latest start."""
        return file_tail(self.log_path, limit, self._log_offset)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Self:
        """Launch and wait until ready (no-op when running). The first start moves to another
        free port when the chosen one was taken meanwhile; later starts keep the port.
        Raises :class:`ServerStartFailed` (the log's tail in it) when the child exits first
        or is not ready within ``start_timeout`` seconds (it is killed then)."""
        if self.running:
            return self
        may_move = not self._fixed_port and not self._started_once
        self._port = on_a_free_port(self._launch, self._port, may_move=may_move, what=self.name)
        self._started_once = True
        return self

    def _launch(self, port: int) -> None:
        self._port = port
        self.prepare()
        if self.log_path is None:
            if self._log_dir is None:
                slug = "".join(c if c.isalnum() else "-" for c in self.name.lower())
                self._log_dir = Path(tempfile.mkdtemp(prefix=f"bootseer-{slug}-"))
                weakref.finalize(self, shutil.rmtree, self._log_dir, True)  # if never closed
            self.log_path = self._log_dir / "server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            self._log_offset = log.seek(0, os.SEEK_END)
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE if self.stdin_lifeline else subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=self.popen_env(),
                    cwd=self.cwd,
                    close_fds=True,
                    start_new_session=self.process_group,  # its own group: stopped as one
                )
            except OSError as exc:
                self.cleanup()
                raise ComponentUnavailable(f"{self.name}: cannot run {argv[0]}: {exc}") from exc
        self._proc = proc
        self._finalizer = weakref.finalize(
            self,
            stop_process,
            proc,
            sig=self.stop_signal,
            grace=self.stop_grace,
            group=self.process_group,
            what=self.name,
        )
        try:
            self._wait_ready(proc, argv)
        except BaseException:
            self.stop()  # idempotent: an interrupt or a failing check leaves no child behind
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes], argv: list[str]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if _exited(proc):
                tail = self.log_tail()
                self.stop()
                code = self._returncode
                if self.listens_on_tcp and BUSY_MARKER in tail.lower():
                    raise PortBusy(tail.splitlines()[-1])
                raise ServerStartFailed(
                    f"{self.name} ({' '.join(argv)}) exited with status {code} at start; "
                    f"its log ({self.log_path}) ends:\n{tail}",
                    log_tail=tail,
                    returncode=code,
                )
            if self.is_ready() and not _exited(proc):
                return
            if time.monotonic() >= deadline:
                tail = self.log_tail()
                self.stop()
                where = f" on {self.host}" if self.listens_on_tcp else ""
                raise ServerStartFailed(
                    f"{self.name}{where} was not ready within {self.start_timeout:g} s and was "
                    f"killed ({' '.join(argv)}); its log ({self.log_path}) ends:\n{tail}",
                    log_tail=tail,
                    returncode=None,
                )
            time.sleep(self.poll_interval)

    def stop(self) -> None:
        """Stop the child (``stop_signal``, SIGKILL after ``stop_grace`` s; its process group
        with ``process_group``) and wait for it; then :meth:`cleanup`. Idempotent."""
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        try:
            if proc is not None:
                stop_process(
                    proc,
                    sig=self.stop_signal,
                    grace=self.stop_grace,
                    group=self.process_group,
                    what=self.name,
                )
                self._returncode = proc.returncode
        finally:
            if proc is not None and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            self.cleanup()

    def close(self) -> None:
        """Stop, and remove the private log directory (if the log path was not given).
        Idempotent; a later ``start()`` works and logs to a new directory."""
        self.stop()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            if self.log_path is not None and self.log_path.parent == self._log_dir:
                self.log_path = None
            self._log_dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        where = self.url if self.listens_on_tcp else "no TCP port"
        return f"{type(self).__name__}({self.name}, {where}, {state})"
