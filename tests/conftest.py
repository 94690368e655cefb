"""Shared fixtures: real components (moto S3, nginx, FUSE) on 127.0.0.1 with free ports.

A component that cannot be started skips its tests with the reason, or fails them when
``BOOTSEER_REQUIRE_SYSTEM=1`` (a provisioned CI machine must not skip silently).
"""

from __future__ import annotations

import os

# Before anything imports botocore: tests must never reach real AWS, whatever the developer's
# environment holds (credentials, profiles, config files with endpoints, instance metadata).
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_SECURITY_TOKEN"] = "testing"
os.environ["AWS_SESSION_TOKEN"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["AWS_CONFIG_FILE"] = os.devnull
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
os.environ.pop("AWS_PROFILE", None)
os.environ.pop("AWS_ENDPOINT_URL", None)
os.environ.pop("AWS_ENDPOINT_URL_S3", None)
# The job's secret that the controller's store records are sealed with (bootseer.robust.seal):
# every process a test starts inherits it; tests of a missing or wrong secret set their own.
os.environ.setdefault("BOOTSEER_JOB_SECRET", "test-job-secret-0123456789abcdef")
# Loopback traffic never goes through an HTTP proxy configured in the environment.
for _var in ("NO_PROXY", "no_proxy"):
    _hosts = [h for h in os.environ.get(_var, "").split(",") if h]
    for _host in ("127.0.0.1", "localhost"):
        if _host not in _hosts:
            _hosts.append(_host)
    os.environ[_var] = ",".join(_hosts)

import contextlib  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

import pytest  # noqa: E402

from bootseer.testing.servers import (  # noqa: E402
    ComponentUnavailable,
    MotoS3Server,
    NginxServer,
    fuse_available,
    require_system,
)

_SYSTEM_FIXTURES = {"nginx_factory", "fuse"}


def require_component(reason: str) -> NoReturn:
    """A component this test needs is unavailable: skip with the reason, or fail when
    ``BOOTSEER_REQUIRE_SYSTEM=1``."""
    if require_system():
        pytest.fail(
            f"required component unavailable (BOOTSEER_REQUIRE_SYSTEM=1): {reason}", pytrace=False
        )
    pytest.skip(reason)


def need(reason: str | None) -> None:
    """``need(fuse_available())``: continue when the check returned None, else
    :func:`require_component` with its reason."""
    if reason is not None:
        require_component(reason)


@contextlib.contextmanager
def s3_through_a_counter(options: dict[str, Any]) -> Iterator[tuple[dict[str, Any], Any]]:
    """(storage options, proxy): the same S3 server reached through an unshaped
    :class:`~bootseer.testing.shaper.Shaper`, so a test measures what a client read from the
    store (``proxy.bytes_down``) with real HTTP."""
    from bootseer.testing.shaper import Shaper, ShaperSettings

    endpoint = options["client_kwargs"]["endpoint_url"].removeprefix("http://")
    host, port = endpoint.rsplit(":", 1)
    proxy = Shaper(host, int(port), ShaperSettings(), "127.0.0.1", 0).start()
    try:
        kwargs = {**options["client_kwargs"], "endpoint_url": f"http://{proxy.address}"}
        yield {**options, "client_kwargs": kwargs}, proxy
    finally:
        proxy.stop()


def modules_loaded_by(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has loaded after running ``code`` (the
    repository on its path): the check that a light import stays light."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    probe = f"{code}\nimport json as _j, sys as _s\nprint(_j.dumps([m for m in {modules!r} if m in _s.modules]))\n"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


@pytest.fixture
def system() -> Callable[[str | None], None]:
    """The :func:`need` helper as a fixture: ``system(fuse_available())`` in a test."""
    return need


#: The longest test files (seconds summed in a CI run, 2026-11-24), run first: with
#: ``--dist loadfile --no-loadscope-reorder`` (the Makefile) a file runs whole on one worker in
#: collection order, and a long file started last keeps one worker busy while the other idles
#: (xdist's own order, most tests first, started the 173 s e2e file last: 1092 s, now 935 s).
LONGEST_FIRST = (
    "test_bench_harness",
    "test_e2e",
    "test_striped_fsspec_suite",
    "test_robust_failslow",
    "test_robust_standby",
    "test_robust_faults",
    "test_ckpt_kill",
    "test_robust_controller",
    "test_fuse_posix",
    "test_cluster",
    "test_ckpt_dist",
    "test_cri",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests using a system-component fixture get the ``system`` marker (``-m "not system"``);
    the :data:`LONGEST_FIRST` files move to the front, each file's own order kept."""
    for item in items:
        if _SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.system)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


# -- S3 (moto server mode) -------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3Server]:
    """One in-process moto S3 server for the session. A test that stops it must start it
    again; ``s3_bucket`` restarts it if it finds it stopped."""
    server = MotoS3Server(in_process=True)
    try:
        server.start()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def s3_server_factory() -> Iterator[Callable[..., MotoS3Server]]:
    """``factory(in_process=True, port=None)`` -> a started MotoS3Server private to the test
    (free to stop, restart or kill); all are stopped at teardown. In-process servers share
    moto's global state with ``s3_server``."""
    servers: list[MotoS3Server] = []

    def factory(*, in_process: bool = True, port: int | None = None) -> MotoS3Server:
        server = MotoS3Server(port, in_process=in_process)
        servers.append(server)
        try:
            return server.start()
        except ComponentUnavailable as exc:
            require_component(str(exc))

    yield factory
    for server in servers:
        server.close()


@pytest.fixture
def s3_bucket(s3_server: MotoS3Server) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, uniquely named bucket: ``(bucket_name, s3fs storage_options)``. Emptied and
    deleted at teardown so that moto's memory does not grow over the session."""
    yield from s3_bucket_of(s3_server)


def s3_bucket_of(s3_server: MotoS3Server) -> Iterator[tuple[str, dict[str, Any]]]:
    """The body of :func:`s3_bucket`, for a fixture of a wider scope (a bucket per class whose
    tests each take a fresh path in it: fsspec's suite, a few thousand requests fewer)."""
    if not s3_server.running:
        s3_server.start()
    name = f"bootseer-test-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(name)
    yield name, s3_server.storage_options()
    if not s3_server.running:
        s3_server.start()
    try:
        client = s3_server.admin_client()
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=name):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        uploads = client.list_multipart_uploads(Bucket=name).get("Uploads", [])
        for upload in uploads:
            client.abort_multipart_upload(
                Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        client.delete_bucket(Bucket=name)
    except Exception as exc:  # cleanup only; never mask the test's own outcome
        print(f"s3_bucket teardown: could not delete {name}: {exc!r}")


@pytest.fixture
def s3fs_fs(s3_server: MotoS3Server) -> Any:
    """A fresh (uncached) ``s3fs.S3FileSystem`` talking HTTP to ``s3_server``."""
    import s3fs

    if not s3_server.running:
        s3_server.start()
    return s3fs.S3FileSystem(**s3_server.storage_options(), skip_instance_cache=True)


# -- nginx ------------------------------------------------------------------------------------


@pytest.fixture
def nginx_factory() -> Iterator[Callable[..., NginxServer]]:
    """``factory(root_dir, **kwargs)`` -> a started NginxServer serving ``root_dir`` on
    127.0.0.1; every server is stopped at teardown. Skips (or fails, under
    BOOTSEER_REQUIRE_SYSTEM=1) when nginx is not installed."""
    servers: list[NginxServer] = []

    def factory(root_dir: str | os.PathLike[str] | Path, **kwargs: Any) -> NginxServer:
        server = NginxServer(root_dir, **kwargs)
        servers.append(server)
        try:
            return server.start()
        except ComponentUnavailable as exc:
            require_component(str(exc))

    yield factory
    for server in servers:
        server.stop()


# -- FUSE -------------------------------------------------------------------------------------


@pytest.fixture
def fuse() -> None:
    """Requires a working FUSE setup (/dev/fuse, libfuse2 via fusepy, fusermount)."""
    need(fuse_available())


# -- local PEP 503 package index ------------------------------------------------------------


from bootseer.testing.pypi import PackageIndex, build_test_wheels  # noqa: E402


@pytest.fixture
def package_index(tmp_path: Path) -> Iterator[PackageIndex]:
    """A started :class:`bootseer.testing.pypi.PackageIndex` on 127.0.0.1 serving freshly built
    copies of ``TEST_WHEELS`` (tinyalpha 1.0 and 2.0, tinybeta 0.1, tinydata 0.3) from
    ``index.wheel_dir`` (a private directory: a test may add wheels with ``build_wheel``).
    Install from it with ``--index-url index.url`` under ``installer_env()``."""
    wheel_dir = tmp_path / "wheels"
    build_test_wheels(wheel_dir)
    with PackageIndex(wheel_dir) as index:
        yield index


# -- OCI registry (CNCF distribution) ---------------------------------------------------------


from bootseer.testing.registry import RegistryServer  # noqa: E402

_SYSTEM_FIXTURES |= {"registry", "registry_factory"}


@pytest.fixture
def registry_factory(tmp_path: Path) -> Iterator[Callable[..., RegistryServer]]:
    """``factory(htpasswd=None, token_auth=False, **kwargs)`` -> a started
    :class:`~bootseer.testing.registry.RegistryServer` (``docker-registry serve``) on
    127.0.0.1 with its storage under ``tmp_path``; ``htpasswd=(user, password)`` turns on Basic
    auth, with ``token_auth=True`` those credentials go to a local token server (Bearer flow).
    All are stopped at teardown. Skips (or fails, under BOOTSEER_REQUIRE_SYSTEM=1) when
    docker-registry, or bcrypt for htpasswd, is missing."""
    servers: list[RegistryServer] = []

    def factory(
        *, htpasswd: tuple[str, str] | None = None, token_auth: bool = False, **kwargs: Any
    ) -> RegistryServer:
        root = tmp_path / f"registry-{len(servers)}"
        server = RegistryServer(root, htpasswd=htpasswd, token_auth=token_auth, **kwargs)
        servers.append(server)
        try:
            return server.start()
        except ComponentUnavailable as exc:
            require_component(str(exc))

    yield factory
    for server in servers:
        server.close()


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryServer]) -> RegistryServer:
    """A private registry without auth for this test (starts in about 0.1 s)."""
    return registry_factory()


# -- containerd (a private daemon per test) -------------------------------------------------


@pytest.fixture
def containerd(tmp_path: Path):
    """A started :class:`bootseer.testing.containerd.ContainerdServer` (CRI off, own socket);
    skips, or fails under BOOTSEER_REQUIRE_SYSTEM=1, without containerd or root."""
    from bootseer.testing.containerd import ContainerdServer

    server = ContainerdServer(tmp_path / "containerd")
    try:
        server.start()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    yield server
    server.stop()


@pytest.fixture
def containerd_factory(tmp_path: Path):
    """``factory(**kwargs)`` -> a started ContainerdServer (``proxy_snapshotters={name:
    socket}`` adds proxy plugins); all are stopped at teardown."""
    from bootseer.testing.containerd import ContainerdServer

    servers: list[ContainerdServer] = []

    def factory(**kwargs: Any) -> ContainerdServer:
        server = ContainerdServer(tmp_path / f"containerd-{len(servers)}", **kwargs)
        try:
            server.start()
        except ComponentUnavailable as exc:
            require_component(str(exc))
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


_SYSTEM_FIXTURES |= {"containerd", "containerd_factory"}


@pytest.fixture
def cri_node_factory(tmp_path: Path):
    """``factory(sandbox_image, **kwargs)`` -> a started :class:`cri_helpers.CRINode` (the
    bootseer snapshotter under a containerd with CRI on); all are closed at teardown."""
    from cri_helpers import CRINode

    need(fuse_available())
    nodes: list[CRINode] = []

    def factory(sandbox_image: str, **kwargs: Any) -> CRINode:
        try:
            node = CRINode(tmp_path / f"cri-node{len(nodes)}", sandbox_image, **kwargs)
        except ComponentUnavailable as exc:
            require_component(str(exc))
        nodes.append(node)
        return node

    yield factory
    for node in nodes:
        node.close()


_SYSTEM_FIXTURES |= {"cri_node_factory"}


@pytest.fixture(scope="session")
def e2e_bench(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The end-to-end job's quick form through ``bootseer bench e2e``, once a session: minutes
    of CI, shared by test_e2e.py and test_bench_harness.py (see e2e_helpers)."""
    from e2e_helpers import missing_component, run_e2e_bench

    need(missing_component())
    return run_e2e_bench(tmp_path_factory.mktemp("e2e"))


_SYSTEM_FIXTURES |= {"e2e_bench"}


@pytest.fixture
def cluster_factory():
    """``factory(nodes=2, **kwargs)`` -> a started :class:`bootseer.testing.cluster.Cluster`
    (network namespaces, real services); each is closed at teardown and its leak check must
    come back empty. Skips (or fails under BOOTSEER_REQUIRE_SYSTEM=1) without root, iproute2,
    tc or cgroup2."""
    from bootseer.testing.cluster import Cluster

    clusters: list[Cluster] = []

    def factory(nodes: int = 2, **kwargs: Any) -> Cluster:
        cluster = Cluster(nodes, **kwargs)
        try:
            cluster.start()
        except ComponentUnavailable as exc:
            require_component(str(exc))
        clusters.append(cluster)
        return cluster

    yield factory
    for cluster in clusters:
        cluster.close()  # raises when anything of the cluster is left


_SYSTEM_FIXTURES |= {"cluster_factory"}


@pytest.fixture()
def tcp_store() -> Iterator[Any]:
    """A real c10d TCPStore of this test's own on a free loopback port (the store the robust
    agents, the controller and their records go through)."""
    import datetime

    from torch.distributed import TCPStore

    s = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    yield s
    del s
