"""``bootseer demo``: the main job on embedded defaults (local services, nothing to configure).

``bootseer demo`` (``restart``) runs the quick form of the end-to-end scenario
(``benchmarks/bench_e2e.py --quick``): a training job in a container started by containerd,
a rank killed, the restart timed for the baseline and for bootseer, the phase breakdown
printed and charted. ``bootseer demo striped`` shows striped_fs alone: a file written and
read through a shaped link to S3 (moto), plain single-stream s3fs against striped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from striped_fs import StripedFileSystem, parse_size

from ..progress import human_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on embedded defaults (local services)")
    p.add_argument(
        "scenario",
        nargs="?",
        choices=("restart", "striped"),
        default="restart",
        help="restart: the end-to-end restart scenario, quick form (default); "
        "striped: striped S3 reads and writes only",
    )
    p.add_argument(
        "--results",
        default="demo-results",
        help="where the restart scenario writes e2e.json, e2e.md and e2e.png",
    )
    p.add_argument("--size", default="64MiB", help="file size (default 64MiB)")
    p.add_argument(
        "--stripe-size",
        default="2MiB",
        help="stripe size for the demo (default 2MiB, so a small file still spans many streams)",
    )
    p.add_argument("--per-conn-mbps", type=float, default=10.0)
    p.add_argument("--total-mbps", type=float, default=160.0)
    p.add_argument("--latency-ms", type=float, default=1.0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.scenario == "restart":
        return run_restart(args)
    return run_striped(args)


def run_restart(args: argparse.Namespace) -> int:
    """The quick end-to-end scenario, through the benchmark harness of the source checkout."""
    from .bench import benchmarks_dir, run_child

    results = os.path.abspath(args.results)
    print(
        "bootseer demo: the end-to-end restart scenario, quick form (a few minutes: an image "
        "built and pushed, two cold starts, two measured restarts)"
    )
    # The report it prints ends with the breakdown table, the verdict and the chart's path.
    return run_child(
        [sys.executable, str(benchmarks_dir() / "bench_e2e.py"), "--quick", "--results", results]
    ).status


def run_striped(args: argparse.Namespace) -> int:
    import s3fs

    from ..testing.servers import MotoS3Server
    from ..testing.shaper import ShaperProcess, ShaperSettings

    size = parse_size(args.size, name="--size")
    settings = ShaperSettings.from_mb(args.latency_ms, args.per_conn_mbps, args.total_mbps)
    data = os.urandom(size)
    print(f"bootseer demo: {human_bytes(size)} through a shaped link ({settings.describe()})")
    with (
        MotoS3Server(in_process=False) as server,
        ShaperProcess("127.0.0.1", server.port, settings) as shaper,
    ):
        server.create_bucket("demo")
        options = server.storage_options(endpoint_url=f"http://{shaper.address}")
        plain = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        striped = StripedFileSystem(
            target_protocol="s3",
            target_options=options,
            stripe_size=args.stripe_size,
            skip_instance_cache=True,
        )
        rows = []
        for label, write, read in (
            (
                "plain s3fs (1 stream)",
                lambda: plain.pipe_file("demo/plain.bin", data),
                lambda: plain.cat_file("demo/plain.bin"),
            ),
            (
                f"striped ({striped.options.concurrency} streams)",
                lambda: striped.pipe_file("demo/striped.bin", data),
                lambda: striped.cat_file("demo/striped.bin"),
            ),
        ):
            t0 = time.perf_counter()
            write()
            t1 = time.perf_counter()
            back = read()
            t2 = time.perf_counter()
            if back != data:
                raise SystemExit(f"demo: {label} returned different bytes")
            rows.append((label, size / (t1 - t0), size / (t2 - t1)))
    print(f"{'method':<26} {'write':>12} {'read':>12}")
    for label, w, r in rows:
        print(f"{label:<26} {w / 1e6:>8.1f} MB/s {r / 1e6:>7.1f} MB/s")
    print(
        f"striped speed-up: write {rows[1][1] / rows[0][1]:.1f}x, read {rows[1][2] / rows[0][2]:.1f}x "
        f"(link cap {args.total_mbps:g} MB/s total); bytes verified equal"
    )
    return 0
