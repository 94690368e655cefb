"""Many nodes on one machine: a cluster of Linux network namespaces for tests and benchmarks.

Why: bootseer is for jobs on many nodes, where the slowest node sets the pace, the registry
and the checkpoint store serve every node at once, and a node is lost on its own. This builds
that with real kernel networking and real components: N nodes (each a network namespace with
its own address on a bridge, host name, shaped link, cgroup, disk, counting proxies to the
services, optionally its own containerd and bootseer snapshotter) and a services host
(registry, S3, package index, the controller's c10d store). docs/cluster.md has the picture.

    with Cluster(nodes=2, link=Link(rate="100mbit")) as c:
        c.services.create_bucket("ckpt")
        procs = [n.popen(n.torchrun(["train.py"], nnodes="2:2")) for n in c.nodes]
        c.kill_node(1)                 # every process of node1 at once
        fresh = c.replace_node(1)      # same name and address, empty disk

Everything is removed on ``close()`` (also after an exception or a killed node);
:meth:`Cluster.leaks` says what would have been left.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from .cgroup import Cgroup, KillMethod, cgroup2_root, groups_named
from .cluster_cache import CacheHost
from .cluster_host import Host, HostDead
from .cluster_node import RUNC_ROOT, Node, NodeDirs
from .cluster_services import ALL_SERVICES, PORTS, Services, check_services
from .cluster_sweep import forget, record, sweep_stale
from .links import Link, qdisc_available
from .netns import NETNS_DIR, ip, mounts_under
from .servers import ComponentUnavailable
from .switch import Switch

__all__ = [
    "ALL_SERVICES",
    "MAX_NODES",
    "PORTS",
    "Cluster",
    "Host",
    "HostDead",
    "Link",
    "Node",
    "NodeDirs",
    "Services",
]

MAX_NODES = 8
SUBNET = "198.18.0."  # RFC 2544's benchmarking range: private to the cluster's namespaces
SERVICES_ADDRESS = SUBNET + "2"
CACHE_ADDRESS = SUBNET + "3"  # the cache tier's host (Cluster(cache=True))
FIRST_NODE = 10  # node i is SUBNET + (10 + i)
_SIZE = re.compile(r"^\d+[kmg]?$", re.IGNORECASE)
_TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "umount")


class Cluster:
    """``nodes`` nodes (1 to 8) and a services host; a context manager (or ``start()`` and
    ``close()``).

    ``link``: every node's link (tc rate, delay); ``service_link``: the services host's own
    link (all nodes share it). ``services``: which of ``ALL_SERVICES`` to start.
    ``containerd``/``snapshotter``: a containerd (and the bootseer snapshotter, which implies
    containerd) per node. ``disk_size``: each node's disk (tmpfs ``size=``). ``workdir``:
    where the cluster's private directory goes (default: the temp directory)."""

    def __init__(
        self,
        nodes: int = 2,
        *,
        link: Link | None = None,
        service_link: Link | None = None,
        services: Sequence[str] = ALL_SERVICES,
        containerd: bool = False,
        snapshotter: bool = False,
        snapshotter_args: Sequence[str] = (),
        disk_size: str = "512m",
        workdir: str | os.PathLike[str] | None = None,
        kill_method: KillMethod = "auto",
        cache: bool = False,
    ) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"a cluster has 1 to {MAX_NODES} nodes, not {nodes}")
        if not _SIZE.match(disk_size):
            raise ValueError(
                f"disk_size {disk_size!r} is not a size: write it as tmpfs does, "
                "e.g. '512m' or '2g'"
            )
        self.node_count = nodes
        self.link = link or Link()
        self.service_link = service_link or Link()
        self.service_names = check_services(tuple(services))
        self.containerd = containerd or snapshotter
        self.snapshotter = snapshotter
        self.snapshotter_args = tuple(snapshotter_args)
        self.disk_size = disk_size
        self.workdir = None if workdir is None else Path(workdir)
        self.kill_method: KillMethod = kill_method
        self.cache_tier = cache
        self.id = uuid.uuid4().hex[:8]
        self.prefix = f"bsc-{self.id}"  # every name this cluster gives starts with it
        self.dir: Path | None = None
        self.nodes: list[Node] = []
        self._services: Services | None = None
        self._cache: CacheHost | None = None
        self._switch = Switch(f"{self.prefix}-switch")
        self._cgroup: Cgroup | None = None
        self._problems: list[str] = []
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"Cluster({self.prefix}, {len(self.nodes)} nodes, {self.link.describe()}, "
            f"services={list(self.service_names)})"
        )

    @property
    def services(self) -> Services:
        if self._services is None:
            raise RuntimeError("the cluster is not started: use it as a context manager")
        return self._services

    @property
    def cache(self) -> CacheHost:
        """The cache tier's host (``Cluster(cache=True)``): ``origin_bytes(service)``."""
        if self._cache is None:
            raise RuntimeError("this cluster has no cache tier: Cluster(cache=True)")
        return self._cache

    @property
    def tc_delays(self) -> bool:
        """Whether tc (netem) delays the links; else the nodes' service proxies do, and
        traffic between nodes gets no delay."""
        return qdisc_available("netem")

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> Self:
        """Build the switch, the services host and the nodes; on failure, remove what was
        built and raise (ComponentUnavailable when something is not installed)."""
        if self.dir is not None or self._closed:
            raise RuntimeError(
                f"cluster {self.prefix} was started already: a Cluster starts once (use a new one)"
            )
        self._check_machine()
        if swept := sweep_stale():
            warnings.warn(
                f"removed the remains of clusters whose owner died: {swept}",
                RuntimeWarning,
                stacklevel=2,
            )
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir=self.workdir))
            cgroup = cgroup2_root() / self.prefix
            record(self.prefix, self.dir, cgroup)  # a killed owner's remains can be found
            self._cgroup = Cgroup(cgroup).create()
            self._switch.create()
            self._services = Services(
                "services",
                SERVICES_ADDRESS,
                f"{self.prefix}-services",
                self.dir / "services",
                self._cgroup.child("services"),
                self.kill_method,
                names=self.service_names,
                index_dir=self.dir / "services" / "index",
            )
            self._services._create(self._switch, "svc", self.service_link)
            self._services._start()
            if self.cache_tier:
                self._cache = CacheHost(
                    "cache",
                    CACHE_ADDRESS,
                    f"{self.prefix}-cache",
                    self.dir / "cache",
                    self._cgroup.child("cache"),
                    self.kill_method,
                    services=self._services,
                )
                self._cache._create(self._switch, "cache", self.service_link)
                self._cache._start()
            self.nodes = [self._new_node(i, 1) for i in range(self.node_count)]
        except BaseException:
            self.close(raise_leaks=False)
            raise
        return self

    def _check_machine(self) -> None:
        if os.geteuid() != 0:
            raise ComponentUnavailable(
                "the cluster needs root (network namespaces, tc, cgroups, mounts)"
            )
        missing = [t for t in _TOOLS if shutil.which(t) is None]
        if missing:
            raise ComponentUnavailable(
                f"the cluster needs {', '.join(missing)} (apt: iproute2 util-linux mount)"
            )
        if not qdisc_available("tbf"):
            raise ComponentUnavailable("this kernel has no tbf qdisc: links cannot be shaped")

    def _new_node(self, index: int, generation: int) -> Node:
        assert self.dir is not None and self._cgroup is not None and self._services
        name = f"node{index}"
        node = Node(
            name,
            f"{SUBNET}{FIRST_NODE + index}",
            f"{self.prefix}-{name}",
            self.dir / f"{name}.{generation}",
            self._cgroup.child(f"{name}.{generation}"),
            self.kill_method,
            index=index,
            generation=generation,
            services=self._services,
            link=self.link,
            cache=self._cache,
        )
        if index < len(self.nodes):
            self.nodes[index] = node
        else:
            self.nodes.append(node)  # in the list before it starts: close() removes a half one
        node._create(self._switch, f"n{index}", self.link)
        node._start(
            self.disk_size,
            f"{self.prefix}-{name}",
            containerd=self.containerd,
            snapshotter=self.snapshotter,
            snapshotter_args=self.snapshotter_args,
            containerd_namespace=f"{self.prefix}-{name}-g{generation}",
        )
        return node

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(raise_leaks=exc is None)

    def close(self, *, raise_leaks: bool = True) -> None:
        """Remove everything: every process (cgroups killed), mount, namespace, veth, the
        bridge, the cgroups, the private directory. Idempotent. What could not be removed is
        raised (``raise_leaks``) or warned about."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes:
            self._problems += node.close(self._switch, f"n{node.index}")
        if self._cache is not None:
            self._problems += self._cache.close(self._switch, "cache")
        if self._services is not None:
            self._problems += self._services.close(self._switch, "svc")
        self._switch.delete()
        if self._cgroup is not None:
            try:
                self._cgroup.remove()
            except OSError as exc:
                self._problems.append(f"cgroup {self._cgroup.path}: {exc}")
        if (
            self.dir is not None
            and self.dir.name.startswith(f"{self.prefix}-")
            and not mounts_under(self.dir)
        ):
            shutil.rmtree(self.dir, ignore_errors=True)
        left = self.leaks()
        if not left:
            forget(self.prefix)  # else the record stays: a later sweep retries
            return
        if raise_leaks:
            raise RuntimeError(f"cluster {self.prefix} teardown left: {'; '.join(left)}")
        warnings.warn(
            f"cluster {self.prefix} teardown left: {'; '.join(left)}", RuntimeWarning, stacklevel=2
        )

    def leaks(self) -> list[str]:
        """What of this cluster exists after ``close()`` (empty when everything is gone):
        network namespaces, its cgroup, mounts or files under its directory, runc state,
        processes found in its namespaces at teardown."""
        found = list(self._problems)
        if NETNS_DIR.is_dir():
            found += [
                f"network namespace {p.name}"
                for p in NETNS_DIR.iterdir()
                if p.name.startswith(f"{self.prefix}-")
            ]
        if self._cgroup is not None and self._cgroup.path.exists():
            found.append(f"cgroup {self._cgroup.path}")
        found += [f"cgroup {p} (a container's)" for p in groups_named(f"{self.prefix}-")]
        if self.dir is not None:
            found += [f"mount {m}" for m in mounts_under(self.dir)]
            if self.dir.exists():
                found.append(f"directory {self.dir}")
        if RUNC_ROOT.is_dir():
            found += [
                f"runc state {p}"
                for p in RUNC_ROOT.iterdir()
                if p.name.startswith(f"{self.prefix}-")
            ]
        return found

    # -- node operations -----------------------------------------------------------------

    def kill_node(self, index: int) -> None:
        """Lose node ``index``: every process it runs gets SIGKILL at once (its cgroup, then
        anything left in its namespaces). Its address stays up, so peers see their
        connections reset; its mounts and disk stay until :meth:`replace_node`."""
        self.nodes[index].kill()

    def replace_node(self, index: int) -> Node:
        """Remove node ``index`` entirely (processes, mounts, disk, namespaces) and put a
        fresh, empty one in its place: same name, address and link, new directories, new
        proxies (byte counters at zero), its own containerd again when the cluster has one."""
        old = self.nodes[index]
        self._problems += old.close(self._switch, f"n{index}")
        return self._new_node(index, old.generation + 1)

    def slow_link(
        self, index: int, *, rate: str | None = None, delay_ms: float | None = None
    ) -> Link:
        """Change node ``index``'s link (rate, delay; what is not given stays). Returns it."""
        node = self.nodes[index]
        link = Link(
            rate if rate is not None else node.link.rate,
            delay_ms if delay_ms is not None else node.link.delay_ms,
        )
        self._switch.shape(f"n{index}", node.netns, link)
        node.set_delay(link)
        return link

    def disconnect(self, index: int) -> None:
        """Unplug node ``index``'s cable: its packets are dropped, nobody is told (a network
        partition: peers time out instead of seeing a reset)."""
        self._switch.set_up(f"n{index}", False)

    def reconnect(self, index: int) -> None:
        """Plug the cable back in. Every host forgets the neighbours it failed to reach
        meanwhile (a FAILED entry answers EHOSTUNREACH until the kernel re-probes it), so the
        next connection resolves the address again, as after a real repair."""
        self._switch.set_up(f"n{index}", True)
        for host in (*self.nodes, *([self._services] if self._services is not None else [])):
            ip("neigh", "flush", "all", netns=host.netns, check=False)

    def fill_disk(self, index: int) -> int:
        """Fill node ``index``'s disk (writes on it fail with ENOSPC); returns the bytes."""
        return self.nodes[index].fill_disk()

    def free_disk(self, index: int) -> None:
        self.nodes[index].free_disk()

    def service_down(self, name: str, down: bool = True) -> None:
        """Take a proxied service ("s3", "registry", "index") down for every node, or bring it
        back: while down, open connections are reset and new ones refused at once, as by a
        dying server; its data stays (the server itself keeps running)."""
        for node in self.nodes:
            proxy = node._proxy(name)
            proxy.set_refuse(down)
            if down:
                proxy.drop_active()
