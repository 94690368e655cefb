"""Riding out a durable store's outage behind the memory tier.

With the memory tier every step is already in the node's memory and on its peer, so a
durable save that fails because the store is briefly unreachable loses nothing: stopping
every rank for it (a restart that then cannot list the store either) costs the whole job the
outage and its restart. :class:`DurableOutage` decides, per failed durable save, whether
training goes on (a transient failure, the outage shorter than its bound) or the failure is
raised in the caller (anything else, or an outage past the bound). Without the memory tier
nothing else holds the state, and every failure is raised as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from striped_fs import is_transient

from .errors import CheckpointSaveError, CommitTimeout

log = logging.getLogger("ckpt")

__all__ = ["DurableOutage", "transient_save_failure"]


def transient_save_failure(exc: BaseException) -> bool:
    """Whether a failed save failed on the store's side and may succeed later: a dropped or
    refused connection or a timeout anywhere in its causes, or a commit that missed another
    rank's shard. A permission, a missing bucket or a bug is not: those are raised at once."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, CommitTimeout) or is_transient(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class DurableOutage:
    """The current run of failed durable saves of one rank: since when, from which step."""

    def __init__(
        self, bound_s: float, url: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bound_s = bound_s
        self.url = url
        self.clock = clock
        self.since: float | None = None
        self.first_step: int | None = None
        self.failures = 0
        self.skipped = 0

    @property
    def failing(self) -> bool:
        """A durable save failed and none has succeeded since: the store is out."""
        return self.since is not None

    def succeeded(self, step: int) -> None:
        """A durable save committed (or, on a rank other than 0, wrote its shard)."""
        if self.since is not None:
            log.warning(
                "checkpoint store %s is back: step %d is durable after %d failed and "
                "%d skipped durable save(s) over %.0f s",
                self.url,
                step,
                self.failures,
                self.skipped,
                self.clock() - self.since,
            )
        self.since, self.first_step, self.failures, self.skipped = None, None, 0, 0

    def failed(self, exc: CheckpointSaveError, newest_in_memory: int) -> None:
        """A durable save failed: log it and go on, or raise it (see the module)."""
        if self.bound_s <= 0 or not transient_save_failure(exc):
            raise exc
        now = self.clock()
        if self.since is None:
            self.since, self.first_step = now, exc.step
        self.failures += 1
        lasted = now - self.since
        if lasted > self.bound_s:
            raise CheckpointSaveError(
                f"the checkpoint store {self.url} has failed every durable save for "
                f"{lasted:.0f} s since step {self.first_step} (the bound is "
                f"ckpt.durable_outage_s={self.bound_s:g} s); the last: {exc}. The memory "
                f"tier holds step {newest_in_memory}: bring the store back and restart, or "
                "raise the bound",
                step=exc.step,
            ) from exc
        log.warning(
            "durable save of step %d failed (%s); training goes on, the memory tier "
            "holds step %d; raised if the store still fails %g s after the first "
            "failure (ckpt.durable_outage_s)",
            exc.step,
            exc,
            newest_in_memory,
            self.bound_s,
        )

    def skip(self, step: int, persisting: int) -> None:
        """A durable save due at ``step`` is not started: the store is failing and
        ``persisting`` still runs."""
        self.skipped += 1
        log.info(
            "durable save of step %d skipped: the store is failing and step %d is still "
            "being written (the memory tier holds step %d)",
            step,
            persisting,
            step,
        )
