"""The tree a lazy environment presents, built from a snapshot's manifest and TOC alone.

Every member is checked by :func:`snapshot.safety.plan_extraction` first, the same rules a
full restore applies (no absolute or ``..`` paths, no member under a symlink, hardlinks only to
earlier regular files inside the root, no devices or FIFOs, setuid/setgid stripped, data inside
the stream), plus the limits a view held in memory needs (members, names per directory): a
crafted TOC is refused with an error naming the member and the rule before anything is mounted.

A file's bytes are ``[offset, offset + size)`` of the snapshot's tar stream; which chunks hold
them is :func:`snapshot.manifest.iter_chunk_spans`' business. Metadata (stat, listing, link
targets) comes from here only, so listing the tree or stat-ing every file fetches nothing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from .errors import SnapshotError, UnsafeMemberError
from .manifest import DIR, FILE, SYMLINK, Manifest, Member, iter_chunk_spans
from .safety import plan_extraction

MAX_MEMBERS = 4_000_000
"""Most members a lazy view holds (a torch environment has 22k): a TOC within the size cap
could otherwise declare tens of millions of empty members and exhaust the mount's memory."""


@dataclass(eq=False)
class Node:
    """One path of the view. A hardlink is the same node under a second name."""

    kind: str  # FILE, DIR or SYMLINK
    mode: int  # permission bits only (setuid/setgid already stripped)
    mtime_ns: int
    ino: int
    size: int = 0
    offset: int = 0  # a file's data in the tar stream
    link: str = ""  # a symlink's target
    nlink: int = 1
    children: dict[str, Node] = field(default_factory=dict)

    @property
    def st_mode(self) -> int:
        kind = {FILE: stat.S_IFREG, DIR: stat.S_IFDIR, SYMLINK: stat.S_IFLNK}[self.kind]
        return kind | (0o777 if self.kind == SYMLINK else self.mode)


class LazyView:
    """The checked tree of ``manifest``'s snapshot (``members`` is its decoded TOC)."""

    def __init__(self, manifest: Manifest, members: list[Member]) -> None:
        if manifest.kind != "prefix":
            raise SnapshotError(
                f"snapshot {manifest.key} is a capture of {manifest.capture.get('roots')}; "
                f"only an environment prefix can be mounted lazily (replay captures with "
                f"`bootseer env ensure --capture ...`)"
            )
        if len(members) > MAX_MEMBERS:
            raise UnsafeMemberError(
                f"({len(members)} members)", f"more than {MAX_MEMBERS} members in one snapshot"
            )
        plan = plan_extraction(members, manifest.stream_size)
        self.manifest = manifest
        self.stripped = plan.stripped
        self.root = Node(DIR, 0o755, int(manifest.created * 1e9), ino=1)
        self.nodes: dict[str, Node] = {"": self.root}
        self.files = 0
        self.bytes = 0
        ino = 1
        for member in plan.dirs + plan.files + plan.symlinks:
            ino += 1
            node = Node(
                member.kind,
                member.mode,
                member.mtime_ns,
                ino,
                size=member.size if member.kind == FILE else 0,
                offset=member.offset if member.kind == FILE else 0,
                link=member.link if member.kind == SYMLINK else "",
            )
            if member.kind == FILE:
                self.files += 1
                self.bytes += member.size
            self._attach(member.path, node)
        for member in plan.hardlinks:  # plan_extraction: the target is an earlier file
            target = self.nodes[member.link]
            target.nlink += 1
            self._attach(member.path, target)

    def _attach(self, path: str, node: Node) -> None:
        parent, _, name = path.rpartition("/")
        # plan_extraction checked that the parent is an earlier directory member; the dirs
        # come first here, in TOC order, so the parent is always in place.
        self.nodes[parent].children[name] = node
        self.nodes[path] = node

    def lookup(self, path: str) -> Node | None:
        """The node at a FUSE path (``/a/b``), None when there is none."""
        return self.nodes.get(path.strip("/"))

    def file_chunks(self, node: Node, start: int = 0, end: int | None = None) -> list[int]:
        """Indices of the chunks holding bytes ``[start, end)`` of a file."""
        stop = node.size if end is None else min(end, node.size)
        if node.kind != FILE or stop <= start:
            return []
        return [
            i
            for i, _, _ in iter_chunk_spans(
                self.manifest.chunks, node.offset + start, node.offset + stop
            )
        ]

    def paths(self) -> list[str]:
        """Every member path, sorted (the root left out)."""
        return sorted(p for p in self.nodes if p)


def check_prefix(manifest: Manifest, prefix: str) -> None:
    """A lazy view is read-only, so it cannot be relocated: refuse another prefix when the
    snapshot's files embed the one it was built at (a venv's scripts and ``pyvenv.cfg`` do)."""
    prefix = os.path.abspath(prefix)
    if manifest.prefix != prefix and manifest.prefix_refs:
        shown = ", ".join(r.get("path", "?") for r in manifest.prefix_refs[:3])
        raise SnapshotError(
            f"snapshot {manifest.key} was built at {manifest.prefix} and "
            f"{len(manifest.prefix_refs)} of its files name that path ({shown}...); a lazy "
            f"mount cannot rewrite them: mount it at {manifest.prefix}, or restore it to "
            f"{prefix} with `bootseer env restore` (which relocates)"
        )
