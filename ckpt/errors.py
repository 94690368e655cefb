"""Checkpoint errors: each names the step, the rank or the file, and what to do."""

from __future__ import annotations

from striped_fs import redact


class CheckpointError(Exception):
    """Base class for ckpt errors. Messages never show credentials (a store URL's
    ``user:password@``, keys, tokens): they are redacted as the error is made."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) for a in args))


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No committed checkpoint (at that step) exists under the URL."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint failed verification; ``path`` names the file."""

    def __init__(self, message: str, *, step: int, path: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.path = path


class CheckpointStoreUnavailable(CheckpointError):
    """The checkpoint store could not be listed or read (connection refused, timeouts,
    credentials): not the same as an empty store, which holds no checkpoint yet."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = redact(url)


class CheckpointSaveError(CheckpointError):
    """A background save failed; raised in the caller at the next save/wait/close."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class CommitTimeout(CheckpointSaveError):
    """Rank 0 waited ``commit_timeout_s`` for every rank's shard of a step and some never
    came: their save failed or was skipped (a store outage), not this rank's."""


class StateMismatchError(CheckpointError):
    """The state to load into does not match the checkpoint; lists every mismatch."""

    def __init__(self, step: int, problems: list[str]) -> None:
        self.step = step
        self.problems = problems
        lines = "\n  ".join(problems)
        super().__init__(
            f"checkpoint step {step} does not match the state to load ({len(problems)} "
            f"problem(s)); pass strict=False to load what matches:\n  {lines}"
        )
