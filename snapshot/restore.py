"""Restore a snapshot into a prefix: fetch, verify, decompress and extract in a pipeline,
relocate, then move into place atomically.

Pipeline: the TOC is fetched and checked first (nothing is written before every member passed
:mod:`snapshot.safety`); chunks are then fetched concurrently through striped_fs's backend
(bounded window, retries) while a few worker threads each verify a chunk's sha256, decompress
it into a reused buffer and write its files. Workers take chunks from evenly spaced places in
the stream, so that two threads rarely create files in the same directory (ext4 serializes
creates per directory). Everything lands in ``.<name>.bootseer-staging-<pid>-*`` beside the
prefix, which replaces the prefix with one ``rename`` (``renameat2(RENAME_EXCHANGE)`` when an
older environment is there). A killed restore leaves only a staging directory, removed by the
next restore; the prefix is never half-written.

fsync: off by default. An environment is reproducible from the store, and the marker written
with it lets the next start verify every file's type, size and mtime (``verify``), which
catches what a crash can leave (empty files); ``fsync=True`` syncs the filesystem before the
move for those who want the stronger promise.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import zstandard
from fsspec.callbacks import DEFAULT_CALLBACK, Callback

from striped_fs import pid_exists, redact

from .errors import CorruptSnapshotError, RelocationError, SnapshotError
from .extract import Extractor, _umask
from .manifest import (
    MAX_CHUNK_RAW,
    MAX_TOC_RAW,
    Chunk,
    Manifest,
    Member,
    decode_toc,
)
from .relocate import PrefixRef, RelocationReport, binary_refusal, relocate, rewrite_path
from .safety import Plan, plan_extraction
from .state import write_state
from .store import SnapshotStore
from .verify import MARKER, VERIFY_TOC, VerifyResult, read_marker, verify, verify_rows
from .zframe import frame_size, inflate, inflate_into

log = logging.getLogger(__name__)

STAGING_TAG = ".bootseer-staging-"


@dataclass
class RestoreResult:
    """What a restore did (the orchestrator turns this into a startup-trace span)."""

    key: str
    prefix: str
    files: int
    bytes: int
    compressed_bytes: int
    chunks: int
    seconds: float
    relocation: RelocationReport | None = None
    stripped_setid: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step, in order


# -- pipeline ----------------------------------------------------------------------------------


def fetch_toc(store: SnapshotStore, manifest: Manifest) -> list[Member]:
    name = manifest.toc["name"]
    data = store.fetch(
        manifest.key, name, size=manifest.toc["size"], sha256=manifest.toc["sha256"]
    ).result()
    if len(data) != manifest.toc["size"] or (
        hashlib.sha256(data).hexdigest() != manifest.toc["sha256"]
    ):
        raise CorruptSnapshotError(
            f"snapshot {manifest.key}: TOC {name} does not match its "
            f"sha256 or size; the snapshot is damaged: remove it with "
            f"`bootseer env rm` and rebuild",
            chunk=name,
        )
    raw = inflate(
        data,
        f"TOC {name} of snapshot {manifest.key}",
        declared=manifest.toc["raw_size"],
        limit=MAX_TOC_RAW,
        chunk=name,
    )
    return decode_toc(raw, where=f"snapshot {manifest.key} TOC")


class _ChunkPipeline:
    """Fetch chunks ahead (bounded), and let ``workers`` threads extract them as they land."""

    def __init__(
        self,
        store: SnapshotStore,
        manifest: Manifest,
        extractor: Extractor,
        workers: int,
        window: int,
        progress: Callback,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.extractor = extractor
        self.workers = workers
        self.window = window
        self.progress = progress
        self.order = spread_order(len(manifest.chunks), workers)
        self.futures: dict[int, Future[bytes]] = {}
        self.next = 0
        self.lock = threading.Lock()
        self.failed: BaseException | None = None
        self.local = threading.local()

    def start_fetching(self) -> None:
        """Put the first window of chunk fetches in flight (before the directories exist)."""
        with self.lock:
            for index in self.order[: self.window]:
                if index not in self.futures:
                    self.futures[index] = self._fetch(index)

    def run(self) -> None:
        self.start_fetching()
        threads = [
            threading.Thread(target=self._work, name=f"snapshot-restore-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.failed is not None:
            raise self.failed

    def _fetch(self, index: int) -> Future[bytes]:
        chunk = self.manifest.chunks[index]
        return self.store.fetch(self.manifest.key, chunk.name, size=chunk.size, sha256=chunk.sha256)

    def _take(self) -> tuple[int, Future[bytes]] | None:
        with self.lock:
            if self.failed is not None or self.next >= len(self.order):
                return None
            index = self.order[self.next]
            ahead = self.next + self.window
            if ahead < len(self.order):
                self.futures[self.order[ahead]] = self._fetch(self.order[ahead])
            self.next += 1
            return index, self.futures.pop(index)

    def _work(self) -> None:
        try:
            while (item := self._take()) is not None:
                index, future = item
                chunk = self.manifest.chunks[index]
                self._extract(index, chunk, future.result())
                self.progress.relative_update(chunk.raw_size)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by run()
            with self.lock:
                if self.failed is None:
                    self.failed = exc
                for future in self.futures.values():
                    future.cancel()

    def _extract(self, index: int, chunk: Chunk, data: bytes) -> None:
        what = f"chunk {chunk.name} of snapshot {self.manifest.key}"
        if len(data) != chunk.size or hashlib.sha256(data).hexdigest() != chunk.sha256:
            raise CorruptSnapshotError(
                f"{what} is corrupt (sha256 or size differs from the manifest); the prefix was "
                f"not changed. Remove the snapshot (`bootseer env rm`) and rebuild it",
                chunk=chunk.name,
            )
        # Checked before the buffer grows: the frame header, the manifest, the bytes.
        size = frame_size(
            data, what, declared=chunk.raw_size, limit=MAX_CHUNK_RAW, chunk=chunk.name
        )
        raw = self._buffer(size)
        inflate_into(self._decompressor(), data, raw, what, chunk=chunk.name)
        self.extractor.feed(index, raw)

    def _buffer(self, size: int) -> memoryview:
        """This thread's reused buffer, ``size`` bytes of it (grown only when needed)."""
        buf = getattr(self.local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self.local.buf = memoryview(bytearray(size))
        return buf[:size]

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decomp = getattr(self.local, "decomp", None)
        if decomp is None:
            decomp = self.local.decomp = zstandard.ZstdDecompressor()
        return decomp


def spread_order(count: int, lanes: int) -> list[int]:
    """0..count-1 taken round-robin from ``lanes`` evenly spaced runs: with ``lanes``
    workers, concurrent chunks lie far apart in the tree (different directories)."""
    lanes = max(1, min(lanes, count))
    bounds = [count * i // lanes for i in range(lanes + 1)]
    runs = [list(range(bounds[i], bounds[i + 1])) for i in range(lanes)]
    order: list[int] = []
    for step in range(max((len(r) for r in runs), default=0)):
        order.extend(run[step] for run in runs if step < len(run))
    return order


# -- the prefix --------------------------------------------------------------------------------


def _staging_dir(prefix: Path) -> Path:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(prefix)
    return Path(
        tempfile.mkdtemp(prefix=f".{prefix.name}{STAGING_TAG}{os.getpid()}-", dir=prefix.parent)
    )


def remove_stale_staging(prefix: Path) -> list[Path]:
    """Staging directories beside ``prefix`` left by killed restores (their pid is gone)."""
    removed = []
    try:
        names = os.listdir(prefix.parent)
    except FileNotFoundError:
        return removed
    tag = f".{prefix.name}{STAGING_TAG}"
    for name in names:
        if not name.startswith(tag):
            continue
        pid_text = name[len(tag) :].split("-", 1)[0]
        if pid_text.isdigit() and pid_exists(int(pid_text)) and int(pid_text) != os.getpid():
            continue
        path = prefix.parent / name
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        log.info("removed %s, left by an interrupted restore", path)
    return removed


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    res = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if res == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def mark_damaged(prefix: str | os.PathLike, reason: str) -> bool:
    """Mark the environment at ``prefix`` damaged (a check beside the command found files
    changed): the next :func:`verify` fails, and the next ensure restores it again (the marker
    stays: the prefix is still bootseer's to replace). False when it holds no marker."""
    marker = read_marker(prefix)
    if marker is None:
        return False
    marker["damaged"] = reason[:500]
    write_state(prefix, {MARKER: json.dumps(marker, indent=1).encode()})
    return True


def check_replaceable(prefix: Path, replace: bool) -> None:
    """May a restore put an environment at ``prefix``? (Asked before any download, and again
    just before the move.)"""
    if not os.path.lexists(prefix):
        return
    if prefix.is_symlink() or not prefix.is_dir():
        raise SnapshotError(
            f"{prefix} exists and is not a directory; remove it or choose another prefix"
        )
    if any(prefix.iterdir()) and read_marker(prefix) is None and not replace:
        raise SnapshotError(
            f"{prefix} exists and was not made by bootseer; pass --replace to swap it out "
            f"(it is deleted), or choose another prefix"
        )


def move_into_place(staging: Path, prefix: Path, *, replace: bool = False) -> None:
    """Make ``staging`` the prefix in one step; an older bootseer environment is swapped out
    and removed. A directory bootseer did not make is only replaced with ``replace``."""
    if not os.path.lexists(prefix):
        os.rename(staging, prefix)
        return
    check_replaceable(prefix, replace)
    try:
        swapped = _exchange(staging, prefix)
    except OSError as exc:
        if exc.errno in (errno.EBUSY, errno.EXDEV):
            raise SnapshotError(
                f"cannot move the environment into {prefix}: it is a mount "
                f"point ({exc.strerror}); restore to a path inside the mounted "
                f"volume instead"
            ) from exc
        raise
    if not swapped:  # no renameat2: two renames, with a moment in which the prefix is absent
        old = staging.with_name(staging.name + "-old")
        os.rename(prefix, old)
        os.rename(staging, prefix)
        staging = old
    shutil.rmtree(staging, ignore_errors=True)


def write_marker(
    root: Path,
    key: str,
    prefix: Path,
    members: list[Member],
    *,
    built_at: str,
    store_url: str | None,
    published: bool,
    publisher: str = "",
    changed: RelocationReport | None | bool = True,
) -> None:
    """Record what ``root`` holds, and the TOC to verify it against on the next start.

    ``changed=True``: stat every file (a tree bootseer did not write); otherwise the members'
    sizes and mtimes are what was written, except the files a relocation rewrote or removed.
    State is written through descriptors, never through a link (:mod:`snapshot.state`).
    """
    rows = verify_rows(root, members, changed)
    marker = {
        "key": key,
        "prefix": str(prefix),
        "built_at": built_at,
        "publisher": publisher,
        "store": redact(store_url) if store_url else None,
        "published": published,
        "written": time.time(),
        "entries": len(rows),
    }
    write_state(
        root,
        {
            VERIFY_TOC: zstandard.ZstdCompressor(level=3).compress(json.dumps(rows).encode()),
            MARKER: json.dumps(marker, indent=1).encode(),
        },
    )


# -- entry point -----------------------------------------------------------------------------


def restore(
    store: SnapshotStore,
    key: str,
    prefix: str | os.PathLike,
    *,
    force: bool = False,
    replace: bool = False,
    workers: int | None = None,
    window: int | None = None,
    fsync: bool = False,
    progress: Callback = DEFAULT_CALLBACK,
    before_move: Callable[[Path], None] | None = None,
    manifest: Manifest | None = None,
) -> RestoreResult:
    """Restore snapshot ``key`` from ``store`` to ``prefix`` (see the module docstring).

    ``force`` restores to another prefix even when binaries embed the old one;
    ``replace`` swaps out a non-empty directory bootseer did not make. ``manifest``: the
    key's committed manifest, just read from ``store`` by the caller (``ensure``), so that it
    is not read twice: an environment's names every file that embeds its prefix (each
    ``.pyc``: hundreds of KB for torch's), read from the store by every fresh node.
    """
    start = time.perf_counter()
    phases: dict[str, float] = {}
    mark = start

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now

    prefix = Path(os.path.abspath(prefix))
    if manifest is None:
        manifest = store.require_manifest(key)
    elif manifest.key != key:
        raise SnapshotError(f"restore of {key}: the manifest given is {manifest.key}'s")
    if manifest.kind != "prefix":
        raise SnapshotError(
            f"snapshot {key} is a capture of {manifest.capture.get('roots')}; "
            f"replay it with `bootseer env ensure --capture ...`"
        )
    check_replaceable(prefix, replace)
    refs = [PrefixRef.from_json(r) for r in manifest.prefix_refs]
    relocating = manifest.prefix != str(prefix)
    binaries = [r.path for r in refs if r.kind == "binary"]
    if relocating and binaries and not force:
        # Refuse before any download; relocate() repeats the check on the extracted tree.
        raise binary_refusal(sorted(set(binaries)), manifest.prefix, str(prefix))
    phase("manifest")
    members = fetch_toc(store, manifest)
    plan = plan_extraction(members, manifest.stream_size)
    if relocating:
        plan = _relocate_links(plan, manifest.prefix, str(prefix))
    progress.set_size(manifest.stream_size)
    staging = _staging_dir(prefix)
    phase("toc")
    try:
        extractor = Extractor(staging, plan, manifest.chunks)
        workers = workers or max(4, 2 * (os.cpu_count() or 2))
        window = window or max(2 * workers, store.fs.options.concurrency)
        pipeline = _ChunkPipeline(store, manifest, extractor, workers, window, progress)
        pipeline.start_fetching()  # the first chunks travel while the directories are made
        try:
            extractor.prepare()
            phase("directories")
            pipeline.run()
            phase("extract")
            extractor.finish()
            phase("links")
        finally:
            extractor.close()
        report = None
        if relocating:
            report = relocate(staging, manifest.prefix, str(prefix), refs, force=force)
            log.info("%s", report.summary())
            phase("relocate")
        write_marker(
            staging,
            key,
            prefix,
            members,
            built_at=manifest.prefix,
            store_url=store.url,
            published=True,
            publisher=manifest.publisher,
            changed=report,
        )
        # mkdtemp made the staging directory 0700; the prefix gets the mode mkdir gives.
        os.chmod(staging, 0o777 & ~_umask())
        phase("marker")
        if before_move is not None:
            before_move(staging)
        if fsync:
            _syncfs(staging)
            phase("fsync")
        move_into_place(staging, prefix, replace=replace)
        phase("move")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.debug("restore phases: %s", ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()))
    return RestoreResult(
        key,
        str(prefix),
        manifest.files,
        manifest.bytes,
        manifest.compressed_size,
        len(manifest.chunks),
        time.perf_counter() - start,
        report,
        plan.stripped,
        phases,
    )


def _relocate_links(plan: Plan, old: str, new: str) -> Plan:
    """Symlinks that point into the old prefix point into the new one."""
    links = [
        Member(m.path, m.kind, m.mode, m.mtime_ns, m.size, m.offset, rewrite_path(m.link, old, new))
        for m in plan.symlinks
    ]
    return Plan(plan.dirs, plan.files, links, plan.hardlinks, plan.stripped)


def _syncfs(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


__all__ = [
    "RelocationError",
    "RestoreResult",
    "VerifyResult",
    "mark_damaged",
    "restore",
    "verify",
    "remove_stale_staging",
    "move_into_place",
    "read_marker",
    "spread_order",
]
