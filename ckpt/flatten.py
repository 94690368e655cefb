"""Nested training state <-> flat ``{key: leaf}``.

Dicts and lists are walked; everything else is a leaf (tensors, DTensors, FlatShards,
PerRank values, and plain Python objects). Keys are path components joined by ``/``, with
``%`` and ``/`` inside a component escaped, so any dict key round-trips.

Keys alone do not say whether a level was a list or a dict keyed by integers (an
optimizer's ``state`` is ``{0: ..., 1: ...}``): :func:`container_kinds` records those
levels at save time, and :func:`unflatten` rebuilds them exactly from that record.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

LIST, INT_KEYS = "list", "int"
KINDS = (LIST, INT_KEYS)


def _escape(part: Any) -> str:
    return str(part).replace("%", "%25").replace("/", "%2F")


def _unescape(part: str) -> str:
    return part.replace("%2F", "/").replace("%25", "%")


def join_key(parts: tuple[Any, ...]) -> str:
    return "/".join(_escape(p) for p in parts)


def walk(state: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield ``(key, leaf, container, slot)`` for every leaf, so a loader can replace it."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list):
        items = enumerate(state)
    else:
        raise TypeError(
            f"checkpoint state must be a dict or list at the top, got {type(state).__name__}"
        )
    for slot, value in items:
        path = (*prefix, slot)
        if isinstance(value, dict | list) and value:
            yield from walk(value, path)
        else:
            yield join_key(path), value, state, slot


def flatten(state: Any) -> dict[str, Any]:
    return {key: leaf for key, leaf, _, _ in walk(state)}


def container_kinds(state: Any) -> dict[str, str]:
    """``{container key: "list" | "int"}`` for every level of ``state`` that :func:`walk`
    descends into and that is not a dict keyed by strings (``""`` is the top level)."""
    kinds: dict[str, str] = {}

    def visit(node: Any, prefix: tuple[Any, ...]) -> None:
        if isinstance(node, list):
            kinds[join_key(prefix)] = LIST
            items: Any = enumerate(node)
        else:
            if node and all(type(k) is int for k in node):
                kinds[join_key(prefix)] = INT_KEYS
            items = node.items()
        for slot, value in items:
            if isinstance(value, dict | list) and value:
                visit(value, (*prefix, slot))

    if isinstance(state, dict | list):
        visit(state, ())
    return kinds


class _Level(dict):
    """A level rebuilt from keys (a leaf that happens to be a dict is not one)."""


def unflatten(flat: dict[str, Any], kinds: dict[str, str] | None = None) -> Any:
    """Rebuild nested state from flat keys.

    With ``kinds`` (what :func:`container_kinds` recorded) every level comes back as it
    was: lists as lists, integer dict keys as integers, everything else a dict keyed by
    strings. Without it (checkpoints older than that record) a level whose keys are all
    integers becomes a list when they are 0..n-1 and an int-keyed dict otherwise.
    Raises ``ValueError`` when ``kinds`` contradicts the keys."""
    root = _Level()
    for key, value in flat.items():
        parts = key.split("/")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, _Level())
            if not isinstance(node, _Level):
                raise ValueError(f"key {key!r} nests under a value, not a container")
        if isinstance(node.get(parts[-1]), _Level):
            raise ValueError(f"key {key!r} is both a value and a container")
        node[parts[-1]] = value
    if kinds is None:
        return _listify(root)
    return _rebuild(root, "", kinds)


def _rebuild(level: _Level, path: str, kinds: dict[str, str]) -> Any:
    items = {
        part: _rebuild(value, f"{path}/{part}" if path else part, kinds)
        if isinstance(value, _Level)
        else value
        for part, value in level.items()
    }
    names = {part: _unescape(part) for part in items}
    kind = kinds.get(path)
    where = f"level {_unescape(path)!r}" if path else "the top level"
    if kind == LIST:
        order = sorted(items, key=lambda p: int(names[p]) if names[p].isdigit() else -1)
        if [names[p] for p in order] != [str(i) for i in range(len(items))]:
            raise ValueError(
                f"{where} is recorded as a list but its keys are "
                f"{sorted(names.values())[:5]} (rule: a list holds items 0..n-1)"
            )
        return [items[p] for p in order]
    if kind == INT_KEYS:
        out: dict[Any, Any] = {}
        for part, value in items.items():
            name = names[part]
            try:
                number = int(name)
            except ValueError:
                number = None
            if number is None or str(number) != name:
                raise ValueError(
                    f"{where} is recorded as keyed by integers but holds key "
                    f"{name!r} (rule: integer keys)"
                )
            out[number] = value
        return out
    return {names[p]: v for p, v in items.items()}


def _listify(node: Any) -> Any:
    if not isinstance(node, _Level):
        return node
    out = {_unescape(k): _listify(v) for k, v in node.items()}
    if out and all(k.isdigit() for k in out):
        keys = sorted(out, key=int)
        if [int(k) for k in keys] == list(range(len(keys))):
            return [out[k] for k in keys]
        return {int(k): out[k] for k in keys}
    return out


# -- DCP's keys ------------------------------------------------------------------------------


def flatten_like_dcp(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(flat, mapping)``: ``state`` keyed by DCP FQNs, the same tensor objects as leaves.

    ``CheckpointManager.load`` does this itself for a checkpoint converted from DCP; it is
    public for code that wants DCP's keys (``unflatten_like_dcp`` reverses it)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)


def unflatten_like_dcp(flat: dict[str, Any], mapping: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten_like_dcp` (a new nested dict)."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict(flat, mapping)


def dcp_slots(state: Any) -> dict[str, tuple[Any, Any]]:
    """``{DCP FQN: (container, slot)}``: where each of DCP's flat values lives in ``state``,
    so a value loaded under its FQN is put back in place (integer dict keys included,
    which DCP's paths spell as strings)."""
    if not isinstance(state, Mapping):
        raise TypeError(
            "a checkpoint converted from DCP loads into a dict (DCP's state is "
            f"keyed by names), got {type(state).__name__}"
        )
    _, mapping = flatten_like_dcp(state)  # type: ignore[arg-type]
    slots = {}
    for fqn, path in mapping.items():
        node: Any = state
        for part in path[:-1]:
            node = node[_slot(node, part)]
        slots[fqn] = (node, _slot(node, path[-1]))
    return slots


def _slot(node: Any, part: Any) -> Any:
    if isinstance(node, Mapping) and part not in node:
        return next(k for k in node if str(k) == part)
    return part
