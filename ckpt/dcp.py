"""Conversion between ``torch.distributed.checkpoint`` (DCP) checkpoints and ours, both ways.

Both directions run in one process, need no process group (DCP is driven with
``no_dist=True``, so it is safe to call from one rank of a running job) and **hold the whole
state in host memory** (every tensor at its global size, plus the objects).

Key mapping
-----------
DCP stores a flat table keyed by *FQN*: nested dicts and lists of the saved state are joined
with ``.`` (``{"model": {"0.weight": t}}`` -> ``"model.0.weight"``; optimizer state
``{"state": {0: {"exp_avg": t}}}`` -> ``"optim.state.0.exp_avg"``); lists that hold no
tensor and no dict (``param_groups[0]["params"]``) stay one value.

* DCP -> ours (:func:`dcp_to_bootseer`): every FQN becomes one key of a *flat* state dict,
  unchanged (``"model.0.weight"``). Tensors become tensors of our format at their global
  shape and dtype (a DCP checkpoint sharded over any number of ranks is assembled); the
  non-tensor entries (DCP "bytes" items: learning rates, ``param_groups`` fields, user
  objects) become our objects. The checkpoint is marked as keyed by FQNs: ``mgr.load(state)``
  into live nested state flattens ``state`` the way DCP does, fills the tensors in place and
  puts the objects back where they were; :meth:`CheckpointManager.load_full` returns the flat
  table. (Checkpoints converted before that mark need ``flat, m = flatten_like_dcp(state)``,
  ``mgr.load(flat)``, ``state = unflatten_like_dcp(flat, m)``.)
* Ours -> DCP (:func:`bootseer_to_dcp`): the checkpoint is read with
  :meth:`CheckpointManager.load_full` (nested dicts/lists, full plain tensors, rank 0's
  objects) and handed to ``dcp.save``, which flattens it with its own rules. A checkpoint
  saved from ``{"model": model.state_dict(), "optim": opt.state_dict()}`` therefore gets the
  FQNs DCP itself would give that state, and ``dcp.load`` into the same structure works.
  A checkpoint that came from DCP (flat FQN keys) gets its original FQNs back, so
  DCP -> ours -> DCP is bit-exact and key-exact.

What does not carry over: DTensor/FlatShard placements (DCP gets full plain tensors; a
FlatShard parameter stays 1-D), :class:`~ckpt.PerRank` values of ranks other than 0, and
the step number (DCP has none: pass ``step`` when converting to ours).

URLs
----
The DCP side is an fsspec URL or a local path. It is *written* exactly as given: a plain path
or ``s3://`` URL gets standard DCP files (readable by ``FileSystemReader``/any DCP),
``striped::...`` gets the striped layout (parallel I/O; readable through ``striped::``).
It is *read* through ``striped::`` always, which reads striped and plain files alike. Our
side is any URL :class:`CheckpointManager` takes. ``storage_options`` are keyed by protocol
(``{"s3": {...}, "striped": {...}}``) for both sides.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from striped_fs import to_striped_url

from .errors import CheckpointError, CheckpointNotFound
from .flatten import flatten_like_dcp, unflatten_like_dcp
from .layout import MANIFEST, dtype_name, step_dir
from .loader import unpickling_refusal
from .manager import CheckpointManager

log = logging.getLogger("ckpt")

DCP_METADATA = ".metadata"


class ConversionError(CheckpointError):
    """DCP failed while reading or writing; the message carries DCP's underlying error
    (which names the file, and for striped files the stripe)."""


@dataclass
class ConversionResult:
    """What one conversion moved."""

    src: str
    dst: str
    step: int
    tensors: int
    objects: int
    tensor_bytes: int
    seconds: float


def dcp_to_bootseer(
    dcp_url: str,
    ckpt_url: str,
    step: int,
    storage_options: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
    stripe_size: int | str | None = None,
    concurrency: int | None = None,
    trust_objects: bool = False,
) -> ConversionResult:
    """Convert the DCP checkpoint at ``dcp_url`` into step ``step`` of ours under ``ckpt_url``.

    The whole state is held in memory (every tensor at its global size). DCP FQNs become the
    keys of a flat state dict (see the module docstring). A DCP checkpoint is pickles: its
    ``.metadata`` and its non-tensor entries, which DCP itself would unpickle with plain
    ``pickle``/``torch.load(weights_only=False)``. Unless ``trust_objects``, the metadata is
    read by an unpickler that admits only DCP's metadata classes and torch's dtypes and sizes,
    and the entries with ``torch.load(weights_only=True)``: anything else is refused before it
    runs (:class:`ConversionError` naming the file or entry and the rule). Refuses an
    existing ``step`` unless ``overwrite=True``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    started = time.perf_counter()
    read_url = to_striped_url(dcp_url)
    reader_class = FsspecReader if trust_objects else _untrusted_reader()
    reader = reader_class(read_url, **fsspec_kwargs(read_url, storage_options))
    planner = None if trust_objects else _untrusted_planner()(reader, dcp_url)
    try:
        metadata = reader.read_metadata()
    except (FileNotFoundError, IsADirectoryError):
        raise CheckpointNotFound(
            f"no DCP checkpoint at {dcp_url} (no {DCP_METADATA} file)"
        ) from None

    state: dict[str, Any] = {}
    tensor_bytes = n_objects = 0
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            try:
                dtype_name(dtype)
            except ValueError:
                raise ValueError(
                    f"{dcp_url}: tensor {fqn!r} has dtype {dtype}, which bootseer "
                    "checkpoints do not support"
                ) from None
            state[fqn] = torch.empty(tuple(meta.size), dtype=dtype)
            tensor_bytes += state[fqn].numel() * state[fqn].element_size()
        elif isinstance(meta, BytesStorageMetadata):
            state[fqn] = None  # placeholder: DCP puts the unpickled object here
            n_objects += 1
        else:  # pragma: no cover - DCP has no other kind today
            raise ValueError(
                f"{dcp_url}: entry {fqn!r} has unknown DCP metadata {type(meta).__name__}"
            )
    n_tensors = len(state) - n_objects

    with CheckpointManager(
        ckpt_url,
        rank=0,
        world_size=1,
        storage_options=storage_options,
        stripe_size=stripe_size,
        concurrency=concurrency,
    ) as mgr:
        directory = step_dir(mgr.root, step)
        if mgr.fs.exists(directory):
            if not overwrite:
                committed = mgr.fs.exists(f"{directory}/{MANIFEST}")
                raise FileExistsError(
                    f"step {step} already exists under {ckpt_url}"
                    f"{'' if committed else ' (incomplete)'}; choose another step or overwrite"
                )
            if mgr.fs.exists(f"{directory}/{MANIFEST}"):
                mgr.fs.rm_file(f"{directory}/{MANIFEST}")  # invisible first, then the bytes
            mgr.fs.rm(directory, recursive=True)
        log.info(
            "reading DCP checkpoint %s: %d tensors (%.1f MiB), %d objects",
            dcp_url,
            n_tensors,
            tensor_bytes / 2**20,
            n_objects,
        )
        loading = time.perf_counter()
        with _quiet_dcp(), _dcp_errors(f"reading DCP checkpoint {dcp_url}"):
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        log.info(
            "read %s in %.2f s; writing step %d under %s",
            dcp_url,
            time.perf_counter() - loading,
            step,
            ckpt_url,
        )
        mgr._save(step, state, block=True, key_style="dcp")  # load() then flattens like DCP
    seconds = time.perf_counter() - started
    log.info("converted %s -> %s step %d in %.2f s", dcp_url, ckpt_url, step, seconds)
    return ConversionResult(dcp_url, ckpt_url, step, n_tensors, n_objects, tensor_bytes, seconds)


def bootseer_to_dcp(
    ckpt_url: str,
    dcp_url: str,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
    trust_objects: bool = False,
    thread_count: int = 1,
) -> ConversionResult:
    """Write step ``step`` (default: the newest committed) of ours as a DCP checkpoint.

    The whole state is held in memory (:meth:`CheckpointManager.load_full`: every tensor as
    one full plain tensor, plus rank 0's objects). ``dcp_url`` is written as given (plain
    DCP files for a path or ``s3://``, the striped layout for ``striped::``). Objects are
    read with ``torch.load(weights_only=True)`` unless ``trust_objects``. Refuses a
    ``dcp_url`` that already holds a DCP checkpoint unless ``overwrite=True``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    started = time.perf_counter()
    with CheckpointManager(
        ckpt_url, storage_options=storage_options, trust_objects=trust_objects
    ) as mgr:
        if step is None:
            step = mgr.latest()
            if step is None:
                raise CheckpointNotFound(f"no committed checkpoint under {ckpt_url}")
        writer = FsspecWriter(
            dcp_url,
            overwrite=True,
            thread_count=thread_count,
            **fsspec_kwargs(dcp_url, storage_options),
        )
        if writer.fs.exists(writer.fs.concat_path(writer.path, DCP_METADATA)) and not overwrite:
            raise FileExistsError(
                f"{dcp_url} already holds a DCP checkpoint; choose another destination or overwrite"
            )
        log.info("reading step %d of %s", step, ckpt_url)
        loading = time.perf_counter()
        state = mgr.load_full(step)
    if isinstance(state, list):  # every top-level key was an integer: DCP needs a dict
        state = dict(enumerate(state))
    n_tensors = n_objects = tensor_bytes = 0
    for leaf in flatten_like_dcp(state)[0].values():  # counted as DCP will see them
        if isinstance(leaf, torch.Tensor):
            n_tensors += 1
            tensor_bytes += leaf.numel() * leaf.element_size()
        else:
            n_objects += 1
    log.info(
        "read step %d (%d tensors, %.1f MiB, %d objects) in %.2f s; writing DCP checkpoint %s",
        step,
        n_tensors,
        tensor_bytes / 2**20,
        n_objects,
        time.perf_counter() - loading,
        dcp_url,
    )
    with _quiet_dcp(), _dcp_errors(f"writing DCP checkpoint {dcp_url}"):
        dcp.save(state, storage_writer=writer, no_dist=True)
    seconds = time.perf_counter() - started
    log.info("converted %s step %d -> %s in %.2f s", ckpt_url, step, dcp_url, seconds)
    return ConversionResult(ckpt_url, dcp_url, step, n_tensors, n_objects, tensor_bytes, seconds)


# -- reading a DCP checkpoint that is not trusted ---------------------------------------------

_RULE = (
    "rule: a DCP checkpoint's pickles are deserialized only as DCP metadata and torch's "
    "weights-only allow-list without trust_objects=True, bootseer's --trust-objects; pass "
    "it only for a checkpoint you trust"
)
# What DCP's own metadata pickle is made of (torch 2.x): its dataclasses, torch sizes, dtypes,
# layouts and memory formats. Constructing any of them runs no code of the checkpoint's.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class _Refused(pickle.UnpicklingError):
    """A global outside the DCP metadata allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: every global the pickle names must be on
    ``_METADATA_GLOBALS`` (or be a torch dtype, layout or memory format). Pickle calls only
    what ``find_class`` returns, so a ``__reduce__`` naming ``os.system`` stops here."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        raise _Refused(f"global {module}.{name} is not DCP metadata")


def _untrusted_reader() -> type:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class UntrustedReader(FsspecReader):
        """DCP's reader, its ``.metadata`` read by :class:`_MetadataUnpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except _Refused as exc:
                    raise ConversionError(f"{path}: {exc} ({_RULE})") from None
                except Exception as exc:  # noqa: BLE001 - a malformed pickle: EOF, memo, lookups
                    raise ConversionError(
                        f"{path}: not DCP metadata ({type(exc).__name__}: {exc})"
                    ) from None
            if not isinstance(metadata, Metadata):
                raise ConversionError(
                    f"{path}: holds a {type(metadata).__name__}, not DCP metadata"
                )
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return UntrustedReader


def _untrusted_planner() -> type:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class UntrustedPlanner(DefaultLoadPlanner):
        """DCP's load planner, its non-tensor entries read with ``weights_only=True``."""

        def __init__(self, reader: Any, url: str) -> None:
            super().__init__()
            self.reader, self.url = reader, url

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                storage = getattr(self.reader, "storage_data", {}).get(read_item.storage_index)
                where = f"{self.url}/{storage.relative_path}" if storage else self.url
                raise ConversionError(
                    f"{where}: entry {fqn!r}: {unpickling_refusal(exc)} ({_RULE})"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return UntrustedPlanner


def fsspec_kwargs(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """Per-protocol ``storage_options`` as the keyword arguments fsspec's ``url_to_fs`` wants
    for ``url``: keyed by protocol for a chained URL (``striped::s3://...`` ->
    ``{"striped": ..., "s3": ...}``), the bare options of its one protocol otherwise."""
    options = storage_options or {}
    if "::" in url:
        protocols = [part.split("://", 1)[0] if "://" in part else part for part in url.split("::")]
        return {p: options[p] for p in protocols if p in options}
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return dict(options.get(protocol, {}))


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP reports failures as ``CheckpointException``, a ``BaseException`` whose text is a
    formatted traceback; turn it into a :class:`ConversionError` naming the first cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        causes = [f[0] for f in exc.failures.values() if isinstance(f, tuple) and f]
        cause = causes[0] if causes else None
        text = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        error = ConversionError(f"{what} failed: {text}")
        if isinstance(cause, BaseException):
            raise error from cause
        raise error from None


class _quiet_dcp(warnings.catch_warnings):
    """DCP warns about running without a process group and about overwriting; both are
    expected here (single process by design, overwrite checked beforehand)."""

    def __enter__(self) -> None:
        super().__enter__()
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        warnings.filterwarnings("ignore", message=".*will default to False.*")


__all__ = [
    "ConversionError",
    "ConversionResult",
    "bootseer_to_dcp",
    "dcp_to_bootseer",
    "flatten_like_dcp",
    "fsspec_kwargs",
    "unflatten_like_dcp",
]
