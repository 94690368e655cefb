"""The do-it-yourself restart's own logic (benchmarks/e2e_diy.py, e2e_train.wait_for_copy,
bench_e2e.phases_of), cheaply: rclone against moto's S3 server, the breakdown from recorded
milestones. The whole method runs only in the benchmark (too long for CI)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_e2e  # noqa: E402
import e2e_diy  # noqa: E402
import e2e_train  # noqa: E402

needs_rclone = pytest.mark.skipif(
    shutil.which("rclone") is None, reason="rclone is not installed (apt: rclone)"
)


def put_checkpoint(
    client: Any, bucket: str, root: str, step: int, *, committed: bool, data: dict[str, bytes]
) -> None:
    """A DCP-shaped step directory: data files, and ``.metadata`` (written last) if committed."""
    for name, blob in data.items():
        client.put_object(Bucket=bucket, Key=f"{root}/step-{step:08d}/{name}", Body=blob)
    if committed:
        client.put_object(
            Bucket=bucket, Key=f"{root}/step-{step:08d}/.metadata", Body=f"meta {step}".encode()
        )


@needs_rclone
def test_copy_takes_the_newest_committed_step_byte_for_byte(
    s3_server: Any, s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A newer step without ``.metadata`` (a save in flight when the rank died) is skipped;
    the newest committed one arrives whole, split into ranged GETs (files above the lowered
    cutoff), and the ranks' wait returns its step."""
    bucket, options = s3_bucket
    client = s3_server.boto3_client()
    shards = {"__0_0.distcp": os.urandom(3 << 20) + b"r0", "__1_0.distcp": os.urandom(5 << 20)}
    put_checkpoint(client, bucket, "ckpt/diy", 3, committed=True, data={"__0_0.distcp": b"old"})
    put_checkpoint(client, bucket, "ckpt/diy", 6, committed=True, data=shards)
    put_checkpoint(client, bucket, "ckpt/diy", 9, committed=False, data={"__0_0.distcp": b"x"})
    dest = tmp_path / "copy"
    dest.mkdir()
    job = e2e_diy.CopyJob(
        f"{bucket}/ckpt/diy",
        dest,
        e2e_diy.rclone_env(options),
        tmp_path / "rclone.log",
        e2e_diy.RcloneTuning(cutoff="1M", streams=4),
    )
    status = job.start().join(120)
    assert status["ok"], (status, (tmp_path / "rclone.log").read_text())
    assert status["step"] == 6
    got = {p.name: p.read_bytes() for p in (dest / "step-00000006").iterdir()}
    assert got == {**shards, ".metadata": b"meta 6"}
    assert sorted(p.name for p in dest.iterdir()) == [e2e_train.COPY_STATUS, "step-00000006"]
    assert status["bytes"] == sum(len(b) for b in got.values())
    assert e2e_train.wait_for_copy(str(dest), timeout=5)["step"] == 6


@needs_rclone
def test_no_committed_checkpoint_fails_the_ranks_instead_of_a_fresh_start(
    s3_server: Any, s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Only an uncommitted step: the copy ends with an error in its status file, and a rank
    waiting for it raises, naming the copy, rather than training from step 0."""
    bucket, options = s3_bucket
    put_checkpoint(
        s3_server.boto3_client(),
        bucket,
        "ckpt/diy",
        4,
        committed=False,
        data={"__0_0.distcp": b"partial"},
    )
    dest = tmp_path / "copy"
    dest.mkdir()
    status = (
        e2e_diy.CopyJob(
            f"{bucket}/ckpt/diy", dest, e2e_diy.rclone_env(options), tmp_path / "rclone.log"
        )
        .start()
        .join(120)
    )
    assert not status["ok"]
    assert "no committed checkpoint" in status["error"]
    assert not (dest / "step-00000004").exists()
    with pytest.raises(RuntimeError, match="checkpoint copy into .* failed: no committed"):
        e2e_train.wait_for_copy(str(dest), timeout=5)


@needs_rclone
def test_an_unreachable_store_is_reported_to_the_ranks(
    s3_server_factory: Any, tmp_path: Path
) -> None:
    """The S3 server dies before the copy: rclone fails, the status says so with the log's
    path, and the ranks raise instead of waiting for ever."""
    server = s3_server_factory(in_process=False)
    server.create_bucket("gone")
    options = server.storage_options()
    server.close()
    dest = tmp_path / "copy"
    dest.mkdir()
    env = {**e2e_diy.rclone_env(options), "RCLONE_RETRIES": "1", "RCLONE_LOW_LEVEL_RETRIES": "1"}
    status = e2e_diy.CopyJob("gone/ckpt/diy", dest, env, tmp_path / "rclone.log").start().join(120)
    assert not status["ok"]
    assert (
        "rclone lsf exited" in status["error"] and str(tmp_path / "rclone.log") in status["error"]
    )
    with pytest.raises(RuntimeError, match="rclone lsf exited"):
        e2e_train.wait_for_copy(str(dest), timeout=5)


def test_wait_for_copy_without_a_status_file_stops_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match=f"checkpoint copy into {tmp_path} did not finish"):
        e2e_train.wait_for_copy(str(tmp_path), timeout=0.2, poll=0.05)


def test_the_rclone_command_lines() -> None:
    """The tuning reaches the command line; the credentials go in the environment, never argv."""
    options = {
        "key": "AKID",
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "r1"},
    }
    env = e2e_diy.rclone_env(options)
    assert env["RCLONE_CONFIG_E2E_ENDPOINT"] == "http://127.0.0.1:9"
    assert env["RCLONE_CONFIG_E2E_SECRET_ACCESS_KEY"] == "s3cr3t"
    assert env["RCLONE_CONFIG_E2E_REGION"] == "r1"
    argv = e2e_diy.copy_argv("ckpt/diy/", 12, Path("/d"), e2e_diy.RcloneTuning())
    assert argv[:4] == ["rclone", "copy", "e2e:ckpt/diy/step-00000012", "/d/step-00000012"]
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert flags["--multi-thread-streams"] == "8" and flags["--transfers"] == "4"
    assert flags["--multi-thread-cutoff"] == "32M"
    assert not any("s3cr3t" in a or "AKID" in a for a in argv + e2e_diy.list_argv("ckpt/diy"))
    with pytest.raises(ValueError, match="endpoint_url"):
        e2e_diy.rclone_env({"key": "k", "secret": "s"})


def test_newest_step_counts_only_committed_steps() -> None:
    listing = (
        "step-00000003/.metadata\nstep-00000010/.metadata\nstep-00000012/__0_0.distcp\n"
        "x/step-00000099/.metadata\n"
    )
    assert e2e_diy.newest_step(listing) == 10
    assert e2e_diy.newest_step("") is None


def diy_events(copy_done: float) -> list[dict[str, Any]]:
    """A diy restart's milestones (t0 = 100): the container's launcher at 130, torchrun at
    130.1, the ranks ready to load at 135 and 136, the copy done at ``copy_done``."""
    ev: list[dict[str, Any]] = [
        {"event": "entry", "t": 130.0, "rank": -1},
        {"event": "env_ready", "t": 130.05, "rank": -1, "installer": "baked"},
        {"event": "command_start", "t": 130.1, "rank": -1},
    ]
    for rank, ready in ((0, 135.0), (1, 136.0)):
        go = max(ready, copy_done) + 0.01
        ev += [
            {"event": "copy_ready", "t": go, "waited": go - ready, "rank": rank},
            {"event": "load_start", "t": go, "rank": rank},
            {"event": "load_end", "t": go + 2.0, "rank": rank},
            {
                "event": "verified",
                "t": go + 2.3,
                "seconds": 0.3,
                "rank": rank,
                "step": 6,
                "digest": f"d{rank}",
            },
            {"event": "first_step", "t": go + 6.3, "rank": rank},
        ]
    return [{**e, "attempt": 0} for e in ev]


@pytest.mark.parametrize(("copy_done", "wait"), [(150.0, 14.01), (120.0, 0.01)])
def test_the_diy_breakdown_puts_the_wait_for_the_copy_in_its_own_phase(
    copy_done: float, wait: float
) -> None:
    """The job's wait for the copy is from the last rank ready to load to the load; the
    phases add up to the total, and the copy that ended in time costs (almost) nothing."""
    phases, first, detail = bench_e2e.phases_of("diy", diy_events(copy_done), 100.0, 129.0, [])
    assert phases["prefetch"] == pytest.approx(wait + 0.05)  # + the launcher's own gap
    assert phases["launch"] == pytest.approx(136.0 - 130.1)  # the slower rank's own start
    assert phases["image"] == pytest.approx(29.0) and phases["container"] == pytest.approx(1.0)
    assert sum(phases.values()) == pytest.approx(first - 100.0)
    assert first == pytest.approx(max(136.0, copy_done) + 0.01 + 6.0)
    assert detail["environment"]["installer"] == "baked"


def test_a_diy_run_without_a_milestone_is_an_error_naming_it() -> None:
    ev = [e for e in diy_events(120.0) if e["event"] != "command_start"]
    with pytest.raises(RuntimeError, match="diy-warm: no 'command_start' milestone"):
        bench_e2e.phases_of("diy-warm", ev, 100.0, None, [])


def test_compare_reports_bootseer_against_each_baseline() -> None:
    runs = {"bootseer": {"total": 20.0}, "baseline": {"total": 200.0}, "diy-warm": {"total": 16.0}}
    vs = bench_e2e.compare(runs)
    assert vs["baseline"] == {"speedup": 10.0, "less": 0.9}
    assert vs["diy-warm"]["speedup"] == pytest.approx(0.8)  # slower: said, not hidden
    assert vs["diy-warm"]["less"] == pytest.approx(-0.25)
    assert "diy" not in vs


def test_status_file_is_written_whole(tmp_path: Path) -> None:
    e2e_diy.write_status(tmp_path, {"ok": True, "step": 3})
    assert json.loads((tmp_path / e2e_train.COPY_STATUS).read_text()) == {"ok": True, "step": 3}
    assert list(tmp_path.iterdir()) == [tmp_path / e2e_train.COPY_STATUS]


def test_a_failed_jobs_message_names_the_ranks_exception(tmp_path: Path) -> None:
    """torchrun's summary at the end of a log names no exception; the message shows the
    rank's own one first, whatever the log's length."""
    log = tmp_path / "job.log"
    log.write_text(
        "Traceback (most recent call last):\n  File x\n"
        "[rank1]: RuntimeError: the checkpoint copy into /ckpt-local failed: boom\n"
        + "torchrun summary line\n"
        * 100
    )
    text = bench_e2e.log_tail(log)
    assert (
        text.splitlines()[1]
        == "[rank1]: RuntimeError: the checkpoint copy into /ckpt-local failed: boom"
    )
    assert text.endswith("torchrun summary line")
