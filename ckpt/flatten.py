"""Nested training state <-> flat ``{key: leaf}``.

Dicts and lists are walked; everything else is a leaf (tensors, DTensors, FlatShards,
PerRank values, and plain Python objects). Keys are path components joined by ``/``, with
``%`` and ``/`` inside a component escaped, so any dict key round-trips.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def _escape(part: Any) -> str:
    return str(part).replace("%", "%25").replace("/", "%2F")


def join_key(parts: tuple[Any, ...]) -> str:
    return "/".join(_escape(p) for p in parts)


def walk(state: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield ``(key, leaf, container, slot)`` for every leaf, so a loader can replace it."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list):
        items = enumerate(state)
    else:
        raise TypeError(f"checkpoint state must be a dict or list at the top, got {type(state).__name__}")
    for slot, value in items:
        path = (*prefix, slot)
        if isinstance(value, dict | list) and value:
            yield from walk(value, path)
        else:
            yield join_key(path), value, state, slot


def flatten(state: Any) -> dict[str, Any]:
    return {key: leaf for key, leaf, _, _ in walk(state)}


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Rebuild nested dicts from flat keys (lists come back as dicts keyed by index strings
    turned into ints where every key of a level is an integer)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        parts = [p.replace("%2F", "/").replace("%25", "%") for p in key.split("/")]
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _listify(root)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _listify(v) for k, v in node.items()}
    if out and all(k.isdigit() for k in out):
        keys = sorted(out, key=int)
        if [int(k) for k in keys] == list(range(len(keys))):
            return [out[k] for k in keys]
        return {int(k): out[k] for k in keys}
    return out
