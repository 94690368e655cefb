"""``CheckpointManager``: save asynchronously, commit atomically, load with resharding.

mgr = CheckpointManager("striped::s3://bucket/run1", rank=rank, world_size=world, keep=3)
step = mgr.load(state) if mgr.latest() is not None else 0   # every rank: the same step
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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from striped_fs import StripedFileSystem, StripedIOError, redact, url_to_fs

from . import agree
from .agree import DAMAGED, ERROR, NONE, OK, Outcome
from .cache import StepCache, open_cache
from .errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, CheckpointSaveError
from .layout import MANIFEST, data_name, newest_committed, parse_step, step_dir
from .loader import (
    CheckpointView,
    LoadReport,
    Reads,
    check_unread,
    full_state,
    load_into,
    read_manifest,
)
from .outage import DurableOutage
from .persist import SaveResult, committed_steps, persist
from .sighting import NodeSighting
from .skip import poisoned, rules_from_env
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
        return (
            f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:"
            f"{os.environ['TORCHELASTIC_RESTART_COUNT']}"
        )
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
            raise CheckpointSaveError(
                f"checkpoint step {self.step} failed: {exc}", step=self.step
            ) from exc


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
    Loads agree on one step over ``process_group`` (``None``: torch.distributed's default
    group when it is this manager's world; ``False``: none).
    """

    def __init__(
        self,
        url: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep: int | None = None,
        storage_options: dict[str, Any] | None = None,
        stripe_size: int | str | None = None,
        concurrency: int | None = None,
        commit_timeout_s: float = 1800.0,
        trust_objects: bool = False,
        attempt: str | None = None,
        cache_dir: str | os.PathLike | bool | None = None,
        cache_writes: bool = True,
        process_group: Any = None,
        memory: Any = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 checkpoint (or None for all)")
        self.url = redact(url)  # for messages: never the credentials
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.fs: StripedFileSystem
        self.fs, self.root = url_to_fs(
            url, storage_options, stripe_size=stripe_size, concurrency=concurrency
        )
        self.commit_timeout_s = commit_timeout_s
        self.attempt = default_attempt() if attempt is None else attempt
        # An attempt from the environment is each node's own count: agreed over the process
        # group at the first save (agree_attempt), so a replaced node's ranks write the same
        # attempt as the survivors'. One given by the caller is used as it is.
        self._attempt_agreed = attempt is not None
        self.trust_objects = trust_objects
        # Node-local cache filled by prefetch_latest (docs/ckpt.md); None: $BOOTSEER_CKPT_CACHE.
        self.cache = open_cache(cache_dir, url)
        # Saves write this rank's files into that cache too: an in-place restart on this
        # node then only verifies them (docs/ckpt.md#the-node-local-cache).
        self.cache_writes = cache_writes
        self._pool = StagingPool()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-persist-r{rank}")
        self._pending: SaveHandle | None = None
        self._loading: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        # What loads agree over (agree.resolve_group): None, the default group when it is
        # this manager's world; False, none; or a ProcessGroup. Resolved at each load.
        self.process_group = process_group
        self._view: CheckpointView | None = None  # the last commit read: latest() -> load
        # The node's one look at the store for this launch (ckpt/sighting.py): used until
        # this manager's first load returns or its first save, then the store every time.
        self._sighting = NodeSighting.for_launch(self.cache.root) if self.cache else None
        self._sighted: tuple[int, bytes] | None = None  # (step, its commit record) from it
        # The memory tier (ckpt.memory, docs/ckpt.md): a MemoryConfig; None: the one `bootseer
        # run` hands down (BOOTSEER_MEMCKPT_DIR), if any; False: none.
        self.memory = _memory_tier(memory, rank, world_size, process_group, trust_objects)
        self._outage = DurableOutage(
            self.memory.config.durable_outage_s if self.memory is not None else 0.0, self.url
        )
        # Steps saved after a NaN by the attempt that hit it are not resumed from (ckpt/skip.py:
        # `bootseer run` hands the rules down after a NaN verdict).
        self.skip_rules = rules_from_env()
        self._skip_said: set[int] = set()

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, block: bool = False) -> SaveHandle:
        """Stage ``state`` (the only stall) and persist it in the background.

        Raises the previous save's failure, if any, before starting. ``block=True`` waits
        until this rank's shard is durable (and, on rank 0, committed) and returns the
        finished handle (``handle.wait()`` gives its result at once).

        With the memory tier, every save is first copied into the node's memory; the durable
        tier is written only every ``durable_every`` steps (the handle of a memory-only save
        is finished, with ``committed=False`` and no bytes written). With
        ``MemoryConfig.replication="sync"`` it returns once the peer acked the step (the
        durable save, when due, already started), else raises
        ``ckpt.memory.MemoryPushError`` naming the peer and the step.

        With the memory tier the durable tier is a backstop that must not stop training: a
        previous durable save that failed on a transient store error is logged, not raised,
        for up to ``MemoryConfig.durable_outage_s``, and while the store is failing a durable
        save due while the previous one is still being written is skipped (``ckpt.outage``).
        """
        self._end_sighting()
        if self.memory is None:
            return self._save(step, state, block=block)
        stall = self.memory.save(step, state, acked=False)
        every = self.memory.config.durable_every
        handle = None if every and step % every else self._durable_behind_memory(step, state, block)
        if self.memory.sync:  # after the durable save started: a failed push loses nothing
            stall += self.memory.wait_acked(step)
        if handle is not None:
            return handle
        done: Future[SaveResult] = Future()
        done.set_result(SaveResult(step, self.rank, 0, stall, 0.0, False))
        return SaveHandle(step, done, stall)

    def _durable_behind_memory(self, step: int, state: Any, block: bool) -> SaveHandle | None:
        """A durable save under the memory tier (which holds ``step`` already), or None when
        it is skipped: the store is failing and the previous one is still being written (an
        unreachable store stalls no step after its first failure; ``block=True`` waits). A
        store that works keeps the durable cadence: the save waits for the previous one, as
        without the memory tier."""
        pending, outage = self._pending, self._outage
        if pending is not None and not pending.done() and not block and outage.failing:
            outage.skip(step, pending.step)
            return None
        try:
            result = self._flush()
        except CheckpointSaveError as exc:
            outage.failed(exc, step)  # raises unless the outage is ridden out
        else:
            if result is not None:
                outage.succeeded(result.step)
        return self._save(step, state, block=block)

    def _save(self, step: int, state: Any, *, block: bool, key_style: str = "") -> SaveHandle:
        """``save``; ``key_style="dcp"`` marks a checkpoint whose keys are DCP FQNs
        (``ckpt.dcp.dcp_to_bootseer``), which ``load`` then flattens the state for."""
        self._check_open()
        if self._pending is not None and not self._pending.done():
            previous, waited = self._pending.step, time.perf_counter()
            log.info("save(step=%d) waits for step %d, still persisting", step, previous)
            self._flush()
            log.info(
                "save(step=%d) waited %.2f s for step %d",
                step,
                time.perf_counter() - waited,
                previous,
            )
        else:
            self._flush()
        if not self._attempt_agreed:
            self.attempt = agree.agree_attempt(
                self.attempt, self.process_group, self.rank, self.world_size
            )
            self._attempt_agreed = True
        staged = stage(
            step,
            state,
            rank=self.rank,
            world_size=self.world_size,
            pool=self._pool,
            key_style=key_style,
        )
        future = self._executor.submit(
            persist,
            self.fs,
            self.root,
            staged,
            rank=self.rank,
            world_size=self.world_size,
            commit_timeout_s=self.commit_timeout_s,
            keep=self.keep,
            protected=self._loading,
            attempt=self.attempt,
            cache=self.cache if self.cache_writes else None,
        )
        handle = self._pending = SaveHandle(step, future, staged.stage_s)
        if block:
            self._flush()
        return handle

    def _flush(self) -> SaveResult | None:
        handle, self._pending = self._pending, None
        if handle is None or handle.reported:
            return None
        return handle.wait()

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight, and for the memory tier's last copy to be committed
        and pushed to its peer (bounded: ``MemoryConfig.push_wait_s``); raise a failure
        naming the step (``ckpt.memory.MemoryPushError`` naming the peer)."""
        result = self._flush()
        if self.memory is not None:
            self.memory.wait()
        return result

    def close(self) -> None:
        """Flush the last save (raising its failure) and release the background thread."""
        if self._closed:
            return
        try:
            self._flush()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            if self.memory is not None:
                self.memory.close()

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
        """The newest step whose commit is valid, or ``None``.

        Valid: its ``MANIFEST.json`` is well-formed and every rank's index it lists is there
        and matches it (what a load reads before any data). Uncommitted (torn) saves, and a
        commit whose files were replaced or lost since, are passed over; damage inside the
        data files is found only by reading them, and ``load`` then falls back (every rank
        together). Steps are numbers: a job that resumed from an older step leaves newer
        ones in place until it saves them again (docs/ckpt.md). Local: no collective."""
        for step in self._newest_committed():
            try:
                view = self._open_view(step)
            except (CheckpointCorrupt, StripedIOError, FileNotFoundError) as exc:
                log.warning(
                    "checkpoint step %d under %s is committed but its commit is not "
                    "valid (%s); latest() passes over it",
                    step,
                    self.url,
                    exc,
                )
                continue
            if self._skipped(step, view.manifest.created):
                continue
            return step
        return None

    def _newest_committed(self, at_most: int | None = None) -> Iterator[int]:
        """The committed steps not above ``at_most``, newest first (``layout.newest_committed``),
        the first from the node's sighting while this manager has one."""
        if self._sighting is not None:
            newest, raw = self._sighting.look(self._look_at_store)
            if newest is None:
                return  # the store held no commit a moment ago, for every rank of the node
            if at_most is None or newest <= at_most:
                if raw is not None:
                    self._sighted = (newest, raw)
                yield newest
                at_most = newest - 1
        yield from newest_committed(self.fs, self.root, at_most=at_most)

    def _look_at_store(self) -> tuple[int | None, bytes | None]:
        newest = next(newest_committed(self.fs, self.root), None)
        if newest is None:
            return None, None
        try:
            return newest, read_manifest(self.fs, self.root, newest)
        except CheckpointCorrupt:  # removed since the listing
            return newest, None

    def _end_sighting(self) -> None:
        self._sighting, self._sighted = None, None

    def _skipped(self, step: int, created: float | None = None) -> bool:
        """Whether ``step`` was saved after a NaN by the attempt that hit it (said once)."""
        if not self.skip_rules or step < min(r.from_step for r in self.skip_rules):
            return False
        if created is None:
            try:
                created = self._open_view(step).manifest.created
            except (CheckpointCorrupt, StripedIOError, FileNotFoundError):
                return False  # the load finds the damage and falls back on every rank
        why = poisoned(self.skip_rules, step, created)
        if why and step not in self._skip_said:
            self._skip_said.add(step)
            log.warning("checkpoint under %s: %s", self.url, why)
        return why is not None

    def _open_view(self, step: int) -> CheckpointView:
        """Step ``step``'s manifest and indexes, read and checked; the last one is kept, so
        a load right after ``latest()`` reads only the manifest again (to see it is the same
        commit) and not every rank's index."""
        sighted = self._sighted
        if sighted is not None and sighted[0] == step:
            raw = sighted[1]  # the node's look at the store, this launch (ckpt/sighting.py)
        else:
            raw = read_manifest(self.fs, self.root, step)
        known = self._view
        if known is not None and known.step == step and known.manifest_raw == raw:
            return known.with_cache(self._cached(step))
        view = CheckpointView(self.fs, self.root, step, self._cached(step), manifest_raw=raw)
        self._view = view
        return view

    # -- loading ---------------------------------------------------------------------------
    def load(self, state: Any, step: int | None = None, *, strict: bool = True) -> int:
        """Load into ``state`` in place (tensors filled, objects replaced); returns the step.

        With ``step=None`` every rank loads the same step: the newest committed one that
        every rank can load (agreed over the process group; docs/ckpt.md). A step that some
        rank cannot load is skipped on every rank, with a warning on every rank naming the
        step, the rank and the file. An explicit ``step`` that some rank cannot load raises
        on every rank.
        """
        return self.load_with_report(state, step, strict=strict).step

    def load_with_report(
        self, state: Any, step: int | None = None, *, strict: bool = True
    ) -> LoadReport:
        """``load``, returning what it did: bytes, seconds, keys, and the steps skipped."""
        try:
            return self._load_tiers(state, step, strict)
        finally:
            self._end_sighting()  # later looks for newer steps ask the store

    def _load_tiers(self, state: Any, step: int | None, strict: bool) -> LoadReport:
        if self.memory is not None and step is None:
            # the memory tier first: the newest step every rank holds in memory, unless the
            # durable tier has a newer commit (every rank decides the same)
            from_memory = self.memory.load(
                state, self._durable_newer if self.memory.config.check_durable else None
            )
            if from_memory is not None:
                return from_memory
            try:
                report = self._load_durable(state, step, strict)
            except CheckpointNotFound:  # a fresh start: every copy in memory is another run's
                self.memory.resume_from(None)
                if self.memory.damaged:  # a failed copy may have written part of the state
                    raise CheckpointError(
                        "memory tier: every copy in memory failed while loading and the "
                        f"durable tier under {self.url} has no checkpoint; the state passed to "
                        "load() may be partly overwritten: build the model and optimizer "
                        "afresh before starting from step 0 (the damaged copies are dropped; "
                        "a restart starts clean). Failed: " + "; ".join(self.memory.damaged[:4])
                    ) from None
                raise
            self.memory.resume_from(report.step)  # newer copies in memory are another run's
            return report
        return self._load_durable(state, step, strict)

    def _durable_newer(self, step: int) -> int | None:
        """The newest committed durable step newer than ``step``, or None: one listing, and a
        manifest check only for newer steps (none, normally): off the in-place restart's
        critical path, unlike ``latest()``, which reads every rank's index."""
        try:
            self.fs.invalidate_cache(self.root)
            try:
                entries = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return None
            newer = sorted(
                (
                    s
                    for e in entries
                    if e["type"] == "directory"
                    and (s := parse_step(e["name"])) is not None
                    and s > step
                ),
                reverse=True,
            )
            return next(
                (
                    s
                    for s in newer
                    if self.fs.exists(f"{step_dir(self.root, s)}/{MANIFEST}")
                    and not self._skipped(s)
                ),
                None,
            )
        except (OSError, StripedIOError, CheckpointError) as exc:  # memory is all there is
            log.warning(
                "memory tier: the durable tier under %s cannot be listed (%s)", self.url, exc
            )
            return None

    def _load_durable(self, state: Any, step: int | None, strict: bool) -> LoadReport:
        group = agree.resolve_group(self.process_group, self.rank, self.world_size)
        exchange = agree.group_exchange(group) if group is not None else agree.alone
        failed: set[int] = set()
        skipped: list[str] = []
        held: LoadReport | None = None  # what this rank's state holds, loaded whole
        bound = step
        while True:
            outcome, report, error = self._try(
                state, step, bound, failed, held, strict, check_all=group is None
            )
            outcomes = exchange(outcome)
            if outcomes is None:
                assert report is not None
                report.skipped = skipped
                return report
            errors = [o for o in outcomes if o.status == ERROR]
            if errors:
                if outcome.status == ERROR and error is not None:
                    raise error
                first = errors[0]
                raise CheckpointError(
                    f"loading checkpoint step {first.step} under {self.url} "
                    f"failed on rank {first.rank}: {first.message}"
                )
            held = report if outcome.status == OK else None
            for o in outcomes:
                if o.status == DAMAGED:
                    failed.add(o.step)
                    skipped.append(agree.warn(o, self.url, group is None))
            if held is not None and held.step in failed:
                held = None
            low = min(o.step for o in outcomes)
            if step is not None and failed:
                raise CheckpointCorrupt(
                    f"checkpoint step {step} under {self.url} cannot be "
                    "loaded by every rank:\n  " + "\n  ".join(skipped),
                    step=step,
                    path=_first_path(outcomes),
                )
            if low == NONE:
                if not skipped and all(o.step == NONE for o in outcomes):
                    raise CheckpointNotFound(f"no committed checkpoint under {self.url}")
                raise CheckpointCorrupt(
                    f"no committed checkpoint under {self.url} could be "
                    "loaded by every rank:\n  " + "\n  ".join(skipped or _none_left(outcomes)),
                    step=max(failed, default=NONE),
                    path=_first_path(outcomes),
                )
            bound = low  # every rank next tries the newest step not newer than this one

    def _try(
        self,
        state: Any,
        step: int | None,
        bound: int | None,
        failed: set[int],
        held: LoadReport | None,
        strict: bool,
        *,
        check_all: bool,
    ) -> tuple[Outcome, LoadReport | None, BaseException | None]:
        """One round on this rank: pick the newest candidate step, load it. Never raises:
        every outcome, errors included, goes to the exchange."""
        candidate = NONE
        try:
            if step is not None:
                candidate = step if step not in failed else NONE
            else:
                candidate = next(
                    (
                        s
                        for s in self._newest_committed(at_most=bound)
                        if s not in failed and not self._skipped(s)
                    ),
                    NONE,
                )
            if candidate == NONE:
                return Outcome(self.rank, NONE, OK, "no committed step left to try"), None, None
            if held is not None and held.step == candidate:
                return Outcome(self.rank, candidate, OK), held, None  # holds it already
            report = self._load_step(state, candidate, strict, check_all)
        except (CheckpointCorrupt, StripedIOError, FileNotFoundError) as exc:
            path = getattr(exc, "path", None) or getattr(exc, "filename", None) or ""
            message = str(exc).removeprefix(f"step {candidate}: ")  # the step is said anyway
            message = message if str(path) in message else f"{message} ({path})"
            return Outcome(self.rank, candidate, DAMAGED, message, str(path)), None, exc
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the exchange
            return Outcome(self.rank, candidate, ERROR, f"{type(exc).__name__}: {exc}"), None, exc
        return Outcome(self.rank, candidate, OK), report, None

    def _load_step(
        self, state: Any, step: int, strict: bool, check_all: bool = False
    ) -> LoadReport:
        with self._lock:
            self._loading.add(step)
        try:
            view = self._open_view(step)
            reads = Reads()
            report = load_into(
                view,
                state,
                rank=self.rank,
                strict=strict,
                concurrency=self.fs.options.concurrency,
                trust_objects=self.trust_objects,
                reads=reads,
            )
            if check_all:
                check_unread(view, reads, self.fs.options.concurrency)
            return report
        finally:
            with self._lock:
                self._loading.discard(step)

    def load_full(self, step: int | None = None) -> dict[str, Any]:
        """The whole checkpoint as plain full tensors and objects (like ``torch.load``)."""
        step = self._resolve_step(step)
        return full_state(self._open_view(step), rank=self.rank, trust_objects=self.trust_objects)

    def _cached(self, step: int) -> StepCache | None:
        return self.cache.step(step) if self.cache is not None else None

    def _resolve_step(self, step: int | None, *, newest: bool = False) -> int:
        """``step``, checked to be committed; ``None``: ``latest()`` (``newest``: the newest
        committed step, valid or not: what verify examines)."""
        if step is None:
            if newest:
                done, _ = committed_steps(self.fs, self.root)
                step = done[-1] if done else None
            else:
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
        step = self._resolve_step(step, newest=True)
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


def _memory_tier(memory: Any, rank: int, world_size: int, group: Any, trust_objects: bool) -> Any:
    if memory is False:
        return None
    from .memory import MemoryConfig, MemoryTier

    config = MemoryConfig.from_env() if memory is None else memory
    if config is None:
        return None
    return MemoryTier(
        config, rank=rank, world_size=world_size, process_group=group, trust_objects=trust_objects
    )


def _first_path(outcomes: list[Outcome]) -> str | None:
    return next((o.path for o in outcomes if o.path), None)


def _none_left(outcomes: list[Outcome]) -> list[str]:
    return [f"rank {o.rank}: {o.message}" for o in outcomes if o.step == NONE]
