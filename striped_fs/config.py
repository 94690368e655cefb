"""Striping options: defaults, parsing and validation.

The defaults come from the sweep in ``benchmarks/bench_striped.py`` (see docs/benchmarks.md):
8 MiB stripes are large enough that per-request cost (latency, request parsing, a Python
round trip) is a few percent of the transfer even on a slow link, and small enough that
16 streams in flight hold only 128 MiB.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import OptionError

MiB = 1 << 20

DEFAULT_STRIPE_SIZE = 8 * MiB
DEFAULT_CONCURRENCY = 16
DEFAULT_RETRIES = 5
DEFAULT_BACKOFF_S = 0.1
DEFAULT_BACKOFF_CAP_S = 2.0
#: Seconds a mirror may take to accept a connection, and to send each next byte, before the
#: read goes to the origin (an idle timeout: a slow but moving transfer is not cut short).
DEFAULT_MIRROR_TIMEOUT_S = 5.0

MIN_STRIPE_SIZE = 4096
MAX_STRIPE_SIZE = 1 << 30
MAX_CONCURRENCY = 1024

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Parse ``8388608``, ``"8MiB"``, ``"8M"`` or ``"512k"`` into bytes (binary units)."""
    if isinstance(value, bool):
        raise OptionError(f"striped_fs option {name!r}={value!r}: expected a byte count")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise OptionError(
        f"striped_fs option {name!r}={value!r}: expected bytes as an integer or a size "
        "such as '8MiB', '512KiB' or '1G'"
    )


@dataclass(frozen=True)
class StripeOptions:
    """How a striped read or write is cut and how many streams run at once.

    ``readahead`` is how many stripes a sequential reader keeps in flight or buffered
    ahead of the position; memory per open reader is about ``(readahead + 1) * stripe_size``.
    ``None`` means "same as concurrency".

    ``mirror`` (a filesystem's, not a call's): the base URL of a read-only HTTP cache of the
    store (``http://10.0.0.5:9000``) that stripe reads try first; '' = none. See
    :mod:`striped_fs.mirror`.
    """

    stripe_size: int = DEFAULT_STRIPE_SIZE
    concurrency: int = DEFAULT_CONCURRENCY
    readahead: int | None = None
    retries: int = DEFAULT_RETRIES
    backoff_s: float = DEFAULT_BACKOFF_S
    backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S
    fsync: bool = True
    direct_io: bool = True
    mirror: str = ""
    mirror_timeout_s: float = DEFAULT_MIRROR_TIMEOUT_S

    def __post_init__(self) -> None:
        if not MIN_STRIPE_SIZE <= self.stripe_size <= MAX_STRIPE_SIZE:
            raise OptionError(
                f"striped_fs option 'stripe_size'={self.stripe_size}: must be between "
                f"{MIN_STRIPE_SIZE} bytes and 1 GiB"
            )
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise OptionError(
                f"striped_fs option 'concurrency'={self.concurrency}: must be 1..{MAX_CONCURRENCY}"
            )
        if self.readahead is not None and not 0 <= self.readahead <= MAX_CONCURRENCY:
            raise OptionError(
                f"striped_fs option 'readahead'={self.readahead}: must be 0..{MAX_CONCURRENCY}"
            )
        if self.retries < 0:
            raise OptionError(f"striped_fs option 'retries'={self.retries}: must be >= 0")
        from .mirror import check_mirror_url  # here: mirror.py imports this module

        object.__setattr__(self, "mirror", check_mirror_url(self.mirror))
        if not self.mirror_timeout_s > 0:
            raise OptionError(
                f"striped_fs option 'mirror_timeout_s'={self.mirror_timeout_s}: must be > 0"
            )

    @property
    def window(self) -> int:
        """Stripes kept in flight ahead of a sequential reader."""
        return max(1, self.concurrency if self.readahead is None else self.readahead)

    def updated(self, **overrides: Any) -> StripeOptions:
        """A copy with per-call overrides applied (``None`` values are ignored)."""
        return replace(self, **_coerce(overrides))

    @classmethod
    def resolve(cls, **options: Any) -> StripeOptions:
        """Defaults, then ``options`` (``None`` values ignored). striped_fs reads no variable:
        what a process sets in its environment reaches these options only through fsspec's
        own configuration (``FSSPEC_STRIPED_STRIPE_SIZE``...), which fsspec passes as
        constructor options, below storage options and per-call arguments."""
        for name, option in RETIRED_ENV.items():
            if os.environ.get(name):
                raise OptionError(
                    f"environment variable {name} is no longer read: set "
                    f"FSSPEC_STRIPED_{option.upper()} (fsspec's default for "
                    f"striped://), or the storage option striped="
                    f"{{{option!r}: ...}}"
                )
        return cls(**_coerce({k: v for k, v in options.items() if v is not None}))


#: Variables earlier versions read -> the option they set. A leftover one is refused rather than
#: silently ignored.
RETIRED_ENV = {"BOOTSEER_STRIPE_SIZE": "stripe_size", "BOOTSEER_STRIPE_CONCURRENCY": "concurrency"}


OPTION_NAMES = frozenset(f.name for f in fields(StripeOptions))
#: Options of a filesystem as a whole (its backend is built with them), never of one call.
FILESYSTEM_OPTIONS = frozenset({"mirror", "mirror_timeout_s"})


def _coerce(values: dict[str, Any]) -> dict[str, Any]:
    """Turn strings from URLs, environment or CLI into typed option values."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        if key not in OPTION_NAMES:
            raise OptionError(
                f"unknown striped_fs option {key!r}; known options: {', '.join(sorted(OPTION_NAMES))}"
            )
        try:
            if key == "stripe_size":
                out[key] = parse_size(value, name=key)
            elif key in ("concurrency", "readahead", "retries"):
                out[key] = int(value)
            elif key in ("backoff_s", "backoff_cap_s", "mirror_timeout_s"):
                out[key] = float(value)
            elif key == "mirror":
                out[key] = value  # checked (and normalized) by StripeOptions itself
            elif key in ("fsync", "direct_io"):
                out[key] = (
                    value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
                )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, OptionError):
                raise
            raise OptionError(f"striped_fs option {key!r}={value!r}: {exc}") from exc
    return out
