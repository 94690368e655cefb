"""snapshot: dependency environments installed once, snapshotted, restored everywhere.

    from snapshot import ensure
    result = ensure(["requirements.txt"], prefix="/opt/venv", store="s3://bucket/envs")
    result.outcome   # "verified" | "restored" | "built" | "installed-locally"

See docs/snapshot.md.
"""

from typing import TYPE_CHECKING, Any

FORMAT_VERSION = 1
"""Version of the snapshot format (tar stream cut into zstd chunks + manifest); part of the key."""

# Imported eagerly, below the constant (the submodules import it from here): the functions
# ``ensure`` and ``restore`` share their modules' names, and binding them here, once, keeps
# ``snapshot.ensure`` the function whatever is imported later.
from .capture import ensure_capture  # noqa: E402
from .ensure import (  # noqa: E402
    EnsureResult,
    PublishResult,
    clear_interrupted_install,
    create,
    ensure,
    prefix_lock,
    publish,
)
from .errors import (  # noqa: E402
    CorruptSnapshotError,
    InstallError,
    RelocationError,
    SnapshotError,
    SnapshotNotFound,
    StoreUnavailable,
    UnsafeMemberError,
)
from .key import EnvKey, compute_key, parse_extras  # noqa: E402
from .restore import RestoreResult, VerifyResult, mark_damaged, restore, verify  # noqa: E402
from .store import SnapshotStore  # noqa: E402

#: Lazy environments (:mod:`snapshot.lazy`), imported on first use: they load libfuse.
_LAZY_EXPORTS = frozenset({"LazyMount", "mount_lazy", "mounted_key", "serve_lazy", "unmount_lazy"})


if TYPE_CHECKING:  # what the names are, for type checkers (imported lazily below)
    from .lazy import LazyMount, mount_lazy, mounted_key, serve_lazy, unmount_lazy


def __getattr__(name: str) -> Any:
    if name in _LAZY_EXPORTS:
        from . import lazy

        return getattr(lazy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "CorruptSnapshotError",
    "EnsureResult",
    "EnvKey",
    "InstallError",
    "LazyMount",
    "PublishResult",
    "RelocationError",
    "RestoreResult",
    "SnapshotError",
    "SnapshotNotFound",
    "SnapshotStore",
    "StoreUnavailable",
    "UnsafeMemberError",
    "VerifyResult",
    "clear_interrupted_install",
    "compute_key",
    "create",
    "ensure",
    "ensure_capture",
    "mark_damaged",
    "mount_lazy",
    "mounted_key",
    "parse_extras",
    "prefix_lock",
    "publish",
    "restore",
    "serve_lazy",
    "unmount_lazy",
    "verify",
]
