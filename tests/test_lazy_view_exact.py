"""The lazy image view equals containerd's own unpack of the same layers, path by path.

The reference is containerd's real unpack: the unconverted image pulled by ``ctr images pull``
into containerd's overlayfs snapshotter (the default one, the one Kubernetes runs), mounted
with ``ctr images mount``. The same image, converted, is mounted lazily alone
(``bootseer image mount``), and in a mixed stack under the bootseer snapshotter: an unconverted
image sharing the base layer pulled first (unpacked by containerd), then the converted image,
whose upper layers are lazy above that unpacked base (one FUSE view as an overlayfs lowerdir);
and, the other way round, the converted image pulled first and the unconverted one after it
in another namespace, which makes the snapshotter write its lazy snapshots out whole (read
with the registry stopped).
Every path is compared: type, mode, owner, size, mtime (ns), link target (bytes), device
numbers, xattrs, sha256 of the content, and which paths share an inode
(tests/lazy_view_helpers.py builds the layers and does the comparison).

The focused tests below each reproduce one defect the comparison found, on the smallest
image that shows it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_helpers import background_log, bootseer_cli, remove_background_log
from containerd_helpers import SnapshotterProcess
from lazy_view_helpers import (
    PRE_1970,
    Member,
    Scan,
    build_layers,
    differences,
    lazy_image,
    mounted,
    scan,
    tar,
)
from test_prefetch_cache_merge import E
from test_prefetch_image import _push_gzip_image

from prefetch.containerd.client import ContainerdClient
from prefetch.containerd.pull import chain_ids, pull_image
from prefetch.containerd.views import lower_dirs
from prefetch.image import convert_image
from prefetch.merge import merge_layers
from striped_fs.fuse import is_mounted, unmount

pytestmark = pytest.mark.usefixtures("fuse")

FRAME = 64 << 10  # small frames: every file of any size spans or shares frames


@pytest.fixture
def private_dir() -> Iterator[Path]:
    """A short private directory for mount points and sockets (removed at the end, only if
    nothing is still mounted under it)."""
    path = Path(tempfile.mkdtemp(prefix="bootseer-lazyview-"))
    yield path
    for p in [p for p in path.iterdir() if is_mounted(p)]:
        unmount(p, lazy=True)
    if path.parent == Path(tempfile.gettempdir()) and path.name.startswith("bootseer-lazyview-"):
        shutil.rmtree(path, ignore_errors=True)


class Node:
    """containerd (its overlayfs snapshotter for the reference) with the bootseer snapshotter
    as the proxy plugin ``bootseer``."""

    def __init__(self, root: Path, sock_dir: Path, containerd_factory) -> None:
        self.root = root
        self.snapshotter = SnapshotterProcess(
            root / "snapshotter", str(sock_dir / "sn.sock"), root / "snapshotter.log"
        ).start()
        self.containerd = containerd_factory(
            proxy_snapshotters={"bootseer": self.snapshotter.address}
        )

    @contextlib.contextmanager
    def view(
        self, snapshotter: str, chain_id: str, target: Path, namespace: str = ""
    ) -> Iterator[Path]:
        """A read-only view of snapshot ``chain_id`` (of ``namespace``, default containerd's)
        mounted at ``target``, as containerd mounts a container's root (the snapshotter's
        own mounts, mount(8) for each)."""
        target.mkdir()
        key = f"view-{target.name}"
        with (
            ContainerdClient(
                self.containerd.address, namespace or self.containerd.namespace
            ) as client,
            client.lease() as ctd,
        ):  # nothing is collected while the lease lives
            mounts = ctd.view_snapshot(snapshotter, key, chain_id)
            assert len(mounts) == 1, mounts
            m = mounts[0]
            options = [o for o in m.options if o != "rbind"]
            if m.type == "bind":
                options.append("bind")
            proc = subprocess.run(
                ["mount", "-t", m.type, "-o", ",".join(options), m.source, str(target)],
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, f"mount {m}: {proc.stderr}"
            try:
                yield target
            finally:
                unmount(target)
                ctd.remove_snapshot(snapshotter, key)

    def close(self) -> None:
        self.snapshotter.stop()
        lazy = self.root / "snapshotter" / "lazy"
        if is_mounted(lazy):
            unmount(lazy, lazy=True)


@pytest.fixture
def stack(registry, tmp_path: Path, private_dir: Path, containerd_factory):
    """(node, references, reference scan): the layers pushed as a gzip image (``full``), its
    conversion (``lazy``) and an image of the base layer alone (``base``); the reference is
    containerd's overlayfs unpack of ``full``."""
    tars = build_layers(tmp_path / "layers")
    host = registry.host
    _push_gzip_image(host, "exact/img", "full", tars)
    _push_gzip_image(host, "exact/img", "base", tars[:1])
    refs = {
        "full": f"{host}/exact/img:full",
        "base": f"{host}/exact/img:base",
        "lazy": f"{host}/exact/img:lazy",
    }
    convert_image(refs["full"], refs["lazy"], frame_size=FRAME)
    node = Node(tmp_path / "node", private_dir, containerd_factory)
    try:
        started = time.time_ns()
        node.containerd.ctr(
            "images", "pull", "--plain-http", "--snapshotter", "overlayfs", refs["full"]
        )
        top = chain_ids(["sha256:" + hashlib.sha256(t).hexdigest() for t in tars])[-1]
        with node.view("overlayfs", top, private_dir / "reference") as target:
            reference = scan(target, unpacked_after_ns=started)
        yield node, refs, reference, started
    finally:
        node.close()


def _assert_same(reference: Scan, lazy: Scan) -> None:
    diff = differences(reference, lazy)
    assert not diff, "the lazy view differs from containerd's unpack:\n" + "\n".join(diff)


def test_the_lazy_mount_alone_equals_containerds_unpack(
    stack, tmp_path: Path, private_dir: Path
) -> None:
    node, refs, reference, started = stack
    assert len(reference.paths) > 60 and reference.links  # the image is what it claims
    mnt = private_dir / "alone"
    mnt.mkdir()
    out = bootseer_cli(
        "image", "mount", refs["lazy"], str(mnt), "--cache", str(tmp_path / "cache")
    ).stdout
    log = background_log(out, "image")
    try:
        _assert_same(reference, scan(mnt, unpacked_after_ns=started))
        _tools_walk(mnt)
    finally:
        bootseer_cli("image", "umount", str(mnt))
        remove_background_log(log, "image")


def test_lazy_layers_over_an_unpacked_base_equal_containerds_unpack(
    stack, private_dir: Path
) -> None:
    node, refs, reference, started = stack
    base = pull_image(refs["base"], node.containerd.address, namespace=node.containerd.namespace)
    assert (base.lazy_layers, base.unpacked_layers) == (0, 1)
    mixed = pull_image(refs["lazy"], node.containerd.address, namespace=node.containerd.namespace)
    assert mixed.lazy_layers == 2  # layer 0 is the base's unpacked snapshot
    with node.view("bootseer", mixed.chain_id, private_dir / "mixed") as target:
        lazy = scan(target, unpacked_after_ns=started)
        # The snapshotter adds its ready signal to every view (docs/containerd.md): the
        # only path that is not the image's.
        assert {p for p in lazy.paths if p.startswith(b".bootseer")} == {
            b".bootseer",
            b".bootseer/ready",
        }
        paths = {p: v for p, v in lazy.paths.items() if not p.startswith(b".bootseer")}
        _assert_same(reference, Scan(paths, lazy.links))
        _tools_walk(target)


def test_lazy_snapshots_written_out_for_an_unconverted_image_equal_containerds_unpack(
    stack, registry, private_dir: Path
) -> None:
    """The converted image pulled first (every layer lazy), then its unconverted original in
    another namespace (``bootseer image pull``'s default beside CRI's ``k8s.io``): every
    chain ID is there, lazily. The snapshotter writes those snapshots out whole
    (prefetch/containerd/materialize.py), and with the registry gone the original's tree
    equals containerd's own unpack path by path."""
    node, refs, reference, started = stack
    assert (
        pull_image(
            refs["lazy"], node.containerd.address, namespace=node.containerd.namespace
        ).lazy_layers
        == 3
    )
    full = pull_image(refs["full"], node.containerd.address, namespace="gzip")
    log = node.snapshotter.log_path.read_text()
    assert log.count("written out whole") == 3, log
    registry.stop()
    with node.view("bootseer", full.chain_id, private_dir / "whole", "gzip") as target:
        _assert_same(reference, scan(target, unpacked_after_ns=started))
        _tools_walk(target)


def test_a_whiteout_is_dropped_where_overlayfs_does_not_merge_the_directory(tmp_path: Path) -> None:
    """Layer 1 makes the unpacked layer's symlink ``s2d`` a directory, layer 2 deletes a file
    in it: overlayfs does not merge the view's ``s2d`` with a symlink, so it listed the
    whiteout left there (a name nobody can stat). Where the directory below is merged, or a
    nearer unpacked layer's opaque directory or whiteout hides it, that is what counts."""
    below = tmp_path / "unpacked"
    (below / "etc").mkdir(parents=True)
    (below / "etc/gone").write_bytes(b"deleted above\n")
    (below / "opq").mkdir()
    os.symlink("usr", below / "s2d")
    nearer = tmp_path / "nearer"
    (nearer / "opq").mkdir(parents=True)
    os.setxattr(nearer / "opq", "trusted.overlay.opaque", b"y")
    (below / "opq/sub").mkdir()
    tree = merge_layers(
        [
            [E("s2d", "dir"), E("s2d/inside.txt"), E("s2d/kept"), E("opq/sub/f")],
            [E("s2d/.wh.inside.txt"), E("etc/.wh.gone"), E("opq/sub/.wh.f")],
        ],
        overlay=True,
        below=lower_dirs([str(nearer), str(below)]),
    )
    assert sorted(tree.lookup("s2d").children) == ["kept"]
    assert sorted(tree.lookup("etc").children) == ["gone"]  # a whiteout: etc is merged
    assert tree.lookup("etc/gone").mode() == stat.S_IFCHR
    assert tree.lookup("opq/sub").children == {}  # the nearer opaque opq hides opq/sub
    kept = merge_layers(
        [[E("s2d", "dir"), E("s2d/x")], [E("s2d/.wh.x")]],
        overlay=True,
        below=lower_dirs([str(below)]),
        keep_whiteouts=True,
    )
    assert list(kept.lookup("s2d").children) == ["x"]  # one layer's own directory


def test_the_snapshotters_fuse_replies_carry_times_before_1970() -> None:
    """The snapshotter's FUSE replies packed times unsigned: a stat of a file dated before
    1970 (an unpacked directory's, which a view shows for a parent it implies) failed with
    struct.error, EIO in the container. A timespec's nanoseconds stay in [0, 10**9)."""
    from prefetch.containerd import fuseproto

    fields = fuseproto.ATTR.unpack(
        fuseproto.attr({"st_atime": 0, "st_mtime": -1_500_000_000, "st_ctime": PRE_1970}, 7)
    )
    assert fields[3:6] == (0, -2, PRE_1970 // 10**9)
    assert fields[6:9] == (0, 500_000_000, PRE_1970 % 10**9)


def _tools_walk(root: Path) -> None:
    """``find``, ``ls -lR`` and ``cp -a`` walk the whole tree without an error (a listed entry
    that cannot be stat-ed fails all three)."""
    for args in (["find", str(root), "-printf", "%p %y %s\n"], ["ls", "-lRa", str(root)]):
        proc = subprocess.run(args, capture_output=True)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    copy = Path(tempfile.mkdtemp(prefix="bootseer-lazyview-copy-"))
    try:
        proc = subprocess.run(["cp", "-a", f"{root}/.", str(copy)], capture_output=True)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    finally:
        shutil.rmtree(copy)


# --- one defect each ----------------------------------------------------------------------------

D, S, L = tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE


@contextlib.contextmanager
def _over_unpacked(
    tmp_path: Path,
    private_dir: Path,
    lower: dict[str, bytes],
    upper: list[Member],
    prepare: Callable[[Path], None] | None = None,
) -> Iterator[Path]:
    """``upper`` served lazily as one overlayfs lowerdir above a normally unpacked directory
    holding ``lower`` (path -> bytes; ``prepare(dir)`` may change it further), mounted the
    way the snapshotter's mounts stack them for containerd."""
    below = private_dir / "unpacked"
    for path, data in lower.items():
        (below / path).parent.mkdir(parents=True, exist_ok=True)
        (below / path).write_bytes(data)
    if prepare is not None:
        prepare(below)
    image = lazy_image(
        [tar(upper)], tmp_path / "cache", overlay=True, below=lower_dirs([str(below)])
    )
    with mounted(image, private_dir / "view") as view:
        target = private_dir / "overlay"
        target.mkdir()
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"ro,index=off,lowerdir={view}:{below}",
                str(target),
            ],
            check=True,
        )
        try:
            yield target
        finally:
            unmount(target)


def test_whiteouts_of_a_lazy_layer_hide_unpacked_entries_from_listings(
    tmp_path: Path, private_dir: Path
) -> None:
    """High: the deleted files of a lazy layer above an unpacked one were still listed (and
    could not be opened): overlayfs recognizes a whiteout in a listing by its d_type, which
    the view did not report."""
    lower = {
        "etc/removed.txt": b"deleted\n",
        "etc/kept": b"kept\n",
        "opt/x/a": b"a\n",
        "opt/x/sub/c": b"c\n",
        "var/log/syslog": b"log\n",
    }
    upper = [
        Member("etc/.wh.removed.txt"),
        Member("opt/x", D, mode=0o755),
        Member("opt/x/.wh..wh..opq"),
        Member("opt/x/b", data=b"b\n"),
        Member("var/.wh.log"),
    ]
    with _over_unpacked(tmp_path, private_dir, lower, upper) as root:
        assert sorted(os.listdir(root / "etc")) == ["kept"]
        assert sorted(os.listdir(root / "opt/x")) == ["b"]
        assert os.listdir(root / "var") == []
        for args in (["find", str(root)], ["ls", "-lR", str(root)]):
            proc = subprocess.run(args, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr
            assert "removed.txt" not in proc.stdout and "syslog" not in proc.stdout


def test_a_parent_the_lazy_layer_only_implies_keeps_the_unpacked_ones_attributes(
    tmp_path: Path, private_dir: Path
) -> None:
    """A lazy layer writing into a directory of the unpacked layer below without listing it:
    containerd's own unpack gives the directory it creates the lower one's mode, owner and
    xattrs, and overlayfs shows the upper one; the view showed 0755 root."""

    def prepare(below: Path) -> None:
        os.chmod(below / "home/user", 0o700)
        os.chown(below / "home/user", 1000, 1000)
        os.setxattr(below / "home/user", "user.home", b"kept")

    lower = {"home/user/.profile": b"PS1=$\n"}
    upper = [Member("home/user/.bashrc", data=b"set -o vi\n", uid=1000, gid=1000)]
    with _over_unpacked(tmp_path, private_dir, lower, upper, prepare) as root:
        st = os.lstat(root / "home/user")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, 1000, 1000)
        assert os.getxattr(root / "home/user", "user.home") == b"kept"
        assert sorted(os.listdir(root / "home/user")) == [".bashrc", ".profile"]


def test_a_name_that_is_not_utf8_is_listed_opened_and_read(
    tmp_path: Path, private_dir: Path
) -> None:
    """A directory holding a name that is not UTF-8 could not be listed (EINVAL)."""
    bad = b"caf\xe9-latin1"
    image = lazy_image(
        [
            tar(
                [
                    Member("d", D),
                    Member("d/" + os.fsdecode(bad), data=b"bytes\n"),
                    Member("d/ok", data=b"ok\n"),
                    Member("link", S, link=os.fsdecode(b"d/" + bad)),
                ]
            )
        ],
        tmp_path / "cache",
    )
    with mounted(image, private_dir / "mnt") as mnt:
        assert sorted(os.listdir(bytes(mnt / "d"))) == [bad, b"ok"]
        assert (mnt / "d" / os.fsdecode(bad)).read_bytes() == b"bytes\n"
        assert os.readlink(bytes(mnt / "link")) == b"d/" + bad


def test_readlink_of_a_hardlink_to_a_symlink(tmp_path: Path, private_dir: Path) -> None:
    """A hardlink to a symlink is that symlink (one inode); readlink of it failed (EINVAL)."""
    image = lazy_image(
        [tar([Member("s", S, link="target"), Member("h", L, link="s")])], tmp_path / "cache"
    )
    with mounted(image, private_dir / "mnt") as mnt:
        assert os.readlink(mnt / "h") == os.readlink(mnt / "s") == "target"
        assert stat.S_ISLNK(os.lstat(mnt / "h").st_mode)
        assert os.lstat(mnt / "h").st_ino == os.lstat(mnt / "s").st_ino


def test_an_mtime_of_0_is_shown_as_0(tmp_path: Path, private_dir: Path) -> None:
    """An mtime of 0 (1970) showed as the mount time."""
    image = lazy_image(
        [
            tar(
                [
                    Member("zero", data=b"0\n", mtime_ns=0),
                    Member("dir", D, mtime_ns=0),
                    Member("dir/f", data=b"f\n"),
                ]
            )
        ],
        tmp_path / "cache",
    )
    with mounted(image, private_dir / "mnt") as mnt:
        assert os.lstat(mnt / "zero").st_mtime_ns == 0
        assert os.lstat(mnt / "dir").st_mtime_ns == 0


def test_a_symlinks_size_counts_bytes_and_its_mode_is_0777(
    tmp_path: Path, private_dir: Path
) -> None:
    """A symlink's size counted characters, not bytes; its header's mode was shown (Linux
    symlinks are always 0777, and so is every symlink containerd unpacks)."""
    target = "ターゲット/ファイル"
    image = lazy_image([tar([Member("l", S, link=target, mode=0o755)])], tmp_path / "cache")
    with mounted(image, private_dir / "mnt") as mnt:
        st = os.lstat(mnt / "l")
        assert st.st_size == len(target.encode()) == 28  # 10 characters
        assert st.st_mode == stat.S_IFLNK | 0o777


def test_a_hardlink_through_a_symlinked_directory_is_applied_as_containerd_does(
    tmp_path: Path, private_dir: Path
) -> None:
    """``sd -> real`` and a hardlink to ``sd/x``: containerd follows a symlink of the same
    layer on the link's parent path (so does a member's own path, ``sd/y``); the view
    refused to build at all, and every path of the mount failed."""
    layer = tar(
        [
            Member("real", D),
            Member("real/x", data=b"x\n"),
            Member("sd", S, link="real"),
            Member("via", L, link="sd/x"),
            Member("sd/y", data=b"y\n"),
            Member("abs", S, link="/real"),
            Member("via-abs", L, link="abs/x"),
        ]
    )
    image = lazy_image([layer], tmp_path / "cache")
    assert image.tree.problems == []
    with mounted(image, private_dir / "mnt") as mnt:
        assert os.lstat(mnt / "via").st_ino == os.lstat(mnt / "real/x").st_ino
        assert os.lstat(mnt / "via-abs").st_ino == os.lstat(mnt / "real/x").st_ino
        assert (mnt / "real/y").read_bytes() == b"y\n"
        assert os.readlink(mnt / "sd") == "real"
        assert sorted(os.listdir(mnt / "real")) == ["x", "y"]


def test_a_member_that_cannot_be_applied_is_left_out_and_named(
    tmp_path: Path, private_dir: Path
) -> None:
    """A hardlink to nothing, or to a path through a symlink of a lower layer (containerd's
    overlayfs unpack refuses both): that member is left out and named; the rest is served."""
    lower = tar([Member("real", D), Member("real/x", data=b"x\n"), Member("sd", S, link="real")])
    upper = tar(
        [
            Member("ok", data=b"ok\n"),
            Member("ghost", L, link="missing"),
            Member("through", L, link="sd/x"),
        ]
    )
    image = lazy_image([lower, upper], tmp_path / "cache")
    assert image.tree.problems == [
        "layer 1: member 'ghost' left out: hardlink to 'missing': no such file in this or a "
        "lower layer",
        "layer 1: member 'through' left out: hardlink to 'sd/x': no such file in this or a "
        "lower layer",
    ]
    with mounted(image, private_dir / "mnt") as mnt:
        assert (mnt / "ok").read_bytes() == b"ok\n"
        assert sorted(os.listdir(mnt)) == ["ok", "real", "sd"]
        with pytest.raises(FileNotFoundError):
            os.lstat(mnt / "ghost")


def test_a_symlink_of_a_lower_layer_on_a_members_path_becomes_a_directory() -> None:
    """containerd's overlayfs snapshotter unpacks each layer into its own directory: a member
    under ``sd/`` creates a directory there, which hides the lower layer's symlink."""
    tree = merge_layers([[E("real", "dir"), E("sd", "symlink", link="real")], [E("sd/y")]])
    assert tree.lookup("sd").is_dir and list(tree.lookup("sd").children) == ["y"]
    assert list(tree.lookup("real").children) == []


def test_the_root_is_containerds_and_a_symlink_loop_is_left_out() -> None:
    """A layer's ``./`` entry is ignored (containerd ignores it: the root stays 0755 root's);
    a member under a loop of symlinks of its own layer is left out, not fatal."""
    tree = merge_layers(
        [
            [
                E(".", "dir", mode=0o700, uid=5),
                E("a", "symlink", link="b"),
                E("b", "symlink", link="a"),
                E("a/x"),
            ]
        ]
    )
    assert tree.root.entry is None and tree.root.mode() == stat.S_IFDIR | 0o755
    assert tree.problems == ["layer 0: member 'a/x' left out: more than 255 symlinks on its path"]
    assert sorted(tree.root.children) == ["a", "b"]


def test_a_hardlinks_header_sets_the_inodes_mode_owner_time_and_xattrs() -> None:
    """containerd applies each hardlink's header to the inode it links (chown, chmod, times,
    xattrs): the last header naming an inode decides what every name of it shows."""
    tree = merge_layers(
        [
            [
                E("a", mode=0o640, uid=1000, mtime_ns=5, xattrs={"user.a": b"1"}),
                E(
                    "b",
                    "hardlink",
                    link="a",
                    mode=0o600,
                    uid=7,
                    gid=8,
                    mtime_ns=9,
                    xattrs={"user.b": b"2"},
                ),
            ]
        ]
    )
    a, b = tree.lookup("a"), tree.lookup("b")
    assert a.ino == b.ino and a.meta is b.meta
    assert (a.mode() & 0o7777, a.meta.uid, a.meta.gid, a.meta.mtime_ns) == (0o600, 7, 8, 9)
    assert a.meta.xattrs == {"user.a": b"1", "user.b": b"2"}
