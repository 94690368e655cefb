"""``bootseer fs mount`` over striped files: background and foreground, cp/dd/open, signals;
the background mount's private log (no symlink planted at a predictable name is followed) and
``--allow-other`` (other users read, never write: the kernel enforces the modes)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from canary import Canary
from cli_helpers import background_log, bootseer_cli, log_removed, remove_background_log
from unprivileged import as_nobody, mode, need_setpriv, umask

from bootseer.cli.mounts import start_background_mount
from striped_fs import StripedFileSystem
from striped_fs.fuse import is_mounted, unmount, wait_mounted

pytestmark = pytest.mark.usefixtures("fuse")
STRIPE = 256 * 1024


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return bootseer_cli(*args, env=env, check=False)


@pytest.fixture
def mountpoint(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    yield mnt
    if is_mounted(mnt):
        unmount(mnt, lazy=True)
    assert not is_mounted(mnt)


def test_background_mount_of_s3_shows_striped_files(tmp_path, mountpoint, s3_bucket):
    bucket, options = s3_bucket
    fs = StripedFileSystem(
        target_protocol="s3", target_options=options, stripe_size=STRIPE, skip_instance_cache=True
    )
    data = random.Random(1).randbytes(10 * STRIPE + 77)
    fs.pipe_file(f"{bucket}/ckpt/model.bin", data)
    fs.target.pipe_file(f"{bucket}/ckpt/plain.txt", b"plain object\n")
    env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": options})}
    up = run_cli(
        "fs", "mount", f"s3://{bucket}/ckpt", str(mountpoint), "--stripe-size", str(STRIPE), env=env
    )
    assert up.returncode == 0, up.stderr
    assert "mounted" in up.stdout and is_mounted(mountpoint)
    log = background_log(up.stdout, "fs")
    assert sorted(os.listdir(mountpoint)) == ["model.bin", "plain.txt"]  # no hidden stripes
    assert os.stat(mountpoint / "model.bin").st_size == len(data)
    # cp out, dd out in large blocks, Python random access
    subprocess.run(["cp", str(mountpoint / "model.bin"), str(tmp_path / "copy.bin")], check=True)
    assert (tmp_path / "copy.bin").read_bytes() == data
    dd = subprocess.run(
        ["dd", f"if={mountpoint / 'model.bin'}", f"of={tmp_path / 'dd.bin'}", "bs=4M"],
        capture_output=True,
        check=True,
    )
    assert (tmp_path / "dd.bin").read_bytes() == data, dd.stderr
    with open(mountpoint / "model.bin", "rb") as f:
        f.seek(3 * STRIPE - 5)
        assert f.read(2 * STRIPE) == data[3 * STRIPE - 5 : 5 * STRIPE - 5]
    assert (mountpoint / "plain.txt").read_bytes() == b"plain object\n"
    # writes through the mount become striped objects
    with open(mountpoint / "new.bin", "wb") as f:
        f.write(data[: 3 * STRIPE])
    assert fs.info(f"{bucket}/ckpt/new.bin")["striped"]
    assert fs.cat_file(f"{bucket}/ckpt/new.bin") == data[: 3 * STRIPE]
    subprocess.run(["cp", str(tmp_path / "copy.bin"), str(mountpoint / "cp.bin")], check=True)
    assert fs.cat_file(f"{bucket}/ckpt/cp.bin") == data
    down = run_cli("fs", "umount", str(mountpoint))
    assert down.returncode == 0, down.stderr
    assert not is_mounted(mountpoint)
    assert log_removed(log), f"the clean mount's log outlived it: {log}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_mount_unmounts_on_signal(tmp_path, mountpoint, sig):
    store = tmp_path / "store"
    store.mkdir()
    fs = StripedFileSystem(target_protocol="file", stripe_size=STRIPE, skip_instance_cache=True)
    data = random.Random(2).randbytes(4 * STRIPE)
    fs.pipe_file(f"{store}/a.bin", data)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bootseer",
            "fs",
            "mount",
            str(store),
            str(mountpoint),
            "--foreground",
            "--read-only",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        wait_mounted(mountpoint, timeout=30, proc=proc)
        assert (mountpoint / "a.bin").read_bytes() == data
        with pytest.raises(OSError) as err:
            (mountpoint / "b.bin").write_bytes(b"x")
        assert err.value.errno == 30  # EROFS
        time.sleep(0.2)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert not is_mounted(mountpoint)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_mount_of_missing_url_is_a_clear_error(tmp_path, mountpoint):
    proc = run_cli("fs", "mount", str(tmp_path / "nope"), str(mountpoint), "--foreground")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert not is_mounted(mountpoint)


def test_background_mount_that_fails_says_why_and_leaves_no_log_directory(tmp_path, mountpoint):
    """The error carries the log's tail, so the private log directory goes with the failure."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = run_cli("fs", "mount", str(tmp_path / "nope"), str(mountpoint), env={"TMPDIR": str(tmp)})
    assert proc.returncode != 0 and "does not exist" in proc.stderr, proc.stderr
    assert not is_mounted(mountpoint)
    assert list(tmp.iterdir()) == []


def test_the_background_log_is_private_and_follows_no_planted_link(tmp_path, mountpoint, capsys):
    """The log used to be /tmp/bootseer-<kind>-<mountpoint's name>-<pid>.log, opened for
    appending as whoever mounted (root): a user who planted a symlink there had the mount
    write into a file of their choosing. Now: a new 0700 directory, a 0600 file created
    exclusively in it, whatever the umask."""
    canary = Canary.plant(tmp_path / "canary")
    store = tmp_path / "store"
    store.mkdir()
    (store / "f").write_bytes(b"through the mount\n")
    planted = Path(tempfile.gettempdir()) / f"bootseer-fs-{mountpoint.name}-{os.getpid()}.log"
    planted.symlink_to(canary.victim)  # at the old name: this process's pid, as the CLI's
    argv = [
        sys.executable,
        "-m",
        "bootseer",
        "-v",
        "fs",
        "mount",
        str(store),
        str(mountpoint),
        "--foreground",
    ]
    log = None
    try:
        with umask(0):
            start_background_mount(argv, str(mountpoint), timeout=30, what=str(store), kind="fs")
        log = background_log(capsys.readouterr().out, "fs")
        assert (mountpoint / "f").read_bytes() == b"through the mount\n"
        st = os.lstat(log)
        assert stat.S_ISREG(st.st_mode) and (mode(log.parent), mode(log)) == (0o700, 0o600)
        text = log.read_text()
        assert f"at {mountpoint} (read_only" in text  # the mount's own log went there
        unmount(mountpoint)
        assert log_removed(log)  # unmounted cleanly: its log and directory removed
        canary.assert_unchanged()
        assert os.readlink(planted) == str(canary.victim)
    finally:
        planted.unlink()
        if log is not None:
            remove_background_log(log, "fs")


def test_allow_other_lets_others_read_but_never_write(tmp_path, s3_bucket):
    """A store mounted by root with --allow-other, where any user may traverse: nobody reads
    (files 0644, directories 0755, root's), but creating, writing, renaming and deleting are
    refused by the kernel (default_permissions), and the store is unchanged."""
    need_setpriv()
    bucket, options = s3_bucket
    fs = StripedFileSystem(
        target_protocol="s3", target_options=options, stripe_size=STRIPE, skip_instance_cache=True
    )
    fs.pipe_file(f"{bucket}/ckpt/model.bin", b"weights")
    shared = Path(tempfile.mkdtemp(prefix="bootseer-shared-"))
    shared.chmod(0o755)
    mnt = shared / "mnt"
    mnt.mkdir()
    env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": options})}
    log = None
    try:
        up = run_cli("fs", "mount", f"s3://{bucket}/ckpt", str(mnt), "--allow-other", env=env)
        assert up.returncode == 0, up.stderr
        log = background_log(up.stdout, "fs")
        read = as_nobody("cat", str(mnt / "model.bin"))
        assert (read.returncode, read.stdout) == (0, "weights")
        for argv in (
            ["sh", "-c", f"echo x > {mnt}/new.bin"],
            ["sh", "-c", f"echo x >> {mnt}/model.bin"],
            ["mv", str(mnt / "model.bin"), str(mnt / "moved.bin")],
            ["rm", "-f", str(mnt / "model.bin")],
            ["mkdir", str(mnt / "d")],
        ):
            denied = as_nobody(*argv)
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, argv
        assert [p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/ckpt", detail=False)] == [
            "model.bin"
        ]
        assert fs.cat_file(f"{bucket}/ckpt/model.bin") == b"weights"
    finally:
        if is_mounted(mnt):
            unmount(mnt, lazy=True)
        if not is_mounted(mnt):
            shutil.rmtree(shared, ignore_errors=True)
        if log is not None:
            remove_background_log(log, "fs")
