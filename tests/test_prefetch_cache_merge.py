"""The block cache (content-addressed, verified, bounded, persistent) and the OCI layer merge
rules (whiteouts, opaque directories, replacement, hardlinks across layers)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefetch.cache import BlockCache, FrameMemory
from prefetch.merge import merge_layers


def _frame(n: int, size: int = 1000) -> tuple[str, bytes]:
    data = hashlib.sha256(str(n).encode()).digest() * (size // 32)
    return hashlib.sha256(data).hexdigest(), data


def test_cache_round_trip_persists_and_verifies(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path, max_bytes=1 << 20)
    digest, data = _frame(1)
    assert cache.get(digest) is None
    cache.put(digest, data)
    assert cache.get(digest) == data
    again = BlockCache(tmp_path, max_bytes=1 << 20)  # a remount: the frames are still there
    assert digest in again and again.get(digest) == data and again.size == len(data)
    with pytest.raises(ValueError, match="do not match"):
        cache.put(_frame(2)[0], data)


def test_cache_drops_a_damaged_file_instead_of_serving_it(tmp_path: Path) -> None:
    cache = BlockCache(tmp_path)
    digest, data = _frame(3)
    cache.put(digest, data)
    path = tmp_path / "frames" / digest[:2] / digest
    damaged = bytearray(path.read_bytes())
    damaged[10] ^= 0xFF
    path.write_bytes(bytes(damaged))
    assert cache.get(digest) is None
    assert cache.dropped_corrupt == 1 and not path.exists() and digest not in cache


def test_cache_evicts_least_recently_used_and_cleans_torn_writes(tmp_path: Path) -> None:
    frames = [_frame(i) for i in range(10)]
    cache = BlockCache(tmp_path, max_bytes=5 * 992)
    for digest, data in frames[:5]:
        cache.put(digest, data)
    cache.get(frames[0][0])  # recently used: survives
    cache.put(*frames[5])
    assert frames[0][0] in cache and frames[1][0] not in cache
    assert cache.size <= cache.max_bytes
    (tmp_path / "frames" / "ab").mkdir(exist_ok=True)
    (tmp_path / "frames" / "ab" / ".tmp-deadbeef").write_bytes(b"torn")
    BlockCache(tmp_path)
    assert not (tmp_path / "frames" / "ab" / ".tmp-deadbeef").exists()


def test_frame_memory_is_bounded() -> None:
    mem = FrameMemory(max_bytes=3000)
    for i in range(5):
        mem.put(i, b"x" * 1000)
    assert mem.get(0) is None and mem.get(4) == b"x" * 1000


@dataclass
class E:
    """A TOC entry, as far as the merge reads one."""

    name: str
    type: str = "reg"
    link: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    xattrs: dict | None = None


def _paths(tree) -> dict[str, tuple[int, str]]:
    return {p: (n.layer, n.data.entry.type if n.data.entry else "dir") for p, n in tree.walk() if p}


def test_merge_whiteouts_opaque_and_replacement() -> None:
    lower = [
        E("etc", "dir", mode=0o755),
        E("etc/passwd"),
        E("etc/hosts"),
        E("opt", "dir", mode=0o755),
        E("opt/tool", "dir", mode=0o755),
        E("opt/tool/a"),
        E("opt/tool/sub", "dir", mode=0o755),
        E("opt/tool/sub/b"),
        E("lib", "dir"),
        E("lib/x.so"),
        E("data"),
        E("was-dir", "dir"),
        E("was-dir/f"),
    ]
    upper = [
        E("etc/.wh.hosts"),
        E("opt/tool/.wh..wh..opq"),
        E("opt/tool/new"),
        E("lib", "dir", mode=0o700),
        E("data", "symlink", link="/elsewhere"),
        E("was-dir"),
        E("usr/bin/implied"),
    ]
    tree = merge_layers([lower, upper])
    paths = _paths(tree)
    assert "etc/hosts" not in paths and paths["etc/passwd"] == (0, "reg")
    assert "opt/tool/a" not in paths and "opt/tool/sub" not in paths
    assert paths["opt/tool/new"] == (1, "reg")
    assert paths["lib"][0] == 1 and tree.lookup("lib").mode() & 0o777 == 0o700
    assert paths["lib/x.so"] == (0, "reg")  # a dir over a dir keeps the lower children
    assert paths["data"] == (1, "symlink")
    assert paths["was-dir"] == (1, "reg") and "was-dir/f" not in paths
    assert tree.lookup("usr/bin").is_dir and paths["usr/bin/implied"] == (1, "reg")
    # The whiteout hides lower layers only: an entry of the same layer stays.
    same = merge_layers([[E("d", "dir"), E("d/.wh.f"), E("d/f")]])
    assert same.lookup("d/f") is not None


def test_merge_hardlinks_share_content_and_inode_across_layers() -> None:
    tree = merge_layers([[E("a"), E("b", "hardlink", link="a")], [E("c", "hardlink", link="/a")]])
    a, b, c = (tree.lookup(p) for p in ("a", "b", "c"))
    assert a.ino == b.ino == c.ino and a.nlink == 3
    assert c.data is a and c.data.layer == 0
    broken = merge_layers([[E("x", "hardlink", link="missing"), E("y")]])
    assert broken.lookup("x") is None and broken.lookup("y") is not None  # the rest stays
    assert broken.problems == [
        "layer 0: member 'x' left out: hardlink to 'missing': no such file in this or a lower layer"
    ]


def test_merge_modes() -> None:
    tree = merge_layers([[E("bin", "dir", mode=0o755), E("bin/sh", mode=0o4755)]])
    assert tree.lookup("bin/sh").mode() == 0o104755
