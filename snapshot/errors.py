"""Snapshot errors: each names the key, the chunk, the member or the command, and what to do."""

from __future__ import annotations

from striped_fs import redact


class SnapshotError(Exception):
    """Base class for snapshot errors. Messages never show credentials (a store URL's
    ``user:password@``, keys, tokens): they are redacted as the error is made."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) for a in args))


class SnapshotNotFound(SnapshotError, FileNotFoundError):
    """No committed snapshot exists for the key in the store."""


class CorruptSnapshotError(SnapshotError):
    """A snapshot's manifest or one of its objects failed verification; ``chunk`` names the
    object (a chunk or the TOC) and ``rule`` the check it failed, when there is one."""

    def __init__(self, message: str, *, chunk: str | None = None, rule: str | None = None) -> None:
        super().__init__(message)
        self.chunk = chunk
        self.rule = rule


class UnsafeMemberError(SnapshotError):
    """A member breaks an untrusted-input rule; ``member`` and ``rule`` name both."""

    def __init__(self, member: str, rule: str) -> None:
        super().__init__(f"refused snapshot member {member!r}: {rule}")
        self.member = member
        self.rule = rule


class RelocationError(SnapshotError):
    """The snapshot cannot be restored to another prefix: binaries embed the old one."""

    def __init__(self, message: str, *, paths: list[str]) -> None:
        super().__init__(message)
        self.paths = paths


class InstallError(SnapshotError):
    """The install (or setup) command failed: nothing was published."""

    def __init__(self, command: list[str], returncode: int, output_tail: str) -> None:
        shown = " ".join(command)
        super().__init__(
            f"install command failed with exit code {returncode}: {shown}\n"
            f"--- last lines of its output ---\n{output_tail.rstrip()}"
        )
        self.command = command
        self.returncode = returncode
        self.output_tail = output_tail


class StoreUnavailable(SnapshotError):
    """The snapshot store could not be reached (network, credentials, missing bucket)."""
