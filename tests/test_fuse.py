"""The FUSE view of an fsspec filesystem (striped_fs.fuse).

Two layers: the operations object driven directly (no kernel involved: MemoryFileSystem and
LocalFileSystem backings), and real mounts served by a child process and used from here with
cp, dd and plain ``open()``. The mount tests skip without FUSE, unless BOOTSEER_REQUIRE_SYSTEM=1.

Every wait is bounded (see fuse_helpers).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fuse_helpers import (
    IO_TIMEOUT,
    MOUNT_TIMEOUT,
    Mount,
    bounded,
    errno_of,
    fuse_missing,
    mounted_in_proc_mounts,
    need_fuse,
    run,
    stop_mount,
)

from striped_fs import StripedFileSystem
from striped_fs.fuse import (
    FsspecOperations,
    FuseOSError,
    MountError,
    MountTimeout,
    _unescape_mountinfo,
    is_mounted,
    unmount,
    wait_mounted,
)
from striped_fs.layout import Manifest

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# The child process serving a mount: argv = backing-kind, backing path, mountpoint, mode.
RUNNER = r"""
import sys
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from striped_fs.fuse import serve


class _FailingCommit(LocalFileOpener):
    def close(self):
        super().close()
        if "w" in self.mode:
            raise RuntimeError("injected commit failure")


class FailingCommitFS(LocalFileSystem):
    cachable = False

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        return _FailingCommit(path, mode, fs=self, **kwargs)


kind, backing, mountpoint, mode = sys.argv[1:5]
fs = {"local": LocalFileSystem, "memory": MemoryFileSystem, "failcommit": FailingCommitFS}[kind]()
sys.exit(serve(fs, backing, mountpoint, read_only=(mode == "ro")))
"""


# -- FUSE availability ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fuse_probe(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """One real mount attempt per session: /dev/fuse can exist while mounting is forbidden."""
    reason = fuse_missing()
    if reason is not None:
        return reason
    base = tmp_path_factory.mktemp("fuse-probe")
    (base / "back").mkdir()
    (base / "mnt").mkdir()
    m = _start(base / "back", base / "mnt", "local", "rw")
    try:
        wait_mounted(m.path, MOUNT_TIMEOUT, m.proc)
    except MountError as e:
        return f"a test mount failed: {e}"
    finally:
        stop_mount(m)
    return None


# -- mounts served by a child process ----------------------------------------------------------


def _start(backing: Path, mountpoint: Path, kind: str, mode: str) -> Mount:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, kind, str(backing), str(mountpoint), mode],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    return Mount(backing, mountpoint, proc)


@pytest.fixture
def mounts(fuse_probe: str | None, tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """``mounts(kind="local", mode="rw")`` -> a ready mount over a fresh backing directory."""
    need_fuse(fuse_probe)
    started: list[Mount] = []

    def factory(kind: str = "local", mode: str = "rw") -> Mount:
        n = len(started)
        backing, mnt = tmp_path / f"back{n}", tmp_path / f"mnt{n}"
        backing.mkdir()
        mnt.mkdir()
        m = _start(backing, mnt, kind, mode)
        started.append(m)
        wait_mounted(mnt, MOUNT_TIMEOUT, m.proc)
        return m

    yield factory
    for m in started:
        stop_mount(m)
    leaked = [str(m.path) for m in started if mounted_in_proc_mounts(m.path)]
    assert not leaked, f"mounts left behind: {leaked}"


# == the operations object, no kernel ==========================================================


def _write_file(ops: FsspecOperations, path: str, chunks: list[bytes]) -> None:
    fh = ops("create", path, 0o644)
    off = 0
    for c in chunks:
        assert ops("write", path, c, off, fh) == len(c)
        off += len(c)
    ops("flush", path, fh)
    ops("release", path, fh)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_ops_write_then_read_back(kind: str, tmp_path: Path) -> None:
    fs: Any = MemoryFileSystem() if kind == "memory" else LocalFileSystem()
    root = f"/t-{os.getpid()}-{time.monotonic_ns()}" if kind == "memory" else str(tmp_path)
    fs.makedirs(root, exist_ok=True)
    ops = FsspecOperations(fs, root)
    data = random.Random(1).randbytes(3 * MiB + 123)
    chunks = [data[i : i + 131072] for i in range(0, len(data), 131072)]

    fh = ops("create", "/f.bin", 0o644)
    ops("write", "/f.bin", chunks[0], 0, fh)
    # While being written the file exists for getattr (the kernel looks it up after create).
    assert ops("getattr", "/f.bin")["st_size"] == len(chunks[0])
    assert "f.bin" in [e if isinstance(e, str) else e[0] for e in ops("readdir", "/", 0)]
    off = len(chunks[0])
    for c in chunks[1:]:
        ops("write", "/f.bin", c, off, fh)
        off += len(c)
    ops("flush", "/f.bin", fh)
    ops("flush", "/f.bin", fh)  # a second flush (dup'ed fd closed) is harmless
    ops("release", "/f.bin", fh)
    assert fs.cat_file(f"{root}/f.bin") == data

    st = ops("getattr", "/f.bin")
    assert st["st_size"] == len(data) and st["st_mode"] & 0o777 == 0o644
    assert st["st_blocks"] * 512 >= len(data)
    fh = ops("open", "/f.bin", os.O_RDONLY)
    rng = random.Random(2)
    for _ in range(200):
        off = rng.randrange(len(data))
        size = rng.choice([1, 4096, 131072])
        assert ops("read", "/f.bin", size, off, fh) == data[off : off + size]
    assert ops("read", "/f.bin", 4096, len(data), fh) == b""
    ops("release", "/f.bin", fh)


def test_ops_non_sequential_write_poisons_the_handle() -> None:
    ops = FsspecOperations(MemoryFileSystem(), f"/nonseq-{time.monotonic_ns()}")
    fh = ops("create", "/x", 0o644)
    ops("write", "/x", b"a" * 100, 0, fh)
    with pytest.raises(FuseOSError) as exc:
        ops("write", "/x", b"b" * 10, 50, fh)
    assert exc.value.errno == errno.EOPNOTSUPP
    with pytest.raises(FuseOSError) as exc:  # later writes fail too: no silent holes
        ops("write", "/x", b"c" * 10, 100, fh)
    assert exc.value.errno == errno.EIO
    with pytest.raises(FuseOSError) as exc:  # and close() reports it
        ops("flush", "/x", fh)
    assert exc.value.errno == errno.EIO
    with pytest.raises(FuseOSError) as exc:  # release too (the kernel ignores it, logs do not)
        ops("release", "/x", fh)
    assert exc.value.errno == errno.EIO
    assert not ops._handles and not ops._writing


def test_ops_flush_commits_at_close_and_dd_starts_again(tmp_path: Path) -> None:
    """FLUSH arrives for every close of a shared descriptor (``dd``: dup2(fd, 1); close(fd)).
    A new file is committed empty at the first one, and data written after that starts it
    again, committed at the writer's own close; a write after a commit with data is loud."""
    fs = StripedFileSystem(target_protocol="file", skip_instance_cache=True)
    ops = FsspecOperations(fs, str(tmp_path))

    def stored(name: str) -> bytes:
        return fs.cat_file(f"{tmp_path}/{name}")

    fh = ops("create", "/d.bin", 0o644)
    ops("flush", "/d.bin", fh)  # dd closes the original descriptor
    assert stored("d.bin") == b""  # a new file: there, empty
    ops("write", "/d.bin", b"pay", 0, fh)
    ops("write", "/d.bin", b"load", 3, fh)
    assert ops("getattr", "/d.bin")["st_size"] == 7  # the handle answers while it is written
    ops("flush", "/d.bin", fh)  # the writer's close: committed
    assert stored("d.bin") == b"payload"
    with pytest.raises(FuseOSError) as exc:  # a write through another dup after that is loud
        ops("write", "/d.bin", b"more", 7, fh)
    assert exc.value.errno == errno.EIO
    ops("release", "/d.bin", fh)
    assert stored("d.bin") == b"payload"

    fh = ops("create", "/empty", 0o644)  # touch: committed by close(), not by a later release
    ops("flush", "/empty", fh)
    assert stored("empty") == b""
    assert ops("getattr", "/empty")["st_size"] == 0
    ops("release", "/empty", fh)
    assert stored("empty") == b""

    # Replacing a non-empty file: a flush before any data is not final, and committing it
    # empty would hide the old bytes; they stay until the new ones are committed.
    fh = ops("open", "/d.bin", os.O_WRONLY | os.O_TRUNC)
    ops("flush", "/d.bin", fh)
    assert stored("d.bin") == b"payload"
    ops("write", "/d.bin", b"new", 0, fh)
    ops("flush", "/d.bin", fh)
    ops("release", "/d.bin", fh)
    assert stored("d.bin") == b"new"
    assert not ops._handles and not ops._writing


class _SlowCommitFS(LocalFileSystem):
    """Local files whose commit (close of a written file) waits until ``land`` is set."""

    cachable = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closing = threading.Event()
        self.land = threading.Event()

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "w" in mode:
            close = f.close

            def slow_close() -> None:
                self.closing.set()
                assert self.land.wait(30), "the test never let the commit land"
                close()

            f.close = slow_close
        return f


@contextlib.contextmanager
def _commit_landing(tmp_path: Path) -> Iterator[tuple[FsspecOperations, int]]:
    """``/x`` (3 bytes) written and closed: inside the block its commit is on its way."""
    fs = _SlowCommitFS()
    ops = FsspecOperations(fs, str(tmp_path))
    fh = ops("create", "/x", 0o644)
    ops("write", "/x", b"abc", 0, fh)
    closer = threading.Thread(target=ops, args=("flush", "/x", fh))
    closer.start()
    try:
        assert fs.closing.wait(30)
        yield ops, fh
    finally:
        fs.land.set()
        closer.join(30)


def test_ops_a_file_stays_visible_while_its_commit_lands(tmp_path: Path) -> None:
    """The mount forgot a file in flight before its commit had landed: a lookup in between
    (``cat x`` right after ``touch x``, rsync's utime after close) found nothing, ENOENT."""
    with _commit_landing(tmp_path) as (ops, fh):
        st = ops("getattr", "/x")  # the commit is on its way: the handle answers
        assert st["st_size"] == 3 and stat.S_ISREG(st["st_mode"])
        names = [e if isinstance(e, str) else e[0] for e in ops("readdir", "/", 0)]
        assert "x" in names
    assert (tmp_path / "x").read_bytes() == b"abc"
    assert ops("getattr", "/x")["st_size"] == 3
    ops("release", "/x", fh)
    assert not ops._writing


def test_ops_unlink_while_the_commit_lands_wins(tmp_path: Path) -> None:
    with _commit_landing(tmp_path) as (ops, fh):
        ops("unlink", "/x")
    ops("release", "/x", fh)
    assert not (tmp_path / "x").exists()
    assert errno_of(lambda: ops("getattr", "/x")) == errno.ENOENT


OLD_NS = 1_000_000_000_123_456_789  # nanoseconds a float of seconds cannot hold
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2


@pytest.mark.parametrize("kind", ["local", "striped"])
def test_ops_utimens_sets_the_mtime(kind: str, tmp_path: Path) -> None:
    """utimens was accepted and ignored, so rsync re-sent every file on every run."""
    fs: Any = (
        LocalFileSystem()
        if kind == "local"
        else StripedFileSystem(target_protocol="file", skip_instance_cache=True)
    )
    ops = FsspecOperations(fs, str(tmp_path))
    _write_file(ops, "/a", [b"committed"])
    ops("utimens", "/a", (OLD_NS, OLD_NS))
    assert ops("getattr", "/a")["st_mtime"] == OLD_NS
    assert fs.info(f"{tmp_path}/a").get("mtime_ns", OLD_NS) == OLD_NS
    ops("utimens", "/a", (UTIME_NOW, UTIME_OMIT))  # atime only: the mtime stays
    assert ops("getattr", "/a")["st_mtime"] == OLD_NS
    before = time.time_ns()
    ops("utimens", "/a", (UTIME_OMIT, UTIME_NOW))
    assert before <= ops("getattr", "/a")["st_mtime"] <= time.time_ns()
    ops("utimens", "/a", None)  # utime(path, NULL): now
    assert before <= ops("getattr", "/a")["st_mtime"] <= time.time_ns()
    assert fs.cat_file(f"{tmp_path}/a") == b"committed"

    fh = ops("create", "/b", 0o644)  # cp -p: futimens after the data, before close
    ops("write", "/b", b"data", 0, fh)
    ops("utimens", "/b", (OLD_NS, OLD_NS + 5))
    assert ops("getattr", "/b")["st_mtime"] == OLD_NS + 5
    ops("flush", "/b", fh)
    ops("release", "/b", fh)
    assert ops("getattr", "/b")["st_mtime"] == OLD_NS + 5
    if kind == "striped":  # recorded by the commit's own manifest
        manifest = Manifest.from_bytes((tmp_path / "b").read_bytes(), path="b")
        assert manifest.mtime_ns == OLD_NS + 5
    else:
        assert os.stat(tmp_path / "b").st_mtime_ns == OLD_NS + 5

    fh = ops("create", "/c", 0o644)  # a write after utimens: the mtime is the commit's again
    ops("utimens", "/c", (OLD_NS, OLD_NS))
    ops("write", "/c", b"later", 0, fh)
    ops("flush", "/c", fh)
    ops("release", "/c", fh)
    assert ops("getattr", "/c")["st_mtime"] >= before

    ops("mkdir", "/d", 0o755)  # a local directory keeps its time
    ops("utimens", "/d", (OLD_NS, OLD_NS))
    assert os.stat(tmp_path / "d").st_mtime_ns == OLD_NS


def test_ops_utimens_where_the_store_keeps_no_times() -> None:
    """fsspec's memory store has no settable mtime: a file says so (EOPNOTSUPP, before any
    data is written), a directory accepts it and ignores it (rsync -a sets every one)."""
    fs = MemoryFileSystem()
    root = f"/utimens-{time.monotonic_ns()}"
    fs.mkdir(root)
    ops = FsspecOperations(fs, root)
    _write_file(ops, "/f", [b"x"])
    assert errno_of(lambda: ops("utimens", "/f", (OLD_NS, OLD_NS))) == errno.EOPNOTSUPP
    fh = ops("create", "/g", 0o644)
    assert errno_of(lambda: ops("utimens", "/g", (OLD_NS, OLD_NS))) == errno.EOPNOTSUPP
    ops("release", "/g", fh)
    ops("mkdir", "/d", 0o755)
    assert ops("utimens", "/d", (OLD_NS, OLD_NS)) == 0
    assert ops("utimens", "/", (OLD_NS, OLD_NS)) == 0
    assert fs.cat_file(f"{root}/f") == b"x"


def test_ops_rename_waits_for_a_pending_release(tmp_path: Path) -> None:
    """``touch a && mv a b``: RELEASE of the empty ``a`` may still be on its way."""
    ops = FsspecOperations(LocalFileSystem(), str(tmp_path))
    fh = ops("create", "/a", 0o644)
    ops("flush", "/a", fh)
    timer = threading.Timer(0.2, lambda: ops("release", "/a", fh))
    timer.start()
    try:
        ops("rename", "/a", "/b")
    finally:
        timer.join(5)
    assert (tmp_path / "b").exists() and not (tmp_path / "a").exists()


def test_ops_gaps_are_zero_filled_and_truncate_follows_the_stream(tmp_path: Path) -> None:
    fs = LocalFileSystem()
    ops = FsspecOperations(fs, str(tmp_path))
    fh = ops("create", "/s", 0o644)
    ops("write", "/s", b"x" * 10, 0, fh)
    ops("write", "/s", b"y" * 10, 30, fh)  # cp --sparse: a hole, then data
    ops("truncate", "/s", 60, fh)  # trailing hole via ftruncate
    ops("truncate", "/s", 60, fh)  # no-op at the current end
    with pytest.raises(FuseOSError) as exc:
        ops("truncate", "/s", 5, fh)
    assert exc.value.errno == errno.EOPNOTSUPP
    ops("flush", "/s", fh)
    ops("release", "/s", fh)
    assert (tmp_path / "s").read_bytes() == b"x" * 10 + bytes(20) + b"y" * 10 + bytes(20)

    fh = ops("open", "/s", os.O_WRONLY | os.O_TRUNC)
    ops("write", "/s", b"old", 0, fh)
    ops("truncate", "/s", 0, fh)  # start over
    ops("write", "/s", b"new", 0, fh)
    ops("flush", "/s", fh)
    ops("release", "/s", fh)
    assert (tmp_path / "s").read_bytes() == b"new"

    with pytest.raises(FuseOSError) as exc:  # rewriting in place is not possible
        ops("open", "/s", os.O_WRONLY)
    assert exc.value.errno == errno.EOPNOTSUPP
    with pytest.raises(FuseOSError) as exc:
        ops("truncate", "/s", 1)
    assert exc.value.errno == errno.EOPNOTSUPP
    ops("truncate", "/s", 0)
    assert (tmp_path / "s").read_bytes() == b""


def test_ops_namespace_on_memory() -> None:
    fs = MemoryFileSystem()
    root = f"/ns-{time.monotonic_ns()}"
    fs.mkdir(root)
    ops = FsspecOperations(fs, root)
    ops("mkdir", "/d", 0o755)
    assert ops("getattr", "/d")["st_mode"] & 0o170000 == 0o040000
    with pytest.raises(FuseOSError) as exc:
        ops("mkdir", "/d", 0o755)
    assert exc.value.errno == errno.EEXIST
    _write_file(ops, "/d/a", [b"hello"])
    names = [e if isinstance(e, str) else e[0] for e in ops("readdir", "/d", 0)]
    assert sorted(names) == [".", "..", "a"]
    with pytest.raises(FuseOSError) as exc:
        ops("rmdir", "/d")
    assert exc.value.errno == errno.ENOTEMPTY
    ops("rename", "/d/a", "/b")
    assert fs.cat_file(f"{root}/b") == b"hello" and not fs.exists(f"{root}/d/a")
    ops("mkdir", "/e", 0o755)
    ops("rename", "/d", "/e")  # a directory replaces an empty directory
    assert ops("getattr", "/e")["st_mode"] & 0o040000
    with pytest.raises(FuseOSError) as exc:
        ops("getattr", "/d")
    assert exc.value.errno == errno.ENOENT
    ops("unlink", "/b")
    ops("rmdir", "/e")
    with pytest.raises(FuseOSError) as exc:
        ops("getattr", "/b")
    assert exc.value.errno == errno.ENOENT
    with pytest.raises(FuseOSError) as exc:
        ops("open", "/nope", os.O_RDONLY)
    assert exc.value.errno == errno.ENOENT


def test_ops_read_only_refuses_every_mutation(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    ops = FsspecOperations(LocalFileSystem(), str(tmp_path), read_only=True)
    assert ops("getattr", "/f")["st_mode"] & 0o777 == 0o444
    fh = ops("open", "/f", os.O_RDONLY)
    assert ops("read", "/f", 10, 0, fh) == b"data"
    ops("release", "/f", fh)
    calls: list[tuple[Any, ...]] = [
        ("create", "/g", 0o644),
        ("open", "/f", os.O_WRONLY | os.O_TRUNC),
        ("unlink", "/f"),
        ("rename", "/f", "/g"),
        ("mkdir", "/d", 0o755),
        ("rmdir", "/d"),
        ("truncate", "/f", 0),
        ("write", "/f", b"x", 0, 1),
        ("chmod", "/f", 0o600),
        ("utimens", "/f", None),
    ]
    for call in calls:
        with pytest.raises(FuseOSError) as exc:
            ops(*call)
        assert exc.value.errno == errno.EROFS, call
    with pytest.raises(FuseOSError) as exc:
        ops("access", "/f", os.W_OK)
    assert exc.value.errno == errno.EROFS
    assert (tmp_path / "f").read_bytes() == b"data"


class _Raising(MemoryFileSystem):
    """info() raises whatever the test put in ``exc``."""

    cachable = False
    exc: BaseException | None = None
    calls = 0

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        type(self).calls += 1
        if self.exc is not None:
            raise self.exc
        return super().info(path, **kwargs)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (FileNotFoundError("x"), errno.ENOENT),
        (PermissionError("x"), errno.EACCES),
        (IsADirectoryError("x"), errno.EISDIR),
        (FileExistsError("x"), errno.EEXIST),
        (NotADirectoryError("x"), errno.ENOTDIR),
        (OSError(errno.ENOSPC, "full"), errno.ENOSPC),
        (OSError("no errno"), errno.EIO),
        (RuntimeError("boom"), errno.EIO),
        (ValueError("bad"), errno.EIO),
    ],
)
def test_ops_exceptions_become_errnos(
    exc: BaseException, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    fs = _Raising()
    fs.exc = exc
    ops = FsspecOperations(fs, "/err")
    with caplog.at_level(logging.INFO, logger="striped_fs.fuse"):
        with pytest.raises(FuseOSError) as raised:
            ops("getattr", "/some/file")
    assert raised.value.errno == code
    if code == errno.EIO:  # the unexpected ones are logged with the path
        assert any("/some/file" in r.getMessage() for r in caplog.records)


def test_ops_info_cache_ttl_and_invalidation() -> None:
    fs = _Raising()
    root = f"/cache-{time.monotonic_ns()}"
    fs.mkdir(root)
    fs.pipe(f"{root}/f", b"abc")
    ops = FsspecOperations(fs, root, info_ttl=60)
    _Raising.calls = 0
    for _ in range(5):
        assert ops("getattr", "/f")["st_size"] == 3
    assert _Raising.calls == 1
    for _ in range(3):  # negative results are cached as well
        with pytest.raises(FuseOSError):
            ops("getattr", "/missing")
    assert _Raising.calls == 2
    ops("readdir", "/", 0)  # listing fills the cache for the children
    _write_file(ops, "/missing", [b"now here"])  # a write invalidates
    assert ops("getattr", "/missing")["st_size"] == 8
    ops("unlink", "/f")
    with pytest.raises(FuseOSError):
        ops("getattr", "/f")
    short = FsspecOperations(fs, root, info_ttl=0.05)
    short("getattr", "/missing")
    fs.pipe(f"{root}/missing", b"longer content")  # behind the mount's back
    time.sleep(0.1)
    assert short("getattr", "/missing")["st_size"] == 14


def test_is_mounted_and_wait_helpers(tmp_path: Path) -> None:
    assert _unescape_mountinfo(r"/mnt/a\040b\134c") == "/mnt/a b\\c"
    assert is_mounted("/")
    assert not is_mounted(tmp_path)
    assert not is_mounted(tmp_path / "does-not-exist")
    unmount(tmp_path)  # not mounted: nothing to do
    with pytest.raises(MountTimeout):
        wait_mounted(tmp_path, 0.3)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stderr.write('boom: no fuse'); sys.exit(3)"],
        stderr=subprocess.PIPE,
    )
    try:
        with pytest.raises(MountError) as exc:
            wait_mounted(tmp_path, 30, proc)
        assert "boom: no fuse" in str(exc.value) and "code 3" in str(exc.value)
    finally:
        proc.wait(timeout=10)


# == real mounts ===============================================================================


def _random_file(path: Path, size: int, seed: int = 0) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


def test_cp_in_and_out(mounts: Callable[..., Mount], tmp_path: Path) -> None:
    m = mounts()
    src = tmp_path / "src.bin"
    data = _random_file(src, 20 * MiB)
    r = run("cp", str(src), str(m.path / "in.bin"))
    assert r.returncode == 0, r.stderr
    assert (m.backing / "in.bin").read_bytes() == data  # committed when cp closed it
    out = tmp_path / "out.bin"
    r = run("cp", str(m.path / "in.bin"), str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    assert os.stat(m.path / "in.bin").st_size == len(data)

    smaller = _random_file(src, 5 * MiB + 7, seed=9)  # cp over an existing file: O_TRUNC
    r = run("cp", str(src), str(m.path / "in.bin"))
    assert r.returncode == 0, r.stderr
    assert (m.backing / "in.bin").read_bytes() == smaller
    assert bounded(m, lambda: os.stat(m.path / "in.bin").st_size) == len(smaller)

    assert run("touch", str(m.path / "empty")).returncode == 0  # commits at release (async)
    deadline = time.monotonic() + 10
    while not (m.backing / "empty").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (m.backing / "empty").read_bytes() == b""


def test_dd_and_python_reads(mounts: Callable[..., Mount], tmp_path: Path) -> None:
    m = mounts()
    data = _random_file(m.backing / "big.bin", 24 * MiB + 4097, seed=3)
    r = run("dd", f"if={m.path / 'big.bin'}", "of=/dev/null", "bs=1M")
    assert r.returncode == 0, r.stderr
    assert f"{len(data)} bytes" in r.stderr

    src = tmp_path / "dd-src.bin"
    _random_file(src, 13 * MiB + 5, seed=4)
    r = run("dd", f"if={src}", f"of={m.path / 'dd.bin'}", "bs=4M")
    assert r.returncode == 0, r.stderr
    assert (m.backing / "dd.bin").read_bytes() == src.read_bytes()

    def random_seeks() -> None:
        rng = random.Random(5)
        with open(m.path / "big.bin", "rb", buffering=0) as f:
            for _ in range(300):
                off = rng.randrange(len(data))
                size = rng.choice([1, 512, 4096, 65536, 300_000, MiB])
                f.seek(off)
                got = f.read(size)
                assert got == data[off : off + size], (off, size)

    def large_reads() -> None:
        with open(m.path / "big.bin", "rb", buffering=0) as f:
            chunks = []
            while chunk := f.read(MiB):
                chunks.append(chunk)
        assert b"".join(chunks) == data

    bounded(m, random_seeks)
    bounded(m, large_reads)

    # Reads on several handles at once (the FUSE loop is multi-threaded).
    procs = [
        subprocess.Popen(
            ["dd", f"if={m.path / name}", "of=/dev/null", "bs=1M"], stderr=subprocess.DEVNULL
        )
        for name in ("big.bin", "dd.bin", "big.bin", "dd.bin")
    ]
    try:
        assert [p.wait(timeout=IO_TIMEOUT) for p in procs] == [0, 0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_directory_operations_reach_the_backing_store(mounts: Callable[..., Mount]) -> None:
    m = mounts()
    _random_file(m.backing / "a.bin", 1000)
    (m.backing / "sub").mkdir()
    _random_file(m.backing / "sub" / "b.bin", 70000)

    def check() -> None:
        assert sorted(os.listdir(m.path)) == ["a.bin", "sub"]
        assert os.stat(m.path / "a.bin").st_size == 1000
        assert os.stat(m.path / "sub" / "b.bin").st_size == 70000
        assert os.path.isdir(m.path / "sub")
        os.mkdir(m.path / "new")
        assert (m.backing / "new").is_dir()
        os.rename(m.path / "a.bin", m.path / "new" / "a2.bin")
        assert (m.backing / "new" / "a2.bin").stat().st_size == 1000
        assert not (m.backing / "a.bin").exists()
        os.rename(m.path / "sub", m.path / "sub2")
        assert (m.backing / "sub2" / "b.bin").exists()
        assert sorted(os.listdir(m.path)) == ["new", "sub2"]
        os.unlink(m.path / "new" / "a2.bin")
        assert not (m.backing / "new" / "a2.bin").exists()
        assert errno_of(lambda: os.rmdir(m.path / "sub2")) == errno.ENOTEMPTY
        os.rmdir(m.path / "new")
        assert not (m.backing / "new").exists()
        assert errno_of(lambda: os.stat(m.path / "new")) == errno.ENOENT
        with open(m.path / "sub2" / "c.txt", "w") as f:
            f.write("text")
        assert (m.backing / "sub2" / "c.txt").read_text() == "text"
        assert os.stat(m.path / "sub2" / "c.txt").st_size == 4

    bounded(m, check)
    r = run("sh", "-c", f"touch {m.path}/t && mv {m.path}/t {m.path}/u && ls {m.path}")
    assert r.returncode == 0 and "u" in r.stdout.split(), r.stderr


def test_memory_backed_mount(mounts: Callable[..., Mount], tmp_path: Path) -> None:
    m = mounts(
        kind="memory"
    )  # the child's MemoryFileSystem starts empty: fill it through the mount
    src = tmp_path / "m.bin"
    data = _random_file(src, 3 * MiB + 1, seed=6)
    assert run("mkdir", str(m.path / "dir")).returncode == 0
    r = run("cp", str(src), str(m.path / "dir" / "m.bin"))
    assert r.returncode == 0, r.stderr
    r = run("cp", str(m.path / "dir" / "m.bin"), str(tmp_path / "back.bin"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "back.bin").read_bytes() == data
    assert bounded(m, lambda: os.listdir(m.path / "dir")) == ["m.bin"]


def test_read_only_mount(mounts: Callable[..., Mount]) -> None:
    m = mounts(mode="ro")
    data = _random_file(m.backing / "f.bin", 300_000, seed=7)
    (m.backing / "d").mkdir()

    def check() -> None:
        assert (m.path / "f.bin").read_bytes() == data
        assert os.stat(m.path / "f.bin").st_mode & 0o777 == 0o444
        assert errno_of(lambda: open(m.path / "g.bin", "wb")) == errno.EROFS
        assert errno_of(lambda: open(m.path / "f.bin", "wb")) == errno.EROFS
        assert errno_of(lambda: os.mkdir(m.path / "e")) == errno.EROFS
        assert errno_of(lambda: os.unlink(m.path / "f.bin")) == errno.EROFS
        assert errno_of(lambda: os.rename(m.path / "f.bin", m.path / "h")) == errno.EROFS
        assert errno_of(lambda: os.rmdir(m.path / "d")) == errno.EROFS

    bounded(m, check)
    assert run("cp", str(m.path / "f.bin"), str(m.path / "g.bin")).returncode != 0
    assert (m.backing / "f.bin").read_bytes() == data
    assert sorted(os.listdir(m.backing)) == ["d", "f.bin"]


def test_non_sequential_write_fails_loudly(mounts: Callable[..., Mount]) -> None:
    m = mounts()

    def check() -> tuple[int | None, int | None]:
        fd = os.open(m.path / "x.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"a" * 200_000)
            os.lseek(fd, 1000, os.SEEK_SET)
            write_err = errno_of(lambda: os.write(fd, b"b" * 100))
        finally:
            close_err = errno_of(lambda: os.close(fd))
        return write_err, close_err

    write_err, close_err = bounded(m, check)
    assert write_err == errno.EOPNOTSUPP
    assert close_err == errno.EIO  # the handle is poisoned: close() says the file is not good


def test_failed_commit_fails_cp(mounts: Callable[..., Mount], tmp_path: Path) -> None:
    m = mounts(kind="failcommit")
    src = tmp_path / "c.bin"
    _random_file(src, MiB, seed=8)
    r = run("cp", str(src), str(m.path / "c.bin"))
    assert r.returncode != 0
    assert "Input/output error" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_unmounts_cleanly(mounts: Callable[..., Mount], sig: int) -> None:
    m = mounts()
    (m.backing / "f").write_bytes(b"ok")
    assert bounded(m, lambda: (m.path / "f").read_bytes()) == b"ok"
    assert mounted_in_proc_mounts(m.path)
    m.proc.send_signal(sig)
    assert m.proc.wait(timeout=15) == 0, m.stderr()
    assert not mounted_in_proc_mounts(m.path)
    assert not is_mounted(m.path)


def test_unmount_helper_ends_the_server(mounts: Callable[..., Mount]) -> None:
    m = mounts()
    unmount(m.path)
    assert m.proc.wait(timeout=15) == 0, m.stderr()
    assert not mounted_in_proc_mounts(m.path)


def test_module_entry_point(fuse_probe: str | None, tmp_path: Path) -> None:
    """``python -m striped_fs.fuse URL MOUNTPOINT --read-only`` serves an fsspec URL."""
    need_fuse(fuse_probe)
    back, mnt = tmp_path / "back", tmp_path / "mnt"
    back.mkdir()
    mnt.mkdir()
    (back / "f").write_bytes(b"via url")
    proc = subprocess.Popen(
        [sys.executable, "-m", "striped_fs.fuse", f"file://{back}", str(mnt), "--read-only"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    m = Mount(back, mnt, proc)
    try:
        wait_mounted(mnt, MOUNT_TIMEOUT, proc)
        assert bounded(m, lambda: (mnt / "f").read_bytes()) == b"via url"
        with open("/proc/mounts", encoding="utf-8") as f:
            line = next(x for x in f if x.split()[1] == str(mnt))
        fstype, options = line.split()[2], line.split()[3].split(",")
        assert fstype == "fuse.striped_fs"
        assert {"ro", "nodev", "nosuid"} <= set(options)
    finally:
        stop_mount(m)
    assert proc.returncode == 0
    assert not mounted_in_proc_mounts(mnt)


def test_a_mount_nobody_serves_is_found_and_detached_without_a_stat(
    mounts: Callable[..., Mount],
) -> None:
    """The benchmarks' mount helpers on a FUSE mount whose server stopped answering (SIGSTOP:
    what a snapshotter gone while the FUSE holder keeps its descriptor leaves): every stat of
    its root blocks in the kernel, so they read the mount table only. Until 2026-12-03 their
    ``realpath`` hung a benchmark for 24 minutes in ``request_wait_answer``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_prefetch as bp

    m = mounts()
    m.proc.send_signal(signal.SIGSTOP)
    try:
        done: list[bool] = []
        probe = threading.Thread(target=lambda: done.append(bp.is_mounted(m.path)), daemon=True)
        probe.start()
        probe.join(10)
        assert done == [True], "is_mounted blocked on the unserved mount"
        bp.unmount(m.path, lazy=True)
        assert not mounted_in_proc_mounts(m.path)
    finally:
        m.proc.send_signal(signal.SIGCONT)


def test_unmount_without_fusermount_or_umount_uses_the_system_call(
    mounts: Callable[..., Mount], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A minimal container image has neither tool (the e2e image's lazy environment hung its
    wrapper's exit there): root unmounts with ``umount2`` itself, and the server ends."""
    m = mounts()
    (m.backing / "f").write_bytes(b"ok")
    assert bounded(m, lambda: (m.path / "f").read_bytes()) == b"ok"
    monkeypatch.setenv("PATH", "/nonexistent")
    unmount(m.path)
    assert not mounted_in_proc_mounts(m.path)
    assert m.proc.wait(timeout=15) == 0, m.stderr()
