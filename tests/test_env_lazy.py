"""Lazy environments: a snapshot served by a real FUSE mount (``snapshot.lazy``), against a
local store and moto's S3 in server mode.

* the mounted tree equals a full restore path by path (kind, mode, size, content, mtime, link
  target, hardlinks), and a real venv runs from it;
* the read profile records first reads in order, the next mount fetches them first, and a
  forged profile is ignored (it could only reorder fetches anyway);
* a flipped byte in a stored chunk is EIO (fetched twice, never served), a damaged cache file
  is fetched again; the store lost mid-read is EIO within the read timeout, not a hang;
* kill -9 of the mount process leaves a dead mount that ``bootseer env unmount`` and the next
  mount clear; crafted members (traversal, absolute, huge sizes, devices) refuse the mount.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fuse_helpers import abort_connection
from snapshot_helpers import (
    MTIME_NS,
    StoreUnderTest,
    assert_env_works,
    ensure_env,
    make_store,
    publish_crafted,
    scan,
    tar_stream,
    tree_differences,
    use_test_index,
    write_requirements,
)

from snapshot import SnapshotError, SnapshotStore, mount_lazy, mounted_key, unmount_lazy
from snapshot.ensure import publish
from snapshot.key import EnvKey
from snapshot.lazy import LazyMount
from snapshot.lazyprofile import PROFILE_NAME
from snapshot.lazyview import LazyView
from snapshot.manifest import Member
from snapshot.restore import fetch_toc, restore
from striped_fs.fuse import is_mounted

pytestmark = pytest.mark.usefixtures("fuse")

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64 << 10


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def mounts() -> Iterator[list[LazyMount]]:
    """Every mount a test makes is unmounted at teardown, whatever state it is in."""
    made: list[LazyMount] = []
    yield made
    for m in made:
        try:
            m.close(timeout_s=10)
        except Exception:  # noqa: BLE001 - teardown: never mask the test's outcome
            pass
        if is_mounted(m.prefix):
            subprocess.run(["fusermount", "-u", "-z", m.prefix], capture_output=True, check=False)
        assert not is_mounted(m.prefix), f"stale mount left at {m.prefix}"


def bounded(prefix: str, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Run I/O on a mount with a deadline: a hung mount fails the test, never hangs it."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        abort_connection(Path(prefix))
        thread.join(10)
        pytest.fail(f"I/O on {prefix} did not finish within {timeout}s")
    box["seconds"] = time.monotonic() - started
    if "error" in box:
        raise box["error"]
    return box.get("value")


def errno_of(fn: Callable[[], Any]) -> int | None:
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return None


def make_tree(root: Path) -> None:
    """Files of many sizes and modes (one larger than several chunks), symlinks (relative,
    absolute, dangling), a hardlink group, a 0700 directory, a setuid file, odd names."""
    (root / "lib/pkg/sub").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "private").mkdir(mode=0o700)
    os.chmod(root / "private", 0o700)
    (root / "lib/pkg/__init__.py").write_text("VALUE = 42\n")
    (root / "lib/pkg/big.so").write_bytes(os.urandom(5 * CHUNK + 123))
    (root / "lib/pkg/sub/data.bin").write_bytes(bytes(range(256)) * 1000)
    (root / "lib/pkg/empty").write_bytes(b"")
    (root / "lib/pkg/ünïcode name.txt").write_text("odd\n")
    (root / "private/secret").write_text("s\n")
    os.chmod(root / "private/secret", 0o600)
    (root / "bin/tool").write_text("#!/bin/sh\necho tool-ok\n")
    os.chmod(root / "bin/tool", 0o755)
    (root / "bin/setuid").write_text("x\n")
    os.chmod(root / "bin/setuid", 0o4755)
    os.symlink("../lib/pkg/__init__.py", root / "bin/rel")
    os.symlink("/usr/bin/env", root / "bin/abs")
    os.symlink("nowhere", root / "bin/dangling")
    os.link(root / "lib/pkg/__init__.py", root / "lib/pkg/hard.py")
    for i in range(10):
        (root / f"lib/pkg/mod{i}.py").write_bytes(bytes([65 + i]) * (CHUNK - 900))


def published(store: SnapshotStore, tmp_path: Path, *, chunk_size: int = CHUNK) -> str:
    src = tmp_path / "src"
    make_tree(src)
    key = uuid.uuid4().hex
    publish(store, EnvKey(key, {}), src, chunk_size=chunk_size)
    return key


def mount(
    mounts: list[LazyMount], sut: StoreUnderTest, key: str, prefix: Path, cache: Path, **kw: Any
) -> LazyMount:
    m = mount_lazy(
        sut.url, key, prefix, cache_dir=cache, storage_options=sut.storage_options or None, **kw
    )
    mounts.append(m)
    return m


def view_of(store: SnapshotStore, key: str) -> LazyView:
    manifest = store.require_manifest(key)
    return LazyView(manifest, fetch_toc(store, manifest))


# -- correctness --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_the_mounted_tree_equals_a_full_restore(kind, tmp_path, request, mounts):
    sut = make_store(kind, tmp_path, request)
    store = sut.open()
    key = published(store, tmp_path)
    restore(store, key, tmp_path / "restored")
    m = mount(mounts, sut, key, tmp_path / "lazy", tmp_path / "cache", prefetch=False)
    full = scan(tmp_path / "restored")
    lazy = bounded(m.prefix, lambda: scan(tmp_path / "lazy"))
    assert tree_differences(full, lazy) == []
    assert lazy["bin/setuid"].mode == 0o755  # stripped, as a restore strips it
    assert lazy["private"].mode == 0o700 and lazy["private/secret"].mode == 0o600
    out = subprocess.run([f"{m.prefix}/bin/tool"], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "tool-ok"
    assert errno_of(lambda: open(f"{m.prefix}/new", "w")) in (errno.EROFS, errno.EACCES)
    assert mounted_key(m.prefix) == key[:16]
    stats = m.close()
    assert mounted_key(m.prefix) is None
    assert stats["unmounted"] and stats["failures"] == 0
    assert stats["bytes_served"] >= lazy["lib/pkg/big.so"].size  # every file was read
    assert not is_mounted(m.prefix)


def test_a_real_environment_runs_from_the_lazy_mount(
    tmp_path, monkeypatch, package_index, request, mounts
):
    """ensure builds and publishes a venv at P; P is removed; the snapshot mounted lazily at P
    runs its console script and imports its packages."""
    use_test_index(monkeypatch)
    sut = make_store("s3", tmp_path, request)
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    prefix = tmp_path / "venv"
    built = ensure_env(prefix, sut, [req])
    assert built.outcome == "built"
    shutil.rmtree(prefix)
    m = mount(mounts, sut, built.key, prefix, tmp_path / "cache", prefetch=False)
    bounded(m.prefix, lambda: assert_env_works(prefix))
    assert m.close()["chunks_read"] >= 1


# -- the read profile ---------------------------------------------------------------------------


def test_the_profile_records_first_reads_in_order_and_is_fetched_first_next(
    tmp_path, request, mounts
):
    sut = make_store("local", tmp_path, request)
    store = sut.open()
    key = published(store, tmp_path)
    view = view_of(store, key)
    order = ["lib/pkg/mod7.py", "lib/pkg/mod2.py", "lib/pkg/mod5.py"]
    expected: list[int] = []
    for path in order:
        for i in view.file_chunks(view.nodes[path]):
            if i not in expected:
                expected.append(i)
    m = mount(mounts, sut, key, tmp_path / "lazy", tmp_path / "cache1", prefetch=False)
    for path in order:
        bounded(m.prefix, lambda p=path: (Path(m.prefix) / p).read_bytes())
    first = m.close()
    assert first["recording"] and first["profile_saved"]["chunks"] == len(expected)
    profile = json.loads(store.fetch(key, PROFILE_NAME).result())
    assert [i for i, _ in profile["chunks"]] == expected
    assert [sha for _, sha in profile["chunks"]] == [
        view.manifest.chunks[i].sha256 for i in expected
    ]

    # The next start (a fresh node: an empty cache) fetches the profile's chunks first.
    m = mount(mounts, sut, key, tmp_path / "lazy", tmp_path / "cache2", connections=1)
    assert m.wait_complete(30)
    stats = m.close()
    assert not stats["recording"]  # a profile was there: not replaced
    assert stats["profile"]["chunks"] == len(expected)
    assert stats["fetch_order"][: len(expected)] == expected
    # Then every other chunk once (chunks of equal bytes are one cache entry: fetched once).
    chunks = view.manifest.chunks
    assert len(set(stats["fetch_order"])) == len(stats["fetch_order"])
    assert {chunks[i].sha256 for i in stats["fetch_order"]} == {c.sha256 for c in chunks}
    assert stats["complete"]


@pytest.mark.parametrize(
    "case",
    ["not-json", "other-key", "index-out-of-range", "wrong-sha256", "duplicate", "too-large"],
)
def test_a_forged_profile_is_ignored(case, tmp_path, request, mounts):
    sut = make_store("local", tmp_path, request)
    store = sut.open()
    key = published(store, tmp_path)
    manifest = store.require_manifest(key)
    first = [0, manifest.chunks[0].sha256]
    doc: Any = {"format": "bootseer-env-profile/1", "key": key, "chunks": [first]}
    if case == "other-key":
        doc["key"] = "ff" * 20
    elif case == "index-out-of-range":
        doc["chunks"] = [[len(manifest.chunks), manifest.chunks[0].sha256]]
    elif case == "wrong-sha256":
        doc["chunks"] = [[1, manifest.chunks[0].sha256]]
    elif case == "duplicate":
        doc["chunks"] = [first, first]
    raw = b"{not json" if case == "not-json" else json.dumps(doc).encode()
    if case == "too-large":
        raw = json.dumps({**doc, "pad": "x" * (5 << 20)}).encode()
    store.put(key, PROFILE_NAME, raw).result()
    m = mount(mounts, sut, key, tmp_path / "lazy", tmp_path / "cache", record="never")
    data = bounded(m.prefix, lambda: (Path(m.prefix) / "lib/pkg/big.so").read_bytes())
    assert data == (tmp_path / "src/lib/pkg/big.so").read_bytes()
    assert m.wait_complete(30)
    assert m.close()["profile"] is None


# -- faults -------------------------------------------------------------------------------------


def _flip(path: Path, at: int) -> bytes:
    data = path.read_bytes()
    path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    return data


def test_a_flipped_byte_in_a_stored_chunk_is_eio_never_wrong_bytes(tmp_path, request, mounts):
    sut = make_store("local", tmp_path, request)
    store = sut.open()
    key = published(store, tmp_path)
    view = view_of(store, key)
    target = view.nodes["lib/pkg/mod3.py"]
    (i,) = view.file_chunks(target)
    chunk = view.manifest.chunks[i]
    object_path = Path(store.path(key, chunk.name))
    original = _flip(object_path, chunk.size // 2)
    m = mount(mounts, sut, key, tmp_path / "lazy", tmp_path / "cache", prefetch=False)
    victim = Path(m.prefix) / "lib/pkg/mod3.py"
    for _ in range(2):  # every read is EIO: nothing of the chunk is ever served
        assert bounded(m.prefix, lambda: errno_of(victim.read_bytes)) == errno.EIO
    good = bounded(m.prefix, lambda: (Path(m.prefix) / "lib/pkg/mod4.py").read_bytes())
    assert good == (tmp_path / "src/lib/pkg/mod4.py").read_bytes()
    assert not (tmp_path / "cache/chunks" / chunk.sha256[:2] / chunk.sha256).exists()
    object_path.write_bytes(original)  # the store repaired: the next read fetches again
    assert bounded(m.prefix, victim.read_bytes) == (tmp_path / "src/lib/pkg/mod3.py").read_bytes()
    stats = m.close()
    assert stats["corrupt"] >= 4  # each failed read fetched the chunk twice
    assert stats["failures"] >= 2


def test_a_damaged_cache_file_is_fetched_again(tmp_path, request, mounts):
    sut = make_store("local", tmp_path, request)
    store = sut.open()
    key = published(store, tmp_path)
    m = mount(mounts, sut, key, tmp_path / "lazy", tmp_path / "cache")
    assert m.wait_complete(30)
    m.close()
    view = view_of(store, key)
    (i,) = view.file_chunks(view.nodes["lib/pkg/mod6.py"])
    sha = view.manifest.chunks[i].sha256
    _flip(tmp_path / "cache/chunks" / sha[:2] / sha, 10)
    m = mount(mounts, sut, key, tmp_path / "lazy", tmp_path / "cache", prefetch=False)
    data = bounded(m.prefix, lambda: (Path(m.prefix) / "lib/pkg/mod6.py").read_bytes())
    assert data == (tmp_path / "src/lib/pkg/mod6.py").read_bytes()
    assert m.close()["chunks_fetched"] == 1


def test_the_store_lost_mid_read_is_eio_within_the_timeout(tmp_path, s3_server_factory, mounts):
    server = s3_server_factory()  # in-process: its objects survive stop() and start()
    bucket = f"lazy-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    options = {"s3": server.storage_options(), "striped": {"retries": 1, "backoff_s": 0.1}}
    sut = StoreUnderTest("s3", f"s3://{bucket}/envs", options)
    key = published(sut.open(), tmp_path)
    m = mount(
        mounts, sut, key, tmp_path / "lazy", tmp_path / "cache", prefetch=False, read_timeout_s=8
    )
    first = Path(m.prefix) / "lib/pkg/mod1.py"
    assert bounded(m.prefix, first.read_bytes) == (tmp_path / "src/lib/pkg/mod1.py").read_bytes()
    server.stop()
    started = time.monotonic()
    victim = Path(m.prefix) / "lib/pkg/mod8.py"
    assert bounded(m.prefix, lambda: errno_of(victim.read_bytes), timeout=40) == errno.EIO
    assert time.monotonic() - started < 30
    assert bounded(m.prefix, first.read_bytes)  # what was read stays readable
    server.start()  # the store back: the same read succeeds (once the failed fetch ended)
    deadline = time.monotonic() + 60
    while (code := bounded(m.prefix, lambda: errno_of(victim.read_bytes))) == errno.EIO:
        assert time.monotonic() < deadline, "reads still fail a minute after the store is back"
        time.sleep(0.5)
    assert code is None
    assert bounded(m.prefix, victim.read_bytes) == (tmp_path / "src/lib/pkg/mod8.py").read_bytes()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "bootseer", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_kill_9_of_the_mount_process_leaves_a_mount_that_unmount_clears(tmp_path, request, mounts):
    sut = make_store("local", tmp_path, request)
    key = published(sut.open(), tmp_path)
    prefix = tmp_path / "lazy"
    m = mount(mounts, sut, key, prefix, tmp_path / "cache", prefetch=False)
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait(timeout=10)
    assert is_mounted(prefix)
    assert errno_of(lambda: os.listdir(prefix)) == errno.ENOTCONN
    # The next mount clears the dead one and serves again.
    m = mount(mounts, sut, key, prefix, tmp_path / "cache", prefetch=False)
    assert bounded(m.prefix, lambda: (prefix / "bin/tool").read_text()).endswith("tool-ok\n")
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait(timeout=10)
    out = _cli("env", "unmount", str(prefix))
    assert out.returncode == 0, out.stderr
    assert not is_mounted(prefix)
    assert _cli("env", "unmount", str(prefix)).returncode == 1  # nothing mounted there now


def test_close_stops_the_mount_process_when_the_caller_cannot_unmount(
    tmp_path, request, mounts, monkeypatch
):
    """The e2e container's case (2026-12-03): no fusermount, no umount, and the unmount from
    the caller fails. ``close()`` used to wait forever on the log pipe its reader thread
    held; now it stops the mount process (its libfuse unmounts on SIGTERM) and returns, the
    mount gone, while that thread still reads the child's log."""
    import snapshot.lazy as lazy
    from snapshot import SnapshotError

    sut = make_store("local", tmp_path, request)
    key = published(sut.open(), tmp_path)
    prefix = tmp_path / "lazy"
    m = mount(mounts, sut, key, prefix, tmp_path / "cache", prefetch=False)
    assert bounded(m.prefix, lambda: (prefix / "bin/tool").read_text()).endswith("tool-ok\n")
    assert m.proc.stderr is not None  # the log's pump thread reads it

    def refused(*args: Any, **kwargs: Any) -> bool:
        raise SnapshotError(f"could not unmount {prefix}: no tool found")

    monkeypatch.setattr(lazy, "unmount_lazy", refused)
    done: list[dict[str, Any]] = []
    closer = threading.Thread(target=lambda: done.append(m.close(timeout_s=20)), daemon=True)
    closer.start()
    closer.join(40)
    assert done, "close() hung"
    assert m.proc.poll() is not None
    assert not is_mounted(prefix)


def test_the_cli_mounts_and_unmounts(tmp_path, request):
    sut = make_store("local", tmp_path, request)
    key = published(sut.open(), tmp_path)
    prefix = tmp_path / "lazy"
    out = _cli(
        "env", "mount", key, str(prefix), "--store", sut.url,
        "--env-cache", str(tmp_path / "cache"), "--wait-complete", "30",
    )  # fmt: skip
    try:
        assert out.returncode == 0, out.stderr
        assert "every chunk local" in out.stderr
        assert (prefix / "lib/pkg/__init__.py").read_text() == "VALUE = 42\n"
        assert os.stat(tmp_path / "cache").st_mode & 0o777 == 0o700
    finally:
        result = _cli("env", "unmount", str(prefix))
        if is_mounted(prefix):
            subprocess.run(["fusermount", "-u", "-z", str(prefix)], check=False)
    assert result.returncode == 0, result.stderr
    assert not is_mounted(prefix)


# -- untrusted snapshots ------------------------------------------------------------------------


def _members_with(bad: Member) -> tuple[list[Member], bytes]:
    members, stream = tar_stream([("d", "lib"), ("f", "lib/ok.py", b"ok\n")])
    return [*members, bad], stream


@pytest.mark.parametrize(
    ("bad", "rule"),
    [
        (Member("../escape", "f", 0o644, MTIME_NS), "'..' in member path"),
        (Member("lib/../../escape", "f", 0o644, MTIME_NS), "'..' in member path"),
        (Member("/etc/passwd", "f", 0o644, MTIME_NS), "absolute member path"),
        (Member("lib/huge", "f", 0o644, MTIME_NS, 1 << 50, 512), "lies beyond the tar stream"),
        (Member("lib/dev", "c", 0o644, MTIME_NS), "character device"),
        (Member("lib/ok.py/x", "f", 0o644, MTIME_NS), "is not an earlier directory member"),
        (Member("lib/h", "h", 0o644, MTIME_NS, link="../x"), "outside the root"),
        (Member(".bootseer/env.json", "f", 0o644, MTIME_NS), "reserved"),
    ],
)
def test_crafted_members_refuse_the_mount(bad, rule, tmp_path, request, mounts, monkeypatch):
    tmp = tmp_path / "tmp"  # where mount_lazy makes its stats directory
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    sut = make_store("local", tmp_path, request)
    members, stream = _members_with(bad)
    manifest = publish_crafted(sut.open(), members, stream, prefix=tmp_path / "lazy")
    with pytest.raises(SnapshotError) as info:
        mount(mounts, sut, manifest.key, tmp_path / "lazy", tmp_path / "cache")
    assert rule in str(info.value) and bad.path in str(info.value)
    assert not is_mounted(tmp_path / "lazy")
    assert os.listdir(tmp_path / "lazy") == []
    assert os.listdir(tmp) == []  # the refused mount's bootseer-env-mount-* went with it


def test_a_non_empty_prefix_or_another_prefix_is_refused(tmp_path, request, mounts):
    sut = make_store("local", tmp_path, request)
    members, stream = tar_stream([("d", "bin"), ("f", "bin/tool", b"#!/opt/venv/bin/python\n")])

    def refs(data: dict[str, Any]) -> None:
        data["prefix_refs"] = [{"path": "bin/tool", "kind": "text"}]

    manifest = publish_crafted(sut.open(), members, stream, prefix="/opt/venv", tamper=refs)
    with pytest.raises(SnapshotError, match="cannot rewrite them"):
        mount(mounts, sut, manifest.key, tmp_path / "elsewhere", tmp_path / "cache")
    (tmp_path / "full").mkdir()
    (tmp_path / "full/file").write_text("x")
    with pytest.raises(SnapshotError, match="is not empty"):
        mount(mounts, sut, manifest.key, tmp_path / "full", tmp_path / "cache")
    assert unmount_lazy(tmp_path / "full") is False


# -- bootseer run ---------------------------------------------------------------------------------


def test_bootseer_run_mounts_the_environment_lazily_and_unmounts_after(tmp_path):
    """env.lazy: the first run builds and publishes; on a node without the environment the
    next run mounts it, the command runs inside it, and the mount is gone when run ends."""
    from run_helpers import run_wrapper, spans

    req = tmp_path / "requirements.txt"
    req.write_text("")
    prefix = tmp_path / "venv"
    trace = tmp_path / "trace"
    flags = ["--env-spec", str(req), "--env-prefix", str(prefix)]
    flags += ["--env-store", str(tmp_path / "store"), "--env-cache", str(tmp_path / "cache")]
    probe = [
        "python",
        "-c",
        "import os, sys; print('PREFIX', sys.prefix, os.path.ismount(sys.prefix))",
    ]
    built = run_wrapper(trace, *flags, "--env-lazy", command=probe)
    assert built.returncode == 0, built.stderr
    assert f"PREFIX {prefix} False" in built.stdout  # a miss: built and published here
    shutil.rmtree(prefix)
    lazy = run_wrapper(trace, *flags, "--env-lazy", command=probe)
    assert lazy.returncode == 0, lazy.stderr
    assert f"PREFIX {prefix} True" in lazy.stdout
    span = [s for s in spans(trace) if s["phase"] == "environment"][-1]
    assert span["detail"]["outcome"] == "mounted-lazily", span
    assert f"unmounted {prefix}" in lazy.stderr
    assert not is_mounted(prefix)
    assert json.loads(
        SnapshotStore(str(tmp_path / "store")).fetch(span["detail"]["key"], PROFILE_NAME).result()
    )["chunks"]  # the first lazy start stored its read profile


def test_a_second_wrapper_on_the_node_uses_the_mount_it_finds(tmp_path, mounts):
    """Two `bootseer run` on one node: the second finds the prefix mounted lazily with its
    key and runs inside it, instead of restoring over the mount."""
    from bootseer.startup import StartupPlan, environment_phase
    from snapshot import ensure

    req = tmp_path / "requirements.txt"
    req.write_text("")
    prefix = tmp_path / "venv"
    store = str(tmp_path / "store")
    key = ensure([req], prefix=prefix, store=store).key
    shutil.rmtree(prefix)
    mounts.append(mount_lazy(store, key, prefix, cache_dir=tmp_path / "cache"))
    plan = StartupPlan(env_spec=[str(req)], env_prefix=str(prefix), env_store=store, env_lazy=True)
    result = environment_phase(plan, {"PATH": "/usr/bin"})
    assert result.detail == {
        "outcome": "mounted-lazily",
        "key": key,
        "prefix": str(prefix),
        "shared": True,
    }
    assert result.env["PATH"] == f"{prefix}/bin:/usr/bin"
