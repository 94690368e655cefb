"""The node check before every (re)start of ``bootseer run``: a real full tmpfs as the state
directory, memory above what the machine has, nvidia-smi absent (and broken)."""

from __future__ import annotations

import os
import stat

from robust_helpers import scenario_argv, tiny_disk  # noqa: F401 - a fixture
from run_helpers import child, run_wrapper, spans

from bootseer.robust.events import Event, read_records
from bootseer.robust.health import check_gpu


def health_events(trace) -> list[Event]:
    records, _ = read_records([trace])
    return [r for r in records if isinstance(r, Event) and r.kind == "health"]


def fill(directory) -> None:
    try:
        with open(directory / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass


def test_a_full_state_disk_stops_the_start(tmp_path, tiny_disk):  # noqa: F811
    fill(tiny_disk)
    trace, marker = tmp_path / "trace", tmp_path / "ran"
    proc = run_wrapper(
        trace, "--state-dir", str(tiny_disk), "--max-restarts", "3", command=child("touch", marker)
    )
    assert proc.returncode == 2, proc.stderr
    assert not marker.exists()  # the command never ran
    assert "node check failed before attempt 0, the job does not start" in proc.stderr
    assert f"free on {tiny_disk} (state.dir)" in proc.stderr
    assert "health.min_free_disk" in proc.stderr
    [event] = health_events(trace)
    assert (
        event.failure_class,
        event.evidence["check"],
        event.evidence["path"],
        event.evidence["key"],
    ) == ("disk_full", "disk", str(tiny_disk), "state.dir")
    assert event.evidence["free_bytes"] < event.evidence["min_free_bytes"] == 1 << 30


def test_a_disk_filled_by_the_job_stops_the_restart(tmp_path, tiny_disk):  # noqa: F811
    """Attempt 0 passes the check, fills the disk and dies of ENOSPC (disk_full); the check
    before attempt 1 sees the full disk and stops the job instead of restarting into it."""
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace,
        "--state-dir",
        str(tiny_disk),
        "--min-free-disk",
        "64KiB",
        "--max-restarts",
        "3",
        command=scenario_argv("write", tiny_disk / "shard-0.bin", 1),
    )
    assert proc.returncode == 2, proc.stderr
    assert [s["attempt"] for s in spans(trace) if s["phase"] == "command_start"] == [0]
    records, _ = read_records([trace])
    crash, verdict, health = records
    assert (crash.kind, crash.failure_class) == ("crash", "disk_full")
    assert verdict.action == "replace_and_restart"
    assert (health.kind, health.failure_class, health.evidence["path"]) == (
        "health",
        "disk_full",
        str(tiny_disk),
    )
    assert "node check failed before attempt 1" in proc.stderr


def test_too_little_memory_stops_the_start(tmp_path):
    trace, marker = tmp_path / "trace", tmp_path / "ran"
    proc = run_wrapper(trace, "--min-free-memory", "1024TiB", command=child("touch", marker))
    assert proc.returncode == 2, proc.stderr
    assert not marker.exists()
    assert "memory: " in proc.stderr and "(health.min_free_memory)" in proc.stderr
    [event] = health_events(trace)
    assert (event.failure_class, event.evidence["min_free_bytes"]) == ("cpu_oom", 1024 << 40)
    assert 0 < event.evidence["available_bytes"] < 1024 << 40


def test_no_nvidia_smi_is_skipped_and_said(tmp_path):
    trace, marker = tmp_path / "trace", tmp_path / "ran"
    proc = (
        run_wrapper(trace, command=child("touch", marker), env={"PATH": "/usr/bin:/bin"})
        if not os.path.exists("/usr/bin/nvidia-smi")
        else None
    )
    if proc is None:  # a GPU machine: the check runs for real
        assert check_gpu().ok is True
        return
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()
    assert "gpu: no nvidia-smi on PATH; skipped" in proc.stderr
    assert not health_events(trace)


def test_a_failing_nvidia_smi_stops_the_start(tmp_path):
    """No GPU here: a stand-in nvidia-smi that fails as the real one does when the driver is
    gone (its message quoted), first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate "
        "with the NVIDIA driver. Make sure that the latest NVIDIA driver is "
        'installed and running."\nexit 9\n'
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    trace, marker = tmp_path / "trace", tmp_path / "ran"
    proc = run_wrapper(
        trace, command=child("touch", marker), env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )
    assert proc.returncode == 2, proc.stderr
    assert not marker.exists()
    assert "gpu: nvidia-smi failed (exit 9: NVIDIA-SMI has failed" in proc.stderr
    [event] = health_events(trace)
    assert (event.failure_class, event.evidence["exit_code"]) == ("cuda_error", 9)
