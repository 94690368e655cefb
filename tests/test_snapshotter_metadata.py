"""The proxy snapshotter's sqlite metadata (prefetch.containerd.metadata): semantics, errors,
transactions, persistence, threads, and SIGKILL mid-write."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from prefetch.containerd.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from prefetch.containerd.filters import parse, snapshot_adaptor
from prefetch.containerd.metadata import (
    SCHEMA_VERSION,
    Kind,
    MetadataStore,
    SchemaVersionError,
)


@pytest.fixture
def store(tmp_path):
    s = MetadataStore(tmp_path / "metadata.db")
    yield s
    s.close()


def layered(store: MetadataStore, *names: str) -> None:
    """Committed snapshots, each on the previous one."""
    parent = ""
    for name in names:
        store.create(f"{name}-key", parent, Kind.ACTIVE)
        store.commit(f"{name}-key", name)
        parent = name


def test_create_and_get(store):
    snap = store.create("k", "", Kind.ACTIVE, labels={"a": "1"}, source={"digest": "sha256:x"})
    assert (snap.name, snap.parent, snap.kind, snap.labels) == ("k", "", Kind.ACTIVE, {"a": "1"})
    assert snap.source == {"digest": "sha256:x"}
    assert snap.created_ns == snap.updated_ns > 0
    assert (snap.size, snap.inodes) == (0, 0)
    assert store.get("k") == snap
    assert store.find("nothing") is None
    with pytest.raises(NotFoundError, match="'nothing'"):
        store.get("nothing")


def test_create_errors(store):
    layered(store, "base")
    store.create("work", "base", Kind.ACTIVE)
    with pytest.raises(AlreadyExistsError, match="'work'"):
        store.create("work", "", Kind.VIEW)
    with pytest.raises(NotFoundError, match="'missing'"):
        store.create("x", "missing", Kind.ACTIVE)
    with pytest.raises(FailedPreconditionError, match="'work'.*active, not committed"):
        store.create("x", "work", Kind.VIEW)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        store.create("", "", Kind.ACTIVE)
    with pytest.raises(InvalidArgumentError, match="bad kind"):
        store.create("x", "", 7)  # type: ignore[arg-type]
    assert store.find("x") is None


def test_committed_created_directly_for_remote_layers(store):
    remote = store.create("sha256:layer", "", Kind.COMMITTED, source={"image": "r/i:1"})
    assert remote.kind == Kind.COMMITTED
    assert store.create("view", "sha256:layer", Kind.VIEW).parent == "sha256:layer"


def test_labels_are_validated(store):
    store.create("ok", "", Kind.ACTIVE, labels={"k": "v" * 4095})  # 4096 bytes: allowed
    with pytest.raises(InvalidArgumentError, match="'big'.*4097 bytes"):
        store.create("x", "", Kind.ACTIVE, labels={"big": "v" * 4094})
    with pytest.raises(InvalidArgumentError, match="'k'"):
        store.create("x", "", Kind.ACTIVE, labels={"k": "é" * 2048})  # bytes, not characters
    with pytest.raises(InvalidArgumentError, match="'big'"):
        store.update("ok", {"big": "v" * 5000})
    assert store.find("x") is None
    assert store.get("ok").labels == {"k": "v" * 4095}


def test_commit_keeps_the_id_and_renames(store):
    layered(store, "base")
    active = store.create("key", "base", Kind.ACTIVE, labels={"a": "1", "b": "2"})
    time.sleep(0.001)
    done = store.commit("key", "layer", labels={"b": "3", "c": "4"}, size=1234, inodes=5)
    assert done.id == active.id
    assert (done.name, done.parent, done.kind) == ("layer", "base", Kind.COMMITTED)
    assert done.labels == {"b": "3", "c": "4"}  # replaced, as containerd does
    assert (done.size, done.inodes) == (1234, 5)
    assert done.updated_ns > active.updated_ns
    assert store.find("key") is None
    # the rename keeps children attached (links are by id)
    store.create("child", "layer", Kind.VIEW)
    assert [s.name for s in store.chain("child")] == ["child", "layer", "base"]


def test_commit_errors(store):
    layered(store, "base")
    store.create("view", "base", Kind.VIEW)
    store.create("key", "base", Kind.ACTIVE)
    with pytest.raises(NotFoundError, match="'missing'"):
        store.commit("missing", "x")
    with pytest.raises(FailedPreconditionError, match="'view' is view, not active"):
        store.commit("view", "x")
    with pytest.raises(FailedPreconditionError, match="'base' is committed"):
        store.commit("base", "x")
    with pytest.raises(AlreadyExistsError, match="'base'"):
        store.commit("key", "base")
    with pytest.raises(InvalidArgumentError):
        store.commit("key", "")
    assert store.get("key").kind == Kind.ACTIVE


def test_remove(store):
    layered(store, "base", "mid")
    store.create("a", "mid", Kind.ACTIVE)
    store.create("b", "mid", Kind.VIEW)
    with pytest.raises(FailedPreconditionError, match="'mid'.*children 'a', 'b'"):
        store.remove("mid")
    with pytest.raises(NotFoundError, match="'nothing'"):
        store.remove("nothing")
    a = store.remove("a")
    assert a.name == "a" and a.id not in store.ids()
    store.remove("b")
    removed = store.remove("mid")
    assert removed.parent == "base"
    assert [s.name for s in store.list()] == ["base"]


def test_ids_are_not_reused(store):
    first = store.create("a", "", Kind.ACTIVE).id
    store.remove("a")
    assert store.create("b", "", Kind.ACTIVE).id > first  # a stale directory stays stale
    assert store.ids() == {store.get("b").id}


def test_update_labels(store):
    store.create("s", "", Kind.ACTIVE, labels={"a": "1", "b": "2", "x.y/z": "3"})
    before = store.get("s").updated_ns
    time.sleep(0.001)
    snap = store.update("s", {"c": "9"})  # no fieldpaths: replace all
    assert snap.labels == {"c": "9"} and snap.updated_ns > before
    assert store.update("s", {"a": "1"}, ["labels"]).labels == {"a": "1"}
    store.update("s", {"a": "1", "b": "2", "x.y/z": "3"})
    snap = store.update(
        "s",
        {"b": "20", "new": "n", "ignored": "i"},
        ["labels.b", "labels.new", "labels.x.y/z", "labels.gone"],
    )
    assert snap.labels == {"a": "1", "b": "20", "new": "n"}  # x.y/z deleted; ignored unset
    for bad in ("name", "parent", "kind", "labels.", "labelsx"):
        with pytest.raises(InvalidArgumentError, match=repr(bad)):
            store.update("s", {}, [bad])
    assert store.get("s").labels == {"a": "1", "b": "20", "new": "n"}
    with pytest.raises(NotFoundError):
        store.update("nothing", {})


def test_set_source(store):
    store.create("s", "", Kind.COMMITTED, labels={"l": "1"})
    store.set_source("s", {"digest": "sha256:abc", "ref": "reg/img:1", "n": [1, 2]})
    snap = store.get("s")
    assert snap.source == {"digest": "sha256:abc", "ref": "reg/img:1", "n": [1, 2]}
    assert snap.labels == {"l": "1"}
    with pytest.raises(NotFoundError):
        store.set_source("nothing", {})


def test_list_children_chain(store):
    layered(store, "l1", "l2", "l3")
    store.create("c1", "l3", Kind.ACTIVE)
    store.create("c0", "l3", Kind.VIEW)
    assert [s.name for s in store.list()] == ["c0", "c1", "l1", "l2", "l3"]
    assert [s.name for s in store.children("l3")] == ["c0", "c1"]
    assert store.children("c1") == []
    assert [s.name for s in store.chain("c1")] == ["c1", "l3", "l2", "l1"]
    assert [s.name for s in store.chain("l1")] == ["l1"]
    ids = [s.id for s in store.chain("c1")]
    assert ids == [store.get(n).id for n in ("c1", "l3", "l2", "l1")]
    assert store.ids() == set(ids) | {store.get("c0").id}
    for call in (store.children, store.chain):
        with pytest.raises(NotFoundError):
            call("nothing")


def test_filters_over_rows(store):
    layered(store, "base")
    store.create(
        "remote", "base", Kind.COMMITTED, labels={"containerd.io/snapshot.ref": "sha256:abc"}
    )
    store.create("work", "remote", Kind.ACTIVE)
    f = parse(['labels."containerd.io/snapshot.ref"==sha256:abc,parent=="base"', "kind==active"])
    assert [s.name for s in store.list() if f.match(snapshot_adaptor(s))] == ["remote", "work"]


def test_transaction_rolls_back_everything_inside(store):
    layered(store, "base")
    with pytest.raises(RuntimeError, match="boom"):
        with store.transaction():
            store.create("a", "base", Kind.ACTIVE)
            store.commit("a", "b")
            store.update("base", {"changed": "yes"})
            store.create("v", "b", Kind.VIEW)
            raise RuntimeError("boom")
    assert [s.name for s in store.list()] == ["base"]
    assert store.get("base").labels == {}
    # a failing operation inside a transaction leaves the rest of it alone
    with store.transaction():
        store.create("x", "", Kind.ACTIVE)
        with pytest.raises(AlreadyExistsError):
            store.create("x", "", Kind.ACTIVE)
        with pytest.raises(RuntimeError):
            with store.transaction():  # nested: undoes only its own writes
                store.create("y", "", Kind.ACTIVE)
                raise RuntimeError
        store.create("z", "", Kind.ACTIVE)
    assert [s.name for s in store.list()] == ["base", "x", "z"]


def test_uncommitted_writes_are_invisible_to_other_threads(store):
    created, reader_started = threading.Event(), threading.Event()
    seen = []

    def reader():
        assert created.wait(10)
        reader_started.set()
        seen.append(store.find("tmp"))  # waits for the writer's transaction to end

    t = threading.Thread(target=reader)
    t.start()
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.create("tmp", "", Kind.ACTIVE)
            created.set()
            assert reader_started.wait(10)
            time.sleep(0.05)
            raise RuntimeError("roll back")
    t.join(10)
    assert seen == [None]


def test_persistence_across_reopen(tmp_path):
    path = tmp_path / "m.db"
    with MetadataStore(path) as s:
        layered(s, "base")
        s.create("work", "base", Kind.ACTIVE, labels={"k": "v"}, source={"x": 1})
        s.commit("work", "done", size=10, inodes=2)
        before = s.list()
        ids = s.ids()
    with MetadataStore(path) as s:
        assert s.list() == before
        assert s.ids() == ids
        assert s.create("next", "done", Kind.VIEW).id > max(ids)


def test_schema_version(tmp_path):
    path = tmp_path / "m.db"
    MetadataStore(path).close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(SchemaVersionError, match=f"version {SCHEMA_VERSION + 1} is newer"):
        MetadataStore(path)


def test_closed_store_refuses(tmp_path):
    s = MetadataStore(tmp_path / "m.db")
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.list()


def test_threads_creating_distinct_snapshots(store):
    layered(store, "base")
    errors = []

    def worker(t: int) -> None:
        try:
            for i in range(40):
                store.create(f"t{t}-{i}", "base", Kind.ACTIVE, labels={"t": str(t)})
                if i % 2:
                    store.commit(f"t{t}-{i}", f"t{t}-{i}-done")
                assert store.get(f"t{t}-{i - i % 2}").labels == {"t": str(t)}
                store.list()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == []
    snaps = store.list()
    assert len(snaps) == 1 + 8 * 40
    assert len({s.id for s in snaps}) == len(snaps)
    assert len(store.children("base")) == 8 * 40


CHILD = """
import sys
from prefetch.containerd.metadata import Kind, MetadataStore
store = MetadataStore(sys.argv[1])
parent = ""
for i in range(100000):
    with store.transaction():  # several writes that must land together or not at all
        store.create(f"key{i}", parent, Kind.ACTIVE, labels={"i": str(i)})
        store.commit(f"key{i}", f"layer{i}", labels={"done": "1"}, size=i)
        store.create(f"view{i}", f"layer{i}", Kind.VIEW)
        store.set_source(f"layer{i}", {"i": i})
    print(f"layer{i}", flush=True)
    parent = f"layer{i}"
"""


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_loses_no_answered_commit(tmp_path, trial):
    path = tmp_path / "m.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    printed = []
    try:
        while len(printed) < 20 + 10 * trial:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            printed.append(line.strip())
        time.sleep(random.uniform(0, 0.02))  # land anywhere in a transaction
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    printed += out.split()

    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert db.execute("PRAGMA foreign_key_check").fetchall() == []
    db.close()
    with MetadataStore(path) as s:
        names = {snap.name for snap in s.list()}
        for name in printed:
            assert name in names
        n = max(int(name.removeprefix("layer")) for name in names if name.startswith("layer"))
        assert n + 1 >= len(printed)
        for i in range(n + 1):  # every transaction landed whole
            layer = s.get(f"layer{i}")
            assert s.get(f"view{i}").parent == f"layer{i}"
            assert (layer.labels, layer.source, layer.size) == ({"done": "1"}, {"i": i}, i)
            assert layer.parent == (f"layer{i - 1}" if i else "")
        assert names == {f"layer{i}" for i in range(n + 1)} | {f"view{i}" for i in range(n + 1)}
        assert [x.name for x in s.chain(f"view{n}")][:3] == [
            f"view{n}",
            f"layer{n}",
            f"layer{n - 1}",
        ]
        assert len(s.chain(f"layer{n}")) == n + 1
