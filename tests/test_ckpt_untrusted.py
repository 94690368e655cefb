"""A checkpoint is untrusted input: crafted bytes are refused, naming the file and the rule.

Every checkpoint here is written by the test itself, byte by byte (manifest, indexes, data
and objects files as plain files, which striped_fs reads like striped ones): the project's
own writers refuse to produce them. Each attack runs with a canary tree beside the
checkpoint, which must be unchanged afterwards, and a state to load into, which must be
untouched (nothing is loaded from a refused checkpoint).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shlex
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from canary import Canary

from bootseer.cli import main
from ckpt import CheckpointCorrupt, CheckpointManager, layout
from ckpt.dcp import ConversionError, dcp_to_bootseer
from ckpt.layout import (
    MANIFEST,
    MAX_BYTES,
    RankIndex,
    data_name,
    index_name,
    objects_name,
    tiling_problem,
)
from ckpt.persist import check_indexes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEP = 1


class RunsCode:
    """Unpickling this runs a shell command that writes into the canary (``os.system``)."""

    def __init__(self, canary: Canary) -> None:
        victim, marker = shlex.quote(str(canary.victim)), shlex.quote(str(canary.root / "pwned"))
        self.command = f"echo pwned >> {victim}; touch {marker}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


# -- writing a checkpoint by hand ----------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def rank_files(
    rank: int,
    world: int,
    tensors: dict[str, tuple[torch.Tensor, list[int], list[int]]],
    *,
    objects: bytes = b"",
    object_keys: tuple[str, ...] = (),
) -> tuple[dict, bytes, bytes]:
    """(index body, data bytes, objects bytes) of one rank; ``tensors`` maps a key to
    (the chunk's values, global shape, offsets of the chunk)."""
    data = bytearray()
    chunks = []
    for key, (values, global_shape, offsets) in tensors.items():
        raw = tensor_bytes(values)
        chunks.append(
            {
                "key": key,
                "kind": "tensor",
                "dtype": str(values.dtype).removeprefix("torch."),
                "global_shape": global_shape,
                "offsets": offsets,
                "shape": list(values.shape),
                "byte_offset": len(data),
                "nbytes": len(raw),
                "crc32": zlib.crc32(raw),
            }
        )
        data += raw + b"\0" * (-len(raw) % 64)
    body = {
        "step": STEP,
        "rank": rank,
        "world_size": world,
        "data_size": len(data),
        "chunks": chunks,
        "tensor_keys": sorted(tensors),
        "replicated_keys": [],
        "object_keys": sorted(object_keys),
        "objects_size": len(objects),
        "objects_crc32": zlib.crc32(objects) if objects else 0,
        "attempt": "",
        "format": 1,
        "created": 0.0,
    }
    return body, bytes(data), objects


def write_step(
    root: Path,
    ranks: list[tuple[dict, bytes, bytes]],
    manifest: Callable[[dict], None] | None = None,
) -> Path:
    """``step-1/`` of ``root``: every rank's files, then a manifest whose checksums match
    the indexes as written (``manifest`` may then change it)."""
    directory = root / f"step-{STEP}"
    directory.mkdir(parents=True)
    entries = []
    for r, (body, data, objects) in enumerate(ranks):
        raw_index = json.dumps(body).encode()
        (directory / index_name(r)).write_bytes(raw_index)
        (directory / data_name(r)).write_bytes(data)
        if objects:
            (directory / objects_name(r)).write_bytes(objects)
        entries.append(
            {"rank": r, "data_size": body["data_size"], "index_crc32": zlib.crc32(raw_index)}
        )
    body = {
        "step": STEP,
        "world_size": len(ranks),
        "ranks": entries,
        "total_bytes": 0,
        "tensor_count": 1,
        "format": 1,
        "created": 0.0,
    }
    if manifest is not None:
        manifest(body)
    (directory / MANIFEST).write_bytes(json.dumps(body).encode())
    return directory


def one_rank(
    chunk: Callable[[dict], None] | None = None, body: Callable[[dict], None] | None = None
) -> list[tuple[dict, bytes, bytes]]:
    """A 1-rank checkpoint of ``w`` = arange(8.) whose first chunk/index ``chunk``/``body``
    may change."""
    index, data, objects = rank_files(0, 1, {"w": (torch.arange(8.0), [8], [0])})
    if chunk is not None:
        chunk(index["chunks"][0])
    if body is not None:
        body(index)
    return [(index, data, objects)]


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Canary]:
    """The checkpoint root and a canary tree beside it (never inside)."""
    return tmp_path / "run", Canary.plant(tmp_path / "canary")


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``bootseer ARGS`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    out = capsys.readouterr()
    return exited.value.code, out.out, out.err


def assert_refused(
    root: Path, canary: Canary, *needles: str, objects: tuple[str, ...] = ()
) -> None:
    """verify fails, load and load_full raise, each naming ``needles`` (the file or tensor and
    the rule); nothing is loaded and the canary is unchanged. ``objects``: the object keys
    the checkpoint holds (the state to load into has them too)."""
    mgr = CheckpointManager(str(root), cache_dir=False)
    report = mgr.verify(STEP)
    problems = "\n".join(report.problems)
    assert not report.ok, "verify passed a crafted checkpoint"
    for needle in needles:
        assert needle in problems, (needle, problems)
    target: dict[str, Any] = {"w": torch.full((8,), -1.0), **dict.fromkeys(objects)}
    for attempt in (
        lambda: mgr.load(target),
        lambda: mgr.load(target, STEP),
        lambda: mgr.load_full(STEP),
    ):
        with pytest.raises(CheckpointCorrupt) as err:
            attempt()
        for needle in needles:
            assert needle in str(err.value), (needle, str(err.value))
    assert torch.equal(target["w"], torch.full((8,), -1.0)), "a refused checkpoint was loaded"
    assert all(target[k] is None for k in objects), "a refused checkpoint was loaded"
    canary.assert_unchanged()


# -- objects: never unpickled unless trusted by name -----------------------------------------------


def _objects_blob(canary: Canary, form: str) -> bytes:
    values = {"epoch": 3, "evil": RunsCode(canary)}
    if form == "pickle":  # protocol 2: torch's reader meets the global, not a new opcode, first
        return pickle.dumps(values, protocol=2)
    buffer = io.BytesIO()
    torch.save(values, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("form", ["torch.save", "pickle"])
def test_objects_that_run_code_are_never_unpickled_without_trust_objects(
    run, tmp_path, capsys, form
):
    root, canary = run
    blob = _objects_blob(canary, form)
    write_step(
        root,
        [
            rank_files(
                0,
                1,
                {"w": (torch.arange(8.0), [8], [0])},
                objects=blob,
                object_keys=("epoch", "evil"),
            )
        ],
    )
    objects_file = f"{root}/step-{STEP}/{objects_name(0)}"

    # verify checks the objects' bytes (size, CRC-32), runs no unpickler, and says so
    report = CheckpointManager(str(root), cache_dir=False).verify(STEP)
    assert report.ok and report.objects_not_deserialized == 2 and report.object_files == 1
    assert report.bytes_checked >= len(blob)
    code, out, _ = cli(capsys, "ckpt", "verify", str(root))
    assert code == 0 and f"step {STEP}: ok" in out
    assert "2 object(s) in 1 objects file(s) checked by size and CRC-32, not deserialized" in out
    code, out, _ = cli(capsys, "ckpt", "inspect", str(root), "--json")
    assert code == 0 and json.loads(out)["objects"] == {"0": ["epoch", "evil"]}
    code, out, _ = cli(capsys, "ckpt", "ls", str(root))
    assert code == 0
    canary.assert_unchanged()

    # the default load and load_full refuse before the payload runs, naming file and rule
    mgr = CheckpointManager(str(root), cache_dir=False)
    target = {"w": torch.zeros(8), "epoch": None, "evil": None}
    for attempt in (lambda: mgr.load(target), lambda: mgr.load_full()):
        with pytest.raises(CheckpointCorrupt) as err:
            attempt()
        text = str(err.value)
        assert objects_file in text and "posix.system" in text
        assert "not deserialized without trust_objects=True" in text and "--trust-objects" in text
    assert target["evil"] is None
    code, _, err_text = cli(
        capsys, "ckpt", "convert", str(root), str(tmp_path / "dcp"), "--from", "bootseer"
    )
    assert code == 2 and objects_file in err_text and "--trust-objects" in err_text
    assert not (tmp_path / "dcp").exists()
    canary.assert_unchanged()

    # control: the bytes are a live attack, and only the opt-in by name runs them
    trusting = CheckpointManager(str(root), cache_dir=False, trust_objects=True)
    try:
        trusting.load_full()
    except CheckpointCorrupt:
        pass  # a bare pickle: torch's legacy reader rejects it, after the payload ran
    assert (canary.root / "pwned").exists(), (
        "the crafted payload is not live: the test proves nothing"
    )


def test_verify_checks_the_objects_bytes_without_deserializing_them(run):
    root, canary = run
    blob = _objects_blob(canary, "torch.save")
    directory = write_step(
        root,
        [
            rank_files(
                0,
                1,
                {"w": (torch.arange(8.0), [8], [0])},
                objects=blob,
                object_keys=("epoch", "evil"),
            )
        ],
    )
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x01
    (directory / objects_name(0)).write_bytes(bytes(damaged))
    assert_refused(
        root,
        canary,
        f"{directory}/{objects_name(0)} does not match its index",
        objects=("epoch", "evil"),
    )


# -- the manifest's world size and ranks --------------------------------------------------------


def _ranks(listed: list[int]) -> Callable[[dict], None]:
    def change(m: dict) -> None:
        first = m["ranks"][0]
        m["ranks"] = [{**first, "rank": r} for r in listed]

    return change


@pytest.mark.parametrize(
    "change, rule",
    [
        (lambda m: m.update(world_size=-1), "world_size is -1 (rule: an integer in [1, 1048576])"),
        (lambda m: m.update(world_size=0, ranks=[]), "world_size is 0 (rule: an integer in [1, "),
        (
            lambda m: m.update(world_size=2),
            "world_size 2 but 1 rank(s) listed (rule: world_size "
            "equals the number of ranks listed)",
        ),
        (lambda m: m.update(world_size=2**40), "world_size is 1099511627776 (rule: an integer in"),
        (lambda m: m.update(world_size=True), "world_size is True (rule: an integer"),
        (
            lambda m: (_ranks([0, 0])(m), m.update(world_size=2)),
            "rank(s) [0] listed twice, [1] missing (rule: ranks 0..1 each listed once)",
        ),
        (
            lambda m: (_ranks([0, 2])(m), m.update(world_size=2)),
            "a rank is 2 (rule: an integer in [0, 1])",
        ),
        (
            lambda m: m.update(step=7),
            "says step 7 (rule: a manifest commits its own step directory)",
        ),
        (lambda m: m.update(created=1e300), "created is 1e+300 (rule: seconds since the epoch in"),
    ],
    ids=[
        "negative",
        "zero",
        "more-than-listed",
        "huge",
        "bool",
        "duplicate-rank",
        "rank-out-of-range",
        "other-step",
        "created-unprintable",
    ],
)
def test_a_crafted_world_size_or_rank_list_is_refused(run, capsys, change, rule):
    root, canary = run
    directory = write_step(root, one_rank(), manifest=change)
    assert_refused(root, canary, f"{directory}/{MANIFEST}", rule)
    code, out, _ = cli(capsys, "ckpt", "verify", str(root))
    assert code == 1 and "FAILED" in out and rule in out
    code, out, _ = cli(capsys, "ckpt", "ls", str(root))  # listed, not a traceback
    assert code == 0 and "(unreadable manifest)" in out
    canary.assert_unchanged()


@pytest.mark.parametrize(
    "change, rule",
    [
        (
            lambda b: b.update(world_size=3),
            "world_size 3, the manifest's is 1 (rule: one world size)",
        ),
        (lambda b: b.update(world_size=-1), "world_size is -1 (rule: an integer in [1,"),
        (lambda b: b.update(rank=0, world_size=2), "world_size 2, the manifest's is 1"),
        (lambda b: b.update(step=9), "step 9, the manifest's is 1 (rule: one step)"),
    ],
    ids=["index-world-3", "index-world-negative", "index-world-2", "index-other-step"],
)
def test_an_index_disagreeing_with_its_manifest_is_refused(run, change, rule):
    root, canary = run
    directory = write_step(root, one_rank(body=change))
    assert_refused(root, canary, f"{directory}/{index_name(0)}", rule)


def test_an_index_claiming_another_rank_is_refused(run):
    root, canary = run
    r0 = rank_files(0, 2, {"w": (torch.arange(4.0), [8], [0])})
    r1 = rank_files(0, 2, {"w": (torch.arange(4.0, 8.0), [8], [4])})  # says rank 0 again
    directory = write_step(root, [r0, r1])
    assert_refused(
        root, canary, f"{directory}/{index_name(1)}", "rank 0 (rule: rank-R's index is rank R's)"
    )


# -- what an index says about the state's structure ------------------------------------------------


@pytest.mark.parametrize(
    "kind, rule",
    [
        (
            "list",
            "the top level is recorded as a list but its keys are ['w'] (rule: a list holds "
            "items 0..n-1)",
        ),
        (
            "int",
            "the top level is recorded as keyed by integers but holds key 'w' (rule: integer keys)",
        ),
    ],
)
def test_container_kinds_that_contradict_the_keys_are_refused_by_load_full(run, kind, rule):
    """The record only shapes what load_full returns: load_full refuses a record that the
    keys contradict, naming the index; a load into a state of one's own does not use it."""
    root, canary = run
    directory = write_step(root, one_rank(body=lambda b: b.update(format=2, containers={"": kind})))
    mgr = CheckpointManager(str(root), cache_dir=False)
    with pytest.raises(CheckpointCorrupt) as err:
        mgr.load_full(STEP)
    assert f"{directory}/{index_name(0)}" in str(err.value) and rule in str(err.value)
    target = {"w": torch.zeros(8)}
    assert mgr.load(target) == STEP and torch.equal(target["w"], torch.arange(8.0))
    canary.assert_unchanged()


# -- chunk shapes: the chained != -----------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        # len(shape) == len(global_shape) != len(offsets): the chained != accepted it
        lambda c: c.update(global_shape=[2, 4], shape=[2, 4], offsets=[0]),
        # len(shape) != len(global_shape) == len(offsets): the chained != accepted it
        lambda c: c.update(global_shape=[8], shape=[2, 4], offsets=[0]),
        lambda c: c.update(global_shape=[8], shape=[8], offsets=[]),
    ],
    ids=["offsets-short", "shape-long", "offsets-empty"],
)
def test_chunk_dimensions_must_agree(run, change):
    root, canary = run
    directory = write_step(root, one_rank(chunk=change))
    assert_refused(
        root,
        canary,
        f"{directory}/{index_name(0)}: chunk 'w'",
        "(rule: the same number of dimensions, at most 64)",
    )


# -- load_full never returns memory that no chunk filled -------------------------------------------


def _two_ranks(a: tuple[int, int], b: tuple[int, int], length: int = 8) -> list:
    """``w`` of ``length`` elements stored as chunks [a0, a0+a1) on rank 0, [b0, b0+b1) on 1."""
    values = torch.arange(float(length + 8))
    return [
        rank_files(r, 2, {"w": (values[o : o + n], [length], [o])})
        for r, (o, n) in enumerate((a, b))
    ]


@pytest.mark.parametrize(
    "ranks, region",
    [
        (
            _two_ranks((0, 3), (5, 3)),
            "no chunk stores the elements at offsets [3] shape [2] (rule: "
            "the chunks cover the whole tensor)",
        ),
        (_two_ranks((0, 3), (3, 3)), "no chunk stores the elements at offsets [6] shape [2]"),
        (_two_ranks((2, 3), (5, 3)), "no chunk stores the elements at offsets [0] shape [2]"),
        # overlap and gap of the same size: the element count alone was right
        (
            _two_ranks((0, 4), (2, 4)),
            "chunks overlap at offsets [2] shape [2] (rule: every element stored once)",
        ),
        # one start, two shapes: the smaller used to shadow the other as a "replica"
        (_two_ranks((0, 8), (0, 4)), "chunks overlap at offsets [0] shape [4]"),
    ],
    ids=["hole", "short-tail", "missing-head", "overlap-and-gap", "shadowed-replica"],
)
def test_chunks_that_do_not_tile_the_tensor_are_refused(run, ranks, region):
    root, canary = run
    write_step(root, ranks)
    assert_refused(root, canary, "tensor 'w'", region)


def test_a_hole_in_a_2d_grid_is_named(run):
    root, canary = run
    values = torch.arange(16.0).view(4, 4)
    blocks = {(0, 0): values[:2, :2], (0, 2): values[:2, 2:], (2, 0): values[2:, :2]}  # no (2, 2)
    ranks = [
        rank_files(r, 3, {"w": (v, [4, 4], list(at))}) for r, (at, v) in enumerate(blocks.items())
    ]
    write_step(root, ranks)
    assert_refused(
        root, canary, "tensor 'w'", "no chunk stores the elements at offsets [2, 2] shape [2, 2]"
    )


def test_chunks_of_one_tensor_must_agree_on_dtype_and_shape(run):
    root, canary = run
    r0 = rank_files(0, 2, {"w": (torch.arange(4.0), [8], [0])})
    r1 = rank_files(1, 2, {"w": (torch.arange(4, dtype=torch.int32), [8], [4])})
    directory = write_step(root, [r0, r1])
    assert_refused(
        root,
        canary,
        f"{directory}/{index_name(1)}: chunk 'w' is int32 [8], rank 0's "
        "is float32 [8] (rule: every chunk of a tensor has one dtype and global shape)",
    )


# -- other declared lengths ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, rule",
    [
        (
            lambda c: c.update(offsets=[-2], shape=[8]),
            "(rule: a chunk lies inside its global shape [8])",
        ),
        (lambda c: c.update(offsets=[4]), "offsets [4] and shape [8] (rule: a chunk lies inside"),
        (
            lambda c: c.update(global_shape=[-8], offsets=[0]),
            "(rule: a chunk lies inside its global shape",
        ),
        (
            lambda c: c.update(byte_offset=40),
            "bytes 40+32 (rule: inside the data file, whose index says 64 bytes)",
        ),
        (lambda c: c.update(byte_offset=-8), "byte_offset is -8 (rule: an integer in [0,"),
        (
            lambda c: c.update(nbytes=16),
            "16 bytes for shape [8] of float32 (rule: nbytes = elements x 4)",
        ),
        (
            lambda c: c.update(nbytes=2**70),
            "nbytes is 1180591620717411303424 (rule: an integer in [0,",
        ),
        (lambda c: c.update(byte_offset=1.5), "byte_offset is 1.5 (rule: an integer"),
        (lambda c: c.update(offsets=[True]), "must be lists of integers"),
        (lambda c: c.update(dtype="object"), "unknown dtype 'object'"),
        (lambda c: c.update(kind="pickle"), "kind 'pickle' (rule: one of tensor, dtensor, flat)"),
        (
            lambda c: c.update(global_shape=[2**31] * 3, offsets=[0] * 3, shape=[8, 1, 1]),
            f"(rule: at most {MAX_BYTES} bytes)",
        ),
        (
            lambda c: c.update(global_shape=[1] * 65, offsets=[0] * 65, shape=[1] * 65),
            "(rule: the same number of dimensions, at most 64)",
        ),
        (lambda c: c.update(crc32=-1), "crc32 is -1 (rule: an integer in [0, 4294967295])"),
    ],
    ids=[
        "negative-offset",
        "past-the-end",
        "negative-global",
        "bytes-past-file",
        "negative-byte-offset",
        "nbytes-vs-shape",
        "nbytes-huge",
        "float-offset",
        "bool-dim",
        "unknown-dtype",
        "unknown-kind",
        "numel-overflow",
        "too-many-dims",
        "crc-negative",
    ],
)
def test_declared_chunk_lengths_are_checked(run, change, rule):
    root, canary = run
    directory = write_step(root, one_rank(chunk=change))
    assert_refused(root, canary, f"{directory}/{index_name(0)}", rule)


@pytest.mark.parametrize(
    "change, rule",
    [
        (lambda b: b.update(data_size=-64), "data_size is -64 (rule: an integer in [0,"),
        (lambda b: b.update(objects_size=-1), "objects_size is -1 (rule: an integer in [0,"),
        (lambda b: b.update(object_keys=[1, 2]), "object_keys must be a list of strings"),
        (lambda b: b.update(chunks={"w": 1}), "chunks must be a list of objects"),
        (
            lambda b: b["chunks"].append({**b["chunks"][0], "key": "alias"}),
            "chunk 'alias' at bytes 0+32 overlaps chunk 'w' (rule: chunks occupy disjoint byte ranges",
        ),
        # what the index says about the state's structure (format 2)
        (
            lambda b: b.update(format=2, containers=["w"]),
            "containers must map keys to one of ['list', 'int']",
        ),
        (
            lambda b: b.update(format=2, containers={"": "tuple"}),
            "containers must map keys to one of",
        ),
        (
            lambda b: b.update(format=2, key_style="pickle"),
            "key_style 'pickle' (rule: one of ['', 'dcp'])",
        ),
        (lambda b: b.update(format=3), "format 3, expected one of [1, 2]"),
    ],
    ids=[
        "negative-data-size",
        "negative-objects-size",
        "non-string-keys",
        "chunks-not-list",
        "aliased-bytes",
        "containers-list",
        "containers-kind",
        "key-style",
        "format-3",
    ],
)
def test_declared_index_lengths_are_checked(run, change, rule):
    root, canary = run
    directory = write_step(
        root,
        one_rank(body=change),  # the manifest keeps the real size
        manifest=lambda m: m["ranks"][0].update(data_size=64),
    )
    assert_refused(root, canary, f"{directory}/{index_name(0)}", rule)


def test_a_huge_declared_size_is_checked_against_the_file_before_allocating(run, monkeypatch):
    """An index declaring a 4 TiB tensor over a 64-byte file: refused by the file's size,
    and nothing of the declared size is ever allocated."""
    root, canary = run
    huge = 1 << 42

    def claim(b: dict) -> None:
        b["data_size"] = huge
        b["chunks"][0].update(global_shape=[huge // 4], shape=[huge // 4], nbytes=huge)

    directory = write_step(root, one_rank(body=claim))
    allocated: list[int] = []
    empty = torch.empty

    def spy(*shape: Any, **kwargs: Any) -> torch.Tensor:
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        allocated.append(int(torch.Size(size).numel()))
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    mgr = CheckpointManager(str(root), cache_dir=False)
    with pytest.raises(CheckpointCorrupt) as err:
        mgr.load_full()
    assert f"{directory}/{data_name(0)} holds 64 bytes, its index says {huge}" in str(err.value)
    assert not allocated or max(allocated) < 1 << 20, allocated
    report = mgr.verify(STEP)
    assert not report.ok and f"64 bytes, index says {huge}" in "\n".join(report.problems)
    canary.assert_unchanged()


# -- the writer's own commit check is the reader's ----------------------------------------------


def test_commit_refuses_overlapping_shards_whose_count_adds_up():
    """The commit counted elements: an overlap and a gap of the same size passed it."""
    indexes = [
        RankIndex.from_json(json.dumps(body).encode(), path=f"r{r}")
        for r, (body, _, _) in enumerate(_two_ranks((0, 4), (2, 4)))
    ]
    problems = check_indexes(indexes, STEP, 2)
    assert problems == [
        "the shards of 'w': chunks overlap at offsets [2] shape [2] (rule: every "
        "element stored once)"
    ]


def test_tiling_check_handles_non_grid_layouts_and_bounds_its_work(monkeypatch):
    # a legal non-grid layout: one full-width row block above two column blocks
    assert tiling_problem([4, 4], [([0, 0], [2, 4]), ([2, 0], [2, 2]), ([2, 2], [2, 2])]) is None
    assert tiling_problem([], [([], [])]) is None  # a scalar
    assert "offsets [] shape []" in tiling_problem([], [])
    assert tiling_problem([0, 5], []) is None  # nothing to cover
    rows = [([i, 0], [1, 2]) for i in range(50)]
    assert tiling_problem([50, 2], rows) is None
    column = ([0, 1], [50, 1])
    assert tiling_problem([50, 2], [*rows, column]).startswith(
        "chunks overlap at offsets [0, 1] shape [1, 1]"
    )
    monkeypatch.setattr(layout, "MAX_TILING_CELLS", 100)  # 50 rows + a column: 150 cells
    assert "too fragmented to check (rule: at most 100 cells)" in tiling_problem(
        [50, 2], [*rows, column]
    )


# -- DCP checkpoints: pickles, read only as DCP metadata and weights-only objects -------------------


def test_a_dcp_metadata_pickle_that_runs_code_is_refused(tmp_path, capsys):
    canary = Canary.plant(tmp_path / "canary")
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(RunsCode(canary)))
    with pytest.raises(ConversionError) as err:
        dcp_to_bootseer(str(src), str(tmp_path / "ours"), 0)
    assert (
        f"{src}/.metadata" in str(err.value)
        and "global posix.system is not DCP metadata" in str(err.value)
        and "--trust-objects" in str(err.value)
    )
    code, _, err_text = cli(
        capsys, "ckpt", "convert", str(src), str(tmp_path / "ours"), "--from", "dcp"
    )
    assert code == 2 and "posix.system is not DCP metadata" in err_text
    assert not (tmp_path / "ours").exists() or not any((tmp_path / "ours").iterdir())
    canary.assert_unchanged()


class UnknownLayout:
    """An allowed callable with an argument it has no answer for (a KeyError inside)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch.serialization._get_layout, ("torch.no_such_layout",))


@pytest.mark.parametrize(
    "payload, rule",
    [
        (pickle.dumps(UnknownLayout()), "not DCP metadata (KeyError: 'torch.no_such_layout')"),
        (b"\x80\x04\x95", "not DCP metadata ("),  # truncated
        (pickle.dumps(42), "holds a int, not DCP metadata"),
    ],
    ids=["allowed-callable-bad-argument", "truncated", "not-metadata"],
)
def test_a_malformed_dcp_metadata_pickle_is_a_clear_error(tmp_path, capsys, payload, rule):
    canary = Canary.plant(tmp_path / "canary")
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(payload)
    code, _, err_text = cli(
        capsys, "ckpt", "convert", str(src), str(tmp_path / "ours"), "--from", "dcp"
    )
    assert code == 2 and f"{src}/.metadata: " in err_text and rule in err_text, err_text
    assert "Traceback" not in err_text
    canary.assert_unchanged()


def test_a_dcp_entry_that_runs_code_is_refused_and_runs_only_when_trusted(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    canary = Canary.plant(tmp_path / "canary")
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.arange(8.0), "epoch": 3},
            storage_writer=dcp.FileSystemWriter(src),
            no_dist=True,
        )
        metadata = FileSystemReader(src).read_metadata()  # our own, trusted: written just now
    # the test's payload appended to the data file; the entry's storage record points at it
    payload = io.BytesIO()
    torch.save(RunsCode(canary), payload)
    (index,) = [i for i in metadata.storage_data if i.fqn == "epoch"]
    info = metadata.storage_data[index]
    data_file = src / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        info, offset=offset, length=len(payload.getvalue())
    )
    (src / ".metadata").write_bytes(pickle.dumps(metadata))

    code, _, err_text = cli(
        capsys, "ckpt", "convert", str(src), str(tmp_path / "ours"), "--from", "dcp"
    )
    assert code == 2, err_text
    assert f"{src}/{info.relative_path}: entry 'epoch'" in err_text and "posix.system" in err_text
    assert "--trust-objects" in err_text
    assert CheckpointManager(str(tmp_path / "ours"), cache_dir=False).latest() is None
    canary.assert_unchanged()

    # control: the entry is a live attack, and --trust-objects is what would run it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp_to_bootseer(str(src), str(tmp_path / "trusted"), 0, trust_objects=True)
        except Exception:  # noqa: BLE001 - os.system's return value is no valid state
            pass
    assert (canary.root / "pwned").exists(), (
        "the crafted payload is not live: the test proves nothing"
    )
