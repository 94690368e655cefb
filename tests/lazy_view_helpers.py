"""An image built outside bootseer's own writers, and a path-by-path comparison of two trees.

Three layers, each a plain OCI tar layer:

* layer 0, a small root filesystem written by GNU tar (``--format=pax --xattrs --sparse``)
  from a directory made on disk as root: owners, setuid/setgid/sticky modes, a hardlink group,
  xattrs with binary values, character and block devices, fifos, a PAX 1.0 sparse file, long
  and odd names (spaces, a newline, bytes that are not UTF-8, leading dashes, 255-byte
  components, paths over 255 bytes), symlinks (absolute, relative, dangling, multi-byte and
  non-UTF-8 targets), an mtime of 0 and nanosecond mtimes, mtimes before 1970 and in 2400
  (containerd's unpack shows any time outside [1970, 2262] as 0), a symlink ``s2d``;
* layer 1, written header by header with Python's tarfile (PAX): a whiteout of a file, of a
  directory and of one name of a hardlink group, every file/dir/symlink/device/fifo type swap
  over layer 0, hardlinks within the layer (to a file, to a symlink, and through a symlinked
  directory), a member written through a symlinked directory, parents the layer does not list
  (new ones, and a 0700 one of layer 0 with an xattr),
  a symlink whose header says 0755, a non-UTF-8 name, mtime 0, devices, times before 1970
  (with nanoseconds), in 2400 and with ten fractional digits, on files, a directory and a
  hardlink's header; ``s2d`` made a directory holding ``inside.txt``;
* layer 2, by GNU tar in its own format (``--format=gnu``): an opaque directory, a whiteout,
  GNU long names and long link targets, a file with holes (stored dense: containerd refuses
  GNU's own sparse members), a file rewritten, and the whiteout of ``s2d/inside.txt`` (in a
  mixed stack, layer 0 unpacked below, overlayfs does not merge ``s2d`` with layer 0's
  symlink, so a whiteout left in the view's ``s2d`` would be listed).

:func:`scan` records every path of a tree (type, mode, owner, size, mtime in ns, link target
bytes, device numbers, xattrs, sha256 of the content, and which paths share an inode);
:func:`differences` lists where two scans disagree, one line per path and field.
:func:`lazy_image` and :func:`mounted` serve small layers lazily in this process, for tests of
one case each.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import subprocess
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prefetch.cache import BlockCache
from prefetch.fetcher import Blob, FrameFetcher
from prefetch.layer import convert_layer
from prefetch.lazyfs import Layer, LazyImage, mount
from prefetch.merge import LowerDir
from prefetch.toc import LayerIndex
from striped_fs.fuse import is_mounted, unmount, wait_mounted

T0 = 1_700_000_000_123_456_789  # a nanosecond mtime
PRE_1970 = -315_619_199_876_543_211  # 1960-01-01T00:00:00.123456789 (ext4 keeps it)
Y2400 = 13_569_465_600_000_000_007  # 2400-01-01, past what a Go time.Time of ns holds
BIG = hashlib.sha256(b"big").digest() * (3 << 15)  # 3 MiB: spans frames
NON_UTF8 = b"\xff\xfe-latin1"
LONG = "long-" * 30  # 150 bytes: past ustar's 100-byte name field


def _gnu_tar(root: Path, fmt: str) -> bytes:
    args = [
        "tar",
        f"--format={fmt}",
        "--numeric-owner",
        "--sort=name",
        "-C",
        str(root),
        "-cf",
        "-",
        ".",
    ]
    if fmt == "pax":  # containerd refuses GNU's own sparse members (type S): PAX ones only
        args[1:1] = ["--xattrs", "--xattrs-include=user.*", "--sparse"]
    return subprocess.run(args, check=True, capture_output=True).stdout


def _write(
    path: Path | bytes,
    data: bytes,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
) -> None:
    with open(path, "wb") as f:
        f.write(data)
    os.chown(path, uid, gid)
    os.chmod(path, mode)


def _mkdir(path: Path, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


def _times(root: Path, special: dict[str, int]) -> None:
    """Every path under ``root`` (children before parents) gets mtime T0, or ``special``'s."""
    for dirpath, dirnames, filenames in os.walk(bytes(root), topdown=False):
        for name in [*filenames, *dirnames, b""]:
            path = os.path.join(dirpath, name) if name else dirpath
            rel = os.path.relpath(path, bytes(root)).decode("utf-8", "surrogateescape")
            t = special.get(rel, T0)
            os.utime(path, ns=(t, t), follow_symlinks=False)


def _layer0(root: Path) -> bytes:
    _mkdir(root, 0o755)
    usr = _mkdir(root / "usr")
    bin_ = _mkdir(usr / "bin")
    lib = _mkdir(usr / "lib")
    os.symlink("usr/bin", root / "bin")
    _write(bin_ / "tool", b"#!/bin/sh\necho tool\n" * 500, 0o755)
    os.setxattr(bin_ / "tool", "user.origin", b"\x00\xffbinary")
    os.link(bin_ / "tool", bin_ / "tool-hl1")
    os.link(bin_ / "tool", bin_ / "tool-hl2")
    _write(bin_ / "su", b"setuid\n", 0o4755)
    _write(bin_ / "wall", b"setgid\n", 0o2755, gid=5)
    _write(lib / "big.so", BIG, 0o755)
    with open(lib / "sparse.img", "wb") as f:  # a hole, data, a hole, data, a hole
        f.seek(8192)
        f.write(b"first extent" * 400)
        f.seek(5 << 20)
        f.write(b"second extent" * 1000)
        f.truncate(8 << 20)
    etc = _mkdir(root / "etc")
    os.setxattr(etc, "user.dir", b"1")
    _write(etc / "hosts", b"127.0.0.1 localhost\n")
    _write(etc / "removed.txt", b"deleted by layer 1\n")
    _write(etc / "shadow", b"root:*:19000::::::\n", 0o640, gid=42)
    _write(_mkdir(etc / "dir-to-file") / "child", b"gone with its directory\n")
    _write(etc / "file-to-dir", b"becomes a directory\n")
    _write(etc / "file-to-link", b"becomes a symlink\n")
    os.symlink("hosts", etc / "link-to-file")
    os.symlink("../usr", etc / "link-to-dir")
    _write(_mkdir(etc / "dir-to-link") / "child", b"gone, a symlink replaces the dir\n")
    os.mknod(etc / "dev-to-file", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    _write(etc / "file-to-fifo", b"becomes a fifo\n")
    _write(
        _mkdir(root / "home/user", 0o700, 1000, 1000) / ".profile", b"PS1=$\n", 0o600, 1000, 1000
    )
    os.setxattr(root / "home/user", "user.home", b"kept")
    os.chown(root / "home", 0, 0)
    _mkdir(root / "tmp", 0o1777)
    dev = _mkdir(root / "dev")
    os.mknod(dev / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(dev / "loop0", 0o660 | stat.S_IFBLK, os.makedev(7, 0))
    os.chown(dev / "loop0", 0, 6)
    os.mkfifo(dev / "initctl", 0o600)
    log = _mkdir(root / "var/log")
    for name in ("syslog", "dpkg.log"):
        _write(log / name, f"{name}\n".encode())
    cache = _mkdir(root / "var/cache")
    _write(cache / "a", b"a\n")
    _write(_mkdir(cache / "sub") / "c", b"c\n")
    names = _mkdir(root / "names")
    for name in ("with space", "new\nline", "-leading-dash", "--", "é名前", ".hidden", "x" * 255):
        _write(names / name, name.encode() + b"\n")
    _write(os.path.join(bytes(names), NON_UTF8), b"latin-1 name\n")
    deep = _mkdir(names / ("d" * 100) / ("e" * 100))
    _write(deep / ("f" * 100), b"a path of over 300 bytes\n")
    links = _mkdir(root / "links")
    for name, target in (
        ("abs", b"/etc/hosts"),
        ("rel", b"../etc/hosts"),
        ("utf8", "ターゲット/ファイル".encode()),
        ("nonutf8", b"\xff\xfe"),
        ("dangling", b"nowhere"),
        ("long", b"t" * 200),
    ):
        os.symlink(target, os.path.join(bytes(links), name.encode()))
    times = _mkdir(root / "times")
    _write(times / "zero", b"mtime 0\n")
    _write(times / "y2100", b"mtime in 2100\n")
    _write(times / "pre1970", b"mtime in 1960\n")
    _write(times / "y2400", b"mtime in 2400\n")
    _mkdir(times / "olddir")
    os.symlink("usr", root / "s2d")  # layer 1 makes it a directory
    _times(
        root,
        {
            "times/zero": 0,
            "times/y2100": 4_102_444_800_000_000_001,
            "usr/lib/big.so": T0 + 1,
            "times/pre1970": PRE_1970,
            "times/y2400": Y2400,
            "times/olddir": PRE_1970 - 1,
            "s2d": PRE_1970,
        },
    )
    return _gnu_tar(root, "pax")


@dataclass
class Member:
    """One tar member, every header field explicit."""

    name: str
    kind: bytes = tarfile.REGTYPE
    data: bytes = b""
    mode: int = 0o644
    link: str = ""
    uid: int = 0
    gid: int = 0
    mtime_ns: int = T0
    dev: tuple[int, int] = (0, 0)
    pax: dict[str, str] = field(default_factory=dict)


def tar(members: list[Member]) -> bytes:
    """A PAX tar stream of ``members``, in order (names may hold surrogate escapes)."""
    out = io.BytesIO()
    with tarfile.open(
        fileobj=out, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape"
    ) as tf:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type, info.mode, info.linkname = m.kind, m.mode, m.link
            info.uid, info.gid, info.devmajor, info.devminor = m.uid, m.gid, *m.dev
            info.mtime = m.mtime_ns // 10**9
            info.pax_headers = dict(m.pax)
            if m.mtime_ns % 10**9 and "mtime" not in m.pax:  # tarfile would write a float
                sign, whole = "-" if m.mtime_ns < 0 else "", abs(m.mtime_ns)  # PAX: sign, digits
                info.pax_headers["mtime"] = f"{sign}{whole // 10**9}.{whole % 10**9:09d}"
            if m.kind == tarfile.REGTYPE:
                info.size = len(m.data)
            tf.addfile(info, io.BytesIO(m.data) if m.kind == tarfile.REGTYPE else None)
    return out.getvalue()


def _layer1() -> bytes:
    D, S, L = tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
    C, B, F = tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE
    bad = NON_UTF8.decode("utf-8", "surrogateescape")
    return tar(
        [
            Member("etc", D, mode=0o755, pax={"SCHILY.xattr.user.dir": "2"}),
            Member("etc/.wh.removed.txt"),
            Member("etc/dir-to-file", data=b"was a directory\n"),
            Member("etc/file-to-dir", D, mode=0o750),
            Member("etc/file-to-dir/child", data=b"child\n"),
            Member("etc/file-to-link", S, mode=0o755, link="hosts"),
            Member("etc/link-to-file", data=b"was a symlink\n"),
            Member("etc/link-to-dir", D, mode=0o755),
            Member("etc/link-to-dir/child", data=b"child\n"),
            Member("etc/dir-to-link", S, mode=0o777, link="../usr"),
            Member("etc/dev-to-file", data=b"was a device\n", mode=0o600),
            Member("etc/file-to-fifo", F, mode=0o644),
            Member("var/.wh.log"),
            Member("usr/bin/.wh.tool-hl2"),
            Member("new", D, mode=0o750, uid=1000, gid=1000),
            Member("new/a", data=b"hardlinked in its layer\n", mode=0o640, uid=1000),
            Member(
                "new/a-hl",
                L,
                link="new/a",
                mode=0o600,
                uid=1000,
                pax={"SCHILY.xattr.user.link": "added by the hardlink's header"},
            ),
            Member(
                "new/a-hl2", L, link="./new/a", mode=0o604, uid=1001, gid=1001, mtime_ns=T0 + 7
            ),  # the last header naming the inode decides
            Member("new/sym", S, link="a"),
            Member("new/sym-hl", L, link="new/sym"),  # a hardlink to a symlink
            Member("new/real", D),
            Member("new/real/x", data=b"x\n"),
            Member("new/sd", S, link="real"),
            Member("new/via-sd", L, link="new/sd/x"),  # a hardlink through a symlinked dir
            Member("new/sd/y", data=b"written through a symlinked dir\n"),
            Member("new/zero-mtime", data=b"mtime 0\n", mtime_ns=0),
            Member("new/zero-dir", D, mtime_ns=0),
            Member(f"new/{bad}", data=b"a name that is not UTF-8\n"),
            Member("new/utf8-link", S, link="ターゲット"),  # 15 bytes, 5 characters
            Member(f"new/{LONG}", data=b"a long name\n"),
            Member("new/long-link", S, link="/" + LONG * 2),
            Member("new/implied/deeper/file", data=b"parents not listed\n"),
            Member("new/tty", C, mode=0o620, gid=5, dev=(4, 64)),
            Member("new/sda1", B, mode=0o660, gid=6, dev=(8, 1)),
            Member(
                "new/xattrs",
                data=b"xattrs\n",
                pax={"SCHILY.xattr.user.text": "value", "SCHILY.xattr.user.bin": "\x00\udcff\x01"},
            ),
            Member("new/-dash", data=b"-\n"),
            Member(
                "home/user/.bashrc", data=b"set -o vi\n", uid=1000, gid=1000
            ),  # parents unlisted
            Member("old", D, mode=0o755, mtime_ns=-1),  # 1969-12-31T23:59:59.999999999
            Member("old/neg-ns", data=b"-1.5 s\n", mtime_ns=-1_500_000_000),
            Member("old/y2400", data=b"2400\n", mtime_ns=Y2400),
            Member("old/max", data=b"the last ns Go holds\n", mtime_ns=(1 << 63) - 1),
            Member("old/past-max", data=b"one ns later\n", mtime_ns=1 << 63),
            Member(
                "old/ten-digits",
                data=b"ten fractional digits\n",
                pax={"mtime": "1700000000.1234567899"},
            ),  # Go keeps nine, truncated
            Member(
                "old/neg-ten-digits", data=b"negative, ten digits\n", pax={"mtime": "-0.0000000019"}
            ),
            Member("old/linked", data=b"its hardlink's header dates it\n"),
            Member("old/hl-1960", L, link="old/linked", mtime_ns=PRE_1970),  # the inode's time
            Member("s2d", D, mode=0o755),  # over layer 0's symlink
            Member("s2d/inside.txt", data=b"deleted by layer 2\n"),
            Member("s2d/kept.txt", data=b"kept\n"),
        ]
    )


def _layer2(root: Path) -> bytes:
    _mkdir(root, 0o755)
    cache = _mkdir(root / "var/cache")
    _write(cache / ".wh..wh..opq", b"")
    _write(cache / "fresh", b"after the opaque marker\n")
    lib = _mkdir(root / "usr/lib")
    _write(lib / ".wh.big.so", b"")
    with open(lib / "holes.img", "wb") as f:
        f.seek(1 << 20)
        f.write(b"old GNU sparse" * 500)
        f.truncate(3 << 20)
    etc = _mkdir(root / "etc")
    os.setxattr(etc, "user.dir", b"2")  # GNU format drops xattrs: the dir keeps none
    _write(etc / "hosts", b"127.0.0.1 localhost rewritten\n")
    _write(_mkdir(root / "s2d") / ".wh.inside.txt", b"")
    gnu = _mkdir(root / "gnu")
    _write(gnu / ("g" * 180), b"a GNU long name\n")
    os.symlink("k" * 180, gnu / "long-target")
    _times(root, {})
    return _gnu_tar(root, "gnu")


def build_layers(work: Path) -> list[bytes]:
    """The three tar layers (see the module), built under ``work`` (a private directory)."""
    return [_layer0(work / "layer0"), _layer1(), _layer2(work / "layer2")]


# --- scanning and comparing -------------------------------------------------------------------


@dataclass(frozen=True)
class Scan:
    """What a tree shows: per path (bytes, relative), its fields; and the hardlink groups."""

    paths: dict[bytes, dict[str, object]]
    links: frozenset[frozenset[bytes]]


def _xattrs(path: bytes) -> dict[str, bytes]:
    out = {}
    for name in os.listxattr(path, follow_symlinks=False):
        if name.startswith("trusted.overlay."):
            continue
        out[name] = os.getxattr(path, name, follow_symlinks=False)
    return out


def _sha256(path: bytes) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def scan(root: Path, *, unpacked_after_ns: int) -> Scan:
    """Every path under ``root``. A directory whose mtime is at or after
    ``unpacked_after_ns`` got it from the unpack (a parent no layer listed, one a member was
    created in): its mtime is recorded as ``"unpack time"``."""
    paths: dict[bytes, dict[str, object]] = {}
    inodes: dict[tuple[int, int], set[bytes]] = {}
    base = bytes(root)
    for dirpath, dirnames, filenames in os.walk(base):
        for name in [b"", *dirnames, *filenames]:
            path = os.path.join(dirpath, name) if name else dirpath
            rel = os.path.relpath(path, base)
            if name == b"" and path != base:
                continue  # listed by its parent
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            info: dict[str, object] = {
                "type": stat.filemode(kind)[0],
                "mode": oct(stat.S_IMODE(st.st_mode)),
                "uid": st.st_uid,
                "gid": st.st_gid,
                "mtime": st.st_mtime_ns,
                "xattrs": _xattrs(path),
            }
            if stat.S_ISDIR(st.st_mode):
                if st.st_mtime_ns >= unpacked_after_ns:
                    info["mtime"] = "unpack time"
            else:
                info["size"] = st.st_size
                inodes.setdefault((st.st_dev, st.st_ino), set()).add(rel)
            if stat.S_ISLNK(st.st_mode):
                info["link"] = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                info["sha256"] = _sha256(path)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                info["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
            paths[rel] = info
    links = frozenset(frozenset(g) for g in inodes.values() if len(g) > 1)
    return Scan(paths, links)


def differences(reference: Scan, other: Scan) -> list[str]:
    """One line per path and field where ``other`` differs from ``reference`` (empty: equal).
    A directory the reference unpack dated itself matches any mtime."""
    out = []
    for path in sorted(reference.paths.keys() | other.paths.keys()):
        ref, got = reference.paths.get(path), other.paths.get(path)
        if ref is None or got is None:
            out.append(f"{path!r}: {'only in the lazy view' if ref is None else 'missing'}")
            continue
        for key in sorted(ref.keys() | got.keys()):
            if key == "mtime" and ref[key] == "unpack time":
                continue
            if ref.get(key) != got.get(key):
                out.append(f"{path!r} {key}: reference {ref.get(key)!r}, lazy {got.get(key)!r}")
    if reference.links != other.links:
        out.append(
            f"hardlink groups: reference {sorted(map(sorted, reference.links))}, "
            f"lazy {sorted(map(sorted, other.links))}"
        )
    return out


# --- small images served in this process ------------------------------------------------------


def lazy_image(
    tars: list[bytes],
    cache_dir: Path,
    *,
    overlay: bool = False,
    below: Callable[[str], LowerDir | None] | None = None,
) -> LazyImage:
    """``tars`` (lowest first) converted and served lazily from memory."""
    blobs: dict[str, bytes] = {}
    layers = []
    for i, raw in enumerate(tars):
        out = io.BytesIO()
        result = convert_layer(io.BytesIO(raw), out, frame_size=64 << 10)
        blob = blobs[result.digest] = out.getvalue()
        index = LayerIndex.from_blob(lambda s, e, b=blob: b[s:e], len(blob), result.digest)
        layers.append(Layer(index, Blob(result.digest, index.frames, i)))
    fetcher = FrameFetcher(
        lambda digest, start, end: blobs[digest][start:end],
        BlockCache(cache_dir),
        connections=2,
        retries=0,
    )
    return LazyImage(layers, fetcher, overlay=overlay, below=below)


@contextlib.contextmanager
def mounted(image: LazyImage, mountpoint: Path) -> Iterator[Path]:
    """``image`` mounted at ``mountpoint`` (a new directory) by a thread of this process."""
    mountpoint.mkdir()
    thread = threading.Thread(target=mount, args=(image, str(mountpoint)), daemon=True)
    thread.start()
    wait_mounted(mountpoint, 10)
    try:
        yield mountpoint
    finally:
        unmount(mountpoint)
        thread.join(10)
        image.fetcher.close()
        assert not is_mounted(mountpoint)
