"""Real components on loopback for tests and benchmarks: moto's S3 server, nginx, FUSE checks.

Everything here binds 127.0.0.1 only and picks free ports, so several test sessions (and the
benchmarks) can run side by side on one machine. This module must not import pytest: the
benchmarks use it too. Tests turn :class:`ComponentUnavailable` (and the reason strings of
:func:`fuse_available`) into a skip, or into a failure when ``BOOTSEER_REQUIRE_SYSTEM=1``.
"""

from __future__ import annotations

import contextlib
import grp
import http.client
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "LOOPBACK",
    "ComponentUnavailable",
    "MotoS3Server",
    "NginxServer",
    "find_nginx",
    "free_port",
    "fuse_available",
    "require_system",
]

LOOPBACK = "127.0.0.1"
"""The only address any component here ever binds or connects to."""

DUMMY_AWS_KEY = "testing"
DUMMY_AWS_SECRET = "testing"
DUMMY_AWS_REGION = "us-east-1"

_NGINX_CANDIDATES: tuple[str, ...] = ("/usr/sbin/nginx",)


def start_on_a_free_port(server: Any, binary: str, what: str) -> None:
    """``server._start_once(binary)``, moving to another free port when the chosen one was
    taken meanwhile (a race with other processes), unless the caller fixed the port or the
    server ran before (a restart must keep its address)."""
    may_move = not server._fixed_port and not server._started_once
    attempts = 5 if may_move else 1
    for attempt in range(attempts):
        try:
            server._start_once(binary)
            break
        except _PortBusy as exc:
            if attempt + 1 == attempts:
                raise RuntimeError(
                    f"{what} could not bind 127.0.0.1:{server._port}: {exc}"
                ) from exc
            server._port = free_port()
    server._started_once = True


class ConnectionTracking:
    """socketserver mixin: remember open connections so that a test server's stop() can cut
    them (a dropped connection in flight, or idle keep-alives that would outlive it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.open_connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.open_connections.add(request)
        super().process_request(request, client_address)  # type: ignore[misc]

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.open_connections.discard(request)
        super().shutdown_request(request)  # type: ignore[misc]

    def cut_connections(self) -> None:
        with self.connections_lock:
            conns = list(self.open_connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class ComponentUnavailable(RuntimeError):
    """A real component (binary, device, Python package) is missing; the message says how to
    install it. Tests skip on it, or fail when ``BOOTSEER_REQUIRE_SYSTEM=1``."""


def require_system() -> bool:
    """True when ``BOOTSEER_REQUIRE_SYSTEM=1``: a missing component is then a failure, not a
    skip (CI on a fully provisioned machine must not silently skip the system tests)."""
    return os.environ.get("BOOTSEER_REQUIRE_SYSTEM", "") == "1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read, close).

    Another process may grab it before the caller binds it; the servers below retry with a
    fresh port when they picked it themselves."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _http_probe(
    port: int, path: str = "/", timeout: float = 2.0
) -> http.client.HTTPResponse | None:
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


def _tail(path: Path, limit: int = 2000) -> str:
    """The end of a log file, for error messages."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace").strip()


def _terminate(proc: subprocess.Popen[bytes], sig: int, timeout: float, group: bool) -> None:
    """Send ``sig``, wait up to ``timeout``, then SIGKILL; with ``group`` the whole process group
    (nginx workers) is killed too, so nothing outlives the server object."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            proc.wait(timeout=timeout)
    if group:
        # Workers whose master died abruptly keep serving; make sure none is left.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# moto S3
# --------------------------------------------------------------------------------------------


class _InProcessMoto:
    """moto's server on a werkzeug thread, like ``moto.server.ThreadedMotoServer``, built from
    the same public pieces (``DomainDispatcherApplication``, ``create_backend_app``,
    ``MotoRequestHandler``) with three differences the tests need:

    - a failed bind raises in ``start()`` (ThreadedMotoServer waits forever for its thread);
    - ``stop()`` also cuts connections with a request in flight, so a client in the middle of
      a transfer sees the storage go away (ThreadedMotoServer lets them finish);
    - per-request access logging is off (it floods stderr during large transfers).
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            from moto.server import (
                DomainDispatcherApplication,
                MotoRequestHandler,
                create_backend_app,
            )
            from werkzeug.serving import ThreadedWSGIServer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ComponentUnavailable(
                f"moto server mode is not installed ({exc}): pip install 'moto[server]'"
            ) from exc

        class QuietHandler(MotoRequestHandler):  # type: ignore[misc, valid-type]
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        class TrackingServer(ConnectionTracking, ThreadedWSGIServer):  # type: ignore[misc, valid-type]
            """Remembers open connections so that stop() can cut them."""

        app = DomainDispatcherApplication(create_backend_app)
        # Binding happens here, in the caller's thread, so a busy port raises right away.
        self._server = TrackingServer(LOOPBACK, self.port, app, handler=QuietHandler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name=f"moto-s3-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()  # werkzeug's serve_forever closes the listening socket on exit
        if thread is not None:
            thread.join(timeout=10)
        server.server_close()
        server.cut_connections()


def _stop_moto_process(proc: subprocess.Popen[bytes]) -> None:
    _terminate(proc, signal.SIGTERM, timeout=10, group=False)


class MotoS3Server:
    """moto's S3 in server mode on 127.0.0.1, reached over real HTTP by s3fs/boto3.

    ``in_process=True`` (tests) serves from a thread of this process: cheap to start, and
    moto's backend state is global to the process, so it survives ``stop()``/``start()`` (and
    is shared with any other in-process moto server or ``mock_aws``). ``in_process=False``
    (benchmarks) runs ``python -m moto.server`` as a child process, so moto's CPU does not
    compete with the client for this process's GIL; its state lives in that process, so after
    ``stop()``/``start()`` the server is empty again (buckets must be re-created), like a
    storage service that lost its data.

    ``stop()`` closes the listening socket and cuts requests in flight (werkzeug does not keep
    connections alive, so nothing else lingers); ``start()`` again binds the same port, so clients holding the endpoint URL see the storage go away and come back.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        in_process: bool = True,
        start_timeout: float = 60.0,
    ) -> None:
        self._fixed_port = port is not None
        self._port = port if port is not None else free_port()
        self.in_process = in_process
        self.start_timeout = start_timeout
        self._thread_server: _InProcessMoto | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_dir: Path | None = None
        self._started_once = False
        self._admin: Any = None  # admin_client's, kept while the server runs

    # -- properties -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port; fixed for the life of the object once started."""
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``, the S3 endpoint to hand to clients."""
        return f"http://{LOOPBACK}:{self._port}"

    @property
    def running(self) -> bool:
        """Whether the server is currently started."""
        if self.in_process:
            return self._thread_server is not None
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The child's pid in subprocess mode (None otherwise or when stopped)."""
        return self._proc.pid if self._proc is not None and self.running else None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Start serving (no-op when running). The first start may move to another free port
        if the chosen one was taken meanwhile; later starts always reuse the same port."""
        if self.running:
            return self
        # botocore must never reach for real AWS: no EC2 instance-metadata credential lookups.
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
        may_move = not self._fixed_port and not self._started_once
        attempts = 5 if may_move else 1
        for attempt in range(attempts):
            try:
                if self.in_process:
                    self._start_thread()
                else:
                    self._start_process()
                break
            except _PortBusy as exc:
                if attempt + 1 == attempts:
                    raise RuntimeError(
                        f"moto S3 server could not bind 127.0.0.1:{self._port}: {exc}"
                    ) from exc
                self._port = free_port()
        self._started_once = True
        return self

    def _start_thread(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            server = _InProcessMoto(self._port)
            try:
                server.start()
            except OSError as exc:
                # Right after stop() the port is free (SO_REUSEADDR), but allow a short wait in
                # case a previous owner is still closing it.
                if self._started_once and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                raise _PortBusy(str(exc)) from exc
            self._thread_server = server
            return

    def _start_process(self) -> None:
        try:
            import moto.server  # noqa: F401
        except ImportError as exc:
            raise ComponentUnavailable(
                f"moto server mode is not installed ({exc}): pip install 'moto[server]'"
            ) from exc
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="bootseer-moto-"))
            weakref.finalize(self, shutil.rmtree, self._log_dir, True)
        log_path = self._log_dir / "moto.log"
        env = dict(os.environ)
        env["AWS_EC2_METADATA_DISABLED"] = "true"
        env.setdefault("AWS_ACCESS_KEY_ID", DUMMY_AWS_KEY)
        env.setdefault("AWS_SECRET_ACCESS_KEY", DUMMY_AWS_SECRET)
        env.setdefault("AWS_DEFAULT_REGION", DUMMY_AWS_REGION)
        env.pop("MOTO_PORT", None)
        cmd = [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self._port)]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, close_fds=True
            )
        self._proc = proc
        self._finalizer = weakref.finalize(self, _stop_moto_process, proc)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if proc.poll() is not None:
                self._proc = None
                self._finalizer.detach()
                log_text = _tail(log_path)
                if "Address already in use" in log_text:
                    log_path.unlink(missing_ok=True)
                    raise _PortBusy(log_text.splitlines()[-1] if log_text else "busy")
                raise RuntimeError(
                    f"moto S3 server ({' '.join(cmd)}) exited with status {proc.returncode}:\n"
                    f"{log_text}"
                )
            resp = _http_probe(self._port, "/moto-api/data.json", timeout=2.0)
            if resp is not None and resp.status == 200 and proc.poll() is None:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"moto S3 server on 127.0.0.1:{self._port} did not answer within "
                    f"{self.start_timeout:.0f}s; log:\n{_tail(log_path)}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop serving: listening socket and open connections are closed (idempotent)."""
        self._admin = None  # its pooled connections die with the server
        if self._thread_server is not None:
            self._thread_server.stop()
            self._thread_server = None
        if self._proc is not None:
            proc, self._proc = self._proc, None
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
            _stop_moto_process(proc)

    def close(self) -> None:
        """Stop and remove the subprocess log directory."""
        self.stop()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
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

    # -- clients -----------------------------------------------------------------------------

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """s3fs/fsspec options for this server. ``endpoint_url`` overrides the address, e.g. to
        go through a shaping proxy on another loopback port. Credentials are dummies, so a
        misrouted request can never authenticate against real AWS."""
        return {
            "key": DUMMY_AWS_KEY,
            "secret": DUMMY_AWS_SECRET,
            "client_kwargs": {
                "endpoint_url": endpoint_url or self.endpoint_url,
                "region_name": DUMMY_AWS_REGION,
            },
        }

    def boto3_client(self, endpoint_url: str | None = None) -> Any:
        """A boto3 S3 client on this server (for setup and checks outside s3fs)."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 comes with moto
            raise ComponentUnavailable(
                f"boto3 is not installed ({exc}): pip install 'moto[server]'"
            ) from exc
        return boto3.client(
            "s3",
            endpoint_url=endpoint_url or self.endpoint_url,
            region_name=DUMMY_AWS_REGION,
            aws_access_key_id=DUMMY_AWS_KEY,
            aws_secret_access_key=DUMMY_AWS_SECRET,
            config=Config(retries={"max_attempts": 2, "mode": "standard"}),
        )

    def admin_client(self) -> Any:
        """One boto3 client kept for set-up and clean-up (a bucket per test): a new client costs
        about 0.1 s, twice a test over hundreds of tests. Dropped when the server stops."""
        if self._admin is None:
            self._admin = self.boto3_client()
        return self._admin

    def create_bucket(self, name: str) -> str:
        """Create a bucket (us-east-1, so no location constraint) and return its name."""
        self.admin_client().create_bucket(Bucket=name)
        return name

    def reset(self) -> None:
        """Drop all of moto's state (every bucket) through moto's own reset endpoint. In
        process mode this also resets any other in-process moto user."""
        conn = http.client.HTTPConnection(LOOPBACK, self._port, timeout=30)
        try:
            conn.request("POST", "/moto-api/reset")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise RuntimeError(f"moto reset failed: HTTP {resp.status}")
        finally:
            conn.close()

    def __repr__(self) -> str:
        mode = "in-process" if self.in_process else "subprocess"
        state = "running" if self.running else "stopped"
        return f"MotoS3Server({self.endpoint_url}, {mode}, {state})"


class _PortBusy(Exception):
    """The chosen port was taken by someone else between free_port() and bind()."""


# --------------------------------------------------------------------------------------------
# nginx
# --------------------------------------------------------------------------------------------


def find_nginx() -> str:
    """Path of the nginx binary (/usr/sbin/nginx, else PATH); ComponentUnavailable if none."""
    for candidate in _NGINX_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nginx")
    if found:
        return found
    raise ComponentUnavailable("nginx not found: apt-get install nginx")


def _nginx_quote(value: str | os.PathLike[str]) -> str:
    text = str(value)
    if any(c in text for c in "\n\r\0"):
        raise ValueError(f"path not usable in an nginx config: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _stop_nginx_process(proc: subprocess.Popen[bytes]) -> None:
    # SIGTERM is nginx's fast shutdown: open connections are closed at once, which is what a
    # test simulating "storage went away" wants; graceful SIGQUIT would wait for transfers.
    _terminate(proc, signal.SIGTERM, timeout=10, group=True)


class NginxServer:
    """nginx serving ``root_dir`` read-only on 127.0.0.1, with HTTP Range (static files).

    Everything nginx writes (config, pid, logs, temp dirs) lives in a private prefix directory,
    so no system nginx configuration is read or touched. Large ranged reads from one file are
    what moto cannot serve efficiently; this is the component for those figures.

    When run as root, workers also run as root (``user root``): the default unprivileged
    worker user could not read test directories, which are mode 0700.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        port: int | None = None,
        *,
        worker_processes: int | str = 1,
        start_timeout: float = 30.0,
    ) -> None:
        self.root_dir = Path(root_dir).resolve()
        self._fixed_port = port is not None
        self._port = port if port is not None else free_port()
        self.worker_processes = worker_processes
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._prefix: Path | None = None
        self._started_once = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``; a file ``root_dir/a/b`` is at ``url + "/a/b"``."""
        return f"http://{LOOPBACK}:{self._port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The nginx master's pid while running."""
        return self._proc.pid if self._proc is not None and self.running else None

    @property
    def prefix(self) -> Path | None:
        """The private prefix (config, logs) while running."""
        return self._prefix

    def config_text(self, prefix: Path) -> str:
        """The nginx.conf used for ``prefix`` (public so benchmarks can record it)."""
        user_line = ""
        if os.geteuid() == 0:
            user = pwd.getpwuid(os.geteuid()).pw_name
            group = grp.getgrgid(os.getegid()).gr_name
            user_line = f"user {user} {group};\n"
        q = _nginx_quote
        tmp = prefix / "tmp"
        return f"""\
# Written by bootseer.testing.servers.NginxServer; private to this server instance.
daemon off;
master_process on;
worker_processes {self.worker_processes};
{user_line}pid {q(prefix / "nginx.pid")};
error_log {q(prefix / "logs" / "error.log")} warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    server_tokens off;
    default_type application/octet-stream;
    types {{ }}
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_requests 100000;
    keepalive_timeout 65;
    client_body_temp_path {q(tmp / "client_body")};
    proxy_temp_path {q(tmp / "proxy")};
    fastcgi_temp_path {q(tmp / "fastcgi")};
    uwsgi_temp_path {q(tmp / "uwsgi")};
    scgi_temp_path {q(tmp / "scgi")};

    server {{
        listen {LOOPBACK}:{self._port};
        server_name localhost;
        root {q(self.root_dir)};
        location / {{
            autoindex on;
        }}
    }}
}}
"""

    def start(self) -> Self:
        """Start nginx and wait until it answers (no-op when running)."""
        if self.running:
            return self
        binary = find_nginx()
        if not self.root_dir.is_dir():
            raise NotADirectoryError(f"nginx root_dir is not a directory: {self.root_dir}")
        start_on_a_free_port(self, binary, "nginx")
        return self

    def _start_once(self, binary: str) -> None:
        prefix = Path(tempfile.mkdtemp(prefix="bootseer-nginx-"))
        (prefix / "logs").mkdir()
        (prefix / "tmp").mkdir()
        conf = prefix / "nginx.conf"
        conf.write_text(self.config_text(prefix))
        error_log = prefix / "logs" / "error.log"
        cmd = [binary, "-c", str(conf), "-p", str(prefix), "-e", str(error_log)]
        with open(prefix / "logs" / "stderr.log", "wb") as stderr:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                close_fds=True,
                start_new_session=True,  # own process group: workers are stopped with it
            )
        self._proc, self._prefix = proc, prefix
        self._finalizer = weakref.finalize(self, _stop_nginx_process, proc)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if proc.poll() is not None:
                log_text = "\n".join(
                    t for t in (_tail(error_log), _tail(prefix / "logs" / "stderr.log")) if t
                )
                self._cleanup()
                if "Address already in use" in log_text:
                    raise _PortBusy(log_text.splitlines()[-1])
                raise RuntimeError(
                    f"nginx exited with status {proc.returncode} at start ({' '.join(cmd)}):\n"
                    f"{log_text}"
                )
            resp = _http_probe(self._port, "/", timeout=2.0)
            if resp is not None and (resp.getheader("Server") or "").startswith("nginx"):
                if proc.poll() is None:
                    return
            if time.monotonic() > deadline:
                log_text = _tail(error_log)
                self.stop()
                raise RuntimeError(
                    f"nginx on 127.0.0.1:{self._port} did not answer within "
                    f"{self.start_timeout:.0f}s; error log:\n{log_text}"
                )
            time.sleep(0.05)

    def _cleanup(self) -> None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _stop_nginx_process(proc)
        if self._prefix is not None:
            shutil.rmtree(self._prefix, ignore_errors=True)
            self._prefix = None

    def stop(self) -> None:
        """Fast shutdown (SIGTERM, then SIGKILL to the process group after 10 s); removes the
        private prefix. Idempotent; ``start()`` afterwards reuses the same port."""
        self._cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"NginxServer({self.url}, root={self.root_dir}, {state})"


# --------------------------------------------------------------------------------------------
# FUSE
# --------------------------------------------------------------------------------------------


def fuse_available() -> str | None:
    """None when a fusepy mount can work here, else the reason (what is missing, how to get
    it). Checks /dev/fuse, fusermount, and that fusepy imports (it loads libfuse2 at import)."""
    dev = "/dev/fuse"
    if not os.path.exists(dev):
        return (
            "/dev/fuse missing: load the fuse kernel module (modprobe fuse) or run the "
            "container with --device /dev/fuse --cap-add SYS_ADMIN"
        )
    if not os.access(dev, os.R_OK | os.W_OK):
        return f"/dev/fuse is not readable and writable by uid {os.geteuid()}"
    if not (shutil.which("fusermount") or shutil.which("fusermount3")):
        return "fusermount not found: apt-get install fuse3"
    try:
        import fuse
    except ImportError as exc:
        return f"fusepy is not installed ({exc}): pip install fusepy"
    except OSError as exc:  # fusepy raises EnvironmentError when libfuse cannot be loaded
        return f"libfuse2 cannot be loaded ({exc}): apt-get install libfuse2"
    if not hasattr(fuse, "FUSE"):
        return (
            f"the importable 'fuse' module ({getattr(fuse, '__file__', '?')}) is not fusepy: "
            "pip uninstall fuse-python; pip install fusepy"
        )
    return None
