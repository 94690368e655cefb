"""Images in the real registry (CNCF distribution on 127.0.0.1): convert a gzip image, open it
lazily (TOCs only), mount it and compare with a full extraction, record a profile as an OCI
referrer, and prefetch it into a fresh cache so that the recorded reads need no request."""

from __future__ import annotations

import gzip
import hashlib
import json
import threading
from pathlib import Path

import pytest
from test_prefetch_lazyfs import BIG, LOWER, UPPER, _reference, _scan, _tar

from prefetch.image import convert_image, load_profile, open_image, save_profile
from prefetch.lazyfs import mount
from prefetch.mediatypes import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST
from prefetch.profile import plan_prefetch
from prefetch.registry import SyncRegistry
from prefetch.toc import NotConvertedError
from striped_fs.fuse import unmount, wait_mounted


def _push_gzip_image(
    host: str, repo: str, tag: str, tars: list[bytes], run_config: dict | None = None
) -> str:
    layers, diff_ids = [], []
    with SyncRegistry(host) as reg:
        for raw in tars:
            blob = gzip.compress(raw, mtime=0)
            digest = "sha256:" + hashlib.sha256(blob).hexdigest()
            reg.put_blob(repo, blob, digest)
            layers.append({"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": len(blob)})
            diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "rootfs": {"type": "layers", "diff_ids": diff_ids},
                "config": run_config or {},
            }
        ).encode()
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        reg.put_blob(repo, config, config_digest)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
                "layers": layers,
            }
        ).encode()
        return reg.put_manifest(repo, tag, manifest, OCI_MANIFEST)


@pytest.fixture
def converted(registry, tmp_path: Path):
    tars = [_tar(LOWER), _tar(UPPER)]
    src = f"{registry.host}/app/train:v1"
    dst = f"{registry.host}/app/train:v1-lazy"
    _push_gzip_image(registry.host, "app/train", "v1", tars)
    result = convert_image(src, dst, frame_size=256 << 10)
    return src, dst, result, tars


def test_convert_keeps_the_tar_and_is_idempotent(converted) -> None:
    src, dst, result, tars = converted
    assert result.converted and result.layers == 2
    assert result.size_after > 0 and result.size_before > 0
    again = convert_image(src, dst, frame_size=256 << 10)
    assert not again.converted and again.digest == result.digest
    with pytest.raises(NotConvertedError, match="bootseer image convert"):
        open_image(src, "/tmp/unused-cache")


def test_lazy_mount_record_and_prefetch(converted, tmp_path: Path, fuse) -> None:
    src, dst, result, tars = converted
    image = open_image(dst, tmp_path / "cache1", record=True)
    try:
        assert image.registry.client is not None
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        thread = threading.Thread(target=mount, args=(image.lazy, str(mnt)), daemon=True)
        thread.start()
        wait_mounted(mnt, 10)
        try:
            reference = tmp_path / "ref"
            _reference(tars, reference)
            assert _scan(mnt) == _scan(reference)  # every file read: a full "start"
        finally:
            unmount(mnt)
            thread.join(10)
        profile = image.lazy.recorder.stop()
        assert profile.frames and profile.image == image.manifest.digest
        save_profile(image, profile)
    finally:
        image.close()

    # A fresh node: an empty cache, the profile from the registry, prefetched before reads.
    fresh = open_image(dst, tmp_path / "cache2")
    try:
        stored = load_profile(fresh)
        assert stored is not None
        assert [f[:2] for f in stored.frames] == [f[:2] for f in profile.frames]
        plan, full = plan_prefetch(stored, fresh.blobs)
        assert full  # this start read every file: the whole image is the profile
        fresh.lazy.fetcher.prefetch(plan)
        assert fresh.lazy.fetcher.wait_idle(30)
        requests = fresh.lazy.fetcher.stats.requests
        node = fresh.lazy.tree.lookup("lib/big.so")
        assert fresh.lazy.read(node, 0, len(BIG)) == BIG
        stats = fresh.lazy.fetcher.report()
        assert stats.requests == requests  # served from the prefetched cache
        assert stats.cache_hits == stats.frames_read > 0
    finally:
        fresh.close()
