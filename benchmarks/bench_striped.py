"""striped_fs benchmark: striped reads and writes over shaped loopback links, against the peers.

One run, on one machine, prints and records:

1. the unshaped ceiling of this machine (server + shaping proxy + client, nothing capped);
2. the shaped links used below (constants here), with a warning when the ceiling is too close;
3. ranged reads of a 1 GiB random file from nginx behind the shaper: fsspec single stream,
   ``striped::http://`` (fsspec), rclone with 16 streams, and the FUSE mount (``cat``);
4. the striped layout on moto S3 behind the shaper: striped write/read vs s3fs single stream,
   s3fs defaults and rclone (16 streams, 8 MiB chunks);
5. a sweep of stripe size x concurrency (skipped with ``--quick``);
6. peak RSS of a child process streaming a 4 GiB file through ``striped::http://`` (unshaped);
7. a final table (metric | bootseer | peer | limit/target | pass/fail), also written as
   ``DIR/striped.json`` and ``DIR/striped.md``.

Run with ``bootseer bench striped`` (or ``make bench``), or directly:
``python benchmarks/bench_striped.py --results bench-results [--quick] [--size 512MiB]``.
Every read-back is checked against the source (crc32 of the stream, sha256 of downloaded files,
sampled ranges for the FUSE ``cat``). Failed targets are reported, never raised; the exit status
is non-zero only when a measurement crashed.

Everything binds and connects to 127.0.0.1 only. Test data is generated once (random bytes) in
``~/.cache/bootseer-bench`` (``BOOTSEER_BENCH_CACHE``) and reused; everything else the run
starts (nginx, moto, proxies, the mount, rclone, temporary files) is removed on exit, Ctrl-C
included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_smoke_flag,
    command_line,
    md_table,
    run_bench,
    smoke_implies_quick,
    source_state,
)

if str(_ROOT) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(_ROOT))

import fsspec  # noqa: E402
import s3fs  # noqa: E402

from bootseer.process import pid_alive  # noqa: E402
from bootseer.testing.servers import MotoS3Server, NginxServer  # noqa: E402
from bootseer.testing.shaper import ShaperProcess, ShaperSettings  # noqa: E402
from striped_fs import StripedFileSystem  # noqa: E402
from striped_fs.config import DEFAULT_CONCURRENCY, DEFAULT_STRIPE_SIZE, parse_size  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MB = 1e6  # rates are reported in MB/s, MB = 10**6 bytes

# -- the shaped links ------------------------------------------------------------------------
# Both sit below the unshaped ceiling that step 1 measures on the 2-core machine these figures
# come from, so the link, not a CPU, is what binds: through the proxy, nginx serves striped
# ranged reads at ~1.0-1.1 GB/s (160 MB/s is < 1/6 of that); moto is CPU-bound at ~130-145 MB/s
# for striped writes and ~180-220 MB/s for reads, hence its lower 100 MB/s total. 10 MB/s per
# connection makes one stream clearly slower than the link, as on a real WAN or object store.
# The run re-measures the ceiling and warns when it is below CEILING_MARGIN x the total cap.
HTTP_LINK = ShaperSettings.from_mb(latency_ms=1.0, per_conn_mbps=10.0, total_mbps=160.0)
S3_LINK = ShaperSettings.from_mb(latency_ms=1.0, per_conn_mbps=10.0, total_mbps=100.0)
CEILING_MARGIN = 1.2

# -- targets (ratios, reported, never asserted) ----------------------------------------------
READ_VS_SINGLE = 8.0  # striped read >= 8x a single stream
READ_VS_CAP = 0.75  # striped read >= 75% of the link's total cap
WRITE_VS_SINGLE = 6.0  # striped write >= 6x a single stream
FUSE_VS_STRIPED = 0.70  # FUSE cat >= 70% of the striped fsspec read
RSS_BASE = 150 * MiB  # peak RSS <= 150 MiB + concurrency x stripe

# -- sizes -------------------------------------------------------------------------------------
MAIN_SIZE = GiB  # the ranged-read and S3 file
MOTO_CEILING_SIZE = 256 * MiB
SWEEP_SIZE = 256 * MiB
RSS_SIZE = 4 * GiB
QUICK_DIVISOR = 64
SWEEP_READ_STRIPES = (2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
SWEEP_READ_CONCURRENCY = (8, 16, 32)
SWEEP_WRITE_STRIPES = (4 * MiB, 8 * MiB, 16 * MiB)
SWEEP_WRITE_CONCURRENCY = 16

CHUNK = 8 * MiB  # read size of every streaming reader here (and fsspec's block size)
BUCKET = "bootseer-bench"
RCLONE_STREAMS = 16
RCLONE_CHUNK = "8M"
RCLONE_REMOTE = "BOOTSEERBENCHS3"

_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MB / max(seconds, 1e-9)


def human(size: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


# -- test data ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataFile:
    path: Path
    size: int
    sha256: str
    crc32: int

    @property
    def name(self) -> str:
        return self.path.name


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "bootseer-bench"
    path = Path(os.environ.get("BOOTSEER_BENCH_CACHE") or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_data(cache: Path, size: int) -> DataFile:
    """``random-<size>.bin`` in the cache: random bytes, made once, digests kept beside it.

    Sizes above 1 GiB that are whole GiB are the 1 GiB file repeated (dense, non-zero)."""
    path = cache / f"random-{human(size)}.bin"
    meta_path = cache / f"{path.name}.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        meta = json.loads(meta_path.read_text())
        st = path.stat()
        if meta["size"] == size == st.st_size and meta["mtime_ns"] == st.st_mtime_ns:
            return DataFile(path, size, meta["sha256"], int(meta["crc32"]))
    log(f"generating test data {path} ({human(size)}, once; reused by later runs)")
    sha, crc = hashlib.sha256(), 0
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as out:
            if size > GiB and size % GiB == 0:
                base = ensure_data(cache, GiB)
                for _ in range(size // GiB):
                    with open(base.path, "rb") as src:
                        while block := src.read(16 * MiB):
                            out.write(block)
                            sha.update(block)
                            crc = zlib.crc32(block, crc)
            else:
                left = size
                while left:
                    block = os.urandom(min(16 * MiB, left))
                    out.write(block)
                    sha.update(block)
                    crc = zlib.crc32(block, crc)
                    left -= len(block)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    st = path.stat()
    meta_path.write_text(
        json.dumps(
            {"size": size, "mtime_ns": st.st_mtime_ns, "sha256": sha.hexdigest(), "crc32": crc}
        )
    )
    return DataFile(path, size, sha.hexdigest(), crc)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 * MiB):
            h.update(block)
    return h.hexdigest()


def check_file(path: str | Path, df: DataFile) -> tuple[bool, str]:
    size = os.path.getsize(path)
    if size != df.size:
        return False, f"size {size} != {df.size}"
    digest = sha256_file(path)
    return (
        digest == df.sha256
    ), f"sha256 {digest[:16]}{'' if digest == df.sha256 else ' MISMATCH'}"


def check_ranges(
    path: str | Path, df: DataFile, count: int = 8, length: int = MiB
) -> tuple[bool, str]:
    """Size plus ``count`` ranges (first, last, evenly spread) compared byte for byte."""
    size = os.path.getsize(path)
    if size != df.size:
        return False, f"size {size} != {df.size}"
    length = min(length, df.size)
    span = df.size - length
    offsets = sorted({span * i // max(1, count - 1) for i in range(count)})
    with open(path, "rb") as got, open(df.path, "rb") as want:
        for off in offsets:
            if os.pread(got.fileno(), length, off) != os.pread(want.fileno(), length, off):
                return False, f"bytes at {off} differ"
    return True, f"size + {len(offsets)} ranges of {human(length)}"


def stream(f: Any, chunk: int = CHUNK) -> tuple[int, int]:
    """Read ``f`` to the end in ``chunk`` reads; (bytes, crc32). crc32 costs ~7 GB/s."""
    nbytes, crc = 0, 0
    while True:
        data = f.read(chunk)
        if not data:
            return nbytes, crc
        crc = zlib.crc32(data, crc)
        nbytes += len(data)


def stream_result(
    nbytes: int, crc: int, seconds: float, df: DataFile, **extra: Any
) -> dict[str, Any]:
    ok = nbytes == df.size and crc == df.crc32
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "mb_s": mbps(nbytes, seconds),
        "verified": ok,
        "check": f"size + crc32 of the stream{'' if ok else ' MISMATCH'}",
        **extra,
    }


def file_result(local: Path, seconds: float, df: DataFile, **extra: Any) -> dict[str, Any]:
    ok, how = check_file(local, df)
    return {
        "bytes": df.size,
        "seconds": seconds,
        "mb_s": mbps(df.size, seconds),
        "verified": ok,
        "check": how,
        **extra,
    }


# -- clients -----------------------------------------------------------------------------------


def striped_http(**opts: Any) -> StripedFileSystem:
    return StripedFileSystem(
        target_protocol="http",
        target_options={"skip_instance_cache": True},
        skip_instance_cache=True,
        **opts,
    )


def striped_s3(storage_options: dict[str, Any], **opts: Any) -> StripedFileSystem:
    return StripedFileSystem(
        target_protocol="s3",
        target_options={**storage_options, "skip_instance_cache": True},
        skip_instance_cache=True,
        **opts,
    )


def plain_s3(storage_options: dict[str, Any], **kw: Any) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(skip_instance_cache=True, **storage_options, **kw)


def clean_env() -> dict[str, str]:
    """This process's environment without proxy settings: loopback must stay loopback."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def rclone_version() -> str:
    exe = shutil.which("rclone")
    if exe is None:
        return "not installed"
    out = subprocess.run(
        [exe, "version"], capture_output=True, text=True, timeout=30, env=clean_env(), check=False
    ).stdout
    return out.splitlines()[0] if out else "unknown"


def run_rclone(args: list[str], env_extra: dict[str, str] | None = None) -> tuple[float, str]:
    """Run rclone isolated from any user config; (seconds, its log). Raises on failure."""
    exe = shutil.which("rclone")
    if exe is None:
        raise RuntimeError("rclone not installed (apt-get install rclone)")
    # No AWS_* (AWS_CA_BUNDLE breaks rclone's plain-HTTP client) and no RCLONE_* from outside.
    env = {k: v for k, v in clean_env().items() if not k.startswith(("AWS_", "RCLONE_"))}
    env.update(env_extra or {})
    cmd = [
        exe,
        "--config",
        "/dev/null",
        "--bind",
        "127.0.0.1",
        "--retries",
        "1",
        "--low-level-retries",
        "2",
        "--stats",
        "0",
        "-v",
        *args,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"rclone exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return seconds, proc.stderr


# -- the benchmark ---------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = smoke_implies_quick(args)
        self.quick = bool(args.quick)
        div = QUICK_DIVISOR if self.quick else 1
        self.main_size = parse_size(args.size, name="--size") if args.size else MAIN_SIZE // div
        self.moto_ceiling_size = MOTO_CEILING_SIZE // div
        self.sweep_size = SWEEP_SIZE
        self.rss_size = RSS_SIZE // div
        self.results_dir = Path(args.results)
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.R: dict[str, Any] = {
            "suite": "striped",
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": command_line("bench_striped.py"),
            "source": source_state(["striped_fs", "bootseer/testing"]),
            "quick": self.quick,
            "smoke": self.smoke,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "fsspec": fsspec.__version__,
                "s3fs": s3fs.__version__,
                "rclone": rclone_version(),
            },
            "sizes": {
                "main": self.main_size,
                "moto_ceiling": self.moto_ceiling_size,
                "sweep": None if self.quick else self.sweep_size,
                "rss": self.rss_size,
            },
            "links": {"http": _settings_dict(HTTP_LINK), "s3": _settings_dict(S3_LINK)},
            "defaults": {"stripe_size": DEFAULT_STRIPE_SIZE, "concurrency": DEFAULT_CONCURRENCY},
            "ceiling": {},
            "http": {},
            "s3": {},
            "sweep": {},
            "rss": {},
            "warnings": [],
            "errors": self.errors,
        }
        with contextlib.suppress(Exception):
            import moto

            self.R["machine"]["moto"] = moto.__version__
        with contextlib.suppress(Exception):
            self.R["machine"]["nginx"] = subprocess.run(
                ["nginx", "-v"], capture_output=True, text=True, check=False
            ).stderr.strip()

    # -- plumbing ---------------------------------------------------------------------------
    def measure(
        self, section: str, key: str, what: str, fn: Callable[[], dict[str, Any]]
    ) -> dict | None:
        """Run one measurement; record it (or its error) under ``R[section][key]``."""
        log(f"{what} ...")
        try:
            result = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            msg = f"{section}.{key}: {type(exc).__name__}: {exc}"
            self.errors.append(msg)
            self.R[section][key] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  ERROR {msg}")
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
            return None
        # Other processes on the machine take CPU from server, proxy and client alike.
        result["loadavg_1m"] = round(os.getloadavg()[0], 2)
        self.R[section][key] = result
        extra = ""
        if "verified" in result:
            extra = (
                f"  [{'ok' if result['verified'] else 'DATA MISMATCH'}: {result.get('check', '')}]"
            )
        if "mb_s" in result:
            log(
                f"  {what}: {result['mb_s']:.1f} MB/s ({human_or_bytes(result['bytes'])} in "
                f"{result['seconds']:.2f} s){extra}"
            )
        return result

    def warn(self, msg: str) -> None:
        self.R["warnings"].append(msg)
        log(f"WARNING: {msg}")

    def scratch_dir(self) -> Path:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        path = Path(tempfile.mkdtemp(prefix="bootseer-bench-", dir=base))
        self.stack.callback(shutil.rmtree, path, True)
        return path

    # -- run --------------------------------------------------------------------------------
    def run(self) -> None:
        log(
            f"bench striped: {'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run, file {human(self.main_size)}, "
            f"{os.cpu_count()} CPUs, python {platform.python_version()}"
        )
        load = os.getloadavg()
        self.R["loadavg_at_start"] = [round(x, 2) for x in load]
        if load[0] > 0.5 * (os.cpu_count() or 1):
            self.warn(
                f"machine busy before the run (load average {load[0]:.2f} on {os.cpu_count()} "
                "CPUs): other processes compete with server, proxy and client; the unshaped "
                "ceiling is the first figure to drop"
            )
        cache = cache_dir()
        self.R["cache_dir"] = str(cache)
        self.main = ensure_data(cache, self.main_size)
        self.moto_file = ensure_data(cache, self.moto_ceiling_size)
        self.sweep_file = None if self.quick else ensure_data(cache, self.sweep_size)
        self.rss_file = ensure_data(cache, self.rss_size)
        self.scratch = self.scratch_dir()

        log("starting nginx and moto (subprocess) on 127.0.0.1")
        self.nginx = self.stack.enter_context(NginxServer(cache))
        self.moto = MotoS3Server(in_process=False)
        self.stack.callback(self.moto.close)
        self.moto.start()
        self.moto.create_bucket(BUCKET)
        log(f"  nginx {self.nginx.url} serving {cache}; moto {self.moto.endpoint_url}")

        self.step_ceiling()
        self.step_links()
        self.step_http()
        self.step_s3()
        if self.quick:
            log("sweep skipped (--quick)")
        else:
            self.step_sweep()
        self.step_rss()

    # -- 1. ceiling -------------------------------------------------------------------------
    def step_ceiling(self) -> None:
        log("== 1. unshaped ceiling: server + proxy (no limits) + client on this machine")
        df = self.main
        with ShaperProcess("127.0.0.1", self.nginx.port, ShaperSettings()) as proxy:
            url = f"http://{proxy.address}/{df.name}"

            def nginx_read() -> dict[str, Any]:  # best of two
                runs = []
                for _ in range(2):  # best of two: the first pays for connection set-up
                    fs = striped_http()
                    try:
                        t0 = time.perf_counter()
                        with fs.open(url, "rb") as f:
                            n, crc = stream(f)
                        runs.append(stream_result(n, crc, time.perf_counter() - t0, df))
                    finally:
                        fs.close()
                best = max(runs, key=lambda r: r["mb_s"])
                return {
                    **best,
                    "verified": all(r["verified"] for r in runs),
                    "runs_mb_s": [r["mb_s"] for r in runs],
                }

            self.measure(
                "ceiling",
                "nginx_striped_read",
                f"ceiling (best of 2): striped read of {human(df.size)} from nginx via unshaped proxy",
                nginx_read,
            )

        mf = self.moto_file
        with ShaperProcess("127.0.0.1", self.moto.port, ShaperSettings()) as proxy:
            opts = self.moto.storage_options(endpoint_url=f"http://{proxy.address}")
            self._s3_write_read(
                "ceiling", "moto_striped", opts, mf, label="ceiling (best of 2)", repeat=2
            )

    # -- 2. links ---------------------------------------------------------------------------
    def step_links(self) -> None:
        log("== 2. shaped links (chosen below the measured ceiling)")
        log(f"  HTTP/nginx: {HTTP_LINK.describe()}")
        log(f"  S3/moto:    {S3_LINK.describe()}")
        c = self.R["ceiling"]
        pairs = [
            ("nginx striped read", c.get("nginx_striped_read", {}).get("mb_s"), HTTP_LINK),
            ("moto striped write", c.get("moto_striped_write", {}).get("mb_s"), S3_LINK),
            ("moto striped read", c.get("moto_striped_read", {}).get("mb_s"), S3_LINK),
        ]
        for what, ceiling, link in pairs:
            cap = link.total_bps / MB
            if ceiling is None:
                self.warn(
                    f"{what}: no ceiling measured; cannot tell whether {cap:g} MB/s is below it"
                )
            elif ceiling < CEILING_MARGIN * cap:
                self.warn(
                    f"{what}: unshaped ceiling {ceiling:.0f} MB/s is below {CEILING_MARGIN}x "
                    f"the {cap:g} MB/s cap: the CPU may bind, not the link; figures against "
                    "the cap understate striping"
                )
            else:
                log(
                    f"  {what}: ceiling {ceiling:.0f} MB/s >= {CEILING_MARGIN}x cap {cap:g} MB/s: ok"
                )

    # -- 3. HTTP ranged reads ---------------------------------------------------------------
    def step_http(self) -> None:
        df = self.main
        log(
            f"== 3. ranged reads of {human(df.size)} from nginx behind the shaper ({HTTP_LINK.describe()})"
        )
        proxy = self.stack.enter_context(ShaperProcess("127.0.0.1", self.nginx.port, HTTP_LINK))
        base = f"http://{proxy.address}"
        url = f"{base}/{df.name}"

        def single() -> dict[str, Any]:
            fs = fsspec.filesystem("http", skip_instance_cache=True)
            t0 = time.perf_counter()
            with fs.open(url, "rb", block_size=CHUNK) as f:
                n, crc = stream(f)
            return stream_result(
                n,
                crc,
                time.perf_counter() - t0,
                df,
                how=f"fsspec http open(block_size={human(CHUNK)}), read({human(CHUNK)})",
            )

        def striped() -> dict[str, Any]:
            fs = striped_http()
            try:
                t0 = time.perf_counter()
                with fs.open(url, "rb") as f:
                    n, crc = stream(f)
                return stream_result(
                    n,
                    crc,
                    time.perf_counter() - t0,
                    df,
                    stripe_size=fs.options.stripe_size,
                    concurrency=fs.options.concurrency,
                    how=f"striped::http fs.open, read({human(CHUNK)})",
                )
            finally:
                fs.close()

        def rclone() -> dict[str, Any]:
            dest = self.scratch / "rclone-http"
            dest.mkdir()
            try:
                seconds, out = run_rclone(
                    [
                        "copy",
                        "--http-url",
                        base,
                        f":http:{df.name}",
                        str(dest),
                        "--multi-thread-streams",
                        str(RCLONE_STREAMS),
                        "--multi-thread-cutoff",
                        "1M",
                    ]
                )
                return file_result(
                    dest / df.name,
                    seconds,
                    df,
                    multi_thread="Multi-thread" in out,
                    how=f"rclone copy :http: --multi-thread-streams {RCLONE_STREAMS} "
                    "into tmpfs (process start included)",
                )
            finally:
                shutil.rmtree(dest, ignore_errors=True)

        self.measure("http", "single_stream", "HTTP (a) fsspec single stream", single)
        self.measure("http", "striped", "HTTP (b) striped::http fs.open streaming read", striped)
        self.measure("http", "rclone", f"HTTP (c) rclone copy, {RCLONE_STREAMS} streams", rclone)
        self.measure(
            "http",
            "fuse",
            "HTTP (d) FUSE mount of striped::http, cat > /dev/null",
            lambda: self._fuse_cat(base, df),
        )

    def _fuse_cat(self, base: str, df: DataFile) -> dict[str, Any]:
        from striped_fs import fuse

        mnt = Path(tempfile.mkdtemp(prefix="bootseer-bench-mnt-"))
        pid: list[int] = []

        def mount_processes() -> set[int]:
            """Our mount process(es): the only processes whose command line names ``mnt`` (a
            fresh temporary directory), found even when the mount command was interrupted
            before it printed the pid."""
            found = set(pid)
            needle = str(mnt).encode()
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) != os.getpid():
                    with contextlib.suppress(OSError):
                        argv = (entry / "cmdline").read_bytes().split(b"\0")
                        if needle in argv and b"mount" in argv:
                            found.add(int(entry.name))
            return found

        def cleanup() -> None:
            procs = mount_processes()
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(Exception):
                    if fuse.is_mounted(mnt):
                        subprocess.run(
                            [sys.executable, "-m", "bootseer", "fs", "umount", str(mnt)],
                            capture_output=True,
                            timeout=60,
                            env=clean_env(),
                            check=False,
                        )
                    if fuse.is_mounted(mnt):
                        fuse.unmount(mnt, lazy=True)
                procs |= mount_processes()
                for p in [p for p in procs if pid_alive(p)]:
                    if time.monotonic() > deadline - 10:  # SIGTERM: libfuse unmounts and exits
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGTERM)
                alive = [p for p in procs if pid_alive(p)]
                gone = False
                with contextlib.suppress(OSError):
                    if not fuse.is_mounted(mnt):
                        mnt.rmdir()
                        gone = True
                if (gone or not mnt.exists()) and not alive:
                    break
                if time.monotonic() > deadline:
                    log(
                        f"WARNING: could not fully clean up the FUSE mount at {mnt} "
                        f"(processes {alive}); remove it with: bootseer fs umount {mnt}"
                    )
                    break
                time.sleep(0.2)
            # The background mount logs to TMPDIR/bootseer-fs-mount-*/<mountpoint name>.log, a
            # private directory of its own (the mountpoint's name is unique).
            for log_file in Path(tempfile.gettempdir()).glob(f"bootseer-fs-mount-*/{mnt.name}.log"):
                with contextlib.suppress(OSError):
                    log_file.unlink()
                    log_file.parent.rmdir()

        with contextlib.ExitStack() as local:
            local.callback(cleanup)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "fs",
                    "mount",
                    f"striped::{base}",
                    str(mnt),
                    "--read-only",
                ],
                capture_output=True,
                text=True,
                timeout=120,
                env=clean_env(),
                check=False,
            )
            m = re.search(r"\(pid (\d+)", proc.stdout)
            if m:
                pid.append(int(m.group(1)))
            if proc.returncode != 0:
                raise RuntimeError(
                    f"bootseer fs mount exited {proc.returncode}: "
                    f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
                )
            path = mnt / df.name
            t0 = time.perf_counter()
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
            seconds = time.perf_counter() - t0
            ok, how = check_ranges(path, df)
            return {
                "bytes": df.size,
                "seconds": seconds,
                "mb_s": mbps(df.size, seconds),
                "verified": ok,
                "check": how,
                "how": "bootseer fs mount striped::http://... --read-only; cat FILE > /dev/null "
                "(mount outside the timing)",
            }

    # -- 4. S3 ------------------------------------------------------------------------------
    def _s3_write_read(
        self,
        section: str,
        prefix: str,
        opts: dict[str, Any],
        df: DataFile,
        label: str,
        repeat: int = 1,
        **stripe_opts: Any,
    ) -> None:
        """Striped put_file then get_file (to tmpfs) of ``df``; removes the object after.

        ``repeat`` > 1 keeps the best of that many runs of each (the ceiling: a first run on
        a machine that was idle or busy a moment ago is often far slower)."""
        fs = striped_s3(opts, **stripe_opts)
        key = f"{BUCKET}/{prefix}-{human(df.size)}.bin"
        local = self.scratch / f"{prefix}.get"
        try:

            def write_once() -> dict[str, Any]:
                fs.target.ls(BUCKET)  # client set-up (botocore session, first request) untimed
                t0 = time.perf_counter()
                fs.put_file(str(df.path), key)
                seconds = time.perf_counter() - t0
                return {
                    "bytes": df.size,
                    "seconds": seconds,
                    "mb_s": mbps(df.size, seconds),
                    "stripe_size": fs.options.stripe_size,
                    "concurrency": fs.options.concurrency,
                    "how": "striped put_file from the local file",
                }

            def read_once() -> dict[str, Any]:
                t0 = time.perf_counter()
                fs.get_file(key, str(local))
                seconds = time.perf_counter() - t0
                return file_result(local, seconds, df, how="striped get_file into tmpfs")

            def best(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
                def run() -> dict[str, Any]:
                    runs = [fn() for _ in range(repeat)]
                    top = max(runs, key=lambda r: r["mb_s"])
                    if repeat == 1:
                        return top
                    out = {**top, "runs_mb_s": [r["mb_s"] for r in runs]}
                    if any("verified" in r for r in runs):
                        out["verified"] = all(r.get("verified", True) for r in runs)
                    return out

                return run

            write, read = best(write_once), best(read_once)

            if self.measure(
                section,
                f"{prefix}_write",
                f"{label}: striped write of {human(df.size)} to moto",
                write,
            ):
                self.measure(
                    section,
                    f"{prefix}_read",
                    f"{label}: striped read of {human(df.size)} from moto",
                    read,
                )
        finally:
            with contextlib.suppress(Exception):
                local.unlink()
            with contextlib.suppress(Exception):
                fs.rm(key)
            fs.close()

    def step_s3(self) -> None:
        df = self.main
        log(
            f"== 4. striped layout on moto S3 behind the shaper ({S3_LINK.describe()}), {human(df.size)}"
        )
        proxy = self.stack.enter_context(ShaperProcess("127.0.0.1", self.moto.port, S3_LINK))
        endpoint = f"http://{proxy.address}"
        opts = self.moto.storage_options(endpoint_url=endpoint)
        self._s3_write_read("s3", "striped", opts, df, label="S3")

        def s3fs_pair(name: str, label: str, kw: dict[str, Any]) -> None:
            fs = plain_s3(opts)
            key = f"{BUCKET}/{name}-{human(df.size)}.bin"
            local = self.scratch / f"{name}.get"
            try:

                def put() -> dict[str, Any]:
                    fs.ls(BUCKET)  # client set-up untimed, as for the striped client
                    t0 = time.perf_counter()
                    fs.put_file(str(df.path), key, **kw)
                    seconds = time.perf_counter() - t0
                    return {
                        "bytes": df.size,
                        "seconds": seconds,
                        "mb_s": mbps(df.size, seconds),
                        "how": f"s3fs put_file {kw or '(defaults)'}",
                    }

                def get() -> dict[str, Any]:
                    t0 = time.perf_counter()
                    fs.get_file(key, str(local), **kw)
                    seconds = time.perf_counter() - t0
                    return file_result(
                        local, seconds, df, how=f"s3fs get_file {kw or '(defaults)'} into tmpfs"
                    )

                if self.measure("s3", f"{name}_write", f"S3: {label} put_file", put):
                    self.measure("s3", f"{name}_read", f"S3: {label} get_file", get)
            finally:
                with contextlib.suppress(Exception):
                    local.unlink()
                with contextlib.suppress(Exception):
                    fs.rm(key)

        # s3fs >= 2024 moves parts concurrently by default (max_concurrency=10): the single
        # stream is asked for explicitly; the defaults are recorded as a second peer.
        s3fs_pair("s3fs_single", "s3fs single stream (max_concurrency=1)", {"max_concurrency": 1})
        s3fs_pair("s3fs_default", "s3fs defaults", {})

        env = {
            f"RCLONE_CONFIG_{RCLONE_REMOTE}_TYPE": "s3",
            f"RCLONE_CONFIG_{RCLONE_REMOTE}_PROVIDER": "Other",
            f"RCLONE_CONFIG_{RCLONE_REMOTE}_ENDPOINT": endpoint,
            f"RCLONE_CONFIG_{RCLONE_REMOTE}_ACCESS_KEY_ID": "testing",
            f"RCLONE_CONFIG_{RCLONE_REMOTE}_SECRET_ACCESS_KEY": "testing",
            f"RCLONE_CONFIG_{RCLONE_REMOTE}_REGION": "us-east-1",
            f"RCLONE_CONFIG_{RCLONE_REMOTE}_FORCE_PATH_STYLE": "true",
        }
        remote = f"{RCLONE_REMOTE}:{BUCKET}/rclone-{human(df.size)}.bin"
        local = self.scratch / "rclone-s3.get"

        def rclone_up() -> dict[str, Any]:
            seconds, _ = run_rclone(
                [
                    "copyto",
                    str(df.path),
                    remote,
                    "--s3-upload-concurrency",
                    str(RCLONE_STREAMS),
                    "--s3-chunk-size",
                    RCLONE_CHUNK,
                    "--s3-upload-cutoff",
                    RCLONE_CHUNK,
                    "--s3-no-check-bucket",
                    "--s3-disable-checksum",
                    # rclone HEADs the new object with ?versionId=null (moto's CompleteMultipartUpload
                    # says x-amz-version-id: null) and moto answers 400: skip that check.
                    "--s3-no-head",
                ],
                env,
            )
            return {
                "bytes": df.size,
                "seconds": seconds,
                "mb_s": mbps(df.size, seconds),
                "how": f"rclone copyto, --s3-upload-concurrency {RCLONE_STREAMS} "
                f"--s3-chunk-size {RCLONE_CHUNK} (process start included)",
            }

        def rclone_down() -> dict[str, Any]:
            seconds, out = run_rclone(
                [
                    "copyto",
                    remote,
                    str(local),
                    "--multi-thread-streams",
                    str(RCLONE_STREAMS),
                    "--multi-thread-cutoff",
                    "1M",
                ],
                env,
            )
            return file_result(
                local,
                seconds,
                df,
                multi_thread="Multi-thread" in out,
                how=f"rclone copyto --multi-thread-streams {RCLONE_STREAMS} into "
                "tmpfs (ranged GETs of one object: moto re-reads the whole "
                "object for each)",
            )

        try:
            if self.measure(
                "s3", "rclone_write", f"S3: rclone upload, {RCLONE_STREAMS} streams", rclone_up
            ):
                self.measure(
                    "s3",
                    "rclone_read",
                    f"S3: rclone download, {RCLONE_STREAMS} streams",
                    rclone_down,
                )
        finally:
            with contextlib.suppress(Exception):
                local.unlink()
            with contextlib.suppress(Exception):
                plain_s3(opts).rm(f"{BUCKET}/rclone-{human(df.size)}.bin")

    # -- 5. sweep ---------------------------------------------------------------------------
    def step_sweep(self) -> None:
        df = self.sweep_file
        assert df is not None
        log(f"== 5. sweep: striped read over the shaped HTTP link, {human(df.size)} each")
        http_proxy = self.stack.enter_context(
            ShaperProcess("127.0.0.1", self.nginx.port, HTTP_LINK)
        )
        url = f"http://{http_proxy.address}/{df.name}"
        reads: dict[str, Any] = {}
        for stripe in SWEEP_READ_STRIPES:
            for conc in SWEEP_READ_CONCURRENCY:

                def one(stripe: int = stripe, conc: int = conc) -> dict[str, Any]:
                    fs = striped_http(stripe_size=stripe, concurrency=conc)
                    try:
                        t0 = time.perf_counter()
                        with fs.open(url, "rb") as f:
                            n, crc = stream(f)
                        return stream_result(
                            n,
                            crc,
                            time.perf_counter() - t0,
                            df,
                            stripe_size=stripe,
                            concurrency=conc,
                        )
                    finally:
                        fs.close()

                key = f"read_{human(stripe)}_c{conc}"
                reads[key] = self.measure(
                    "sweep", key, f"sweep read stripe {human(stripe)} x {conc}", one
                )
        log(
            f"== 5. sweep: striped write to shaped moto, concurrency {SWEEP_WRITE_CONCURRENCY}, {human(df.size)} each"
        )
        s3_proxy = self.stack.enter_context(ShaperProcess("127.0.0.1", self.moto.port, S3_LINK))
        opts = self.moto.storage_options(endpoint_url=f"http://{s3_proxy.address}")
        for stripe in SWEEP_WRITE_STRIPES:
            fs = striped_s3(opts, stripe_size=stripe, concurrency=SWEEP_WRITE_CONCURRENCY)
            key = f"{BUCKET}/sweep-{human(stripe)}.bin"
            try:

                def put(
                    fs: StripedFileSystem = fs, key: str = key, stripe: int = stripe
                ) -> dict[str, Any]:
                    fs.target.ls(BUCKET)  # client set-up untimed
                    t0 = time.perf_counter()
                    fs.put_file(str(df.path), key)
                    seconds = time.perf_counter() - t0
                    return {
                        "bytes": df.size,
                        "seconds": seconds,
                        "mb_s": mbps(df.size, seconds),
                        "stripe_size": stripe,
                        "concurrency": SWEEP_WRITE_CONCURRENCY,
                    }

                self.measure(
                    "sweep",
                    f"write_{human(stripe)}_c{SWEEP_WRITE_CONCURRENCY}",
                    f"sweep write stripe {human(stripe)} x {SWEEP_WRITE_CONCURRENCY}",
                    put,
                )
            finally:
                with contextlib.suppress(Exception):
                    fs.rm(key)
                fs.close()
        for line in self.sweep_tables():
            print(line, flush=True)

    # -- 6. RSS -----------------------------------------------------------------------------
    def step_rss(self) -> None:
        df = self.rss_file
        log(
            f"== 6. peak RSS: child process streams {human(df.size)} through striped::http from "
            "nginx, unshaped"
        )

        def child() -> dict[str, Any]:
            url = f"{self.nginx.url}/{df.name}"
            # A shell that forks the child (the trailing command stops it from exec'ing it): with
            # a direct vfork+exec, ru_maxrss would start at this process's own peak RSS.
            cmd = [
                "/bin/sh",
                "-c",
                '"$@"; exit $?',
                "sh",
                sys.executable,
                str(Path(__file__).with_name("_rss_child.py")),
                url,
                str(DEFAULT_STRIPE_SIZE),
                str(DEFAULT_CONCURRENCY),
                str(CHUNK),
            ]
            env = clean_env()
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
            for name in ("BOOTSEER_STRIPE_SIZE", "BOOTSEER_STRIPE_CONCURRENCY"):
                env.pop(name, None)
            err_path = self.scratch / "rss-child.stderr"
            with open(err_path, "wb") as err_file:
                # Own process group (the shell and the child): stopped together on Ctrl-C.
                proc = subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=err_file,
                    text=True,
                    env=env,
                    start_new_session=True,
                )
            try:
                done = None
                assert proc.stdout is not None
                for line in proc.stdout:
                    event = json.loads(line)
                    if event["event"] == "baseline":
                        log(
                            f"  child baseline RSS after imports: {event['baseline_rss'] / MiB:.1f} MiB "
                            f"(ru_maxrss; VmHWM {(event['baseline_vmhwm'] or 0) / MiB:.1f} MiB)"
                        )
                    elif event["event"] == "done":
                        done = event
                code = proc.wait(timeout=60)
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
            err = err_path.read_text(errors="replace")
            err_path.unlink()
            if code != 0 or done is None:
                raise RuntimeError(f"RSS child exited {code}: {err.strip()[-2000:]}")
            limit = RSS_BASE + done["concurrency"] * done["stripe_size"]
            ok = done["bytes"] == df.size and done["crc32"] == df.crc32
            return {
                "bytes": done["bytes"],
                "seconds": done["seconds"],
                "mb_s": mbps(done["bytes"], done["seconds"]),
                "baseline_rss": done["baseline_rss"],
                "peak_rss": done["peak_rss"],
                "baseline_vmhwm": done.get("baseline_vmhwm"),
                "peak_vmhwm": done.get("peak_vmhwm"),
                "limit": limit,
                "stripe_size": done["stripe_size"],
                "concurrency": done["concurrency"],
                "window": done["window"],
                "verified": ok,
                "check": f"size + crc32 of the stream{'' if ok else ' MISMATCH'}",
            }

        r = self.measure("rss", "stream", f"RSS: stream {human(df.size)} in a child", child)
        if r:
            log(
                f"  peak RSS {r['peak_rss'] / MiB:.1f} MiB (VmHWM {(r['peak_vmhwm'] or 0) / MiB:.1f} MiB; "
                f"baseline {r['baseline_rss'] / MiB:.1f} MiB, "
                f"limit {r['limit'] / MiB:.0f} MiB = 150 MiB + {r['concurrency']} x "
                f"{human(r['stripe_size'])})"
            )

    # -- 7. report --------------------------------------------------------------------------
    def final_rows(self) -> list[list[str]]:
        R = self.R
        http, s3, ceil = R["http"], R["s3"], R["ceiling"]
        rows: list[list[str]] = []

        def rate(r: dict | None) -> float | None:
            return r.get("mb_s") if r else None

        def fmt(r: dict | None, label: str = "") -> str:
            if not r:
                return "n/a"
            if "error" in r:
                return "error"
            text = f"{r['mb_s']:.1f} MB/s"
            if r.get("verified") is False:
                text += " (DATA MISMATCH)"
            return f"{label}{text}"

        def bad(*rs: dict | None) -> bool:
            return any(r is not None and r.get("verified") is False for r in rs)

        def verdict(ok: bool | None, *rs: dict | None) -> str:
            if bad(*rs):
                return "FAIL (data)"
            if ok is None:
                return "n/a"
            return "PASS" if ok else "FAIL"

        def vs_peer(
            metric: str, ours: dict | None, peer: dict | None, peer_label: str, factor: float | None
        ) -> None:
            a, b = rate(ours), rate(peer)
            ratio = a / b if a is not None and b else None
            ratio_text = f"{ratio:.1f}x" if ratio is not None else "n/a"
            if factor is None:
                rows.append(
                    [
                        metric,
                        fmt(ours),
                        fmt(peer, f"{peer_label} "),
                        f"info (ratio {ratio_text})",
                        "info" if not bad(ours, peer) else "FAIL (data)",
                    ]
                )
            else:
                rows.append(
                    [
                        metric,
                        fmt(ours),
                        fmt(peer, f"{peer_label} "),
                        f">= {factor:g}x peer (got {ratio_text})",
                        verdict(None if ratio is None else ratio >= factor, ours, peer),
                    ]
                )

        def vs_cap(
            metric: str, ours: dict | None, link: ShaperSettings, share: float | None
        ) -> None:
            a = rate(ours)
            cap = link.total_bps / MB
            pct = f"{100 * a / cap:.0f}%" if a is not None else "n/a"
            if share is None:
                rows.append(
                    [
                        metric,
                        fmt(ours),
                        f"link cap {cap:g} MB/s",
                        f"info ({pct} of cap)",
                        "info" if not bad(ours) else "FAIL (data)",
                    ]
                )
            else:
                rows.append(
                    [
                        metric,
                        fmt(ours),
                        f"link cap {cap:g} MB/s",
                        f">= {share * 100:.0f}% of cap = {share * cap:g} MB/s (got {pct})",
                        verdict(None if a is None else a >= share * cap, ours),
                    ]
                )

        hs = http.get("striped")
        vs_peer(
            "HTTP read: striped vs single stream",
            hs,
            http.get("single_stream"),
            "fsspec 1 stream",
            READ_VS_SINGLE,
        )
        vs_cap("HTTP read: striped vs link", hs, HTTP_LINK, READ_VS_CAP)
        vs_peer(
            "HTTP read: striped vs rclone",
            hs,
            http.get("rclone"),
            f"rclone {RCLONE_STREAMS} streams",
            None,
        )
        vs_peer(
            "HTTP read: FUSE cat vs striped fsspec", http.get("fuse"), hs, "striped fsspec", None
        )
        # FUSE target is a share of the striped read, not a multiple: rewrite the last row.
        f_rate, s_rate = rate(http.get("fuse")), rate(hs)
        share = f_rate / s_rate if f_rate is not None and s_rate else None
        rows[-1][3] = f">= {FUSE_VS_STRIPED * 100:.0f}% of striped fsspec (got " + (
            f"{share * 100:.0f}%)" if share is not None else "n/a)"
        )
        rows[-1][4] = verdict(
            None if share is None else share >= FUSE_VS_STRIPED, http.get("fuse"), hs
        )

        sw, sr = s3.get("striped_write"), s3.get("striped_read")
        vs_peer(
            "S3 write: striped vs s3fs single stream",
            sw,
            s3.get("s3fs_single_write"),
            "s3fs 1 stream",
            WRITE_VS_SINGLE,
        )
        vs_cap("S3 write: striped vs link", sw, S3_LINK, None)
        vs_peer(
            "S3 write: striped vs s3fs defaults",
            sw,
            s3.get("s3fs_default_write"),
            "s3fs max_concurrency=10",
            None,
        )
        vs_peer(
            "S3 write: striped vs rclone",
            sw,
            s3.get("rclone_write"),
            f"rclone {RCLONE_STREAMS} streams",
            None,
        )
        vs_peer(
            "S3 read: striped vs s3fs single stream",
            sr,
            s3.get("s3fs_single_read"),
            "s3fs 1 stream",
            READ_VS_SINGLE,
        )
        vs_cap("S3 read: striped vs link", sr, S3_LINK, READ_VS_CAP)
        vs_peer(
            "S3 read: striped vs s3fs defaults",
            sr,
            s3.get("s3fs_default_read"),
            "s3fs max_concurrency=10",
            None,
        )
        vs_peer(
            "S3 read: striped vs rclone",
            sr,
            s3.get("rclone_read"),
            f"rclone {RCLONE_STREAMS} streams",
            None,
        )

        rss = self.R["rss"].get("stream")
        if rss and "peak_rss" in rss:
            rows.append(
                [
                    f"peak RSS streaming {human(rss['bytes'])} (striped::http, unshaped)",
                    f"{rss['peak_rss'] / MiB:.1f} MiB (VmHWM {(rss.get('peak_vmhwm') or 0) / MiB:.1f})",
                    f"baseline after imports {rss['baseline_rss'] / MiB:.1f} MiB",
                    f"<= 150 MiB + {rss['concurrency']} x {human(rss['stripe_size'])} = "
                    f"{rss['limit'] / MiB:.0f} MiB",
                    verdict(rss["peak_rss"] <= rss["limit"], rss),
                ]
            )
        else:
            rows.append(
                [
                    f"peak RSS streaming {human(self.rss_size)}",
                    "error" if rss else "n/a",
                    "",
                    "<= 150 MiB + N x stripe",
                    "n/a",
                ]
            )

        for key, metric, link in (
            ("nginx_striped_read", "ceiling: striped read, nginx, unshaped proxy", HTTP_LINK),
            ("moto_striped_write", "ceiling: striped write, moto, unshaped proxy", S3_LINK),
            ("moto_striped_read", "ceiling: striped read, moto, unshaped proxy", S3_LINK),
        ):
            r = ceil.get(key)
            cap = link.total_bps / MB
            ok = rate(r) is not None and rate(r) >= CEILING_MARGIN * cap
            rows.append(
                [
                    metric,
                    fmt(r),
                    f"shaped cap {cap:g} MB/s",
                    f"info (>= {CEILING_MARGIN}x cap wanted)",
                    "FAIL (data)" if bad(r) else ("info" if ok else "info: CPU may bind"),
                ]
            )
        return rows

    def sweep_tables(self) -> list[str]:
        sweep = self.R["sweep"]
        if not sweep:
            return []
        lines = [
            f"Sweep: striped read over the shaped HTTP link ({HTTP_LINK.describe()}), "
            f"{human(self.sweep_size)}, MB/s",
            "",
        ]
        head = ["stripe \\ concurrency", *[str(c) for c in SWEEP_READ_CONCURRENCY]]
        body = []
        for stripe in SWEEP_READ_STRIPES:
            cells = [human(stripe)]
            for conc in SWEEP_READ_CONCURRENCY:
                r = sweep.get(f"read_{human(stripe)}_c{conc}")
                cells.append(_cell(r))
            body.append(cells)
        lines += md_table(head, body)
        lines += [
            "",
            f"Sweep: striped write to the shaped moto link ({S3_LINK.describe()}), "
            f"concurrency {SWEEP_WRITE_CONCURRENCY}, {human(self.sweep_size)}, MB/s",
            "",
        ]
        head = ["stripe", "write MB/s"]
        body = [
            [human(s), _cell(sweep.get(f"write_{human(s)}_c{SWEEP_WRITE_CONCURRENCY}"))]
            for s in SWEEP_WRITE_STRIPES
        ]
        lines += md_table(head, body)
        return lines

    def report(self) -> None:
        rows = self.final_rows()
        table = md_table(["metric", "bootseer", "peer", "limit/target", "pass/fail"], rows)
        self.R["final_table"] = [
            dict(zip(["metric", "bootseer", "peer", "target", "verdict"], r, strict=True))
            for r in rows
        ]
        print("", flush=True)
        log("== 7. results")
        for line in table:
            print(line)
        sweep = self.sweep_tables()
        if sweep:
            print("")
            for line in sweep:
                print(line)
        cpus = os.cpu_count() or 1
        busy = [
            f"{sec}.{key} ({r['loadavg_1m']:.1f})"
            for sec in ("ceiling", "http", "s3", "sweep", "rss")
            for key, r in self.R[sec].items()
            if isinstance(r, dict) and r.get("loadavg_1m", 0) > cpus + 1
        ]
        if busy:
            # This run's own server, proxy and client account for about one CPU's worth of load.
            self.R["warnings"].append(
                f"load average above {cpus + 1} ({cpus} CPUs) at the end of: {', '.join(busy)}: "
                "other processes were competing for CPU; those figures may be low"
            )
        if self.quick:
            self.R["warnings"].append(
                f"--quick: a {human(self.main_size)} file is {self.main_size // DEFAULT_STRIPE_SIZE} "
                "stripes, too few to fill 16 streams or to amortise start-up; the verdicts are a "
                "smoke test, not the figures (run without --quick for those)"
            )
        if self.R["warnings"]:
            print("")
            for w in self.R["warnings"]:
                print(f"WARNING: {w}")
        sys.stdout.flush()
        self.write_files(table, sweep)

    def write_files(self, table: list[str] | None = None, sweep: list[str] | None = None) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        self.R["elapsed_s"] = time.monotonic() - _T0
        (self.results_dir / "striped.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )
        if table is None:
            return
        m = self.R["machine"]
        md = [
            f"# striped_fs benchmark ({'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run)",
            "",
            f"- command: `{self.R['command']}` (run time {self.R['elapsed_s']:.0f} s, {self.R['finished']})",
            f"- machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, fsspec {m['fsspec']}, "
            f"s3fs {m['s3fs']}, moto {m.get('moto', '?')}, {m.get('nginx', 'nginx ?')}, {m['rclone']}",
            f"- source: commit {self.R['source'].get('commit', '?')[:12]}"
            + (
                f", local changes in {', '.join(self.R['source']['local_changes'])}"
                if self.R["source"].get("local_changes")
                else ""
            ),
            f"- load average at start: {' '.join(str(x) for x in self.R.get('loadavg_at_start', []))}",
            f"- file: {human(self.main_size)} random bytes; RSS file {human(self.rss_size)}",
            f"- HTTP link (nginx behind the shaping proxy): {HTTP_LINK.describe()}",
            f"- S3 link (moto subprocess behind the shaping proxy): {S3_LINK.describe()}",
            f"- striped_fs defaults: stripe {human(DEFAULT_STRIPE_SIZE)}, concurrency {DEFAULT_CONCURRENCY}",
            "",
            *table,
        ]
        if sweep:
            md += ["", *sweep]
        if self.R["warnings"]:
            md += ["", *[f"- WARNING: {w}" for w in self.R["warnings"]]]
        if self.errors:
            md += ["", *[f"- ERROR: {e}" for e in self.errors]]
        (self.results_dir / "striped.md").write_text("\n".join(md) + "\n")
        log(f"wrote {self.results_dir / 'striped.json'} and {self.results_dir / 'striped.md'}")


# -- small helpers -----------------------------------------------------------------------------


def _settings_dict(s: ShaperSettings) -> dict[str, Any]:
    return {
        "latency_ms": s.latency_s * 1e3,
        "per_conn_mb_s": None if s.per_conn_bps is None else s.per_conn_bps / MB,
        "total_mb_s": None if s.total_bps is None else s.total_bps / MB,
        "describe": s.describe(),
    }


def _cell(r: dict | None) -> str:
    if not r:
        return "n/a"
    if "error" in r:
        return "error"
    return f"{r['mb_s']:.1f}" + ("" if r.get("verified", True) else " (DATA MISMATCH)")


def human_or_bytes(n: int) -> str:
    return human(n) if human(n) != f"{n}B" else f"{n / MB:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_striped.py", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench-results", help="directory for striped.json/.md")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes / {QUICK_DIVISOR}, no sweep: a smoke run of under 2 minutes",
    )
    parser.add_argument("--size", help="size of the main test file, e.g. 512MiB (default 1GiB)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    bench = Bench(args)
    code = run_bench(bench, done_key="final_table", report_inside=False, log_fn=log)
    log(f"done in {time.monotonic() - _T0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
