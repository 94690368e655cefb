"""Persisting a staged save, committing it, and retention.

Runs on the manager's background thread and never touches a process group: ranks report
"my shard is durable" by writing their index file, and rank 0 commits by writing
``MANIFEST.json`` once every index is present (shard markers in storage work on every
backend and cannot deadlock with training collectives).
"""

from __future__ import annotations

import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from striped_fs import StripedFileSystem

from .cache import NodeCache
from .errors import CheckpointSaveError, CommitTimeout
from .layout import (
    MANIFEST,
    Manifest,
    RankIndex,
    committed_steps,
    data_name,
    index_name,
    objects_name,
    step_dir,
    tiling_problem,
)
from .staging import StagedSave

log = logging.getLogger("ckpt")


@dataclass
class SaveResult:
    """What one save did: for traces and benchmarks."""

    step: int
    rank: int
    bytes_written: int
    stage_s: float
    persist_s: float
    committed: bool


def chunk_crcs(staged: StagedSave) -> None:
    view = memoryview(staged.buffer.numpy())
    for chunk in staged.chunks:
        chunk.crc32 = zlib.crc32(view[chunk.byte_offset : chunk.byte_offset + chunk.nbytes])


def persist(
    fs: StripedFileSystem,
    root: str,
    staged: StagedSave,
    *,
    rank: int,
    world_size: int,
    commit_timeout_s: float,
    keep: int | None,
    protected: set[int],
    attempt: str = "",
    cache: NodeCache | None = None,
) -> SaveResult:
    """Write this rank's files, report them durable, commit on rank 0. With ``cache`` (the
    node's checkpoint cache) the rank's files are also written there, so that an in-place
    restart on this node does not fetch what it just saved."""
    started = time.perf_counter()
    directory = step_dir(root, staged.step)
    fs.makedirs(directory, exist_ok=True)
    own_index = f"{directory}/{index_name(rank)}"
    stale = withdraw(fs, directory, own_index, staged.step)
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc") as crc_pool:
        crcs = crc_pool.submit(chunk_crcs, staged)  # hashing overlaps the write (no GIL held)
        with fs.open(f"{directory}/{data_name(rank)}", "wb") as f:
            f.write_borrowed(staged.buffer.numpy())
        crcs.result()
    if staged.objects_blob:
        fs.pipe_file(f"{directory}/{objects_name(rank)}", staged.objects_blob)
    index = RankIndex(
        step=staged.step,
        rank=rank,
        world_size=world_size,
        data_size=staged.data_size,
        chunks=staged.chunks,
        tensor_keys=staged.tensor_keys,
        replicated_keys=staged.replicated_keys,
        object_keys=staged.object_keys,
        objects_size=len(staged.objects_blob),
        objects_crc32=zlib.crc32(staged.objects_blob) if staged.objects_blob else 0,
        attempt=attempt,
        containers=staged.containers,
        key_style=staged.key_style,
    )
    index_blob = index.to_json()
    fs.pipe_file(own_index, index_blob)  # "my shard is durable"
    written = staged.data_size + len(staged.objects_blob)
    committed = False
    if rank == 0:
        commit(fs, root, staged.step, world_size, commit_timeout_s, attempt, stale)
        committed = True
        if keep is not None:
            apply_retention(fs, root, keep, protected)
    if cache is not None:  # after the commit: the local copy never delays it
        cache.remember_source_quietly()
        step_cache = cache.step(staged.step)
        if step_cache.put_saved(
            rank, memoryview(staged.buffer.numpy()).cast("B"), staged.objects_blob, index_blob
        ):
            cache.drop_steps_before(_previous_step(cache, staged.step))
    return SaveResult(
        staged.step, rank, written, staged.stage_s, time.perf_counter() - started, committed
    )


def _previous_step(cache: NodeCache, step: int) -> int:
    """The newest cached step before ``step`` (kept: it may be the newest committed one)."""
    older = [s for s in cache.steps() if s < step]
    return older[-1] if older else step


def withdraw(fs: StripedFileSystem, directory: str, own_index: str, step: int) -> dict[int, int]:
    """Before any file of a step changes: retract this rank's index (left by an earlier save
    of this step), then withdraw the step's commit if it has one, so that no reader and no
    ``latest()`` takes the step for committed while its files are replaced.

    Returns the withdrawn manifest's index checksums by rank: an index that still has one
    of them is the earlier save's, never committed with the new one's."""
    if fs.exists(own_index):
        fs.rm_file(own_index)
    path = f"{directory}/{MANIFEST}"
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return {}
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass  # another rank withdrew it first
    log.info("step %d is saved again: its earlier commit is withdrawn until this one commits", step)
    try:
        return {e["rank"]: e["index_crc32"] for e in Manifest.from_json(raw, path=path).ranks}
    except ValueError:
        return {}


def commit(
    fs: StripedFileSystem,
    root: str,
    step: int,
    world_size: int,
    timeout_s: float,
    attempt: str = "",
    stale: dict[int, int] | None = None,
) -> Manifest:
    """Wait for every rank's index of this attempt, cross-check them, write the manifest.

    An index written by another attempt (a killed run that reached this step before), or
    one the withdrawn earlier commit of this step listed (``stale``), does not count: its
    rank will replace it when it gets here, so the poll goes on.
    """
    stale = stale or {}
    directory = step_dir(root, step)
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    found: dict[int, tuple[RankIndex, bytes]] = {}
    while True:
        fs.invalidate_cache(directory)
        names = {p.rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)}
        for r in range(world_size):
            if r not in found and index_name(r) in names:
                index = _read_index(fs, directory, r, step)
                if (
                    index is not None
                    and index[0].attempt == attempt
                    and zlib.crc32(index[1]) != stale.get(r)
                ):
                    found[r] = index
        missing = [r for r in range(world_size) if r not in found]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CommitTimeout(
                f"step {step}: rank(s) {missing} did not report a durable shard of this attempt "
                f"within {timeout_s:.0f} s; the checkpoint was not committed",
                step=step,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    indexes = [found[r][0] for r in range(world_size)]
    problems = check_indexes(indexes, step, world_size)
    if problems:
        raise CheckpointSaveError(f"step {step}: not committed: " + "; ".join(problems), step=step)
    manifest = Manifest(
        step=step,
        world_size=world_size,
        ranks=[
            {"rank": r, "data_size": found[r][0].data_size, "index_crc32": zlib.crc32(found[r][1])}
            for r in range(world_size)
        ],
        total_bytes=sum(i.data_size + i.objects_size for i in indexes),
        tensor_count=len({c.key for i in indexes for c in i.chunks}),
    )
    fs.pipe_file(f"{directory}/{MANIFEST}", manifest.to_json())
    log.info(
        "checkpoint step %d committed: %d ranks, %.1f MiB",
        step,
        world_size,
        manifest.total_bytes / 2**20,
    )
    return manifest


def _read_index(
    fs: StripedFileSystem, directory: str, rank: int, step: int
) -> tuple[RankIndex, bytes] | None:
    """An index being replaced may vanish between listing and reading: then not yet."""
    path = f"{directory}/{index_name(rank)}"
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        return RankIndex.from_json(raw, path=path), raw
    except ValueError as exc:
        raise CheckpointSaveError(f"step {step}: {exc}", step=step) from exc


def check_indexes(indexes: list[RankIndex], step: int, world_size: int) -> list[str]:
    problems = []
    for i in indexes:
        if i.step != step or i.world_size != world_size:
            problems.append(f"rank {i.rank} wrote step {i.step} of world size {i.world_size}")
    written = {c.key for i in indexes for c in i.chunks}
    held = [set(i.replicated_keys) for i in indexes]
    every = set().union(*held) if held else set()
    for i, keys in zip(indexes, held, strict=True):
        for key in sorted(every - keys)[:5]:
            problems.append(
                f"rank {i.rank} does not hold replicated tensor {key!r} (plain "
                "tensors must exist on every rank; wrap per-rank values in PerRank)"
            )
    for key in sorted(every - written)[:5]:
        problems.append(f"no rank wrote replicated tensor {key!r}")
    problems += _coverage_problems(indexes)
    return problems


def _coverage_problems(indexes: list[RankIndex]) -> list[str]:
    """The stored chunks of every tensor must cover it exactly once, with one dtype and
    global shape (what every reader checks before loading, ``tiling_problem``)."""
    boxes: dict[str, list[tuple[list[int], list[int]]]] = {}
    shapes: dict[str, tuple[str, list[int]]] = {}
    problems, disagree = [], set()
    for i in indexes:
        for c in i.chunks:
            boxes.setdefault(c.key, []).append((c.offsets, c.shape))
            if shapes.setdefault(c.key, (c.dtype, c.global_shape)) != (c.dtype, c.global_shape):
                problems.append(
                    f"rank {i.rank} wrote {c.key!r} as {c.dtype} {c.global_shape}, "
                    f"another rank as {shapes[c.key][0]} {shapes[c.key][1]}"
                )
                disagree.add(c.key)
    for key, found in boxes.items():
        problem = None if key in disagree else tiling_problem(shapes[key][1], found)
        if problem:
            problems.append(f"the shards of {key!r}: {problem}")
    return problems[:5]


def apply_retention(fs: StripedFileSystem, root: str, keep: int, protected: set[int]) -> None:
    """Delete committed checkpoints beyond the newest ``keep`` and torn ones older than the
    newest commit; never a step in ``protected`` (being loaded)."""
    done, torn = committed_steps(fs, root)
    if not done:
        return
    newest = done[-1]
    doomed = [s for s in done[:-keep] if s not in protected] if keep > 0 else []
    doomed += [s for s in torn if s < newest and s not in protected]
    for s in doomed:
        directory = step_dir(root, s)
        try:
            if fs.exists(f"{directory}/{MANIFEST}"):
                fs.rm_file(f"{directory}/{MANIFEST}")  # invisible first, then the bytes
            fs.rm(directory, recursive=True)
            log.info("retention: removed checkpoint step %d", s)
        except FileNotFoundError:
            pass
