"""Images in the registry: convert them to the seekable format, open them lazily, and keep
their hot-block profiles next to them.

* :func:`convert_image` pulls ``SRC`` (gzip or zstd layers), rewrites every layer into the
  seekable format (the tar bytes, hence the diff_ids and the config, are unchanged), pushes
  the layers, the config and an OCI manifest annotated with the format and the source digest;
  each layer descriptor carries the digest of its index (:data:`INDEX_ANNOTATION`), which
  binds the index to the manifest's digest. Every TOC is derived from the tar stream: a source
  layer already in the format is converted again from its tar, never copied. Converting again
  is a no-op when ``DST`` already holds the conversion of the same source.
* :func:`open_image` resolves a converted image and reads each layer's TOC from the blob's
  tail, refusing an index that does not match the digest its manifest records (or a converted
  layer without one): the lazy root filesystem's metadata, with no layer downloaded.
* Profiles are OCI artifacts whose ``subject`` is the image manifest (the referrers API, or
  its tag-schema fallback on registries without it, such as distribution 2.8).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import BlockCache
from .fetcher import Blob, FrameFetcher
from .layer import convert_layer_blob
from .lazyfs import Layer, LazyImage
from .mediatypes import OCI_LAYER_ZSTD, OCI_MANIFEST
from .profile import ARTIFACT_TYPE, Profile, ProfileError, Recorder
from .reference import Reference
from .registry import SyncRegistry
from .toc import INDEX_ANNOTATION, LayerIndex, NotConvertedError, UnboundIndexError

log = logging.getLogger(__name__)

FORMAT_ANNOTATION = "io.bootseer.layer.format"
FORMAT_VALUE = "seekable-zstd/1"
SOURCE_ANNOTATION = "io.bootseer.converted-from"
TOC_OFFSET_ANNOTATION = "io.bootseer.toc.offset"
PROFILE_MEDIA_TYPE = "application/vnd.bootseer.profile.v1+json"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass
class ConvertImageResult:
    source: str
    destination: str
    digest: str  # the converted manifest's digest
    layers: int
    size_before: int
    size_after: int
    converted: bool  # False: DST already held this conversion
    seconds: float = 0.0


def _registry(ref: Reference, **kwargs: Any) -> SyncRegistry:
    return SyncRegistry(ref.registry, **kwargs)


async def _file_chunks(path: str, size: int = 8 << 20) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def convert_image(
    src: str,
    dst: str,
    *,
    platform: str = "linux/amd64",
    workdir: str | None = None,
    **convert_options: Any,
) -> ConvertImageResult:
    """Convert image ``src`` into ``dst`` (see the module docstring)."""
    import time

    started = time.perf_counter()
    src_ref, dst_ref = Reference.parse(src), Reference.parse(dst)
    with _registry(src_ref) as src_reg, _registry(dst_ref) as dst_reg:
        manifest = src_reg.resolve_image(src_ref, platform)
        doc = manifest.parsed
        before = sum(d.size for d in manifest.layers)
        existing = _existing_conversion(dst_reg, dst_ref, manifest.digest)
        if existing is not None:
            log.info("%s already holds the conversion of %s", dst, manifest.digest)
            after = sum(d.size for d in existing.layers)
            return ConvertImageResult(
                src,
                dst,
                existing.digest,
                len(existing.layers),
                before,
                after,
                False,
                time.perf_counter() - started,
            )
        config = manifest.config
        config_bytes = src_reg.get_blob(src_ref.repository, config.digest)
        dst_reg.put_blob(dst_ref.repository, config_bytes, config.digest)
        layers = []
        for n, layer in enumerate(manifest.layers):
            # A layer already in the format is converted again from its tar stream like any
            # other: its TOC is derived here, never copied (the TOC it carries could point a
            # name at another member's bytes).
            with tempfile.TemporaryDirectory(dir=workdir, prefix="bootseer-convert-") as tmp:
                raw_path = os.path.join(tmp, "layer.in")
                with open(raw_path, "wb") as f:
                    for chunk in src_reg.iter_blob(src_ref.repository, layer.digest):
                        f.write(chunk)
                out_path = os.path.join(tmp, "layer.out")
                with open(raw_path, "rb") as blob_in, open(out_path, "wb") as out:
                    result = convert_layer_blob(blob_in, layer.media_type, out, **convert_options)
                dst_reg.put_blob(dst_ref.repository, _file_chunks(out_path), result.digest)
            log.info(
                "layer %d/%d %s: %d -> %d bytes, %d frames",
                n + 1,
                len(manifest.layers),
                layer.digest[:19],
                layer.size,
                result.size,
                result.frames,
            )
            layers.append(
                {
                    "mediaType": OCI_LAYER_ZSTD,
                    "digest": result.digest,
                    "size": result.size,
                    "annotations": {
                        FORMAT_ANNOTATION: FORMAT_VALUE,
                        TOC_OFFSET_ANNOTATION: str(result.toc_offset),
                        INDEX_ANNOTATION: result.index_digest,
                    },
                }
            )
        new = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": config.media_type,
                "digest": config.digest,
                "size": config.size,
            },
            "layers": layers,
            "annotations": {
                **(doc.get("annotations") or {}),
                FORMAT_ANNOTATION: FORMAT_VALUE,
                SOURCE_ANNOTATION: manifest.digest,
            },
        }
        data = json.dumps(new, separators=(",", ":")).encode()
        digest = dst_reg.put_manifest(dst_ref.repository, dst_ref.ref, data, OCI_MANIFEST)
        after = sum(int(layer["size"]) for layer in layers)
    return ConvertImageResult(
        src, dst, digest, len(layers), before, after, True, time.perf_counter() - started
    )


def _existing_conversion(reg: SyncRegistry, ref: Reference, source_digest: str) -> Any:
    try:
        current = reg.resolve_image(ref)
    except Exception:  # noqa: BLE001 - absent (or unreadable): convert
        return None
    annotations = current.parsed.get("annotations") or {}
    if annotations.get(SOURCE_ANNOTATION) != source_digest:
        return None
    if not all(INDEX_ANNOTATION in (d.annotations or {}) for d in current.layers):
        return None  # converted before indexes were bound to the manifest: convert again
    return current


@dataclass
class OpenImage:
    """A lazily opened image: its registry, manifest, layers and the lazy tree."""

    reference: Reference
    registry: SyncRegistry
    manifest: Any
    lazy: LazyImage
    blobs: list[Blob] = field(default_factory=list)

    def close(self) -> None:
        self.lazy.fetcher.close()
        self.registry.close()


def open_image(
    reference: str,
    cache_dir: str | os.PathLike,
    *,
    platform: str = "linux/amd64",
    connections: int = 16,
    cache_bytes: int = 16 << 30,
    record: bool = False,
    registry_options: dict[str, Any] | None = None,
) -> OpenImage:
    """Resolve a converted image and build its lazy tree from the layers' TOCs."""
    ref = Reference.parse(reference)
    reg = _registry(ref, **(registry_options or {}))
    try:
        manifest = reg.resolve_image(ref, platform)
        repo = ref.repository
        layers: list[Layer] = []
        blobs: list[Blob] = []
        for i, desc in enumerate(manifest.layers):

            def read_range(start: int, end: int, digest: str = desc.digest) -> bytes:
                return reg.get_blob_range(repo, digest, start, end)

            index_digest = bound_index_digest(desc.digest, desc.annotations)
            index = LayerIndex.from_blob(
                read_range, desc.size, desc.digest, index_digest=index_digest
            )
            blob = Blob(desc.digest, index.frames, i, index_digest)
            blobs.append(blob)
            layers.append(Layer(index, blob))
        recorder = Recorder(manifest.digest) if record else None
        # retries=0: the registry client already retries connection errors and 5xx with
        # backoff (one retry layer); the fetcher still refetches a corrupted frame once.
        fetcher = FrameFetcher(
            lambda digest, s, e: reg.get_blob_range(repo, digest, s, e),
            BlockCache(cache_dir, cache_bytes),
            connections=connections,
            on_access=recorder,
            retries=0,
        )
        lazy = LazyImage(layers, fetcher)
        lazy.recorder = recorder  # type: ignore[attr-defined]
    except BaseException:
        reg.close()
        raise
    return OpenImage(ref, reg, manifest, lazy, blobs)


@dataclass
class VerifyImageResult:
    reference: str
    digest: str  # the manifest's
    layers: int
    frames: int
    members: int
    bytes: int  # blob bytes read
    seconds: float


def verify_image(
    reference: str,
    *,
    platform: str = "linux/amd64",
    workdir: str | None = None,
    registry_options: dict[str, Any] | None = None,
) -> VerifyImageResult:
    """Check, once, everything a lazy mount checks only for the frames it reads: every layer
    is downloaded (its digest checked), its index checked against the manifest's digest, every
    frame checked to be one zstd frame of its declared size, and every TOC entry against its
    tar header, none left out. When it passes, a lazy mount of the image shows exactly what a
    plain unpack does, metadata of never-read members included. Raises the error of the first
    check that fails (naming the layer, and the member and rule for a TOC mismatch)."""
    import time

    started = time.perf_counter()
    ref = Reference.parse(reference)
    frames = members = total = 0
    with _registry(ref, **(registry_options or {})) as reg:
        manifest = reg.resolve_image(ref, platform)
        for desc in manifest.layers:
            index_digest = bound_index_digest(desc.digest, desc.annotations)
            with tempfile.TemporaryFile(dir=workdir, prefix="bootseer-verify-") as f:
                for chunk in reg.iter_blob(ref.repository, desc.digest, expected_size=desc.size):
                    f.write(chunk)  # the stream checks the digest before its last chunk
                f.flush()

                def read_range(start: int, end: int, fd: int = f.fileno()) -> bytes:
                    return os.pread(fd, end - start, start)

                index = LayerIndex.from_blob(
                    read_range, desc.size, desc.digest, index_digest=index_digest
                )
                for i in range(len(index.frames)):
                    index.fetch_and_verify(read_range, i)
            frames += len(index.frames)
            members += len(index.entries)
            total += desc.size
    return VerifyImageResult(
        reference,
        manifest.digest,
        len(manifest.layers),
        frames,
        members,
        total,
        time.perf_counter() - started,
    )


def bound_index_digest(layer: str, annotations: Mapping[str, Any] | None) -> str:
    """The index digest a converted layer's descriptor records; a layer the manifest does not
    mark as converted is :class:`NotConvertedError` (the convert hint), a converted one without
    a well-formed index digest :class:`UnboundIndexError` (its index is never trusted)."""
    annotations = annotations or {}
    if annotations.get(FORMAT_ANNOTATION) != FORMAT_VALUE:
        raise NotConvertedError(
            layer, f"its descriptor has no {FORMAT_ANNOTATION}: {FORMAT_VALUE} annotation"
        )
    value = annotations.get(INDEX_ANNOTATION)
    if value is None:
        raise UnboundIndexError(
            layer, f"the manifest marks it {FORMAT_VALUE} but records no {INDEX_ANNOTATION}"
        )
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise UnboundIndexError(layer, f"{INDEX_ANNOTATION} {value!r} is not a sha256 digest")
    return value


def load_profile(image: OpenImage) -> Profile | None:
    """The newest profile stored for the image, or None (absent or unreadable: warned)."""
    return find_profile(image.registry, image.reference.repository, image.manifest)


def find_profile(reg: SyncRegistry, repo: str, manifest: Any) -> Profile | None:
    """The newest profile stored in ``repo`` for ``manifest``, or None (warned when the
    registry cannot list them or one is unreadable: a profile is an optimization)."""
    try:
        referrers = reg.get_referrers(repo, manifest.digest, artifact_type=ARTIFACT_TYPE)
    except Exception as exc:  # noqa: BLE001 - a profile is an optimization
        log.warning("could not list the profiles of %s@%s: %s", repo, manifest.digest[:19], exc)
        return None
    for desc in reversed(list(referrers)):
        try:
            artifact = reg.get_manifest(repo, desc.digest)
            blob = artifact.layers[0]
            profile = Profile.from_bytes(reg.get_blob(repo, blob.digest))
        except (ProfileError, IndexError, Exception) as exc:  # noqa: BLE001
            log.warning(
                "ignoring profile %s of %s@%s: %s",
                desc.digest[:19],
                repo,
                manifest.digest[:19],
                exc,
            )
            continue
        if profile.image == manifest.digest:
            return profile
    return None


def save_profile(image: OpenImage, profile: Profile) -> str:
    """Store ``profile`` as an artifact referring to the image; returns its digest."""
    return store_profile(image.registry, image.reference.repository, image.manifest, profile)


def store_profile(reg: SyncRegistry, repo: str, manifest: Any, profile: Profile) -> str:
    """Push ``profile`` as an artifact whose subject is ``manifest``; returns its digest."""
    desc = reg.put_referrer(
        repo,
        manifest,
        ARTIFACT_TYPE,
        [(PROFILE_MEDIA_TYPE, profile.to_bytes())],
        annotations={"io.bootseer.profile.frames": str(len(profile.frames))},
    )
    return desc.digest


def profile_path_for(cache_dir: str | os.PathLike, digest: str) -> Path:
    return Path(cache_dir) / "profiles" / f"{digest.replace(':', '-')}.json"
