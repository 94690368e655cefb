"""striped_fs.private's files: created 0600 exclusively, written whole or not at all."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from striped_fs import create_private, write_private


def test_a_private_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(b"old")
    write_private(path, memoryview(b"new bytes"))
    assert path.read_bytes() == b"new bytes"
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk"]


def test_a_failed_private_write_keeps_the_old_file_and_removes_its_temporary(
    tmp_path: Path,
) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(b"old")

    class Broken:  # the write fails after the temporary file was created (as a full disk)
        def __buffer__(self, flags: int) -> memoryview:
            raise OSError(28, "No space left on device")

    with pytest.raises((OSError, TypeError)):
        write_private(path, Broken())  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk"]


def test_create_private_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        os.close(create_private(tmp_path / "link"))
    assert not target.exists()


def test_pid_exists_names_owners_only() -> None:
    """A temporary file's owner: this process exists, a reaped child does not, and 0 or a
    negative number (a process group to kill(2)) names nobody."""
    import subprocess
    import sys

    from striped_fs import pid_exists

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert pid_exists(os.getpid())
    assert not pid_exists(child.pid)
    assert not pid_exists(0) and not pid_exists(-1)
