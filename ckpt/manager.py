"""``CheckpointManager``: save asynchronously, commit atomically, load with resharding.

    mgr = CheckpointManager("striped::s3://bucket/run1", rank=rank, world_size=world, keep=3)
    step = mgr.load(state) if mgr.latest() is not None else 0
    for step in range(step, steps):
        train_step()
        if step % 100 == 0:
            mgr.save(step, state)        # returns after staging; persists in the background
    mgr.close()                          # flushes the last save, raises if it failed
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from striped_fs import StripedFileSystem, StripedIOError
from striped_fs.redact import redact
from striped_fs.urls import url_to_fs

from .cache import StepCache, open_cache
from .errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, CheckpointSaveError
from .layout import MANIFEST, data_name, step_dir
from .loader import CheckpointView, LoadReport, full_state, load_into
from .persist import SaveResult, committed_steps, persist
from .staging import StagingPool, stage

log = logging.getLogger("ckpt")


def default_attempt() -> str:
    """Which run of the job this is, as every rank of it sees it (no communication needed).

    ``BOOTSEER_ATTEMPT`` (set by ``bootseer run``), else torchelastic's run id and restart
    count. Without either, attempts are indistinguishable: see docs/ckpt.md.
    """
    if os.environ.get("BOOTSEER_ATTEMPT"):
        return os.environ["BOOTSEER_ATTEMPT"]
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:"
                f"{os.environ['TORCHELASTIC_RESTART_COUNT']}")
    return ""


class SaveHandle:
    """A save in flight. ``wait()`` returns its :class:`SaveResult` or raises its error."""

    def __init__(self, step: int, future: Future[SaveResult], stage_s: float) -> None:
        self.step = step
        self.stage_s = stage_s
        self._future = future
        self.reported = False  # its failure reached the caller once; not raised again

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        try:
            return self._future.result(timeout)
        except CheckpointSaveError:
            self.reported = True
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the step named
            self.reported = True
            raise CheckpointSaveError(f"checkpoint step {self.step} failed: {exc}",
                                      step=self.step) from exc


@dataclass
class CheckpointInfo:
    step: int
    world_size: int
    total_bytes: int
    tensor_count: int
    created: float


@dataclass
class VerifyReport:
    step: int
    ok: bool
    bytes_checked: int
    problems: list[str]
    # objects whose bytes were checked (size, CRC-32) but never deserialized: verify runs no
    # unpickler on a checkpoint it has not been told to trust
    objects_not_deserialized: int = 0
    object_files: int = 0


class CheckpointManager:
    """Sharded asynchronous checkpoints under one URL (any fsspec URL; striped I/O).

    One manager per rank. ``keep`` committed checkpoints are retained (``None``: all).
    Persisting runs on one background thread; a new ``save`` waits for the previous one.
    """

    def __init__(self, url: str, *, rank: int = 0, world_size: int = 1, keep: int | None = None,
                 storage_options: dict[str, Any] | None = None,
                 stripe_size: int | str | None = None, concurrency: int | None = None,
                 commit_timeout_s: float = 1800.0, trust_objects: bool = False,
                 attempt: str | None = None,
                 cache_dir: str | os.PathLike | bool | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint (or None for all)")
        self.url = redact(url)  # for messages: never the credentials
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.fs: StripedFileSystem
        self.fs, self.root = url_to_fs(url, storage_options, stripe_size=stripe_size,
                                       concurrency=concurrency)
        self.commit_timeout_s = commit_timeout_s
        self.attempt = default_attempt() if attempt is None else attempt
        self.trust_objects = trust_objects
        # Node-local cache filled by prefetch_latest (docs/ckpt.md); None: $BOOTSEER_CKPT_CACHE.
        self.cache = open_cache(cache_dir, url)
        self._pool = StagingPool()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-persist-r{rank}")
        self._pending: SaveHandle | None = None
        self._loading: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, block: bool = False) -> SaveHandle:
        """Stage ``state`` (the only stall) and persist it in the background.

        Raises the previous save's failure, if any, before starting. ``block=True`` waits
        until this rank's shard is durable (and, on rank 0, committed).
        """
        self._check_open()
        if self._pending is not None and not self._pending.done():
            previous, waited = self._pending.step, time.perf_counter()
            log.info("save(step=%d) waits for step %d, still persisting", step, previous)
            self._flush()
            log.info("save(step=%d) waited %.2f s for step %d", step,
                     time.perf_counter() - waited, previous)
        else:
            self._flush()
        staged = stage(step, state, rank=self.rank, world_size=self.world_size, pool=self._pool)
        future = self._executor.submit(
            persist, self.fs, self.root, staged, rank=self.rank, world_size=self.world_size,
            commit_timeout_s=self.commit_timeout_s, keep=self.keep, protected=self._loading,
            attempt=self.attempt)
        self._pending = SaveHandle(step, future, staged.stage_s)
        if block:
            self._flush()
        return self._pending

    def _flush(self) -> SaveResult | None:
        handle, self._pending = self._pending, None
        if handle is None or handle.reported:
            return None
        return handle.wait()

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight; raise its failure naming the step."""
        return self._flush()

    def close(self) -> None:
        """Flush the last save (raising its failure) and release the background thread."""
        if self._closed:
            return
        try:
            self._flush()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.url} is closed")

    # -- discovering -------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        done, _ = committed_steps(self.fs, self.root)
        out = []
        for s in done:
            try:
                m = CheckpointView(self.fs, self.root, s).manifest
            except CheckpointError:
                continue
            out.append(CheckpointInfo(s, m.world_size, m.total_bytes, m.tensor_count, m.created))
        return out

    def latest(self) -> int | None:
        """The newest committed step, or ``None``. Uncommitted (torn) saves are invisible."""
        done, _ = committed_steps(self.fs, self.root)
        return done[-1] if done else None

    # -- loading ---------------------------------------------------------------------------
    def load(self, state: Any, step: int | None = None, *, strict: bool = True) -> int:
        """Load into ``state`` in place (tensors filled, objects replaced); returns the step.

        With ``step=None`` the newest committed checkpoint is used; if it fails to read or
        verify, the previous one is tried, with a warning naming what was wrong.
        """
        return self.load_with_report(state, step, strict=strict).step

    def load_with_report(self, state: Any, step: int | None = None, *,
                         strict: bool = True) -> LoadReport:
        if step is not None:
            return self._load_step(state, step, strict)
        done, _ = committed_steps(self.fs, self.root)
        if not done:
            raise CheckpointNotFound(f"no committed checkpoint under {self.url}")
        failures = []
        for candidate in reversed(done):
            try:
                report = self._load_step(state, candidate, strict)
            except (CheckpointCorrupt, StripedIOError, FileNotFoundError) as exc:
                log.warning("checkpoint step %d under %s cannot be loaded (%s); falling back "
                            "to the previous committed checkpoint", candidate, self.url, exc)
                failures.append(f"step {candidate}: {exc}")
                continue
            return report
        raise CheckpointCorrupt("no committed checkpoint could be loaded:\n  " +
                                "\n  ".join(failures), step=done[-1])

    def _load_step(self, state: Any, step: int, strict: bool) -> LoadReport:
        with self._lock:
            self._loading.add(step)
        try:
            view = CheckpointView(self.fs, self.root, step, self._cached(step))
            return load_into(view, state, rank=self.rank, strict=strict,
                             concurrency=self.fs.options.concurrency,
                             trust_objects=self.trust_objects)
        finally:
            with self._lock:
                self._loading.discard(step)

    def load_full(self, step: int | None = None) -> dict[str, Any]:
        """The whole checkpoint as plain full tensors and objects (like ``torch.load``)."""
        step = self._resolve_step(step)
        return full_state(CheckpointView(self.fs, self.root, step, self._cached(step)),
                          rank=self.rank, trust_objects=self.trust_objects)

    def _cached(self, step: int) -> StepCache | None:
        return self.cache.step(step) if self.cache is not None else None

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFound(f"no committed checkpoint under {self.url}")
        elif not self.fs.exists(f"{step_dir(self.root, step)}/{MANIFEST}"):
            raise CheckpointNotFound(f"step {step} is not a committed checkpoint under {self.url}")
        return step

    # -- verifying ---------------------------------------------------------------------------
    def verify(self, step: int | None = None) -> VerifyReport:
        """Read every byte of a checkpoint and check every stripe and chunk checksum.

        The manifest and indexes are checked against their rules (world size and ranks,
        shapes, offsets, byte ranges, exact coverage); the objects files by size and CRC-32
        only: verify never deserializes objects, and reports how many it did not."""
        step = self._resolve_step(step)
        problems: list[str] = []
        checked = objects = object_files = 0
        try:
            view = CheckpointView(self.fs, self.root, step)
        except CheckpointCorrupt as exc:
            return VerifyReport(step, False, 0, [str(exc)])
        for idx in view.indexes:
            path = f"{view.dir}/{data_name(idx.rank)}"
            try:
                data = self.fs.cat_file(path)
            except (StripedIOError, FileNotFoundError) as exc:
                problems.append(f"{path}: {exc}")
                data = None
            if data is not None:
                checked += len(data)
                if len(data) != idx.data_size:
                    problems.append(f"{path}: {len(data)} bytes, index says {idx.data_size}")
                else:
                    view_ = memoryview(data)
                    for c in idx.chunks:
                        if zlib.crc32(view_[c.byte_offset : c.byte_offset + c.nbytes]) != c.crc32:
                            problems.append(f"{path}: tensor {c.key} fails its checksum")
            if not idx.objects_size:
                continue
            try:
                checked += len(view.objects_blob(idx.rank))
            except (CheckpointCorrupt, StripedIOError) as exc:
                problems.append(str(exc))
                continue
            objects += len(idx.object_keys)
            object_files += 1
        return VerifyReport(step, not problems, checked, problems, objects, object_files)
