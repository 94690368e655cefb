"""Staging: copy the state's tensors into one reusable CPU buffer, laid out as the data file.

That copy is the only stall training sees: once it returns the caller may mutate every
tensor, and the background writer persists the buffer as it is (no further copy; the data
file *is* the buffer). The buffer is allocated once and reused while the state's size does
not grow; it is pinned when CUDA tensors are staged so device-to-host copies run at full
speed.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .flatten import container_kinds, walk
from .layout import ChunkRecord, align, dtype_name
from .tensors import PerRank, TensorLeaf, describe, is_tensor_leaf


@dataclass
class StagedSave:
    """Everything the background writer needs; immutable once staging returns."""

    step: int
    buffer: torch.Tensor  # uint8, exactly data_size bytes, a view of the pool's buffer
    chunks: list[ChunkRecord]
    tensor_keys: list[str]
    replicated_keys: list[str]
    objects_blob: bytes
    object_keys: list[str]
    stage_s: float
    total_state_bytes: int = 0
    containers: dict[str, str] = field(default_factory=dict)  # flatten.container_kinds
    key_style: str = ""  # "dcp": the keys are DCP FQNs (a converted checkpoint)

    @property
    def data_size(self) -> int:
        return self.buffer.numel()


PAGE = 4096


class StagingPool:
    """One CPU buffer, grown when needed, reused across saves (one save in flight)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.allocations = 0

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def acquire(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A view of ``nbytes`` starting on a page boundary (whole stripes then go to a
        local disk with O_DIRECT, straight from this buffer)."""
        buf = self._buffer
        if buf is None or buf.numel() < nbytes + PAGE or (pin and not buf.is_pinned()):
            self._buffer = None  # free the old one before allocating the new one
            buf = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
            self._buffer = buf
            self.allocations += 1
        start = -buf.data_ptr() % PAGE
        return buf[start : start + nbytes]


#: Replicated plain tensors up to this size (an optimizer's ``step``, a scaler's scale) are
#: written by every rank: the copies cost bytes, not time, and a rank's load then reads
#: them from its own file (its node's cache) instead of a stripe of another rank's file
#: from the store (issue 29: a survivor read 4-6 MB of others' files for a few scalars).
SMALL_REPLICA_BYTES = 64 << 10


def assign_replicated_writers(leaves: list[TensorLeaf], world_size: int) -> dict[str, int]:
    """Which rank writes each replicated plain tensor larger than ``SMALL_REPLICA_BYTES``:
    greedy by size, deterministic (smaller ones are written by every rank).

    Every rank computes the same answer from the same keys and sizes, so no collective
    is needed; the commit checks that every key was written.
    """
    loads = [0] * world_size
    owner: dict[str, int] = {}
    large = (x for x in leaves if x.kind == "tensor" and x.nbytes > SMALL_REPLICA_BYTES)
    for leaf in sorted(large, key=lambda x: (-x.nbytes, x.key)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[leaf.key] = rank
        loads[rank] += leaf.nbytes
    return owner


def stage(
    step: int, state: Any, *, rank: int, world_size: int, pool: StagingPool, key_style: str = ""
) -> StagedSave:
    """Describe, lay out and copy the state. Returns when the state may be mutated."""
    started = time.perf_counter()
    leaves: list[TensorLeaf] = []
    objects: dict[str, Any] = {}
    for key, value, _container, _slot in walk(state):
        if is_tensor_leaf(value):
            leaves.append(describe(key, value))
        else:
            objects[key] = value.value if isinstance(value, PerRank) else value
    owners = assign_replicated_writers(leaves, world_size)
    written = [x for x in leaves if (owners.get(x.key, rank) == rank and x.writes)]
    offset = 0
    placed: list[tuple[TensorLeaf, int]] = []
    for leaf in written:
        placed.append((leaf, offset))
        offset = align(offset + leaf.nbytes)
    uses_cuda = any(x.local.is_cuda for x in written)
    pin = uses_cuda and torch.cuda.is_available()
    buffer = pool.acquire(offset, pin)
    chunks = []
    for leaf, at in placed:
        src = leaf.local
        if src.numel():
            dst = buffer[at : at + leaf.nbytes].view(src.dtype).view(src.shape)
            dst.copy_(src, non_blocking=pin)
        chunks.append(
            ChunkRecord(
                key=leaf.key,
                kind=leaf.kind,
                dtype=dtype_name(src.dtype),
                global_shape=list(leaf.global_shape),
                offsets=list(leaf.box.offsets),
                shape=list(leaf.box.shape),
                byte_offset=at,
                nbytes=leaf.nbytes,
                crc32=0,
            )
        )
    if pin:
        torch.cuda.synchronize()
    blob = b""
    if objects:
        out = io.BytesIO()
        torch.save(objects, out)  # pickled now: later mutation of the objects cannot leak in
        blob = out.getvalue()
    return StagedSave(
        step=step,
        buffer=buffer,
        chunks=chunks,
        tensor_keys=[x.key for x in leaves],
        replicated_keys=sorted(x.key for x in leaves if x.replicated),
        objects_blob=blob,
        object_keys=sorted(objects),
        stage_s=time.perf_counter() - started,
        total_state_bytes=sum(x.nbytes for x in leaves),
        containers=container_kinds(state),
        key_style=key_style,
    )
