"""striped_fs against real servers: S3 (moto server over HTTP) and nginx (HTTP Range)."""

from __future__ import annotations

import random
import threading

import fsspec
import pytest

from bootseer.testing.shaper import Shaper, ShaperSettings
from striped_fs import StripedFileSystem, StripedIOError
from striped_fs.layout import MAGIC, stripes_dir

STRIPE = 256 * 1024


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def s3_striped(s3_bucket):
    bucket, options = s3_bucket
    fs = StripedFileSystem(
        target_protocol="s3",
        target_options={**options, "skip_instance_cache": True},
        stripe_size=STRIPE,
        concurrency=8,
        skip_instance_cache=True,
    )
    yield fs, bucket
    fs.close()


@pytest.fixture
def http_site(tmp_path, nginx_factory):
    root = tmp_path / "site"
    root.mkdir()
    data = payload(5 * STRIPE + 4321, 11)
    (root / "model.bin").write_bytes(data)
    (root / "small.txt").write_bytes(b"hello")
    server = nginx_factory(root)
    return server, data


# -- S3 ------------------------------------------------------------------------------------


def test_s3_roundtrip_uses_striped_layout(s3_striped):
    fs, bucket = s3_striped
    data = payload(7 * STRIPE + 3)
    fs.pipe_file(f"{bucket}/ckpt/model.bin", data)
    assert fs.cat_file(f"{bucket}/ckpt/model.bin") == data
    assert fs.info(f"{bucket}/ckpt/model.bin")["size"] == len(data)
    keys = fs.target.find(f"{bucket}/ckpt")
    assert len(keys) == 8 + 1  # 8 stripe objects + the manifest
    assert fs.target.cat_file(f"{bucket}/ckpt/model.bin").startswith(MAGIC)
    assert fs.ls(f"{bucket}/ckpt", detail=False) == [f"{bucket}/ckpt/model.bin"]


def test_s3_makedirs_under_a_bucket_never_creates_the_bucket(s3_server, s3_striped):
    """No directories exist under an S3 bucket: makedirs(bucket/key, exist_ok=True) does
    nothing. s3fs would create the bucket whenever it cannot see it (right after a store
    outage a pooled connection fails its check: the soak's checkpoint save then failed on
    CreateBucket); a bucket that is really missing fails the write itself, by name."""
    import botocore.exceptions

    fs, bucket = s3_striped
    fs.makedirs(f"{bucket}/run/step-00000001", exist_ok=True)
    missing = f"{bucket}-missing"
    fs.makedirs(f"{missing}/run/step-00000001", exist_ok=True)
    with pytest.raises(botocore.exceptions.ClientError, match="NoSuchBucket|Not Found|404"):
        s3_server.boto3_client().head_bucket(Bucket=missing)
    with pytest.raises((FileNotFoundError, StripedIOError)):
        fs.pipe_file(f"{missing}/run/step-00000001/data", b"x" * 10)
    fs.pipe_file(f"{bucket}/run/step-00000001/data", b"y" * 10)
    assert fs.cat_file(f"{bucket}/run/step-00000001/data") == b"y" * 10


def test_s3_fsspec_url_chaining(s3_bucket):
    bucket, options = s3_bucket
    url = f"striped::s3://{bucket}/x/data.bin"
    data = payload(3 * STRIPE + 1, 5)
    with fsspec.open(url, "wb", s3=options, striped={"stripe_size": STRIPE}) as f:
        f.write(data)
    with fsspec.open(url, "rb", s3=options) as f:
        assert f.read() == data
    fs, path = fsspec.core.url_to_fs(url, s3=options)
    assert isinstance(fs, StripedFileSystem) and path == f"{bucket}/x/data.bin"


def test_s3_plain_object_read_striped(s3_striped):
    fs, bucket = s3_striped
    data = payload(6 * STRIPE + 17, 3)
    fs.target.pipe_file(f"{bucket}/plain.bin", data)
    assert fs.cat_file(f"{bucket}/plain.bin") == data
    with fs.open(f"{bucket}/plain.bin") as f:
        f.seek(STRIPE * 2 + 5)
        assert f.read(STRIPE) == data[STRIPE * 2 + 5 : STRIPE * 3 + 5]


def test_s3_rm_mv_as_one_file(s3_striped):
    fs, bucket = s3_striped
    data = payload(3 * STRIPE)
    fs.pipe_file(f"{bucket}/a", data)
    fs.mv(f"{bucket}/a", f"{bucket}/b")
    assert not fs.exists(f"{bucket}/a")
    assert fs.target.find(stripes_dir(f"{bucket}/a")) == []
    assert fs.cat_file(f"{bucket}/b") == data
    fs.rm(f"{bucket}/b")
    assert fs.target.find(bucket) == []


def test_s3_concurrent_writers_leave_one_complete_version(s3_striped):
    fs, bucket = s3_striped
    datas = [payload(4 * STRIPE + i, 100 + i) for i in range(4)]
    errors = []

    def write(i):
        try:
            fs.pipe_file(f"{bucket}/same", datas[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fs.cat_file(f"{bucket}/same") in datas
    fs.gc(bucket, older_than_s=0)
    versions = fs.target.ls(stripes_dir(f"{bucket}/same"), detail=False)
    assert len(versions) == 1


# -- HTTP (nginx) --------------------------------------------------------------------------


def test_http_ranged_parallel_reads(http_site):
    server, data = http_site
    url = f"striped::{server.url}/model.bin"
    fs, path = fsspec.core.url_to_fs(url, striped={"stripe_size": STRIPE, "concurrency": 4})
    assert fs.info(path)["size"] == len(data)
    assert fs.cat_file(path) == data
    assert fs.cat_file(path, STRIPE - 10, 3 * STRIPE + 10) == data[STRIPE - 10 : 3 * STRIPE + 10]
    with fs.open(path) as f:
        f.seek(len(data) - 100)
        assert f.read() == data[-100:]
    assert fs.cat_file(f"{server.url}/small.txt") == b"hello"


def test_http_info_of_a_page_without_a_size_does_not_fail(http_site):
    """nginx's directory listing has no Content-Length; info (and so a FUSE ``ls``) works."""
    server, _ = http_site
    fs = StripedFileSystem(target_protocol="http", skip_instance_cache=True)
    info = fs.info(f"{server.url}/")
    assert info.get("size") is None and "striped" not in info


def test_http_is_read_only(http_site):
    server, _ = http_site
    fs, path = fsspec.core.url_to_fs(f"striped::{server.url}/new.bin")
    with pytest.raises(PermissionError, match="read-only"):
        fs.open(path, "wb")


# -- faults, injected in the shaper ----------------------------------------------------------


def _shaped_http(server) -> Shaper:
    return Shaper("127.0.0.1", server.port, ShaperSettings())


def test_dropped_connection_mid_stripe_is_retried(http_site, caplog):
    server, data = http_site
    with _shaped_http(server) as shaper:
        shaper.drop_after(STRIPE // 2, count=3)
        fs = StripedFileSystem(
            target_protocol="http",
            stripe_size=STRIPE,
            concurrency=4,
            backoff_s=0.01,
            skip_instance_cache=True,
        )
        url = f"http://{shaper.address}/model.bin"
        assert fs.cat_file(url) == data
    assert "retrying" in caplog.text


def test_permanent_failure_names_path_and_stripe(http_site):
    server, data = http_site
    with _shaped_http(server) as shaper:
        fs = StripedFileSystem(
            target_protocol="http",
            stripe_size=STRIPE,
            concurrency=2,
            retries=2,
            backoff_s=0.01,
            skip_instance_cache=True,
        )
        url = f"http://{shaper.address}/model.bin"
        reader = fs.open(url)  # size known before the link fails
        shaper.drop_active()
        shaper.set_refuse(True)
        with pytest.raises(StripedIOError) as err:
            reader.read()
        assert "model.bin" in str(err.value) and "stripe 0" in str(err.value)
        assert "after 3 attempt(s)" in str(err.value)
        shaper.set_refuse(False)
        reader.seek(0)
        assert reader.read() == data  # the link is back: the same reader works again


def _striped_s3_via(shaper: Shaper, s3_server, **options) -> StripedFileSystem:
    """A striped filesystem on the S3 server, reached through the shaper (faults go there)."""
    opts = s3_server.storage_options(endpoint_url=f"http://{shaper.address}")
    return StripedFileSystem(
        target_protocol="s3",
        target_options={**opts, "skip_instance_cache": True},
        stripe_size=STRIPE,
        skip_instance_cache=True,
        **options,
    )


def test_s3_transient_outage_during_write_is_retried(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    with Shaper("127.0.0.1", s3_server.port, ShaperSettings()) as shaper:
        fs = _striped_s3_via(shaper, s3_server, concurrency=4, retries=6, backoff_s=0.1)
        data = payload(6 * STRIPE, 21)
        with fs.open(f"{bucket}/w.bin", "wb") as f:
            f.write(data[: 2 * STRIPE])
            shaper.set_refuse(True)
            shaper.drop_active()
            timer = threading.Timer(0.4, shaper.set_refuse, args=(False,))
            timer.start()
            f.write(data[2 * STRIPE :])
        timer.join()
        assert fs.cat_file(f"{bucket}/w.bin") == data


def test_s3_permanent_outage_during_write_raises_and_commits_nothing(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    with Shaper("127.0.0.1", s3_server.port, ShaperSettings()) as shaper:
        fs = _striped_s3_via(shaper, s3_server, concurrency=2, retries=2, backoff_s=0.01)
        shaper.set_refuse(True)
        with pytest.raises(StripedIOError) as err:
            with fs.open(f"{bucket}/w.bin", "wb") as f:
                f.write(payload(3 * STRIPE))
        assert "w.bin" in str(err.value) and "stripe" in str(err.value)
        shaper.set_refuse(False)
        assert not fs.exists(f"{bucket}/w.bin")
