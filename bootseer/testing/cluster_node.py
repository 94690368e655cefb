"""A training node of the cluster: a :class:`~bootseer.testing.cluster_host.Host` with a disk
of its own, counting proxies to the shared services, and (when asked) its own containerd and
bootseer snapshotter.

The disk is a tmpfs of a fixed size, so that a full disk is one call away (``fill``) and a
fresh node really is empty. The proxies run in this process on the node's loopback
(``127.0.0.1:PORT``, as a node-local registry mirror or S3 gateway would), count every byte
the node takes from each service, and carry the link's delay where tc cannot (no netem).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cgroup import Cgroup, cgroup2_root, groups_named
from .cluster_host import Host
from .cluster_services import PORTS, Services
from .containerd import ContainerdServer
from .links import Link, qdisc_available
from .netns import entered
from .servers import LOOPBACK
from .shaper import Shaper, ShaperSettings

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Node", "NodeDirs"]

RUNC_ROOT = Path("/run/containerd/runc")  # runc's state, one directory per namespace
SHIM_SOCKETS = Path("/run/containerd/s")  # containerd 1.6 shims' sockets, named by a hash
FILL_NAME = ".bootseer-cluster-fill"
CACHE_PORT_OFFSET = 1  # a node reaches the cache tier's service PORT at 127.0.0.1:PORT+1


@dataclass(frozen=True)
class NodeDirs:
    """A node's directories. ``disk`` is its disk (a tmpfs: full when filled); ``cache`` and
    ``work`` are on it; ``root`` (logs, sockets, namespace files) is not, so logs survive a
    full disk."""

    root: Path
    disk: Path
    cache: Path
    work: Path
    logs: Path
    run: Path


class Node(Host):
    """``node{index}``: ``dirs``, ``containerd`` and ``snapshotter`` (None unless the cluster
    was asked for them), ``link``, ``bytes_from(service)``."""

    def __init__(
        self,
        *args: Any,
        index: int,
        generation: int,
        services: Services,
        link: Link,
        cache: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.index = index
        self.generation = generation
        self.services = services
        self.link = link
        self.cache = cache  # the cluster's cache tier (cluster_cache.CacheHost), or None
        self.dirs = NodeDirs(
            self.root,
            self.root / "disk",
            self.root / "disk" / "cache",
            self.root / "disk" / "work",
            self.logs,
            self.root / "run",
        )
        self.containerd: ContainerdServer | None = None
        self.snapshotter: subprocess.Popen | None = None
        self.snapshotter_address: str | None = None
        self._proxies: dict[str, Shaper] = {}

    # -- start ---------------------------------------------------------------------------

    def _start(
        self,
        disk_size: str,
        tmpfs_name: str,
        *,
        containerd: bool,
        snapshotter: bool,
        snapshotter_args: Sequence[str],
        containerd_namespace: str,
    ) -> None:
        self.dirs.run.mkdir(mode=0o700)
        self.dirs.disk.mkdir(mode=0o700)
        subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={disk_size},mode=0700",
                tmpfs_name,
                str(self.dirs.disk),
            ],
            check=True,
            capture_output=True,
        )
        self.dirs.cache.mkdir()
        self.dirs.work.mkdir()
        with entered(self.netns_path):  # the proxies' sockets live on the node
            for name in self.services.proxied:
                proxy = Shaper(
                    self.services.address,
                    PORTS[name],
                    self._proxy_settings(),
                    LOOPBACK,
                    PORTS[name],
                )
                self._proxies[name] = proxy.start()
            for name in self.cache.names if self.cache is not None else ():
                proxy = Shaper(
                    self.cache.address,
                    PORTS[name],
                    self._proxy_settings(),
                    LOOPBACK,
                    CACHE_PORT_OFFSET + PORTS[name],
                )
                self._proxies[f"{name}-cache"] = proxy.start()
        if containerd or snapshotter:
            self._start_containerd(snapshotter, snapshotter_args, containerd_namespace)

    def _proxy_settings(self) -> ShaperSettings:
        tc_delays = qdisc_available("netem")
        return ShaperSettings(latency_s=0.0 if tc_delays else self.link.delay_ms / 1e3)

    def _start_containerd(
        self, snapshotter: bool, snapshotter_args: Sequence[str], namespace: str
    ) -> None:
        proxies = {}
        self.containerd = ContainerdServer(self.dirs.disk / "containerd", namespace)
        if snapshotter:
            # containerd's own short socket directory: a unix socket path has at most 107
            # bytes, and the node's run directory may sit under a deep tmp_path.
            self.snapshotter_address = os.path.join(self.containerd.sock_dir, "snapshotter.sock")
            proxies["bootseer"] = self.snapshotter_address
            log_path = self.logs / "snapshotter.log"
            with open(log_path, "ab") as log:
                self.snapshotter = self.popen(
                    [
                        sys.executable,
                        "-m",
                        "bootseer",
                        "snapshotter",
                        "--state-dir",
                        str(self.dirs.cache / "bootseer"),
                        "--root",
                        str(self.containerd.snapshotter_root("bootseer")),
                        "--address",
                        self.snapshotter_address,
                        *snapshotter_args,
                    ],
                    stdout=log,
                    stderr=log,
                )
            deadline = time.monotonic() + 60
            while not os.path.exists(self.snapshotter_address):
                if self.snapshotter.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name}: the bootseer snapshotter did not start: "
                        f"{log_path.read_text(errors='replace')[-3000:]}"
                    )
                time.sleep(0.05)
        self.containerd.proxy_snapshotters.update(proxies)
        with self.entered():  # containerd pulls and its shims run on the node
            self.containerd.start()
        assert self.containerd.pid is not None
        self.adopt(self.containerd.pid)  # nothing forked yet: no task was created

    # -- what tests and benchmarks use ---------------------------------------------------

    def cache_endpoint(self, service: str) -> str:
        """``127.0.0.1:PORT`` at which this node reaches the cache tier's ``service``
        ("registry" or "s3"; its bytes count as ``bytes_from(f"{service}-cache")``)."""
        if self.cache is None or service not in self.cache.names:
            raise ValueError(
                f"the cluster has no cache tier for {service!r}: "
                "Cluster(cache=True) with that service"
            )
        return f"{LOOPBACK}:{CACHE_PORT_OFFSET + PORTS[service]}"

    def bytes_from(self, service: str) -> int:
        """Bytes this node received from ``service`` ("registry", "s3", "index"; through the
        cache tier: "registry-cache", "s3-cache") since it started (response headers
        included)."""
        return self._proxy(service).bytes_down

    def bytes_to(self, service: str) -> int:
        """Bytes this node sent to ``service`` (request bodies: uploads, checkpoint saves)."""
        return self._proxy(service).bytes_up

    @property
    def service_latency_s(self) -> float:
        """The one-way delay this node's service proxies add (the link's delay where tc has
        no netem, else 0: netem carries it)."""
        return self._proxy_settings().latency_s

    def _proxy(self, service: str) -> Shaper:
        try:
            return self._proxies[service]
        except KeyError:
            raise ValueError(
                f"{self.name} counts bytes of {sorted(self._proxies)}, not "
                f"{service!r} (a service of the cluster's services=...)"
            ) from None

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``ctr`` against this node's containerd, run on the node (pulls go through its
        link)."""
        if self.containerd is None:
            raise ValueError(f"{self.name} has no containerd: Cluster(..., containerd=True)")
        return self.run(
            [
                "ctr",
                "--address",
                self.containerd.address,
                "--namespace",
                self.containerd.namespace,
                *args,
            ],
            check=check,
        )

    def torchrun(
        self,
        script: Sequence[str],
        *,
        nnodes: str | int,
        nproc_per_node: int = 1,
        rdzv_id: str | None = "job",
        max_restarts: int = 3,
        rdzv_conf: dict[str, Any] | None = None,
        python: str = sys.executable,
        launch: Sequence[str] = (),
    ) -> list[str]:
        """The torchrun command line for this node: c10d rendezvous on the controller's store
        (``is_host=false``: no node hosts it), the node's address for the job's own store,
        ``--nnodes MIN:MAX``. A node lost is noticed in about 3 s (keep-alive 1 s x 3).

        ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's default the job's store is the
        rank-0 agent's, kept across rounds, and a node that joins after a restart waits
        forever for the ``MASTER_ADDR`` that agent wrote only in its first round (torch
        2.13; pytorch/pytorch#135712 is the same family). Unshared, every round writes it.
        ``rdzv_id=None``: none on the command line (torchrun then reads ``PET_RDZV_ID``,
        which ``bootseer run`` under a controller sets per epoch). ``launch``: torchrun's own options for starting the workers (``("--run-path",
        "--start-method", "fork")``: forked from torchrun, torch already imported)."""
        conf = {
            "is_host": "false",
            "keep_alive_interval": 1,
            "keep_alive_max_attempt": 3,
            "join_timeout": 600,
            **(rdzv_conf or {}),
        }
        return [
            "env",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.services.rendezvous_endpoint,
            *(["--rdzv-id", rdzv_id] if rdzv_id is not None else []),
            "--rdzv-conf",
            ",".join(f"{k}={v}" for k, v in conf.items()),
            "--local-addr",
            self.address,
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.5",
            *launch,
            *script,
        ]

    # -- faults --------------------------------------------------------------------------

    def fill_disk(self) -> int:
        """Fill the node's disk: every later write on it fails with ENOSPC. Returns the bytes
        the fill took; :meth:`free_disk` gives them back."""
        path = self.dirs.disk / FILL_NAME
        written = 0
        with open(path, "ab") as f:
            st = os.statvfs(self.dirs.disk)
            with contextlib.suppress(OSError):
                os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
            written = os.fstat(f.fileno()).st_size
            chunk = b"\0" * (1 << 16)
            while True:  # what fallocate left (rounding), a page at a time
                try:
                    written += os.write(f.fileno(), chunk[:4096])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        return written

    def free_disk(self) -> None:
        """Undo :meth:`fill_disk`."""
        (self.dirs.disk / FILL_NAME).unlink(missing_ok=True)

    def set_delay(self, link: Link) -> None:
        """The proxies' share of a new link (its delay, where tc has no netem)."""
        self.link = link
        for proxy in self._proxies.values():
            proxy.update(self._proxy_settings())

    # -- teardown ------------------------------------------------------------------------

    def _outside_groups(self) -> list[Cgroup]:
        """The node's containers: runc puts each at ``/NAMESPACE/ID`` of every hierarchy, its
        containerd namespace being named after the node."""
        if self.containerd is None:
            return []
        return [Cgroup(cgroup2_root() / self.containerd.namespace)]

    def _release(self) -> None:
        for proxy in self._proxies.values():
            proxy.stop()
        if self.containerd is not None:
            ns = self.containerd.namespace
            tasks = self.containerd.dir / "state" / "io.containerd.runtime.v2.task" / ns
            ids = [p.name for p in tasks.iterdir()] if tasks.is_dir() else []
            self.containerd.stop()  # dead already: removes its socket directory
            for cid in ids:  # a killed shim leaves its socket behind
                digest = hashlib.sha256(os.path.join(self.containerd.address, ns, cid).encode())
                (SHIM_SOCKETS / digest.hexdigest()).unlink(missing_ok=True)
            runc = RUNC_ROOT / ns  # only a namespace this node named after itself
            if ns.startswith(f"{self.netns}-") and runc.is_dir():
                shutil.rmtree(runc, ignore_errors=True)
            for path in groups_named(ns):  # the containers' groups, empty by now
                if path.name == ns:
                    Cgroup(path).remove()
