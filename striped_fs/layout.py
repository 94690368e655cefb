"""The striped layout: where stripes live and what the manifest (the commit point) says.

A striped file at ``dir/name`` is two things on the target filesystem:

* its stripes, one object each: ``dir/.name.stripes/<version>/<index:08d>``;
* its manifest, at ``dir/name`` itself: ``MAGIC`` followed by JSON.

Because the manifest sits at the file's own path, the final write of a file is one atomic
replace of that path (an S3 PUT, a local ``rename``): a reader sees either the old version
or the new one, never a mixture, and a plain file and a striped file cannot both claim one
path: whichever was committed last is the file. The previous version's stripes are deleted
after the new manifest is in place.
"""

from __future__ import annotations

import json
import math
import re
import time
import zlib
from dataclasses import dataclass, field

from .config import MAX_STRIPE_SIZE
from .errors import ManifestError

MAGIC = b"BOOTSEER-STRIPED\x00v1\n"
#: Format 2 is format 1 plus ``mtime_ns``. A manifest is written as format 1 unless it
#: carries an mtime, so files nobody set a time on stay readable by older readers, which
#: refuse format 2 by its number ("upgrade bootseer"), not as an unknown field.
FORMAT_VERSION = 2
FORMATS = (1, 2)
CHECKSUM_ALGO = "crc32"
# Manifests hold ~11 bytes per stripe; 16 MiB holds the largest stripe count below.
MAX_MANIFEST_SIZE = 16 << 20
# An mtime is integer nanoseconds since the epoch, within what a signed 64-bit time holds.
MIN_MTIME_NS, MAX_MTIME_NS = -(1 << 63), (1 << 63) - 1
# Caps on what a manifest may declare (checked before anything is allocated from it):
# 2**20 stripes are 8 TiB at the default 8 MiB stripes and 1 PiB at the 1 GiB maximum.
MAX_STRIPES = 1 << 20
MAX_FILE_SIZE = MAX_STRIPES * MAX_STRIPE_SIZE
# Files at most this large are read whole when probed: one request answers both
# "is it a manifest?" and "what are its bytes?".
SMALL_FILE_PROBE = 64 << 10

_STRIPES_DIR_RE = re.compile(r"^\.(?P<name>.+)\.stripes$")
_VERSION_RE = re.compile(r"[0-9a-f]{32}")  # always fullmatch()


def checksum(data: bytes | bytearray | memoryview) -> int:
    """CRC-32 of a stripe (zlib, ~7 GB/s here; detects corruption, not tampering)."""
    return zlib.crc32(data) & 0xFFFFFFFF


def split_path(path: str) -> tuple[str, str]:
    """``a/b/c`` -> (``a/b``, ``c``); a top-level name has parent ``""``."""
    parent, _, name = path.rpartition("/")
    return parent, name


def stripes_dir(path: str) -> str:
    """The hidden directory holding every version's stripes of ``path``."""
    parent, name = split_path(path)
    hidden = f".{name}.stripes"
    return f"{parent}/{hidden}" if parent or path.startswith("/") else hidden


def version_dir(path: str, version: str) -> str:
    """``dir/.name.stripes/<version>``: ``version`` is 32 hex digits, so the directory is
    always inside ``path``'s own stripes directory (a manifest cannot point elsewhere)."""
    if not isinstance(version, str) or not _VERSION_RE.fullmatch(version):
        raise ValueError(f"{path}: stripe version {version!r} is not 32 lowercase hex digits")
    return f"{stripes_dir(path)}/{version}"


def stripe_path(path: str, version: str, index: int) -> str:
    """The object holding stripe ``index``: derived from the file's own path, the version
    and the index only, never from a name stored in the manifest."""
    if not _is_int(index) or index < 0:
        raise ValueError(f"{path}: stripe index {index!r} is not a non-negative integer")
    return f"{version_dir(path, version)}/{index:08d}"


def is_stripes_dir_name(name: str) -> bool:
    """True for the hidden ``.name.stripes`` entries that listings must not show."""
    return bool(_STRIPES_DIR_RE.match(name))


def owner_of_stripes_dir(name: str) -> str | None:
    m = _STRIPES_DIR_RE.match(name)
    return m.group("name") if m else None


@dataclass
class Manifest:
    """What a reader needs to reassemble one logical file and check every stripe."""

    size: int
    stripe_size: int
    version: str
    checksums: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    #: The file's modification time when one was set (utime, rsync -a, cp -p); otherwise
    #: the time the target gives the manifest object (its commit) is the file's mtime.
    mtime_ns: int | None = None

    @property
    def stripe_count(self) -> int:
        return len(self.checksums)

    def stripe_range(self, index: int) -> tuple[int, int]:
        start = index * self.stripe_size
        return start, min(start + self.stripe_size, self.size)

    def to_bytes(self) -> bytes:
        body: dict[str, object] = {
            "format": 1 if self.mtime_ns is None else 2,
            "size": self.size,
            "stripe_size": self.stripe_size,
            "version": self.version,
            "checksum": CHECKSUM_ALGO,
            "stripes": self.checksums,
            "created": self.created,
        }
        if self.mtime_ns is not None:
            body["mtime_ns"] = self.mtime_ns
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, path: str) -> Manifest:
        """Parse and check a manifest: every declared size and count is checked against the
        others and against the caps before anything is allocated from it.

        A refusal is a :class:`ManifestError` naming ``path`` and the rule it breaks.
        """
        if not data.startswith(MAGIC):
            raise ManifestError(f"{path}: not a striped manifest", path=path)
        if len(data) > MAX_MANIFEST_SIZE:
            raise _refused(
                path, f"the manifest is {len(data)} bytes, over the {MAX_MANIFEST_SIZE}-byte limit"
            )
        try:
            body = json.loads(data[len(MAGIC) :], object_pairs_hook=_no_duplicates)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"{path}: malformed striped manifest ({exc})", path=path) from exc
        if not isinstance(body, dict):
            raise ManifestError(
                f"{path}: malformed striped manifest (not a JSON object)", path=path
            )
        missing = [k for k in _V1_FIELDS if k not in body and k != "created"]
        if missing:
            raise ManifestError(
                f"{path}: malformed striped manifest (missing field(s) {', '.join(missing)})",
                path=path,
            )
        fmt, algo = body["format"], body["checksum"]
        if type(fmt) is not int or fmt not in FORMATS or algo != CHECKSUM_ALGO:
            raise ManifestError(
                f"{path}: striped manifest format {fmt!r}/{algo!r} is not supported by this "
                f"bootseer (reads {'/'.join(map(str, FORMATS))} with {CHECKSUM_ALGO}); "
                "upgrade bootseer",
                path=path,
            )
        if fmt == 2 and "mtime_ns" not in body:
            raise _refused(path, "format 2 is format 1 with an mtime_ns, which is missing")
        unknown = sorted(set(body) - set(_FIELDS[fmt]))
        if unknown:
            # Stripe names, offsets and lengths are derived, never read from the manifest: a
            # field this reader does not know could only be meant to change what it reads.
            raise _refused(
                path,
                f"unknown field(s) {', '.join(map(repr, unknown))} (format "
                f"{fmt} has exactly: {', '.join(_FIELDS[fmt])})",
            )
        size, stripe_size, version = body["size"], body["stripe_size"], body["version"]
        sums, created = body["stripes"], body.get("created", 0.0)
        mtime_ns = body.get("mtime_ns")
        if not _is_int(size) or not 0 <= size <= MAX_FILE_SIZE:
            raise _refused(path, f"size {size!r} must be an integer from 0 to {MAX_FILE_SIZE}")
        if not _is_int(stripe_size) or not 1 <= stripe_size <= MAX_STRIPE_SIZE:
            raise _refused(
                path, f"stripe_size {stripe_size!r} must be an integer from 1 to {MAX_STRIPE_SIZE}"
            )
        if not isinstance(version, str) or not _VERSION_RE.fullmatch(version):
            raise _refused(
                path,
                f"version {version!r} must be 32 lowercase hex digits (it "
                "names the directory of this file's stripes)",
            )
        if not isinstance(sums, list):
            raise _refused(path, f"stripes must be a list of checksums, not {type(sums).__name__}")
        expected = -(-size // stripe_size)
        if expected > MAX_STRIPES:
            raise _refused(
                path,
                f"declares {size} bytes in {stripe_size}-byte stripes, "
                f"{expected} stripes: over the limit of {MAX_STRIPES}",
            )
        if len(sums) != expected:
            raise _refused(
                path,
                f"declares {size} bytes in {stripe_size}-byte stripes "
                f"({expected} stripes) but lists {len(sums)} checksums",
            )
        bad = next(
            (i for i, c in enumerate(sums) if not _is_int(c) or not 0 <= c <= 0xFFFFFFFF), None
        )
        if bad is not None:
            raise _refused(
                path,
                f"checksum of stripe {bad} ({sums[bad]!r}) must be a crc32, "
                "an integer from 0 to 4294967295",
            )
        if (
            not isinstance(created, int | float)
            or isinstance(created, bool)
            or not math.isfinite(created)
        ):
            raise _refused(path, f"created {created!r} must be a finite number (seconds)")
        if fmt == 2 and (not _is_int(mtime_ns) or not MIN_MTIME_NS <= mtime_ns <= MAX_MTIME_NS):
            raise _refused(
                path,
                f"mtime_ns {mtime_ns!r} must be an integer (nanoseconds since "
                f"the epoch) from {MIN_MTIME_NS} to {MAX_MTIME_NS}",
            )
        return cls(
            size=size,
            stripe_size=stripe_size,
            version=version,
            checksums=sums,
            created=float(created),
            mtime_ns=mtime_ns,
        )


_V1_FIELDS = ("format", "size", "stripe_size", "version", "checksum", "stripes", "created")
#: The fields each format has, exactly ("created" may be left out).
_FIELDS = {1: _V1_FIELDS, 2: (*_V1_FIELDS, "mtime_ns")}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are unique: a key given twice could be read either way."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"field {key!r} appears twice")
        out[key] = value
    return out


def _refused(path: str, rule: str) -> ManifestError:
    return ManifestError(f"{path}: striped manifest refused: {rule}", path=path)
