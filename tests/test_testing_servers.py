"""The base of the test servers (bootseer.testing.process_server): real child processes come
up on a free port and serve, and every way a start or a stop can go wrong ends with no process
left and an error that holds the child's log."""

from __future__ import annotations

import gc
import hashlib
import os
import random
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bootseer.testing.process_server import (
    ComponentUnavailable,
    ProcessServer,
    ServerStartFailed,
    http_get,
    http_ready,
)
from bootseer.testing.shaper import ShaperProcess, ShaperSettings

PY = sys.executable


def http_server(directory: Path, **kwargs: Any) -> ProcessServer:
    """``python -m http.server`` on the server's port, serving ``directory``."""
    return ProcessServer(
        lambda port: [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", directory],
        ready=http_ready("/", status=200),
        name="http.server",
        **kwargs,
    )


def listener(*, ignore_term: bool = False, grandchild: bool = False) -> str:
    """A child that listens on argv[1] and prints its pid (and its grandchild's)."""
    return "\n".join(
        [
            "import os, signal, socket, subprocess, sys, time",
            f"if {ignore_term}: signal.signal(signal.SIGTERM, signal.SIG_IGN)",
            f"kid = subprocess.Popen(['sleep', '600']).pid if {grandchild} else 0",
            "print('pids', os.getpid(), kid, flush=True)",
            "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()",
            "time.sleep(600)",
        ]
    )


def pids_in(text: str) -> list[int]:
    match = re.search(r"pids (\d+) (\d+)", text)
    assert match, f"no pids line in the log: {text!r}"
    return [int(p) for p in match.groups() if p != "0"]


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Every pid has exited (a zombie not yet reaped by init counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


# -- a real server ---------------------------------------------------------------------------


def test_http_server_comes_up_serves_and_stops(tmp_path: Path) -> None:
    (tmp_path / "hello.txt").write_bytes(b"hello from the child\n")
    server = http_server(tmp_path)
    port = server.port
    assert server.url == f"http://127.0.0.1:{port}" and server.host == f"127.0.0.1:{port}"
    assert not server.running and server.pid is None and server.returncode is None

    with server:
        assert server.running and server.port == port
        pid = server.pid
        assert pid is not None and pid != os.getpid()
        assert os.getpgid(pid) == pid  # its own process group: stopped as one
        resp = http_get(port, "/hello.txt")
        assert resp is not None and resp.status == 200
        # the body went by: the child's request log names the file
        assert server.log_path is not None and server.log_path.is_file()
        assert '"GET /hello.txt HTTP/1.1" 200' in server.log_tail()
        log_dir = server.log_path.parent

    assert not server.running and server.pid is None
    assert server.returncode == -signal.SIGTERM  # stopped politely, in time
    assert gone([pid]) and refused(port)
    assert not log_dir.exists()  # close() removed the private log directory


def test_restart_keeps_the_port_and_the_log_tail_is_the_latest_run(tmp_path: Path) -> None:
    server = http_server(tmp_path)
    try:
        server.start()
        port = server.port
        assert http_get(port, "/first-run") is not None
        server.stop()
        assert refused(port)
        server.start()
        assert server.port == port
        assert http_get(port, "/second-run") is not None
        tail = server.log_tail()
        assert "/second-run" in tail and "/first-run" not in tail
        assert server.log_path is not None
        assert "/first-run" in server.log_path.read_text()  # appended, not truncated
    finally:
        server.close()


def test_taken_port_moves_the_first_start_to_a_free_one(tmp_path: Path) -> None:
    server = http_server(tmp_path)
    chosen = server.port
    with socket.socket() as squatter:  # someone else binds it between choosing and starting
        squatter.bind(("127.0.0.1", chosen))
        squatter.listen()
        with server:
            assert server.port != chosen
            resp = http_get(server.port, "/")
            assert resp is not None and resp.status == 200


def test_taken_fixed_port_is_refused_by_name(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = http_server(tmp_path, port=port)
        with pytest.raises(
            ComponentUnavailable, match=rf"http.server could not bind 127.0.0.1:{port}"
        ):
            server.start()
        assert not server.running
        server.close()


# -- failures at start -----------------------------------------------------------------------


def test_command_that_exits_at_once_raises_with_its_log_tail() -> None:
    script = "import sys; print('bad config: no such key frobnicate', file=sys.stderr); sys.exit(3)"
    server = ProcessServer(lambda port: [PY, "-c", script], name="broken server")
    with pytest.raises(ServerStartFailed) as caught:
        server.start()
    err = caught.value
    assert isinstance(err, ComponentUnavailable)  # tests skip on it, or fail when required
    assert err.returncode == 3 and server.returncode == 3
    assert "bad config: no such key frobnicate" in err.log_tail
    assert "broken server" in str(err) and "exited with status 3" in str(err)
    assert "bad config: no such key frobnicate" in str(err)
    assert not server.running
    server.close()


def test_server_never_ready_is_killed_at_the_deadline_with_its_group() -> None:
    # listens on another port than the one it was told: never ready on its own
    server = ProcessServer(
        lambda port: [PY, "-c", listener(grandchild=True), "0"],
        name="deaf server",
        start_timeout=1.5,
    )
    started = time.monotonic()
    with pytest.raises(
        ServerStartFailed, match=r"deaf server on 127.0.0.1:\d+ was not ready within 1.5 s"
    ) as caught:
        server.start()
    took = time.monotonic() - started
    assert 1.5 <= took < 15, took
    pids = pids_in(caught.value.log_tail)
    assert len(pids) == 2  # the child and the grandchild it started
    assert gone(pids), "a process of the server outlived its deadline"
    assert not server.running and server.pid is None
    assert server.returncode == -signal.SIGTERM
    server.close()


def test_missing_binary_is_component_unavailable() -> None:
    server = ProcessServer(lambda port: ["/nonexistent/bootseer-server"], name="ghost")
    with pytest.raises(
        ComponentUnavailable, match="ghost: cannot run /nonexistent/bootseer-server"
    ):
        server.start()
    server.close()


def test_failing_readiness_check_leaves_no_child(tmp_path: Path) -> None:
    seen: list[int] = []

    def ready(port: int) -> bool:
        assert server.pid is not None
        seen.append(server.pid)
        raise RuntimeError("probe blew up")

    server = ProcessServer(lambda port: [PY, "-c", listener(), str(port)], ready=ready)
    with pytest.raises(RuntimeError, match="probe blew up"):
        server.start()
    assert seen and gone(seen[:1]) and not server.running
    server.close()


# -- stopping ----------------------------------------------------------------------------------


def test_child_ignoring_sigterm_is_killed_after_the_grace() -> None:
    server = ProcessServer(
        lambda port: [PY, "-c", listener(ignore_term=True), str(port)],
        name="stubborn",
        stop_grace=0.5,
    )
    server.start()
    pid = server.pid
    assert pid is not None
    # ready means listening, and the child ignores SIGTERM before it listens
    started = time.monotonic()
    server.stop()
    took = time.monotonic() - started
    assert took >= 0.5, f"stop() returned after {took:.2f} s, before the grace"
    assert server.returncode == -signal.SIGKILL
    assert gone([pid])
    server.close()


def test_close_twice_and_before_start_is_fine(tmp_path: Path) -> None:
    never = http_server(tmp_path)
    never.close()
    never.close()
    never.stop()

    server = http_server(tmp_path)
    server.start()
    pid = server.pid
    assert pid is not None
    log_dir = server.log_path.parent if server.log_path else None
    server.close()
    server.close()
    server.stop()
    assert gone([pid]) and log_dir is not None and not log_dir.exists()
    # a closed server may start again, with a new private log
    with server:
        assert server.running and server.log_path is not None and server.log_path.is_file()


def test_dropped_server_object_stops_its_child(tmp_path: Path) -> None:
    server = http_server(tmp_path)
    server.start()
    pid = server.pid
    assert pid is not None and server.log_path is not None
    log_dir = server.log_path.parent
    del server
    gc.collect()
    assert gone([pid]), "the child outlived its server object"
    assert not log_dir.exists(), "the private log directory outlived its server object"


def test_subclass_hooks_run_per_launch(tmp_path: Path) -> None:
    """prepare() sees the final port before each launch; cleanup() runs after each stop."""

    class Configured(ProcessServer):
        def __init__(self) -> None:
            super().__init__(name="configured", log_path=tmp_path / "configured.log")
            self.events: list[str] = []

        def prepare(self) -> None:
            (tmp_path / "port.conf").write_text(str(self.port))
            self.events.append(f"prepare {self.port}")

        def argv(self) -> list[str]:
            port = (tmp_path / "port.conf").read_text()
            return [PY, "-c", listener(), port]

        def cleanup(self) -> None:
            self.events.append("cleanup")

    server = Configured()
    with server:
        port = server.port
    assert server.events == [f"prepare {port}", "cleanup"]
    assert "pids" in (tmp_path / "configured.log").read_text()  # a given log path is kept


def test_containerd_socket_directory_goes_with_its_server(tmp_path: Path) -> None:
    """ContainerdServer makes a short bootseer-ctd-* directory in /tmp for its socket at
    construction: stop() removes it, and so does dropping a server that never started."""
    from bootseer.testing.containerd import ContainerdServer

    stopped = ContainerdServer(tmp_path / "a")
    sock_dir = Path(stopped.sock_dir)
    assert sock_dir.is_dir() and len(stopped.address) < 108
    stopped.stop()
    assert not sock_dir.exists()

    dropped = ContainerdServer(tmp_path / "b")
    sock_dir = Path(dropped.sock_dir)
    assert sock_dir.is_dir()
    del dropped
    gc.collect()
    assert not sock_dir.exists(), "the socket directory outlived its server object"


# -- the shaper's child process -----------------------------------------------------------------


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(256 * 1024):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A TCP echo server on a thread: the upstream behind the shaper."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def echoed(port: int, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` through 127.0.0.1:port while reading it back: (what came back, seconds)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sender = threading.Thread(
            target=lambda: (sock.sendall(data), sock.shutdown(socket.SHUT_WR))
        )
        sender.start()
        back = bytearray()
        while chunk := sock.recv(256 * 1024):
            back += chunk
        sender.join()
    return bytes(back), time.monotonic() - started


def test_shaper_process_shapes_a_real_connection_and_stops(echo_port: int) -> None:
    shaper = ShaperProcess("127.0.0.1", echo_port, ShaperSettings(latency_s=0.05))
    assert isinstance(shaper, ProcessServer)
    port = shaper.port  # chosen free before the start, kept by it
    assert port > 0 and shaper.address == f"127.0.0.1:{port}" and shaper.host == "127.0.0.1"
    data = random.Random(7).randbytes(1 << 20)

    with shaper:
        pid = shaper.pid
        assert pid is not None and os.getpgid(pid) == pid and shaper.port == port
        assert f"LISTENING 127.0.0.1:{port}" in shaper.log_tail()  # its readiness
        back, took = echoed(port, data)
        assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
        assert took >= 0.1, f"{took:.3f} s: not shaped (50 ms each way)"
        assert shaper.log_path is not None
        log_dir = shaper.log_path.parent

    assert not shaper.running and shaper.pid is None
    assert shaper.returncode == 0  # SIGTERM: the proxy closes and exits cleanly
    assert gone([pid]) and refused(port)
    assert not log_dir.exists()


def test_shaper_process_moves_off_a_taken_port(echo_port: int) -> None:
    shaper = ShaperProcess("127.0.0.1", echo_port)
    chosen = shaper.port
    with socket.socket() as squatter:  # taken between choosing and the child's bind
        squatter.bind(("127.0.0.1", chosen))
        squatter.listen()
        with shaper:
            assert shaper.port != chosen
            assert echoed(shaper.port, b"moved")[0] == b"moved"


def test_shaper_process_dies_with_a_killed_parent(echo_port: int, tmp_path: Path) -> None:
    """Its stdin is a lifeline: a parent killed by SIGKILL (no finalizer runs) leaves no
    shaper behind."""
    script = (
        "import sys, time\n"
        "from bootseer.testing.shaper import ShaperProcess\n"
        f"s = ShaperProcess('127.0.0.1', {echo_port})\n"
        "s.start()\n"
        "print(s.pid, s.port, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [PY, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        assert parent.stdout is not None
        pid, port = (int(x) for x in parent.stdout.readline().split())
        assert echoed(port, b"alive")[0] == b"alive"
    finally:
        parent.kill()
        parent.wait()
    assert gone([pid]), "the shaper outlived its SIGKILLed parent"
    assert refused(port)


def test_the_documented_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/architecture.md's example of the base is code that works."""
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    section = doc.split("## bootseer/testing: the fixture library", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/architecture.md", "exec"), {})
    url = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
    assert refused(int(url.rsplit(":", 1)[1]))  # stopped at the end of the with block
