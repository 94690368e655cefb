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
    env = _clean_env(BOOTSEER_STATE_DIR=str(tmp_path / "state"))
    nothing = bootseer_cli("warmup", env=env, check=False)
    assert nothing.returncode == 2 and "nothing to warm up" in nothing.stderr
    no_ranks = bootseer_cli("warmup", "--ckpt-url", str(tmp_path), env=env, check=False)
    assert no_ranks.returncode == 2 and "says which ranks this node serves" in no_ranks.stderr
    assert "--ranks 0-7" in no_ranks.stderr
    no_prefix = bootseer_cli("warmup", "--env-spec", "r.txt", env=env, check=False)
    assert no_prefix.returncode == 2 and "--env-prefix" in no_prefix.stderr
    bad = bootseer_cli(
        "warmup", "--ckpt-url", str(tmp_path), "--ranks", "7-1", env=env, check=False
    )
    assert bad.returncode == 2 and "ckpt.ranks in flag --ranks" in bad.stderr
    assert "'7-1'" in bad.stderr
    for old, new in (
        ("--ckpt", "--ckpt-url"),
        ("--image", "--image-ref"),
        ("--ckpt-cache", "--ckpt-cache-dir"),
    ):
        renamed = bootseer_cli("warmup", old, "x", env=env, check=False)
        assert renamed.returncode == 2, renamed.stderr
        assert f"{old} is now {new}" in renamed.stderr
    handed = bootseer_cli(
        "warmup",
        "--ckpt-url",
        str(tmp_path),
        "--ranks",
        "0",
        env={**env, "BOOTSEER_CKPT_CACHE": "/old/cache"},
        check=False,
    )
    assert handed.returncode == 2, handed.stderr
    assert (
        "BOOTSEER_CKPT_CACHE=/old/cache is what `bootseer run` hands its command" in handed.stderr
    )
    assert f"ckpt.cache_dir = '{tmp_path}/state/ckpt'" in handed.stderr
    assert not (tmp_path / "state").exists()  # nothing was started


def _spans(trace: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted(trace.glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def test_checkpoint_and_environment_fail_alone_then_warm_then_nothing_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package_index
) -> None:
    env = use_test_index(monkeypatch)
    ckpt_store, ckpt_cache = str(tmp_path / "ckpt"), tmp_path / "ckpt-cache"
    save_both(ckpt_store, 3, seed=3)
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    prefix, env_store = tmp_path / "node" / "venv", str(tmp_path / "envs")
    trace = tmp_path / "trace"
    argv = [
        "warmup",
        "--ckpt-url",
        ckpt_store,
        "--ckpt-cache-dir",
        str(ckpt_cache),
        "--ranks",
        "0-1",
        "--env-spec",
        str(req),
        "--env-prefix",
        str(prefix),
        "--env-store",
        env_store,
        "--trace-dir",
        str(trace),
    ]

    # No snapshot of the environment yet: that part fails (warmup never installs), the
    # checkpoint part completes.
    first = bootseer_cli(*argv, env=env, check=False)
    assert first.returncode == 1, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith("warmup: environment FAILED") and "does not install" in lines[0]
    assert (
        lines[1].startswith("warmup: checkpoint  ok") and "cached step 3 for ranks 0-1" in lines[1]
    )
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
        ("environment", "failed"),
        ("environment", "ok"),
        ("environment", "ok"),
    ]
    ckpt_spans = [s for s in spans if s["phase"] == "checkpoint_prefetch"]
    assert [s["outcome"] for s in ckpt_spans] == ["ok"] * 3
    assert ckpt_spans[0]["bytes"] > 0 and ckpt_spans[2]["bytes"] == 0
    assert ckpt_spans[0]["bytes_by_remote"] == {"file": ckpt_spans[0]["bytes"]}  # a path
    assert ckpt_spans[2]["bytes_by_remote"] == {} and ckpt_spans[2]["detail"]["warmup"] is True
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


def test_an_unreachable_checkpoint_store_fails_its_part_only(
    lazy_image: str, tmp_path: Path
) -> None:
    options = {
        "s3": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
        "striped": {"retries": 1, "backoff_s": 0.01},
    }
    argv = [
        "warmup",
        "--image-ref",
        lazy_image,
        "--image-all",
        "--image-cache",
        str(tmp_path / "blocks"),
        "--ckpt-url",
        "s3://bucket/run",
        "--ranks",
        "0-7",
        "--ckpt-cache-dir",
        str(tmp_path / "ckpt"),
        "--storage-options",
        json.dumps(options),
        "--trace-dir",
        str(tmp_path / "trace"),
    ]
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

    again = bootseer_cli(
        "warmup",
        "--image-ref",
        lazy_image,
        "--image-all",
        "--image-cache",
        str(tmp_path / "blocks"),
        "--trace-dir",
        str(tmp_path / "trace"),
        "--json",
    )
    result = json.loads(again.stdout)
    assert result["ok"] is True
    (part,) = result["parts"]
    assert part["warm_already"] is True and part["bytes"] == 0
    assert "already cached" in part["outcome"]


def test_an_image_without_a_profile_is_not_an_error(lazy_image: str, tmp_path: Path) -> None:
    proc = bootseer_cli(
        "warmup",
        "--image-ref",
        lazy_image,
        "--image-cache",
        str(tmp_path / "b"),
        "--trace-dir",
        str(tmp_path / "trace"),
    )
    assert "no hot-block profile" in proc.stdout and "--image-all" in proc.stdout


# -- one configuration: what warmup fetches is what run's job loads --------------------------------

#: The job of the tests below: resume the way training code does (the cache is what `bootseer run`
#: hands over in BOOTSEER_CKPT_CACHE), save what was loaded and how.
LOAD_SCRIPT = """
import json, os, sys, torch
from ckpt import CheckpointManager
url, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
state = {"w": torch.zeros(4096), "b": torch.zeros(17, dtype=torch.float64), "step": -1}
with CheckpointManager(url, storage_options=options) as mgr:
    report = mgr.load_with_report(state)
torch.save(state, out)
with open(out + ".json", "w") as f:
    json.dump({"cache": os.environ.get("BOOTSEER_CKPT_CACHE"), "step": report.step,
               "cached_files": report.cached_files, "cached_bytes": report.cached_bytes,
               "bytes_read": report.bytes_read}, f)
"""


def _saved_state(step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(4096, generator=g),
        "b": torch.randn(17, generator=g, dtype=torch.float64),
        "step": step,
    }


def _only_the_commit_record_left(fs, step_dir: str) -> list[str]:
    """Remove every shard, index and object file of a step from the store, keeping its
    MANIFEST.json: a load can then only succeed from a node-local copy."""
    record = ("/MANIFEST.json", "/.MANIFEST.json.stripes/")  # the file, and its stripes
    removed = [p for p in fs.find(step_dir) if not any(r in p for r in record)]
    assert removed
    fs.rm(removed)
    return removed


def _clean_env(**extra: str) -> dict:
    """No BOOTSEER_* setting of the developer's shell; the given ones instead."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    return {**env, **extra}


def _assert_loaded(out: Path, saved: dict) -> dict:
    import torch

    loaded = torch.load(out, weights_only=True)
    assert loaded["step"] == saved["step"]
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["b"], saved["b"])
    return json.loads(Path(f"{out}.json").read_text())


def test_warmup_then_run_with_defaults_load_from_what_warmup_fetched(
    tmp_path: Path, s3_bucket
) -> None:
    import subprocess
    import sys

    import s3fs

    bucket, s3 = s3_bucket
    url, options = f"s3://{bucket}/run1", {"s3": s3}
    saved = _saved_state(7)
    with CheckpointManager(url, storage_options=options, cache_dir=False) as mgr:
        mgr.save(7, saved, block=True)
    # Both commands get the same environment and no path setting but the node's state
    # directory (the default of the checkpoint cache and of the trace is under it).
    state = tmp_path / "state"
    env = _clean_env(
        BOOTSEER_STATE_DIR=str(state),
        BOOTSEER_CKPT_URL=url,
        BOOTSEER_CKPT_RANKS="0",
        BOOTSEER_STORAGE_OPTIONS=json.dumps(options),
        BOOTSEER_RESTART_MAX_RESTARTS="0",
    )
    warm = subprocess.run(
        [sys.executable, "-m", "bootseer", "warmup"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert warm.returncode == 0, warm.stderr
    assert "cached step 7 for ranks 0" in warm.stdout
    assert (state / "ckpt" / store_key(url) / "step-7").is_dir()

    store = s3fs.S3FileSystem(**s3, skip_instance_cache=True)
    _only_the_commit_record_left(store, f"{bucket}/run1/step-7")

    out = tmp_path / "loaded.pt"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--",
            sys.executable,
            "-c",
            LOAD_SCRIPT,
            url,
            json.dumps(options),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    seen = _assert_loaded(out, saved)
    assert seen["cache"] == str(state / "ckpt") and seen["step"] == 7
    assert seen["cached_files"] >= 2 and seen["cached_bytes"] > 0  # data and objects, cached

    spans = [s for s in _spans(state / "trace") if s["phase"] == "checkpoint_prefetch"]
    warmup_span, run_span = spans  # warmup's, then the run's, in the node's one trace
    assert warmup_span["bytes"] > 0 and warmup_span["detail"]["step"] == 7
    assert run_span["outcome"] == "ok" and run_span["bytes"] == 0
    assert run_span["detail"]["files"] == 0 and run_span["detail"]["cached_already"] > 0
    # what each read from the store, named by kind for the report's bytes per remote
    assert warmup_span["bytes_by_remote"] == {"s3": warmup_span["bytes"]}
    assert run_span["bytes_by_remote"] == {} and "warmup" not in run_span["detail"]


def test_warmup_and_run_read_one_config_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    from striped_fs.urls import url_to_fs

    store = str(tmp_path / "store")
    saved = _saved_state(3)
    with CheckpointManager(store, cache_dir=False) as mgr:
        mgr.save(3, saved, block=True)
    cache, trace = tmp_path / "node-cache", tmp_path / "node-trace"
    config = tmp_path / "bootseer.toml"
    config.write_text(
        f'[run]\ntrace_dir = "{trace}"\n[restart]\nmax_restarts = 0\n'
        f'[ckpt]\nurl = "{store}"\ncache_dir = "{cache}"\nranks = "0"\n'
    )
    env = _clean_env(BOOTSEER_STATE_DIR=str(tmp_path / "unused-state"))

    warm = subprocess.run(
        [sys.executable, "-m", "bootseer", "warmup", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert warm.returncode == 0, warm.stderr
    assert (cache / store_key(store) / "step-3").is_dir()
    fs, root = url_to_fs(store)
    _only_the_commit_record_left(fs, f"{root}/step-3")

    out = tmp_path / "loaded.pt"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--",
            sys.executable,
            "-c",
            LOAD_SCRIPT,
            store,
            "{}",
            str(out),
        ],
        env={**env, "BOOTSEER_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    seen = _assert_loaded(out, saved)
    assert seen["cache"] == str(cache) and seen["cached_files"] >= 2
    assert not (tmp_path / "unused-state").exists()  # every path came from the file
    assert [s["phase"] for s in _spans(trace)].count("checkpoint_prefetch") == 2


def test_warmup_fills_the_image_cache_that_image_commands_read(
    lazy_image: str, tmp_path: Path
) -> None:
    env = _clean_env(BOOTSEER_STATE_DIR=str(tmp_path / "state"))
    warm = bootseer_cli("warmup", "--image-ref", lazy_image, "--image-all", env=env)
    assert "prefetched" in warm.stdout and str(tmp_path / "state" / "images") in warm.stdout
    # `bootseer image prefetch` with its defaults finds every frame there: nothing moves.
    again = bootseer_cli("image", "prefetch", lazy_image, "--all", env=env)
    assert "prefetched 0 frame(s), 0 B in" in again.stdout, again.stdout
    assert f"into {tmp_path / 'state' / 'images'}" in again.stdout
