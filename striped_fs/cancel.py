"""Cancelling a set of reads so that none of them writes anything after it is abandoned.

A read that lands straight in the caller's memory (``Source.fetch_into``) runs on a worker
thread, retried with backoff. When a set of reads fails part-way (a stripe that fails its
checksum, a stripe object missing), the caller abandons it and may reuse the same memory at
once (a checkpoint load falling back to an older step). A ``concurrent.futures`` cancel does
not stop a read that is already running, nor one sleeping between retries: without this, the
abandoned read would go on writing into memory the caller now owns again.

``CancelToken`` is what every worker of the set checks: before each attempt, while sleeping
between attempts, and around each write into a destination. ``cancel()`` returns only once no
write into a destination is under way, and none can start after it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ReadCancelled(Exception):  # noqa: N818 - a state, not a failure of the read itself
    """The read was stopped because the set it belongs to was abandoned.

    Not an ``OSError``: it says nothing about the data, so it is never taken for damage."""


class CancelToken:
    """Shared by the reads of one set; see the module docstring."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._event = threading.Event()
        self._writers = 0

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise ``ReadCancelled`` once the set is abandoned (before an attempt starts)."""
        if self._event.is_set():
            raise ReadCancelled("read cancelled: the reads it belonged to were abandoned")

    def sleep(self, seconds: float) -> None:
        """A retry's backoff that ends at once, raising, when the set is abandoned."""
        if self._event.wait(seconds):
            self.check()

    async def sleep_async(self, seconds: float) -> None:
        """``sleep`` for a read on an event loop (s3fs): ends, raising, within 50 ms of a
        cancel, so a join after ``cancel()`` never waits out a whole backoff."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.check()
            await asyncio.sleep(min(left, 0.05))
        self.check()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around a write into a destination: refused once cancelled; ``cancel()`` waits for
        the ones under way."""
        with self._cond:
            self.check()
            self._writers += 1
        try:
            yield
        finally:
            with self._cond:
                self._writers -= 1
                if not self._writers:
                    self._cond.notify_all()

    def cancel(self) -> None:
        """Abandon the set: no write into a destination starts after this returns, and the
        ones under way have finished."""
        with self._cond:
            self._event.set()
            self._cond.wait_for(lambda: self._writers == 0)
