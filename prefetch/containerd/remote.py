"""Layers the snapshotter serves from the registry: manifests, layer indexes, one shared frame
fetcher and block cache, and the hot-block profiles of the images it serves.

Everything a lazy snapshot needs to be mounted again after a restart of the snapshotter is
kept on disk under the root: the manifest it came from (``manifests/``, named by its digest and
checked against it when read back) and the index bytes of each layer (``indexes/``), so a
restart reads no registry before it can serve a mount.

Where it reads: the registry an image reference names, through the hosts containerd's hosts
configuration gives it (``registry_config_path``, containerd's ``config_path``: mirrors first,
see :mod:`.hosts`), re-read at every pull as containerd does. What a mirror serves is checked
exactly as the registry's own bytes are (below), so a mirror can make a layer unreadable, never
different. A layer that no host can serve (unreachable, 401, 404) raises UNAVAILABLE, and the
snapshotter lets containerd unpack it.

Trust: a layer is served lazily only when the manifest (fetched by, or checked against, its
digest) marks it converted and records the digest of its index (``io.bootseer.layer.index.
digest``); an index, fetched or cached, is used only when its bytes hash to that digest. The
node's caches are keyed by verified content only: indexes by their digest, frames by their
sha256 (which the verified index lists), layers in memory by (layer digest, index digest,
registry, repository), and each layer's frames are read from the registry of the image that
named that index. A second
registry serving other bytes under the same layer digest can therefore neither replace nor
poison what another image's layer shows, now or after a restart. A converted layer whose
manifest records no index digest is not trusted: containerd unpacks it the normal way.

Profiles follow ``bootseer image record``'s rules, with containerd as the runner: the first
start of an image that has no profile records one, from its first lazy layer until a ready
signal (a container opening ``/.bootseer/ready``) or ``record_timeout_s``; the profile is kept
on this node and pushed next to the image. A start of an image with a profile prefetches it as
soon as the pull names the image, long before the container reads anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from striped_fs import make_dir

from ..cache import BlockCache
from ..fetcher import Blob, FrameFetcher
from ..image import (
    FORMAT_VALUE,
    bound_index_digest,
    find_profile,
    store_profile,
)
from ..lazyfs import Layer, LazyImage
from ..merge import LowerDir
from ..oci import Manifest
from ..profile import Profile, ProfileError, Recorder, plan_prefetch
from ..reference import Reference
from ..registry import RegistryError, RegistryUnavailable
from ..toc import LayerFormatError, LayerIndex, NotConvertedError, UnboundIndexError
from .errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from .hosts import RegistryHosts, registry_hosts
from .labels import LayerRequest

log = logging.getLogger(__name__)


@dataclass
class RemoteLayer:
    """A converted layer: where it lives, its index and its frame table."""

    digest: str
    size: int
    image_ref: str  # the reference it was first served for (registry + repository)
    manifest: str
    index_digest: str  # what the manifest records, and what the index was checked against
    index: LayerIndex
    blob: Blob

    def source(self) -> dict[str, Any]:
        """What the snapshot's metadata keeps to serve this layer again after a restart."""
        return {
            "remote": True,
            "digest": self.digest,
            "size": self.size,
            "ref": self.image_ref,
            "manifest": self.manifest,
            "index": self.index_digest,
        }


@dataclass
class _Image:
    ref: Reference
    manifest: Manifest
    layers: list[dict[str, Any]]
    profile_checked: bool = False
    recorder: Recorder | None = None
    timer: threading.Timer | None = None
    prefetched: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class RemoteLayers:
    """The registry side of the snapshotter (thread-safe: gRPC and FUSE threads call in)."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        cache_bytes: int = 64 << 30,
        connections: int = 16,
        record_timeout_s: float = 120.0,
        push_profiles: bool = True,
        prefetch: bool = True,
        registry_options: dict[str, Any] | None = None,
        registry_config_path: str | os.PathLike | None = None,
        unreadable_retry_s: float = 30.0,
    ) -> None:
        self.root = make_dir(root, tighten=True)  # 0700, and each directory in it
        for sub in ("manifests", "indexes", "profiles", "cache"):
            make_dir(self.root / sub, tighten=True)
        self.record_timeout_s = record_timeout_s
        self.push_profiles = push_profiles
        self.prefetch_enabled = prefetch
        self._registry_options = registry_options or {}
        self.registry_config_path = registry_config_path  # containerd's hosts.toml tree
        self._registries: dict[str, RegistryHosts] = {}
        self._retired: list[RegistryHosts] = []  # replaced after a hosts.toml change
        # (registry, manifest digest or reference) -> (when, why) its manifest could not be
        # read: the other layers of that pull fall back at once instead of retrying
        self._unreadable: dict[tuple[str, str], tuple[float, str]] = {}
        self.unreadable_retry_s = unreadable_retry_s
        self._images: dict[str, _Image] = {}  # manifest digest -> image
        # (layer digest, index digest, registry, repository) -> layer: a layer digest alone is
        # what a registry claims; the index digest comes from a digest-checked manifest; and
        # a registry serving the right index over the wrong frames only fails its own images
        self._layers: dict[tuple[str, str, str, str], RemoteLayer] = {}
        self._lock = threading.RLock()
        self._layer_locks: dict[tuple[str, str, str, str], threading.Lock] = {}
        self.cache = BlockCache(self.root / "cache", cache_bytes)
        self.fetcher = FrameFetcher(
            self._read_range,
            self.cache,
            connections=connections,
            on_access=self._on_access,
            retries=0,
        )
        self.saved_profiles: list[str] = []  # manifest digests whose profile was stored

    # -- registry plumbing -------------------------------------------------------------------
    def _registry(self, registry: str, *, reread_hosts: bool = False) -> RegistryHosts:
        """The registry, read through the hosts containerd's hosts.toml gives it. containerd
        reads that file at every pull, so a pull (``reread_hosts``) reads it again."""
        with self._lock:
            reg = self._registries.get(registry)
        hosts = (
            registry_hosts(self.registry_config_path, registry)
            if reg is None or reread_hosts
            else reg.hosts
        )
        with self._lock:
            reg = self._registries.get(registry)
            if reg is None or reg.hosts != hosts:
                if reg is not None:
                    self._retired.append(reg)  # reads in flight may still use it
                    log.info(
                        "registry %s: hosts now %s",
                        registry,
                        ", ".join(h.url for h in hosts) or "none",
                    )
                reg = self._registries[registry] = RegistryHosts(
                    registry, hosts, **self._registry_options
                )
            return reg

    def _read_range(self, digest: str, start: int, end: int) -> bytes:
        raise OSError(f"layer {digest} is not known to the snapshotter")  # blobs name a source

    def _blob_reader(self, ref: Reference, digest: str) -> Any:
        def read_range(start: int, end: int) -> bytes:
            return self._registry(ref.registry).get_blob_range(ref.repository, digest, start, end)

        return read_range

    # -- images and layers -------------------------------------------------------------------
    def image(self, image_ref: str, manifest_digest: str | None) -> _Image:
        """The manifest the request names (by digest when given, else resolved from the
        reference for linux/amd64), cached in memory and on disk."""
        try:
            ref = Reference.parse(image_ref)
        except ValueError as exc:
            raise InvalidArgumentError(f"image reference {image_ref!r}: {exc}") from None
        if manifest_digest is not None:
            with self._lock:
                known = self._images.get(manifest_digest)
            if known is not None:
                return known
            manifest = self._load_manifest(manifest_digest)
        else:
            manifest = None
        if manifest is None:
            manifest = self._read_manifest(ref, image_ref, manifest_digest)
            if manifest.is_index:
                raise InvalidArgumentError(
                    f"{image_ref}@{manifest.digest} is an index, not an image manifest: "
                    "label the layer with the platform's manifest digest"
                )
            self._store_manifest(manifest, image_ref)
        layers = manifest.parsed.get("layers")
        if not isinstance(layers, list):
            raise InvalidArgumentError(f"manifest {manifest.digest} of {image_ref} has no layers")
        with self._lock:
            image = self._images.setdefault(manifest.digest, _Image(ref, manifest, layers))
        return image

    def _read_manifest(
        self, ref: Reference, image_ref: str, manifest_digest: str | None
    ) -> Manifest:
        """The manifest from the registry. A failure is remembered for ``unreadable_retry_s``
        so that the other layers of the pull do not wait for the registry again: for that
        manifest, or for the whole registry when it could not be reached at all."""
        key = (ref.registry, manifest_digest or str(ref))
        now = time.monotonic()
        with self._lock:
            self._unreadable = {
                k: v for k, v in self._unreadable.items() if now - v[0] < self.unreadable_retry_s
            }
            failed = self._unreadable.get(key) or self._unreadable.get((ref.registry, ""))
        if failed is not None:
            raise UnavailableError(
                f"cannot read the manifest of {image_ref}: {failed[1]} ({now - failed[0]:.1f} s "
                f"ago; not tried again for {self.unreadable_retry_s:.0f} s)"
            )
        reg = self._registry(ref.registry, reread_hosts=True)
        try:
            manifest = (
                reg.get_manifest(ref.repository, manifest_digest)
                if manifest_digest is not None
                else reg.resolve_image(ref)
            )
        except Exception as exc:  # noqa: BLE001 - a registry error of any kind
            with self._lock:
                self._unreadable[key] = (time.monotonic(), str(exc))
                if isinstance(exc, RegistryUnavailable):  # unreachable: every image of it
                    self._unreadable[(ref.registry, "")] = self._unreadable[key]
            raise UnavailableError(f"cannot read the manifest of {image_ref}: {exc}") from None
        with self._lock:
            self._unreadable.pop(key, None)
        return manifest

    def _manifest_path(self, digest: str) -> Path:
        return self.root / "manifests" / digest.replace(":", "-")

    def _store_manifest(self, manifest: Manifest, image_ref: str) -> None:
        doc = {"media_type": manifest.media_type, "ref": image_ref, "data": manifest.data.decode()}
        _write_atomic(self._manifest_path(manifest.digest), json.dumps(doc).encode())

    def _load_manifest(self, digest: str) -> Manifest | None:
        try:
            doc = json.loads(self._manifest_path(digest).read_bytes())
            manifest = Manifest(doc["media_type"], doc["data"].encode(), digest)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if "sha256:" + hashlib.sha256(manifest.data).hexdigest() != digest:
            return None  # a damaged copy: read it from the registry again
        return manifest

    def layer(self, request: LayerRequest) -> RemoteLayer | None:
        """The converted layer the request names, or None when it is not in the bootseer
        format (then containerd unpacks it the normal way)."""
        image = self.image(request.image_ref, request.manifest_digest)
        desc = next(
            (
                d
                for d in image.layers
                if isinstance(d, dict) and d.get("digest") == request.layer_digest
            ),
            None,
        )
        if desc is None:
            raise InvalidArgumentError(
                f"layer {request.layer_digest} is not a layer of {request.image_ref} "
                f"({image.manifest.digest})"
            )
        size = desc.get("size")
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"layer {request.layer_digest}: invalid size {size!r}")
        index_digest = _index_digest(request.layer_digest, desc, image.manifest.digest)
        if index_digest is None:
            return None
        layer = self._open_layer(
            request.layer_digest, size, request.image_ref, image.manifest.digest, index_digest
        )
        self._start_image(image)
        return layer

    def marked_converted(self, request: LayerRequest) -> bool | None:
        """Whether the image the request names marks its layer converted (with an index
        digest: what this snapshotter would serve lazily); None when that cannot be told
        (the manifest cannot be read, or does not list the layer)."""
        try:
            image = self.image(request.image_ref, request.manifest_digest)
        except (UnavailableError, InvalidArgumentError):
            return None
        desc = next(
            (
                d
                for d in image.layers
                if isinstance(d, dict) and d.get("digest") == request.layer_digest
            ),
            None,
        )
        if desc is None:
            return None
        return _index_digest(request.layer_digest, desc, image.manifest.digest) is not None

    def layer_from_source(self, source: dict[str, Any]) -> RemoteLayer:
        """A layer of an existing snapshot (after a restart), from its recorded source. The
        index digest is the one recorded at Prepare (from the digest-checked manifest); a
        snapshot recorded without one takes it from that manifest, kept on disk."""
        digest, manifest = source["digest"], source["manifest"]
        index_digest = source.get("index")
        if not isinstance(index_digest, str):
            image = self.image(source["ref"], manifest)
            desc = next(
                (d for d in image.layers if isinstance(d, dict) and d.get("digest") == digest), {}
            )
            index_digest = _index_digest(digest, desc, manifest)
            if index_digest is None:
                raise FailedPreconditionError(
                    f"layer {digest} of {manifest}: no index digest "
                    "in its manifest: it cannot be served lazily"
                )
        return self._open_layer(digest, int(source["size"]), source["ref"], manifest, index_digest)

    def _open_layer(
        self, digest: str, size: int, image_ref: str, manifest: str, index_digest: str
    ) -> RemoteLayer:
        ref = Reference.parse(image_ref)
        key = (digest, index_digest, ref.registry, ref.repository)
        with self._lock:
            known = self._layers.get(key)
            if known is not None:
                return known
            lock = self._layer_locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                known = self._layers.get(key)
            if known is not None:
                return known
            read_range = self._blob_reader(ref, digest)
            try:
                index = self._index(read_range, digest, size, index_digest)
            except NotConvertedError:
                raise FailedPreconditionError(
                    f"layer {digest} of {image_ref} is annotated {FORMAT_VALUE} but has no "
                    "bootseer index: convert the image again (bootseer image convert)"
                ) from None
            except LayerFormatError as exc:
                raise FailedPreconditionError(f"layer {digest} of {image_ref}: {exc}") from None
            except (OSError, RuntimeError, RegistryError) as exc:
                raise UnavailableError(
                    f"cannot read the index of layer {digest} of {image_ref}: {exc}"
                ) from None
            layer = RemoteLayer(
                digest,
                size,
                image_ref,
                manifest,
                index_digest,
                index,
                Blob(
                    digest,
                    index.frames,
                    index_digest=index_digest,
                    check=index.verify_frame,
                    source=read_range,
                ),
            )
            with self._lock:
                self._layers[key] = layer
            return layer

    def _index_path(self, index_digest: str) -> Path:
        return self.root / "indexes" / index_digest.replace(":", "-")

    def _index(self, read_range: Any, digest: str, size: int, index_digest: str) -> LayerIndex:
        """The layer's index from ``indexes/<index digest>`` or the registry; either way its
        bytes must hash to ``index_digest`` (a cached copy that does not is dropped and read
        again; a registry's that does not is refused)."""
        path = self._index_path(index_digest)
        try:
            tail = path.read_bytes()
            if not LayerIndex.parse_tail(tail, size, digest):
                return LayerIndex.from_tail(tail, size, digest, index_digest=index_digest)
        except (OSError, LayerFormatError, ValueError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning(
                    "index cache %s: %s; reading it from the registry again", path.name, exc
                )
        tail = LayerIndex.fetch_tail(read_range, size, digest)
        index = LayerIndex.from_tail(tail, size, digest, index_digest=index_digest)
        _write_atomic(path, tail[index.toc_offset - (size - len(tail)) :])  # verified bytes only
        return index

    def lazy_image(
        self,
        layers: Iterable[RemoteLayer],
        *,
        overlay: bool,
        below: Callable[[str], LowerDir | None] | None = None,
        keep_whiteouts: bool = False,
    ) -> LazyImage:
        """The merged tree of ``layers`` (lowest first), read through the shared fetcher
        (``overlay``, ``below``, ``keep_whiteouts``: :func:`prefetch.merge.merge_layers`)."""
        return LazyImage(
            [Layer(layer.index, layer.blob) for layer in layers],
            self.fetcher,
            overlay=overlay,
            below=below,
            keep_whiteouts=keep_whiteouts,
        )

    def release(self, digest: str, index_digest: str | None = None) -> int:
        """Forget a layer no snapshot uses any more: its cached frames and index go (every
        index of the digest when ``index_digest`` is None)."""
        with self._lock:
            keys = [k for k in self._layers if k[0] == digest and index_digest in (None, k[1])]
            layers = [self._layers.pop(k) for k in keys]
            for k in keys:
                self._layer_locks.pop(k, None)
        indexes = {index_digest} if index_digest else {layer.index_digest for layer in layers}
        for value in indexes:
            self._index_path(value).unlink(missing_ok=True)
        return sum(self.cache.discard(f.sha256 for f in layer.index.frames) for layer in layers)

    # -- profiles ----------------------------------------------------------------------------
    def _start_image(self, image: _Image) -> None:
        """On an image's first lazy layer: prefetch its profile, or start recording one."""
        with image.lock:
            if image.profile_checked:
                return
            image.profile_checked = True
        threading.Thread(
            target=self._profile_or_record,
            args=(image,),
            daemon=True,
            name=f"profile-{image.manifest.digest[7:19]}",
        ).start()

    def _profile_or_record(self, image: _Image) -> None:
        profile = self._local_profile(image.manifest.digest) if self.prefetch_enabled else None
        if profile is None and self.prefetch_enabled:
            reg = self._registry(image.ref.registry)
            profile = find_profile(reg, image.ref.repository, image.manifest)
        if profile is not None:
            self._prefetch(image, profile)
            return
        recorder = Recorder(image.manifest.digest)
        timer = threading.Timer(self.record_timeout_s, self._finish_recording, (image, "timeout"))
        timer.daemon = True
        with image.lock:
            image.recorder, image.timer = recorder, timer
        timer.start()
        log.info(
            "recording the start of %s (%s) until ready or %.0f s",
            image.ref,
            image.manifest.digest[:19],
            self.record_timeout_s,
        )

    def _prefetch(self, image: _Image, profile: Profile) -> None:
        blobs = []
        for desc in image.layers:
            digest = desc.get("digest")
            try:
                index_digest = _index_digest(digest, desc, image.manifest.digest)
                if index_digest is None:
                    continue  # unpacked the normal way: nothing to prefetch
                layer = self._open_layer(
                    digest,
                    int(desc.get("size", 0)),
                    str(image.ref),
                    image.manifest.digest,
                    index_digest,
                )
            except Exception as exc:  # noqa: BLE001 - prefetch is an optimization
                log.warning("prefetch of %s: layer %s skipped: %s", image.ref, digest, exc)
                continue
            blobs.append(layer.blob)
        plan, full = plan_prefetch(profile, blobs)
        queued = self.fetcher.prefetch(plan)
        image.prefetched = queued
        log.info(
            "prefetching %d frames of %s (profile of %d frames%s)",
            queued,
            image.ref,
            len(profile.frames),
            ", then the rest" if full else "",
        )

    def _on_access(self, blob: Blob, frame: int, t: float) -> None:
        with self._lock:
            images = list(self._images.values())
        for image in images:
            recorder = image.recorder
            if recorder is not None and any(d.get("digest") == blob.digest for d in image.layers):
                recorder(blob, frame, t)

    def ready(self, digests: Iterable[str]) -> int:
        """A container of an image holding these layers said it is ready: finish the
        recordings of those images (returns how many were finished)."""
        wanted = set(digests)
        with self._lock:
            images = [
                i
                for i in self._images.values()
                if i.recorder is not None and any(d.get("digest") in wanted for d in i.layers)
            ]
        for image in images:
            threading.Thread(
                target=self._finish_recording, args=(image, "ready"), daemon=True
            ).start()
        return len(images)

    def _finish_recording(self, image: _Image, why: str) -> None:
        with image.lock:
            recorder, timer = image.recorder, image.timer
            image.recorder = image.timer = None
        if recorder is None:
            return
        if timer is not None:
            timer.cancel()
        profile = recorder.stop()
        log.info(
            "recorded %d frames of %s (%s after %.1f s)",
            len(profile.frames),
            image.ref,
            why,
            profile.duration_s,
        )
        if not profile.frames:
            return
        _write_atomic(self._profile_path(image.manifest.digest), profile.to_bytes())
        if self.push_profiles:
            try:
                reg = self._registry(image.ref.registry)
                store_profile(reg, image.ref.repository, image.manifest, profile)
            except Exception as exc:  # noqa: BLE001 - the local copy still serves this node
                log.warning("could not push the profile of %s: %s", image.ref, exc)
        with self._lock:
            self.saved_profiles.append(image.manifest.digest)

    def _profile_path(self, digest: str) -> Path:
        return self.root / "profiles" / (digest.replace(":", "-") + ".json")

    def _local_profile(self, digest: str) -> Profile | None:
        try:
            profile = Profile.from_bytes(self._profile_path(digest).read_bytes())
        except (OSError, ProfileError):
            return None
        return profile if profile.image == digest else None

    def recording(self, manifest_digest: str) -> bool:
        with self._lock:
            image = self._images.get(manifest_digest)
        return image is not None and image.recorder is not None

    def close(self) -> None:
        with self._lock:
            images = list(self._images.values())
            registries = [*self._registries.values(), *self._retired]
            self._registries.clear()
            self._retired.clear()
        for image in images:
            if image.timer is not None:
                image.timer.cancel()
        self.fetcher.close()
        for reg in registries:
            reg.close()


def _index_digest(layer: str, desc: dict[str, Any], manifest: str) -> str | None:
    """The index digest a layer descriptor records, or None when the layer is not to be served
    lazily: not marked converted, or converted without a (well-formed) index digest, which is
    never trusted (logged; containerd unpacks it the normal way, checking its digest)."""
    try:
        return bound_index_digest(layer, desc.get("annotations"))
    except NotConvertedError:
        return None
    except UnboundIndexError as exc:
        log.warning("manifest %s: %s; unpacking it the normal way", manifest, exc)
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
