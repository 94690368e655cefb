"""ckpt across processes: torch.distributed (gloo) ranks save and reshard-load checkpoints.

Ranks are spawned with ``torch.multiprocessing`` (see ``ckpt_workers``); each holds replicated
plain tensors of many dtypes, DTensors (Shard(0), Shard(1), Replicate() on a 1-D mesh, and
[Shard(0), Replicate()], [Shard(0), Shard(1)] on a 2x2 mesh at world size 4), uneven FlatShards
(some empty), PerRank values and plain objects. Checkpoints saved at world sizes 1, 2 and 4
are loaded at other world sizes, on a local directory and on S3 (moto over HTTP).

Process groups are few and shared by the tests (the machine has 2 cores): four groups run
every save and load once, in an order where each load finds its checkpoint committed:

    group 1 (2 ranks): save W=2
    group 2 (4 ranks): save W=4; load 2->4; partial read 2->4
    group 3 (1 rank):  save W=1; load 2->1, 4->1
    group 4 (2 ranks): load 4->2, 1->2, 2->2; partial read 4->2; mismatch
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ckpt_workers as W
import pytest

from ckpt.layout import RankIndex, dtype_of, index_name, step_dir
from ckpt.staging import SMALL_REPLICA_BYTES
from striped_fs.urls import url_to_fs

BACKENDS = ["local", "s3"]
SAVE_STEPS = {1: 11, 2: 12, 4: 14}  # world size -> step saved from it
PAIRS = [(2, 4), (4, 2), (2, 1), (4, 1), (1, 2), (2, 2)]
PARTIAL = [(2, 4), (4, 2)]
GROUPS: list[tuple[int, list[tuple[str, int]]]] = [
    (2, [("save", 2)]),
    (4, [("save", 4), ("load", 2), ("partial_read", 2)]),
    (1, [("save", 1), ("load", 2), ("load", 4)]),
    (2, [("load", 4), ("load", 1), ("load", 2), ("partial_read", 4), ("mismatch", 4)]),
]


def seed_of(backend: str, world: int) -> int:
    return 100 * world + BACKENDS.index(backend)  # every checkpoint holds different values


def tag(op: str, backend: str, saved: int, loaded: int | None = None) -> str:
    return f"{op}:{backend}:{saved}" + ("" if loaded is None else f"->{loaded}")


@dataclass
class Dist:
    targets: dict[str, tuple[str, dict[str, Any] | None]]
    results: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def need(self, backend: str) -> None:
        if backend in self.skipped:
            pytest.skip(self.skipped[backend])

    def url(self, backend: str, world: int) -> tuple[str, dict[str, Any] | None]:
        base, options = self.targets[backend]
        return f"{base}/w{world}", options

    def result(self, key: str, ranks: int) -> dict[int, dict[str, Any]]:
        got = self.results.get(key)
        assert got is not None, f"{key} did not run"
        assert sorted(got) == list(range(ranks)), f"{key}: results from ranks {sorted(got)}"
        errors = {r: v["error"] for r, v in got.items() if "error" in v}
        assert not errors, f"{key} raised:\n" + "\n".join(
            f"rank {r}: {e}" for r, e in errors.items()
        )
        return got


def _actions(world: int, plan: list[tuple[str, int]], dist: Dist) -> list[dict[str, Any]]:
    actions = []
    for backend in dist.targets:
        for op, saved in plan:
            url, options = dist.url(backend, saved)
            actions.append(
                {
                    "op": op,
                    "tag": tag(op, backend, saved, None if op == "save" else world),
                    "url": url,
                    "storage_options": options,
                    "step": SAVE_STEPS[saved],
                    "seed": seed_of(backend, saved),
                    "saved_world": saved,
                }
            )
    return actions


def _delete_bucket(server: Any, name: str) -> None:
    try:
        client = server.boto3_client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)
    except Exception as exc:  # noqa: BLE001 - cleanup only
        print(f"could not delete bucket {name}: {exc!r}")


@pytest.fixture(scope="module")
def dist(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("ckpt-dist")
    dist = Dist({"local": (str(base / "store"), None)})
    server = bucket = None
    try:
        server = request.getfixturevalue("s3_server")
    except pytest.skip.Exception as exc:
        dist.skipped["s3"] = str(exc)
    if server is not None:
        if not server.running:
            server.start()
        bucket = f"bootseer-ckpt-dist-{uuid.uuid4().hex[:12]}"
        server.create_bucket(bucket)
        dist.targets["s3"] = (f"s3://{bucket}/ckpt", {"s3": server.storage_options()})
    try:
        for i, (world, plan) in enumerate(GROUPS):
            started = time.perf_counter()
            dist.results.update(W.run_group(world, _actions(world, plan, dist), base / f"g{i}"))
            print(f"group {i} ({world} ranks): {time.perf_counter() - started:.1f} s")
        yield dist
    finally:
        if bucket is not None:
            _delete_bucket(server, bucket)


# -- save at W, load at W' ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("saved", "loaded"), PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
def test_save_at_w_load_at_other_w_is_bit_exact(
    dist: Dist, backend: str, saved: int, loaded: int
) -> None:
    dist.need(backend)
    saves = dist.result(tag("save", backend, saved), saved)
    assert saves[0]["committed"], "rank 0 did not commit"
    loads = dist.result(tag("load", backend, saved, loaded), loaded)
    problems = [p for r in sorted(loads) for p in loads[r]["problems"]]
    assert not problems, "\n".join(problems)
    assert all(r["loaded"] > 0 and r["bytes_read"] > 0 for r in loads.values())


# -- who writes what ---------------------------------------------------------------------------


def _boxes_disjoint(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    (ao, ashape), (bo, bshape) = a, b
    return any(
        x + xs <= y or y + ys <= x for x, xs, y, ys in zip(ao, ashape, bo, bshape, strict=True)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_replicas_written_once_and_ranks_balanced(dist: Dist, backend: str, world: int) -> None:
    dist.need(backend)
    dist.result(tag("save", backend, world), world)
    url, options = dist.url(backend, world)
    fs, root = url_to_fs(url, options)
    directory = step_dir(root, SAVE_STEPS[world])
    indexes = [
        RankIndex.from_json(fs.cat_file(f"{directory}/{index_name(r)}"), path=str(r))
        for r in range(world)
    ]
    assert [i.rank for i in indexes] == list(range(world))
    full = W.global_tensors(seed_of(backend, world))
    specs = W.dtensor_specs(world)
    plain = [k for k in full if k not in W.FLAT_SHAPES and specs.get(k) is None]
    assert set(W.PLAIN_KEYS) <= set(plain)
    writers: dict[str, list[int]] = {}
    for key, tensor in full.items():
        chunks = [(i.rank, c) for i in indexes for c in i.chunks if c.key == key]
        writers[key] = [r for r, _ in chunks]
        for _, c in chunks:
            assert dtype_of(c.dtype) == tensor.dtype
            assert c.global_shape == (
                [tensor.numel()] if key in W.FLAT_SHAPES else list(tensor.shape)
            )
        # a small plain tensor: a copy on every rank (its load reads its own file); any
        # other chunk stored once, and together they are the whole tensor
        nbytes = tensor.numel() * tensor.element_size()
        if key in plain and nbytes <= SMALL_REPLICA_BYTES:
            assert sorted(r for r, _ in chunks) == list(range(world)), key
            assert all(c.offsets == [0] * tensor.dim() for _, c in chunks), key
            assert all(c.nbytes == nbytes for _, c in chunks), key
            continue
        boxes = [(c.offsets, c.shape) for _, c in chunks if all(c.shape)]
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                assert _boxes_disjoint(boxes[a], boxes[b]), f"{key}: chunks overlap: {boxes}"
        assert sum(c.nbytes for _, c in chunks) == nbytes, key
        assert all(key in i.tensor_keys for i in indexes), f"{key} missing from a rank's index"
    large = [k for k in plain if full[k].numel() * full[k].element_size() > SMALL_REPLICA_BYTES]
    assert large, "the workload must keep a replicated tensor that is written once"
    for key in plain:
        if key in large:
            assert len(writers[key]) == 1, f"replicated {key} written by ranks {writers[key]}"
        assert all(key in i.replicated_keys for i in indexes)
    # DTensor replicas: only mesh coordinate 0 of each Replicate dimension writes
    assert writers["dt/rep"] == [0] and all("dt/rep" in i.replicated_keys for i in indexes)
    assert writers["dt/row"] == list(range(world))
    if world == 4:
        assert writers["dt/mesh_sr"] == [0, 2]  # mesh [[0, 1], [2, 3]]: column 0 writes
        assert writers["dt/mesh_ss"] == [0, 1, 2, 3]
        assert "dt/mesh_ss" not in indexes[0].replicated_keys
    elif world == 2:
        assert writers["dt/mesh_sr"] == [0, 1]
    assert all(i.objects_size > 0 for i in indexes)  # PerRank values: every rank
    if world > 1:
        per_rank = [sum(c.nbytes for c in i.chunks if c.key in large) for i in indexes]
        largest = max(full[k].numel() * full[k].element_size() for k in large)
        assert max(per_rank) - min(per_rank) <= largest, per_rank  # greedy bound
        sizes = [i.data_size for i in indexes]
        assert max(sizes) <= 1.5 * min(sizes), f"unbalanced data files: {sizes}"


# -- reading only what is needed ------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("saved", "loaded"), PARTIAL, ids=[f"{a}to{b}" for a, b in PARTIAL])
def test_each_rank_fetches_only_its_slice(
    dist: Dist, backend: str, saved: int, loaded: int
) -> None:
    dist.need(backend)
    reads = dist.result(tag("partial_read", backend, saved, loaded), loaded)
    for rank, r in sorted(reads.items()):
        assert r["equal"], f"rank {rank}: Shard(0) slice differs"
        assert r["loaded"] == [W.ROW_KEY] and r["unexpected"] > 0
        # whole stripes around each overlapping stored chunk, nothing else
        bound = r["slice_bytes"] + 2 * W.STRIPE * r["source_chunks"]
        assert r["bytes_read"] <= bound, (rank, r)
        assert r["bytes_read"] < 0.7 * r["whole_bytes"], (rank, r)
        print(
            f"{backend} {saved}->{loaded} rank {rank}: read {r['bytes_read']} bytes for a "
            f"{r['slice_bytes']}-byte slice of {r['whole_bytes']}"
        )


# -- mismatches -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatch_lists_every_problem_and_non_strict_loads_the_rest(
    dist: Dist, backend: str
) -> None:
    dist.need(backend)
    results = dist.result(tag("mismatch", backend, 4, 2), 2)
    for rank, r in sorted(results.items()):
        err = r["strict_error"]
        assert err is not None, f"rank {rank}: strict load of a mismatched state passed"
        problems = err["problems"]
        assert err["step"] == SAVE_STEPS[4]
        assert len(problems) == 3, problems
        assert any("missing" in p and "model/new_head" in p for p in problems), problems
        assert any(
            "shape of model/embed" in p and "[512, 128]" in p and "[500, 128]" in p
            for p in problems
        ), problems
        assert any("unexpected" in p and "model/count" in p for p in problems), problems
        assert r["missing"] == ["model/new_head"]
        assert r["mismatched"] == ["model/embed"]
        assert r["unexpected"] == ["model/count"]
        assert not r["problems"], "\n".join(r["problems"])
