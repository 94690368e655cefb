"""containerd integration: the project's own API definitions (``api/``), a gRPC client
(``client``), and a proxy snapshotter that mounts bootseer-format layers lazily
(``snapshotter``). See docs/containerd.md."""
