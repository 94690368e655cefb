"""``bootseer fs``: striped copies, stat, listing, garbage collection and the FUSE mount."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from striped_fs import redact, split_credentials, url_to_fs

from ..config import add_config_arguments, storage_options
from ..progress import ByteProgress, human_bytes
from .errors import CliError
from .mounts import remove_own_log, start_background_mount


def register(sub: argparse._SubParsersAction) -> None:
    fs = sub.add_parser("fs", help="parallel striped I/O over fsspec URLs (file, s3, http, hdfs)")
    fs_sub = fs.add_subparsers(dest="fs_command", metavar="SUBCOMMAND", required=True)

    cp = fs_sub.add_parser("cp", help="copy a file; remote sides are read/written striped")
    cp.add_argument("src", help="path or URL (s3://b/k, http://h/f, striped::file:///x)")
    cp.add_argument("dst", help="path or URL")
    _stripe_args(cp)
    cp.set_defaults(func=cmd_cp, store_args=("src", "dst"))

    stat = fs_sub.add_parser("stat", help="size and layout of a file (JSON)")
    stat.add_argument("url")
    _stripe_args(stat)
    stat.set_defaults(func=cmd_stat, store_args=("url",))

    ls = fs_sub.add_parser("ls", help="list a directory with logical sizes")
    ls.add_argument("url")
    _stripe_args(ls)
    ls.set_defaults(func=cmd_ls, store_args=("url",))

    gc = fs_sub.add_parser("gc", help="remove stripes left by killed or failed writers")
    gc.add_argument("url")
    gc.add_argument(
        "--older-than",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="only versions untouched this long (default 3600)",
    )
    _stripe_args(gc)
    gc.set_defaults(func=cmd_gc, store_args=("url",))

    mount = fs_sub.add_parser("mount", help="FUSE-mount a URL (the same striped view)")
    mount.add_argument("url")
    mount.add_argument("mountpoint")
    mount.add_argument("--read-only", action="store_true")
    mount.add_argument(
        "--foreground",
        "-f",
        action="store_true",
        help="stay attached; SIGINT/SIGTERM unmount (default: run in background)",
    )
    mount.add_argument("--allow-other", action="store_true")
    mount.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for a background mount (default 30)",
    )
    _stripe_args(mount)
    mount.set_defaults(func=cmd_mount)

    umount = fs_sub.add_parser("umount", help="unmount a bootseer FUSE mount")
    umount.add_argument("mountpoint")
    umount.add_argument("--lazy", action="store_true")
    umount.set_defaults(func=cmd_umount)


def _stripe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stripe-size", help="bytes per stripe, e.g. 8MiB (default 8MiB)")
    p.add_argument("--concurrency", type=int, help="parallel streams (default 16)")
    add_config_arguments(p, ("storage", "striped"))


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return storage_options(args.cfg)


def _fs(args: argparse.Namespace, url: str):
    return url_to_fs(
        url, _options(args), stripe_size=args.stripe_size, concurrency=args.concurrency
    )


def cmd_cp(args: argparse.Namespace) -> int:
    """A plain path as destination gets a plain file; a URL (s3://, file://) gets stripes."""
    src_fs, src = _fs(args, args.src)
    info = src_fs.info(src)
    if info["type"] == "directory":
        raise IsADirectoryError(f"{args.src} is a directory: bootseer fs cp copies one file")
    name = src.rstrip("/").rsplit("/", 1)[-1]
    with ByteProgress(f"cp {args.src} -> {args.dst}", info["size"]) as progress:
        if _is_plain_path(args.dst):
            dst = os.path.join(args.dst, name) if os.path.isdir(args.dst) else args.dst
            src_fs.get_file(src, dst, callback=progress)
        else:
            dst_fs, dst = _fs(args, args.dst)
            if dst_fs.isdir(dst):
                dst = f"{dst.rstrip('/')}/{name}"
            if _is_plain_path(args.src) and not info.get("striped"):
                dst_fs.put_file(src, dst, callback=progress)
            else:  # stream through a striped reader into a striped writer
                with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
                    while chunk := fin.read(dst_fs.options.stripe_size):
                        fout.write(chunk)
                        progress.relative_update(len(chunk))
    size = info["size"]
    print(
        f"copied {human_bytes(size)} in {progress.elapsed_s:.2f} s "
        f"({human_bytes(size / max(progress.elapsed_s, 1e-9))}/s)"
    )
    return 0


def _is_plain_path(url: str) -> bool:
    return "://" not in url and "::" not in url


def cmd_stat(args: argparse.Namespace) -> int:
    fs, path = _fs(args, args.url)
    info = fs.info(path)
    print(json.dumps({k: v for k, v in info.items() if _jsonable(v)}, indent=2, default=str))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    fs, path = _fs(args, args.url)
    entries = fs.ls(path, detail=True)
    for entry in entries:
        kind = "d" if entry["type"] == "directory" else ("s" if entry.get("striped") else "-")
        print(f"{kind} {entry.get('size') or 0:>14} {entry['name']}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    fs, path = _fs(args, args.url)
    n = fs.gc(path, older_than_s=args.older_than, on_remove=lambda p: print(f"removed {p}"))
    print(f"{n} unreferenced stripe version(s) removed")
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from striped_fs import fuse

    if not os.path.isdir(args.mountpoint):
        raise CliError(f"mount point {args.mountpoint} is not a directory: create it first")
    if not args.foreground:
        return _mount_in_background(args)
    fs, path = _fs(args, args.url)
    if not fs.exists(path):
        raise FileNotFoundError(f"{args.url} does not exist: nothing to mount")
    fuse.mount(  # a MountError is a StripedError: one line, named by the entry point
        fs,
        path,
        args.mountpoint,
        foreground=True,
        read_only=args.read_only,
        allow_other=args.allow_other,
    )
    remove_own_log()  # unmounted cleanly: a background mount's log is not needed
    return 0


def _mount_in_background(args: argparse.Namespace) -> int:
    # The mount outlives this command: its command line (visible to every local user in the
    # process list) carries no credentials; they travel in its environment.
    url, options = split_credentials(args.url, _options(args))
    argv = [sys.executable, "-m", "bootseer", "fs", "mount", url, args.mountpoint, "--foreground"]
    for flag, value in (("--stripe-size", args.stripe_size), ("--concurrency", args.concurrency)):
        if value is not None:
            argv += [flag, str(value)]
    env = {**os.environ, "BOOTSEER_STORAGE_OPTIONS": json.dumps(options)}
    if args.read_only:
        argv.append("--read-only")
    if args.allow_other:
        argv.append("--allow-other")
    return start_background_mount(
        argv, args.mountpoint, timeout=args.timeout, what=redact(args.url), kind="fs", env=env
    )


def cmd_umount(args: argparse.Namespace) -> int:
    from striped_fs import fuse

    fuse.unmount(args.mountpoint, lazy=args.lazy)
    return 0


def _jsonable(value: Any) -> bool:
    return isinstance(value, str | int | float | bool | type(None) | list | dict) or hasattr(
        value, "isoformat"
    )
