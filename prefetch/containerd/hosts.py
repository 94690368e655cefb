"""containerd's registry hosts configuration, read the way containerd 1.6 reads it, so that the
snapshotter fetches a layer from where containerd was told to pull it (a mirror, a pull-through
cache) and not only from the registry named in the image reference.

containerd (CRI's ``registry.config_path``, ``ctr --hosts-dir``) looks for one directory per
registry under the config path: ``<host>_<port>_``, then ``<host>:<port>`` (or just
``<host>``), then ``_default``. Its ``hosts.toml``::

    server = "https://registry.example.com"   # the registry itself; default: its own name
    [host."http://mirror.local:5000"]         # tried first, in the order of the file
      capabilities = ["pull", "resolve"]      # default: pull, resolve, push

A read by digest goes to hosts with ``pull``, a tag resolution to hosts with ``resolve``, a push
to hosts with ``push``. A missing directory or file means the registry alone; a file that does
not parse (or names an unknown capability) is logged and means the registry alone, as in
containerd.

Not honoured here: ``header``, the TLS settings (``ca``, ``client``, ``skip_verify``) and API
roots other than ``/v2`` (a URL with a path, ``override_path``). A host that needs them is
skipped (and logged): if no other host serves the layer, the snapshotter falls back to
containerd's own download, which does honour them.
"""

from __future__ import annotations

import logging
import os
import threading
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..reference import is_digest
from ..registry import RegistryError, RegistryUnavailable, SyncRegistry

log = logging.getLogger(__name__)

CAPABILITIES = frozenset({"pull", "resolve", "push"})


@dataclass(frozen=True)
class RegistryHost:
    """One place to read a registry from: ``url`` is ``scheme://host[:port]``, or the bare
    registry name for the default (the registry client then picks the scheme)."""

    url: str
    capabilities: frozenset[str] = CAPABILITIES


def host_dirs(config_path: str | os.PathLike, registry: str) -> list[Path]:
    """The directories containerd looks at for ``registry``, in its order."""
    root = Path(config_path)
    dirs = []
    host, sep, port = registry.rpartition(":")
    if sep and host and port.isdigit():
        dirs.append(root / f"{host}_{port}_")
    return [*dirs, root / registry, root / "_default"]


def registry_hosts(config_path: str | os.PathLike | None, registry: str) -> list[RegistryHost]:
    """The hosts to read ``registry`` from, in order (the registry alone without a config)."""
    default = [RegistryHost(registry)]
    if not config_path:
        return default
    found = next((d for d in host_dirs(config_path, registry) if d.is_dir()), None)
    if found is None:
        return default
    path = found / "hosts.toml"
    try:
        doc = tomllib.loads(path.read_text())
        return _parse(doc, registry, path)
    except FileNotFoundError:
        return default
    except (OSError, ValueError, TypeError) as exc:
        log.warning("%s: %s; reading %s itself, as containerd does", path, exc, registry)
        return default


def _parse(doc: dict[str, Any], registry: str, path: Path) -> list[RegistryHost]:
    hosts = []
    table = doc.get("host", {})
    if not isinstance(table, dict):
        raise ValueError("'host' must be a table of [host.\"URL\"] entries")
    for url, entry in table.items():  # TOML tables keep the file's order
        host = _host(url, entry, path)
        if host is not None:
            hosts.append(host)
    server = doc.get("server", "")
    if not isinstance(server, str):
        raise ValueError(f"server = {server!r} is not a URL")
    if server:
        host = _host(server, doc, path)
        if host is not None:
            hosts.append(host)
    else:
        hosts.append(RegistryHost(registry, _capabilities(doc)))
    return hosts


def _capabilities(entry: dict[str, Any]) -> frozenset[str]:
    caps = entry.get("capabilities")
    if caps is None or caps == []:
        return CAPABILITIES
    if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
        raise ValueError(f"capabilities = {caps!r} is not a list of strings")
    unknown = {c.lower() for c in caps} - CAPABILITIES
    if unknown:
        raise ValueError(f"unknown capability {sorted(unknown)[0]!r} (pull, resolve, push)")
    return frozenset(c.lower() for c in caps)


def _host(url: str, entry: Any, path: Path) -> RegistryHost | None:
    if not isinstance(entry, dict):
        raise ValueError(f"host {url!r} is not a table")
    caps = _capabilities(entry)
    full = url if url.startswith(("http://", "https://")) else "https://" + url
    parts = urlsplit(full)
    unsupported = [k for k in ("header", "ca", "client", "skip_verify") if k in entry]
    if parts.path.rstrip("/") not in ("", "/v2") or entry.get("override_path"):
        unsupported.append(f"API root {parts.path!r}")
    if unsupported or not parts.netloc:
        log.warning(
            "%s: host %s skipped by the snapshotter (%s not supported): layers only "
            "it serves are unpacked by containerd",
            path,
            url,
            ", ".join(unsupported) or "no host name",
        )
        return None
    return RegistryHost(f"{parts.scheme}://{parts.netloc}", caps)


# Which capability each registry call needs (containerd's terms: "pull" reads by digest).
_READS = {
    "get_blob": "pull",
    "get_blob_range": "pull",
    "head_blob": "pull",
    "get_referrers": "pull",
    "resolve_image": "resolve",
    "list_tags": "resolve",
}
_PUSHES = ("put_blob", "put_manifest", "put_referrer", "mount_blob")


class RegistryHosts:
    """One registry read through its hosts: a call goes to the hosts with the capability it
    needs, the host that last answered first, then the others in the configured order; a
    registry error (unreachable, 401, 404, a digest mismatch) moves on to the next host. When
    every host fails, the error names each host and why. Thread-safe; the same blocking calls
    as :class:`~prefetch.registry.SyncRegistry`."""

    def __init__(self, registry: str, hosts: Sequence[RegistryHost], **options: Any) -> None:
        self.registry = registry
        self.hosts = list(hosts)
        self._options = options
        self._clients: dict[str, SyncRegistry] = {}
        self._preferred: RegistryHost | None = None
        self._lock = threading.Lock()

    def _client(self, host: RegistryHost) -> SyncRegistry:
        with self._lock:
            client = self._clients.get(host.url)
            if client is None:
                client = self._clients[host.url] = SyncRegistry(host.url, **self._options)
            return client

    def _order(self, capability: str) -> list[RegistryHost]:
        able = [h for h in self.hosts if capability in h.capabilities]
        preferred = self._preferred
        if preferred in able:
            able.remove(preferred)
            able.insert(0, preferred)
        return able

    def _capability(self, name: str, args: tuple[Any, ...]) -> str:
        if name == "get_manifest":  # (repo, tag or digest)
            return "pull" if len(args) > 1 and is_digest(str(args[1])) else "resolve"
        if name in _PUSHES:
            return "push"
        if name in _READS:
            return _READS[name]
        raise AttributeError(f"RegistryHosts has no call {name!r}")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, args, kwargs)

        self._capability(name, ("", ""))  # unknown calls fail here, not on first use
        return call

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        capability = self._capability(name, args)
        hosts = self._order(capability)
        if not hosts:
            raise RegistryUnavailable(
                f"registry {self.registry}: no configured host may "
                f"{capability} (hosts.toml capabilities)",
                registry=self.registry,
            )
        failures: list[tuple[RegistryHost, RegistryError]] = []
        for host in hosts:
            try:
                result = getattr(self._client(host), name)(*args, **kwargs)
            except RegistryError as exc:
                failures.append((host, exc))
                continue
            self._preferred = host
            return result
        if len(failures) == 1:
            raise failures[0][1]
        kinds = {type(e) for _, e in failures}  # all unreachable: the registry is unreachable
        cls = kinds.pop() if len(kinds) == 1 else RegistryError
        raise cls(
            f"registry {self.registry}: no host could serve it: "
            + "; ".join(f"{h.url}: {e}" for h, e in failures),
            registry=self.registry,
        )

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()
