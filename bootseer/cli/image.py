"""``bootseer image``: convert images to the seekable format, mount them lazily, record a
start's hot blocks, and prefetch them.

    bootseer image convert registry:5000/team/train:v1 registry:5000/team/train:v1-lazy
    bootseer image record registry:5000/team/train:v1-lazy -- python3 -c "import torch"
    bootseer image mount registry:5000/team/train:v1-lazy /run/rootfs      # prefetches
    bootseer image prefetch registry:5000/team/train:v1-lazy               # warmup, no mount
    bootseer image verify registry:5000/team/train:v1-lazy    # the lazy view == a plain unpack
    bootseer image pull registry:5000/team/train:v1-lazy --address /run/containerd/containerd.sock
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..config import add_config_arguments
from ..progress import human_bytes
from .errors import CliError
from .mounts import remove_own_log, start_background_mount

log = logging.getLogger("bootseer")

#: The [image] keys of commands that open an image (its block cache: image.cache, by default
#: <state.dir>/images, the cache `bootseer warmup` fills); `--cache` is `--image-cache`.
_OPEN_KEYS = ("state", "image.cache", "image.platform", "image.connections")
_SHORT = {"image.cache": "--cache"}


def _platform_arg(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ("image.platform",))


def register(sub: argparse._SubParsersAction) -> None:
    img = sub.add_parser("image", help="lazy images: convert, mount, record, prefetch")
    img_sub = img.add_subparsers(dest="image_command", metavar="SUBCOMMAND", required=True)

    convert = img_sub.add_parser(
        "convert",
        help="rewrite an image's layers into the seekable format and push it (idempotent)",
    )
    convert.add_argument("src")
    convert.add_argument("dst")
    _platform_arg(convert)
    convert.add_argument("--frame-size", type=int, default=None, help="bytes (default 1 MiB)")
    convert.add_argument("--level", type=int, default=None, help="zstd level (default 9)")
    convert.set_defaults(func=cmd_convert)

    mount = img_sub.add_parser(
        "mount",
        help="the image's root filesystem, lazily (prefetching its profile when there is one)",
    )
    mount.add_argument("ref")
    mount.add_argument("mountpoint")
    _open_args(mount)
    mount.add_argument("--no-prefetch", action="store_true", help="ignore the profile")
    mount.add_argument("--foreground", action="store_true", help="serve in this process")
    mount.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the mount")
    mount.add_argument("--stats", help="write fetch statistics (JSON) here at unmount")
    mount.set_defaults(func=cmd_mount)

    umount = img_sub.add_parser("umount", help="unmount a lazy image")
    umount.add_argument("mountpoint")
    umount.add_argument("--lazy", action="store_true")
    umount.set_defaults(func=cmd_umount)

    record = img_sub.add_parser(
        "record",
        usage="bootseer image record REF [options] -- CMD [ARGS...]",
        help="mount lazily, run CMD in the rootfs (chroot), store the frames it read "
        "in first-access order as the image's profile",
    )
    record.add_argument("ref")
    _open_args(record)
    record.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="stop recording after this many seconds (default 600)",
    )
    record.add_argument(
        "--no-chroot",
        action="store_true",
        help="run CMD as is, with $BOOTSEER_ROOTFS set to the mount",
    )
    record.set_defaults(func=cmd_record, takes_command=True, command=None)

    prefetch = img_sub.add_parser(
        "prefetch", help="fill the block cache from the profile without mounting (what warmup does)"
    )
    prefetch.add_argument("ref")
    _open_args(prefetch)
    prefetch.add_argument("--all", action="store_true", help="every frame, not only the profile's")
    prefetch.set_defaults(func=cmd_prefetch)

    verify = img_sub.add_parser(
        "verify",
        help="download a converted image once and check "
        "that its lazy view equals a plain unpack (every "
        "frame, every TOC entry against its tar header)",
    )
    verify.add_argument("ref")
    _platform_arg(verify)
    verify.set_defaults(func=cmd_verify)

    pull = img_sub.add_parser(
        "pull",
        help="put an image into containerd through a "
        "snapshotter: converted layers lazily, others "
        "unpacked",
    )
    pull.add_argument("ref")
    pull.add_argument(
        "--address",
        default="/run/containerd/containerd.sock",
        help="containerd's socket (default %(default)s)",
    )
    pull.add_argument("--namespace", default="default", help="containerd namespace")
    pull.add_argument(
        "--snapshotter",
        default="bootseer",
        help="the proxy plugin's name in containerd's config (default bootseer)",
    )
    pull.add_argument(
        "--local",
        action="store_true",
        help="then fetch every lazy layer whole and write it out on the node: "
        "containers start from local files at overlayfs's speed, without "
        "the registry (a warm standby)",
    )
    _platform_arg(pull)
    pull.set_defaults(func=cmd_pull)


def _open_args(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, _OPEN_KEYS, short=_SHORT)


def cmd_convert(args: argparse.Namespace) -> int:
    from prefetch import convert_image

    options: dict[str, Any] = {}
    if args.frame_size:
        options["frame_size"] = args.frame_size
    if args.level:
        options["level"] = args.level
    result = convert_image(args.src, args.dst, platform=args.cfg.image.platform, **options)
    verb = "converted" if result.converted else "already converted"
    print(
        f"{verb} {args.src} -> {args.dst} ({result.digest}): {result.layers} layer(s), "
        f"{human_bytes(result.size_before)} -> {human_bytes(result.size_after)} in "
        f"{result.seconds:.1f}s"
    )
    return 0


def _open(args: argparse.Namespace, *, record: bool = False):
    from prefetch import open_image

    image = args.cfg.image
    return open_image(
        args.ref, image.cache, platform=image.platform, connections=image.connections, record=record
    )


def _start_prefetch(image: Any, everything: bool = False) -> str:
    from prefetch import load_profile, plan_prefetch, profile_summary

    profile = load_profile(image)
    if profile is None and not everything:
        return "no profile: lazy reads only"
    if everything:
        plan = [(b, i) for b in image.blobs for i in range(len(b.frames))]
        full = True
    else:
        plan, full = plan_prefetch(profile, image.blobs)
    queued = image.lazy.fetcher.prefetch(plan)
    if profile is not None:
        s = profile_summary(profile, image.blobs)
        return (
            f"prefetching {queued} frame(s) ({s['coverage']:.0%} of the image"
            f"{', then the rest: the profile covers most of it' if full else ''})"
        )
    return f"prefetching all {queued} frame(s)"


def _stats_line(image: Any) -> str:
    s = image.lazy.fetcher.report()
    return (
        f"frames read {s.frames_read} (cache hits {s.cache_hits}), prefetched "
        f"{s.prefetched} ({s.prefetched_unused} unused), fetched "
        f"{human_bytes(s.bytes_fetched)} in {s.requests} request(s), "
        f"readers waited {s.seconds_waiting:.2f}s"
    )


def cmd_mount(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.mountpoint):
        raise CliError(f"mount point {args.mountpoint} is not a directory: create it first")
    if not args.foreground:
        return _mount_in_background(args)
    from prefetch import mount_image

    image = _open(args)
    try:
        if not args.no_prefetch:
            log.info("%s", _start_prefetch(image))
        mount_image(image.lazy, args.mountpoint, foreground=True)
    finally:
        line = _stats_line(image)
        log.info("unmounted %s: %s", args.mountpoint, line)
        if args.stats:
            Path(args.stats).write_text(json.dumps(image.lazy.fetcher.report().as_dict()))
        image.close()
    remove_own_log()  # unmounted cleanly: a background mount's log is not needed
    return 0


def _mount_in_background(args: argparse.Namespace) -> int:
    image = args.cfg.image
    argv = [
        sys.executable,
        "-m",
        "bootseer",
        "-v",
        "image",
        "mount",
        args.ref,
        args.mountpoint,
        "--foreground",
        "--image-cache",
        image.cache,
        "--platform",
        image.platform,
        "--connections",
        str(image.connections),
    ]
    if args.no_prefetch:
        argv.append("--no-prefetch")
    if args.stats:
        argv += ["--stats", args.stats]
    return start_background_mount(
        argv, args.mountpoint, timeout=args.timeout, what=args.ref, kind="image"
    )


def cmd_umount(args: argparse.Namespace) -> int:
    from striped_fs import fuse

    fuse.unmount(args.mountpoint, lazy=args.lazy)
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from prefetch import mount_image, save_profile
    from striped_fs import fuse

    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError(
            "record needs the start to record after --, e.g. -- python3 -c 'import torch'"
        )
    image = _open(args, record=True)
    mnt = tempfile.mkdtemp(prefix="bootseer-record-")
    thread = threading.Thread(
        target=mount_image, args=(image.lazy, mnt), kwargs={"dev_suid": True}, daemon=True
    )
    try:
        thread.start()
        fuse.wait_mounted(mnt, timeout=30)
        env = dict(os.environ, BOOTSEER_ROOTFS=mnt)
        argv = command if args.no_chroot else ["chroot", mnt, *command]
        started = time.monotonic()
        try:
            code = subprocess.run(argv, env=env, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = None
            log.warning("recording stopped after %.0fs (--timeout)", args.timeout)
        profile = image.lazy.recorder.stop()
        elapsed = time.monotonic() - started
    finally:
        fuse.unmount(mnt, lazy=True)
        thread.join(10)
        os.rmdir(mnt)
    try:
        digest = save_profile(image, profile)
        print(
            f"recorded {len(profile.frames)} frame(s) in {elapsed:.1f}s (command exit "
            f"{code}); profile {digest} stored with {args.ref}"
        )
        print(_stats_line(image))
    finally:
        image.close()
    return 0 if code == 0 else 1


def cmd_prefetch(args: argparse.Namespace) -> int:
    image = _open(args)
    try:
        started = time.monotonic()
        message = _start_prefetch(image, everything=args.all)
        print(message)
        if not image.lazy.fetcher.wait_idle():
            raise CliError("prefetch did not finish")
        s = image.lazy.fetcher.report()
        print(
            f"prefetched {s.prefetched} frame(s), {human_bytes(s.bytes_fetched)} in "
            f"{time.monotonic() - started:.1f}s into {args.cfg.image.cache}"
        )
        if s.failures:
            raise CliError(f"{s.failures} range request(s) failed; see the log")
    finally:
        image.close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from prefetch import verify_image

    r = verify_image(args.ref, platform=args.cfg.image.platform)
    print(
        f"verified {args.ref} ({r.digest}): {r.layers} layer(s), {r.frames} frame(s), "
        f"{r.members} member(s), {human_bytes(r.bytes)} in {r.seconds:.1f}s: the lazy view "
        "equals a plain unpack"
    )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from prefetch import pull_image

    result = pull_image(
        args.ref,
        args.address,
        namespace=args.namespace,
        snapshotter=args.snapshotter,
        platform=args.cfg.image.platform,
        local=args.local,
    )
    print(
        f"pulled {result.image} ({result.manifest[:19]}) in {result.seconds:.2f} s: "
        f"{result.lazy_layers} layers lazy, {result.unpacked_layers} unpacked "
        f"({human_bytes(result.bytes_downloaded)} downloaded), {result.present_layers} "
        f"already present"
        + (
            f", written out locally in {result.phases['local']:.2f} s"
            if "local" in result.phases
            else ""
        )
        + f"; run it with: ctr -n {args.namespace} run --snapshotter "
        f"{args.snapshotter} {result.image} ID CMD"
    )
    return 0
