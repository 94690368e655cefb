"""Helpers of the snapshot tests: environments built from the local test index, stores (local
directory or moto S3), crafted (hostile) snapshots, and tree comparisons."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zstandard

from bootseer.testing.pypi import TINYDATA_DIGEST, PackageIndex, installer_env
from snapshot.ensure import EnsureResult, ensure
from snapshot.install import find_uv
from snapshot.manifest import MANIFEST_NAME, Chunk, Manifest, Member, encode_toc
from snapshot.restore import STAGING_TAG
from snapshot.store import SnapshotStore

PY = sys.executable
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE = f"lib/{PYVER}/site-packages"
STATE_DIR = ".bootseer"
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
"""What the environment's programs run with: nothing of this interpreter's venv leaks in."""


# -- the process environment of an install ---------------------------------------------------


def use_test_index(
    monkeypatch: pytest.MonkeyPatch, cache_dir: str | os.PathLike | None = None
) -> dict[str, str]:
    """Make ``os.environ`` the :func:`installer_env` (pip and uv see only the test index) for
    in-process ``ensure`` calls, whose install subprocesses inherit it; also drops the
    bootseer variables that would change a key or a store. Returns the environment."""
    env = installer_env(cache_dir)
    for name in (
        "BOOTSEER_ENV_BASE_IMAGE",
        "BOOTSEER_ENV_STORE",
        "BOOTSEER_STORAGE_OPTIONS",
        "BOOTSEER_ENV_UV",
        "VIRTUAL_ENV",
        "PYTHONPATH",
    ):
        env.pop(name, None)
    for name in list(os.environ):
        if name not in env:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def write_requirements(directory: Path, index: PackageIndex, *requirements: str) -> Path:
    """``directory/req-<hash>.txt`` naming the test index and ``requirements`` (one file per
    distinct set, so that the same set always gives the same key)."""
    text = f"--index-url {index.url}\n" + "".join(f"{r}\n" for r in requirements)
    path = directory / f"req-{hashlib.sha256(text.encode()).hexdigest()[:12]}.txt"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def uv_bin() -> str:
    uv = find_uv()
    if uv is None:
        pytest.skip("uv is not installed (pip install uv)")
    return uv


def uv_venv_command(requirements: Path, *then: str) -> list[str]:
    """A custom install command: a uv venv with ``requirements`` at {prefix}, then the shell
    commands ``then`` (in the same ``sh -c``)."""
    uv = uv_bin()
    steps = [
        f"{uv} venv -q --python {PY} {{prefix}}",
        f"{uv} pip install -q --python {{prefix}}/bin/python --compile-bytecode -r {requirements}",
        *then,
    ]
    return ["sh", "-c", " && ".join(steps)]


# -- stores ----------------------------------------------------------------------------------


@dataclass
class StoreUnderTest:
    """A snapshot store of a test: a local directory or ``s3://bucket/envs`` on moto."""

    kind: str  # "local" | "s3"
    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def open(self, **kwargs: Any) -> SnapshotStore:
        return SnapshotStore(self.url, self.storage_options or None, **kwargs)

    def cli_args(self) -> list[str]:
        args = ["--store", self.url]
        if self.storage_options:
            args += ["--storage-options", json.dumps(self.storage_options)]
        return args

    def objects(self) -> list[str]:
        """Every object under the store, relative to its root, sorted (no caches)."""
        store = self.open()
        store.target.invalidate_cache()
        try:
            found = store.target.find(store.root)
        except FileNotFoundError:
            return []
        return sorted(p[len(store.root) + 1 :] for p in found)

    def read(self, name: str) -> bytes:
        store = self.open()
        return store.target.cat_file(f"{store.root}/{name}")

    def write(self, name: str, data: bytes) -> None:
        store = self.open()
        store.target.pipe_file(f"{store.root}/{name}", data)

    def layout(self) -> dict[str, dict[str, Any]]:
        """``{key: {"manifest": bool, "lock": bool, "publishers": {pub: [names]}}}``."""
        out: dict[str, dict[str, Any]] = {}
        for obj in self.objects():
            parts = obj.split("/")
            entry = out.setdefault(
                parts[0], {"manifest": False, "lock": False, "publishers": {}, "other": []}
            )
            if parts[1:] == [MANIFEST_NAME]:
                entry["manifest"] = True
            elif parts[1:] == ["lock.json"]:
                entry["lock"] = True
            elif len(parts) == 3:
                entry["publishers"].setdefault(parts[1], []).append(parts[2])
            else:
                entry["other"].append(obj)
        return out


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> StoreUnderTest:
    if kind == "local":
        return StoreUnderTest("local", str(tmp_path / "store"))
    bucket, options = request.getfixturevalue("s3_bucket")
    return StoreUnderTest("s3", f"s3://{bucket}/envs", {"s3": options})


def assert_one_snapshot(store: StoreUnderTest, key: str) -> list[str]:
    """The store holds exactly the committed snapshot of ``key``: its manifest and one
    publisher's chunks and TOC, no lease. Returns the chunk names."""
    layout = store.layout()
    assert list(layout) == [key], layout
    entry = layout[key]
    assert entry["manifest"] and not entry["lock"] and not entry["other"], entry
    assert len(entry["publishers"]) == 1, entry
    ((publisher, names),) = entry["publishers"].items()
    manifest = store.open().require_manifest(key)
    assert manifest.publisher == publisher
    assert sorted(names) == sorted(
        [c.name.split("/")[1] for c in manifest.chunks] + ["toc.json.zst"]
    )
    return [c.name for c in manifest.chunks]


# -- environments ----------------------------------------------------------------------------


def run_in(
    prefix: Path, *argv: str | os.PathLike, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a program of the environment (``bin/NAME`` or an absolute path) with a clean
    environment."""
    first = Path(argv[0]) if os.path.isabs(argv[0]) else prefix / "bin" / argv[0]
    proc = subprocess.run(
        [str(first), *map(str, argv[1:])],
        capture_output=True,
        text=True,
        env={**CLEAN_ENV, **(env or {})},
        timeout=60,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{argv} in {prefix} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def assert_env_works(prefix: Path, *, alpha: str = "2.0") -> None:
    """The test packages work at ``prefix``: the console script (shebang) and an import."""
    assert run_in(prefix, "tinybeta-cli").stdout.strip() == f"beta-cli-ok alpha-{alpha}"
    out = run_in(prefix, "python", "-c", "import tinydata; print(tinydata.DIGEST)").stdout
    assert out.strip() == TINYDATA_DIGEST


def ensure_env(
    prefix: Path,
    store: StoreUnderTest | SnapshotStore | None,
    requirements: Sequence[str | os.PathLike] = (),
    **kwargs: Any,
) -> EnsureResult:
    """``ensure`` with a store of a test (the caller set the index environment)."""
    if isinstance(store, StoreUnderTest):
        kwargs.setdefault("storage_options", store.storage_options or None)
        store = store.url
    return ensure(list(requirements), prefix=prefix, store=store, **kwargs)


def staging_dirs(prefix: Path) -> list[Path]:
    """Staging directories of restores to ``prefix`` (finished restores leave none)."""
    return sorted(prefix.parent.glob(f".{prefix.name}{STAGING_TAG}*"))


def leftovers(prefix: Path) -> list[str]:
    """Anything bootseer left beside ``prefix``: staging directories, an environment moved
    aside, an install marker (not the node-local lock file, which stays by design)."""
    return sorted(
        p.name
        for p in prefix.parent.iterdir()
        if p.name.startswith(f".{prefix.name}.bootseer")
        and p.name != f".{prefix.name}.bootseer-lock"
    )


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.005
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- trees -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    kind: str  # "f", "d", "l"
    mode: int
    mtime_ns: int
    size: int = 0
    digest: str = ""
    link: str = ""
    inode: tuple[int, int] = (0, 0)
    nlink: int = 1


def scan(root: Path, *, exclude: Iterable[str] = (STATE_DIR,)) -> dict[str, Entry]:
    """Every entry under ``root`` (links not followed), keyed by relative path."""
    skip = set(exclude)
    out: dict[str, Entry] = {}

    def visit(rel: str) -> None:
        base = root / rel if rel else root
        for name in sorted(os.listdir(base)):
            child = f"{rel}/{name}" if rel else name
            if not rel and name in skip:
                continue
            path = base / name
            st = os.lstat(path)
            ident = (st.st_dev, st.st_ino)
            if stat.S_ISDIR(st.st_mode):
                out[child] = Entry("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns, inode=ident)
                visit(child)
            elif stat.S_ISLNK(st.st_mode):
                out[child] = Entry(
                    "l",
                    stat.S_IMODE(st.st_mode),
                    st.st_mtime_ns,
                    link=os.readlink(path),
                    inode=ident,
                )
            elif stat.S_ISREG(st.st_mode):
                data = path.read_bytes()
                out[child] = Entry(
                    "f",
                    stat.S_IMODE(st.st_mode),
                    st.st_mtime_ns,
                    len(data),
                    hashlib.sha256(data).hexdigest(),
                    inode=ident,
                    nlink=st.st_nlink,
                )
            else:
                out[child] = Entry("?", stat.S_IMODE(st.st_mode), st.st_mtime_ns, inode=ident)

    visit("")
    return out


def hardlink_groups(tree: dict[str, Entry]) -> set[frozenset[str]]:
    """Sets of paths that are one inode (only groups of two or more)."""
    groups: dict[tuple[int, int], set[str]] = {}
    for path, entry in tree.items():
        if entry.kind == "f":
            groups.setdefault(entry.inode, set()).add(path)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def tree_differences(
    src: dict[str, Entry],
    dst: dict[str, Entry],
    *,
    content_differs: Iterable[str] = (),
    check_modes: bool = True,
    mtime_resolution_ns: int = 1,
    check_link_mtimes: bool = True,
    check_dir_mtimes: bool = True,
) -> list[str]:
    """What differs between two scanned trees: paths, kinds, contents (except the paths in
    ``content_differs``), modes, mtimes (compared at ``mtime_resolution_ns``), link targets
    and hardlink identity. An empty list means the same tree."""
    problems: list[str] = []
    skip_content = set(content_differs)
    for path in sorted(set(src) - set(dst)):
        problems.append(f"{path}: missing")
    for path in sorted(set(dst) - set(src)):
        problems.append(f"{path}: unexpected")
    for path in sorted(set(src) & set(dst)):
        a, b = src[path], dst[path]
        if a.kind != b.kind:
            problems.append(f"{path}: kind {a.kind} != {b.kind}")
            continue
        if a.kind == "f" and path not in skip_content and (a.size, a.digest) != (b.size, b.digest):
            problems.append(f"{path}: content differs")
        if a.kind == "l" and a.link != b.link:
            problems.append(f"{path}: link {a.link!r} != {b.link!r}")
        if check_modes and a.kind != "l" and a.mode != b.mode:
            problems.append(f"{path}: mode {a.mode:o} != {b.mode:o}")
        if (
            a.kind == "f"
            or (a.kind == "l" and check_link_mtimes)
            or (a.kind == "d" and check_dir_mtimes)
        ) and a.mtime_ns // mtime_resolution_ns != b.mtime_ns // mtime_resolution_ns:
            problems.append(f"{path}: mtime {a.mtime_ns} != {b.mtime_ns}")
    if hardlink_groups(src) != hardlink_groups(dst):
        problems.append(
            f"hardlinks {sorted(map(sorted, hardlink_groups(src)))} != "
            f"{sorted(map(sorted, hardlink_groups(dst)))}"
        )
    return problems


# -- crafted snapshots -----------------------------------------------------------------------

MTIME_NS = 1_600_000_000_123_456_789
_TAR_TYPES = {
    "f": tarfile.REGTYPE,
    "d": tarfile.DIRTYPE,
    "l": tarfile.SYMTYPE,
    "h": tarfile.LNKTYPE,
    "c": tarfile.CHRTYPE,
    "b": tarfile.BLKTYPE,
    "p": tarfile.FIFOTYPE,
}
_DEFAULT_MODES = {
    "f": 0o644,
    "d": 0o755,
    "l": 0o777,
    "h": 0o644,
    "c": 0o666,
    "b": 0o660,
    "p": 0o644,
}


def tar_stream(entries: Sequence[tuple]) -> tuple[list[Member], bytes]:
    """A real tar stream (pax, as ``snapshot.pack`` writes it) and its TOC, from entries
    ``(kind, path[, payload[, mode]])``: payload is a file's bytes (``"f"``) or a link's
    target (``"l"``, ``"h"``). Nothing is checked: paths may be hostile."""
    stream = bytearray()
    members: list[Member] = []
    for entry in entries:
        kind, path = entry[0], entry[1]
        payload = entry[2] if len(entry) > 2 else (b"" if kind == "f" else "")
        mode = entry[3] if len(entry) > 3 else _DEFAULT_MODES[kind]
        info = tarfile.TarInfo(path)
        info.type = _TAR_TYPES[kind]
        info.mode = mode & 0o7777
        info.mtime = MTIME_NS // 1_000_000_000
        data = payload if kind == "f" else b""
        info.size = len(data)
        if kind in ("l", "h"):
            info.linkname = payload
        stream += info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        members.append(
            Member(
                path,
                kind,
                mode,
                MTIME_NS,
                len(data),
                len(stream),
                payload if kind in ("l", "h") else "",
            )
        )
        stream += data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)
    stream += b"\0" * (2 * tarfile.BLOCKSIZE)
    return members, bytes(stream)


def publish_crafted(
    store: SnapshotStore,
    members: Sequence[Member],
    stream: bytes,
    *,
    prefix: str | os.PathLike,
    key: str | None = None,
    chunk_size: int | None = None,
    tamper: Callable[[dict[str, Any]], None] | None = None,
    compress: Callable[[bytes], bytes] | None = None,
    kind: str = "prefix",
    capture: dict[str, Any] | None = None,
) -> Manifest:
    """Publish a hand-made snapshot (``members`` as the TOC, ``stream`` cut into zstd chunks
    of ``chunk_size`` bytes, default one) the way a publisher would, hostile or not.
    ``compress(raw)`` makes each chunk object (default: real zstd; :func:`zstd_frame` for a
    frame written byte by byte); ``kind`` and ``capture`` make a capture snapshot;
    ``tamper(manifest_json)`` may edit the manifest before it is written. Returns the
    manifest as built (before tampering)."""
    key = key or uuid.uuid4().hex
    publisher = uuid.uuid4().hex
    size = chunk_size or max(len(stream), 1)
    comp = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True)
    chunks = []
    for i, start in enumerate(range(0, len(stream), size)):
        raw = stream[start : start + size]
        data = (compress or comp.compress)(raw)
        name = f"{publisher}/{i:06d}.tar.zst"
        store.put(key, name, data).result()
        chunks.append(Chunk(name, start, len(raw), len(data), hashlib.sha256(data).hexdigest()))
    toc_raw = encode_toc(list(members))
    toc = comp.compress(toc_raw)
    toc_name = f"{publisher}/toc.json.zst"
    store.put(key, toc_name, toc).result()
    manifest = Manifest(
        key=key,
        kind=kind,
        prefix=os.fspath(prefix),
        chunks=chunks,
        toc={
            "name": toc_name,
            "sha256": hashlib.sha256(toc).hexdigest(),
            "size": len(toc),
            "raw_size": len(toc_raw),
        },
        stream_size=len(stream),
        files=sum(m.kind == "f" for m in members),
        bytes=sum(m.size for m in members if m.kind == "f"),
        publisher=publisher,
        created=time.time(),
        host="crafted",
        capture=capture or {},
    )
    if tamper is None:
        assert store.commit(manifest)
    else:
        data = manifest.to_json()
        tamper(data)
        store.put(key, MANIFEST_NAME, json.dumps(data).encode()).result()
    return manifest


def decompress_chunks(store: SnapshotStore, manifest: Manifest) -> bytes:
    """The snapshot's whole tar stream: its chunk objects concatenated, then decompressed as
    one zstd stream (what ``cat *.tar.zst | zstd -d`` does)."""
    joined = b"".join(store.fetch(manifest.key, c.name).result() for c in manifest.chunks)
    data = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(joined, read_across_frames=True)
    while piece := reader.read(1 << 20):
        data += piece
    return bytes(data)


def replace_object(
    store: SnapshotStore, manifest: dict[str, Any], ref: dict[str, Any], data: bytes
) -> None:
    """Inside a ``tamper``: make the object ``ref`` names (a chunk or the TOC entry of
    ``manifest``) hold ``data``, with the size and sha256 that let it pass the checksum
    layer."""
    store.put(manifest["key"], ref["name"], data).result()
    ref.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())


def capture_entries(roots: Sequence[Path], entries: Sequence[tuple]) -> list[tuple]:
    """Entries of a capture snapshot (paths relative to ``/``): every ancestor of each root
    and the root as directories, then ``entries`` (paths relative to ``/`` too)."""
    out: list[tuple] = []
    seen: set[str] = set()
    for root in roots:
        parts = str(root).strip("/").split("/")
        for depth in range(1, len(parts) + 1):
            path = "/".join(parts[:depth])
            if path not in seen:
                seen.add(path)
                out.append(("d", path))
    return out + list(entries)


# -- zstd frames written byte by byte (RFC 8878) ---------------------------------------------

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZSTD_BLOCK_MAX = 128 << 10
_RUN = re.compile(rb"(.)\1{31,}", re.S)


def _zstd_block(kind: int, size: int, body: bytes, last: bool = False) -> bytes:
    """One block: 3-byte header (last flag, type 0 raw / 1 RLE, size), then its body."""
    return (int(last) | kind << 1 | size << 3).to_bytes(3, "little") + body


def _zstd_blocks(raw: bytes) -> Iterator[bytes]:
    """``raw`` as raw blocks, its runs of one byte as RLE blocks (4 bytes per 128 KiB)."""
    pos = 0
    for run in [*_RUN.finditer(raw), None]:
        literal = raw[pos : run.start() if run else len(raw)]
        for i in range(0, len(literal), ZSTD_BLOCK_MAX):
            piece = literal[i : i + ZSTD_BLOCK_MAX]
            yield _zstd_block(0, len(piece), piece)
        if run is not None:
            yield from _rle_blocks(run.group(1), run.end() - run.start())
            pos = run.end()


def _rle_blocks(byte: bytes, count: int) -> Iterator[bytes]:
    while count > 0:
        size = min(count, ZSTD_BLOCK_MAX)
        yield _zstd_block(1, size, byte)
        count -= size


def zstd_frame(raw: bytes, *, content_size: int | None | str = "true", inflate: int = 0) -> bytes:
    """A zstd frame written byte by byte: ``raw``, then ``inflate`` more zero bytes (RLE
    blocks: 512 MiB cost 16 KiB, a decompression bomb), under a header that declares
    ``content_size``: the true size of the bytes before the bomb (``"true"``), any number,
    or None (no size in the header). No checksum; window 128 KiB."""
    blocks = [*_zstd_blocks(raw), *_rle_blocks(b"\0", inflate)] or [_zstd_block(0, 0, b"")]
    last = blocks[-1]
    blocks[-1] = bytes([last[0] | 1]) + last[1:]
    if content_size == "true":
        content_size = len(raw)
    header = ZSTD_MAGIC + (
        bytes([0x00, 7 << 3])
        if content_size is None
        else bytes([0xC0, 7 << 3]) + int(content_size).to_bytes(8, "little")
    )
    return header + b"".join(blocks)
