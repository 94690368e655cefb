"""striped_fs's errors, under one root: ``except StripedError`` catches every failure it
reports to a person, each naming the file, the stripe, the option or the mountpoint.

    StripedError
    +-- StripedIOError (also OSError): StripeChecksumError, ManifestError
    +-- ShortReadError (also ConnectionError: retried as a dropped connection)
    +-- OptionError (also ValueError; striped_fs.config)
    +-- UnsafePath (also PermissionError; striped_fs.privdir)
    +-- MountError (also RuntimeError; striped_fs.fuse): MountTimeout (also TimeoutError)

Each keeps the builtin base callers catch it by. ``ReadCancelled`` (striped_fs.cancel) is
not one of them: it is the state of an abandoned read, not a failure, and a handler of
``StripedError`` must not swallow it."""

from __future__ import annotations

import errno

from .redact import redact_text


class StripedError(Exception):
    """Base class for striped_fs's errors; ``str()`` is the full message."""


class StripedIOError(StripedError, OSError):
    """A stripe could not be read or written after bounded retries."""

    def __init__(self, message: str, *, path: str, stripe: int | None = None) -> None:
        super().__init__(errno.EIO, redact_text(message))
        self.path = path
        self.stripe = stripe

    def __str__(self) -> str:  # OSError's default prefixes "[Errno 5]"; keep the message readable
        return self.strerror


class StripeChecksumError(StripedIOError):
    """The bytes of a stripe do not match the checksum recorded when it was written."""


class ManifestError(StripedIOError):
    """A striped file's manifest is malformed or inconsistent with its declared sizes, or
    with the stripe objects the target holds; ``field``, when known, names the manifest's
    field that does not hold (``stripe_size``, ``size``, ``stripes``, ``version``)."""

    def __init__(
        self, message: str, *, path: str, stripe: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(message, path=path, stripe=stripe)
        self.field = field


class ShortReadError(StripedError, ConnectionError):
    """A range came back shorter than asked: treated as a dropped connection and retried."""


class OptionError(StripedError, ValueError):
    """A striping option has a value that cannot be used; the message says which and why."""


class UnsafePath(StripedError, PermissionError):
    """A directory or file that another user could control: refused, never used. The
    message names the path, what was found, the rule and what to do."""


class MountError(StripedError, RuntimeError):
    """A mount could not be made, awaited or removed; the message says why."""


class MountTimeout(MountError, TimeoutError):
    """The mount did not appear in time."""
