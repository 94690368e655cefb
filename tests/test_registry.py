"""The OCI registry client (prefetch.registry) against the real CNCF distribution registry.

Everything runs on 127.0.0.1: ``docker-registry`` 2.8 from the ``registry`` / ``registry_factory``
fixtures (with htpasswd Basic auth, or token auth through a local token server), the shaping
proxy for dropped connections, and tiny aiohttp servers for answers a healthy registry never
gives (5xx, 429, ignored Range, no mount).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web

from bootseer.testing.registry import RegistryServer
from bootseer.testing.servers import free_port
from bootseer.testing.shaper import Shaper, ShaperSettings
from prefetch import mediatypes as mt
from prefetch.auth import Credentials, load_credentials, merge_scopes, parse_challenges
from prefetch.reference import Reference, compute_digest
from prefetch.registry import (
    DigestMismatch,
    Manifest,
    PlatformNotFound,
    RangeNotSupported,
    RegistryAuthError,
    RegistryClient,
    RegistryError,
    RegistryNotFound,
    RegistryUnavailable,
    SyncRegistry,
    referrers_tag,
    run_sync,
)

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
USER, PASSWORD = "alice", "pw-Secret-7f3a9c"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def _no_ambient_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The developer's env and ~/.docker/config.json must not leak into these tests."""
    monkeypatch.delenv("BOOTSEER_REGISTRY_USERNAME", raising=False)
    monkeypatch.delenv("BOOTSEER_REGISTRY_PASSWORD", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


async def agen(data: bytes, piece: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), piece):
        await asyncio.sleep(0)
        yield data[i : i + piece]


def image_manifest(config: str, layers: list[tuple[str, int]]) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": mt.OCI_MANIFEST,
            "config": {"mediaType": mt.OCI_CONFIG, "digest": config, "size": 2},
            "layers": [{"mediaType": mt.OCI_LAYER_ZSTD, "digest": d, "size": n} for d, n in layers],
        }
    ).encode()


async def push_image(c: RegistryClient, repo: str, tag: str, seed: int = 0) -> Manifest:
    config = await c.put_blob(repo, b"{}")
    layer = blob(1000 + seed, seed)
    d = await c.put_blob(repo, layer)
    data = image_manifest(config, [(d, len(layer))])
    digest = await c.put_manifest(repo, tag, data, mt.OCI_MANIFEST)
    return Manifest(mt.OCI_MANIFEST, data, digest)


# -- pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "registry", "repo", "tag", "digest"),
    [
        ("127.0.0.1:5000/team/img:tag", "127.0.0.1:5000", "team/img", "tag", None),
        ("localhost/img", "localhost", "img", None, None),
        ("ubuntu", "docker.io", "library/ubuntu", None, None),
        ("ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", None),
        ("user/app:v1", "docker.io", "user/app", "v1", None),
        (
            "ghcr.io/o/r/deep/name@sha256:" + "a" * 64,
            "ghcr.io",
            "o/r/deep/name",
            None,
            "sha256:" + "a" * 64,
        ),
        ("[::1]:5000/x:y@sha256:" + "b" * 64, "[::1]:5000", "x", "y", "sha256:" + "b" * 64),
    ],
)
def test_reference_parse(
    text: str, registry: str, repo: str, tag: str | None, digest: str | None
) -> None:
    ref = Reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)
    assert Reference.parse(str(ref)) == ref
    if registry != "docker.io":
        assert str(ref) == text
    assert ref.ref == (digest or tag or "latest")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "team/Img",
        "img:",
        "img@sha256:abc",
        "http://host/img",
        "a b",
        "host:5000/img:t@x",
        "img:" + "t" * 129,
        "x//y",
    ],
)
def test_reference_errors_name_the_reference(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid image reference") as err:
        Reference.parse(bad)
    assert repr(bad) in str(err.value)


def test_challenges_and_credential_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    [bearer] = parse_challenges(
        ['Bearer realm="http://a/token",service="reg",scope="repository:x:pull repository:y:pull"']
    )
    assert (bearer.scheme, bearer.realm, bearer.service) == ("bearer", "http://a/token", "reg")
    assert bearer.scopes == ("repository:x:pull", "repository:y:pull")
    basic, bearer2 = parse_challenges(['Basic realm="r"', "Bearer realm=x, service=s"])
    assert basic.scheme == "basic" and bearer2.service == "s"
    # Registries list actions in any order; scopes are merged per repository.
    assert merge_scopes(
        ["repository:a/b:push,pull"], ["repository:a/b:pull", "repository:c:pull"]
    ) == (
        "repository:a/b:pull,push",
        "repository:c:pull",
    )

    config_dir = tmp_path / "docker"
    config_dir.mkdir()
    auth = base64.b64encode(b"bob:from-config:with-colon").decode()
    (config_dir / "config.json").write_text(
        json.dumps(
            {
                "auths": {
                    "https://reg.example:5000/v1/": {"auth": auth},
                    "https://index.docker.io/v1/": {"username": "hub", "password": "hubpw"},
                },
                "credHelpers": {"helped.example": "secretservice"},
            }
        )
    )
    monkeypatch.setenv("DOCKER_CONFIG", str(config_dir))
    creds = load_credentials("reg.example:5000")
    assert creds is not None and (creds.username, creds.password) == (
        "bob",
        "from-config:with-colon",
    )
    assert "docker config" in creds.source
    hub = load_credentials("docker.io")
    assert hub is not None and hub.username == "hub"
    with caplog.at_level(logging.DEBUG, logger="prefetch.auth"):
        assert load_credentials("helped.example") is None
    assert "credential helper" in caplog.text
    monkeypatch.setenv("BOOTSEER_REGISTRY_USERNAME", "envuser")
    monkeypatch.setenv("BOOTSEER_REGISTRY_PASSWORD", "envpw")
    env = load_credentials("reg.example:5000")
    assert env is not None and (env.username, env.source) == ("envuser", "environment")
    explicit = load_credentials("reg.example:5000", ("me", "mine"))
    assert explicit is not None and explicit.username == "me"
    assert "mine" not in repr(explicit) and "from-config" not in repr(creds)


# -- blobs ----------------------------------------------------------------------------------------


def test_blobs_monolithic_chunked_streamed(registry: RegistryServer) -> None:
    async def main() -> None:
        async with RegistryClient(registry.host) as c:
            assert await c.ping() == "registry/2.0"
            small = blob(5000, 1)
            d1 = await c.put_blob("team/img", small)
            assert d1 == compute_digest(small)
            assert await c.head_blob("team/img", d1) == 5000
            assert await c.get_blob("team/img", d1) == small

            big = blob(300_000, 2)
            d2 = await c.put_blob("team/img", big, compute_digest(big), chunk_size=64 * 1024)
            assert await c.get_blob("team/img", d2, expected_size=len(big)) == big

            streamed = blob(200_000, 3)
            d3 = await c.put_blob("team/img", agen(streamed, 7000), chunk_size=50_000)
            assert d3 == compute_digest(streamed)
            d4 = await c.put_blob("team/other", agen(streamed, 9999))  # default chunk size
            assert d4 == d3 and await c.head_blob("team/other", d4) == len(streamed)

            empty = await c.put_blob("team/img", b"", chunk_size=10)
            assert await c.get_blob("team/img", empty) == b""

            # Already present: nothing is uploaded (the stream is not even read).
            async def boom() -> AsyncIterator[bytes]:
                raise AssertionError("stream read although the blob exists")
                yield b""

            assert await c.put_blob("team/img", boom(), d2) == d2

            # Wrong digest: refused before anything is committed.
            with pytest.raises(DigestMismatch, match="digests to"):
                await c.put_blob("team/img", b"abc", compute_digest(b"abd"))
            with pytest.raises(DigestMismatch, match="upload cancelled"):
                await c.put_blob("team/img", agen(b"xyz" * 100, 10), compute_digest(b"nope"))
            assert await c.head_blob("team/img", compute_digest(b"abc")) is None

            async with c.open_blob_stream("team/img", d2, chunk_size=100_000) as stream:
                sizes = [len(chunk) async for chunk in stream]
            assert sizes == [100_000, 100_000, 100_000]

    run(main())


def test_blob_ranges(registry: RegistryServer) -> None:
    data = blob(100_000, 4)

    async def main() -> None:
        async with RegistryClient(registry.host) as c:
            d = await c.put_blob("r/ranges", data)
            for start, end in [(0, 1), (4096, 12_345), (len(data) - 1, len(data)), (0, len(data))]:
                assert await c.get_blob_range("r/ranges", d, start, end) == data[start:end]
            with pytest.raises(ValueError):
                await c.get_blob_range("r/ranges", d, 10, 10)
            with pytest.raises(RangeNotSupported, match="inside the blob|416"):
                await c.get_blob_range("r/ranges", d, len(data) - 10, len(data) + 10)
            with pytest.raises(RangeNotSupported, match="416"):
                await c.get_blob_range("r/ranges", d, len(data) + 5, len(data) + 10)

    run(main())


def test_corrupt_blob_detected(registry: RegistryServer) -> None:
    data = blob(200_000, 5)
    digest = compute_digest(data)

    async def main() -> None:
        async with RegistryClient(registry.host) as c:
            await c.put_blob("r/corrupt", data)
            path = registry.blob_path(digest)
            raw = bytearray(path.read_bytes())
            assert raw == data
            raw[150_000] ^= 0xFF
            path.write_bytes(bytes(raw))
            with pytest.raises(DigestMismatch) as err:
                await c.get_blob("r/corrupt", digest)
            msg = str(err.value)
            assert digest in msg and registry.host in msg and "r/corrupt" in msg
            assert err.value.digest == digest
            # The stream hands out chunks, but the last one only after the digest checked out.
            got = 0
            with pytest.raises(DigestMismatch):
                async for chunk in c.open_blob_stream("r/corrupt", digest, chunk_size=65536):
                    got += len(chunk)
            assert got == 3 * 65536
            # A range read is not verifiable here: it returns what is stored.
            assert await c.get_blob_range("r/corrupt", digest, 150_000, 150_001) == bytes(
                [data[150_000] ^ 0xFF]
            )

    run(main())


# -- manifests, tags, referrers ----------------------------------------------------------------------


def test_manifests_index_and_platforms(registry: RegistryServer) -> None:
    async def main() -> None:
        async with RegistryClient(registry.host) as c:
            repo = "team/multi"
            amd = await push_image(c, repo, "amd64-only", seed=1)
            arm = await push_image(c, repo, "arm64-only", seed=2)
            index = json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": mt.OCI_INDEX,
                    "manifests": [
                        {
                            **amd.descriptor.to_json(),
                            "platform": {"os": "linux", "architecture": "amd64"},
                        },
                        {
                            **arm.descriptor.to_json(),
                            "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"},
                        },
                    ],
                }
            ).encode()
            index_digest = await c.put_manifest(repo, "v1", index, mt.OCI_INDEX)

            got = await c.get_manifest(repo, "v1")
            assert (got.media_type, got.digest, got.data) == (mt.OCI_INDEX, index_digest, index)
            assert [m.digest for m in got.manifests] == [amd.digest, arm.digest]
            by_digest = await c.get_manifest(repo, amd.digest)
            assert by_digest.data == amd.data and by_digest.layers[0].size == 1001
            head = await c.head_manifest(repo, "v1")
            assert head is not None and (head.digest, head.size) == (index_digest, len(index))
            assert await c.head_manifest(repo, "nope") is None

            ref = f"{registry.host}/{repo}:v1"
            assert (await c.resolve_image(ref)).digest == amd.digest
            assert (await c.resolve_image(ref, "linux/arm64")).digest == arm.digest
            assert (await c.resolve_image(ref, "linux/aarch64/v8")).digest == arm.digest
            pinned = Reference.parse(ref).with_digest(index_digest)
            assert (await c.resolve_image(pinned, "linux/arm64/v8")).digest == arm.digest
            # A plain image manifest is returned as it is.
            direct = await c.resolve_image(f"{registry.host}/{repo}:arm64-only")
            assert direct.digest == arm.digest

            with pytest.raises(PlatformNotFound) as err:
                await c.resolve_image(ref, "linux/s390x")
            assert err.value.available == ["linux/amd64", "linux/arm64/v8"]
            assert "linux/s390x" in str(err.value) and "linux/arm64/v8" in str(err.value)
            assert registry.host in str(err.value) and repo in str(err.value)

            # Pushing under a digest that is not the bytes' digest is refused locally.
            with pytest.raises(DigestMismatch):
                await c.put_manifest(repo, amd.digest, index, mt.OCI_INDEX)

    run(main())


def test_tags_and_not_found_errors(registry: RegistryServer) -> None:
    async def main() -> None:
        async with RegistryClient(registry.host) as c:
            m = await push_image(c, "t/tags", "a")
            for tag in ("b", "c", "d", "e"):
                await c.put_manifest("t/tags", tag, m.data, mt.OCI_MANIFEST)
            assert sorted(await c.list_tags("t/tags", page_size=2)) == list("abcde")

            with pytest.raises(RegistryNotFound) as err:
                await c.get_manifest("t/tags", "missing")
            msg = str(err.value)
            assert "t/tags:missing" in msg and registry.host in msg and "404" in msg
            assert "MANIFEST_UNKNOWN" in msg and "check" in msg
            assert err.value.status == 404 and err.value.code == "MANIFEST_UNKNOWN"
            unknown = compute_digest(b"never pushed")
            with pytest.raises(RegistryNotFound, match=f"t/tags@{unknown}.*HTTP 404"):
                await c.get_blob("t/tags", unknown)
            with pytest.raises(RegistryNotFound, match="NAME_UNKNOWN"):
                await c.list_tags("no/such/repo")

    run(main())


def test_cross_repo_mount(registry: RegistryServer) -> None:
    data = blob(70_000, 6)

    async def main() -> None:
        async with RegistryClient(registry.host) as c:
            d = await c.put_blob("src/repo", data)
            assert await c.head_blob("dst/repo", d) is None
            assert await c.mount_blob("dst/repo", d, "src/repo") is True
            assert await c.get_blob("dst/repo", d) == data

    run(main())


async def _start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"


def test_mount_falls_back_to_copy(registry: RegistryServer) -> None:
    """A registry that answers the mount request with 202 (an upload session): the client
    copies the blob through itself. The 'registry' here is a proxy that strips ?mount=."""
    data = blob(150_000, 7)

    async def main() -> None:
        async with aiohttp.ClientSession(auto_decompress=False) as upstream:

            async def forward(request: web.Request) -> web.StreamResponse:
                query = {k: v for k, v in request.query.items() if k not in ("mount", "from")}
                url = f"{registry.url}{request.path}"
                headers = {
                    k: v
                    for k, v in request.headers.items()
                    if k.lower() not in ("host", "content-length", "transfer-encoding")
                }
                async with upstream.request(
                    request.method,
                    url,
                    params=query,
                    headers=headers,
                    data=await request.read(),
                    allow_redirects=False,
                ) as resp:
                    body = await resp.read()
                    out = {
                        k: v
                        for k, v in resp.headers.items()
                        if k.lower()
                        not in (
                            "content-length",
                            "transfer-encoding",
                            "date",
                            "server",
                            "connection",
                        )
                    }
                    return web.Response(status=resp.status, body=body, headers=out)

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", forward)
            runner, host = await _start_app(app)
            try:
                async with RegistryClient(registry.host) as direct:
                    d = await direct.put_blob("src/repo", data)
                async with RegistryClient(host) as c:
                    assert await c.mount_blob("dst/copy", d, "src/repo", chunk_size=64_000) is False
                async with RegistryClient(registry.host) as direct:
                    assert await direct.get_blob("dst/copy", d) == data
            finally:
                await runner.cleanup()

    run(main())


def test_referrers_tag_schema_fallback(registry: RegistryServer) -> None:
    async def main() -> None:
        async with RegistryClient(registry.host) as c:
            repo = "team/prof"
            image = await push_image(c, repo, "v1")
            assert await c.get_referrers(repo, image.digest) == []
            p1 = await c.put_referrer(
                repo,
                image,
                "application/vnd.bootseer.profile.v1+json",
                [("application/json", b'{"frames": [1, 2]}')],
                annotations={"org.bootseer.node": "n1"},
            )
            p2 = await c.put_referrer(repo, image.descriptor, "application/vnd.example.sbom")
            assert c._referrers_api is False  # distribution 2.8: no referrers API
            tags = await c.list_tags(repo)
            assert referrers_tag(image.digest) in tags
            refs = await c.get_referrers(repo, image.digest)
            assert {r.digest for r in refs} == {p1.digest, p2.digest}
            only = await c.get_referrers(
                repo, image.digest, "application/vnd.bootseer.profile.v1+json"
            )
            assert [r.digest for r in only] == [p1.digest]
            assert only[0].annotations == {"org.bootseer.node": "n1"}
            art = await c.get_manifest(repo, p1.digest)
            assert art.subject is not None and art.subject.digest == image.digest
            assert art.artifact_type == "application/vnd.bootseer.profile.v1+json"
            assert await c.get_blob(repo, art.layers[0].digest) == b'{"frames": [1, 2]}'
            # Pushing the same artifact again does not duplicate the index entry.
            again = await c.put_referrer(repo, image.descriptor, "application/vnd.example.sbom")
            assert again.digest == p2.digest
            assert len(await c.get_referrers(repo, image.digest)) == 2

    run(main())


# -- faults -----------------------------------------------------------------------------------------


class RangeSpy(RegistryClient):
    """Records the Range headers of blob GETs."""

    ranges: list[str]

    async def _request(self, method: str, url: Any, ctx: Any, **kwargs: Any) -> Any:
        rng = (kwargs.get("headers") or {}).get("Range")
        if method == "GET" and rng:
            self.ranges = [*getattr(self, "ranges", []), rng]
        return await super()._request(method, url, ctx, **kwargs)


def test_dropped_connections_mid_blob_resume(registry: RegistryServer) -> None:
    data = blob(2_000_000, 8)

    async def main() -> None:
        async with RegistryClient(registry.host) as direct:
            d = await direct.put_blob("f/drop", data)
        with Shaper("127.0.0.1", registry.port) as shaper:
            shaper.drop_after(700_000)
            async with RangeSpy(shaper.address, backoff_s=0.01) as c:
                assert await c.get_blob("f/drop", d) == data
            assert shaper.connections_total >= 2
            # Resumed with a Range request from where it broke off, not restarted.
            assert len(c.ranges) == 1 and c.ranges[0].startswith("bytes=")
            assert 0 < int(c.ranges[0][6:-1]) <= 700_000

            # Reset while a stream is being read (the link is slow, so data is still due).
            shaper.update(ShaperSettings(per_conn_bps=8e6))
            before = shaper.connections_total
            async with RangeSpy(shaper.address, backoff_s=0.01) as c:
                got = bytearray()
                async with c.open_blob_stream("f/drop", d, chunk_size=64 * 1024) as stream:
                    async for chunk in stream:
                        if not got:
                            await asyncio.to_thread(shaper.drop_active)
                        got += chunk
                assert bytes(got) == data
            assert shaper.connections_total - before >= 2 and len(c.ranges) >= 1

    run(main())


def test_dead_registry_bounded_retries() -> None:
    host = f"127.0.0.1:{free_port()}"
    digest = compute_digest(b"x")

    async def main() -> None:
        async with RegistryClient(host, retries=2, backoff_s=0.01) as c:
            t0 = time.monotonic()
            with pytest.raises(RegistryUnavailable) as err:
                await c.get_blob("dead/repo", digest)
            assert time.monotonic() - t0 < 5
            msg = str(err.value)
            assert host in msg and "dead/repo" in msg and digest in msg
            assert "after 3 attempts" in msg and "reachable" in msg
            with pytest.raises(RegistryUnavailable, match="after 3 attempts"):
                await c.put_blob("dead/repo", b"data")

    run(main())


def test_retries_5xx_429_but_never_4xx() -> None:
    calls: dict[str, int] = {}
    manifest = image_manifest(compute_digest(b"{}"), [])
    digest = compute_digest(manifest)
    data = blob(1000, 9)

    async def handler(request: web.Request) -> web.Response:
        key = request.path
        calls[key] = calls.get(key, 0) + 1
        n = calls[key]
        if key.endswith("/manifests/flaky"):
            if n == 1:
                return web.Response(status=503)
            if n == 2:
                return web.Response(status=429, headers={"Retry-After": "1"})
            return web.Response(
                body=manifest,
                headers={"Content-Type": mt.OCI_MANIFEST, "Docker-Content-Digest": digest},
            )
        if key.endswith("/manifests/bad"):
            body = {"errors": [{"code": "MANIFEST_INVALID", "message": "manifest invalid"}]}
            return web.json_response(body, status=400)
        if key.endswith("/manifests/lying"):
            return web.Response(
                body=manifest,
                headers={
                    "Content-Type": mt.OCI_MANIFEST,
                    "Docker-Content-Digest": compute_digest(b"other"),
                },
            )
        if "/blobs/" in key:  # ignores Range
            return web.Response(body=data)
        return web.Response(status=404)

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner, host = await _start_app(app)
        try:
            async with RegistryClient(host, retries=3, backoff_s=0.01) as c:
                t0 = time.monotonic()
                m = await c.get_manifest("x/y", "flaky")
                assert m.digest == digest and calls["/v2/x/y/manifests/flaky"] == 3
                assert time.monotonic() - t0 >= 0.9  # Retry-After: 1 was honoured

                with pytest.raises(RegistryError) as err:
                    await c.get_manifest("x/y", "bad")
                assert not isinstance(err.value, RegistryUnavailable)
                assert calls["/v2/x/y/manifests/bad"] == 1
                assert "HTTP 400 MANIFEST_INVALID" in str(err.value)

                with pytest.raises(DigestMismatch, match="expected sha256:"):
                    await c.get_manifest("x/y", "lying")

                d = compute_digest(data)
                with pytest.raises(RangeNotSupported, match="ignored the Range header"):
                    await c.get_blob_range("x/y", d, 0, 10)
                assert await c.get_blob("x/y", d) == data
        finally:
            await runner.cleanup()

    run(main())


# -- auth -------------------------------------------------------------------------------------------


def test_basic_auth_htpasswd(
    registry_factory: Callable[..., RegistryServer],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    server = registry_factory(htpasswd=(USER, PASSWORD))

    async def main() -> None:
        async with RegistryClient(server.host) as anon:
            with pytest.raises(RegistryAuthError, match="BOOTSEER_REGISTRY_USERNAME") as err:
                await anon.ping()
            assert err.value.status == 401
        async with RegistryClient(server.host, credentials=(USER, "wrong-password")) as bad:
            with pytest.raises(RegistryAuthError, match="refused the credentials of user 'alice'"):
                await bad.put_blob("a/b", b"data")
        async with RegistryClient(server.host, credentials=(USER, PASSWORD)) as c:
            d = await c.put_blob("a/b", b"data")
            assert await c.get_blob("a/b", d) == b"data"

    run(main())

    # The same credentials from docker's config.json, and from the environment.
    cfg = tmp_path / "dockercfg"
    cfg.mkdir()
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (cfg / "config.json").write_text(json.dumps({"auths": {server.host: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    with SyncRegistry(server.host) as reg:
        assert reg.credentials_source is not None and "docker config" in reg.credentials_source
        assert reg.get_blob("a/b", compute_digest(b"data")) == b"data"
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("BOOTSEER_REGISTRY_USERNAME", USER)
    monkeypatch.setenv("BOOTSEER_REGISTRY_PASSWORD", PASSWORD)
    with SyncRegistry(server.host) as reg:
        assert reg.credentials_source == "environment"
        assert b"".join(reg.iter_blob("a/b", compute_digest(b"data"), chunk_size=1)) == b"data"


def test_token_auth_bearer_flow(registry_factory: Callable[..., RegistryServer]) -> None:
    server = registry_factory(
        htpasswd=(USER, PASSWORD),
        token_auth=True,
        token_grants={
            USER: {
                "team/app": ["pull", "push"],
                "team/lib": ["pull", "push"],
                "team/base": ["pull"],
            }
        },
    )
    tokens = server.token_server
    assert tokens is not None

    async def main() -> None:
        async with RegistryClient(server.host) as anon:
            with pytest.raises(RegistryAuthError) as err:
                await anon.head_blob("team/app", compute_digest(b"x"))
            assert "BOOTSEER_REGISTRY_USERNAME" in str(err.value)
        async with RegistryClient(server.host, credentials=(USER, "wrong")) as bad:
            with pytest.raises(RegistryAuthError, match="token server refused") as err:
                await bad.ping()
            assert err.value.status == 401
        async with RegistryClient(server.host, credentials=(USER, PASSWORD)) as c:
            await c.ping()
            d = await c.put_blob("team/app", blob(100_000, 10), chunk_size=30_000)
            fetched = c.token_fetches
            for _ in range(3):  # cached per scope: no new tokens
                await c.get_blob("team/app", d)
                await c.head_blob("team/app", d)
            after_pulls = c.token_fetches
            assert after_pulls - fetched <= 1
            for _ in range(3):
                await c.get_blob("team/app", d)
            assert c.token_fetches == after_pulls
            assert any(s == "repository:team/app:pull,push" for s in tokens.scopes_seen)
            # Pull-only on team/base: pushing there is refused with a clear error, after
            # one token request (a fresh token for the same scopes would not do better).
            before = tokens.requests
            with pytest.raises(RegistryAuthError) as err:
                await c.put_blob("team/base", b"not allowed")
            msg = str(err.value)
            assert "team/base" in msg and server.host in msg and "insufficient_scope" in msg
            assert "lacks permission" in msg
            assert tokens.requests - before <= 2, tokens.scopes_seen[-4:]
            # A cross-repository mount needs pull on the source too: one token, both scopes.
            lib = await c.put_blob("team/lib", b"shared layer")
            assert await c.mount_blob("team/app", lib, "team/lib") is True
            assert "repository:team/lib:pull" in tokens.scopes_seen
            assert await c.get_blob("team/app", lib) == b"shared layer"

    run(main())


def test_secrets_never_logged_or_raised(
    registry_factory: Callable[..., RegistryServer], caplog: pytest.LogCaptureFixture
) -> None:
    basic = registry_factory(htpasswd=(USER, PASSWORD))
    token = registry_factory(htpasswd=(USER, PASSWORD), token_auth=True)
    assert token.token_server is not None
    messages: list[str] = []

    async def attempt(fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            await fn()
        except RegistryError as exc:
            err: BaseException | None = exc
            while err is not None:
                messages.extend([str(err), repr(err)])
                err = err.__cause__ or err.__context__

    async def main() -> None:
        for server in (basic, token):
            for password in (PASSWORD, "wrong-" + PASSWORD):
                creds = Credentials(USER, password)
                messages.append(repr(creds))
                async with RegistryClient(
                    server.host, credentials=creds, retries=1, backoff_s=0.01
                ) as c:
                    messages.append(repr(c))
                    await attempt(c.ping)
                    await attempt(lambda c=c: c.put_blob("s/r", b"payload"))
                    await attempt(lambda c=c: c.get_manifest("s/r", "missing"))
                    await attempt(lambda c=c: c.get_blob("s/r", compute_digest(b"nope")))
        dead = RegistryClient(
            f"127.0.0.1:{free_port()}", credentials=(USER, PASSWORD), retries=1, backoff_s=0.01
        )
        async with dead:
            await attempt(dead.ping)

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert token.token_server.issued, "the token flow did not run"
    secrets = [PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()]
    secrets += token.token_server.issued
    secrets += [t.split(".")[2] for t in token.token_server.issued]  # the signatures
    text = caplog.text + "\n".join(r.getMessage() for r in caplog.records) + "\n".join(messages)
    assert "s/r" in text and "refused" in text  # the flows did produce messages
    for secret in secrets:
        assert secret not in text


def test_run_sync_and_sync_facade(registry: RegistryServer) -> None:
    async def push() -> str:
        async with RegistryClient(registry.host) as c:
            return await c.put_blob("s/sync", b"abc")

    d = run_sync(push())

    async def inside_a_loop() -> str:  # run_sync must not nest loops
        return run_sync(push())

    assert asyncio.run(inside_a_loop()) == d
    with SyncRegistry(registry.host) as reg:
        assert reg.head_blob("s/sync", d) == 3
        assert reg.get_blob_range("s/sync", d, 1, 3) == b"bc"
        with pytest.raises(RegistryNotFound):
            reg.get_manifest("s/sync", "nope")
    with pytest.raises(RuntimeError, match="closed"):
        reg.head_blob("s/sync", d)


def test_client_argument_checks() -> None:
    c = RegistryClient("127.0.0.1:5000")
    assert str(c.base_url) == "http://127.0.0.1:5000" and c.plain_http
    assert RegistryClient("ghcr.io").base_url.scheme == "https"
    assert str(RegistryClient("docker.io").base_url) == "https://registry-1.docker.io"
    assert RegistryClient("http://reg.example:80").plain_http
    with pytest.raises(ValueError, match="HOST"):
        RegistryClient("127.0.0.1:5000/repo")
