"""The origins' serve rates, measured on the cluster the sweep runs on (``bench_e2e_sweep.py``;
the scale model's ``S``, ``startup_model.py``).

Why a probe: a restart's own traffic does not load the origins to their limit (one fresh node
pulls, the survivors read a few MB each), so its bytes over its time say how much the job
asked for, not how much the origin can give. Here every node of a cluster of N reads the same
object from one origin at the same moment (the registry: a blob by digest; S3: one object;
the package index: one file), and the origin's aggregate rate is the bytes every node read over
the wall time from the first read's start to the last one's end. Each node's bytes are checked
against the object's sha256, and counted by the node's proxy as the restart's are.

The readers run on the nodes (``python e2e_sweep_probe.py --get ...``): each imports what it
needs, says it is ready, and starts when the harness creates the go file, once every node is
ready (so that no node's interpreter start is inside the measured time).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ORIGINS = ("registry", "s3", "index")
REPO = "probe/blob"
BUCKET = "probe"
INDEX_FILE = "bootseerprobe-0.0.0-py3-none-any.whl"  # the index serves wheel names only
READY_TIMEOUT_S = 300.0
READ_TIMEOUT_S = 900.0
CHUNK = 1 << 20


def measure(
    nodes: int, size: int, workdir: Path, *, node_link: Any = None, service_link: Any = None
) -> dict[str, dict[str, Any]]:
    """Each origin's aggregate serve rate to ``nodes`` nodes reading ``size`` bytes each at
    once, on a cluster of its own (no containerd: only the links and the services)."""
    from bootseer.testing.cluster import Cluster

    with Cluster(
        nodes,
        link=node_link,
        service_link=service_link,
        services=("registry", "s3", "index"),
        workdir=workdir,
    ) as c:
        payload = c.dir / "probe.bin"
        with open(payload, "wb") as f:
            for _ in range(0, size, CHUNK):
                f.write(os.urandom(min(CHUNK, size - f.tell())))
        digest = hashlib.sha256(payload.read_bytes()).hexdigest()
        where = stage(c, payload, digest)
        return {origin: read_at_once(c, origin, where[origin], digest, size) for origin in ORIGINS}


def stage(c: Any, payload: Path, digest: str) -> dict[str, dict[str, Any]]:
    """Put the payload into every origin (from the services host: not a node's traffic)."""
    c.services.create_bucket(BUCKET)
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    opts = c.services.storage_options()
    for args in (
        ["--put-s3", json.dumps(opts), str(payload)],
        ["--put-blob", c.services.registry_host, str(payload), digest],
    ):
        c.services.run([sys.executable, str(Path(__file__).resolve()), *args], env=env, timeout=600)
    index_copy = c.services.index_dir / INDEX_FILE
    index_copy.write_bytes(payload.read_bytes())
    return {
        "registry": {"url": f"{c.services.registry_url}/v2/{REPO}/blobs/sha256:{digest}"},
        "s3": {"path": f"{BUCKET}/probe.bin", "options": opts},
        "index": {"url": f"{c.services.index_url.removesuffix('/simple/')}/files/{INDEX_FILE}"},
    }


def read_at_once(
    c: Any, origin: str, spec: dict[str, Any], digest: str, size: int
) -> dict[str, Any]:
    """Every node reads ``spec`` from ``origin`` at once; the aggregate rate and each node's
    time. A node that read other bytes, or fewer, is an error (not a rate)."""
    work = Path(tempfile.mkdtemp(prefix=f"probe-{origin}-", dir=c.dir))
    go = work / "go"
    before = {n.name: n.bytes_from(origin) for n in c.nodes}
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    procs = {
        n.name: n.popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--get",
                origin,
                json.dumps(spec),
                str(work / n.name),
                str(go),
            ],
            env=env,
        )
        for n in c.nodes
    }
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all((work / f"{name}.ready").exists() for name in procs):
        for name, proc in procs.items():
            if proc.poll() is not None and not (work / f"{name}.ready").exists():
                raise RuntimeError(
                    f"probe {origin}: the reader on {name} exited "
                    f"{proc.returncode} before it was ready"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"probe {origin}: readers not ready in {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
    go.touch()
    for name, proc in procs.items():
        if proc.wait(timeout=READ_TIMEOUT_S) != 0:
            raise RuntimeError(f"probe {origin}: the reader on {name} exited {proc.returncode}")
    got = {name: json.loads((work / f"{name}.json").read_text()) for name in procs}
    bad = [
        f"{name} ({g['bytes']} bytes, sha256 {g['sha256'][:12]})"
        for name, g in got.items()
        if g["bytes"] != size or g["sha256"] != digest
    ]
    if bad:
        raise RuntimeError(
            f"probe {origin}: read other bytes than the {size} put there: {', '.join(bad)}"
        )
    start = min(g["start"] for g in got.values())
    end = max(g["end"] for g in got.values())
    counted = {n.name: n.bytes_from(origin) - before[n.name] for n in c.nodes}
    return {
        "nodes": len(got),
        "bytes_per_node": size,
        "seconds": end - start,
        "rate_Bps": len(got) * size / (end - start),
        "node_seconds": {name: g["end"] - g["start"] for name, g in sorted(got.items())},
        "counted_bytes": counted,
    }


# -- on the services host and on the nodes -------------------------------------------------------
def _put_s3(options: dict[str, Any], path: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    fs.put_file(path, f"{BUCKET}/probe.bin")


def _put_blob(registry: str, path: str, digest: str) -> None:
    from prefetch.registry import SyncRegistry

    with SyncRegistry(registry) as reg:
        reg.put_blob(REPO, Path(path).read_bytes(), f"sha256:{digest}")


def _reader(origin: str, spec: dict[str, Any]) -> Any:
    """A function that reads the object and yields its chunks (everything imported now)."""
    if origin == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **spec["options"])

        def read_s3() -> Any:
            yield fs.cat_file(spec["path"])  # one GET, as a striped stripe or a layer is

        return read_s3
    import urllib.request

    def read_http() -> Any:
        with urllib.request.urlopen(spec["url"], timeout=READ_TIMEOUT_S) as r:
            while block := r.read(CHUNK):
                yield block

    return read_http


def _get(origin: str, spec: dict[str, Any], out: str, go: str) -> None:
    read = _reader(origin, spec)
    Path(f"{out}.ready").touch()
    while not os.path.exists(go):
        time.sleep(0.002)
    h, n = hashlib.sha256(), 0
    start = time.time()
    for block in read():
        h.update(block)
        n += len(block)
    end = time.time()
    tmp = Path(f"{out}.json.tmp")
    tmp.write_text(json.dumps({"start": start, "end": end, "bytes": n, "sha256": h.hexdigest()}))
    tmp.rename(f"{out}.json")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--put-s3"]:
        _put_s3(json.loads(argv[1]), argv[2])
    elif argv[:1] == ["--put-blob"]:
        _put_blob(argv[1], argv[2], argv[3])
    elif argv[:1] == ["--get"]:
        _get(argv[1], json.loads(argv[2]), argv[3], argv[4])
    else:
        raise SystemExit(
            "usage: e2e_sweep_probe.py --put-s3 OPTS FILE | --put-blob REGISTRY "
            "FILE DIGEST | --get ORIGIN SPEC OUT GO"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
