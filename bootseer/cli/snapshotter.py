"""``bootseer snapshotter``: the containerd proxy snapshotter, and ``bootseer fuse-holder``, which
keeps its lazy mount alive across its restarts (see docs/containerd.md).

    bootseer fuse-holder --address /run/bootseer/fuse-holder.sock
    bootseer snapshotter --root /var/lib/containerd/io.containerd.snapshotter.v1.bootseer \\
        --address /run/bootseer/snapshotter.sock --registry-config-path /etc/containerd/certs.d

Its settings are the configuration's ``[snapshotter]`` keys (and ``image.connections``), read
like every command's: file, ``BOOTSEER_SNAPSHOTTER_*`` variables, flags.
"""

from __future__ import annotations

import argparse

from ..config import add_config_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "snapshotter",
        help="serve containerd's snapshots API: lazy layers for `ctr run --snapshotter bootseer`",
    )
    add_config_arguments(p, ("state", "snapshotter", "image.connections"))
    p.set_defaults(func=cmd_snapshotter)

    from prefetch.containerd import holder

    h = sub.add_parser(
        "fuse-holder",
        help="keep the snapshotter's lazy mount alive across its restarts (run as its own service)",
    )
    holder.add_arguments(h)
    h.set_defaults(func=cmd_fuse_holder)


def cmd_snapshotter(args: argparse.Namespace) -> int:
    from prefetch.containerd import service  # a service: its module is the contract

    cfg = args.cfg.snapshotter
    options = {
        "cache_bytes": cfg.cache_size,
        "connections": args.cfg.image.connections,
        "record_timeout_s": cfg.record_timeout_s,
        "push_profiles": cfg.push_profiles,
        "prefetch": cfg.prefetch,
        "registry_config_path": cfg.registry_config_path or None,
    }
    return service.serve(
        cfg.root,
        cfg.address,
        remote_options=options,
        holder=cfg.holder or None,
        spawn_holder=cfg.spawn_holder,
        takeover_wait_s=cfg.takeover_wait_s,
    )


def cmd_fuse_holder(args: argparse.Namespace) -> int:
    from prefetch.containerd import holder

    return holder.run(args.address, exit_when_idle=args.exit_when_idle)
