"""The containerd client against a private containerd 1.6: version, content (write, dedup,
digest and size refusal, a failing source), images (also seen by ``ctr``), leases (what they
protect from garbage collection), snapshots through the built-in overlayfs snapshotter, diff
apply, the error mapping; and the API definitions themselves: the committed generated code is
current, and every message and RPC matches the descriptors compiled into the installed
containerd binary (field numbers, types, streaming)."""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import importlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from prefetch.containerd import errors
from prefetch.containerd.client import (
    CHUNK_SIZE,
    GC_EXPIRE_LABEL,
    ContainerdClient,
    Descriptor,
    Mount,
    SnapshotInfo,
    _chunks,
    descriptor_from_proto,
    descriptor_to_proto,
    info_from_proto,
    info_to_proto,
    mount_from_proto,
    mount_to_proto,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTTER = "overlayfs"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def client(containerd):
    with ContainerdClient(containerd.address, containerd.namespace, timeout_s=30) as c:
        c.ensure_namespace()
        yield c


def _collect_garbage(client: ContainerdClient) -> None:
    """Runs containerd's garbage collector now (a synchronous delete of an empty lease)."""
    client.delete_lease(client.create_lease(), sync=True)


# -- pure conversions -------------------------------------------------------------------------


def test_proto_conversions_round_trip() -> None:
    m = Mount("overlay", "overlay", ["lowerdir=/a:/b", "ro"], target="/x")
    assert m.options == ("lowerdir=/a:/b", "ro")
    assert mount_from_proto(mount_to_proto(m)) == m
    d = Descriptor(MANIFEST, "sha256:" + "ab" * 32, 42, {"k": "v"})
    assert descriptor_from_proto(descriptor_to_proto(d)) == d
    when = dt.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=dt.UTC)
    info = SnapshotInfo("n", "p", "committed", {"a": "b"}, when, when)
    assert info_from_proto(info_to_proto(info)) == info
    assert info_from_proto(info_to_proto(SnapshotInfo("bare"))).created is None


def test_chunks_are_bounded_and_lossless() -> None:
    data = os.urandom(2 * CHUNK_SIZE + 7)
    pieces = list(_chunks(data))
    assert [len(p) for p in pieces] == [CHUNK_SIZE, CHUNK_SIZE, 7]
    streamed = list(_chunks(iter([b"", data[:10], data[10:]])))
    assert b"".join(streamed) == data and max(map(len, streamed)) <= CHUNK_SIZE


def test_unreachable_socket_is_unavailable(tmp_path: Path) -> None:
    with ContainerdClient(str(tmp_path / "none.sock"), timeout_s=5) as c:
        with pytest.raises(errors.UnavailableError, match="version"):
            c.version()


# -- the API definitions ------------------------------------------------------------------------


def test_generated_code_is_current() -> None:
    pytest.importorskip("grpc_tools")
    proc = subprocess.run(
        [sys.executable, "-m", "prefetch.containerd.api.generate", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_generate_check_names_drifted_missing_and_stale_files(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("grpc_tools")
    from prefetch.containerd.api import generate

    api = tmp_path / "prefetch/containerd/api"
    shutil.copytree(generate.API_DIR, api)
    monkeypatch.setattr(generate, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(generate, "API_DIR", api)
    assert generate.check() == []
    (api / "types/mount_pb2.py").write_text("# edited by hand\n")
    (api / "types/descriptor_pb2.pyi").unlink()
    (api / "types/old_pb2.py").write_text("")
    assert generate.check() == [
        "missing: prefetch/containerd/api/types/descriptor_pb2.pyi",
        "stale (no .proto generates it): prefetch/containerd/api/types/old_pb2.py",
        "differs: prefetch/containerd/api/types/mount_pb2.py",
    ]
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0  # regenerates in place (the stale file stays for review)
    assert generate.check() == [
        "stale (no .proto generates it): prefetch/containerd/api/types/old_pb2.py"
    ]


def _embedded_descriptors(binary: str) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """The gzipped FileDescriptorProtos that gogo/golang protobuf compiled into a Go binary,
    by proto package and file name."""
    data = Path(binary).read_bytes()
    found: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    start = data.find(b"\x1f\x8b\x08")
    while start >= 0:
        try:
            raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(
                data[start : start + (4 << 20)]
            )
            fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            if "containerd/api/" in fd.name or fd.package == "runtime.v1":  # + CRI's
                found[f"{fd.package}/{fd.name.rsplit('/', 1)[-1]}"] = fd
        except Exception:  # not a gzip stream, or not a descriptor
            pass
        start = data.find(b"\x1f\x8b\x08", start + 1)
    return found


OUR_MODULES = [
    "prefetch.containerd.api.types.mount_pb2",
    "prefetch.containerd.api.types.descriptor_pb2",
    "prefetch.containerd.api.services.content.v1.content_pb2",
    "prefetch.containerd.api.services.diff.v1.diff_pb2",
    "prefetch.containerd.api.services.images.v1.images_pb2",
    "prefetch.containerd.api.services.leases.v1.leases_pb2",
    "prefetch.containerd.api.services.namespaces.v1.namespace_pb2",
    "prefetch.containerd.api.services.snapshots.v1.snapshots_pb2",
    "prefetch.containerd.api.services.version.v1.version_pb2",
]
# Fields containerd added after 1.6 (the daemon these tests run against ignores them).
NEWER_FIELDS = {(".containerd.services.diff.v1.DiffRequest", 6)}


def _messages(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.DescriptorProto]:
    out: dict[str, descriptor_pb2.DescriptorProto] = {}

    def walk(prefix: str, msgs) -> None:
        for m in msgs:
            out[prefix + m.name] = m
            walk(prefix + m.name + ".", m.nested_type)

    walk(f".{fd.package}.", fd.message_type)
    return out


@pytest.mark.system
def test_protos_match_installed_containerd(system) -> None:
    binary = shutil.which("containerd")
    system(None if binary else "needs containerd (apt: containerd)")
    theirs = _embedded_descriptors(binary)
    if not theirs:
        pytest.skip("this containerd build embeds no gzipped descriptors to compare with")
    checked = 0
    for module in OUR_MODULES:
        ours = descriptor_pb2.FileDescriptorProto()
        importlib.import_module(module).DESCRIPTOR.CopyToProto(ours)
        key = f"{ours.package}/{ours.name.rsplit('/', 1)[-1]}"
        assert key in theirs, f"containerd has no {key}"
        ref = theirs[key]
        our_msgs, ref_msgs = _messages(ours), _messages(ref)
        assert set(our_msgs) == set(ref_msgs), key
        for name, ref_msg in ref_msgs.items():
            our_fields = {f.number: f for f in our_msgs[name].field}
            for f in ref_msg.field:
                o = our_fields.pop(f.number, None)
                assert o is not None, f"{name} lacks field {f.number} ({f.name})"
                assert (o.name, o.type, o.label, o.type_name) == (
                    f.name,
                    f.type,
                    f.label,
                    f.type_name,
                ), f"{name}.{f.name}"
            assert {(name, n) for n in our_fields} <= NEWER_FIELDS, f"{name}: extra fields"
            assert our_msgs[name].options.map_entry == ref_msg.options.map_entry
        for ref_enum in ref.enum_type:
            our_enum = next(e for e in ours.enum_type if e.name == ref_enum.name)
            assert [(v.name, v.number) for v in our_enum.value] == [
                (v.name, v.number) for v in ref_enum.value
            ]
        for ref_svc in ref.service:
            our_methods = {
                m.name: m for m in next(s for s in ours.service if s.name == ref_svc.name).method
            }
            for m in ref_svc.method:
                o = our_methods[m.name]
                assert (o.input_type, o.output_type, o.client_streaming, o.server_streaming) == (
                    m.input_type,
                    m.output_type,
                    m.client_streaming,
                    m.server_streaming,
                )
            assert set(our_methods) == {m.name for m in ref_svc.method}
        checked += 1
    assert checked == len(OUR_MODULES)


def test_the_drift_check_covers_the_cri_api() -> None:
    from prefetch.containerd.api import generate

    assert Path("prefetch/containerd/api/cri/runtime/v1/api.proto") in generate.proto_files()


@pytest.mark.system
def test_cri_proto_is_a_wire_compatible_subset_of_installed_containerds(system) -> None:
    """The CRI definition keeps only what the client uses: every message, field, enum value
    and method it has must be containerd's, with the same number, name and type."""
    binary = shutil.which("containerd")
    system(None if binary else "needs containerd (apt: containerd)")
    theirs = _embedded_descriptors(binary).get("runtime.v1/api.proto")
    if theirs is None:
        pytest.skip("this containerd build embeds no CRI v1 descriptor to compare with")
    from prefetch.containerd.api.cri.runtime.v1 import api_pb2

    ours = descriptor_pb2.FileDescriptorProto()
    api_pb2.DESCRIPTOR.CopyToProto(ours)
    ref_msgs = _messages(theirs)
    for name, msg in _messages(ours).items():
        assert name in ref_msgs, f"containerd's CRI has no {name}"
        ref_fields = {f.number: f for f in ref_msgs[name].field}
        for f in msg.field:
            r = ref_fields.get(f.number)
            assert r is not None, f"{name}.{f.name}: containerd has no field {f.number}"
            assert (f.name, f.type, f.label, f.type_name) == (
                r.name,
                r.type,
                r.label,
                r.type_name,
            ), f"{name}.{f.name}"
    for enum in ours.enum_type:
        ref_enum = next(e for e in theirs.enum_type if e.name == enum.name)
        assert {(v.name, v.number) for v in enum.value} <= {
            (v.name, v.number) for v in ref_enum.value
        }, enum.name
    for svc in ours.service:
        ref_methods = {
            m.name: m for m in next(s for s in theirs.service if s.name == svc.name).method
        }
        for m in svc.method:
            r = ref_methods[m.name]
            assert (m.input_type, m.output_type) == (r.input_type, r.output_type), m.name


# -- against a private containerd ---------------------------------------------------------------


def test_version_and_namespace(client: ContainerdClient, containerd) -> None:
    version, revision = client.version()
    assert version.lstrip("v").startswith("1."), version
    assert revision
    client.ensure_namespace("bootseer-other")
    client.ensure_namespace("bootseer-other")  # exists: no error
    assert {containerd.namespace, "bootseer-other"} <= set(client.list_namespaces())
    assert "bootseer-other" in containerd.ctr("namespaces", "ls").stdout


def test_content_write_read_dedup_delete(client: ContainerdClient) -> None:
    """Under a lease, as containerd's own clients write: content nothing references is removed
    by containerd's garbage collector, which runs 100 ms after containerd starts and after
    deletions, so a write-then-read without one failed whenever the test ran that long (on a
    busy machine, e.g. after test_snapshotter_restart.py). A collection between the write and
    the reads is forced here."""
    with client.lease() as c:
        data = os.urandom(2 * CHUNK_SIZE + 12345)  # three Write messages and a commit
        digest = _digest(data)
        assert c.write_content(data, digest=digest, size=len(data), labels={"a": "1"}) is True
        _collect_garbage(client)
        assert c.read_content(digest) == data
        assert c.read_content(digest, offset=10, size=100) == data[10:110]
        got_digest, size, labels = c.content_info(digest)
        assert (got_digest, size, labels) == (digest, len(data), {"a": "1"})
        # The same blob again, from an iterable: nothing written, labels merged.
        assert (
            c.write_content(
                iter([data[:5], data[5:]]), digest=digest, size=len(data), labels={"b": "2"}
            )
            is False
        )
        assert c.content_info(digest).labels == {"a": "1", "b": "2"}
        c.update_content_labels(digest, {"a": ""})  # "" removes
        assert c.content_info(digest).labels == {"b": "2"}
        assert [i.digest for i in c.list_content(f"digest=={digest}")] == [digest]
        assert c.ingest_refs() == []
        c.delete_content(digest)  # an explicit delete removes it, lease or not
        with pytest.raises(errors.NotFoundError, match=digest):
            c.content_info(digest)


def test_wrong_digest_or_size_is_refused_and_leaves_nothing(client: ContainerdClient) -> None:
    data = b"bootseer layer bytes"
    wrong = "sha256:" + "0" * 64
    with pytest.raises(errors.FailedPreconditionError, match="unexpected commit digest"):
        client.write_content(data, digest=wrong, size=len(data))
    with pytest.raises(errors.NotFoundError):
        client.content_info(wrong)
    with pytest.raises(errors.FailedPreconditionError, match="size"):
        client.write_content(data, digest=_digest(data), size=len(data) - 1)
    with pytest.raises(errors.NotFoundError):
        client.content_info(_digest(data))
    assert client.ingest_refs() == []  # containerd keeps failed ingests; the client aborts them


def test_failing_source_aborts_the_write(client: ContainerdClient) -> None:
    data = os.urandom(3 * CHUNK_SIZE)

    def source():
        yield data[:CHUNK_SIZE]
        raise OSError("download broke")

    with pytest.raises(OSError, match="download broke"):
        client.write_content(source(), digest=_digest(data), size=len(data))
    with pytest.raises(errors.NotFoundError):
        client.content_info(_digest(data))
    assert client.ingest_refs() == []
    # A retry under the same ref starts over and succeeds.
    assert client.write_content(data, digest=_digest(data), size=len(data)) is True


def test_images_round_trip(client: ContainerdClient, containerd) -> None:
    manifest = b'{"schemaVersion": 2}'
    target = Descriptor(MANIFEST, _digest(manifest), len(manifest))
    client.write_content(manifest, digest=target.digest, size=target.size)
    name = "registry.test/app/train:v1"
    client.put_image(name, target, labels={"bootseer.io/lazy": "true"})
    image = client.get_image(name)
    assert (image.name, image.target, image.labels) == (name, target, {"bootseer.io/lazy": "true"})
    assert image.created is not None and image.updated is not None
    listing = containerd.ctr("images", "ls").stdout
    assert name in listing and target.digest in listing

    other = Descriptor(MANIFEST, "sha256:" + "1" * 64, 7)
    client.put_image(name, other)  # exists: retargeted, labels kept
    image = client.get_image(name)
    assert image.target == other and image.labels == {"bootseer.io/lazy": "true"}
    client.put_image(name, other, labels={})
    assert client.get_image(name).labels == {}
    client.put_image("registry.test/app/eval:v1", target)
    assert [i.name for i in client.list_images(f"name=={name}")] == [name]
    assert len(client.list_images()) == 2

    client.delete_image(name, sync=True)
    with pytest.raises(errors.NotFoundError, match=name):
        client.get_image(name)
    with pytest.raises(errors.NotFoundError):
        client.delete_image(name)
    assert name not in containerd.ctr("images", "ls").stdout


def test_lease_protects_what_is_written_under_it(client: ContainerdClient, containerd) -> None:
    loose, leased = os.urandom(1000), os.urandom(1000)
    lease_id = client.create_lease(expire_s=600, labels={"purpose": "test"})
    before = dt.datetime.now(dt.UTC)
    [info] = [le for le in client.list_leases() if le.id == lease_id]
    expiry = dt.datetime.fromisoformat(info.labels[GC_EXPIRE_LABEL])
    assert info.labels["purpose"] == "test"
    assert dt.timedelta(seconds=590) < expiry - before < dt.timedelta(seconds=610)
    assert lease_id in containerd.ctr("leases", "ls").stdout

    client.write_content(loose, digest=_digest(loose), size=len(loose))
    client.with_lease(lease_id).write_content(leased, digest=_digest(leased), size=len(leased))
    _collect_garbage(client)
    with pytest.raises(errors.NotFoundError):  # nothing referenced it
        client.content_info(_digest(loose))
    assert client.content_info(_digest(leased)).size == len(leased)

    client.delete_lease(lease_id, sync=True)
    assert lease_id not in containerd.ctr("leases", "ls").stdout
    with pytest.raises(errors.NotFoundError):
        client.content_info(_digest(leased))
    with pytest.raises(errors.NotFoundError):
        client.delete_lease(lease_id)

    with client.lease() as leased_client:
        assert leased_client.lease_id in {le.id for le in client.list_leases()}
    assert leased_client.lease_id not in {le.id for le in client.list_leases()}


def test_snapshots_through_overlayfs(client: ContainerdClient) -> None:
    with client.lease() as c:
        [mount] = c.prepare_snapshot(SNAPSHOTTER, "work-1", labels={"bootseer.test": "yes"})
        assert mount.type == "bind" and Path(mount.source).is_dir()  # first layer: a directory
        (Path(mount.source) / "hello.txt").write_bytes(b"from the test\n")
        assert c.stat_snapshot(SNAPSHOTTER, "work-1").kind == "active"
        assert c.snapshot_mounts(SNAPSHOTTER, "work-1") == [mount]

        c.commit_snapshot(SNAPSHOTTER, "layer-1", "work-1", labels={"bootseer.test": "yes"})
        info = c.stat_snapshot(SNAPSHOTTER, "layer-1")
        assert (info.name, info.parent, info.kind) == ("layer-1", "", "committed")
        assert info.labels == {"bootseer.test": "yes"} and info.created is not None
        with pytest.raises(errors.NotFoundError):  # the active key is gone
            c.stat_snapshot(SNAPSHOTTER, "work-1")
        size, inodes = c.snapshot_usage(SNAPSHOTTER, "layer-1")
        assert size > 0 and inodes >= 1

        assert [i.name for i in c.list_snapshots(SNAPSHOTTER, "name==layer-1")] == ["layer-1"]
        assert [i.name for i in c.list_snapshots(SNAPSHOTTER, 'labels."bootseer.test"==yes')] == [
            "layer-1"
        ]
        assert c.list_snapshots(SNAPSHOTTER, "name==absent") == []
        updated = c.update_snapshot_labels(SNAPSHOTTER, "layer-1", {"extra": "1"})
        assert updated.labels == {"bootseer.test": "yes", "extra": "1"}

        [view] = c.view_snapshot(SNAPSHOTTER, "view-1", "layer-1")
        assert "ro" in view.options
        assert (Path(view.source) / "hello.txt").read_bytes() == b"from the test\n"
        assert c.stat_snapshot(SNAPSHOTTER, "view-1").kind == "view"
        with pytest.raises(errors.FailedPreconditionError):  # a parent with children stays
            c.remove_snapshot(SNAPSHOTTER, "layer-1")
        c.remove_snapshot(SNAPSHOTTER, "view-1")
        c.remove_snapshot(SNAPSHOTTER, "layer-1")
        assert c.list_snapshots(SNAPSHOTTER) == []
        assert c.cleanup_snapshots(SNAPSHOTTER) in (True, False)  # 1.6: not implemented


def test_snapshot_errors_map_to_classes(client: ContainerdClient) -> None:
    with pytest.raises(errors.NotFoundError, match="stat snapshot missing"):
        client.stat_snapshot(SNAPSHOTTER, "missing")
    with pytest.raises(errors.NotFoundError, match="parent"):
        client.prepare_snapshot(SNAPSHOTTER, "child", parent="missing")
    with client.lease() as c:
        c.prepare_snapshot(SNAPSHOTTER, "a")
        with pytest.raises(errors.AlreadyExistsError):
            c.prepare_snapshot(SNAPSHOTTER, "a")
        c.remove_snapshot(SNAPSHOTTER, "a")
    with pytest.raises(errors.ContainerdError, match="no-such-snapshotter"):
        client.stat_snapshot("no-such-snapshotter", "x")


def _layer(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, body in files.items():
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(body), 0o644
            tar.addfile(member, io.BytesIO(body))
    return buf.getvalue()


def test_apply_diff_unpacks_a_layer_into_a_snapshot(client: ContainerdClient) -> None:
    tar = _layer({"etc/bootseer/hello.txt": b"hello from a layer\n", "bin/tool": b"\x7fELF..."})
    blob = gzip.compress(tar)
    layer = Descriptor(LAYER_GZIP, _digest(blob), len(blob))
    with client.lease() as c:
        assert c.write_content(blob, digest=layer.digest, size=layer.size)
        mounts = c.prepare_snapshot(SNAPSHOTTER, "extract-1")
        applied = c.apply_diff(layer, mounts)  # containerd mounts them itself
        assert applied.digest == _digest(tar) and applied.size == len(tar)  # the diff ID
        assert applied.media_type == "application/vnd.oci.image.layer.v1.tar"
        c.commit_snapshot(SNAPSHOTTER, "layer-1", "extract-1")

        [view] = c.view_snapshot(SNAPSHOTTER, "check-1", "layer-1")
        assert view.type == "bind"
        root = Path(view.source)
        assert (root / "etc/bootseer/hello.txt").read_bytes() == b"hello from a layer\n"
        assert (root / "bin/tool").read_bytes() == b"\x7fELF..."
        c.remove_snapshot(SNAPSHOTTER, "check-1")

        missing = Descriptor(LAYER_GZIP, "sha256:" + "2" * 64, 10)
        with pytest.raises(errors.NotFoundError, match="apply layer"):
            c.apply_diff(missing, c.prepare_snapshot(SNAPSHOTTER, "extract-2", "layer-1"))
