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
INSTALL = (
    "import os, sys, time; p = os.environ['BOOTSEER_PREFIX']; os.makedirs(p + '/bin'); "
    "open(p + '/bin/tool', 'w').write('v1'); "
    "open(sys.argv[1], 'a').write('ran\\n'); time.sleep(1.5)"
)


def _ensure(tmp_path: Path, prefix: Path, counter: Path) -> subprocess.Popen:
    code = (
        "import json, sys; from snapshot.ensure import ensure; "
        f"r = ensure(prefix={str(prefix)!r}, store={str(tmp_path / 'store')!r}, "
        f"command=[sys.executable, '-c', {INSTALL!r}, {str(counter)!r}]); "
        "print(json.dumps(r.outcome))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


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


def test_restore_of_many_directories_under_a_low_open_file_limit(tmp_path: Path) -> None:
    """A container's default limit is 1024 open files and a torch environment has more
    directories than that: the restore keeps a bounded set of directory descriptors. Here
    600 directories (symlinks, a hardlink and modes included) under a limit of 64."""
    from snapshot.ensure import publish
    from snapshot.key import EnvKey
    from snapshot.store import SnapshotStore

    built = tmp_path / "built" / "venv"
    for i in range(200):
        leaf = built / "lib" / f"pkg{i}" / "sub" / "deep"
        leaf.mkdir(parents=True)
        (leaf / "mod.py").write_text(f"VALUE = {i}\n")
        (built / "lib" / f"pkg{i}" / "link").symlink_to("sub/deep/mod.py")
    os.link(built / "lib/pkg0/sub/deep/mod.py", built / "lib/pkg1/hard.py")
    (built / "lib/pkg7").chmod(0o750)
    store = SnapshotStore(str(tmp_path / "store"))
    key = EnvKey("cd" * 20, {})
    publish(store, key, built)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "from snapshot.restore import restore, verify\n"
        "from snapshot.store import SnapshotStore\n"
        f"restore(SnapshotStore({str(tmp_path / 'store')!r}), {key.key!r}, "
        f"{str(tmp_path / 'node' / 'venv')!r})\n"
        f"sys.exit(0 if verify({str(tmp_path / 'node' / 'venv')!r}, {key.key!r}).ok else 3)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    node = tmp_path / "node" / "venv"
    for i in (0, 99, 199):
        assert (node / "lib" / f"pkg{i}" / "sub/deep/mod.py").read_text() == f"VALUE = {i}\n"
        assert os.readlink(node / "lib" / f"pkg{i}" / "link") == "sub/deep/mod.py"
    assert (node / "lib/pkg1/hard.py").stat().st_ino == (
        node / "lib/pkg0/sub/deep/mod.py"
    ).stat().st_ino
    assert (node / "lib/pkg7").stat().st_mode & 0o777 == 0o750


def test_directory_handles_stay_within_their_limit_and_refuse_unknown_paths(tmp_path: Path) -> None:
    import pytest

    from snapshot.errors import UnsafeMemberError
    from snapshot.extract import DirectoryHandles

    for i in range(20):
        (tmp_path / f"d{i}" / "e").mkdir(parents=True)
    known = {f"d{i}" for i in range(20)} | {f"d{i}/e" for i in range(20)}
    handles = DirectoryHandles(tmp_path, known, limit=4)
    with handles.open("d3/e") as held:
        for i in range(20):
            with handles.open(f"d{i}/e") as fd:
                assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / f"d{i}" / "e"))
            assert len(handles._fds) <= 5  # the limit, plus the one held
        assert os.path.samestat(os.fstat(held), os.stat(tmp_path / "d3" / "e"))  # never closed
    with pytest.raises(UnsafeMemberError):
        with handles.open("elsewhere"):
            pass
    (tmp_path / "d5" / "e").rmdir()
    (tmp_path / "d5" / "e").symlink_to("/tmp")
    with pytest.raises(OSError):  # O_NOFOLLOW: a swapped-in symlink is never entered
        with handles.open("d5/e"):
            pass
    handles.close()


def test_ensure_reads_the_manifest_once_for_a_restore(
    s3_bucket: tuple[str, dict], tmp_path: Path
) -> None:
    """A fresh node's ensure finds the snapshot and restores it with the manifest it read:
    an environment's manifest names every file that embeds its prefix (each ``.pyc``:
    hundreds of KB for torch's), and every fresh node reads it from the store, which no cache
    tier serves."""
    from conftest import s3_through_a_counter

    from snapshot.ensure import ensure, publish
    from snapshot.key import EnvKey
    from snapshot.store import SnapshotStore

    bucket, options = s3_bucket
    built = tmp_path / "built" / "venv"
    (built / "lib").mkdir(parents=True)
    for i in range(1500):  # files that name the prefix: one manifest entry each
        (built / "lib" / f"mod{i:04d}.py").write_text(f"# {built}\nVALUE = {i}\n")
    url = f"s3://{bucket}/envs"
    key = EnvKey("cd" * 20, {})
    publish(SnapshotStore(url, {"s3": options}), key, built)
    manifest = SnapshotStore(url, {"s3": options}).require_manifest(key.key)
    size = len(manifest.to_bytes())
    assert len(manifest.prefix_refs) == 1500 and size > 60_000
    with s3_through_a_counter(options) as (node, proxy):
        result = ensure(
            prefix=tmp_path / "node" / "venv", store=url, storage_options={"s3": node}, key=key
        )
        read = proxy.bytes_down
    assert result.outcome == "restored"
    assert (tmp_path / "node" / "venv" / "lib" / "mod0007.py").read_text().endswith("VALUE = 7\n")
    stored = sum(c.size for c in manifest.chunks) + manifest.toc["size"]
    assert size + stored <= read < 1.5 * size + stored, (read, size, stored)


def test_a_restore_given_another_key_s_manifest_refuses(tmp_path: Path) -> None:
    import pytest

    from snapshot import SnapshotError
    from snapshot.ensure import publish
    from snapshot.key import EnvKey
    from snapshot.restore import restore
    from snapshot.store import SnapshotStore

    built = tmp_path / "built"
    built.mkdir()
    (built / "f").write_text("x")
    store = SnapshotStore(str(tmp_path / "store"))
    publish(store, EnvKey("ab" * 20, {}), built)
    other = store.require_manifest("ab" * 20)
    with pytest.raises(SnapshotError, match=f"the manifest given is {'ab' * 20}'s"):
        restore(store, "ef" * 20, tmp_path / "node", manifest=other)
