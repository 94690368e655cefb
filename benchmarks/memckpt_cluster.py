"""The memory tier's recovery trials on the cluster fixture (``bench_memckpt.py``'s part).

Two nodes of ``bootseer.testing.cluster`` (network namespaces with their own addresses and
disks; S3 on the services host behind the nodes' links), one rank each. On every node a real
agent, ``bootseer run --ckpt-memory`` with its memory directory on the node's disk and its
peer server on the node's address (``--ckpt-memory-listen ADDR:7070``, the job's token in
``BOOTSEER_MEMCKPT_TOKEN``), runs ``torchrun`` (static rendezvous, ``--node-rank`` = the
node's index, so rank i is on node i in every phase) of ``memckpt_train.py``:

* ``train``: memory every step, durable every ``interval``; every rank SIGKILLs itself in the
  last step (the step in progress is lost), the agents exit;
* ``load-local``: both agents started again on the same nodes (in-place restart): each rank
  loads from its own node's memory;
* ``load-peer``: node1 replaced by an empty node (``Cluster.replace_node``): rank 1 loads from
  node0's agent over the cluster's network;
* ``load-durable``: both nodes replaced: the durable tier from S3 over the nodes' links.

Each phase's seconds: the load call, and from the agents' start to the state loaded.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("memckpt_train.py")
ROOT = Path(__file__).resolve().parents[1]
PEER_PORT, MASTER_PORT = 7070, 29517
# The nodes' links are the veths' own speed (the job's fabric); S3's host has 800 Mbit/s
# (100 MB/s, the loopback trials' total): a remote store slower than the fabric, as in a
# cluster. tc cannot cap each connection (the loopback trials' 10 MB/s per connection).
NODE_LINK, SERVICE_LINK = None, "800mbit"


def _job(
    c: Any,
    cfg: dict[str, Any],
    phase: str,
    spec: dict[str, Any],
    out: Path,
    token: str,
    log: Callable[[str], None],
    name: str = "",
) -> dict[str, Any]:
    """One job on every node under its agent; the ranks' results (``{name}-{r}.json``,
    written by ``memckpt_train.py``; ``name`` defaults to the phase)."""
    from ckpt.memory_peer import TOKEN_ENV

    full = {**cfg, **spec, "phase": phase, "out_dir": str(out), "from_env": True}
    started = time.time()
    procs = []
    for i, n in enumerate(c.nodes):
        argv = [
            sys.executable,
            "-m",
            "bootseer",
            "run",
            "--trace-dir",
            str(n.dirs.logs / f"trace-{phase}"),
            "--max-restarts",
            "0",
            "--backoff",
            "0",
            "--ckpt-memory",
            "--ckpt-memory-dir",
            str(n.dirs.disk / "memckpt"),
            "--ckpt-memory-listen",
            f"{n.address}:{PEER_PORT}",
            "--ckpt-durable-every",
            str(cfg["interval"]),
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(c.nodes)),
            "--node-rank",
            str(i),
            "--nproc-per-node",
            "1",
            "--master-addr",
            c.nodes[0].address,
            "--master-port",
            str(MASTER_PORT),
            "--max-restarts",
            "0",
            str(WORKER),
            json.dumps(full),
        ]
        with open(n.dirs.logs / f"{phase}.log", "wb") as f:
            procs.append(
                n.popen(
                    argv,
                    env={TOKEN_ENV: token, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
    codes = [p.wait(1800) for p in procs]
    log(f"  {phase}: agents exited {codes}")
    got: dict[str, Any] = {"codes": codes, "started": started}
    for rank in range(len(c.nodes)):
        path = out / f"{name or phase}-{rank}.json"
        if not path.exists():
            tail = (c.nodes[rank].dirs.logs / f"{phase}.log").read_text(errors="replace")
            raise RuntimeError(
                f"cluster {phase}: rank {rank} wrote no results; node "
                f"{rank}'s agent log ends:\n{tail[-3000:]}"
            )
        got[str(rank)] = json.loads(path.read_text())
    return got


def cluster_trials(cfg: dict[str, Any], work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Train, kill, then recover in place, from the peer and from S3 on the cluster fixture."""
    from bootseer.testing.cluster import Cluster, Link

    state_mb = cfg["layers"] * (cfg["d"] * cfg["d"] + cfg["d"]) * 4 * 3 / 1e6
    disk = f"{max(256, int(state_mb * 5) + 128)}m"  # 2 own copies + 2 of the peer's
    out = work / "cluster-out"
    out.mkdir(parents=True)
    token = secrets.token_hex(32)
    result: dict[str, Any] = {
        "link": f"nodes {NODE_LINK or 'unshaped (veth)'}, S3 host {SERVICE_LINK}",
        "disk": disk,
    }
    with Cluster(
        2,
        link=Link(rate=NODE_LINK),
        service_link=Link(rate=SERVICE_LINK),
        services=("s3", "rendezvous"),
        disk_size=disk,
        workdir=work,
    ) as c:
        c.services.create_bucket("memckpt")
        base = {
            "storage_options": {"s3": c.services.storage_options()},
            "durable": "striped::s3://memckpt/run",
        }
        kill_at = cfg["steps"] - 1
        log(
            f"cluster: 2 nodes, links {result['link']}, disks {disk}; train {cfg['steps']} steps, "
            f"SIGKILL in step {kill_at}"
        )
        train = _job(
            c,
            cfg,
            "train",
            {
                **base,
                "mode": "train",
                "variants": ["memory"],
                "kill_at": kill_at,
                "rounds": 0,
            },  # no overhead here
            out,
            token,
            log,
            "train-memory",
        )
        result["train"] = train
        result["prints"] = {str(r): train[str(r)]["prints"] for r in range(2)}
        spec = {**base, "mode": "load", "durable": f"{base['durable']}/memory"}  # train's
        log("cluster: load-local (both agents restarted in place)")
        result["local"] = _job(c, cfg, "load-local", spec, out, token, log)
        log("cluster: load-peer (node1 replaced by an empty node)")
        c.replace_node(1)
        result["peer"] = _job(c, cfg, "load-peer", spec, out, token, log)
        log("cluster: load-durable (both nodes replaced)")
        c.replace_node(0)
        c.replace_node(1)
        result["durable"] = _job(c, cfg, "load-durable", spec, out, token, log)
        result["kill_at"] = kill_at
    return result


def cluster_rows(
    res: dict[str, Any], verdict: Callable[[bool], str], target_peer: float
) -> list[list[str]]:
    """The table rows of the cluster trials."""
    rows = []
    kill_at = res["kill_at"]
    loads = {}
    for where in ("local", "peer", "durable"):
        ranks = [res[where][str(r)] for r in range(2)]
        load_s = max(r["load_s"] for r in ranks)
        total = max(r["loaded_at"] - res[where]["started"] for r in ranks)
        step = ranks[0]["step"]
        same = all(r["step"] == step for r in ranks)
        exact = all(r["print"] == res["prints"][str(r["rank"])][str(step)] for r in ranks)
        lost = kill_at - 1 - step
        sources = ",".join(r["source"].split(":")[0] for r in ranks)
        loads[where] = load_s
        ok = same and exact and (lost == 0 or where == "durable")
        rows.append(
            [
                f"cluster: recovery {where} (ranks 0,1 from {sources}): load / agents' "
                "start to loaded",
                f"{load_s:.3f} s / {total:.2f} s",
                f"step {step}, {lost} step(s) lost beyond the one in progress"
                + ("" if same and exact else " (STATE MISMATCH)"),
                "0 steps lost" if where != "durable" else "-",
                verdict(ok),
            ]
        )
    rows += push_rows([{**res["train"][str(r)], "kill_at": kill_at} for r in range(2)], "cluster")
    ratio = loads["durable"] / loads["peer"]
    rows.append(
        [
            "cluster: durable load / peer load",
            f"{ratio:.1f}x",
            f"durable {loads['durable']:.2f} s, peer {loads['peer']:.3f} s; links: {res['link']}",
            f">= {target_peer}x",
            verdict(ratio >= target_peer),
        ]
    )
    return rows


def push_rows(ranks: list[dict[str, Any]], where: str) -> list[list[str]]:
    """What each rank's peer held at the kill (``memckpt_train.py`` records its pushes): the
    acked step, a push in flight, and push time against step time (the window in which a
    lost node loses the newest step)."""
    import statistics

    rows = []
    for r in ranks:
        pushes = r.get("pushes") or []
        if not pushes:
            continue
        kill, state = r["killed_at"], r["push_state"]
        done = [p for p in pushes if "end" in p]
        push_s = statistics.median(p["end"] - p["start"] for p in done) if done else 0.0
        lag = statistics.median(p["end"] - p["committed"] for p in done) if done else 0.0
        last = pushes[-1]
        flight = state.get("in_flight")
        margin = (
            f"step {last['step']}'s push ended {kill - last['end']:.3f} s before the kill"
            if "end" in last
            else f"step {last['step']}'s push in flight at the kill "
            f"(started {kill - last.get('start', kill):.3f} s before it)"
        )
        step_s = statistics.median(r["step_s"][1:]) if len(r["step_s"]) > 1 else 0.0
        rows.append(
            [
                f"{where}: rank {r['rank']}'s peer at the kill (in step {r['kill_at']})",
                f"acked step {state.get('acked')}; in flight: "
                f"{flight['step'] if flight else 'none'}",
                f"{margin}; push median {push_s:.3f} s (commit to acked {lag:.3f} s) on a "
                f"step of {step_s:.3f} s; the "
                f"training thread waited {r.get('push_wait_s', 0.0):.3f} s in all for "
                "pushes",
                "acked = the step before the kill",
                "info",
            ]
        )
    return rows
