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
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .process_server import (
    LOOPBACK,
    ComponentUnavailable,
    PortBusy,
    ProcessServer,
    file_tail,
    free_port,
    http_ready,
    on_a_free_port,
)

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

DUMMY_AWS_KEY = "testing"
DUMMY_AWS_SECRET = "testing"
DUMMY_AWS_REGION = "us-east-1"

_NGINX_CANDIDATES: tuple[str, ...] = ("/usr/sbin/nginx",)


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


def require_system() -> bool:
    """True when ``BOOTSEER_REQUIRE_SYSTEM=1``: a missing component is then a failure, not a
    skip (CI on a fully provisioned machine must not silently skip the system tests)."""
    return os.environ.get("BOOTSEER_REQUIRE_SYSTEM", "") == "1"


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
    - per-request access logging is off (it floods stderr during large transfers);
    - which backend serves a host is looked up once per host: moto's lookup lists its package
      directory (about 150 ``isdir`` calls) on every request, a fifth of a small request's CPU
      (measured: a HEAD and GET pair 15.2 -> 12.3 ms of CPU), and the S3 tests are CPU-bound.
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

        class CachedDispatcher(DomainDispatcherApplication):
            """moto's dispatcher with the host -> backend answer kept (it never changes)."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self._backend_of_host: dict[str | None, Any] = {}

            def get_backend_for_host(self, host: str | None) -> Any:
                try:
                    return self._backend_of_host[host]
                except KeyError:
                    backend = self._backend_of_host[host] = super().get_backend_for_host(host)
                    return backend

        app = CachedDispatcher(create_backend_app)
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


class _MotoProcess(ProcessServer):
    """``python -m moto.server`` on the port, its own S3 state in that process."""

    def __init__(self, port: int | None, start_timeout: float) -> None:
        super().__init__(
            port=port,
            name="moto S3 server",
            ready=http_ready("/moto-api/data.json", status=200),
            start_timeout=start_timeout,
            poll_interval=0.1,
        )

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)]

    def popen_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["AWS_EC2_METADATA_DISABLED"] = "true"
        env.setdefault("AWS_ACCESS_KEY_ID", DUMMY_AWS_KEY)
        env.setdefault("AWS_SECRET_ACCESS_KEY", DUMMY_AWS_SECRET)
        env.setdefault("AWS_DEFAULT_REGION", DUMMY_AWS_REGION)
        env.pop("MOTO_PORT", None)
        return env


class MotoS3Server:
    """moto's S3 in server mode on 127.0.0.1, reached over real HTTP by s3fs/boto3.

    ``in_process=True`` (tests) serves from a thread of this process: cheap to start, and
    moto's backend state is global to the process, so it survives ``stop()``/``start()`` (and
    is shared with any other in-process moto server or ``mock_aws``). ``in_process=False``
    (benchmarks) runs ``python -m moto.server`` as a child process (a
    :class:`~bootseer.testing.process_server.ProcessServer`), so moto's CPU does not
    compete with the client for this process's GIL; its state lives in that process, so after
    ``stop()``/``start()`` the server is empty again (buckets must be re-created), like a
    storage service that lost its data.

    ``stop()`` closes the listening socket and cuts requests in flight (werkzeug does not keep
    connections alive, so nothing else lingers); ``start()`` again binds the same port, so
    clients holding the endpoint URL see the storage go away and come back.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        in_process: bool = True,
        start_timeout: float = 60.0,
    ) -> None:
        self.in_process = in_process
        self.start_timeout = start_timeout
        self._process = None if in_process else _MotoProcess(port, start_timeout)
        self._fixed_port = port is not None
        if self._process is not None:
            self._port = self._process.port
        else:
            self._port = port if port is not None else free_port()
        self._thread_server: _InProcessMoto | None = None
        self._started_once = False
        self._admin: Any = None  # admin_client's, kept while the server runs

    # -- properties -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port; fixed for the life of the object once started."""
        return self._process.port if self._process is not None else self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``, the S3 endpoint to hand to clients."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server is currently started."""
        if self._process is not None:
            return self._process.running
        return self._thread_server is not None

    @property
    def pid(self) -> int | None:
        """The child's pid in subprocess mode (None otherwise or when stopped)."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path | None:
        """The child's log in subprocess mode (None otherwise, or before the first start)."""
        return self._process.log_path if self._process is not None else None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Start serving (no-op when running). The first start may move to another free port
        if the chosen one was taken meanwhile; later starts always reuse the same port."""
        if self.running:
            return self
        # botocore must never reach for real AWS: no EC2 instance-metadata credential lookups.
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
        if self._process is not None:
            try:
                import moto.server  # noqa: F401
            except ImportError as exc:
                raise ComponentUnavailable(
                    f"moto server mode is not installed ({exc}): pip install 'moto[server]'"
                ) from exc
            self._process.start_timeout = self.start_timeout
            self._process.start()
            return self
        may_move = not self._fixed_port and not self._started_once
        self._port = on_a_free_port(
            self._start_thread, self._port, may_move=may_move, what="moto S3 server"
        )
        self._started_once = True
        return self

    def _start_thread(self, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            server = _InProcessMoto(port)
            try:
                server.start()
            except OSError as exc:
                # Right after stop() the port is free (SO_REUSEADDR), but allow a short wait in
                # case a previous owner is still closing it.
                if self._started_once and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                raise PortBusy(str(exc)) from exc
            self._thread_server = server
            return

    def stop(self) -> None:
        """Stop serving: listening socket and open connections are closed (idempotent)."""
        self._admin = None  # its pooled connections die with the server
        if self._thread_server is not None:
            self._thread_server.stop()
            self._thread_server = None
        if self._process is not None:
            self._process.stop()

    def close(self) -> None:
        """Stop and remove the subprocess log directory."""
        self.stop()
        if self._process is not None:
            self._process.close()

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
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=30)
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


class NginxServer(ProcessServer):
    """nginx serving ``root_dir`` read-only on 127.0.0.1, with HTTP Range (static files).

    Everything nginx writes (config, pid, logs, temp dirs) lives in a private prefix directory,
    made at each start and removed at each stop, so no system nginx configuration is read or
    touched. Large ranged reads from one file are what moto cannot serve efficiently; this is
    the component for those figures.

    When run as root, workers also run as root (``user root``): the default unprivileged
    worker user could not read test directories, which are mode 0700.

    ``stop()`` is nginx's fast shutdown (SIGTERM: open connections are closed at once, what a
    test simulating "storage went away" wants; graceful SIGQUIT would wait for transfers), then
    SIGKILL to the process group after 10 s, so no worker outlives the server.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        port: int | None = None,
        *,
        worker_processes: int | str = 1,
        start_timeout: float = 30.0,
    ) -> None:
        super().__init__(
            port=port,
            name="nginx",
            # the Server header: nginx itself answers, not whatever else took the port
            ready=http_ready("/", header="Server", header_prefix="nginx"),
            start_timeout=start_timeout,
        )
        self.root_dir = Path(root_dir).resolve()
        self.worker_processes = worker_processes
        self._binary = ""
        self._prefix: Path | None = None

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
        listen {LOOPBACK}:{self.port};
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
        self._binary = find_nginx()
        if not self.root_dir.is_dir():
            raise NotADirectoryError(f"nginx root_dir is not a directory: {self.root_dir}")
        return super().start()

    def prepare(self) -> None:
        prefix = Path(tempfile.mkdtemp(prefix="bootseer-nginx-"))
        (prefix / "logs").mkdir()
        (prefix / "tmp").mkdir()
        (prefix / "nginx.conf").write_text(self.config_text(prefix))
        self._prefix = prefix
        self.log_path = prefix / "logs" / "stderr.log"

    def argv(self) -> list[str]:
        assert self._prefix is not None
        conf, error_log = self._prefix / "nginx.conf", self._prefix / "logs" / "error.log"
        return [self._binary, "-c", str(conf), "-p", str(self._prefix), "-e", str(error_log)]

    def log_tail(self, limit: int = 2000) -> str:
        """nginx's error log, then its stderr (both from the latest start)."""
        error_log = self._prefix / "logs" / "error.log" if self._prefix is not None else None
        return "\n".join(t for t in (file_tail(error_log, limit), super().log_tail(limit)) if t)

    def cleanup(self) -> None:
        """Remove the private prefix (config, pid, logs)."""
        if self._prefix is not None:
            shutil.rmtree(self._prefix, ignore_errors=True)
            self._prefix = None
            self.log_path = None

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
