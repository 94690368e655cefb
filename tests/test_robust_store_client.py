"""bootseer's torch-free c10d store client against torch's real TCPStore server (libuv and
the classic one), side by side with torch's own client on the same keys, and against servers
this test crafts byte by byte (a forged length, a wrong nonce, a connection cut mid-reply)."""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bootseer.robust.store_client import StoreClient, StoreError, StoreTimeout

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def server(request):
    from torch.distributed import TCPStore

    s = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        use_libuv=request.param,
        timeout=datetime.timedelta(seconds=10),
    )
    yield s
    del s


def test_every_operation_agrees_with_torchs_own_client(server) -> None:
    c = StoreClient("127.0.0.1", server.port, timeout_s=5)
    c.set("a", b"x\x00y")
    assert server.get("a") == b"x\x00y"  # the same key: torch's "/" prefix, bytes intact
    server.set("b", "hello")
    assert c.get("b") == b"hello"
    assert c.check(["a", "b"]) and not c.check(["a", "missing"])
    assert c.add("n", 5) == 5 and server.add("n", 1) == 6 and c.add("n", 0) == 6
    c.append("l", "1\n")
    assert c.check(["l"])  # answered on the same connection: the append went first
    server.append("l", "2\n")
    assert c.get("l") == b"1\n2\n"
    assert c.compare_set("cs", "", "v1") == b"v1"  # missing and expected empty: set
    assert c.compare_set("cs", "other", "v2") == b"v1"  # no match: the value it holds
    assert server.compare_set("cs", "v1", "v3") == b"v3"
    assert c.delete_key("a") is True and c.delete_key("a") is False
    assert not server.check(["a"])
    assert c.num_keys() == server.num_keys()
    big = bytes(range(256)) * (24 << 10)  # 6 MiB (libuv takes at most 8): several recv()s
    server.set("big", big)
    assert c.get("big") == big


def test_a_key_that_never_comes_times_out_and_the_client_goes_on(server) -> None:
    c = StoreClient("127.0.0.1", server.port, timeout_s=5)
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"wait 'never': not set within 0.3 s"):
        c.wait(["never"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - started < 3
    c.set_timeout(datetime.timedelta(seconds=0.3))
    with pytest.raises(StoreTimeout, match="get 'never'"):
        c.get("never")
    server.set("late", "here")  # the next call connects again and is answered in step
    assert c.get("late") == b"here"


def test_a_set_on_the_master_wakes_a_waiting_get(server) -> None:
    c = StoreClient("127.0.0.1", server.port, timeout_s=5)
    threading.Timer(0.3, lambda: server.set("soon", "v")).start()
    assert c.get("soon") == b"v"


def test_nothing_listening_is_a_clear_error_after_the_timeout() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: refused
    started = time.monotonic()
    with pytest.raises(StoreError, match=rf"store 127.0.0.1:{port}: cannot connect"):
        StoreClient("127.0.0.1", port, timeout_s=0.5)
    assert 0.1 < time.monotonic() - started < 3  # retried (a store still starting), then said


# -- servers that lie ------------------------------------------------------------------------


@contextlib.contextmanager
def _crafted_server(answer: Callable[[socket.socket, int], None]) -> Iterator[int]:
    """A listener that validates like torch's server, then lets ``answer`` reply to the
    connection's queries (``answer(conn, n)``, n = how many connections came before)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        n = 0
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                head = _recv(conn, 5 + 5)  # VALIDATE magic, PING nonce
                assert head[0] == 0 and struct.unpack("=I", head[1:5])[0] == 0x3C85F7CE
                conn.sendall(head[6:10])
                answer(conn, n)
            n += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _recv(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _skip_get_query(conn: socket.socket, key: bytes) -> None:
    """Read a WAIT for one key, answer stop-waiting, read the GET that follows."""
    _recv(conn, 1 + 8 + 8 + len(key))
    conn.sendall(b"\x00")
    _recv(conn, 1 + 8 + len(key))


def test_a_forged_length_is_refused_before_anything_is_allocated() -> None:
    def answer(conn: socket.socket, n: int) -> None:
        _skip_get_query(conn, b"/k")
        conn.sendall(struct.pack("=Q", 1 << 62) + b"junk")
        time.sleep(0.5)

    with _crafted_server(answer) as port:
        c = StoreClient("127.0.0.1", port, timeout_s=5, max_value_bytes=1 << 20)
        with pytest.raises(
            StoreError,
            match=r"get 'k': the store announced a 4611686018427387904"
            r"-byte value, over the 1048576-byte limit",
        ):
            c.get("k")


def test_a_wrong_ping_answer_is_not_taken_for_a_store() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            _recv(conn, 10)
            conn.sendall(b"HTTP")  # whatever else listens on the port

    threading.Thread(target=serve, daemon=True).start()
    with listener, pytest.raises(StoreError, match="ping: answered .* not a c10d store"):
        StoreClient("127.0.0.1", listener.getsockname()[1], timeout_s=5)


def test_a_connection_cut_mid_reply_is_dropped_and_the_next_call_is_in_step() -> None:
    def answer(conn: socket.socket, n: int) -> None:
        _skip_get_query(conn, b"/k")
        if n == 0:
            conn.sendall(struct.pack("=Q", 10) + b"half")  # then the connection closes
        else:
            conn.sendall(struct.pack("=Q", 5) + b"whole")

    with _crafted_server(answer) as port:
        c = StoreClient("127.0.0.1", port, timeout_s=5)
        with pytest.raises(StoreError, match="get 'k': receive failed .*closed the connection"):
            c.get("k")
        assert c.get("k") == b"whole"  # a new connection, never the old stream's tail


def test_the_agents_and_controllers_store_link_does_not_import_torch(tcp_store) -> None:
    code = (
        "import sys\n"
        "from bootseer.robust import wire\n"
        "from bootseer.robust.remote import ControllerLink\n"
        "from bootseer.robust.controller import Controller\n"
        f"link = ControllerLink.connect('127.0.0.1:{tcp_store.port}', node='n0')\n"
        "link.register()\n"
        "Controller(wire.connect('127.0.0.1:%d')).step()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
        % tcp_store.port
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert tcp_store.get("bootseer/job/nodes") == b"n0\n"  # registered through the real store
