"""``bootseer env``: dependency environments installed once, snapshotted, restored everywhere.

The line for a container entrypoint::

    bootseer env ensure --spec requirements.txt --prefix /opt/venv --store s3://bucket/envs

The settings are the configuration's ``[env]`` keys, as ``bootseer run`` reads them (file,
``BOOTSEER_ENV_*``, flags); inside ``bootseer env`` their flags may drop the ``env-`` prefix
(``--store`` is ``--env-store``).
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

from ..config import add_config_arguments, storage_options
from ..progress import ByteProgress, human_bytes
from .errors import CliError
from .options import trailing_command

log = logging.getLogger("bootseer")

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def register(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser(
        "env", help="dependency environments: ensure, create, restore, mount, ls, gc"
    )
    env_sub = env.add_subparsers(dest="env_command", metavar="SUBCOMMAND", required=True)

    key = env_sub.add_parser("key", help="print the key of an environment and every input")
    _key_args(key)
    key.add_argument("--json", action="store_true", help="machine-readable output")
    key.set_defaults(func=cmd_key)

    ensure = env_sub.add_parser(
        "ensure",
        help="verify, restore or build (install, pack, publish) an environment",
        description="Hit: restore the snapshot (or only verify, when the prefix already holds "
        "it). Miss: install (a venv at --prefix with uv when present, else pip, or "
        "the command after --), pack and publish. With --capture, snapshot what a "
        "setup command changes under those paths, and replay it (env.spec and "
        "env.prefix of the file or environment are then not used).",
    )
    _key_args(ensure, _TARGET_KEYS)
    _target_args(ensure)
    ensure.add_argument(
        "--lease",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a builder that stops renewing its lease this long is replaced",
    )
    ensure.add_argument(
        "--wait-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="longest wait for another node's build before building here",
    )
    ensure.set_defaults(func=cmd_ensure)

    create = env_sub.add_parser(
        "create",
        help="build and publish, even if the store has it (replaces nothing there: the first wins)",
    )
    _key_args(create, _TARGET_KEYS)
    _target_args(create)
    create.set_defaults(func=cmd_create)

    restore = env_sub.add_parser("restore", help="restore a snapshot by key")
    restore.add_argument("key", help="the key, as `bootseer env key` or `ls` prints it")
    _config_args(restore, ("env.prefix", "env.store", "storage", "striped"))
    restore.add_argument(
        "--force",
        action="store_true",
        help="restore to another prefix even if binaries embed the old one",
    )
    restore.add_argument(
        "--replace",
        action="store_true",
        help="swap out a non-empty prefix that bootseer did not make",
    )
    restore.add_argument(
        "--fsync",
        action="store_true",
        help="sync the filesystem before moving the environment into place",
    )
    restore.set_defaults(func=cmd_restore)

    verify = env_sub.add_parser(
        "verify",
        help="does a prefix hold an intact environment? (every file, now)",
        description="Check every member of the environment at PREFIX against the record "
        "its restore wrote: type, size, mtime and mode, and no entries the snapshot does "
        "not hold (bytecode in __pycache__ aside). Exit 0: intact; 2: not (the first "
        "mismatches listed; `bootseer env restore` or the next start repairs it).",
    )
    verify.add_argument("prefix")
    verify.add_argument("--key", help="the key it must hold (default: any)")
    verify.set_defaults(func=cmd_verify)

    mount = env_sub.add_parser(
        "mount",
        help="serve a snapshot lazily at PREFIX (FUSE, read-only): chunks fetched as read",
        description="Mount snapshot KEY read-only at PREFIX (an empty or missing directory) "
        "and return once it is up: the manifest and TOC were read and every member checked, "
        "nothing else fetched. The mount process then fetches the chunks the key's read "
        "profile names, then the rest, into the node-local cache (env.cache); a read jumps "
        "that queue. The chunks this start reads become the key's profile when it has none. "
        "A chunk that fails verification is EIO, never wrong bytes. Unmount with "
        "`bootseer env unmount PREFIX`.",
    )
    mount.add_argument("key", help="the key, as `bootseer env key` or `ls` prints it")
    mount.add_argument("prefix", help="where to mount (the prefix the snapshot was built at)")
    _config_args(mount, ("env.store", "env.cache", "storage", "striped"))
    mount.add_argument(
        "--no-prefetch",
        action="store_true",
        help="fetch only what is read (no profile, no background fetch of the rest)",
    )
    mount.add_argument(
        "--record-profile",
        choices=("auto", "always", "never"),
        default="auto",
        help="store the chunks this start reads as the key's profile: when it has none "
        "(auto), always, or never",
    )
    mount.add_argument(
        "--profile-seconds",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long after the mount reads count for the profile (or until the unmount)",
    )
    mount.add_argument(
        "--read-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a read waits this long for its chunk (the store lost), then fails with EIO",
    )
    mount.add_argument(
        "--foreground", action="store_true", help="serve in this process until unmounted"
    )
    mount.add_argument(
        "--wait-complete",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after mounting, wait up to this long for every chunk to be local",
    )
    mount.set_defaults(func=cmd_mount)

    unmount = env_sub.add_parser("unmount", help="unmount a lazily served environment")
    unmount.add_argument("prefix")
    unmount.add_argument(
        "--lazy", action="store_true", help="detach it even while processes still use it"
    )
    unmount.set_defaults(func=cmd_unmount)

    ls = env_sub.add_parser("ls", help="snapshots in a store")
    _config_args(ls, _STORE_KEYS)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)

    rm = env_sub.add_parser("rm", help="delete snapshots")
    rm.add_argument("keys", nargs="+", metavar="KEY")
    _config_args(rm, _STORE_KEYS)
    rm.set_defaults(func=cmd_rm)

    gc = env_sub.add_parser("gc", help="delete old snapshots and leftovers of dead publishers")
    _config_args(gc, _STORE_KEYS)
    gc.add_argument("--older-than", required=True, metavar="AGE", help="e.g. 3600, 90m, 12h, 14d")
    gc.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    gc.set_defaults(func=cmd_gc)


#: The short spellings of the [env] keys' flags inside `bootseer env`.
SHORT = {
    "env.spec": "--spec",
    "env.prefix": "--prefix",
    "env.store": "--store",
    "env.base_image": "--base-image",
}
_KEY_KEYS = ("env.spec", "env.base_image")
_TARGET_KEYS = (
    "state",
    "env.spec",
    "env.base_image",
    "env.prefix",
    "env.store",
    "env.uv",
    "storage",
    "striped",
)
_STORE_KEYS = ("env.store", "storage")


def _config_args(p: argparse.ArgumentParser, keys: tuple[str, ...]) -> None:
    add_config_arguments(p, keys, short=SHORT)


def _key_args(p: argparse.ArgumentParser, keys: tuple[str, ...] = _KEY_KEYS) -> None:
    _config_args(p, keys)
    p.add_argument("--python", help="interpreter to build with (default: this one)")
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another input of the key, e.g. cuda=12.4 (repeatable)",
    )
    p.add_argument(
        "--capture",
        action="append",
        default=[],
        metavar="PATH",
        help="capture mode: snapshot what the command changes under PATH (repeatable)",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after --: the install (or setup) command; {prefix} is replaced",
    )
    p.set_defaults(takes_command=True)


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--installer",
        choices=("auto", "uv", "pip"),
        default="auto",
        help="default install: uv when present (auto), or force one",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="restore to another prefix even if binaries embed the old one",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="swap out a non-empty prefix that bootseer did not make",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return storage_options(args.cfg)


def _command(args: argparse.Namespace) -> list[str] | None:
    return trailing_command(args)


def _store(args: argparse.Namespace) -> str | None:
    return args.cfg.env.store or None


def _require_store(args: argparse.Namespace) -> str:
    store = _store(args)
    if not store:
        raise CliError("no snapshot store: pass --store URL or set BOOTSEER_ENV_STORE (env.store)")
    return store


def _flagged(args: argparse.Namespace, key: str) -> bool:
    return args.cfg.source(key).startswith("flag ")


def _spec(args: argparse.Namespace) -> list[str]:
    """env.spec; in capture mode only as given on the command line (the file's [env] is the
    job's environment, not a capture's)."""
    if getattr(args, "capture", None) and not _flagged(args, "env.spec"):
        return []
    return args.cfg.env.spec


def _prefix(args: argparse.Namespace) -> str:
    if getattr(args, "capture", None) and not _flagged(args, "env.prefix"):
        return ""
    return args.cfg.env.prefix


def _env_key(args: argparse.Namespace):
    from snapshot import compute_key, parse_extras

    return compute_key(
        _spec(args),
        _command(args),
        python=args.python,
        base_image=args.cfg.env.base_image or None,
        extras=parse_extras(args.extra),
        capture=args.capture,
    )


def cmd_key(args: argparse.Namespace) -> int:
    env_key = _env_key(args)
    if args.json:
        print(json.dumps(env_key.to_json(), indent=1))
    else:
        print(env_key.describe())
    return 0


def _check_target(args: argparse.Namespace) -> None:
    if args.capture:
        if _prefix(args):
            raise CliError(
                "--capture and --prefix exclude each other: a capture replays "
                "changes under its paths"
            )
        if not _command(args):
            raise CliError("--capture needs the setup command after --")
    elif not _prefix(args):
        raise CliError("--prefix is required (where the environment lives; env.prefix)")
    if not _spec(args) and not _command(args):
        raise CliError("nothing to install: pass --spec FILE, or the install command after --")


def cmd_ensure(args: argparse.Namespace) -> int:
    _check_target(args)
    env_key = _env_key(args)
    if args.capture:
        from snapshot import ensure_capture

        result = ensure_capture(
            args.capture,
            _command(args),
            store=_store(args),
            storage_options=_options(args),
            key=env_key,
            state_dir=args.cfg.state.dir,
        )
    else:
        from snapshot import ensure

        prefix = _prefix(args)
        with ByteProgress(f"env {env_key.key[:12]} -> {prefix}") as progress:
            result = ensure(
                _spec(args),
                prefix=prefix,
                store=_store(args),
                command=_command(args),
                installer=args.installer,
                uv=args.cfg.env.uv or None,
                force=args.force,
                replace=args.replace,
                storage_options=_options(args),
                lease_s=args.lease,
                wait_timeout_s=args.wait_timeout,
                progress=progress,
                key=env_key,
            )
    _report(result, args.json)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    _check_target(args)
    store = _require_store(args)
    env_key = _env_key(args)
    if args.capture:
        from snapshot import ensure_capture

        result = ensure_capture(
            args.capture,
            _command(args),
            store=store,
            storage_options=_options(args),
            key=env_key,
            rebuild=True,
            state_dir=args.cfg.state.dir,
        )
    else:
        from snapshot import create

        result = create(
            _spec(args),
            prefix=_prefix(args),
            store=store,
            command=_command(args),
            installer=args.installer,
            uv=args.cfg.env.uv or None,
            replace=args.replace,
            storage_options=_options(args),
            key=env_key,
        )
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
        line += (
            f" ({result.restore.files} files, {human_bytes(result.restore.bytes)}, "
            f"{human_bytes(result.restore.compressed_bytes)} fetched)"
        )
    if result.installer:
        line += f" (installed with {result.installer})"
    if result.publish is not None:
        line += " (published)" if result.publish.published else " (another node published it first)"
    print(line, file=sys.stderr)


def cmd_restore(args: argparse.Namespace) -> int:
    from snapshot import SnapshotStore, restore

    prefix = args.cfg.env.prefix
    if not prefix:
        raise CliError("--prefix is required (where the environment goes; env.prefix)")
    store = SnapshotStore(_require_store(args), _options(args))
    with ByteProgress(f"restore {args.key[:12]} -> {prefix}") as progress:
        result = restore(
            store,
            args.key,
            prefix,
            force=args.force,
            replace=args.replace,
            fsync=args.fsync,
            progress=progress,
        )
    print(
        f"restored {result.key} to {result.prefix}: {result.files} files, "
        f"{human_bytes(result.bytes)} in {result.seconds:.2f}s",
        file=sys.stderr,
    )
    if result.relocation is not None:
        print(result.relocation.summary(), file=sys.stderr)
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from snapshot import mount_lazy, serve_lazy
    from striped_fs import make_dir

    prefix = os.path.abspath(args.prefix)
    store = _require_store(args)
    cache = args.cfg.env.cache
    settings = dict(
        cache_dir=cache,
        storage_options=_options(args) or None,
        prefetch=not args.no_prefetch,
        record=args.record_profile,
        profile_s=args.profile_seconds,
        read_timeout_s=args.read_timeout,
    )
    if args.foreground:
        return serve_lazy(store, args.key, prefix, **settings)
    make_dir(cache)
    tag = f"{args.key[:16]}-{os.getpid()}"
    mounted = mount_lazy(
        store,
        args.key,
        prefix,
        stats_path=os.path.join(cache, f"mount-{tag}.json"),
        log_path=os.path.join(cache, f"mount-{tag}.log"),
        **settings,
    )
    stats = mounted.stats()
    line = f"mounted {args.key} at {prefix} (mount process {mounted.proc.pid}; log {cache}/mount-{tag}.log)"
    if args.wait_complete > 0:
        done = mounted.wait_complete(args.wait_complete)
        stats = mounted.stats()
        line += "; every chunk local" if done else "; still fetching"
    print(line, file=sys.stderr)
    if stats.get("profile"):
        print(f"  read profile: {stats['profile']['chunks']} chunks queued first", file=sys.stderr)
    return 0


def cmd_unmount(args: argparse.Namespace) -> int:
    from snapshot import unmount_lazy

    prefix = os.path.abspath(args.prefix)
    if not unmount_lazy(prefix, lazy=args.lazy):
        print(f"nothing is mounted at {prefix}", file=sys.stderr)
        return 1
    print(f"unmounted {prefix}", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from snapshot import verify

    prefix = os.path.abspath(args.prefix)
    result = verify(prefix, args.key)
    print(
        f"{prefix}: {'intact' if result.ok else 'NOT OK'}: {result.reason} "
        f"(key {result.key}, {result.checked} entries, {result.seconds:.2f}s)"
    )
    for problem in result.problems:
        print(f"  {problem}")
    if result.key and (result.problems or result.reason.startswith("a check found")):
        print(
            f"  repair: bootseer env restore {result.key} --prefix {prefix} --store STORE "
            f"(or the next `bootseer run` restores it)"
        )
    return 0 if result.ok else 2


def cmd_ls(args: argparse.Namespace) -> int:
    from snapshot import SnapshotStore

    manifests = SnapshotStore(_require_store(args), _options(args)).list()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "key": m.key,
                        "kind": m.kind,
                        "prefix": m.prefix,
                        "created": m.created,
                        "host": m.host,
                        "installer": m.installer,
                        "files": m.files,
                        "bytes": m.bytes,
                        "compressed_bytes": m.compressed_size,
                        "capture": m.capture.get("roots"),
                    }
                    for m in manifests
                ],
                indent=1,
            )
        )
        return 0
    if not manifests:
        print(f"no snapshots in {_store(args)}")
        return 0
    print(f"{'KEY':40}  {'CREATED':19}  {'FILES':>7}  {'SIZE':>10}  {'STORED':>10}  WHAT")
    for m in manifests:
        created = datetime.fromtimestamp(m.created).strftime("%Y-%m-%d %H:%M:%S")
        what = m.prefix if m.kind == "prefix" else "capture " + " ".join(m.capture["roots"])
        print(
            f"{m.key:40}  {created}  {m.files:>7}  {human_bytes(m.bytes):>10}  "
            f"{human_bytes(m.compressed_size):>10}  {what} ({m.installer or m.host})"
        )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from snapshot import SnapshotStore

    store = SnapshotStore(_require_store(args), _options(args))
    for key in args.keys:
        store.remove(key)
        print(f"removed {key}")
    return 0


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise CliError(
            f"--older-than {text!r}: use seconds or a number with s, m, h, d or w (e.g. 12h, 14d)"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def cmd_gc(args: argparse.Namespace) -> int:
    from snapshot import SnapshotStore

    store = SnapshotStore(_require_store(args), _options(args))
    started = time.monotonic()
    removed = store.gc(parse_duration(args.older_than), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"{verb} {len(removed)} item(s) in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0
