"""What a tensor leaf is, globally: its global shape and the box this rank holds.

Three kinds are understood: plain tensors (replicated: identical on every rank, written
once), DTensors with ``Shard(dim)``/``Replicate()`` placements, and :class:`FlatShard`
(FSDP-style: a contiguous range of a flattened parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FlatShard:
    """This rank's part ``[offset, offset + local.numel())`` of a flat parameter of ``numel``.

    ``shape`` is the parameter's unflattened shape, kept in the index for tools; resharding
    works on the flat range, so any W -> W' split of the same ``numel`` loads.
    """

    local: torch.Tensor
    offset: int
    numel: int
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.local.dim() != 1:
            raise ValueError(f"FlatShard.local must be 1-D, got shape {tuple(self.local.shape)}")
        if not 0 <= self.offset <= self.offset + self.local.numel() <= self.numel:
            raise ValueError(
                f"FlatShard [{self.offset}, {self.offset + self.local.numel()}) "
                f"is outside a flat parameter of {self.numel} elements"
            )


@dataclass
class PerRank:
    """A value that differs per rank (an RNG state, a data-loader position): stored with
    this rank's objects and given back to the same rank, not deduplicated or resharded."""

    value: Any


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(
            min(a + s, b + t)
            for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape, strict=True)
        )
        if any(h <= low for low, h in zip(lo, hi, strict=True)) and self.shape:
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


@dataclass
class TensorLeaf:
    """One tensor leaf of this rank: where its local chunk sits in the global tensor."""

    key: str
    kind: str  # "tensor" | "dtensor" | "flat"
    local: torch.Tensor
    global_shape: tuple[int, ...]
    box: Box
    replicated: bool  # identical copies exist on other ranks: only one writes it
    writes: bool  # whether this rank's copy is the one written (for DTensor replicas)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


def is_tensor_leaf(value: Any) -> bool:
    return isinstance(value, torch.Tensor | FlatShard)


def describe(key: str, value: Any) -> TensorLeaf:
    """Global view of one leaf. Raises for placements that cannot be checkpointed."""
    if isinstance(value, FlatShard):
        n = value.local.numel()
        return TensorLeaf(
            key,
            "flat",
            value.local,
            (value.numel,),
            Box((value.offset,), (n,)),
            replicated=False,
            writes=True,
        )
    if _is_dtensor(value):
        return _describe_dtensor(key, value)
    shape = tuple(value.shape)
    return TensorLeaf(
        key, "tensor", value, shape, Box((0,) * len(shape), shape), replicated=True, writes=True
    )


def _describe_dtensor(key: str, value: Any) -> TensorLeaf:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = value.device_mesh, value.placements
    for p in placements:
        if not isinstance(p, Shard | Replicate):
            raise ValueError(
                f"{key}: DTensor placement {p} cannot be checkpointed; "
                "redistribute to Shard/Replicate first"
            )
    local_shape, offsets = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    coordinate = mesh.get_coordinate() or []
    replicated_dims = [i for i, p in enumerate(placements) if isinstance(p, Replicate)]
    writes = all(coordinate[i] == 0 for i in replicated_dims) if coordinate else True
    return TensorLeaf(
        key,
        "dtensor",
        value.to_local(),
        tuple(value.shape),
        Box(tuple(offsets), tuple(local_shape)),
        replicated=bool(replicated_dims),
        writes=writes,
    )
