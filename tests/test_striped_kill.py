"""Writers killed with SIGKILL and concurrent writer processes, on local disk and S3."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from striped_fs import StripedFileSystem
from striped_fs.layout import stripes_dir

STRIPE = 64 * 1024

WRITER = textwrap.dedent("""
    import json, random, sys, time
    from striped_fs import StripedFileSystem
    cfg = json.loads(sys.argv[1])
    fs = StripedFileSystem(target_protocol=cfg["protocol"], target_options=cfg["options"],
                           stripe_size=cfg["stripe"], concurrency=4, skip_instance_cache=True)
    data = random.Random(cfg["seed"]).randbytes(cfg["size"])
    with fs.open(cfg["path"], "wb") as f:
        for i in range(0, len(data), cfg["chunk"]):
            f.write(data[i:i + cfg["chunk"]])
            if i == 0:
                print("WRITING", flush=True)
            time.sleep(cfg["pause"])
    print("COMMITTED", flush=True)
""")


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def start_writer(
    protocol: str, options: dict, path: str, seed: int, size: int, pause: float
) -> subprocess.Popen:
    cfg = dict(
        protocol=protocol,
        options=options,
        path=path,
        seed=seed,
        size=size,
        stripe=STRIPE,
        chunk=STRIPE // 2,
        pause=pause,
    )
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(cfg)], stdout=subprocess.PIPE, text=True
    )


@pytest.fixture(params=["file", "s3"])
def target(request, tmp_path):
    if request.param == "file":
        yield "file", {}, str(tmp_path)
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        yield "s3", options, bucket


def make_fs(protocol: str, options: dict) -> StripedFileSystem:
    return StripedFileSystem(
        target_protocol=protocol,
        target_options={**options, **({"skip_instance_cache": True} if options else {})},
        stripe_size=STRIPE,
        concurrency=4,
        skip_instance_cache=True,
    )


def wait_for_a_stripe(fs: StripedFileSystem, path: str, timeout: float = 60.0) -> None:
    """Until a writer of ``path`` has stored a stripe (under load, its client may take a
    second to start: a kill before that would leave nothing behind)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fs.target.invalidate_cache()
        try:
            if any(name.rsplit("/", 1)[-1].isdigit() for name in fs.target.find(stripes_dir(path))):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"no stripe of {path} stored within {timeout} s")


def test_sigkill_mid_write_leaves_nothing_visible_or_the_previous_version(target):
    protocol, options, root = target
    fs = make_fs(protocol, options)
    rng = random.Random(7)
    previous = payload(3 * STRIPE + 5, 1)
    fs.pipe_file(f"{root}/kept", previous)
    for trial in range(4):
        for name in ("fresh", "kept"):
            proc = start_writer(
                protocol, options, f"{root}/{name}", seed=100 + trial, size=40 * STRIPE, pause=0.01
            )
            assert proc.stdout.readline().strip() == "WRITING"
            if trial == 0:  # one kill surely after a stripe landed: something for gc below
                wait_for_a_stripe(fs, f"{root}/{name}")
            time.sleep(rng.uniform(0.0, 0.3))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGKILL
            fs.target.invalidate_cache()
        assert not fs.exists(f"{root}/fresh"), f"trial {trial}: a killed writer's file is visible"
        assert fs.cat_file(f"{root}/kept") == previous, f"trial {trial}: previous version damaged"
    # the killed writers left stripes behind; gc removes them and keeps the committed version
    assert fs.gc(root, older_than_s=0) >= 1
    fs.target.invalidate_cache()
    assert fs.cat_file(f"{root}/kept") == previous
    assert len(fs.target.ls(stripes_dir(f"{root}/kept"), detail=False)) == 1


def test_concurrent_writer_processes_leave_one_complete_version(target):
    protocol, options, root = target
    procs = [
        start_writer(
            protocol, options, f"{root}/shared", seed=200 + i, size=12 * STRIPE + i, pause=0.0
        )
        for i in range(4)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "COMMITTED" in out
    fs = make_fs(protocol, options)
    got = fs.cat_file(f"{root}/shared")
    assert got in [payload(12 * STRIPE + i, 200 + i) for i in range(4)]
    assert fs.info(f"{root}/shared")["size"] == len(got)


def test_writer_killed_before_first_stripe_on_local_leaves_no_directory_entry(tmp_path):
    proc = start_writer("file", {}, f"{tmp_path}/f", seed=1, size=4 * STRIPE, pause=5)
    assert proc.stdout.readline().strip() == "WRITING"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    visible = [n for n in os.listdir(tmp_path) if not n.startswith(".")]
    assert visible == []
