"""Micro-benchmark: what the lazy read path's checks cost per frame, against decompression.

Converts a tar (``--tar PATH``, e.g. ``tar -cf sp.tar -C .venv/lib/python3.11/site-packages
numpy pip grpc``) in memory, then times over every frame, best of ``--rounds``:

* decompression as before (``ZstdDecompressor.decompress(max_output_size=...)``) and now
  (``prefetch.toc.decompress_bounded``: the zstd frame walked, then decompressed);
* ``LayerIndex.verify_frame``: every TOC entry whose header starts in the frame checked
  against the tar header (the one-block fast path where it applies), and the same through
  ``tarfile`` only (the fast path disabled).

``python benchmarks/micro_layer_checks.py --tar sp.tar``; prints one line per figure.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zstandard  # noqa: E402

from prefetch import members  # noqa: E402
from prefetch.layer import convert_layer  # noqa: E402
from prefetch.toc import LayerIndex, decompress_bounded, zstd_frame  # noqa: E402


def best(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tar", required=True, help="an uncompressed tar to convert")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    out = io.BytesIO()
    started = time.perf_counter()
    with open(args.tar, "rb") as f:
        result = convert_layer(f, out)
    blob = out.getvalue()
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    frames = index.frames
    n, entries = len(frames), len(index.entries)
    print(
        f"layer: {result.tar_size / 1e6:.0f} MB tar, {n} frames, {entries} members "
        f"({entries / n:.1f} per frame), converted in {time.perf_counter() - started:.1f} s"
    )
    comps = [blob[f.c_offset : f.c_end] for f in frames]
    dctx = zstandard.ZstdDecompressor()
    old = best(
        lambda: [
            dctx.decompress(c, max_output_size=f.u_size) for c, f in zip(comps, frames, strict=True)
        ],
        args.rounds,
    )
    walk = best(lambda: [zstd_frame(c) for c in comps], args.rounds)
    new = best(
        lambda: [decompress_bounded(c, f.u_size) for c, f in zip(comps, frames, strict=True)],
        args.rounds,
    )
    raws = [decompress_bounded(c, f.u_size) for c, f in zip(comps, frames, strict=True)]

    def verify_all() -> None:
        index.verified.clear()
        for i, raw in enumerate(raws):
            index.verify_frame(i, raw, lambda j: raws[j])

    check = best(verify_all, args.rounds)
    quick = members._quick_match
    members._quick_match = lambda block, entry: False  # type: ignore[assignment]
    try:
        slow = best(verify_all, args.rounds)
    finally:
        members._quick_match = quick
    ms = 1e3 / n
    print(
        f"decompress per frame: before {old * ms:.3f} ms, now {new * ms:.3f} ms "
        f"(of which the frame walk {walk * ms:.4f} ms)"
    )
    print(
        f"TOC-vs-tar check per frame: {check * ms:.3f} ms ({check / old:.1%} of decompression;"
        f" {check / entries * 1e6:.1f} us per member)"
    )
    print(
        f"the same through tarfile only: {slow * ms:.3f} ms per frame "
        f"({slow / entries * 1e6:.1f} us per member)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
