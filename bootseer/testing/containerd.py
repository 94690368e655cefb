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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

from .servers import ComponentUnavailable

if TYPE_CHECKING:
    from prefetch.containerd.cri import CRIClient

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


class ContainerdServer:
    def __init__(
        self,
        root_dir: str | os.PathLike,
        namespace: str = "bootseer-test",
        *,
        proxy_snapshotters: dict[str, str] | None = None,
        cri: CRIOptions | None = None,
    ) -> None:
        self.dir = Path(root_dir)
        self.namespace = namespace
        self.cri = cri
        # name -> socket of a proxy snapshotter plugin (`ctr run --snapshotter NAME`)
        self.proxy_snapshotters = dict(proxy_snapshotters or {})
        # A unix socket path must stay short (108 bytes): not under a deep tmp_path.
        self._sock_dir = tempfile.mkdtemp(prefix="bootseer-ctd-")
        self.sock_dir = self._sock_dir  # short paths for other sockets of the test
        self.address = os.path.join(self._sock_dir, "containerd.sock")
        self.log_path = self.dir / "containerd.log"
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        """The daemon's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def root(self) -> Path:
        return self.dir / "root"

    def snapshotter_root(self, name: str) -> Path:
        """Where containerd assumes snapshotter ``name`` keeps its files: CRI reports this
        directory to the kubelet as the image filesystem (``ImageFsInfo``)."""
        return self.root / f"io.containerd.snapshotter.v1.{name}"

    def start(self, timeout_s: float = 30.0) -> Self:
        missing = [b for b in ("containerd", "ctr") if shutil.which(b) is None]
        if missing:
            raise ComponentUnavailable(f"needs {', '.join(missing)} (apt: containerd)")
        if os.geteuid() != 0:
            raise ComponentUnavailable("containerd needs root")
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "config.toml"
        config.write_text(
            f'version = 2\nroot = "{self.root}"\nstate = "{self.dir}/state"\n'
            + ("" if self.cri else 'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n')
            + f'[grpc]\n  address = "{self.address}"\n'
            + (self.cri.toml(self.dir / "state") if self.cri else "")
            + "".join(
                f'[proxy_plugins.{name}]\n  type = "snapshot"\n  address = "{sock}"\n'
                for name, sock in self.proxy_snapshotters.items()
            )
        )
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                ["containerd", "--config", str(config)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout_s
        while self.ctr("version", check=False).returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ComponentUnavailable(
                    f"containerd did not start: {self.log_path.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        return self

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
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
        from prefetch.containerd.cri import CRIClient

        return CRIClient(self.address)

    def remove_pods(self) -> None:
        """Stops and removes every CRI pod (their containers too): shims and their mounts
        would outlive containerd."""
        with self.cri_client() as cri:
            for sandbox in cri.list_pod_sandboxes():
                cri.stop_pod_sandbox(sandbox)
                cri.remove_pod_sandbox(sandbox)

    def stop(self) -> None:
        if self.cri is not None and self._proc is not None and self._proc.poll() is None:
            try:
                self.remove_pods()
            except Exception as exc:  # noqa: BLE001 - teardown goes on; say what is left
                print(f"containerd {self.address}: could not remove pods: {exc}")
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
