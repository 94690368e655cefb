"""``bootseer warmup``: the parts run together, each is summarized, a failed one fails the
command (exit 1) while the others complete, and a second warmup moves nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import bootseer_cli
from snapshot_helpers import assert_env_works, use_test_index, write_requirements
from test_ckpt_cache import blank, rank_state, save_both
from test_prefetch_image import _push_gzip_image
from test_prefetch_lazyfs import LOWER, UPPER, _tar

from bootseer.config import parse_ranks
from bootseer.testing.servers import free_port
from bootseer.warmup import format_ranks
from ckpt import CheckpointManager
from ckpt.cache import store_key
from snapshot.ensure import ensure


def test_ranks_are_parsed_and_printed_as_ranges() -> None:
    assert parse_ranks("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_ranks("5") == [5]
    assert parse_ranks("8, 0-1,1") == [0, 1, 8]
    assert format_ranks([8, 0, 1, 2, 3]) == "0-3,8"
    for bad in ("3-1", "a", "1-", "-1"):
        with pytest.raises(ValueError, match="rank"):
            parse_ranks(bad)


def test_usage_errors_are_clear(tmp_path: Path) -> None:
    nothing = bootseer_cli("warmup", check=False)
    assert nothing.returncode == 2 and "nothing to warm up" in nothing.stderr
    no_ranks = bootseer_cli("warmup", "--ckpt", str(tmp_path), check=False)
    assert no_ranks.returncode == 2 and "--ckpt needs --ranks" in no_ranks.stderr
    no_prefix = bootseer_cli("warmup", "--env-spec", "r.txt", check=False)
    assert no_prefix.returncode == 2 and "--env-prefix" in no_prefix.stderr
    bad = bootseer_cli("warmup", "--ckpt", str(tmp_path), "--ranks", "7-1", check=False)
    assert bad.returncode == 2 and "bad rank list '7-1'" in bad.stderr


def _spans(trace: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(trace.glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def test_checkpoint_and_environment_fail_alone_then_warm_then_nothing_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package_index) -> None:
    env = use_test_index(monkeypatch)
    ckpt_store, ckpt_cache = str(tmp_path / "ckpt"), tmp_path / "ckpt-cache"
    save_both(ckpt_store, 3, seed=3)
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    prefix, env_store = tmp_path / "node" / "venv", str(tmp_path / "envs")
    trace = tmp_path / "trace"
    argv = ["warmup", "--ckpt", ckpt_store, "--ckpt-cache", str(ckpt_cache), "--ranks", "0-1",
            "--env-spec", str(req), "--env-prefix", str(prefix), "--env-store", env_store,
            "--trace-dir", str(trace)]

    # No snapshot of the environment yet: that part fails (warmup never installs), the
    # checkpoint part completes.
    first = bootseer_cli(*argv, env=env, check=False)
    assert first.returncode == 1, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith("warmup: environment FAILED") and "does not install" in lines[0]
    assert lines[1].startswith("warmup: checkpoint  ok") and "cached step 3 for ranks 0-1" in lines[1]
    assert "environment" in first.stderr and "1 of 2 part(s) failed (environment)" in first.stderr
    assert not prefix.exists()
    assert (ckpt_cache / store_key(ckpt_store) / "step-3" / "rank-00001.data").exists()

    # The job's first start builds and publishes the environment; a fresh node restores it.
    ensure([req], prefix=prefix, store=env_store)
    shutil.rmtree(prefix)
    second = bootseer_cli(*argv, env=env)
    lines = second.stdout.splitlines()
    assert lines[0].startswith("warmup: environment ok") and "restored environment" in lines[0]
    assert "step 3 already cached for ranks 0-1 (7 file(s) verified)" in lines[1]
    assert lines[2].startswith("warmup: done in") and "already in place" not in lines[2]
    assert_env_works(prefix)

    third = bootseer_cli(*argv, env=env)
    lines = third.stdout.splitlines()
    assert "verified" in lines[0] and "already in place" in lines[0]
    assert lines[2].endswith("(everything was already in place)")

    spans = _spans(trace)
    assert [(s["phase"], s["outcome"]) for s in spans if s["phase"] == "environment"] == [
        ("environment", "failed"), ("environment", "ok"), ("environment", "ok")]
    ckpt_spans = [s for s in spans if s["phase"] == "checkpoint_prefetch"]
    assert [s["outcome"] for s in ckpt_spans] == ["ok"] * 3
    assert ckpt_spans[0]["bytes"] > 0 and ckpt_spans[2]["bytes"] == 0
    assert ckpt_spans[2]["detail"]["warm_already"] is True
    assert all(s["end"] >= s["start"] for s in spans)

    # What warmup cached is what the job's ranks load.
    with CheckpointManager(ckpt_store, rank=1, world_size=2, cache_dir=ckpt_cache) as mgr:
        target = blank(1)
        assert mgr.load_with_report(target).cached_files == 4
    assert target["step"] == 3 and target["w"].local.equal(rank_state(3, 1)["w"].local)


@pytest.fixture
def lazy_image(registry) -> str:
    _push_gzip_image(registry.host, "app/train", "v1", [_tar(LOWER), _tar(UPPER)])
    src, dst = f"{registry.host}/app/train:v1", f"{registry.host}/app/train:lazy"
    bootseer_cli("image", "convert", src, dst, "--frame-size", str(256 << 10))
    return dst


def test_an_unreachable_checkpoint_store_fails_its_part_only(lazy_image: str,
                                                             tmp_path: Path) -> None:
    options = {"s3": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
               "striped": {"retries": 1, "backoff_s": 0.01}}
    argv = ["warmup", "--image", lazy_image, "--image-all", "--image-cache",
            str(tmp_path / "blocks"), "--ckpt", "s3://bucket/run", "--ranks", "0-7",
            "--ckpt-cache", str(tmp_path / "ckpt"), "--storage-options", json.dumps(options)]
    proc = bootseer_cli(*argv, check=False)
    assert proc.returncode == 1, proc.stderr
    image, ckpt = proc.stdout.splitlines()
    assert image.startswith("warmup: image       ok") and "prefetched" in image
    assert "every frame of the image" in image
    assert ckpt.startswith("warmup: checkpoint  FAILED") and "CheckpointStoreUnavailable" in ckpt
    assert "s3://bucket/run" in ckpt
    assert "checkpoint (s3://bucket/run) failed: CheckpointStoreUnavailable" in proc.stderr
    assert "1 of 2 part(s) failed (checkpoint); the others completed" in proc.stderr
    assert "Traceback" not in proc.stderr

    again = bootseer_cli("warmup", "--image", lazy_image, "--image-all", "--image-cache",
                         str(tmp_path / "blocks"), "--json")
    result = json.loads(again.stdout)
    assert result["ok"] is True
    (part,) = result["parts"]
    assert part["warm_already"] is True and part["bytes"] == 0
    assert "already cached" in part["outcome"]


def test_an_image_without_a_profile_is_not_an_error(lazy_image: str, tmp_path: Path) -> None:
    proc = bootseer_cli("warmup", "--image", lazy_image, "--image-cache", str(tmp_path / "b"))
    assert "no hot-block profile" in proc.stdout and "--image-all" in proc.stdout
