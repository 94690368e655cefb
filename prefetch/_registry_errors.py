"""The registry client's errors (:mod:`prefetch.registry` re-exports them): one root,
:class:`RegistryError`, whose message names the registry, repository, reference and status and
says what to do; and :class:`_Ctx`, what an operation is about, for scopes and messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import (
    Sequence,
)
from typing import Any

from prefetch.errors import PrefetchError
from prefetch.reference import (
    is_digest,
    validate_repository,
    validate_tag_or_digest,
)

# -- errors ---------------------------------------------------------------------------------------


class RegistryError(PrefetchError):
    """A registry operation failed. ``str()`` is the full, actionable message; the attributes
    say what it was about (any may be None)."""

    def __init__(
        self,
        message: str,
        *,
        registry: str | None = None,
        repository: str | None = None,
        reference: str | None = None,
        status: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.registry = registry
        self.repository = repository
        self.reference = reference
        self.status = status
        self.code = code

    @property
    def digest(self) -> str | None:
        """The digest the operation was about, when its reference is one."""
        return self.reference if self.reference and is_digest(self.reference) else None


class RegistryNotFound(RegistryError):
    """HTTP 404: repository, manifest, tag or blob unknown."""


class RegistryAuthError(RegistryError):
    """HTTP 401/403, or the token server refused: credentials missing, wrong or insufficient."""


class RegistryUnavailable(RegistryError):
    """The registry could not be reached or kept failing (connection errors, timeouts, 5xx,
    429) after the bounded retries, or an upload broke off and could not be replayed."""


class DigestMismatch(RegistryError):
    """Bytes do not match their digest (corrupt storage, a broken proxy, or wrong input)."""


class RangeNotSupported(RegistryError):
    """The registry ignored or refused an HTTP Range request."""


class RegistryProtocolError(RegistryError):
    """The registry answered something the OCI distribution spec does not allow."""


class PlatformNotFound(RegistryError):
    """An index has no manifest for the requested platform; ``available`` lists those it has."""

    def __init__(self, message: str, *, available: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.available = list(available)


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """What an operation is about, for scopes and messages."""

    op: str
    repo: str | None = None
    ref: str | None = None
    actions: str = "pull"
    extra_scopes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Names and references go into URL paths: refuse anything outside the grammar.
        if self.repo is not None:
            validate_repository(self.repo)
        if self.ref is not None:
            validate_tag_or_digest(self.ref)

    @property
    def scopes(self) -> tuple[str, ...]:
        if self.repo is None:
            return self.extra_scopes
        return (f"repository:{self.repo}:{self.actions}", *self.extra_scopes)

    def target(self) -> str:
        if self.repo is None:
            return ""
        if self.ref is None:
            return f" {self.repo}"
        sep = "@" if is_digest(self.ref) else ":"
        return f" {self.repo}{sep}{self.ref}"
