"""ckpt: sharded asynchronous checkpoints with atomic commit, integrity and resharding.

See docs/ckpt.md. The entry point is :class:`CheckpointManager`.

The names that need torch are imported on first use: ``bootseer run`` prefetches a checkpoint
(``prefetch_latest``) in a container whose torch is still being restored.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .cache import PrefetchResult, cache_dir_from_env, held_step, prefetch_latest
from .errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointSaveError,
    CheckpointStoreUnavailable,
    StateMismatchError,
)

# the node agent's side of the memory tier: torch-free
from .memory_env import check_memory_settings, memory_handoff

_LAZY = {
    "LoadReport": "loader",
    "CheckpointInfo": "manager",
    "CheckpointManager": "manager",
    "SaveHandle": "manager",
    "VerifyReport": "manager",
    "init_optimizer_state": "optim",
    "SaveResult": "persist",
    "FlatShard": "tensors",
    "PerRank": "tensors",
}

if TYPE_CHECKING:
    from .loader import LoadReport
    from .manager import CheckpointInfo, CheckpointManager, SaveHandle, VerifyReport
    from .optim import init_optimizer_state
    from .persist import SaveResult
    from .tensors import FlatShard, PerRank


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


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
    "check_memory_settings",
    "held_step",
    "init_optimizer_state",
    "memory_handoff",
    "prefetch_latest",
]
