"""striped_fs: parallel striped reads and writes over any fsspec filesystem.

    import fsspec
    with fsspec.open("striped::s3://bucket/data.bin", "rb", s3={...}) as f:
        data = f.read()

See docs/striped_fs.md for the layout, the options and their defaults.
"""

from .backend import RetryPolicy, is_transient
from .cancel import CancelToken, ReadCancelled
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
from .mirror import check_mirror_url

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
from .privdir import TRACE_WHAT, PrivateDir, open_append, open_owned, owned_file
from .reader import StripedSource, fetch_piece_set, fetch_pieces

# ``redact`` the function shares its module's name: bound here, once, ``striped_fs.redact`` is
# the function whatever is imported later (the module stays ``sys.modules["striped_fs.redact"]``,
# so ``from striped_fs.redact import ...`` inside striped_fs still works)
from .redact import (
    install_log_redaction,
    protect_process,
    redact,
    redact_options,
    redact_text,
    register_options,
    register_secret,
)
from .urls import split_credentials, to_striped_url, url_to_fs

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_STRIPE_SIZE",
    "TRACE_WHAT",
    "CancelToken",
    "ManifestError",
    "MountError",
    "MountTimeout",
    "OptionError",
    "PrivateDir",
    "ReadCancelled",
    "RetryPolicy",
    "ShortReadError",
    "StripeChecksumError",
    "StripeOptions",
    "StripedError",
    "StripedFileSystem",
    "StripedIOError",
    "StripedSource",
    "UnsafePath",
    "canonical_path",
    "check_mirror_url",
    "create_private",
    "fetch_piece_set",
    "fetch_pieces",
    "install_log_redaction",
    "is_mounted",
    "is_transient",
    "load_fusepy",
    "make_dir",
    "open_append",
    "open_owned",
    "owned_file",
    "parse_size",
    "pid_exists",
    "protect_process",
    "redact",
    "redact_options",
    "redact_text",
    "register_options",
    "register_secret",
    "run_fuse",
    "split_credentials",
    "to_striped_url",
    "unescape_mountinfo",
    "unmount",
    "url_to_fs",
    "wait_mounted",
    "write_private",
]
