"""``bootseer warmup``: fill a node ahead of the job (image hot frames, environment,
checkpoint shards for its ranks), all parts at once. Idempotent.

    bootseer warmup --image registry:5000/team/train:v1-lazy \\
        --env-spec requirements.txt --env-prefix /opt/venv --env-store s3://bucket/envs \\
        --ckpt s3://bucket/run1 --ranks 0-7 --trace-dir /var/log/bootseer
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from .errors import CliError
from .options import parse_storage_options, trailing_command


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``warmup`` subcommand (imports nothing heavy: every command builds it)."""
    p = sub.add_parser(
        "warmup", help="fill a node ahead of the job: image hot frames, environment, "
                       "checkpoint shards (idempotent)",
        description="Runs the given parts concurrently; prints one line per part and exits 1 "
                    "when any failed (the others still complete). Each part is optional; give "
                    "at least one. An environment installed by a custom command (`bootseer env "
                    "ensure ... -- CMD`) takes the same command after --: it is part of its "
                    "key.")
    image = p.add_argument_group("image (hot frames into the block cache)")
    image.add_argument("--image", metavar="REF", help="a converted image reference")
    image.add_argument("--image-cache", metavar="DIR", default=None,
                       help="block cache (default: as `bootseer image`, env BOOTSEER_IMAGE_CACHE)")
    image.add_argument("--image-all", action="store_true",
                       help="every frame, not only the recorded profile's")
    image.add_argument("--platform", default="linux/amd64")

    env = p.add_argument_group("environment (restored or verified; never installed)")
    env.add_argument("--env-spec", action="extend", nargs="+", default=[], metavar="FILE",
                     help="requirements.txt, pyproject.toml or uv.lock, as given to "
                          "`bootseer env ensure --spec`")
    env.add_argument("--env-prefix", metavar="DIR", help="where the environment lives")
    env.add_argument("--env-store", metavar="URL", default=os.environ.get("BOOTSEER_ENV_STORE"),
                     help="snapshot store (env BOOTSEER_ENV_STORE)")
    env.add_argument("--env-extra", action="append", default=[], metavar="NAME=VALUE",
                     help="another input of the environment's key, as `env ensure --extra`")
    env.add_argument("--env-base-image", default=None,
                     help="base image digest of the key (default: env BOOTSEER_BASE_IMAGE)")

    ckpt = p.add_argument_group("checkpoint (shards of this node's ranks into the local cache)")
    ckpt.add_argument("--ckpt", metavar="URL", help="the job's checkpoint URL")
    ckpt.add_argument("--ckpt-cache", metavar="DIR", default=None,
                      help="node-local checkpoint cache (env BOOTSEER_CKPT_CACHE; default "
                           "/var/lib/bootseer/ckpt as root, else ~/.cache/bootseer/ckpt)")
    ckpt.add_argument("--ranks", metavar="LIST", help="this node's ranks, e.g. 0-7 or 0-3,8")

    p.add_argument("--storage-options", default=os.environ.get("BOOTSEER_STORAGE_OPTIONS"),
                   metavar="JSON", help='fsspec options by protocol for the stores, e.g. '
                                        '\'{"s3": {"endpoint_url": "http://127.0.0.1:9000"}}\' '
                                        "(env BOOTSEER_STORAGE_OPTIONS)")
    p.add_argument("--connections", type=int, default=16,
                   help="parallel streams per part (default %(default)s)")
    p.add_argument("--trace-dir", metavar="DIR", help="write a trace span per part here")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_warmup, takes_command=True, command=None)


def _parts(args: argparse.Namespace) -> list[Any]:
    from ..config import parse_ranks
    from ..warmup import Part, warm_checkpoint, warm_environment, warm_image

    options = parse_storage_options(args.storage_options) or None
    parts = []
    if args.image:
        from .image import default_cache

        cache = args.image_cache or default_cache()
        parts.append(Part("image", args.image, lambda: warm_image(
            args.image, cache, platform=args.platform, connections=args.connections,
            everything=args.image_all)))
    command = trailing_command(args)
    if args.env_spec or args.env_prefix or command:
        if not args.env_prefix:
            raise CliError("--env-spec needs --env-prefix (where the environment lives)")
        if not args.env_spec and not command:
            raise CliError("--env-prefix needs --env-spec FILE (or the install command after "
                           "--): they make the environment's key")
        from snapshot.key import parse_extras

        extras = parse_extras(args.env_extra)
        parts.append(Part("environment", args.env_prefix, lambda: warm_environment(
            args.env_spec, args.env_prefix, args.env_store, command=command, extras=extras,
            base_image=args.env_base_image, storage_options=options)))
    if args.ckpt:
        if not args.ranks:
            raise CliError("--ckpt needs --ranks (this node's ranks, e.g. 0-7)")
        ranks = parse_ranks(args.ranks)
        from ckpt.cache import default_cache_dir  # torch: only once the arguments are good

        cache_dir = args.ckpt_cache or default_cache_dir()
        parts.append(Part("checkpoint", args.ckpt, lambda: warm_checkpoint(
            args.ckpt, cache_dir, ranks, storage_options=options,
            connections=args.connections)))
    elif args.ranks:
        raise CliError("--ranks is for --ckpt (whose shards to cache)")
    if not parts:
        raise CliError("nothing to warm up: give --image, --env-spec/--env-prefix, or --ckpt")
    return parts


def cmd_warmup(args: argparse.Namespace) -> int:
    from ..trace import TraceWriter
    from ..warmup import run_parts, summary_lines

    parts = _parts(args)
    trace = TraceWriter(args.trace_dir) if args.trace_dir else None
    started = time.perf_counter()
    results = run_parts(parts, trace)
    seconds = time.perf_counter() - started
    failed = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps({"ok": not failed, "seconds": seconds,
                          "parts": [asdict(r) for r in results]}, indent=1, default=str))
    else:
        for line in summary_lines(results):
            print(f"warmup: {line}")
    if failed:
        for r in failed:
            print(f"bootseer: warmup: {r.part} ({r.what}) failed: {r.error}", file=sys.stderr)
        print(f"bootseer: warmup: {len(failed)} of {len(results)} part(s) failed "
              f"({', '.join(r.part for r in failed)}); the others completed", file=sys.stderr)
        return 1
    if not args.json:
        note = " (everything was already in place)" if all(r.warm_already for r in results) \
            else ""
        print(f"warmup: done in {seconds:.2f}s{note}")
    return 0
