"""Warm standby and elastic membership on the cluster fixture (2 job nodes + 1 standby, one
rank each, a small model): a lost node replaced by a standby that was warmed and parked at the
rendezvous before the loss; an elastic job (``--nnodes 1:2``) that shrinks, goes on, and grows
back; an evicted standby refused by name. One cluster for the module (CI time); each test has
its own bucket, rendezvous id and output directory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cluster import JOB, _read, _wait_for

from bootseer.robust.policy import ExclusionList
from bootseer.robust.standby import pool_size, rendezvous_members
from bootseer.testing.cluster import Cluster, Link

pytestmark = pytest.mark.system

BOOTSEER = [sys.executable, "-m", "bootseer"]
STORE_PORT = 29400
# Keep-alive: 1 s x 10. The fixture's 1 s x 3 lets a live node that misses three beats on a
# machine at load 30 be sanitized out of the round: the parked standby then takes its place
# (seen in bench_standby.py; docs/robust.md). A loss is noticed 7 s later than with 3.
PATIENT = {"keep_alive_max_attempt": 10}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    from conftest import require_component

    from bootseer.testing.servers import ComponentUnavailable

    c = Cluster(3, link=Link(rate="1gbit"), services=("s3", "rendezvous"))
    try:
        c.start()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    try:
        yield c
    finally:
        c.close()


def _launch(node, argv: list[str], out: Path, tag: str) -> subprocess.Popen:
    log = open(out / f"{node.name}.{node.generation}.{tag}.log", "w")  # noqa: SIM115
    with log:
        return node.popen(argv, stdout=log, stderr=subprocess.STDOUT)


def _logs(out: Path) -> dict[str, str]:
    return {p.name: p.read_text()[-2500:] for p in out.glob("*.log")}


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _reference(*args: str) -> str:
    return subprocess.run(
        [sys.executable, str(JOB), "--reference", *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def _rendezvous(c: Cluster, run_id: str) -> dict[str, Any] | None:
    """torch's rendezvous state of ``run_id``, read from the services host."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    with c.services.entered():
        store = TCPStore("127.0.0.1", STORE_PORT, is_master=False, timeout=timedelta(seconds=20))
        return rendezvous_members(store, run_id)


def _job(c: Cluster, tmp_path: Path, bucket: str, *extra: str) -> tuple[Path, list[str], str]:
    c.services.create_bucket(bucket)
    out = tmp_path / "out"
    out.mkdir()
    opts = json.dumps({"s3": c.services.storage_options()})
    script = [
        str(JOB),
        "--ckpt",
        f"s3://{bucket}/run",
        "--out",
        str(out),
        "--storage-options",
        opts,
        "--steps",
        "14",
        "--save-every",
        "3",
        "--hold-at",
        "9",
        *extra,
    ]
    return out, script, opts


# -- (c) an excluded standby is refused ------------------------------------------------------


def test_an_excluded_standby_is_refused_by_name(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    out, _, opts = _job(c, tmp_path, "excl")
    listed = out / "excluded.json"
    ExclusionList(listed).add(
        ["node2"], "cuda_error: uncorrectable ECC error", failure_class="cuda_error"
    )
    ctl = c.services.popen(
        [
            *BOOTSEER,
            "controller",
            "--store",
            f"127.0.0.1:{STORE_PORT}",
            "--job",
            "standby-c",
            "--exclusion",
            str(listed),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        from bootseer.testing.cluster_host import wait_for_line

        ready = wait_for_line(ctl, "READY", "the controller", 60)
        assert "excluded: node2" in ready  # the file's nodes, published to the store

        spare = c.nodes[2]
        state = spare.dirs.work / "state-c"
        flags = [
            "--controller",
            f"{c.services.controller}:{STORE_PORT}",
            "--job",
            "standby-c",
            "--node",
            spare.name,
            "--state-dir",
            str(state),
            "--trace-dir",
            str(out / "trace"),
            "--ckpt-url",
            "s3://excl/run",
            "--storage-options",
            opts,
            "--ranks",
            "0-1",
            "--min-free-disk",
            "1MiB",
            "--min-free-memory",
            "1MiB",
        ]
        refused = spare.run([*BOOTSEER, "warmup", "--self-check", *flags], check=False)
        assert refused.returncode == 2, refused.stderr
        assert "node node2 is on job standby-c's exclusion list" in refused.stderr
        assert str(listed) in refused.stderr and "uncorrectable ECC" in refused.stderr
        assert "must not join" in refused.stderr
        # nothing was warmed: refused before any part (no cache, no trace)
        assert not state.exists() and not (out / "trace").exists()
        # its `bootseer run` (the launcher that would park it at the rendezvous) refuses too,
        # before the command starts
        ran = out / "ran"
        joined = spare.run(
            [*BOOTSEER, "run", *flags, "--hang-timeout", "0", "--", "touch", str(ran)], check=False
        )
        assert (
            joined.returncode == 2
            and "node node2 is on job standby-c's exclusion list" in joined.stderr
        ), joined.stderr
        assert not ran.exists()
    finally:
        ctl.send_signal(signal.SIGTERM)
        ctl.wait(timeout=30)


def test_the_gate_reads_the_file_and_the_verdicts_through_the_store(tmp_path: Path) -> None:
    """On a real TCPStore in this process: the file's nodes published with their reasons, a
    verdict's eviction added beside them, a broken file refused and left as it is."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from bootseer.robust.controller import Controller
    from bootseer.robust.events import Event
    from bootseer.robust.remote import ControllerLink
    from bootseer.robust.standby import ExcludedNode, check_admission, read_exclusions

    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    listed = ExclusionList(tmp_path / "excluded.json")
    listed.add(["n7"], "disk_full: 0 B free on /var/lib/bootseer")
    ctl = Controller(store, exclusion=listed.path, settle_s=0, log=lambda _: None)
    assert ctl.publish_exclusions() == ["n7"]
    check_admission(store, "n1")  # not listed: admitted
    with pytest.raises(ExcludedNode) as refused:
        check_admission(store, "n7", where="10.0.0.5:29400")
    assert str(refused.value).startswith(
        "node n7 is on job job's exclusion list (store key bootseer/job/excluded at "
        f"10.0.0.5:29400, from the controller's file {listed.path}): evicted for 'disk_full"
    )
    # a crash verdict evicts n1: the file and the store both hold it, n7 stays
    for node in ("n1", "n2"):
        ControllerLink(store, node).register()
    ControllerLink(store, "n1").publish(
        Event("crash", "cuda_error", node="n1", rank=1, time=time.time())
    )
    for _ in range(6):  # incident 1 opened, both nodes answer its dump order, the verdict
        if ctl.step() is not None:
            break
        for node in ("n1", "n2"):
            ControllerLink(store, node).answer(1, [])
    assert set(listed.nodes()) == {"n1", "n7"}
    doc = read_exclusions(store)
    assert doc["nodes"] == ["n1", "n7"] and doc["list"] == str(listed.path)
    assert "GPU" in doc["reasons"]["n1"] and "disk_full" in doc["reasons"]["n7"]
    with pytest.raises(ExcludedNode, match="node n1 is on job job's exclusion list"):
        ControllerLink(store, "n1").register()
    # repaired: out of the file, and the restarted controller admits it again
    listed.remove(["n7"])
    assert ctl.publish_exclusions() == ["n1"]
    check_admission(store, "n7")
    # a file that cannot be read is refused by name, and left as it is
    listed.path.write_text("{not json")
    with pytest.raises(ValueError, match="is not readable"):
        ctl.publish_exclusions()
    assert listed.path.read_text() == "{not json"


def test_a_standby_that_fails_its_self_check_is_not_parked(tmp_path: Path) -> None:
    """The health check after the parts: a disk below ``health.min_free_disk`` fails it
    (exit 1, the disk named, a failed ``self_check`` span); --json stays one document."""
    (tmp_path / "ckpt").mkdir()
    flags = [
        "--ckpt-url",
        str(tmp_path / "ckpt"),
        "--ranks",
        "0",
        "--state-dir",
        str(tmp_path / "state"),
        "--node",
        "spare-1",
        "--min-free-memory",
        "1MiB",
        "--no-gpu-check",
        "--json",
        "--self-check",
    ]
    bad = subprocess.run(
        [*BOOTSEER, "warmup", *flags, "--min-free-disk", "1000000TiB"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1, bad.stderr
    assert "self-check failed" in bad.stderr and "disk" in bad.stderr
    doc = json.loads(bad.stdout)
    assert doc["ok"] is False and doc["self_check"] is False
    good = subprocess.run(
        [*BOOTSEER, "warmup", *flags, "--min-free-disk", "1MiB"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(good.stdout)["self_check"] is True
    spans = [
        json.loads(line)
        for line in (tmp_path / "state" / "trace" / "spare-1.jsonl").read_text().splitlines()
        if '"self_check"' in line
    ]
    assert [s["outcome"] for s in spans] == ["failed", "ok"]


def test_the_pool_is_the_p99_of_binomial_losses() -> None:
    assert pool_size(1024, 0.001) == 4  # ByteRobust's figure for 1,024 machines
    assert pool_size(2, 0.0) == 0
    assert pool_size(8, 1.0) == 8
    with pytest.raises(ValueError, match="p_loss"):
        pool_size(8, 1.5)


# -- (b) --nnodes 1:2: shrink, go on, grow back ----------------------------------------------


def test_an_elastic_job_shrinks_goes_on_and_grows_back(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    out, script, _ = _job(
        c, tmp_path, "elastic", "--hold-again-at", "12", "--hold-again-world", "1"
    )
    conf = {**PATIENT, "last_call_timeout": 8}  # the first round waits 8 s for the second

    def torchrun(node) -> list[str]:
        return node.torchrun(script, nnodes="1:2", rdzv_id="elastic", rdzv_conf=conf)

    procs = {n.name: _launch(n, torchrun(n), out, "elastic") for n in c.nodes[:2]}
    try:
        _wait_for([out / "holding-0", out / "holding-1"], procs, 180)
        c.kill_node(1)
        assert procs["node1"].wait(timeout=10) == -signal.SIGKILL
        del procs["node1"]
        # node0 alone: a round of one (min 1), resumes from step 8 and holds at step 12
        _wait_for([out / "holding-w1-0"], procs, 180)
        fresh = c.replace_node(1)
        procs["node1"] = _launch(fresh, torchrun(fresh), out, "elastic")
        for proc in procs.values():
            assert proc.wait(timeout=240) == 0, _logs(out)
    finally:
        _stop(procs)
        if c.nodes[1].generation == 1:  # killed and never replaced (a failure above)
            c.replace_node(1)
    loaded = {p.name: _read(p) for p in out.glob("loaded-*.json")}
    shrunk = [d for d in loaded.values() if d["world"] == 1]
    grown = {n: d for n, d in loaded.items() if d["world"] == 2}
    # the survivor alone resumed the committed step bit-identically
    assert len(shrunk) == 1 and shrunk[0]["step"] == 8, loaded
    assert shrunk[0]["digest"] == _read(out / "saved-0-8.json")["digest"]
    assert _read(out / "saved-0-8.json") == _read(out / "saved-1-8.json")
    # it went on with one rank (a save at step 11), then both ranks loaded that step
    assert {n.split("-")[2] for n in grown} == {"node0", "node1"}, loaded
    assert {d["step"] for d in grown.values()} == {11}
    assert {d["digest"] for d in grown.values()} == {_read(out / "saved-0-11.json")["digest"]}
    final = _reference("--reference-worlds", "2:9,1:3,2:2")
    assert _read(out / "saved-0-11.json")["digest"] == _reference("--reference-worlds", "2:9,1:3")
    for rank in (0, 1):
        assert _read(out / f"final-{rank}.json") == {"digest": final, "world": 2}


# -- (a) a lost node replaced by the warm standby --------------------------------------------


WIDTH = "4096"  # ~1 MB of state per rank: a checkpoint read shows in the byte counts


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_lost_node_is_replaced_by_the_warm_standby(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    out, script, opts = _job(c, tmp_path, "standby", "--width", WIDTH)
    procs = {
        n.name: _launch(
            n, n.torchrun(script, nnodes="2:2", rdzv_id="standby", rdzv_conf=PATIENT), out, "job"
        )
        for n in c.nodes[:2]
    }
    spare = c.nodes[2]
    node_flags = [
        "--node",
        spare.name,
        "--state-dir",
        str(spare.dirs.work / "state"),
        "--trace-dir",
        str(out / "trace"),
        "--ckpt-url",
        "s3://standby/run",
        "--storage-options",
        opts,
        "--ranks",
        "0-1",
        "--min-free-disk",
        "1MiB",
        "--min-free-memory",
        "1MiB",
    ]
    # the job's environment, built once by a node and published as a snapshot (a custom
    # install command: 2 MB of random bytes in its prefix, so that a restore shows)
    spec = out / "env.txt"
    spec.write_text("# the standby test's environment\n")

    def env_flags(node) -> list[str]:
        return [
            "--env-spec",
            str(spec),
            "--env-prefix",
            str(node.dirs.work / "venv"),
            "--env-store",
            "s3://standby/envs",
            "--",
            "sh",
            "-c",
            'mkdir -p "$BOOTSEER_PREFIX/bin" && head -c 2000000 /dev/urandom'
            ' > "$BOOTSEER_PREFIX/blob"',
        ]

    builder = c.nodes[0]
    builder.run(
        [
            *BOOTSEER,
            "env",
            "ensure",
            "--storage-options",
            opts,
            "--state-dir",
            str(builder.dirs.work / "state"),
            *env_flags(builder),
        ]
    )
    try:
        _wait_for([out / "holding-0", out / "holding-1"], procs, 180)
        # the standby: warmed (the environment; the newest checkpoint's shards for any rank
        # it may take) and checked, then the same launcher as the job's nodes: it parks at
        # the rendezvous
        warm = spare.run([*BOOTSEER, "warmup", "--self-check", *node_flags, *env_flags(spare)])
        assert "cached step 8 for ranks 0-1" in warm.stdout and "self-check ok" in warm.stdout
        assert "restored environment" in warm.stdout, warm.stdout
        blob = (builder.dirs.work / "venv" / "blob").read_bytes()
        assert (spare.dirs.work / "venv" / "blob").read_bytes() == blob
        procs["node2"] = _launch(
            spare,
            [
                *BOOTSEER,
                "run",
                *node_flags,
                "--hang-timeout",
                "0",
                "--",
                *spare.torchrun(script, nnodes="2:2", rdzv_id="standby", rdzv_conf=PATIENT),
            ],
            out,
            "job",
        )
        deadline = time.monotonic() + 120
        while True:  # torch keeps it in the round's redundancy list: no join timeout there
            state = _rendezvous(c, "standby")
            if state and spare.address in state["redundancy"]:
                break
            assert time.monotonic() < deadline, (state, _logs(out))
            for name, proc in procs.items():
                assert proc.poll() is None, (name, _logs(out))
            time.sleep(0.5)
        assert state["waiting"] == [] and len(state["participants"]) == 2  # not waiting:
        assert not list(out.glob("loaded-*"))  # the running job was not restarted for it
        s3_before = spare.bytes_from("s3")
        lost_at = time.time()
        c.kill_node(1)
        assert procs["node1"].wait(timeout=10) == -signal.SIGKILL
        del procs["node1"]
        for name, proc in procs.items():
            assert proc.wait(timeout=240) == 0, (name, _logs(out))
        s3_after = spare.bytes_from("s3")
    finally:
        _stop(procs)
        if c.nodes[1].generation == 1:
            c.replace_node(1)
    # both ranks resumed from step 8, the survivor and the standby, bit-identically
    loaded = {p.name: _read(p) for p in out.glob("loaded-*.json")}
    assert {n.split("-")[2] for n in loaded} == {"node0", "node2"}, loaded
    assert {n.split("-")[1] for n in loaded} == {"0", "1"}
    for name, got in loaded.items():
        assert got["step"] == 8 and got["world"] == 2
        assert got["digest"] == _read(out / f"saved-{name.split('-')[1]}-8.json")["digest"]
    final = _reference("--steps", "14", "--width", WIDTH)
    for rank in (0, 1):
        assert _read(out / f"final-{rank}.json") == {"digest": final, "world": 2}
    # the standby did its start-up work before the loss: the warmup and its run's startup
    # phases all ended before it; after the loss it read the checkpoint from its cache (the
    # bytes it took from S3 then are metadata, not a rank's ~1 MB of tensors)
    spans = _spans(out / "trace" / "node2.jsonl")
    startup = [
        s
        for s in spans
        if s["phase"] in ("image_prefetch", "environment", "checkpoint_prefetch", "self_check")
    ]
    assert {s["phase"] for s in startup} >= {"checkpoint_prefetch", "environment", "self_check"}, (
        spans
    )
    assert all(s["end"] < lost_at for s in startup), (lost_at, startup)
    fetched = [s for s in startup if s["phase"] == "checkpoint_prefetch" and s["bytes"] > 0]
    assert len(fetched) == 1 and fetched[0]["detail"].get("warmup"), startup
    restored = [s for s in startup if s["phase"] == "environment" and s["bytes"] > 0]
    assert len(restored) == 1 and restored[0]["detail"].get("warmup"), startup
    rank_bytes = fetched[0]["bytes"] / 2
    assert s3_after - s3_before < rank_bytes / 4, (s3_after - s3_before, rank_bytes)
