"""Writing a striped file: stripes uploaded concurrently, the manifest written last.

Nothing is visible at the file's path until :meth:`StripedWriter.close` has every stripe
durable and replaces the path with the new manifest in one atomic step. A writer that
fails, is discarded, or is killed leaves only unreferenced stripes behind (invisible to
readers; ``StripedFileSystem.gc`` removes them).

A ``close()`` that comes while an exception raised after the file was opened is in flight
(``fsspec.open``'s ``with`` block, a ``TextIOWrapper`` around the file, a ``finally``)
discards instead of committing: those callers close without saying why. Inside an fsspec
transaction, ``close()`` uploads and :meth:`StripedWriter.commit` (at the transaction's end)
makes the file visible.
"""

from __future__ import annotations

import io
import logging
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from .backend import Backend, RetryPolicy
from .config import StripeOptions
from .layout import MAX_STRIPES, Manifest, checksum, stripe_path

log = logging.getLogger("striped_fs")


class StripedWriter(io.BufferedIOBase):
    """A write-only file object; at most ``concurrency`` stripes are buffered or in flight.

    A background upload failure is raised in the caller at the next ``write`` or at
    ``close``; it is never swallowed. Leaving a ``with`` block by an exception discards the
    file instead of committing it. With ``autocommit=False`` (fsspec transactions) ``close``
    only uploads; :meth:`commit` or :meth:`discard` decides.
    """

    def __init__(
        self,
        path: str,
        backend: Backend,
        options: StripeOptions,
        commit: Callable[[str, Manifest], None],
        prepare: Callable[[str, str], None] | None = None,
        discard_version: Callable[[str, str], None] | None = None,
        autocommit: bool = True,
    ) -> None:
        super().__init__()
        self.name = path
        self.path = path
        self.version = uuid.uuid4().hex
        self._backend = backend
        self._opts = options
        self._retry = RetryPolicy.from_options(options)
        self._commit = commit
        self._discard_version = discard_version
        self._buf = bytearray()
        self._checksums: list[int] = []
        self._inflight: dict[Future[None], int] = {}
        self._size = 0
        self._state = "open"
        self._autocommit = autocommit
        self._manifest: Manifest | None = None
        # The exception being handled when the file was opened, if any: a close() while a
        # *later* one is in flight is a with block (or a finally) unwinding.
        self._exc_at_open: BaseException | None = sys.exc_info()[1]
        #: The mtime (ns) the manifest records, when set before close() (cp -p, rsync); None:
        #: the commit's own time is the file's mtime.
        self.mtime_ns: int | None = None
        if prepare is not None:
            prepare(path, self.version)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data) -> int:  # type: ignore[override]
        if self._state != "open":
            raise ValueError(f"write to {self._state} striped file {self.path}")
        stripe = self._opts.stripe_size
        if not self._buf and type(data) is bytes and len(data) == stripe:
            self._upload(data)  # immutable and exactly one stripe: no copy at all
            self._size += stripe
            return stripe
        view = memoryview(data).cast("B")
        written = len(view)
        while view:
            room = stripe - len(self._buf)
            if not self._buf and len(view) >= stripe:
                self._upload(bytes(view[:stripe]))  # whole stripe: one copy, no staging
                view = view[stripe:]
                continue
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) == stripe:
                self._upload(bytes(self._buf))
                self._buf.clear()
        self._size += written
        return written

    def write_borrowed(self, buffer) -> int:
        """Write without copying: ``buffer`` must stay unchanged until :meth:`close` returns.

        For staged data that is immutable by construction (a checkpoint's staging buffer);
        whole stripes are handed to the backend as views. Targets whose clients need
        ``bytes`` (object stores) get one copy per stripe, as with :meth:`write`.
        """
        view = memoryview(buffer).cast("B")
        total = view.nbytes
        stripe = self._opts.stripe_size
        if self._buf:  # finish a partial stripe first, copying only that part
            room = stripe - len(self._buf)
            self.write(view[:room])
            view = view[room:]
        whole = len(view) - len(view) % stripe
        for start in range(0, whole, stripe):
            chunk = view[start : start + stripe]
            self._upload(chunk if self._backend.accepts_views else bytes(chunk))
        self._size += whole
        if whole < len(view):
            self.write(view[whole:])
        return total

    def close(self) -> None:
        """Flush, wait for every stripe, then commit the manifest (the only visible step).

        Called while an exception raised after the file was opened is in flight, it discards
        instead: that exception is what the caller sees.
        """
        try:
            if self._state == "open":
                in_flight = sys.exc_info()[1]
                if in_flight is not None and in_flight is not self._exc_at_open:
                    log.info(
                        "%s closed while %s propagates: discarded, nothing committed",
                        self.path,
                        type(in_flight).__name__,
                    )
                    self._abort()
                else:
                    self._finish(commit=self._autocommit)
        finally:
            self._exc_at_open = None
            super().close()

    def commit(self) -> None:
        """Make the file visible (the end of an fsspec transaction calls this)."""
        if self._state == "committed":
            return
        if self._state not in ("open", "uploaded"):
            raise ValueError(f"cannot commit {self._state} striped file {self.path}")
        try:
            self._finish(commit=True)
        finally:
            super().close()

    def _finish(self, *, commit: bool) -> None:
        try:
            if self._state == "open":
                if self._buf:
                    self._upload(bytes(self._buf))
                    self._buf.clear()
                self._drain(0)
                self._manifest = Manifest(
                    size=self._size,
                    stripe_size=self._opts.stripe_size,
                    version=self.version,
                    checksums=self._checksums,
                    mtime_ns=self.mtime_ns,
                )
                self._state = "uploaded"
            if commit and self._manifest is not None:
                self._commit(self.path, self._manifest)
                self._state = "committed"
        except BaseException:
            self._abort()
            raise

    def discard(self) -> None:
        """Abandon the file: nothing becomes visible, uploaded stripes are removed."""
        if self._state in ("open", "uploaded"):
            self._abort()
        self._exc_at_open = None
        super().close()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()

    def __del__(self) -> None:
        # io's finalizer would call close() and commit a half-written file; only an
        # explicit close() commits, so an abandoned writer is discarded instead.
        if getattr(self, "_state", None) in ("open", "uploaded"):
            log.warning(
                "striped file %s was never closed: discarding it, nothing committed", self.path
            )
            self.discard()

    # -- internals ---------------------------------------------------------------------
    def _upload(self, data: bytes | memoryview) -> None:
        self._drain(self._opts.concurrency - 1)
        index = len(self._checksums)
        if index >= MAX_STRIPES:  # readers refuse such a manifest: fail now, not after upload
            raise ValueError(
                f"{self.path}: more than {MAX_STRIPES} stripes of {self._opts.stripe_size} "
                "bytes; write it with a larger stripe_size"
            )
        self._checksums.append(checksum(data))
        fut = self._backend.write_object(
            stripe_path(self.path, self.version, index),
            data,
            retry=self._retry,
            durable=self._opts.fsync,
            stripe=index,
            what=f"stripe {index} of {self.path}",
        )
        self._inflight[fut] = index

    def _drain(self, limit: int) -> None:
        """Wait until at most ``limit`` uploads are pending; raise the first failure."""
        while len(self._inflight) > limit:
            done, _ = wait(list(self._inflight), return_when=FIRST_COMPLETED)
            for fut in done:
                self._inflight.pop(fut)
                fut.result()

    def _abort(self) -> None:
        if self._state in ("discarded", "committed"):
            return
        self._state = "discarded"
        for fut in self._inflight:
            fut.cancel()
        wait(list(self._inflight))
        self._inflight.clear()
        if self._discard_version is not None:
            try:
                self._discard_version(self.path, self.version)
            except Exception as exc:  # noqa: BLE001 - cleanup is best effort, the cause is raised
                log.warning(
                    "could not remove stripes of abandoned write %s (%s): %s",
                    self.path,
                    self.version,
                    exc,
                )

    def __repr__(self) -> str:
        return f"<StripedWriter {self.path!r} {self._state} {self._size} bytes>"
