"""``bootseer snapshotter``: containerd's snapshots API over gRPC on a unix socket, in front of
:class:`~prefetch.containerd.snapshotter.Snapshotter`, with the lazy views' FUSE mount.

One process holds both: the FUSE mount runs in the main thread (libfuse's signal handling
unmounts it on SIGTERM), and the gRPC server starts from the mount's ``init``, so containerd
never gets a lazy snapshot's path before that path can be read. A mount left by a killed
predecessor is detached first; every lazy snapshot in the metadata is served again.

Whatever umask the process was started with, everything it creates is private to root: the
daemon runs under umask 077, its directories get explicit modes (snapshotter.py), and the
socket is bound in a private directory, made 0600 there and only then renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import empty_pb2, timestamp_pb2

from striped_fs.private import make_dir

from .api.services.snapshots.v1 import snapshots_pb2 as pb
from .api.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from .api.types import mount_pb2
from .errors import ContainerdError
from .metadata import Snapshot
from .snapshotter import MountSpec, Snapshotter

log = logging.getLogger(__name__)

_KIND_NAMES = {1: "view", 2: "active", 3: "committed"}


def _mounts(specs: list[MountSpec]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, options=list(m.options))
            for m in specs]


def _timestamp(ns: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def info_to_proto(snap: Snapshot) -> pb.Info:
    return pb.Info(name=snap.name, parent=snap.parent, kind=int(snap.kind),
                   created_at=_timestamp(snap.created_ns), updated_at=_timestamp(snap.updated_ns),
                   labels=snap.labels)


class SnapshotsService(pb_grpc.SnapshotsServicer):
    """Maps each RPC to the snapshotter; a ContainerdError becomes its gRPC status (the
    message names the snapshot and what to do), anything else INTERNAL, logged."""

    def __init__(self, snapshotter: Snapshotter) -> None:
        self.sn = snapshotter

    def _call(self, context: grpc.ServicerContext, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ContainerdError as exc:
            if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                log.info("%s: %s", what, exc)
            context.abort(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - containerd must get an answer
            log.exception("%s failed", what)
            context.abort(grpc.StatusCode.INTERNAL, f"{what}: {type(exc).__name__}: {exc}")

    def Prepare(self, request: Any, context: grpc.ServicerContext) -> Any:
        specs = self._call(context, f"prepare {request.key!r}", self.sn.prepare, request.key,
                           request.parent, dict(request.labels))
        return pb.PrepareSnapshotResponse(mounts=_mounts(specs))

    def View(self, request: Any, context: grpc.ServicerContext) -> Any:
        specs = self._call(context, f"view {request.key!r}", self.sn.view, request.key,
                           request.parent, dict(request.labels))
        return pb.ViewSnapshotResponse(mounts=_mounts(specs))

    def Mounts(self, request: Any, context: grpc.ServicerContext) -> Any:
        specs = self._call(context, f"mounts {request.key!r}", self.sn.mounts, request.key)
        return pb.MountsResponse(mounts=_mounts(specs))

    def Commit(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, f"commit {request.key!r} as {request.name!r}", self.sn.commit,
                   request.name, request.key, dict(request.labels))
        return empty_pb2.Empty()

    def Remove(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, f"remove {request.key!r}", self.sn.remove, request.key)
        return empty_pb2.Empty()

    def Stat(self, request: Any, context: grpc.ServicerContext) -> Any:
        snap = self._call(context, f"stat {request.key!r}", self.sn.stat, request.key)
        return pb.StatSnapshotResponse(info=info_to_proto(snap))

    def Update(self, request: Any, context: grpc.ServicerContext) -> Any:
        paths = list(request.update_mask.paths) if request.HasField("update_mask") else []
        snap = self._call(context, f"update {request.info.name!r}", self.sn.update,
                          request.info.name, dict(request.info.labels), paths)
        return pb.UpdateSnapshotResponse(info=info_to_proto(snap))

    def List(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        snaps = self._call(context, "list", lambda: list(self.sn.list(list(request.filters))))
        batch: list[pb.Info] = []
        for snap in snaps:
            batch.append(info_to_proto(snap))
            if len(batch) == 100:  # containerd sends pages of 100 too
                yield pb.ListSnapshotsResponse(info=batch)
                batch = []
        if batch:
            yield pb.ListSnapshotsResponse(info=batch)

    def Usage(self, request: Any, context: grpc.ServicerContext) -> Any:
        size, inodes = self._call(context, f"usage {request.key!r}", self.sn.usage, request.key)
        return pb.UsageResponse(size=size, inodes=inodes)

    def Cleanup(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, "cleanup", self.sn.cleanup)
        return empty_pb2.Empty()


def start_grpc(snapshotter: Snapshotter, address: str, *, workers: int = 32) -> grpc.Server:
    """Serve the snapshots API on the unix socket ``address``, mode 0600 whatever the umask.

    gRPC binds the socket with the umask's mode, in its own threads' time; so it binds a name
    in a fresh 0700 directory beside ``address`` (nobody else can reach it there), the socket
    is made 0600, then renamed onto ``address`` (atomically replacing the stale socket of a
    killed predecessor). A missing parent directory is created 0700; an existing one keeps
    its mode."""
    parent = make_dir(Path(address).parent)
    staging = tempfile.mkdtemp(prefix=".sock-", dir=parent)  # 0700, whatever the umask
    try:
        bound = os.path.join(staging, "s")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                        thread_name_prefix="snapshots"))
        pb_grpc.add_SnapshotsServicer_to_server(SnapshotsService(snapshotter), server)
        if server.add_insecure_port(f"unix://{bound}") == 0:
            raise OSError(f"cannot listen on unix socket {bound} (for {address}; a unix "
                          "socket path has at most 107 bytes)")
        os.chmod(bound, 0o600)
        os.replace(bound, address)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    server.start()
    return server


def serve(root: str | os.PathLike, address: str, *, remote_options: dict[str, Any] | None = None,
          ready: threading.Event | None = None) -> int:
    """Run the snapshotter until SIGTERM/SIGINT (or an unmount of its lazy directory), under
    umask 077 (the caller's is put back after)."""
    umask = os.umask(0o077)
    try:
        return _serve(Path(root).resolve(), address, remote_options, ready)
    finally:
        os.umask(umask)


def _serve(root: Path, address: str, remote_options: dict[str, Any] | None,
           ready: threading.Event | None) -> int:
    from striped_fs import fuse

    from .remote import RemoteLayers
    from .views import ViewOperations, mount_views

    make_dir(root, tighten=True)
    lazy_dir = root / "lazy"
    if _is_stale_mount(lazy_dir) or fuse.is_mounted(lazy_dir):
        log.info("detaching the lazy mount a previous snapshotter left at %s", lazy_dir)
        fuse.unmount(lazy_dir, lazy=True)
    remote = RemoteLayers(root / "remote", **(remote_options or {}))
    server: list[grpc.Server] = []

    def on_init() -> None:
        server.append(start_grpc(snapshotter, address))
        log.info("bootseer snapshotter serving %s (root %s)", address, root)
        if ready is not None:
            ready.set()

    views = ViewOperations(on_init=on_init)
    snapshotter = Snapshotter(root, remote=remote, views=views)
    try:
        mount_views(views, str(lazy_dir))
    finally:
        for srv in server:
            srv.stop(grace=2).wait()
        if os.path.exists(address):
            os.unlink(address)
        snapshotter.close()
    return 0


def _is_stale_mount(path: Path) -> bool:
    """A FUSE mount whose daemon died answers ENOTCONN."""
    try:
        os.stat(path)
    except OSError as exc:
        import errno

        return exc.errno == errno.ENOTCONN
    return False
