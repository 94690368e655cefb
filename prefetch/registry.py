"""Asyncio client for the OCI distribution API (aiohttp).

What it does:

- manifests and indexes, with platform selection (:meth:`RegistryClient.resolve_image`);
- blobs: whole (:meth:`~RegistryClient.get_blob`), streamed (:meth:`~RegistryClient.
  open_blob_stream`), by HTTP Range (:meth:`~RegistryClient.get_blob_range`);
- uploads: monolithic or chunked, cross-repository mounts;
- tags, and referrers (the ``referrers`` API, or the tag-schema fallback of registries without
  it, such as distribution 2.8);
- auth: anonymous, Basic, and Bearer tokens from the registry's token server (docker's token
  spec), tokens cached per scope until shortly before they expire;
- retries with exponential backoff and jitter on connection errors, timeouts, 5xx and 429
  (``Retry-After`` honoured), never on other 4xx; a blob read that breaks off resumes with a
  Range request from where it stopped.

Every byte that has a digest is verified against it: manifests fetched by digest (or against
``Docker-Content-Digest``), whole and streamed blobs (:class:`DigestMismatch`). Range reads
cannot be verified here; the layer format verifies its frames.

Errors are :class:`RegistryError` subclasses whose message names the registry, repository,
reference or digest and HTTP status, and says what to do. No message or log line ever holds a
password or token.

Non-async code uses :class:`SyncRegistry` or :func:`run_sync`. The object model
(:class:`Descriptor`, :class:`Manifest`, platform selection) lives in :mod:`prefetch.oci`,
references and digests in :mod:`prefetch.reference`, auth pieces in :mod:`prefetch.auth`; the
names used with the client are re-exported here.

The code is in private modules, cut where this file had its sections: the errors
(``_registry_errors``), the limits and HTTP helpers (``_registry_helpers``), the client
(``_registry_client``) and the synchronous use (``_registry_sync``). Import from here: the
names below are the contract, and their ``__module__`` says ``prefetch.registry``.
"""

from __future__ import annotations

from prefetch._registry_client import BlobStream, RegistryClient
from prefetch._registry_errors import (
    DigestMismatch,
    PlatformNotFound,
    RangeNotSupported,
    RegistryAuthError,
    RegistryError,
    RegistryNotFound,
    RegistryProtocolError,
    RegistryUnavailable,
)
from prefetch._registry_helpers import (  # noqa: F401 (the limits, importable from here as before)
    DEFAULT_CHUNK,
    MAX_RETRY_AFTER_S,
    STREAM_UPLOAD_CHUNK,
    USER_AGENT,
)
from prefetch._registry_sync import SyncRegistry, run_sync
from prefetch.oci import Descriptor, Manifest, parse_platform, referrers_tag, select_platform

__all__ = [
    "BlobStream",
    "Descriptor",
    "DigestMismatch",
    "Manifest",
    "PlatformNotFound",
    "RangeNotSupported",
    "RegistryAuthError",
    "RegistryClient",
    "RegistryError",
    "RegistryNotFound",
    "RegistryProtocolError",
    "RegistryUnavailable",
    "SyncRegistry",
    "parse_platform",
    "referrers_tag",
    "run_sync",
    "select_platform",
]

# What the private modules define is shown (repr, tracebacks, pickles, docs) as this module's:
# the path a caller imports it by. prefetch.oci's names keep their own home.
for _obj in (
    BlobStream,
    RegistryClient,
    DigestMismatch,
    PlatformNotFound,
    RangeNotSupported,
    RegistryAuthError,
    RegistryError,
    RegistryNotFound,
    RegistryProtocolError,
    RegistryUnavailable,
    SyncRegistry,
    run_sync,
):
    _obj.__module__ = __name__
del _obj
