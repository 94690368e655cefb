"""``bootseer snapshotter``: the containerd proxy snapshotter (see docs/containerd.md).

    bootseer snapshotter --root /var/lib/containerd/io.containerd.snapshotter.v1.bootseer \\
        --address /run/bootseer/snapshotter.sock --registry-config-path /etc/containerd/certs.d
"""

from __future__ import annotations

import argparse

from striped_fs import parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("snapshotter", help="serve containerd's snapshots API: lazy layers for "
                                           "`ctr run --snapshotter bootseer`")
    p.add_argument("--root", default="/var/lib/containerd/io.containerd.snapshotter.v1.bootseer",
                   help="metadata, snapshots, layer cache; made 0700. Where containerd's CRI "
                        "reports the image filesystem to the kubelet: <containerd root>/"
                        "io.containerd.snapshotter.v1.<name> (default %(default)s)")
    p.add_argument("--address", default="/run/bootseer/snapshotter.sock",
                   help="unix socket containerd's proxy_plugins entry names, created 0600 "
                        "(default %(default)s)")
    p.add_argument("--cache-size", default="64G", help="block cache limit (default 64G)")
    p.add_argument("--connections", type=int, default=16,
                   help="parallel range requests to the registry (default 16)")
    p.add_argument("--record-timeout", type=float, default=120.0,
                   help="seconds a first start is recorded when no ready signal comes "
                        "(default 120)")
    p.add_argument("--no-push-profiles", action="store_true",
                   help="keep recorded profiles on this node only")
    p.add_argument("--no-prefetch", action="store_true", help="ignore stored profiles")
    p.add_argument("--registry-config-path", default="", metavar="DIR",
                   help="containerd's registry hosts directory (CRI's registry.config_path, "
                        "e.g. /etc/containerd/certs.d): read layers from the mirrors its "
                        "hosts.toml files name, as containerd does")
    p.set_defaults(func=cmd_snapshotter)


def cmd_snapshotter(args: argparse.Namespace) -> int:
    from prefetch.containerd.service import serve

    options = {"cache_bytes": parse_size(args.cache_size, name="--cache-size"), "connections": args.connections,
               "record_timeout_s": args.record_timeout,
               "push_profiles": not args.no_push_profiles, "prefetch": not args.no_prefetch,
               "registry_config_path": args.registry_config_path or None}
    return serve(args.root, args.address, remote_options=options)
