"""``bootseer env``: dependency environments installed once, snapshotted, restored everywhere.

The line for a container entrypoint::

    bootseer env ensure --spec requirements.txt --prefix /opt/venv --store s3://bucket/envs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict
from datetime import datetime
from typing import Any

from ..progress import ByteProgress, human_bytes
from .errors import CliError
from .options import parse_storage_options, trailing_command

log = logging.getLogger("bootseer")

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def register(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="dependency environments: ensure, create, restore, ls, gc")
    env_sub = env.add_subparsers(dest="env_command", metavar="SUBCOMMAND", required=True)

    key = env_sub.add_parser("key", help="print the key of an environment and every input")
    _key_args(key)
    key.add_argument("--json", action="store_true", help="machine-readable output")
    key.set_defaults(func=cmd_key)

    ensure = env_sub.add_parser(
        "ensure", help="verify, restore or build (install, pack, publish) an environment",
        description="Hit: restore the snapshot (or only verify, when the prefix already holds "
                    "it). Miss: install (a venv at --prefix with uv when present, else pip, or "
                    "the command after --), pack and publish. With --capture, snapshot what a "
                    "setup command changes under those paths, and replay it.")
    _key_args(ensure)
    _target_args(ensure)
    ensure.add_argument("--lease", type=float, default=60.0, metavar="SECONDS",
                        help="a builder that stops renewing its lease this long is replaced")
    ensure.add_argument("--wait-timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="longest wait for another node's build before building here")
    ensure.set_defaults(func=cmd_ensure)

    create = env_sub.add_parser("create", help="build and publish, even if the store has it "
                                               "(replaces nothing there: the first wins)")
    _key_args(create)
    _target_args(create)
    create.set_defaults(func=cmd_create)

    restore = env_sub.add_parser("restore", help="restore a snapshot by key")
    restore.add_argument("key", help="the key, as `bootseer env key` or `ls` prints it")
    restore.add_argument("--prefix", required=True, help="where the environment goes")
    _store_arg(restore)
    restore.add_argument("--force", action="store_true",
                         help="restore to another prefix even if binaries embed the old one")
    restore.add_argument("--replace", action="store_true",
                         help="swap out a non-empty prefix that bootseer did not make")
    restore.add_argument("--fsync", action="store_true",
                         help="sync the filesystem before moving the environment into place")
    restore.set_defaults(func=cmd_restore)

    verify = env_sub.add_parser("verify", help="does a prefix hold an intact environment?")
    verify.add_argument("prefix")
    verify.add_argument("--key", help="the key it must hold (default: any)")
    verify.set_defaults(func=cmd_verify)

    ls = env_sub.add_parser("ls", help="snapshots in a store")
    _store_arg(ls)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)

    rm = env_sub.add_parser("rm", help="delete snapshots")
    rm.add_argument("keys", nargs="+", metavar="KEY")
    _store_arg(rm)
    rm.set_defaults(func=cmd_rm)

    gc = env_sub.add_parser("gc", help="delete old snapshots and leftovers of dead publishers")
    _store_arg(gc)
    gc.add_argument("--older-than", required=True, metavar="AGE",
                    help="e.g. 3600, 90m, 12h, 14d")
    gc.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    gc.set_defaults(func=cmd_gc)


def _key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", action="append", default=[], metavar="FILE",
                   help="requirements.txt, pyproject.toml or uv.lock (repeatable)")
    p.add_argument("--python", help="interpreter to build with (default: this one)")
    p.add_argument("--base-image", default=None,
                   help="base image digest (default: env BOOTSEER_BASE_IMAGE)")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=VALUE",
                   help="another input of the key, e.g. cuda=12.4 (repeatable)")
    p.add_argument("--capture", action="append", default=[], metavar="PATH",
                   help="capture mode: snapshot what the command changes under PATH "
                        "(repeatable)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: the install (or setup) command; {prefix} is replaced")
    p.set_defaults(takes_command=True)


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", help="where the environment lives (not with --capture)")
    _store_arg(p)
    p.add_argument("--installer", choices=("auto", "uv", "pip"), default="auto",
                   help="default install: uv when present (auto), or force one")
    p.add_argument("--force", action="store_true",
                   help="restore to another prefix even if binaries embed the old one")
    p.add_argument("--replace", action="store_true",
                   help="swap out a non-empty prefix that bootseer did not make")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=os.environ.get("BOOTSEER_ENV_STORE"),
                   help="snapshot store: path or URL, e.g. s3://bucket/envs "
                        "(env BOOTSEER_ENV_STORE)")
    p.add_argument("--storage-options", default=os.environ.get("BOOTSEER_STORAGE_OPTIONS"),
                   metavar="JSON",
                   help='fsspec options by protocol, e.g. \'{"s3": {"endpoint_url": '
                        '"http://127.0.0.1:9000"}}\' (env BOOTSEER_STORAGE_OPTIONS)')


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return parse_storage_options(args.storage_options)


def _command(args: argparse.Namespace) -> list[str] | None:
    return trailing_command(args)


def _require_store(args: argparse.Namespace) -> str:
    if not args.store:
        raise CliError("no snapshot store: pass --store URL or set BOOTSEER_ENV_STORE")
    return args.store


def _env_key(args: argparse.Namespace):
    from snapshot.key import compute_key, parse_extras

    return compute_key(args.spec, _command(args), python=args.python,
                       base_image=args.base_image, extras=parse_extras(args.extra),
                       capture=args.capture)


def cmd_key(args: argparse.Namespace) -> int:
    env_key = _env_key(args)
    if args.json:
        print(json.dumps(env_key.to_json(), indent=1))
    else:
        print(env_key.describe())
    return 0


def _check_target(args: argparse.Namespace) -> None:
    if args.capture:
        if args.prefix:
            raise CliError("--capture and --prefix exclude each other: a capture replays "
                           "changes under its paths")
        if not _command(args):
            raise CliError("--capture needs the setup command after --")
    elif not args.prefix:
        raise CliError("--prefix is required (where the environment lives)")
    if not args.spec and not _command(args):
        raise CliError("nothing to install: pass --spec FILE, or the install command after --")


def cmd_ensure(args: argparse.Namespace) -> int:
    _check_target(args)
    env_key = _env_key(args)
    if args.capture:
        from snapshot.capture import ensure_capture

        result = ensure_capture(args.capture, _command(args), store=args.store,
                                storage_options=_options(args), key=env_key)
    else:
        from snapshot.ensure import ensure

        with ByteProgress(f"env {env_key.key[:12]} -> {args.prefix}") as progress:
            result = ensure(args.spec, prefix=args.prefix, store=args.store,
                            command=_command(args), installer=args.installer,
                            force=args.force, replace=args.replace,
                            storage_options=_options(args), lease_s=args.lease,
                            wait_timeout_s=args.wait_timeout, progress=progress, key=env_key)
    _report(result, args.json)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    _check_target(args)
    store = _require_store(args)
    env_key = _env_key(args)
    if args.capture:
        from snapshot.capture import ensure_capture

        result = ensure_capture(args.capture, _command(args), store=store,
                                storage_options=_options(args), key=env_key, rebuild=True)
    else:
        from snapshot.ensure import create

        result = create(args.spec, prefix=args.prefix, store=store, command=_command(args),
                        installer=args.installer, replace=args.replace,
                        storage_options=_options(args), key=env_key)
    _report(result, args.json)
    return 0


def _report(result: Any, as_json: bool) -> None:
    for warning in getattr(result, "warnings", []):
        print(f"bootseer: warning: {warning}", file=sys.stderr)
    if as_json:
        print(json.dumps(asdict(result), indent=1, default=str))
        return
    line = f"env {result.key}: {result.outcome} at {result.prefix} in {result.seconds:.2f}s"
    if result.restore is not None:
        line += (f" ({result.restore.files} files, {human_bytes(result.restore.bytes)}, "
                 f"{human_bytes(result.restore.compressed_bytes)} fetched)")
    if result.installer:
        line += f" (installed with {result.installer})"
    if result.publish is not None:
        line += (" (published)" if result.publish.published
                 else " (another node published it first)")
    print(line, file=sys.stderr)


def cmd_restore(args: argparse.Namespace) -> int:
    from snapshot.restore import restore
    from snapshot.store import SnapshotStore

    store = SnapshotStore(_require_store(args), _options(args))
    with ByteProgress(f"restore {args.key[:12]} -> {args.prefix}") as progress:
        result = restore(store, args.key, args.prefix, force=args.force, replace=args.replace,
                         fsync=args.fsync, progress=progress)
    print(f"restored {result.key} to {result.prefix}: {result.files} files, "
          f"{human_bytes(result.bytes)} in {result.seconds:.2f}s", file=sys.stderr)
    if result.relocation is not None:
        print(result.relocation.summary(), file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from snapshot.restore import verify

    result = verify(args.prefix, args.key)
    print(f"{args.prefix}: {'intact' if result.ok else 'NOT OK'}: {result.reason} "
          f"(key {result.key}, {result.checked} entries, {result.seconds:.2f}s)")
    for problem in result.problems:
        print(f"  {problem}")
    return 0 if result.ok else 1


def cmd_ls(args: argparse.Namespace) -> int:
    from snapshot.store import SnapshotStore

    manifests = SnapshotStore(_require_store(args), _options(args)).list()
    if args.json:
        print(json.dumps([{"key": m.key, "kind": m.kind, "prefix": m.prefix,
                           "created": m.created, "host": m.host, "installer": m.installer,
                           "files": m.files, "bytes": m.bytes,
                           "compressed_bytes": m.compressed_size,
                           "capture": m.capture.get("roots")} for m in manifests], indent=1))
        return 0
    if not manifests:
        print(f"no snapshots in {args.store}")
        return 0
    print(f"{'KEY':40}  {'CREATED':19}  {'FILES':>7}  {'SIZE':>10}  {'STORED':>10}  WHAT")
    for m in manifests:
        created = datetime.fromtimestamp(m.created).strftime("%Y-%m-%d %H:%M:%S")
        what = m.prefix if m.kind == "prefix" else "capture " + " ".join(m.capture["roots"])
        print(f"{m.key:40}  {created}  {m.files:>7}  {human_bytes(m.bytes):>10}  "
              f"{human_bytes(m.compressed_size):>10}  {what} ({m.installer or m.host})")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from snapshot.store import SnapshotStore

    store = SnapshotStore(_require_store(args), _options(args))
    for key in args.keys:
        store.remove(key)
        print(f"removed {key}")
    return 0


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise CliError(f"--older-than {text!r}: use seconds or a number with s, m, h, d or w "
                       f"(e.g. 12h, 14d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def cmd_gc(args: argparse.Namespace) -> int:
    from snapshot.store import SnapshotStore

    store = SnapshotStore(_require_store(args), _options(args))
    started = time.monotonic()
    removed = store.gc(parse_duration(args.older_than), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"{verb} {len(removed)} item(s) in {time.monotonic() - started:.1f}s",
          file=sys.stderr)
    return 0
