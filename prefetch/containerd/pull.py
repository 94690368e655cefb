"""``bootseer image pull``: put an image into containerd through a snapshotter, lazily where the
snapshotter can serve a layer from the registry.

The steps are the ones containerd's own pull takes, with the labels CRI adds, so the result is
an ordinary containerd image (``ctr images ls``, ``ctr run --snapshotter bootseer``):

1. resolve the reference with bootseer's registry client (token auth, platform selection);
2. under a lease (nothing is collected half-way), write the manifest and config into
   containerd's content store, labelled so containerd's garbage collector keeps the config and
   the image's top snapshot while the image exists;
3. prepare each layer's snapshot with ``containerd.io/snapshot.ref`` (its chain ID) and the
   layer, manifest and image labels. The bootseer snapshotter answers ALREADY_EXISTS for a
   converted layer (served lazily, nothing downloaded); any other layer comes back as an
   active snapshot, and is unpacked the normal way: its blob is streamed into the content store,
   applied by containerd's diff service (checked against the config's diff ID) and committed;
4. create (or update) the image record.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ..reference import Reference
from ..registry import SyncRegistry
from . import labels as lbl
from .client import ContainerdClient, Descriptor
from .errors import AlreadyExistsError, ContainerdError, InvalidArgumentError

log = logging.getLogger(__name__)


@dataclass
class PullResult:
    image: str
    manifest: str
    chain_id: str
    lazy_layers: int = 0
    unpacked_layers: int = 0
    present_layers: int = 0
    bytes_downloaded: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI chain IDs of a stack of layers (image-spec, "ChainID")."""
    out: list[str] = []
    for diff_id in diff_ids:
        if not out:
            out.append(diff_id)
        else:
            out.append("sha256:" + hashlib.sha256(f"{out[-1]} {diff_id}".encode()).hexdigest())
    return out


def pull_image(
    reference: str,
    address: str,
    *,
    namespace: str = "default",
    snapshotter: str = "bootseer",
    platform: str = "linux/amd64",
    registry_options: dict[str, Any] | None = None,
    client: ContainerdClient | None = None,
    local: bool = False,
    local_timeout_s: float = 3600.0,
) -> PullResult:
    """Pull ``reference`` into the containerd at ``address`` (see the module docstring).
    ``local``: then every lazy layer fetched whole and written out on the node (the
    snapshotter's :data:`labels.LOCAL`): containers start from local files at overlayfs's
    speed, and the node needs the registry no more (a warm standby)."""
    started = time.perf_counter()
    ref = Reference.parse(reference)
    name = str(ref if ref.tag or ref.digest else ref.with_tag("latest"))
    own_client = client is None
    ctd = client or ContainerdClient(address, namespace)
    phases: dict[str, float] = {}
    try:
        with SyncRegistry(ref.registry, **(registry_options or {})) as reg:
            t = time.perf_counter()
            manifest = reg.resolve_image(ref, platform)
            doc = manifest.parsed
            config_desc = doc.get("config") or {}
            config_bytes = reg.get_blob(ref.repository, config_desc["digest"])
            config = _json(config_bytes, f"config of {reference}")
            diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
            layers = doc.get("layers") or []
            if len(diff_ids) != len(layers) or not layers:
                raise InvalidArgumentError(
                    f"{reference}: {len(layers)} layers but {len(diff_ids)} diff_ids in its "
                    "config: the image is malformed"
                )
            chains = chain_ids(diff_ids)
            phases["resolve"] = time.perf_counter() - t
            result = PullResult(name, manifest.digest, chains[-1])
            ctd.ensure_namespace()
            with ctd.lease() as leased:
                t = time.perf_counter()
                leased.write_content(
                    config_bytes,
                    digest=config_desc["digest"],
                    size=len(config_bytes),
                    labels={f"containerd.io/gc.ref.snapshot.{snapshotter}": chains[-1]},
                )
                refs = {"containerd.io/gc.ref.content.config": config_desc["digest"]}
                for i, layer in enumerate(layers):
                    refs[f"containerd.io/gc.ref.content.l.{i}"] = layer["digest"]
                leased.write_content(
                    manifest.data, digest=manifest.digest, size=len(manifest.data), labels=refs
                )
                phases["content"] = time.perf_counter() - t
                t = time.perf_counter()
                layer_digests = ",".join(layer["digest"] for layer in layers)
                for i, layer in enumerate(layers):
                    _unpack_layer(
                        leased,
                        reg,
                        ref,
                        snapshotter,
                        manifest.digest,
                        layer,
                        diff_ids[i],
                        chains[i],
                        chains[i - 1] if i else "",
                        layer_digests,
                        result,
                    )
                phases["layers"] = time.perf_counter() - t
                target = Descriptor(manifest.media_type, manifest.digest, len(manifest.data))
                leased.put_image(name, target)
                if local:
                    t = time.perf_counter()
                    leased.update_snapshot_labels(
                        snapshotter, chains[-1], {lbl.LOCAL: "1"}, timeout_s=local_timeout_s
                    )
                    phases["local"] = time.perf_counter() - t
    finally:
        if own_client:
            ctd.close()
    result.phases = phases
    result.seconds = time.perf_counter() - started
    log.info(
        "pulled %s: %d lazy, %d unpacked, %d present layers in %.2f s",
        name,
        result.lazy_layers,
        result.unpacked_layers,
        result.present_layers,
        result.seconds,
    )
    return result


def _unpack_layer(
    ctd: ContainerdClient,
    reg: SyncRegistry,
    ref: Reference,
    snapshotter: str,
    manifest_digest: str,
    layer: dict[str, Any],
    diff_id: str,
    chain_id: str,
    parent: str,
    layer_digests: str,
    result: PullResult,
) -> None:
    labels = {
        lbl.SNAPSHOT_REF: chain_id,
        lbl.IMAGE_REF: str(ref),
        lbl.MANIFEST_DIGEST: manifest_digest,
        lbl.LAYER_DIGEST: layer["digest"],
    }
    if len(layer_digests) < 3500:  # containerd limits a label to 4 KiB, as CRI does
        labels[lbl.IMAGE_LAYERS] = layer_digests
    key = f"extract-{secrets.token_hex(6)}-{chain_id}"
    try:
        mounts = ctd.prepare_snapshot(snapshotter, key, parent, labels)
    except AlreadyExistsError:
        info = ctd.stat_snapshot(snapshotter, chain_id)
        if info.labels.get(lbl.REMOTE) == "true":
            result.lazy_layers += 1
        else:
            result.present_layers += 1
        return
    try:
        desc = Descriptor(layer["mediaType"], layer["digest"], int(layer["size"]))
        ctd.write_content(
            reg.iter_blob(ref.repository, desc.digest), digest=desc.digest, size=desc.size
        )
        result.bytes_downloaded += desc.size
        applied = ctd.apply_diff(desc, mounts)
        if applied.digest != diff_id:
            raise ContainerdError(
                f"layer {desc.digest} of {ref} unpacks to {applied.digest}, but the image "
                f"config says {diff_id}: the image is corrupt or was tampered with"
            )
        ctd.commit_snapshot(snapshotter, chain_id, key, {lbl.SNAPSHOT_REF: chain_id})
        result.unpacked_layers += 1
    except BaseException:
        try:
            ctd.remove_snapshot(snapshotter, key)
        except ContainerdError as exc:
            log.warning("could not remove the half-unpacked snapshot %s: %s", key, exc)
        raise


def _json(data: bytes, what: str) -> dict[str, Any]:
    import json

    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"{what} is not a JSON object")
    return doc
