"""bootseer: fast, safe restarts for large PyTorch training jobs."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Training code calls ``bootseer.ready()``, ``bootseer.heartbeat(step)`` and
# ``bootseer.finishing()``; they live in
# bootseer.client, imported on first use so that ``import bootseer`` stays cheap.
_LAZY = {"ready", "heartbeat", "finishing"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'bootseer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
