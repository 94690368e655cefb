"""Capture mode: what a setup command changed under some paths, snapshotted and replayed."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from snapshot.capture import ensure_capture, verify_capture
from snapshot.errors import SnapshotError, UnsafeMemberError
from snapshot.manifest import MANIFEST_NAME

SETUP = (
    "mkdir -p {root}/bin {root}/share/data && "
    "printf '#!/bin/sh\\necho tool-ok\\n' > {root}/bin/tool && chmod 755 {root}/bin/tool && "
    "ln -s bin/tool {root}/tool-link && ln -s /etc/hostname {root}/abs-link && "
    "head -c 300000 /dev/urandom > {root}/share/data/blob && "
    "ln {root}/share/data/blob {root}/share/data/blob-hardlink && "
    "rm -rf {root}/old && echo changed > {root}/keep"
)


def _host(root: Path) -> None:
    """The state of a fresh node before the setup command ran."""
    (root / "old").mkdir(parents=True)
    (root / "old" / "f").write_text("old\n")
    (root / "keep").write_text("keep\n")
    (root / "untouched").write_text("same on every node\n")


def _command(root: Path) -> list[str]:
    return ["sh", "-c", SETUP.format(root=shlex.quote(str(root)))]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """The node's state directory, given to every capture call (the library reads no
    environment variable for it)."""
    return tmp_path / "state"


def _snapshot(root: Path) -> dict[str, tuple]:
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            found[rel] = ("dir", path.stat().st_mode & 0o7777)
        else:
            st = path.stat()
            found[rel] = ("file", path.read_bytes(), st.st_mode & 0o7777, st.st_mtime_ns)
    return found


@pytest.mark.parametrize("store_kind", ["local", "s3"])
def test_capture_build_then_replay_on_another_node(
    tmp_path: Path, state: Path, store_kind, request
) -> None:
    root = tmp_path / "node1" / "tool"
    _host(root)
    if store_kind == "local":
        store, options = str(tmp_path / "store"), None
    else:
        bucket, s3_options = request.getfixturevalue("s3_bucket")
        store, options = f"s3://{bucket}/envs", {"s3": s3_options}
    built = ensure_capture(
        [str(root)], _command(root), store=store, storage_options=options, state_dir=state
    )
    assert built.outcome == "built"
    expected = _snapshot(root)
    assert "old" not in expected and expected["keep"][1] == b"changed\n"

    again = ensure_capture(
        [str(root)], _command(root), store=store, storage_options=options, state_dir=state
    )
    assert again.outcome == "verified"

    # Another node: same paths, original state, no local record. The command must not run.
    state_two = tmp_path / "state2"
    moved = tmp_path / "node1-built"
    root.rename(moved)
    _host(root)
    replayed = ensure_capture(
        [str(root)],
        ["sh", "-c", "exit 99"],
        store=store,
        storage_options=options,
        key=built_key(built, root),
        state_dir=state_two,
    )
    assert replayed.outcome == "restored"
    replayed_tree, built_tree = _snapshot(root), _snapshot(moved)
    # "untouched" was made by each node itself (its own mtime); everything else is the build's.
    assert replayed_tree.pop("untouched")[1] == built_tree.pop("untouched")[1]
    assert replayed_tree == built_tree
    assert os.readlink(root / "abs-link") == "/etc/hostname"  # a link out: restored as a link
    blob, twin = root / "share/data/blob", root / "share/data/blob-hardlink"
    assert blob.stat().st_ino == twin.stat().st_ino
    assert (root / "untouched").read_text() == "same on every node\n"
    assert verify_capture(built.key, state_two)
    assert not [p for p in root.parent.iterdir() if "bootseer-capture" in p.name]


def built_key(result, root: Path):
    from snapshot.key import compute_key

    key = compute_key((), _command(root), capture=[str(root)])
    assert key.key == result.key
    return key


def test_capture_detects_changes_after_replay(tmp_path: Path, state: Path) -> None:
    root = tmp_path / "tool"
    _host(root)
    built = ensure_capture(
        [str(root)], _command(root), store=str(tmp_path / "store"), state_dir=state
    )
    (root / "bin" / "tool").write_text("tampered\n")
    assert not verify_capture(built.key, state)
    again = ensure_capture(
        [str(root)], _command(root), store=str(tmp_path / "store"), state_dir=state
    )
    assert again.outcome == "restored"
    assert b"tool-ok" in (root / "bin" / "tool").read_bytes()


def test_replay_refuses_members_outside_the_callers_paths(tmp_path: Path, state: Path) -> None:
    root = tmp_path / "tool"
    _host(root)
    store = tmp_path / "store"
    built = ensure_capture([str(root)], _command(root), store=str(store), state_dir=state)
    # Forge the manifest: it now claims to be a capture of root/bin only, but its members
    # still cover root/share and root/keep.
    narrow = str(root / "bin")
    manifest_path = store / built.key / MANIFEST_NAME
    data = json.loads(manifest_path.read_text())
    data["capture"]["roots"] = [narrow]
    manifest_path.write_text(json.dumps(data))
    from snapshot.capture import replay
    from snapshot.store import SnapshotStore

    snapshots = SnapshotStore(str(store))
    manifest = snapshots.require_manifest(built.key)
    before = _snapshot(root)
    with pytest.raises(UnsafeMemberError, match="outside the capture paths"):
        replay(snapshots, manifest, [narrow], state_dir=tmp_path / "state2")
    assert _snapshot(root) == before
    # And the caller's paths must be the ones captured.
    with pytest.raises(SnapshotError, match="captured"):
        replay(snapshots, manifest, [str(root)], state_dir=tmp_path / "state2")


def test_replay_never_follows_a_host_symlink(tmp_path: Path, state: Path) -> None:
    root = tmp_path / "tool"
    _host(root)
    store = str(tmp_path / "store")
    built = ensure_capture([str(root)], _command(root), store=store, state_dir=state)
    # Another node where root/share is a symlink to a directory outside the root.
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "old-root").mkdir()
    root.rename(tmp_path / "old-root" / "tool")
    _host(root)
    (root / "share").symlink_to(outside)
    with pytest.raises(SnapshotError, match="never followed"):
        ensure_capture(
            [str(root)],
            ["sh", "-c", "exit 99"],
            store=store,
            key=built_key(built, root),
            state_dir=tmp_path / "state2",
        )
    assert list(outside.iterdir()) == []
    assert (root / "old" / "f").read_text() == "old\n"  # refused before any change
    assert (root / "keep").read_text() == "keep\n"


def test_capture_paths_are_checked(tmp_path: Path, state: Path) -> None:
    with pytest.raises(SnapshotError, match="not allowed"):
        ensure_capture(["/"], ["true"], store=None, state_dir=state)
    with pytest.raises(SnapshotError, match="overlap"):
        ensure_capture([str(tmp_path), str(tmp_path / "a")], ["true"], store=None, state_dir=state)


def test_capture_without_a_store_runs_the_setup_and_records_it(tmp_path: Path, state: Path) -> None:
    root = tmp_path / "tool"
    _host(root)
    result = ensure_capture([str(root)], _command(root), store=None, state_dir=state)
    assert result.outcome == "installed-locally"
    assert (root / "bin" / "tool").exists()
    assert (
        ensure_capture([str(root)], _command(root), store=None, state_dir=state).outcome
        == "verified"
    )
