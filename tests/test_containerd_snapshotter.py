"""The bootseer snapshotter under a real containerd (proxy plugin) with runc and a real
registry: a converted image runs lazily and an unconverted one is unpacked; a restart (even a
kill -9) of the snapshotter breaks no image; removing the image cleans its mounts and cache;
malformed labels are refused with clear gRPC errors and nothing half-created; the first start
records a profile and a fresh node prefetches it."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from cli_helpers import bootseer_cli
from containerd_helpers import BIG, SCRIPT, SnapshotterProcess, expected_output, push_images

from prefetch.containerd import labels as lbl
from prefetch.containerd.client import ContainerdClient
from prefetch.containerd.errors import InvalidArgumentError, NotFoundError
from prefetch.containerd.pull import pull_image
from prefetch.image import ARTIFACT_TYPE
from prefetch.registry import SyncRegistry
from striped_fs.fuse import is_mounted

pytestmark = pytest.mark.usefixtures("fuse")


class Node:
    """One node: a snapshotter process and a containerd that uses it as ``bootseer``."""

    def __init__(self, root: Path, containerd_factory, *extra: str) -> None:
        self.sock_dir = tempfile.mkdtemp(prefix="bsn-")
        self.root = root
        self.snapshotter = SnapshotterProcess(
            root / "snapshotter",
            os.path.join(self.sock_dir, "sn.sock"),
            root / "snapshotter.log",
            extra,
        ).start()
        self.containerd = containerd_factory(
            proxy_snapshotters={"bootseer": self.snapshotter.address}
        )
        self._runs = 0

    @property
    def lazy_dir(self) -> Path:
        return self.root / "snapshotter" / "lazy"

    def pull(self, ref: str):
        return pull_image(ref, self.containerd.address, namespace=self.containerd.namespace)

    def run(self, ref: str, script: str = SCRIPT) -> str:
        # The pause: a process that exits right after its last write can lose that write on
        # its way out through ctr (the stdout copy races the exit; concourse/concourse#6775
        # is the same race). Seen once under load: output cut before sha256sum's line, exit
        # 0. The output is compared whole, so a failing command is still caught.
        script = f"{script}; sleep 0.3"
        deadline = time.monotonic() + 15
        while True:
            self._runs += 1
            proc = self.containerd.ctr(
                "run",
                "--rm",
                "--snapshotter",
                "bootseer",
                ref,
                f"c{self._runs}",
                "/bin/sh",
                "-c",
                script,
                check=False,
            )
            # containerd redials a restarted snapshotter after its gRPC backoff; until then
            # a call fails fast with UNAVAILABLE (as with any proxy plugin)
            if "unavailable" not in proc.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert proc.returncode == 0, (proc.stderr, self.snapshotter.log())
        return proc.stdout

    def restart_snapshotter(self, sig: int) -> None:
        self.snapshotter.stop(sig)
        self.snapshotter.start()

    def close(self) -> None:
        self.snapshotter.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


@pytest.fixture
def images(registry) -> tuple[str, str]:
    return push_images(registry.host)


@pytest.fixture
def node_factory(tmp_path: Path, containerd_factory):
    nodes: list[Node] = []

    def factory(*extra: str) -> Node:
        node = Node(tmp_path / f"node{len(nodes)}", containerd_factory, *extra)
        nodes.append(node)
        return node

    yield factory
    for node in nodes:
        node.close()


def test_a_converted_image_runs_lazily(images, node_factory) -> None:
    _, lazy = images
    node = node_factory()
    result = node.pull(lazy)
    assert (result.lazy_layers, result.unpacked_layers, result.bytes_downloaded) == (3, 0, 0)
    assert node.run(lazy) == expected_output()
    listing = node.containerd.ctr("snapshots", "--snapshotter", "bootseer", "ls").stdout
    assert listing.count("Committed") == 3
    assert is_mounted(node.lazy_dir)
    # the CLI does the same; a second pull finds every layer present
    out = bootseer_cli(
        "image",
        "pull",
        lazy,
        "--address",
        node.containerd.address,
        "--namespace",
        node.containerd.namespace,
    ).stdout
    assert "3 layers lazy" in out


def test_a_local_pull_writes_every_layer_out_and_containers_start_from_local_files(
    images, node_factory, registry
) -> None:
    """``bootseer image pull --local`` (a warm standby): the lazy layers are fetched whole and
    written out on the node, so a container's rootfs is overlayfs over local directories
    (kernel speed, no FUSE lower), and it starts with the registry gone."""
    _, lazy = images
    node = node_factory()
    out = bootseer_cli(
        "image",
        "pull",
        lazy,
        "--local",
        "--address",
        node.containerd.address,
        "--namespace",
        node.containerd.namespace,
    ).stdout
    assert "3 layers lazy" in out and "written out locally" in out, out
    with SyncRegistry(registry.host) as reg:
        doc = reg.resolve_image(lazy).parsed
        config = reg.get_blob("app/run", doc["config"]["digest"])
    import json

    from prefetch.containerd.pull import chain_ids

    top = chain_ids(json.loads(config)["rootfs"]["diff_ids"])[-1]
    with ContainerdClient(node.snapshotter.address) as direct:
        assert direct.stat_snapshot("bootseer", top).labels[lbl.LOCAL] == "done"
        mounts = direct.view_snapshot("bootseer", "local-view", top)
        lowers = [
            o.split("=", 1)[1] for m in mounts for o in m.options if o.startswith("lowerdir=")
        ][0].split(":")
        assert len(lowers) == 3 and all("/snapshots/" in d and d.endswith("/fs") for d in lowers), (
            mounts
        )
        assert not any(str(node.lazy_dir) in d for d in lowers)
        direct.remove_snapshot("bootseer", "local-view")
    assert "written out whole" in node.snapshotter.log()
    registry.stop()
    assert node.run(lazy) == expected_output()


def test_an_unconverted_image_is_unpacked_the_normal_way(images, node_factory) -> None:
    plain, _ = images
    node = node_factory()
    result = node.pull(plain)
    assert (result.lazy_layers, result.unpacked_layers) == (0, 3)
    assert result.bytes_downloaded > 3 << 20
    assert node.run(plain) == expected_output()
    listing = node.containerd.ctr("snapshots", "--snapshotter", "bootseer", "ls").stdout
    assert listing.count("Committed") == 3
    unpacked = [d / "fs" for d in (node.root / "snapshotter" / "snapshots").iterdir()]
    assert any(
        (d / "app/big.bin").is_file() and (d / "app/big.bin").read_bytes() == BIG for d in unpacked
    )  # the top layer, unpacked into its own directory


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill-9"])
def test_a_restart_of_the_snapshotter_breaks_no_image(images, node_factory, sig) -> None:
    _, lazy = images
    node = node_factory()
    node.pull(lazy)
    assert node.run(lazy) == expected_output()
    node.snapshotter.stop(sig)
    assert is_mounted(node.lazy_dir)  # kept by the FUSE holder for the next start
    node.snapshotter.start()  # which serves the same mount again
    assert node.run(lazy) == expected_output()


def test_removing_the_image_cleans_mounts_and_cache(images, node_factory) -> None:
    _, lazy = images
    node = node_factory()
    node.pull(lazy)
    assert node.run(lazy) == expected_output()
    cache = node.root / "snapshotter" / "remote" / "cache"
    assert _files(cache)  # the run's frames are cached
    orphan = node.root / "snapshotter" / "snapshots" / "999"  # as a crash would leave it
    (orphan / "fs").mkdir(parents=True)
    node.containerd.ctr("images", "rm", "--sync", lazy)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.listdir(node.lazy_dir):
        time.sleep(0.2)
    assert os.listdir(node.lazy_dir) == []  # no lazy view is served any more
    assert (
        node.containerd.ctr("snapshots", "--snapshotter", "bootseer", "ls")
        .stdout.strip()
        .count("\n")
        == 0
    )  # header only
    assert _files(cache) == []
    assert os.listdir(node.root / "snapshotter" / "remote" / "indexes") == []
    assert not orphan.exists()  # containerd's GC ends with Cleanup, which removes orphans


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_malformed_or_missing_labels_are_refused_and_create_nothing(images, node_factory) -> None:
    _, lazy = images
    node = node_factory()
    chain = "sha256:" + "1" * 64
    with SyncRegistry(lazy.split("/")[0]) as reg:
        manifest = reg.resolve_image(lazy)
    layer = manifest.parsed["layers"][0]["digest"]
    good = {
        lbl.SNAPSHOT_REF: chain,
        lbl.IMAGE_REF: lazy,
        lbl.LAYER_DIGEST: layer,
        lbl.MANIFEST_DIGEST: manifest.digest,
    }
    cases = {
        "not-a-digest": ({**good, lbl.LAYER_DIGEST: "sha256:xyz"}, "is not a sha256 digest"),
        "no-image-ref": (
            {k: v for k, v in good.items() if k != lbl.IMAGE_REF},
            "cri.image-ref is missing",
        ),
        "bad-chain": ({**good, lbl.SNAPSHOT_REF: "latest"}, "is not a sha256 digest"),
        "foreign-layer": ({**good, lbl.LAYER_DIGEST: "sha256:" + "2" * 64}, "is not a layer of"),
        "bad-reference": ({**good, lbl.IMAGE_REF: "UPPER/case::x"}, "image reference"),
    }
    # Straight at the snapshotter's socket (what containerd's proxy sends) ...
    with ContainerdClient(node.snapshotter.address) as direct:
        for key, (labels, message) in cases.items():
            with pytest.raises(InvalidArgumentError, match=message.replace(".", r"\.")):
                direct.prepare_snapshot("bootseer", key, "", labels)
        assert direct.list_snapshots("bootseer") == []
        with pytest.raises(NotFoundError):
            direct.stat_snapshot("bootseer", chain)
    # ... and through containerd, whose client sees the same code and message.
    ctd = ContainerdClient(node.containerd.address, node.containerd.namespace)
    with ctd, pytest.raises(InvalidArgumentError, match="is not a layer of"):
        ctd.prepare_snapshot("bootseer", "k", "", cases["foreign-layer"][0])
    assert os.listdir(node.lazy_dir) == []
    dirs = [d for d in (node.root / "snapshotter" / "snapshots").iterdir()]
    assert dirs == []


def test_the_first_start_records_a_profile_and_a_fresh_node_prefetches_it(
    images, node_factory, registry
) -> None:
    _, lazy = images
    first = node_factory("--record-timeout", "60")
    first.pull(lazy)
    # The container reads what it needs, then says it is ready.
    assert first.run(lazy, SCRIPT + "; cat /.bootseer/ready") == expected_output()
    with SyncRegistry(registry.host) as reg:
        manifest = reg.resolve_image(lazy)
        deadline = time.monotonic() + 20
        while not (
            found := reg.get_referrers("app/run", manifest.digest, artifact_type=ARTIFACT_TYPE)
        ):
            assert time.monotonic() < deadline, first.snapshotter.log()
            time.sleep(0.2)
    assert len(found) == 1

    fresh = node_factory()  # an empty cache: the profile comes from the registry
    fresh.pull(lazy)
    cache = fresh.root / "snapshotter" / "remote" / "cache"
    deadline = time.monotonic() + 20
    while not _files(cache):  # frames arrive before any container has run
        assert time.monotonic() < deadline, fresh.snapshotter.log()
        time.sleep(0.1)
    assert "prefetching" in fresh.snapshotter.log()
    assert fresh.run(lazy) == expected_output()


def test_without_a_profile_a_pull_fetches_no_frame(images, node_factory) -> None:
    _, lazy = images
    node = node_factory("--no-push-profiles")
    node.pull(lazy)
    time.sleep(1.0)
    assert _files(node.root / "snapshotter" / "remote" / "cache") == []


def test_an_unreachable_registry_falls_back_to_a_normal_unpack(
    images, node_factory, registry
) -> None:
    """A snapshotter that cannot read the registry (down, a mirror it does not know, a 401)
    must not fail the pull: Prepare answers with an ordinary active snapshot, which containerd
    fills the normal way, and the log says why; a second layer of the same image does not
    wait for the registry again."""
    _, lazy = images
    node = node_factory()
    with SyncRegistry(registry.host) as reg:
        manifest = reg.resolve_image(lazy)
    layers = manifest.parsed["layers"]
    labels = [
        {
            lbl.SNAPSHOT_REF: "sha256:" + str(i) * 64,
            lbl.IMAGE_REF: lazy,
            lbl.LAYER_DIGEST: layer["digest"],
            lbl.MANIFEST_DIGEST: manifest.digest,
        }
        for i, layer in enumerate(layers[:2], start=3)
    ]
    registry.stop()
    with ContainerdClient(node.snapshotter.address) as direct:
        mounts = direct.prepare_snapshot("bootseer", "k", "", labels[0])
        assert [m.type for m in mounts] == ["bind"]  # an empty directory to unpack into
        assert direct.stat_snapshot("bootseer", "k").kind == "active"
        assert direct.stat_snapshot("bootseer", "k").labels == labels[0]
        with open(os.path.join(mounts[0].source, "unpacked"), "wb") as f:
            f.write(b"by containerd")
        direct.commit_snapshot("bootseer", labels[0][lbl.SNAPSHOT_REF], "k")
        second = direct.prepare_snapshot("bootseer", "k2", labels[0][lbl.SNAPSHOT_REF], labels[1])
        assert [m.type for m in second] == ["overlay"]
        assert {s.name: s.kind for s in direct.list_snapshots("bootseer")} == {
            labels[0][lbl.SNAPSHOT_REF]: "committed",
            "k2": "active",
        }
    log = node.snapshotter.log()
    for layer in layers[:2]:
        assert f"layer {layer['digest']} of {lazy} cannot be served lazily" in log, log
    assert "containerd downloads and unpacks it" in log
    assert log.count("cannot read the manifest") == 2
    assert "not tried again for" in log  # the second layer did not retry the registry


def test_the_deploy_snippet_registers_the_snapshotter(tmp_path: Path, containerd_factory) -> None:
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    config = tomllib.loads((repo / "deploy/containerd/config.toml").read_text())
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri == {"snapshotter": "bootseer", "disable_snapshot_annotations": False}
    ((name, plugin),) = config["proxy_plugins"].items()
    assert plugin["type"] == "snapshot"
    unit = (repo / "deploy/systemd/bootseer-snapshotter.service").read_text()
    assert plugin["address"] in unit  # the unit serves the socket the snippet names
    assert "UMask=0077" in unit.splitlines()
    sock_dir = tempfile.mkdtemp(prefix="bsn-")
    try:
        sn = SnapshotterProcess(
            tmp_path / "sn", os.path.join(sock_dir, "sn.sock"), tmp_path / "sn.log"
        ).start()
        try:
            ctd = containerd_factory(proxy_snapshotters={name: sn.address})
            plugins = ctd.ctr("plugins", "ls").stdout
            assert any(
                line.split()[:2] == ["io.containerd.snapshotter.v1", name]
                and line.split()[-1] == "ok"
                for line in plugins.splitlines()
            )
            with ContainerdClient(ctd.address, ctd.namespace) as client:
                mounts = client.prepare_snapshot(name, "plain", "")
                assert mounts[0].type == "bind"  # a plain snapshot, served by bootseer
        finally:
            sn.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_lazy_layers_above_an_unpacked_one_keep_its_deletions(
    images, node_factory, registry
) -> None:
    """A mixed image: the base layer in gzip (unpacked into a directory), the upper two
    converted (one lazy view above it). The view must show layer two's whiteout and opaque
    directory the overlayfs way, or the deleted lower files would reappear."""

    plain, lazy = images
    with SyncRegistry(registry.host) as reg:
        gz, conv = reg.resolve_image(plain), reg.resolve_image(lazy)
        doc = dict(conv.parsed)
        doc["layers"] = [gz.parsed["layers"][0], *conv.parsed["layers"][1:]]
        doc.pop("annotations", None)
    node = node_factory()
    _pulls_and_runs(node, _put_variant(registry, "mixed", doc), lazy=2, unpacked=1)


def _put_variant(registry, tag: str, doc: dict) -> str:
    """Push ``doc`` as the manifest of app/run:TAG; returns the reference."""
    import json

    from prefetch.mediatypes import OCI_MANIFEST

    with SyncRegistry(registry.host) as reg:
        reg.put_manifest("app/run", tag, json.dumps(doc).encode(), OCI_MANIFEST)
    return f"{registry.host}/app/run:{tag}"


def _pulls_and_runs(node: Node, ref: str, *, lazy: int, unpacked: int) -> None:
    result = node.pull(ref)
    assert (result.lazy_layers, result.unpacked_layers) == (lazy, unpacked)
    assert node.run(ref) == expected_output()


def test_a_layer_claiming_the_format_without_an_index_is_refused(
    images, node_factory, registry
) -> None:
    import json

    from prefetch.containerd.errors import FailedPreconditionError
    from prefetch.mediatypes import OCI_MANIFEST

    plain, lazy = images
    with SyncRegistry(registry.host) as reg:
        gz, conv = reg.resolve_image(plain), reg.resolve_image(lazy)
        doc = dict(conv.parsed)
        liar = {**gz.parsed["layers"][0], "annotations": conv.parsed["layers"][0]["annotations"]}
        doc["layers"] = [liar, *conv.parsed["layers"][1:]]
        digest = reg.put_manifest("app/run", "liar", json.dumps(doc).encode(), OCI_MANIFEST)
    node = node_factory()
    labels = {
        lbl.SNAPSHOT_REF: "sha256:" + "4" * 64,
        lbl.IMAGE_REF: f"{registry.host}/app/run:liar",
        lbl.LAYER_DIGEST: liar["digest"],
        lbl.MANIFEST_DIGEST: digest,
    }
    with ContainerdClient(node.snapshotter.address) as direct:
        with pytest.raises(FailedPreconditionError, match="convert the image again"):
            direct.prepare_snapshot("bootseer", "k", "", labels)
        assert direct.list_snapshots("bootseer") == []


def test_every_rpc_of_the_snapshots_api(tmp_path: Path) -> None:
    """Prepare, View, Mounts, Commit, Stat, Update, Usage, List (filters), Remove, Cleanup,
    straight on the snapshotter's socket, with containerd's semantics."""
    from prefetch.containerd.errors import AlreadyExistsError, FailedPreconditionError

    sock_dir = tempfile.mkdtemp(prefix="bsn-")
    sn = SnapshotterProcess(
        tmp_path / "sn", os.path.join(sock_dir, "sn.sock"), tmp_path / "sn.log"
    ).start()
    try:
        with ContainerdClient(sn.address) as c:
            base = c.prepare_snapshot("bootseer", "a", "", {"team": "ml"})
            assert base[0].type == "bind" and "rw" in base[0].options
            (Path(base[0].source) / "hello").write_bytes(b"layer a")
            assert c.snapshot_usage("bootseer", "a")[1] == 1  # one inode so far
            c.commit_snapshot("bootseer", "A", "a", {"team": "ml"})
            with pytest.raises(NotFoundError):
                c.stat_snapshot("bootseer", "a")
            info = c.stat_snapshot("bootseer", "A")
            assert (info.kind, info.parent, info.labels) == ("committed", "", {"team": "ml"})
            upper = c.prepare_snapshot("bootseer", "b", "A")
            assert upper[0].type == "overlay"
            opts = dict(o.split("=", 1) for o in upper[0].options if "=" in o)
            assert (Path(opts["lowerdir"]) / "hello").read_bytes() == b"layer a"
            assert c.snapshot_mounts("bootseer", "b") == upper
            view = c.view_snapshot("bootseer", "v", "A")
            assert view[0].type == "bind" and "ro" in view[0].options
            with pytest.raises(AlreadyExistsError):
                c.prepare_snapshot("bootseer", "b", "A")
            with pytest.raises(FailedPreconditionError):
                c.prepare_snapshot("bootseer", "c", "b")  # the parent must be committed
            with pytest.raises(FailedPreconditionError):
                c.remove_snapshot("bootseer", "A")  # it has children
            updated = c.update_snapshot_labels("bootseer", "A", {"owner": "x"})
            assert updated.labels == {"team": "ml", "owner": "x"}
            names = lambda *f: sorted(i.name for i in c.list_snapshots("bootseer", *f))  # noqa: E731
            assert names() == ["A", "b", "v"]
            assert names("kind==active") == ["b"]
            assert names("parent==A,kind==view") == ["v"]
            assert names('labels."owner"==x', "name==b") == ["A", "b"]
            for key in ("v", "b", "A"):
                c.remove_snapshot("bootseer", key)
            assert names() == []
            (tmp_path / "sn" / "snapshots" / "77").mkdir()  # an orphan
            assert c.cleanup_snapshots("bootseer")
            assert list((tmp_path / "sn" / "snapshots").iterdir()) == []
    finally:
        sn.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_an_unbound_or_swapped_converted_layer_is_never_served_lazily(
    images, node_factory, registry
) -> None:
    """Trust boundaries through containerd: a converted image whose manifest records no index
    digests is unpacked the normal way (containerd checks every blob's digest) and runs; a
    layer blob swapped in the registry's storage (same digest path, same size, another
    self-consistent index) is refused by Prepare, naming the layer and the rule, and nothing
    is created."""
    import json

    from layer_craft import honest_entries, padded_blob, tar_of

    from prefetch.containerd.errors import FailedPreconditionError
    from prefetch.toc import INDEX_ANNOTATION, RULE_BOUND

    _, lazy = images
    with SyncRegistry(registry.host) as reg:
        conv = reg.resolve_image(lazy)
    doc = json.loads(conv.data)
    for desc in doc["layers"]:
        desc["annotations"].pop(INDEX_ANNOTATION)
    node = node_factory()
    _pulls_and_runs(node, _put_variant(registry, "unbound", doc), lazy=0, unpacked=3)
    assert "records no io.bootseer.layer.index.digest" in node.snapshotter.log()

    layer = conv.layers[2]  # the big file's layer, replaced by one of the same size
    tar = tar_of([("app", None), ("app/big.bin", b"EVIL")])
    crafted = padded_blob(tar, honest_entries(tar), layer.size)
    registry.blob_path(layer.digest).write_bytes(crafted.blob)
    labels = {
        lbl.SNAPSHOT_REF: "sha256:" + "5" * 64,
        lbl.IMAGE_REF: lazy,
        lbl.LAYER_DIGEST: layer.digest,
        lbl.MANIFEST_DIGEST: conv.digest,
    }
    with ContainerdClient(node.snapshotter.address) as direct:
        before = {s.name for s in direct.list_snapshots("bootseer")}
        with pytest.raises(FailedPreconditionError) as info:
            direct.prepare_snapshot("bootseer", "swapped", "", labels)
        assert layer.digest in str(info.value) and RULE_BOUND in str(info.value)
        # nothing new (the earlier container's snapshot may still be going away meanwhile)
        assert {s.name for s in direct.list_snapshots("bootseer")} <= before


def test_a_converted_image_lying_about_its_diff_ids_cannot_stand_in_for_an_unconverted_one(
    images, node_factory, registry
) -> None:
    """A converted image whose config names the diff IDs of another image's layers (here its
    base is another tar, holding ``/etc/image-id``): containerd never checks a lazy layer's
    diff ID, so its snapshots took the chain IDs of the honest image's. Pulled first, they
    stood in for the honest image's layers (its containers saw the liar's files). Now the
    snapshotter writes a lazy snapshot out whole before an unconverted pull stands on it,
    checking the tar's sha256 on the way: the honest pull fails, naming the layer, and
    nothing of the liar's reaches it."""
    import hashlib
    import json

    from prefetch.containerd.errors import FailedPreconditionError
    from prefetch.mediatypes import OCI_MANIFEST

    plain, _ = images
    _, evil = push_images(registry.host, "app/evil", b"evil")
    with SyncRegistry(registry.host) as reg:
        honest_config = json.loads(
            reg.get_blob("app/run", reg.resolve_image(plain).parsed["config"]["digest"])
        )
        manifest = reg.resolve_image(evil)
        config = json.loads(reg.get_blob("app/evil", manifest.parsed["config"]["digest"]))
        assert config["rootfs"]["diff_ids"][0] != honest_config["rootfs"]["diff_ids"][0]
        config["rootfs"] = honest_config["rootfs"]
        data = json.dumps(config).encode()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        reg.put_blob("app/evil", data, digest)
        doc = dict(
            manifest.parsed,
            config={**manifest.parsed["config"], "digest": digest, "size": len(data)},
        )
        reg.put_manifest("app/evil", "liar", json.dumps(doc).encode(), OCI_MANIFEST)
    node = node_factory()
    assert node.pull(f"{registry.host}/app/evil:liar").lazy_layers == 3
    with ContainerdClient(node.containerd.address, "honest") as other:
        with pytest.raises(FailedPreconditionError, match="does not give its snapshot"):
            pull_image(plain, node.containerd.address, namespace="honest", client=other)
        assert other.list_images() == []
    assert "written out whole" not in node.snapshotter.log()
