"""``bootseer snapshotter``: the containerd proxy snapshotter, and ``bootseer fuse-holder``, which
keeps its lazy mount alive across its restarts (see docs/containerd.md).

    bootseer fuse-holder --address /run/bootseer/fuse-holder.sock
    bootseer snapshotter --root /var/lib/bootseer/snapshotter \\
        --address /run/bootseer/snapshotter.sock
"""

from __future__ import annotations

import argparse

from striped_fs import parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("snapshotter", help="serve containerd's snapshots API: lazy layers for "
                                           "`ctr run --snapshotter bootseer`")
    p.add_argument("--root", default="/var/lib/bootseer/snapshotter",
                   help="metadata, snapshots, layer cache; made 0700 (default %(default)s)")
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
    p.add_argument("--holder", default=None,
                   help="the FUSE holder's socket (`bootseer fuse-holder`), which keeps the lazy "
                        "mount across restarts; started when none runs (default: "
                        "fuse-holder.sock beside --address)")
    p.add_argument("--no-spawn-holder", action="store_true",
                   help="never start a holder: wait for the holder service (deploy/)")
    p.add_argument("--takeover-wait", type=float, default=30.0,
                   help="seconds to wait for a predecessor still serving --root to stop "
                        "(default 30)")
    p.set_defaults(func=cmd_snapshotter)

    from prefetch.containerd import holder

    h = sub.add_parser("fuse-holder", help="keep the snapshotter's lazy mount alive across its "
                                           "restarts (run as its own service)")
    holder.add_arguments(h)
    h.set_defaults(func=cmd_fuse_holder)


def cmd_snapshotter(args: argparse.Namespace) -> int:
    from prefetch.containerd.service import serve

    options = {"cache_bytes": parse_size(args.cache_size, name="--cache-size"), "connections": args.connections,
               "record_timeout_s": args.record_timeout,
               "push_profiles": not args.no_push_profiles, "prefetch": not args.no_prefetch}
    return serve(args.root, args.address, remote_options=options, holder=args.holder,
                 spawn_holder=not args.no_spawn_holder, takeover_wait_s=args.takeover_wait)


def cmd_fuse_holder(args: argparse.Namespace) -> int:
    from prefetch.containerd.holder import run

    return run(args.address, exit_when_idle=args.exit_when_idle)
