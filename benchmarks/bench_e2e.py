"""End-to-end benchmark: a training job restarted after a rank is killed, time to the first step.

The job (``e2e_train.py``): a transformer-shaped model in FSDP2 over gloo, world size 2 (two
ranks under ``torchrun`` in one container: one node), 1.15 GB of state (0.25 GB with
``--quick``), checkpoints saved asynchronously to S3. It runs in a container that containerd
(``ctr run``, runc) starts from the training image (``e2e_image.py``: Debian + python3.11 +
the entrypoint's code; torch is the job's environment, not the image).

Everything remote sits behind the shaping proxy (1 ms, 10 MB/s per connection, 160 MB/s in
all; S3 100 MB/s in all): the registry, the package index (the torch CPU wheel and its
dependencies) and the S3 server (moto) holding checkpoints and environment snapshots.

Each method first runs the job cold on a fresh node (its own containerd): it trains, saves,
and once a checkpoint is committed and training has gone past it, rank 1 gets SIGKILL. Then
the measured restart, on a fresh node (empty image store, empty caches, page cache dropped):

* ``baseline``: ``ctr images pull`` (gzip, containerd's overlayfs snapshotter), ``ctr run``;
  in the container ``pip install -r requirements.txt`` (torch from the index), ``torchrun``,
  ``torch.distributed.checkpoint.load`` over s3fs (FsspecReader);
* ``bootseer``: ``bootseer image pull`` of the converted image through the bootseer
  snapshotter (the hot-block profile recorded by the first start prefetched), ``ctr run``;
  in the container ``bootseer run``: the environment restored from its snapshot while the
  checkpoint's shards for ranks 0-1 are prefetched into the node-local cache (striped reads),
  then ``torchrun``; ``CheckpointManager.load`` reads the cache;
* ``bootseer-lazy``: the same with ``env.lazy = true``: the environment's snapshot mounted at
  its prefix (FUSE inside the container: ``/dev/fuse`` and ``CAP_SYS_ADMIN``, libfuse2 in the
  runtime layer) and its chunks fetched as the job reads them, the rest behind;
* ``diy``: the strongest do-it-yourself restart (``e2e_diy.py``): the job's dependencies baked
  into the image (a third gzip layer), ``ctr images pull`` + ``ctr run`` as in the baseline;
  from the restart on, ``rclone copy`` (many streams) copies the newest DCP checkpoint from S3
  to the node's disk while the image is pulled and the container starts; each rank waits for
  the copy, then ``torch.distributed.checkpoint.load`` with ``FileSystemReader``;
* ``diy-warm``: the same with the image already on the node (pulled before the clock starts);
* ``bootseer-warm``: bootseer's restart on a fresh node that ``bootseer warmup`` filled before
  the clock starts (diy-warm's like-for-like peer): the lazy image pulled and written out on
  the node (``bootseer image pull --local``), then ``bootseer warmup`` in a container of the image
  restores the environment into the node's directory and caches the newest checkpoint's
  shards; the page cache is dropped, then the clock starts with ``ctr run``;
* info, ``bootseer in place``: the supervisor's own restart on the node of the first start
  (environment verified, the checkpoint its ranks saved found in the node cache, image
  blocks cached), from the kill; its all-local floor is the same restart less the
  environment, the prefetch and the load's wait for it.

``diy`` and ``diy-warm`` share one first start (the job saves with DCP to S3, as the baseline).
The clock runs from the restart (the pull; for ``in place`` the SIGKILL) to the first finished
training step of the slower rank, minus the state digest each rank takes right after loading
(it proves the resumed state bit-identical to the saved one and is not part of a start).
Phases come from the job's milestones (and ``bootseer run``'s trace), on the same wall clock.

Target (reported, never asserted): bootseer's restart takes >= 70% less time than the baseline.

``python benchmarks/bench_e2e.py --results DIR [--quick] [--keep] [--methods ...]`` or
``bootseer bench e2e``;
root, containerd, runc, FUSE and docker-registry needed. Writes ``DIR/e2e.json``,
``DIR/e2e.md`` and ``DIR/e2e.png``. ``--nodes N``: the scenario on N nodes of a cluster
(``bench_e2e_nodes.py``); ``--sweep 2,4,8``: that for each N, and what the startup model needs
(``bench_e2e_sweep.py``).
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
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefetch as bp  # noqa: E402
import e2e_cache  # noqa: E402
import e2e_diy  # noqa: E402
import e2e_image  # noqa: E402
from _common import (
    command_line,
    download_wheels,
    drop_caches,
    log,
    md_table,
    mem_total,
    run_bench,  # noqa: E402
)
from bench_containerd import NAMESPACE, Node  # noqa: E402
from e2e_train import dcp_latest  # noqa: E402

from striped_fs.redact import redact_argv  # noqa: E402

SUITE = "e2e"
TARGET_REDUCTION = 0.70
TORCH = "torch==2.13.0"
LINKS = {"registry": (1.0, 10.0, 160.0), "index": (1.0, 10.0, 160.0), "s3": (1.0, 10.0, 100.0)}
BUCKETS = ("ckpt", "envs")
STEP_TIMEOUT_S = 1200.0
# gzip level by --quick: a quick run's image is built afresh in every CI run (e2e_image's
# layer_from_tree); the multi-node scenario uses the same, so its layers are the one-node's
LEVEL = {True: 1, False: 6}
PHASES = [  # (key, label, colour) in critical-path order
    ("image", "image pull", "#4e79a7"),
    ("container", "container start / restart", "#a0cbe8"),
    ("environment", "environment (pip / snapshot)", "#f28e2b"),
    ("prefetch", "checkpoint prefetch / copy (not overlapped)", "#ffbe7d"),
    ("launch", "torchrun, import torch, init, model", "#59a14f"),
    ("load", "checkpoint load", "#e15759"),
    ("step", "first training step", "#b07aa1"),
]
LABELS = {
    "baseline": "baseline: full pull + pip install + DCP load over s3fs",
    "diy": "diy: deps baked in the image, full pull + rclone copy + DCP load from disk",
    "diy-warm": "diy-warm: the same, image already on the node",
    "bootseer": "bootseer: lazy image + env snapshot + ckpt prefetch",
    "bootseer-lazy": "bootseer-lazy: the same, the environment mounted lazily (env.lazy)",
    "bootseer-warm": "bootseer-warm: the same on a node filled by `bootseer warmup`",
    "bootseer-baked": "bootseer-baked: deps baked in, lazy image with its profile + ckpt prefetch",
    "inplace": "bootseer in place: supervisor restart on the same node (info)",
}
# --methods, in the order they run: the slowest last, so a run cut short keeps the others
METHODS = (
    "diy",
    "diy-warm",
    "bootseer",
    "bootseer-lazy",
    "bootseer-warm",
    "bootseer-baked",
    "baseline",
)
ORDER = (
    "baseline",
    "diy",
    "diy-warm",
    "bootseer",
    "bootseer-lazy",
    "bootseer-warm",
    "bootseer-baked",
    "inplace",
)  # the rows
DIY = ("diy", "diy-warm")
BAKED = ("bootseer-baked",)  # the diy image (torch baked in) converted: no environment phase
BOOTSEER = ("bootseer", "bootseer-lazy", "bootseer-warm", "bootseer-baked")
LAZY_ENV = ("bootseer-lazy",)  # env.lazy: the container may mount FUSE (/dev/fuse, SYS_ADMIN)
ENV_ROOT = "/opt/bootseer-env"  # bootseer-warm: the node's environment directory, mounted
RCLONE = e2e_diy.RcloneTuning()


def family(method: str) -> str:
    """The method whose first start (and checkpoint prefix) ``method`` uses."""
    if method in BAKED:
        return method
    return "diy" if method in DIY else "bootseer" if method in BOOTSEER else method


def ckpt_root(method: str) -> str:
    """bucket/prefix of ``method``'s checkpoints."""
    return {"baseline": "ckpt/dcp", "diy": "ckpt/diy", "bootseer-baked": "ckpt/baked"}.get(
        family(method), "ckpt/bootseer"
    )


def phases_of(
    method: str, ev: list[dict[str, Any]], t0: float, pulled: float | None, spans: list[Any]
) -> tuple[dict[str, float], float, dict[str, Any]]:
    """(phases, first step's time, detail) of one restart from its milestones ``ev`` (one
    attempt) and, for bootseer, ``bootseer run``'s trace ``spans``; every phase ends where the
    next begins, so they add up to the total."""

    def last(name: str) -> dict[str, Any]:
        found = [e for e in ev if e["event"] == name]
        if not found:
            raise RuntimeError(f"{method}: no '{name}' milestone")
        return max(found, key=lambda e: e["t"])

    waited = 0.0
    if method in ("baseline", *DIY):
        entry, env_end = last("entry")["t"], last("env_ready")["t"]
        cmd = last("command_start")["t"]
        detail: dict[str, Any] = {
            "environment": {"installer": last("env_ready")["installer"], "seconds": env_end - entry}
        }
        if method in DIY:  # the job's wait for the copy: from the last rank ready to load
            ready = max(e["t"] - e["waited"] for e in ev if e["event"] == "copy_ready")
            waited = max(0.0, last("load_start")["t"] - max(ready, cmd))
    else:
        phase = {s.phase: s for s in spans if s.rank is None}
        entry = min(phase[p].start for p in ("environment", "checkpoint_prefetch"))
        env_end = phase["environment"].end
        cmd = phase["command_start"].end
        pre = phase["checkpoint_prefetch"]
        detail = {
            "environment": {
                "outcome": phase["environment"].detail.get("outcome"),
                "seconds": phase["environment"].seconds,
                "bytes": phase["environment"].bytes,
            },
            "checkpoint_prefetch": {
                "seconds": pre.seconds,
                "bytes": pre.bytes,
                "step": pre.detail.get("step"),
            },
        }
    verify = max(e["seconds"] for e in ev if e["event"] == "verified")
    load_start, load_end = last("load_start")["t"], last("load_end")["t"]
    first = last("first_step")["t"] - verify
    start = pulled if pulled is not None else t0
    phases = {
        "image": (pulled - t0) if pulled is not None else 0.0,
        "container": entry - start,
        "environment": min(env_end, cmd) - entry,
        "prefetch": cmd - min(env_end, cmd) + waited,
        "launch": load_start - cmd - waited,
        "load": load_end - load_start,
        "step": first - load_end,
    }
    return phases, first, detail


def container_id(node: Node) -> str:
    """The job's container on ``node``: unique to this node's directory, because runc keeps
    every containerd's containers of one namespace under one state directory
    (/run/containerd/runc/<namespace>) and benchmarks may run side by side."""
    return f"job-{node.dir.name}-{hashlib.sha256(str(node.dir).encode()).hexdigest()[:8]}"


def log_tail(path: Path, lines: int = 40) -> str:
    """The end of a job's log, for errors that a CI run shows without the file; a rank's own
    exception comes first (torchrun's summary, at the end, does not name it)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(unreadable: {exc})"
    raised = [
        ln
        for ln in text  # torchrun prefixes a rank's lines with "[rankN]:"
        if re.match(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b: ", ln)
    ]
    head = ["exceptions raised in the job:", *raised[-10:], "..."] if raised else []
    return "\n".join(head + text[-lines:])


def compare(runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """bootseer's restart against each other fresh-node restart that ran: speedup and the
    share of start-up time it removes (negative: bootseer was slower)."""
    pairs = [("bootseer", m) for m in ("baseline", "diy", "diy-warm")]
    pairs.append(("bootseer-warm", "diy-warm"))  # the like-for-like pair
    pairs += [("bootseer-lazy", "bootseer"), ("bootseer-lazy", "diy-warm")]
    pairs += [("bootseer-baked", "diy"), ("bootseer-baked", "bootseer")]  # same image / job
    return {
        m if ours == "bootseer" else f"{ours} vs {m}": {
            "speedup": runs[m]["total"] / runs[ours]["total"],
            "less": 1 - runs[ours]["total"] / runs[m]["total"],
        }
        for ours, m in pairs
        if ours in runs and m in runs
    }


def all_local_floor(run: dict[str, Any]) -> float:
    """An in-place restart with nothing to fetch: its own phases less the environment, the
    prefetch and the load's wait for the prefetch (what a restart with everything already on
    the node's disk pays: the container's restart, the launch, the load, the first step)."""
    ph = run["phases"]
    return ph["container"] + ph["launch"] + ph["load"] + ph["step"] - run.get("load_wait_s", 0.0)


def deps_layer(work: Path, image_dir: Path, wheel_dir: Path) -> dict[str, Any]:
    """The diy image's third layer (torch and its dependencies installed), built once per
    set of wheels (``work`` holds the tree while it is packed): the tree is large, so its
    layer is cached by what goes into it. Shared by the one-node and the multi-node scenario."""
    key = hashlib.sha256(
        json.dumps(
            [TORCH, platform.python_version(), sorted(p.name for p in wheel_dir.glob("*.whl"))]
        ).encode()
    ).hexdigest()[:16]
    ref = image_dir / "e2e" / f"deps-for-{key}.json"
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads(ref.read_text())
        if e2e_cache.layer_intact(meta):
            return meta
    tree = work / "deps-tree"
    log(f"baking {TORCH} into a layer (once per set of wheels)")
    e2e_image.build_deps_tree(tree, wheel_dir, [TORCH])
    meta = e2e_image.layer_from_tree(tree, image_dir / "e2e", "deps")
    shutil.rmtree(tree)
    ref.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = bool(args.quick)
        self.methods = [m for m in METHODS if m in args.methods.split(",")]
        self.size = "quick" if self.quick else "full"
        self.cache = (
            Path(
                args.cache
                or os.environ.get("BOOTSEER_BENCH_CACHE")
                or Path.home() / ".cache" / "bootseer-bench"
            )
            .expanduser()
            .resolve()
        )
        self.work = self.cache / "e2e-run"
        self.results_dir = Path(args.results).resolve()
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.nodes: list[Node] = []
        self.cold = True
        self.run_id = uuid.uuid4().hex[:8]  # in the jobs' tags: concurrent runs never meet
        self.R: dict[str, Any] = {
            "suite": SUITE,
            "quick": self.quick,
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": command_line("bench_e2e.py"),
            "machine": {
                "cpus": os.cpu_count(),
                "ram_bytes": mem_total(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "containerd": bp.version_of(["containerd", "--version"]),
            },
            "links": {
                k: {"latency_ms": v[0], "per_conn_mb_s": v[1], "total_mb_s": v[2]}
                for k, v in LINKS.items()
            },
            "target": {"reduction_min": TARGET_REDUCTION},
            "runs": {},
            "warnings": [],
            "errors": self.errors,
        }

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("needs root: containerd, runc, FUSE mounts and drop_caches")
        for tool in (
            "containerd",
            "ctr",
            "runc",
            "containerd-shim-runc-v2",
            "fusermount",
            "tar",
            "gzip",
        ):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed (see .ci/run for the packages)")
        from bootseer.testing.pypi import PackageIndex
        from bootseer.testing.registry import RegistryServer
        from bootseer.testing.servers import MotoS3Server
        from bootseer.testing.shaper import ShaperProcess, ShaperSettings

        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.stack.callback(self.cleanup)
        image_dir = self.cache / "image"
        image_dir.mkdir(parents=True, exist_ok=True)
        self.R["image"] = e2e_image.training_layers(
            self.cache,
            self.work,
            self.args.base or ("host" if self.quick else "auto"),
            LEVEL[self.quick],
        )
        base, layers = self.R["image"]["base"], self.R["image"]["layers"]
        log(f"image base: {base['source']}, python {base.get('python')}")
        log(
            "image layers: "
            + ", ".join(
                f"{la['name']} {la['tar_bytes'] / 1e6:.0f} MB tar, {la['size'] / 1e6:.0f} MB gzip"
                + (" (kept)" if la.get("reused") else "")
                for la in layers
            )
        )
        wheels = download_wheels(self.cache / "wheels-e2e", [TORCH])
        diy_layers = None
        if set(self.methods) & {*DIY, *BAKED}:
            diy_layers = [*layers, deps_layer(self.work, image_dir, wheels[0].parent)]
            self.R["image"]["diy_layers"] = diy_layers

        def shaped(port: int, link: str) -> str:
            proxy = self.stack.enter_context(
                ShaperProcess("127.0.0.1", port, ShaperSettings.from_mb(*LINKS[link]))
            )
            return proxy.address

        self.registry = RegistryServer(self.work / "registry").start()
        self.stack.callback(self.registry.close)
        registry_addr = shaped(self.registry.port, "registry")
        repo = f"e2e/train-{self.size}"
        digest = e2e_image.push_image(
            self.registry.host, repo, "gzip", layers, e2e_image.image_config(layers)
        )
        self.gzip_ref = f"{registry_addr}/{repo}:gzip"
        log(f"pushed {self.gzip_ref} ({digest[:19]})")
        self.gzip_blobs = [self.registry.blob_path(la["digest"]) for la in layers]
        if set(self.methods) & {
            "bootseer",
            "bootseer-lazy",
            "bootseer-warm",
        }:  # the converted image
            conv = self.convert(f"{repo}:gzip", f"{repo}:lazy")
            self.R["conversion"] = conv
            self.lazy_ref = f"{registry_addr}/{repo}:lazy"
            self.lazy_blobs = [self.registry.blob_path(d) for d in conv["layer_digests"]]
        if diy_layers:
            e2e_image.push_image(
                self.registry.host, repo, "diy", diy_layers, e2e_image.image_config(diy_layers)
            )
            self.diy_ref = f"{registry_addr}/{repo}:diy"
            self.diy_blobs = [self.registry.blob_path(la["digest"]) for la in diy_layers]
            log(
                f"pushed {self.diy_ref} (the dependencies baked in: "
                f"{diy_layers[-1]['size'] / 1e6:.0f} MB gzip more)"
            )
        if set(self.methods) & set(BAKED):  # the diy image in bootseer's layer format
            conv = self.convert(f"{repo}:diy", f"{repo}:baked-lazy")
            self.R["conversion_baked"] = conv
            self.baked_ref = f"{registry_addr}/{repo}:baked-lazy"
            self.baked_blobs = [self.registry.blob_path(d) for d in conv["layer_digests"]]
        self.index = self.stack.enter_context(PackageIndex(wheels[0].parent))
        index_addr = shaped(self.index.port, "index")
        self.moto = MotoS3Server(in_process=False)
        self.stack.callback(self.moto.close)
        self.moto.start()
        for bucket in BUCKETS:
            self.moto.create_bucket(bucket)
        s3_addr = shaped(self.moto.port, "s3")
        self.s3_options = {"s3": self.moto.storage_options(endpoint_url=f"http://{s3_addr}")}
        self.rclone_env = e2e_diy.rclone_env(self.s3_options["s3"])
        self.direct_options = {"s3": self.moto.storage_options()}  # the harness's own checks

        self.job = self.work / "job"
        self.job.mkdir()
        (self.job / "requirements.txt").write_text(
            f"--index-url http://{index_addr}/simple/\n{TORCH}\n"
        )
        (self.job / "bootseer.toml").write_text(
            '[run]\ntrace_dir = "/var/log/bootseer/trace"\n\n'
            "[restart]\nmax_restarts = 2\nbackoff_s = 1.0\n\n"
            '[env]\nspec = ["/job/requirements.txt"]\nprefix = "/opt/env"\n'
            'store = "s3://envs/e2e"\n\n'
            '[ckpt]\nurl = "s3://ckpt/bootseer"\ncache_dir = "/var/cache/bootseer/ckpt"\n'
            'ranks = "0-1"\n'
        )
        lazy = (
            (self.job / "bootseer.toml")
            .read_text()
            .replace('store = "s3://envs/e2e"\n', 'store = "s3://envs/e2e"\nlazy = true\n')
        )
        (self.job / "bootseer-lazy.toml").write_text(lazy)
        (self.job / "bootseer-baked.toml").write_text(  # torch is in the image: no [env]
            '[run]\ntrace_dir = "/var/log/bootseer/trace"\n\n'
            "[restart]\nmax_restarts = 2\nbackoff_s = 1.0\n\n"
            '[ckpt]\nurl = "s3://ckpt/baked"\ncache_dir = "/var/cache/bootseer/ckpt"\n'
            'ranks = "0-1"\n'
        )
        log(
            f"registry {registry_addr}, index {index_addr}, S3 {s3_addr} (all shaped: "
            + "; ".join(f"{k} {ShaperSettings.from_mb(*v).describe()}" for k, v in LINKS.items())
            + ")"
        )

    def convert(self, src: str, dst: str) -> dict[str, Any]:
        """Image ``src`` of the run's registry converted to bootseer's layer format as ``dst``:
        once per source manifest digest in the cache (``e2e_cache.convert_cached``)."""
        src, dst = f"{self.registry.host}/{src}", f"{self.registry.host}/{dst}"
        t0 = time.perf_counter()
        conv = e2e_cache.convert_cached(
            self.cache / e2e_cache.CONVERTED,
            src,
            dst,
            lambda: self._helper("convert", {"src": src, "dst": dst, "workdir": str(self.work)}),
        )
        how = "kept conversion pushed" if conv["cached"] else "converted"
        log(f"{dst}: {how} to the bootseer layer format in {time.perf_counter() - t0:.1f} s")
        return conv

    def _helper(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        out = bp.run_checked(
            [sys.executable, str(Path(bp.__file__)), "--helper", name, json.dumps(params)],
            env=bp.clean_env(),
            what=f"helper {name}",
            timeout=3600,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def cleanup(self) -> None:
        for node in list(self.nodes):
            with contextlib.suppress(Exception):
                self.retire(node)
        if self.args.keep:
            log(f"kept {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- nodes and containers --------------------------------------------------------------------
    def node(self, tag: str, snapshotter_args: tuple[str, ...] | None = None) -> Node:
        node = Node(self.work / "nodes", tag, snapshotter_args)
        self.nodes.append(node)
        for sub in ("ckpt-cache", "trace", "ckpt-copy"):
            (node.dir / "local" / sub).mkdir(parents=True)
        return node

    def retire(self, node: Node) -> None:
        """Stop the node's container (every process in it), then its daemons. containerd's
        shims outlive containerd by design, so the container goes first."""
        cid = container_id(node)
        subprocess.run(
            node.ctr("tasks", "kill", "--all", "-s", "SIGKILL", cid),
            capture_output=True,
            check=False,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listed = subprocess.run(
                node.ctr("tasks", "ls", "-q"),
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            ).stdout.split()
            if cid not in listed:
                break
            time.sleep(0.2)
        for what in ("tasks", "containers"):
            subprocess.run(
                node.ctr(what, "delete", cid), capture_output=True, check=False, timeout=60
            )
        self.kill_tagged(self.tag(node.dir.name))
        address = node.containerd.address
        node.close()
        self.nodes.remove(node)
        for entry in Path("/proc").iterdir():  # a shim left behind by a task that would not die
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                    if b"containerd-shim" in argv[0] and address.encode() in argv:
                        os.kill(int(entry.name), signal.SIGKILL)
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            target = line.split()[1]
            if target.startswith(str(node.dir)):
                subprocess.run(["umount", "-l", target], capture_output=True, check=False)

    def tag(self, name: str) -> str:
        """The ``BOOTSEER_E2E_TAG`` of the job named ``name`` (its node's and results' name)."""
        return f"{self.run_id}-{name}"

    @staticmethod
    def tagged(tag: str) -> Iterator[tuple[int, list[bytes]]]:
        """(host PID, environment) of every process of the job tagged ``tag`` (containers
        have their own PID namespace; the host sees every process)."""
        want = f"BOOTSEER_E2E_TAG={tag}".encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    environ = (entry / "environ").read_bytes().split(b"\0")
                    if want in environ:
                        yield int(entry.name), environ

    def kill_tagged(self, tag: str) -> None:
        """SIGKILL whatever the job tagged ``tag`` left running."""
        for pid, _ in self.tagged(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def blobs(self, method: str) -> list[Path]:
        """The registry blobs of the image that ``method`` pulls."""
        if method in DIY:
            return self.diy_blobs
        if method in BAKED:
            return self.baked_blobs
        return self.lazy_blobs if method in BOOTSEER else self.gzip_blobs

    def go_cold(self, blobs: list[Path]) -> None:
        if not drop_caches():
            self.cold = False
        for blob in blobs:  # the registry's disk is not this node's
            bp.read_through(blob)

    def pull(self, node: Node, method: str, logf: Any, *, local: bool = False) -> float:
        """The method's image pull; ``local`` (bootseer's warm node): every lazy layer then
        fetched whole and written out, as diy-warm's image is unpacked on its node."""
        if method == "baseline":
            argv = node.ctr("images", "pull", "--plain-http", self.gzip_ref)
        elif method in DIY:
            argv = node.ctr("images", "pull", "--plain-http", self.diy_ref)
        else:
            ref = self.baked_ref if method in BAKED else self.lazy_ref
            argv = [
                sys.executable,
                "-m",
                "bootseer",
                "image",
                "pull",
                ref,
                "--address",
                node.containerd.address,
                "--namespace",
                NAMESPACE,
                *(["--local"] if local else []),
            ]
        t = time.time()
        r = subprocess.run(
            argv, stdout=logf, stderr=logf, env=bp.clean_env(), timeout=STEP_TIMEOUT_S, check=False
        )
        if r.returncode != 0:
            raise RuntimeError(
                f"{argv[0]} pull exited {r.returncode} (log {logf.name}):\n"
                f"{log_tail(Path(logf.name))}"
            )
        return time.time() - t

    def start(
        self,
        node: Node,
        method: str,
        results: Path,
        logf: Any,
        *,
        first: bool,
        warmup: bool = False,
    ) -> subprocess.Popen:
        """``ctr run`` the job (``warmup``: ``bootseer warmup`` in the job's image); its
        results (events) go to ``results``."""
        results.mkdir(parents=True, exist_ok=True)
        (results / "events.jsonl").touch()
        train = [
            "--mode",
            "bootseer" if method in BOOTSEER else "dcp",
            "--size",
            self.size,
            "--results",
            "/results",
            "--ckpt",
            f"s3://{ckpt_root(method)}",
        ]
        if first:
            train += ["--save-every", str(self.args.save_every)]
        elif method in DIY:
            train += ["--local-copy", "/ckpt-local"]
        if method == "baseline":
            cmd = [
                "python3",
                "/app/train.py",
                "launch",
                "--requirements",
                "/job/requirements.txt",
                "--results",
                "/results",
                "--",
                *train,
            ]
            ref, snapshotter = self.gzip_ref, "overlayfs"
        elif method in DIY:
            cmd = ["python3", "/app/train.py", "launch", "--results", "/results", "--", *train]
            ref, snapshotter = self.diy_ref, "overlayfs"
        elif warmup:
            cmd = [
                "python3",
                "-m",
                "bootseer",
                "warmup",
                "--config",
                "/job/bootseer.toml",
                "--node",
                node.dir.name,
            ]
            ref, snapshotter = self.lazy_ref, "bootseer"
        else:
            config = (
                "bootseer-baked"
                if method in BAKED
                else "bootseer-lazy"
                if method in LAZY_ENV
                else "bootseer"
            )
            cmd = [
                "python3",
                "-m",
                "bootseer",
                "run",
                "--config",
                f"/job/{config}.toml",
                "--node",
                node.dir.name,
                "--",
                "python3" if method in BAKED else "python",
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "/app/train.py",
                "train",
                *train,
            ]
            ref = self.baked_ref if method in BAKED else self.lazy_ref
            snapshotter = "bootseer"
        trace = node.dir / "local" / ("warmup-trace" if warmup else "trace")
        trace.mkdir(parents=True, exist_ok=True)
        mounts = [
            (self.job, "/job", "ro"),
            (results, "/results", "rw"),
            (node.dir / "local" / "ckpt-cache", "/var/cache/bootseer/ckpt", "rw"),
            (trace, "/var/log/bootseer/trace", "rw"),
            (Path("/dev/shm"), "/dev/shm", "rw"),
        ]
        if method in DIY:  # where the copy tool puts the checkpoint
            mounts.append((node.dir / "local" / "ckpt-copy", "/ckpt-local", "rw"))
        env = {
            "BOOTSEER_STORAGE_OPTIONS": json.dumps(self.s3_options),
            "BOOTSEER_E2E_TAG": self.tag(results.name),
            "PYTHONUNBUFFERED": "1",
        }
        fuse: list[str] = []
        if method in LAZY_ENV and not warmup:  # the lazy mount inside the container
            fuse = ["--device", "/dev/fuse", "--cap-add", "CAP_SYS_ADMIN"]
            env["FUSE_LIBRARY_PATH"] = e2e_image.LIBFUSE
        if method == "bootseer-warm":  # the environment lives on the node, not in the rootfs
            (node.dir / "local" / "env-root").mkdir(exist_ok=True)
            mounts.append((node.dir / "local" / "env-root", ENV_ROOT, "rw"))
            env["BOOTSEER_ENV_PREFIX"] = f"{ENV_ROOT}/env"
        argv = node.ctr(
            "run",
            "--rm",
            "--net-host",
            "--snapshotter",
            snapshotter,
            *fuse,
            *[
                a
                for src, dst, mode in mounts
                for a in ("--mount", f"type=bind,src={src},dst={dst},options=rbind:{mode}")
            ],
            *[a for k, v in env.items() for a in ("--env", f"{k}={v}")],
            ref,
            container_id(node),
            *cmd,
        )
        shown = redact_argv(argv)  # credentials are never logged
        logf.write(f"$ {' '.join(shown)}\n".encode())
        logf.flush()
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=bp.clean_env()
        )

    # -- watching the job ------------------------------------------------------------------------
    @staticmethod
    def events(results: Path) -> list[dict[str, Any]]:
        path = results / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(
        self,
        what: str,
        proc: subprocess.Popen,
        logp: Path,
        check: Any,
        timeout: float = STEP_TIMEOUT_S,
    ) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the job ended (exit {proc.returncode}) before {what} "
                    f"(log {logp}):\n{log_tail(logp)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what} (log {logp}):\n{log_tail(logp)}")
            time.sleep(0.2)

    def committed(self, method: str) -> int | None:
        if method not in BOOTSEER:
            import fsspec

            fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.direct_options["s3"])
            return dcp_latest(fs, ckpt_root(method))
        from ckpt import CheckpointManager

        mgr = CheckpointManager(
            f"s3://{ckpt_root(method)}", storage_options=self.direct_options, cache_dir=False
        )
        try:
            return mgr.latest()
        finally:
            mgr.close()

    def rank_pid(self, tag: str, rank: int) -> int | None:
        """The host PID of ``rank``'s training process in the job tagged ``tag``."""
        for pid, environ in self.tagged(tag):
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if (
                    f"RANK={rank}".encode() in environ
                    and b"train.py" in cmdline
                    and b"torch.distributed.run" not in cmdline
                ):
                    return pid
        return None

    # -- the runs --------------------------------------------------------------------------------
    def first_start(self, method: str) -> dict[str, Any]:
        """Cold start on a fresh node; train, save, then SIGKILL rank 1 after a commit."""
        args = ("--record-timeout", "1200") if method in ("bootseer", *BAKED) else None
        node = self.node(f"{method}-first", args)
        results = self.work / "results" / f"{method}-first"
        logp = self.work / f"{method}-first.log"
        out: dict[str, Any] = {}
        with open(logp, "ab") as logf:
            log(f"{method}: first start on a fresh node (cold; trains and saves)")
            t0 = time.time()
            self.pull(node, method, logf)
            proc = self.start(node, method, results, logf, first=True)
            first = self.wait_for(
                "the first step",
                proc,
                logp,
                lambda: [e for e in self.events(results) if e["event"] == "first_step"],
            )
            out["cold_start_s"] = first[0]["t"] - t0
            log(
                f"  first step {out['cold_start_s']:.1f} s after the pull began (cold start: "
                "environment built, nothing cached)"
            )
            step = self.wait_for(
                "a committed checkpoint", proc, logp, lambda: self.committed(method)
            )
            last = max(e["step"] for e in self.events(results) if e["event"] == "step")
            self.wait_for(
                "a step after the commit",
                proc,
                logp,
                lambda: any(
                    e["event"] == "step" and e["step"] > last for e in self.events(results)
                ),
            )
            pid = self.rank_pid(self.tag(results.name), 1)
            if pid is None:
                raise RuntimeError("rank 1's process was not found")
            out["committed_step"] = step
            out["kill_t"] = time.time()
            os.kill(pid, signal.SIGKILL)
            log(f"  step {step} committed; SIGKILL to rank 1 (host pid {pid})")
            if method in ("bootseer", *BAKED):
                rc = proc.wait(timeout=STEP_TIMEOUT_S)
                if rc != 0:
                    raise RuntimeError(
                        f"bootseer run ended with {rc} after its restart (log {logp})"
                    )
                if method == "bootseer":
                    out["inplace"] = self.breakdown(
                        "inplace",
                        results,
                        out["kill_t"],
                        None,
                        node.dir / "local" / "trace",
                        attempt=1,
                    )
                self.wait_profile(node)
            else:
                proc.wait(timeout=STEP_TIMEOUT_S)
                out["exit_code"] = proc.returncode
        self.retire(node)
        return out

    def warm_node(self, node: Node, method: str, logf: Any) -> None:
        """Fill a fresh node before the clock, as a pre-job step would: the lazy image
        pulled and written out on the node (``bootseer image pull --local``: containers start
        from local files, as diy-warm's do from its unpacked image), then ``bootseer warmup``
        (environment into the node's directory, the newest checkpoint's shards into the node
        cache) in a container of the image, with the job's configuration."""
        log(
            f"{method}: the node filled by `bootseer image pull` + `bootseer warmup` before "
            "the clock starts"
        )
        t = time.time()
        self.pull(node, method, logf, local=True)
        results = self.work / "results" / f"{method}-warmup"
        proc = self.start(node, method, results, logf, first=False, warmup=True)
        rc = proc.wait(timeout=STEP_TIMEOUT_S)
        if rc != 0:
            raise RuntimeError(
                f"bootseer warmup exited {rc} (log {logf.name}):\n{log_tail(Path(logf.name))}"
            )
        self.R.setdefault("warmup", {})[method] = {"seconds": time.time() - t}
        log(f"  warmed in {time.time() - t:.1f} s")

    def wait_profile(self, node: Node) -> None:
        deadline = time.monotonic() + 60
        while "recorded " not in node.snapshotter_log():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no profile was recorded ({node.dir / 'snapshotter.log'})")
            time.sleep(0.2)
        time.sleep(2.0)  # the push to the registry follows the local copy

    def restart(self, method: str) -> dict[str, Any]:
        """The measured restart on a fresh node."""
        node = self.node(f"{method}-restart", () if method in BOOTSEER else None)
        results = self.work / "results" / f"{method}-restart"
        logp = self.work / f"{method}-restart.log"
        copy = None
        with open(logp, "ab") as logf:
            if method == "diy-warm":  # the image is on the node before the clock starts
                log(f"{method}: the image pulled before the clock starts")
                self.pull(node, method, logf)
            if method == "bootseer-warm":
                self.warm_node(node, method, logf)
            log(f"{method}: restart on a fresh node (page cache dropped)")
            self.go_cold(self.blobs(method))
            t0 = time.time()
            try:
                if method in DIY:  # the copy starts with the restart, beside pull and start
                    copy = e2e_diy.CopyJob(
                        ckpt_root(method),
                        node.dir / "local" / "ckpt-copy",
                        self.rclone_env,
                        self.work / f"{method}-rclone.log",
                        RCLONE,
                    ).start()
                warm = method in ("diy-warm", "bootseer-warm")
                pull_s = 0.0 if warm else self.pull(node, method, logf)
                proc = self.start(node, method, results, logf, first=False)
                rc = proc.wait(timeout=STEP_TIMEOUT_S)
            finally:
                if copy is not None:
                    copy.stop()
        if rc != 0:
            raise RuntimeError(f"the restarted job exited {rc} (log {logp}):\n{log_tail(logp)}")
        out = self.breakdown(
            method, results, t0, t0 + pull_s, node.dir / "local" / "trace", attempt=0
        )
        out["loadavg_1m_after"] = os.getloadavg()[0]  # a shared machine's noise, on record
        if copy is not None:
            st = copy.status
            out["detail"]["checkpoint_copy"] = {
                "tool": "rclone",
                "argv": st.get("argv"),
                "ok": st.get("ok"),
                "step": st.get("step"),
                "bytes": st.get("bytes"),
                "seconds": st.get("seconds"),
                "started_after_restart_s": st["started"] - t0,
                "ended_after_restart_s": st["ended"] - t0,
            }
        if method in BOOTSEER:
            out["prefetch_log"] = [
                ln.split("INFO ", 1)[-1]
                for ln in node.snapshotter_log().splitlines()
                if "prefetching" in ln
            ]
        self.retire(node)
        return out

    # -- the breakdown ---------------------------------------------------------------------------
    def breakdown(
        self,
        method: str,
        results: Path,
        t0: float,
        pulled: float | None,
        trace_dir: Path,
        attempt: int,
    ) -> dict[str, Any]:
        ev = [e for e in self.events(results) if e["attempt"] == attempt]
        spans: list[Any] = []
        if method in (*BOOTSEER, "inplace"):
            from bootseer.trace import read_traces

            spans = [s for s in read_traces([trace_dir])[0] if s.attempt == attempt]
        try:
            phases, first, detail = phases_of(method, ev, t0, pulled, spans)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} in {results}") from None
        verify = max(e["seconds"] for e in ev if e["event"] == "verified")
        loaded = {e["rank"]: e for e in ev if e["event"] == "verified"}
        return {
            "total": first - t0,
            "phases": phases,
            "detail": detail,
            "loaded_step": loaded[0]["step"],
            "loaded_digests": {str(r): e["digest"] for r, e in loaded.items()},
            "load_bytes": sum(e.get("bytes", 0) for e in ev if e["event"] == "load_end"),
            "load_cached_bytes": sum(
                e.get("cached_bytes", 0) for e in ev if e["event"] == "load_end"
            ),
            "load_wait_s": max(
                [e.get("cache_wait_s", 0.0) for e in ev if e["event"] == "load_end"] or [0.0]
            ),
            "verify_s": verify,
        }

    def check_identical(self, method: str, first: Path, out: dict[str, Any]) -> None:
        """The resumed state equals the saved one, byte for byte, on every rank."""
        saved = {
            (e["step"], str(e["rank"])): e["digest"]
            for e in self.events(first)
            if e["event"] == "saved"
        }
        step = out["loaded_step"]
        ok = (
            all(saved.get((step, r)) == d for r, d in out["loaded_digests"].items())
            and len(out["loaded_digests"]) == 2
        )
        out["bit_identical"] = ok
        if not ok:
            self.errors.append(
                f"{method}: the state loaded at step {step} differs from the one "
                "saved (sha256 per rank)"
            )

    def run(self) -> None:
        self.setup()
        for method in self.methods:
            try:
                self.run_method(method)
            except RuntimeError as exc:  # recorded; the other methods still run
                self.errors.append(f"{method}: {exc}")
                log(f"{method} FAILED: {exc}")
                for node in list(self.nodes):
                    self.retire(node)
        if not self.cold:
            self.R["warnings"].append("the page cache could not be dropped: WARM figures")

    def run_method(self, method: str) -> None:
        key = f"{family(method)}-first"
        if key not in self.R["runs"]:  # diy and diy-warm restart from the same one
            first = self.first_start(family(method))
            self.R["runs"][key] = first
            if "inplace" in first:
                self.check_identical(
                    "inplace", self.work / "results/bootseer-first", first["inplace"]
                )
                self.R["runs"]["inplace"] = first["inplace"]
        out = self.restart(method)
        self.check_identical(method, self.work / "results" / key, out)
        self.R["runs"][method] = out
        log(
            f"  {method}: {out['total']:.1f} s to the first step; "
            + ", ".join(f"{k} {v:.1f}" for k, v in out["phases"].items() if v > 0.05)
        )

    # -- the report ------------------------------------------------------------------------------
    def rows(self) -> list[list[str]]:
        runs = self.R["runs"]
        rows = []
        for m in ORDER:
            r = runs.get(m)
            if not r:
                continue
            rows.append(
                [
                    LABELS[m],
                    f"{r['total']:.1f} s",
                    *[f"{r['phases'][k]:.1f}" for k, _, _ in PHASES],
                    "yes" if r.get("bit_identical") else "NO",
                ]
            )
        return rows

    def verdict(self) -> tuple[float | None, str]:
        b, o = self.R["runs"].get("baseline"), self.R["runs"].get("bootseer")
        if not b or not o:
            return None, "n/a"
        reduction = 1 - o["total"] / b["total"]
        return reduction, "PASS" if reduction >= TARGET_REDUCTION else "MISS"

    def chart(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [m for m in ORDER if m in self.R["runs"]]
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.8 * len(names)))
        for i, m in enumerate(names):
            left = 0.0
            for key, label, colour in PHASES:
                width = max(0.0, self.R["runs"][m]["phases"][key])
                ax.barh(i, width, left=left, color=colour, label=label if i == 0 else None)
                left += width
            ax.text(left, i, f" {self.R['runs'][m]['total']:.1f} s", va="center")
        longest = max(self.R["runs"][m]["total"] for m in names)
        ax.set_xlim(0, longest * 1.15)  # room for the totals
        ax.set_yticks(range(len(names)), [LABELS[m].split(":")[0] for m in names])
        ax.invert_yaxis()
        ax.set_xlabel("seconds from the restart to the first training step")
        ax.set_title(f"bootseer end-to-end restart ({self.size} scenario)")
        ax.legend(
            loc="upper center",
            bbox_to_anchor=(0.5, -0.35 if len(names) < 3 else -0.25),
            ncol=4,
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def report(self) -> None:
        head = [
            "restart (fresh node unless noted)",
            "to first step",
            *[label for _, label, _ in PHASES],
            "state bit-identical",
        ]
        table = md_table(head, self.rows())
        reduction, verdict = self.verdict()
        self.R["reduction"] = reduction
        self.R["verdict"] = verdict
        self.R["table"] = table
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        img = self.R.get("image", {})
        runs = self.R["runs"]
        lines = [
            f"# end-to-end restart benchmark ({self.size} scenario)",
            "",
            f"- command: `{self.R['command']}`",
            f"- machine: {self.R['machine']['cpus']} CPUs, "
            f"{self.R['machine']['ram_bytes'] / 2**30:.1f} GiB RAM, "
            f"{self.R['machine']['containerd']}",
            "- image: "
            + ", ".join(
                f"{la['name']} {la['size'] / 1e6:.0f} MB gzip" for la in img.get("layers", [])
            )
            + "".join(
                f"; diy image: + {la['name']} {la['size'] / 1e6:.0f} MB gzip"
                for la in img.get("diy_layers", [])[len(img.get("layers", [])) :]
            ),
            f"- job: FSDP2 over gloo, 2 ranks, state {self.state_text()}, saved "
            f"asynchronously every {self.args.save_every} steps; rank 1 killed with SIGKILL "
            "after a commit",
            "- links: "
            + "; ".join(
                f"{k} {v[0]:g} ms, {v[1]:g} MB/s per connection, {v[2]:g} MB/s in all"
                for k, v in LINKS.items()
            ),
            f"- {'page cache dropped before each restart' if self.cold else 'WARM'}",
            "",
            *table,
            "",
        ]
        if reduction is not None:
            lines.append(
                f"bootseer: {runs['bootseer']['total']:.1f} s vs baseline "
                f"{runs['baseline']['total']:.1f} s: {reduction:.0%} less startup "
                f"(target >= {TARGET_REDUCTION:.0%}): **{verdict}**"
            )
        self.R["vs"] = vs = compare(runs)
        for key, v in vs.items():
            ours, m = key.split(" vs ") if " vs " in key else ("bootseer", key)
            lines.append(
                f"- {ours} vs {m}: {runs[ours]['total']:.1f} s vs "
                f"{runs[m]['total']:.1f} s, {v['speedup']:.2f}x ({v['less']:.0%} less)"
            )
        if "inplace" in runs:
            floor = all_local_floor(runs["inplace"])
            runs["inplace"]["all_local_floor_s"] = floor
            lines.append(
                f"- in place: {runs['inplace']['total']:.1f} s against its all-local "
                f"floor {floor:.1f} s ({runs['inplace']['total'] / floor:.2f}x; "
                "target <= 1.2x)"
                + (f"; diy-warm {runs['diy-warm']['total']:.1f} s" if "diy-warm" in runs else "")
            )
        for m in ORDER[:-1]:
            if m in runs:
                lines.append(
                    f"- {m}: {json.dumps(runs[m]['detail'])}; resumed at step "
                    f"{runs[m]['loaded_step']}; load average "
                    f"{runs[m].get('loadavg_1m_after', float('nan')):.1f} after it"
                )
        for key in ("bootseer-first", "baseline-first", "diy-first", "bootseer-baked-first"):
            if key in runs:
                lines.append(
                    f"- info: {key.rsplit('-first', 1)[0]} cold first start to the "
                    f"first step: {runs[key]['cold_start_s']:.1f} s"
                )
        lines += [f"- WARNING: {w}" for w in self.R["warnings"]]
        lines += [f"- ERROR: {e}" for e in self.errors]
        self.results_dir.mkdir(parents=True, exist_ok=True)
        if self.rows():
            chart = self.results_dir / f"{SUITE}.png"
            self.chart(chart)
            self.R["chart"] = str(chart)
            lines.append(f"- chart: {chart}")
        print("\n".join(lines))
        (self.results_dir / f"{SUITE}.md").write_text("\n".join(lines) + "\n")
        self.write_files()

    def state_text(self) -> str:
        from e2e_train import SIZES

        c = SIZES[self.size]
        d = c["d"]
        params = c["vocab"] * d + c["layers"] * (12 * d * d + 13 * d)
        return f"{params * 12 / 1e9:.2f} GB ({params / 1e6:.0f} M parameters + AdamW moments)"

    def write_files(self) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / f"{SUITE}.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--sweep" or a.startswith("--sweep=") for a in argv):  # its own options
        import bench_e2e_sweep

        return bench_e2e_sweep.main(argv)
    parser = argparse.ArgumentParser(prog="bench_e2e.py", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="the small job (0.25 GB of state)")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument(
        "--base",
        choices=("auto", "debootstrap", "host"),
        default=None,
        help="image base (default: host for --quick, else auto)",
    )
    parser.add_argument("--cache", default=None, help="default ~/.cache/bootseer-bench")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of {', '.join(METHODS)} (default all; with "
        "--nodes: bench_e2e_nodes.METHODS, in-place ones included)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="the scenario on N nodes of a cluster (bench_e2e_nodes.py)",
    )
    parser.add_argument("--lose", type=int, default=None, help="with --nodes: the node lost")
    parser.add_argument(
        "--sweep",
        default=None,
        help="the --nodes scenario for each N of a list, e.g. 2,4,8 "
        "(bench_e2e_sweep.py: e2e-sweep.json, the scale model's input)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="with --nodes or --sweep: ranks per node (default 2; sweep 1)",
    )
    parser.add_argument(
        "--cache-tier",
        action="store_true",
        help="with --nodes or --sweep: the nodes read through the cluster's "
        "cache tier, the origin as the fallback",
    )
    args = parser.parse_args(argv)
    if args.nodes is not None:
        import bench_e2e_nodes

        return bench_e2e_nodes.main(argv)
    for given, flag in (
        (args.ranks_per_node is not None, "--ranks-per-node"),
        (args.cache_tier, "--cache-tier"),
    ):
        if given:
            parser.error(f"{flag}: only with --nodes or --sweep")
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(
            f"--methods: unknown {', '.join(sorted(unknown))} (choose from {', '.join(METHODS)})"
        )
    bench = Bench(args)
    return run_bench(bench, done_key="verdict")


if __name__ == "__main__":
    sys.exit(main())
