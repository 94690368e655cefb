"""The warm start's environment check: O(1) before the command, every file beside it.

A node that holds the environment (its marker names the key and the prefix) starts the
command at once; the file-by-file check (type, size, mtime of every member) runs while it
runs, and a mismatch stops the job with the file named, marks the environment damaged, and
the next start restores it from the store."""

from __future__ import annotations

import os
import time
from pathlib import Path

from run_helpers import child, run_wrapper, spans

from snapshot import ensure, mark_damaged, verify


def _env(tmp_path: Path) -> tuple[list[str], Path]:
    req = tmp_path / "requirements.txt"
    req.write_text("")
    prefix = tmp_path / "venv"
    return [
        "--env-spec",
        str(req),
        "--env-prefix",
        str(prefix),
        "--env-store",
        str(tmp_path / "store"),
    ], prefix


def _environment_spans(trace: Path) -> list[dict]:
    return [s for s in spans(trace) if s["phase"] == "environment"]


def test_the_marker_alone_is_checked_before_and_every_file_beside(tmp_path: Path) -> None:
    flags, prefix = _env(tmp_path)
    trace = tmp_path / "trace"
    built = run_wrapper(trace, *flags, command=child("exit", 0))
    assert built.returncode == 0, built.stderr
    warm = run_wrapper(trace, *flags, command=child("exit", 0))
    assert warm.returncode == 0, warm.stderr
    last = _environment_spans(trace)[-1]
    assert last["detail"]["outcome"] == "verified"
    assert last["detail"]["files"] == "checked beside the command"
    assert verify(prefix).ok  # the check beside found nothing and left the marker alone
    before = run_wrapper(trace, *flags, "--env-verify", "before", command=child("exit", 0))
    assert before.returncode == 0, before.stderr
    assert "files" not in _environment_spans(trace)[-1]["detail"]


def test_a_file_changed_on_the_node_stops_the_job_and_the_next_start_restores(
    tmp_path: Path,
) -> None:
    flags, prefix = _env(tmp_path)
    trace = tmp_path / "trace"
    assert run_wrapper(trace, *flags, command=child("exit", 0)).returncode == 0
    victim = prefix / "pyvenv.cfg"
    original = victim.read_bytes()
    victim.write_bytes(original + b"# changed on the node\n")  # another size: not the snapshot's
    assert verify(prefix, quick=True).ok and not verify(prefix).ok
    # the command would run for a minute: the check beside it stops it long before
    started = time.monotonic()
    stopped = run_wrapper(
        trace, *flags, command=[*child("exit", 0)[:1], "-c", "import time; time.sleep(60)"]
    )
    assert stopped.returncode == 2, stopped.stderr
    assert time.monotonic() - started < 50
    assert "pyvenv.cfg: changed" in stopped.stderr
    assert "the next start restores the environment" in stopped.stderr
    assert [s for s in spans(trace) if s["phase"] == "check_failed"]
    marked = verify(prefix, quick=True)
    assert not marked.ok and "damaged" in marked.reason
    # the next start does not trust it: restored from the store, the file as published
    again = run_wrapper(trace, *flags, command=child("exit", 0))
    assert again.returncode == 0, again.stderr
    assert _environment_spans(trace)[-1]["detail"]["outcome"] == "restored"
    assert victim.read_bytes() == original
    assert verify(prefix).ok


def test_ensure_quick_verify_and_mark_damaged(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("")
    prefix = tmp_path / "venv"
    store = str(tmp_path / "store")
    first = ensure([req], prefix=prefix, store=store)
    assert first.outcome == "built" and first.files_checked
    quick = ensure([req], prefix=prefix, store=store, quick_verify=True)
    assert (quick.outcome, quick.files_checked) == ("verified", False)
    full = ensure([req], prefix=prefix, store=store)
    assert (full.outcome, full.files_checked) == ("verified", True)
    assert mark_damaged(prefix, "a test says so")
    assert not verify(prefix, quick=True).ok
    assert ensure([req], prefix=prefix, store=store, quick_verify=True).outcome == "restored"
    assert not mark_damaged(tmp_path / "nothing-here", "no marker")
    os.listdir(prefix)
