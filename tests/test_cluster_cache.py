"""The cluster's cache tier (nginx ``proxy_cache`` + ``slice`` on a host of its own): what
nodes read through it leaves the origin once, whatever the node count; range reads are
served in slices; writes, listings and manifests by tag pass through uncached; a node can
still reach the origin when the tier is gone."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from bootseer.testing.cluster import Cluster

pytestmark = pytest.mark.system

SIZE = 3 << 20  # three slices and a bit
BLOB = os.urandom(SIZE + 12345)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from conftest import require_component

    from bootseer.testing.servers import ComponentUnavailable

    c = Cluster(3, services=("registry", "s3"), cache=True)
    try:
        c.start()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    try:
        yield c
    finally:
        c.close()


def _fetch(node, url: str, ranges: list[tuple[int, int]] | None = None) -> dict:
    """GETs from ``node`` (a whole object, or each inclusive byte range): sha256 of what came
    back, status codes and the cache's X-Cache-Status. An S3 URL (``s3://ENDPOINT/b/k``) is
    read signed, with boto3, as s3fs would."""
    script = f"""
import hashlib, json, urllib.request
url, ranges = {url!r}, {ranges!r}
out = {{"parts": []}}
def add(status, body, cache):
    out["parts"].append({{"status": status, "sha": hashlib.sha256(body).hexdigest(),
                         "len": len(body), "cache": cache}})
for r in ranges or [None]:
    rng = f"bytes={{r[0]}}-{{r[1]}}" if r else None
    if url.startswith("s3://"):
        import boto3
        endpoint, bucket, key = url[5:].split("/", 2)
        s3 = boto3.client("s3", endpoint_url="http://" + endpoint, region_name="us-east-1")
        resp = s3.get_object(Bucket=bucket, Key=key, **({{"Range": rng}} if rng else {{}}))
        meta = resp["ResponseMetadata"]
        add(meta["HTTPStatusCode"], resp["Body"].read(), meta["HTTPHeaders"].get("x-cache-status"))
        continue
    req = urllib.request.Request(url)
    if rng:
        req.add_header("Range", rng)
    with urllib.request.urlopen(req, timeout=30) as resp:
        add(resp.status, resp.read(), resp.headers.get("X-Cache-Status"))
print(json.dumps(out))
"""
    return json.loads(node.run([sys.executable, "-c", script]).stdout)


def _put_object(c: Cluster, bucket: str, key: str, data: bytes) -> None:
    import boto3

    c.services.create_bucket(bucket)
    with c.services.entered():
        s3 = boto3.client("s3", **_boto(c))
        s3.put_object(Bucket=bucket, Key=key, Body=data)


def _boto(c: Cluster) -> dict:
    opts = c.services.storage_options()
    return {
        "endpoint_url": opts["client_kwargs"]["endpoint_url"],
        "aws_access_key_id": opts["key"],
        "aws_secret_access_key": opts["secret"],
        "region_name": "us-east-1",
    }


def test_an_object_read_by_every_node_leaves_the_origin_once(cluster: Cluster) -> None:
    c = cluster
    _put_object(c, "tier", "stripes/0", BLOB)
    before = c.cache.origin_bytes("s3")
    want = hashlib.sha256(BLOB).hexdigest()
    seen = []
    for node in c.nodes:
        got = _fetch(node, f"s3://{node.cache_endpoint('s3')}/tier/stripes/0")
        assert got["parts"][0]["sha"] == want
        seen.append(got["parts"][0]["cache"])
    origin = c.cache.origin_bytes("s3") - before
    assert SIZE < origin < SIZE * 1.1, origin  # one copy (and its slices' headers)
    assert seen[0] == "MISS" and seen[1:] == ["HIT", "HIT"], seen
    for node in c.nodes:
        assert node.bytes_from("s3-cache") >= SIZE and node.bytes_from("s3") == 0


def test_range_reads_are_served_from_slices_exactly(cluster: Cluster) -> None:
    c = cluster
    _put_object(c, "ranges", "obj", BLOB)
    ranges = [
        (0, 99),
        (1 << 20, (1 << 20) + 4095),
        ((1 << 20) - 10, (1 << 20) + 10),
        (len(BLOB) - 500, len(BLOB) - 1),
    ]
    before = c.cache.origin_bytes("s3")
    got = _fetch(c.nodes[0], f"s3://{c.nodes[0].cache_endpoint('s3')}/ranges/obj", ranges)
    for (lo, hi), part in zip(ranges, got["parts"], strict=True):
        assert part["status"] == 206
        assert part["sha"] == hashlib.sha256(BLOB[lo : hi + 1]).hexdigest(), (lo, hi)
    # only the slices those ranges touch came from the origin (0, 1 and the last), not the
    # whole object
    assert c.cache.origin_bytes("s3") - before < len(BLOB)
    again = _fetch(c.nodes[1], f"s3://{c.nodes[1].cache_endpoint('s3')}/ranges/obj", ranges)
    assert [p["sha"] for p in again["parts"]] == [p["sha"] for p in got["parts"]]
    assert {p["cache"] for p in again["parts"]} == {"HIT"}


def test_writes_listings_and_misses_pass_through_uncached(cluster: Cluster) -> None:
    """A PUT through the tier reaches the origin; a listing (a query string) is never
    cached, so a second object shows at once; a missing key's 404 is not cached either."""
    c = cluster
    c.services.create_bucket("through")
    node = c.nodes[0]
    base = f"http://{node.cache_endpoint('s3')}"
    script = f"""
import json, boto3, botocore.exceptions
s3 = boto3.client("s3", endpoint_url={base!r}, region_name="us-east-1")
def listing():
    resp = s3.list_objects_v2(Bucket="through")
    keys = [o["Key"] for o in resp.get("Contents", [])]
    return keys, resp["ResponseMetadata"]["HTTPHeaders"].get("x-cache-status")
def status(key):
    try:
        s3.get_object(Bucket="through", Key=key)["Body"].read()
        return 200
    except botocore.exceptions.ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"]
missing = status("later")
s3.put_object(Bucket="through", Key="a", Body=b"first")
one, cached = listing()
s3.put_object(Bucket="through", Key="later", Body=b"now there")
two, _ = listing()
print(json.dumps({{"missing": missing, "one": one, "two": two, "cached": cached,
                  "later": status("later")}}))
"""
    out = json.loads(node.run([sys.executable, "-c", script]).stdout)
    assert out["missing"] == 404 and out["later"] == 200  # the 404 was not kept
    assert out["one"] == ["a"] and out["two"] == ["a", "later"]  # the listing was not cached
    assert out["cached"] is None


def test_registry_blobs_by_digest_are_cached_and_tags_are_not(cluster: Cluster) -> None:
    from prefetch.registry import SyncRegistry

    c = cluster
    blob = os.urandom(2 << 20)
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    with c.services.entered(), SyncRegistry(c.services.registry_host) as reg:
        reg.put_blob("tier/app", blob, digest)
    before = c.cache.origin_bytes("registry")
    for node in c.nodes:
        url = f"http://{node.cache_endpoint('registry')}/v2/tier/app/blobs/{digest}"
        got = _fetch(node, url)
        assert got["parts"][0]["sha"] == digest.split(":")[1]
    assert c.cache.origin_bytes("registry") - before < len(blob) * 1.1


def test_the_origin_stays_reachable_when_the_tier_is_lost(tmp_path: Path) -> None:
    """A cache host killed: its address refuses, the node's own route to the origin works
    (clients that list the origin after the mirror fall back: containerd's hosts.toml,
    striped's mirror option)."""
    from conftest import require_component

    from bootseer.testing.servers import ComponentUnavailable

    c = Cluster(1, services=("s3",), cache=True)
    try:
        c.start()
    except ComponentUnavailable as exc:
        require_component(str(exc))
    try:
        _put_object(c, "lost", "obj", b"x" * 1000)
        node = c.nodes[0]
        assert _fetch(node, f"s3://{node.cache_endpoint('s3')}/lost/obj")["parts"][0]["len"] == 1000
        c.cache.kill()
        script = f"""
import json
import boto3
from botocore.config import Config
cached = boto3.client("s3", endpoint_url="http://{node.cache_endpoint("s3")}",
                      region_name="us-east-1", config=Config(retries={{"max_attempts": 1}},
                                                             connect_timeout=5, read_timeout=5))
try:
    cached.get_object(Bucket="lost", Key="obj")["Body"].read()
    cache = "answered"
except Exception as exc:
    cache = type(exc).__name__
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1")
origin = len(s3.get_object(Bucket="lost", Key="obj")["Body"].read())
print(json.dumps({{"cache": cache, "origin": origin}}))
"""
        out = json.loads(node.run([sys.executable, "-c", script]).stdout)
        assert out["cache"] != "answered" and out["origin"] == 1000
    finally:
        c.close()
