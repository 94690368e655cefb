"""bootseer's own .proto definitions of the containerd API it uses, wire-compatible with
containerd 1.6/1.7 (same proto packages, services and field numbers), and of the parts of the
Kubernetes CRI (``cri/runtime/v1``) that its CRI client uses, and the Python code generated from
them (committed; regenerate with ``make protos``, see ``generate``)."""
