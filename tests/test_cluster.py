"""The cluster fixture (bootseer.testing.cluster): nodes in network namespaces with real
services, node faults, teardown that leaves nothing, and a training job across nodes that
survives a lost node bit-identically (the CI form: 2 nodes x 1 rank)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bootseer.testing.cluster import Cluster, HostDead, Link
from bootseer.testing.netns import NETNS_DIR, mounts_under

pytestmark = pytest.mark.system

HERE = Path(__file__).resolve().parent
JOB = HERE / "cluster_job.py"


def _qdisc(netns: str, dev: str) -> str:
    return subprocess.run(
        ["tc", "-n", netns, "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True
    ).stdout


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


# -- bad input --------------------------------------------------------------------------------


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="1 to 8 nodes"):
        Cluster(9)
    with pytest.raises(ValueError, match="'fast' is not a rate"):
        Link(rate="fast")
    with pytest.raises(ValueError, match="delay_ms"):
        Link(delay_ms=-1)
    with pytest.raises(ValueError, match="unknown cluster service.*'ftp'"):
        Cluster(2, services=("s3", "ftp"))
    with pytest.raises(ValueError, match="disk_size '1 GB'"):
        Cluster(2, disk_size="1 GB")


# -- the fixture's own checks -------------------------------------------------------------------


def test_nodes_have_addresses_hostnames_and_shaped_links(cluster_factory) -> None:
    own_hostname = socket.gethostname()
    c = cluster_factory(3, link=Link(rate="100mbit", delay_ms=5), services=("rendezvous",))
    assert [n.name for n in c.nodes] == ["node0", "node1", "node2"]
    assert len({n.address for n in c.nodes} | {c.services.controller}) == 4
    for node in c.nodes:
        assert node.run(["hostname"]).stdout.strip() == node.name
    assert socket.gethostname() == own_hostname  # the machine's own name is untouched

    # node2 serves its host name on its address; node0 and node1 reach it over the bridge
    server = c.nodes[2].popen(
        _python(
            "import socket\n"
            f"s = socket.create_server(('{c.nodes[2].address}', 7000))\n"
            "print('READY', flush=True)\n"
            "for _ in range(2):\n"
            "    conn, peer = s.accept()\n"
            "    conn.sendall(f'{socket.gethostname()} saw {peer[0]}'.encode()); conn.close()\n"
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "READY"
    for node in c.nodes[:2]:
        got = node.run(
            _python(
                f"import socket; s = socket.create_connection(('{c.nodes[2].address}', 7000), 10)\n"
                "print(s.recv(100).decode())"
            )
        ).stdout.strip()
        assert got == f"node2 saw {node.address}"
    assert server.wait(timeout=30) == 0
    # the controller's c10d store answers on its address from a node
    c.nodes[0].run(
        _python(
            "import datetime; from torch.distributed import TCPStore\n"
            f"s = TCPStore('{c.services.controller}', 29400, is_master=False,"
            " timeout=datetime.timedelta(seconds=20)); s.set('k', 'v'); assert s.get('k') == b'v'"
        )
    )

    # both ends of every link carry the rate; tc delays only where the kernel has netem
    for i, node in enumerate(c.nodes):
        for netns, dev in ((node.netns, "eth0"), (c._switch.netns, f"n{i}")):
            assert "rate 100Mbit" in _qdisc(netns, dev)
        assert node.service_latency_s == (0.0 if c.tc_delays else 0.005)
    c.slow_link(1, rate="10mbit", delay_ms=20)
    assert "rate 10Mbit" in _qdisc(c.nodes[1].netns, "eth0")
    assert "rate 10Mbit" in _qdisc(c._switch.netns, "n1")
    assert c.nodes[1].service_latency_s == (0.0 if c.tc_delays else 0.02)
    assert "rate 100Mbit" in _qdisc(c.nodes[0].netns, "eth0")  # the others keep theirs
    assert c.nodes[0].service_latency_s == (0.0 if c.tc_delays else 0.005)


def test_bytes_from_services_are_counted_per_node(cluster_factory) -> None:
    from containerd_helpers import runnable_layers
    from test_prefetch_image import _push_gzip_image

    from bootseer.testing.pypi import build_test_wheels, installer_env

    c = cluster_factory(2, services=("registry", "s3", "index"), snapshotter=True)
    blob = os.urandom(3 << 20)
    c.services.create_bucket("data")
    with c.services.entered():
        c.services.s3.boto3_client().put_object(Bucket="data", Key="blob", Body=blob)
        _push_gzip_image(c.services.registry_host, "app/run", "v1", runnable_layers(b""))
    assert [n.bytes_from("s3") for n in c.nodes] == [0, 0]

    got = (
        c.nodes[0]
        .run(
            _python(
                "import hashlib, boto3\n"
                f"s3 = boto3.client('s3', endpoint_url='{c.services.s3_endpoint}')\n"
                "print(hashlib.sha256(s3.get_object(Bucket='data', Key='blob')['Body'].read())"
                ".hexdigest())"
            )
        )
        .stdout.strip()
    )
    assert got == hashlib.sha256(blob).hexdigest()
    assert len(blob) <= c.nodes[0].bytes_from("s3") < len(blob) + (64 << 10)
    assert c.nodes[1].bytes_from("s3") == 0
    assert c.nodes[0].bytes_to("s3") < 64 << 10  # a GET sends no body

    # the package index: real pip on node0 downloads a wheel, bytes equal
    wheels = {p.name: p for p in build_test_wheels(c.services.index_dir)}
    c.nodes[0].run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--index-url",
            c.services.index_url,
            "-d",
            str(c.nodes[0].dirs.work),
            "tinyalpha==2.0",
        ],
        env=installer_env(),
    )
    (got_wheel,) = c.nodes[0].dirs.work.iterdir()
    assert got_wheel.read_bytes() == wheels[got_wheel.name].read_bytes()
    assert c.nodes[0].bytes_from("index") >= got_wheel.stat().st_size
    assert c.nodes[1].bytes_from("index") == 0

    ref = f"{c.services.registry_host}/app/run:v1"
    c.nodes[1].ctr("images", "pull", "--plain-http", "--snapshotter", "bootseer", ref)
    blobs = Path(c.services.registry.storage_dir).rglob("blobs/sha256/*/*/data")
    stored = sum(p.stat().st_size for p in blobs)  # config, layers and manifest
    assert stored <= c.nodes[1].bytes_from("registry") < stored + (256 << 10)
    assert c.nodes[0].bytes_from("registry") == 0
    listed = c.nodes[1].ctr("images", "ls", "-q").stdout.split()
    assert listed == [ref]
    assert c.nodes[0].ctr("images", "ls", "-q").stdout.split() == []  # containerd per node
    # node1's layers were unpacked by node1's own bootseer snapshotter, node0's has none
    snapshots = [
        n.ctr("snapshots", "--snapshotter", "bootseer", "ls").stdout.splitlines()[1:]
        for n in c.nodes
    ]
    assert snapshots[0] == [] and len(snapshots[1]) == len(runnable_layers(b""))
    assert c.nodes[1].snapshotter is not None
    assert c.nodes[1].snapshotter.pid in c.nodes[1].cgroup.pids()


@pytest.mark.parametrize("kill_method", ["kill", "freeze"])
def test_kill_replace_and_fill_a_node(cluster_factory, kill_method: str) -> None:
    """Both ways of losing every process at once: cgroup.kill, and freeze + SIGKILL (kernels
    before 5.14)."""
    c = cluster_factory(2, services=("s3",), kill_method=kill_method)
    # node1 runs a process tree that keeps forking; node0 runs one process
    tree = c.nodes[1].popen(
        ["/bin/sh", "-c", "sleep 600 & sleep 600 & while :; do sleep 0.05; done"]
    )
    other = c.nodes[0].popen(["sleep", "600"])
    (c.nodes[1].dirs.cache / "layer").write_bytes(b"x" * 1000)
    first_dirs = c.nodes[1].dirs
    deadline = time.monotonic() + 10
    while len(c.nodes[1].cgroup.pids()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = c.nodes[1].cgroup.pids()
    assert tree.pid in pids and len(pids) >= 4

    c.kill_node(1)
    assert tree.wait(timeout=10) == -signal.SIGKILL
    assert not any(_alive(p) for p in pids)
    assert c.nodes[1].cgroup.pids() == []
    assert other.poll() is None  # node0 is untouched
    with pytest.raises(HostDead, match="node1 was killed: replace it"):
        c.nodes[1].run(["true"])

    fresh = c.replace_node(1)
    assert fresh is c.nodes[1]
    assert (fresh.name, fresh.address) == ("node1", "198.18.0.11")
    assert fresh.run(["hostname"]).stdout.strip() == "node1"
    assert fresh.dirs.cache != first_dirs.cache and not first_dirs.root.exists()
    assert list(fresh.dirs.cache.iterdir()) == []  # a fresh node is empty
    assert fresh.bytes_from("s3") == 0

    # a full disk: a write on the node fails with ENOSPC, then works again once freed
    filled = c.fill_disk(0)
    assert filled > 0
    write = _python(f"open('{c.nodes[0].dirs.cache}/f', 'wb').write(b'y' * 65536)")
    failed = c.nodes[0].run(write, check=False)
    assert failed.returncode != 0 and "No space left on device" in failed.stderr
    c.free_disk(0)
    c.nodes[0].run(write)
    assert (c.nodes[0].dirs.cache / "f").stat().st_size == 65536

    # an unplugged cable: connections to node0 time out (nobody is told), then work again
    listener = c.nodes[0].popen(
        _python(
            f"import socket; s = socket.create_server(('{c.nodes[0].address}', 7001))\n"
            "print('READY', flush=True)\n"
            "while True: s.accept()[0].close()"
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout is not None and listener.stdout.readline().strip() == "READY"
    connect = _python(f"import socket; socket.create_connection(('{c.nodes[0].address}', 7001), 2)")
    c.disconnect(0)
    cut = c.nodes[1].run(connect, check=False)
    assert cut.returncode != 0 and "timed out" in cut.stderr
    c.reconnect(0)
    c.nodes[1].run(connect)


def test_teardown_leaves_nothing_after_a_killed_node_and_an_exception() -> None:
    from conftest import require_component

    from bootseer.testing.servers import ComponentUnavailable

    cluster = Cluster(2, services=("s3", "rendezvous"))
    pids: list[int] = []
    left: list[Path] = []  # what a killed program leaves in its temporary directory
    leaver = (
        "import tempfile, time; print(tempfile.mkdtemp(prefix='bootseer-control-'), "
        "flush=True); time.sleep(600)"
    )
    try:
        with pytest.raises(RuntimeError, match="the test failed"), cluster as c:
            for node in c.nodes:
                pids.append(node.popen(["sleep", "600"]).pid)
                proc = node.popen([sys.executable, "-c", leaver], stdout=subprocess.PIPE, text=True)
                pids.append(proc.pid)
                assert proc.stdout is not None
                left.append(Path(proc.stdout.readline().strip()))
                assert left[-1].parent == node.tmp and left[-1].is_dir()  # TMPDIR: the node's
            pids += c.services.cgroup.pids()
            c.fill_disk(0)
            c.kill_node(1)
            raise RuntimeError("the test failed")
    except ComponentUnavailable as exc:
        require_component(str(exc))
    assert cluster.leaks() == []
    assert not [p for p in NETNS_DIR.iterdir() if p.name.startswith(cluster.prefix)]
    assert cluster._cgroup is not None and not cluster._cgroup.path.exists()
    assert cluster.dir is not None and not cluster.dir.exists()
    assert mounts_under(cluster.dir) == []
    assert not any(_alive(p) for p in pids)
    assert not any(p.exists() for p in left)  # went with the node, not left in /tmp
    cluster.close()  # again: a no-op


def _container_cgroups(prefix: str) -> list[Path]:
    """Cgroup directories of a cluster's containers, in every hierarchy (runc puts a
    container at /CONTAINERD-NAMESPACE/ID: the namespace is named after the node)."""
    return sorted(Path("/sys/fs/cgroup").glob(f"*/{prefix}-*")) + sorted(
        Path("/sys/fs/cgroup").glob(f"{prefix}-*")
    )


def test_a_lost_node_loses_its_containers(cluster_factory) -> None:
    """runc moves a container out of the node's cgroup and into a network namespace of its
    own: killing the node must still kill it, and teardown must remove it and its cgroups."""
    from conftest import require_component
    from containerd_helpers import runnable_layers
    from test_prefetch_image import _push_gzip_image

    from bootseer.testing.servers import ComponentUnavailable

    cluster = Cluster(2, services=("registry",), containerd=True)
    try:
        c = cluster.start()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    pids: list[int] = []
    try:
        with c.services.entered():
            _push_gzip_image(c.services.registry_host, "app/run", "v1", runnable_layers(b""))
        ref = f"{c.services.registry_host}/app/run:v1"
        for node in c.nodes:
            node.ctr("images", "pull", "--plain-http", ref)
            node.ctr("run", "-d", ref, "sleeper", "sleep", "600")
            pids.append(int(node.ctr("task", "ls").stdout.splitlines()[1].split()[1]))
        assert all(_alive(p) for p in pids)
        assert _container_cgroups(c.prefix)  # runc made them, outside the node's group
        c.kill_node(1)
        assert not _alive(pids[1])
        assert _alive(pids[0])  # node0's container is untouched
    finally:
        cluster.close(raise_leaks=False)
    assert not _alive(pids[0])
    assert cluster.leaks() == []
    assert _container_cgroups(cluster.prefix) == []


_OWNER = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from containerd_helpers import runnable_layers
from test_prefetch_image import _push_gzip_image
from bootseer.testing.cluster import Cluster
c = Cluster(2, services=("registry", "rendezvous"), containerd=True).start()
sleeper = c.nodes[0].popen(["sleep", "600"])
c.fill_disk(0)
with c.services.entered():
    _push_gzip_image(c.services.registry_host, "app/run", "v1", runnable_layers(b""))
ref = c.services.registry_host + "/app/run:v1"
c.nodes[1].ctr("images", "pull", "--plain-http", ref)
c.nodes[1].ctr("run", "-d", ref, "sleeper", "sleep", "600")
container = c.nodes[1].ctr("task", "ls").stdout.splitlines()[1].split()[1]
print(c.prefix, c.dir, c._cgroup.path, sleeper.pid, container, *c.services.cgroup.pids(),
      flush=True)
sys.stdin.read()
"""


def test_a_killed_owners_cluster_is_swept_by_the_next() -> None:
    """The test process itself SIGKILLed (no teardown runs): the next cluster's start removes
    what it left, and leaves a live owner's cluster alone."""
    from conftest import need

    from bootseer.testing.cluster_host import wait_for_line
    from bootseer.testing.cluster_sweep import RECORDS, sweep_stale

    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:  # the nodes' processes inherit its stdout: an exit does not end the pipe
        line = wait_for_line(owner, "bsc-", "the owner's cluster", 240).split()
    except RuntimeError as exc:
        owner.kill()
        sweep_stale()
        need(f"the cluster did not start: {exc}")
    prefix, directory, cgroup, *pids = line
    try:
        assert prefix not in sweep_stale()  # its owner lives: left alone
        assert (NETNS_DIR / f"{prefix}-node0").exists()
        owner.kill()
        owner.wait()
        assert (RECORDS / f"{prefix}.json").exists() and Path(directory).exists()
        assert all(_alive(int(p)) for p in pids)  # orphans: services, node0's sleep, container
        assert _container_cgroups(prefix)
    finally:
        swept = sweep_stale()
    assert prefix in swept
    assert not [p for p in NETNS_DIR.iterdir() if p.name.startswith(prefix)]
    assert not Path(cgroup).exists() and not Path(directory).exists()
    assert mounts_under(Path(directory)) == []
    assert not any(_alive(int(p)) for p in pids)
    assert _container_cgroups(prefix) == []
    assert not (RECORDS / f"{prefix}.json").exists()


# -- the CI form: 2 nodes x 1 rank, a node lost, replaced, resumed bit-identical ---------------


def _wait_for(paths: list[Path], procs: dict[str, subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name}'s torchrun exited {proc.returncode}"
        assert time.monotonic() < deadline, f"no {[p.name for p in paths]} in {timeout_s} s"
        time.sleep(0.1)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_training_survives_a_lost_node_bit_identically(cluster_factory, tmp_path: Path) -> None:
    c = cluster_factory(2, link=Link(rate="1gbit"), services=("s3", "rendezvous"))
    c.services.create_bucket("ckpt")
    out = tmp_path / "out"  # every node writes its results here (mounts are shared)
    out.mkdir()
    script = [
        str(JOB),
        "--ckpt",
        "s3://ckpt/run",
        "--out",
        str(out),
        "--storage-options",
        json.dumps({"s3": c.services.storage_options()}),
        "--steps",
        "14",
        "--save-every",
        "3",
        "--hold-at",
        "9",
    ]

    def launch(node) -> subprocess.Popen:
        log = open(out / f"{node.name}.{node.generation}.log", "w")  # noqa: SIM115
        with log:
            return node.popen(
                node.torchrun(script, nnodes="2:2"), stdout=log, stderr=subprocess.STDOUT
            )

    procs = {n.name: launch(n) for n in c.nodes}
    try:
        _wait_for([out / "holding-0", out / "holding-1"], procs, 120)
        c.kill_node(1)  # every process of node1 at once: its agent and its rank
        assert procs["node1"].wait(timeout=10) == -signal.SIGKILL
        procs["node1"] = launch(c.replace_node(1))  # a fresh, empty node1 joins
        for name, proc in procs.items():
            assert proc.wait(timeout=150) == 0, (out / f"{name}.1.log").read_text()[-3000:]
    finally:
        logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")}
    # the committed step before the loss was 8 (saves after steps 2, 5, 8); both ranks loaded
    # it bit-identically: rank 0 on the surviving node, rank 1 on the fresh one
    loaded = {p.name: _read(p) for p in out.glob("loaded-*.json")}
    assert len(loaded) == 2, (loaded, logs)
    assert {n.split("-")[1] for n in loaded} == {"0", "1"}
    assert {n.split("-")[2] for n in loaded} == {"node0", "node1"}
    assert _read(out / "saved-0-8.json") == _read(out / "saved-1-8.json")
    for name, got in loaded.items():
        rank = name.split("-")[1]
        assert got["step"] == 8 and got["world"] == 2
        assert got["digest"] == _read(out / f"saved-{rank}-8.json")["digest"]

    # training went on to the end, and every state is the uninterrupted run's, bit for bit
    def reference(steps: int) -> str:
        return subprocess.run(
            [sys.executable, str(JOB), "--reference", "--steps", str(steps)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    assert _read(out / "saved-0-8.json")["digest"] == reference(9)
    final = reference(14)
    for rank in (0, 1):
        assert _read(out / f"final-{rank}.json") == {"digest": final, "world": 2}
