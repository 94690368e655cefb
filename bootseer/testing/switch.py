"""The cluster's switch: a Linux bridge in a network namespace of its own, one veth pair per host.

Why a namespace of its own: nothing of the cluster's network touches the machine's (no
interface, route or address appears on the host), so two clusters on one machine may use the
same addresses, and deleting the namespaces removes every interface with them. Each host's
link is shaped on both ends of its veth pair (:mod:`bootseer.testing.links`).
"""

from __future__ import annotations

from .links import Link, shape
from .netns import create_netns, delete_netns, ip

__all__ = ["HOST_IFNAME", "PREFIX_LEN", "Switch"]

HOST_IFNAME = "eth0"  # the interface a host sees (GLOO_SOCKET_IFNAME)
PREFIX_LEN = 24
BRIDGE = "br0"


class Switch:
    """A bridge in namespace ``netns``; :meth:`connect` plugs a host's namespace into it."""

    def __init__(self, netns: str) -> None:
        self.netns = netns

    def create(self) -> Switch:
        create_netns(self.netns)
        ip("link", "add", BRIDGE, "type", "bridge", netns=self.netns)
        ip("link", "set", BRIDGE, "up", netns=self.netns)
        return self

    def connect(self, port: str, host_netns: str, address: str, link: Link) -> None:
        """A veth pair: ``port`` on the bridge, ``eth0`` with ``address`` in ``host_netns``;
        ``link`` shapes both directions. No IPv6 link-local address: gloo would pick it."""
        ip(
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            HOST_IFNAME,
            "netns",
            host_netns,
            netns=self.netns,
        )
        ip("link", "set", port, "master", BRIDGE, "up", netns=self.netns)
        ip("link", "set", HOST_IFNAME, "addrgenmode", "none", netns=host_netns)
        ip("addr", "add", f"{address}/{PREFIX_LEN}", "dev", HOST_IFNAME, netns=host_netns)
        ip("link", "set", HOST_IFNAME, "up", netns=host_netns)
        self.shape(port, host_netns, link)

    def shape(self, port: str, host_netns: str, link: Link) -> None:
        """Give the link between ``port`` and its host this rate and delay, both ways."""
        shape(self.netns, port, link)  # towards the host
        shape(host_netns, HOST_IFNAME, link)  # from the host

    def set_up(self, port: str, up: bool) -> None:
        """Plug or unplug a host's cable: down, its packets are dropped, nobody is told."""
        ip("link", "set", port, "up" if up else "down", netns=self.netns)

    def disconnect(self, port: str) -> None:
        """Remove a host's veth pair (no-op when gone)."""
        ip("link", "delete", port, netns=self.netns, check=False)

    def delete(self) -> None:
        delete_netns(self.netns)
