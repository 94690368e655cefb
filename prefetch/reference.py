"""Image references (``registry/repo:tag@digest``) and content digests.

The grammar follows distribution's ``reference`` package: the first path component is a
registry host when it contains ``.`` or ``:``, is ``localhost``, or has upper-case letters;
otherwise the reference is on Docker Hub (``docker.io``), where a one-component name gets the
``library/`` prefix. A reference without tag or digest keeps ``tag=None``; :attr:`Reference.ref`
then says ``latest``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

__all__ = [
    "DOCKER_HUB",
    "Digester",
    "Reference",
    "compute_digest",
    "digest_hex",
    "is_digest",
    "validate_digest",
    "validate_repository",
    "validate_tag_or_digest",
]

DOCKER_HUB = "docker.io"
"""The registry name of unqualified references."""

DOCKER_HUB_API = "registry-1.docker.io"
"""The host that serves Docker Hub's registry API."""

_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH_RE = re.compile(rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*")
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(
    rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
)
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST_RE = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]+")
_HEX_LENGTHS = {"sha256": 64, "sha512": 128}
_NAME_MAX = 255


def validate_digest(digest: str) -> str:
    """Return ``digest`` when it is ``sha256:<64 hex>`` or ``sha512:<128 hex>`` (lower case);
    raise ValueError naming it otherwise."""
    if not isinstance(digest, str):
        raise ValueError(f"digest must be a string, got {type(digest).__name__}")
    algo, sep, hexpart = digest.partition(":")
    length = _HEX_LENGTHS.get(algo)
    if not sep or length is None:
        raise ValueError(
            f"unsupported digest {digest!r}: expected sha256:<64 hex digits> or sha512:<128>"
        )
    if len(hexpart) != length or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(
            f"malformed digest {digest!r}: {algo} needs {length} lower-case hex digits"
        )
    return digest


def validate_repository(name: str) -> str:
    """Return ``name`` when it is a valid repository path (``team/app``); ValueError else."""
    if not isinstance(name, str) or len(name) > _NAME_MAX or not _PATH_RE.fullmatch(name):
        raise ValueError(
            f"invalid repository name {name!r}: lower-case letters and digits, separated by "
            "'.', '_', '__' or '-', components joined by '/'"
        )
    return name


def validate_tag_or_digest(ref: str) -> str:
    """Return ``ref`` when it is a valid tag or a supported digest; ValueError else."""
    if isinstance(ref, str) and ":" in ref:
        return validate_digest(ref)
    if not isinstance(ref, str) or not _TAG_RE.fullmatch(ref):
        raise ValueError(f"invalid tag {ref!r}: [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}")
    return ref


def is_digest(text: str) -> bool:
    """True when ``text`` is a digest this package can verify (sha256 or sha512)."""
    try:
        validate_digest(text)
    except ValueError:
        return False
    return True


def digest_hex(digest: str) -> str:
    """The hex part of a valid digest."""
    return validate_digest(digest).partition(":")[2]


class Digester:
    """Incremental digest of a byte stream (``update`` then ``digest()``)."""

    def __init__(self, algorithm: str = "sha256") -> None:
        if algorithm not in _HEX_LENGTHS:
            raise ValueError(f"unsupported digest algorithm {algorithm!r} (sha256, sha512)")
        self.algorithm = algorithm
        self._hash = hashlib.new(algorithm)
        self.size = 0

    @classmethod
    def for_digest(cls, digest: str) -> Digester:
        """A digester with the algorithm of ``digest``."""
        return cls(validate_digest(digest).partition(":")[0])

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self.size += len(data)

    def digest(self) -> str:
        return f"{self.algorithm}:{self._hash.hexdigest()}"


def compute_digest(data: bytes | bytearray | memoryview, algorithm: str = "sha256") -> str:
    """``algorithm:hex`` of ``data``."""
    d = Digester(algorithm)
    d.update(data)
    return d.digest()


@dataclasses.dataclass(frozen=True)
class Reference:
    """A parsed image reference. ``str()`` gives the canonical form back."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if not _DOMAIN_RE.fullmatch(self.registry):
            raise ValueError(f"invalid registry host {self.registry!r} in image reference")
        if not _PATH_RE.fullmatch(self.repository):
            raise ValueError(
                f"invalid repository name {self.repository!r}: lower-case letters, digits and "
                "separators (. _ __ -) between components, components joined by '/'"
            )
        if self.tag is not None and not _TAG_RE.fullmatch(self.tag):
            raise ValueError(f"invalid tag {self.tag!r}: [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}")
        if self.digest is not None:
            validate_digest(self.digest)

    @classmethod
    def parse(cls, text: str) -> Reference:
        """Parse ``[registry/]repository[:tag][@digest]``; ValueError names the reference and
        says what is wrong with it."""
        if not isinstance(text, str):
            raise ValueError(f"image reference must be a string, got {type(text).__name__}")
        try:
            return cls._parse(text)
        except ValueError as exc:
            raise ValueError(f"invalid image reference {text!r}: {exc}") from None

    @classmethod
    def _parse(cls, text: str) -> Reference:
        if not text:
            raise ValueError("empty")
        if text != text.strip() or any(c.isspace() for c in text):
            raise ValueError("contains white space")
        if "://" in text:
            raise ValueError("a reference has no URL scheme (drop 'http://' or 'https://')")
        remainder, at, digest = text.partition("@")
        if at:
            if not _DIGEST_RE.fullmatch(digest):
                raise ValueError(f"malformed digest {digest!r}")
            validate_digest(digest)
        name, tag = remainder, None
        slash = remainder.rfind("/")
        colon = remainder.rfind(":")
        if colon > slash:  # a ':' after the last '/' starts the tag (not a registry port)
            name, tag = remainder[:colon], remainder[colon + 1 :]
            if not _TAG_RE.fullmatch(tag):
                raise ValueError(f"malformed tag {tag!r}")
        if not name:
            raise ValueError("missing repository name")
        if len(name) > _NAME_MAX:
            raise ValueError(f"name longer than {_NAME_MAX} characters")
        first, sep, rest = name.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost" or first.lower() != first):
            registry, repository = first, rest
        else:
            registry, repository = DOCKER_HUB, name
        if registry == "index.docker.io":
            registry = DOCKER_HUB
        if registry == DOCKER_HUB and "/" not in repository:
            repository = f"library/{repository}"
        if not _DOMAIN_RE.fullmatch(registry):
            raise ValueError(f"malformed registry host {registry!r}")
        if not _PATH_RE.fullmatch(repository):
            raise ValueError(
                f"malformed repository name {repository!r} (lower-case letters, digits, "
                "'.', '_', '__' or '-' between them, components joined by '/')"
            )
        return cls(registry, repository, tag, digest or None)

    @property
    def ref(self) -> str:
        """What to fetch: the digest when there is one, else the tag, else ``latest``."""
        return self.digest or self.tag or "latest"

    @property
    def name(self) -> str:
        """``registry/repository``."""
        return f"{self.registry}/{self.repository}"

    def with_digest(self, digest: str) -> Reference:
        """The same name and tag pinned to ``digest``."""
        return dataclasses.replace(self, digest=validate_digest(digest))

    def with_tag(self, tag: str | None) -> Reference:
        return dataclasses.replace(self, tag=tag, digest=None)

    def __str__(self) -> str:
        text = self.name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
