"""Chunks of a lazy environment: on demand first, then the read profile, then the rest.

One queue, three priorities: a read that a program is waiting for (:meth:`ChunkFetcher.chunk`)
always goes before prefetch work, a chunk queued for prefetch is promoted when a read needs it,
and the read profile of an earlier start (:mod:`snapshot.lazyprofile`) goes before the
background fetch of everything else (so the node ends with a complete local copy). Workers, one
per connection, fetch whole chunk objects through the store (only the bytes the manifest
declares; the backend retries transient errors with backoff).

Every chunk is checked against the manifest's sha256 and size before it is cached or
decompressed: a mismatch is fetched once more (a bit flipped in transit), then fails the read
with EIO and an error naming the snapshot and the chunk; nothing unverified is ever served, and
a later read tries again. Decompression is bounded as in a restore (:mod:`snapshot.zframe`).
A reader waits at most ``read_timeout_s`` for a chunk (the store lost mid-read): then EIO,
never a hang.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from .errors import CorruptSnapshotError, SnapshotError
from .lazycache import ChunkCache
from .manifest import MAX_CHUNK_RAW, Manifest
from .store import SnapshotStore
from .zframe import inflate

log = logging.getLogger(__name__)

ON_DEMAND, PROFILE, BACKGROUND = 0, 1, 2
DEFAULT_READ_TIMEOUT_S = 60.0
MAX_FETCH_ORDER = 1024


class ChunkUnavailable(OSError):
    """A chunk could not be served (corrupt twice, the store unreachable, a timeout): EIO."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


@dataclass
class FetchStats:
    """What the mount fetched and served, for the trace and the benchmark."""

    chunks_fetched: int = 0
    bytes_fetched: int = 0  # compressed bytes from the store
    raw_bytes_fetched: int = 0  # their tar-stream bytes
    on_demand: int = 0  # chunks a reader waited for
    chunks_read: int = 0  # distinct chunks readers asked for
    bytes_served: int = 0  # file bytes the kernel asked for (reads and their readahead)
    cache_hits: int = 0  # of those, found in the node-local cache or memory
    corrupt: int = 0  # chunks that failed verification (each fetched once more)
    failures: int = 0  # reads answered with EIO
    seconds_waiting: float = 0.0
    local_chunks: int = 0  # chunks known to be in the node-local cache
    fetch_order: list[int] = field(default_factory=list)  # the first chunks fetched, in order

    def as_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["fetch_order"] = list(self.fetch_order)
        return data


class _Memory:
    """A bounded LRU of decompressed chunks: an import reads a .so page by page."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[int, bytearray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, i: int) -> bytearray | None:
        with self._lock:
            data = self._items.get(i)
            if data is not None:
                self._items.move_to_end(i)
            return data

    def put(self, i: int, data: bytearray) -> None:
        with self._lock:
            old = self._items.pop(i, None)
            if old is not None:
                self._bytes -= len(old)
            self._items[i] = data
            self._bytes += len(data)
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)


class ChunkFetcher:
    """Serves the decompressed, verified chunks of ``manifest``'s snapshot."""

    def __init__(
        self,
        store: SnapshotStore,
        manifest: Manifest,
        cache: ChunkCache,
        *,
        connections: int = 8,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        memory_bytes: int = 256 << 20,
        on_access: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.cache = cache
        self.read_timeout_s = read_timeout_s
        self.memory = _Memory(memory_bytes)
        self.on_access = on_access
        self.stats = FetchStats()
        self._seen: set[int] = set()
        self._local: set[int] = set()
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, int]] = []  # (priority, seq, chunk)
        self._queued: dict[int, int] = {}  # chunk -> best priority queued
        self._pending: dict[int, Future[bytes]] = {}
        self._seq = itertools.count()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"env-lazy-fetch-{n}", daemon=True)
            for n in range(max(1, connections))
        ]
        for worker in self._workers:
            worker.start()

    # -- what readers and the prefetch call ---------------------------------------------------
    def chunk(self, i: int) -> bytearray:
        """Chunk ``i``'s tar-stream bytes, verified; :class:`ChunkUnavailable` (EIO) when it
        cannot be had."""
        if i not in self._seen:
            self._seen.add(i)
            self.stats.chunks_read += 1
            if self.on_access is not None:
                self.on_access(i)
        raw = self.memory.get(i)
        if raw is not None:
            return raw
        info = self.manifest.chunks[i]
        comp = self.cache.get(info.sha256)
        if comp is not None:
            self.stats.cache_hits += 1
            self._is_local(i)
        else:
            self.stats.on_demand += 1
            waited = time.monotonic()
            future = self._request(i, ON_DEMAND)
            try:
                comp = future.result(timeout=self.read_timeout_s)
            except FutureTimeout:
                self.stats.failures += 1
                raise ChunkUnavailable(
                    f"snapshot {self.manifest.key}: chunk {info.name} not fetched within "
                    f"{self.read_timeout_s:.0f}s (is the store {self.store.url} reachable?)"
                ) from None
            except ChunkUnavailable:
                self.stats.failures += 1
                raise
            finally:
                self.stats.seconds_waiting += time.monotonic() - waited
        try:
            raw = inflate(
                comp,
                f"chunk {info.name} of snapshot {self.manifest.key}",
                declared=info.raw_size,
                limit=MAX_CHUNK_RAW,
                chunk=info.name,
            )
        except CorruptSnapshotError as exc:  # the sha256 matched: the publisher made it so
            self.stats.failures += 1
            log.error("%s", exc)
            raise ChunkUnavailable(str(exc)) from exc
        self.memory.put(i, raw)
        return raw

    def prefetch(self, indices: Iterable[int], priority: int = PROFILE) -> int:
        """Queue chunks in this order; returns how many were not cached yet."""
        queued = 0
        for i in indices:
            if i in self._local:
                continue
            if self.manifest.chunks[i].sha256 in self.cache:
                self._is_local(i)
                continue
            self._request(i, priority)
            queued += 1
        return queued

    def fetch_rest(self) -> int:
        """Queue every chunk not cached yet behind everything else (the complete copy)."""
        return self.prefetch(range(len(self.manifest.chunks)), BACKGROUND)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is queued or in flight."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
        return True

    def complete(self) -> bool:
        """Whether every chunk is in the node-local cache."""
        return len(self._local) == len(self.manifest.chunks)

    def _is_local(self, i: int) -> None:
        with self._cond:
            if i not in self._local:
                self._local.add(i)
                self.stats.local_chunks = len(self._local)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for future in self._pending.values():
                future.cancel()
            self._cond.notify_all()

    # -- the queue ------------------------------------------------------------------------------
    def _request(self, i: int, priority: int) -> Future[bytes]:
        with self._cond:
            future = self._pending.get(i)
            if future is None:
                future = Future()
                self._pending[i] = future
                self._push(i, priority)
            elif i in self._queued and priority < self._queued[i]:
                self._push(i, priority)  # promoted: the stale entry is skipped when popped
            return future

    def _push(self, i: int, priority: int) -> None:
        heapq.heappush(self._queue, (priority, next(self._seq), i))
        self._queued[i] = priority
        self._cond.notify()

    def _take(self) -> int | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                while self._queue:
                    priority, _, i = heapq.heappop(self._queue)
                    if self._queued.get(i) != priority:
                        continue
                    del self._queued[i]
                    return i
                self._cond.wait()

    def _work(self) -> None:
        while (i := self._take()) is not None:
            try:
                data = self._fetch(i)
            except Exception as exc:  # noqa: BLE001 - handed to every waiter
                error = exc if isinstance(exc, ChunkUnavailable) else ChunkUnavailable(str(exc))
                log.error("%s", error.strerror)
                self._finish(i, None, error)
                continue
            self._finish(i, data, None)

    def _fetch(self, i: int) -> bytes:
        info = self.manifest.chunks[i]
        cached = self.cache.get(info.sha256)
        if cached is not None:
            self._is_local(i)
            return cached
        what = f"snapshot {self.manifest.key}: chunk {info.name}"
        for attempt in range(2):
            try:
                data = self.store.fetch(
                    self.manifest.key, info.name, size=info.size, sha256=info.sha256
                ).result()
            except (OSError, SnapshotError) as exc:
                raise ChunkUnavailable(
                    f"{what} could not be fetched from {self.store.url}: {exc}"
                ) from exc
            self.stats.bytes_fetched += len(data)
            if len(data) == info.size and hashlib.sha256(data).hexdigest() == info.sha256:
                self.stats.chunks_fetched += 1
                if len(self.stats.fetch_order) < MAX_FETCH_ORDER:
                    self.stats.fetch_order.append(i)
                self.stats.raw_bytes_fetched += info.raw_size
                self.cache.put(info.sha256, data)
                self._is_local(i)
                return data
            self.stats.corrupt += 1
            log.warning(
                "%s does not match its sha256 in the manifest%s",
                what,
                "; fetching it once more" if attempt == 0 else "",
            )
        raise ChunkUnavailable(
            f"{what} is corrupt in the store (sha256 or size differs from the manifest, twice); "
            f"reads of the files it holds fail with EIO. Remove the snapshot (`bootseer env rm "
            f"{self.manifest.key}`) and rebuild it"
        )

    def _finish(self, i: int, data: bytes | None, error: BaseException | None) -> None:
        with self._cond:
            future = self._pending.pop(i, None)
            self._cond.notify_all()
        if future is None or future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(data)  # type: ignore[arg-type]
