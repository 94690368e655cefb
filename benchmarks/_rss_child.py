"""Child process of ``bench_striped.py``: stream one URL through ``striped::`` and report RSS.

Run as ``python _rss_child.py URL STRIPE_SIZE CONCURRENCY CHUNK``. Prints JSON lines: the
baseline ``ru_maxrss`` right after the imports, then the peak at the end, the bytes read, their
crc32 and the time taken. ``VmHWM`` (/proc/self/status) is reported beside it as a cross-check.

Linux carries ``ru_maxrss`` across ``execve`` from the memory image being replaced: a child
that Python's subprocess starts with vfork+exec inherits the *parent's* peak RSS. The benchmark
therefore starts this script from a small shell that forks it (not execs it), so that the
figure is this process's own.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import zlib

import fsspec.implementations.http  # noqa: F401 - imported before the baseline on purpose

from striped_fs import StripedFileSystem


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _status_bytes(field: str) -> int | None:
    """``VmHWM``/``VmRSS`` of /proc/self/status: this process image only, never inherited."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: list[str]) -> int:
    url, stripe_size, concurrency, chunk = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    baseline = _maxrss_bytes()
    baseline_hwm = _status_bytes("VmHWM")
    print(
        json.dumps({"event": "baseline", "baseline_rss": baseline, "baseline_vmhwm": baseline_hwm}),
        flush=True,
    )
    fs = StripedFileSystem(
        target_protocol="http",
        target_options={"skip_instance_cache": True},
        stripe_size=stripe_size,
        concurrency=concurrency,
        skip_instance_cache=True,
    )
    crc = 0
    nbytes = 0
    try:
        start = time.perf_counter()
        with fs.open(url, "rb") as f:
            while True:
                data = f.read(chunk)
                if not data:
                    break
                crc = zlib.crc32(data, crc)
                nbytes += len(data)
                del data
        seconds = time.perf_counter() - start
    finally:
        fs.close()
    print(
        json.dumps(
            {
                "event": "done",
                "baseline_rss": baseline,
                "peak_rss": _maxrss_bytes(),
                "baseline_vmhwm": baseline_hwm,
                "peak_vmhwm": _status_bytes("VmHWM"),
                "bytes": nbytes,
                "crc32": crc,
                "seconds": seconds,
                "stripe_size": fs.options.stripe_size,
                "concurrency": fs.options.concurrency,
                "window": fs.options.window,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
