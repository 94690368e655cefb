"""ckpt: sharded asynchronous checkpoints with atomic commit, integrity and resharding.

See docs/ckpt.md. The entry point is :class:`CheckpointManager`.
"""

from .cache import PrefetchResult, cache_dir_from_env, prefetch_latest
from .errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointSaveError,
    CheckpointStoreUnavailable,
    StateMismatchError,
)
from .loader import LoadReport
from .manager import CheckpointInfo, CheckpointManager, SaveHandle, VerifyReport
from .optim import init_optimizer_state
from .persist import SaveResult
from .tensors import FlatShard, PerRank

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointSaveError",
    "CheckpointStoreUnavailable",
    "FlatShard",
    "LoadReport",
    "PerRank",
    "PrefetchResult",
    "SaveHandle",
    "SaveResult",
    "StateMismatchError",
    "VerifyReport",
    "cache_dir_from_env",
    "init_optimizer_state",
    "prefetch_latest",
]
