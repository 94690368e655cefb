"""The real-component fixtures work and serve correct bytes over real loopback HTTP."""

from __future__ import annotations

import http.client
import os
import random
import socket
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import fsspec
import psutil
import pytest
from conftest import need, require_component

from bootseer.testing import servers
from bootseer.testing.servers import (
    ComponentUnavailable,
    MotoS3Server,
    NginxServer,
    free_port,
    fuse_available,
    require_system,
)


def _payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- helpers -----------------------------------------------------------------------------------


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_require_component_skips_or_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BOOTSEER_REQUIRE_SYSTEM", raising=False)
    assert not require_system()
    with pytest.raises(pytest.skip.Exception, match="nginx not found"):
        require_component("nginx not found: apt-get install nginx")
    need(None)  # available: no-op
    monkeypatch.setenv("BOOTSEER_REQUIRE_SYSTEM", "1")
    assert require_system()
    with pytest.raises(pytest.fail.Exception, match="apt-get install nginx"):
        need("nginx not found: apt-get install nginx")


def test_missing_nginx_is_component_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "_NGINX_CANDIDATES", ())
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ComponentUnavailable, match=r"nginx not found: apt-get install nginx"):
        NginxServer(tmp_path).start()


# -- S3 over real HTTP -----------------------------------------------------------------------


def test_s3fs_roundtrip_and_ranged_read(s3_bucket, s3fs_fs, s3_server: MotoS3Server) -> None:
    bucket, options = s3_bucket
    assert options["client_kwargs"]["endpoint_url"] == s3_server.endpoint_url
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    data = _payload(3 * 1024 * 1024 + 12345, seed=1)
    path = f"{bucket}/dir/blob.bin"

    s3fs_fs.pipe(path, data)

    assert s3fs_fs.info(path)["size"] == len(data)
    assert s3fs_fs.cat_file(path) == data
    start, end = 1_000_003, 2_500_017
    assert s3fs_fs.cat_file(path, start=start, end=end) == data[start:end]
    assert s3fs_fs.ls(f"{bucket}/dir") == [path]

    # The same object seen by an independent client over HTTP (boto3, ranged GET).
    resp = s3_server.boto3_client().get_object(
        Bucket=bucket, Key="dir/blob.bin", Range="bytes=10-29"
    )
    assert resp["Body"].read() == data[10:30]


def test_storage_options_endpoint_override(s3_server: MotoS3Server) -> None:
    opts = s3_server.storage_options(endpoint_url="http://127.0.0.1:1")
    assert opts["client_kwargs"] == {
        "endpoint_url": "http://127.0.0.1:1",
        "region_name": "us-east-1",
    }
    assert opts["key"] == "testing" and opts["secret"] == "testing"
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"


def test_in_process_moto_restart_same_port_keeps_state(s3_server_factory) -> None:
    server: MotoS3Server = s3_server_factory(in_process=True)
    port = server.port
    bucket = server.create_bucket(f"restart-{uuid.uuid4().hex[:12]}")
    server.boto3_client().put_object(Bucket=bucket, Key="k", Body=b"persisted")

    server.stop()
    assert not server.running
    assert _refused(port), "stopped in-process moto server still accepts connections"

    server.start()
    assert server.port == port
    body = server.boto3_client().get_object(Bucket=bucket, Key="k")["Body"].read()
    assert body == b"persisted"  # moto's in-process backend state is global


def test_in_process_moto_stop_cuts_transfer_in_flight(s3_server_factory) -> None:
    """A client mid-download sees the storage go away, as with a real outage."""
    server: MotoS3Server = s3_server_factory(in_process=True)
    bucket = server.create_bucket(f"inflight-{uuid.uuid4().hex[:12]}")
    data = _payload(48 * 1024 * 1024, seed=4)
    client = server.boto3_client()
    client.put_object(Bucket=bucket, Key="big", Body=data)
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "big"})
    path = url.split(str(server.port), 1)[1]

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    assert resp.status == 200
    head = resp.read(1024 * 1024)
    assert head == data[: len(head)]
    server.stop()
    received = len(head)
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        while chunk := resp.read(1024 * 1024):
            received += len(chunk)
        raise http.client.IncompleteRead(b"", len(data) - received)
    assert received < len(data)
    conn.close()


def test_subprocess_moto_serves_s3fs_and_restarts_on_same_port(s3_server_factory) -> None:
    import s3fs

    server: MotoS3Server = s3_server_factory(in_process=False)
    assert server.pid is not None and server.pid != os.getpid()
    port = server.port
    bucket = server.create_bucket("subprocess-bucket")
    fs = s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)
    data = _payload(2 * 1024 * 1024 + 7, seed=2)
    fs.pipe(f"{bucket}/obj", data)
    assert fs.cat_file(f"{bucket}/obj") == data
    assert fs.cat_file(f"{bucket}/obj", start=5, end=1_048_600) == data[5:1_048_600]

    pid = server.pid
    server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert _refused(port)

    server.start()
    assert server.port == port
    client = server.boto3_client()
    # Documented: a subprocess server starts empty again.
    assert client.list_buckets()["Buckets"] == []
    server.create_bucket("subprocess-bucket")
    fs2 = s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)
    fs2.pipe(f"{bucket}/again", b"back")
    assert fs2.cat_file(f"{bucket}/again") == b"back"
    server.reset()  # moto's own reset endpoint empties the server
    assert client.list_buckets()["Buckets"] == []


# -- nginx -------------------------------------------------------------------------------------


def test_nginx_range_requests(tmp_path: Path, nginx_factory) -> None:
    data = _payload(5 * 1024 * 1024 + 3, seed=3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file.bin").write_bytes(data)
    tmp_path.chmod(0o700)  # as root, nginx workers must still read a private directory
    server: NginxServer = nginx_factory(tmp_path)
    url = f"{server.url}/sub/file.bin"
    assert url.startswith("http://127.0.0.1:")

    opener = _no_proxy_opener()
    req = urllib.request.Request(url, headers={"Range": "bytes=1000-1048575"})
    with opener.open(req, timeout=30) as resp:
        assert resp.status == 206
        assert resp.headers["Content-Range"] == f"bytes 1000-1048575/{len(data)}"
        assert resp.read() == data[1000:1048576]

    req = urllib.request.Request(url, headers={"Range": f"bytes={len(data) - 10}-"})
    with opener.open(req, timeout=30) as resp:
        assert resp.status == 206
        assert resp.read() == data[-10:]

    with opener.open(url, timeout=30) as resp:
        assert resp.status == 200
        assert resp.read() == data

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    assert fs.info(url)["size"] == len(data)
    assert fs.cat_file(url, start=123_457, end=4_000_001) == data[123_457:4_000_001]
    assert fs.cat_file(url) == data


def test_nginx_is_read_only_and_confined(tmp_path: Path, nginx_factory) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    server: NginxServer = nginx_factory(tmp_path)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("PUT", "/a.txt", body=b"changed")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 405
        conn.request("GET", "/../../etc/passwd")
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status in (400, 404)
        assert b"root:" not in body
    finally:
        conn.close()
    assert (tmp_path / "a.txt").read_bytes() == b"hello"
    # Nothing written outside the private prefix: the served directory is untouched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_nginx_stop_leaves_no_process_and_restarts_on_same_port(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"0123456789")
    server = NginxServer(tmp_path)
    try:
        server.start()
        prefix = server.prefix
        assert prefix is not None and (prefix / "nginx.conf").is_file()
        master = psutil.Process(server.pid)
        family = [master, *master.children(recursive=True)]
        assert len(family) >= 2  # master + worker
        port = server.port

        server.stop()
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert alive == []
        assert _refused(port)
        assert not prefix.exists()

        server.start()
        assert server.port == port
        with _no_proxy_opener().open(
            urllib.request.Request(f"{server.url}/x", headers={"Range": "bytes=2-4"}), timeout=10
        ) as resp:
            assert resp.status == 206 and resp.read() == b"234"
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        _no_proxy_opener().open(f"{server.url}/x", timeout=5)


# -- FUSE ----------------------------------------------------------------------------------------


def test_fuse_available_here() -> None:
    reason = fuse_available()
    assert reason is None or isinstance(reason, str)
    need(reason)  # skips with the reason, or fails under BOOTSEER_REQUIRE_SYSTEM=1
    import fuse as fusepy

    assert hasattr(fusepy, "FUSE")
    assert os.path.exists("/dev/fuse")


def test_fuse_fixture(fuse: None) -> None:
    assert fuse_available() is None


# -- nothing left behind ---------------------------------------------------------------------------


def test_no_server_child_left_running(s3_server_factory, nginx_factory, tmp_path: Path) -> None:
    sub = s3_server_factory(in_process=False)
    web = nginx_factory(tmp_path)
    me = psutil.Process()
    assert {sub.pid, web.pid} <= {k.pid for k in me.children(recursive=True)}
    # only the servers' own process trees: other tests may leave unrelated helpers alive
    # (multiprocessing's resource tracker lives as long as the test session)
    servers = [psutil.Process(sub.pid), psutil.Process(web.pid)]
    tree = servers + [c for p in servers for c in p.children(recursive=True)]
    sub.stop()
    web.stop()
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert alive == []
