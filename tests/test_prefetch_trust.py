"""Trust boundaries of lazy layers (issue "Trust boundaries"). Every attack is injected with bytes
the test writes itself (tests/layer_craft.py: zstd frames, a TOC JSON with its header, the seek
table), never with the project's converter, which refuses to write them.

* the index is bound to the layer's manifest: a blob swapped in the registry's storage, a
  second registry serving other bytes under the same layer digest, a converted layer whose
  manifest records no index digest, a poisoned index cache: refused (naming the layer and the
  rule) or served from the right, verified bytes; never the attacker's files;
* the index must match the tar: a TOC that points a name at another member's bytes, renames,
  retypes or re-modes a member, or leaves one out fails the read with EIO, naming the member
  and the rule, while ``zstd -d | tar`` of the same blob shows the benign content;
* bounded decompression: a frame that declares 2 MiB (or 3 GiB) and inflates to 3 GiB fails
  without the memory;
* a tiny TOC declaring millions of entries is refused before anything is allocated;
* convert derives the TOC itself; an image copied by another tool stays lazy.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import random
import subprocess
import sys
import tarfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import zstandard
from canary import Canary
from cli_helpers import bootseer_cli
from layer_craft import (
    Crafted,
    build_blob,
    honest_entries,
    padded_blob,
    rle_frame,
    seek_table,
    sha256,
    tar_of,
    toc_frame,
    zstd_frame,
)
from test_prefetch_image import _push_gzip_image

from prefetch.cache import BlockCache
from prefetch.containerd.errors import FailedPreconditionError
from prefetch.containerd.labels import LayerRequest
from prefetch.containerd.remote import RemoteLayers
from prefetch.fetcher import Blob, FrameFetcher
from prefetch.image import convert_image, open_image, verify_image
from prefetch.layer import ConvertError, convert_layer
from prefetch.lazyfs import Layer, LazyImage, mount
from prefetch.mediatypes import OCI_CONFIG, OCI_LAYER_ZSTD, OCI_MANIFEST
from prefetch.members import _quick_match, read_member, tar_entry
from prefetch.registry import SyncRegistry
from prefetch.toc import (
    INDEX_ANNOTATION,
    RULE_BOUND,
    RULE_COMPLETE,
    RULE_MATCH,
    FrameVerificationError,
    LayerIndex,
    MalformedLayerError,
    TocMismatchError,
    UnboundIndexError,
)
from striped_fs.fuse import is_mounted, unmount, wait_mounted

BENIGN = b"benign config: what zstd -d | tar and the scanners see\n"
EVIL = b"EVIL payload the lazy mount must never show under another name\n"


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def canary(tmp_path: Path):
    """A canary tree beside the caches, mounts and node roots every test here puts under
    ``tmp_path``: whatever a crafted layer or index does, nothing outside them changes."""
    planted = Canary.plant(tmp_path / "canary")
    yield planted
    planted.assert_unchanged()


class Server:
    """Blobs by digest, served by range (a registry in memory)."""

    def __init__(self, *blobs: Crafted) -> None:
        self.blobs = {b.digest: b.blob for b in blobs}

    def __call__(self, digest: str, start: int, end: int) -> bytes:
        return self.blobs[digest][start:end]


def lazy_image(tmp_path: Path, *crafted: Crafted) -> LazyImage:
    """The lazy tree of crafted layers, read through the FUSE read path (fetcher, block cache,
    frame checks), each index bound to the digest of its own bytes."""
    layers = []
    for i, c in enumerate(crafted):
        index = LayerIndex.from_blob(c.read, len(c.blob), c.digest, index_digest=c.index_digest)
        layers.append(Layer(index, Blob(c.digest, index.frames, i, c.index_digest)))
    fetcher = FrameFetcher(
        Server(*crafted), BlockCache(tmp_path / "cache"), connections=2, retries=0
    )
    return LazyImage(layers, fetcher)


def read(lazy: LazyImage, path: str, offset: int = 0, size: int | None = None) -> bytes:
    node = lazy.tree.lookup(path)
    assert node is not None, path
    entry = node.data.entry
    return lazy.read(node, offset, entry.size if size is None else size)


def plain_unpack(blob: bytes) -> dict[str, bytes]:
    """What a plain pull shows: ``zstd -d`` (across frames, skipping skippable ones) | tar."""
    tar = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isreg()}


def entry(entries: list[dict], name: str) -> dict:
    return next(e for e in entries if e["name"] == name)


def assert_refused(exc: BaseException, member: str, rule: str, *fragments: str) -> None:
    """The read failed with EIO, and the error names the layer, the member and the rule."""
    assert isinstance(exc, OSError) and exc.errno == errno.EIO, exc
    cause = exc.__cause__
    assert isinstance(cause, TocMismatchError), exc
    assert cause.member == member and cause.rule == rule
    message = str(exc)
    assert repr(member) in message and rule in message and "layer sha256:" in message
    for fragment in fragments:
        assert fragment in message, message


# --- (d) the index must match the tar ----------------------------------------------------------

LAYER = [
    ("etc", None),
    ("etc/a.conf", BENIGN),
    ("etc/b.conf", EVIL),
    ("etc/link", b"->a.conf"),
    ("etc/z", b"last member\n"),
]


def _point_a_at_b(entries: list[dict]) -> None:
    """a.conf's entry points at b.conf's data (b.conf's own entry goes: entries may not
    overlap, which is refused as soon as the TOC is parsed)."""
    a, b = entry(entries, "etc/a.conf"), entry(entries, "etc/b.conf")
    a["offset"], a["size"] = b["offset"], b["size"]
    entries.remove(b)


def _rename_b(entries: list[dict]) -> None:
    entry(entries, "etc/b.conf")["name"] = "etc/shadow"


def _relink(entries: list[dict]) -> None:
    entry(entries, "etc/link")["link"] = "/etc/shadow"  # presented, never followed


def _setuid(entries: list[dict]) -> None:
    entry(entries, "etc/z")["mode"] = 0o4755


def _grow(entries: list[dict]) -> None:
    entry(entries, "etc/a.conf")["size"] += 100


def _retype(entries: list[dict]) -> None:
    b = entry(entries, "etc/b.conf")
    b["type"], b["size"] = "fifo", 0


def _drop(name: str):
    def mutate(entries: list[dict]) -> None:
        entries.remove(entry(entries, name))

    return mutate


# case: (mutation, path read, member named, rule, what the message says)
LIES = {
    "name pointed at another member's bytes": (
        _point_a_at_b,
        "etc/a.conf",
        "etc/a.conf",
        RULE_MATCH,
        "offset is",
    ),
    "a member renamed": (
        _rename_b,
        "etc/shadow",
        "etc/shadow",
        RULE_MATCH,
        "name is 'etc/shadow' in the TOC, 'etc/b.conf' in the tar",
    ),
    "a symlink retargeted": (
        _relink,
        "etc/a.conf",
        "etc/link",
        RULE_MATCH,
        "link is '/etc/shadow' in the TOC, 'a.conf' in the tar",
    ),
    "a setuid bit added": (_setuid, "etc/z", "etc/z", RULE_MATCH, "mode is 2541 in the TOC"),
    "a size grown": (_grow, "etc/a.conf", "etc/a.conf", RULE_MATCH, "size is"),
    "a type changed": (_retype, "etc/a.conf", "etc/b.conf", RULE_MATCH, "type is 'fifo'"),
    "a member left out": (
        _drop("etc/b.conf"),
        "etc/a.conf",
        "etc/a.conf",
        RULE_COMPLETE,
        "the next TOC entry ('etc/link')",
    ),
    "the last member left out": (
        _drop("etc/z"),
        "etc/a.conf",
        "etc/link",
        RULE_COMPLETE,
        "more after byte",
    ),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_a_toc_that_lies_about_the_tar_fails_the_read_naming_member_and_rule(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    mutate, path, member, rule, what = LIES[case]
    tar = tar_of(LAYER)
    entries = honest_entries(tar)
    mutate(entries)
    crafted = build_blob(tar, entries)
    assert plain_unpack(crafted.blob)["etc/a.conf"] == BENIGN  # a plain pull: benign
    lazy = lazy_image(tmp_path, crafted)  # the index itself is well formed and bound
    with pytest.raises(OSError) as info:
        read(lazy, path)
    assert_refused(info.value, member, rule, what, crafted.digest)
    assert any(
        r.levelname == "ERROR" and repr(member) in r.getMessage() and rule in r.getMessage()
        for r in caplog.records
    )  # logged, naming member and rule
    with pytest.raises(OSError):  # every later read of the frame fails too: never bytes
        read(lazy, path)
    lazy.fetcher.close()


def test_an_honest_hand_made_layer_reads_back(tmp_path: Path) -> None:
    tar = tar_of(LAYER)
    crafted = build_blob(tar, honest_entries(tar))
    lazy = lazy_image(tmp_path, crafted)
    assert read(lazy, "etc/a.conf") == BENIGN and read(lazy, "etc/b.conf") == EVIL
    lazy.fetcher.close()


def test_the_mount_answers_eio_for_a_name_pointed_at_another_members_bytes(
    tmp_path: Path, fuse
) -> None:
    tar = tar_of(LAYER)
    entries = honest_entries(tar)
    _point_a_at_b(entries)
    lazy = lazy_image(tmp_path, build_blob(tar, entries))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    thread = threading.Thread(target=mount, args=(lazy, str(mnt)), daemon=True)
    thread.start()
    wait_mounted(mnt, 10)
    try:
        assert (mnt / "etc/a.conf").stat().st_size == len(EVIL)  # what the TOC claims...
        with pytest.raises(OSError) as info:
            (mnt / "etc/a.conf").read_bytes()  # ... is never served
        assert info.value.errno == errno.EIO
    finally:
        unmount(mnt)
        thread.join(10)
        lazy.fetcher.close()
    assert not is_mounted(mnt)


BIG = random.Random(5).randbytes(300_000)
LONG = "usr/lib/python3/" + "/".join(["a_rather_long_directory_name"] * 6) + "/mod.py"


@pytest.mark.parametrize("lie", [False, True], ids=["honest", "renamed"])
def test_a_header_in_one_frame_and_its_data_in_the_next(tmp_path: Path, lie: bool) -> None:
    """Cut right after big.bin's header block (frames counted from 0): a read inside its data
    (frame 2) checks the header in frame 0 first. A long name's pax header is cut from its
    ustar block (frame 2 ends inside the header chain): checking it reads on into frame 3."""
    tar = tar_of([("x", b"x" * 100), ("big.bin", BIG), (LONG, b"print('long')\n"), ("y", b"y")])
    entries = honest_entries(tar)
    big, long = entry(entries, "big.bin"), entry(entries, LONG)
    assert long["offset"] - long["header"] > 512  # a pax header chain
    cuts = [big["offset"], big["offset"] + 100_000, long["offset"] - 512]
    if lie:
        big["name"] = "big-decoy.bin"
    crafted = build_blob(tar, entries, cuts=cuts)
    lazy = lazy_image(tmp_path, crafted)
    name = "big-decoy.bin" if lie else "big.bin"
    if lie:
        with pytest.raises(OSError) as info:
            read(lazy, name, 150_000, 4096)
        assert_refused(info.value, name, RULE_MATCH, "'big.bin' in the tar")
        return
    assert read(lazy, name, 150_000, 4096) == BIG[150_000:154_096]
    index = lazy.layers[0].index
    assert {0, 2} <= index.verified  # the header's frame was checked before the data's
    assert read(lazy, LONG) == b"print('long')\n"  # a header chain across frames 3 and 4
    assert read(lazy, "y") == b"y"
    lazy.fetcher.close()


def test_a_global_pax_header_that_sets_member_fields_is_refused(tmp_path: Path) -> None:
    def tar_with_global(pax: dict[str, str]) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers=pax) as tf:
            for name, data in (("a", b"a"), ("b", b"bb")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        return out.getvalue()

    harmless = tar_with_global({"comment": "built by git archive"})
    out = io.BytesIO()
    convert_layer(io.BytesIO(harmless), out, frame_size=64 << 10)
    blob = out.getvalue()
    index = LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob))
    assert index.entries[0].header_offset == 0  # the member's headers start with the global
    assert index.read("b", lambda s, e: blob[s:e]) == b"bb"

    with pytest.raises(ConvertError, match="global pax header sets uid"):
        convert_layer(io.BytesIO(tar_with_global({"uid": "0"})), io.BytesIO())
    # A crafted TOC over such a tar is refused when read.
    evil = tar_with_global({"path": "etc/shadow"})
    entries = honest_entries(evil)
    entries[0]["header"] = 0
    crafted = build_blob(evil, entries)
    lazy = lazy_image(tmp_path, crafted)
    with pytest.raises(OSError) as info:
        read(lazy, entries[0]["name"])
    assert_refused(info.value, entries[0]["name"], RULE_MATCH, "global pax header sets path")
    lazy.fetcher.close()


def test_the_fast_header_check_never_accepts_what_tarfile_reads_differently() -> None:
    """The one-block fast path against tarfile, on 20,000 randomly damaged headers: whenever
    the fast path accepts a block as the entry, tarfile reads exactly that entry from it."""
    from test_layer_format import build_tar

    tar, _ = build_tar(tarfile.GNU_FORMAT, seed=11)
    blob = io.BytesIO()
    convert_layer(io.BytesIO(tar), blob, frame_size=64 << 10)
    data = blob.getvalue()
    index = LayerIndex.from_blob(lambda s, e: data[s:e], len(data))
    plain = [e for e in index.entries if e.offset == e.header_offset + 512]
    assert len(plain) > 150
    rng = random.Random(3)
    accepted = 0
    for n in range(20_000):
        e = rng.choice(plain)
        block = bytearray(tar[e.header_offset : e.header_offset + 512])
        assert _quick_match(bytes(block), e)  # the real header passes the fast path
        for _ in range(rng.choice([1, 1, 2])):
            at = rng.choice(
                [
                    rng.randrange(512),
                    rng.randrange(100),
                    rng.randrange(100, 160),
                    rng.randrange(257, 500),
                ]
            )
            block[at] = rng.choice([0, 0x20, 0x2F, 0x30, 0x37, rng.randrange(256)])
        if n % 2:  # keep the checksum right half the time: the other fields then decide
            block[148:156] = b"        "
            block[148:155] = b"%06o\0" % sum(block)
        if not _quick_match(bytes(block), e):
            continue
        accepted += 1
        h = e.header_offset
        padded = bytes(block) + tar[h + 512 :]
        info, end = read_member(lambda s, t, p=padded, h=h: p[s - h : t - h], h, h + 512)
        assert tar_entry(info, h, end) == e
    assert accepted > 500  # damage in ignored bytes (and equal rewrites) is accepted


# --- (e) bounded decompression ------------------------------------------------------------------

BOMB_CHILD = r"""
import errno, hashlib, resource, sys
sys.path.insert(0, sys.argv[4])
resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))  # 1.5 GiB: a regression fails
from layer_craft import rle_frame
from prefetch.cache import BlockCache
from prefetch.fetcher import Blob, FrameFetcher
from prefetch.toc import Frame
declared = None if sys.argv[1] == "none" else int(sys.argv[1])
data = rle_frame(declared, int(sys.argv[2]))
if sys.argv[3] == "trailing":
    data = rle_frame(2 << 20, 16) + rle_frame(1 << 20, 8)
frame = Frame(0, 0, len(data), 0, 2 << 20, hashlib.sha256(data).hexdigest())
fetcher = FrameFetcher(lambda d, s, e: data[s:e], BlockCache(sys.argv[5]), connections=1,
                       retries=0)
try:
    fetcher.frame(Blob("sha256:" + "0" * 64, [frame]), 0)
    print("SERVED")
except OSError as exc:
    print("EIO" if exc.errno == errno.EIO else "OTHER", exc)
# VmHWM: this process's own peak (ru_maxrss would include the parent's, inherited at exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status")
            if line.startswith("VmHWM:"))
print("peak_mb", peak // 1024, len(data))
"""


@pytest.mark.parametrize(
    "declared, blocks, shape, message",
    [
        (2 << 20, 24576, "bomb", "Destination buffer is too small"),
        (3 << 30, 24576, "bomb", "declares 3221225472 bytes of content, the seek table 2097152"),
        ("none", 24576, "bomb", "declares None bytes of content"),
        (2 << 20, 16, "trailing", "one zstd frame expected"),
    ],
    ids=["declares-2MiB-inflates-3GiB", "declares-3GiB", "no-content-size", "two-frames"],
)
def test_a_decompression_bomb_frame_fails_with_bounded_memory(
    tmp_path: Path, declared: Any, blocks: int, shape: str, message: str
) -> None:
    """A 98 KB frame of RLE blocks that inflates to 3 GiB, the seek table saying 2 MiB: the
    read fails with EIO, and the process never holds more than a frame's worth."""
    tests = str(Path(__file__).parent)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            BOMB_CHILD,
            str(declared),
            str(blocks),
            shape,
            tests,
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("EIO") and message in lines[0], proc.stdout
    rss = int(lines[1].split()[1])
    assert rss < 400, f"peak RSS {rss} MiB: the frame was inflated"
    if shape == "bomb":
        assert 90_000 < int(lines[1].split()[2]) < 110_000  # the 98 KB frame


def test_the_layer_index_path_is_bounded_too() -> None:
    tar = tar_of([("zeros", bytes(2 << 20))])
    entries = honest_entries(tar)
    bomb = rle_frame(len(tar), 24576)  # declares the tar's size, inflates to 3 GiB
    crafted = build_blob(tar, entries, frames=[(bomb, len(tar))])
    index = LayerIndex.from_blob(crafted.read, len(crafted.blob), crafted.digest)
    started = time.monotonic()
    with pytest.raises(FrameVerificationError, match="frame 0 failed verification: zstd"):
        index.read("zeros", crafted.read)
    assert time.monotonic() - started < 5


# --- (f) a tiny blob declaring millions of TOC entries -------------------------------------------


def _toc_bomb(kind: str) -> bytes:
    """A blob whose TOC declares far more than its bytes: the JSON is written straight into a
    zstd stream, never held in memory here."""
    tar = bytes(1024)  # an empty layer: one 1 KiB frame
    frame = zstd_frame(tar)
    row = [0, len(frame), 0, len(tar), hashlib.sha256(frame).hexdigest()]
    one = json.dumps(
        {
            "name": "f",
            "type": "reg",
            "mode": 420,
            "uid": 0,
            "gid": 0,
            "size": 0,
            "mtime": 0,
            "offset": 512,
            "header": 0,
        },
        separators=(",", ":"),
    ).encode()
    count = {"millions": 1_400_000, "values": 10_000, "headers": 40}[kind]
    head = (
        json.dumps(
            {
                "format": "bootseer-layer-toc",
                "version": 1,
                "tar_size": len(tar),
                "diff_id": sha256(tar),
                "frame_size": 1 << 20,
                "level": 3,
                "frames": [row],
            },
            separators=(",", ":"),
        ).encode()[:-1]
        + b',"entries":['
    )

    def pieces():
        yield head
        left = count
        while left:
            n = min(left, 10_000)
            yield (b"," if left < count else b"") + b",".join([one] * n)
            left -= n
        yield b"]}"

    digest, size = hashlib.sha256(), 0
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False)
    for piece in pieces():
        digest.update(piece)
        size += len(piece)
        writer.write(piece)
    writer.flush(zstandard.FLUSH_FRAME)
    toc = toc_frame(b"", declared=(size, digest.digest()), compressed=out.getvalue())
    table = seek_table([(len(frame), len(tar), 0), (len(toc), 0, 0x51D8E999)])
    return frame + toc + table


@pytest.mark.parametrize(
    "kind, message",
    [
        ("millions", "bytes of JSON from"),
        ("values", "JSON values (more than 32 per byte)"),
        ("headers", "more than the 2 headers of 512 bytes a 1024-byte tar stream can hold"),
    ],
)
def test_a_tiny_toc_declaring_millions_of_entries_is_refused_before_allocation(
    kind: str, message: str
) -> None:
    blob = _toc_bomb(kind)
    assert len(blob) < 64 << 10  # the attack: 1.4 M entries in an 11 KB blob
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(MalformedLayerError) as info:
            LayerIndex.from_blob(lambda s, e: blob[s:e], len(blob), "sha256:" + "7" * 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message in str(info.value)
    assert time.monotonic() - started < 2
    assert peak < 16 << 20, f"{peak >> 20} MiB allocated before refusing"


# --- registry images: the index bound to the manifest ---------------------------------------------

FILES = [("etc", None), ("etc/a.conf", BENIGN), ("app", None), ("app/big.bin", BIG)]
ATTACK = [("etc", None), ("etc/a.conf", EVIL), ("app", None), ("app/big.bin", EVIL * 10)]


@pytest.fixture
def converted(registry) -> dict[str, Any]:
    """A gzip image and its bootseer conversion in the real registry."""
    _push_gzip_image(registry.host, "team/app", "v1", [tar_of(FILES)])
    src, dst = f"{registry.host}/team/app:v1", f"{registry.host}/team/app:lazy"
    convert_image(src, dst, frame_size=64 << 10)
    with SyncRegistry(registry.host) as reg:
        manifest = reg.resolve_image(dst)
    layer = manifest.layers[0]
    return {
        "ref": dst,
        "manifest": manifest,
        "digest": layer.digest,
        "size": layer.size,
        "index": layer.annotations[INDEX_ANNOTATION],
    }


def same_size_attack(size: int) -> Crafted:
    """A self-consistent layer of the attacker's files, exactly as long as the real blob."""
    tar = tar_of(ATTACK)
    return padded_blob(tar, honest_entries(tar), size)


def remote_read(remote: RemoteLayers, layer: Any, path: str) -> bytes:
    lazy = remote.lazy_image([layer], overlay=False)
    return read(lazy, path)


def request(image: dict[str, Any], chain: str = "1") -> LayerRequest:
    return LayerRequest(
        "sha256:" + chain * 64, image["ref"], image["digest"], image["manifest"].digest
    )


def test_the_index_carries_its_digest_and_the_mount_checks_it(converted, tmp_path: Path) -> None:
    image = open_image(converted["ref"], tmp_path / "cache")
    try:
        assert image.lazy.layers[0].index.index_digest == converted["index"]
        assert read(image.lazy, "etc/a.conf") == BENIGN
        assert read(image.lazy, "app/big.bin") == BIG
    finally:
        image.close()


def test_a_blob_swapped_in_the_registry_storage_is_refused(
    converted, registry, tmp_path: Path
) -> None:
    """(a) The registry's own file for the layer digest now holds another self-consistent
    layer of the same size: the manifest (and any signature on it) still verifies, the
    index does not."""
    remote = RemoteLayers(tmp_path / "node", prefetch=False, push_profiles=False)
    try:
        legit = remote.layer(request(converted))  # on the node before the swap: cached
        assert remote_read(remote, legit, "etc/a.conf") == BENIGN
    finally:
        remote.close()
    attack = same_size_attack(converted["size"])
    registry.blob_path(converted["digest"]).write_bytes(attack.blob)

    with pytest.raises(UnboundIndexError) as info:
        open_image(converted["ref"], tmp_path / "cache")
    assert converted["digest"] in str(info.value) and INDEX_ANNOTATION in str(info.value)
    assert info.value.rule == RULE_BOUND and attack.index_digest in str(info.value)

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = bootseer_cli(
        "image", "mount", converted["ref"], str(mnt), "--cache", str(tmp_path / "c2"), check=False
    )
    assert proc.returncode == 2 and converted["digest"] in proc.stderr
    assert RULE_BOUND in proc.stderr and "Traceback" not in proc.stderr
    assert not is_mounted(mnt)

    # The snapshotter: a fresh node refuses the layer; the node that cached the real index
    # keeps serving the real files, also when its index cache was overwritten with the
    # attacker's index (it is checked against the manifest when read back).
    fresh = RemoteLayers(tmp_path / "fresh", prefetch=False, push_profiles=False)
    try:
        with pytest.raises(FailedPreconditionError) as refused:
            fresh.layer(request(converted, "2"))
        assert converted["digest"] in str(refused.value) and RULE_BOUND in str(refused.value)
    finally:
        fresh.close()
    cached = tmp_path / "node" / "indexes" / converted["index"].replace(":", "-")
    assert cached.is_file()
    restarted = RemoteLayers(tmp_path / "node", prefetch=False, push_profiles=False)
    try:
        layer = restarted.layer_from_source(legit.source())
        assert remote_read(restarted, layer, "etc/a.conf") == BENIGN  # frames cached
    finally:
        restarted.close()
    cached.write_bytes(attack.blob[attack.toc_offset :])  # poison the node's index cache
    poisoned = RemoteLayers(tmp_path / "node", prefetch=False, push_profiles=False)
    try:
        with pytest.raises(FailedPreconditionError, match=RULE_BOUND):
            poisoned.layer_from_source(legit.source())  # re-read from the swapped registry
    finally:
        poisoned.close()


def _push_manifest(
    host: str,
    repo: str,
    tag: str,
    layers: list[dict],
    config: Any,
    blobs: dict[str, bytes] | None = None,
) -> str:
    with SyncRegistry(host) as reg:
        for digest, data in (blobs or {}).items():
            reg.put_blob(repo, data, digest)
        doc = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": config.digest, "size": config.size},
            "layers": layers,
        }
        return reg.put_manifest(repo, tag, json.dumps(doc).encode(), OCI_MANIFEST)


def test_a_second_registry_cannot_poison_a_layer_of_the_same_digest(
    converted, registry, registry_factory, tmp_path: Path
) -> None:
    """(b) Registry two serves an image whose manifest names the same layer digest (with the
    attacker's index digest, self-consistent) and other bytes under it. Both images on one
    node, the attacker's first: the real image shows its own files, now and after a restart,
    through `bootseer image mount`'s cache and the snapshotter's caches alike."""
    evil = registry_factory()
    attack = same_size_attack(converted["size"])
    with SyncRegistry(registry.host) as reg:
        config_bytes = reg.get_blob("team/app", converted["manifest"].config.digest)
        legit_blob = reg.get_blob("team/app", converted["digest"])
    config = converted["manifest"].config
    layer = {
        "mediaType": OCI_LAYER_ZSTD,
        "digest": converted["digest"],
        "size": converted["size"],
        "annotations": {
            "io.bootseer.layer.format": "seekable-zstd/1",
            INDEX_ANNOTATION: attack.index_digest,
        },
    }
    manifest_b = _push_manifest(
        evil.host,
        "team/app",
        "lazy",
        [layer],
        config,
        {config.digest: config_bytes, converted["digest"]: legit_blob},
    )
    evil.blob_path(converted["digest"]).write_bytes(attack.blob)  # other bytes, same digest
    ref_b = f"{evil.host}/team/app:lazy"

    cache = tmp_path / "images"
    b = open_image(ref_b, cache)  # the attacker's image shows the attacker's files...
    try:
        assert read(b.lazy, "etc/a.conf") == EVIL
    finally:
        b.close()
    for _ in range(2):  # ... and the real one its own, on the same block cache, twice
        a = open_image(converted["ref"], cache)
        try:
            assert read(a.lazy, "etc/a.conf") == BENIGN
            assert read(a.lazy, "app/big.bin") == BIG
        finally:
            a.close()

    node = tmp_path / "node"
    remote = RemoteLayers(node, prefetch=False, push_profiles=False)
    try:
        layer_b = remote.layer(
            LayerRequest("sha256:" + "b" * 64, ref_b, converted["digest"], manifest_b)
        )
        assert remote_read(remote, layer_b, "etc/a.conf") == EVIL
        layer_a = remote.layer(request(converted))
        assert layer_a is not layer_b and layer_a.index_digest == converted["index"]
        assert remote_read(remote, layer_a, "etc/a.conf") == BENIGN
        assert remote_read(remote, layer_a, "app/big.bin") == BIG
        sources = (layer_a.source(), layer_b.source())
    finally:
        remote.close()
    names = sorted(p.name for p in (node / "indexes").iterdir())
    assert names == sorted(d.replace(":", "-") for d in (converted["index"], attack.index_digest))

    # A third registry names the real index digest and serves the real index over damaged
    # frames: its own image fails (EIO), the real one, opened after it, does not.
    third = registry_factory()
    manifest_c = _push_manifest(
        third.host,
        "team/app",
        "lazy",
        [{**layer, "annotations": converted["manifest"].parsed["layers"][0]["annotations"]}],
        config,
        {config.digest: config_bytes, converted["digest"]: legit_blob},
    )
    damaged = bytearray(legit_blob)
    damaged[100] ^= 0xFF  # inside the first data frame; the index is untouched
    third.blob_path(converted["digest"]).write_bytes(bytes(damaged))
    fresh = RemoteLayers(tmp_path / "node3", prefetch=False, push_profiles=False)
    try:
        layer_c = fresh.layer(
            LayerRequest(
                "sha256:" + "d" * 64, f"{third.host}/team/app:lazy", converted["digest"], manifest_c
            )
        )
        with pytest.raises(OSError) as info:
            remote_read(fresh, layer_c, "etc/a.conf")
        assert info.value.errno == errno.EIO
        layer_a = fresh.layer(request(converted))
        assert layer_a is not layer_c
        assert remote_read(fresh, layer_a, "etc/a.conf") == BENIGN
    finally:
        fresh.close()
    restarted = RemoteLayers(node, prefetch=False, push_profiles=False)
    try:
        layer_a = restarted.layer_from_source(sources[0])
        assert remote_read(restarted, layer_a, "etc/a.conf") == BENIGN
        layer_b = restarted.layer_from_source(sources[1])
        assert remote_read(restarted, layer_b, "etc/a.conf") == EVIL
    finally:
        restarted.close()


@pytest.mark.parametrize(
    "value", [None, "sha256:nothex", "sha256:" + "0" * 64], ids=["missing", "malformed", "wrong"]
)
def test_a_converted_layer_without_a_bound_index_is_never_trusted(
    converted, registry, tmp_path: Path, value: str | None
) -> None:
    """(c) A converted layer whose manifest records no (or a bad) index digest: `bootseer
    image mount` refuses it naming the layer and the rule; the snapshotter does not serve it
    lazily (containerd unpacks it the normal way, checking its digest) or refuses it."""
    desc = dict(converted["manifest"].parsed["layers"][0])
    annotations = dict(desc["annotations"])
    annotations.pop(INDEX_ANNOTATION)
    if value is not None:
        annotations[INDEX_ANNOTATION] = value
    desc["annotations"] = annotations
    digest = _push_manifest(
        registry.host, "team/app", "unbound", [desc], converted["manifest"].config
    )
    ref = f"{registry.host}/team/app:unbound"
    with pytest.raises(UnboundIndexError) as info:
        open_image(ref, tmp_path / "cache")
    assert converted["digest"] in str(info.value) and info.value.rule == RULE_BOUND
    remote = RemoteLayers(tmp_path / "node", prefetch=False, push_profiles=False)
    try:
        req = LayerRequest("sha256:" + "c" * 64, ref, converted["digest"], digest)
        if value == "sha256:" + "0" * 64:  # well formed but not this index: refused
            with pytest.raises(FailedPreconditionError, match=RULE_BOUND):
                remote.layer(req)
        else:
            assert remote.layer(req) is None  # normal unpack
        assert list((tmp_path / "node" / "indexes").iterdir()) == []
    finally:
        remote.close()


def test_an_image_copied_by_another_tool_stays_lazy(
    converted, registry, registry_factory, tmp_path: Path
) -> None:
    """The lazy path needs only the manifest's annotations: a copy of the blobs and the
    manifest bytes into another registry (crane/skopeo style), or a manifest re-serialized
    with its annotations kept, mounts lazily with the right content."""
    other = registry_factory()
    manifest = converted["manifest"]
    with SyncRegistry(registry.host) as src, SyncRegistry(other.host) as dst:
        for desc in (manifest.config, *manifest.layers):
            dst.put_blob("mirror/app", src.get_blob("team/app", desc.digest), desc.digest)
        dst.put_manifest("mirror/app", "copy", manifest.data, manifest.media_type)
        pretty = json.dumps(manifest.parsed, indent=3, sort_keys=True).encode()
        dst.put_manifest("mirror/app", "reserialized", pretty, manifest.media_type)
    for tag in ("copy", "reserialized"):
        image = open_image(f"{other.host}/mirror/app:{tag}", tmp_path / tag)
        try:
            assert read(image.lazy, "etc/a.conf") == BENIGN
            assert image.lazy.fetcher.stats.bytes_fetched < converted["size"]  # lazily
        finally:
            image.close()


def test_convert_derives_the_toc_and_never_copies_a_supplied_one(registry, tmp_path: Path) -> None:
    """A source image whose layer is already "converted", with a TOC pointing a.conf at
    b.conf's bytes (and even an index digest that matches it): the conversion derives the TOC
    from the tar, so the converted image shows a.conf as the tar holds it."""
    tar = tar_of(LAYER)
    entries = honest_entries(tar)
    _point_a_at_b(entries)
    crafted = build_blob(tar, entries)
    src = _push_crafted(registry.host, "team/lies", crafted)
    dst = f"{registry.host}/team/lies:lazy"

    lying = open_image(src, tmp_path / "c1")  # bound, but the tar check catches it
    try:
        with pytest.raises(OSError) as info:
            read(lying.lazy, "etc/a.conf")
        assert_refused(info.value, "etc/a.conf", RULE_MATCH)
    finally:
        lying.close()

    result = convert_image(src, dst, frame_size=64 << 10)
    assert result.converted
    image = open_image(dst, tmp_path / "c2")
    try:
        assert image.manifest.layers[0].digest != crafted.digest
        assert read(image.lazy, "etc/a.conf") == BENIGN
        assert read(image.lazy, "etc/b.conf") == EVIL
    finally:
        image.close()


# --- what a lazy read does not check, `bootseer image verify` does --------------------------------


def _push_crafted(host: str, repo: str, crafted: Crafted) -> str:
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [sha256(crafted.tar)]},
        }
    ).encode()

    class Config:
        digest, size = sha256(config), len(config)

    layer = {
        "mediaType": OCI_LAYER_ZSTD,
        "digest": crafted.digest,
        "size": len(crafted.blob),
        "annotations": {
            "io.bootseer.layer.format": "seekable-zstd/1",
            INDEX_ANNOTATION: crafted.index_digest,
        },
    }
    _push_manifest(
        host, repo, "v1", [layer], Config, {Config.digest: config, crafted.digest: crafted.blob}
    )
    return f"{host}/{repo}:v1"


def test_verify_checks_the_frames_a_lazy_start_never_reads(registry, tmp_path: Path) -> None:
    """A frame that holds a second zstd frame (a member only a plain unpack sees) is found by
    a lazy read only when the read touches it; `bootseer image verify` reads every frame."""
    tar = tar_of([("a", b"a" * 3000), ("b", b"b" * 3000), ("c", b"c" * 3000)])
    entries = honest_entries(tar)
    cut1, cut2 = entry(entries, "b")["header"], entry(entries, "c")["header"]
    hidden = tar_of([("etc/hidden", b"only a plain unpack shows this")])[:1024]
    frames = [
        (zstd_frame(tar[:cut1]), cut1),
        (zstd_frame(tar[cut1:cut2]) + zstd_frame(hidden), cut2 - cut1),
        (zstd_frame(tar[cut2:]), len(tar) - cut2),
    ]
    crafted = build_blob(tar, entries, frames=frames)
    assert "etc/hidden" in plain_unpack(crafted.blob)
    ref = _push_crafted(registry.host, "team/hidden", crafted)
    image = open_image(ref, tmp_path / "cache")
    try:
        assert read(image.lazy, "c") == b"c" * 3000  # frame 2 alone: not caught (documented)
        with pytest.raises(OSError) as info:
            read(image.lazy, "b")  # frame 1: caught on read
        assert info.value.errno == errno.EIO and "one zstd frame expected" in str(info.value)
    finally:
        image.close()
    with pytest.raises(
        FrameVerificationError, match="frame 1 failed verification: .*one zstd frame expected"
    ):
        verify_image(ref)


def test_bootseer_image_verify(converted, registry) -> None:
    result = verify_image(converted["ref"])
    assert (result.layers, result.members) == (1, len(FILES))
    assert result.bytes == converted["size"] and result.frames > 4
    out = bootseer_cli("image", "verify", converted["ref"]).stdout
    assert out.startswith("verified") and "equals a plain unpack" in out

    tar = tar_of(LAYER)
    entries = honest_entries(tar)
    _relink(entries)
    ref = _push_crafted(registry.host, "team/relinked", build_blob(tar, entries))
    proc = bootseer_cli("image", "verify", ref, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'etc/link'" in proc.stderr and RULE_MATCH in proc.stderr
