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

# the layout, read by tools that never load a step (``bootseer ckpt ls``/``verify``)
from .layout import MANIFEST, Manifest, committed_steps, element_size, step_dir

# the node agent's side of the memory tier: torch-free, like the NaN skip rules it hands on
from .memory_env import check_memory_settings, memory_handoff
from .skip import SKIP_ENV, SkipRule, to_env

_LAZY = {
    "CheckpointView": "loader",
    "LoadReport": "loader",
    "CheckpointInfo": "manager",
    "CheckpointManager": "manager",
    "SaveHandle": "manager",
    "VerifyReport": "manager",
    "init_optimizer_state": "optim",
    "SaveResult": "persist",
    "FlatShard": "tensors",
    "PerRank": "tensors",
    "bootseer_to_dcp": "dcp",
    "dcp_to_bootseer": "dcp",
    "PeerServer": "memory_peer",  # numpy, cryptography
    "verify_copies": "memory_verify",  # numpy, xxhash
}

if TYPE_CHECKING:
    from .dcp import bootseer_to_dcp, dcp_to_bootseer
    from .loader import CheckpointView, LoadReport
    from .manager import CheckpointInfo, CheckpointManager, SaveHandle, VerifyReport
    from .memory_peer import PeerServer
    from .memory_verify import verify_copies
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
    "MANIFEST",
    "SKIP_ENV",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointSaveError",
    "CheckpointStoreUnavailable",
    "CheckpointView",
    "FlatShard",
    "LoadReport",
    "Manifest",
    "PeerServer",
    "PerRank",
    "PrefetchResult",
    "SaveHandle",
    "SaveResult",
    "SkipRule",
    "StateMismatchError",
    "VerifyReport",
    "bootseer_to_dcp",
    "cache_dir_from_env",
    "check_memory_settings",
    "committed_steps",
    "dcp_to_bootseer",
    "element_size",
    "held_step",
    "init_optimizer_state",
    "memory_handoff",
    "prefetch_latest",
    "step_dir",
    "to_env",
    "verify_copies",
]
