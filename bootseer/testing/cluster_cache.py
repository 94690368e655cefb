"""The cluster's caching tier: nginx with ``proxy_cache`` and the ``slice`` module on a host of
its own, between the nodes and the services' registry and S3 (docs/cluster.md, "The cache
tier"; docs/decisions.md says why nginx).

Why this engine: the nodes' reads are HTTP range requests (the lazy image's frames, the
striped checkpoint's and environment's stripes), and nginx's ``slice`` module caches a range
request as aligned 1 MiB slices, each fetched from the origin once whatever range asked for it;
``proxy_cache_lock`` makes concurrent misses of one slice a single origin request, so N nodes
starting at once cost the origin one copy. It is a Debian package every cluster already runs.
What it caches: the registry's blobs by digest (content-addressed: a stale copy cannot exist)
and S3 GETs without a query string (bootseer sends only immutable objects there, striped
stripes and environment snapshot chunks: ``striped``'s ``mirror`` option); everything else (manifests by tag, listings, writes, HEADs)
passes through uncached. A 404 is never cached. Nothing read through the cache is trusted: the
frames' sha256, the stripes' checksums, the chunks' sha256 are checked on every node as for
the origin.

Layout: the cache host listens on its address at the services' ports (5000 registry, 9000 S3)
and reaches the origin through counting proxies of its own (``origin_bytes``): the bytes that
left the origin for the cluster, whatever the node count.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from .cluster_host import Host
from .cluster_services import PORTS, Services
from .servers import ComponentUnavailable, find_nginx
from .shaper import Shaper, ShaperSettings

__all__ = ["CACHED", "CacheHost", "anonymous_read_policy", "nginx_cache_config"]

CACHED = ("registry", "s3")  # the services the tier caches
SLICE = "1m"
START_TIMEOUT_S = 30.0


def _quote(value: str | os.PathLike[str]) -> str:
    text = str(value)
    if any(c in text for c in '\n\r\0"\\;{}'):
        raise ValueError(f"path not usable in an nginx config: {text!r}")
    return f'"{text}"'


def anonymous_read_policy(bucket: str) -> dict[str, Any]:
    """A bucket policy letting anyone GET its objects: the cache tier's reads are unsigned
    (striped's ``mirror``), so a bucket it serves must allow them (docs/decisions.md)."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": "*",
                "Action": "s3:GetObject",
                "Resource": f"arn:aws:s3:::{bucket}/*",
            }
        ],
    }


def nginx_cache_config(
    prefix: Path,
    listen: str,
    upstreams: dict[str, tuple[str, int]],
    max_size: str = "8g",
    ports: dict[str, int] | None = None,
) -> str:
    """nginx.conf of the caching tier: for each cached service, a server on
    ``listen:PORTS[service]`` (or ``ports[service]``: tests on free ports) in front of
    ``upstreams[service]`` (host, port)."""
    q = _quote
    tmp = prefix / "tmp"
    user = "user root root;\n" if os.geteuid() == 0 else ""
    servers = []
    for name, (host, port) in upstreams.items():
        if name == "registry":  # blobs by digest: content-addressed, cached in slices
            cached_location = r'location ~ "^/v2/.+/blobs/sha256:[0-9a-f]{64}$"'
        else:  # S3: GETs without a query string (the stripes bootseer reads through it)
            cached_location = "location /"
        # the rest of the registry's API (tags, manifests, uploads) goes through uncached
        passthrough = (
            "" if name == "s3" else f"        location / {{ proxy_pass http://origin_{name}; }}"
        )
        servers.append(f"""
    upstream origin_{name} {{
        server {host}:{port};
        keepalive 64;
    }}
    server {{
        listen {listen}:{(ports or PORTS)[name]};
        client_max_body_size 0;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $http_host;
        proxy_request_buffering off;
        error_page 418 = @pass;
        {cached_location} {{
            if ($request_method != GET) {{ return 418; }}
            if ($args != "") {{ return 418; }}
            slice {SLICE};
            proxy_cache tier;
            proxy_cache_key "{name}$uri$slice_range";
            proxy_set_header Range $slice_range;
            proxy_cache_valid 200 206 24h;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 60s;
            proxy_cache_lock_age 60s;
            add_header X-Cache-Status $upstream_cache_status;
            proxy_pass http://origin_{name};
        }}
{passthrough}
        location @pass {{
            proxy_buffering off;
            proxy_pass http://origin_{name};
        }}
    }}""")
    return f"""# Written by bootseer.testing.cluster_cache; private to this cache host.
daemon off;
master_process on;
worker_processes 1;
{user}pid {q(prefix / "nginx.pid")};
error_log {q(prefix / "logs" / "error.log")} warn;
events {{ worker_connections 4096; }}
http {{
    access_log {q(prefix / "logs" / "access.log")};
    server_tokens off;
    sendfile on;
    tcp_nodelay on;
    keepalive_requests 100000;
    client_body_temp_path {q(tmp / "client_body")};
    proxy_temp_path {q(tmp / "proxy")};
    fastcgi_temp_path {q(tmp / "fastcgi")};
    uwsgi_temp_path {q(tmp / "uwsgi")};
    scgi_temp_path {q(tmp / "scgi")};
    proxy_cache_path {q(prefix / "cache")} levels=1:2 keys_zone=tier:32m max_size={max_size}
                     inactive=24h use_temp_path=off;
{"".join(servers)}
}}
"""


class CacheHost(Host):
    """The cache tier's host: ``origin_bytes(service)`` is what nginx fetched from the origin
    (the cluster's egress from the registry or S3)."""

    def __init__(self, *args: Any, services: Services, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.services = services
        self.names = tuple(n for n in CACHED if n in services.proxied)
        self._origin: dict[str, Shaper] = {}
        self.nginx: subprocess.Popen | None = None

    def _start(self) -> None:
        binary = find_nginx()
        prefix = self.root / "nginx"
        for sub in ("logs", "tmp", "cache"):
            (prefix / sub).mkdir(parents=True, mode=0o700)
        upstreams = {}
        with self.entered():  # the counting proxies' sockets live on the cache host
            for name in self.names:
                proxy = Shaper(
                    self.services.address, PORTS[name], ShaperSettings(), "127.0.0.1", 0
                ).start()
                self._origin[name] = proxy
                upstreams[name] = ("127.0.0.1", proxy.port)
        conf = prefix / "nginx.conf"
        conf.write_text(nginx_cache_config(prefix, self.address, upstreams))
        with open(self.logs / "nginx.log", "ab") as log:
            self.nginx = self.popen(
                [binary, "-c", str(conf), "-p", str(prefix)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(self.names)
        while pending:
            assert self.nginx is not None
            if self.nginx.poll() is not None:
                raise ComponentUnavailable(
                    f"nginx of the cache tier exited {self.nginx.returncode}: "
                    f"{(self.logs / 'nginx.log').read_text(errors='replace')[-2000:]}"
                )
            with (
                self.entered(),
                contextlib.suppress(OSError),
                socket.create_connection((self.address, PORTS[pending[0]]), timeout=0.5),
            ):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the cache tier did not listen on {pending} in {START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)

    def origin_bytes(self, service: str) -> int:
        """Bytes the cache tier received from ``service`` at the origin since it started."""
        try:
            return self._origin[service].bytes_down
        except KeyError:
            raise ValueError(f"the cache tier caches {list(self.names)}, not {service!r}") from None

    def wipe(self) -> None:
        """Forget every cached slice (nginx keeps running: the next reads miss)."""
        cache = self.root / "nginx" / "cache"
        for entry in cache.iterdir():
            shutil.rmtree(entry, ignore_errors=True)

    def _release(self) -> None:
        for proxy in self._origin.values():
            with contextlib.suppress(Exception):
                proxy.stop()
