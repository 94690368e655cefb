"""The ``bootseer`` command: --version and ``bootseer fs`` against local disk and S3."""

from __future__ import annotations

import json
import random

import pytest
from cli_helpers import bootseer_cli

import bootseer


def test_version():
    assert bootseer_cli("--version").stdout.strip() == f"bootseer {bootseer.__version__}"


def test_cp_stat_ls_roundtrip_through_s3(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    src = tmp_path / "in.bin"
    data = random.Random(3).randbytes(3 * 1024 * 1024 + 7)
    src.write_bytes(data)
    env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": options})}
    up = bootseer_cli(
        "fs", "cp", str(src), f"s3://{bucket}/d/x.bin", "--stripe-size", "1MiB", env=env
    )
    assert "copied 3.0 MiB" in up.stdout
    stat = json.loads(bootseer_cli("fs", "stat", f"s3://{bucket}/d/x.bin", env=env).stdout)
    assert stat["size"] == len(data) and stat["striped"] is True and stat["stripes"] == 4
    listing = bootseer_cli("fs", "ls", f"s3://{bucket}/d", env=env).stdout.split("\n")
    assert [line.split()[:2] for line in listing if line] == [["s", str(len(data))]]
    bootseer_cli("fs", "cp", f"s3://{bucket}/d/x.bin", str(tmp_path / "out.bin"), env=env)
    assert (tmp_path / "out.bin").read_bytes() == data
    # remote to remote, into an existing "directory" keeps the name
    bootseer_cli("fs", "cp", f"s3://{bucket}/d/x.bin", f"s3://{bucket}/e.bin", env=env)
    bootseer_cli("fs", "cp", f"striped::s3://{bucket}/e.bin", str(tmp_path / "out2.bin"), env=env)
    assert (tmp_path / "out2.bin").read_bytes() == data


def test_cp_local_paths_and_logs_progress_when_not_a_terminal(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 100_000)
    out = bootseer_cli("-v", "fs", "cp", str(src), f"file://{tmp_path}/b.bin")
    assert "done" in out.stderr and "cp " in out.stderr  # a log line, not a progress bar
    assert bootseer_cli("fs", "stat", str(tmp_path / "b.bin")).stdout.count('"striped": true') == 1
    bootseer_cli("fs", "cp", str(tmp_path / "b.bin"), str(tmp_path / "c.bin"))
    assert (tmp_path / "c.bin").read_bytes() == src.read_bytes()  # a plain path gets plain bytes


@pytest.mark.parametrize(
    "args, message",
    [
        (["fs", "stat", "nosuch://x/y"], "unknown protocol 'nosuch'"),
        (["fs", "stat", "/definitely/not/here"], "/definitely/not/here"),
        (["fs", "cp", "a", "b", "--stripe-size", "huge"], "stripe_size"),
        (["fs", "cp", "a", "b", "--concurrency", "0"], "concurrency"),
        (
            ["fs", "stat", "x", "--storage-options", "{not json"],
            "storage.options in flag --storage-options: not valid JSON",
        ),
        (["fs", "mount", "x", "/definitely/not/a/dir"], "is not a directory"),
    ],
)
def test_bad_input_gets_a_clear_message(args, message, tmp_path):
    proc = bootseer_cli(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_credentials_are_not_logged(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    secret = "s3cr3t-value-never-printed"
    options = {**options, "secret": secret}
    src = tmp_path / "in.bin"
    src.write_bytes(b"y" * 1000)
    env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": options})}
    proc = bootseer_cli("-vv", "fs", "cp", str(src), f"s3://{bucket}/z", env=env, check=False)
    assert secret not in proc.stdout + proc.stderr
