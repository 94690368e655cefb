"""Which stored chunks overlap a requested box, without scanning every chunk.

Chunks of one tensor usually form a grid (DTensor shards, flat shards, one full replica).
Per dimension we keep the sorted chunk start offsets; a query bisects each dimension and
looks up only the grid cells it touches: O(k log n) for k overlapping chunks of n. Chunks
that do not form a grid (hand-made overlapping layouts) fall back to a linear scan.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .tensors import Box


@dataclass(frozen=True)
class StoredChunk:
    key: str
    rank: int
    box: Box
    byte_offset: int
    nbytes: int
    dtype: str


class ChunkIndex:
    def __init__(self, chunks: Sequence[StoredChunk], global_shape: tuple[int, ...]) -> None:
        self.global_shape = global_shape
        # Empty chunks (an FSDP rank with no elements, a DTensor shard past the end) hold no
        # data; keyed by start they would shadow the real chunk starting at the same offset.
        self.chunks = [c for c in chunks if c.box.numel]
        self._by_start: dict[tuple[int, ...], StoredChunk] = {}
        # Replicas (the same box in several ranks' files): a load takes its own rank's copy
        # when there is one, which its node already holds (cache, memory tier).
        self._copies: dict[tuple[int, ...], dict[int, StoredChunk]] = {}
        for c in self.chunks:
            self._by_start.setdefault(c.box.offsets, c)
            copies = self._copies.setdefault(c.box.offsets, {})
            if self._by_start[c.box.offsets].box == c.box:
                copies.setdefault(c.rank, c)
        ndim = len(global_shape)
        self._bounds = [sorted({c.box.offsets[d] for c in self.chunks}) for d in range(ndim)]
        self.is_grid = self._check_grid()

    def _check_grid(self) -> bool:
        for d, bounds in enumerate(self._bounds):
            ends = set(bounds[1:]) | {self.global_shape[d]}
            extent: dict[int, int] = {}
            for c in self._by_start.values():
                start, size = c.box.offsets[d], c.box.shape[d]
                if start + size not in ends or extent.setdefault(start, size) != size:
                    return False
        return True

    def overlapping(self, box: Box, prefer_rank: int | None = None) -> list[StoredChunk]:
        """The stored chunks that hold part of ``box``, one copy of each replica: the copy
        in ``prefer_rank``'s file where it has one."""
        found = self._overlapping(box)
        if prefer_rank is None:
            return found
        return [self._copies[c.box.offsets].get(prefer_rank, c) for c in found]

    def _overlapping(self, box: Box) -> list[StoredChunk]:
        if not self.is_grid:
            return [c for c in self._by_start.values() if c.box.intersect(box) is not None]
        per_dim = []
        for d, bounds in enumerate(self._bounds):
            lo, hi = box.offsets[d], box.offsets[d] + box.shape[d]
            i0 = max(0, bisect.bisect_right(bounds, lo) - 1)
            i1 = bisect.bisect_left(bounds, hi)
            per_dim.append(bounds[i0 : max(i1, i0 + 1)])
        found = []
        for start in itertools.product(*per_dim):
            c = self._by_start.get(tuple(start))
            if c is not None and c.box.intersect(box) is not None:
                found.append(c)
        return found

    def covered(self, box: Box) -> int:
        """Elements of ``box`` that stored chunks cover (replicas counted once)."""
        return sum(i.numel for c in self.overlapping(box) if (i := c.box.intersect(box)))
