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
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefetch as bp  # noqa: E402
import e2e_image  # noqa: E402
from _common import command_line, download_wheels, log, md_table, mem_total, run_bench  # noqa: E402
from e2e_nodes_spans import (  # noqa: E402
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
METHODS = ("bootseer", "baseline")


class NodesBench:
    """One cluster per method; the results in ``R`` (``e2e-nodes.json``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = bool(args.quick)
        self.size = "quick" if self.quick else "full"
        self.model = MODEL[self.size]
        self.nodes = int(args.nodes)
        if not 2 <= self.nodes <= 8:
            raise ValueError(f"--nodes {self.nodes}: the scenario needs 2 to 8 nodes (a node "
                             "is lost and the others wait for its replacement)")
        self.lose = self.nodes - 1 if args.lose is None else int(args.lose)
        if not 0 <= self.lose < self.nodes:
            raise ValueError(f"--lose {self.lose}: choose a node from 0 to {self.nodes - 1}")
        self.cache = Path(args.cache or os.environ.get("BOOTSEER_BENCH_CACHE")
                          or Path.home() / ".cache" / "bootseer-bench").expanduser().resolve()
        self.work = self.cache / f"e2e-nodes-run-{uuid.uuid4().hex[:8]}"  # private to this run
        self.results_dir = Path(args.results).resolve()
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.R: dict[str, Any] = {
            "suite": SUITE, "quick": self.quick, "nodes": self.nodes, "ranks_per_node": 2,
            "lost_node": f"node{self.lose}", "model": self.model,
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": command_line("bench_e2e.py"),
            "machine": {"cpus": os.cpu_count(), "ram_bytes": mem_total(),
                        "platform": platform.platform(), "python": platform.python_version(),
                        "containerd": bp.version_of(["containerd", "--version"])},
            "links": {"node": {"rate": NODE_LINK[0], "delay_ms": NODE_LINK[1]},
                      "services": {"rate": SERVICE_LINK}},
            "runs": {}, "warnings": [], "errors": self.errors,
        }

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("needs root: network namespaces, containerd, runc, FUSE")
        self.work.mkdir(parents=True)
        self.stack.callback(self.cleanup)
        self.R["image"] = e2e_image.training_layers(
            self.cache, self.work, self.args.base or ("host" if self.quick else "auto"))
        self.layers = self.R["image"]["layers"]
        self.wheels = download_wheels(self.cache / "wheels-e2e", [TORCH])

    def cleanup(self) -> None:
        if self.args.keep:
            log(f"kept {self.work}")
        elif self.work.name.startswith("e2e-nodes-run-") and self.work.parent == self.cache:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- one method ------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        for method in self.args.methods.split(","):
            try:
                self.R["runs"][method] = self.run_method(method)
            except Exception as exc:  # noqa: BLE001 - the other method still runs
                self.errors.append(f"{method}: {type(exc).__name__}: {exc}")
                log(f"{method} failed: {exc}")

    def run_method(self, method: str) -> dict[str, Any]:
        from bootseer.testing.cluster import Cluster, Link

        bootseer = method == "bootseer"
        cluster = Cluster(self.nodes, link=Link(rate=NODE_LINK[0], delay_ms=NODE_LINK[1]),
                          service_link=Link(rate=SERVICE_LINK), containerd=True,
                          snapshotter=bootseer, snapshotter_args=("--record-timeout", "1200"),
                          disk_size="6g" if not bootseer else "3g", workdir=self.work)
        log(f"{method}: starting {self.nodes} nodes")
        with cluster as c:
            run = MethodRun(self, c, method)
            return run.execute()

    # -- the report ------------------------------------------------------------------------------
    def report(self) -> None:
        runs = self.R["runs"]
        lines = [f"# end-to-end restart on {self.nodes} nodes ({self.size} scenario)", "",
                 f"- command: `{self.R['command']}`",
                 f"- machine: {self.R['machine']['cpus']} CPUs, "
                 f"{self.R['machine']['ram_bytes'] / 2**30:.1f} GiB RAM, "
                 f"{self.R['machine']['containerd']}; every node, its containerd and its ranks "
                 "share these CPUs",
                 f"- job: FSDP2 over gloo, {self.nodes} nodes x 2 ranks, model "
                 f"`{self.model}` ({state_text(self.model)}); node{self.lose} lost "
                 "(SIGKILL to all its processes) after a commit, replaced by a fresh node",
                 f"- links: each node {NODE_LINK[0]} ({NODE_LINK[1]:g} ms to the services), "
                 f"the services host {SERVICE_LINK} shared", ""]
        head = ["method", "p50 (ranks)", "p90", "max (job back)", "critical path ends on",
                "its split", "paced by (waited for)", "its phases before the rendezvous",
                "registry MB", "S3 MB", "index MB", "bit-identical"]
        rows = []
        for m, r in runs.items():
            s = r["summary"]
            rows.append([m, f"{s['p50_s']:.1f} s", f"{s['p90_s']:.1f} s", f"{s['max_s']:.1f} s",
                         s["straggler"], s["why"], s["paced_by"], s["paced_why"],
                         *[f"{r['bytes_total'].get(k, 0) / 1e6:.1f}"
                           for k in ("registry", "s3", "index")],
                         "yes" if r["bit_identical"] else "NO"])
        lines += md_table(head, rows) + [""]
        if "bootseer" in runs and "baseline" in runs:
            b, o = runs["baseline"]["summary"]["max_s"], runs["bootseer"]["summary"]["max_s"]
            self.R["reduction"] = 1 - o / b
            lines += [f"bootseer: job back {o:.1f} s after the loss vs baseline {b:.1f} s: "
                      f"{1 - o / b:.0%} less", ""]
        for m, r in runs.items():
            lines += [f"## {m}: per node (seconds from the loss; the node's slowest rank)", ""]
            phases = sorted({p for n in r["per_node"].values() for p in n["phases"]},
                            key=phase_order)
            lines += md_table(["node", "back at", *phases, "registry MB", "S3 MB", "index MB"],
                              [[n, f"{v['first_step_s']:.1f}",
                                *[f"{v['phases'].get(p, 0.0):.1f}" for p in phases],
                                *[f"{v['bytes'].get(k, 0) / 1e6:.1f}"
                                  for k in ("registry", "s3", "index")]]
                               for n, v in r["per_node"].items()])
            lines += ["", f"- bootseer report: {r['report_dir']}", ""]
        lines += [f"- WARNING: {w}" for w in self.R["warnings"]]
        lines += [f"- ERROR: {e}" for e in self.errors]
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        self.R["done"] = True
        print("\n".join(lines))
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / f"{SUITE}.md").write_text("\n".join(lines) + "\n")
        self.write_files()

    def write_files(self) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / f"{SUITE}.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n")


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
    """One method on one cluster: first start, loss, replacement, restart, results."""

    def __init__(self, bench: NodesBench, cluster: Any, method: str) -> None:
        self.b = bench
        self.c = cluster
        self.method = method
        self.bootseer = method == "bootseer"
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

    # -- services ----------------------------------------------------------------------------------
    def helper(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """A helper run on the services host (its loopback reaches the registry and S3
        directly, uncounted: set-up and checks are not a node's traffic)."""
        out = self.c.services.run([sys.executable, str(Path(__file__).resolve()), "--helper",
                                   name, json.dumps(params)], timeout=3600,
                                  env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        return json.loads(out.stdout.strip().splitlines()[-1])

    def prepare(self) -> None:
        c = self.c
        for bucket in ("ckpt", "envs"):
            c.services.create_bucket(bucket)
        host = c.services.registry_host
        self.helper("push", {"registry": host, "repo": self.repo, "tag": "gzip",
                             "layers": self.b.layers,
                             "config": e2e_image.image_config(self.b.layers)})
        self.ref = f"{host}/{self.repo}:gzip"
        if self.bootseer:
            self.b.R.setdefault("conversion", self.helper("convert", {
                "src": self.ref, "dst": f"{host}/{self.repo}:lazy",
                "workdir": str(self.work)}))
            self.ref = f"{host}/{self.repo}:lazy"
        c.services.index_dir.mkdir(parents=True, exist_ok=True)  # torch for pip and uv
        for wheel in self.b.wheels:
            shutil.copy2(wheel, c.services.index_dir / wheel.name)
        (self.job / "requirements.txt").write_text(f"--index-url {c.services.index_url}\n"
                                                   f"{TORCH}\n")
        for i in range(self.b.nodes):
            (self.job / f"bootseer-node{i}.toml").write_text(
                '[run]\ntrace_dir = "/var/log/bootseer/trace"\n\n'
                '[restart]\nmax_restarts = 0\n\n'
                '[env]\nspec = ["/job/requirements.txt"]\nprefix = "/opt/env"\n'
                'store = "s3://envs/e2e"\n\n'
                '[ckpt]\nurl = "s3://ckpt/bootseer"\ncache_dir = "/var/cache/bootseer/ckpt"\n'
                f'ranks = "{2 * i}-{2 * i + 1}"\n')

    # -- nodes ---------------------------------------------------------------------------------------
    def pull(self, node: Any) -> tuple[float, float]:
        t = time.time()
        if self.bootseer:
            node.run([sys.executable, "-m", "bootseer", "image", "pull", self.ref, "--address",
                      node.containerd.address, "--namespace", node.containerd.namespace],
                     timeout=STEP_TIMEOUT_S)
        else:
            node.run(["ctr", "--address", node.containerd.address, "--namespace",
                      node.containerd.namespace, "images", "pull", "--plain-http", self.ref],
                     timeout=STEP_TIMEOUT_S)
        return t, time.time()

    def start(self, node: Any, first: bool) -> None:
        """``ctr run`` the job's container on ``node`` (in the background)."""
        key = f"{node.name}.g{node.generation}"
        trace = self.traces / key
        trace.mkdir()
        cache = node.dirs.cache / "ckpt"
        cache.mkdir(exist_ok=True)
        opts = node.torchrun([], nnodes=f"{self.b.nodes}:{self.b.nodes}", nproc_per_node=2,
                             rdzv_id=f"e2e-{self.method}", python="python")
        opts = opts[opts.index("torch.distributed.run") + 1:]  # torchrun's own options
        train = ["--mode", "bootseer" if self.bootseer else "dcp", "--size", self.b.model,
                 "--results", "/results", "--ckpt",
                 "s3://ckpt/bootseer" if self.bootseer else "s3://ckpt/dcp"]
        if first:
            train += ["--save-every", str(self.b.args.save_every)]
        env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": self.c.services.storage_options()}),
               "BOOTSEER_E2E_TAG": f"{self.method}-{key}", "BOOTSEER_E2E_NODE": node.name,
               "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "eth0",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if self.bootseer:
            cmd = ["python3", "-m", "bootseer", "run", "--config",
                   f"/job/bootseer-{node.name}.toml", "--node", node.name, "--", "python", "-m",
                   "torch.distributed.run", *opts, "/app/train.py", "train", *train]
            snapshotter = "bootseer"
        else:
            env["BOOTSEER_E2E_TORCHRUN"] = json.dumps(opts)
            cmd = ["python3", "/app/train.py", "launch", "--requirements",
                   "/job/requirements.txt", "--results", "/results", "--", *train]
            snapshotter = "overlayfs"
        mounts = [(self.job, "/job", "ro"), (self.results, "/results", "rw"),
                  (cache, "/var/cache/bootseer/ckpt", "rw"),
                  (trace, "/var/log/bootseer/trace", "rw")]
        argv = ["ctr", "--address", node.containerd.address, "--namespace",
                node.containerd.namespace, "run", "--rm", "--net-host", "--snapshotter",
                snapshotter,
                *[a for src, dst, mode in mounts for a in (
                    "--mount", f"type=bind,src={src},dst={dst},options=rbind:{mode}")],
                *[a for k, v in env.items() for a in ("--env", f"{k}={v}")],
                self.ref, f"job-{key}", *cmd]
        self.logs[key] = self.work / f"{key}.log"
        with open(self.logs[key], "ab") as logf:
            self.procs[key] = node.popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=logf)

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
                    raise RuntimeError(f"{key}'s job ended (exit {self.procs[key].returncode}) "
                                       f"before {what}:\n{tail(self.logs[key])}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(1.0)

    def committed(self) -> int | None:
        return self.helper("committed", {"method": self.method,
                                         "options": {"s3": self.c.services.storage_options()}}
                           )["step"]

    def env_built(self, key: str) -> bool:
        """The node's ``bootseer run`` made its environment (raises when it could not)."""
        from bootseer.trace import read_traces

        for span in read_traces([self.traces / key])[0]:
            if span.phase == "environment":
                if span.outcome != "ok":
                    raise RuntimeError(f"{key}: the environment could not be made:\n"
                                       f"{tail(self.logs[key])}")
                return True
        return False

    def recorded(self) -> bool:
        return any("recorded " in (n.logs / "snapshotter.log").read_text(errors="replace")
                   for n in self.c.nodes if (n.logs / "snapshotter.log").exists())

    # -- the scenario ------------------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        c, b = self.c, self.b
        self.prepare()
        log(f"{self.method}: first start on {b.nodes} fresh nodes")
        t0 = time.time()
        first_keys = []
        for i, node in enumerate(list(c.nodes)):  # bootseer: node0 builds the env snapshot
            self.pull(node)
            self.start(node, first=True)
            first_keys.append(f"{node.name}.g{node.generation}")
            if self.bootseer and i == 0:
                self.wait_for("node0's environment", lambda: self.env_built(first_keys[0]),
                              first_keys)
        self.wait_for("the first step", lambda: [
            e for e in self.events() if e["event"] == "first_step"], first_keys)
        cold_s = time.time() - t0
        log(f"  every node started; first step {cold_s:.1f} s after the first pull")
        step = self.wait_for("a committed checkpoint", self.committed, first_keys)
        last = max(e["step"] for e in self.events() if e["event"] == "step")
        self.wait_for("a step after the commit", lambda: any(
            e["event"] == "step" and e["step"] > last for e in self.events()), first_keys)
        if self.bootseer:
            self.wait_for("a recorded image profile", self.recorded, first_keys)
        before = {n.name: {s: n.bytes_from(s) for s in ("registry", "s3", "index")}
                  for n in c.nodes}
        lost_key = f"node{b.lose}.g{c.nodes[b.lose].generation}"
        kill_t = time.time()
        c.kill_node(b.lose)
        self.procs[lost_key].wait(timeout=60)
        fresh = c.replace_node(b.lose)
        replaced_t = time.time()
        log(f"  step {step} committed; node{b.lose} lost, replaced in {replaced_t - kill_t:.1f} s")
        pulled = self.pull(fresh)
        self.start(fresh, first=False)
        fresh_key = f"{fresh.name}.g{fresh.generation}"
        for key, proc in self.procs.items():
            if key == lost_key:
                continue
            rc = proc.wait(timeout=STEP_TIMEOUT_S)
            if rc != 0:
                raise RuntimeError(f"{key}'s job exited {rc} after the restart:\n"
                                   f"{tail(self.logs[key])}")
        after = {n.name: {s: n.bytes_from(s) for s in ("registry", "s3", "index")}
                 for n in c.nodes}
        nbytes = {n: {s: after[n][s] - (0 if n == fresh.name else before[n][s]) for s in v}
                  for n, v in after.items()}
        return self.results_for(NodeRun(
            method=self.method, kill_t=kill_t, replaced_t=replaced_t, lost=fresh.name,
            pull=pulled, bytes=nbytes,
            trace_dir=self.traces / fresh_key if self.bootseer else None), cold_s, step)

    def results_for(self, run: NodeRun, cold_s: float, step: int) -> dict[str, Any]:
        events = self.events()
        spans = harness_spans(run, events)
        report_dir = self.b.results_dir / f"{SUITE}-report" / self.method
        shutil.rmtree(report_dir, ignore_errors=True)
        report_dir.mkdir(parents=True)
        with open(report_dir / "harness.jsonl", "w") as f:
            f.writelines(s.to_json() + "\n" for s in spans)
        subprocess.run([sys.executable, "-m", "bootseer", "report", str(report_dir)],
                       check=True, capture_output=True, env=bp.clean_env())
        report = json.loads((report_dir / "report.json").read_text())
        out = summarize(report, run, rank_totals(run, events), spans)
        out["identical"] = check_identical(events, run.kill_t)
        out["bit_identical"] = out["identical"]["ok"]
        if not out["bit_identical"]:
            self.b.errors.append(f"{self.method}: resumed state differs: {out['identical']}")
        out.update(cold_start_s=cold_s, committed_step=step, report_dir=str(report_dir),
                   node_replace_s=run.replaced_t - run.kill_t)
        s = out["summary"]
        log(f"  {self.method}: p50 {s['p50_s']:.1f} s, p90 {s['p90_s']:.1f} s, max "
            f"{s['max_s']:.1f} s; critical path {s['straggler']} ({s['why']}); paced by "
            f"{s['paced_by']} ({s['paced_why']})")
        return out


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


# -- helpers run on the services host ------------------------------------------------------------
def helper(name: str, params: dict[str, Any]) -> int:
    if name == "push":
        digest = e2e_image.push_image(params["registry"], params["repo"], params["tag"],
                                      params["layers"], params["config"])
        print(json.dumps({"manifest": digest}))
    elif name == "convert":
        from prefetch.image import convert_image

        r = convert_image(params["src"], params["dst"], workdir=params["workdir"])
        print(json.dumps({"digest": r.digest, "size_before": r.size_before,
                          "size_after": r.size_after, "seconds": r.seconds}))
    elif name == "committed":
        if params["method"] == "baseline":
            import fsspec
            from e2e_train import dcp_latest

            fs = fsspec.filesystem("s3", skip_instance_cache=True, **params["options"]["s3"])
            print(json.dumps({"step": dcp_latest(fs, "ckpt/dcp")}))
        else:
            from ckpt import CheckpointManager

            mgr = CheckpointManager("s3://ckpt/bootseer", storage_options=params["options"],
                                    cache_dir=False)
            try:
                print(json.dumps({"step": mgr.latest()}))
            finally:
                mgr.close()
    else:
        raise SystemExit(f"unknown helper {name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--helper"]:
        return helper(argv[1], json.loads(argv[2]))
    parser = argparse.ArgumentParser(prog="bench_e2e.py --nodes N",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--lose", type=int, default=None, help="the node lost (default the last)")
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="the tiny model")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--base", choices=("auto", "debootstrap", "host"), default=None)
    parser.add_argument("--cache", default=None, help="default ~/.cache/bootseer-bench")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))} (of {', '.join(METHODS)})")
    try:
        bench = NodesBench(args)
    except ValueError as exc:
        parser.error(str(exc))
    return run_bench(bench, done_key="done")


if __name__ == "__main__":
    sys.exit(main())
