"""The node's privileges (DESIGN.md, "The node itself"): no user of the node but root reaches
what bootseer keeps or serves there, whatever the umask it was started with.

An image holds what such a user must never get at: a 0600 file of root's, a setuid-root
program (a copy of ``id``, 4755) and a device node (1:3, as /dev/null). ``bootseer image
mount`` and the snapshotter under containerd serve it lazily, both started under umask 000
in a directory every user may traverse (nothing but bootseer's own modes stands in the way).
Then ``nobody`` tries to stat, list, open, connect to and execute every path under the
snapshotter's root, the mount points, the caches, the logs and the socket: each attempt
fails with EACCES. As root, the files still look as the image says, and a container still
sees its setuid program and its device work: the container runtime decides, not the lazy
mount.

Also: containerd's snapshotter conformance check RootPermission (a new snapshot's root is
0755 under umask 000); the modes the snapshotter and the block cache give under umask 000
when used as a library (without the daemon's umask); and a node set up by an older version
(0755 directories, 0644 files) tightened at start.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
from cli_helpers import background_log, bootseer_cli, remove_background_log
from containerd_helpers import SnapshotterProcess, _add, add_programs, runnable_layers
from test_prefetch_image import _push_gzip_image
from unprivileged import mode, need_setpriv, probe, reached, tree, umask

from prefetch.cache import BlockCache
from prefetch.containerd.client import ContainerdClient
from prefetch.containerd.pull import pull_image
from prefetch.containerd.remote import RemoteLayers
from prefetch.containerd.snapshotter import Snapshotter
from striped_fs.fuse import is_mounted, unmount

pytestmark = pytest.mark.usefixtures("fuse")

SECRET = b"root's alone\n"
SETPRIV_NOBODY = ("/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def special_layer() -> bytes:
    """``id``, ``setpriv`` and ``head`` with their libraries; /secret (0600), /bin/suid-id
    (4755), /devnull (character device 1:3, 0666), /private (0700) holding a 0644 file; all
    root's."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_programs(tar, ("id", "setpriv", "head"))
        _add(tar, "secret", SECRET, mode=0o600)
        _add(
            tar, "bin/suid-id", Path(os.path.realpath(shutil.which("id"))).read_bytes(), mode=0o4755
        )
        dev = tarfile.TarInfo("devnull")
        dev.type, dev.mode, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 0o666, 1, 3
        tar.addfile(dev)
        _add(tar, "private", kind=tarfile.DIRTYPE, mode=0o700)
        _add(tar, "private/inner", b"in a 0700 directory\n")
    return out.getvalue()


def push_special_image(host: str) -> str:
    """The runnable base layer and the special one, converted; returns the lazy reference."""
    from prefetch.image import convert_image

    _push_gzip_image(host, "app/priv", "v1", [runnable_layers()[0], special_layer()])
    convert_image(f"{host}/app/priv:v1", f"{host}/app/priv:lazy", frame_size=256 << 10)
    return f"{host}/app/priv:lazy"


def assert_presented(root: Path) -> None:
    """Root sees the image's files as the image says: modes, owners, device numbers."""
    secret = os.lstat(root / "secret")
    assert (stat.S_IMODE(secret.st_mode), secret.st_uid, secret.st_gid) == (0o600, 0, 0)
    assert (root / "secret").read_bytes() == SECRET
    suid = os.lstat(root / "bin/suid-id")
    assert (stat.S_IMODE(suid.st_mode), suid.st_uid) == (0o4755, 0)
    dev = os.lstat(root / "devnull")
    assert stat.S_ISCHR(dev.st_mode) and stat.S_IMODE(dev.st_mode) == 0o666
    assert (os.major(dev.st_rdev), os.minor(dev.st_rdev)) == (1, 3)
    assert mode(root / "private") == 0o700
    assert (root / "private/inner").read_bytes() == b"in a 0700 directory\n"


def assert_nothing_reached(paths: list[Path], allowed: tuple[tuple[Path, str], ...] = ()) -> None:
    """nobody reaches none of ``paths`` but what is ``allowed`` (a directory's own lstat):
    every attempt is refused for want of permission (the paths exist: root listed them)."""
    found = probe(paths)
    assert not reached(found, allowed=allowed), found
    refusals = {outcome for ops in found.values() for outcome in ops.values() if outcome != "ok"}
    assert refusals == {"EACCES"}, found


def mount_options(path: Path) -> tuple[set[str], set[str]]:
    """(per-mount options, superblock options) of the mount at ``path``."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path):
                sep = fields.index("-")
                return set(fields[5].split(",")), set(fields[sep + 3].split(","))
    raise AssertionError(f"{path} is not mounted")


def mount_all(mounts: list, target: Path) -> None:
    """Mount what the snapshotter answered, as containerd would."""
    for m in mounts:
        kind = [] if m.type == "bind" else ["-t", m.type]
        subprocess.run(
            ["mount", *kind, "-o", ",".join(m.options), m.source, str(target)],
            check=True,
            capture_output=True,
            text=True,
        )


@pytest.fixture
def open_dir():
    """A directory every user may traverse (pytest's tmp_path is 0700: it would hide
    everything from nobody whatever bootseer does); mounts in it are detached at the end."""
    need_setpriv()
    path = Path(tempfile.mkdtemp(prefix="bootseer-priv-"))
    path.chmod(0o755)
    yield path
    for mnt in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    if not _mounts_under(path):  # never delete through a mount that is still there
        shutil.rmtree(path, ignore_errors=True)


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(f"{path}/")]


def test_nobody_reaches_nothing_of_a_lazy_image_mount(open_dir: Path, registry) -> None:
    ref = push_special_image(registry.host)
    mnt, cache = open_dir / "mnt", open_dir / "images"  # the cache is created by the mount
    mnt.mkdir()
    mnt.chmod(0o755)
    out = bootseer_cli("image", "mount", ref, str(mnt), "--cache", str(cache), umask=0).stdout
    log: Path | None = None
    try:
        log = background_log(out, "image")
        assert_presented(mnt)  # reads frames into the cache
        per_mount, per_super = mount_options(mnt)
        assert {"ro", "nosuid", "nodev"} <= per_mount
        assert "default_permissions" in per_super and "allow_other" not in per_super
        files = [p for p in tree(cache) if p.is_file()]
        assert files and {mode(p) for p in files} == {0o600}
        assert {mode(p) for p in [cache, *tree(cache)] if p.is_dir()} == {0o700}
        assert (mode(log.parent), mode(log)) == (0o700, 0o600)
        assert_nothing_reached(
            [mnt, *tree(mnt), cache, *tree(cache), log.parent, log],
            allowed=((cache, "lstat"), (log.parent, "lstat")),
        )
    finally:
        bootseer_cli("image", "umount", str(mnt))
        if log is not None:
            remove_background_log(log, "image")


def test_nobody_reaches_nothing_of_the_snapshotter(
    open_dir: Path, tmp_path: Path, registry, containerd_factory
) -> None:
    ref = push_special_image(registry.host)
    run_dir = open_dir / "run"  # like /run: open; bootseer/ in it does not exist yet
    run_dir.mkdir()
    run_dir.chmod(0o755)
    address, root = str(run_dir / "bootseer" / "sn.sock"), open_dir / "snapshotter"
    sn = SnapshotterProcess(root, address, tmp_path / "sn.log", umask=0).start()
    mounted: list[Path] = []
    try:
        ctd = containerd_factory(proxy_snapshotters={"bootseer": address})
        assert pull_image(ref, ctd.address, namespace=ctd.namespace).lazy_layers == 2
        _a_container_sees_the_image_as_it_says(ctd, ref)
        # containerd's garbage collector removes the snapshots it holds no record of, and the
        # probes below are made on the snapshotter directly: under load it ran during the walk
        # and left no snapshot to check (seen in a full run; 15 s after the probes, always)
        ctd.stop()

        # A view and an active snapshot, mounted as containerd would (in a private place).
        with ContainerdClient(address) as client:
            infos = client.list_snapshots("bootseer")
            parents = {i.parent for i in infos if i.kind == "committed"}
            top = next(i.name for i in infos if i.kind == "committed" and i.name not in parents)
            for key, fn in (("view", client.view_snapshot), ("active", client.prepare_snapshot)):
                target = tmp_path / key
                target.mkdir()
                mount_all(fn("bootseer", f"probe-{key}", top), target)
                mounted.append(target)
                assert_presented(target)

        lazy = root / "lazy"
        per_mount, per_super = mount_options(lazy)
        assert {"ro", "nosuid", "nodev"} <= per_mount
        assert {"default_permissions", "allow_other"} <= per_super
        _assert_modes(root, address)
        holder = Path(sn.holder_address)  # the FUSE holder's socket, beside the snapshotter's
        assert mode(holder) == 0o600
        assert_nothing_reached(
            [root, *tree(root), Path(address).parent, Path(address), holder],
            allowed=((root, "lstat"), (Path(address).parent, "lstat")),
        )
    finally:
        for target in mounted:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)
        sn.close()


def _a_container_sees_the_image_as_it_says(ctd, ref: str) -> None:
    """Through containerd's overlay on the lazy view: the 0600 file is root's alone, the
    setuid program gains euid 0 when the runtime allows new privileges (and only then), the
    device opens; a read-only container (a bind mount of the view) too."""
    runs = iter(range(100))

    def ctr_run(*argv: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return ctd.ctr(
            "run",
            "--rm",
            "--snapshotter",
            "bootseer",
            *flags,
            ref,
            f"priv{next(runs)}",
            *argv,
            check=False,
        )

    suid = (*SETPRIV_NOBODY, "/bin/suid-id", "-u")
    assert ctr_run(*suid, flags=("--allow-new-privs",)).stdout.strip() == "0"
    assert ctr_run(*suid).stdout.strip() == "65534"  # ctr's default: no new privileges
    ro = ctr_run(*suid, flags=("--allow-new-privs", "--read-only"))
    assert ro.stdout.strip() == "0", ro.stderr
    dev = ctr_run("/bin/head", "-c", "1", "/devnull")
    assert dev.returncode == 0, dev.stderr
    assert ctr_run("/bin/cat", "/secret").stdout.encode() == SECRET
    denied = ctr_run(*SETPRIV_NOBODY, "/bin/cat", "/secret")
    assert denied.returncode != 0 and "Permission denied" in denied.stdout + denied.stderr


def _assert_modes(root: Path, address: str) -> None:
    """containerd's modes after CVE-2021-41103, whatever the umask (the process ran under
    000): the root and every directory leading to container filesystems or caches 0700; a
    snapshot's fs 0755, work 0711; files and the socket 0600."""
    assert mode(root) == mode(root / "snapshots") == mode(root / "lazy") == 0o700
    # a snapshot being removed (renamed to .removed-*, then deleted) may vanish under the walk
    snapshot_dirs = [
        d for d in (root / "snapshots").iterdir() if not d.name.startswith(".removed-")
    ]
    assert snapshot_dirs and {mode(d) for d in snapshot_dirs} == {0o700}
    assert {mode(d / "fs") for d in snapshot_dirs} == {0o755}
    # a container's writable snapshot has a work dir (ctr run --rm may have removed it by now)
    assert {mode(d / "work") for d in snapshot_dirs if (d / "work").exists()} <= {0o711}
    remote = [root / "remote", *tree(root / "remote")]
    assert {mode(p) for p in remote if p.is_dir()} == {0o700}
    files = [p for p in remote if p.is_file()] + list(root.glob("metadata.db*"))
    assert any(p.parent.name == "frames" or p.parent.parent.name == "frames" for p in files)
    assert {mode(p) for p in files} == {0o600}, {str(p): oct(mode(p)) for p in files}
    sock = os.lstat(address)
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
    assert mode(Path(address).parent) == 0o700  # created by the snapshotter


def test_root_permission_under_umask_000(open_dir: Path, tmp_path: Path) -> None:
    """containerd's snapshotter conformance suite, RootPermission (snapshots/testsuite), run
    as the suite runs it: umask 000, the root made 0777 beforehand; a snapshot prepared
    without parent and mounted has mode 0755. Here also: one with a parent (its overlay's
    upper directory), the root made 0700, and the socket (in an open directory) refused to
    nobody by its own mode."""
    root = open_dir / "root"
    with umask(0):
        root.mkdir(0o777)
    sn = SnapshotterProcess(root, str(open_dir / "sn.sock"), tmp_path / "sn.log", umask=0).start()
    labels = {"containerd.io/gc.root": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        with ContainerdClient(sn.address) as client:
            for key, parent in (("preparing", ""), ("next", "committed")):
                target = tmp_path / key
                with umask(0):
                    target.mkdir(0o777)
                mount_all(client.prepare_snapshot("bootseer", key, parent, labels), target)
                try:
                    assert mode(target) == 0o755
                finally:
                    subprocess.run(["umount", str(target)], check=True)
                if not parent:
                    client.commit_snapshot("bootseer", "committed", key, labels)
        assert mode(root) == 0o700
        assert mode(sn.address) == 0o600
        assert_nothing_reached([Path(sn.address)], allowed=((Path(sn.address), "lstat"),))
    finally:
        sn.stop()
        if is_mounted(root / "lazy"):
            unmount(root / "lazy", lazy=True)


def test_state_is_private_under_umask_000_as_a_library(tmp_path: Path) -> None:
    """Without the daemon's umask: the snapshotter's directories and database, and a block
    cache with its missing parents, get their explicit modes under umask 000."""
    frame = b"a compressed frame"
    with umask(0):
        sn = Snapshotter(tmp_path / "a" / "root")
        try:
            sn.prepare("k")
            sn.commit("K", "k")
            sn.view("v", "K")
            sn.prepare("k2", "K")
            root = sn.root
            db_files = list(root.glob("metadata.db*"))
            assert len(db_files) == 3  # the database, its WAL and shared memory
            assert {mode(p) for p in db_files} == {0o600}
        finally:
            sn.close()
        cache = BlockCache(tmp_path / "b" / "images")
        cache.put(hashlib.sha256(frame).hexdigest(), frame)
    assert mode(tmp_path / "a") == mode(root) == mode(root / "snapshots") == 0o700
    assert mode(root / "lazy") == 0o700
    snapshot_dirs = list((root / "snapshots").iterdir())
    assert len(snapshot_dirs) == 3 and {mode(d) for d in snapshot_dirs} == {0o700}
    assert {mode(d / "fs") for d in snapshot_dirs} == {0o755}
    # a container's writable snapshot has a work dir (ctr run --rm may have removed it by now)
    assert {mode(d / "work") for d in snapshot_dirs if (d / "work").exists()} <= {0o711}
    cache_paths = [tmp_path / "b", *tree(tmp_path / "b")]
    assert {mode(p) for p in cache_paths if p.is_dir()} == {0o700}
    assert {mode(p) for p in cache_paths if p.is_file()} == {0o600}


def test_an_older_nodes_open_directories_are_tightened_at_start(tmp_path: Path) -> None:
    """A node set up by a version before this one: 0755 directories and 0644 files under the
    snapshotter's root. A start sets the root, its directories and the database to their
    modes (the files in 0700 directories are out of reach from then on)."""
    root = tmp_path / "root"
    Snapshotter(root, remote=RemoteLayers(root / "remote")).close()
    for path in [root, *tree(root)]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    sn = Snapshotter(root, remote=RemoteLayers(root / "remote"))
    try:
        for path in (
            "",
            "snapshots",
            "lazy",
            "remote",
            "remote/cache",
            "remote/cache/frames",
            "remote/indexes",
            "remote/manifests",
            "remote/profiles",
        ):
            assert mode(root / path) == 0o700, path
        assert mode(root / "metadata.db") == 0o600
    finally:
        sn.close()
