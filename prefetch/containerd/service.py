"""``bootseer snapshotter``: containerd's snapshots API over gRPC on a unix socket, in front of
:class:`~prefetch.containerd.snapshotter.Snapshotter`, with the lazy views' FUSE mount.

One process serves both. At start it takes over the lazy mount's connection from the FUSE
holder (or mounts anew: lazymount.py), registers every lazy snapshot of its metadata, serves
the mount (fuseserver.py) and only then the gRPC socket, so containerd never gets a lazy
snapshot's path before that path can be read. A stop (SIGTERM, SIGINT, SIGHUP; or SIGKILL)
leaves the mount to the holder: running containers wait for the next start, which resumes
the same connection, and lose nothing.

Whatever umask the process was started with, everything it creates is private to root: the
daemon runs under umask 077, its directories get explicit modes (snapshotter.py), and the
socket is bound in a private directory, made 0600 there and only then renamed into place.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import empty_pb2, timestamp_pb2

from striped_fs import make_dir

from .api.services.snapshots.v1 import snapshots_pb2 as pb
from .api.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from .api.types import mount_pb2
from .errors import ContainerdError
from .holder import HolderClient, HolderError
from .metadata import Snapshot
from .snapshotter import MountSpec, Snapshotter
from .unixsock import private_socket

log = logging.getLogger(__name__)

_KIND_NAMES = {1: "view", 2: "active", 3: "committed"}


def _mounts(specs: list[MountSpec]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, options=list(m.options)) for m in specs]


def _timestamp(ns: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def info_to_proto(snap: Snapshot) -> pb.Info:
    return pb.Info(
        name=snap.name,
        parent=snap.parent,
        kind=int(snap.kind),
        created_at=_timestamp(snap.created_ns),
        updated_at=_timestamp(snap.updated_ns),
        labels=snap.labels,
    )


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
        specs = self._call(
            context,
            f"prepare {request.key!r}",
            self.sn.prepare,
            request.key,
            request.parent,
            dict(request.labels),
        )
        return pb.PrepareSnapshotResponse(mounts=_mounts(specs))

    def View(self, request: Any, context: grpc.ServicerContext) -> Any:
        specs = self._call(
            context,
            f"view {request.key!r}",
            self.sn.view,
            request.key,
            request.parent,
            dict(request.labels),
        )
        return pb.ViewSnapshotResponse(mounts=_mounts(specs))

    def Mounts(self, request: Any, context: grpc.ServicerContext) -> Any:
        specs = self._call(context, f"mounts {request.key!r}", self.sn.mounts, request.key)
        return pb.MountsResponse(mounts=_mounts(specs))

    def Commit(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(
            context,
            f"commit {request.key!r} as {request.name!r}",
            self.sn.commit,
            request.name,
            request.key,
            dict(request.labels),
        )
        return empty_pb2.Empty()

    def Remove(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._call(context, f"remove {request.key!r}", self.sn.remove, request.key)
        return empty_pb2.Empty()

    def Stat(self, request: Any, context: grpc.ServicerContext) -> Any:
        snap = self._call(context, f"stat {request.key!r}", self.sn.stat, request.key)
        return pb.StatSnapshotResponse(info=info_to_proto(snap))

    def Update(self, request: Any, context: grpc.ServicerContext) -> Any:
        paths = list(request.update_mask.paths) if request.HasField("update_mask") else []
        snap = self._call(
            context,
            f"update {request.info.name!r}",
            self.sn.update,
            request.info.name,
            dict(request.info.labels),
            paths,
        )
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
    """Serve the snapshots API on the unix socket ``address``, mode 0600 whatever the umask
    (bound privately, then renamed into place: unixsock.private_socket)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="snapshots")
    )
    pb_grpc.add_SnapshotsServicer_to_server(SnapshotsService(snapshotter), server)
    with private_socket(address) as bound:
        if server.add_insecure_port(f"unix://{bound}") == 0:
            raise OSError(
                f"cannot listen on unix socket {bound} (for {address}; a unix "
                "socket path has at most 107 bytes)"
            )
    server.start()
    return server


def serve(
    root: str | os.PathLike,
    address: str,
    *,
    remote_options: dict[str, Any] | None = None,
    ready: threading.Event | None = None,
    holder: str | None = None,
    spawn_holder: bool = True,
    takeover_wait_s: float = 30.0,
) -> int:
    """Run the snapshotter until SIGTERM/SIGINT/SIGHUP (or an unmount of its lazy directory),
    under umask 077 (the caller's is put back after). ``holder``: the FUSE holder's socket
    (default: ``fuse-holder.sock`` beside ``address``); one is started when none runs unless
    not ``spawn_holder`` (a holder service is waited for); ``takeover_wait_s``: how long a
    predecessor still serving the root is waited for."""
    umask = os.umask(0o077)
    try:
        client = HolderClient(
            holder or default_holder(address),
            spawn=spawn_holder,
            timeout_s=10.0 if spawn_holder else 60.0,
        )
        return _serve(Path(root).resolve(), address, remote_options, ready, client, takeover_wait_s)
    finally:
        os.umask(umask)


def default_holder(address: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(address)), "fuse-holder.sock")


def _serve(
    root: Path,
    address: str,
    remote_options: dict[str, Any] | None,
    ready: threading.Event | None,
    holder: HolderClient,
    takeover_wait_s: float,
) -> int:
    from .fuseserver import FuseServer
    from .lazymount import open_lazy_mount
    from .remote import RemoteLayers
    from .views import ViewOperations

    make_dir(root, tighten=True)
    try:
        lazy = open_lazy_mount(root / "lazy", holder, wait_s=takeover_wait_s)
    except HolderError as exc:
        log.error("cannot serve %s: %s", root, exc)
        holder.close()
        return 1
    views = ViewOperations()
    views.mounted_at = lazy.conn.meta.get("mounted_at", views.mounted_at)
    try:  # every lazy snapshot is registered before the first request is read
        snapshotter = Snapshotter(
            root, remote=RemoteLayers(root / "remote", **(remote_options or {})), views=views
        )
    except BaseException:
        holder.close()
        lazy.conn.close()
        raise
    fuse = FuseServer(views, lazy.conn)
    if lazy.resumed:
        fuse.resend()
    fuse.start()
    holder.watch()
    server: grpc.Server | None = None
    try:
        server = start_grpc(snapshotter, address)
        log.info(
            "bootseer snapshotter serving %s (root %s, lazy mount %s)",
            address,
            root,
            "taken over" if lazy.resumed else "new",
        )
        if ready is not None:
            ready.set()
        _wait(fuse)
    finally:
        if server is not None:
            server.stop(grace=2).wait()
        stopped = fuse.stop()  # the requests read are answered; the holder keeps the mount
        if os.path.exists(address):
            os.unlink(address)
        snapshotter.close()
        holder.close()
        if stopped:
            lazy.conn.close()
            fuse.close()
    return 0


def _wait(fuse: Any) -> None:
    """Until a stop signal, or the end of the lazy mount's connection (an unmount)."""
    stop = threading.Event()
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            saved[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            if fuse.ended.is_set():
                log.info("the lazy mount was unmounted: stopping")
                return
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
