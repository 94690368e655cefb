"""The registry client for synchronous code: :func:`run_sync` and :class:`SyncRegistry`
(:mod:`prefetch.registry` re-exports both).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
from collections.abc import (
    Coroutine,
    Iterator,
)
from typing import Any, Self, TypeVar

from prefetch._registry_client import RegistryClient

T = TypeVar("T")

# -- synchronous use -------------------------------------------------------------------------------


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code: ``asyncio.run`` when no loop runs in
    this thread, else on a fresh loop in a helper thread (never nests loops)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bootseer-run-sync") as ex:
        return ex.submit(asyncio.run, coro).result()


class SyncRegistry:
    """Blocking facade over :class:`RegistryClient` for CLI code: the client lives on a
    private event loop in a daemon thread; every coroutine method of the client is available
    here as a blocking call (``reg.get_blob(repo, digest)``), and :meth:`iter_blob` replaces
    ``open_blob_stream``. Use as a context manager, or call :meth:`close`."""

    def __init__(self, registry: str, **kwargs: Any) -> None:
        self.client = RegistryClient(registry, **kwargs)  # argument errors before any thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="bootseer-registry", daemon=True
        )
        self._thread.start()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("SyncRegistry is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "client":
            raise AttributeError(name)
        if name == "open_blob_stream":
            raise AttributeError("SyncRegistry has iter_blob() instead of open_blob_stream()")
        attr = getattr(self.client, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(attr(*args, **kwargs))

        return call

    def iter_blob(self, repo: str, digest: str, **kwargs: Any) -> Iterator[bytes]:
        """Blocking iterator over a blob's verified chunks (see ``open_blob_stream``)."""
        stream = self.client.open_blob_stream(repo, digest, **kwargs)
        try:
            while True:
                try:
                    yield self._call(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._call(stream.aclose())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
