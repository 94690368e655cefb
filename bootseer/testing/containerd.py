"""A private containerd for tests: its own config, root, state and socket, on no network.

``ContainerdServer(tmp_dir).start()`` runs ``containerd --config`` with the CRI plugin off;
``ctr(*args)`` runs ``ctr`` against it in a test namespace; ``stop()`` terminates it. Needs
root (containerd mounts snapshots) and the Debian ``containerd`` package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from .servers import ComponentUnavailable


class ContainerdServer:
    def __init__(self, root_dir: str | os.PathLike, namespace: str = "bootseer-test", *,
                 proxy_snapshotters: dict[str, str] | None = None) -> None:
        self.dir = Path(root_dir)
        self.namespace = namespace
        # name -> socket of a proxy snapshotter plugin (`ctr run --snapshotter NAME`)
        self.proxy_snapshotters = dict(proxy_snapshotters or {})
        # A unix socket path must stay short (108 bytes): not under a deep tmp_path.
        self._sock_dir = tempfile.mkdtemp(prefix="bootseer-ctd-")
        self.sock_dir = self._sock_dir  # short paths for other sockets of the test
        self.address = os.path.join(self._sock_dir, "containerd.sock")
        self.log_path = self.dir / "containerd.log"
        self._proc: subprocess.Popen | None = None

    @property
    def root(self) -> Path:
        return self.dir / "root"

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
            f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.address}"\n'
            + "".join(f'[proxy_plugins.{name}]\n  type = "snapshot"\n  address = "{sock}"\n'
                      for name, sock in self.proxy_snapshotters.items()))
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(["containerd", "--config", str(config)],
                                          stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while self.ctr("version", check=False).returncode != 0:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ComponentUnavailable(
                    f"containerd did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        return self

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["ctr", "--address", self.address, "--namespace",
                               self.namespace, *args], capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} failed ({proc.returncode}): "
                                 f"{proc.stderr.strip()}")
        return proc

    def stop(self) -> None:
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
