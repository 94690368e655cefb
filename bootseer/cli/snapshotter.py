"""``bootseer snapshotter``: the containerd proxy snapshotter (see docs/containerd.md).

    bootseer snapshotter --root /var/lib/containerd/io.containerd.snapshotter.v1.bootseer \\
        --address /run/bootseer/snapshotter.sock --registry-config-path /etc/containerd/certs.d

Its settings are the configuration's ``[snapshotter]`` keys (and ``image.connections``), read
like every command's: file, ``BOOTSEER_SNAPSHOTTER_*`` variables, flags.
"""

from __future__ import annotations

import argparse

from ..config import add_config_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("snapshotter", help="serve containerd's snapshots API: lazy layers for "
                                           "`ctr run --snapshotter bootseer`")
    add_config_arguments(p, ("state", "snapshotter", "image.connections"))
    p.set_defaults(func=cmd_snapshotter)


def cmd_snapshotter(args: argparse.Namespace) -> int:
    from prefetch.containerd.service import serve

    cfg = args.cfg.snapshotter
    options = {"cache_bytes": cfg.cache_size, "connections": args.cfg.image.connections,
               "record_timeout_s": cfg.record_timeout_s, "push_profiles": cfg.push_profiles,
               "prefetch": cfg.prefetch,
               "registry_config_path": cfg.registry_config_path or None}
    return serve(cfg.root, cfg.address, remote_options=options)
