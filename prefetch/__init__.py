"""prefetch: lazy container images (registry client, seekable layers, containerd snapshotter).

``PrefetchError`` is the root of its errors (see ``prefetch.errors``). The other error
classes are reachable here too, loaded on first use: ``import prefetch`` stays free of
aiohttp, grpc and zstandard.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import PrefetchError

# name -> the module that defines it (imported when the name is first asked for)
_LAZY_ERRORS = {
    "RegistryError": "prefetch.registry",
    "RegistryNotFound": "prefetch.registry",
    "RegistryAuthError": "prefetch.registry",
    "RegistryUnavailable": "prefetch.registry",
    "DigestMismatch": "prefetch.registry",
    "RangeNotSupported": "prefetch.registry",
    "RegistryProtocolError": "prefetch.registry",
    "PlatformNotFound": "prefetch.registry",
    "LayerFormatError": "prefetch.toc",
    "NotConvertedError": "prefetch.toc",
    "MalformedLayerError": "prefetch.toc",
    "UnsafeLayerError": "prefetch.toc",
    "UnboundIndexError": "prefetch.toc",
    "TocMismatchError": "prefetch.toc",
    "FrameVerificationError": "prefetch.toc",
    "UnsafeMemberError": "prefetch.safety",
    "ConvertError": "prefetch.members",
    "ProfileError": "prefetch.profile",
    "ContainerdError": "prefetch.containerd.errors",
    "HolderError": "prefetch.containerd.holder",
    "SchemaVersionError": "prefetch.containerd.metadata",
}

# written out, not ``[*_LAZY_ERRORS]``: tests/test_architecture.py reads it without importing
__all__ = [
    "ContainerdError",
    "ConvertError",
    "DigestMismatch",
    "FrameVerificationError",
    "HolderError",
    "LayerFormatError",
    "MalformedLayerError",
    "NotConvertedError",
    "PlatformNotFound",
    "PrefetchError",
    "ProfileError",
    "RangeNotSupported",
    "RegistryAuthError",
    "RegistryError",
    "RegistryNotFound",
    "RegistryProtocolError",
    "RegistryUnavailable",
    "SchemaVersionError",
    "TocMismatchError",
    "UnboundIndexError",
    "UnsafeLayerError",
    "UnsafeMemberError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY_ERRORS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefetch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
