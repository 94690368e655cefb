"""Fetching frames of lazy layers: on demand first, prefetch in profile order, many at once.

One queue, two priorities: a read that a program is waiting for (``frame``) always goes before
prefetch work, and a frame already queued for prefetch is promoted when a read needs it.
Workers (one per connection) take the first item and coalesce the queued frames that follow
it in the same blob into one range request, up to ``merge_cap`` bytes, so that a profile of
many small adjacent frames costs few requests. Every frame is checked against its sha256
before it is cached or used: a mismatch is refetched once, then fails with EIO, as does a
range that still fails after the retries. A failed read never returns wrong bytes.

A frame is decompressed only when it is exactly one zstd frame declaring the seek table's
content size, into a buffer of that size (:func:`prefetch.toc.decompress_bounded`). A blob
that carries a ``check`` (a lazy layer's :meth:`~prefetch.toc.LayerIndex.verify_frame`) has
each frame's TOC entries checked against the tar headers in it before the frame serves a read;
a mismatch fails the read with EIO and an error naming the layer, the member and the rule.

The first on-demand access of each frame is reported to ``on_access`` (the recorder); what
prefetch fetched and nobody read is counted, so a profile's precision can be judged.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from .cache import BlockCache, FrameMemory
from .toc import Frame, LayerFormatError, decompress_bounded

log = logging.getLogger(__name__)

ON_DEMAND, PREFETCH = 0, 1


FrameCheck = Callable[[int, bytes, Callable[[int], bytes]], None]
"""``check(i, content, load)``: raise when frame ``i``'s content contradicts the index
(``load(j)`` gives another frame's content); see :meth:`prefetch.toc.LayerIndex.verify_frame`."""


@dataclass(eq=False)
class Blob:
    """A layer blob: its digest, the digest of the index its frame table came from, and the
    frame table."""

    digest: str
    frames: Sequence[Frame]
    index: int = 0  # the layer's position in the image, for profiles
    index_digest: str = ""  # the verified index (io.bootseer.layer.index.digest)
    check: FrameCheck | None = None
    # Where this blob's bytes come from (``source(start, end)``: its own registry and
    # repository); None: the fetcher's read_range, by digest.
    source: Callable[[int, int], bytes] | None = None


@dataclass
class FetchStats:
    frames_read: int = 0  # distinct frames served to readers
    cache_hits: int = 0  # of those, found in the block cache or memory
    prefetched: int = 0  # frames fetched by prefetch
    prefetched_unused: int = 0  # computed by report(): prefetched, never read
    bytes_fetched: int = 0
    requests: int = 0
    retries: int = 0
    failures: int = 0
    seconds_waiting: float = 0.0  # readers blocked on the network

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


ReadRange = Callable[[str, int, int], bytes]
"""``read_range(blob_digest, start, end)``: the bytes [start, end) of a blob."""


@dataclass(order=True)
class _Item:
    priority: int
    seq: int
    blob: Blob = field(compare=False)
    frame: int = field(compare=False)


class FrameFetcher:
    """Serves decompressed frames from memory, the block cache, or the registry."""

    def __init__(
        self,
        read_range: ReadRange,
        cache: BlockCache,
        *,
        memory: FrameMemory | None = None,
        connections: int = 16,
        merge_cap: int = 4 << 20,
        retries: int = 4,
        backoff_s: float = 0.2,
        on_access: Callable[[Blob, int, float], None] | None = None,
    ) -> None:
        self.read_range = read_range
        self.cache = cache
        self.memory = memory or FrameMemory()
        self.merge_cap = merge_cap
        self.retries = retries
        self.backoff_s = backoff_s
        self.on_access = on_access
        self.stats = FetchStats()
        self._queue: list[_Item] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._pending: dict[tuple[int, int], Future[bytes]] = {}  # (id(blob), frame) -> comp
        self._queued: dict[tuple[int, int], int] = {}  # key -> best priority queued
        self._seen: set[tuple[str, str, int]] = set()
        self._prefetched: set[tuple[str, str, int]] = set()
        self._closed = False
        self._started = time.monotonic()
        self._workers = [
            threading.Thread(target=self._work, name=f"prefetch-{i}", daemon=True)
            for i in range(connections)
        ]
        for worker in self._workers:
            worker.start()

    # -- the two entry points ---------------------------------------------------------------
    def frame(self, blob: Blob, i: int, *, record: bool = True) -> bytes:
        """Frame ``i`` of ``blob``, decompressed and checked: what a read waits for (jumps the
        queue). ``record=False``: not a program's read (a whole layer written to disk), so
        neither counted nor reported to ``on_access`` (a profile records what starts read)."""
        key = (blob.digest, blob.index_digest, i)
        first = record and key not in self._seen
        if first:
            self._seen.add(key)
            self.stats.frames_read += 1
            if self.on_access is not None:
                self.on_access(blob, i, time.monotonic() - self._started)
        raw, hit = self._content(blob, i)
        if hit and first:
            self.stats.cache_hits += 1
        if blob.check is not None:
            try:
                blob.check(i, raw, lambda j: self._content(blob, j)[0])
            except LayerFormatError as exc:
                self.stats.failures += 1
                log.error("%s", exc)
                raise OSError(errno.EIO, str(exc)) from exc
        return raw

    def _content(self, blob: Blob, i: int) -> tuple[bytes, bool]:
        """(frame ``i``'s content, whether it was local). Memory holds decompressed frames by
        the sha256 of their compressed bytes (content-addressed like the block cache: the same
        frame in two layers is one entry; what a frame means to a layer is its index's
        business)."""
        info = blob.frames[i]
        raw = self.memory.get(info.sha256)
        if raw is not None and len(raw) == info.u_size:
            return raw, True
        comp = self.cache.get(info.sha256)
        hit = comp is not None
        if comp is None:
            waited = time.monotonic()
            comp = self._request(blob, i, ON_DEMAND).result()
            self.stats.seconds_waiting += time.monotonic() - waited
        raw = _decompress(comp, info, blob, i)
        self.memory.put(info.sha256, raw)
        return raw, hit

    def prefetch(self, items: Sequence[tuple[Blob, int]]) -> int:
        """Queue frames in this order (a profile); returns how many were not cached yet."""
        queued = 0
        for blob, i in items:
            if blob.frames[i].sha256 in self.cache:
                continue
            self._request(blob, i, PREFETCH)
            self._prefetched.add((blob.digest, blob.index_digest, i))
            queued += 1
        return queued

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until nothing is queued or in flight (``bootseer image prefetch``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
        return True

    def report(self) -> FetchStats:
        self.stats.prefetched_unused = len(self._prefetched - self._seen)
        return self.stats

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for future in self._pending.values():
                future.cancel()
            self._cond.notify_all()

    # -- queue ------------------------------------------------------------------------------
    def _request(self, blob: Blob, i: int, priority: int) -> Future[bytes]:
        key = (id(blob), i)
        with self._cond:
            future = self._pending.get(key)
            if future is None:
                future = Future()
                self._pending[key] = future
                self._push(blob, i, priority)
            elif priority < self._queued.get(key, priority):  # in flight: not queued
                self._push(blob, i, priority)  # promote: the stale entry is skipped later
            return future

    def _push(self, blob: Blob, i: int, priority: int) -> None:
        heapq.heappush(self._queue, _Item(priority, next(self._seq), blob, i))
        self._queued[(id(blob), i)] = priority
        self._cond.notify()

    def _take(self) -> list[tuple[Blob, int]] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                while self._queue:
                    item = heapq.heappop(self._queue)
                    key = (id(item.blob), item.frame)
                    if self._queued.get(key) != item.priority:
                        continue  # promoted or already taken
                    del self._queued[key]
                    return self._coalesce(item.blob, item.frame)
                self._cond.wait()

    def _coalesce(self, blob: Blob, first: int) -> list[tuple[Blob, int]]:
        """``first`` plus the queued frames right after it in the blob, up to merge_cap."""
        run = [(blob, first)]
        size = blob.frames[first].c_size
        nxt = first + 1
        while nxt < len(blob.frames):
            key = (id(blob), nxt)
            if key not in self._queued or size + blob.frames[nxt].c_size > self.merge_cap:
                break
            del self._queued[key]
            run.append((blob, nxt))
            size += blob.frames[nxt].c_size
            nxt += 1
        return run

    # -- workers ----------------------------------------------------------------------------
    def _work(self) -> None:
        while (run := self._take()) is not None:
            blob = run[0][0]
            frames = [blob.frames[i] for _, i in run]
            try:
                pieces = self._fetch_run(blob, [i for _, i in run], frames)
            except Exception as exc:  # noqa: BLE001 - handed to every waiter
                self.stats.failures += 1
                log.error(
                    "prefetch: frames %d-%d of layer %s failed: %s",
                    run[0][1],
                    run[-1][1],
                    blob.digest[:19],
                    exc,
                )
                error = OSError(
                    errno.EIO, f"layer {blob.digest}: frames {run[0][1]}-{run[-1][1]}: {exc}"
                )
                self._finish(run, None, error)
                continue
            self._finish(run, pieces, None)

    def _fetch_run(self, blob: Blob, indices: list[int], frames: list[Frame]) -> list[bytes]:
        start = frames[0].c_offset
        end = frames[-1].c_offset + frames[-1].c_size
        verified_once = False
        attempt = 0
        while True:
            try:
                self.stats.requests += 1
                data = (
                    blob.source(start, end)
                    if blob.source is not None
                    else self.read_range(blob.digest, start, end)
                )
                if len(data) != end - start:
                    raise ConnectionError(f"short range: {len(data)} of {end - start} bytes")
                pieces = []
                for i, info in zip(indices, frames, strict=True):
                    at = info.c_offset - start
                    piece = data[at : at + info.c_size]
                    if _sha256(piece) != info.sha256:
                        raise _Corrupt(f"frame {i} does not match its sha256")
                    pieces.append(piece)
                self.stats.bytes_fetched += len(data)
                return pieces
            except _Corrupt:
                if verified_once:
                    raise
                verified_once = True  # once more: a flipped bit in transit, not at rest
                self.stats.retries += 1
                log.warning("layer %s: %s; refetching", blob.digest[:19], "corrupt frame")
            except (OSError, ConnectionError, TimeoutError) as exc:
                if attempt >= self.retries:
                    raise
                self.stats.retries += 1
                delay = min(5.0, self.backoff_s * 2**attempt)
                log.warning(
                    "layer %s: range %d-%d: %s; retrying in %.1fs",
                    blob.digest[:19],
                    start,
                    end,
                    exc,
                    delay,
                )
                time.sleep(delay)
                attempt += 1

    def _finish(
        self, run: list[tuple[Blob, int]], pieces: list[bytes] | None, error: BaseException | None
    ) -> None:
        for n, (blob, i) in enumerate(run):
            if pieces is not None:
                self.cache.put(blob.frames[i].sha256, pieces[n])
                if (blob.digest, blob.index_digest, i) in self._prefetched:
                    self.stats.prefetched += 1
        with self._cond:
            for n, (blob, i) in enumerate(run):
                future = self._pending.pop((id(blob), i), None)
                if future is None or future.cancelled():
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(pieces[n])
            self._cond.notify_all()


class _Corrupt(Exception):
    pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _decompress(comp: bytes, info: Frame, blob: Blob, i: int) -> bytes:
    try:
        return decompress_bounded(comp, info.u_size)
    except ValueError as exc:
        log.error("layer %s: frame %d: %s", blob.digest, i, exc)
        raise OSError(errno.EIO, f"layer {blob.digest}: frame {i}: {exc}") from None
