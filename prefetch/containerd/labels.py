"""The snapshot labels of containerd's remote-snapshot handshake, and their validation.

containerd's unpacker (and CRI, with ``disable_snapshot_annotations = false``) prepares each
layer's snapshot with ``containerd.io/snapshot.ref`` set to the layer's chain ID and, from CRI,
the image reference and the layer and manifest digests under ``containerd.io/snapshot/cri.*``.
``bootseer image pull`` sends the same labels, so one snapshotter serves both paths. A
snapshotter that can serve the layer without its bytes answers ALREADY_EXISTS after
committing a snapshot carrying the ``snapshot.ref`` label: containerd then skips the download.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidArgumentError

SNAPSHOT_REF = "containerd.io/snapshot.ref"
IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
MANIFEST_DIGEST = "containerd.io/snapshot/cri.manifest-digest"
LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
IMAGE_LAYERS = "containerd.io/snapshot/cri.image-layers"
# Set by bootseer on the snapshots it serves lazily (visible in `ctr snapshots info`).
REMOTE = "containerd.io/snapshot/bootseer.remote"
# Asked for on a committed snapshot (`bootseer image pull --local`, or `ctr snapshots label`):
# every lazy layer of its chain fetched whole and written out on the node, so that containers
# started on it read local files through overlayfs, at the kernel's speed. The Update that
# sets it returns once they are written; the snapshot keeps the label ("done").
LOCAL = "containerd.io/snapshot/bootseer.local"

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class LayerRequest:
    """What a Prepare asks for when it names a layer: enough to serve it remotely."""

    chain_id: str
    image_ref: str
    layer_digest: str
    manifest_digest: str | None


def layer_request(key: str, labels: dict[str, str]) -> LayerRequest | None:
    """The layer a Prepare names, or None for a plain Prepare (a container's rootfs, a build
    step). Labels that half-describe a layer are refused, naming the label: a wrong label must
    not silently become a full download or, worse, a wrong layer."""
    chain_id = labels.get(SNAPSHOT_REF)
    layer = labels.get(LAYER_DIGEST)
    if chain_id is None or layer is None:
        return None  # plain `ctr pull` sends only snapshot.ref: unpacked the normal way
    image_ref = labels.get(IMAGE_REF, "").strip()
    problems = []
    if not _DIGEST.match(chain_id):
        problems.append(f"{SNAPSHOT_REF}={chain_id!r} is not a sha256 digest")
    if not _DIGEST.match(layer):
        problems.append(f"{LAYER_DIGEST}={layer!r} is not a sha256 digest")
    manifest = labels.get(MANIFEST_DIGEST)
    if manifest is not None and not _DIGEST.match(manifest):
        problems.append(f"{MANIFEST_DIGEST}={manifest!r} is not a sha256 digest")
    if not image_ref:
        problems.append(f"{IMAGE_REF} is missing (the registry to read {layer} from)")
    if problems:
        raise InvalidArgumentError(f"prepare {key!r}: " + "; ".join(problems))
    return LayerRequest(chain_id, image_ref, layer, manifest)
