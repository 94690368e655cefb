"""striped_fs behaves as an fsspec filesystem where data can be lost: mv, rm, globs, ls of a
file, ``with`` blocks left by an exception, exclusive creation, transactions, get_file.

Every test runs on memory, local disk and S3 (the session's moto server) and checks the
bytes, not only that the call returned.
"""

from __future__ import annotations

import io
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest

from striped_fs import StripedFileSystem
from striped_fs.layout import stripes_dir

STRIPE = 4096


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@dataclass
class Target:
    """A striped filesystem over one target, a root inside it, and its URL form."""

    fs: StripedFileSystem
    root: str
    protocol: str
    options: dict[str, Any] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"striped::{self.protocol}://{path}"

    def open(self, path: str, mode: str) -> Any:
        """``fsspec.open`` on the URL, as a library that only knows URLs would."""
        opts = {self.protocol: self.options} if self.options else {}
        return fsspec.open(self.url(path), mode, striped={"stripe_size": STRIPE}, **opts)

    def stripe_objects(self, path: str) -> list[str]:
        """What the target holds under ``path``'s stripes directory (nothing, once removed)."""
        self.fs.invalidate_cache()
        try:
            return self.fs.target.find(stripes_dir(path))
        except FileNotFoundError:
            return []


@pytest.fixture(params=["memory", "file", "s3"])
def target(request, tmp_path) -> Iterator[Target]:
    kind = request.param
    common = {"stripe_size": STRIPE, "concurrency": 4, "skip_instance_cache": True}
    if kind == "memory":
        fs = StripedFileSystem(target_protocol="memory", **common)
        root = f"/sem-{uuid.uuid4().hex[:12]}"
        fs.target.mkdir(root)
        t = Target(fs, root, "memory")
    elif kind == "file":
        fs = StripedFileSystem(target_protocol="file", **common)
        t = Target(fs, str(tmp_path / "remote"), "file")
        fs.makedirs(t.root)
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        fs = StripedFileSystem(
            target_protocol="s3", target_options={**options, "skip_instance_cache": True}, **common
        )
        t = Target(fs, bucket, "s3", options)
    yield t
    if kind == "memory" and fs.target.exists(t.root):
        fs.target.rm(t.root, recursive=True)
    fs.close()


def _names(fs: StripedFileSystem, path: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/", 1)[1] for p in fs.ls(path, detail=False))


# -- mv ------------------------------------------------------------------------------------------


def test_mv_onto_itself_keeps_the_file(target):
    fs, p = target.fs, f"{target.root}/same.bin"
    data = payload(3 * STRIPE + 5)
    fs.pipe_file(p, data)
    fs.mv(p, p)
    assert fs.cat_file(p) == data


def test_mv_glob_moves_the_data_not_only_the_manifests(target):
    fs, d = target.fs, f"{target.root}/d"
    files = {
        "a.bin": payload(2 * STRIPE + 1, 1),
        "b.bin": payload(STRIPE, 2),
        "keep.txt": b"not matched",
    }
    for name, data in files.items():
        fs.pipe_file(f"{d}/{name}", data)
    fs.mv(f"{d}/*.bin", f"{d}/sub/")
    assert fs.cat_file(f"{d}/sub/a.bin") == files["a.bin"]
    assert fs.cat_file(f"{d}/sub/b.bin") == files["b.bin"]
    assert fs.cat_file(f"{d}/keep.txt") == files["keep.txt"]
    assert _names(fs, d) == ["keep.txt", "sub"]
    assert target.stripe_objects(f"{d}/a.bin") == [] and target.stripe_objects(f"{d}/b.bin") == []


def test_mv_file_into_an_existing_directory_puts_it_inside(target):
    fs, root = target.fs, target.root
    data, other = payload(2 * STRIPE + 7, 3), payload(100, 4)
    fs.pipe_file(f"{root}/model.bin", data)
    fs.pipe_file(f"{root}/dir/other.bin", other)  # the directory exists (on S3: has a key)
    fs.mv(f"{root}/model.bin", f"{root}/dir")
    assert fs.cat_file(f"{root}/dir/model.bin") == data
    assert fs.cat_file(f"{root}/dir/other.bin") == other
    assert fs.isdir(f"{root}/dir")
    assert not fs.exists(f"{root}/model.bin")
    assert target.stripe_objects(f"{root}/model.bin") == []


def test_mv_of_lists(target):
    fs, root = target.fs, target.root
    blobs = [payload(STRIPE + i, 10 + i) for i in range(4)]
    for i, data in enumerate(blobs):
        fs.pipe_file(f"{root}/src/f{i}", data)
    fs.mv([f"{root}/src/f0", f"{root}/src/f1"], [f"{root}/x/g0", f"{root}/y/g1"])
    assert fs.cat_file(f"{root}/x/g0") == blobs[0] and fs.cat_file(f"{root}/y/g1") == blobs[1]
    fs.mv([f"{root}/src/f2", f"{root}/src/f3"], f"{root}/into/")  # a list into a directory
    assert fs.cat_file(f"{root}/into/f2") == blobs[2] and fs.cat_file(f"{root}/into/f3") == blobs[3]
    assert not fs.exists(f"{root}/src") or _names(fs, f"{root}/src") == []


def test_mv_directory_moves_every_file(target):
    fs, root = target.fs, target.root
    blobs = {f"d/f{i}": payload(STRIPE * i + 3, i) for i in range(3)}
    blobs["d/n/deep"] = payload(5, 9)
    for name, data in blobs.items():
        fs.pipe_file(f"{root}/{name}", data)
    fs.mv(f"{root}/d", f"{root}/e", recursive=True)
    for name, data in blobs.items():
        assert fs.cat_file(f"{root}/{name.replace('d/', 'e/', 1)}") == data
    assert not fs.exists(f"{root}/d")
    with pytest.raises(ValueError, match="into itself"):
        fs.mv(f"{root}/e", f"{root}/e/inner", recursive=True)
    assert fs.cat_file(f"{root}/e/n/deep") == blobs["d/n/deep"]
    fs.mv(f"{root}/e", f"{root}/d")  # a directory moves whole without recursive=True too
    for name, data in blobs.items():
        assert fs.cat_file(f"{root}/{name}") == data
    assert not fs.exists(f"{root}/e")


def test_mv_that_cannot_write_the_destination_keeps_the_source(target):
    fs, root = target.fs, target.root
    data = payload(3 * STRIPE, 5)
    fs.pipe_file(f"{root}/src.bin", data)
    if target.protocol == "s3":
        dst = f"no-such-bucket-{uuid.uuid4().hex[:8]}/dst.bin"  # the store refuses the copy
    else:
        fs.target.pipe_file(f"{root}/blocker", b"a plain file where a directory must go")
        dst = f"{root}/blocker/dst.bin"
    with pytest.raises(OSError):
        fs.mv(f"{root}/src.bin", dst)
    assert fs.cat_file(f"{root}/src.bin") == data


def test_mv_of_a_missing_source_is_an_error_naming_it(target):
    with pytest.raises(FileNotFoundError, match="nothing.bin"):
        target.fs.mv(f"{target.root}/nothing.bin", f"{target.root}/b.bin")
    with pytest.raises(FileNotFoundError, match=r"\*\.none"):
        target.fs.mv(f"{target.root}/*.none", f"{target.root}/b/")


# -- rm ------------------------------------------------------------------------------------------


def test_rm_expands_globs(target):
    fs, d = target.fs, f"{target.root}/d"
    fs.pipe_file(f"{d}/a.bin", payload(2 * STRIPE, 1))
    fs.pipe_file(f"{d}/b.bin", payload(STRIPE, 2))
    fs.pipe_file(f"{d}/keep.txt", b"kept")
    fs.rm(f"{d}/*.bin")
    assert _names(fs, d) == ["keep.txt"]
    assert fs.cat_file(f"{d}/keep.txt") == b"kept"
    assert target.stripe_objects(f"{d}/a.bin") == [] and target.stripe_objects(f"{d}/b.bin") == []
    with pytest.raises(FileNotFoundError, match=r"\*\.bin"):
        fs.rm(f"{d}/*.bin")  # nothing matches any more: said, not silently ignored


def test_rm_of_an_existing_name_with_glob_characters_removes_only_it(target):
    fs, d = target.fs, f"{target.root}/d"
    fs.pipe_file(f"{d}/x[1].bin", b"literal")
    fs.pipe_file(f"{d}/x1.bin", b"would match the pattern")
    fs.rm(f"{d}/x[1].bin")
    assert _names(fs, d) == ["x1.bin"]
    assert fs.cat_file(f"{d}/x1.bin") == b"would match the pattern"


def test_rm_recursive_glob_and_list(target):
    fs, root = target.fs, target.root
    for name in ("r1/a", "r1/n/b", "r2/c", "s/d", "t"):
        fs.pipe_file(f"{root}/{name}", name.encode())
    with pytest.raises(IsADirectoryError):
        fs.rm(f"{root}/r*")
    fs.rm(f"{root}/r*", recursive=True)
    fs.rm([f"{root}/s/d", f"{root}/t"])
    fs.invalidate_cache()
    assert fs.find(target.root) == []


def test_rm_with_maxdepth_keeps_what_is_deeper(target):
    fs, root = target.fs, target.root
    for name in ("m/a", "m/n/b", "m/n/o/c"):
        fs.pipe_file(f"{root}/{name}", name.encode())
    fs.rm(f"{root}/m", recursive=True, maxdepth=2)
    fs.invalidate_cache()
    assert fs.find(f"{root}/m") == [f"{root}/m/n/o/c"]
    assert fs.cat_file(f"{root}/m/n/o/c") == b"m/n/o/c"


def test_stripes_directories_cannot_be_named(target):
    fs, root = target.fs, target.root
    fs.pipe_file(f"{root}/f.bin", payload(2 * STRIPE))
    for call in (
        lambda: fs.rm(f"{root}/.f.bin.stripes", recursive=True),
        lambda: fs.mv(f"{root}/.f.bin.stripes", f"{root}/elsewhere"),
    ):
        with pytest.raises(ValueError, match="stripes"):
            call()
    assert fs.cat_file(f"{root}/f.bin") == payload(2 * STRIPE)


# -- ls, get_file ---------------------------------------------------------------------------------


def test_ls_of_a_file_reports_the_file_not_its_manifest(target):
    fs, p = target.fs, f"{target.root}/f.bin"
    fs.pipe_file(p, payload(3 * STRIPE + 11))
    (entry,) = fs.ls(p, detail=True)
    assert entry["size"] == 3 * STRIPE + 11 and entry["striped"] is True
    assert fs.ls(p, detail=False) == [entry["name"]]


def test_get_file_creates_the_local_parent_and_takes_a_file_object(target, tmp_path):
    fs, p = target.fs, f"{target.root}/f.bin"
    data = payload(5 * STRIPE + 3, 7)
    fs.pipe_file(p, data)
    local = tmp_path / "new" / "nested" / "f.bin"
    fs.get_file(p, str(local))
    assert local.read_bytes() == data
    buf = io.BytesIO()
    fs.get_file(p, buf)
    assert buf.getvalue() == data


# -- with blocks left by an exception --------------------------------------------------------


@pytest.mark.parametrize("how", ["fsspec.open wb", "fsspec.open w", "fs.open wb", "fs.open w"])
def test_with_block_left_by_an_exception_commits_nothing(target, how):
    fs, p = target.fs, f"{target.root}/w.bin"
    opener, mode = how.split()
    ctx = target.open(p, mode) if opener == "fsspec.open" else fs.open(p, mode)
    with pytest.raises(RuntimeError, match="crashed"), ctx as f:
        f.write(b"x" * (3 * STRIPE) if "b" in mode else "x" * (3 * STRIPE))
        raise RuntimeError("training crashed")
    assert not fs.exists(p)
    assert target.stripe_objects(p) == []
    # an overwrite that fails keeps the old version, byte for byte
    fs.pipe_file(p, b"old version")
    ctx = target.open(p, mode) if opener == "fsspec.open" else fs.open(p, mode)
    with pytest.raises(RuntimeError), ctx as f:
        f.write(b"y" * (2 * STRIPE) if "b" in mode else "y" * (2 * STRIPE))
        raise RuntimeError("crashed again")
    assert fs.cat_file(p) == b"old version"
    # and a with block that ends normally commits, as always
    with target.open(p, mode) as f:
        f.write(b"new" if "b" in mode else "new")
    assert fs.cat_file(p) == b"new"


def test_close_inside_an_except_block_for_an_earlier_error_commits(target):
    fs, p = target.fs, f"{target.root}/fallback.bin"
    try:
        raise KeyError("a failure the caller handles")
    except KeyError:
        f = fs.open(p, "wb")
        f.write(b"fallback")
        f.close()
    assert fs.cat_file(p) == b"fallback"


def test_close_in_a_finally_while_an_error_propagates_discards_and_commit_commits(target):
    fs, root = target.fs, target.root
    with pytest.raises(ValueError):
        f = fs.open(f"{root}/finally.bin", "wb")
        try:
            f.write(payload(2 * STRIPE))
            raise ValueError("bad batch")
        finally:
            f.close()
    assert not fs.exists(f"{root}/finally.bin")
    assert target.stripe_objects(f"{root}/finally.bin") == []
    f = fs.open(f"{root}/chosen.bin", "wb")
    try:
        raise ValueError("handled, and the file is wanted anyway")
    except ValueError:
        f.write(b"kept on purpose")
        f.commit()
    assert fs.cat_file(f"{root}/chosen.bin") == b"kept on purpose"


# -- exclusive creation ----------------------------------------------------------------------


def test_pipe_and_put_with_mode_create_refuse_an_existing_file(target, tmp_path):
    fs, p = target.fs, f"{target.root}/x.bin"
    fs.pipe_file(p, b"first")
    with pytest.raises(FileExistsError):
        fs.pipe_file(p, b"second", mode="create")
    local = tmp_path / "up.bin"
    local.write_bytes(payload(2 * STRIPE))
    with pytest.raises(FileExistsError):
        fs.put_file(str(local), p, mode="create")
    assert fs.cat_file(p) == b"first"
    fs.put_file(str(local), f"{target.root}/new.bin", mode="create")
    assert fs.cat_file(f"{target.root}/new.bin") == local.read_bytes()


def test_exclusive_create_is_decided_at_the_commit(target):
    """Two ``xb`` writers opened before either commits: the second commit is refused."""
    fs, p = target.fs, f"{target.root}/race.bin"
    first, second = fs.open(p, "xb"), fs.open(p, "xb")
    first.write(payload(2 * STRIPE, 1))
    second.write(payload(3 * STRIPE, 2))
    first.close()
    with pytest.raises(FileExistsError):
        second.close()
    assert fs.cat_file(p) == payload(2 * STRIPE, 1)
    fs.invalidate_cache()
    assert len(fs.target.ls(stripes_dir(p), detail=False)) == 1  # the loser's stripes are gone


# -- transactions --------------------------------------------------------------------------------


def test_transaction_commits_at_its_end(target):
    fs, root = target.fs, target.root
    fs.pipe_file(f"{root}/src.bin", payload(STRIPE + 1, 3))
    with fs.transaction:
        fs.pipe_file(f"{root}/a.bin", payload(2 * STRIPE, 1))
        with fs.open(f"{root}/b.bin", "wb") as f:
            f.write(payload(STRIPE + 9, 2))
        fs.cp_file(f"{root}/src.bin", f"{root}/c.bin")
        assert not fs.exists(f"{root}/a.bin") and not fs.exists(f"{root}/b.bin")
        assert not fs.exists(f"{root}/c.bin")
    assert fs.cat_file(f"{root}/a.bin") == payload(2 * STRIPE, 1)
    assert fs.cat_file(f"{root}/b.bin") == payload(STRIPE + 9, 2)
    assert fs.cat_file(f"{root}/c.bin") == payload(STRIPE + 1, 3)


def test_transaction_left_by_an_exception_commits_nothing(target):
    fs, root = target.fs, target.root
    fs.pipe_file(f"{root}/a.bin", b"before")
    with pytest.raises(RuntimeError), fs.transaction:
        fs.pipe_file(f"{root}/a.bin", payload(2 * STRIPE, 1))
        fs.pipe_file(f"{root}/b.bin", payload(STRIPE, 2))
        raise RuntimeError("abandoned")
    assert fs.cat_file(f"{root}/a.bin") == b"before"
    assert not fs.exists(f"{root}/b.bin")
    assert target.stripe_objects(f"{root}/b.bin") == []
    assert len(fs.target.ls(stripes_dir(f"{root}/a.bin"), detail=False)) == 1


def test_what_a_transaction_cannot_defer_is_refused(target):
    fs, root = target.fs, target.root
    fs.pipe_file(f"{root}/a.bin", b"kept")
    fs.target.pipe_file(f"{root}/plain.txt", b"plain")
    with fs.transaction:
        for call in (
            lambda: fs.rm(f"{root}/a.bin"),
            lambda: fs.rm_file(f"{root}/a.bin"),
            lambda: fs.mv(f"{root}/a.bin", f"{root}/b.bin"),
            lambda: fs.cp_file(f"{root}/plain.txt", f"{root}/copy.txt"),
        ):
            with pytest.raises(NotImplementedError, match="transaction"):
                call()
    assert fs.cat_file(f"{root}/a.bin") == b"kept" and not fs.exists(f"{root}/b.bin")
    assert not fs.exists(f"{root}/copy.txt")
