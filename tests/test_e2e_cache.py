"""The end-to-end benchmark's cache under ``--cache`` (benchmarks/e2e_cache.py): a second run
takes the first's image layers and conversion instead of building them again, and never a
stale or damaged entry (test_e2e.py's 2-node run relies on it for its time, not its result)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import e2e_cache  # noqa: E402
import e2e_image  # noqa: E402


def _tree(root: Path, text: str = "hello\n") -> Path:
    (root / "app/sub").mkdir(parents=True)
    (root / "app/hello.txt").write_text(text)
    (root / "app/sub/data.bin").write_bytes(os.urandom(1 << 16))
    os.symlink("hello.txt", root / "app/link")
    return root


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class Builds:
    """``cached_layer``'s build: ``layer_from_tree`` of ``tree``, counted."""

    def __init__(self, tree: Path, layers: Path) -> None:
        self.tree, self.layers, self.count = tree, layers, 0

    def __call__(self) -> dict[str, Any]:
        self.count += 1
        return e2e_image.layer_from_tree(self.tree, self.layers, "t", level=1)

    def layer(self) -> dict[str, Any]:
        key = e2e_cache.content_key(e2e_cache.tree_files(self.tree), "recipe", "1")
        return e2e_cache.cached_layer(self.layers, "t", key, self)


def test_a_layer_is_built_once_per_content_and_again_when_its_files_change(
    tmp_path: Path,
) -> None:
    build = Builds(_tree(tmp_path / "tree"), tmp_path / "layers")
    first = build.layer()
    again = build.layer()
    assert build.count == 1 and again["reused"] is True
    assert {k: again[k] for k in first} == first
    assert e2e_cache.intact(Path(again["path"]), first["digest"], first["size"])

    (tmp_path / "tree/app/hello.txt").write_text("changed\n")  # same size, other bytes
    changed = build.layer()
    assert build.count == 2 and "reused" not in changed
    assert changed["diff_id"] != first["diff_id"]


def test_the_key_covers_modes_links_and_names_and_never_reads_a_fifo(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    os.mkfifo(tree / "app/fifo")  # a device node or fifo (debootstrap's /dev): listed, not read

    def key() -> str:
        return e2e_cache.content_key(e2e_cache.tree_files(tree), "recipe")

    keys = [key()]
    os.chmod(tree / "app/hello.txt", 0o600)
    keys.append(key())
    os.unlink(tree / "app/link")
    os.symlink("sub/data.bin", tree / "app/link")
    keys.append(key())
    os.rename(tree / "app/sub", tree / "app/other")
    keys.append(key())
    keys.append(e2e_cache.content_key(e2e_cache.tree_files(tree), "another recipe"))
    assert len(set(keys)) == len(keys)
    assert key() == keys[-2]  # the same tree: the same key


def test_a_damaged_or_vanished_layer_blob_is_rebuilt_not_used(tmp_path: Path) -> None:
    build = Builds(_tree(tmp_path / "tree"), tmp_path / "layers")
    first = build.layer()
    _damage(Path(first["path"]))  # same size, one byte flipped
    rebuilt = build.layer()
    assert build.count == 2 and "reused" not in rebuilt
    assert rebuilt["digest"] == first["digest"]  # gzip -n of the same tar: the same blob
    assert e2e_cache.intact(Path(rebuilt["path"]), first["digest"], first["size"])

    Path(rebuilt["path"]).unlink()
    assert build.layer()["digest"] == first["digest"] and build.count == 3


# -- conversions ---------------------------------------------------------------------------------


def _push(registry: Any, layer: dict[str, Any], repo: str = "e2e/train") -> str:
    e2e_image.push_image(registry.host, repo, "gzip", [layer], e2e_image.image_config([layer]))
    return f"{registry.host}/{repo}:gzip"


def _converter(src: str, dst: str, calls: list[str]) -> Any:
    def convert() -> dict[str, Any]:
        from prefetch.image import convert_image

        calls.append(src)
        r = convert_image(src, dst, frame_size=64 << 10)
        return {"digest": r.digest, "seconds": r.seconds}

    return convert


def _never() -> dict[str, Any]:
    raise AssertionError("converted again: the kept conversion was not used")


def test_a_kept_conversion_is_pushed_into_a_fresh_registry_instead_of_converting(
    tmp_path: Path, registry_factory: Any
) -> None:
    from prefetch.image import verify_image

    layer = Builds(_tree(tmp_path / "tree"), tmp_path / "layers").layer()
    root, calls = tmp_path / "converted", []
    first_reg = registry_factory()
    src = _push(first_reg, layer)
    dst = f"{first_reg.host}/e2e/train:lazy"
    first = e2e_cache.convert_cached(root, src, dst, _converter(src, dst, calls))
    assert first["cached"] is False and calls == [src]

    fresh = registry_factory()  # another run's registry, another repository
    src2 = _push(fresh, layer, "e2e/train-nodes")
    dst2 = f"{fresh.host}/e2e/train-nodes:lazy"
    kept = e2e_cache.convert_cached(root, src2, dst2, _never)
    assert kept["cached"] is True
    assert kept["digest"] == first["digest"] and kept["layer_digests"] == first["layer_digests"]
    checked = verify_image(dst2)  # every blob, index and TOC entry of the pushed image
    assert checked.digest == first["digest"] and checked.layers == 1


@pytest.mark.parametrize("part", ["layer", "manifest", "record"])
def test_a_damaged_kept_conversion_is_converted_again_not_pushed(
    tmp_path: Path, registry_factory: Any, part: str
) -> None:
    layer = Builds(_tree(tmp_path / "tree"), tmp_path / "layers").layer()
    root, calls = tmp_path / "converted", []
    reg = registry_factory()
    src, dst = _push(reg, layer), f"{reg.host}/e2e/train:lazy"
    first = e2e_cache.convert_cached(root, src, dst, _converter(src, dst, calls))
    (entry,) = root.iterdir()
    if part == "layer":
        _damage(entry / "blobs" / first["layer_digests"][0].removeprefix("sha256:"))
    elif part == "manifest":
        _damage(entry / "manifest.json")
    else:  # a record naming another source
        record = json.loads((entry / "entry.json").read_text())
        (entry / "entry.json").write_text(json.dumps({**record, "source": "sha256:" + "0" * 64}))

    fresh = registry_factory()
    src2, dst2 = _push(fresh, layer), f"{fresh.host}/e2e/train:lazy"
    again = e2e_cache.convert_cached(root, src2, dst2, _converter(src2, dst2, calls))
    assert again["cached"] is False and calls == [src, src2]
    assert again["digest"] == first["digest"]
    # the entry was replaced by the new conversion: the next run takes it
    third = registry_factory()
    src3, dst3 = _push(third, layer), f"{third.host}/e2e/train:lazy"
    assert e2e_cache.convert_cached(root, src3, dst3, _never)["cached"] is True
