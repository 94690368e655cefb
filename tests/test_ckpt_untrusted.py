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
from ckpt import CheckpointCorrupt, CheckpointManager
from ckpt.dcp import ConversionError, dcp_to_bootseer
from ckpt.layout import MANIFEST, data_name, index_name, objects_name

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


def rank_files(rank: int, world: int, tensors: dict[str, tuple[torch.Tensor, list[int], list[int]]],
               *, objects: bytes = b"", object_keys: tuple[str, ...] = ()) -> tuple[dict, bytes, bytes]:
    """(index body, data bytes, objects bytes) of one rank; ``tensors`` maps a key to
    (the chunk's values, global shape, offsets of the chunk)."""
    data = bytearray()
    chunks = []
    for key, (values, global_shape, offsets) in tensors.items():
        raw = tensor_bytes(values)
        chunks.append({"key": key, "kind": "tensor", "dtype": str(values.dtype).removeprefix("torch."),
                       "global_shape": global_shape, "offsets": offsets,
                       "shape": list(values.shape), "byte_offset": len(data), "nbytes": len(raw),
                       "crc32": zlib.crc32(raw)})
        data += raw + b"\0" * (-len(raw) % 64)
    body = {"step": STEP, "rank": rank, "world_size": world, "data_size": len(data),
            "chunks": chunks, "tensor_keys": sorted(tensors), "replicated_keys": [],
            "object_keys": sorted(object_keys), "objects_size": len(objects),
            "objects_crc32": zlib.crc32(objects) if objects else 0, "attempt": "", "format": 1,
            "created": 0.0}
    return body, bytes(data), objects


def write_step(root: Path, ranks: list[tuple[dict, bytes, bytes]],
               manifest: Callable[[dict], None] | None = None) -> Path:
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
        entries.append({"rank": r, "data_size": body["data_size"], "index_crc32": zlib.crc32(raw_index)})
    body = {"step": STEP, "world_size": len(ranks), "ranks": entries, "total_bytes": 0,
            "tensor_count": 1, "format": 1, "created": 0.0}
    if manifest is not None:
        manifest(body)
    (directory / MANIFEST).write_bytes(json.dumps(body).encode())
    return directory


def one_rank(chunk: Callable[[dict], None] | None = None,
             body: Callable[[dict], None] | None = None) -> list[tuple[dict, bytes, bytes]]:
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


def assert_refused(root: Path, canary: Canary, *needles: str, objects: tuple[str, ...] = ()) -> None:
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
    for attempt in (lambda: mgr.load(target), lambda: mgr.load(target, STEP),
                    lambda: mgr.load_full(STEP)):
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
def test_objects_that_run_code_are_never_unpickled_without_trust_objects(run, tmp_path, capsys,
                                                                         form):
    root, canary = run
    blob = _objects_blob(canary, form)
    write_step(root, [rank_files(0, 1, {"w": (torch.arange(8.0), [8], [0])}, objects=blob,
                                 object_keys=("epoch", "evil"))])
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
    code, _, err_text = cli(capsys, "ckpt", "convert", str(root), str(tmp_path / "dcp"),
                            "--from", "bootseer")
    assert code == 2 and objects_file in err_text and "--trust-objects" in err_text
    assert not (tmp_path / "dcp").exists()
    canary.assert_unchanged()

    # control: the bytes are a live attack, and only the opt-in by name runs them
    trusting = CheckpointManager(str(root), cache_dir=False, trust_objects=True)
    try:
        trusting.load_full()
    except CheckpointCorrupt:
        pass  # a bare pickle: torch's legacy reader rejects it, after the payload ran
    assert (canary.root / "pwned").exists(), "the crafted payload is not live: the test proves nothing"


def test_verify_checks_the_objects_bytes_without_deserializing_them(run):
    root, canary = run
    blob = _objects_blob(canary, "torch.save")
    directory = write_step(root, [rank_files(0, 1, {"w": (torch.arange(8.0), [8], [0])},
                                             objects=blob, object_keys=("epoch", "evil"))])
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x01
    (directory / objects_name(0)).write_bytes(bytes(damaged))
    assert_refused(root, canary, f"{directory}/{objects_name(0)} does not match its index",
                   objects=("epoch", "evil"))


# -- DCP checkpoints: pickles, read only as DCP metadata and weights-only objects -------------------

def test_a_dcp_metadata_pickle_that_runs_code_is_refused(tmp_path, capsys):
    canary = Canary.plant(tmp_path / "canary")
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(RunsCode(canary)))
    with pytest.raises(ConversionError) as err:
        dcp_to_bootseer(str(src), str(tmp_path / "ours"), 0)
    assert f"{src}/.metadata" in str(err.value) and "global posix.system is not DCP metadata" in \
        str(err.value) and "--trust-objects" in str(err.value)
    code, _, err_text = cli(capsys, "ckpt", "convert", str(src), str(tmp_path / "ours"),
                            "--from", "dcp")
    assert code == 2 and "posix.system is not DCP metadata" in err_text
    assert not (tmp_path / "ours").exists() or not any((tmp_path / "ours").iterdir())
    canary.assert_unchanged()


def test_a_dcp_entry_that_runs_code_is_refused_and_runs_only_when_trusted(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    canary = Canary.plant(tmp_path / "canary")
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(8.0), "epoch": 3}, storage_writer=dcp.FileSystemWriter(src),
                 no_dist=True)
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
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset,
                                                       length=len(payload.getvalue()))
    (src / ".metadata").write_bytes(pickle.dumps(metadata))

    code, _, err_text = cli(capsys, "ckpt", "convert", str(src), str(tmp_path / "ours"),
                            "--from", "dcp")
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
    assert (canary.root / "pwned").exists(), "the crafted payload is not live: the test proves nothing"
