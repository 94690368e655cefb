"""Trust boundaries of snapshot restore and capture replay, attacked with bytes the tests
write themselves: tar members and TOCs (``tar_stream``), zstd frames written byte by byte
(``zstd_frame``), manifests carrying the sizes and sha256 that let them through the checksum
layer. Every attack plants a canary tree beside the target and asserts it is unchanged
afterwards, and that the error names the member (or object) and the rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from canary import Canary
from snapshot_helpers import (
    capture_entries,
    publish_crafted,
    replace_object,
    scan,
    staging_dirs,
    tar_stream,
    zstd_frame,
)

from snapshot.capture import replay, verify_capture
from snapshot.ensure import ensure
from snapshot.errors import SnapshotError, UnsafeMemberError
from snapshot.manifest import MAX_CHUNK_RAW, MAX_TOC_RAW, Manifest, Member, encode_toc
from snapshot.restore import read_marker, restore, write_marker
from snapshot.store import SnapshotStore

REPO = Path(__file__).resolve().parents[1]


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
        "state-dir-directory": (
            [("d", ".bootseer"), ("f", ".bootseer/env.json", b'{"key": "forged"}')],
            ".bootseer",
        ),
        "state-dir-file": ([("f", ".bootseer", b"not a directory")], ".bootseer"),
        "marker-symlink": ([("d", ".bootseer"), ("l", ".bootseer/env.json", marker)], ".bootseer"),
        "toc-symlink": ([("d", ".bootseer"), ("l", ".bootseer/toc.json.zst", victim)], ".bootseer"),
        "marker-symlink-alone": ([("l", ".bootseer/env.json", marker)], ".bootseer/env.json"),
        "toc-symlink-alone": ([("l", ".bootseer/toc.json.zst", victim)], ".bootseer/toc.json.zst"),
        # spellings that are the same path on a case-insensitive or normalizing filesystem
        "upper-case": ([("l", ".BOOTSEER", root)], ".BOOTSEER"),
        "mixed-case-dir": ([("d", ".BootSeer"), ("l", ".BootSeer/env.json", marker)], ".BootSeer"),
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


def test_state_is_never_written_through_a_planted_state_dir_link(tmp_path: Path) -> None:
    """Even past the member checks, write_marker opens the state directory with O_NOFOLLOW:
    a ``.bootseer`` link is refused, never written through, never read as a marker."""
    canary = Canary.plant(tmp_path / "canary")
    root = tmp_path / "venv"
    root.mkdir()
    (root / "data.txt").write_text("data\n")
    _plant_state(root, canary, "state-dir-symlink")
    before = scan(root, exclude=())
    with pytest.raises(UnsafeMemberError) as caught:
        write_marker(
            root,
            "0" * 40,
            root,
            [Member("data.txt", "f", 0o644, 0, 5)],
            built_at=str(root),
            store_url=None,
            published=False,
        )
    assert caught.value.member == ".bootseer"
    assert "reserved" in caught.value.rule and "never written through" in caught.value.rule
    canary.assert_unchanged()
    assert scan(root, exclude=()) == before
    assert read_marker(root) is None  # a marker reached through a link is not one


@pytest.mark.parametrize("how", ["marker-symlink", "toc-symlink"])
def test_a_link_planted_in_the_state_dir_is_replaced_never_followed(
    tmp_path: Path, how: str
) -> None:
    """Each state file is written under a new name (O_EXCL | O_NOFOLLOW) and renamed over its
    final name inside the directory's descriptor: a link planted there is replaced by the
    real file, and what it pointed at is unchanged."""
    canary = Canary.plant(tmp_path / "canary")
    root = tmp_path / "venv"
    root.mkdir()
    (root / "data.txt").write_text("data\n")
    _plant_state(root, canary, how)
    assert read_marker(root) is None  # a marker reached through a link is not one
    write_marker(
        root,
        "0" * 40,
        root,
        [Member("data.txt", "f", 0o644, 0, 5)],
        built_at=str(root),
        store_url=None,
        published=False,
    )
    canary.assert_unchanged()
    state = root / ".bootseer"
    for name in ("env.json", "toc.json.zst"):
        assert (state / name).is_file() and not (state / name).is_symlink()
    assert sorted(p.name for p in state.iterdir()) == ["env.json", "toc.json.zst"]
    assert read_marker(root)["key"] == "0" * 40


def test_a_directory_planted_at_a_state_file_is_refused(tmp_path: Path) -> None:
    canary = Canary.plant(tmp_path / "canary")
    root = tmp_path / "venv"
    (root / ".bootseer" / "env.json").mkdir(parents=True)
    with pytest.raises(UnsafeMemberError) as caught:
        write_marker(root, "0" * 40, root, [], built_at=str(root), store_url=None, published=False)
    assert caught.value.member == ".bootseer/env.json" and "reserved" in caught.value.rule
    canary.assert_unchanged()
    assert [p.name for p in (root / ".bootseer").iterdir()] == ["env.json"]  # no temp left


def test_an_installed_prefix_is_published_again_with_its_state(tmp_path: Path) -> None:
    """The state bootseer wrote at install is a real directory: publishing the prefix later
    (another store, a retry) reuses it, rewriting each file atomically."""
    from snapshot.ensure import publish
    from snapshot.key import compute_key

    command = ["sh", "-c", "mkdir -p {prefix} && echo data > {prefix}/data"]
    prefix = tmp_path / "venv"
    ensure([], prefix=prefix, store=None, command=command)
    first = read_marker(prefix)
    assert first is not None
    store = SnapshotStore(str(tmp_path / "store"))
    key = compute_key([], install_command=command)
    assert publish(store, key, prefix).published
    assert read_marker(prefix)["key"] == key.key
    assert sorted(p.name for p in (prefix / ".bootseer").iterdir()) == ["env.json", "toc.json.zst"]


def test_an_install_that_plants_the_state_dir_is_refused(tmp_path: Path) -> None:
    """The install command's tree is content too: a ``.bootseer`` it made is refused."""
    canary = Canary.plant(tmp_path / "canary")
    command = [
        "sh",
        "-c",
        f"mkdir -p {{prefix}} && echo data > {{prefix}}/data && "
        f"ln -s {canary.root} {{prefix}}/.bootseer",
    ]
    with pytest.raises(UnsafeMemberError) as caught:
        ensure([], prefix=tmp_path / "venv", store=None, command=command)
    assert caught.value.member == ".bootseer" and "reserved" in caught.value.rule
    canary.assert_unchanged()


# -- medium: decompression bounded by the declared and checked size ---------------------------

BOMB = 512 << 20  # what the crafted frames would inflate to (16 KiB of RLE blocks)
GREW_LIMIT_KIB = 32 << 10  # peak RSS growth allowed for a refused restore (half a capped chunk)
ENTRIES = [("d", "lib"), ("f", "lib/data", b"a" * (1 << 20)), ("f", "lib/small", b"hello\n")]


def _grow_declared(size: int):
    """Tamper: the manifest declares ``size`` raw bytes for the one chunk."""

    def tamper(m: dict) -> None:
        m["chunks"][0]["raw_size"] = m["stream_size"] = size

    return tamper


def _toc_object(store: SnapshotStore, members: list[Member], frame_of, raw_size=None):
    """Tamper: the TOC object becomes ``frame_of(toc bytes)``, with the size and sha256 that
    pass the checksum layer, and the manifest's TOC ``raw_size`` if given."""

    def tamper(m: dict) -> None:
        replace_object(store, m, m["toc"], frame_of(encode_toc(members)))
        if raw_size is not None:
            m["toc"]["raw_size"] = raw_size

    return tamper


def bomb_case(target: Target, case: str) -> tuple[str, str, str]:
    """Publish the crafted snapshot; (key, "chunk" or "toc", a piece of the rule)."""
    members, stream = tar_stream(ENTRIES)
    chunk = "chunk"
    if case == "chunk-header-declares-the-manifest-size":
        options = dict(compress=lambda raw: zstd_frame(raw, inflate=BOMB))
        rule = "does not decompress to exactly its declared"
    elif case == "chunk-header-declares-no-size":
        options = dict(compress=lambda raw: zstd_frame(raw, content_size=None, inflate=BOMB))
        rule = "no content size"
    elif case == "chunk-header-declares-what-it-inflates-to":
        options = dict(
            compress=lambda raw: zstd_frame(raw, content_size=len(raw) + BOMB, inflate=BOMB)
        )
        rule = "frame declares"
    elif case == "chunk-second-frame":
        options = dict(compress=lambda raw: zstd_frame(raw) + zstd_frame(b"", inflate=BOMB))
        rule = "does not decompress to exactly its declared"
    elif case == "manifest-declares-more-than-the-header":
        options = dict(tamper=_grow_declared(MAX_CHUNK_RAW))  # the most a manifest may say
        rule = "frame declares"
    elif case == "manifest-and-header-declare-more-than-the-bytes-hold":
        options = dict(
            compress=lambda raw: zstd_frame(raw, content_size=MAX_CHUNK_RAW),
            tamper=_grow_declared(MAX_CHUNK_RAW),
        )
        rule = "more than zstd can expand"
    elif case == "toc-header-declares-the-manifest-size":
        options = dict(
            tamper=_toc_object(target.store, members, lambda raw: zstd_frame(raw, inflate=BOMB))
        )
        chunk, rule = "toc", "does not decompress to exactly its declared"
    elif case == "toc-manifest-and-header-declare-the-limit":
        options = dict(
            tamper=_toc_object(
                target.store,
                members,
                lambda raw: zstd_frame(raw, content_size=MAX_TOC_RAW),
                raw_size=MAX_TOC_RAW,
            )
        )
        chunk, rule = "toc", "more than zstd can expand"
    else:  # pragma: no cover
        raise AssertionError(case)
    key = publish_crafted(target.store, members, stream, prefix=target.prefix, **options).key
    return key, chunk, rule


BOMB_CASES = [
    "chunk-header-declares-the-manifest-size",
    "chunk-header-declares-no-size",
    "chunk-header-declares-what-it-inflates-to",
    "chunk-second-frame",
    "manifest-declares-more-than-the-header",
    "manifest-and-header-declare-more-than-the-bytes-hold",
    "toc-header-declares-the-manifest-size",
    "toc-manifest-and-header-declare-the-limit",
]

RESTORE_AND_MEASURE = """
import json, resource, sys
from snapshot.errors import SnapshotError
from snapshot.restore import restore
from snapshot.store import SnapshotStore
store = SnapshotStore(sys.argv[1])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {"error": None}
try:
    restore(store, sys.argv[2], sys.argv[3])
except SnapshotError as exc:
    out = {"error": type(exc).__name__, "message": str(exc),
           "chunk": getattr(exc, "chunk", None), "rule": getattr(exc, "rule", None)}
out["grew_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
print(json.dumps(out))
"""


def restore_in_child(target: Target, key: str) -> dict:
    """Restore in a fresh interpreter; its error, and how much its peak RSS grew (KiB)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", RESTORE_AND_MEASURE, target.store.url, key, str(target.prefix)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", BOMB_CASES)
def test_a_bomb_is_refused_within_the_declared_size(target: Target, case: str) -> None:
    key, which, rule = bomb_case(target, case)
    manifest = target.store.require_manifest(key)
    name = manifest.toc["name"] if which == "toc" else manifest.chunks[0].name
    out = restore_in_child(target, key)
    assert out["error"] == "CorruptSnapshotError", out
    assert out["chunk"] == name and name in out["message"], out
    assert rule in out["rule"] and out["rule"] in out["message"], out
    assert out["grew_kib"] < GREW_LIMIT_KIB, f"peak RSS grew {out['grew_kib']} KiB: {out}"
    target.assert_untouched()


def test_only_the_declared_bytes_of_an_object_are_fetched(target: Target) -> None:
    """The store holds more bytes than the manifest declares (chunk and TOC): a restore reads
    the declared bytes only (a range), never the whole object, and they are the snapshot."""

    def grow(m: dict) -> None:
        for ref in (m["chunks"][0], m["toc"]):
            data = target.store.fetch(m["key"], ref["name"]).result()
            target.store.put(m["key"], ref["name"], data + bytes(8 << 20)).result()

    key = target.publish(ENTRIES, tamper=grow)
    restore(target.store, key, target.prefix)
    assert (target.prefix / "lib/data").read_bytes() == b"a" * (1 << 20)
    target.canary.assert_unchanged()


# -- high: capture replay never deletes through a symlink -------------------------------------


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """The node's state directory, given to every capture call (never an environment
    variable: the library reads none)."""
    return tmp_path / "state"


def rel(path: Path) -> str:
    return str(path).lstrip("/")


def publish_capture(
    store: SnapshotStore, root: Path, entries: list[tuple], deleted: list[str]
) -> Manifest:
    members, stream = tar_stream(capture_entries([root], entries))
    return publish_crafted(
        store,
        members,
        stream,
        prefix="/",
        kind="capture",
        capture={"roots": [str(root)], "deleted": deleted},
    )


DELETIONS = {"file": "victim.txt", "tree": "tree", "nested": "tree/deep/keep.bin"}


@pytest.mark.parametrize("what", sorted(DELETIONS))
@pytest.mark.parametrize("planted_by", ["host", "earlier-replay"])
def test_replay_never_deletes_through_a_symlink(
    tmp_path: Path, state: Path, what: str, planted_by: str
) -> None:
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
        replay(store, first, [str(root)], state_dir=state)
        assert os.readlink(link) == str(canary.root)
    before = scan(root, exclude=())
    target = f"{rel(link)}/{DELETIONS[what]}"
    manifest = publish_capture(store, root, [("f", rel(root / "new.txt"), b"new\n")], [target])
    with pytest.raises(UnsafeMemberError) as caught:
        replay(store, manifest, [str(root)], state_dir=state)
    assert caught.value.member == target
    assert "symlink" in caught.value.rule and "never followed" in caught.value.rule
    assert rel(link) in caught.value.rule
    canary.assert_unchanged()
    assert scan(root, exclude=()) == before  # refused before anything changed
    assert not verify_capture(manifest.key, state)


def test_replay_deletes_a_listed_symlink_itself_not_its_target(tmp_path: Path, state: Path) -> None:
    canary = Canary.plant(tmp_path / "canary")
    store = SnapshotStore(str(tmp_path / "store"))
    root = tmp_path / "host" / "tool"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "to-tree").symlink_to(canary.tree)
    (root / "old").mkdir()
    (root / "old" / "f").write_text("old\n")
    manifest = publish_capture(
        store,
        root,
        [("f", rel(root / "new.txt"), b"new\n")],
        [rel(root / "sub" / "to-tree"), rel(root / "old")],
    )
    replay(store, manifest, [str(root)], state_dir=state)
    assert not os.path.lexists(root / "sub" / "to-tree") and not (root / "old").exists()
    assert (root / "new.txt").read_text() == "new\n"
    canary.assert_unchanged()


def test_capture_paths_may_not_hold_the_state_dir(tmp_path: Path) -> None:
    """The replay's record is bootseer's state: no snapshot member may reach it."""
    canary = Canary.plant(tmp_path / "canary")
    root = tmp_path / "host" / "tool"
    root.mkdir(parents=True)
    store = SnapshotStore(str(tmp_path / "store"))
    manifest = publish_capture(store, root, [("l", rel(root / "state"), str(canary.root))], [])
    with pytest.raises(SnapshotError, match="state directory"):
        replay(store, manifest, [str(root)], state_dir=root / "state")
    canary.assert_unchanged()
    assert list(root.iterdir()) == []


def test_the_capture_record_is_never_written_through_a_link(tmp_path: Path, state: Path) -> None:
    canary = Canary.plant(tmp_path / "canary")
    state.mkdir()
    (state / "captures").symlink_to(canary.root)
    store = SnapshotStore(str(tmp_path / "store"))
    root = tmp_path / "host" / "tool"
    root.mkdir(parents=True)
    manifest = publish_capture(store, root, [("f", rel(root / "new.txt"), b"new\n")], [])
    with pytest.raises(SnapshotError, match="never written through"):
        replay(store, manifest, [str(root)], state_dir=state)
    canary.assert_unchanged()


def test_the_packer_never_writes_a_chunk_restores_refuse(tmp_path: Path) -> None:
    """Chunks above the restore's cap would publish a snapshot no node can restore."""
    from snapshot.pack import pack_tree

    (tmp_path / "tree").mkdir()
    with pytest.raises(ValueError, match="chunk_size"):
        pack_tree(
            tmp_path / "tree",
            lambda name, data: None,
            publisher="test",
            chunk_size=MAX_CHUNK_RAW + 1,
        )
