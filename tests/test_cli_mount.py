"""``bootseer fs mount`` over striped files: background and foreground, cp/dd/open, signals."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import bootseer_cli

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
    fs = StripedFileSystem(target_protocol="s3", target_options=options, stripe_size=STRIPE,
                           skip_instance_cache=True)
    data = random.Random(1).randbytes(10 * STRIPE + 77)
    fs.pipe_file(f"{bucket}/ckpt/model.bin", data)
    fs.target.pipe_file(f"{bucket}/ckpt/plain.txt", b"plain object\n")
    env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": options})}
    up = run_cli("fs", "mount", f"s3://{bucket}/ckpt", str(mountpoint), "--stripe-size",
                 str(STRIPE), env=env)
    assert up.returncode == 0, up.stderr
    assert "mounted" in up.stdout and is_mounted(mountpoint)
    assert sorted(os.listdir(mountpoint)) == ["model.bin", "plain.txt"]  # no hidden stripes
    assert os.stat(mountpoint / "model.bin").st_size == len(data)
    # cp out, dd out in large blocks, Python random access
    subprocess.run(["cp", str(mountpoint / "model.bin"), str(tmp_path / "copy.bin")], check=True)
    assert (tmp_path / "copy.bin").read_bytes() == data
    dd = subprocess.run(["dd", f"if={mountpoint / 'model.bin'}", f"of={tmp_path / 'dd.bin'}",
                         "bs=4M"], capture_output=True, check=True)
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_mount_unmounts_on_signal(tmp_path, mountpoint, sig):
    store = tmp_path / "store"
    store.mkdir()
    fs = StripedFileSystem(target_protocol="file", stripe_size=STRIPE, skip_instance_cache=True)
    data = random.Random(2).randbytes(4 * STRIPE)
    fs.pipe_file(f"{store}/a.bin", data)
    proc = subprocess.Popen([sys.executable, "-m", "bootseer", "fs", "mount", str(store),
                             str(mountpoint), "--foreground", "--read-only"],
                            stderr=subprocess.PIPE)
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
