"""A canary directory for attack tests: what lies outside the target must not change.

An attack test plants a canary tree beside (never inside) the target, points the crafted
input at it (a symlink member aimed at it, a deletion through a link into it, ...), runs the
operation, then asserts that the tree is exactly as it was: every path's type, mode, size,
link target and content hash. A tree that changed fails with the paths that differ.

    canary = Canary.plant(tmp_path / "canary")
    ... run the attack, expect the refusal ...
    canary.assert_unchanged()
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

# what a canary tree holds: a file an attack would truncate, a nested one it would delete,
# a directory tree it would remove, and a symlink it would follow
_FILES = {
    "victim.txt": b"canary: must never be truncated, overwritten or deleted\n",
    "env.json": b'{"canary": true}\n',
    "tree/deep/keep.bin": bytes(range(256)) * 16,
    "tree/other.txt": b"second canary file\n",
}


def _fingerprint(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (and ``root`` itself) by lstat and content, never following
    a link."""
    seen: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [".", *dirnames, *filenames]:
            path = Path(dirpath) / name if name != "." else Path(dirpath)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            detail: object = None
            if stat.S_ISREG(st.st_mode):
                detail = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                detail = os.readlink(path)
            seen[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_size, st.st_nlink, detail)
    return seen


@dataclass
class Canary:
    """A planted tree and its fingerprint at planting time."""

    root: Path
    before: dict[str, tuple] = field(default_factory=dict)

    @classmethod
    def plant(cls, root: Path) -> Canary:
        root.mkdir(parents=True, exist_ok=True)
        for rel, data in _FILES.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return cls(root, _fingerprint(root))

    @property
    def victim(self) -> Path:
        """A regular file an attack aims at."""
        return self.root / "victim.txt"

    @property
    def tree(self) -> Path:
        """A directory tree an attack aims at."""
        return self.root / "tree"

    def changes(self) -> list[str]:
        """The paths that differ from planting time (added, removed or changed)."""
        after = _fingerprint(self.root) if self.root.exists() else {}
        paths = sorted(set(self.before) | set(after))
        return [p for p in paths if self.before.get(p) != after.get(p)]

    def assert_unchanged(self) -> None:
        changed = self.changes()
        assert not changed, f"the canary outside the target changed: {changed}"
