"""Node-local behaviour of ensure: one process per prefix at a time, and leftovers of killed
builds (a half-installed prefix, the environment it had moved aside) are cleaned up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from snapshot.ensure import clear_interrupted_install

# A custom "install" that is slow enough for the two processes to overlap, and counts runs.
INSTALL = ("import os, sys, time; p = os.environ['BOOTSEER_PREFIX']; os.makedirs(p + '/bin'); "
           "open(p + '/bin/tool', 'w').write('v1'); "
           "open(sys.argv[1], 'a').write('ran\\n'); time.sleep(1.5)")


def _ensure(tmp_path: Path, prefix: Path, counter: Path) -> subprocess.Popen:
    code = ("import json, sys; from snapshot.ensure import ensure; "
            f"r = ensure(prefix={str(prefix)!r}, store={str(tmp_path / 'store')!r}, "
            f"command=[sys.executable, '-c', {INSTALL!r}, {str(counter)!r}]); "
            "print(json.dumps(r.outcome))")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_on_one_prefix_install_once(tmp_path: Path) -> None:
    prefix = tmp_path / "node" / "venv"
    counter = tmp_path / "runs"
    procs = [_ensure(tmp_path, prefix, counter) for _ in range(2)]
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outcomes.append(json.loads(out))
    # Same key in both. One built it, the other waited on the prefix lock and found it verified.
    assert sorted(outcomes) == ["built", "verified"]
    assert counter.read_text() == "ran\n"
    assert (prefix / "bin" / "tool").read_text() == "v1"


def test_a_killed_build_is_cleared_and_the_old_environment_put_back(tmp_path: Path) -> None:
    prefix = tmp_path / "venv"
    prefix.mkdir()
    (prefix / "half-installed").write_text("x")
    old = tmp_path / f".venv.bootseer-old-{2**22 + 12345}"
    old.mkdir()
    (old / "previous").write_text("kept")
    dead_pid = 2**22 + 12345  # above pid_max's default: never a live process
    (tmp_path / ".venv.bootseer-installing").write_text(json.dumps({"pid": dead_pid}))
    assert clear_interrupted_install(prefix)
    assert (prefix / "previous").read_text() == "kept"
    assert not old.exists()
    assert not (tmp_path / ".venv.bootseer-installing").exists()


def test_a_live_builder_is_left_alone(tmp_path: Path) -> None:
    prefix = tmp_path / "venv"
    prefix.mkdir()
    # Our own pid counts as "ours" (a retry in-process), so use the parent's: alive, not us.
    (tmp_path / ".venv.bootseer-installing").write_text(json.dumps({"pid": os.getppid()}))
    assert not clear_interrupted_install(prefix)
    assert prefix.exists()


def test_restore_with_fsync_syncs_and_restores(tmp_path: Path) -> None:
    """``fsync=True`` (``bootseer env restore --fsync``) runs syncfs before the move; the
    environment is the same as without it."""
    from snapshot.ensure import publish
    from snapshot.key import EnvKey
    from snapshot.restore import restore, verify
    from snapshot.store import SnapshotStore

    built = tmp_path / "built" / "venv"
    (built / "bin").mkdir(parents=True)
    (built / "bin" / "tool").write_text("#!/bin/sh\necho ok\n")
    (built / "bin" / "tool").chmod(0o755)
    store = SnapshotStore(str(tmp_path / "store"))
    key = EnvKey("ab" * 20, {})
    publish(store, key, built)
    result = restore(store, key.key, tmp_path / "node" / "venv", fsync=True)
    assert "fsync" in result.phases
    target = tmp_path / "node" / "venv" / "bin" / "tool"
    assert target.read_text() == "#!/bin/sh\necho ok\n" and target.stat().st_mode & 0o777 == 0o755
    assert verify(tmp_path / "node" / "venv", key.key).ok
