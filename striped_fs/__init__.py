"""striped_fs: parallel striped reads and writes over any fsspec filesystem.

    import fsspec
    with fsspec.open("striped::s3://bucket/data.bin", "rb", s3={...}) as f:
        data = f.read()

See docs/striped_fs.md for the layout, the options and their defaults.
"""

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

# the FUSE plumbing: never loads fusepy (a process that only reads a store or waits for a
# mount does not pay for libfuse); striped_fs.fuse serves mounts
from .mount import (
    canonical_path,
    is_mounted,
    load_fusepy,
    run_fuse,
    unescape_mountinfo,
    unmount,
    wait_mounted,
)
from .private import create_private, make_dir, pid_exists, write_private

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
    "canonical_path",
    "create_private",
    "is_mounted",
    "load_fusepy",
    "make_dir",
    "parse_size",
    "pid_exists",
    "run_fuse",
    "unescape_mountinfo",
    "unmount",
    "wait_mounted",
    "write_private",
]
