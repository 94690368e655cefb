"""Errors that name the file and the stripe, so an operator knows what to look at."""

from __future__ import annotations

import errno

from .redact import redact_text


class StripedIOError(OSError):
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


class ShortReadError(ConnectionError):
    """A range came back shorter than asked: treated as a dropped connection and retried."""
