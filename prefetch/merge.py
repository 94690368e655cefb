"""The merged root filesystem of an image: its layers' TOCs stacked the OCI way.

One merged view instead of one FUSE mount per layer under kernel overlayfs: a single FUSE
process knows, for every path, which layer and which frames hold it, so a read goes straight
to the right frames (and is recorded once, for the profile), there is one mount to clean up,
and it works where overlayfs over FUSE is unavailable (unprivileged containers, older
kernels). The OCI rules (image-spec, "Applying changesets"):

* whiteouts apply to lower layers only: ``dir/.wh.name`` hides ``dir/name`` and everything
  under it; ``dir/.wh..wh..opq`` hides every lower entry inside ``dir``;
* an entry replaces what a lower layer had at its path; a directory over a directory keeps
  the lower children and takes the upper metadata;
* a hardlink names a path already present (in this layer or a lower one) and shares its
  content (and inode number);
* parents a layer does not list exist as directories.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"

_TYPE_BITS = {"reg": stat.S_IFREG, "hardlink": stat.S_IFREG, "dir": stat.S_IFDIR,
              "symlink": stat.S_IFLNK, "char": stat.S_IFCHR, "block": stat.S_IFBLK,
              "fifo": stat.S_IFIFO}


class MergeError(ValueError):
    """A layer cannot be applied (a hardlink to nothing, a path under a non-directory)."""


@dataclass(eq=False)
class Node:
    """One path of the merged tree. ``entry`` is the TOC entry (None for an implied
    directory); ``layer`` the index of the layer that provides it (and its bytes)."""

    name: str
    entry: Any
    layer: int
    ino: int
    children: dict[str, Node] | None = None
    nlink: int = 1
    content: Node | None = None  # for a hardlink: the node holding the bytes
    opaque: bool = False  # overlay presentation: hides every lower entry inside this dir

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def data(self) -> Node:
        """The node whose entry and layer hold this file's bytes."""
        return self.content or self

    def mode(self) -> int:
        entry = self.data.entry
        if entry is None:
            return stat.S_IFDIR | 0o755
        return _TYPE_BITS[entry.type] | (int(entry.mode) & 0o7777)


@dataclass
class MergedTree:
    root: Node
    inodes: dict[int, Node] = field(default_factory=dict)

    def lookup(self, path: str) -> Node | None:
        node = self.root
        for part in _parts(path):
            if node.children is None:
                return None
            child = node.children.get(part)
            if child is None:
                return None
            node = child
        return node

    def walk(self) -> Iterator[tuple[str, Node]]:
        """(path, node) for every node, parents first, children sorted."""
        stack: list[tuple[str, Node]] = [("", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if node.children:
                for name in sorted(node.children, reverse=True):
                    stack.append((f"{path}/{name}" if path else name, node.children[name]))


def _parts(path: str) -> list[str]:
    return [p for p in path.strip("/").split("/") if p and p != "."]


@dataclass(frozen=True)
class _Whiteout:
    """An overlayfs whiteout (a 0:0 character device) standing for an OCI ``.wh.`` file."""

    name: str
    type: str = "char"
    mode: int = 0
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime_ns: int = 0
    link: str = ""
    devmajor: int = 0
    devminor: int = 0


def merge_layers(layers: Iterable[Iterable[Any]], *, overlay: bool = False) -> MergedTree:
    """Stack TOC entries (``name``, ``type``, ``link``, ``mode``...) of layers, lowest
    first, into one tree.

    ``overlay=True`` builds a tree meant to be one lowerdir of a kernel overlayfs above
    layers it does not hold (a containerd snapshot over a normally unpacked layer): deletions
    stay visible the overlayfs way, a whiteout as a 0:0 character device and an opaque
    directory as a node with ``opaque`` set (presented as ``trusted.overlay.opaque=y``)."""
    counter = iter(range(1, 1 << 62))
    root = Node("", None, -1, next(counter), children={})
    tree = MergedTree(root)
    tree.inodes[root.ino] = root
    for index, entries in enumerate(layers):
        entries = list(entries)
        # Whiteouts first: they hide lower layers, never entries of their own layer.
        for entry in entries:
            parts = _parts(entry.name)
            if not parts or not parts[-1].startswith(WHITEOUT):
                continue
            parent = _dir_at(tree, parts[:-1], index, counter, create=overlay)
            if parent is None:
                continue
            if parts[-1] == OPAQUE:
                parent.children.clear()
                parent.opaque = parent.opaque or overlay
            else:
                name = parts[-1][len(WHITEOUT):]
                parent.children.pop(name, None)
                if overlay:
                    node = Node(name, _Whiteout(name), index, next(counter))
                    parent.children[name] = node
                    tree.inodes[node.ino] = node
        for entry in entries:
            parts = _parts(entry.name)
            if not parts:  # the layer's own "./": root metadata
                if entry.type == "dir":
                    root.entry, root.layer = entry, index
                continue
            if parts[-1].startswith(WHITEOUT):
                continue
            parent = _dir_at(tree, parts[:-1], index, counter, create=True)
            assert parent is not None and parent.children is not None
            name = parts[-1]
            existing = parent.children.get(name)
            if entry.type == "dir":
                if existing is not None and existing.is_dir:
                    existing.entry, existing.layer = entry, index
                    continue
                node = Node(name, entry, index, next(counter), children={},
                            opaque=_is_whiteout(existing))
            elif entry.type == "hardlink":
                target = tree.lookup(entry.link)
                if target is None or target.is_dir:
                    raise MergeError(f"layer {index}: hardlink {entry.name} -> "
                                     f"{entry.link}: no such file in this or a lower layer")
                data = target.data
                data.nlink += 1
                node = Node(name, entry, index, data.ino, content=data)
            else:
                node = Node(name, entry, index, next(counter))
            parent.children[name] = node
            tree.inodes.setdefault(node.ino, node)
    return tree


def _dir_at(tree: MergedTree, parts: list[str], layer: int, counter: Iterator[int],
            *, create: bool) -> Node | None:
    node = tree.root
    for part in parts:
        assert node.children is not None
        child = node.children.get(part)
        if child is None or not child.is_dir:
            if not create:
                return None
            # Over a whiteout (overlay trees only) the new directory must hide the lower one.
            child = Node(part, None, layer, next(counter), children={},
                         opaque=_is_whiteout(child))
            node.children[part] = child
            tree.inodes[child.ino] = child
        node = child
    return node


def _is_whiteout(node: Node | None) -> bool:
    return node is not None and isinstance(node.entry, _Whiteout)
