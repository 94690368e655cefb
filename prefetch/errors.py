"""The root of prefetch's errors: ``except PrefetchError`` catches every failure prefetch
reports to a person (a registry, a layer's format, a profile, a conversion, the containerd
side), and the command line prints each as one line naming the object and the fix.

The classes stay where they are raised (``prefetch.registry.RegistryError``...), with the
builtin base a caller may catch them by (``ValueError``, ``RuntimeError``) kept beside this
one. This module imports nothing, so it is cheap to load where aiohttp or grpc are not.

    PrefetchError
    +-- RegistryError (registry.py): RegistryNotFound, RegistryAuthError, RegistryUnavailable,
    |   DigestMismatch, RangeNotSupported, RegistryProtocolError, PlatformNotFound
    +-- LayerFormatError (toc.py): NotConvertedError, MalformedLayerError, UnsafeLayerError,
    |   UnboundIndexError, TocMismatchError, FrameVerificationError
    +-- UnsafeMemberError (safety.py, also ValueError)
    +-- ConvertError (members.py, also ValueError)
    +-- ProfileError (profile.py, also ValueError)
    +-- ContainerdError (containerd/errors.py): NotFoundError, AlreadyExistsError,
    |   FailedPreconditionError, InvalidArgumentError, UnavailableError
    +-- HolderError (containerd/holder.py, also RuntimeError)
    +-- SchemaVersionError (containerd/metadata.py, also RuntimeError)
"""

from __future__ import annotations

__all__ = ["PrefetchError"]


class PrefetchError(Exception):
    """Base class for prefetch's errors; ``str()`` is the full, actionable message."""
