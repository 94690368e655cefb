"""A synchronous containerd client over gRPC on containerd's unix socket.

It speaks the project's own API definitions (``prefetch.containerd.api``) and covers what
bootseer needs to put images into containerd and to unpack layers: namespaces, content, images,
leases, snapshots (through containerd's snapshots service, so the ``snapshotter`` argument picks
a built-in plugin such as ``overlayfs`` or a proxy plugin such as ``bootseer``) and diff apply.

Every call carries the namespace in the ``containerd-namespace`` metadata header and, on a
client from :meth:`ContainerdClient.with_lease`, a lease in ``containerd-lease``: content and
snapshots created under a lease survive garbage collection until the lease goes. gRPC failures
are raised as :mod:`prefetch.containerd.errors` classes naming the call and the object.

The dataclasses and the ``*_to_proto``/``*_from_proto`` helpers are shared with the proxy
snapshotter, which serves the same messages.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self, TypeVar

import grpc
from google.protobuf import empty_pb2, field_mask_pb2, timestamp_pb2

from . import errors
from .api.services.content.v1 import content_pb2, content_pb2_grpc
from .api.services.diff.v1 import diff_pb2, diff_pb2_grpc
from .api.services.images.v1 import images_pb2, images_pb2_grpc
from .api.services.leases.v1 import leases_pb2, leases_pb2_grpc
from .api.services.namespaces.v1 import namespace_pb2, namespace_pb2_grpc
from .api.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc
from .api.services.version.v1 import version_pb2_grpc
from .api.types import descriptor_pb2, mount_pb2

NAMESPACE_HEADER = "containerd-namespace"
LEASE_HEADER = "containerd-lease"
GC_EXPIRE_LABEL = "containerd.io/gc.expire"
# Write chunks stay well under gRPC's and containerd's 16 MiB message limits.
CHUNK_SIZE = 1 << 20
_MAX_MESSAGE = 16 << 20

_T = TypeVar("_T")


# -- records and their proto forms ----------------------------------------------------------


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor (``containerd.types.Descriptor``)."""

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Mount:
    """One mount(2) call (``containerd.types.Mount``); ``options`` is stored as a tuple."""

    type: str
    source: str
    options: Sequence[str] = ()
    target: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(self.options))


@dataclass
class SnapshotInfo:
    """A snapshot's metadata; ``kind`` is "view", "active", "committed" (or "unknown")."""

    name: str
    parent: str = ""
    kind: str = "unknown"
    labels: dict[str, str] = field(default_factory=dict)
    created: dt.datetime | None = None
    updated: dt.datetime | None = None


@dataclass
class ImageRecord:
    """An image in containerd's image store: a name pointing at a descriptor."""

    name: str
    target: Descriptor
    labels: dict[str, str] = field(default_factory=dict)
    created: dt.datetime | None = None
    updated: dt.datetime | None = None


class ContentInfo(NamedTuple):
    """A committed blob; unpacks as ``digest, size, labels``."""

    digest: str
    size: int
    labels: dict[str, str]


@dataclass
class LeaseInfo:
    id: str
    labels: dict[str, str] = field(default_factory=dict)
    created: dt.datetime | None = None


_KIND_TO_PROTO = {
    "unknown": snapshots_pb2.UNKNOWN,
    "view": snapshots_pb2.VIEW,
    "active": snapshots_pb2.ACTIVE,
    "committed": snapshots_pb2.COMMITTED,
}
_KIND_FROM_PROTO = {v: k for k, v in _KIND_TO_PROTO.items()}


def time_from_proto(ts: timestamp_pb2.Timestamp, present: bool = True) -> dt.datetime | None:
    """An aware UTC datetime, or None for an unset timestamp."""
    return ts.ToDatetime(tzinfo=dt.UTC) if present else None


def time_to_proto(when: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if when is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(when if when.tzinfo else when.replace(tzinfo=dt.UTC))
    return ts


def mount_to_proto(m: Mount) -> mount_pb2.Mount:
    return mount_pb2.Mount(type=m.type, source=m.source, target=m.target, options=m.options)


def mount_from_proto(p: mount_pb2.Mount) -> Mount:
    return Mount(type=p.type, source=p.source, options=tuple(p.options), target=p.target)


def descriptor_to_proto(d: Descriptor) -> descriptor_pb2.Descriptor:
    return descriptor_pb2.Descriptor(
        media_type=d.media_type, digest=d.digest, size=d.size, annotations=dict(d.annotations)
    )


def descriptor_from_proto(p: descriptor_pb2.Descriptor) -> Descriptor:
    return Descriptor(
        media_type=p.media_type, digest=p.digest, size=p.size, annotations=dict(p.annotations)
    )


def info_to_proto(info: SnapshotInfo) -> snapshots_pb2.Info:
    """A snapshot Info message; an unknown kind string raises KeyError."""
    return snapshots_pb2.Info(
        name=info.name,
        parent=info.parent,
        kind=_KIND_TO_PROTO[info.kind],
        labels=info.labels,
        created_at=time_to_proto(info.created),
        updated_at=time_to_proto(info.updated),
    )


def info_from_proto(p: snapshots_pb2.Info) -> SnapshotInfo:
    return SnapshotInfo(
        name=p.name,
        parent=p.parent,
        kind=_KIND_FROM_PROTO.get(p.kind, "unknown"),
        labels=dict(p.labels),
        created=time_from_proto(p.created_at, p.HasField("created_at")),
        updated=time_from_proto(p.updated_at, p.HasField("updated_at")),
    )


def image_from_proto(p: images_pb2.Image) -> ImageRecord:
    return ImageRecord(
        name=p.name,
        target=descriptor_from_proto(p.target),
        labels=dict(p.labels),
        created=time_from_proto(p.created_at, p.HasField("created_at")),
        updated=time_from_proto(p.updated_at, p.HasField("updated_at")),
    )


def label_mask(labels: Mapping[str, str]) -> field_mask_pb2.FieldMask:
    """A mask that sets exactly these labels (containerd drops a label set to "")."""
    return field_mask_pb2.FieldMask(paths=[f"labels.{k}" for k in labels])


def rfc3339(when: dt.datetime) -> str:
    """The form containerd parses in ``containerd.io/gc.expire`` (Go's time.RFC3339)."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- the client -------------------------------------------------------------------------------


def dial(address: str) -> grpc.Channel:
    """A channel to containerd's socket: a path, or a ``unix://`` target."""
    target = address if address.startswith("unix:") else "unix://" + address
    return grpc.insecure_channel(
        target,
        options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
        ],
    )


def _error(what: str, exc: grpc.RpcError) -> errors.ContainerdError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return errors.from_status(code, f"{what}: {details}")


def unary(
    what: str,
    method: Callable[..., _T],
    request: Any,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]] = (),
) -> _T:
    """One unary call; a gRPC failure is raised as its :mod:`errors` class, naming ``what``."""
    try:
        return method(request, metadata=metadata, timeout=timeout_s)
    except grpc.RpcError as exc:
        raise _error(what, exc) from exc


class ContainerdClient:
    """containerd's API in one namespace (and optionally under one lease)."""

    def __init__(
        self,
        address: str,
        namespace: str = "default",
        *,
        lease: str | None = None,
        timeout_s: float = 120.0,
        channel: grpc.Channel | None = None,
    ) -> None:
        """``channel``: share an open channel (then :meth:`close` leaves it open)."""
        self.address = address
        self.namespace = namespace
        self.lease_id = lease
        self.timeout_s = timeout_s
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else dial(address)
        self._metadata: tuple[tuple[str, str], ...] = ((NAMESPACE_HEADER, namespace),)
        if lease:
            self._metadata += ((LEASE_HEADER, lease),)
        self._version = version_pb2_grpc.VersionStub(self._channel)
        self._namespaces = namespace_pb2_grpc.NamespacesStub(self._channel)
        self._content = content_pb2_grpc.ContentStub(self._channel)
        self._images = images_pb2_grpc.ImagesStub(self._channel)
        self._leases = leases_pb2_grpc.LeasesStub(self._channel)
        self._snapshots = snapshots_pb2_grpc.SnapshotsStub(self._channel)
        self._diff = diff_pb2_grpc.DiffStub(self._channel)

    def with_lease(self, lease_id: str | None) -> ContainerdClient:
        """A client on the same channel whose calls run under ``lease_id`` (None: no lease)."""
        return ContainerdClient(
            self.address,
            self.namespace,
            lease=lease_id,
            timeout_s=self.timeout_s,
            channel=self._channel,
        )

    def with_namespace(self, namespace: str) -> ContainerdClient:
        """A client on the same channel for another namespace (same lease)."""
        return ContainerdClient(
            self.address,
            namespace,
            lease=self.lease_id,
            timeout_s=self.timeout_s,
            channel=self._channel,
        )

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self, what: str, method: Callable[..., _T], request: Any, timeout_s: float | None = None
    ) -> _T:
        """One unary call with this client's headers and deadline, errors converted."""
        return unary(
            what,
            method,
            request,
            self.timeout_s if timeout_s is None else timeout_s,
            self._metadata,
        )

    def _stream(
        self,
        what: str,
        method: Callable[..., Iterable[_T]],
        request: Any,
        timeout_s: float | None = None,
    ) -> list[_T]:
        """All messages of a server-streaming call, errors converted."""
        try:
            return list(
                method(
                    request,
                    metadata=self._metadata,
                    timeout=self.timeout_s if timeout_s is None else timeout_s,
                )
            )
        except grpc.RpcError as exc:
            raise _error(what, exc) from exc

    # -- version and namespaces -----------------------------------------------------------

    def version(self) -> tuple[str, str]:
        """(version, revision) of the daemon, e.g. ("1.6.20", "...")."""
        resp = self._call("version", self._version.Version, empty_pb2.Empty())
        return resp.version, resp.revision

    def ensure_namespace(self, name: str | None = None) -> None:
        """Creates the namespace (default: this client's) unless it exists."""
        name = name or self.namespace
        req = namespace_pb2.CreateNamespaceRequest(namespace=namespace_pb2.Namespace(name=name))
        try:
            self._call(f"create namespace {name}", self._namespaces.Create, req)
        except errors.AlreadyExistsError:
            pass

    def list_namespaces(self) -> list[str]:
        resp = self._call(
            "list namespaces", self._namespaces.List, namespace_pb2.ListNamespacesRequest()
        )
        return [ns.name for ns in resp.namespaces]

    # -- content ----------------------------------------------------------------------------

    def content_info(self, digest: str) -> ContentInfo:
        """Size and labels of a committed blob; NotFoundError when absent."""
        resp = self._call(
            f"content info {digest}", self._content.Info, content_pb2.InfoRequest(digest=digest)
        )
        return ContentInfo(resp.info.digest, resp.info.size, dict(resp.info.labels))

    def list_content(self, *filters: str) -> list[ContentInfo]:
        resps = self._stream(
            "list content", self._content.List, content_pb2.ListContentRequest(filters=filters)
        )
        return [ContentInfo(i.digest, i.size, dict(i.labels)) for r in resps for i in r.info]

    def write_content(
        self,
        data: bytes | Iterable[bytes],
        *,
        digest: str,
        size: int,
        labels: Mapping[str, str] | None = None,
        ref: str | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Stores a blob whose digest and size are known in advance; containerd verifies both.

        Returns False when the blob already existed (``labels`` are then set with an update).
        Any other failure, such as a digest mismatch (FailedPreconditionError), aborts the
        ingest so that nothing is left behind. ``timeout_s`` bounds the whole stream (default:
        the client's); ``data`` may be a lazy iterable, e.g. a download.
        """
        ref = ref or f"bootseer-{digest}"
        what = f"write content {digest} (ref {ref})"
        source_error: list[BaseException] = []

        def requests() -> Iterator[content_pb2.WriteContentRequest]:
            # The first message names the ref and the expectations (containerd checks then that
            # the blob is not there yet); every message is answered; COMMIT verifies and ends.
            offset, first = 0, True
            try:
                for chunk in _chunks(data):
                    yield content_pb2.WriteContentRequest(
                        action=content_pb2.WRITE,
                        ref=ref,
                        total=size,
                        offset=offset,
                        data=chunk,
                        expected=digest if first else "",
                    )
                    offset += len(chunk)
                    first = False
            except Exception as exc:  # surfaced after the call, instead of a bare CANCELLED
                source_error.append(exc)
                return
            yield content_pb2.WriteContentRequest(
                action=content_pb2.COMMIT,
                ref=ref,
                total=size,
                expected=digest,
                offset=offset,
                labels=dict(labels or {}),
            )

        try:
            answers = list(
                self._content.Write(  # one small answer per message
                    requests(),
                    metadata=self._metadata,
                    timeout=self.timeout_s if timeout_s is None else timeout_s,
                )
            )
        except grpc.RpcError as exc:
            err = _error(what, exc)
            if isinstance(err, errors.AlreadyExistsError):
                if labels:
                    self.update_content_labels(digest, labels)
                return False
            self._abort_quietly(ref)
            if source_error:
                raise source_error[0] from err
            raise err from exc
        if source_error:  # the stream ended early without containerd noticing
            self._abort_quietly(ref)
            raise source_error[0]
        if not answers or answers[-1].action != content_pb2.COMMIT:
            self._abort_quietly(ref)
            raise errors.ContainerdError(f"{what}: stream ended before the commit was answered")
        return True

    def _abort_quietly(self, ref: str) -> None:
        try:
            self._call(
                f"abort ingest {ref}", self._content.Abort, content_pb2.AbortRequest(ref=ref)
            )
        except errors.ContainerdError:
            pass  # nothing to abort (already gone) or the daemon is unreachable

    def ingest_refs(self) -> list[str]:
        """Refs of unfinished ingests (what a failed write could leave behind)."""
        resp = self._call(
            "list ingests", self._content.ListStatuses, content_pb2.ListStatusesRequest()
        )
        return [s.ref for s in resp.statuses]

    def update_content_labels(self, digest: str, labels: Mapping[str, str]) -> None:
        """Sets these labels on a blob, leaving others; a value of "" removes a label."""
        req = content_pb2.UpdateRequest(
            info=content_pb2.Info(digest=digest, labels=labels), update_mask=label_mask(labels)
        )
        self._call(f"update content labels {digest}", self._content.Update, req)

    def read_content(
        self, digest: str, *, offset: int = 0, size: int = 0, timeout_s: float | None = None
    ) -> bytes:
        """The blob's bytes (``size`` 0: to the end)."""
        req = content_pb2.ReadContentRequest(digest=digest, offset=offset, size=size)
        resps = self._stream(f"read content {digest}", self._content.Read, req, timeout_s)
        return b"".join(r.data for r in resps)

    def delete_content(self, digest: str) -> None:
        self._call(
            f"delete content {digest}",
            self._content.Delete,
            content_pb2.DeleteContentRequest(digest=digest),
        )

    # -- images -----------------------------------------------------------------------------

    def put_image(
        self, name: str, target: Descriptor, labels: Mapping[str, str] | None = None
    ) -> None:
        """Creates the image, or points an existing one at ``target`` (and replaces its labels
        when ``labels`` is given)."""
        image = images_pb2.Image(
            name=name, target=descriptor_to_proto(target), labels=dict(labels or {})
        )
        try:
            self._call(
                f"create image {name}",
                self._images.Create,
                images_pb2.CreateImageRequest(image=image),
            )
            return
        except errors.AlreadyExistsError:
            pass
        paths = ["target"] + (["labels"] if labels is not None else [])
        self._call(
            f"update image {name}",
            self._images.Update,
            images_pb2.UpdateImageRequest(
                image=image, update_mask=field_mask_pb2.FieldMask(paths=paths)
            ),
        )

    def get_image(self, name: str) -> ImageRecord:
        resp = self._call(
            f"get image {name}", self._images.Get, images_pb2.GetImageRequest(name=name)
        )
        return image_from_proto(resp.image)

    def list_images(self, *filters: str) -> list[ImageRecord]:
        """Images matching any of the filters (containerd syntax, e.g. ``name==x``)."""
        resp = self._call(
            "list images", self._images.List, images_pb2.ListImagesRequest(filters=filters)
        )
        return [image_from_proto(i) for i in resp.images]

    def delete_image(self, name: str, *, sync: bool = False) -> None:
        """``sync``: containerd garbage-collects before answering."""
        self._call(
            f"delete image {name}",
            self._images.Delete,
            images_pb2.DeleteImageRequest(name=name, sync=sync),
        )

    # -- leases -----------------------------------------------------------------------------

    def create_lease(
        self,
        *,
        expire_s: float | None = 3600,
        labels: Mapping[str, str] | None = None,
        lease_id: str | None = None,
    ) -> str:
        """A new lease (random id unless given) that expires after ``expire_s`` (None: never),
        so that a crashed process does not pin its objects forever."""
        all_labels = dict(labels or {})
        if expire_s is not None:
            expiry = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=expire_s)
            all_labels[GC_EXPIRE_LABEL] = rfc3339(expiry)
        req = leases_pb2.CreateRequest(
            id=lease_id or f"bootseer-{secrets.token_hex(8)}", labels=all_labels
        )
        resp = self._call(f"create lease {req.id}", self._leases.Create, req)
        return resp.lease.id

    def delete_lease(self, lease_id: str, *, sync: bool = False) -> None:
        """Releases the lease's objects to garbage collection (``sync``: collect now)."""
        self._call(
            f"delete lease {lease_id}",
            self._leases.Delete,
            leases_pb2.DeleteRequest(id=lease_id, sync=sync),
        )

    def list_leases(self, *filters: str) -> list[LeaseInfo]:
        resp = self._call("list leases", self._leases.List, leases_pb2.ListRequest(filters=filters))
        return [
            LeaseInfo(
                id=le.id,
                labels=dict(le.labels),
                created=time_from_proto(le.created_at, le.HasField("created_at")),
            )
            for le in resp.leases
        ]

    @contextmanager
    def lease(
        self, expire_s: float | None = 3600, *, sync: bool = False
    ) -> Iterator[ContainerdClient]:
        """A client working under a fresh lease, which is deleted on exit (what is still
        needed must be referenced by then, e.g. by an image or a committed snapshot's use)."""
        lease_id = self.create_lease(expire_s=expire_s)
        try:
            yield self.with_lease(lease_id)
        finally:
            try:
                self.delete_lease(lease_id, sync=sync)
            except errors.NotFoundError:
                pass

    # -- snapshots --------------------------------------------------------------------------

    def prepare_snapshot(
        self, snapshotter: str, key: str, parent: str = "", labels: Mapping[str, str] | None = None
    ) -> list[Mount]:
        """An active snapshot on ``parent`` (empty: none); returns the mounts to use it."""
        req = snapshots_pb2.PrepareSnapshotRequest(
            snapshotter=snapshotter, key=key, parent=parent, labels=dict(labels or {})
        )
        resp = self._call(f"prepare snapshot {key} ({snapshotter})", self._snapshots.Prepare, req)
        return [mount_from_proto(m) for m in resp.mounts]

    def view_snapshot(
        self, snapshotter: str, key: str, parent: str = "", labels: Mapping[str, str] | None = None
    ) -> list[Mount]:
        """A read-only view of ``parent``; returns its mounts."""
        req = snapshots_pb2.ViewSnapshotRequest(
            snapshotter=snapshotter, key=key, parent=parent, labels=dict(labels or {})
        )
        resp = self._call(f"view snapshot {key} ({snapshotter})", self._snapshots.View, req)
        return [mount_from_proto(m) for m in resp.mounts]

    def snapshot_mounts(self, snapshotter: str, key: str) -> list[Mount]:
        req = snapshots_pb2.MountsRequest(snapshotter=snapshotter, key=key)
        resp = self._call(f"snapshot mounts {key} ({snapshotter})", self._snapshots.Mounts, req)
        return [mount_from_proto(m) for m in resp.mounts]

    def commit_snapshot(
        self, snapshotter: str, name: str, key: str, labels: Mapping[str, str] | None = None
    ) -> None:
        """Turns active snapshot ``key`` into committed snapshot ``name``."""
        req = snapshots_pb2.CommitSnapshotRequest(
            snapshotter=snapshotter, name=name, key=key, labels=dict(labels or {})
        )
        self._call(f"commit snapshot {key} as {name} ({snapshotter})", self._snapshots.Commit, req)

    def remove_snapshot(self, snapshotter: str, key: str) -> None:
        req = snapshots_pb2.RemoveSnapshotRequest(snapshotter=snapshotter, key=key)
        self._call(f"remove snapshot {key} ({snapshotter})", self._snapshots.Remove, req)

    def stat_snapshot(self, snapshotter: str, key: str) -> SnapshotInfo:
        req = snapshots_pb2.StatSnapshotRequest(snapshotter=snapshotter, key=key)
        resp = self._call(f"stat snapshot {key} ({snapshotter})", self._snapshots.Stat, req)
        return info_from_proto(resp.info)

    def update_snapshot_labels(
        self,
        snapshotter: str,
        key: str,
        labels: Mapping[str, str],
        *,
        timeout_s: float | None = None,
    ) -> SnapshotInfo:
        """Sets these labels, leaving others; a value of "" removes a label."""
        req = snapshots_pb2.UpdateSnapshotRequest(
            snapshotter=snapshotter,
            info=snapshots_pb2.Info(name=key, labels=labels),
            update_mask=label_mask(labels),
        )
        resp = self._call(
            f"update snapshot labels {key} ({snapshotter})", self._snapshots.Update, req, timeout_s
        )
        return info_from_proto(resp.info)

    def list_snapshots(self, snapshotter: str, *filters: str) -> list[SnapshotInfo]:
        """Snapshots matching any of the filters (e.g. ``name==x``, ``labels."k"==v``)."""
        req = snapshots_pb2.ListSnapshotsRequest(snapshotter=snapshotter, filters=filters)
        resps = self._stream(f"list snapshots ({snapshotter})", self._snapshots.List, req)
        return [info_from_proto(i) for r in resps for i in r.info]

    def snapshot_usage(self, snapshotter: str, key: str) -> tuple[int, int]:
        """(bytes, inodes) used by the snapshot's own layer."""
        req = snapshots_pb2.UsageRequest(snapshotter=snapshotter, key=key)
        resp = self._call(f"snapshot usage {key} ({snapshotter})", self._snapshots.Usage, req)
        return resp.size, resp.inodes

    def cleanup_snapshots(self, snapshotter: str) -> bool:
        """Asks the snapshotter to free the space of removed snapshots; False when it does not
        implement Cleanup (containerd 1.6 answers so for its built-in snapshotters, whose
        space its garbage collector frees)."""
        try:
            self._call(
                f"cleanup snapshots ({snapshotter})",
                self._snapshots.Cleanup,
                snapshots_pb2.CleanupRequest(snapshotter=snapshotter),
            )
        except errors.ContainerdError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
        return True

    # -- diff -------------------------------------------------------------------------------

    def apply_diff(
        self, layer: Descriptor, mounts: Sequence[Mount], *, timeout_s: float | None = None
    ) -> Descriptor:
        """Unpacks ``layer`` (from the content store) onto ``mounts``, which containerd mounts
        itself; returns the uncompressed layer's descriptor (its digest is the diff ID)."""
        req = diff_pb2.ApplyRequest(
            diff=descriptor_to_proto(layer), mounts=[mount_to_proto(m) for m in mounts]
        )
        resp = self._call(f"apply layer {layer.digest}", self._diff.Apply, req, timeout_s)
        return descriptor_from_proto(resp.applied)

    def create_diff(
        self,
        left: Sequence[Mount],
        right: Sequence[Mount],
        *,
        media_type: str = "",
        ref: str = "",
        labels: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Descriptor:
        """Writes the changes of ``right`` over ``left`` into the content store as a layer."""
        req = diff_pb2.DiffRequest(
            left=[mount_to_proto(m) for m in left],
            right=[mount_to_proto(m) for m in right],
            media_type=media_type,
            ref=ref,
            labels=dict(labels or {}),
        )
        resp = self._call("create diff", self._diff.Diff, req, timeout_s)
        return descriptor_from_proto(resp.diff)


def _chunks(data: bytes | Iterable[bytes]) -> Iterator[bytes]:
    """The data in pieces of at most CHUNK_SIZE bytes (empty pieces dropped)."""
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    for piece in pieces:
        view = memoryview(piece)
        for start in range(0, len(view), CHUNK_SIZE):
            yield bytes(view[start : start + CHUNK_SIZE])
