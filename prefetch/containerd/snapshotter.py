"""The snapshotter's logic, without gRPC: containerd's snapshot model over directories,
overlayfs and the lazy views.

Layout under the root::

    metadata.db          snapshots, parents, labels (sqlite, one transaction per change)
    snapshots/<id>/fs    a normal snapshot's files (an active one's overlay upperdir)
    snapshots/<id>/work  its overlay workdir
    lazy/                the FUSE mount of every lazy snapshot (views.py)
    remote/              manifests, layer indexes, the block cache, profiles (remote.py)

Semantics follow containerd's own overlayfs snapshotter: an active snapshot without parent is a
bind mount of its directory, with parents an overlay whose lowerdirs are the parents'
directories, nearest first; a view of one parent is a read-only bind mount of it. A lazy
snapshot (a converted layer, committed at Prepare time and reported ALREADY_EXISTS) has no
directory: its lazy view stands for it and for the lazy parents below it.

Modes, as containerd's own snapshotters after CVE-2021-41103, whatever the umask: the root,
``snapshots/``, each ``snapshots/<id>``, ``lazy/`` (and the lazy mount's own root) and
``remote/`` are 0700, root's alone; inside them ``fs`` is 0755 (a container's ``/`` looks as
usual) and ``work`` 0711. An existing root and those directories are set to their modes at
start (a node set up by an older version).

Fallback: a layer the snapshotter cannot read from the registry (unreachable, a 401 because
the credentials came with the kubelet's pull secret and went to containerd alone, a mirror it
was not told about) gets an ordinary active snapshot, which containerd fills the normal way;
the log says why. Only malformed labels and layers whose index breaks the rules are refused.

Crash safety: the database changes first, in one transaction; directories are created before
the row commits and deleted after it is gone, so a crash can leave an orphan directory (which
``cleanup`` removes) but never a row without its directory.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from striped_fs.fuse import is_mounted
from striped_fs.private import make_dir

from . import labels as lbl
from .errors import AlreadyExistsError, InvalidArgumentError, UnavailableError
from .filters import parse, snapshot_adaptor
from .metadata import Kind, MetadataStore, Snapshot
from .remote import RemoteLayers
from .views import ViewOperations, lower_dirs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MountSpec:
    """One mount as containerd's API carries it."""

    type: str
    source: str
    options: tuple[str, ...]


def _is_lazy(snap: Snapshot) -> bool:
    return bool(snap.source.get("remote"))


class Snapshotter:
    """containerd's snapshots API over a root directory (thread-safe)."""

    def __init__(self, root: str | os.PathLike, *, remote: RemoteLayers | None = None,
                 views: ViewOperations | None = None) -> None:
        self.root = make_dir(Path(root).resolve(), tighten=True)
        make_dir(self.root / "snapshots", tighten=True)
        self.lazy_dir = self.root / "lazy"
        if not is_mounted(self.lazy_dir):  # a held mount nobody serves yet would block a stat
            make_dir(self.lazy_dir, tighten=True)
        self.db = MetadataStore(self.root / "metadata.db")
        self.remote = remote
        self.views = views or ViewOperations()
        self.views._on_ready = self._ready  # noqa: SLF001 - wired once, here
        for snap in self.db.list():  # restore: every lazy snapshot is served again
            if _is_lazy(snap):
                self._register_view(snap)

    # -- paths -------------------------------------------------------------------------------
    def _dir(self, snap: Snapshot) -> Path:
        return self.root / "snapshots" / str(snap.id)

    def _layer_dir(self, snap: Snapshot) -> str:
        if _is_lazy(snap):
            return str(self.lazy_dir / str(snap.id))
        return str(self._dir(snap) / "fs")

    def _lowerdirs(self, parent: str) -> list[str]:
        """The lowerdirs for a snapshot on ``parent``, nearest first; one lazy view stands for
        a run of lazy snapshots."""
        if not parent:
            return []
        dirs: list[str] = []
        in_lazy_run = False
        for snap in self.db.chain(parent):
            lazy = _is_lazy(snap)
            if lazy and in_lazy_run:
                continue
            dirs.append(self._layer_dir(snap))
            in_lazy_run = lazy
        return dirs

    def _mounts(self, snap: Snapshot) -> list[MountSpec]:
        lowers = self._lowerdirs(snap.parent)
        base = self._dir(snap)
        if snap.kind == Kind.ACTIVE:
            if not lowers:
                return [MountSpec("bind", str(base / "fs"), ("rw", "rbind"))]
            return [MountSpec("overlay", "overlay", (
                "index=off", f"workdir={base / 'work'}", f"upperdir={base / 'fs'}",
                "lowerdir=" + ":".join(lowers)))]
        if snap.kind == Kind.VIEW or snap.kind == Kind.COMMITTED:
            if snap.kind == Kind.COMMITTED:
                lowers = [self._layer_dir(snap), *lowers]
            if not lowers:
                return [MountSpec("bind", str(base / "fs"), ("ro", "rbind"))]
            if len(lowers) == 1:
                return [MountSpec("bind", lowers[0], ("ro", "rbind"))]
            return [MountSpec("overlay", "overlay", ("index=off", "lowerdir=" + ":".join(lowers)))]
        raise InvalidArgumentError(f"snapshot {snap.name!r} has no mounts (kind {snap.kind})")

    # -- the API -----------------------------------------------------------------------------
    def prepare(self, key: str, parent: str = "", labels: dict[str, str] | None = None
                ) -> list[MountSpec]:
        labels = dict(labels or {})
        request = lbl.layer_request(key, labels)
        if request is not None and self.remote is not None:
            try:
                self._serve_remotely(key, parent, labels, request)  # raises ALREADY_EXISTS
            except UnavailableError as exc:  # containerd can read what this process cannot
                log.warning("prepare %s: layer %s of %s cannot be served lazily (%s): "
                            "containerd downloads and unpacks it", key, request.layer_digest,
                            request.image_ref, exc)
        return self._create(key, parent, Kind.ACTIVE, labels)

    def view(self, key: str, parent: str = "", labels: dict[str, str] | None = None
             ) -> list[MountSpec]:
        return self._create(key, parent, Kind.VIEW, dict(labels or {}))

    def _create(self, key: str, parent: str, kind: Kind, labels: dict[str, str]
                ) -> list[MountSpec]:
        with self.db.transaction():
            snap = self.db.create(key, parent, kind, labels)
            base = self._dir(snap)
            if base.exists():  # an orphan of a crash with this id: not ours any more
                shutil.rmtree(base)
            make_dir(base)
            make_dir(base / "fs", 0o755)  # containerd's modes, whatever the umask
            if kind == Kind.ACTIVE:
                make_dir(base / "work", 0o711)
        return self._mounts(snap)

    def _serve_remotely(self, key: str, parent: str, labels: dict[str, str],
                        request: lbl.LayerRequest) -> None:
        target = request.chain_id
        existing = self.db.find(target)
        if existing is not None:
            raise AlreadyExistsError(f"target snapshot {target!r} already exists")
        assert self.remote is not None
        layer = self.remote.layer(request)  # the registry: outside any transaction
        if layer is None:
            log.info("prepare %s: layer %s is not in the bootseer format: normal unpack", key,
                     request.layer_digest)
            return
        keep = {k: v for k, v in labels.items() if k.startswith("containerd.io/snapshot")}
        keep[lbl.SNAPSHOT_REF] = target
        keep[lbl.REMOTE] = "true"
        with self.db.transaction():
            if self.db.find(target) is not None:
                raise AlreadyExistsError(f"target snapshot {target!r} already exists")
            snap = self.db.create(target, parent, Kind.COMMITTED, keep, source=layer.source())
        self._register_view(snap)
        log.info("prepare %s: layer %s served lazily as %s", key, request.layer_digest, target)
        raise AlreadyExistsError(f"target snapshot {target!r}: served lazily by bootseer")

    def _register_view(self, snap: Snapshot) -> None:
        if self.remote is None:
            log.warning("snapshot %s is lazy but no registry access is configured", snap.name)
            return
        remote = self.remote

        def build() -> Any:
            run = self._lazy_run(snap.name)
            layers = [remote.layer_from_source(s.source) for s in reversed(run.snapshots)]
            return remote.lazy_image(layers, overlay=run.has_base, below=lower_dirs(run.below))

        self.views.register(snap.id, build)

    @dataclass
    class _LazyRun:
        snapshots: list[Snapshot]  # top first
        has_base: bool  # a normal snapshot lies below: keep whiteouts for overlayfs
        below: list[str]  # the normal snapshots' directories right below, nearest first

    def _lazy_run(self, name: str) -> Snapshotter._LazyRun:
        run: list[Snapshot] = []
        chain = self.db.chain(name)
        for i, snap in enumerate(chain):
            if not _is_lazy(snap):
                below = itertools.takewhile(lambda s: not _is_lazy(s), chain[i:])
                return self._LazyRun(run, True, [self._layer_dir(s) for s in below])
            run.append(snap)
        return self._LazyRun(run, False, [])

    def mounts(self, key: str) -> list[MountSpec]:
        return self._mounts(self.db.get(key))

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> Snapshot:
        active = self.db.get(key)
        size, inodes = (_usage(self._dir(active) / "fs") if active.kind == Kind.ACTIVE
                        else (0, 0))
        with self.db.transaction():
            snap = self.db.commit(key, name, labels or {}, size=size, inodes=inodes)
        work = self._dir(snap) / "work"
        shutil.rmtree(work, ignore_errors=True)
        return snap

    def remove(self, key: str) -> Snapshot:
        with self.db.transaction():
            snap = self.db.remove(key)
        if _is_lazy(snap):
            self.views.unregister(snap.id)
            digest, index = snap.source.get("digest"), snap.source.get("index")
            still_used = any(s.source.get("digest") == digest and s.source.get("index") == index
                             for s in self.db.list())
            if self.remote is not None and digest and not still_used:
                dropped = self.remote.release(digest, index)
                log.info("removed lazy snapshot %s; %d cached frames of %s dropped", key,
                         dropped, digest)
        else:
            self._delete_dir(snap.id)
        return snap

    def _delete_dir(self, snap_id: int) -> None:
        base = self.root / "snapshots" / str(snap_id)
        if not base.exists():
            return
        trash = self.root / "snapshots" / f".removed-{snap_id}-{time.time_ns()}"
        os.rename(base, trash)  # gone from its place at once, then deleted
        shutil.rmtree(trash, ignore_errors=True)

    def stat(self, key: str) -> Snapshot:
        return self.db.get(key)

    def update(self, name: str, labels: dict[str, str], fieldpaths: Sequence[str] = ()
               ) -> Snapshot:
        with self.db.transaction():
            return self.db.update(name, labels, fieldpaths)

    def list(self, filters: Sequence[str] = ()) -> Iterator[Snapshot]:
        matcher = parse(list(filters))
        for snap in self.db.list():
            if matcher.match(snapshot_adaptor(snap)):
                yield snap

    def usage(self, key: str) -> tuple[int, int]:
        snap = self.db.get(key)
        if snap.kind == Kind.ACTIVE:
            return _usage(self._dir(snap) / "fs")
        if _is_lazy(snap) and self.remote is not None:
            layer = self.remote.layer_from_source(snap.source)
            return layer.index.tar_size, len(layer.index.entries)
        return snap.size, snap.inodes

    def cleanup(self) -> int:
        """Delete directories no snapshot owns (left by a crash or an interrupted remove)."""
        ids = self.db.ids()
        removed = 0
        for entry in (self.root / "snapshots").iterdir():
            name = entry.name
            if name.startswith(".removed-") or (name.isdigit() and int(name) not in ids):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        return removed

    def _ready(self, view_id: int) -> None:
        if self.remote is None:
            return
        snap = next((s for s in self.db.list() if s.id == view_id), None)
        if snap is None:
            return
        digests = [s.source.get("digest") for s in self._lazy_run(snap.name).snapshots]
        self.remote.ready(d for d in digests if d)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        self.db.close()


def _usage(path: Path) -> tuple[int, int]:
    """(bytes, inodes) under ``path``, hardlinks counted once (what `du` reports)."""
    size = inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            inodes += 1
            size += st.st_blocks * 512
    return size, inodes
