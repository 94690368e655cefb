"""Four nodes start the same environment at once: one builds, the others wait for its
snapshot (the builder's lease) and restore it; exactly one snapshot is published."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from snapshot_helpers import (
    PY,
    StoreUnderTest,
    assert_env_works,
    assert_one_snapshot,
    ensure_env,
    leftovers,
    make_store,
    use_test_index,
    write_requirements,
)

from snapshot.manifest import MANIFEST_NAME
from snapshot.restore import verify
from snapshot.store import SnapshotStore

NODES = 4
TINYBETA_WHEEL = "tinybeta-0.1-py3-none-any.whl"


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_four_nodes_build_once(kind, tmp_path, request, monkeypatch, package_index):
    store = make_store(kind, tmp_path, request)
    env = use_test_index(monkeypatch)
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    prefixes = [tmp_path / f"node-{i}" / "venv" for i in range(NODES)]
    procs = [
        subprocess.Popen(
            [
                PY,
                "-m",
                "bootseer",
                "env",
                "ensure",
                "--spec",
                str(req),
                "--prefix",
                str(prefix),
                *store.cli_args(),
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for prefix in prefixes
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out))

    keys = {r["key"] for r in results}
    assert len(keys) == 1
    key = keys.pop()
    # One builder; the three others waited for its snapshot instead of installing.
    assert sorted(r["outcome"] for r in results) == ["built"] + ["restored"] * (NODES - 1), [
        (r["outcome"], r["warnings"]) for r in results
    ]
    builder = next(r for r in results if r["outcome"] == "built")
    assert builder["publish"]["published"] is True
    assert_one_snapshot(store, key)  # one manifest, one publisher directory, no lease
    for prefix, result in zip(prefixes, results, strict=True):
        assert result["prefix"] == str(prefix)
        assert_env_works(prefix)
        assert verify(prefix, key).ok
        assert leftovers(prefix) == []
    # The index served the wheels once: to the builder.
    assert package_index.downloads(TINYBETA_WHEEL) == 1
    assert package_index.downloads("tinydata-0.3-py3-none-any.whl") == 1


# -- the interleavings a lease alone does not cover, made to happen --------------------------


@pytest.mark.parametrize("moment", ["before-the-lease", "while-waiting"])
def test_a_snapshot_published_meanwhile_is_restored_not_rebuilt(
    moment, tmp_path, monkeypatch, package_index
):
    """Another node publishes and lets go of its lease in the moment between this node's
    look for the manifest and its look at the lease: this node must not build again.

    ``before-the-lease``: no manifest yet when looked for, then the lease is free (its builder
    just released it); ``while-waiting``: a waiter sees no manifest, then no lease.
    """
    use_test_index(monkeypatch)
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    store_url = str(tmp_path / "store")
    built = ensure_env(tmp_path / "builder" / "venv", store_url, [req])
    key = built.key
    manifest_path = Path(store_url) / key / MANIFEST_NAME
    hidden = tmp_path / "manifest.not-yet-committed"
    os.rename(manifest_path, hidden)
    store = SnapshotStore(store_url)
    other_builder = "b" * 32

    def publish_and_let_go() -> None:
        if hidden.exists():
            os.rename(hidden, manifest_path)
            store.release_lease(key, other_builder)

    if moment == "before-the-lease":
        real_try_lease = store.try_lease

        def try_lease(k: str, publisher: str) -> bool:
            publish_and_let_go()
            return real_try_lease(k, publisher)

        monkeypatch.setattr(store, "try_lease", try_lease)
    else:
        assert store.try_lease(key, other_builder)  # the other node is building
        real_read_lease = store.read_lease

        def read_lease(k: str):
            publish_and_let_go()
            return real_read_lease(k)

        monkeypatch.setattr(store, "read_lease", read_lease)

    node = tmp_path / "node" / "venv"
    result = ensure_env(node, store, [req])
    assert result.outcome == "restored", result
    assert not hidden.exists()
    assert package_index.downloads(TINYBETA_WHEEL) == 1
    assert_one_snapshot(StoreUnderTest("local", store_url), key)  # and no lease left
    assert_env_works(node)
