"""torch.distributed.checkpoint over ``striped::`` where a checkpoint could be lost or mixed:
``async_save``, ``overwrite=False``, a write that fails part-way (an exception in the data,
the S3 link lost), and PyTorch's own ``test_remove_on_fail``, on local disk and S3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_ckpt_dcp import _assert_same, _assert_striped, _fresh_state, _trained_state
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from bootseer.testing.shaper import Shaper, ShaperSettings
from striped_fs import StripedIOError
from striped_fs.layout import stripes_dir
from striped_fs.urls import url_to_fs

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning", "ignore:.*overwrite.*:UserWarning"
)

STRIPED = {"stripe_size": "4KiB", "retries": 1, "backoff_s": 0.01}


@dataclass
class Store:
    """Where a checkpoint goes: a ``striped::`` URL and the fsspec options DCP passes on."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def writer(self, **kwargs: Any) -> FsspecWriter:
        return FsspecWriter(self.url, striped=STRIPED, **self.options, **kwargs)

    def reader(self) -> FsspecReader:
        return FsspecReader(self.url, **self.options)

    def fs(self):
        fs, root = url_to_fs(self.url, self.options)
        fs.invalidate_cache()
        return fs, root


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> Iterator[Store]:
    if request.param == "file":
        yield Store(f"striped::file://{tmp_path}/dcp")
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        yield Store(f"striped::s3://{bucket}/runs/dcp", {"s3": options})


class _FaultAt(dcp.DefaultSavePlanner):
    """Runs ``fault`` when DCP asks for the ``at``-th item's data: the storage writer has
    already streamed the items before it into the open data file."""

    def __init__(self, at: int, fault: Callable[[], None]) -> None:
        super().__init__()
        self.at, self.fault, self.calls = at, fault, 0

    def resolve_data(self, write_item):
        self.calls += 1
        if self.calls == self.at:
            self.fault()
        return super().resolve_data(write_item)


def _big_state(seed: int) -> dict[str, Any]:
    """Tensors of several 4 KiB stripes each, so that a failed file has stripes uploaded."""
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64, 64, generator=g) for i in range(6)}


def _causes(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _nothing_committed(store: Store) -> None:
    fs, root = store.fs()
    names = [n.rsplit("/", 1)[1] for n in fs.ls(root, detail=False)] if fs.exists(root) else []
    assert ".metadata" not in names and not [n for n in names if n.endswith(".distcp")], names


# -- save and load -------------------------------------------------------------------------------


def test_dcp_sync_and_async_save_load(store):
    _, _, state = _trained_state(0)
    dcp.save(state, storage_writer=store.writer())
    _assert_striped(store.url, [".metadata", "__0_0.distcp"], store.options)
    target = _fresh_state()
    dcp.load(target, storage_reader=store.reader())
    _assert_same(state, target)

    later = _trained_state(2)[2]
    future = dcp.async_save(later, storage_writer=store.writer(overwrite=True))
    future.result()
    target = _fresh_state()
    dcp.load(target, storage_reader=store.reader())
    _assert_same(later, target)


def test_dcp_overwrite_false_refuses_and_keeps_the_first(store):
    _, _, first = _trained_state(0)
    dcp.save(first, storage_writer=store.writer(overwrite=False))
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(_trained_state(1)[2], storage_writer=store.writer(overwrite=False))
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.async_save(_trained_state(1)[2], storage_writer=store.writer(overwrite=False)).result()
    target = _fresh_state()
    dcp.load(target, storage_reader=store.reader())
    _assert_same(first, target)


# -- a write that fails part-way -------------------------------------------------------------


def test_dcp_failing_write_commits_nothing(store):
    def boom() -> None:
        raise OSError("device lost while saving")

    with pytest.raises(CheckpointException) as err:
        dcp.save(_big_state(1), storage_writer=store.writer(), planner=_FaultAt(4, boom))
    assert "device lost while saving" in str(err.value.failures[0][0])
    _nothing_committed(store)
    fs, root = store.fs()
    assert fs.target.find(stripes_dir(f"{root}/__0_0.distcp")) == []  # the stripes went too


def test_dcp_failed_overwrite_never_loads_mixed_data(store):
    """DCP's create_stream removes the file it failed to write, and with it the previous
    version: the old checkpoint's metadata is left pointing at a missing file. A load then
    fails naming that file; it never returns old and new tensors mixed."""

    def boom() -> None:
        raise OSError("device lost while saving")

    dcp.save(_big_state(2), storage_writer=store.writer())
    with pytest.raises(CheckpointException):
        dcp.save(_big_state(3), storage_writer=store.writer(), planner=_FaultAt(4, boom))
    with pytest.raises(CheckpointException, match="__0_0.distcp"):
        dcp.load(_big_state(4), storage_reader=store.reader())


def test_dcp_s3_link_lost_mid_save_reaches_the_caller_and_commits_nothing(s3_server, s3_bucket):
    bucket, _ = s3_bucket
    with Shaper("127.0.0.1", s3_server.port, ShaperSettings()) as shaper:
        options = {"s3": s3_server.storage_options(endpoint_url=f"http://{shaper.address}")}
        store = Store(f"striped::s3://{bucket}/runs/lost", options)

        def lose_link() -> None:
            shaper.set_refuse(True)
            shaper.drop_active()

        with pytest.raises(CheckpointException) as err:
            dcp.save(_big_state(1), storage_writer=store.writer(), planner=_FaultAt(4, lose_link))
        # torch.save turns the stream's error into its own; ours is its cause, naming the stripe
        ours = [e for e in _causes(err.value.failures[0][0]) if isinstance(e, StripedIOError)]
        assert ours and "stripe" in str(ours[0]) and "__0_0.distcp" in str(ours[0])
        shaper.set_refuse(False)
        _nothing_committed(store)
        # what the lost link kept the writer from removing is unreferenced, and gc takes it
        fs, root = store.fs()
        fs.gc(root, older_than_s=0)
        fs.invalidate_cache()
        assert fs.target.find(f"{bucket}/runs/lost") == []


# -- PyTorch's test_remove_on_fail, on striped URLs --------------------------------------------


def test_torch_remove_on_fail(store):
    fs = FileSystem()
    path = fs.init_path(store.url, **store.options)
    write_file = fs.concat_path(path, "writeable")
    with pytest.raises(OSError, match="fail"), fs.create_stream(write_file, "w") as s:
        s.write("aaa")
        raise OSError("fail")
    assert not fs.exists(write_file)

    read_file = fs.concat_path(path, "readable")
    with fs.create_stream(read_file, "w") as s:
        s.write("bbb")
    assert fs.exists(read_file)
    with pytest.raises(OSError, match="fail"), fs.create_stream(read_file, "r") as s:
        raise OSError("fail")
    assert fs.exists(read_file)
    with fs.create_stream(read_file, "r") as s:
        assert s.read() == "bbb"
