"""containerd's hosts configuration as the snapshotter reads it: which hosts, in which order,
for which calls; and reads through them against real registries (a mirror down, a mirror
missing a blob, a mirror serving corrupt bytes, every host failing)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from prefetch.containerd.hosts import CAPABILITIES, RegistryHost, RegistryHosts, registry_hosts
from prefetch.registry import RegistryNotFound, RegistryUnavailable, SyncRegistry

REG = "registry.example.com:5000"


def _write(root: Path, directory: str, text: str) -> None:
    (root / directory).mkdir(parents=True, exist_ok=True)
    (root / directory / "hosts.toml").write_text(text)


def test_without_a_config_the_registry_is_read_itself(tmp_path: Path) -> None:
    assert registry_hosts(None, REG) == [RegistryHost(REG)]
    assert registry_hosts(tmp_path, REG) == [RegistryHost(REG)]  # no directory for it
    (tmp_path / REG).mkdir()
    assert registry_hosts(tmp_path, REG) == [RegistryHost(REG)]  # a directory, no file


def test_hosts_come_in_file_order_then_the_server(tmp_path: Path) -> None:
    _write(
        tmp_path,
        REG,
        """
server = "https://upstream.example.com"
capabilities = ["pull", "resolve", "push"]
[host."http://mirror-b:5000"]
  capabilities = ["pull"]
[host."mirror-a.example.com"]
  capabilities = ["pull", "Resolve"]
""",
    )
    assert registry_hosts(tmp_path, REG) == [
        RegistryHost("http://mirror-b:5000", frozenset({"pull"})),
        RegistryHost("https://mirror-a.example.com", frozenset({"pull", "resolve"})),
        RegistryHost("https://upstream.example.com", CAPABILITIES),
    ]


def test_without_a_server_the_registry_itself_comes_last(tmp_path: Path) -> None:
    _write(tmp_path, REG, '[host."http://mirror:5000"]\n')
    assert registry_hosts(tmp_path, REG) == [RegistryHost("http://mirror:5000"), RegistryHost(REG)]


def test_directories_are_looked_up_in_containerds_order(tmp_path: Path) -> None:
    _write(tmp_path, "_default", '[host."http://everyone"]\n')
    _write(tmp_path, REG, '[host."http://by-name"]\n')
    assert registry_hosts(tmp_path, REG)[0].url == "http://by-name"
    _write(tmp_path, "registry.example.com_5000_", '[host."http://by-port"]\n')
    assert registry_hosts(tmp_path, REG)[0].url == "http://by-port"
    assert registry_hosts(tmp_path, "other.example.com")[0].url == "http://everyone"


def test_hosts_the_snapshotter_cannot_honour_are_skipped_and_logged(tmp_path: Path, caplog) -> None:
    _write(
        tmp_path,
        REG,
        """
[host."https://needs-ca"]
  ca = "/etc/certs/ca.pem"
[host."https://with-header"]
  [host."https://with-header".header]
    x-token = "t0ken"
[host."https://harbor.example.com/v2/proxy"]
[host."https://fine/v2"]
""",
    )
    with caplog.at_level(logging.WARNING, logger="prefetch.containerd.hosts"):
        hosts = registry_hosts(tmp_path, REG)
    assert [h.url for h in hosts] == ["https://fine", REG]
    for name in ("needs-ca", "with-header", "harbor.example.com"):
        assert name in caplog.text
    assert "t0ken" not in caplog.text  # a header's value may be a credential


@pytest.mark.parametrize(
    "text",
    [
        "server = [1]",
        'capabilities = ["fetch"]',
        "host = 3",
        "[host",
        '[host."h"]\n  capabilities = "pull"',
    ],
)
def test_a_file_containerd_would_reject_means_the_registry_alone(
    tmp_path: Path, caplog, text: str
) -> None:
    _write(tmp_path, REG, text)
    with caplog.at_level(logging.WARNING, logger="prefetch.containerd.hosts"):
        assert registry_hosts(tmp_path, REG) == [RegistryHost(REG)]
    assert "hosts.toml" in caplog.text and REG in caplog.text


# -- reads through the hosts, against real registries --------------------------------------


def _blob(registry, data: bytes, repo: str = "team/app") -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with SyncRegistry(registry.host) as reg:
        reg.put_blob(repo, data, digest)
    return digest


def test_a_read_moves_on_from_a_host_that_cannot_serve_it(registry_factory) -> None:
    mirror, upstream = registry_factory(), registry_factory()
    only_upstream = _blob(upstream, b"only upstream has me")
    both = _blob(upstream, b"everyone has me")
    _blob(mirror, b"everyone has me")
    hosts = RegistryHosts(
        "origin.example.com", [RegistryHost(mirror.url), RegistryHost(upstream.url)]
    )
    try:
        assert hosts.get_blob("team/app", only_upstream) == b"only upstream has me"  # 404
        assert hosts.get_blob_range("team/app", both, 0, 8) == b"everyone"
        mirror.stop()  # unreachable: the next host answers
        assert hosts.get_blob("team/app", both) == b"everyone has me"
    finally:
        hosts.close()


def test_a_mirror_serving_corrupt_bytes_is_passed_over(registry_factory) -> None:
    mirror, upstream = registry_factory(), registry_factory()
    digest = _blob(upstream, b"the real bytes")
    _blob(mirror, b"the real bytes")
    mirror.blob_path(digest).write_bytes(b"the fake bytes")
    hosts = RegistryHosts(
        "origin.example.com", [RegistryHost(mirror.url), RegistryHost(upstream.url)], retries=0
    )
    try:
        assert hosts.get_blob("team/app", digest) == b"the real bytes"
    finally:
        hosts.close()


def test_when_every_host_fails_the_error_names_each(registry_factory) -> None:
    mirror, upstream = registry_factory(), registry_factory()
    missing = "sha256:" + "0" * 64
    hosts = RegistryHosts(
        "origin.example.com", [RegistryHost(mirror.url), RegistryHost(upstream.url)]
    )
    try:
        with pytest.raises(RegistryNotFound) as info:
            hosts.get_blob("team/app", missing)
        assert mirror.host in str(info.value) and upstream.host in str(info.value)
        assert "origin.example.com" in str(info.value)
    finally:
        hosts.close()


def test_calls_go_only_to_hosts_with_their_capability(registry_factory) -> None:
    mirror, upstream = registry_factory(), registry_factory()
    data = b"pushed"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    hosts = RegistryHosts(
        "origin.example.com",
        [
            RegistryHost(mirror.url, frozenset({"pull", "resolve"})),
            RegistryHost(upstream.url, frozenset({"push"})),
        ],
    )
    try:
        hosts.put_blob("team/app", data, digest)  # only the push host takes it
        with SyncRegistry(mirror.host) as reg:
            assert reg.head_blob("team/app", digest) is None
        with SyncRegistry(upstream.host) as reg:
            assert reg.head_blob("team/app", digest) == len(data)
        with pytest.raises(RegistryNotFound):  # reads do not go to the push-only host
            hosts.get_blob("team/app", digest)
        none = RegistryHosts("origin.example.com", [RegistryHost(mirror.url, frozenset({"pull"}))])
        with pytest.raises(RegistryUnavailable, match="no configured host may resolve"):
            none.resolve_image("origin.example.com/team/app:v1")
        none.close()
    finally:
        hosts.close()


# -- the snapshotter's registry side reading through them ----------------------------------


def test_the_snapshotter_reads_the_hosts_file_again_at_every_pull(
    tmp_path: Path, registry_factory
) -> None:
    """An image named after a registry nobody serves: unreadable (and, being unreachable,
    every image of that registry is given up at once for a while); once containerd's hosts
    directory names a mirror, the next pull reads the mirror, with no restart."""
    from containerd_helpers import push_images

    from bootseer.testing.servers import free_port
    from prefetch.containerd.errors import UnavailableError
    from prefetch.containerd.remote import RemoteLayers

    mirror = registry_factory()
    push_images(mirror.host, "team/app")
    with SyncRegistry(mirror.host) as reg:
        digest = reg.resolve_image(f"{mirror.host}/team/app:lazy").digest
    origin = f"127.0.0.1:{free_port()}"
    config = tmp_path / "certs.d"
    remote = RemoteLayers(
        tmp_path / "remote",
        registry_config_path=config,
        registry_options={"retries": 0},
        unreadable_retry_s=60,
    )
    try:
        with pytest.raises(UnavailableError, match=f"registry at http://{origin} is up"):
            remote.image(f"{origin}/team/app:lazy", digest)
        with pytest.raises(UnavailableError, match="not tried again for 60 s"):
            remote.image(f"{origin}/team/other:v1", None)  # the whole registry, for now
        remote.unreadable_retry_s = 0
        (config / origin).mkdir(parents=True)
        (config / origin / "hosts.toml").write_text(f'[host."{mirror.url}"]\n')
        image = remote.image(f"{origin}/team/app:lazy", digest)
        assert image.manifest.digest == digest
        assert [h.url for h in remote._registry(origin).hosts] == [mirror.url, origin]
    finally:
        remote.close()
