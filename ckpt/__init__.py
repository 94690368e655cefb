"""ckpt: sharded asynchronous checkpoints with atomic commit, integrity and resharding.

See docs/ckpt.md. The entry point is :class:`CheckpointManager`.
"""

from .errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointSaveError,
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
    "FlatShard",
    "LoadReport",
    "PerRank",
    "SaveHandle",
    "SaveResult",
    "StateMismatchError",
    "VerifyReport",
    "init_optimizer_state",
]
