"""prefetch: lazy container images (registry client, seekable layers, containerd snapshotter).

``PrefetchError`` is the root of its errors (see ``prefetch.errors``). Everything else is
reachable here too, loaded on first use: ``import prefetch`` stays free of aiohttp, grpc and
zstandard.

    image = open_image("registry:5000/team/train:v1", "/var/cache/bootseer/image")
    plan, full = plan_prefetch(load_profile(image), image.blobs)
    mount_image(image.lazy, "/mnt/rootfs")       # prefetch.lazyfs.mount

The containerd services (``bootseer snapshotter``, ``bootseer fuse-holder``) are their
modules, ``prefetch.containerd.service`` and ``prefetch.containerd.holder``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import PrefetchError

# name -> the module that defines it, or (module, its name there); imported when first asked for
_LAZY: dict[str, str | tuple[str, str]] = {
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
    # images: convert, open, verify, their hot-frame profiles, the lazy mount
    "convert_image": "prefetch.image",
    "open_image": "prefetch.image",
    "verify_image": "prefetch.image",
    "load_profile": "prefetch.image",
    "save_profile": "prefetch.image",
    "plan_prefetch": "prefetch.profile",
    "profile_summary": "prefetch.profile",
    "mount_image": ("prefetch.lazyfs", "mount"),
    # containerd: a pull through the snapshotter, the kubelet's calls (CRI)
    "pull_image": "prefetch.containerd.pull",
    "CRIClient": "prefetch.containerd.cri",
}

if TYPE_CHECKING:
    from .containerd.cri import CRIClient
    from .containerd.errors import ContainerdError
    from .containerd.holder import HolderError
    from .containerd.metadata import SchemaVersionError
    from .containerd.pull import pull_image
    from .image import convert_image, load_profile, open_image, save_profile, verify_image
    from .lazyfs import mount as mount_image
    from .members import ConvertError
    from .profile import ProfileError, plan_prefetch, profile_summary
    from .registry import (
        DigestMismatch,
        PlatformNotFound,
        RangeNotSupported,
        RegistryAuthError,
        RegistryError,
        RegistryNotFound,
        RegistryProtocolError,
        RegistryUnavailable,
    )
    from .safety import UnsafeMemberError
    from .toc import (
        FrameVerificationError,
        LayerFormatError,
        MalformedLayerError,
        NotConvertedError,
        TocMismatchError,
        UnboundIndexError,
        UnsafeLayerError,
    )

# written out, not ``[*_LAZY]``: tests/test_architecture.py reads it without importing
__all__ = [
    "CRIClient",
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
    "convert_image",
    "load_profile",
    "mount_image",
    "open_image",
    "plan_prefetch",
    "profile_summary",
    "pull_image",
    "save_profile",
    "verify_image",
]


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'prefetch' has no attribute {name!r}")
    module, attribute = (where, name) if isinstance(where, str) else where
    return getattr(importlib.import_module(module), attribute)
