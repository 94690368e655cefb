"""The Kubernetes path: containerd's CRI plugin with ``snapshotter = "bootseer"`` and snapshot
annotations on, driven by the project's own CRI client with the kubelet's calls (PullImage,
RunPodSandbox, CreateContainer, StartContainer, ImageFsInfo).

- Credentials given only as the kubelet's pull secret reach containerd, not the snapshotter:
  its registry reads get 401, and every layer (converted or not) falls back to containerd's
  own download and unpack, logged, the secret never. Node-level credentials make the same
  converted image lazy.
- A registry mirror in containerd's hosts config: a snapshotter given the same config reads
  the mirror and serves converted layers lazily; one that is not falls back.
- An unconverted image sharing its base with a converted one pulled before it starts with the
  registry down (the snapshotter wrote the lazy base out whole during the pull).
- In every case the pods start and the files their containers read are the image's bytes;
  ``ImageFsInfo`` names the snapshotter's root, which exists and has a capacity, and counts
  the bytes of lazy layers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from containerd_helpers import SCRIPT, expected_output, push_images
from cri_helpers import CRINode, push_pause_image, registry_login, write_hosts_toml

from bootseer.config import config_from_args
from bootseer.testing.servers import free_port
from prefetch.containerd import labels as lbl
from prefetch.containerd.errors import ContainerdError

USER, PASSWORD = "alice", "pull-secret-s3cret"
WRONG_PASSWORD = "node-password-wrong"


CHECK = SCRIPT + "; sha256sum /etc/image-id"


def _expected(salt: bytes) -> str:
    """What CHECK prints: the image's files (three layers, a whiteout, an opaque directory, a
    hardlink, a 3 MiB file, the image's own ID file) as pushed."""
    return expected_output() + f"{hashlib.sha256(salt).hexdigest()}  /etc/image-id\n"


def _run_and_check(node: CRINode, image: str, salt: bytes) -> None:
    assert node.run(image, CHECK) == _expected(salt)


def _layers(node: CRINode) -> dict[str, int]:
    """How many committed layer snapshots are lazy and how many were unpacked."""
    committed = [s for s in node.snapshots() if s.kind == "committed"]
    lazy = sum(1 for s in committed if s.labels.get(lbl.REMOTE) == "true")
    return {"lazy": lazy, "unpacked": len(committed) - lazy}


def _fallbacks(log: str) -> int:
    return log.count("cannot be served lazily")


@pytest.fixture
def open_registry(registry_factory):
    """A registry without auth holding the pause image."""
    registry = registry_factory()
    registry.pause_image = push_pause_image(registry.host)
    return registry


@pytest.mark.parametrize(
    "node_credentials",
    [None, PASSWORD, WRONG_PASSWORD],
    ids=["pull-secret-only", "node-credentials", "wrong-node-credentials"],
)
def test_pulls_with_a_pull_secret(
    registry_factory, open_registry, cri_node_factory, node_credentials
) -> None:
    secured = registry_factory(htpasswd=(USER, PASSWORD))
    with registry_login(USER, PASSWORD):
        _, converted = push_images(secured.host, "team/conv", b"conv")
        plain, _ = push_images(secured.host, "team/plain", b"plain")
    env = (
        {"BOOTSEER_REGISTRY_USERNAME": USER, "BOOTSEER_REGISTRY_PASSWORD": node_credentials}
        if node_credentials
        else None
    )
    node = cri_node_factory(open_registry.pause_image, snapshotter_env=env)

    with pytest.raises(ContainerdError, match="(?i)401|unauthorized"):
        node.pull(converted)  # the registry does want credentials
    node.pull(converted, auth=(USER, PASSWORD))
    node.pull(plain, auth=(USER, PASSWORD))
    _run_and_check(node, converted, b"conv")
    _run_and_check(node, plain, b"plain")

    log = node.snapshotter.log()
    lazy = 3 if node_credentials == PASSWORD else 0
    # 3 + 3 image layers and the pause image's one
    assert _layers(node) == {"lazy": lazy, "unpacked": 7 - lazy}, log
    if lazy:
        assert _fallbacks(log) == 0, log
    else:  # each layer of both images fell back, saying why
        assert _fallbacks(log) == 6, log
        assert "HTTP 401" in log
    for secret in (PASSWORD, WRONG_PASSWORD):
        assert secret not in log
        assert secret not in node.containerd.log_path.read_text()
    # What CRI tells a snapshotter about a layer: no credentials, so a pull secret cannot
    # reach it (containerd 1.6; docs/containerd.md#credentials)
    cri_labels = {
        lbl.SNAPSHOT_REF,
        lbl.IMAGE_REF,
        lbl.MANIFEST_DIGEST,
        lbl.LAYER_DIGEST,
        lbl.IMAGE_LAYERS,
        lbl.REMOTE,
    }
    for snap in node.snapshots():
        if snap.kind == "committed":
            assert set(snap.labels) <= cri_labels, snap.labels
            assert not any(PASSWORD in value for value in snap.labels.values())


@pytest.mark.parametrize("follows_hosts", [True, False], ids=["hosts-config", "no-hosts-config"])
def test_pulls_through_a_mirror(
    tmp_path: Path, open_registry, cri_node_factory, follows_hosts: bool
) -> None:
    """The image names a registry the node cannot reach; containerd's hosts.toml sends its
    pulls to a mirror that holds the same repositories."""
    mirror = open_registry
    push_images(mirror.host, "team/conv", b"conv")
    push_images(mirror.host, "team/plain", b"plain")
    origin = f"127.0.0.1:{free_port()}"  # nothing listens there
    config_path = tmp_path / "certs.d"
    write_hosts_toml(config_path, origin, f"http://{origin}", [mirror.url])
    args = ("--registry-config-path", str(config_path)) if follows_hosts else ()
    node = cri_node_factory(
        mirror.pause_image, registry_config_path=str(config_path), snapshotter_args=args
    )
    converted, plain = f"{origin}/team/conv:lazy", f"{origin}/team/plain:v1"

    node.pull(converted)
    node.pull(plain)
    running = node.start(converted, ["/bin/sleep", "infinity"])  # stays up: read it by exec
    result = node.exec(running, ["/bin/sh", "-c", CHECK])
    assert (result.exit_code, result.stdout.decode()) == (0, _expected(b"conv")), result
    _run_and_check(node, plain, b"plain")

    log = node.snapshotter.log()
    if follows_hosts:
        assert _layers(node) == {"lazy": 3, "unpacked": 4}, log
        assert _fallbacks(log) == 0, log
    else:
        assert _layers(node) == {"lazy": 0, "unpacked": 7}, log
        assert _fallbacks(log) == 6, log
        assert f"check that the registry at http://{origin} is up" in log
    _check_image_fs(node)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill-9"])
def test_a_running_pod_keeps_reading_its_lazy_image_across_a_snapshotter_restart(
    open_registry, cri_node_factory, sig: signal.Signals
) -> None:
    """The kubelet's path: a pod started through CRI on a lazily pulled image keeps running,
    and files it never read before come right, after the snapshotter is stopped (or killed)
    and started again under it (docs/containerd.md, "Restarts and upgrades")."""
    push_images(open_registry.host, "team/conv", b"conv")
    node = cri_node_factory(open_registry.pause_image)
    image = f"{open_registry.host}/team/conv:lazy"
    node.pull(image)
    assert _layers(node)["lazy"] == 3
    running = node.start(image, ["/bin/sleep", "infinity"])
    first = node.exec(running, ["/bin/sh", "-c", "sha256sum /etc/image-id"])
    assert first.exit_code == 0, first
    before = node.snapshotter.log_path.read_text(errors="replace").count("lazy mount taken over")

    node.restart_snapshotter(sig)
    deadline = time.monotonic() + 30
    while (
        node.snapshotter.log_path.read_text(errors="replace").count("lazy mount taken over")
        <= before
    ):
        assert time.monotonic() < deadline, node.snapshotter.log()
        time.sleep(0.1)

    assert node.cri.container_status(running.container_id).state == "running"
    result = node.exec(running, ["/bin/sh", "-c", CHECK])  # every file, most never read
    assert (result.exit_code, result.stdout.decode()) == (0, _expected(b"conv")), (
        result,
        node.snapshotter.log(),
    )
    log = node.snapshotter.log()
    assert "ENOTCONN" not in log and "Transport endpoint" not in log
    # a pull after the restart is served by the new process
    push_images(open_registry.host, "team/later", b"later")
    node.pull(f"{open_registry.host}/team/later:lazy")
    _run_and_check(node, f"{open_registry.host}/team/later:lazy", b"later")


def _check_image_fs(node: CRINode) -> None:
    """ImageFsInfo names the snapshotter's root, which the kubelet statfs()es for the image
    filesystem's capacity (so it must exist), with the bytes and inodes CRI summed from the
    snapshotter's Usage."""
    deadline = time.monotonic() + 30
    while True:
        (fs,) = node.cri.image_fs_info()
        if fs.used_bytes > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # CRI refreshes snapshot usage every stats_collect_period (1 s here)
    assert fs.mountpoint == str(node.snapshotter_root)
    stat = os.statvfs(fs.mountpoint)
    assert stat.f_blocks * stat.f_frsize > 0 and stat.f_files > 0
    assert fs.used_bytes > 0 and fs.inodes_used > 0


def test_the_deploy_files_agree_with_what_cri_expects() -> None:
    """The documented node layout: the snapshotter's root is where CRI reports the image
    filesystem, and it reads the hosts directory containerd reads, in the systemd unit, the
    DaemonSet and the command's defaults alike."""
    import shlex
    import tomllib

    import yaml

    from bootseer.cli import build_parser

    repo = Path(__file__).resolve().parents[1]
    config = tomllib.loads((repo / "deploy/containerd/config.toml").read_text())
    ((name, plugin),) = config["proxy_plugins"].items()
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["containerd"]["snapshotter"] == name
    root = f"{config.get('root', '/var/lib/containerd')}/io.containerd.snapshotter.v1.{name}"
    wanted = {
        "--root": root,
        "--address": plugin["address"],
        "--registry-config-path": cri["registry"]["config_path"],
    }

    unit = (repo / "deploy/systemd/bootseer-snapshotter.service").read_text()
    exec_start = unit.replace("\\\n", " ").split("ExecStart=", 1)[1].splitlines()[0]
    daemonset = yaml.safe_load((repo / "deploy/kubernetes/daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    for argv in (shlex.split(exec_start), container["command"]):
        assert {k: argv[argv.index(k) + 1] for k in wanted if k in argv} == wanted, argv
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert mounts[root]["mountPropagation"] == "Bidirectional"  # containerd sees the mount
    assert host_paths[mounts[root]["name"]] == root
    hosts_dir = wanted["--registry-config-path"]
    assert host_paths[mounts[hosts_dir]["name"]] == hosts_dir

    args = build_parser().parse_args(["snapshotter"])
    assert (
        config_from_args(args, env={}).snapshotter.root == root
    )  # the command's default is the same layout


def test_an_unconverted_image_on_a_lazy_base_starts_with_the_registry_down(
    open_registry, cri_node_factory
) -> None:
    """A converted image and an unconverted one share their base layer (one chain ID). The
    converted one pulled first makes that snapshot lazy; the unconverted one then stood on
    it, and with the registry down its pods failed at CreateContainer (containerd reads the
    image's ``/etc/passwd`` for its user: EIO) where a node of gzip images starts them. Now
    the snapshotter writes the lazy base out whole before containerd unpacks the unconverted
    image's own layer on it: after its pull that image reads nothing from the registry."""
    import io
    import tarfile

    from containerd_helpers import TOOLS, add_programs
    from test_prefetch_image import _push_gzip_image

    from prefetch.image import convert_image

    passwd = b"root:x:0:0:root:/:/bin/sh\napp:x:1000:1000:app:/:/bin/sh\n"

    def layer(files: dict[str, bytes], tools: tuple[str, ...] = ()) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            add_programs(tar, tools, ("etc",))
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
        return out.getvalue()

    host = open_registry.host
    base = layer({"etc/passwd": passwd, "etc/group": b"root:x:0:\napp:x:1000:\n"}, TOOLS)
    _push_gzip_image(host, "team/conv", "v1", [base, layer({"etc/conv": b"converted\n"})])
    convert_image(f"{host}/team/conv:v1", f"{host}/team/conv:lazy", frame_size=64 << 10)
    plain = f"{host}/team/plain:v1"
    _push_gzip_image(
        host, "team/plain", "v1", [base, layer({"etc/plain": b"plain\n"})], {"User": "app"}
    )
    node = cri_node_factory(open_registry.pause_image)
    node.pull(open_registry.pause_image)  # RunPodSandbox needs it with the registry down
    node.pull(f"{host}/team/conv:lazy")
    assert _layers(node) == {"lazy": 2, "unpacked": 1}
    node.pull(plain)
    assert "written out whole" in node.snapshotter.log()
    open_registry.stop()

    out = node.run(plain, "cat /etc/plain; sha256sum /etc/passwd /bin/sh; cat /proc/self/status")
    sh = Path(os.path.realpath(shutil.which("sh"))).read_bytes()
    lines = out.splitlines()
    assert lines[:3] == [
        "plain",
        f"{hashlib.sha256(passwd).hexdigest()}  /etc/passwd",
        f"{hashlib.sha256(sh).hexdigest()}  /bin/sh",
    ], out
    assert any(line.split()[:2] == ["Uid:", "1000"] for line in lines), out  # the image's user
