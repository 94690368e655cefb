"""Trust boundaries of snapshot restore and capture replay, attacked with bytes the tests
write themselves: tar members and TOCs (``tar_stream``), zstd frames written byte by byte
(``zstd_frame``), manifests carrying the sizes and sha256 that let them through the checksum
layer. Every attack plants a canary tree beside the target and asserts it is unchanged
afterwards, and that the error names the member (or object) and the rule.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from canary import Canary
from snapshot_helpers import capture_entries, publish_crafted, scan, staging_dirs, tar_stream

from snapshot.capture import replay, verify_capture
from snapshot.ensure import ensure
from snapshot.errors import SnapshotError, UnsafeMemberError
from snapshot.manifest import Manifest, Member
from snapshot.restore import read_marker, restore, write_marker
from snapshot.store import SnapshotStore


class Target:
    """A restore target ``<tmp>/node/venv``, its store, and a canary tree beside them."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = SnapshotStore(str(tmp_path / "store"))
        self.prefix = tmp_path / "node" / "venv"
        self.prefix.parent.mkdir(parents=True)
        self.canary = Canary.plant(tmp_path / "canary")

    def publish(self, entries: list[tuple], **kwargs) -> str:
        members, stream = tar_stream(entries)
        return publish_crafted(self.store, members, stream, prefix=self.prefix, **kwargs).key

    def assert_untouched(self) -> None:
        """Nothing changed outside the target, and nothing was left at or beside it."""
        self.canary.assert_unchanged()
        assert not os.path.lexists(self.prefix)
        assert staging_dirs(self.prefix) == []


@pytest.fixture
def target(tmp_path: Path) -> Target:
    return Target(tmp_path)


# -- critical: bootseer's own state paths are reserved ----------------------------------------

def reserved_cases(canary: Canary) -> dict[str, tuple[list[tuple], str]]:
    """name -> (entries, the member the refusal must name)."""
    root, victim, marker = str(canary.root), str(canary.victim), str(canary.root / "env.json")
    return {
        "state-dir-symlink": ([("l", ".bootseer", root)], ".bootseer"),
        "state-dir-directory": ([("d", ".bootseer"),
                                 ("f", ".bootseer/env.json", b'{"key": "forged"}')],
                                ".bootseer"),
        "state-dir-file": ([("f", ".bootseer", b"not a directory")], ".bootseer"),
        "marker-symlink": ([("d", ".bootseer"), ("l", ".bootseer/env.json", marker)],
                           ".bootseer"),
        "toc-symlink": ([("d", ".bootseer"), ("l", ".bootseer/toc.json.zst", victim)],
                        ".bootseer"),
        "marker-symlink-alone": ([("l", ".bootseer/env.json", marker)], ".bootseer/env.json"),
        "toc-symlink-alone": ([("l", ".bootseer/toc.json.zst", victim)],
                              ".bootseer/toc.json.zst"),
        # spellings that are the same path on a case-insensitive or normalizing filesystem
        "upper-case": ([("l", ".BOOTSEER", root)], ".BOOTSEER"),
        "mixed-case-dir": ([("d", ".BootSeer"), ("l", ".BootSeer/env.json", marker)],
                           ".BootSeer"),
        "zero-width-joiner": ([("l", ".boot\u200dseer", root)], ".boot\u200dseer"),
        "fullwidth-dot": ([("l", "\uff0ebootseer", root)], "\uff0ebootseer"),
        "trailing-dot": ([("l", ".bootseer.", root)], ".bootseer."),
        "dos-short-name": ([("l", "BOOTSE~1", root)], "BOOTSE~1"),
    }


@pytest.mark.parametrize("case", sorted(reserved_cases(Canary(Path("/x")))))
def test_a_member_at_the_state_paths_is_refused(target: Target, case: str) -> None:
    entries, member = reserved_cases(target.canary)[case]
    key = target.publish([("d", "bin"), ("f", "bin/tool", b"#!/bin/sh\n", 0o755), *entries])
    with pytest.raises(UnsafeMemberError) as caught:
        restore(target.store, key, target.prefix)
    assert caught.value.member == member
    assert "reserved" in caught.value.rule and ".bootseer" in caught.value.rule
    assert repr(member) in str(caught.value)
    target.assert_untouched()


def _plant_state(root: Path, canary: Canary, how: str) -> None:
    state = root / ".bootseer"
    if how == "state-dir-symlink":
        state.symlink_to(canary.root)
        return
    state.mkdir()
    if how == "marker-symlink":
        (state / "env.json").symlink_to(canary.root / "env.json")
    else:
        (state / "toc.json.zst").symlink_to(canary.victim)


@pytest.mark.parametrize("how", ["state-dir-symlink", "marker-symlink", "toc-symlink"])
def test_state_is_never_written_through_a_planted_link(tmp_path: Path, how: str) -> None:
    """Even past the member checks, write_marker creates its directory and files itself,
    through descriptors, O_NOFOLLOW | O_EXCL: a planted link is refused, never written
    through, and never read as a marker either."""
    canary = Canary.plant(tmp_path / "canary")
    root = tmp_path / "venv"
    root.mkdir()
    (root / "data.txt").write_text("data\n")
    _plant_state(root, canary, how)
    before = scan(root, exclude=())
    with pytest.raises(UnsafeMemberError) as caught:
        write_marker(root, "0" * 40, root, [Member("data.txt", "f", 0o644, 0, 5)],
                     built_at=str(root), store_url=None, published=False)
    assert caught.value.member == ".bootseer"
    assert "reserved" in caught.value.rule and "never written through" in caught.value.rule
    canary.assert_unchanged()
    assert scan(root, exclude=()) == before
    if how != "toc-symlink":
        assert read_marker(root) is None  # a marker reached through a link is not one


def test_an_install_that_plants_the_state_dir_is_refused(tmp_path: Path) -> None:
    """The install command's tree is content too: a ``.bootseer`` it made is refused."""
    canary = Canary.plant(tmp_path / "canary")
    command = ["sh", "-c", f"mkdir -p {{prefix}} && echo data > {{prefix}}/data && "
                           f"ln -s {canary.root} {{prefix}}/.bootseer"]
    with pytest.raises(UnsafeMemberError) as caught:
        ensure([], prefix=tmp_path / "venv", store=None, command=command)
    assert caught.value.member == ".bootseer" and "reserved" in caught.value.rule
    canary.assert_unchanged()


# -- high: capture replay never deletes through a symlink -------------------------------------

@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "state"
    monkeypatch.setenv("BOOTSEER_STATE_DIR", str(directory))
    return directory


def rel(path: Path) -> str:
    return str(path).lstrip("/")


def publish_capture(store: SnapshotStore, root: Path, entries: list[tuple],
                    deleted: list[str]) -> Manifest:
    members, stream = tar_stream(capture_entries([root], entries))
    return publish_crafted(store, members, stream, prefix="/", kind="capture",
                           capture={"roots": [str(root)], "deleted": deleted})


DELETIONS = {"file": "victim.txt", "tree": "tree", "nested": "tree/deep/keep.bin"}


@pytest.mark.parametrize("what", sorted(DELETIONS))
@pytest.mark.parametrize("planted_by", ["host", "earlier-replay"])
def test_replay_never_deletes_through_a_symlink(tmp_path: Path, state: Path, what: str,
                                                planted_by: str) -> None:
    canary = Canary.plant(tmp_path / "canary")
    store = SnapshotStore(str(tmp_path / "store"))
    root = tmp_path / "host" / "tool"
    root.mkdir(parents=True)
    (root / "keep.txt").write_text("host file\n")
    link = root / "link"
    if planted_by == "host":
        link.symlink_to(canary.root)
    else:  # a link is data: an earlier snapshot may plant one, pointing anywhere
        first = publish_capture(store, root, [("l", rel(link), str(canary.root))], [])
        replay(store, first, [str(root)])
        assert os.readlink(link) == str(canary.root)
    before = scan(root, exclude=())
    target = f"{rel(link)}/{DELETIONS[what]}"
    manifest = publish_capture(store, root, [("f", rel(root / "new.txt"), b"new\n")], [target])
    with pytest.raises(UnsafeMemberError) as caught:
        replay(store, manifest, [str(root)])
    assert caught.value.member == target
    assert "symlink" in caught.value.rule and "never followed" in caught.value.rule
    assert rel(link) in caught.value.rule
    canary.assert_unchanged()
    assert scan(root, exclude=()) == before  # refused before anything changed
    assert not verify_capture(manifest.key)


def test_replay_deletes_a_listed_symlink_itself_not_its_target(tmp_path: Path,
                                                               state: Path) -> None:
    canary = Canary.plant(tmp_path / "canary")
    store = SnapshotStore(str(tmp_path / "store"))
    root = tmp_path / "host" / "tool"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "to-tree").symlink_to(canary.tree)
    (root / "old").mkdir()
    (root / "old" / "f").write_text("old\n")
    manifest = publish_capture(store, root, [("f", rel(root / "new.txt"), b"new\n")],
                               [rel(root / "sub" / "to-tree"), rel(root / "old")])
    replay(store, manifest, [str(root)])
    assert not os.path.lexists(root / "sub" / "to-tree") and not (root / "old").exists()
    assert (root / "new.txt").read_text() == "new\n"
    canary.assert_unchanged()


def test_capture_paths_may_not_hold_the_state_dir(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay's record is bootseer's state: no snapshot member may reach it."""
    canary = Canary.plant(tmp_path / "canary")
    root = tmp_path / "host" / "tool"
    root.mkdir(parents=True)
    monkeypatch.setenv("BOOTSEER_STATE_DIR", str(root / "state"))
    store = SnapshotStore(str(tmp_path / "store"))
    manifest = publish_capture(store, root, [("l", rel(root / "state"), str(canary.root))], [])
    with pytest.raises(SnapshotError, match="state directory"):
        replay(store, manifest, [str(root)])
    canary.assert_unchanged()
    assert list(root.iterdir()) == []


def test_the_capture_record_is_never_written_through_a_link(tmp_path: Path,
                                                            state: Path) -> None:
    canary = Canary.plant(tmp_path / "canary")
    state.mkdir()
    (state / "captures").symlink_to(canary.root)
    store = SnapshotStore(str(tmp_path / "store"))
    root = tmp_path / "host" / "tool"
    root.mkdir(parents=True)
    manifest = publish_capture(store, root, [("f", rel(root / "new.txt"), b"new\n")], [])
    with pytest.raises(SnapshotError, match="never written through"):
        replay(store, manifest, [str(root)])
    canary.assert_unchanged()
