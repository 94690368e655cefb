"""A Kubernetes node without a kubelet: the bootseer snapshotter and a containerd with its CRI
plugin on (``snapshotter = "bootseer"``, snapshot annotations on), driven through the project's
CRI client with the kubelet's calls. The snapshotter's root is where CRI looks for the image
filesystem (``<containerd root>/io.containerd.snapshotter.v1.bootseer``).

``CRINode.start`` leaves a container running (a pod per container, host network), so a test can
restart the snapshotter under it (``restart_snapshotter``) and look inside (``exec``)."""

from __future__ import annotations

import io
import os
import shutil
import signal
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from containerd_helpers import SnapshotterProcess, add_programs
from test_prefetch_image import _push_gzip_image

from bootseer.testing.containerd import CRI_NAMESPACE, ContainerdServer, CRIOptions
from prefetch.auth import ENV_PASSWORD, ENV_USERNAME
from prefetch.containerd.client import ContainerdClient, SnapshotInfo
from prefetch.containerd.cri import (
    CRIClient,
    ExecResult,
    container_config,
    host_network_pod,
    log_text,
)
from striped_fs.fuse import is_mounted, unmount

SNAPSHOTTER = "bootseer"


def push_pause_image(host: str) -> str:
    """A pause-like sandbox image (the host's ``sleep``, entrypoint ``sleep infinity``)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_programs(tar, ("sleep",))
    _push_gzip_image(
        host, "pause", "1", [layer.getvalue()], {"Entrypoint": ["/bin/sleep", "infinity"]}
    )
    return f"{host}/pause:1"


@contextmanager
def registry_login(user: str, password: str) -> Iterator[None]:
    """Registry credentials in this process's environment (bootseer's client reads them) for
    the duration; child processes started meanwhile inherit them."""
    saved = {k: os.environ.get(k) for k in (ENV_USERNAME, ENV_PASSWORD)}
    os.environ[ENV_USERNAME], os.environ[ENV_PASSWORD] = user, password
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def write_hosts_toml(config_path: Path, registry: str, server: str, mirrors: list[str]) -> Path:
    """containerd's ``<config_path>/<registry>/hosts.toml``: ``mirrors`` (URLs) tried first for
    pulls and tag resolution, then ``server``."""
    path = config_path / registry / "hosts.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'server = "{server}"\n'
        + "".join(f'[host."{url}"]\n  capabilities = ["pull", "resolve"]\n' for url in mirrors)
    )
    return path


@dataclass
class PodContainer:
    """A container started through CRI in a pod of its own."""

    sandbox_id: str
    container_id: str
    log_file: Path


class CRINode:
    """One node (see the module docstring). ``snapshotter_args`` go to ``bootseer
    snapshotter``, ``snapshotter_env`` to its environment (node-level registry credentials)."""

    def __init__(
        self,
        root: Path,
        sandbox_image: str,
        *,
        registry_config_path: str = "",
        snapshotter_args: tuple[str, ...] = (),
        snapshotter_env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.logs = root / "pod-logs"
        self.logs.mkdir(parents=True)
        self.sock_dir = tempfile.mkdtemp(prefix="bscri-")
        address = os.path.join(self.sock_dir, "sn.sock")
        options = CRIOptions(
            sandbox_image=sandbox_image,
            snapshotter=SNAPSHOTTER,
            registry_config_path=registry_config_path,
        )
        self.containerd = ContainerdServer(
            root / "containerd", cri=options, proxy_snapshotters={SNAPSHOTTER: address}
        )
        # The snapshotter first (under containerd's root): CRI calls it as soon as it starts,
        # and a proxy plugin that failed to dial waits out gRPC's reconnect backoff.
        self.snapshotter = SnapshotterProcess(
            self.containerd.snapshotter_root(SNAPSHOTTER),
            address,
            root / "snapshotter.log",
            snapshotter_args,
            env=snapshotter_env,
        )
        self.cri = CRIClient(self.containerd.address)
        try:
            self.snapshotter.start()
            self.containerd.start()
        except BaseException:
            self.close()
            raise
        self._pods = 0

    @property
    def snapshotter_root(self) -> Path:
        return self.containerd.snapshotter_root(SNAPSHOTTER)

    @property
    def lazy_dir(self) -> Path:
        return self.snapshotter_root / "lazy"

    def pull(self, image: str, auth: tuple[str, str] | None = None) -> str:
        """CRI PullImage, as the kubelet sends it (``auth``: from a pull secret)."""
        return self.cri.pull_image(image, auth=auth)

    def snapshots(self) -> list[SnapshotInfo]:
        """The bootseer snapshots of CRI's namespace."""
        with ContainerdClient(self.containerd.address, CRI_NAMESPACE) as ctd:
            return ctd.list_snapshots(SNAPSHOTTER)

    def start(self, image: str, command: list[str]) -> PodContainer:
        """RunPodSandbox, CreateContainer, StartContainer: ``command`` runs in ``image``."""
        self._pods += 1
        name = f"pod{self._pods}"
        pod = host_network_pod(name, log_directory=str(self.logs / name))
        sandbox = self.cri.run_pod_sandbox(pod)
        cid = self.cri.create_container(
            sandbox, pod, container_config("main", image, command, "main.log")
        )
        self.cri.start_container(cid)
        return PodContainer(sandbox, cid, self.logs / name / "main.log")

    def run(self, image: str, script: str) -> str:
        """``sh -c script`` in a new pod; its output once it exited 0."""
        started = self.start(image, ["/bin/sh", "-c", script])
        state = self.cri.wait_exited(started.container_id)
        output = log_text(started.log_file.read_text())
        assert state.exit_code == 0, (state, output, self.snapshotter.log())
        return output

    def exec(self, container: PodContainer, cmd: list[str]) -> ExecResult:
        return self.cri.exec_sync(container.container_id, cmd)

    def restart_snapshotter(self, sig: int = signal.SIGTERM) -> None:
        self.snapshotter.stop(sig)
        self.snapshotter.start()

    def close(self) -> None:
        """containerd first (it removes the pods, whose rootfs mounts sit on the lazy view),
        then the snapshotter."""
        try:
            self.cri.close()
            self.containerd.stop()
        finally:
            self.snapshotter.stop()
            if is_mounted(self.lazy_dir):
                unmount(self.lazy_dir, lazy=True)
            shutil.rmtree(self.sock_dir, ignore_errors=True)
