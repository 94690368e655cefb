"""The full environment check (``snapshot.verify``, ``bootseer env verify``) and the warm
start that leaves it beside the command.

What is compared: every member's type, size, mtime and mode, and every directory's entries
(an entry the snapshot does not hold is a mismatch, bytecode in ``__pycache__`` aside); the
interpreter's first reads are checked first. The warm start trusts the marker without a stat
of the files, only when bootseer's state is private."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from cli_helpers import bootseer_cli
from run_helpers import child, run_wrapper, spans

from bootseer.deferred import DeferredChecks
from bootseer.startup import StartupPlan, environment_phase
from snapshot import compute_key, ensure, verify
from snapshot.ensure import mark_local
from snapshot.restore import read_marker

SITE = "lib/python3.11/site-packages"
OLD_NS = 1_600_000_000 * 10**9  # the tree's mtimes: a tamper now gives another one


def _tree(tmp_path: Path) -> tuple[Path, str]:
    """A small environment marked as bootseer's (``mark_local``): no interpreter needed."""
    prefix = tmp_path / "env"
    files = {
        "pyvenv.cfg": b"home = /usr/bin\n",
        "bin/tool": b"#!/bin/sh\necho tool\n",
        f"{SITE}/aaa/__init__.py": b"",
        f"{SITE}/aaa/mod.py": b"VALUE = 1\n",
        f"{SITE}/aaa/__pycache__/mod.cpython-311.pyc": b"\x00" * 16,
        f"{SITE}/zz.pth": b"import aaa\n",
    }
    for rel, data in files.items():
        path = prefix / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, ns=(OLD_NS, OLD_NS))
    (prefix / "bin/tool").chmod(0o755)
    req = tmp_path / "requirements.txt"
    req.write_text("")
    key = compute_key([req])
    mark_local(prefix.resolve(), key)
    return prefix.resolve(), key.key


def _same_size_tamper(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))


def _verify_cli(prefix: Path) -> Any:
    return bootseer_cli("env", "verify", str(prefix), check=False)


def test_env_verify_clean_exits_0_with_a_summary(tmp_path: Path) -> None:
    prefix, key = _tree(tmp_path)
    proc = _verify_cli(prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"{prefix}: intact: intact (key {key}, ")
    assert f"{verify(prefix).checked} entries" in proc.stdout


def test_a_byte_changed_in_place_is_a_mismatch_naming_the_file(tmp_path: Path) -> None:
    prefix, key = _tree(tmp_path)
    victim = prefix / SITE / "aaa/mod.py"
    size = victim.stat().st_size
    _same_size_tamper(victim)
    assert victim.stat().st_size == size
    proc = _verify_cli(prefix)
    assert proc.returncode == 2, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        f"{prefix}: NOT OK: 1 file(s) missing, changed or extra (key {key}, "
        f"{verify(prefix).checked} entries, " + lines[0].rsplit(", ", 1)[1]
    )
    assert lines[1] == f"  {SITE}/aaa/mod.py: changed (size or mtime)"
    assert lines[2].startswith(f"  repair: bootseer env restore {key} --prefix {prefix}")


def test_a_missing_file_an_extra_setuid_file_and_a_mode_change(tmp_path: Path) -> None:
    prefix, _ = _tree(tmp_path)
    (prefix / SITE / "aaa/__init__.py").unlink()
    planted = prefix / "bin/helper"
    planted.write_bytes(b"#!/bin/sh\n")
    planted.chmod(0o4755)
    (prefix / "bin/tool").chmod(0o777)
    result = verify(prefix)
    assert not result.ok
    assert sorted(result.problems) == sorted(
        [
            f"{SITE}/aaa/__init__.py: missing",
            "bin/helper: extra setuid/setgid file (mode 4755), not in the snapshot",
            "bin/tool: changed (mode 0777, the snapshot's 0755)",
        ]
    )
    proc = _verify_cli(prefix)
    assert proc.returncode == 2
    assert "  bin/helper: extra setuid/setgid file (mode 4755), not in the snapshot" in (
        proc.stdout.splitlines()
    )


def test_setuid_on_a_member_and_extras_outside_pycache(tmp_path: Path) -> None:
    prefix, _ = _tree(tmp_path)
    (prefix / "bin/tool").chmod(0o4755)
    (prefix / SITE / "evil.pth").write_text("import os\n")
    os.symlink("/etc/passwd", prefix / SITE / "aaa/link")
    os.mkfifo(prefix / SITE / "aaa/fifo")
    assert sorted(verify(prefix).problems) == sorted(
        [
            "bin/tool: setuid/setgid bit set (mode 4755), not the snapshot's",
            f"{SITE}/evil.pth: extra file, not in the snapshot",
            f"{SITE}/aaa/link: extra symlink, not in the snapshot",
            f"{SITE}/aaa/fifo: extra special file (device, FIFO or socket), not in the snapshot",
        ]
    )


def test_bytecode_written_into_pycache_is_not_a_mismatch(tmp_path: Path) -> None:
    prefix, _ = _tree(tmp_path)
    (prefix / SITE / "aaa/__pycache__/__init__.cpython-311.pyc").write_bytes(b"\x00" * 8)
    fresh = prefix / SITE / "__pycache__"  # a new __pycache__ the interpreter made
    fresh.mkdir()
    (fresh / "zz.cpython-311.pyc").write_bytes(b"\x00" * 8)
    assert verify(prefix).ok
    setuid = fresh / "planted.pyc"
    setuid.write_bytes(b"")
    setuid.chmod(0o2644)
    assert verify(prefix).problems == [
        f"{SITE}/__pycache__/planted.pyc: extra setuid/setgid file (mode 2644), not in the snapshot"
    ]


def test_the_interpreters_first_reads_are_checked_first(tmp_path: Path) -> None:
    prefix, _ = _tree(tmp_path)
    _same_size_tamper(prefix / SITE / "aaa/mod.py")  # earlier in the record (sorted walk)
    _same_size_tamper(prefix / SITE / "zz.pth")  # read by site.py before any import
    assert verify(prefix).problems == [
        f"{SITE}/zz.pth: changed (size or mtime)",
        f"{SITE}/aaa/mod.py: changed (size or mtime)",
    ]


def test_the_marker_is_trusted_alone_only_when_the_state_is_private(tmp_path: Path) -> None:
    prefix, key = _tree(tmp_path)
    quick = verify(prefix, key, quick=True)
    assert quick.ok and not quick.files_checked and quick.checked == 0
    state = prefix / ".bootseer"
    assert stat.S_IMODE(state.stat().st_mode) & 0o022 == 0
    state.chmod(0o777)  # anyone could have rewritten the marker and the record
    full = verify(prefix, key, quick=True)
    assert full.ok and full.files_checked and full.checked > 0
    _same_size_tamper(prefix / "pyvenv.cfg")
    refused = verify(prefix, key, quick=True)
    assert not refused.ok and refused.problems == ["pyvenv.cfg: changed (size or mtime)"]
    state.chmod(0o755)
    (state / "env.json").chmod(0o666)
    assert verify(prefix, key, quick=True).files_checked


class _Recorded(DeferredChecks):
    """Checks that are recorded, not started: what the phase asked for, and when."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[tuple[str, Any, Any, str]] = []

    def start(self, what: str, check: Any, on_failure: Any = None, fix: str = "") -> None:
        self.started.append((what, check, on_failure, fix))


def test_the_warm_environment_phase_stats_no_member(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("")
    prefix = tmp_path / "venv"
    store = str(tmp_path / "store")
    assert ensure([req], prefix=prefix, store=store).outcome == "built"
    entries = verify(prefix).checked
    assert entries > 20
    plan = StartupPlan(env_spec=[str(req)], env_prefix=str(prefix), env_store=store)
    checks = _Recorded()
    calls = {"stat": 0}
    real_lstat, real_stat = os.lstat, os.stat

    def counting(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls["stat"] += 1
            return real(*args, **kwargs)

        return call

    with (
        mock.patch("os.lstat", counting(real_lstat)),
        mock.patch("os.stat", counting(real_stat)),
    ):
        result = environment_phase(plan, dict(os.environ), checks)
        before_command = calls["stat"]
        assert result.detail["outcome"] == "verified"
        assert result.detail["files"] == "checked beside the command"
        assert before_command < 10, before_command  # the marker, not the members
        ((what, check, _, fix),) = checks.started
        checked = check()  # what the thread beside the command runs
    assert checked.ok and checked.checked == entries
    assert calls["stat"] - before_command >= entries
    key = result.detail["key"]
    assert what == f"environment {key} at {prefix}"
    assert f"bootseer env restore {key} --prefix {prefix} --store {store}" in fix


def test_a_same_size_change_stops_the_job_and_the_next_start_restores(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("")
    prefix = tmp_path / "venv"
    flags = ["--env-spec", str(req), "--env-prefix", str(prefix)]
    flags += ["--env-store", str(tmp_path / "store")]
    trace = tmp_path / "trace"
    assert run_wrapper(trace, *flags, command=child("exit", 0)).returncode == 0
    victim = prefix / "pyvenv.cfg"
    original = victim.read_bytes()
    key = read_marker(prefix)["key"]
    size = victim.stat().st_size
    _same_size_tamper(victim)
    assert victim.stat().st_size == size
    stopped = run_wrapper(
        trace, *flags, command=[*child("exit", 0)[:1], "-c", "import time; time.sleep(60)"]
    )
    assert stopped.returncode == 2, stopped.stderr
    error = [line for line in stopped.stderr.splitlines() if "error: environment" in line]
    assert len(error) == 1, stopped.stderr
    assert f"environment {key} at {prefix}: 1 file(s) missing, changed or extra" in error[0]
    assert "(pyvenv.cfg: changed (size or mtime))" in error[0]
    assert f"bootseer env restore {key} --prefix {prefix}" in error[0]
    assert "pyvenv.cfg: changed" in read_marker(prefix)["damaged"]
    assert not verify(prefix, quick=True).ok
    fixed = run_wrapper(trace, *flags, command=child("exit", 0))
    assert fixed.returncode == 0, fixed.stderr
    assert [s for s in spans(trace) if s["phase"] == "environment"][-1]["detail"][
        "outcome"
    ] == "restored"
    assert victim.read_bytes() == original and verify(prefix).ok


@pytest.mark.parametrize("rows", [4, 5])
def test_records_of_both_versions_are_read(tmp_path: Path, rows: int) -> None:
    """A record written before modes were kept (four fields a row) still verifies."""
    import json

    import zstandard

    from snapshot.state import write_state

    prefix, _ = _tree(tmp_path)
    state = prefix / ".bootseer" / "toc.json.zst"
    table = json.loads(zstandard.ZstdDecompressor().decompress(state.read_bytes()))
    assert {len(r) for r in table} == {5}
    table = [r[:rows] for r in table]
    write_state(
        prefix, {"toc.json.zst": zstandard.ZstdCompressor().compress(json.dumps(table).encode())}
    )
    assert verify(prefix).ok
    (prefix / "bin/tool").chmod(0o700)
    assert verify(prefix).ok == (rows == 4)
