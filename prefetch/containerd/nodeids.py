"""Stable FUSE node ids for one lazy view, computed from the view's id and a path alone.

The kernel names every file it looked up by its node id and keeps using that id (an open
file, a mapped page, a cached dentry) across a restart of the process serving the mount. A
successor must therefore map an id it never handed out back to its file, without any state
passed on: ``id = view id << 40 | a 40-bit hash of the path``. Two paths of a view whose
hashes collide are told apart the same way by every process: the paths of the colliding
group, sorted, after the first take the next free values in turn, free among the hashes of
every path of the view (the tree is complete before its first id is handed out). The ids
depend on the path set only, not on how a version of the code numbers its tree's inodes, so
an upgrade keeps them.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable

VIEW_SHIFT = 40
MAX_VIEW = (1 << (64 - VIEW_SHIFT)) - 1
_MASK = (1 << VIEW_SHIFT) - 1


def _hash(path: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=5).digest(), "little"
    )


class ViewNodeIds:
    """The node ids of view ``view_id``, whose paths ``paths()`` lists (``/`` first)."""

    def __init__(self, view_id: int, paths: Callable[[], Iterable[str]]) -> None:
        if not 0 < view_id <= MAX_VIEW:
            raise ValueError(f"view id {view_id} is beyond the node id space (1..{MAX_VIEW})")
        self.view_id = view_id
        self._base = view_id << VIEW_SHIFT
        self._paths = paths
        self._moved = self._resolve_collisions()
        self._reverse: dict[int, str] | None = None
        self._lock = threading.Lock()

    def _resolve_collisions(self) -> dict[str, int]:
        seen: set[int] = set()
        clashes: set[int] = set()
        for path in self._paths():
            h = _hash(path)
            (clashes if h in seen else seen).add(h)
        if not clashes:
            return {}
        groups: dict[int, set[str]] = {}
        for path in self._paths():
            h = _hash(path)
            if h in clashes:
                groups.setdefault(h, set()).add(path)
        moved: dict[str, int] = {}
        for h in sorted(groups):
            for path in sorted(groups[h])[1:]:
                probe = h
                while probe in seen:
                    probe = (probe + 1) & _MASK
                seen.add(probe)
                moved[path] = probe
        return moved

    def nodeid(self, path: str) -> int:
        h = self._moved.get(path)
        return self._base | (_hash(path) if h is None else h)

    def path_of(self, nodeid: int) -> str | None:
        """The path of an id of this view (the reverse table is built on first use: only a
        successor needs it, for ids its predecessor handed out)."""
        with self._lock:
            if self._reverse is None:
                self._reverse = {self.nodeid(p): p for p in self._paths()}
            return self._reverse.get(nodeid)


def view_of(nodeid: int) -> int:
    return nodeid >> VIEW_SHIFT
