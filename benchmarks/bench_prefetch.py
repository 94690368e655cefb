"""prefetch benchmark: lazy image start, with and without a hot-block profile, vs a full pull.

A realistic training image, built once and cached under ``CACHE/image`` (``--cache``, default
``~/.cache/bootseer-bench``, env ``BOOTSEER_BENCH_CACHE``):

* the root filesystem: ``debootstrap --variant=minbase bookworm`` from deb.debian.org, then
  Debian's python3 (3.11) installed with apt inside the chroot (``--base host`` or an
  unreachable mirror: a minimal rootfs copied from this host's Debian packages instead, python3.11
  and its library closure; the output says which), then ``torch==2.13.0`` (CPU wheel) + numpy
  with ``pip install --target ROOT/usr/local/lib/python3.11/dist-packages`` from local wheels
  (/opt/wheels, CACHE/wheels, else ``pip download`` through pip's configured index), checked
  with ``chroot ROOT python3 -c "import torch; torch.ones(1)"``;
* one OCI layer: ``tar --numeric-owner --sort=name`` of the rootfs, ``gzip -6 -n`` (like a
  normal image), a config with its diff_id, an OCI manifest; pushed once to the real registry
  (``docker-registry``, storage kept in ``CACHE/image/registry``).

Every run converts the image with ``prefetch.image.convert_image`` (unshaped, into a fresh
repository: the conversion throughput is reported) and then measures, on a cold node (``sync;
echo 3 > /proc/sys/vm/drop_caches`` before each; the registry's blob files are read back into
the page cache after the drop, as the registry is not this node), with the registry behind the
shaping proxy (1 ms, 10 MB/s per connection, 160 MB/s total, the HTTP link of bench_striped),
each in its own processes, until ``chroot ROOT python3 -c "import torch; torch.ones(1)"`` exits 0
(no /proc needed: the import works without it, in every method alike):

1. ``full``: ``curl`` of the gzip layer (one stream, as ``ctr`` pulls a layer) piped into
   ``tar -xzf - --numeric-owner`` (gunzip single-threaded, like containerd), then the import.
   Download and unpack overlap here; ``ctr`` downloads first, then unpacks, so this figure is
   the peer's best case;
2. ``lazy``: the mount child (this script, ``--mount-child``: ``open_image`` with an empty
   block cache, ``prefetch.lazyfs.mount``), READY once mounted, then the import chrooted into the
   mount; the clock starts before the child is spawned;
3. ``record`` (info, not a method): the same with ``record=True``; when the import exits the
   recorder is stopped and the profile stored in the registry (``save_profile``);
4. ``profile``: the mount child loads the profile (``load_profile``), queues
   ``plan_prefetch(...)`` with ``fetcher.prefetch``, mounts; fresh cache; clock as in 2;
5. ``floor``: the import from the rootfs that 1 extracted, page cache dropped.

Info only: ``warm``, the lazy start again on the block cache the profile start filled (every
frame local, page cache dropped, no network): what the FUSE path itself costs over the floor.

"Bytes startup read": the union of the byte ranges FUSE ``read`` calls returned during the lazy
start without profile (per file, overlaps counted once; what the kernel asked for, readahead
included), compared with the frame bytes fetched (compressed, as on the wire, without TOCs) by
the start with the profile.

Targets (reported, never asserted): with profile <= 1.3x the floor, >= 3x faster than the full
pull, >= 1.5x faster than without profile; bytes fetched with the profile <= 1.2x the bytes
startup read.

``python benchmarks/bench_prefetch.py --results DIR [--quick] [--repeat N] [--cache DIR]
[--base auto|debootstrap|host] [--keep]`` or ``bootseer bench prefetch``; root is needed
(debootstrap, chroot, drop_caches, a FUSE mount with device nodes). ``--quick``: the same base
with numpy only (``import numpy; numpy.ones(1)``); ``--smoke`` (the test's form): python3.11 alone,
no warm start, the page cache kept. Writes ``DIR/prefetch.json`` and
``DIR/prefetch.md``; failed targets are MISS, never raised; the exit status is non-zero only when
a measurement failed. Everything listens on 127.0.0.1; the run's trees (``CACHE/prefetch-run``)
are removed at the end, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_smoke_flag,
    command_line,
    drop_caches,
    fs_type,
    kill_group,
    log,
    md_table,
    mem_total,
    reexec,
    run_bench,
    run_checked,
    smoke_implies_quick,
    source_state,
    version_of,
)

if str(_ROOT) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(_ROOT))

# The harness imports only the standard library and bootseer.testing (stdlib-only modules) at
# the top: a C extension it mapped (zstandard, aiohttp's, libfuse) would stay in the page cache
# through drop_caches and warm the measured mount child. Work that needs prefetch (push,
# convert, mount) runs in subprocesses of this script (``--helper``, ``--mount-child``).
from bootseer.testing.registry import RegistryServer  # noqa: E402
from bootseer.testing.shaper import ShaperProcess, ShaperSettings  # noqa: E402

MB = 1e6
MiB = 1 << 20

# -- the shaped link: bench_striped's HTTP_LINK ----------------------------------------------
LINK = ShaperSettings.from_mb(latency_ms=1.0, per_conn_mbps=10.0, total_mbps=160.0)
CONNECTIONS = 16  # open_image's default: 16 x 10 MB/s fills the 160 MB/s link

# -- targets (reported, never asserted) ------------------------------------------------------
VS_FLOOR = 1.3  # profile start <= 1.3x the floor
VS_FULL = 3.0  # >= 3x faster than the full pull
VS_LAZY = 1.5  # >= 1.5x faster than the lazy start without profile
BYTES_VS_READ = 1.2  # frame bytes fetched with the profile <= 1.2x the bytes startup read

SUITE = "prefetch"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
SUITE_NAME = "bookworm"
PYVER = "3.11"  # bookworm's python3; the cp311 wheels must match
SITE = f"usr/local/lib/python{PYVER}/dist-packages"  # on Debian python3's sys.path
VARIANTS = {
    "full": {
        "packages": ["torch==2.13.0", "numpy"],
        "code": "import torch; torch.ones(1)",
        "what": "torch 2.13.0 CPU + numpy",
    },
    "quick": {
        "packages": ["numpy"],
        "code": "import numpy; numpy.ones(1)",
        "what": "numpy only (--quick)",
    },
    "smoke": {  # tests/test_bench_harness.py: no wheel to install, the smallest image
        "packages": [],
        "code": "import json; json.dumps([1])",
        "what": "the base's python3.11 alone (--smoke)",
        # not read by the import: a quarter of the base, and of every method's bytes
        "prune": [
            "usr/share/locale",
            "usr/share/man",
            "usr/lib/x86_64-linux-gnu/gconv",
            "usr/lib/python3.11/pydoc_data",
            "usr/lib/python3.11/test",
        ],
    },
}
HOST_SEEDS = (
    "python3.11",
    "libpython3.11-stdlib",
    "base-files",
    "libstdc++6",
    "libgcc-s1",
    "libc-bin",
)
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
METHODS = ("full", "lazy", "profile", "floor")
LABELS = {
    "full": "full pull: curl (1 stream) | tar -xzf, then import",
    "lazy": "lazy start without profile (empty cache)",
    "profile": "lazy start with profile (empty cache)",
    "floor": "floor: image extracted locally, cold page cache",
    "record": "profile recording start (info)",
    "warm": "lazy start, block cache already full (info: no network)",
}
STEP_TIMEOUT_S = 900.0
READY_TIMEOUT_S = 300.0

_T0 = time.monotonic()


# -- the mount child ---------------------------------------------------------------------------


def _union_bytes(reads: list[tuple[int, int, int]]) -> int:
    """Bytes covered by (inode, offset, length) ranges, overlaps counted once."""
    by_file: dict[int, list[tuple[int, int]]] = {}
    for ino, off, n in reads:
        if n > 0:
            by_file.setdefault(ino, []).append((off, off + n))
    total = 0
    for ranges in by_file.values():
        ranges.sort()
        lo, hi = ranges[0]
        for a, b in ranges[1:]:
            if a > hi:
                total += hi - lo
                lo, hi = a, b
            else:
                hi = max(hi, b)
        total += hi - lo
    return total


def mount_child(spec_path: str) -> int:
    """Open the image lazily (optionally with its profile prefetched), mount it, print READY,
    serve until unmounted (or SIGTERM), then write the fetch statistics to ``spec["out"]``.
    ``STOP`` on stdin (record mode) stops the recorder and stores the profile: ``SAVED {...}``."""
    t_start = time.monotonic()
    spec = json.loads(Path(spec_path).read_text())

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)  # outside the FUSE loop (which has libfuse's own)
    import logging

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from prefetch.image import TOC_OFFSET_ANNOTATION, load_profile, open_image, save_profile
    from prefetch.lazyfs import mount
    from prefetch.profile import plan_prefetch, profile_summary
    from prefetch.toc import TAIL_GUESS
    from striped_fs.mount import wait_mounted

    info: dict[str, Any] = {"t_imports": time.monotonic() - t_start}
    image = open_image(
        spec["ref"], spec["cache"], record=spec["record"], connections=spec["connections"]
    )
    info["t_open"] = time.monotonic() - t_start
    toc = 0
    for desc in image.manifest.layers:
        at = int((desc.annotations or {}).get(TOC_OFFSET_ANNOTATION, desc.size))
        toc += max(desc.size - at, min(TAIL_GUESS, desc.size))
    info["toc_bytes"] = toc
    info["blob_bytes"] = sum(d.size for d in image.manifest.layers)
    info["frames_total"] = sum(len(b.frames) for b in image.blobs)
    fetcher = image.lazy.fetcher
    if spec["profile"]:
        profile = load_profile(image)
        info["t_profile_loaded"] = time.monotonic() - t_start
        if profile is None:
            info["profile_error"] = "no profile stored for the image"
        else:
            plan, full = plan_prefetch(profile, image.blobs)
            queued = fetcher.prefetch(plan)
            info["profile"] = {
                **profile_summary(profile, image.blobs),
                "recorded": profile.recorded,
                "plan_frames": len(plan),
                "full": full,
                "queued": queued,
                "plan_bytes": sum(b.frames[i].c_size for b, i in plan),
            }
        info["t_prefetch_queued"] = time.monotonic() - t_start

    # Instrumentation (no prefetch change): what FUSE reads returned, which frames were read.
    lock = threading.Lock()
    reads: list[tuple[int, int, int]] = []
    frames_seen: set[tuple[str, int]] = set()
    blobs = {b.digest: b for b in image.blobs}
    lazy_read = image.lazy.read
    fetch_frame = fetcher.frame

    # The wrappers take the wrapped methods' ``record`` keyword (a layer written out to disk
    # reads with record=False): without it every FUSE read failed with EINVAL, so exec in the
    # mount failed (chroot exited 126). Only a program's reads (record=True) are counted.
    def counted_read(node: Any, offset: int, size: int, *, record: bool = True) -> bytes:
        data = lazy_read(node, offset, size, record=record)
        if record:
            with lock:
                reads.append((node.ino, offset, len(data)))
        return data

    def counted_frame(blob: Any, i: int, *, record: bool = True) -> bytes:
        if record:
            with lock:
                frames_seen.add((blob.digest, i))
        return fetch_frame(blob, i, record=record)

    image.lazy.read = counted_read  # type: ignore[method-assign]
    fetcher.frame = counted_frame  # type: ignore[method-assign]

    mnt = spec["mnt"]

    def announce() -> None:
        try:
            wait_mounted(mnt, 120)
        except Exception as exc:  # noqa: BLE001 - the parent sees the child exit
            print(f"ERROR mount did not appear: {exc}", flush=True)
            return
        info["t_ready"] = time.monotonic() - t_start
        print("READY", flush=True)

    def control() -> None:
        for line in sys.stdin:
            if line.strip() == "STOP" and spec["record"]:
                t0 = time.monotonic()
                profile = image.lazy.recorder.stop()
                digest = save_profile(image, profile)
                saved = {
                    "digest": digest,
                    "recorded": profile.recorded,
                    "seconds_to_save": time.monotonic() - t0,
                    **profile_summary(profile, image.blobs),
                }
                info["saved"] = saved
                print("SAVED " + json.dumps(saved), flush=True)

    threading.Thread(target=announce, daemon=True).start()
    threading.Thread(target=control, daemon=True).start()
    error = None
    try:
        mount(image.lazy, mnt, foreground=True, dev_suid=True)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent in the JSON
        error = f"{type(exc).__name__}: {exc}"
    stats = fetcher.report().as_dict()
    with lock:
        seen = sorted(frames_seen)
        info.update(
            error=error,
            stats=stats,
            fuse_reads=len(reads),
            read_bytes=sum(n for _, _, n in reads),
            read_unique_bytes=_union_bytes(reads),
            frames_read=len(seen),
            frames_read_c_bytes=sum(blobs[d].frames[i].c_size for d, i in seen),
            frames_read_u_bytes=sum(blobs[d].frames[i].u_size for d, i in seen),
            cache_bytes=fetcher.cache.size,
        )
    info["t_end"] = time.monotonic() - t_start
    Path(spec["out"]).write_text(json.dumps(info))
    with contextlib.suppress(Exception):
        image.close()
    return 0 if error is None else 1


# -- helpers run in subprocesses (they import prefetch) ---------------------------------------


def helper_main(name: str, arg: str) -> int:
    params = json.loads(arg)
    if name == "push":
        from e2e_image import push_image

        t0 = time.perf_counter()
        layer = {"path": params["layer"], "digest": params["digest"], "size": params["size"]}
        digest = push_image(
            params["registry"], params["repo"], params["tag"], [layer], params["config"]
        )
        print(json.dumps({"manifest": digest, "seconds": time.perf_counter() - t0}))
        return 0
    if name == "convert":
        from prefetch.image import convert_image
        from prefetch.reference import Reference
        from prefetch.registry import SyncRegistry

        t0 = time.perf_counter()
        r = convert_image(params["src"], params["dst"], workdir=params["workdir"])
        with SyncRegistry(Reference.parse(params["dst"]).registry) as reg:
            converted = reg.resolve_image(Reference.parse(params["dst"]))
        out = {
            "digest": r.digest,
            "layers": r.layers,
            "size_before": r.size_before,
            "layer_digests": [d.digest for d in converted.layers],
            "size_after": r.size_after,
            "converted": r.converted,
            "seconds": r.seconds,
            "wall_s": time.perf_counter() - t0,
        }
        with contextlib.suppress(Exception):
            from prefetch.layer import DEFAULT_FRAME_SIZE, DEFAULT_LEVEL

            out.update(frame_size=DEFAULT_FRAME_SIZE, level=DEFAULT_LEVEL)
        print(json.dumps(out))
        return 0
    raise SystemExit(f"unknown helper {name}")


# -- small utilities ---------------------------------------------------------------------------


def clean_env() -> dict[str, str]:
    """This environment without proxy settings (loopback must stay loopback), without
    ``PYTHON*`` variables, with this checkout on PYTHONPATH (for the helpers and the child)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if "proxy" not in k.lower()
        and not k.startswith(("PYTHON", "PIP_"))
        and k not in ("VIRTUAL_ENV", "CONDA_PREFIX")
    }
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["PYTHONPATH"] = str(_ROOT)
    return env


def read_through(path: Path) -> None:
    """Read a file to put it in the page cache (the registry's blobs after a drop)."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 * MiB)
        while f.readinto(buf):
            pass


def tree_stats(root: Path) -> tuple[int, int]:
    """(entries, bytes of regular files) under ``root``, not following links."""
    entries = size = 0
    for dirpath, dirs, names in os.walk(root):
        entries += len(dirs)
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                entries += 1
                if not os.path.islink(os.path.join(dirpath, name)):
                    size += st.st_size
    return entries, size


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            h.update(block)
    return h.hexdigest()


def is_mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point, read from the mount table only: a FUSE mount whose
    connection is held but not served (the snapshotter stopped, the FUSE holder keeping its
    descriptor) blocks every stat of its root in the kernel, so nothing here resolves it (a
    benchmark hung there for 24 minutes, 2026-12-03). Imported here, not at the top: striped_fs
    loads fsspec, and with it zstandard, which main() requires to be cold."""
    from striped_fs.mount import is_mounted as table_says_mounted

    return table_says_mounted(path)


def unmount(path: Path, lazy: bool = False) -> None:
    """Unmount ``path`` if it is mounted (fusermount, then umount); a failure is left to the
    caller's next check, as before."""
    from striped_fs.errors import MountError
    from striped_fs.mount import unmount as fuse_unmount

    with contextlib.suppress(MountError):
        fuse_unmount(path, lazy=lazy)


def _command_line() -> str:
    return command_line("bench_prefetch.py")


def _source_state() -> dict[str, Any]:
    return source_state(["prefetch", "striped_fs", "bootseer", "benchmarks"])


def _mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MB:.1f} MB"


# -- the image ---------------------------------------------------------------------------------


def mirror_reachable() -> bool:
    url = f"{DEBIAN_MIRROR}/dists/{SUITE_NAME}/Release"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as debootstrap
    with contextlib.suppress(Exception):
        with opener.open(urllib.request.Request(url, method="HEAD"), timeout=15) as resp:
            return resp.status == 200
    # A configured HTTP proxy is what debootstrap/apt would use too.
    with contextlib.suppress(Exception):
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15) as resp:
            return resp.status == 200
    return False


def ensure_debootstrap() -> bool:
    if shutil.which("debootstrap"):
        return True
    log("debootstrap is not installed: apt-get install -y debootstrap")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(
        ["apt-get", "install", "-y", "debootstrap"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False)
        r = subprocess.run(
            ["apt-get", "install", "-y", "debootstrap"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    return r.returncode == 0 and shutil.which("debootstrap") is not None


def _chroot_python(root: Path, code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["chroot", str(root), "/usr/bin/python3", "-c", code],
        env=CHROOT_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _host_closure(seeds: tuple[str, ...]) -> list[str]:
    """Installed packages needed by ``seeds`` (Depends + Pre-Depends, first installed
    alternative), by dpkg-query."""

    def installed(name: str) -> bool:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True, check=False
        )
        return r.returncode == 0 and r.stdout.endswith(" installed")

    todo, done = list(seeds), set()
    while todo:
        pkg = todo.pop()
        if pkg in done or not installed(pkg):
            continue
        done.add(pkg)
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Depends}, ${Pre-Depends}", pkg],
            capture_output=True,
            text=True,
            check=False,
        )
        for group in r.stdout.split(","):
            for alt in group.split("|"):
                name = alt.strip().split(" ")[0].split(":")[0]
                if name and installed(name):
                    todo.append(name)
                    break
    return sorted(done)


def build_host_rootfs(dest: Path) -> dict[str, Any]:
    """A minimal rootfs from this host's Debian packages: python3.11 and its closure (the
    fallback when the Debian mirror cannot be reached)."""
    packages = _host_closure(HOST_SEEDS)
    if "python3.11" not in packages:
        raise RuntimeError("no Debian python3.11 on this host to copy (dpkg -L python3.11)")
    for top in ("bin", "lib", "lib64", "sbin"):
        (dest / "usr" / top).mkdir(parents=True, exist_ok=True)
        os.symlink(f"usr/{top}", dest / top)
    copied = 0
    for pkg in packages:
        listing = subprocess.run(
            ["dpkg-query", "-L", pkg], capture_output=True, text=True, check=False
        ).stdout.splitlines()
        for path in listing:
            if not path.startswith("/") or os.path.isdir(path) and not os.path.islink(path):
                continue
            if not os.path.lexists(path) or path.startswith("/usr/share/doc"):
                continue
            real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
            target = dest / real.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(target):
                continue
            if os.path.islink(path):
                os.symlink(os.readlink(path), target)
            else:
                shutil.copy2(path, target)
            copied += 1
    for d in ("etc", "tmp", "root", "proc", "sys", "dev", "var/tmp", "usr/local/bin"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc/group").write_text("root:x:0:\n")
    for name, minor in (("null", 3), ("zero", 5), ("random", 8), ("urandom", 9)):
        os.mknod(dest / "dev" / name, 0o666 | 0o020000, os.makedev(1, minor))
    for conf in Path("/etc").glob("ld.so.conf*"):
        subprocess.run(["cp", "-a", str(conf), str(dest / "etc")], check=False)
    if (dest / "usr/sbin/ldconfig").exists():
        subprocess.run(["chroot", str(dest), "/usr/sbin/ldconfig"], check=False)
    os.symlink(f"python{PYVER}", dest / "usr/bin/python3")
    r = subprocess.run(
        [
            "chroot",
            str(dest),
            "/usr/bin/python3",
            "-m",
            "compileall",
            "-q",
            f"/usr/lib/python{PYVER}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode not in (0, 1):  # 1: a test module that does not compile; harmless
        raise RuntimeError(f"compileall in the host rootfs failed: {r.stderr[-2000:]}")
    return {"source": "host", "packages": packages, "files_copied": copied}


def build_base(image_dir: Path, base: str) -> dict[str, Any]:
    """The base rootfs (Debian minbase + python3), built once; ``base``: auto|debootstrap|host."""
    for source in ("debootstrap", "host") if base == "auto" else (base,):
        meta_path = image_dir / f"base-{source}.json"
        if meta_path.exists() and (image_dir / f"base-{source}" / "usr/bin/python3").exists():
            return json.loads(meta_path.read_text())
    source = base
    if base in ("auto", "debootstrap"):
        ok = mirror_reachable()
        if not ok:
            log(f"{DEBIAN_MIRROR} is not reachable from this machine")
        elif not ensure_debootstrap():
            log("debootstrap could not be installed")
            ok = False
        if ok:
            source = "debootstrap"
        elif base == "auto":
            log("falling back to a minimal rootfs copied from this host's Debian packages")
            source = "host"
        else:
            raise RuntimeError("--base debootstrap: the Debian mirror or debootstrap is missing")
    final = image_dir / f"base-{source}"
    tmp = image_dir / f"base-{source}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    if source == "debootstrap":
        log(f"debootstrap --variant=minbase {SUITE_NAME} {tmp} {DEBIAN_MIRROR} (once)")
        run_checked(
            ["debootstrap", "--variant=minbase", SUITE_NAME, str(tmp), DEBIAN_MIRROR],
            what="debootstrap",
            timeout=3600,
        )
        log("apt-get install python3 in the chroot")
        apt_env = {**CHROOT_ENV, "DEBIAN_FRONTEND": "noninteractive"}
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            if k in os.environ:
                apt_env[k] = os.environ[k]
        run_checked(
            ["chroot", str(tmp), "apt-get", "install", "-y", "--no-install-recommends", "python3"],
            env=apt_env,
            what="apt-get install python3 (chroot)",
        )
        run_checked(["chroot", str(tmp), "apt-get", "clean"], env=apt_env, what="apt-get clean")
        lists = tmp / "var/lib/apt/lists"
        for p in lists.glob("*"):
            if p.is_file():
                p.unlink()
        meta: dict[str, Any] = {
            "source": "debootstrap",
            "mirror": DEBIAN_MIRROR,
            "suite": SUITE_NAME,
            "variant": "minbase",
        }
    else:
        log("building a minimal rootfs from this host's python3.11 and its Debian packages")
        meta = build_host_rootfs(tmp)
    for mnt in ("proc", "sys", "dev/pts"):  # debootstrap unmounts these; make sure
        if is_mounted(tmp / mnt):
            unmount(tmp / mnt, lazy=True)
    r = _chroot_python(tmp, "import sys; print('%d.%d' % sys.version_info[:2])")
    if r.returncode != 0 or r.stdout.strip() != PYVER:
        raise RuntimeError(f"the base rootfs's python3 is not {PYVER}: {r.stdout} {r.stderr}")
    meta["python"] = _chroot_python(tmp, "import sys; print(sys.version.split()[0])").stdout.strip()
    meta["seconds"] = time.perf_counter() - t0
    meta["built"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    os.replace(tmp, final)
    (image_dir / f"base-{source}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def wheel_dirs(cache: Path) -> list[Path]:
    return [
        d
        for d in (
            cache / "image" / "wheels",
            cache / "wheels",
            cache / "wheels-quick",
            Path("/opt/wheels"),
        )
        if d.is_dir()
    ]


def pip_install_target(cache: Path, target: Path, packages: list[str]) -> str:
    """Install ``packages`` into ``target`` from local wheels; ``pip download`` them (pip's
    configured index, /opt/wheels first) when some are missing. Returns where they came from."""
    base = [sys.executable, "-m", "pip", "--disable-pip-version-check"]

    def install() -> subprocess.CompletedProcess:
        links = [a for d in wheel_dirs(cache) for a in ("--find-links", str(d))]
        return subprocess.run(
            [
                *base,
                "install",
                "--no-index",
                *links,
                "--no-warn-script-location",
                "--target",
                str(target),
                *packages,
            ],
            env=clean_env(),
            capture_output=True,
            text=True,
            check=False,
        )

    r = install()
    if r.returncode == 0:
        return "local wheels"
    log(f"local wheels incomplete ({r.stderr.strip().splitlines()[-1:]}); pip download")
    dest = cache / "image" / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    run_checked(
        [*base, "download", "--only-binary=:all:", "--dest", str(dest), *links, *packages],
        env=clean_env(),
        what="pip download",
    )
    shutil.rmtree(target, ignore_errors=True)
    r = install()
    if r.returncode != 0:
        raise RuntimeError(f"pip install --target failed: {r.stderr.strip()[-3000:]}")
    return "pip download + local wheels"


def build_variant(
    image_dir: Path, cache: Path, name: str, base_meta: dict[str, Any]
) -> dict[str, Any]:
    """The variant's rootfs (base + packages), its gzip layer and its facts, built once."""
    source = base_meta["source"]
    vdir = image_dir / f"{name}-{source}"
    meta_path = vdir / "image.json"
    layer = vdir / "layer.tar.gz"
    with contextlib.suppress(OSError, ValueError, KeyError):
        meta = json.loads(meta_path.read_text())
        if layer.stat().st_size == meta["gzip_bytes"]:
            return meta
    variant = VARIANTS[name]
    t0 = time.perf_counter()
    shutil.rmtree(vdir, ignore_errors=True)
    vdir.mkdir(parents=True)
    rootfs = vdir / "rootfs"
    log(f"building image '{name}' ({variant['what']}) on the {source} base, once")
    run_checked(["cp", "-a", str(image_dir / f"base-{source}"), str(rootfs)], what="cp -a base")
    for path in variant.get("prune", []):
        shutil.rmtree(rootfs / path, ignore_errors=True)
    wheels_from = (
        pip_install_target(cache, rootfs / SITE, variant["packages"])
        if variant["packages"]
        else "none (no packages)"
    )
    r = _chroot_python(rootfs, variant["code"])
    if r.returncode != 0:
        raise RuntimeError(
            f"chroot {rootfs} python3 -c {variant['code']!r} failed: {r.stderr.strip()[-3000:]}"
        )
    entries, nbytes = tree_stats(rootfs)
    log(f"  rootfs: {entries} entries, {nbytes / MB:.0f} MB; tar | gzip -6 (single-threaded, once)")
    tar = subprocess.Popen(
        ["tar", "-C", str(rootfs), "--numeric-owner", "--sort=name", "-cf", "-", "."],
        stdout=subprocess.PIPE,
    )
    partial = vdir / "layer.tar.gz.partial"
    diff, tar_bytes = hashlib.sha256(), 0
    with open(partial, "wb") as out:
        gz = subprocess.Popen(["gzip", "-6", "-n"], stdin=subprocess.PIPE, stdout=out)
        assert tar.stdout is not None and gz.stdin is not None
        while block := tar.stdout.read(MiB):
            diff.update(block)
            tar_bytes += len(block)
            gz.stdin.write(block)
        gz.stdin.close()
        if tar.wait() != 0 or gz.wait() != 0:
            raise RuntimeError(f"tar ({tar.returncode}) | gzip ({gz.returncode}) failed")
    os.replace(partial, layer)
    meta = {
        "variant": name,
        "what": variant["what"],
        "code": variant["code"],
        "packages": variant["packages"],
        "pruned": variant.get("prune", []),
        "wheels": wheels_from,
        "base": base_meta,
        "entries": entries,
        "bytes": nbytes,
        "tar_bytes": tar_bytes,
        "diff_id": "sha256:" + diff.hexdigest(),
        "gzip_bytes": layer.stat().st_size,
        "gzip_digest": "sha256:" + sha256_file(layer),
        "seconds": time.perf_counter() - t0,
        "built": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# -- the benchmark -----------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = smoke_implies_quick(args)
        self.quick = bool(args.quick)
        self.variant = "smoke" if self.smoke else "quick" if self.quick else "full"
        self.repeat = max(1, args.repeat)
        self.cache = (
            Path(
                args.cache
                or os.environ.get("BOOTSEER_BENCH_CACHE")
                or Path.home() / ".cache" / "bootseer-bench"
            )
            .expanduser()
            .resolve()
        )
        self.image_dir = self.cache / "image"
        self.work = self.cache / "prefetch-run"
        self.results_dir = Path(args.results)
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.cold = True
        self.run_id = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d%H%M%S")
        self.R: dict[str, Any] = {
            "suite": SUITE,
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": _command_line(),
            "source": _source_state(),
            "quick": self.quick,
            "smoke": self.smoke,
            "repeat": self.repeat,
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "machine": {
                "cpus": os.cpu_count(),
                "ram_bytes": mem_total(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "tar": version_of(["tar", "--version"]),
                "gzip": version_of(["gzip", "--version"]),
                "curl": version_of(["curl", "--version"]),
                "registry": version_of(["docker-registry", "--version"]),
            },
            "link": {
                "latency_ms": LINK.latency_s * 1e3,
                "per_conn_mb_s": 10.0,
                "total_mb_s": 160.0,
                "describe": LINK.describe(),
                "connections": CONNECTIONS,
            },
            "targets": {
                "profile_vs_floor_max": VS_FLOOR,
                "full_over_profile_min": VS_FULL,
                "lazy_over_profile_min": VS_LAZY,
                "bytes_vs_read_max": BYTES_VS_READ,
            },
            "runs": {m: [] for m in (*METHODS, "record", "warm")},
            "warnings": [],
            "errors": self.errors,
        }

    def form(self) -> str:
        """What the markdown's title calls this run."""
        return "quick, smoke" if self.smoke else "quick" if self.quick else "full"

    # -- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "needs root: debootstrap, chroot, drop_caches and a FUSE mount with device nodes"
            )
        for tool in ("curl", "tar", "gzip", "chroot", "fusermount"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed")
        self.image_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.stack.callback(self.cleanup)
        self.R["machine"]["work_fs"] = fs_type(self.work)
        base = build_base(self.image_dir, self.args.base)
        log(
            f"base rootfs: {base['source']}"
            + (
                f" ({base.get('mirror')} {base.get('suite')}, {base.get('variant')})"
                if base["source"] == "debootstrap"
                else " (copied from this host's packages)"
            )
            + f", python {base.get('python')}"
        )
        self.image = build_variant(self.image_dir, self.cache, self.variant, base)
        self.code = self.image["code"]
        self.R["image"] = self.image
        log(
            f"image: {self.image['what']}, {self.image['entries']} entries, "
            f"{self.image['bytes'] / MB:.0f} MB in files, tar {self.image['tar_bytes'] / MB:.0f} MB, "
            f"gzip layer {self.image['gzip_bytes'] / MB:.0f} MB"
        )

        self.registry = RegistryServer(self.image_dir / "registry").start()
        self.stack.callback(self.registry.close)
        self.shaper = ShaperProcess("127.0.0.1", self.registry.port, LINK).start()
        self.stack.callback(self.shaper.stop)
        log(
            f"registry {self.registry.host} (storage {self.registry.storage_dir}); "
            f"shaper {self.shaper.address}: {LINK.describe()}"
        )
        self.repo = f"bench/{self.variant}-{base['source']}"
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": [f"PATH={CHROOT_ENV['PATH']}"], "Cmd": ["/usr/bin/python3"]},
            "rootfs": {"type": "layers", "diff_ids": [self.image["diff_id"]]},
        }
        pushed = self.helper(
            "push",
            {
                "registry": self.registry.host,
                "repo": self.repo,
                "tag": "gzip",
                "layer": str(self.image_dir / f"{self.variant}-{base['source']}" / "layer.tar.gz"),
                "digest": self.image["gzip_digest"],
                "size": self.image["gzip_bytes"],
                "config": config,
            },
        )
        self.R["image"]["manifest"] = pushed["manifest"]
        log(
            f"gzip image {self.registry.host}/{self.repo}:gzip ({pushed['manifest'][:19]}; "
            f"push/check {pushed['seconds']:.1f} s)"
        )

        # Conversion: every run, into a fresh repository (the figure is this run's); unshaped.
        dst_repo = f"{self.repo}-lazy-{self.run_id}"
        log(f"convert_image -> {dst_repo}:lazy (unshaped registry) ...")
        conv = self.helper(
            "convert",
            {
                "src": f"{self.registry.host}/{self.repo}:gzip",
                "dst": f"{self.registry.host}/{dst_repo}:lazy",
                "workdir": str(self.work),
            },
            timeout=3600,
        )
        conv["mb_s"] = self.image["tar_bytes"] / MB / conv["seconds"]
        self.R["conversion"] = conv
        log(
            f"  {conv['seconds']:.1f} s: {self.image['tar_bytes'] / MB:.0f} MB tar "
            f"({conv['size_before'] / MB:.0f} MB gzip) -> {conv['size_after'] / MB:.0f} MB "
            f"seekable zstd, {conv['mb_s']:.0f} MB/s of uncompressed tar"
        )
        self.lazy_ref = f"{self.shaper.address}/{dst_repo}:lazy"
        self.gzip_url = (
            f"http://{self.shaper.address}/v2/{self.repo}/blobs/{self.image['gzip_digest']}"
        )
        self.gzip_blob = self.registry.blob_path(self.image["gzip_digest"])
        self.lazy_blobs = [self.registry.blob_path(d) for d in conv["layer_digests"]]

    def helper(self, name: str, params: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
        out = run_checked(
            [sys.executable, str(Path(__file__).resolve()), "--helper", name, json.dumps(params)],
            env=clean_env(),
            what=f"helper {name}",
            timeout=timeout,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def cleanup(self) -> None:
        for mnt in sorted(self.work.glob("*-mnt")):
            with contextlib.suppress(Exception):
                unmount(mnt, lazy=True)
        if self.args.keep:
            log(f"kept {self.work}")
            return
        shutil.rmtree(self.work, ignore_errors=True)

    # -- plumbing ------------------------------------------------------------------------------
    def go_cold(self, warm: list[Path]) -> None:
        if not drop_caches():
            self.cold = False
        for path in warm:  # the registry's disk is not this node's
            read_through(path)

    def chroot_import(self, root: Path, logf: Any, timeout: float = STEP_TIMEOUT_S) -> int | None:
        logf.write(f"\n$ chroot {root} /usr/bin/python3 -c {self.code!r}\n".encode())
        logf.flush()
        try:
            return subprocess.run(
                ["chroot", str(root), "/usr/bin/python3", "-c", self.code],
                env=CHROOT_ENV,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            return None

    def measure(self, method: str, rnd: int, fn: Any) -> dict[str, Any] | None:
        load = os.getloadavg()[0]
        log(f"{LABELS[method]} (round {rnd + 1}/{self.repeat}; load {load:.2f}) ...")
        try:
            result = fn(rnd)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            result = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc(file=sys.stdout)
        result["loadavg_before"] = round(load, 2)
        result["cold"] = self.cold
        self.R["runs"][method].append(result)
        if result.get("error"):
            self.errors.append(f"{method} round {rnd + 1}: {result['error']}")
            log(f"  ERROR {result['error']}")
            return None
        return result

    # -- methods ---------------------------------------------------------------------------------
    def full_pull(self, rnd: int) -> dict[str, Any]:
        dest = self.work / f"full-r{rnd}-rootfs"
        dest.mkdir()
        logp = self.work / f"full-r{rnd}.log"
        self.go_cold([self.gzip_blob])
        with open(logp, "ab") as logf:
            t0 = time.perf_counter()
            curl = subprocess.Popen(
                ["curl", "-sS", "-f", "--noproxy", "*", self.gzip_url],
                stdout=subprocess.PIPE,
                stderr=logf,
                env=clean_env(),
            )
            tar = subprocess.Popen(
                ["tar", "-xzf", "-", "-C", str(dest), "--numeric-owner"],
                stdin=curl.stdout,
                stderr=logf,
            )
            assert curl.stdout is not None
            curl.stdout.close()
            try:
                curl_rc = curl.wait(timeout=STEP_TIMEOUT_S)
                t_download = time.perf_counter() - t0
                tar_rc = tar.wait(timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                curl.kill()
                tar.kill()
                raise RuntimeError("pull timed out") from None
            t_extract = time.perf_counter() - t0
            if curl_rc != 0 or tar_rc != 0:
                raise RuntimeError(f"curl exited {curl_rc}, tar exited {tar_rc} (log {logp})")
            rc = self.chroot_import(dest, logf)
            total = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"import exited {rc} (log {logp})")
        self.last_rootfs = dest
        r = {
            "total": total,
            "download_done": t_download,
            "extract_done": t_extract,
            "import": total - t_extract,
            "gzip_bytes": self.image["gzip_bytes"],
        }
        log(
            f"  {total:.2f} s (download done {t_download:.2f}, extract done {t_extract:.2f}, "
            f"import {total - t_extract:.2f})"
        )
        return r

    def floor(self, rnd: int) -> dict[str, Any]:
        root = getattr(self, "last_rootfs", None)
        if root is None:
            raise RuntimeError("no extracted rootfs (the full pull failed)")
        logp = self.work / f"floor-r{rnd}.log"
        self.go_cold([])
        with open(logp, "ab") as logf:
            t0 = time.perf_counter()
            rc = self.chroot_import(root, logf)
            total = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"import exited {rc} (log {logp})")
        log(f"  {total:.2f} s")
        return {"total": total}

    def lazy_start(
        self,
        name: str,
        rnd: int,
        *,
        record: bool = False,
        profile: bool = False,
        cache: Path | None = None,
    ) -> dict[str, Any]:
        tag = f"{name}-r{rnd}"
        mnt = self.work / f"{tag}-mnt"
        mnt.mkdir()
        if cache is None:  # a fresh node: an empty block cache
            cache = self.work / f"{tag}-cache"
            cache.mkdir()
        out, logp = self.work / f"{tag}.json", self.work / f"{tag}.log"
        spec = {
            "ref": self.lazy_ref,
            "cache": str(cache),
            "mnt": str(mnt),
            "record": record,
            "profile": profile,
            "connections": CONNECTIONS,
            "out": str(out),
        }
        spec_path = self.work / f"{tag}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.go_cold(self.lazy_blobs)
        lines: queue.Queue[str | None] = queue.Queue()
        with open(logp, "ab") as logf:
            t0 = time.perf_counter()
            child = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--mount-child", str(spec_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=clean_env(),
                start_new_session=True,
            )

            def pump() -> None:
                assert child.stdout is not None
                for raw in child.stdout:
                    lines.put(raw.decode(errors="replace").rstrip("\n"))
                lines.put(None)

            threading.Thread(target=pump, daemon=True).start()
            try:
                self._expect(lines, "READY", READY_TIMEOUT_S, logp)
                t_ready = time.perf_counter() - t0
                rc = self.chroot_import(mnt, logf)
                total = time.perf_counter() - t0
                saved = None
                if record and rc == 0:
                    assert child.stdin is not None
                    child.stdin.write(b"STOP\n")
                    child.stdin.flush()
                    saved = json.loads(self._expect(lines, "SAVED ", 300, logp)[6:])
            finally:
                unmount(mnt)
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.pid, signal.SIGTERM)
                    try:
                        child.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        kill_group(child)
                    unmount(mnt, lazy=True)
        if rc != 0:
            raise RuntimeError(f"import in the lazy mount exited {rc} (log {logp})")
        try:
            info = json.loads(out.read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"the mount child left no statistics ({exc}; log {logp})") from None
        if info.get("error"):
            raise RuntimeError(f"mount child: {info['error']} (log {logp})")
        st = info["stats"]
        r = {
            "total": total,
            "ready": t_ready,
            "import": total - t_ready,
            "child": info,
            "bytes_fetched": st["bytes_fetched"],
            "requests": st["requests"],
            "read_unique_bytes": info["read_unique_bytes"],
            "saved": saved,
        }
        extra = ""
        if profile:
            p = info.get("profile")
            if p is None:
                raise RuntimeError(
                    f"the profile start found no profile: {info.get('profile_error')}"
                )
            extra = (
                f"; profile {p['frames']} frames, {p['hot_bytes'] / MB:.1f} MB "
                f"({100 * p['coverage']:.0f}% of the image), full={p['full']}"
            )
        log(
            f"  {total:.2f} s (ready {t_ready:.2f}, import {total - t_ready:.2f}); fetched "
            f"{st['bytes_fetched'] / MB:.1f} MB in {st['requests']} requests, "
            f"{info['frames_read']} frames read ({st['cache_hits']} from cache), readers waited "
            f"{st['seconds_waiting']:.2f} s; FUSE returned {info['read_bytes'] / MB:.1f} MB "
            f"({info['read_unique_bytes'] / MB:.1f} MB unique){extra}"
        )
        return r

    def _expect(self, lines: queue.Queue, prefix: str, timeout: float, logp: Path) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"mount child: no {prefix.strip()} after {timeout:.0f} s (log {logp})"
                )
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                tail = logp.read_text(errors="replace")[-2000:] if logp.exists() else ""
                raise RuntimeError(f"mount child exited before {prefix.strip()}: {tail}")
            if line.startswith(prefix):
                return line
            if line.startswith("ERROR"):
                raise RuntimeError(f"mount child: {line}")

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        if self.R["loadavg_at_start"][0] > 1.0:
            self.R["warnings"].append(
                f"load average {self.R['loadavg_at_start'][0]:.2f} at the start: other processes "
                "were busy; timings may be high"
            )
        recorded = None
        for rnd in range(self.repeat):
            self.measure("full", rnd, self.full_pull)
            self.measure("lazy", rnd, lambda r: self.lazy_start("lazy", r))
            if recorded is None:
                rec = self.measure(
                    "record", rnd, lambda r: self.lazy_start("record", r, record=True)
                )
                recorded = rec["saved"] if rec else None
            if recorded is not None:
                res = self.measure(
                    "profile", rnd, lambda r: self.lazy_start("profile", r, profile=True)
                )
                if res and abs(res["child"]["profile"]["recorded"] - recorded["recorded"]) > 1e-3:
                    self.R["warnings"].append(
                        "the profile start loaded another profile than the one this run recorded"
                    )
            else:
                self.errors.append("profile: skipped, no profile was recorded")
            if (
                not self.smoke  # info only, and the same lazy start as the others
                and self.R["runs"]["profile"]
                and not self.R["runs"]["profile"][-1].get("error")
            ):
                # Info: the same start with every frame it reads already in the block cache
                # (the profile start's cache), page cache dropped: what FUSE, the cache and
                # decompression cost without any network.
                self.measure(
                    "warm",
                    rnd,
                    lambda r: self.lazy_start("warm", r, cache=self.work / f"profile-r{r}-cache"),
                )
            self.measure("floor", rnd, self.floor)
        if not self.cold:
            self.R["warnings"].append(
                "--smoke keeps the page cache: WARM figures"
                if self.smoke
                else "the page cache could not be dropped: WARM figures"
            )

    # -- report ----------------------------------------------------------------------------------
    def median(self, method: str, key: str = "total") -> float | None:
        runs = self.R["runs"][method]
        ok = [r[key] for r in runs if not r.get("error") and r.get(key) is not None]
        return statistics.median(ok) if ok and len(ok) == len(runs) else None

    def rows(self) -> list[list[str]]:
        rows: list[list[str]] = []
        p, fl, fu, la = (self.median(m) for m in ("profile", "floor", "full", "lazy"))

        def t(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f} s"

        def verdict(ok: bool | None) -> str:
            return "n/a" if ok is None else ("PASS" if ok else "MISS")

        def runs_text(method: str) -> str:
            runs = [r["total"] for r in self.R["runs"][method] if "total" in r]
            return f" (median of {', '.join(f'{x:.2f}' for x in runs)})" if len(runs) > 1 else ""

        ratio = p / fl if p and fl else None
        rows.append(
            [
                LABELS["profile"] + " vs floor",
                t(p) + runs_text("profile"),
                f"floor {t(fl)}{runs_text('floor')}",
                "n/a" if ratio is None else f"{ratio:.2f}x of floor",
                f"<= {VS_FLOOR:g}x floor",
                verdict(None if ratio is None else ratio <= VS_FLOOR),
            ]
        )
        ratio = fu / p if p and fu else None
        rows.append(
            [
                LABELS["profile"] + " vs full pull",
                t(p),
                f"full pull {t(fu)}" + runs_text("full"),
                "n/a" if ratio is None else f"{ratio:.1f}x faster",
                f">= {VS_FULL:g}x faster",
                verdict(None if ratio is None else ratio >= VS_FULL),
            ]
        )
        ratio = la / p if p and la else None
        rows.append(
            [
                LABELS["profile"] + " vs without profile",
                t(p),
                f"without profile {t(la)}{runs_text('lazy')}",
                "n/a" if ratio is None else f"{ratio:.1f}x faster",
                f">= {VS_LAZY:g}x faster",
                verdict(None if ratio is None else ratio >= VS_LAZY),
            ]
        )
        fetched, read = (
            self.median("profile", "bytes_fetched"),
            self.median("lazy", "read_unique_bytes"),
        )
        ratio = fetched / read if fetched is not None and read else None
        rows.append(
            [
                "bytes fetched with profile (frames, compressed) vs bytes startup read",
                _mb(fetched),
                f"startup read {_mb(read)} (unique FUSE read bytes, lazy start without profile)",
                "n/a" if ratio is None else f"{ratio:.2f}x",
                f"<= {BYTES_VS_READ:g}x",
                verdict(None if ratio is None else ratio <= BYTES_VS_READ),
            ]
        )
        # info rows
        full = [r for r in self.R["runs"]["full"] if not r.get("error")]
        if full:
            f0 = full[-1]
            rows.append(
                [
                    LABELS["full"],
                    t(fu),
                    f"download done {f0['download_done']:.2f} s, "
                    f"extract done {f0['extract_done']:.2f} s, import {f0['import']:.2f} s "
                    f"({_mb(f0['gzip_bytes'])} gzip)",
                    "",
                    "",
                    "info",
                ]
            )
        for method in ("lazy", "profile", "record", "warm"):
            ok = [r for r in self.R["runs"][method] if not r.get("error")]
            if not ok:
                continue
            r0, c = ok[-1], ok[-1]["child"]
            st = c["stats"]
            phases = (
                f"child: imports {c['t_imports']:.2f}, open_image {c['t_open'] - c['t_imports']:.2f}"
                + (
                    f", profile {c['t_profile_loaded'] - c['t_open']:.2f}"
                    if "t_profile_loaded" in c
                    else ""
                )
                + f", mounted at {c.get('t_ready', 0):.2f} s"
            )
            detail = (
                f"ready {r0['ready']:.2f} s ({phases}) + import {r0['import']:.2f} s; fetched "
                f"{_mb(st['bytes_fetched'])} in {st['requests']} requests (+ TOC "
                f"{_mb(c['toc_bytes'])}); {c['frames_read']} frames read "
                f"({_mb(c['frames_read_c_bytes'])} compressed, "
                f"{_mb(c['frames_read_u_bytes'])} raw), {st['cache_hits']} from cache; "
                f"readers waited {st['seconds_waiting']:.2f} s; FUSE returned "
                f"{_mb(c['read_bytes'])} ({_mb(c['read_unique_bytes'])} unique)"
            )
            if method == "profile" and c.get("profile"):
                pr = c["profile"]
                detail += (
                    f"; plan {pr['plan_frames']} frames {_mb(pr['plan_bytes'])}, "
                    f"full={pr['full']}, {st['prefetched']} prefetched, "
                    f"{st['prefetched_unused']} unused"
                )
            if method == "record" and r0.get("saved"):
                s = r0["saved"]
                detail += (
                    f"; profile {s['frames']} frames, {_mb(s['hot_bytes'])} "
                    f"({100 * s['coverage']:.0f}% of {_mb(s['image_bytes'])}), stored in "
                    f"{s['seconds_to_save']:.2f} s"
                )
            warm = self.median("warm") if method == "warm" else None
            ratio_text = f"{warm / fl:.2f}x of floor" if warm and fl else ""
            if len(ok) > 1:
                detail = "last round: " + detail
            rows.append(
                [
                    LABELS[method],
                    t(r0["total"]) if method == "record" else t(self.median(method)),
                    detail,
                    ratio_text,
                    "",
                    "info",
                ]
            )
        if fl is not None:
            rows.append([LABELS["floor"], t(fl), "", "", "", "info"])
        conv = self.R.get("conversion")
        if conv:
            rows.append(
                [
                    "conversion throughput (convert_image, unshaped registry)",
                    f"{conv['mb_s']:.0f} MB/s",
                    f"{conv['seconds']:.1f} s for {_mb(self.image['tar_bytes'])} tar: "
                    f"{_mb(conv['size_before'])} gzip -> {_mb(conv['size_after'])} seekable "
                    f"zstd (level {conv.get('level', '?')}, frames "
                    f"{conv.get('frame_size', 0) // 1024} KiB)",
                    "",
                    "",
                    "info",
                ]
            )
        return rows

    def report(self) -> None:
        head = ["metric", "bootseer", "peer / reference", "ratio", "target", "result"]
        rows = self.rows()
        table = md_table(head, rows)
        self.R["table"] = [dict(zip(head, r, strict=True)) for r in rows]
        cpus = os.cpu_count() or 1
        busy = [
            f"{m} ({r['loadavg_before']:.1f})"
            for m, runs in self.R["runs"].items()
            for r in runs
            if r.get("loadavg_before", 0) > cpus + 1
        ]
        if busy:
            self.R["warnings"].append(
                f"load average above {cpus + 1} ({cpus} CPUs) before: "
                f"{', '.join(busy)}; those figures may be high"
            )
        if self.quick:
            self.R["warnings"].append(
                "--smoke: python3.11 alone, no warm start; a test's run, not the figures"
                if self.smoke
                else "--quick: numpy only (no torch); a smoke run, not the figures"
            )
        self.R["load_end"] = [round(x, 2) for x in os.getloadavg()]
        print("")
        m, img = self.R["machine"], self.R.get("image", {})
        log(
            f"== results ({'cold node: page cache dropped before each method' if self.cold else 'WARM'}; "
            f"{m['cpus']} CPUs, {m['ram_bytes'] / 2**30:.1f} GiB RAM)"
        )
        if img:
            base = img["base"]
            print(
                f"image: {img['what']}, base {base['source']}"
                + (
                    f" (debootstrap --variant=minbase {base.get('suite')})"
                    if base["source"] == "debootstrap"
                    else " (host packages)"
                )
                + f", python {base.get('python')}; {img['entries']} entries, "
                f"{img['bytes'] / MB:.0f} MB in files; one gzip layer {img['gzip_bytes'] / MB:.0f} MB"
            )
        print(
            f"link: registry behind the shaper, {LINK.describe()}; startup = "
            f'`chroot ROOT python3 -c "{self.R.get("image", {}).get("code", "?")}"` exits 0'
        )
        for line in table:
            print(line)
        print(
            f"load average: before the run {self.R['loadavg_at_start'][0]:.2f}, after "
            f"{self.R['load_end'][0]:.2f}"
        )
        for w in self.R["warnings"]:
            print(f"WARNING: {w}")
        for e in self.errors:
            print(f"ERROR: {e}")
        sys.stdout.flush()
        self.write_files(table)

    def write_files(self, table: list[str] | None = None) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        self.R["elapsed_s"] = time.monotonic() - _T0
        (self.results_dir / f"{SUITE}.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )
        if table is None:
            log(f"wrote {self.results_dir / f'{SUITE}.json'} (partial)")
            return
        m, img = self.R["machine"], self.R.get("image", {})
        base = img.get("base", {})
        md = [
            f"# prefetch benchmark ({self.form()} run)",
            "",
            f"- command: `{self.R['command']}` (run time {self.R['elapsed_s']:.0f} s, "
            f"{self.R['finished']})",
            f"- machine: {m['cpus']} CPUs, {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
            f"{m['platform']}, Python {m['python']}, {m['tar']}, {m['gzip']}, "
            f"{m['curl'].split(' (')[0]}, docker-registry {m['registry']}; work dir on "
            f"{m.get('work_fs')}",
            f"- source: commit {self.R['source'].get('commit', '?')[:12]}"
            + (
                f", local changes in {', '.join(self.R['source']['local_changes'])}"
                if self.R["source"].get("local_changes")
                else ""
            ),
            f"- load average: {self.R['loadavg_at_start'][0]:.2f} at start, "
            f"{self.R.get('load_end', ['?'])[0]} at end",
            f"- {'cold node: `sync; echo 3 > /proc/sys/vm/drop_caches` before each method (the registry blob re-read into the page cache)' if self.cold else 'WARM: --smoke keeps the page cache' if self.smoke else 'WARM: the page cache could not be dropped'}",
            f"- image: {img.get('what')}; base "
            + (
                f"`debootstrap --variant=minbase {base.get('suite')}` + apt python3"
                if base.get("source") == "debootstrap"
                else "copied from the host's Debian packages"
            )
            + f" (python {base.get('python')}); {img.get('entries')} entries, "
            f"{img.get('bytes', 0) / MB:.0f} MB in files, tar {img.get('tar_bytes', 0) / MB:.0f} MB, "
            f"one gzip layer {img.get('gzip_bytes', 0) / MB:.0f} MB",
            f'- startup: `chroot ROOT python3 -c "{img.get("code")}"` exits 0',
            f"- link: the registry behind the shaping proxy, {LINK.describe()}; "
            f"{CONNECTIONS} connections for lazy reads, one stream (curl) for the full pull",
            "",
            *table,
        ]
        if self.R["warnings"]:
            md += ["", *[f"- WARNING: {w}" for w in self.R["warnings"]]]
        if self.errors:
            md += ["", *[f"- ERROR: {e}" for e in self.errors]]
        (self.results_dir / f"{SUITE}.md").write_text("\n".join(md) + "\n")
        log(f"wrote {self.results_dir / f'{SUITE}.json'} and {self.results_dir / f'{SUITE}.md'}")


# C extensions the mount child loads. A process that has them mapped keeps their pages in the
# page cache through drop_caches: `bootseer bench` runs this script in a fresh interpreter.
_MAPPED_BY_TOOLS = (
    "aiohttp",
    "yarl",
    "multidict",
    "frozenlist",
    "propcache",
    "zstandard",
    "fuse",
    "numpy",
    "torch",
    "prefetch.fetcher",
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--mount-child"]:
        return mount_child(argv[1])
    if argv[:1] == ["--helper"]:
        return helper_main(argv[1], argv[2])
    if any(name in sys.modules for name in _MAPPED_BY_TOOLS):
        return reexec(__file__, argv)
    parser = argparse.ArgumentParser(prog="bench_prefetch.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--results", default="bench-results", help="directory for prefetch.json/.md"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="numpy only (no torch): a smoke run of about a minute once built",
    )
    add_smoke_flag(parser)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the four methods (one profile recorded); medians reported",
    )
    parser.add_argument(
        "--cache",
        help="cache dir (default ~/.cache/bootseer-bench, env "
        "BOOTSEER_BENCH_CACHE); the image is built under CACHE/image",
    )
    parser.add_argument(
        "--base",
        choices=("auto", "debootstrap", "host"),
        default="auto",
        help="base rootfs: debootstrap (default when deb.debian.org answers) or a "
        "copy of this host's Debian python3.11 packages",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep CACHE/prefetch-run (trees, caches, logs) for inspection",
    )
    args = parser.parse_args(argv)
    bench = Bench(args)
    code = run_bench(bench, done_key="finished")
    log(f"done in {time.monotonic() - _T0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
