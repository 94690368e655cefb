"""striped_fs: parallel striped reads and writes over any fsspec filesystem.

    import fsspec
    with fsspec.open("striped::s3://bucket/data.bin", "rb", s3={...}) as f:
        data = f.read()

See docs/striped_fs.md for the layout, the options and their defaults.
"""

from typing import TYPE_CHECKING, Any

from .config import DEFAULT_CONCURRENCY, DEFAULT_STRIPE_SIZE, OptionError, StripeOptions, parse_size
from .errors import (
    ManifestError,
    MountError,
    MountTimeout,
    ShortReadError,
    StripeChecksumError,
    StripedError,
    StripedIOError,
    UnsafePath,
)
from .filesystem import StripedFileSystem
from .private import create_private, make_dir, write_private

#: The FUSE helpers, imported on first use (``striped_fs.fuse`` loads libfuse through fusepy,
#: which a process that only reads or writes a store should not pay for).
_FUSE_EXPORTS = frozenset({"is_mounted", "run_fuse", "unmount", "wait_mounted"})


if TYPE_CHECKING:  # what the names are, for type checkers (imported lazily below)
    from .fuse import is_mounted, run_fuse, unmount, wait_mounted


def __getattr__(name: str) -> Any:
    if name in _FUSE_EXPORTS:
        from . import fuse

        return getattr(fuse, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_STRIPE_SIZE",
    "ManifestError",
    "MountError",
    "MountTimeout",
    "OptionError",
    "ShortReadError",
    "StripeChecksumError",
    "StripeOptions",
    "StripedError",
    "StripedFileSystem",
    "StripedIOError",
    "UnsafePath",
    "create_private",
    "is_mounted",
    "make_dir",
    "parse_size",
    "run_fuse",
    "unmount",
    "wait_mounted",
    "write_private",
]
