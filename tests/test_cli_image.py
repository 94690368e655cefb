"""``bootseer image``: convert, record, prefetch, mount/umount against the real registry, and
the faults: an unconverted image, a SIGTERM'd mount (no leaked mount), a registry that goes
down mid-prefetch (reads fail with EIO, then work again when it is back), a corrupted frame in
the registry (EIO, never wrong bytes), and a layer with a `..` member refused at convert."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import bootseer_cli
from test_prefetch_image import _push_gzip_image
from test_prefetch_lazyfs import BIG, LOWER, UPPER, _info, _tar

from bootseer.testing.shaper import Shaper, ShaperSettings
from prefetch.registry import SyncRegistry
from striped_fs.fuse import is_mounted, unmount, wait_mounted


@pytest.fixture
def image(registry) -> tuple[str, str]:
    _push_gzip_image(registry.host, "app/train", "v1", [_tar(LOWER), _tar(UPPER)])
    src, dst = f"{registry.host}/app/train:v1", f"{registry.host}/app/train:lazy"
    out = bootseer_cli("image", "convert", src, dst, "--frame-size", str(256 << 10)).stdout
    assert out.startswith("converted") and "2 layer(s)" in out
    return src, dst


def test_convert_twice_and_unconverted_images(image, tmp_path: Path) -> None:
    src, dst = image
    again = bootseer_cli("image", "convert", src, dst).stdout
    assert again.startswith("already converted")
    proc = bootseer_cli("image", "prefetch", src, "--cache", str(tmp_path / "c"), check=False)
    assert proc.returncode == 2 and "bootseer image convert" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_record_then_prefetch_then_a_prefetched_mount(image, tmp_path: Path, fuse) -> None:
    _, ref = image
    script = 'cat "$BOOTSEER_ROOTFS/etc/passwd" "$BOOTSEER_ROOTFS/lib/big.so" > /dev/null'
    out = bootseer_cli(
        "image",
        "record",
        ref,
        "--cache",
        str(tmp_path / "rec"),
        "--no-chroot",
        "--",
        "sh",
        "-c",
        script,
    ).stdout
    assert out.startswith("recorded") and "stored with" in out

    warm = bootseer_cli("image", "prefetch", ref, "--cache", str(tmp_path / "node")).stdout
    assert "prefetching" in warm and "prefetched" in warm

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stats = tmp_path / "stats.json"
    bootseer_cli(
        "image", "mount", ref, str(mnt), "--cache", str(tmp_path / "node"), "--stats", str(stats)
    )
    try:
        assert (mnt / "lib/big.so").read_bytes() == BIG
    finally:
        bootseer_cli("image", "umount", str(mnt))
    deadline = time.monotonic() + 10
    while not stats.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    report = json.loads(stats.read_text())
    assert report["frames_read"] > 0 and report["cache_hits"] == report["frames_read"]


def test_sigterm_unmounts_cleanly(image, tmp_path: Path, fuse) -> None:
    _, ref = image
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bootseer",
            "image",
            "mount",
            ref,
            str(mnt),
            "--foreground",
            "--cache",
            str(tmp_path / "c"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_mounted(mnt, 20, proc=proc)
        assert (mnt / "opt/x/c").read_bytes() == b"c"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()
        assert not is_mounted(mnt)
        assert "frames read" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        unmount(mnt, lazy=True)


def test_registry_down_mid_prefetch_then_back(registry, tmp_path: Path, fuse) -> None:
    _push_gzip_image(registry.host, "app/train", "v1", [_tar(LOWER), _tar(UPPER)])
    port = int(registry.host.rsplit(":", 1)[1])
    with Shaper("127.0.0.1", port, ShaperSettings()) as shaper:
        via = f"127.0.0.1:{shaper.port}"
        bootseer_cli("image", "convert", f"{via}/app/train:v1", f"{via}/app/train:lazy")
        from prefetch.image import open_image
        from prefetch.lazyfs import mount

        image = open_image(f"{via}/app/train:lazy", tmp_path / "cache")
        image.lazy.fetcher.retries = 1
        image.lazy.fetcher.backoff_s = 0.01
        image.registry.client.retries = 1
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        thread = threading.Thread(target=mount, args=(image.lazy, str(mnt)), daemon=True)
        thread.start()
        try:
            wait_mounted(mnt, 10)
            shaper.set_refuse(True)
            shaper.drop_active()
            with pytest.raises(OSError) as info:
                (mnt / "lib/big.so").read_bytes()
            assert info.value.errno == errno.EIO
            shaper.set_refuse(False)  # the registry is back: the mount keeps working
            assert (mnt / "lib/big.so").read_bytes() == BIG
        finally:
            unmount(mnt)
            thread.join(10)
            image.close()


def test_a_corrupted_frame_in_the_registry_is_eio_never_wrong_bytes(
    image, registry, tmp_path: Path, fuse
) -> None:
    _, ref = image
    with SyncRegistry(registry.host) as reg:
        manifest = reg.resolve_image(ref)
        layer = manifest.layers[0]
    path = registry.blob_path(layer.digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside a data frame of the big file's region
    path.write_bytes(bytes(data))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    bootseer_cli("image", "mount", ref, str(mnt), "--cache", str(tmp_path / "c"))
    try:
        with pytest.raises(OSError) as info:
            (mnt / "lib/big.so").read_bytes()
        assert info.value.errno == errno.EIO
        assert (mnt / "etc/passwd").read_bytes()  # other frames still serve
    finally:
        bootseer_cli("image", "umount", str(mnt))


def test_a_layer_with_a_dotdot_member_is_refused_at_convert(registry) -> None:
    evil = _tar([_info("etc", b"5", mode=0o755), _info("etc/../../escape", data=b"x")])
    _push_gzip_image(registry.host, "app/evil", "v1", [evil])
    proc = bootseer_cli(
        "image",
        "convert",
        f"{registry.host}/app/evil:v1",
        f"{registry.host}/app/evil:lazy",
        check=False,
    )
    assert proc.returncode == 2 and "etc/../../escape" in proc.stderr and ".." in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_plain_containerd_pull_unpacks_the_converted_image(image, registry, containerd) -> None:
    """The converted image is still an ordinary image: containerd pulls it from the registry
    over HTTP, decompresses every seekable layer with its own zstd reader (skippable frames
    and all), checks the diff_ids against the unchanged config, and unpacks it."""
    _, ref = image
    containerd.ctr("images", "pull", "--plain-http", "--snapshotter", "native", ref)
    containerd.ctr("images", "check")
    snapshots = containerd.ctr("snapshots", "--snapshotter", "native", "ls").stdout
    assert len(snapshots.strip().splitlines()) == 3  # header + one snapshot per layer
    dirs = list((containerd.root / "io.containerd.snapshotter.v1.native/snapshots").iterdir())
    top = max(dirs, key=lambda d: int(d.name))  # the upper layer applied on the lower
    assert (top / "lib/big.so").read_bytes() == BIG
    assert not (top / "etc/hosts").exists()  # whited out by the upper layer
    assert (top / "opt/x/c").read_bytes() == b"c" and not (top / "opt/x/a").exists()
