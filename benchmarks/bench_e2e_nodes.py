"""End-to-end restart on several nodes: a node is lost, a fresh one replaces it, time to the
first training step on every rank (issue 16; ``bootseer bench e2e --nodes 4``).

The job is the one-node scenario's (``e2e_train.py``, FSDP2 over gloo) on ``--nodes`` nodes x 2
ranks of a :class:`bootseer.testing.cluster.Cluster` (network namespaces on this machine, each
with its own containerd, bootseer snapshotter, disk and shaped link; registry, S3, package index
and the controller's c10d store on a services host, bytes counted per node). On every node
containerd starts the training image (``e2e_image.py``) and ``torchrun`` joins a c10d rendezvous
on the controller (``--nnodes N:N``). The model is small, because this machine has 2 cores for
8 ranks and 4 containerds: ``tiny`` (0.66 M parameters, 8 MB of state) with ``--quick``,
``quick`` (21 M parameters, 0.25 GB) in the full form.

Per method, on a cluster of its own: the job starts cold on every node, trains, checkpoints to
S3; once a checkpoint is committed and training went past it, node ``--lose`` is lost (every
process SIGKILLed: ``Cluster.kill_node``) and a fresh empty node takes its place
(``replace_node``). The survivors' torchrun agents restart their workers and wait in the
rendezvous; the fresh node pulls the image, starts the container and joins. The clock runs from
the loss to the first training step of every rank (minus the state digest each rank takes after
loading, which proves the resumed state bit-identical to the saved one):

* ``bootseer``: ``bootseer image pull`` through the node's bootseer snapshotter (the hot-block
  profile that the first start recorded is prefetched), ``ctr run``; in the container
  ``bootseer run`` restores the environment snapshot while prefetching the node's checkpoint
  shards, then torchrun; ``CheckpointManager.load``.
* ``baseline``: ``ctr images pull`` (gzip, overlayfs), ``ctr run``; in the container ``pip
  install`` of torch from the index, torchrun, DCP ``load`` over s3fs on every rank.
* ``diy``: the strong do-it-yourself restart (``e2e_diy.py``, as in the one-node scenario):
  torch baked into the image, ``ctr images pull``; ``rclone copy`` of the newest DCP checkpoint
  runs on the fresh node from the moment it is up, beside the pull and the container start;
  the fresh node's ranks wait for it and load from disk (the survivors' restarted workers
  load over s3fs: torchrun restarts them with the first start's command).
* ``diy-warm``: the same with the image pulled onto the fresh node before the clock, which
  then starts when the node is given to the job.
* in place (``inplace``: bootseer; ``diy-inplace``, ``baseline-inplace``): the node is kept and
  only the job's processes on it get SIGKILL; ``bootseer run`` restarts torchrun itself, the
  baselines' container is run again from the image the node holds.

Per node the phase breakdown; across ranks p50, p90 and max; the critical path from
``bootseer report`` run on every node's trace (the harness writes the spans it measures next to
``bootseer run``'s own) and the node that set the pace (the one the others waited for in the
rendezvous) with its phases; registry, S3 and index bytes per node (the cluster's counting proxies).
Writes ``DIR/e2e-nodes.json`` and ``DIR/e2e-nodes.md`` (and each method's report under
``DIR/e2e-nodes-report/METHOD/``).

``python benchmarks/bench_e2e.py --nodes 4 [--quick] --results DIR`` or
``bootseer bench e2e --nodes 4``; root, containerd, runc, FUSE, iproute2 and docker-registry.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e  # noqa: E402
import bench_prefetch as bp  # noqa: E402
import e2e_cache  # noqa: E402
import e2e_diy  # noqa: E402
import e2e_image  # noqa: E402
from _common import command_line, download_wheels, log, md_table, mem_total, run_bench  # noqa: E402
from e2e_nodes_spans import (  # noqa: E402
    SERVICES,
    NodeRun,
    check_identical,
    harness_spans,
    rank_totals,
    summarize,
)

SUITE = "e2e-nodes"
TORCH = "torch==2.13.0"
MODEL = {"quick": "tiny", "full": "quick"}  # e2e_train.SIZES per form
NODE_LINK = ("400mbit", 1.0)  # each node's link: 50 MB/s, 1 ms one way to the services
SERVICE_LINK = "1280mbit"  # the services host's link, shared by every node: 160 MB/s
STEP_TIMEOUT_S = 1500.0
# --methods, in the order they run (the slowest last, so a run cut short keeps the others);
# the in-place rows of the two baselines last of all
METHODS = ("diy", "diy-warm", "bootseer", "inplace", "baseline", "diy-inplace", "baseline-inplace")
ORDER = (
    "baseline",
    "diy",
    "diy-warm",
    "bootseer",
    "baseline-inplace",
    "diy-inplace",
    "inplace",
)  # the report's rows
LABELS = {
    "baseline": "baseline: full pull + `pip install` + DCP over s3fs",
    "diy": "diy: deps baked in the image, full pull + rclone copy + DCP from disk",
    "diy-warm": "diy-warm: the same, the image already on the fresh node",
    "bootseer": "bootseer: lazy image + env snapshot + ckpt prefetch",
    "inplace": "bootseer in place: `bootseer run` restarts torchrun on the same node",
    "baseline-inplace": "baseline in place: the container restarted on the same node",
    "diy-inplace": "diy in place: the container restarted on the same node",
}
RCLONE = e2e_diy.RcloneTuning()
MAX_RANKS_PER_NODE = 8


def rank_list(node: int, per_node: int) -> str:
    """The ranks node ``node`` serves (``ckpt.ranks``): ``"2-3"``, or ``"5"`` for one rank."""
    first = node * per_node
    return str(first) if per_node == 1 else f"{first}-{first + per_node - 1}"


def family(method: str) -> str:
    """The image, job and checkpoint of ``method``: bootseer, diy or baseline."""
    return "bootseer" if method == "inplace" else method.split("-")[0]


def in_place(method: str) -> bool:
    """The lost node's processes die but the node stays: the same node restarts them."""
    return method == "inplace" or method.endswith("-inplace")


class ResultFiles:
    """``report()`` and ``write_files()`` of a bench whose results are ``R``, written as
    ``DIR/<suite>.json`` and, rendered, ``DIR/<suite>.md``."""

    suite: str
    results_dir: Path
    R: dict[str, Any]

    def render(self) -> list[str]:
        raise NotImplementedError

    def report(self) -> None:
        lines = self.render()
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        self.R["done"] = True
        print("\n".join(lines))
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / f"{self.suite}.md").write_text("\n".join(lines) + "\n")
        self.write_files()

    def write_files(self) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / f"{self.suite}.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )


class NodesBench(ResultFiles):
    """One cluster per method; the results in ``R`` (``e2e-nodes.json``)."""

    suite = SUITE

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = bool(args.quick)
        self.size = "quick" if self.quick else "full"
        self.model = MODEL[self.size]
        self.nodes = int(args.nodes)
        if not 2 <= self.nodes <= 8:
            raise ValueError(
                f"--nodes {self.nodes}: the scenario needs 2 to 8 nodes (a node "
                "is lost and the others wait for its replacement)"
            )
        per_node = getattr(args, "ranks_per_node", None)
        self.ranks_per_node = 2 if per_node is None else int(per_node)
        if not 1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE:
            raise ValueError(
                f"--ranks-per-node {self.ranks_per_node}: give 1 to "
                f"{MAX_RANKS_PER_NODE} (every rank of every node shares this "
                "machine's cores)"
            )
        self.lose = self.nodes - 1 if args.lose is None else int(args.lose)
        if not 0 <= self.lose < self.nodes:
            raise ValueError(f"--lose {self.lose}: choose a node from 0 to {self.nodes - 1}")
        self.cache = (
            Path(
                args.cache
                or os.environ.get("BOOTSEER_BENCH_CACHE")
                or Path.home() / ".cache" / "bootseer-bench"
            )
            .expanduser()
            .resolve()
        )
        self.work = self.cache / f"e2e-nodes-run-{uuid.uuid4().hex[:8]}"  # private to this run
        self.converted = self.cache / e2e_cache.CONVERTED
        self.results_dir = Path(args.results).resolve()
        self.methods = [m for m in METHODS if m in args.methods.split(",")]
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.R: dict[str, Any] = {
            "suite": SUITE,
            "quick": self.quick,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "lost_node": f"node{self.lose}",
            "model": self.model,
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
                "node": {"rate": NODE_LINK[0], "delay_ms": NODE_LINK[1]},
                "services": {"rate": SERVICE_LINK},
            },
            "runs": {},
            "warnings": [],
            "errors": self.errors,
        }

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("needs root: network namespaces, containerd, runc, FUSE")
        self.work.mkdir(parents=True)
        self.stack.callback(self.cleanup)
        self.R["image"] = e2e_image.training_layers(
            self.cache,
            self.work,
            self.args.base or ("host" if self.quick else "auto"),
            bench_e2e.LEVEL[self.quick],
        )
        self.layers = self.R["image"]["layers"]
        self.wheels = download_wheels(self.cache / "wheels-e2e", [TORCH])
        self.diy_layers = None
        if any(family(m) == "diy" for m in self.methods):  # torch baked in: a third layer
            self.diy_layers = [
                *self.layers,
                bench_e2e.deps_layer(self.work, self.cache / "image", self.wheels[0].parent),
            ]
            self.R["image"]["diy_layers"] = self.diy_layers

    def cleanup(self) -> None:
        if self.args.keep:
            log(f"kept {self.work}")
        elif self.work.name.startswith("e2e-nodes-run-") and self.work.parent == self.cache:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- one method ------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        for method in self.methods:
            try:
                self.R["runs"][method] = self.run_method(method)
            except Exception as exc:  # noqa: BLE001 - the other method still runs
                self.errors.append(f"{method}: {type(exc).__name__}: {exc}")
                log(f"{method} failed: {exc}")

    def hosts_dir(self) -> Path:
        """containerd's registry hosts directory of every node (``--cache-tier``): the cache
        tier as the registry's mirror (each node reaches it at 127.0.0.1:5001), the registry
        itself after it, as containerd tries them."""
        from bootseer.testing.cluster_node import CACHE_PORT_OFFSET
        from bootseer.testing.cluster_services import PORTS

        root = self.work / "hosts.d"
        origin = f"127.0.0.1:{PORTS['registry']}"
        mirror = f"127.0.0.1:{PORTS['registry'] + CACHE_PORT_OFFSET}"
        (root / origin).mkdir(parents=True, exist_ok=True)
        (root / origin / "hosts.toml").write_text(
            f'server = "http://{origin}"\n\n[host."http://{mirror}"]\n'
            '  capabilities = ["pull", "resolve"]\n'
        )
        return root

    def run_method(self, method: str) -> dict[str, Any]:
        from bootseer.testing.cluster import Cluster, Link

        bootseer = family(method) == "bootseer"
        tier = bool(getattr(self.args, "cache_tier", False))
        args: tuple[str, ...] = ("--record-timeout", "1200")
        if tier:
            args += ("--registry-config-path", str(self.hosts_dir()))
        cluster = Cluster(
            self.nodes,
            link=Link(rate=NODE_LINK[0], delay_ms=NODE_LINK[1]),
            service_link=Link(rate=SERVICE_LINK),
            containerd=True,
            snapshotter=bootseer,
            snapshotter_args=args,
            disk_size="6g" if not bootseer else "3g",
            workdir=self.work,
            cache=tier,
        )
        log(f"{method}: starting {self.nodes} nodes")
        with cluster as c:
            run = MethodRun(self, c, method)
            return run.execute()

    def render(self) -> list[str]:
        return render(self.R)


def render(R: dict[str, Any]) -> list[str]:  # noqa: N803 - the results, as in e2e-nodes.json
    """The markdown report of a run's results (``--render FILE`` redoes it from the JSON)."""
    runs, size = R["runs"], "quick" if R["quick"] else "full"
    lines = [
        f"# end-to-end restart on {R['nodes']} nodes ({size} scenario)",
        "",
        f"- command: `{R['command']}`",
        f"- machine: {R['machine']['cpus']} CPUs, "
        f"{R['machine']['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"{R['machine']['containerd']}; every node, its containerd and its ranks "
        "share these CPUs",
        f"- job: FSDP2 over gloo, {R['nodes']} nodes x "
        f"{R.get('ranks_per_node', 2)} ranks, model "
        f"`{R['model']}` ({state_text(R['model'])}); {R['lost_node']} lost "
        "(SIGKILL to all its processes) after a commit, replaced by a fresh node; "
        "in place: its job processes killed, the same node restarts them",
        f"- links: each node {NODE_LINK[0]} ({NODE_LINK[1]:g} ms to the services), "
        f"the services host {SERVICE_LINK} shared",
        "",
    ]
    head = [
        "method",
        "p50 (ranks)",
        "p90",
        "max (job back)",
        "critical path ends on",
        "its split",
        "paced by (waited for)",
        "its phases before the rendezvous",
        "registry MB",
        "S3 MB",
        "index MB",
        "bit-identical",
        "load avg (1 min)",
    ]
    rows = []
    for m in [m for m in ORDER if m in runs]:
        r, s = runs[m], runs[m]["summary"]
        load = r.get("loadavg_1m", {})
        rows.append(
            [
                LABELS[m],
                f"{s['p50_s']:.1f} s",
                f"{s['p90_s']:.1f} s",
                f"{s['max_s']:.1f} s",
                s["straggler"],
                s["why"],
                s["paced_by"],
                s["paced_why"],
                *[f"{r['bytes_total'].get(k, 0) / 1e6:.1f}" for k in ("registry", "s3", "index")],
                "yes" if r["bit_identical"] else "NO",
                f"{load.get('before', float('nan')):.1f} / {load.get('after', float('nan')):.1f}",
            ]
        )
    lines += md_table(head, rows) + [""]
    if "bootseer" in runs and "baseline" in runs:
        b, o = runs["baseline"]["summary"]["max_s"], runs["bootseer"]["summary"]["max_s"]
        R["reduction"] = 1 - o / b
    R["vs"] = vs = bench_e2e.compare({m: {"total": r["summary"]["max_s"]} for m, r in runs.items()})
    lines += [
        f"- bootseer vs {m}: job back {runs['bootseer']['summary']['max_s']:.1f} s vs "
        f"{runs[m]['summary']['max_s']:.1f} s after the loss, {v['speedup']:.2f}x "
        + (f"({v['less']:.0%} less)" if v["less"] >= 0 else f"(bootseer {-v['less']:.0%} slower)")
        for m, v in vs.items()
    ]
    if "inplace" in runs:
        lines += [
            f"- in place (the node kept): bootseer {runs['inplace']['summary']['max_s']:.1f} s"
            + "".join(
                f", {m.split('-')[0]} {runs[m]['summary']['max_s']:.1f} s"
                for m in ("baseline-inplace", "diy-inplace")
                if m in runs
            )
        ]
    lines += [
        f"- {m}: rclone copied step {r['checkpoint_copy']['step']}, "
        f"{(r['checkpoint_copy']['bytes'] or 0) / 1e6:.1f} MB in "
        f"{r['checkpoint_copy']['seconds']:.1f} s, from "
        f"{r['checkpoint_copy']['started_after_loss_s']:.1f} s to "
        f"{r['checkpoint_copy']['ended_after_loss_s']:.1f} s after the loss"
        for m, r in runs.items()
        if r.get("checkpoint_copy")
    ]
    lines.append("")
    for m, r in runs.items():
        lines += [f"## {m}: per node (seconds from the loss; the node's slowest rank)", ""]
        phases = sorted({p for n in r["per_node"].values() for p in n["phases"]}, key=phase_order)
        lines += md_table(
            ["node", "back at", *phases, "registry MB", "S3 MB", "index MB"],
            [
                [
                    n,
                    f"{v['first_step_s']:.1f}",
                    *[f"{v['phases'].get(p, 0.0):.1f}" for p in phases],
                    *[f"{v['bytes'].get(k, 0) / 1e6:.1f}" for k in ("registry", "s3", "index")],
                ]
                for n, v in r["per_node"].items()
            ],
        )
        lines += ["", f"- bootseer report: {r['report_dir']}", ""]
    lines += [f"- WARNING: {w}" for w in R["warnings"]]
    lines += [f"- ERROR: {e}" for e in R["errors"]]

    return lines


def phase_order(phase: str) -> int:
    from e2e_nodes_spans import PHASE_ORDER

    return PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)


def state_text(model: str) -> str:
    from e2e_train import SIZES

    c = SIZES[model]
    d = c["d"]
    params = c["vocab"] * d + c["layers"] * (12 * d * d + 13 * d)
    return f"{params / 1e6:.2f} M parameters, {params * 12 / 1e6:.0f} MB of state"


class MethodRun:
    """One method on one cluster: first start, loss, replacement (or restart in place),
    restart, results."""

    def __init__(self, bench: NodesBench, cluster: Any, method: str) -> None:
        self.b = bench
        self.c = cluster
        self.method = method
        self.family = family(method)
        self.bootseer = self.family == "bootseer"
        self.diy = self.family == "diy"
        self.in_place = in_place(method)
        self.work = bench.work / method
        self.results = self.work / "results"
        self.traces = self.work / "traces"
        self.job = self.work / "job"
        for d in (self.results, self.traces, self.job):
            d.mkdir(parents=True)
        (self.results / "events.jsonl").touch()
        self.repo = f"e2e/train-nodes-{bench.size}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.copy: e2e_diy.CopyJob | None = None
        self.warm_bytes: dict[str, dict[str, int]] = {}  # diy-warm: counted before the clock

    # -- services ----------------------------------------------------------------------------------
    def helper(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """A helper run on the services host (its loopback reaches the registry and S3
        directly, uncounted: set-up and checks are not a node's traffic)."""
        out = self.c.services.run(
            [sys.executable, str(Path(__file__).resolve()), "--helper", name, json.dumps(params)],
            timeout=3600,
            env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def prepare(self) -> None:
        c = self.c
        for bucket in ("ckpt", "envs"):
            c.services.create_bucket(bucket)
            if self.tier:  # the mirror's GETs are unsigned: its objects readable without one
                from bootseer.testing.cluster_cache import anonymous_read_policy

                with c.services.entered():
                    c.services.s3.admin_client().put_bucket_policy(
                        Bucket=bucket, Policy=json.dumps(anonymous_read_policy(bucket))
                    )
        host = c.services.registry_host
        layers = self.b.diy_layers if self.diy else self.b.layers
        tag = "diy" if self.diy else "gzip"
        self.helper(
            "push",
            {
                "registry": host,
                "repo": self.repo,
                "tag": tag,
                "layers": layers,
                "config": e2e_image.image_config(layers),
            },
        )
        self.ref = f"{host}/{self.repo}:{tag}"
        if self.bootseer:  # converted once: the next clusters get the kept conversion
            params = {"src": self.ref, "dst": f"{host}/{self.repo}:lazy", "workdir": str(self.work)}
            conv = self.helper("convert", {**params, "cache": str(self.b.converted)})
            self.b.R.setdefault("conversion", conv)
            how = (
                "kept conversion pushed"
                if conv["cached"]
                else f"converted in {conv['seconds']:.1f} s"
            )
            log(f"  {params['dst']}: {how}")
            self.ref = params["dst"]
        c.services.index_dir.mkdir(parents=True, exist_ok=True)  # torch for pip and uv
        for wheel in self.b.wheels:
            shutil.copy2(wheel, c.services.index_dir / wheel.name)
        (self.job / "requirements.txt").write_text(f"--index-url {c.services.index_url}\n{TORCH}\n")
        restarts = 1 if self.in_place else 0  # in place: bootseer run restarts torchrun
        for i in range(self.b.nodes):
            (self.job / f"bootseer-node{i}.toml").write_text(
                '[run]\ntrace_dir = "/var/log/bootseer/trace"\n\n'
                f"[restart]\nmax_restarts = {restarts}\nbackoff_s = 1.0\n\n"
                '[env]\nspec = ["/job/requirements.txt"]\nprefix = "/opt/env"\n'
                'store = "s3://envs/e2e"\n\n'
                '[ckpt]\nurl = "s3://ckpt/bootseer"\ncache_dir = "/var/cache/bootseer/ckpt"\n'
                f'ranks = "{rank_list(i, self.b.ranks_per_node)}"\n'
            )

    @property
    def tier(self) -> bool:
        return bool(getattr(self.b.args, "cache_tier", False))

    def job_storage_options(self) -> dict[str, Any]:
        """The job's storage options: the services' S3, and with ``--cache-tier`` the cache
        host's S3 port (127.0.0.1:9001 on each node) as striped's ``mirror``, so the nodes'
        checkpoint and environment stripe reads go through the cache (docs/striped_fs.md)."""
        from bootseer.testing.cluster_node import CACHE_PORT_OFFSET
        from bootseer.testing.cluster_services import PORTS

        options: dict[str, Any] = {"s3": self.c.services.storage_options()}
        if self.tier:
            mirror = f"http://127.0.0.1:{PORTS['s3'] + CACHE_PORT_OFFSET}"
            options["striped"] = {"mirror": mirror}
        return options

    # -- nodes ---------------------------------------------------------------------------------------
    def pull(self, node: Any) -> tuple[float, float]:
        t = time.time()
        if self.bootseer:
            node.run(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "image",
                    "pull",
                    self.ref,
                    "--address",
                    node.containerd.address,
                    "--namespace",
                    node.containerd.namespace,
                ],
                timeout=STEP_TIMEOUT_S,
            )
        else:
            tier = (
                ["--hosts-dir", str(self.b.hosts_dir())]
                if getattr(self.b.args, "cache_tier", False)
                else []
            )
            node.run(
                [
                    "ctr",
                    "--address",
                    node.containerd.address,
                    "--namespace",
                    node.containerd.namespace,
                    "images",
                    "pull",
                    "--plain-http",
                    *tier,
                    self.ref,
                ],
                timeout=STEP_TIMEOUT_S,
            )
        return t, time.time()

    def copy_dir(self, node: Any) -> Path:
        """Where the diy copy puts the checkpoint on ``node``'s disk (``/ckpt-local``)."""
        path = node.dirs.cache / "ckpt-copy"
        path.mkdir(exist_ok=True)
        return path

    def start_copy(self, node: Any) -> None:
        """diy: ``rclone copy`` of the newest DCP checkpoint, run on ``node`` (through its
        link, its bytes counted), beside the pull and the container start."""
        self.copy = e2e_diy.CopyJob(
            "ckpt/diy",
            self.copy_dir(node),
            e2e_diy.rclone_env(self.c.services.storage_options()),
            self.work / f"{node.name}-rclone.log",
            RCLONE,
            wrap=node.argv,
        ).start()

    def start(self, node: Any, first: bool, key: str | None = None) -> str:
        """``ctr run`` the job's container on ``node`` (in the background); its key."""
        key = key or f"{node.name}.g{node.generation}"
        trace = self.traces / key
        trace.mkdir()
        cache = node.dirs.cache / "ckpt"
        cache.mkdir(exist_ok=True)
        opts = node.torchrun(
            [],
            nnodes=f"{self.b.nodes}:{self.b.nodes}",
            nproc_per_node=self.b.ranks_per_node,
            rdzv_id=f"e2e-{self.method}",
            python="python",
        )
        opts = opts[opts.index("torch.distributed.run") + 1 :]  # torchrun's own options
        train = [
            "--mode",
            "bootseer" if self.bootseer else "dcp",
            "--size",
            self.b.model,
            "--results",
            "/results",
            "--ckpt",
            f"s3://{bench_e2e.ckpt_root(self.family)}",
        ]
        if first:
            train += ["--save-every", str(self.b.args.save_every)]
        elif self.diy:
            train += ["--local-copy", "/ckpt-local"]
        env = {
            "BOOTSEER_STORAGE_OPTIONS": json.dumps(self.job_storage_options()),
            "BOOTSEER_E2E_TAG": f"{self.method}-{key}",
            "BOOTSEER_E2E_NODE": node.name,
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "eth0",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        if self.bootseer:
            cmd = [
                "python3",
                "-m",
                "bootseer",
                "run",
                "--config",
                f"/job/bootseer-{node.name}.toml",
                "--node",
                node.name,
                "--",
                "python",
                "-m",
                "torch.distributed.run",
                *opts,
                "/app/train.py",
                "train",
                *train,
            ]
            snapshotter = "bootseer"
        else:
            env["BOOTSEER_E2E_TORCHRUN"] = json.dumps(opts)
            pip = ["--requirements", "/job/requirements.txt"] if not self.diy else []
            cmd = [
                "python3",
                "/app/train.py",
                "launch",
                *pip,
                "--results",
                "/results",
                "--",
                *train,
            ]
            snapshotter = "overlayfs"
        mounts = [
            (self.job, "/job", "ro"),
            (self.results, "/results", "rw"),
            (cache, "/var/cache/bootseer/ckpt", "rw"),
            (trace, "/var/log/bootseer/trace", "rw"),
        ]
        if self.diy:
            mounts.append((self.copy_dir(node), "/ckpt-local", "rw"))
        argv = [
            "ctr",
            "--address",
            node.containerd.address,
            "--namespace",
            node.containerd.namespace,
            "run",
            "--rm",
            "--net-host",
            "--snapshotter",
            snapshotter,
            *[
                a
                for src, dst, mode in mounts
                for a in ("--mount", f"type=bind,src={src},dst={dst},options=rbind:{mode}")
            ],
            *[a for k, v in env.items() for a in ("--env", f"{k}={v}")],
            self.ref,
            f"job-{key.replace('.', '-')}",
            *cmd,
        ]
        self.logs[key] = self.work / f"{key}.log"
        with open(self.logs[key], "ab") as logf:
            self.procs[key] = node.popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        return key

    def kill_in_place(self, key: str) -> int:
        """SIGKILL the job's processes in the container ``key`` (its tag): every one for the
        baselines (the container ends), all but ``bootseer run`` (PID 1, which restarts
        torchrun) for bootseer. Returns how many were killed."""
        killed = 0
        for pid, _ in bench_e2e.Bench.tagged(f"{self.method}-{key}"):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if self.bootseer and argv[1:4] == [b"-m", b"bootseer", b"run"]:
                    continue
                os.kill(pid, signal.SIGKILL)
                killed += 1
        if not killed:
            raise RuntimeError(f"{key}: no process of the job was found to kill")
        return killed

    # -- watching ----------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        text = (self.results / "events.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def wait_for(self, what: str, check: Any, keys: Iterable[str]) -> Any:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            value = check()
            if value:
                return value
            for key in keys:
                if self.procs[key].poll() is not None:
                    raise RuntimeError(
                        f"{key}'s job ended (exit {self.procs[key].returncode}) "
                        f"before {what}:\n{tail(self.logs[key])}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(1.0)

    def committed(self) -> int | None:
        return self.helper(
            "committed",
            {
                "root": bench_e2e.ckpt_root(self.family),
                "options": {"s3": self.c.services.storage_options()},
            },
        )["step"]

    def started_since(self, t: float, nodes: list[str]) -> int:
        """How many workers on ``nodes`` started after ``t`` (their ``process_start``)."""
        return len(
            {
                (e["node"], e["rank"])
                for e in self.events()
                if e["event"] == "process_start" and e["t"] >= t and e["node"] in nodes
            }
        )

    def survivor_loads(
        self, run: NodeRun, start: tuple[float, dict[str, dict[str, int]]], end: dict[str, Any]
    ) -> dict[str, Any]:
        """Each survivor's bytes from its restarted workers' start to every rank's first step:
        its load's (issue 29: survivors read nothing twice). ``exact``: counted from before the
        first of their loads started (the harness looks once a second)."""
        t, before = start
        loads = [
            e["t"]
            for e in self.events()
            if e["event"] == "load_start" and e["t"] >= run.kill_t and e["node"] != run.lost
        ]
        return {
            "counted_from": t,
            "exact": bool(loads) and t <= min(loads),
            "bytes_per_node": {
                n: {s: end[n][s] - v for s, v in before[n].items()} for n in before if n != run.lost
            },
        }

    def step_files(self, step: int) -> dict[str, Any]:
        """The stored bytes of each file of the loaded step (a striped file's manifest object
        and stripes together): what a survivor's load may read, and the commit record."""
        return {
            "step": step,
            "files": self.helper(
                "step_files",
                {
                    "root": bench_e2e.ckpt_root(self.family),
                    "step": step,
                    "options": {"s3": self.c.services.storage_options()},
                },
            ),
        }

    def env_built(self, key: str) -> bool:
        """The node's ``bootseer run`` made its environment (raises when it could not)."""
        from bootseer.trace import read_traces

        for span in read_traces([self.traces / key])[0]:
            if span.phase == "environment":
                if span.outcome != "ok":
                    raise RuntimeError(
                        f"{key}: the environment could not be made:\n{tail(self.logs[key])}"
                    )
                return True
        return False

    def counters(self) -> dict[str, dict[str, int]]:
        """Every node's bytes from each origin and, where the cluster has a cache tier,
        through it (``registry-cache``, ``s3-cache``: the sweep's per-node cache field)."""
        names = [*SERVICES, *(f"{s}-cache" for s in self.cache_names())]
        return {n.name: {s: n.bytes_from(s) for s in names} for n in self.c.nodes}

    def cache_names(self) -> tuple[str, ...]:
        return tuple(self.c.cache.names) if getattr(self.c, "cache_tier", False) else ()

    def cache_origin(self) -> dict[str, int] | None:
        """What the cache tier fetched from the origins so far (None: no cache tier)."""
        names = self.cache_names()
        return {s: self.c.cache.origin_bytes(s) for s in names} if names else None

    def recorded(self) -> bool:
        return any(
            "recorded " in (n.logs / "snapshotter.log").read_text(errors="replace")
            for n in self.c.nodes
            if (n.logs / "snapshotter.log").exists()
        )

    # -- the scenario ------------------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        c, b = self.c, self.b
        self.prepare()
        log(f"{self.method}: first start on {b.nodes} fresh nodes")
        t0 = time.time()
        first_keys = []
        for i, node in enumerate(list(c.nodes)):  # bootseer: node0 builds the env snapshot
            self.pull(node)
            first_keys.append(self.start(node, first=True))
            if self.bootseer and i == 0:
                self.wait_for(
                    "node0's environment", lambda: self.env_built(first_keys[0]), first_keys
                )
        self.wait_for(
            "the first step",
            lambda: [e for e in self.events() if e["event"] == "first_step"],
            first_keys,
        )
        cold_s = time.time() - t0
        cold_bytes, cold_origin = self.counters(), self.cache_origin()  # the cold start's
        log(f"  every node started; first step {cold_s:.1f} s after the first pull")
        step = self.wait_for("a committed checkpoint", self.committed, first_keys)
        last = max(e["step"] for e in self.events() if e["event"] == "step")
        self.wait_for(
            "a step after the commit",
            lambda: any(e["event"] == "step" and e["step"] > last for e in self.events()),
            first_keys,
        )
        if self.method == "bootseer":  # the fresh node's pull prefetches the profile
            self.wait_for("a recorded image profile", self.recorded, first_keys)
        before, origin_before = self.counters(), self.cache_origin()
        lost_key = first_keys[b.lose]
        load_before = os.getloadavg()[0]
        try:
            run = self.restart_in_place(lost_key) if self.in_place else self.replace(lost_key)
            # the newest step committed at the loss (saves went on while the profile was
            # awaited; none commits without the lost node's ranks, and the restarted job
            # is seconds from its first save): what every rank must resume from
            step = self.committed() or step
            # the restart's bytes: from the loss to every rank's first step after it (the
            # training after it reads and writes for its own saves: not the restart's)
            ranks = b.ranks_per_node * b.nodes
            alive = [k for k in self.procs if k not in run.ended]
            survivors = [n.name for n in c.nodes if n.name != run.lost]
            # the survivors' load: counted from their restarted workers' start (the old
            # workers, and the commit of their last save, are gone by then) to the first step
            self.wait_for(
                "the survivors' restarted workers",
                lambda: (
                    self.started_since(run.kill_t, survivors) >= b.ranks_per_node * len(survivors)
                ),
                alive,
            )
            load_from = time.time(), self.counters()
            self.wait_for(
                "every rank's first step after the restart",
                lambda: (
                    len(
                        {
                            e["rank"]
                            for e in self.events()
                            if e["event"] == "first_step" and e["t"] >= run.kill_t
                        }
                    )
                    >= ranks
                ),
                alive,
            )
            at_first_step, origin_after = self.counters(), self.cache_origin()
            for key, proc in self.procs.items():
                if key in run.ended:
                    continue
                rc = proc.wait(timeout=STEP_TIMEOUT_S)
                if rc != 0:
                    raise RuntimeError(
                        f"{key}'s job exited {rc} after the restart:\n{tail(self.logs[key])}"
                    )
        finally:
            if self.copy is not None:
                self.copy.stop()
        if self.copy is not None:
            st = self.copy.status
            if not st.get("ok"):
                raise RuntimeError(f"the rclone copy failed: {st.get('error')}")
            run.copy = (st["started"], st["ended"], int(st.get("bytes", 0)))
        after = at_first_step
        before.update(self.warm_bytes)  # diy-warm: the pull before the clock is not counted
        run.bytes = {
            n: {
                s: after[n][s]
                - (0 if n in run.fresh_nodes and n not in self.warm_bytes else before[n][s])
                for s in v
            }
            for n, v in after.items()
        }
        out = self.results_for(run, cold_s, step)
        out["cache"] = (
            None
            if origin_after is None or origin_before is None
            else {"origin_bytes": {k: v - origin_before[k] for k, v in origin_after.items()}}
        )
        out["first_start"] = {"bytes_per_node": cold_bytes, "cache_origin_bytes": cold_origin}
        out["survivor_loads"] = self.survivor_loads(run, load_from, at_first_step)
        out["checkpoint"] = self.step_files(step) if self.bootseer else None
        out["loadavg_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
        if self.copy is not None:
            st = self.copy.status
            out["checkpoint_copy"] = {
                "tool": "rclone",
                "argv": st.get("argv"),
                "ok": st.get("ok"),
                "step": st.get("step"),
                "bytes": st.get("bytes"),
                "seconds": st.get("seconds"),
                "started_after_loss_s": st["started"] - run.kill_t,
                "ended_after_loss_s": st["ended"] - run.kill_t,
            }
        return out

    def replace(self, lost_key: str) -> NodeRun:
        """The node is lost and a fresh one takes its place; diy-warm pulls the image onto it
        before the clock starts (the clock then starts when the job is given the node)."""
        c, b = self.c, self.b
        kill_t = time.time()
        c.kill_node(b.lose)
        self.procs[lost_key].wait(timeout=60)
        fresh = c.replace_node(b.lose)
        replaced_t = time.time()
        log(f"  node{b.lose} lost, replaced in {replaced_t - kill_t:.1f} s")
        pulled: tuple[float, float] | None = None
        if self.method == "diy-warm":
            self.pull(fresh)
            self.warm_bytes[fresh.name] = self.counters()[fresh.name]
            log(
                f"  diy-warm: the image pulled onto the fresh node before the clock "
                f"({time.time() - kill_t:.1f} s after the loss)"
            )
            kill_t = time.time()  # the clock: the fresh node, image on it, joins the job
        if self.diy:
            self.start_copy(fresh)  # beside the pull and the container start
        if self.method != "diy-warm":
            pulled = self.pull(fresh)
        fresh_key = self.start(fresh, first=False)
        return NodeRun(
            method=self.method,
            kill_t=kill_t,
            replaced_t=replaced_t if pulled else None,
            lost=fresh.name,
            pull=pulled,
            trace_dir=self.traces / fresh_key if self.bootseer else None,
            ended={lost_key},
            fresh_nodes={fresh.name},
        )

    def restart_in_place(self, lost_key: str) -> NodeRun:
        """The lost node's job processes get SIGKILL; the node restarts them: ``bootseer
        run`` its torchrun (its own restart), the baselines a new container of the same
        image (as a container runtime restarts a failed container: the image and the node's
        disk kept, a fresh root filesystem)."""
        node = self.c.nodes[self.b.lose]
        kill_t = time.time()
        killed = self.kill_in_place(lost_key)
        log(f"  node{self.b.lose}: SIGKILL to {killed} processes of the job, restarted in place")
        if self.bootseer:
            return NodeRun(
                method=self.method,
                kill_t=kill_t,
                replaced_t=None,
                lost=node.name,
                pull=None,
                trace_dir=self.traces / lost_key,
                in_place=True,
            )
        self.procs[lost_key].wait(timeout=60)
        restart_t = time.time()
        if self.diy:
            self.start_copy(node)
        self.start(node, first=False, key=f"{lost_key}.r1")
        return NodeRun(
            method=self.method,
            kill_t=kill_t,
            replaced_t=None,
            lost=node.name,
            pull=None,
            in_place=True,
            restart_t=restart_t,
            ended={lost_key},
        )

    def results_for(self, run: NodeRun, cold_s: float, step: int) -> dict[str, Any]:
        events = self.events()
        spans = harness_spans(run, events)
        report_dir = self.b.results_dir / f"{SUITE}-report" / self.method
        shutil.rmtree(report_dir, ignore_errors=True)
        report_dir.mkdir(parents=True)
        with open(report_dir / "harness.jsonl", "w") as f:
            f.writelines(s.to_json() + "\n" for s in spans)
        subprocess.run(
            [sys.executable, "-m", "bootseer", "report", str(report_dir)],
            check=True,
            capture_output=True,
            env=bp.clean_env(),
        )
        report = json.loads((report_dir / "report.json").read_text())
        out = summarize(report, run, rank_totals(run, events), spans)
        out["identical"] = check_identical(events, run.kill_t)
        out["loads"] = restart_loads(events, run.kill_t)
        out["bit_identical"] = out["identical"]["ok"]
        if not out["bit_identical"]:
            self.b.errors.append(f"{self.method}: resumed state differs: {out['identical']}")
        out.update(
            cold_start_s=cold_s,
            committed_step=step,
            report_dir=str(report_dir),
            node_replace_s=None if run.replaced_t is None else run.replaced_t - run.kill_t,
        )
        s = out["summary"]
        log(
            f"  {self.method}: p50 {s['p50_s']:.1f} s, p90 {s['p90_s']:.1f} s, max "
            f"{s['max_s']:.1f} s; critical path {s['straggler']} ({s['why']}); paced by "
            f"{s['paced_by']} ({s['paced_why']})"
        )
        return out


def restart_loads(events: list[dict[str, Any]], kill_t: float) -> dict[str, dict[str, Any]]:
    """Per rank, what its load after the loss read (``load_end``: the step, bytes from the
    store, bytes from the node's checkpoint cache): whether a survivor read its own state
    twice shows here (issue 29, survivors read nothing twice)."""
    loads: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("event") == "load_end" and e.get("t", 0) >= kill_t:
            loads[f"r{e.get('rank')}"] = {
                k: e.get(k) for k in ("step", "bytes", "cached_bytes", "cache_wait_s")
            }
    return loads


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


# -- helpers run on the services host ------------------------------------------------------------
def helper(name: str, params: dict[str, Any]) -> int:
    if name == "push":
        digest = e2e_image.push_image(
            params["registry"], params["repo"], params["tag"], params["layers"], params["config"]
        )
        print(json.dumps({"manifest": digest}))
    elif name == "convert":
        from prefetch.image import convert_image

        def convert() -> dict[str, Any]:
            r = convert_image(params["src"], params["dst"], workdir=params["workdir"])
            return {
                "digest": r.digest,
                "size_before": r.size_before,
                "size_after": r.size_after,
                "seconds": r.seconds,
            }

        print(
            json.dumps(
                e2e_cache.convert_cached(
                    Path(params["cache"]), params["src"], params["dst"], convert
                )
            )
        )
    elif name == "committed":
        if params["root"] != "ckpt/bootseer":  # DCP's (baseline, diy)
            import fsspec
            from e2e_train import dcp_latest

            fs = fsspec.filesystem("s3", skip_instance_cache=True, **params["options"]["s3"])
            print(json.dumps({"step": dcp_latest(fs, params["root"])}))
        else:
            from ckpt import CheckpointManager

            mgr = CheckpointManager(
                "s3://ckpt/bootseer", storage_options=params["options"], cache_dir=False
            )
            try:
                print(json.dumps({"step": mgr.latest()}))
            finally:
                mgr.close()
    elif name == "step_files":
        print(json.dumps(step_files(params["root"], params["step"], params["options"])))
    else:
        raise SystemExit(f"unknown helper {name}")
    return 0


def step_files(root: str, step: int, options: dict[str, Any]) -> dict[str, int]:
    """``{file: stored bytes}`` of step ``step`` under ``root`` on S3: a striped file's
    manifest object (``rank-0.data``) and its stripes (``.rank-0.data.stripes/...``) counted
    as one file."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options["s3"])
    base = f"{root.rstrip('/')}/step-{step}/"
    files: dict[str, int] = {}
    for path, info in fs.find(base, detail=True).items():
        first = path[len(base) :].split("/", 1)[0]
        name = first[1 : -len(".stripes")] if first.endswith(".stripes") else first
        files[name] = files.get(name, 0) + int(info.get("size") or 0)
    return dict(sorted(files.items()))


def add_scenario_arguments(
    parser: argparse.ArgumentParser, *, methods: str, ranks_per_node: int
) -> None:
    """The options of the scenario, shared by ``--nodes`` and ``--sweep``."""
    parser.add_argument("--lose", type=int, default=None, help="the node lost (default the last)")
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="the tiny model")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--base", choices=("auto", "debootstrap", "host"), default=None)
    parser.add_argument("--cache", default=None, help="default ~/.cache/bootseer-bench")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--cache-tier",
        action="store_true",
        help="nodes read the registry and S3 through the cluster's cache tier "
        "(nginx proxy_cache + slice): containerd and the snapshotter list "
        "it as a mirror in hosts.toml, bootseer's stripes come from it "
        "(striped's mirror), the origin as the fallback",
    )
    parser.add_argument("--methods", default=methods, help=f"default {methods}")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=ranks_per_node,
        help=f"torchrun's --nproc-per-node on every node (default {ranks_per_node})",
    )


def run_checked(parser: argparse.ArgumentParser, args: argparse.Namespace, make: Any) -> int:
    """The methods checked, the bench made (a ValueError is the user's: exit 2), run."""
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))} (of {', '.join(METHODS)})")
    try:
        bench = make(args)
    except ValueError as exc:
        parser.error(str(exc))
    return run_bench(bench, done_key="done")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--helper"]:
        return helper(argv[1], json.loads(argv[2]))
    if argv[:1] == ["--render"]:  # the report again, from a run's e2e-nodes.json
        print("\n".join(render(json.loads(Path(argv[1]).read_text()))))
        return 0
    parser = argparse.ArgumentParser(
        prog="bench_e2e.py --nodes N", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nodes", type=int, required=True)
    add_scenario_arguments(parser, methods=",".join(METHODS), ranks_per_node=2)
    return run_checked(parser, parser.parse_args(argv), NodesBench)


if __name__ == "__main__":
    sys.exit(main())
