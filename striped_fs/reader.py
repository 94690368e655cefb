"""Parallel, in-order reads of one logical file: a plain object or a striped file.

A *source* cuts the file into pieces and fetches one piece as a future. Plain files are cut
into stripe-sized byte ranges of the one object; striped files are cut along their stored
stripes, each checked against its checksum. The reader keeps a readahead window of pieces in
flight, so memory stays near ``(window + 1) * stripe_size`` however large the file.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from .backend import Backend, RetryPolicy
from .cancel import CancelToken
from .errors import ManifestError, StripeChecksumError
from .layout import Manifest, checksum, stripe_path, version_dir


def _done(value: bytes) -> Future[bytes]:
    fut: Future[bytes] = Future()
    fut.set_result(value)
    return fut


class Source:
    """A file cut into pieces that can be fetched independently."""

    path: str
    size: int
    piece_size: int

    @property
    def piece_count(self) -> int:
        return -(-self.size // self.piece_size) if self.size else 0

    def piece_range(self, index: int) -> tuple[int, int]:
        start = index * self.piece_size
        return start, min(start + self.piece_size, self.size)

    def fetch(
        self, index: int, lo: int = 0, hi: int | None = None, cancel: CancelToken | None = None
    ) -> tuple[int, Future[bytes]]:
        """Start fetching piece ``index`` (at least its part inside ``[lo, hi)``).

        Returns the logical offset of the first byte the future will hold, and the future.
        ``cancel``: stops the fetch (and its retries) once its set of reads is abandoned.
        """
        raise NotImplementedError

    def fetch_into(
        self, index: int, view: memoryview, cancel: CancelToken | None = None
    ) -> Future[None]:
        """Read the whole piece ``index`` into ``view`` (exactly its length), verified; with
        ``cancel``, nothing lands in ``view`` once it is cancelled."""
        start, fut = self.fetch(index, cancel=cancel)
        out: Future[None] = Future()

        def done(f: Future[bytes]) -> None:
            try:
                data = f.result()
                if cancel is None:
                    view[:] = data
                else:
                    with cancel.writing():
                        view[:] = data
                out.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                out.set_exception(exc)

        fut.add_done_callback(done)
        return out

    @property
    def striped(self) -> bool:
        return False


@dataclass
class InlineSource(Source):
    """A small file whose bytes are already in hand (read while probing for a manifest)."""

    path: str
    data: bytes

    def __post_init__(self) -> None:
        self.size = len(self.data)
        self.piece_size = max(1, self.size)

    def fetch(
        self, index: int, lo: int = 0, hi: int | None = None, cancel: CancelToken | None = None
    ) -> tuple[int, Future[bytes]]:
        return 0, _done(self.data)


@dataclass
class PlainSource(Source):
    """Any file of the target, read as stripe-sized ranges over concurrent streams."""

    backend: Backend
    path: str
    size: int
    piece_size: int
    retry: RetryPolicy

    def fetch(
        self, index: int, lo: int = 0, hi: int | None = None, cancel: CancelToken | None = None
    ) -> tuple[int, Future[bytes]]:
        start, end = self.piece_range(index)
        start, end = max(start, lo), min(end, self.size if hi is None else hi)
        fut = self.backend.read_range(
            self.path,
            start,
            end,
            retry=self.retry,
            stripe=index,
            what=f"stripe {index} (bytes {start}-{end})",
            cancel=cancel,
        )
        return start, fut

    def fetch_into(
        self, index: int, view: memoryview, cancel: CancelToken | None = None
    ) -> Future[None]:
        start, end = self.piece_range(index)
        return self.backend.read_into(
            self.path,
            view,
            start,
            retry=self.retry,
            stripe=index,
            what=f"stripe {index} (bytes {start}-{end})",
            cancel=cancel,
        )


@dataclass
class StripedSource(Source):
    """A file in the striped layout: whole stripes, each verified against the manifest."""

    backend: Backend
    path: str
    manifest: Manifest
    retry: RetryPolicy

    def __post_init__(self) -> None:
        self.size = self.manifest.size
        self.piece_size = self.manifest.stripe_size

    @property
    def striped(self) -> bool:
        return True

    def fetch(
        self, index: int, lo: int = 0, hi: int | None = None, cancel: CancelToken | None = None
    ) -> tuple[int, Future[bytes]]:
        start, end = self.piece_range(index)
        # At most one byte more than the manifest declares is read: enough to tell a stripe
        # object that is too long, never a whole object of whatever size someone put there.
        fut = self.backend.read_object(
            self._object(index),
            what=f"stripe {index} of {self.path}",
            retry=self.retry,
            validate=self._verifier(index),
            stripe=index,
            limit=end - start + 1,
            cancel=cancel,
            immutable=True,  # a stripe object never changes: its version is unique per write
        )
        return start, fut

    def fetch_into(
        self, index: int, view: memoryview, cancel: CancelToken | None = None
    ) -> Future[None]:
        return self.backend.read_into(
            self._object(index),
            view,
            retry=self.retry,
            validate=self._verifier(index),
            stripe=index,
            what=f"stripe {index} of {self.path}",
            cancel=cancel,
            immutable=True,
        )

    def check_objects(self) -> None:
        """The manifest's geometry against the stripe objects the target holds, before any
        read: one listing of this version's stripes directory. Every stripe the manifest
        lists must be there, no other, each exactly as long as ``size`` and ``stripe_size``
        make it. A manifest edited or damaged into other numbers that still agree with each
        other (``stripe_size`` 65536 -> 65535, ``size`` shortened within its last stripe)
        is refused here, naming the file and the field, instead of being found stripe by
        stripe after reads have started (a direct read has landed by then). Skipped on an
        HTTP target, whose listings are pages, not the store's objects."""
        if _lists_pages(self.backend):
            return
        m = self.manifest
        directory = version_dir(self.path, m.version)
        held = self.backend.object_sizes(
            directory, what=f"stripes of {self.path}", retry=self.retry
        )
        count = m.stripe_count
        missing = [i for i in range(count) if f"{i:08d}" not in held]
        if missing:
            field = "version" if len(missing) == count else "stripes"
            raise _geometry(
                self.path,
                field,
                f"lists {count} stripe(s) of version {m.version} "
                f"but {len(missing)} of their objects are missing from {directory} "
                f"(first: stripe {missing[0]})",
            )
        extra = sorted(n for n in held if n.isdigit() and len(n) == 8 and int(n) >= count)
        if extra:
            raise _geometry(
                self.path,
                "stripes",
                f"lists {count} stripe(s) but {directory} "
                f"holds {len(extra)} more stripe object(s) (first: {extra[0]})",
            )
        for index in range(count):
            size = held[f"{index:08d}"]
            lo, hi = self.piece_range(index)
            if size is None or size == hi - lo:
                continue
            field = "size" if index == count - 1 else "stripe_size"
            declared = f"size {m.size}" if field == "size" else f"stripe_size {m.stripe_size}"
            raise _geometry(
                self.path,
                field,
                f"its {declared} makes stripe {index} "
                f"{hi - lo} bytes long, but its object {self._object(index)} holds "
                f"{size} bytes",
                stripe=index,
            )

    def _object(self, index: int) -> str:
        return stripe_path(self.path, self.manifest.version, index)

    def _verifier(self, index: int) -> Callable[[bytes | memoryview], None]:
        start, end = self.piece_range(index)
        obj = self._object(index)
        expected_crc = self.manifest.checksums[index]
        expected_len = end - start

        def verify(data: bytes | memoryview) -> None:
            if len(data) != expected_len:
                held = f"{len(data)}" if len(data) < expected_len else f"more than {expected_len}"
                raise StripeChecksumError(
                    f"stripe {index} of {self.path} ({obj}) holds {held} bytes, "
                    f"manifest says {expected_len}",
                    path=self.path,
                    stripe=index,
                )
            got = checksum(data)
            if got != expected_crc:
                raise StripeChecksumError(
                    f"stripe {index} of {self.path} ({obj}) is corrupt: crc32 {got:08x}, "
                    f"manifest says {expected_crc:08x}",
                    path=self.path,
                    stripe=index,
                )

        return verify


def _geometry(path: str, field: str, what: str, stripe: int | None = None) -> ManifestError:
    return ManifestError(
        f"{path}: striped manifest does not match its stripe objects (field {field!r}): {what}",
        path=path,
        stripe=stripe,
        field=field,
    )


def _lists_pages(backend: Backend) -> bool:
    protocols = backend.fs.protocol
    protocols = (protocols,) if isinstance(protocols, str) else protocols
    return bool({"http", "https"} & set(protocols))


class StripedReader(io.BufferedIOBase):
    """A seekable, read-only file object with a readahead window.

    A read from offset 0 opens the full ``window``; other sequential reads double it at every
    new piece; a seek elsewhere drops it back to 2, so random access (zip directories, header
    probes) does not drag in the whole file. At most ``window + 2`` pieces are held (the
    window, the current piece and the one before it, kept for out-of-order FUSE requests).
    """

    def __init__(self, source: Source, *, window: int, name: str | None = None) -> None:
        super().__init__()
        self.source = source
        self.name = name or source.path
        self.size = source.size
        self._window = max(1, window)
        self._ramp = 2
        self._pos = 0
        self._last_piece = -2
        self._pieces: dict[int, tuple[int, Future[bytes]]] = {}

    # -- io protocol -------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.name}: seek to negative position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        self._check_open()
        want = self.size - self._pos if n is None or n < 0 else min(n, self.size - self._pos)
        if want <= 0:
            return b""
        parts = list(self._take(want))
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    def read1(self, n: int = -1) -> bytes:
        self._check_open()
        start, end = (
            self.source.piece_range(self._pos // self.source.piece_size)
            if self._pos < self.size
            else (self._pos, self._pos)
        )
        avail = end - self._pos
        return self.read(avail if n is None or n < 0 else min(n, avail))

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self._check_open()
        out = memoryview(buffer).cast("B")
        filled = 0
        for part in self._take(min(len(out), max(0, self.size - self._pos))):
            out[filled : filled + len(part)] = part
            filled += len(part)
        return filled

    readinto1 = readinto

    def close(self) -> None:
        self._drop_all()
        super().close()

    def _drop_all(self) -> None:
        for _, fut in self._pieces.values():
            fut.cancel()
        self._pieces.clear()
        self._ramp = 2
        self._last_piece = -2

    # -- window ------------------------------------------------------------------------
    def _take(self, want: int) -> Iterator[memoryview]:
        """Yield views covering ``want`` bytes from the current position, in order."""
        first = self._pos // self.source.piece_size
        last = (self._pos + want - 1) // self.source.piece_size
        self._schedule(first, last)
        while want > 0:
            index = self._pos // self.source.piece_size
            data_start, fut = self._pieces.get(index) or self._start(index)
            try:
                data = fut.result()
            except BaseException:
                self._drop_all()  # a later read retries from scratch, not a cached failure
                raise
            offset = self._pos - data_start
            take = min(want, len(data) - offset)
            yield memoryview(data)[offset : offset + take]
            self._pos += take
            want -= take
            if self._pos >= self.source.piece_range(index)[1]:
                if want > 0:
                    self._schedule(index + 1, last)

    def _schedule(self, first: int, last: int) -> None:
        """Keep pieces ``first..first+ramp`` in flight; drop what fell behind or too far ahead.

        A read at offset 0 opens the whole window at once (whole-file reads are by far the
        common case, and ramping costs seconds on a slow per-stream link). A read near the
        previous one (inside the window, even slightly out of order, as FUSE's concurrent
        readahead requests arrive) keeps growing the window; anything else is a seek and
        drops it back to 2 pieces.
        """
        if self._last_piece == -2:  # first read
            self._ramp = self._window if first == 0 else 2
            self._last_piece = first
        elif self._last_piece - 1 <= first <= self._last_piece + self._window:  # sequential-ish
            if first > self._last_piece:
                self._ramp = min(self._window, self._ramp * 2)
                self._last_piece = first
        else:  # a seek
            self._ramp = 2
            self._last_piece = first
        upto = min(self.source.piece_count - 1, max(last, first + self._ramp - 1))
        keep_from = first - 1  # an out-of-order request may still want the previous piece
        for index in [
            i for i in self._pieces if i < keep_from or i > max(upto, first + self._window)
        ]:
            self._pieces.pop(index)[1].cancel()
        for index in range(first, upto + 1):
            if index not in self._pieces:
                self._start(index)

    def _start(self, index: int) -> tuple[int, Future[bytes]]:
        entry = self.source.fetch(index)
        self._pieces[index] = entry
        return entry

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"I/O operation on closed file {self.name}")

    def __repr__(self) -> str:
        kind = "striped" if self.source.striped else "plain"
        return f"<StripedReader {self.name!r} {kind} size={self.size}>"


def fetch_pieces(
    source: Source, start: int, end: int, concurrency: int, sink: Callable[[int, bytes], None]
) -> None:
    """Fetch ``[start, end)`` with at most ``concurrency`` pieces in flight.

    ``sink(offset, data)`` receives each piece as it completes (any order), clipped to the
    range. On the first failure the rest are cancelled and the error is raised.
    """
    if end <= start:
        return
    first = start // source.piece_size
    last = (end - 1) // source.piece_size
    fetch_piece_set(source, range(first, last + 1), concurrency, sink, start, end)


def fetch_piece_set(
    source: Source,
    indices: Iterable[int],
    concurrency: int,
    sink: Callable[[int, bytes], None],
    start: int = 0,
    end: int | None = None,
    into: Callable[[int], memoryview | None] | None = None,
    landed: Callable[[int], None] | None = None,
    cancel: CancelToken | None = None,
) -> None:
    """Fetch the pieces ``indices`` (clipped to ``[start, end)``), ``concurrency`` at a time.

    A piece for which ``into(index)`` returns a view is read straight into it (no buffer in
    between) and reported through ``landed(index)``; the others go to ``sink(offset, data)``.
    Callbacks run in the calling thread. The first failure is raised once every other fetch
    is cancelled and finished (retries included): when this returns or raises, nothing it
    started is still running or can still write into a view. ``cancel``, shared by several
    calls (one load reading many files), is cancelled by the first failure of any of them,
    and a call whose token another cancelled raises ``ReadCancelled``.
    """
    end = source.size if end is None else end
    todo = iter(indices)
    inflight: dict[Future, tuple[int, int | None]] = {}
    token = CancelToken() if cancel is None else cancel

    def launch() -> bool:
        token.check()
        index = next(todo, None)
        if index is None:
            return False
        view = into(index) if into is not None else None
        if view is not None:
            inflight[source.fetch_into(index, view, cancel=token)] = (index, None)
        else:
            data_start, fut = source.fetch(index, start, end, cancel=token)
            inflight[fut] = (index, data_start)
        return True

    try:
        while len(inflight) < concurrency and launch():
            pass
        while inflight:
            finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
            for fut in finished:
                index, data_start = inflight.pop(fut)
                result = fut.result()
                if data_start is None:
                    if landed is not None:
                        landed(index)
                else:
                    lo, hi = max(start, data_start), min(end, data_start + len(result))
                    token.check()
                    sink(
                        lo,
                        result
                        if (lo, hi) == (data_start, data_start + len(result))
                        else memoryview(result)[lo - data_start : hi - data_start],
                    )
                launch()
    except BaseException:
        _abandon(token, inflight)
        raise


def _abandon(token: CancelToken, inflight: dict[Future, tuple[int, int | None]]) -> None:
    """Stop every fetch still in flight and wait until each has finished: a fetch running
    or sleeping between retries would otherwise go on (and a direct one write into memory
    the caller has taken back)."""
    token.cancel()  # no write starts from here on; those under way have ended
    running = [fut for fut in inflight if not fut.cancel()]
    wait(running)  # their outcomes are dropped: the first failure is what is raised


def read_range(source: Source, start: int, end: int, concurrency: int) -> bytes:
    """The bytes ``[start, end)`` of a source, fetched in parallel.

    Nothing is allocated from the size a striped manifest declares: pieces are kept as they
    arrive, each already checked (length and checksum) against the manifest, and joined once
    all are in. A file whose stripes are missing or short fails at the first bad piece, having
    allocated no more than the pieces that came back.
    """
    end = min(end, source.size)
    if end <= start:
        return b""
    if isinstance(source, InlineSource):
        return source.data[start:end]
    pieces: dict[int, bytes | memoryview] = {}

    def sink(offset: int, data: bytes | memoryview) -> None:
        pieces[offset] = data

    fetch_pieces(source, start, end, concurrency, sink)
    return b"".join(pieces[offset] for offset in sorted(pieces))


def download(
    source: Source, local_path: str, concurrency: int, progress: Callable[[int], None] | None = None
) -> None:
    """Write a source into a local file with positioned writes as pieces arrive."""
    fd = os.open(local_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:

        def sink(offset: int, data: bytes) -> None:
            view = memoryview(data)
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
            if progress is not None:
                progress(len(data))

        fetch_pieces(source, 0, source.size, concurrency, sink)
        # The declared size is applied only once every piece has arrived and checked out
        # (a no-op then, since the last piece ends there; it keeps an empty file empty).
        os.ftruncate(fd, source.size)
    finally:
        os.close(fd)
