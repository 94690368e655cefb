"""``bootseer warmup``: fill a node ahead of the job (image hot frames, environment,
checkpoint shards for its ranks), all parts at once. Idempotent. It reads the same
configuration as ``bootseer run`` (file, ``BOOTSEER_*`` variables, the same flags), so it
fills exactly the caches the job reads:

    bootseer warmup --config /etc/bootseer.toml --image-ref registry:5000/team/train:v1-lazy
    bootseer warmup --image-ref registry:5000/team/train:v1-lazy \\
        --env-spec requirements.txt --env-prefix /opt/venv --env-store s3://bucket/envs \\
        --ckpt-url s3://bucket/run1 --ranks 0-7
    bootseer warmup --self-check --controller 10.0.0.5:29400 --node spare-3 \
        --ckpt-url s3://bucket/run1 --ranks 0-15      # a warm standby, then `bootseer run`
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
from .options import open_trace, refuse_renamed_flags, trailing_command

#: The keys warmup takes flags for: what it fills, and where.
WARMUP_KEYS = (
    "state",
    "run.trace_dir",
    "run.node",
    "image",
    "env.spec",
    "env.prefix",
    "env.store",
    "env.base_image",
    "ckpt",
    "storage",
    "striped",
    "health",
    "controller",
)

#: Flags of earlier versions -> the schema's flag for the same key (the same in every command).
RENAMED_FLAGS = {
    "--image": "--image-ref",
    "--ckpt": "--ckpt-url",
    "--ckpt-cache": "--ckpt-cache-dir",
}


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``warmup`` subcommand (imports nothing heavy: every command builds it)."""
    from ..config import add_config_arguments

    p = sub.add_parser(
        "warmup",
        help="fill a node ahead of the job: image hot frames, environment, "
        "checkpoint shards (idempotent)",
        description="Runs the configured parts concurrently (image.ref, env.spec/prefix, "
        "ckpt.url: from the config file, BOOTSEER_* variables or flags, as "
        "`bootseer run` reads them); prints one line per part and exits 1 when any "
        "failed (the others still complete). Each part is optional; give at least "
        "one. An environment installed by a custom command (`bootseer env ensure "
        "... -- CMD`) takes the same command after --: it is part of its key. Each "
        "part is a span of the trace in run.trace_dir.",
    )
    add_config_arguments(p, WARMUP_KEYS)
    p.add_argument(
        "--image-all",
        action="store_true",
        help="image: every frame, not only the recorded profile's",
    )
    p.add_argument(
        "--env-extra",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another input of the environment's key, as `env ensure --extra`",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--self-check",
        action="store_true",
        help="a warm standby's warmup: refuse a node on the job's exclusion list "
        "(controller.address) before warming anything (exit 2), then run the "
        "node's health checks after it (exit 1 when one fails); a span "
        "'self_check' in the trace",
    )
    refuse_renamed_flags(p, RENAMED_FLAGS)
    p.set_defaults(func=cmd_warmup, takes_command=True, command=None)


def _parts(args: argparse.Namespace) -> list[Any]:
    from ..config import check_ckpt_cache_handoff, parse_ranks, storage_options
    from ..warmup import Part, warm_checkpoint, warm_environment, warm_image

    cfg = args.cfg
    options = storage_options(cfg) or None
    image, env, ckpt = cfg.image, cfg.env, cfg.ckpt
    parts = []
    if image.ref:
        parts.append(
            Part(
                "image",
                image.ref,
                lambda: warm_image(
                    image.ref,
                    image.cache,
                    platform=image.platform,
                    connections=image.connections,
                    everything=args.image_all,
                ),
            )
        )
    command = trailing_command(args)
    if env.spec or env.prefix or command:
        if not env.prefix:
            raise CliError(
                "env.spec needs env.prefix (where the environment lives): --env-prefix DIR"
            )
        if not env.spec and not command:
            raise CliError(
                "env.prefix needs env.spec (--env-spec FILE) or the install command "
                "after --: they make the environment's key"
            )
        from snapshot import parse_extras

        extras = parse_extras(args.env_extra)
        parts.append(
            Part(
                "environment",
                env.prefix,
                lambda: warm_environment(
                    env.spec,
                    env.prefix,
                    env.store or None,
                    command=command,
                    extras=extras,
                    base_image=env.base_image or None,
                    storage_options=options,
                ),
            )
        )
    if ckpt.url:
        # Before the job nothing may say which ranks will come: never guess rank 0.
        ranks = parse_ranks(ckpt.ranks, os.environ, fallback=False)
        check_ckpt_cache_handoff(cfg)
        parts.append(
            Part(
                "checkpoint",
                ckpt.url,
                lambda: warm_checkpoint(
                    ckpt.url,
                    ckpt.cache_dir,
                    ranks,
                    storage_options=options,
                    connections=ckpt.connections,
                ),
            )
        )
    elif cfg.source("ckpt.ranks").startswith("flag"):
        raise CliError(
            "--ranks is for the checkpoint part (whose shards to cache): give "
            "ckpt.url too (--ckpt-url URL)"
        )
    if not parts:
        raise CliError(
            "nothing to warm up: configure image.ref, env.spec/env.prefix or "
            "ckpt.url (--image-ref, --env-spec/--env-prefix, --ckpt-url, or the "
            "config file)"
        )
    return parts


def cmd_warmup(args: argparse.Namespace) -> int:
    from ..warmup import run_parts, summary_lines

    parts = _parts(args)
    if args.self_check:
        _admitted(args.cfg)
    trace = open_trace(args.cfg)
    started = time.perf_counter()
    results = run_parts(parts, trace)
    seconds = time.perf_counter() - started
    failed = [r for r in results if not r.ok]
    checked = _self_check(args.cfg, trace) if args.self_check and not failed else None
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not failed and checked is not False,
                    "seconds": seconds,
                    "parts": [asdict(r) for r in results],
                    **({} if checked is None else {"self_check": checked}),
                },
                indent=1,
                default=str,
            )
        )
    else:
        for line in summary_lines(results):
            print(f"warmup: {line}")
        if checked:
            print("warmup: self-check ok")
    if checked is False:
        return 1
    if failed:
        for r in failed:
            print(f"bootseer: warmup: {r.part} ({r.what}) failed: {r.error}", file=sys.stderr)
        print(
            f"bootseer: warmup: {len(failed)} of {len(results)} part(s) failed "
            f"({', '.join(r.part for r in failed)}); the others completed",
            file=sys.stderr,
        )
        return 1
    if not args.json:
        note = " (everything was already in place)" if all(r.warm_already for r in results) else ""
        print(f"warmup: done in {seconds:.2f}s{note}")
    return 0


def _admitted(cfg: Any) -> None:
    """A standby evicted from the job must not be warmed, nor join: refused by name."""
    if not cfg.controller.address:
        return
    from ..robust import seal, wire
    from ..robust.standby import ExcludedNode, check_admission
    from ..trace import default_node

    node = cfg.run.node or default_node()
    try:  # the list is sealed: without the job's secret it cannot be read
        seal.require_secret("bootseer warmup --controller")
    except seal.SealError as exc:
        raise CliError(str(exc)) from None
    try:
        store = wire.connect(cfg.controller.address, cfg.controller.wait_s)
        check_admission(
            store,
            node,
            job=cfg.controller.job,
            where=cfg.controller.address,
            log=lambda line: print(f"warmup: {line}", file=sys.stderr, flush=True),
        )
    except ExcludedNode as exc:
        raise CliError(str(exc)) from None
    except (ValueError, RuntimeError, OSError) as exc:  # TCPStore raises these
        raise CliError(
            f"cannot reach the controller's store at {cfg.controller.address} "
            f"(controller.address) to check the exclusion list: {exc}"
        ) from None


def _self_check(cfg: Any, trace: Any) -> bool:
    """The node's health checks (``bootseer run``'s, before every start) on the warmed node;
    a span ``self_check`` records the outcome."""
    from ..startup import StartupError
    from ..trace import default_node
    from .run import node_check

    wall = time.time()
    try:
        node_check(cfg, trace, cfg.run.node or default_node(), 0)
    except StartupError as exc:
        trace.record("self_check", wall, outcome="failed", warmup=True, result=str(exc))
        print(f"bootseer: warmup: self-check failed: {exc}", file=sys.stderr)
        return False
    trace.record("self_check", wall, warmup=True, result="ok")
    return True
