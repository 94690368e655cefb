"""striped_fs.mount: the FUSE plumbing without FUSE.

A process that only waits for a mount, or removes one, must not load fusepy (and libfuse):
a benchmark measuring cold imports refused to run when it did. The two FUSE servers
(striped_fs.fuse, prefetch.lazyfs, snapshot.lazy) share one fusepy and one stand-in for it.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import prefetch.lazyfs as lazyfs
import snapshot.lazy as env_lazy
import striped_fs
import striped_fs.fuse as fuse
from striped_fs import mount
from striped_fs.errors import MountError

ROOT = Path(__file__).resolve().parents[1]


def test_the_mount_table_helpers_load_no_fusepy() -> None:
    code = (
        "import sys\n"
        "from striped_fs.mount import is_mounted, unmount, wait_mounted\n"
        "assert not is_mounted('/nonexistent/bootseer-mount-test')\n"
        "unmount('/nonexistent/bootseer-mount-test')  # not mounted: nothing to do\n"
        "print('fuse' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False"


def test_the_fuse_servers_share_one_fusepy_and_the_old_names_still_import() -> None:
    assert fuse.FuseOSError is lazyfs.FuseOSError is mount.load_fusepy().FuseOSError
    assert env_lazy.FuseOSError is fuse.FuseOSError and env_lazy.Operations is fuse._Operations
    assert fuse.is_mounted is mount.is_mounted is striped_fs.is_mounted
    assert fuse.unmount is mount.unmount and fuse.wait_mounted is mount.wait_mounted
    assert fuse.run_fuse is mount.run_fuse and fuse.restore_sigpipe is mount.restore_sigpipe
    assert fuse._unescape_mountinfo is mount.unescape_mountinfo


def test_without_libfuse_the_stand_in_raises_errnos_and_mounting_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "fuse", None)  # import fuse -> ImportError
    lib = mount.load_fusepy.__wrapped__()
    assert lib.module is None and lib.Operations is object
    err = lib.FuseOSError(errno.ENOENT)
    assert isinstance(err, OSError) and err.errno == errno.ENOENT
    with pytest.raises(MountError, match="FUSE is unavailable: .*fuse"):
        lib.require()
    monkeypatch.setattr(mount, "load_fusepy", lambda: lib)
    with pytest.raises(MountError, match="FUSE is unavailable"):
        mount.run_fuse(object(), "/nonexistent", {})


def test_mountinfo_paths_are_unescaped_and_canonical_without_touching_the_path(
    tmp_path: Path,
) -> None:
    assert mount.unescape_mountinfo(r"/mnt/a\040b\011c\134d") == "/mnt/a b\tc\\d"
    assert mount.unescape_mountinfo("/plain") == "/plain"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    (tmp_path / "real").mkdir()
    # the parent's links resolved, the last component never (a dead mount would block)
    assert mount.canonical_path(link / "mnt") == str(tmp_path.resolve() / "real" / "mnt")
    assert mount.canonical_path(str(link)) == str(tmp_path.resolve() / "link")
    assert mount.canonical_path("/") == "/"
    assert mount.is_mounted("/proc")
