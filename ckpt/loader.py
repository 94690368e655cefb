"""Loading with resharding: each target reads exactly the stored pieces its slice overlaps.

For every tensor in the state to load into, the box it needs (the whole tensor, a DTensor's
local shard, a FlatShard's range) is matched against the stored chunks (``overlap``). Each
overlap becomes a copy job over a byte range of one rank's data file; the striped pieces
those ranges touch are fetched in parallel and copied straight into the target tensors
(through a small temporary only when the overlap is not contiguous in the file).
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from striped_fs import (
    CancelToken,
    ReadCancelled,
    StripedFileSystem,
    StripedIOError,
    StripedSource,
    fetch_piece_set,
)

from .errors import CheckpointCorrupt, StateMismatchError
from .flatten import dcp_slots, walk
from .layout import (
    MANIFEST,
    Manifest,
    RankIndex,
    data_name,
    dtype_of,
    index_disagreement,
    index_name,
    objects_name,
    step_dir,
    tiling_problem,
)
from .overlap import ChunkIndex, StoredChunk
from .tensors import Box, PerRank, TensorLeaf, describe, is_tensor_leaf

if TYPE_CHECKING:
    from .cache import StepCache

log = logging.getLogger("ckpt")


@dataclass
class LoadReport:
    step: int
    bytes_read: int = 0
    seconds: float = 0.0
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the state, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the state
    mismatched: list[str] = field(default_factory=list)
    cached_files: int = 0  # files read from the node-local cache (ckpt.cache), not the store
    cached_bytes: int = 0
    cache_wait_s: float = 0.0  # waited for a prefetch still copying a needed file
    # newer committed steps skipped because some rank could not load them: "step N: rank R:
    # what was wrong (naming the file)"; every rank gets the same list
    skipped: list[str] = field(default_factory=list)


@dataclass
class KeyInfo:
    kind: str
    dtype: str
    global_shape: tuple[int, ...]
    index: ChunkIndex


@dataclass
class Reads:
    """What one load read: the pieces of each rank's data file (``None``: the whole file,
    verified, from the node cache) and whose objects files. The rest of a checkpoint is
    what ``check_unread`` verifies when ranks cannot compare outcomes."""

    pieces: dict[int, set[int] | None] = field(default_factory=dict)
    objects: set[int] = field(default_factory=set)


class CheckpointView:
    """A committed checkpoint's manifest and indexes, read and cross-checked."""

    def __init__(
        self,
        fs: StripedFileSystem,
        root: str,
        step: int,
        cache: StepCache | None = None,
        manifest_raw: bytes | None = None,
    ) -> None:
        self.fs, self.root, self.step = fs, root, step
        self.dir = step_dir(root, step)
        raw = read_manifest(fs, root, step) if manifest_raw is None else manifest_raw
        self.manifest_raw = raw
        self.manifest = _parse(Manifest.from_json, raw, step, f"{self.dir}/{MANIFEST}")
        problem = self.manifest.step_problem(step)
        if problem:
            raise CheckpointCorrupt(
                f"step {step}: {self.dir}/{MANIFEST} {problem}",
                step=step,
                path=f"{self.dir}/{MANIFEST}",
            )
        # The manifest always comes from the store; the cache serves only while it matches.
        self.cache = cache if cache is not None and cache.matches(raw) else None
        blobs = self._read_indexes()
        self.indexes: list[RankIndex] = []
        for rank, blob in enumerate(blobs):
            path = f"{self.dir}/{index_name(rank)}"
            expected = self.manifest.ranks[rank]["index_crc32"]
            if zlib.crc32(blob) != expected:
                raise CheckpointCorrupt(
                    f"step {step}: {path} does not match the manifest's checksum",
                    step=step,
                    path=path,
                )
            index = _parse(RankIndex.from_json, blob, step, path)
            problem = index_disagreement(index, rank, self.manifest)
            if problem:
                raise CheckpointCorrupt(f"step {step}: {path}: {problem}", step=step, path=path)
            self.indexes.append(index)
        grouped: dict[str, list[StoredChunk]] = defaultdict(list)
        meta: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
        for idx in self.indexes:
            for c in idx.chunks:
                grouped[c.key].append(
                    StoredChunk(
                        c.key,
                        idx.rank,
                        Box(tuple(c.offsets), tuple(c.shape)),
                        c.byte_offset,
                        c.nbytes,
                        c.dtype,
                    )
                )
                shape = tuple(c.global_shape)
                first = meta.setdefault(c.key, (c.kind, c.dtype, shape, idx.rank))
                if first[1] != c.dtype or first[2] != shape:
                    path = f"{self.dir}/{index_name(idx.rank)}"
                    raise CheckpointCorrupt(
                        f"step {step}: {path}: chunk {c.key!r} is {c.dtype} {c.global_shape}, rank "
                        f"{first[3]}'s is {first[1]} {list(first[2])} (rule: every chunk of a "
                        "tensor has one dtype and global shape)",
                        step=step,
                        path=path,
                    )
        for key, chunks in grouped.items():
            problem = tiling_problem(meta[key][2], [(c.box.offsets, c.box.shape) for c in chunks])
            if problem:
                raise CheckpointCorrupt(
                    f"step {step}: tensor {key!r} in {self.dir}: {problem}",
                    step=step,
                    path=self.dir,
                )
        self.keys = {
            k: KeyInfo(meta[k][0], meta[k][1], meta[k][2], ChunkIndex(v, meta[k][2]))
            for k, v in grouped.items()
        }
        styles = {idx.key_style for idx in self.indexes}
        if len(styles) > 1:
            raise CheckpointCorrupt(
                f"step {step}: the indexes of {self.dir} disagree on their "
                f"key style {sorted(styles)} (rule: one key style)",
                step=step,
                path=self.dir,
            )
        self.key_style = styles.pop() if styles else ""

    def with_cache(self, cache: StepCache | None) -> CheckpointView:
        """This view (already read and checked) reading data through another node cache
        view: a load reuses the view ``latest()`` built for the same commit."""
        view = copy.copy(self)
        view.cache = cache if cache is not None and cache.matches(self.manifest_raw) else None
        return view

    def _read_indexes(self) -> list[bytes]:
        """Every rank's index (a load checks them all): from the node cache where it holds
        them, the rest from the store. With a cache, the node's ranks take turns fetching
        what it lacks (``StepCache.fetching``) and leave each index that matches the commit
        record there, so the node reads each from the store once, not once per rank."""
        world = self.manifest.world_size
        blobs = self._cached_indexes(range(world))
        if len(blobs) < world and self.cache is not None:
            with self.cache.fetching():
                blobs.update(self._cached_indexes(r for r in range(world) if r not in blobs))
                fetched = self._fetch_indexes([r for r in range(world) if r not in blobs])
                for rank, blob in fetched.items():
                    if zlib.crc32(blob) == self.manifest.ranks[rank]["index_crc32"]:
                        self.cache.keep(index_name(rank), blob)
                blobs.update(fetched)
        elif len(blobs) < world:
            blobs.update(self._fetch_indexes([r for r in range(world) if r not in blobs]))
        return [blobs[r] for r in range(world)]

    def _cached_indexes(self, ranks: Iterable[int]) -> dict[int, bytes]:
        if self.cache is None:
            return {}
        found = {r: self.cache.index(r, self.manifest.ranks[r]["index_crc32"]) for r in ranks}
        return {r: b for r, b in found.items() if b is not None}

    def _fetch_indexes(self, ranks: list[int]) -> dict[int, bytes]:
        if not ranks:
            return {}
        with ThreadPoolExecutor(min(8, len(ranks))) as pool:
            return dict(zip(ranks, pool.map(self._fetch_index, ranks), strict=True))

    def _fetch_index(self, rank: int) -> bytes:
        path = f"{self.dir}/{index_name(rank)}"
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise CheckpointCorrupt(
                f"step {self.step}: {path} is missing", step=self.step, path=path
            ) from None

    def objects_blob(self, rank: int) -> bytes:
        """Rank ``rank``'s objects file, checked against its index (size, CRC-32) and never
        deserialized: what ``verify`` reads."""
        idx = self.indexes[rank]
        if not idx.objects_size:
            return b""
        path = f"{self.dir}/{objects_name(rank)}"
        blob = self.cache.objects(rank, idx) if self.cache is not None else None
        if blob is None:
            try:
                blob = self.fs.cat_file(path)
            except FileNotFoundError:
                raise CheckpointCorrupt(
                    f"step {self.step}: {path} is missing", step=self.step, path=path
                ) from None
        if len(blob) != idx.objects_size or zlib.crc32(blob) != idx.objects_crc32:
            raise CheckpointCorrupt(
                f"step {self.step}: {path} does not match its index", step=self.step, path=path
            )
        return blob

    def objects(self, rank: int, trust_objects: bool) -> dict[str, Any]:
        """Rank ``rank``'s objects. Untrusted (the default), only torch's weights-only
        allow-list is unpickled (tensors, containers, numbers, strings; no other globals):
        a pickle that names any other callable is refused before it runs. ``trust_objects``
        unpickles anything: only for checkpoints the user trusts (docs/decisions.md)."""
        blob = self.objects_blob(rank)
        if not blob:
            return {}
        path = f"{self.dir}/{objects_name(rank)}"
        try:
            values = torch.load(io.BytesIO(blob), weights_only=not trust_objects)
        except pickle.UnpicklingError as exc:
            if trust_objects:
                raise CheckpointCorrupt(
                    f"step {self.step}: {path} cannot be unpickled ({exc})",
                    step=self.step,
                    path=path,
                ) from None
            raise CheckpointCorrupt(
                f"step {self.step}: {path}: {unpickling_refusal(exc)} (rule: objects outside torch's "
                "weights-only allow-list are not deserialized without trust_objects=True, "
                "bootseer's --trust-objects; pass it only for a checkpoint you trust)",
                step=self.step,
                path=path,
            ) from None
        except Exception as exc:  # noqa: BLE001 - a damaged blob: zip, EOF, storage errors
            raise CheckpointCorrupt(
                f"step {self.step}: {path} cannot be read ({type(exc).__name__}: {exc})",
                step=self.step,
                path=path,
            ) from None
        declared = self.indexes[rank].object_keys
        if not isinstance(values, dict) or set(values) != set(declared):
            found = sorted(map(str, values)) if isinstance(values, dict) else type(values).__name__
            raise CheckpointCorrupt(
                f"step {self.step}: {path} holds {found}, its index lists "
                f"{declared} (rule: the objects its index lists)",
                step=self.step,
                path=path,
            )
        return values


def read_manifest(fs: StripedFileSystem, root: str, step: int) -> bytes:
    """The raw ``MANIFEST.json`` of ``step``; a step without one is not committed."""
    path = f"{step_dir(root, step)}/{MANIFEST}"
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise CheckpointCorrupt(
            f"step {step} is not committed (no {MANIFEST})", step=step, path=path
        ) from None


def unpickling_refusal(exc: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only refusal that names the global, not its advice."""
    advice = ("Weights only load failed", "Check the documentation", "Please file an issue")
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and not line.strip().startswith(advice)
    ]
    return lines[0] if lines else "refused by torch's weights-only unpickler"


def _parse(fn: Callable[..., Any], raw: bytes, step: int, path: str) -> Any:
    try:
        return fn(raw, path=path)
    except ValueError as exc:
        raise CheckpointCorrupt(f"step {step}: {exc}", step=step, path=path) from None


# -- targets -----------------------------------------------------------------------------


@dataclass
class Target:
    key: str
    leaf: TensorLeaf
    tensor: torch.Tensor  # where bytes land: the leaf's own memory when it is CPU-contiguous
    box: Box
    done: Callable[[], None] | None = None
    flat_view: bool = False  # loaded through a 1-D view of the same row-major bytes
    info: KeyInfo | None = None  # the stored tensor as this target reads it


def _target(key: str, leaf: TensorLeaf, info: KeyInfo | None) -> Target:
    local = leaf.local
    work = (
        local
        if (local.is_contiguous() and local.device.type == "cpu")
        else torch.empty(local.shape, dtype=local.dtype)
    )
    done = None if work is local else (lambda: local.copy_(work))
    box, flat_view = leaf.box, False
    # A plain tensor loads from flat shards of the same numel, and a FlatShard from a
    # single full copy of an N-D tensor: both are the same bytes in row-major order.
    if info is not None and info.global_shape != leaf.global_shape:
        numel = _prod(leaf.global_shape)
        if (
            numel == _prod(info.global_shape)
            and len(info.global_shape) == 1
            and leaf.kind == "tensor"
        ):
            work, box, flat_view = work.view(-1), Box((0,), (numel,)), True
        elif leaf.kind == "flat" and numel == _prod(info.global_shape):
            full = Box((0,) * len(info.global_shape), info.global_shape)
            if info.index.overlapping(full) and all(c.box == full for c in info.index.chunks):
                # a 1-D reading of the stored tensor, for this target only (the view is shared)
                info = KeyInfo(
                    info.kind,
                    info.dtype,
                    (numel,),
                    ChunkIndex(
                        [
                            StoredChunk(
                                c.key, c.rank, Box((0,), (numel,)), c.byte_offset, c.nbytes, c.dtype
                            )
                            for c in info.index.chunks
                        ],
                        (numel,),
                    ),
                )
                flat_view = True
    return Target(key, leaf, work, box, done, flat_view, info)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def collect(state: Any) -> tuple[dict[str, TensorLeaf], dict[str, tuple[Any, Any, Any]]]:
    tensors: dict[str, TensorLeaf] = {}
    objects: dict[str, tuple[Any, Any, Any]] = {}
    for key, value, container, slot in walk(state):
        if is_tensor_leaf(value):
            tensors[key] = describe(key, value)
        else:
            objects[key] = (container, slot, value)
    return tensors, objects


# -- copy jobs ---------------------------------------------------------------------------


@dataclass
class Job:
    rank: int
    start: int
    end: int
    buffer: memoryview
    finish: Callable[[], None] | None = None
    filled: int = 0


def _run(box: Box, outer: Box) -> tuple[int, int] | None:
    """(element offset, count) when ``box`` is one contiguous run inside ``outer``."""
    shape, rel = outer.shape, [b - o for b, o in zip(box.offsets, outer.offsets, strict=True)]
    d = 0
    while d < len(shape) and box.shape[d] == 1:
        d += 1
    if any(box.shape[k] != shape[k] for k in range(d + 1, len(shape))):
        return None
    offset = 0
    for k in range(len(shape)):
        offset = offset * shape[k] + rel[k]
    return offset, box.numel


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def plan(target: Target, chunks: list[StoredChunk], itemsize: int) -> list[Job]:
    jobs = []
    for c in chunks:
        inter = c.box.intersect(target.box)
        if inter is None or inter.numel == 0:
            continue
        in_chunk = _run(inter, c.box)
        in_target = _run(inter, target.box)
        if in_chunk and in_target:
            start = c.byte_offset + in_chunk[0] * itemsize
            at = in_target[0] * itemsize
            jobs.append(
                Job(
                    c.rank,
                    start,
                    start + inter.numel * itemsize,
                    _bytes_of(target.tensor)[at : at + inter.numel * itemsize],
                )
            )
            continue
        # Not contiguous somewhere: read whole leading rows of the chunk (or the exact run)
        # into a temporary and copy the sub-box with torch.
        if in_chunk:
            start, count, src_shape = in_chunk[0], inter.numel, inter.shape
            narrow_from = (0,) * len(inter.shape)
        else:
            row = _prod(c.box.shape[1:])
            first = inter.offsets[0] - c.box.offsets[0]
            start, count = first * row, inter.shape[0] * row
            src_shape = (inter.shape[0], *c.box.shape[1:])
            narrow_from = (
                0,
                *(i - o for i, o in zip(inter.offsets[1:], c.box.offsets[1:], strict=True)),
            )
        temp = bytearray(count * itemsize)
        dst = target.tensor
        for d, (i, o) in enumerate(zip(inter.offsets, target.box.offsets, strict=True)):
            dst = dst.narrow(d, i - o, inter.shape[d])

        def finish(temp=temp, src_shape=src_shape, narrow_from=narrow_from, inter=inter, dst=dst):
            src = torch.frombuffer(temp, dtype=dst.dtype).view(src_shape)
            for d, (n0, size) in enumerate(zip(narrow_from, inter.shape, strict=True)):
                src = src.narrow(d, n0, size)
            dst.copy_(src)

        byte_start = c.byte_offset + start * itemsize
        jobs.append(Job(c.rank, byte_start, byte_start + len(temp), memoryview(temp), finish))
    return jobs


def data_source(view: CheckpointView, rank: int) -> tuple[str, Any]:
    """Rank ``rank``'s data file in the store, checked before any byte of it is read: its
    size must be what its index says, and a striped file's manifest must describe the
    stripe objects that are there (``StripedSource.check_objects``: stripe count, stripe
    size, size against the objects' lengths)."""
    path = f"{view.dir}/{data_name(rank)}"
    try:
        source = view.fs._resolve(view.fs._norm(path), view.fs.options)
        if source.size != view.indexes[rank].data_size:
            raise CheckpointCorrupt(
                f"step {view.step}: {path} holds {source.size} bytes, its "
                f"index says {view.indexes[rank].data_size}",
                step=view.step,
                path=path,
            )
        if isinstance(source, StripedSource):
            source.check_objects()
    except FileNotFoundError:
        raise CheckpointCorrupt(
            f"step {view.step}: {path} is missing", step=view.step, path=path
        ) from None
    except StripedIOError as exc:  # a manifest refused, a listing that failed
        raise CheckpointCorrupt(f"step {view.step}: {exc}", step=view.step, path=path) from exc
    return path, source


def execute(
    view: CheckpointView, jobs: list[Job], concurrency: int, reads: Reads | None = None
) -> int:
    """Fetch the pieces the jobs touch, file by file in parallel; returns bytes fetched.

    Every data file to read from the store is checked first (``data_source``: size, stripe
    geometry), before any read starts. A piece that cannot be read or fails its checksum is
    a ``CheckpointCorrupt`` naming the data file (and, in its message, the stripe). All or
    nothing: the first failure cancels every other read of the load, and this raises only
    once each one has finished, retries included; no read it started runs, or writes into
    a job's buffer, after it returns or raises. ``reads`` records what was read."""
    by_rank: dict[int, list[Job]] = defaultdict(list)
    for job in jobs:
        by_rank[job.rank].append(job)
    cancel = CancelToken()  # shared by every file's reads: one failure stops them all

    def one_file(rank: int, checked: tuple[str, Any] | None) -> int:
        cancel.check()
        if view.cache is not None:
            copied = view.cache.read_data(view.indexes[rank], by_rank[rank])
            if copied is not None:
                if reads is not None:
                    reads.pieces[rank] = None
                return copied
        path, source = checked if checked is not None else data_source(view, rank)
        size = source.piece_size
        per_piece: dict[int, list[Job]] = defaultdict(list)
        for job in by_rank[rank]:
            for p in range(job.start // size, (job.end - 1) // size + 1):
                per_piece[p].append(job)
        fetched = 0

        def direct(p: int) -> memoryview | None:
            """A piece inside one job that lands in the target as is: read straight into it."""
            jobs = per_piece[p]
            lo, hi = source.piece_range(p)
            if (
                len(jobs) == 1
                and jobs[0].finish is None
                and jobs[0].start <= lo
                and hi <= jobs[0].end
            ):
                return jobs[0].buffer[lo - jobs[0].start : hi - jobs[0].start]
            return None

        def landed(p: int) -> None:
            nonlocal fetched
            lo, hi = source.piece_range(p)
            fetched += hi - lo
            per_piece[p][0].filled += hi - lo

        def sink(offset: int, data: bytes) -> None:
            nonlocal fetched
            fetched += len(data)
            end = offset + len(data)
            for job in per_piece[offset // size]:
                lo, hi = max(job.start, offset), min(job.end, end)
                if lo >= hi:
                    continue
                job.buffer[lo - job.start : hi - job.start] = memoryview(data)[
                    lo - offset : hi - offset
                ]
                job.filled += hi - lo
                if job.filled == job.end - job.start and job.finish is not None:
                    job.finish()

        _fetch(view, path, source, sorted(per_piece), concurrency, sink, direct, landed, cancel)
        if reads is not None:
            reads.pieces[rank] = set(per_piece)
        return fetched

    if not by_rank:
        return 0
    ranks = sorted(by_rank)
    with ThreadPoolExecutor(min(len(ranks), 4), thread_name_prefix="ckpt-load") as pool:
        # Without a node cache every file comes from the store: all of them are checked
        # before the first read (with one, a file is checked when the cache cannot serve it).
        checked = (
            dict(zip(ranks, pool.map(lambda r: data_source(view, r), ranks), strict=True))
            if view.cache is None
            else {}
        )
        return _all_or_nothing([pool.submit(one_file, r, checked.get(r)) for r in ranks], cancel)


def _all_or_nothing(futures: list[Future[int]], cancel: CancelToken) -> int:
    """The sum of the files' results, or the first real failure (not a ``ReadCancelled``)
    raised once every file's reads are cancelled and finished."""
    try:
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:  # interrupted (KeyboardInterrupt): the reads stop before it goes on
        cancel.cancel()
        wait(futures)
        raise
    if pending or any(f.exception() is not None for f in done):
        cancel.cancel()
        wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        raise next((e for e in errors if not isinstance(e, ReadCancelled)), errors[0])
    return sum(f.result() for f in futures)


def _fetch(
    view: CheckpointView,
    path: str,
    source: Any,
    pieces: list[int],
    concurrency: int,
    sink: Callable[[int, bytes], None],
    into: Callable[[int], memoryview | None] | None = None,
    landed: Callable[[int], None] | None = None,
    cancel: CancelToken | None = None,
) -> None:
    """``fetch_piece_set`` whose failures name the step and the data file."""
    try:
        fetch_piece_set(source, pieces, concurrency, sink, into=into, landed=landed, cancel=cancel)
    except (FileNotFoundError, StripedIOError) as exc:
        raise CheckpointCorrupt(
            f"step {view.step}: {path}: {exc}", step=view.step, path=path
        ) from exc


def check_unread(view: CheckpointView, reads: Reads, concurrency: int) -> int:
    """Verify, as a load would, every file of the checkpoint that this load did not read:
    the other pieces of every data file (each stripe's checksum) and every objects file
    (size, CRC-32; never deserialized). Returns the bytes read.

    This is how ranks that cannot compare outcomes (no process group) still agree: each
    takes a step only when every rank's files verify, which is the same answer on every
    rank."""
    checked = 0

    def discard(offset: int, data: bytes) -> None:
        nonlocal checked
        checked += len(data)

    for idx in view.indexes:
        rank = idx.rank
        if idx.data_size and rank in reads.pieces and reads.pieces[rank] is None:
            pass  # read whole from the node cache, every chunk's checksum verified
        elif idx.data_size and (view.cache is None or view.cache.read_data(idx, []) is None):
            path, source = data_source(view, rank)
            done = reads.pieces.get(rank) or set()
            _fetch(
                view,
                path,
                source,
                [p for p in range(source.piece_count) if p not in done],
                concurrency,
                discard,
            )
        if idx.objects_size and rank not in reads.objects:
            checked += len(view.objects_blob(rank))
    return checked


def load_into(
    view: CheckpointView,
    state: Any,
    *,
    rank: int,
    strict: bool,
    concurrency: int,
    trust_objects: bool = False,
    reads: Reads | None = None,
) -> LoadReport:
    """Load ``view`` into ``state`` in place. A checkpoint converted from DCP (keys are DCP
    FQNs) is loaded through DCP's flattening of ``state``, values put back where they were."""
    if view.key_style != "dcp":
        return _load_into(
            view,
            state,
            rank=rank,
            strict=strict,
            concurrency=concurrency,
            trust_objects=trust_objects,
            reads=reads,
        )
    try:
        slots = dcp_slots(state)
    except TypeError as exc:
        raise StateMismatchError(view.step, [str(exc)]) from None
    flat = {fqn: container[slot] for fqn, (container, slot) in slots.items()}
    report = _load_into(
        view,
        flat,
        rank=rank,
        strict=strict,
        concurrency=concurrency,
        trust_objects=trust_objects,
        reads=reads,
    )
    for fqn, (container, slot) in slots.items():
        if flat[fqn] is not container[slot]:
            container[slot] = flat[fqn]  # an object replaced by the load
    return report


def _load_into(
    view: CheckpointView,
    state: Any,
    *,
    rank: int,
    strict: bool,
    concurrency: int,
    trust_objects: bool,
    reads: Reads | None,
) -> LoadReport:
    started = time.perf_counter()
    report = LoadReport(view.step)
    tensors, objects = collect(state)
    saved_objects_rank = rank if rank < view.manifest.world_size else 0
    saved_object_keys = set(view.indexes[saved_objects_rank].object_keys)
    problems: list[str] = []
    targets: list[Target] = []
    for key, leaf in tensors.items():
        info = view.keys.get(key)
        if info is None:
            report.missing.append(key)
            problems.append(f"missing from checkpoint: {key}")
            continue
        target = _target(key, leaf, info)
        issue = _mismatch(key, leaf, target)
        if issue:
            report.mismatched.append(key)
            problems.append(issue)
            continue
        targets.append(target)
    for key in sorted(set(view.keys) - set(tensors)):
        report.unexpected.append(key)
        problems.append(f"unexpected in checkpoint (not in state): {key}")
    for key in sorted(set(objects) - saved_object_keys):
        report.missing.append(key)
        problems.append(f"missing from checkpoint: {key} (object)")
    for key in sorted(saved_object_keys - set(objects)):
        report.unexpected.append(key)
        problems.append(f"unexpected in checkpoint (not in state): {key} (object)")
    if problems and strict:
        raise StateMismatchError(view.step, problems)
    # Objects first: one refused (not trusted, damaged) leaves every tensor untouched.
    wanted = {k for k in objects if k in saved_object_keys}
    values = view.objects(saved_objects_rank, trust_objects) if wanted else {}
    if wanted and reads is not None:
        reads.objects.add(saved_objects_rank)
    jobs = []
    for t in targets:
        assert t.info is not None
        jobs += plan(t, t.info.index.overlapping(t.box, prefer_rank=rank), t.tensor.element_size())
    report.bytes_read = execute(view, jobs, concurrency, reads)
    for t in targets:
        if t.done is not None:
            t.done()
        report.loaded.append(t.key)
    if wanted:
        if saved_objects_rank != rank:
            log.warning(
                "step %d was saved by %d ranks: rank %d takes rank 0's objects",
                view.step,
                view.manifest.world_size,
                rank,
            )
        for key in wanted:
            container, slot, old = objects[key]
            if isinstance(old, PerRank):
                old.value = values[key]
            else:
                container[slot] = values[key]
            report.loaded.append(key)
    if view.cache is not None:
        report.cached_files, report.cached_bytes = view.cache.files, view.cache.bytes
        report.cache_wait_s = view.cache.waited_s
    report.seconds = time.perf_counter() - started
    return report


def _mismatch(key: str, leaf: TensorLeaf, target: Target) -> str | None:
    info = target.info
    assert info is not None
    saved = dtype_of(info.dtype)
    if saved != leaf.dtype:
        return f"dtype of {key}: checkpoint {saved}, state {leaf.dtype}"
    if info.global_shape != leaf.global_shape and not target.flat_view:
        return (
            f"shape of {key}: checkpoint {list(info.global_shape)}, state {list(leaf.global_shape)}"
        )
    covered = info.index.covered(target.box)
    if covered != target.box.numel:
        return (
            f"incomplete {key}: the checkpoint stores {covered} of the "
            f"{target.box.numel} elements this rank needs"
        )
    return None


def full_state(view: CheckpointView, *, rank: int = 0, trust_objects: bool = False) -> Any:
    """Every tensor as one full plain tensor plus rank ``rank``'s objects, nested as saved:
    lists as lists, integer dict keys as integers (an optimizer's ``state``), so that
    ``optimizer.load_state_dict`` takes the optimizer part as it is.

    Nothing is allocated before the data files are known to hold the bytes their indexes
    declare; the view has checked that each tensor's chunks cover it exactly and occupy
    disjoint byte ranges, so every element of every tensor returned is read from the files
    (never uninitialised memory) and the memory taken is at most the files' size."""
    from .flatten import unflatten

    for idx in view.indexes:
        if any(c.nbytes for c in idx.chunks):
            data_source(view, idx.rank)
    flat: dict[str, Any] = {}
    jobs = []
    for key, info in view.keys.items():
        tensor = torch.empty(info.global_shape, dtype=dtype_of(info.dtype))
        leaf = describe(key, tensor)
        target = Target(key, leaf, tensor, leaf.box)
        jobs += plan(target, info.index.overlapping(target.box), tensor.element_size())
        flat[key] = tensor
    execute(view, jobs, view.fs.options.concurrency)
    owner = rank if rank < view.manifest.world_size else 0
    objects = view.objects(owner, trust_objects)
    clash = sorted(set(objects) & set(flat))
    if clash:
        raise CheckpointCorrupt(
            f"step {view.step}: {clash[:5]} are both tensors and objects (rule: one value per key)",
            step=view.step,
            path=view.dir,
        )
    flat.update(objects)
    try:
        return unflatten(flat, view.indexes[owner].containers)
    except ValueError as exc:
        path = f"{view.dir}/{index_name(owner)}"
        raise CheckpointCorrupt(
            f"step {view.step}: the keys of {view.dir} do not nest as {path} says ({exc})",
            step=view.step,
            path=path,
        ) from None
