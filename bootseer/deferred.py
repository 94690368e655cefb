"""Checks of a warm start that run beside the command instead of before it.

A node whose environment marker matches (the key, the prefix it was restored for, its
verification record, bootseer's state private: O(1), ``snapshot.verify(quick=True)``) starts
the command at once; the file-by-file check (every member's type, size, mtime and mode, and
entries the snapshot does not hold: 21k stats, about 1 s for a torch environment,
``snapshot.verify``) runs here, on a thread at the lowest CPU priority, while the command
imports. A mismatch it finds is handed to the supervisor, which stops the job with the
check's problems and its fix; the environment's marker is marked damaged, so the next start
restores it instead of trusting it (docs/run.md, the warm path).

What it cannot do: a file changed since the last start may be read by the command before
the check reaches it (the window is the check's duration). ``env.verify = "before"`` keeps
the check on the start's path.

Usage::

    checks = DeferredChecks()
    checks.start("environment /opt/env", lambda: verify(prefix, key))
    ...
    if (problem := checks.failure()) is not None:   # the supervisor, every poll
        stop_the_job(problem)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DeferredChecks", "DeferredFailure"]


@dataclass(frozen=True)
class DeferredFailure:
    """A check that failed beside the command: what, and why, in words."""

    what: str
    reason: str
    problems: tuple[str, ...] = ()
    fix: str = ""  # what to do about it, in words (the supervisor's error says it)

    def describe(self) -> str:
        shown = "; ".join(self.problems[:5])
        return f"{self.what}: {self.reason}" + (f" ({shown})" if shown else "")


class DeferredChecks:
    """The checks of the running attempt; :meth:`failure` is the first that failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: DeferredFailure | None = None
        self._threads: list[threading.Thread] = []

    def start(
        self,
        what: str,
        check: Callable[[], Any],
        on_failure: Callable[[DeferredFailure], None] | None = None,
        fix: str = "",
    ) -> None:
        """Run ``check`` (returning an object with ``ok``, ``reason``, ``problems``) on a
        thread; ``on_failure`` runs there when it fails (e.g. remove the marker); ``fix``
        goes into the failure."""

        def run() -> None:
            try:  # this thread only: the command and the supervisor keep their priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (OSError, AttributeError):
                pass
            try:
                result = check()
                failed = (
                    None
                    if result.ok
                    else DeferredFailure(
                        what, result.reason, tuple(getattr(result, "problems", ()) or ()), fix
                    )
                )
            except Exception as exc:  # noqa: BLE001 - a check that cannot run has failed
                failed = DeferredFailure(what, f"the check itself failed: {exc}", (), fix)
            if failed is None:
                return
            if on_failure is not None:
                try:
                    on_failure(failed)
                except Exception:  # noqa: BLE001 - the failure itself is what matters
                    pass
            with self._lock:
                if self._failed is None:
                    self._failed = failed

        thread = threading.Thread(target=run, name=f"bootseer-check-{what}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def failure(self) -> DeferredFailure | None:
        with self._lock:
            return self._failed

    def pending(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout: float | None = None) -> None:
        for thread in self._threads:
            thread.join(timeout)

    def reset(self) -> None:
        """A new attempt: the finished checks and their verdict go (a failed check's
        environment was invalidated, and the attempt's startup made it again)."""
        self.join()
        with self._lock:
            self._failed = None
            self._threads = []
