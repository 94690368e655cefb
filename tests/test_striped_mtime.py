"""``StripedFileSystem.set_mtime``: a new manifest naming the same stripes, in one atomic
step, that never undoes a writer committing meanwhile; plain files and directories where the
target has a time to set (local disk), a clear EOPNOTSUPP where it has none.

Over local disk, fsspec's memory store and S3 (moto)."""

from __future__ import annotations

import datetime
import errno
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from striped_fs import StripedFileSystem, mtime
from striped_fs.layout import MAGIC, Manifest, stripes_dir
from striped_fs.mtime import ATTEMPTS, mtime_ns_of

KiB = 1 << 10
OLD_NS = 1_000_000_000_123_456_789  # nanoseconds a float of seconds cannot hold


@pytest.fixture(params=["file", "memory", "s3"])
def target(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[StripedFileSystem, str]]:
    """A striped filesystem with 4 KiB stripes and a root directory on it."""
    opts: dict[str, Any] = {
        "stripe_size": 4 * KiB,
        "concurrency": 4,
        "retries": 1,
        "backoff_s": 0.01,
        "skip_instance_cache": True,
    }
    if request.param == "file":
        yield StripedFileSystem(target_protocol="file", **opts), str(tmp_path)
    elif request.param == "memory":
        fs = StripedFileSystem(target_protocol="memory", **opts)
        root = f"/mtime-{tmp_path.name}"
        fs.target.mkdir(root)
        yield fs, root
        fs.target.rm(root, recursive=True)
    else:
        bucket, s3_options = request.getfixturevalue("s3_bucket")
        yield StripedFileSystem(target_protocol="s3", target_options=s3_options, **opts), bucket


def _stripes(fs: StripedFileSystem, path: str) -> dict[str, bytes]:
    return {p: fs.target.cat_file(p) for p in sorted(fs.target.find(stripes_dir(path)))}


def _manifest(fs: StripedFileSystem, path: str) -> Manifest:
    return Manifest.from_bytes(fs.target.cat_file(path), path=path)


def test_set_mtime_replaces_the_manifest_and_no_stripe(
    target: tuple[StripedFileSystem, str],
) -> None:
    fs, root = target
    path = f"{root}/f.bin"
    data = random.Random(1).randbytes(10 * KiB + 3)
    fs.pipe_file(path, data)
    before, stripes = _manifest(fs, path), _stripes(fs, path)
    assert before.mtime_ns is None and b'"format":1,' in fs.target.cat_file(path)

    fs.set_mtime(path, OLD_NS)
    after = _manifest(fs, path)
    assert (after.version, after.checksums, after.size) == (
        before.version,
        before.checksums,
        before.size,
    )
    assert after.mtime_ns == OLD_NS and b'"format":2,' in fs.target.cat_file(path)
    assert _stripes(fs, path) == stripes
    assert fs.cat_file(path) == data
    info = fs.info(path)
    assert info["mtime_ns"] == OLD_NS and info["size"] == len(data)
    assert [e["mtime_ns"] for e in fs.ls(root) if e["name"].endswith("f.bin")] == [OLD_NS]
    assert fs.modified(path) == datetime.datetime.fromtimestamp(OLD_NS / 1e9, tz=datetime.UTC)

    fs.set_mtime(path, -5)  # before the epoch is a time too
    assert fs.info(path)["mtime_ns"] == -5

    fs.pipe_file(f"{root}/empty", b"")
    fs.set_mtime(f"{root}/empty", OLD_NS)
    assert fs.info(f"{root}/empty")["mtime_ns"] == OLD_NS and fs.cat_file(f"{root}/empty") == b""


def test_mv_keeps_the_mtime(target: tuple[StripedFileSystem, str]) -> None:
    """rsync writes a temporary name, sets its time, renames it over the real one."""
    fs, root = target
    fs.pipe_file(f"{root}/.a.tmp", b"x" * 9000)
    fs.set_mtime(f"{root}/.a.tmp", OLD_NS)
    fs.mv(f"{root}/.a.tmp", f"{root}/a")
    assert fs.info(f"{root}/a")["mtime_ns"] == OLD_NS and fs.cat_file(f"{root}/a") == b"x" * 9000

    fs.pipe_file(f"{root}/b", b"never touched")  # its mtime is the commit's; a rename keeps it
    implicit = fs.info(f"{root}/b")
    fs.mv(f"{root}/b", f"{root}/c")
    moved = fs.info(f"{root}/c")["mtime_ns"]
    assert moved == mtime_ns_of(implicit)


def test_a_reader_of_the_old_manifest_reads_the_same_bytes(
    target: tuple[StripedFileSystem, str],
) -> None:
    """Readers racing with mtime updates: every read returns the file's bytes, whichever
    manifest it resolved."""
    fs, root = target
    path = f"{root}/f.bin"
    data = random.Random(2).randbytes(40 * KiB + 1)
    fs.pipe_file(path, data)
    with fs.open(path, "rb") as early:
        fs.set_mtime(path, OLD_NS)
        assert early.read() == data

    stop = threading.Event()
    errors: list[BaseException] = []

    def touch_loop() -> None:
        t = OLD_NS
        try:
            while not stop.is_set():
                t += 1
                fs.set_mtime(path, t)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    toucher = threading.Thread(target=touch_loop)
    toucher.start()
    try:
        for _ in range(30):
            assert fs.cat_file(path) == data
            with fs.open(path, "rb") as f:
                assert f.read() == data
    finally:
        stop.set()
        toucher.join(60)
    assert not errors, errors
    assert _manifest(fs, path).mtime_ns > OLD_NS


def _commit_during_read(monkeypatch: pytest.MonkeyPatch, path: str, writes: list[bytes]) -> None:
    """Each time set_mtime has read the manifest and is about to replace it, another writer
    commits ``writes[i]`` first."""
    replace = mtime._replace_if_unchanged

    def commit_then_replace(fs: StripedFileSystem, p: str, *args: Any) -> bool:
        if p == path and writes:
            fs.pipe_file(path, writes.pop(0))
        return replace(fs, p, *args)

    monkeypatch.setattr(mtime, "_replace_if_unchanged", commit_then_replace)


def test_a_writer_committing_meanwhile_is_not_undone(
    target: tuple[StripedFileSystem, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """set_mtime reads the manifest, then a writer commits a new version (and deletes the
    old version's stripes): putting the old manifest back would lose that write and point
    the file at deleted stripes. It is noticed (S3 If-Match, the local inode, a re-read), and
    the time is set on the new version."""
    fs, root = target
    path = f"{root}/f.bin"
    fs.pipe_file(path, b"old" * 5000)
    new = random.Random(3).randbytes(20 * KiB)
    _commit_during_read(monkeypatch, path, [new])
    fs.set_mtime(path, OLD_NS)
    assert fs.cat_file(path) == new
    after = _manifest(fs, path)
    assert after.mtime_ns == OLD_NS and after.size == len(new)


def test_a_file_replaced_on_every_attempt_is_an_error_and_kept(
    target: tuple[StripedFileSystem, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, root = target
    path = f"{root}/f.bin"
    fs.pipe_file(path, b"v0")
    versions = [f"v{i}".encode() * 3000 for i in range(1, ATTEMPTS + 1)]
    _commit_during_read(monkeypatch, path, list(versions))
    with pytest.raises(OSError) as err:
        fs.set_mtime(path, OLD_NS)
    assert err.value.errno == errno.EBUSY
    assert path in str(err.value) and "try again" in str(err.value)
    assert fs.cat_file(path) == versions[-1] and _manifest(fs, path).mtime_ns is None


def test_plain_files_and_directories(target: tuple[StripedFileSystem, str]) -> None:
    """A local disk sets any file's or directory's time (os.utime); an object store or the
    memory store has none to set for a plain object or a directory: EOPNOTSUPP naming it and,
    for a file, what to do. Nothing is changed."""
    fs, root = target
    plain = f"{root}/plain.txt"
    fs.target.pipe_file(plain, b"not striped")
    fs.target.makedirs(f"{root}/dir", exist_ok=True)
    fs.target.pipe_file(f"{root}/dir/inside", b"x")
    if fs.backend.is_local:
        fs.set_mtime(plain, OLD_NS)
        fs.set_mtime(f"{root}/dir", OLD_NS + 1)
        assert os.stat(plain).st_mtime_ns == OLD_NS
        assert os.stat(f"{root}/dir").st_mtime_ns == OLD_NS + 1
    else:
        with pytest.raises(OSError) as err:
            fs.set_mtime(plain, OLD_NS)
        assert err.value.errno == errno.EOPNOTSUPP
        assert plain in str(err.value) and "bootseer fs cp" in str(err.value)
        with pytest.raises(OSError) as err:
            fs.set_mtime(f"{root}/dir", OLD_NS)
        assert err.value.errno == errno.EOPNOTSUPP and "directory" in str(err.value)
    assert fs.target.cat_file(plain) == b"not striped"
    assert not fs.target.cat_file(plain).startswith(MAGIC)
    with pytest.raises(FileNotFoundError):
        fs.set_mtime(f"{root}/missing", OLD_NS)
