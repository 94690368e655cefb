"""snapshot benchmark: time to a working ``import torch, numpy`` on a cold node, bootseer vs peers.

A real training environment: torch==2.13.0 (the CPU wheel) + numpy + their dependencies,
served as wheels from a local PEP 503 index (``bootseer.testing.pypi``). One run, two settings:

* ``local``: the index on 127.0.0.1 unshaped, the store a local directory;
* ``shaped``: the index behind the shaping proxy, the store on moto S3 (subprocess) behind the
  shaping proxy (links below; the same figures as ``bench_striped.py``).

Set-up (not timed): the wheels are downloaded once into ``CACHE/wheels`` (``pip download`` with
this machine's pip configuration); the reference environment is built once with ``bootseer env
create`` (uv, bytecode compiled) at a build prefix and published into each setting's store; the
peers' archives are made from the same installed tree (``venv-pack``; ``tar | zstd -T0 -3``) and
put into the same store.

Measured, each method in its own child process, after ``sync; echo 3 > drop_caches`` (root),
into a fresh target path, from start until ``TARGET/bin/python -c "import torch, numpy"`` exits
0 (process start-up and a first import that compiles bytecode included):

* ``pip``: ``python -m venv T && T/bin/pip install -r requirements.txt``, empty cache;
* ``uv``: ``uv venv T && uv pip install -r requirements.txt``, empty UV_CACHE_DIR;
* ``venv-pack``: fetch the .tar.gz (local file, or one s3fs stream), ``tar -xzf - -C T``, then
  the documented unpack (``source T/bin/activate``) and the import;
* ``tar-zstd``: fetch the .tar.zst the same way, ``tar -I 'zstd -T0' -xf - -C T``;
* ``bootseer``: ``bootseer env restore KEY --prefix T --store URL`` (CLI), to another prefix
  than the build's (relocation exercised, as the peers unpack elsewhere too);
* info (local only): ``cp -a`` of the installed tree, and the import alone from it, cold.

Then the warm-node check: ``bootseer env ensure --spec requirements.txt --prefix T`` on the
prefix bootseer restored (outcome "verified"), whole command, page cache warm; and the sizes.

``python benchmarks/bench_snapshot.py --results DIR [--quick] [--settings local,shaped]
[--repeat N] [--skip pip,uv]`` or ``bootseer bench snapshot``. Writes ``DIR/snapshot.json``
and ``DIR/snapshot.md``. Failed targets are reported (MISS), never raised; the exit status is
non-zero only when a measurement crashed. Everything listens on 127.0.0.1; all trees live
under ``CACHE/snapshot-run`` and are deleted at the end (Ctrl-C included), never between
measurements (a 1 GB delete right before a measurement slows ext4's inode allocation).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_smoke_flag,
    command_line,
    download_wheels,
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
# the top: anything it maps into memory (C extensions of s3fs, zstandard...) would stay in the
# page cache through drop_caches and warm the measured processes. Work that needs those
# libraries (S3 uploads, publishing) runs in helper subprocesses (``--helper``).

MB = 1e6
MiB = 1 << 20
GB = 1e9

TORCH = "torch==2.13.0"
BUCKET = "bench"
S3_STORE = f"s3://{BUCKET}/envs"
S3_PEERS = f"{BUCKET}/peers"

# -- the shaped links: the figures of bench_striped.py (HTTP_LINK, S3_LINK) -------------------
# 1 ms latency and 10 MB/s per connection, so that one stream is clearly slower than the link;
# 160 MB/s in all for the index (an HTTP server), 100 MB/s for S3 because moto cannot carry more
# on this 2-core machine.
LINK_MB = {"index": (1.0, 10.0, 160.0), "s3": (1.0, 10.0, 100.0)}

# -- targets (reported, never asserted): peer total / bootseer total --------------------------
TARGETS = {"pip": 10.0, "uv": 2.0, "venv-pack": 2.0, "tar-zstd": 1.3}
VERIFY_LIMIT_S = 1.0
VERIFY_RUNS = 3

METHODS = ("pip", "uv", "venv-pack", "tar-zstd", "bootseer")
INFO_METHODS = ("cp", "import", "floor")  # local setting only
ALL_METHODS = METHODS + INFO_METHODS
LABELS = {
    "pip": "pip install (venv + install, empty cache)",
    "uv": "uv pip install (cold cache) + first import",
    "venv-pack": "venv-pack: fetch + tar -xzf + activate",
    "tar-zstd": "tar -I 'zstd -T0' -xf (fetch + extract)",
    "bootseer": "bootseer env restore (CLI)",
    "cp": "cp -a of the installed tree (info)",
    "import": "import alone, cold, from the installed tree (info)",
    "floor": "floor: the tree's bytes into fresh page cache (dd) + warm import",
}

STEP_TIMEOUT_S = 3600.0
SETTLE_AFTER_DELETE_S = 65  # ext4 skips inodes freed in the last 60 s (recently_deleted)

# A plain single-stream S3 download to stdout, as a peer would script it: one GET, streamed
# (s3fs >= 2024 splits get_file into 10 concurrent ranged parts unless max_concurrency=1; that
# path also truncates its output, which a pipe refuses).
FETCH_CODE = """\
import json, sys
import s3fs
fs = s3fs.S3FileSystem(skip_instance_cache=True, **json.loads(sys.argv[2]))
fs.get_file(sys.argv[1], "/dev/stdout", max_concurrency=1)
"""

_T0 = time.monotonic()


# -- the measured child ------------------------------------------------------------------------


def child_main(spec_path: str) -> int:
    """Run one method's steps, timed: READY, wait for GO (the caches are dropped meanwhile),
    then each step in turn; the result goes to ``spec["result"]``."""
    spec = json.loads(Path(spec_path).read_text())
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return 2
    steps: list[dict[str, Any]] = []
    failed = None
    with open(spec["log"], "ab") as out:
        for step in spec["steps"]:
            if step.get("untimed"):  # preparation that is not part of the figure
                subprocess.run(
                    step["argv"],
                    env=step["env"],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    check=False,
                )
    start = time.perf_counter()
    with open(spec["log"], "ab") as out:
        for step in [s for s in spec["steps"] if not s.get("untimed")]:
            out.write(f"\n$ {' '.join(step['argv'])}\n".encode())
            out.flush()
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(
                    step["argv"],
                    env=step["env"],
                    cwd=step.get("cwd"),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    timeout=spec.get("timeout", STEP_TIMEOUT_S),
                    check=False,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = None
            seconds = time.perf_counter() - t0
            steps.append({"name": step["name"], "seconds": seconds, "rc": rc})
            if rc != 0:
                failed = f"step {step['name']} " + ("timed out" if rc is None else f"exited {rc}")
                break
    total = time.perf_counter() - start
    Path(spec["result"]).write_text(json.dumps({"total": total, "steps": steps, "error": failed}))
    if failed and "timed out" in failed:  # leftovers of a pipeline: our own process group
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return 0


# -- helpers run in subprocesses (they import s3fs / snapshot) --------------------------------


def helper_main(name: str, arg: str) -> int:
    params = json.loads(arg)
    if name == "publish-s3":
        import s3fs

        from snapshot.ensure import publish
        from snapshot.key import compute_key
        from snapshot.store import SnapshotStore

        opts = params["storage_options"]
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        for local, remote in params["uploads"]:
            fs.put_file(local, remote)
        env_key = compute_key([params["spec"]])
        store = SnapshotStore(params["store"], {"s3": opts})
        result = publish(store, env_key, Path(params["prefix"]), installer=params["installer"])
        manifest = store.require_manifest(env_key.key)
        print(
            json.dumps(
                {
                    "key": env_key.key,
                    "published": result.published,
                    "compressed_bytes": manifest.compressed_size,
                    "files": manifest.files,
                    "bytes": manifest.bytes,
                    "chunks": len(manifest.chunks),
                    "seconds": result.seconds,
                }
            )
        )
        return 0
    if name == "manifest":
        from snapshot.store import SnapshotStore

        store = SnapshotStore(params["store"], params.get("storage_options") or None)
        m = store.require_manifest(params["key"])
        print(
            json.dumps(
                {
                    "key": m.key,
                    "compressed_bytes": m.compressed_size,
                    "files": m.files,
                    "bytes": m.bytes,
                    "chunks": len(m.chunks),
                    "installer": m.installer,
                    "toc_bytes": m.toc.get("size"),
                }
            )
        )
        return 0
    raise SystemExit(f"unknown helper {name}")


# -- small utilities ---------------------------------------------------------------------------


def node_env() -> dict[str, str]:
    """The environment of every measured command: this one without proxy settings (loopback
    must stay loopback) and without ``PYTHON*`` variables (a developer's
    PYTHONDONTWRITEBYTECODE would stop the first import from writing the bytecode uv leaves
    to it; PYTHONPATH would add a directory to every import's search)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if "proxy" not in k.lower()
        and not k.startswith("PYTHON")
        and k not in ("VIRTUAL_ENV", "CONDA_PREFIX")
    }
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


def clean_env() -> dict[str, str]:
    """:func:`node_env` plus this checkout on PYTHONPATH: for bootseer's CLI and the helpers."""
    env = node_env()
    env["PYTHONPATH"] = str(_ROOT)
    return env


def tree_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes of regular files) under ``root``, not following links."""
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                files += 1
                if not os.path.islink(os.path.join(dirpath, name)):
                    size += st.st_size
    return files, size


def find_tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


def find_uv() -> str | None:
    with contextlib.suppress(ImportError, FileNotFoundError):
        import uv  # type: ignore[import-not-found]

        return uv.find_uv_bin()
    return find_tool("uv")


def _command_line() -> str:
    return command_line("bench_snapshot.py")


def _source_state() -> dict[str, Any]:
    return source_state(["snapshot", "striped_fs", "bootseer", "benchmarks"])


# -- the benchmark -----------------------------------------------------------------------------


class Setting:
    """Where one setting's installs and restores come from."""

    def __init__(
        self,
        name: str,
        index_url: str,
        store: str,
        peers: dict[str, str],
        storage_options: dict[str, Any] | None,
        requirements: Path,
    ) -> None:
        self.name = name
        self.index_url = index_url
        self.store = store  # bootseer's store URL (a directory, or s3://...)
        self.peers = peers  # "venv-pack" / "tar-zstd" -> local path or bucket/key
        self.storage_options = storage_options  # s3fs options (None: local)
        self.requirements = requirements
        self.key: str = ""
        self.snapshot: dict[str, Any] = {}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = smoke_implies_quick(args)
        self.quick = bool(args.quick)
        self.settings_wanted = [
            s.strip()
            for s in (args.settings or ("local" if self.quick else "local,shaped")).split(",")
            if s.strip()
        ]
        for s in self.settings_wanted:
            if s not in ("local", "shaped"):
                raise SystemExit(f"--settings: unknown setting {s!r} (local, shaped)")
        self.skip = {s.strip() for s in (args.skip or "").split(",") if s.strip()}
        for s in self.skip:
            if s not in ALL_METHODS:
                raise SystemExit(f"--skip: unknown method {s!r} ({', '.join(ALL_METHODS)})")
        self.repeat = max(1, int(args.repeat))
        self.cache = (
            Path(
                args.cache
                or os.environ.get("BOOTSEER_BENCH_CACHE")
                or Path.home() / ".cache" / "bootseer-bench"
            )
            .expanduser()
            .resolve()
        )
        self.work = self.cache / "snapshot-run"
        self.results_dir = Path(args.results)
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.python = sys.executable
        self.base_python = getattr(sys, "_base_executable", None) or sys.executable
        self.import_code = "import numpy" if self.quick else "import torch, numpy"
        self.bootseer = [sys.executable, "-m", "bootseer"]
        self.uv = find_uv()
        self.venv_pack = find_tool("venv-pack")
        self.cold = True
        self.clean_between_rounds = False
        self.setting_objs: dict[str, Setting] = {}
        self.R: dict[str, Any] = {
            "suite": "snapshot",
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": _command_line(),
            "source": _source_state(),
            "quick": self.quick,
            "smoke": self.smoke,
            "repeat": self.repeat,
            "settings_run": self.settings_wanted,
            "skipped": sorted(self.skip),
            "import": self.import_code,
            "links": {
                name: {
                    "latency_ms": lat,
                    "per_conn_mb_s": per,
                    "total_mb_s": tot,
                    "describe": _describe(name),
                }
                for name, (lat, per, tot) in LINK_MB.items()
            },
            "targets": {
                **{f"{k}_over_bootseer": v for k, v in TARGETS.items()},
                "verify_max_s": VERIFY_LIMIT_S,
                "snapshot_bytes": "<= venv-pack .tar.gz",
            },
            "machine": self.machine(),
            "settings": {},
            "warnings": [],
            "errors": self.errors,
        }

    def machine(self) -> dict[str, Any]:
        zstd = re.search(r"v(\d[\w.]*)", version_of(["zstd", "--version"]))
        m: dict[str, Any] = {
            "cpus": os.cpu_count(),
            "ram_bytes": mem_total(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "uv": version_of([self.uv, "--version"]) if self.uv else "not found",
            "venv_pack": version_of([self.venv_pack, "--version"])
            if self.venv_pack
            else "not found",
            "zstd": f"zstd {zstd.group(1)}" if zstd else "zstd ?",
            "tar": version_of(["tar", "--version"]),
        }
        with contextlib.suppress(Exception):
            import ensurepip

            m["pip_in_new_venv"] = ensurepip.version()
        return m

    def warn(self, msg: str) -> None:
        self.R["warnings"].append(msg)
        log(f"WARNING: {msg}")

    # -- set-up ------------------------------------------------------------------------------
    def wheels(self) -> list[Path]:
        reqs = ["numpy"] if self.quick else [TORCH, "numpy"]
        return download_wheels(self.cache / ("wheels-quick" if self.quick else "wheels"), reqs)

    def requirements_text(self, index_url: str, wheels: list[Path]) -> str:
        numpy = next((w for w in wheels if w.name.startswith("numpy-")), None)
        if numpy is None:
            raise RuntimeError("no numpy wheel in the wheelhouse")
        lines = [f"--index-url {index_url}"]
        if not self.quick:
            lines.append(TORCH)
        lines.append(f"numpy=={numpy.name.split('-')[1]}")
        return "\n".join(lines) + "\n"

    def check_space(self, ref_bytes: int, wheel_bytes: int) -> None:
        methods = [m for m in ALL_METHODS if m not in self.skip and m != "import"]
        per_round = {
            s: sum(1 for m in methods if s == "local" or m not in INFO_METHODS)
            for s in self.settings_wanted
        }
        tree = int(ref_bytes * 1.15) + 64 * MiB
        caches = 2 * wheel_bytes + tree  # pip's cache; uv's cache (unzipped, hard-linked)
        need_round = {s: n * tree + caches for s, n in per_round.items()}
        need_all = sum(v * self.repeat for v in need_round.values())
        free = shutil.disk_usage(self.work).free
        self.R["disk"] = {"free_bytes": free, "estimated_bytes": need_all}
        margin = 3 * GB
        if need_all + margin <= free:
            return
        if max(need_round.values()) + margin > free:
            raise RuntimeError(
                f"not enough disk under {self.work}: {free / GB:.1f} GB free, one "
                f"round needs about {max(need_round.values()) / GB:.1f} GB"
            )
        self.clean_between_rounds = True
        self.warn(
            f"{free / GB:.1f} GB free, all rounds need about {need_all / GB:.1f} GB: trees "
            f"are deleted after each round, followed by sync and a {SETTLE_AFTER_DELETE_S} s "
            "pause (ext4 avoids recently freed inodes for 60 s)"
        )

    def run(self) -> None:
        from bootseer.testing.pypi import PackageIndex, installer_env

        cpus = os.cpu_count() or 1
        load = os.getloadavg()
        self.R["loadavg_at_start"] = [round(x, 2) for x in load]
        log(
            f"bench snapshot: {'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run; settings "
            f"{','.join(self.settings_wanted)}; repeat {self.repeat}; {cpus} CPUs, "
            f"{mem_total() / 2**30:.1f} GiB RAM; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        )
        if load[0] > 0.5:
            self.warn(
                f"machine busy before the run (1-min load average {load[0]:.2f} > 0.5 on "
                f"{cpus} CPUs): other processes compete for CPU and disk; times may be high"
            )
        if self.smoke:
            self.cold = False
            self.warn("--smoke keeps the page cache: every method runs WARM")
        elif os.geteuid() != 0:
            self.cold = False
            self.warn(
                "not root: cannot drop the page cache; every method runs WARM (the figures "
                "are not cold-node figures)"
            )
        if self.uv is None:
            self.warn("uv not found: the uv method will fail and bootseer builds with pip")

        # Trees of an earlier, killed run are removed now, long before any measurement.
        if self.work.exists():
            log(f"removing {self.work}, left by an earlier run")
            shutil.rmtree(self.work, ignore_errors=True)
            subprocess.run(["sync"], check=False)
        self.work.mkdir(parents=True)
        if not self.args.keep:
            self.stack.callback(self._remove_work)
        self.R["work_dir"] = str(self.work)
        self.R["machine"]["work_fs"] = fs_type(self.work)

        wheels = self.wheels()
        wheel_bytes = sum(w.stat().st_size for w in wheels)
        self.R["wheels"] = [{"name": w.name, "bytes": w.stat().st_size} for w in wheels]
        log(f"wheelhouse: {len(wheels)} wheels, {wheel_bytes / MB:.0f} MB in {wheels[0].parent}")
        self.wheel_dir = wheels[0].parent

        index = self.stack.enter_context(PackageIndex(self.wheel_dir))
        log(f"index: {index.url} (in this process, unshaped)")

        # -- the reference environment -----------------------------------------------------
        local = Setting(
            "local",
            index.url,
            str(self.work / "store" / "envs"),
            {
                "venv-pack": str(self.work / "store" / "peers" / "env.tar.gz"),
                "tar-zstd": str(self.work / "store" / "peers" / "env.tar.zst"),
            },
            None,
            self.work / "local" / "requirements.txt",
        )
        local.requirements.parent.mkdir(parents=True)
        local.requirements.write_text(self.requirements_text(index.url, wheels))
        self.ref = self.work / "build" / "venv"
        log(f"building the reference environment with `bootseer env create` at {self.ref}")
        t0 = time.perf_counter()
        env = installer_env(self.work / "build" / "cache", base=clean_env())
        out = run_checked(
            [
                *self.bootseer,
                "env",
                "create",
                "--spec",
                str(local.requirements),
                "--prefix",
                str(self.ref),
                "--store",
                local.store,
                "--json",
            ],
            env=env,
            what="bootseer env create",
        )
        created = json.loads(out.stdout)
        local.key = created["key"]
        build_s = time.perf_counter() - t0
        manifest = json.loads(
            run_checked(
                [
                    sys.executable,
                    __file__,
                    "--helper",
                    "manifest",
                    json.dumps({"store": local.store, "key": local.key}),
                ],
                env=clean_env(),
                what="reading the manifest",
            ).stdout
        )
        local.snapshot = manifest
        ref_files, ref_bytes = tree_bytes(self.ref)
        self.R["reference"] = {
            "prefix": str(self.ref),
            "key": local.key,
            "installer": manifest.get("installer"),
            "build_s": build_s,
            "files": ref_files,
            "bytes": ref_bytes,
            "snapshot_files": manifest["files"],
            "snapshot_bytes": manifest["bytes"],
            "snapshot_compressed_bytes": manifest["compressed_bytes"],
            "snapshot_chunks": manifest["chunks"],
        }
        log(
            f"  built in {build_s:.0f} s with {manifest.get('installer')}: {ref_files} files, "
            f"{ref_bytes / MB:.0f} MB; snapshot {manifest['compressed_bytes'] / MB:.1f} MB in "
            f"{manifest['chunks']} chunks; key {local.key}"
        )
        self.check_space(ref_bytes, wheel_bytes)

        # -- the peers' archives of the same tree ------------------------------------------
        peers_dir = self.work / "store" / "peers"
        peers_dir.mkdir(parents=True)
        self.R["archives"] = {}
        if self.venv_pack is None:
            self.errors.append("venv-pack not found: pip install venv-pack")
        else:
            log("packing the same tree with venv-pack (.tar.gz, its default level 4)")
            t0 = time.perf_counter()
            run_checked(
                [
                    self.venv_pack,
                    "-p",
                    str(self.ref),
                    "-o",
                    local.peers["venv-pack"],
                    "--exclude",
                    ".bootseer/*",
                    "-q",
                ],
                env=clean_env(),
                what="venv-pack",
            )
            self.R["archives"]["venv-pack"] = {
                "bytes": os.path.getsize(local.peers["venv-pack"]),
                "pack_s": time.perf_counter() - t0,
                "command": "venv-pack -p PREFIX -o env.tar.gz --exclude '.bootseer/*'",
            }
        log("packing the same tree with tar | zstd -T0 -3")
        t0 = time.perf_counter()
        run_checked(
            [
                "bash",
                "-c",
                'set -o pipefail; tar -C "$1" --exclude=./.bootseer -cf - . '
                '| zstd -T0 -3 -q -o "$2"',
                "bash",
                str(self.ref),
                local.peers["tar-zstd"],
            ],
            env=clean_env(),
            what="tar | zstd",
        )
        self.R["archives"]["tar-zstd"] = {
            "bytes": os.path.getsize(local.peers["tar-zstd"]),
            "pack_s": time.perf_counter() - t0,
            "command": "tar -C PREFIX --exclude=./.bootseer -cf - . | zstd -T0 -3",
        }
        for name, a in self.R["archives"].items():
            log(f"  {name}: {a['bytes'] / MB:.1f} MB in {a['pack_s']:.0f} s")

        if "local" in self.settings_wanted:
            self.setting_objs["local"] = local
        if "shaped" in self.settings_wanted:
            self.setting_objs["shaped"] = self.setup_shaped(index, wheels, local)

        for setting in self.setting_objs.values():
            self.run_setting(setting)
        self.R["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]

    def setup_shaped(self, index: Any, wheels: list[Path], local: Setting) -> Setting:
        from bootseer.testing.servers import MotoS3Server
        from bootseer.testing.shaper import ShaperProcess, ShaperSettings

        log("starting moto S3 (subprocess) and the shaping proxies")
        index_link = ShaperSettings.from_mb(*LINK_MB["index"])
        s3_link = ShaperSettings.from_mb(*LINK_MB["s3"])
        index_proxy = self.stack.enter_context(ShaperProcess("127.0.0.1", index.port, index_link))
        moto = MotoS3Server(in_process=False)
        self.stack.callback(moto.close)
        moto.start()
        moto.create_bucket(BUCKET)
        s3_proxy = self.stack.enter_context(ShaperProcess("127.0.0.1", moto.port, s3_link))
        url = f"http://{index_proxy.address}/simple/"
        shaped = Setting(
            "shaped",
            url,
            S3_STORE,
            {"venv-pack": f"{S3_PEERS}/env.tar.gz", "tar-zstd": f"{S3_PEERS}/env.tar.zst"},
            moto.storage_options(endpoint_url=f"http://{s3_proxy.address}"),
            self.work / "shaped" / "requirements.txt",
        )
        shaped.requirements.parent.mkdir(parents=True)
        shaped.requirements.write_text(self.requirements_text(url, wheels))
        log(
            f"  index {url} behind the shaper ({_describe('index')}); S3 {S3_STORE} on moto "
            f"{moto.endpoint_url} behind the shaper {s3_proxy.address} ({_describe('s3')})"
        )
        # Uploads go straight to moto (set-up, not measured); the key is the shaped spec's.
        log("publishing the reference tree and the peers' archives into S3 (unshaped, set-up)")
        uploads = [
            [local.peers[m], shaped.peers[m]]
            for m in ("venv-pack", "tar-zstd")
            if os.path.exists(local.peers[m])
        ]
        params = {
            "storage_options": moto.storage_options(),
            "uploads": uploads,
            "spec": str(shaped.requirements),
            "store": S3_STORE,
            "prefix": str(self.ref),
            "installer": self.R["reference"].get("installer") or "",
        }
        out = run_checked(
            [sys.executable, __file__, "--helper", "publish-s3", json.dumps(params)],
            env=clean_env(),
            what="publishing into S3",
        )
        info = json.loads(out.stdout.strip().splitlines()[-1])
        shaped.key = info["key"]
        shaped.snapshot = info
        log(f"  snapshot {info['compressed_bytes'] / MB:.1f} MB under key {shaped.key}")
        return shaped

    def _remove_work(self) -> None:
        if self.work.exists():
            log(f"removing {self.work}")
            shutil.rmtree(self.work, ignore_errors=True)

    # -- measuring -------------------------------------------------------------------------
    def steps(self, method: str, s: Setting, run_dir: Path) -> list[dict[str, Any]]:
        from bootseer.testing.pypi import installer_env

        target = run_dir / "venv"
        py = str(target / "bin" / "python")
        base = node_env()
        tools = clean_env()  # bootseer's CLI
        importing = {"name": "import", "argv": [py, "-c", self.import_code], "env": base}
        s3_opts = json.dumps(s.storage_options) if s.storage_options else None

        def fetch_extract(archive: str, tar_flags: str) -> dict[str, Any]:
            if s3_opts is None:  # the store is a directory here: tar reads the file
                script = f'mkdir -p "$1" && tar {tar_flags} "$2" -C "$1"'
                argv = ["bash", "-c", script, "bash", str(target), archive]
            else:  # one s3fs stream into tar's stdin
                script = (
                    f'set -o pipefail; mkdir -p "$1" && "$3" -c "$4" "$2" "$5" '
                    f'| tar {tar_flags} - -C "$1"'
                )
                argv = [
                    "bash",
                    "-c",
                    script,
                    "bash",
                    str(target),
                    archive,
                    self.python,
                    FETCH_CODE,
                    s3_opts,
                ]
            return {"name": "fetch+extract", "argv": argv, "env": base}

        if method == "pip":
            env = installer_env(run_dir / "pip-cache", base=base)
            return [
                {"name": "venv", "argv": [self.base_python, "-m", "venv", str(target)], "env": env},
                {
                    "name": "install",
                    "argv": [
                        str(target / "bin" / "pip"),
                        "install",
                        "--progress-bar",
                        "off",
                        "-r",
                        str(s.requirements),
                    ],
                    "env": env,
                },
                importing,
            ]
        if method == "uv":
            if self.uv is None:
                raise RuntimeError("uv not found")
            env = installer_env(run_dir / "uv-cache", base=base)
            return [
                {
                    "name": "venv",
                    "argv": [self.uv, "venv", "--quiet", str(target), "--python", self.base_python],
                    "env": env,
                },
                {
                    "name": "install",
                    "argv": [self.uv, "pip", "install", "--python", py, "-r", str(s.requirements)],
                    "env": env,
                },
                {**importing, "name": "first import"},
            ]
        if method == "venv-pack":
            # venv-pack's documented unpack: extract, then `source bin/activate` (its activate
            # script finds the prefix from its own location; there is no conda-unpack).
            return [
                fetch_extract(s.peers["venv-pack"], "-xzf"),
                {
                    "name": "activate+import",
                    "argv": [
                        "bash",
                        "-c",
                        '. "$1/bin/activate" && exec python -c "$2"',
                        "bash",
                        str(target),
                        self.import_code,
                    ],
                    "env": base,
                },
            ]
        if method == "tar-zstd":
            return [fetch_extract(s.peers["tar-zstd"], "-I 'zstd -T0' -xf"), importing]
        if method == "bootseer":
            argv = [
                *self.bootseer,
                "env",
                "restore",
                s.key,
                "--prefix",
                str(target),
                "--store",
                s.store,
            ]
            if s3_opts is not None:
                argv += ["--storage-options", json.dumps({"s3": s.storage_options})]
            return [{"name": "restore", "argv": argv, "env": tools}, importing]
        if method == "cp":
            return [
                {"name": "cp -a", "argv": ["cp", "-a", str(self.ref), str(target)], "env": base},
                importing,
            ]
        if method == "floor":
            # What no restore can beat on this machine: writing the tree's bytes into fresh
            # page cache (one file, no per-file cost), then an import whose files are cached.
            ref_py = str(self.ref / "bin" / "python")
            count = -(-int(self.R["reference"]["bytes"]) // (8 * MiB))
            return [
                {
                    "name": "warm the import",
                    "argv": [ref_py, "-c", self.import_code],
                    "env": base,
                    "untimed": True,
                },
                {
                    "name": "page-cache write",
                    "argv": [
                        "dd",
                        "if=/dev/zero",
                        f"of={run_dir / 'floor.bin'}",
                        "bs=8M",
                        f"count={count}",
                        "status=none",
                    ],
                    "env": base,
                },
                {"name": "import (warm)", "argv": [ref_py, "-c", self.import_code], "env": base},
            ]
        if method == "import":
            return [
                {
                    "name": "import",
                    "argv": [str(self.ref / "bin" / "python"), "-c", self.import_code],
                    "env": base,
                }
            ]
        raise ValueError(method)

    def measure(self, s: Setting, method: str, rnd: int) -> dict[str, Any]:
        run_dir = self.work / s.name / f"{method}-r{rnd}"
        run_dir.mkdir(parents=True)
        logs = self.work / "logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"{s.name}-{method}-r{rnd}.log"
        spec = {
            "steps": self.steps(method, s, run_dir),
            "log": str(log_path),
            "result": str(run_dir / "result.json"),
            "timeout": STEP_TIMEOUT_S,
        }
        spec_path = run_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        load = os.getloadavg()[0]
        proc = subprocess.Popen(
            [sys.executable, __file__, "--measure-child", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=clean_env(),
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if proc.stdout.readline().strip() != b"READY":
                raise RuntimeError(f"measuring child did not start (exit {proc.wait()})")
            if self.cold and not drop_caches():
                self.cold = False
                self.warn(
                    "could not write /proc/sys/vm/drop_caches: the remaining methods run WARM"
                )
            if s.name == "shaped":
                # The index is another machine: its files are in its memory, not cold on ours.
                for wheel in self.wheel_dir.glob("*.whl"):
                    with open(wheel, "rb") as f:
                        while f.read(16 * MiB):
                            pass
            proc.stdin.write(b"GO\n")
            proc.stdin.flush()
            proc.stdin.close()
            proc.stdout.read()
            rc = proc.wait()
        except BaseException:
            kill_group(proc)
            raise
        result_path = Path(spec["result"])
        if not result_path.exists():
            raise RuntimeError(f"measuring child exited {rc} without a result")
        result = json.loads(result_path.read_text())
        result.update(
            cold=self.cold,
            loadavg_1m_before=round(load, 2),
            log=str(log_path),
            target=str(run_dir / "venv"),
        )
        if result.get("error"):
            with contextlib.suppress(OSError):
                result["log_tail"] = log_path.read_text(errors="replace")[-3000:]
        return result

    def run_setting(self, s: Setting) -> None:
        methods = [m for m in METHODS if m not in self.skip]
        if s.name == "local":
            methods += [m for m in INFO_METHODS if m not in self.skip]
        R = self.R["settings"][s.name] = {
            "index_url": s.index_url,
            "store": s.store,
            "key": s.key,
            "peers": s.peers,
            "requirements": s.requirements.read_text(),
            "link": None
            if s.name == "local"
            else {"index": _describe("index"), "s3": _describe("s3")},
            "runs": {m: [] for m in methods},
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        }
        log(
            f"== setting {s.name}: index {s.index_url}, store {s.store}"
            + (
                ""
                if s.name == "local"
                else f"; links: index {_describe('index')}, S3 {_describe('s3')}"
            )
        )
        for rnd in range(self.repeat):
            for method in methods:
                what = f"{s.name} r{rnd + 1}/{self.repeat}: {LABELS[method]}"
                log(f"{what} ...")
                try:
                    result = self.measure(s, method, rnd)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                    result = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc(file=sys.stdout)
                R["runs"][method].append(result)
                if result.get("error"):
                    self.errors.append(f"{s.name}.{method} r{rnd + 1}: {result['error']}")
                    log(f"  ERROR {result['error']}")
                    if result.get("log_tail"):
                        print(result["log_tail"][-1500:], flush=True)
                else:
                    split = " + ".join(
                        f"{st['name']} {st['seconds']:.2f}" for st in result["steps"]
                    )
                    log(f"  {result['total']:.2f} s ({split}){'' if result['cold'] else ' WARM'}")
            if self.clean_between_rounds and rnd + 1 < self.repeat:
                log(f"deleting round {rnd + 1}'s trees, sync, {SETTLE_AFTER_DELETE_S} s pause")
                for method in methods:
                    shutil.rmtree(self.work / s.name / f"{method}-r{rnd}", ignore_errors=True)
                subprocess.run(["sync"], check=False)
                time.sleep(SETTLE_AFTER_DELETE_S)
        R["verify"] = self.verify(s) if "bootseer" in methods else None
        R["sizes"] = {
            "bootseer": s.snapshot.get("compressed_bytes"),
            **{k: v["bytes"] for k, v in self.R["archives"].items()},
        }
        R["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]

    def verify(self, s: Setting) -> dict[str, Any]:
        """``bootseer env ensure`` on the prefix bootseer just restored, warm: whole command."""
        runs = [r for r in self.R["settings"][s.name]["runs"]["bootseer"] if not r.get("error")]
        if not runs:
            return {"error": "no successful restore to verify"}
        target = runs[-1]["target"]
        argv = [
            *self.bootseer,
            "env",
            "ensure",
            "--spec",
            str(s.requirements),
            "--prefix",
            target,
            "--store",
            s.store,
            "--json",
        ]
        if s.storage_options:
            argv += ["--storage-options", json.dumps({"s3": s.storage_options})]
        log(
            f"{s.name}: warm verification, `bootseer env ensure` on {target} "
            f"(1 warm-up + {VERIFY_RUNS} timed runs)"
        )
        times, outcomes, failures = [], [], []
        for i in range(VERIFY_RUNS + 1):
            t0 = time.perf_counter()
            proc = subprocess.run(
                argv, env=clean_env(), capture_output=True, text=True, timeout=600, check=False
            )
            seconds = time.perf_counter() - t0
            outcome = "no JSON"
            with contextlib.suppress(ValueError, KeyError, TypeError):
                outcome = json.loads(proc.stdout)["outcome"]
            if proc.returncode != 0:
                outcome = f"exit {proc.returncode}"
            if outcome != "verified":
                failures.append(f"run {i}: {outcome}: {proc.stderr.strip()[-1000:]}")
            if i:
                times.append(seconds)
                outcomes.append(outcome)
        result = {
            "runs_s": times,
            "median_s": statistics.median(times),
            "outcomes": outcomes,
            "command": " ".join(["bootseer", *argv[3:]]),
            "failures": failures,
        }
        ok = all(o == "verified" for o in outcomes)
        if not ok:
            result["error"] = f"outcomes {outcomes} (want verified)"
            self.errors.append(f"{s.name}.verify: {result['error']}")
        for failure in failures:
            log(f"  {failure}")
        log(
            f"  {result['median_s']:.2f} s median ({', '.join(f'{t:.2f}' for t in times)}); "
            f"outcomes {sorted(set(outcomes))}"
        )
        return result

    # -- report ------------------------------------------------------------------------------
    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any] | None:
        ok = [r for r in runs if not r.get("error")]
        if not ok or len(ok) != len(runs):
            return None
        names = [st["name"] for st in ok[0]["steps"]]
        return {
            "total": statistics.median(r["total"] for r in ok),
            "split": [
                (n, statistics.median(r["steps"][i]["seconds"] for r in ok))
                for i, n in enumerate(names)
            ],
            "runs": [r["total"] for r in ok],
        }

    def setting_rows(self, name: str) -> list[list[str]]:
        R = self.R["settings"][name]
        runs = R["runs"]
        sums = {m: self.summary(rs) for m, rs in runs.items()}
        ours = sums.get("bootseer")
        rows: list[list[str]] = []

        def total_text(m: str) -> str:
            s = sums.get(m)
            if s is None:
                return "error" if runs.get(m) else "skipped"
            text = f"{s['total']:.2f} s"
            if len(s["runs"]) > 1:
                text += f" (median of {', '.join(f'{x:.2f}' for x in s['runs'])})"
            return text

        def split_text(m: str) -> str:
            s = sums.get(m)
            return "" if s is None else " + ".join(f"{n} {x:.2f}" for n, x in s["split"])

        for m in METHODS:
            if m not in runs:
                continue
            if m == "bootseer":
                rows.append([LABELS[m], total_text(m), split_text(m), "(reference)", "", ""])
                continue
            peer = sums.get(m)
            ratio = peer["total"] / ours["total"] if peer and ours else None
            target = TARGETS[m]
            verdict = "n/a" if ratio is None else ("PASS" if ratio >= target else "MISS")
            if runs.get(m) and peer is None or runs.get("bootseer") and ours is None:
                verdict = "ERROR"
            rows.append(
                [
                    LABELS[m],
                    total_text(m),
                    split_text(m),
                    "n/a" if ratio is None else f"{ratio:.1f}x",
                    f">= {target:g}x faster than {m}",
                    verdict,
                ]
            )
        v = R.get("verify")
        if v is not None:
            if "median_s" in v:
                rows.append(
                    [
                        "warm verification: bootseer env ensure (whole CLI)",
                        f"{v['median_s']:.2f} s",
                        f"median of {', '.join(f'{t:.2f}' for t in v['runs_s'])}; outcome "
                        f"{'/'.join(sorted(set(v['outcomes'])))}",
                        "",
                        f"<= {VERIFY_LIMIT_S:g} s",
                        "ERROR"
                        if v.get("error")
                        else ("PASS" if v["median_s"] <= VERIFY_LIMIT_S else "MISS"),
                    ]
                )
            else:
                rows.append(
                    [
                        "warm verification",
                        "error",
                        v.get("error", ""),
                        "",
                        f"<= {VERIFY_LIMIT_S:g} s",
                        "ERROR",
                    ]
                )
        sizes = R["sizes"]
        snap, vp, tz = sizes.get("bootseer"), sizes.get("venv-pack"), sizes.get("tar-zstd")
        if snap:
            peers = "; ".join(
                f"{label} {b / MB:.1f} MB"
                for label, b in (("venv-pack .tar.gz", vp), (".tar.zst", tz))
                if b
            )
            rel = f"{snap / vp:.2f}x of venv-pack" if vp else "n/a"
            rows.append(
                [
                    "snapshot size (chunks + TOC)",
                    f"{snap / MB:.1f} MB",
                    peers,
                    rel,
                    "<= venv-pack .tar.gz",
                    "n/a" if not vp else ("PASS" if snap <= vp else "MISS"),
                ]
            )
        for m in INFO_METHODS:
            if m in runs:
                s = sums.get(m)
                ratio = f"{s['total'] / ours['total']:.1f}x" if s and ours else "n/a"
                rows.append([LABELS[m], total_text(m), split_text(m), ratio, "", "info"])
        return rows

    def report(self) -> None:
        head = [
            "method",
            "total to working import",
            "split (s)",
            "peer / bootseer",
            "target",
            "result",
        ]
        tables: dict[str, list[str]] = {}
        for name in self.R["settings"]:
            rows = self.setting_rows(name)
            tables[name] = md_table(head, rows)
            self.R["settings"][name]["table"] = [dict(zip(head, r, strict=True)) for r in rows]
        print("")
        m = self.R["machine"]
        log(
            f"== results ({'cold node: page cache dropped before each method' if self.cold else 'WARM: page cache NOT dropped'}; "
            f"{m['cpus']} CPUs, {m['ram_bytes'] / 2**30:.1f} GiB RAM, {m.get('work_fs')} at {self.work})"
        )
        ref = self.R.get("reference", {})
        if ref:
            print(
                f"environment: {ref['files']} files, {ref['bytes'] / MB:.0f} MB installed "
                f"({'numpy only: --quick' if self.quick else 'torch 2.13.0 CPU + numpy + deps'}), "
                f"built with {ref.get('installer')}"
            )
        for name, table in tables.items():
            S = self.R["settings"][name]
            print("")
            print(
                f"setting {name}: "
                + (
                    "index and store local, unshaped"
                    if name == "local"
                    else f"index behind the shaper ({_describe('index')}); S3 "
                    f"(moto) behind the shaper ({_describe('s3')})"
                )
            )
            for line in table:
                print(line)
            print(
                f"load average at start/end of the setting: {S['loadavg_at_start'][0]:.2f} / "
                f"{S['loadavg_at_end'][0]:.2f}"
            )
        self.R["load_end"] = [round(x, 2) for x in os.getloadavg()]
        print("")
        print(
            f"load average: before the run {self.R['loadavg_at_start'][0]:.2f}, after "
            f"{self.R['load_end'][0]:.2f}"
        )
        if self.quick:
            self.R["warnings"].append(
                "--quick: numpy only (no torch); a smoke run, not the figures"
            )
        for w in self.R["warnings"]:
            print(f"WARNING: {w}")
        for e in self.errors:
            print(f"ERROR: {e}")
        sys.stdout.flush()
        self.write_files(tables)

    def write_files(self, tables: dict[str, list[str]] | None = None) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        self.R["elapsed_s"] = time.monotonic() - _T0
        (self.results_dir / "snapshot.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )
        if tables is None:
            log(f"wrote {self.results_dir / 'snapshot.json'} (partial)")
            return
        m, ref = self.R["machine"], self.R.get("reference", {})
        md = [
            f"# snapshot benchmark ({'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run)",
            "",
            f"- command: `{self.R['command']}` (run time {self.R['elapsed_s']:.0f} s, "
            f"{self.R['finished']})",
            f"- machine: {m['cpus']} CPUs, {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
            f"{m['platform']}, Python {m['python']}, {m['uv']}, "
            f"{m['venv_pack']}, pip {m.get('pip_in_new_venv', '?')} (in new venvs), "
            f"{m['zstd']}, {m['tar']}; work dir on {m.get('work_fs')}",
            f"- source: commit {self.R['source'].get('commit', '?')[:12]}"
            + (
                f", local changes in {', '.join(self.R['source']['local_changes'])}"
                if self.R["source"].get("local_changes")
                else ""
            ),
            f"- load average: {self.R['loadavg_at_start'][0]:.2f} at start, "
            f"{self.R.get('load_end', ['?'])[0]} at end",
            f"- {'cold node: `sync; echo 3 > /proc/sys/vm/drop_caches` before each method' if self.cold else 'WARM: --smoke keeps the page cache' if self.smoke else 'WARM: the page cache could not be dropped'}",
            f"- environment: `{self.import_code}`; {ref.get('files', '?')} files, "
            f"{ref.get('bytes', 0) / MB:.0f} MB installed, built with `bootseer env create` "
            f"({ref.get('installer')}); wheels {sum(w['bytes'] for w in self.R.get('wheels', [])) / MB:.0f} MB",
            f"- links (shaped setting): index {_describe('index')}; S3 {_describe('s3')}",
        ]
        for name, table in tables.items():
            md += ["", f"## {name}", "", *table]
        if self.R["warnings"]:
            md += ["", *[f"- WARNING: {w}" for w in self.R["warnings"]]]
        if self.errors:
            md += ["", *[f"- ERROR: {e}" for e in self.errors]]
        (self.results_dir / "snapshot.md").write_text("\n".join(md) + "\n")
        log(f"wrote {self.results_dir / 'snapshot.json'} and {self.results_dir / 'snapshot.md'}")


def _describe(link: str) -> str:
    lat, per, tot = LINK_MB[link]
    return f"latency {lat:.1f} ms, {per:g} MB/s per connection, {tot:g} MB/s total"


# C extensions the measured tools load (bootseer's CLI, s3fs, numpy). A process that has them
# mapped keeps their pages in the page cache through drop_caches, which would warm the cold
# start of the very commands measured: `bootseer bench` (which imports bootseer's CLI) runs
# this script in a fresh interpreter instead.
_MAPPED_BY_TOOLS = (
    "aiohttp",
    "yarl",
    "multidict",
    "frozenlist",
    "propcache",
    "zstandard",
    "s3fs",
    "numpy",
    "torch",
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure-child"]:
        return child_main(argv[1])
    if argv[:1] == ["--helper"]:
        return helper_main(argv[1], argv[2])
    if any(name in sys.modules for name in _MAPPED_BY_TOOLS):
        return reexec(__file__, argv)
    parser = argparse.ArgumentParser(prog="bench_snapshot.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--results", default="bench-results", help="directory for snapshot.json/.md"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="numpy only (no torch), local setting unless --settings says otherwise",
    )
    parser.add_argument(
        "--settings", help="comma list of local, shaped (default both; --quick: local)"
    )
    parser.add_argument("--skip", help=f"comma list of methods to skip ({', '.join(ALL_METHODS)})")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each method per setting, interleaved; the median is reported",
    )
    parser.add_argument(
        "--cache",
        help="wheel cache and work dir (default ~/.cache/bootseer-bench, env BOOTSEER_BENCH_CACHE)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep CACHE/snapshot-run (trees, stores, logs) for inspection",
    )
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    bench = Bench(args)
    code = run_bench(bench, done_key="finished")
    log(f"done in {time.monotonic() - _T0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
