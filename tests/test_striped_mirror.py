"""striped's ``mirror``: stripe reads go first to a read-only HTTP cache (the cluster's nginx
tier, here on free loopback ports in front of a real moto S3), verified like origin bytes, and
to the origin on any miss: the mirror down, hung, answering 404/5xx, short, or with altered
bytes. A mirror URL that is not a plain http(s) base is refused naming ``striped.mirror``."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bootseer.config import ConfigError, load_config, storage_options
from bootseer.testing.cluster_cache import anonymous_read_policy, nginx_cache_config
from bootseer.testing.servers import ComponentUnavailable, find_nginx, free_port
from bootseer.testing.shaper import Shaper, ShaperSettings
from striped_fs.config import OptionError, StripeOptions
from striped_fs.urls import url_to_fs

STRIPE = 768 << 10  # stripes straddle the cache's 1 MiB slices
DATA = os.urandom(3 * STRIPE + 12345)  # four stripes, the last one short
STRIPES = 4


# -- components ----------------------------------------------------------------------------------


@pytest.fixture
def origin(s3_server: Any) -> Iterator[Shaper]:
    """A counting proxy in front of moto: what the cache fetched from the origin."""
    proxy = Shaper("127.0.0.1", s3_server.port, ShaperSettings(), "127.0.0.1", 0).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def cache(tmp_path: Path, origin: Shaper) -> Iterator[str]:
    """The cluster's nginx cache tier (its own config) in front of ``origin``: its URL."""
    from conftest import require_component

    try:
        binary = find_nginx()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    prefix = tmp_path / "nginx"
    for sub in ("logs", "tmp", "cache"):
        (prefix / sub).mkdir(parents=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(
        nginx_cache_config(
            prefix, "127.0.0.1", {"s3": ("127.0.0.1", origin.port)}, "1g", ports={"s3": port}
        )
    )
    log = open(prefix / "logs" / "stdout.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [binary, "-c", str(conf), "-p", str(prefix)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"nginx did not start: {(prefix / 'logs' / 'error.log').read_text()}"
                )
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def anonymous_read(s3_server: Any, bucket: str) -> None:
    """The mirror reads unsigned GETs: the bucket's objects readable without a signature, as
    a bucket the cache tier serves must be (docs/decisions.md)."""
    s3_server.admin_client().put_bucket_policy(
        Bucket=bucket,
        Policy=json.dumps(anonymous_read_policy(bucket)),
    )


@pytest.fixture
def striped_file(
    s3_bucket: tuple[str, dict[str, Any]], s3_server: Any
) -> tuple[str, dict[str, Any]]:
    """``DATA`` written as a striped file straight to the origin: (url, s3 options)."""
    bucket, opts = s3_bucket
    anonymous_read(s3_server, bucket)
    url = f"s3://{bucket}/ckpt/data.bin"
    fs, path = url_to_fs(url, {"s3": opts}, stripe_size=STRIPE)
    fs.pipe_file(path, DATA)
    return url, opts


def _reader(url: str, opts: dict[str, Any], mirror: str, **striped: Any) -> tuple[Any, str]:
    return url_to_fs(
        url,
        {"s3": opts, "striped": {"mirror": mirror, "skip_instance_cache": True, **striped}},
    )


def _mirror_logs(caplog: pytest.LogCaptureFixture, cause: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "striped_fs"
        and r.getMessage().startswith("striped mirror")
        and cause in r.getMessage()
    ]


class CraftedMirror:
    """A mirror that serves the origin's objects, altered as ``mode`` says: 'corrupt' (one
    byte flipped), 'short' (the last byte missing), '404', '503'. ``requests`` counts GETs."""

    def __init__(self, objects: dict[str, bytes], mode: str) -> None:
        self.objects, self.mode, self.requests = objects, mode, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.requests += 1
                if outer.mode in ("404", "503"):
                    self.send_response(int(outer.mode))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = outer.objects[self.path]
                lo, hi = map(int, re.match(r"bytes=(\d+)-(\d+)", self.headers["Range"]).groups())
                hi = min(hi, len(data) - 1)
                body = bytearray(data[lo : hi + 1])
                if outer.mode == "corrupt":
                    body[len(body) // 2] ^= 0x01
                elif outer.mode == "short":
                    body = body[:-1]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {lo}-{hi}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(bytes(body))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _stripe_objects(url: str, opts: dict[str, Any]) -> dict[str, bytes]:
    """Every stripe object of the file: ``/bucket/key`` -> its bytes (read from the origin)."""
    import s3fs

    target = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    root = url[len("s3://") :].rpartition("/")[0]
    return {f"/{p}": target.cat_file(p) for p in target.find(f"{root}/.data.bin.stripes")}


# -- through the cache -----------------------------------------------------------------------------


def test_stripes_come_through_the_cache_and_a_second_read_leaves_the_origin_alone(
    striped_file: tuple[str, dict[str, Any]], cache: str, origin: Shaper
) -> None:
    url, opts = striped_file
    fs, path = _reader(url, opts, cache)
    assert fs.cat_file(path) == DATA
    first = fs.backend.mirror.stats()
    assert first == {"reads": STRIPES, "bytes": len(DATA), "origin_bytes": 0, "fallbacks": {}}
    fetched = origin.bytes_down
    assert len(DATA) <= fetched < len(DATA) * 1.1  # one copy (and slices' headers)
    with fs.open(path, "rb") as f:  # the sequential reader (read_object) as well
        assert f.read() == DATA
    assert fs.backend.mirror.stats()["reads"] == 2 * STRIPES
    assert origin.bytes_down == fetched  # every byte the second time came from the cache


def test_a_view_read_through_the_cache_lands_verified(
    striped_file: tuple[str, dict[str, Any]], cache: str
) -> None:
    url, opts = striped_file
    fs, path = _reader(url, opts, cache)
    source = fs._resolve(path, fs.options)
    out = bytearray(len(DATA))
    for i in range(source.piece_count):
        lo, hi = source.piece_range(i)
        source.fetch_into(i, memoryview(out)[lo:hi]).result()
    assert bytes(out) == DATA
    assert fs.backend.mirror.stats()["bytes"] == len(DATA)


def test_a_checkpoint_load_reads_its_stripes_through_the_mirror(
    s3_bucket: tuple[str, dict[str, Any]], s3_server: Any, cache: str, capsys: Any
) -> None:
    """The share of a checkpoint load's bytes that the mirror serves (the lead compares it
    with the benchmark's): the stripes; manifests, metadata and listings go to the origin."""
    import torch

    from ckpt import CheckpointManager

    bucket, opts = s3_bucket
    anonymous_read(s3_server, bucket)
    url = f"s3://{bucket}/run"
    state = {"w": torch.randn(1 << 20), "b": torch.randn(300_000), "step": 7}
    with CheckpointManager(url, storage_options={"s3": opts}, cache_dir=False) as mgr:
        mgr.save(1, state, block=True)
    direct = Shaper("127.0.0.1", s3_server.port, ShaperSettings(), "127.0.0.1", 0).start()
    try:
        node = {
            **opts,
            "client_kwargs": {**opts["client_kwargs"], "endpoint_url": f"http://{direct.address}"},
        }
        options = {"s3": node, "striped": {"mirror": cache, "skip_instance_cache": True}}
        target = {"w": torch.zeros(1 << 20), "b": torch.zeros(300_000), "step": 0}
        with CheckpointManager(url, storage_options=options, cache_dir=False) as mgr:
            assert mgr.load(target) == 1
            stats = mgr.fs.backend.mirror.stats()
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
        share = stats["bytes"] / (stats["bytes"] + direct.bytes_down)
    finally:
        direct.stop()
    with capsys.disabled():
        print(
            f"\ncheckpoint load: {stats['bytes']} bytes through the mirror, "
            f"{direct.bytes_down} from the origin (responses with headers): "
            f"{share:.1%} through the mirror"
        )
    assert stats["fallbacks"] == {} and stats["bytes"] >= 5 << 20
    assert share > 0.8


def _publish_env(tmp_path: Path, url: str, opts: dict[str, Any]) -> tuple[str, dict[str, bytes]]:
    """An environment snapshot (incompressible files, several 256 KiB chunks) published
    straight to the origin: its key and the files."""
    from snapshot.ensure import publish_tree
    from snapshot.key import compute_key
    from snapshot.store import SnapshotStore

    files = {f"lib/m{i}.so": os.urandom(300_000 + i) for i in range(4)}
    src = tmp_path / "built"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    key = compute_key([], ["true", "mirror-test"])
    publish_tree(SnapshotStore(url, {"s3": opts}), key, src, kind="prefix", chunk_size=256 << 10)
    return key.key, files


def _env_options(opts: dict[str, Any], mirror: str) -> dict[str, Any]:
    """The job's storage options, as ``bootseer run`` makes them from its configuration
    (``storage.options`` and ``striped.mirror`` from the environment)."""
    env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": opts}), "BOOTSEER_STRIPED_MIRROR": mirror}
    return storage_options(load_config(env=env))


def _same_files(prefix: Path, files: dict[str, bytes]) -> bool:
    return all((prefix / rel).read_bytes() == data for rel, data in files.items())


def test_an_environment_restore_reads_its_chunks_through_the_cache_once(
    s3_bucket: tuple[str, dict[str, Any]],
    s3_server: Any,
    cache: str,
    origin: Shaper,
    tmp_path: Path,
) -> None:
    """The snapshot's chunks and TOC (named by the manifest's sha256, written once under a
    random publisher directory) come from the tier, each byte from the origin once: a second
    node's restore leaves the origin alone. The manifest goes to the store."""
    from snapshot import restore
    from snapshot.store import SnapshotStore

    bucket, opts = s3_bucket
    anonymous_read(s3_server, bucket)
    url = f"s3://{bucket}/envs"
    key, files = _publish_env(tmp_path, url, opts)
    store = SnapshotStore(url, _env_options(opts, cache))
    manifest = store.require_manifest(key)
    stored = sum(c.size for c in manifest.chunks) + manifest.toc["size"]
    assert len(manifest.chunks) >= 4
    restore(store, key, tmp_path / "node-a")
    assert _same_files(tmp_path / "node-a", files)
    assert store.backend.mirror.stats() == {
        "reads": len(manifest.chunks) + 1,
        "bytes": stored,
        "origin_bytes": 0,
        "fallbacks": {},
    }
    fetched = origin.bytes_down
    assert stored <= fetched < stored * 1.1  # one copy (and the slices' headers)
    restore(SnapshotStore(url, _env_options(opts, cache)), key, tmp_path / "node-b")
    assert _same_files(tmp_path / "node-b", files)
    assert origin.bytes_down == fetched  # the second node's chunks all came from the cache


@pytest.mark.parametrize("mode", ["corrupt", "404"])
def test_environment_chunks_the_cache_alters_are_refused_and_read_from_the_origin(
    s3_bucket: tuple[str, dict[str, Any]],
    s3_server: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """The tier is untrusted: a chunk whose sha256 is not the manifest's (or a miss) is
    read from the store, by a restore and by the lazy mount's fetcher, and the environment
    is the published one."""
    import s3fs

    from snapshot import restore
    from snapshot.lazycache import ChunkCache
    from snapshot.lazyfetch import ChunkFetcher
    from snapshot.store import SnapshotStore

    bucket, opts = s3_bucket
    anonymous_read(s3_server, bucket)
    url = f"s3://{bucket}/envs"
    key, files = _publish_env(tmp_path, url, opts)
    target = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    objects = {f"/{p}": target.cat_file(p) for p in target.find(f"{bucket}/envs/{key}")}
    mirror = CraftedMirror(objects, mode)
    caplog.set_level(logging.WARNING, "striped_fs")
    try:
        store = SnapshotStore(url, _env_options(opts, mirror.url))
        manifest = store.require_manifest(key)
        restore(store, key, tmp_path / "restored")
        assert _same_files(tmp_path / "restored", files)
        fetcher = ChunkFetcher(store, manifest, ChunkCache(tmp_path / "lazy-cache"))
        try:
            got = b"".join(bytes(fetcher.chunk(i)) for i in range(len(manifest.chunks)))
        finally:
            fetcher.close()
        assert fetcher.stats.corrupt == 0 and fetcher.stats.failures == 0
        with tarfile.open(fileobj=io.BytesIO(got)) as tar:  # the chunks: the tar stream
            served = {m.name.lstrip("./"): tar.extractfile(m).read() for m in tar if m.isfile()}
        assert served == files
    finally:
        mirror.close()
    reads = 2 * len(manifest.chunks) + 1  # restore: chunks and TOC; the fetcher: chunks
    stats = store.backend.mirror.stats()
    cause = "failed verification" if mode == "corrupt" else "status 404"
    assert mirror.requests == reads
    assert stats["reads"] == 0 and stats["fallbacks"] == {cause: reads}
    logged = _mirror_logs(caplog, cause)
    assert len(logged) == 1, logged
    if mode == "corrupt":
        assert "sha256" in logged[0] and "the manifest says" in logged[0]


# -- a mirror that fails -----------------------------------------------------------------------------


def test_a_mirror_that_is_down_sends_reads_to_the_origin_logged_once(
    striped_file: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    url, opts = striped_file
    closed = f"http://127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, "striped_fs")
    fs, path = _reader(url, opts, closed)
    assert fs.cat_file(path) == DATA
    stats = fs.backend.mirror.stats()
    assert stats["reads"] == 0 and stats["origin_bytes"] == len(DATA)
    assert stats["fallbacks"]["unreachable"] >= 1
    assert sum(stats["fallbacks"].values()) == STRIPES
    assert set(stats["fallbacks"]) <= {"unreachable", "skipped (mirror down)"}
    logged = _mirror_logs(caplog, "unreachable")
    assert len(logged) == 1 and closed in logged[0] and "read from the origin" in logged[0]
    assert fs.cat_file(path) == DATA  # inside the pause: straight to the origin
    assert fs.backend.mirror.stats()["fallbacks"]["skipped (mirror down)"] >= STRIPES
    assert len(_mirror_logs(caplog, "unreachable")) == 1


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("corrupt", "failed verification"),
        ("short", "short read"),
        ("404", "status 404"),
        ("503", "status 5xx"),
    ],
)
def test_a_mirror_answering_wrong_is_refused_and_the_origin_read(
    striped_file: tuple[str, dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
    mode: str,
    cause: str,
) -> None:
    url, opts = striped_file
    mirror = CraftedMirror(_stripe_objects(url, opts), mode)
    caplog.set_level(logging.WARNING, "striped_fs")
    try:
        fs, path = _reader(url, opts, mirror.url)
        assert fs.cat_file(path) == DATA  # sequential reads, with a read limit
        source = fs._resolve(path, fs.options)
        out = bytearray(len(DATA))  # reads into a view: exact ranges
        for i in range(source.piece_count):
            lo, hi = source.piece_range(i)
            source.fetch_into(i, memoryview(out)[lo:hi]).result()
        assert bytes(out) == DATA
    finally:
        mirror.close()
    stats = fs.backend.mirror.stats()
    assert mirror.requests == 2 * STRIPES
    assert stats["reads"] == 0 and stats["origin_bytes"] == 2 * len(DATA)
    if mode == "short":  # a short answer to a read limit is the verifier's to find
        assert stats["fallbacks"] == {"failed verification": STRIPES, "short read": STRIPES}
    else:
        assert stats["fallbacks"] == {cause: 2 * STRIPES}
    logged = _mirror_logs(caplog, cause)
    assert len(logged) == 1, logged
    if mode == "corrupt":
        assert "crc32" in logged[0] and "manifest says" in logged[0]


def test_a_hung_mirror_times_out_to_the_origin_then_is_skipped(
    striped_file: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    url, opts = striped_file
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])  # accepted, never answered

    threading.Thread(target=accept, daemon=True).start()
    caplog.set_level(logging.WARNING, "striped_fs")
    try:
        hung = f"http://127.0.0.1:{listener.getsockname()[1]}"
        fs, path = _reader(url, opts, hung, mirror_timeout_s=0.5)
        t = time.monotonic()
        assert fs.cat_file(path) == DATA
        assert 0.5 <= time.monotonic() - t < 5.0
        assert fs.backend.mirror.stats()["fallbacks"].get("timeout", 0) >= 1
        assert len(_mirror_logs(caplog, "timeout")) == 1
        t = time.monotonic()
        assert fs.cat_file(path) == DATA
        assert time.monotonic() - t < 0.5  # skipped while it is down: no second timeout
        assert fs.backend.mirror.stats()["fallbacks"]["skipped (mirror down)"] >= STRIPES
    finally:
        listener.close()
        for conn in held:
            conn.close()


# -- the option ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://10.0.0.5:9000/?X-Amz-Signature=1", "s3://10.0.0.5:9000", "ftp://cache", "cache:9000"],
)
def test_a_mirror_url_that_is_no_plain_http_base_is_refused_naming_the_key(url: str) -> None:
    with pytest.raises(OptionError, match=r"striped\.mirror"):
        StripeOptions.resolve(mirror=url)
    with pytest.raises(ConfigError, match=r"striped\.mirror \(env BOOTSEER_STRIPED_MIRROR\)"):
        storage_options(load_config(env={"BOOTSEER_STRIPED_MIRROR": url}))


def test_the_config_key_is_merged_into_the_storage_options() -> None:
    env = {
        "BOOTSEER_STRIPED_MIRROR": "http://10.0.0.5:9000/",
        "BOOTSEER_STORAGE_OPTIONS": '{"s3": {"anon": false}, "striped": {"concurrency": 8}}',
    }
    assert storage_options(load_config(env=env)) == {
        "s3": {"anon": False},
        "striped": {"concurrency": 8, "mirror": "http://10.0.0.5:9000"},
    }
    assert storage_options(load_config(env={})) == {}
    clash = {**env, "BOOTSEER_STORAGE_OPTIONS": '{"striped": {"mirror": "http://other:9000"}}'}
    with pytest.raises(ConfigError, match="give the mirror in one place"):
        storage_options(load_config(env=clash))


def test_the_mirror_is_the_filesystems_not_a_calls(
    striped_file: tuple[str, dict[str, Any]],
) -> None:
    url, opts = striped_file
    fs, path = _reader(url, opts, "http://127.0.0.1:9")
    with pytest.raises(OptionError, match="belong to the filesystem"):
        fs.cat_file(path, mirror="http://127.0.0.1:10")


def test_a_local_target_ignores_the_mirror(tmp_path: Path) -> None:
    fs, path = url_to_fs(str(tmp_path / "f"), {"striped": {"mirror": "http://127.0.0.1:9"}})
    fs.pipe_file(path, DATA)
    assert fs.backend.mirror is None and fs.cat_file(path) == DATA
