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
directory: its lazy view stands for it and for the lazy parents below it, until a normal pull
comes to stand on it: then it is written out whole into ``snapshots/<id>/fs`` first
(materialize.py; docs/containerd.md, "An unconverted image never reads the registry after its
pull"), and every later mount on it uses that directory, while the views above it keep it.

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

import contextlib
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from striped_fs import is_mounted, make_dir

from ..registry import RegistryError
from . import labels as lbl
from .errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from .filters import parse, snapshot_adaptor
from .materialize import check_diff_id, write_tree
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
    """Served by a view (also once materialized: the views above it keep their layers)."""
    return bool(snap.source.get("remote"))


def _materialized(snap: Snapshot) -> bool:
    """A lazy snapshot also written out whole into ``snapshots/<id>/fs``."""
    return bool(snap.source.get("materialized"))


def _complete(snap: Snapshot) -> bool:
    """Its directory holds its files: a normal snapshot, or a materialized lazy one."""
    return not _is_lazy(snap) or _materialized(snap)


class Snapshotter:
    """containerd's snapshots API over a root directory (thread-safe)."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        remote: RemoteLayers | None = None,
        views: ViewOperations | None = None,
    ) -> None:
        self.root = make_dir(Path(root).resolve(), tighten=True)
        make_dir(self.root / "snapshots", tighten=True)
        self.lazy_dir = self.root / "lazy"
        if not is_mounted(self.lazy_dir):  # a held mount nobody serves yet would block a stat
            make_dir(self.lazy_dir, tighten=True)
        self.db = MetadataStore(self.root / "metadata.db")
        self.remote = remote
        self._lock = threading.Lock()
        self._mat_locks: dict[int, threading.Lock] = {}  # snapshot id -> one writer at once
        self.views = views or ViewOperations()
        self.views._on_ready = self._ready  # noqa: SLF001 - wired once, here
        for snap in self.db.list():  # restore: every lazy snapshot is served again
            if _is_lazy(snap):
                self._register_view(snap)

    # -- paths -------------------------------------------------------------------------------
    def _dir(self, snap: Snapshot) -> Path:
        return self.root / "snapshots" / str(snap.id)

    def _layer_dir(self, snap: Snapshot) -> str:
        if _complete(snap):
            return str(self._dir(snap) / "fs")
        return str(self.lazy_dir / str(snap.id))

    def _lowerdirs(self, name: str) -> list[str]:
        """The lowerdirs of snapshot ``name`` and its parents, nearest first. One lazy view
        stands for a run of lazy snapshots (materialized ones in it too: the view holds
        them); a materialized snapshot that starts no run is its directory."""
        if not name:
            return []
        dirs: list[str] = []
        in_lazy_run = False
        for snap in self.db.chain(name):
            if in_lazy_run and _is_lazy(snap):
                continue
            dirs.append(self._layer_dir(snap))
            in_lazy_run = not _complete(snap)
        return dirs

    def _mounts(self, snap: Snapshot) -> list[MountSpec]:
        lowers = self._lowerdirs(snap.name if snap.kind == Kind.COMMITTED else snap.parent)
        base = self._dir(snap)
        if snap.kind == Kind.ACTIVE:
            if not lowers:
                return [MountSpec("bind", str(base / "fs"), ("rw", "rbind"))]
            return [
                MountSpec(
                    "overlay",
                    "overlay",
                    (
                        "index=off",
                        f"workdir={base / 'work'}",
                        f"upperdir={base / 'fs'}",
                        "lowerdir=" + ":".join(lowers),
                    ),
                )
            ]
        if snap.kind == Kind.VIEW or snap.kind == Kind.COMMITTED:
            if not lowers:
                return [MountSpec("bind", str(base / "fs"), ("ro", "rbind"))]
            if len(lowers) == 1:
                return [MountSpec("bind", lowers[0], ("ro", "rbind"))]
            return [MountSpec("overlay", "overlay", ("index=off", "lowerdir=" + ":".join(lowers)))]
        raise InvalidArgumentError(f"snapshot {snap.name!r} has no mounts (kind {snap.kind})")

    # -- the API -----------------------------------------------------------------------------
    def prepare(
        self, key: str, parent: str = "", labels: dict[str, str] | None = None
    ) -> list[MountSpec]:
        labels = dict(labels or {})
        request = lbl.layer_request(key, labels)
        converted: bool | None = None  # whether the image marks this layer converted
        if request is not None and self.remote is not None:
            try:
                self._serve_remotely(key, parent, labels, request)  # raises ALREADY_EXISTS
                converted = False
            except UnavailableError as exc:  # containerd can read what this process cannot
                log.warning(
                    "prepare %s: layer %s of %s cannot be served lazily (%s): "
                    "containerd downloads and unpacks it",
                    key,
                    request.layer_digest,
                    request.image_ref,
                    exc,
                )
                converted = self.remote.marked_converted(request)
        if lbl.SNAPSHOT_REF in labels and parent and converted is not True:
            # containerd unpacks a layer of a normal pull on ``parent``: what it stands on
            # must not need the registry after the pull either.
            self._materialize_chain(parent, f"layer {labels[lbl.SNAPSHOT_REF]} is unpacked on it")
        return self._create(key, parent, Kind.ACTIVE, labels)

    def view(
        self, key: str, parent: str = "", labels: dict[str, str] | None = None
    ) -> list[MountSpec]:
        return self._create(key, parent, Kind.VIEW, dict(labels or {}))

    def _create(self, key: str, parent: str, kind: Kind, labels: dict[str, str]) -> list[MountSpec]:
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

    def _serve_remotely(
        self, key: str, parent: str, labels: dict[str, str], request: lbl.LayerRequest
    ) -> None:
        target = request.chain_id
        existing = self.db.find(target)
        assert self.remote is not None
        if existing is not None:
            if not _complete(existing) and self.remote.marked_converted(request) is not True:
                self._materialize_chain(
                    target, f"layer {request.layer_digest} of {request.image_ref} is not converted"
                )
            raise AlreadyExistsError(f"target snapshot {target!r} already exists")
        layer = self.remote.layer(request)  # the registry: outside any transaction
        if layer is None:
            log.info(
                "prepare %s: layer %s is not in the bootseer format: normal unpack",
                key,
                request.layer_digest,
            )
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
            return remote.lazy_image(
                layers,
                overlay=run.has_base,
                below=lower_dirs(run.below),
                keep_whiteouts=run.more_below,
            )

        self.views.register(snap.id, build)

    @dataclass
    class _LazyRun:
        snapshots: list[Snapshot]  # top first
        has_base: bool  # a normal snapshot lies below: keep whiteouts for overlayfs
        below: list[str]  # the complete snapshots' directories right below, nearest first
        more_below: bool  # a lazy view lies below those: ``below`` does not see it

    def _lazy_run(self, name: str) -> Snapshotter._LazyRun:
        """The lazy snapshots one view of ``name`` holds (every lazy one down to the first
        that is not: materialized ones too, so a view never changes what it holds), and
        what lies below them."""
        run: list[Snapshot] = []
        chain = self.db.chain(name)
        for i, snap in enumerate(chain):
            if not _is_lazy(snap):
                below = list(itertools.takewhile(_complete, chain[i:]))
                return self._LazyRun(
                    run, True, [self._layer_dir(s) for s in below], len(below) < len(chain) - i
                )
            run.append(snap)
        return self._LazyRun(run, False, [], False)

    # -- materializing -----------------------------------------------------------------------
    def _materialize_chain(self, name: str, why: str) -> None:
        """Write out every lazy snapshot of ``name``'s chain not complete yet, lowest first
        (materialize.py), so that nothing on it reads the registry again. Raises
        UNAVAILABLE (the registry cannot be read now: the pull fails, the kubelet tries it
        again) or FAILED_PRECONDITION (the layer is not the one its chain ID names)."""
        if self.remote is None or self.db.find(name) is None:
            return  # a missing parent: the Prepare fails, naming it
        for snap in reversed(self.db.chain(name)):
            if not _complete(snap):
                with self._materializing(snap.id):
                    current = self.db.find(snap.name)
                    if current is not None and not _complete(current):
                        self._materialize(current, why)

    @contextlib.contextmanager
    def _materializing(self, snap_id: int) -> Iterator[None]:
        with self._lock:
            lock = self._mat_locks.setdefault(snap_id, threading.Lock())
        with lock:
            yield

    def _materialize(self, snap: Snapshot, why: str) -> None:
        assert self.remote is not None
        started = time.perf_counter()
        base = self._dir(snap)
        staging = base / f".fs-{time.time_ns()}"
        below = [self._layer_dir(s) for s in self.db.chain(snap.name)[1:]]
        try:
            layer = self.remote.layer_from_source(snap.source)
            image = self.remote.lazy_image(
                [layer], overlay=True, below=lower_dirs(below), keep_whiteouts=True
            )
            if image.tree.problems:
                raise FailedPreconditionError(
                    f"layer {layer.digest} cannot be unpacked: "
                    + "; ".join(image.tree.problems)
                    + " (containerd's own unpack refuses it too)"
                )
            frames = check_diff_id(image, snap.name, snap.parent)
            if base.exists():  # what an interrupted attempt left
                shutil.rmtree(base)
            make_dir(base)
            make_dir(staging, 0o755)
            done = write_tree(image, staging)
            os.rename(staging, base / "fs")
        except (OSError, RegistryError) as exc:
            shutil.rmtree(base, ignore_errors=True)
            raise UnavailableError(
                f"lazy snapshot {snap.name} (layer {snap.source.get('digest')}) must be "
                f"written out whole, as {why}, and cannot be now: {exc}"
            ) from None
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        with self.db.transaction():
            self.db.set_source(snap.name, {**snap.source, "materialized": True})
        log.info(
            "lazy snapshot %s (layer %s) written out whole into %s, as %s: %d files, "
            "%d bytes, %d frames in %.2f s",
            snap.name,
            snap.source.get("digest"),
            base / "fs",
            why,
            done.files,
            done.bytes_written,
            frames,
            time.perf_counter() - started,
        )

    def mounts(self, key: str) -> list[MountSpec]:
        return self._mounts(self.db.get(key))

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> Snapshot:
        active = self.db.get(key)
        size, inodes = _usage(self._dir(active) / "fs") if active.kind == Kind.ACTIVE else (0, 0)
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
            self._delete_dir(snap.id)  # materialized
            digest, index = snap.source.get("digest"), snap.source.get("index")
            still_used = any(
                s.source.get("digest") == digest and s.source.get("index") == index
                for s in self.db.list()
            )
            if self.remote is not None and digest and not still_used:
                dropped = self.remote.release(digest, index)
                log.info(
                    "removed lazy snapshot %s; %d cached frames of %s dropped", key, dropped, digest
                )
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

    def update(self, name: str, labels: dict[str, str], fieldpaths: Sequence[str] = ()) -> Snapshot:
        """Labels set as containerd asks; :data:`labels.LOCAL` asked for on a committed
        snapshot also writes out every lazy layer of its chain first (UNAVAILABLE when the
        registry cannot be read now: nothing changes)."""
        asked = labels.get(lbl.LOCAL) and (
            not fieldpaths or any(f in (f"labels.{lbl.LOCAL}", "labels") for f in fieldpaths)
        )
        if asked:
            snap = self.db.get(name)
            if snap.kind != Kind.COMMITTED:
                raise InvalidArgumentError(
                    f"{lbl.LOCAL} names committed snapshots (an image's "
                    f"layers); {name!r} is {snap.kind}"
                )
            self._materialize_chain(name, f"asked for by the label {lbl.LOCAL}")
            labels = {**labels, lbl.LOCAL: "done"}
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
