"""The cluster's shared services, on a host of their own: the registry, S3 (moto), the package
index, and the controller's c10d store for torchrun's rendezvous.

Each server listens on the services host's loopback at a fixed port (the namespace is private,
so fixed ports never collide) and a front proxy makes it reachable on the host's address at
the same port. Every node reaches it at ``127.0.0.1:PORT`` through a proxy of its own that
counts the node's bytes (:mod:`bootseer.testing.cluster_node`), so an image reference or an S3
endpoint is the same on every node and on the services host.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from .cluster_host import Host, wait_for_line
from .registry import RegistryServer
from .servers import LOOPBACK, MotoS3Server
from .shaper import ShaperProcess

__all__ = ["ALL_SERVICES", "PORTS", "PROXIED", "Services", "check_services"]

PORTS = {"registry": 5000, "s3": 9000, "index": 3141, "rendezvous": 29400}
ALL_SERVICES = tuple(PORTS)
PROXIED = ("registry", "s3", "index")  # reached through the nodes' counting proxies
START_TIMEOUT_S = 120.0


class Services(Host):
    """The services host. URLs are the same from every node and from inside :meth:`entered`:
    ``registry_host``, ``s3_endpoint``, ``index_url``; ``controller`` is this host's address,
    ``rendezvous_endpoint`` where torchrun's c10d store listens on it."""

    def __init__(self, *args: Any, names: tuple[str, ...], index_dir: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.names = names
        self.index_dir = index_dir
        self.registry: RegistryServer | None = None
        self.s3: MotoS3Server | None = None

    @property
    def proxied(self) -> tuple[str, ...]:
        return tuple(n for n in PROXIED if n in self.names)

    @property
    def controller(self) -> str:
        """The controller host's address: the rendezvous store runs there, no training does."""
        return self.address

    @property
    def registry_host(self) -> str:
        """``127.0.0.1:5000``: what image references start with, on every node."""
        return f"{LOOPBACK}:{PORTS['registry']}"

    @property
    def registry_url(self) -> str:
        return f"http://{self.registry_host}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{PORTS['s3']}"

    @property
    def index_url(self) -> str:
        """For ``pip install --index-url``."""
        return f"http://{LOOPBACK}:{PORTS['index']}/simple/"

    @property
    def rendezvous_endpoint(self) -> str:
        """``ADDRESS:PORT`` of the c10d store, for ``torchrun --rdzv-endpoint``."""
        return f"{self.address}:{PORTS['rendezvous']}"

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for the S3 service (dummy credentials), valid on every host."""
        return MotoS3Server(PORTS["s3"]).storage_options(self.s3_endpoint)

    def create_bucket(self, name: str) -> str:
        """Create an S3 bucket; returns its name."""
        if self.s3 is None:
            raise ValueError("this cluster has no S3 service: add 's3' to Cluster(services=...)")
        with self.entered():
            return self.s3.create_bucket(name)

    # -- lifecycle -----------------------------------------------------------------------

    def _start(self) -> None:
        """Start the services asked for; the slow ones (moto, torch's store) overlap."""
        waits: list[tuple[subprocess.Popen, str, str]] = []
        if "rendezvous" in self.names:
            waits.append(
                (
                    self._spawn(
                        [
                            sys.executable,
                            "-m",
                            "bootseer.robust.store_host",
                            "--port",
                            str(PORTS["rendezvous"]),
                            "--exit-on-stdin-eof",
                        ],
                        "rendezvous",
                    ),
                    "READY",
                    "the controller's c10d store",
                )
            )
        if "index" in self.names:
            self.index_dir.mkdir(parents=True, exist_ok=True)
            waits.append(
                (
                    self._spawn(
                        [
                            sys.executable,
                            "-m",
                            "bootseer.testing.pypi",
                            str(self.index_dir),
                            "--port",
                            str(PORTS["index"]),
                        ],
                        "index",
                    ),
                    "http://",
                    "the package index",
                )
            )
        for name in self.proxied:
            front = ShaperProcess(
                LOOPBACK, PORTS[name], listen_host=self.address, listen_port=PORTS[name]
            )
            waits.append(
                (
                    self._spawn(front.command(), f"front-{name}"),
                    "LISTENING",
                    f"the {name} front proxy",
                )
            )
        with self.entered():
            if "registry" in self.names:
                self.registry = RegistryServer(self.root / "registry", port=PORTS["registry"])
                self.registry.start()
                assert self.registry.pid is not None
                self.adopt(self.registry.pid)
            if "s3" in self.names:
                self.s3 = MotoS3Server(PORTS["s3"], in_process=False)
                self.s3.start()
                assert self.s3.pid is not None
                self.adopt(self.s3.pid)
        for proc, prefix, what in waits:
            wait_for_line(proc, prefix, what, START_TIMEOUT_S)

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        """A service process whose first stdout line says it is ready; stdin is its lifeline
        (it exits when this process dies), stderr goes to ``logs/NAME.log``."""
        with open(self.logs / f"{log_name}.log", "ab") as log:
            return self.popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )

    def _release(self) -> None:
        for server in (self.registry, self.s3):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.close()


def check_services(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` checked against :data:`ALL_SERVICES` (an unknown one is refused by name)."""
    unknown = [n for n in names if n not in ALL_SERVICES]
    if unknown:
        raise ValueError(f"unknown cluster service(s) {unknown}: choose from {ALL_SERVICES}")
    return tuple(dict.fromkeys(names))
