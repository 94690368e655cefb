"""The lazy root filesystem over FUSE equals a full extraction of the same layers: every
path's type, mode, content and link target; whiteouts, opaque directories, hardlinks within
and across layers, symlinks (absolute ones included), xattrs. Reads fetch only the frames they
need, and a blob server that fails makes a read fail with EIO, never return wrong bytes."""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import tarfile
import threading
from pathlib import Path

import pytest

from prefetch.cache import BlockCache
from prefetch.fetcher import Blob, FrameFetcher
from prefetch.layer import convert_layer
from prefetch.lazyfs import Layer, LazyImage, mount
from prefetch.toc import LayerIndex
from striped_fs.fuse import is_mounted, unmount, wait_mounted

BIG = os.urandom(3 << 20) + b"tail"


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _info(
    name: str,
    kind: bytes = tarfile.REGTYPE,
    *,
    data: bytes = b"",
    mode: int = 0o644,
    link: str = "",
    pax: dict[str, str] | None = None,
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 1_700_000_000
    info.linkname = link
    if pax:
        info.pax_headers = pax
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


LOWER = [
    _info("etc", tarfile.DIRTYPE, mode=0o755),
    _info("etc/passwd", data=b"root:x:0:0\n", pax={"SCHILY.xattr.user.origin": "lower"}),
    _info("etc/hosts", data=b"127.0.0.1 localhost\n"),
    _info("etc/alternatives", tarfile.SYMTYPE, link="/usr/bin/tool"),
    _info("usr", tarfile.DIRTYPE, mode=0o755),
    _info("usr/bin", tarfile.DIRTYPE, mode=0o755),
    _info(
        "usr/bin/tool",
        data=b"#!/bin/sh\necho tool\n",
        mode=0o755,
        pax={"SCHILY.xattr.user.origin": "lower"},
    ),
    _info("usr/bin/tool2", tarfile.LNKTYPE, link="usr/bin/tool"),
    _info("usr/bin/rel", tarfile.SYMTYPE, link="tool"),
    _info("lib", tarfile.DIRTYPE, mode=0o755),
    _info("lib/big.so", data=BIG, mode=0o755),
    _info("opt", tarfile.DIRTYPE, mode=0o755),
    _info("opt/x", tarfile.DIRTYPE, mode=0o750),
    _info("opt/x/a", data=b"a"),
    _info("opt/x/b", data=b"b"),
]
UPPER = [
    _info("etc", tarfile.DIRTYPE, mode=0o755),
    _info("etc/.wh.hosts"),
    _info("etc/passwd", data=b"root:x:0:0\nuser:x:1000:1000\n", mode=0o600),
    _info("opt", tarfile.DIRTYPE, mode=0o755),
    _info("opt/x", tarfile.DIRTYPE, mode=0o750),
    _info("opt/x/.wh..wh..opq"),
    _info("opt/x/c", data=b"c"),
    _info("new", tarfile.DIRTYPE, mode=0o755),
    _info("new/big-link", tarfile.LNKTYPE, link="lib/big.so"),
    _info("new/" + "long-name-" * 12, data=b"a pax long name"),
]


def _reference(layers: list[bytes], root: Path) -> None:
    """A full extraction, applying the OCI whiteout rules by hand (independent of merge.py)."""
    root.mkdir()
    for blob in layers:
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            members = tar.getmembers()
            for m in members:
                base = os.path.basename(m.name)
                parent = root / os.path.dirname(m.name)
                if base == ".wh..wh..opq":
                    for child in list(parent.iterdir()):
                        if child.is_dir() and not child.is_symlink():
                            shutil.rmtree(child)
                        else:
                            child.unlink()
                elif base.startswith(".wh."):
                    victim = parent / base[4:]
                    if victim.is_dir() and not victim.is_symlink():
                        shutil.rmtree(victim)
                    elif victim.exists() or victim.is_symlink():
                        victim.unlink()
            for m in members:
                if os.path.basename(m.name).startswith(".wh."):
                    continue
                target = root / m.name
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    os.chmod(target, m.mode)
                    continue
                if target.exists() or target.is_symlink():
                    target.unlink()
                if m.islnk():  # containerd applies the link's header to the inode
                    os.link(root / m.linkname, target)
                    os.chmod(target, m.mode)
                elif m.issym():
                    os.symlink(m.linkname, target)
                else:
                    target.write_bytes(tar.extractfile(m).read())
                    os.chmod(target, m.mode)


def _scan(root: Path) -> dict[str, tuple]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                found[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return found


class Registry:
    """Blobs by digest, read by range; counts and can fail requests."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.requests = 0
        self.down = False

    def __call__(self, digest: str, start: int, end: int) -> bytes:
        self.requests += 1
        if self.down:
            raise ConnectionRefusedError("registry down")
        return self.blobs[digest][start:end]


@pytest.fixture
def image(tmp_path: Path):
    registry = Registry()
    layers = []
    tars = [_tar(LOWER), _tar(UPPER)]
    for i, raw in enumerate(tars):
        out = io.BytesIO()
        result = convert_layer(io.BytesIO(raw), out, frame_size=256 << 10)
        registry.blobs[result.digest] = out.getvalue()
        blob_bytes = out.getvalue()
        index = LayerIndex.from_blob(
            lambda s, e, b=blob_bytes: b[s:e], len(blob_bytes), result.digest
        )
        layers.append(Layer(index, Blob(result.digest, index.frames, i)))
    fetcher = FrameFetcher(
        registry, BlockCache(tmp_path / "cache"), connections=4, retries=1, backoff_s=0.01
    )
    yield LazyImage(layers, fetcher), registry, tars
    fetcher.close()


@pytest.fixture
def mounted(image, tmp_path: Path, fuse):
    lazy, registry, tars = image
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    thread = threading.Thread(target=mount, args=(lazy, str(mnt)), daemon=True)
    thread.start()
    wait_mounted(mnt, 10)
    yield mnt, lazy, registry, tars
    unmount(mnt)
    thread.join(10)
    assert not is_mounted(mnt)


def test_the_lazy_rootfs_equals_a_full_extraction(mounted, tmp_path: Path) -> None:
    mnt, lazy, registry, tars = mounted
    before = registry.requests
    listing = _scan_metadata(mnt)  # stat and readdir of everything: the TOCs answer
    assert registry.requests == before
    reference = tmp_path / "ref"
    _reference(tars, reference)
    assert _scan(mnt) == _scan(reference)
    assert set(listing) == set(_scan(reference))
    assert os.stat(mnt / "usr/bin/tool").st_ino == os.stat(mnt / "usr/bin/tool2").st_ino
    assert os.stat(mnt / "new/big-link").st_ino == os.stat(mnt / "lib/big.so").st_ino
    assert os.readlink(mnt / "etc/alternatives") == "/usr/bin/tool"  # absolute, as is
    assert os.getxattr(mnt / "usr/bin/tool", "user.origin") == b"lower"
    assert os.listxattr(mnt / "etc/passwd") == []  # the upper passwd replaced it, xattr too


def _scan_metadata(root: Path) -> list[str]:
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            names.append(str(Path(dirpath, name).relative_to(root)))
    return names


def test_a_read_fetches_only_its_frames(mounted) -> None:
    mnt, lazy, registry, _ = mounted
    with open(mnt / "lib/big.so", "rb") as f:
        f.seek(2 << 20)
        assert f.read(4096) == BIG[2 << 20 : (2 << 20) + 4096]
    stats = lazy.fetcher.report()
    big = lazy.layers[0].index.lookup("lib/big.so")
    total = len(lazy.layers[0].index.frames)
    assert 1 <= stats.frames_read <= 2 < total
    assert stats.bytes_fetched < big.size // 4


def test_xattrs_are_presented(image) -> None:
    lazy, _, _ = image
    node = lazy.tree.lookup("etc/passwd")
    assert node.data.entry.mode & 0o777 == 0o600  # upper layer's passwd
    lower = merge_lower(lazy)
    assert lower.lookup("etc/passwd").entry.xattrs == {"user.origin": b"lower"}


def merge_lower(lazy: LazyImage):
    from prefetch.merge import merge_layers

    return merge_layers([lazy.layers[0].entries])


def test_a_read_the_registry_cannot_serve_fails_with_eio(mounted) -> None:
    mnt, lazy, registry, _ = mounted
    registry.down = True
    with pytest.raises(OSError) as info:
        (mnt / "opt/x/c").read_bytes()
    assert info.value.errno == errno.EIO
    registry.down = False  # back: the mount keeps working
    assert (mnt / "opt/x/c").read_bytes() == b"c"


def _sigpipe_disposition() -> int:
    """The C-level SIGPIPE handler (Python's own view is cached and would not show a change
    made by libfuse)."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    current = libc.signal(signal.SIGPIPE, ctypes.c_void_p(1))
    libc.signal(signal.SIGPIPE, ctypes.c_void_p(current or 0))
    return current or 0


def test_a_mount_in_a_thread_leaves_sigpipe_ignored(image, tmp_path: Path, fuse) -> None:
    """libfuse resets SIGPIPE to "terminate" when it stops serving; a write to a closed socket
    afterwards killed the whole test run (exit 141) before mount() put it back."""
    lazy, _, _ = image
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    thread = threading.Thread(target=mount, args=(lazy, str(mnt)), daemon=True)
    thread.start()
    wait_mounted(mnt, 10)
    unmount(mnt)
    thread.join(10)
    assert _sigpipe_disposition() == 1  # SIG_IGN, as Python set it at start-up
