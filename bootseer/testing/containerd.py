"""A private containerd for tests: its own config, root, state and socket, on no network.

``ContainerdServer(tmp_dir).start()`` runs ``containerd --config`` with the CRI plugin off;
``ctr(*args)`` runs ``ctr`` against it in a test namespace; ``stop()`` terminates it. Needs
root (containerd mounts snapshots) and the Debian ``containerd`` package.

With ``cri=CRIOptions(...)`` the CRI plugin is on, as a Kubernetes node runs it, minus the
network: pods must use the node's network (``prefetch.containerd.cri.host_network_pod``), so
no CNI plugin is needed; CNI's directories, the streaming server's port and the stats period
are the test's own. ``stop()`` then stops and removes every pod first (their shims and mounts
outlive containerd otherwise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

from .process_server import ComponentUnavailable, ProcessServer

if TYPE_CHECKING:
    from prefetch import CRIClient

CRI_NAMESPACE = "k8s.io"  # where containerd's CRI plugin keeps images, containers, snapshots


@dataclass(frozen=True)
class CRIOptions:
    """The CRI plugin's settings that matter to image pulls (docs/containerd.md#kubernetes)."""

    sandbox_image: str  # the pause image: CRI pulls it (through ``snapshotter``) per pod
    snapshotter: str = "overlayfs"
    disable_snapshot_annotations: bool = False
    registry_config_path: str = ""  # containerd's hosts.toml directory (``config_path``)
    stats_collect_period_s: int = 1  # how often CRI asks the snapshotter for usage (10 s)

    def toml(self, state_dir: Path) -> str:
        cri = '[plugins."io.containerd.grpc.v1.cri"]'
        return (
            f'{cri}\n  sandbox_image = "{self.sandbox_image}"\n'
            f'  stream_server_port = "0"\n'
            # CRI lowers a sandbox's oom_score_adj to -998, which needs CAP_SYS_RESOURCE
            # (a test machine in a container may lack it): keep containerd's own
            "  restrict_oom_score_adj = true\n"
            f"  stats_collect_period = {self.stats_collect_period_s}\n"
            f'{cri[:-1]}.containerd]\n  snapshotter = "{self.snapshotter}"\n'
            "  disable_snapshot_annotations = "
            f"{str(self.disable_snapshot_annotations).lower()}\n"
            f'{cri[:-1]}.cni]\n  bin_dir = "{state_dir}/cni/bin"\n'
            f'  conf_dir = "{state_dir}/cni/net.d"\n'
            f'{cri[:-1]}.registry]\n  config_path = "{self.registry_config_path}"\n'
        )


class ContainerdServer(ProcessServer):
    """``containerd --config`` with its own root, state and socket; ready once ``ctr version``
    answers on the socket. It listens on no TCP port. Stopped by pid alone (SIGTERM, SIGKILL
    after 10 s), not by process group: shims it started must not die with it, as on a node."""

    listens_on_tcp = False

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        namespace: str = "bootseer-test",
        *,
        proxy_snapshotters: dict[str, str] | None = None,
        cri: CRIOptions | None = None,
    ) -> None:
        self.dir = Path(root_dir)
        super().__init__(
            name="containerd",
            log_path=self.dir / "containerd.log",
            process_group=False,
            poll_interval=0.2,
        )
        self.namespace = namespace
        self.cri = cri
        # name -> socket of a proxy snapshotter plugin (`ctr run --snapshotter NAME`)
        self.proxy_snapshotters = dict(proxy_snapshotters or {})
        # A unix socket path must stay short (108 bytes): not under a deep tmp_path. Removed by
        # stop(); by a finalizer when the object is dropped unstopped (a start that failed).
        self._sock_dir = tempfile.mkdtemp(prefix="bootseer-ctd-")
        weakref.finalize(self, shutil.rmtree, self._sock_dir, True)
        self.sock_dir = self._sock_dir  # short paths for other sockets of the test
        self.address = os.path.join(self._sock_dir, "containerd.sock")

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def config_path(self) -> Path:
        return self.dir / "config.toml"

    def snapshotter_root(self, name: str) -> Path:
        """Where containerd assumes snapshotter ``name`` keeps its files: CRI reports this
        directory to the kubelet as the image filesystem (``ImageFsInfo``)."""
        return self.root / f"io.containerd.snapshotter.v1.{name}"

    def start(self, timeout_s: float = 30.0) -> Self:
        """Start containerd and wait until ``ctr version`` answers (no-op when running)."""
        if self.running:
            return self
        missing = [b for b in ("containerd", "ctr") if shutil.which(b) is None]
        if missing:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            raise ComponentUnavailable(f"needs {', '.join(missing)} (apt: containerd)")
        if os.geteuid() != 0:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            raise ComponentUnavailable("containerd needs root")
        self.start_timeout = timeout_s
        return super().start()

    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.makedirs(self._sock_dir, mode=0o700, exist_ok=True)  # a restart: stop() removed it
        self.config_path.write_text(
            f'version = 2\nroot = "{self.root}"\nstate = "{self.dir}/state"\n'
            + ("" if self.cri else 'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n')
            + f'[grpc]\n  address = "{self.address}"\n'
            + (self.cri.toml(self.dir / "state") if self.cri else "")
            + "".join(
                f'[proxy_plugins.{name}]\n  type = "snapshot"\n  address = "{sock}"\n'
                for name, sock in self.proxy_snapshotters.items()
            )
        )

    def argv(self) -> list[str]:
        return ["containerd", "--config", str(self.config_path)]

    def is_ready(self) -> bool:
        return self.ctr("version", check=False).returncode == 0

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["ctr", "--address", self.address, "--namespace", self.namespace, *args],
            capture_output=True,
            text=True,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"ctr {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc

    def cri_client(self) -> CRIClient:
        from prefetch import CRIClient

        return CRIClient(self.address)

    def remove_pods(self) -> None:
        """Stops and removes every CRI pod (their containers too): shims and their mounts
        would outlive containerd."""
        with self.cri_client() as cri:
            for sandbox in cri.list_pod_sandboxes():
                cri.stop_pod_sandbox(sandbox)
                cri.remove_pod_sandbox(sandbox)

    def stop(self) -> None:
        """Remove every CRI pod (with CRI on), stop containerd, remove the socket directory."""
        if self.cri is not None and self.running:
            try:
                self.remove_pods()
            except Exception as exc:  # noqa: BLE001 - teardown goes on; say what is left
                print(f"containerd {self.address}: could not remove pods: {exc}")
        try:
            super().stop()
        finally:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
