"""Media types of the OCI image spec and their Docker v2 equivalents, used by the registry client."""

from __future__ import annotations

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
"""The empty descriptor's media type: config of an artifact manifest that has none."""

OCI_EMPTY_DATA = b"{}"
OCI_EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"

IMAGE_MANIFESTS = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
"""Manifests that describe one image (config + layers)."""

INDEXES = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
"""Manifests that list per-platform manifests."""

MANIFESTS = IMAGE_MANIFESTS | INDEXES

DEFAULT_MANIFEST_ACCEPT = (OCI_INDEX, OCI_MANIFEST, DOCKER_MANIFEST_LIST, DOCKER_MANIFEST)
"""The Accept list of a manifest request: every type the client can handle, OCI first."""

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
"""Largest manifest the client reads (the distribution spec's recommended registry limit)."""
