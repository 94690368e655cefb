"""Running containers on lazy layers keep working across a restart of the snapshotter.

A container (real containerd, runc, registry) reads files of a converted image when the test
says so, and keeps a file mapped (a static C program copies its pages through user memory, so
a failed page-in is SIGBUS). Between its reads the snapshotter is stopped with SIGTERM, killed
with SIGKILL, replaced by a successor from another copy of the code while it is still
stopping (an upgrade), or its FUSE holder is killed first and then the snapshotter. After
each, the container is still RUNNING and reads the right bytes: files it never read before
(fetched lazily by the successor), the mapped file's remaining pages, and a file read before
the restart, served from the node's block cache (the registry serves garbage by then, which a
never-read file shows). A request the killed snapshotter had read and not answered is
answered by its successor (FUSE_NOTIFY_RESEND). One snapshotter per root; an unmount ends the
connection and the holder lets go.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from containerd_helpers import SnapshotterProcess, _add, add_programs, holder_pid
from test_prefetch_image import _push_gzip_image

from bootseer.testing.shaper import Shaper, ShaperSettings
from prefetch.image import convert_image
from prefetch.registry import SyncRegistry
from striped_fs.fuse import is_mounted, unmount

pytestmark = pytest.mark.usefixtures("fuse")

REPO = Path(__file__).resolve().parents[1]
FILES = {f"f{i}": os.urandom(1536 << 10) for i in range(4)}  # six 256 KiB frames each
MAPPED = os.urandom(4 << 20)
BIG = os.urandom(3 << 20)
TOOLS = ("sh", "cat", "sha256sum", "sleep", "test")

MMAPCAT_C = r"""
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
/* mmapcat FILE READY GO: map FILE, touch its first page, create READY, wait for GO, then copy
   every page through user memory to stdout: a page that cannot be read in is SIGBUS. */
int main(int argc, char **argv) {
    struct stat st;
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0 || fstat(fd, &st) != 0) return 2;
    volatile unsigned char *p = mmap(0, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) return 2;
    unsigned char buf[4096];
    buf[0] = p[0];
    close(open(argv[2], O_CREAT | O_WRONLY, 0644));
    while (access(argv[3], F_OK) != 0) usleep(20000);
    for (off_t off = 0; off < st.st_size; off += sizeof buf) {
        size_t n = st.st_size - off < (off_t)sizeof buf ? (size_t)(st.st_size - off) : sizeof buf;
        for (size_t i = 0; i < n; i++) buf[i] = p[off + i];
        if (write(1, buf, n) != (ssize_t)n) return 3;
    }
    return 0;
}
"""

# The container: maps /data/mapped at once; then, for each go-N the test writes (a file name),
# checksums /data/NAME into out-N and its exit status into done-N.
SCRIPT = """
{ /bin/mmapcat /data/mapped /ctl/mapped /ctl/go-map; echo $? > /ctl/map-status; } \
    | sha256sum > /ctl/out-map &
i=0
while :; do
  while ! test -e /ctl/go-$i; do sleep 0.05; done
  name=$(cat /ctl/go-$i)
  sha256sum /data/$name > /ctl/out-$i 2> /ctl/err-$i
  echo $? > /ctl/done-$i
  i=$((i+1))
done
"""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mmapcat(tmp: Path) -> bytes:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the mmap reader")
    src = tmp / "mmapcat.c"
    src.write_text(MMAPCAT_C)
    subprocess.run(["gcc", "-O2", "-static", "-o", str(tmp / "mmapcat"), str(src)], check=True)
    return (tmp / "mmapcat").read_bytes()


def _layers(mmapcat: bytes) -> list[bytes]:
    tools = io.BytesIO()
    with tarfile.open(fileobj=tools, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_programs(tar, TOOLS, ("ctl", "data"))
        _add(tar, "bin/mmapcat", mmapcat, mode=0o755)
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in FILES.items():
            _add(tar, f"data/{name}", content)
        _add(tar, "data/mapped", MAPPED)
    return [tools.getvalue(), data.getvalue()]


@pytest.fixture
def link(registry):
    """The registry behind a link the test can slow down (unshaped until then)."""
    with Shaper("127.0.0.1", registry.port, ShaperSettings()) as shaper:
        yield shaper


@pytest.fixture
def image(link, tmp_path: Path) -> str:
    host = link.address
    _push_gzip_image(host, "app/restart", "v1", _layers(_mmapcat(tmp_path)))
    convert_image(f"{host}/app/restart:v1", f"{host}/app/restart:lazy", frame_size=256 << 10)
    return f"{host}/app/restart:lazy"


class Node:
    """containerd with the bootseer snapshotter (started the way a node runs it)."""

    def __init__(self, tmp_path: Path, containerd_factory) -> None:
        self.sock_dir = tempfile.mkdtemp(prefix="bsr-")
        self.tmp = tmp_path
        self.sn = self.snapshotter().start()  # before containerd, which dials it once
        self.ctd = containerd_factory(proxy_snapshotters={"bootseer": self.sn.address})
        self.old: list[SnapshotterProcess] = []
        self.jobs: list[str] = []

    def snapshotter(self, env: dict[str, str] | None = None, *extra: str) -> SnapshotterProcess:
        return SnapshotterProcess(
            self.tmp / "sn",
            os.path.join(self.sock_dir, "sn.sock"),
            self.tmp / "sn.log",
            ("--no-push-profiles", "--no-prefetch", *extra),
            env=env,
        )

    @property
    def lazy_dir(self) -> Path:
        return self.tmp / "sn" / "lazy"

    def task(self, name: str) -> str | None:
        for line in self.ctd.ctr("tasks", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == name:
                return fields[-1]
        return None

    def remove(self, name: str) -> None:
        self.ctd.ctr("tasks", "kill", "--signal", "SIGKILL", name, check=False)
        deadline = time.monotonic() + 10
        while self.task(name) not in ("STOPPED", None) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.ctd.ctr("tasks", "delete", name, check=False)
        self.ctd.ctr("containers", "delete", name, check=False)

    def close(self) -> None:
        for name in self.jobs:
            self.remove(name)
        for proc in self.old:
            proc.stop(signal.SIGKILL)
        try:
            self.sn.close()
        finally:  # a task stuck on a connection nobody served is gone now
            for name in self.jobs:
                self.remove(name)
            shutil.rmtree(self.sock_dir, ignore_errors=True)


@pytest.fixture
def node(tmp_path: Path, containerd_factory):
    node = Node(tmp_path, containerd_factory)
    yield node
    node.close()


class Job:
    """A container started with ``ctr run -d`` that reads files when told (SCRIPT)."""

    def __init__(self, node: Node, ref: str) -> None:
        # runc's state is per namespace, not per containerd: a name no other test uses
        self.node, self.ref, self.name = node, ref, f"restart-{uuid.uuid4().hex[:12]}"
        self.ctl = node.tmp / f"ctl-{self.name}"
        self.ctl.mkdir()
        self.reads = 0

    def __enter__(self) -> Job:
        from prefetch.containerd.errors import UnavailableError
        from prefetch.containerd.pull import pull_image

        ctd = self.node.ctd
        deadline = time.monotonic() + 30
        while True:
            try:
                pulled = pull_image(self.ref, ctd.address, namespace=ctd.namespace)
                break
            except UnavailableError:  # containerd redials a restarted snapshotter after its
                if time.monotonic() > deadline:  # gRPC backoff (3 s at most): fails till then
                    raise
                time.sleep(0.5)
        assert pulled.lazy_layers == 2
        self.node.jobs.append(self.name)
        ctd.ctr(
            "run",
            "-d",
            "--snapshotter",
            "bootseer",
            "--mount",
            f"type=bind,src={self.ctl},dst=/ctl,options=rbind:rw",
            self.ref,
            self.name,
            "/bin/sh",
            "-c",
            SCRIPT,
        )
        self._wait(self.ctl / "mapped", line=False)  # mapped, its first page read
        return self

    def __exit__(self, *exc: object) -> None:
        self.node.remove(self.name)

    def status(self) -> str | None:
        return self.node.task(self.name)

    def _wait(self, path: Path, timeout_s: float = 60.0, line: bool = True) -> str:
        deadline = time.monotonic() + timeout_s
        while not (path.exists() and (not line or path.read_text().endswith("\n"))):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{path.name} did not come (task {self.status()}):\n{self.node.sn.log()}"
                )
            time.sleep(0.05)
        return path.read_text()

    def go(self, name: str) -> int:
        """Have the container checksum /data/NAME; returns the read's number."""
        n, self.reads = self.reads, self.reads + 1
        tmp = self.ctl / f".go-{n}"
        tmp.write_text(name)
        tmp.rename(self.ctl / f"go-{n}")
        return n

    def result(self, n: int) -> tuple[int, str]:
        """(exit status of sha256sum, the checksum it printed)."""
        status = int(self._wait(self.ctl / f"done-{n}"))
        out = (self.ctl / f"out-{n}").read_text().split()
        return status, out[0] if out else ""

    def read(self, name: str) -> tuple[int, str]:
        return self.result(self.go(name))

    def mapped(self) -> tuple[int, str]:
        """Let the mapping program copy every page; (its exit status, the checksum)."""
        (self.ctl / "go-map").touch()
        digest = self._wait(self.ctl / "out-map").split()[0]
        return int(self._wait(self.ctl / "map-status")), digest


def _code_copy(dst: Path) -> dict[str, str]:
    """Another installation of this code (an upgrade's new version), and the environment that
    runs it."""
    for package in ("bootseer", "prefetch", "striped_fs", "snapshot", "ckpt"):
        if (REPO / package).is_dir():
            shutil.copytree(
                REPO / package, dst / package, ignore=shutil.ignore_patterns("__pycache__")
            )
    return {**os.environ, "PYTHONPATH": str(dst)}


def _wait_log(sn: SnapshotterProcess, text: str, count: int = 1, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sn.log_path.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in the snapshotter's log:\n{sn.log()}")
        time.sleep(0.05)


def _evict(lazy_dir: Path, path: str) -> None:
    """Drop the kernel's cached pages of ``path`` in the lazy views (the next read goes to
    the snapshotter)."""
    for view in lazy_dir.iterdir():
        target = view / path.lstrip("/")
        if target.exists():
            fd = os.open(target, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restart(node: Node, how: str) -> None:
    if how == "term":
        node.sn.stop(signal.SIGTERM)
        assert is_mounted(node.lazy_dir)  # the holder keeps it for the next start
        node.sn.start()
    elif how == "kill-9":
        node.sn.stop(signal.SIGKILL)
        node.sn.start()
    elif how == "upgrade":  # a new version starts while the old one is still stopping
        old = node.sn
        old.proc.send_signal(signal.SIGTERM)
        node.old.append(old)
        node.sn = node.snapshotter(_code_copy(node.tmp / "v2")).start()
        assert old.proc.wait(timeout=30) == 0
    elif how == "holder-kill-9":  # the holder dies; the snapshotter deposits with a new one
        os.kill(holder_pid(node.sn.holder_address), signal.SIGKILL)
        _wait_log(node.sn, "the FUSE holder holds")
        node.sn.stop(signal.SIGKILL)
        node.sn.start()
    else:
        raise ValueError(how)
    _wait_log(node.sn, "lazy mount taken over")


@pytest.mark.parametrize("how", ["term", "kill-9", "upgrade", "holder-kill-9"])
def test_running_containers_keep_reading_across_a_restart(image, node, link, registry, how) -> None:
    with Job(node, image) as job:
        assert job.read("f0") == (0, _sha(FILES["f0"]))
        _restart(node, how)
        assert job.status() == "RUNNING"
        # never read before the restart: fetched lazily by the successor
        assert job.read("f1") == (0, _sha(FILES["f1"]))
        assert job.mapped() == (0, _sha(MAPPED))  # no SIGBUS: every page came in
        # The registry now serves garbage: a file never fetched fails (EIO, the frames do
        # not verify), a file read before the restart is served from the node's cache.
        with SyncRegistry(registry.host) as reg:
            layer = reg.resolve_image(image.replace(link.address, registry.host)).layers[1]
        blob = registry.blob_path(layer.digest)
        blob.write_bytes(bytes(len(blob.read_bytes())))
        n = job.go("f3")
        assert job.result(n)[0] != 0
        assert "Input/output error" in (job.ctl / f"err-{n}").read_text()
        _evict(node.lazy_dir, "/data/f0")
        assert job.read("f0") == (0, _sha(FILES["f0"]))
        assert job.status() == "RUNNING"
    assert "Transport endpoint is not connected" not in node.sn.log()


def test_a_request_the_killed_snapshotter_had_read_is_answered_by_its_successor(
    image, node, link
) -> None:
    with Job(node, image) as job:
        assert job.read("f0") == (0, _sha(FILES["f0"]))
        link.update(ShaperSettings(per_conn_bps=64e3))  # a 256 KiB frame takes 4 s
        before = link.bytes_down
        n = job.go("f2")
        deadline = time.monotonic() + 30
        while link.bytes_down == before:  # the snapshotter read the request: it fetches
            assert time.monotonic() < deadline, node.sn.log()
            time.sleep(0.01)
        node.sn.stop(signal.SIGKILL)  # mid-fetch: the request is read and unanswered
        link.update(ShaperSettings())
        node.sn.start()
        assert job.result(n) == (0, _sha(FILES["f2"]))
        assert job.status() == "RUNNING"
    assert "answering requests a predecessor had read and left unanswered" in node.sn.log()


def test_one_snapshotter_per_root(image, node) -> None:
    address = os.path.join(node.sock_dir, "second.sock")
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "snapshotter",
            "--root",
            str(node.sn.root),
            "--address",
            address,
            "--holder",
            node.sn.holder_address,
            "--takeover-wait",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert f"is served by pid {node.sn.proc.pid}: one snapshotter per root" in second.stderr
    assert not os.path.exists(address)
    with Job(node, image) as job:  # the first one still serves
        assert job.read("f1") == (0, _sha(FILES["f1"]))


def test_an_unmount_ends_the_connection_and_the_next_start_mounts_anew(image, node) -> None:
    with Job(node, image) as job:
        assert job.read("f0") == (0, _sha(FILES["f0"]))
    node.sn.stop(signal.SIGTERM)
    assert is_mounted(node.lazy_dir)
    unmount(node.lazy_dir, lazy=True)
    deadline = time.monotonic() + 15
    while os.path.exists(node.sn.holder_address):  # nothing held, nobody connected: it exits
        assert time.monotonic() < deadline, node.sn.log()
        time.sleep(0.05)
    assert "FUSE holder: the connection of" in node.sn.log()
    node.sn.start()
    _wait_log(node.sn, "lazy mount new", count=2)
    assert stat.S_IMODE(os.stat(node.lazy_dir).st_mode) == 0o700
    with Job(node, image) as job:  # every snapshot is served again
        assert job.read("f3") == (0, _sha(FILES["f3"]))


# -- the parts on their own: the FUSE server on the kernel, node ids, the holder -------------


def _tree_layer() -> bytes:
    """A directory of 300 long names (READDIR pages), a 3 MiB file, links, an xattr, a name
    that is not UTF-8."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "many", kind=tarfile.DIRTYPE, mode=0o755)
        for i in range(300):
            _add(tar, f"many/{i:04d}-{'n' * 60}", f"{i}\n".encode())
        _add(tar, "big.bin", BIG)
        _add(tar, "link", kind=tarfile.SYMTYPE, link="big.bin")
        _add(tar, os.fsdecode(b"caf\xe9"), b"latin-1 name\n")  # a name that is not UTF-8
        _add(tar, "to-cafe", kind=tarfile.SYMTYPE, link=os.fsdecode(b"caf\xe9"))
        info = tarfile.TarInfo("tagged")
        info.size, info.mtime = 3, 1_700_000_000
        info.pax_headers = {"SCHILY.xattr.user.origin": "layer"}
        tar.addfile(info, io.BytesIO(b"tag"))
    return out.getvalue()


class _Blobs:
    """The converted layer's bytes, read by range; counts the reads (each server's own)."""

    def __init__(self, blob: bytes) -> None:
        self.blob, self.reads = blob, 0

    def __call__(self, digest: str, start: int, end: int) -> bytes:
        self.reads += 1
        return self.blob[start:end]


def _views(raw: bytes, cache: Path, blobs: _Blobs):
    """ViewOperations showing ``raw`` as view 1, as a fresh snapshotter process would."""
    from prefetch.cache import BlockCache
    from prefetch.containerd.views import ViewOperations
    from prefetch.fetcher import Blob, FrameFetcher
    from prefetch.layer import convert_layer
    from prefetch.lazyfs import Layer, LazyImage
    from prefetch.toc import LayerIndex

    out = io.BytesIO()
    result = convert_layer(io.BytesIO(raw), out, frame_size=256 << 10)
    blobs.blob = out.getvalue()
    index = LayerIndex.from_blob(lambda s, e: blobs.blob[s:e], len(blobs.blob), result.digest)
    fetcher = FrameFetcher(blobs, BlockCache(cache), connections=4, retries=0)
    views = ViewOperations()
    views.register(1, lambda: LazyImage([Layer(index, Blob(result.digest, index.frames))], fetcher))
    return views, fetcher


def test_a_successor_serves_the_node_ids_and_handles_its_predecessor_gave_out(tmp_path) -> None:
    """Through the kernel: a file opened and a directory half listed under one server are
    read and listed to the end under a successor that shares nothing with it but the
    connection (its own views, tree, fetcher and cache)."""
    from prefetch.containerd.fuseserver import Connection, FuseServer
    from prefetch.containerd.views import mount_views

    mnt = tmp_path / "mnt"
    mnt.mkdir(mode=0o700)
    raw = _tree_layer()
    conn = mount_views(str(mnt))  # this test holds the connection, as the holder does
    servers = []
    try:
        first_blobs = _Blobs(b"")
        views, fetcher = _views(raw, tmp_path / "cache-1", first_blobs)
        views.mounted_at = conn.meta["mounted_at"]
        first = FuseServer(views, Connection(os.dup(conn.fd), str(mnt), conn.meta))
        servers.append(first)
        first.start()
        names = sorted(f"{i:04d}-{'n' * 60}" for i in range(300))
        root = mnt / "1"
        assert os.listdir(mnt) == ["1"]
        with open(root / "big.bin", "rb", buffering=0) as f, os.scandir(root / "many") as it:
            assert f.read(65536) == BIG[:65536]
            seen = [next(it).name for _ in range(50)]
            before = os.stat(root / "big.bin")
            assert first.stop()
            first.conn.close()

            second_blobs = _Blobs(b"")
            views, fetcher2 = _views(raw, tmp_path / "cache-2", second_blobs)
            views.mounted_at = conn.meta["mounted_at"]
            second = FuseServer(views, Connection(os.dup(conn.fd), str(mnt), conn.meta))
            servers.append(second)
            assert second.resend()
            second.start()
            seen += [entry.name for entry in it]  # the predecessor's handle and offset
            f.seek(2 << 20)
            assert f.read(1 << 20) == BIG[2 << 20 : 3 << 20]  # its node id, its open file
        assert second_blobs.reads > 0  # served by the successor's own fetcher
        assert sorted(seen) == names and len(seen) == len(set(seen))
        after = os.stat(root / "big.bin")
        assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
            before.st_ino,
            before.st_mtime_ns,
            before.st_size,
        )
        assert os.readlink(root / "link") == "big.bin"
        assert b"caf\xe9" in os.listdir(bytes(root))  # names are bytes, as on any Linux fs
        assert (root / os.fsdecode(b"caf\xe9")).read_bytes() == b"latin-1 name\n"
        assert os.readlink(bytes(root / "to-cafe")) == b"caf\xe9"
        assert os.getxattr(root / "tagged", "user.origin") == b"layer"
        assert os.listxattr(root / "tagged") == ["user.origin"]
        assert (root / "many" / names[-1]).read_bytes() == f"{int(names[-1][:4])}\n".encode()
        with pytest.raises(OSError) as refused:
            open(root / "big.bin", "r+b")  # noqa: SIM115
        assert refused.value.errno == errno.EROFS
        assert not (root / "missing").exists()
        fetcher.close()
        fetcher2.close()
    finally:
        unmount(mnt, lazy=True)
        for server in servers:
            server.stop()
        conn.close()
    assert servers[-1].ended.is_set()  # an unmount ends the connection


def test_node_ids_come_from_paths_and_collisions_resolve_the_same_everywhere() -> None:
    from prefetch.containerd.nodeids import VIEW_SHIFT, ViewNodeIds, _hash

    a, b = "/d/f1569505", "/d/f2178348"  # found by search: equal 40-bit hashes
    assert _hash(a) == _hash(b)
    paths = ["/", "/d", b, "/x", a]
    ids = ViewNodeIds(7, lambda: paths)
    successor = ViewNodeIds(7, lambda: list(reversed(paths)))  # another process, order
    h = _hash(a)
    assert ids.nodeid(a) == (7 << VIEW_SHIFT) | h  # the first in sorted order keeps it
    assert ids.nodeid(b) == (7 << VIEW_SHIFT) | (h + 1)
    assert [ids.nodeid(p) for p in paths] == [successor.nodeid(p) for p in paths]
    assert len({ids.nodeid(p) for p in paths}) == len(paths)
    assert all(successor.path_of(ids.nodeid(p)) == p for p in paths)
    assert successor.path_of((7 << VIEW_SHIFT) | 12345) is None
    assert ViewNodeIds(8, lambda: paths).nodeid("/x") >> VIEW_SHIFT == 8
    with pytest.raises(ValueError, match="beyond the node id space"):
        ViewNodeIds(1 << 24, lambda: paths)


@pytest.fixture
def holder(tmp_path: Path):
    """A FUSE holder process on a socket in a private directory."""
    sock_dir = tempfile.mkdtemp(prefix="bsh-")
    address = os.path.join(sock_dir, "h.sock")
    log = open(tmp_path / "holder.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetch.containerd.holder", "--address", address],
        stdout=log,
        stderr=log,
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(address):
        assert proc.poll() is None and time.monotonic() < deadline, (
            tmp_path / "holder.log"
        ).read_text()
        time.sleep(0.05)
    yield address, proc, tmp_path / "holder.log"
    proc.terminate()
    proc.wait(timeout=10)
    log.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def test_the_holder_keeps_a_connection_for_one_owner_at_a_time(holder, tmp_path) -> None:
    from prefetch.containerd.fuseserver import alive
    from prefetch.containerd.holder import HolderClient, HolderError
    from prefetch.containerd.views import mount_views

    address, proc, log = holder
    mnt = tmp_path / "mnt"
    mnt.mkdir(mode=0o700)
    first, second = HolderClient(address, spawn=False), HolderClient(address, spawn=False)
    try:
        assert first.take("lazy") is None
        conn = mount_views(str(mnt))
        first.keep("lazy", conn.fd, conn.meta)
        conn.close()  # only the holder has the connection now
        assert is_mounted(mnt)
        with pytest.raises(HolderError, match=f"served by pid {os.getpid()}: one snapshotter"):
            second.take("lazy")
        assert second.held()["lazy"]["owner"] == os.getpid()
        first.close()  # the owner goes (a stop, a kill -9): the next one takes over
        fd, meta = second.take("lazy")
        try:
            assert meta == {**conn.meta} and alive(fd)
        finally:
            os.close(fd)
        unmount(mnt, lazy=True)  # the connection ends: the holder closes its descriptor
        deadline = time.monotonic() + 15
        while second.held():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert "the connection of lazy ended (unmounted)" in log.read_text()
        with pytest.raises(HolderError, match="put takes one descriptor"):
            second._call({"op": "put", "name": "lazy", "meta": {}})
    finally:
        first.close()
        second.close()
        if is_mounted(mnt):
            unmount(mnt, lazy=True)
    assert proc.poll() is None  # a holder service keeps running when idle


def test_the_holder_refuses_other_users_and_a_second_holder(holder, tmp_path) -> None:
    from unprivileged import as_nobody, need_setpriv

    need_setpriv()
    address, proc, log = holder
    os.chmod(os.path.dirname(address), 0o755)  # a mistake in the modes: the peer check holds
    os.chmod(address, 0o666)
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        f"s.connect({address!r})\n"
        "try:\n"
        '    s.send(b\'{"op": "list"}\')\n'
        "    print(repr(s.recv(99)))\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    print(repr(b''))\n"
    )
    out = as_nobody(sys.executable, "-I", "-c", code)
    assert out.stdout.strip() == "b''", out.stderr  # closed without an answer
    assert "refused a connection of pid" in log.read_text()
    again = subprocess.run(
        [sys.executable, "-m", "prefetch.containerd.holder", "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 1 and "another FUSE holder serves" in again.stderr
    assert proc.poll() is None and os.path.exists(address)


def test_the_deploy_files_keep_the_holder_out_of_the_snapshotters_restarts() -> None:
    """The holder runs on its own (a systemd unit a restart of the snapshotter's never stops, a
    DaemonSet rolled by hand), on the socket the snapshotter is told, which does not start a
    holder of its own (one would die with the snapshotter's cgroup or pod)."""
    import configparser
    import shlex

    import yaml

    from bootseer.cli import build_parser
    from bootseer.config import config_from_args

    def unit(name: str) -> configparser.ConfigParser:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.read_string((REPO / "deploy/systemd" / name).read_text().replace("\\\n", " "))
        return parser

    sn_unit, holder_unit = (
        unit("bootseer-snapshotter.service"),
        unit("bootseer-fuse-holder.service"),
    )
    for dep in ("Requires", "BindsTo", "PartOf", "Requisite"):  # no restart reaches the holder
        assert "bootseer-fuse-holder" not in sn_unit["Unit"].get(dep, "")
        assert "bootseer-snapshotter" not in holder_unit["Unit"].get(dep, "")
    assert "bootseer-fuse-holder.service" in sn_unit["Unit"]["Wants"]
    assert holder_unit["Service"]["UMask"] == "0077"
    sets = {
        "bootseer-fuse-holder": yaml.safe_load(
            (REPO / "deploy/kubernetes/fuse-holder.yaml").read_text()
        ),
        "bootseer-snapshotter": yaml.safe_load(
            (REPO / "deploy/kubernetes/daemonset.yaml").read_text()
        ),
    }
    assert sets["bootseer-fuse-holder"]["spec"]["updateStrategy"]["type"] == "OnDelete"
    commands = {
        "systemd": (
            shlex.split(holder_unit["Service"]["ExecStart"])[1:],
            shlex.split(sn_unit["Service"]["ExecStart"])[1:],
        )
    }
    pods = {}
    for name, ds in sets.items():
        assert ds["metadata"]["name"] == name
        pods[name] = ds["spec"]["template"]["spec"]
    commands["kubernetes"] = tuple(
        pods[n]["containers"][0]["command"][1:]
        for n in ("bootseer-fuse-holder", "bootseer-snapshotter")
    )
    for where, (holder_cmd, sn_cmd) in commands.items():
        holder_args = build_parser().parse_args(holder_cmd)
        cfg = config_from_args(build_parser().parse_args(sn_cmd), env={}).snapshotter
        assert (holder_cmd[0], sn_cmd[0]) == ("fuse-holder", "snapshotter"), where
        assert cfg.holder == holder_args.address and not cfg.spawn_holder, where
    mounts = {
        n: {m["mountPath"]: m["name"] for m in p["containers"][0]["volumeMounts"]}
        for n, p in pods.items()
    }
    host = {
        n: {v["name"]: v.get("hostPath", {}).get("path") for v in p["volumes"]}
        for n, p in pods.items()
    }
    sock_dir = os.path.dirname(cfg.holder)
    assert {host[n][mounts[n][sock_dir]] for n in pods} == {sock_dir}  # one socket for both
