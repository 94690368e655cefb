"""The merged root filesystem of an image: its layers' TOCs stacked the OCI way.

One merged view instead of one FUSE mount per layer under kernel overlayfs: a single FUSE
process knows, for every path, which layer and which frames hold it, so a read goes straight
to the right frames (and is recorded once, for the profile), there is one mount to clean up,
and it works where overlayfs over FUSE is unavailable (unprivileged containers, older
kernels). The OCI rules (image-spec, "Applying changesets"), as containerd's overlayfs
snapshotter (the one Kubernetes runs) applies them, each layer into its own directory:

* whiteouts apply to lower layers only: ``dir/.wh.name`` hides ``dir/name`` and everything
  under it; ``dir/.wh..wh..opq`` hides every lower entry inside ``dir``;
* an entry replaces what a lower layer had at its path; a directory over a directory keeps
  the lower children and takes the upper metadata;
* a hardlink names a path already present (in this layer or a lower one) and shares its
  content (and inode number); a symlink is its own inode, so a hardlink to one is a symlink;
  the inode takes the mode, owner, mtime and xattrs of the last header naming it (containerd
  applies each hardlink's header to the inode it links);
* parents a layer does not list exist as directories (0755, owned by root, unless a lower
  layer has the directory: then it is that one);
* a symlink that the *same* layer put on a member's parent path is followed (inside the
  image: an absolute target starts at the root, ``..`` stops there), for the member's own
  path and for a hardlink's target; a symlink of a lower layer is not (containerd creates
  the directory in the layer's own directory, which hides the link);
* the image's root directory is containerd's (0755, root): a layer's ``./`` entry is ignored;
* a time outside what a Go time of nanoseconds holds from 1970 on (before 1970-01-01, after
  2262-04-11: 2**63 - 1 ns) is shown as 0, as containerd's unpack sets it (its archive
  package's ``boundTime``) (:func:`unpack_time`);
* in a tree meant for overlayfs (``overlay=True``), a whiteout is kept only in a directory
  that overlayfs merges with the layers below (see :func:`merge_layers`).

Nothing a layer holds breaks the whole tree: a member that cannot be applied (a hardlink to
nothing, too many symlinks on a path) is left out and named in :attr:`MergedTree.problems`
(containerd's own unpack refuses such a layer).
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_LINKS = 255  # symlinks followed on one path before giving up (containerd's fs.RootPath)

_TYPE_BITS = {
    "reg": stat.S_IFREG,
    "hardlink": stat.S_IFREG,
    "dir": stat.S_IFDIR,
    "symlink": stat.S_IFLNK,
    "char": stat.S_IFCHR,
    "block": stat.S_IFBLK,
    "fifo": stat.S_IFIFO,
}


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
    inode: _Inode | None = None  # set by a hardlink to this node: the inode's new attributes

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def is_symlink(self) -> bool:
        entry = self.data.entry
        return entry is not None and entry.type == "symlink"

    @property
    def data(self) -> Node:
        """The node whose entry and layer hold this file's bytes."""
        return self.content or self

    @property
    def meta(self) -> Any:
        """What the inode's mode, owner, mtime and xattrs come from (None: an implied
        directory's defaults)."""
        data = self.data
        return data.inode or data.entry

    def mode(self) -> int:
        entry = self.data.entry
        if entry is None:
            return stat.S_IFDIR | 0o755
        if entry.type == "symlink":  # Linux has no symlink modes: every one is 0777
            return stat.S_IFLNK | 0o777
        return _TYPE_BITS[entry.type] | (int(self.meta.mode) & 0o7777)


@dataclass
class MergedTree:
    root: Node
    inodes: dict[int, Node] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # members left out, and why

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


MAX_UNPACK_TIME_NS = 2**63 - 1  # containerd's maxTime on 64-bit Linux: time.Unix(0, 1<<63-1)


def unpack_time(ns: int) -> int:
    """The time (ns) containerd's unpack gives a file whose header says ``ns``: one before
    1970 or past 2262 becomes 0 (``boundTime`` in containerd's archive package)."""
    return ns if 0 <= ns <= MAX_UNPACK_TIME_NS else 0


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


@dataclass(frozen=True)
class _Inode:
    """A file's attributes after a hardlink's header was applied to it."""

    mode: int
    uid: int
    gid: int
    mtime_ns: int
    xattrs: dict[str, bytes]


@dataclass(frozen=True)
class LowerDir:
    """What a directory below an overlay tree (a normally unpacked layer) holds at a path
    the tree only implies: containerd gives the directory it creates there these."""

    mode: int
    uid: int
    gid: int
    mtime_ns: int
    xattrs: dict[str, bytes] = field(default_factory=dict)
    type: str = "dir"
    size: int = 0
    link: str = ""
    devmajor: int = 0
    devminor: int = 0


class _Builder:
    def __init__(self, overlay: bool, below: Callable[[str], LowerDir | None] | None) -> None:
        self.overlay = overlay
        self.below = below if overlay else None
        self.counter = iter(range(1, 1 << 62))
        root = Node("", None, -1, next(self.counter), children={})
        self.tree = MergedTree(root)
        self.tree.inodes[root.ino] = root

    def add(self, node: Node, parent: Node) -> Node:
        assert parent.children is not None
        parent.children[node.name] = node
        self.tree.inodes.setdefault(node.ino, node)
        return node

    def parent(self, parts: list[str], layer: int, *, create: bool) -> Node | None:
        """The directory that the path ``parts`` (a member's parent) of layer ``layer``
        names; missing directories are implied when ``create``. None when it does not exist
        (``create`` False) or too many symlinks lie on it."""
        node = self.tree.root
        for part in parts:  # the common case: every component is a directory already
            child = node.children.get(part)  # type: ignore[union-attr]
            if child is None or child.children is None:
                return self._resolve(parts, layer, create=create)
            node = child
        return node

    def _resolve(self, parts: list[str], layer: int, *, create: bool) -> Node | None:
        """:meth:`parent` where a component is missing, or not a directory."""
        stack = [self.tree.root]
        names: list[str] = []
        pending = list(parts)
        links = 0
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":  # only in a symlink's target; stops at the root
                if names:
                    stack.pop()
                    names.pop()
                continue
            node = stack[-1]
            assert node.children is not None
            child = node.children.get(part)
            if child is not None and child.layer == layer and child.is_symlink:
                links += 1
                if links > MAX_LINKS:
                    return None
                target = child.data.entry.link
                if target.startswith("/"):
                    del stack[1:], names[:]
                pending[:0] = target.split("/")
                continue
            if child is None or not child.is_dir:
                if not create:
                    return None
                child = self.implied_dir(node, part, [*names, part], layer, replaced=child)
            stack.append(child)
            names.append(part)
        return stack[-1]

    def implied_dir(
        self, parent: Node, name: str, path: list[str], layer: int, *, replaced: Node | None
    ) -> Node:
        """A directory a layer needs but does not list. In an overlay tree, one over a
        whiteout hides what lies below (opaque); one over nothing takes the metadata of the
        directory below, as containerd does when it creates it in the layer's directory."""
        whiteout = replaced is not None and isinstance(replaced.entry, _Whiteout)
        entry = None
        if self.below is not None and replaced is None:
            entry = self.below("/".join(path))
        node = Node(name, entry, layer, next(self.counter), children={}, opaque=whiteout)
        return self.add(node, parent)

    def problem(self, layer: int, entry: Any, rule: str) -> None:
        self.tree.problems.append(f"layer {layer}: member {entry.name!r} left out: {rule}")

    def whiteout(self, entry: Any, parts: list[str], layer: int) -> None:
        parent = self.parent(parts[:-1], layer, create=self.overlay)
        if parent is None:
            return
        assert parent.children is not None
        if parts[-1] == OPAQUE:
            parent.children.clear()
            parent.opaque = parent.opaque or self.overlay
            return
        name = parts[-1][len(WHITEOUT) :]
        parent.children.pop(name, None)
        if self.overlay:
            self.add(Node(name, _Whiteout(name), layer, next(self.counter)), parent)

    def member(self, entry: Any, parts: list[str], layer: int) -> None:
        parent = self.parent(parts[:-1], layer, create=True)
        if parent is None:
            self.problem(layer, entry, f"more than {MAX_LINKS} symlinks on its path")
            return
        assert parent.children is not None
        name = parts[-1]
        existing = parent.children.get(name)
        if entry.type == "dir":
            if existing is not None and existing.is_dir:
                existing.entry, existing.layer = entry, layer
                return
            node = Node(
                name,
                entry,
                layer,
                next(self.counter),
                children={},
                opaque=existing is not None and isinstance(existing.entry, _Whiteout),
            )
        elif entry.type == "hardlink":
            target = self.hardlink_target(entry.link, layer)
            if target is None:
                self.problem(
                    layer,
                    entry,
                    f"hardlink to {entry.link!r}: no such file in this or a lower layer",
                )
                return
            data = target.data
            data.nlink += 1
            data.inode = _linked(data, entry)
            node = Node(name, entry, layer, data.ino, content=data)
        else:
            node = Node(name, entry, layer, next(self.counter))
        self.add(node, parent)

    def hardlink_target(self, link: str, layer: int) -> Node | None:
        """The non-directory a hardlink names; symlinks on its parent path are followed as
        for a member's path, the last component is not (a hardlink to a symlink)."""
        parts = _parts(link)
        parent = self.parent(parts[:-1], layer, create=False) if parts else None
        if parent is None:
            return None
        assert parent.children is not None
        target = parent.children.get(parts[-1])
        if target is None or target.is_dir or isinstance(target.entry, _Whiteout):
            return None
        return target

    def drop_unmerged_whiteouts(self) -> int:
        """Remove the whiteouts of every directory overlayfs will not merge with a directory
        below (returns how many). overlayfs filters whiteouts out of a listing only in a
        merged directory; in any other it lists them as they are, names that cannot be
        stat-ed (``ls -l``, ``find`` and ``cp -a`` fail). They hide nothing there: a
        directory is merged only when it is not opaque, its parent is merged and a layer
        below holds a directory at its path. Such whiteouts come from stacking several
        layers into one tree (layer 2 makes layer 1's symlink ``d`` a directory, layer 3
        deletes ``d/f``: containerd's own stack merges layer 3's ``d`` with layer 2's, the
        tree's ``d`` has nothing below it)."""
        assert self.below is not None
        below = self.below
        merged: dict[tuple[str, ...], bool] = {(): True}  # asked of dirs holding whiteouts

        def is_merged(path: tuple[str, ...], nodes: list[Node]) -> bool:
            """``nodes``: the directories from the root's child to ``path``'s."""
            depth = len(path)
            while path[:depth] not in merged:  # the nearest ancestor already decided
                depth -= 1
            for i in range(depth + 1, len(path) + 1):
                merged[path[:i]] = (
                    merged[path[: i - 1]]
                    and not nodes[i - 1].opaque
                    and below("/".join(path[:i])) is not None
                )
            return merged[path]

        dropped = 0
        stack: list[tuple[tuple[str, ...], list[Node]]] = [((), [])]
        while stack:
            path, nodes = stack.pop()
            node = nodes[-1] if nodes else self.tree.root
            assert node.children is not None
            whiteouts = [n for n, c in node.children.items() if isinstance(c.entry, _Whiteout)]
            if whiteouts and not is_merged(path, nodes):
                for name in whiteouts:
                    del node.children[name]
                dropped += len(whiteouts)
            for name, child in node.children.items():
                if child.is_dir:
                    stack.append(((*path, name), [*nodes, child]))
        return dropped


def merge_layers(
    layers: Iterable[Iterable[Any]],
    *,
    overlay: bool = False,
    below: Callable[[str], LowerDir | None] | None = None,
    keep_whiteouts: bool = False,
) -> MergedTree:
    """Stack TOC entries (``name``, ``type``, ``link``, ``mode``...) of layers, lowest
    first, into one tree (the rules: the module's docstring).

    ``overlay=True`` builds a tree meant to be one lowerdir of a kernel overlayfs above
    layers it does not hold (a containerd snapshot over a normally unpacked layer): deletions
    stay visible the overlayfs way, a whiteout as a 0:0 character device and an opaque
    directory as a node with ``opaque`` set (presented as ``trusted.overlay.opaque=y``);
    ``below(path)`` says what directory those layers hold at a path the tree only implies
    (overlayfs shows the upper directory's metadata), and which directories overlayfs merges:
    a whiteout in one it does not merge is dropped (:meth:`_Builder.drop_unmerged_whiteouts`)
    unless ``keep_whiteouts`` (one layer's own directory, as containerd unpacks it, or
    ``below`` not knowing every layer below)."""
    build = _Builder(overlay, below)
    for index, entries in enumerate(layers):
        entries = list(entries)
        # Whiteouts first: they hide lower layers, never entries of their own layer.
        for entry in entries:
            parts = _parts(entry.name)
            if parts and parts[-1].startswith(WHITEOUT):
                build.whiteout(entry, parts, index)
        for entry in entries:
            parts = _parts(entry.name)
            if parts and not parts[-1].startswith(WHITEOUT):
                build.member(entry, parts, index)
    if build.below is not None and not keep_whiteouts:
        build.drop_unmerged_whiteouts()
    return build.tree


def _linked(data: Node, link: Any) -> _Inode:
    """The attributes of ``data``'s inode once hardlink ``link`` is applied: containerd
    chowns, chmods (not a symlink), sets the xattrs and the times of what it linked. A
    symlink keeps its times (Go's Chtimes follows the link, to another inode)."""
    meta = data.meta
    xattrs = {**(getattr(meta, "xattrs", None) or {}), **(getattr(link, "xattrs", None) or {})}
    if data.entry.type == "symlink":
        return _Inode(meta.mode, link.uid, link.gid, meta.mtime_ns, xattrs)
    return _Inode(link.mode, link.uid, link.gid, link.mtime_ns, xattrs)
