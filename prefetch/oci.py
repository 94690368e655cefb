"""The OCI object model the registry client speaks: descriptors, manifests and indexes,
platform selection, and the referrers fallback tag.

Everything parsed from a registry is checked before it is trusted: digests are well formed,
sizes are non-negative integers, annotations map strings to strings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from prefetch import mediatypes as mt
from prefetch.reference import digest_hex, validate_digest

__all__ = [
    "Descriptor",
    "Manifest",
    "parse_platform",
    "referrers_tag",
    "select_platform",
]


def _check_str_map(value: Any, what: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{what}: annotations must map strings to strings")
    return dict(value)


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor. Sizes and digests are checked when parsed from JSON."""

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] | None = None
    artifact_type: str | None = None
    platform: Mapping[str, Any] | None = None

    @classmethod
    def from_json(cls, obj: Any, where: str = "descriptor") -> Descriptor:
        """Parse and validate; ValueError says which field of ``where`` is wrong."""
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        media_type = obj.get("mediaType")
        if not isinstance(media_type, str) or not media_type:
            raise ValueError(f"{where}: mediaType missing or not a string")
        digest = obj.get("digest")
        try:
            validate_digest(digest)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        size = obj.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{where}: size must be a non-negative integer, got {size!r}")
        artifact_type = obj.get("artifactType")
        if artifact_type is not None and not isinstance(artifact_type, str):
            raise ValueError(f"{where}: artifactType must be a string")
        platform = obj.get("platform")
        if platform is not None and not isinstance(platform, dict):
            raise ValueError(f"{where}: platform must be an object")
        return cls(
            media_type,
            digest,
            size,
            _check_str_map(obj.get("annotations"), where),
            artifact_type,
            platform,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.artifact_type is not None:
            out["artifactType"] = self.artifact_type
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.platform is not None:
            out["platform"] = dict(self.platform)
        return out

    @property
    def platform_name(self) -> str | None:
        """``os/arch[/variant]`` of an index entry, or None."""
        p = self.platform
        if not p or not isinstance(p.get("os"), str) or not isinstance(p.get("architecture"), str):
            return None
        name = f"{p['os']}/{p['architecture']}"
        if isinstance(p.get("variant"), str) and p["variant"]:
            name += f"/{p['variant']}"
        return name


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A manifest or index as fetched: its bytes (exactly, as digested), type and digest."""

    media_type: str
    data: bytes
    digest: str

    @functools.cached_property
    def parsed(self) -> dict[str, Any]:
        """The JSON document (ValueError when it is not a JSON object)."""
        try:
            obj = json.loads(self.data)
        except ValueError as exc:
            raise ValueError(f"manifest {self.digest} is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"manifest {self.digest} is not a JSON object")
        return obj

    def json(self) -> dict[str, Any]:
        return self.parsed

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def is_index(self) -> bool:
        return self.media_type in mt.INDEXES

    @property
    def descriptor(self) -> Descriptor:
        """The descriptor that points at this manifest."""
        return Descriptor(
            self.media_type, self.digest, len(self.data), artifact_type=self.artifact_type
        )

    @property
    def artifact_type(self) -> str | None:
        value = self.parsed.get("artifactType")
        return value if isinstance(value, str) else None

    def _descriptors(self, key: str) -> list[Descriptor]:
        items = self.parsed.get(key, [])
        if not isinstance(items, list):
            raise ValueError(f"manifest {self.digest}: '{key}' must be a list")
        return [
            Descriptor.from_json(d, f"manifest {self.digest} {key}[{i}]")
            for i, d in enumerate(items)
        ]

    @property
    def config(self) -> Descriptor:
        """An image manifest's config descriptor."""
        return Descriptor.from_json(self.parsed.get("config"), f"manifest {self.digest} config")

    @property
    def layers(self) -> list[Descriptor]:
        """An image manifest's layer descriptors, in order."""
        return self._descriptors("layers")

    @property
    def manifests(self) -> list[Descriptor]:
        """An index's entries."""
        return self._descriptors("manifests")

    @property
    def subject(self) -> Descriptor | None:
        subject = self.parsed.get("subject")
        if subject is None:
            return None
        return Descriptor.from_json(subject, f"manifest {self.digest} subject")


def referrers_tag(digest: str) -> str:
    """The tag of the referrers tag-schema fallback: ``sha256:abc…`` -> ``sha256-abc…``."""
    algo = validate_digest(digest).partition(":")[0]
    return f"{algo[:32]}-{digest_hex(digest)[:64]}"


_ARCH_ALIASES = {
    "x86_64": "amd64",
    "x86-64": "amd64",
    "aarch64": "arm64",
    "armhf": "arm",
    "armel": "arm",
    "i386": "386",
}


def parse_platform(text: str) -> tuple[str, str, str | None]:
    """``"linux/arm64/v8"`` -> ``("linux", "arm64", "v8")``; common aliases normalised."""
    parts = text.strip().lower().split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"invalid platform {text!r}: expected OS/ARCH or OS/ARCH/VARIANT")
    os_name, arch = parts[0], _ARCH_ALIASES.get(parts[1], parts[1])
    variant = parts[2] if len(parts) == 3 else None
    return os_name, arch, variant


def _norm_variant(arch: str, variant: str | None) -> str | None:
    if arch == "arm64" and variant in (None, "", "v8"):
        return "v8"
    return variant or None


def select_platform(entries: Sequence[Descriptor], platform: str) -> Descriptor | None:
    """The first index entry for ``platform`` (None when there is none). Without a variant in
    ``platform``, any variant matches, an entry without one first."""
    want_os, want_arch, want_variant = parse_platform(platform)
    candidates: list[Descriptor] = []
    for entry in entries:
        if entry.media_type not in mt.MANIFESTS or not entry.platform:
            continue
        p = entry.platform
        os_name = str(p.get("os", "")).lower()
        arch = _ARCH_ALIASES.get(str(p.get("architecture", "")).lower(), "")
        arch = arch or str(p.get("architecture", "")).lower()
        if os_name != want_os or arch != want_arch:
            continue
        variant = p.get("variant") if isinstance(p.get("variant"), str) else None
        if want_variant is not None:
            if _norm_variant(arch, variant) == _norm_variant(arch, want_variant):
                return entry
            continue
        candidates.append(entry)
    if not candidates:
        return None
    for entry in candidates:
        if not (entry.platform or {}).get("variant"):
            return entry
    return candidates[0]
