"""The node-local checkpoint cache: a restart reads its shards from local disk, not the store.

``prefetch_latest`` (``bootseer warmup``, ``bootseer run``) copies the newest committed
checkpoint's files that a node's ranks will load into a local directory ahead of the job;
``CheckpointManager(cache_dir=...)`` (default: ``$BOOTSEER_CKPT_CACHE``) then reads each file
from there when it is present and intact, and from the store otherwise::

    <cache_dir>/<store-key>/SOURCE                          the store's URL (for people)
    <cache_dir>/<store-key>/step-<N>/MANIFEST.json          the store's commit record, copied
    <cache_dir>/<store-key>/step-<N>/rank-<r>.index.json    every rank's index (load reads all)
    <cache_dir>/<store-key>/step-<N>/rank-<r>.data|objects  the shards the node's ranks read

``store-key`` is a hash of the normalized URL, so jobs sharing a node never mix. Trust: the
store's ``MANIFEST.json`` is read from the store (once per node and torchrun launch:
:mod:`.sighting`); a cached step is used only while its copy is byte-identical (a store wiped
and rewritten under the same URL never matches), and every cached file is verified when it is
read, as the manifest and indexes say: an index by its CRC-32 in the manifest, a data file by
its size and every chunk's CRC-32, an objects file by its size and CRC-32. A file that fails is
removed with a warning and read from the store. Files appear under their final names only
complete and verified (written aside, renamed). A load that starts while a prefetch is still
copying (``bootseer run`` starts the command as soon as the environment is ready) waits for
each data file it needs while the prefetch's temporary file for it exists (its owner alive and
writing), and reads the store when the prefetch gave up on it; it never reads a partial file. A
save writes its rank's files into the cache too (``CheckpointManager(cache_writes=True)``, the
default with a cache), so an in-place restart finds the shards this node saved already there.
The cache is its owner's alone whatever the umask: directories 0700, files 0600 (a job that
runs as another user than the prefetch has a cache of its own).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from striped_fs import (
    ManifestError,
    StripeChecksumError,
    StripedFileSystem,
    create_private,
    fetch_pieces,
    make_dir,
    pid_exists,
    redact,
    to_striped_url,
    url_to_fs,
    write_private,
)

from .errors import CheckpointCorrupt, CheckpointError, CheckpointStoreUnavailable
from .layout import (
    MANIFEST,
    Manifest,
    RankIndex,
    committed_steps,
    data_name,
    index_disagreement,
    index_name,
    objects_name,
    parse_step,
    step_dir,
)

log = logging.getLogger("ckpt")

CACHE_ENV = "BOOTSEER_CKPT_CACHE"
FETCH_LOCK = ".fetch.lock"  # a step's lock for reading what the node lacks (StepCache.fetching)
_TEMP_RE = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]{32}$")
T = TypeVar("T")


def cache_dir_from_env() -> str | None:
    """``$BOOTSEER_CKPT_CACHE``, the hand-off ``bootseer run`` sets for its command (the only
    variable ckpt reads), or None: no cache. Where the cache lies is bootseer's setting
    (``ckpt.cache_dir``), never decided here."""
    return os.environ.get(CACHE_ENV, "").strip() or None


def store_key(url: str) -> str:
    """The cache directory name of a store: ``s3://b/run``, ``striped::s3://b/run/`` and the
    same local path spelled two ways all map to one key."""
    normalized = to_striped_url(url).rstrip("/")
    return hashlib.sha256(normalized.encode()).hexdigest()[:24]


@dataclass
class PrefetchResult:
    """What ``prefetch_latest`` did (``bootseer run`` turns it into a trace span)."""

    step: int | None  # the committed step cached; None: the store holds no committed checkpoint
    files: int  # files copied from the store now
    bytes: int  # their bytes
    seconds: float
    cached_already: int  # files found in the cache and verified (a repeated prefetch)
    path: str | None = None  # the cached step's directory


class _Job(Protocol):
    """A loader copy job (``ckpt.loader.Job``): bytes ``[start, end)`` of a data file."""

    start: int
    end: int
    buffer: memoryview
    finish: Callable[[], None] | None


class NodeCache:
    """The cache of one store on this node."""

    def __init__(self, cache_dir: str | os.PathLike, url: str) -> None:
        self.url = redact(url)  # SOURCE and messages: never the credentials
        self.root = Path(cache_dir) / store_key(url)

    def step(self, step: int) -> StepCache:
        """A fresh view of one cached step (its counters start at zero)."""
        return StepCache(self.root / f"step-{step}", step)

    def steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(s for n in names if (s := parse_step(n)) is not None)

    def remember_source(self) -> None:
        make_dir(self.root, tighten=True)
        source = self.root / "SOURCE"
        if not source.exists():
            _atomic_write(source, f"{self.url}\n".encode())

    def remember_source_quietly(self) -> None:
        """``remember_source`` for a save: the cache never fails a save."""
        try:
            self.remember_source()
        except OSError as exc:
            log.warning("checkpoint cache: cannot write %s (%s)", self.root, exc)

    def drop_steps_before(self, step: int) -> None:
        """Cached steps older than ``step`` (a save keeps the one before its own: the newest
        committed step while its own is not committed yet)."""
        for s in self.steps():
            if s < step:
                shutil.rmtree(self.root / f"step-{s}", ignore_errors=True)

    def drop_steps_except(self, keep: int) -> None:
        """Older cached steps are never read again once a newer one is cached."""
        for s in self.steps():
            if s != keep:
                shutil.rmtree(self.root / f"step-{s}", ignore_errors=True)
                log.info("checkpoint cache: removed step %d of %s", s, self.url)


class StepCache:
    """One cached step: verified reads for the loader, verified writes for the prefetch.

    The counters say what the reads took from the cache (thread-safe: the loader reads
    files in parallel)."""

    #: How long a load waits for a file whose prefetch makes no progress (its temporary
    #: file not written to) before it reads the store instead.
    STALL_S = 120.0

    def __init__(self, directory: Path, step: int) -> None:
        self.dir = directory
        self.step = step
        self.files = 0  # files read from the cache
        self.bytes = 0  # their bytes used
        self.waited_s = 0.0  # time the reads waited for a prefetch still copying their file
        self.rejected: list[str] = []  # cached files found damaged (removed)
        self._lock = threading.Lock()

    def await_file(self, name: str, poll: float = 0.02) -> bool:
        """Wait while a live prefetch is copying ``name`` (its temporary file exists and is
        being written); True when the complete file is in place, False when no prefetch
        holds it (never started, failed, killed) or it stalled for ``STALL_S``."""
        final = self.dir / name
        started = time.monotonic()
        progress, last_mtime = started, 0.0
        try:
            while not final.exists():
                pending = [p for p in _temps_of(self.dir, name) if pid_exists(_temp_pid(p))]
                if not pending:
                    return final.exists()  # renamed in place between the two looks
                mtime = max((_mtime(p) for p in pending), default=0.0)
                now = time.monotonic()
                if mtime != last_mtime:
                    progress, last_mtime = now, mtime
                elif now - progress > self.STALL_S:
                    log.warning(
                        "checkpoint cache: the prefetch of %s made no progress for "
                        "%.0f s; reading it from the store",
                        final,
                        self.STALL_S,
                    )
                    return False
                time.sleep(poll)
            return True
        finally:
            waited = time.monotonic() - started
            if waited > 0.001:
                with self._lock:
                    self.waited_s += waited

    # -- reading (the loader) -------------------------------------------------------------
    def matches(self, manifest_raw: bytes) -> bool:
        """Is this cached step the store's step? A different commit record means the store
        was rewritten under the same URL: the cached step is stale and removed."""
        try:
            cached = (self.dir / MANIFEST).read_bytes()
        except FileNotFoundError:
            return self._adopt(manifest_raw)
        except OSError as exc:
            log.warning(
                "checkpoint cache: cannot read %s (%s); reading from the store",
                self.dir / MANIFEST,
                exc,
            )
            return False
        if cached == manifest_raw:
            return True
        log.warning(
            "checkpoint cache: %s holds another step %d than the store's (the store "
            "was rewritten); removing it",
            self.dir,
            self.step,
        )
        shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def _adopt(self, manifest_raw: bytes) -> bool:
        """A step this node's save wrote through (``put_saved``) that no prefetch has seen:
        the store's commit record, just read, becomes the cached one. Safe because nothing
        here is trusted on its own: every cached file is verified against this record when
        it is read (an index by its CRC-32 in it, data and objects by their index), so a
        file of another attempt of the step is removed and read from the store. This is
        what lets survivors of a restart that torchrun runs (no prefetch between) load their
        own shards from the node (issue 29: survivors read nothing twice)."""
        if not self.dir.is_dir() or not any(self.dir.glob("rank-*.index.json")):
            return False
        try:
            _atomic_write(self.dir / MANIFEST, manifest_raw)
        except OSError as exc:
            log.warning(
                "checkpoint cache: cannot record the commit of step %d in %s (%s); "
                "reading from the store",
                self.step,
                self.dir,
                exc,
            )
            return False
        return True

    def index(self, rank: int, crc32: int) -> bytes | None:
        """Rank ``rank``'s index when cached and matching the manifest's checksum."""
        path = self.dir / index_name(rank)
        blob = _read_or_none(path)
        if blob is None:
            return None
        if zlib.crc32(blob) != crc32:
            self._reject(path, "does not match the manifest's checksum")
            return None
        self._count(len(blob))
        return blob

    def objects(self, rank: int, index: RankIndex) -> bytes | None:
        """Rank ``rank``'s objects when cached and matching its index (size and CRC-32)."""
        path = self.dir / objects_name(rank)
        blob = _read_or_none(path)
        if blob is None:
            return None
        if len(blob) != index.objects_size or zlib.crc32(blob) != index.objects_crc32:
            self._reject(path, "does not match its index (size or checksum)")
            return None
        self._count(len(blob))
        return blob

    def read_data(self, index: RankIndex, jobs: Iterable[_Job]) -> int | None:
        """Fill the jobs from the cached data file of ``index.rank``, verified first (size and
        every chunk's CRC-32, before any byte is copied); returns the bytes copied, or None:
        not cached, or damaged (removed): the caller reads the store."""
        path = self.dir / data_name(index.rank)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after the mapping
        except FileNotFoundError:
            if not self.await_file(data_name(index.rank)):
                return None  # no prefetch has it: the store
            try:
                f = open(path, "rb")  # noqa: SIM115
            except FileNotFoundError:  # removed meanwhile (a newer step cached)
                return None
        except OSError as exc:
            log.warning("checkpoint cache: cannot open %s (%s); reading from the store", path, exc)
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != index.data_size:
                self._reject(path, f"holds {size} bytes, its index says {index.data_size}")
                return None
            if size == 0:
                return 0
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        bad = _bad_chunk(view, index)
                        if bad is not None:
                            self._reject(path, f"tensor {bad} fails its checksum")
                            return None
                        copied = 0
                        for job in jobs:
                            job.buffer[:] = view[job.start : job.end]
                            if job.finish is not None:
                                job.finish()
                            copied += job.end - job.start
                    finally:
                        view.release()
            except (OSError, ValueError) as exc:
                log.warning(
                    "checkpoint cache: cannot read %s (%s); reading from the store", path, exc
                )
                return None
        self._count(copied)
        return copied

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.files += 1
            self.bytes += nbytes

    def _reject(self, path: Path, why: str) -> None:
        log.warning("checkpoint cache: %s %s; removed, reading it from the store", path, why)
        with self._lock:
            self.rejected.append(str(path))
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    # -- checking and writing (the prefetch) ------------------------------------------------
    def prepare(self, manifest_raw: bytes) -> bool:
        """Make the directory hold this step's commit record; True when it already did.
        Leftovers of killed prefetches go; a stale step (another commit) is emptied."""
        make_dir(self.dir, tighten=True)
        self._remove_dead_temps()
        cached = _read_or_none(self.dir / MANIFEST)
        if cached == manifest_raw:
            return True
        if cached is not None:
            log.warning(
                "checkpoint cache: %s holds another step %d than the store's; replacing it",
                self.dir,
                self.step,
            )
            shutil.rmtree(self.dir, ignore_errors=True)
            make_dir(self.dir)
        _atomic_write(self.dir / MANIFEST, manifest_raw)
        return False

    def data_ok(self, index: RankIndex) -> bool:
        """Is rank ``index.rank``'s data file cached and intact? A damaged one is removed."""
        path = self.dir / data_name(index.rank)
        try:
            problem = _check_data_file(path, index)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            problem = f"cannot be read ({exc})"
        if problem is not None:
            self._reject(path, problem)
            return False
        return True

    def put(self, name: str, data: bytes | memoryview) -> None:
        _atomic_write(self.dir / name, data)

    # -- sharing a load's store reads among the node's ranks ------------------------------------
    @contextlib.contextmanager
    def fetching(self, poll: float = 0.01) -> Iterator[None]:
        """Hold this step's fetch lock while reading from the store what the node lacks and
        putting it here (:meth:`keep`): the node's ranks, restarted together, take turns, and
        each after the first finds the files in the cache, so the node reads each from the
        store once (issue 29). The kernel's lock (``flock``): a holder that dies lets go. A
        wait past ``STALL_S``, or a lock that cannot be had (an unwritable cache), costs only
        the sharing: the rank reads the store itself."""
        fd: int | None = None
        try:
            fd = lock_within(self.dir / FETCH_LOCK, self.STALL_S, poll)
            if fd is None:
                log.warning(
                    "checkpoint cache: another reader held %s for %.0f s; reading "
                    "from the store without it",
                    self.dir / FETCH_LOCK,
                    self.STALL_S,
                )
        except OSError as exc:
            log.warning(
                "checkpoint cache: cannot lock %s (%s); this rank reads from the store what "
                "the node lacks, without sharing it",
                self.dir / FETCH_LOCK,
                exc,
            )
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def keep(self, name: str, data: bytes | memoryview) -> None:
        """Put a file read from the store (checked against the commit record) here for the
        node's other ranks; a local failure (a full disk) is a warning: they read the store."""
        try:
            _atomic_write(self.dir / name, data)
        except OSError as exc:
            log.warning(
                "checkpoint cache: cannot keep %s for this node's other ranks (%s); they "
                "read it from the store",
                self.dir / name,
                exc,
            )

    # -- writing through (a save) -------------------------------------------------------------
    def put_saved(self, rank: int, data: memoryview, objects: bytes, index: bytes) -> bool:
        """A save's own files of ``rank``, written aside and renamed (the index last): an
        in-place restart's prefetch finds them and only verifies them. The step has no
        commit record here until a prefetch copies the store's, or a load adopts the one
        it read from the store (a load never reads a step the store did not commit). A local failure (a full disk) is a warning: False."""
        try:
            make_dir(self.dir, tighten=True)
            if len(data):
                self.put(data_name(rank), data)
            if objects:
                self.put(objects_name(rank), objects)
            self.put(index_name(rank), index)
        except OSError as exc:
            log.warning(
                "checkpoint cache: cannot write step %d of rank %d into %s (%s); an "
                "in-place restart will fetch it from the store",
                self.step,
                rank,
                self.dir,
                exc,
            )
            for name in (data_name(rank), objects_name(rank), index_name(rank)):
                (self.dir / name).unlink(missing_ok=True)
            return False
        return True

    def temp_path(self, name: str) -> Path:
        return self.dir / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"

    def _remove_dead_temps(self) -> None:
        for name in os.listdir(self.dir):
            m = _TEMP_RE.match(name)
            if m and not pid_exists(int(m.group(1))):
                try:
                    os.unlink(self.dir / name)
                except FileNotFoundError:
                    pass


def lock_within(path: Path, wait_s: float, poll: float = 0.01) -> int | None:
    """The kernel's lock (``flock``, exclusive) on ``path``, created 0600 and never through a
    link, as an open descriptor (closing it lets go, as a holder's death does); None when
    another holder kept it past ``wait_s``. OSError when the file cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(poll)
        except OSError:
            os.close(fd)
            raise


def _temps_of(directory: Path, name: str) -> list[Path]:
    """The temporary files being written for ``name`` (by prefetches or saves)."""
    prefix = f".{name}.tmp-"
    try:
        return [
            directory / n
            for n in os.listdir(directory)
            if n.startswith(prefix) and _TEMP_RE.match(n)
        ]
    except FileNotFoundError:
        return []


def _temp_pid(path: Path) -> int:
    m = _TEMP_RE.match(path.name)
    return int(m.group(1)) if m else -1


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("checkpoint cache: cannot read %s (%s); reading from the store", path, exc)
        return None


def _atomic_write(path: Path, data: bytes | memoryview) -> None:
    write_private(path, data)


def _bad_chunk(view: memoryview, index: RankIndex) -> str | None:
    """The key of the first chunk whose bytes fail their CRC-32, or None."""
    for c in index.chunks:
        if zlib.crc32(view[c.byte_offset : c.byte_offset + c.nbytes]) != c.crc32:
            return c.key
    return None


def _check_data_file(path: Path, index: RankIndex) -> str | None:
    """What is wrong with a local data file (size, a chunk's checksum), or None."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != index.data_size:
            return f"holds {size} bytes, its index says {index.data_size}"
        if size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                bad = _bad_chunk(view, index)
            finally:
                view.release()
    return None if bad is None else f"tensor {bad} fails its checksum"


# -- which files a node's ranks read ------------------------------------------------------------


def files_for_ranks(
    indexes: Sequence[RankIndex], ranks: Iterable[int]
) -> tuple[set[int], set[int]]:
    """(ranks whose data file, ranks whose objects file) the given ranks' load reads, for a
    load at the saved world size.

    A rank reads its own chunks, plus every tensor it holds but did not write (a replicated
    tensor past ``staging.SMALL_REPLICA_BYTES`` is written once, by one rank; a DTensor replica by the first rank of its
    replica group) from the ranks that wrote it: all of that tensor's writers, since the
    index does not say which slice a non-writing rank holds (on a node holding a whole
    tensor-parallel group these are exactly the files it reads). A rank beyond the saved
    world size (a load at another size) takes rank 0's objects; its tensors come from the
    store.
    """
    world = len(indexes)
    writers: dict[str, set[int]] = defaultdict(set)
    for idx in indexes:
        for c in idx.chunks:
            if c.nbytes:
                writers[c.key].add(idx.rank)
    data: set[int] = set()
    objects: set[int] = set()
    for r in ranks:
        if r >= world:
            objects.add(0)
            continue
        idx = indexes[r]
        objects.add(r)
        own = {c.key for c in idx.chunks}
        if any(c.nbytes for c in idx.chunks):
            data.add(r)
        for key in idx.tensor_keys:
            if key not in own:
                data |= writers.get(key, set())
    return (
        {r for r in data if indexes[r].data_size},
        {r for r in objects if indexes[r].objects_size},
    )


# -- prefetch -----------------------------------------------------------------------------------


class _CacheWriteError(Exception):
    """A local write into the cache failed (a full disk): never a store error."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


_STORE_CLIENTS = {
    "botocore",
    "aiobotocore",
    "aiohttp",
    "s3fs",
    "urllib3",
    "requests",
    "pyarrow",
    "fsspec",
    "gcsfs",
    "adlfs",
}


def held_step(cache_dir: str | os.PathLike[str], url: str, ranks: Sequence[int]) -> int | None:
    """The newest step this node's cache holds as committed (the store's commit record,
    copied there by a prefetch or a load) with an index for every rank of ``ranks``; None
    when it holds none. A directory listing and a few stats, no store: the startup uses it
    to start a warm node's command before the store is reached (a job that finds this step
    does not start fresh, even with the store down). Nothing is verified here: the load
    checks every cached file against the store's record, as always."""
    cache = NodeCache(cache_dir, url)
    for step in reversed(cache.steps()):
        directory = cache.root / f"step-{step}"
        if (directory / MANIFEST).is_file() and all(
            (directory / index_name(r)).is_file() for r in ranks
        ):
            return step
    return None


def _is_store_error(exc: BaseException) -> bool:
    """Errors of reaching the store (connections, timeouts, credentials, permissions)."""
    if isinstance(exc, OSError | TimeoutError):
        return True
    return type(exc).__module__.split(".")[0] in _STORE_CLIENTS


def _store(url: str, what: str, fn: Callable[..., T], *args: Any) -> T:
    """Run a store operation; an unreachable store becomes ``CheckpointStoreUnavailable``.
    A missing file or damaged bytes stay what they are: the caller falls back a step."""
    try:
        return fn(*args)
    except (
        FileNotFoundError,
        StripeChecksumError,
        ManifestError,
        CheckpointError,
        _CacheWriteError,
    ):
        raise
    except Exception as exc:
        if _is_store_error(exc):
            raise CheckpointStoreUnavailable(
                f"checkpoint store {url} unavailable ({what}): {type(exc).__name__}: {exc}", url=url
            ) from exc
        raise


@dataclass
class _Tally:
    files: int = 0
    bytes: int = 0
    already: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def fetched(self, nbytes: int) -> None:
        with self._lock:
            self.files += 1
            self.bytes += nbytes

    def cached(self) -> None:
        with self._lock:
            self.already += 1


def prefetch_latest(
    url: str,
    cache_dir: str | os.PathLike,
    ranks: Sequence[int],
    *,
    storage_options: dict | None = None,
    connections: int = 16,
    on_planned: Callable[[int | None], None] | None = None,
) -> PrefetchResult:
    """Copy the newest committed checkpoint's files that ``ranks`` load into ``cache_dir``.

    Idempotent: files already cached and verified are kept. A step that turns out damaged
    or deleted while being copied is skipped for the previous committed one (as ``load``
    does); uncommitted (torn) steps are never considered. Raises
    ``CheckpointStoreUnavailable`` when the store cannot be listed or read; returns
    ``step=None`` when it holds no committed checkpoint.

    ``on_planned(step)`` is called once, as soon as a load may start beside the copy: the
    store was listed, the step's manifest, indexes and objects are cached, and every data
    file still to come has its temporary file, which a load waits on
    (:meth:`StepCache.await_file`). ``bootseer run`` starts the command there.
    """
    started = time.perf_counter()
    planned = _Once(on_planned)
    wanted = sorted({int(r) for r in ranks})
    if not wanted or wanted[0] < 0:
        raise ValueError(f"prefetch needs ranks >= 0, got {list(ranks)!r}")
    fs, root = url_to_fs(url, storage_options, concurrency=connections)
    done, _ = _store(url, "listing the checkpoints", committed_steps, fs, root)
    if not done:
        planned(None)
        return PrefetchResult(None, 0, 0, time.perf_counter() - started, 0)
    node = NodeCache(cache_dir, url)
    try:
        node.remember_source()
    except OSError as exc:
        raise _cache_error(node.root, exc) from exc
    failures: list[str] = []
    for step in reversed(done):
        cache = node.step(step)
        try:
            tally = _prefetch_step(fs, root, url, cache, wanted, connections, planned)
        except (CheckpointCorrupt, StripeChecksumError, ManifestError, FileNotFoundError) as exc:
            log.warning(
                "checkpoint step %d under %s cannot be prefetched (%s); trying the "
                "previous committed checkpoint",
                step,
                node.url,
                exc,
            )
            failures.append(f"step {step}: {exc}")
            continue
        except _CacheWriteError as exc:
            raise _cache_error(cache.dir, exc.error) from exc.error
        node.drop_steps_except(step)
        seconds = time.perf_counter() - started
        log.info(
            "checkpoint step %d of %s cached for ranks %s: %d file(s), %.1f MiB in %.2f s "
            "(%d already cached)",
            step,
            node.url,
            wanted,
            tally.files,
            tally.bytes / 2**20,
            seconds,
            tally.already,
        )
        return PrefetchResult(
            step, tally.files, tally.bytes, seconds, tally.already, str(cache.dir)
        )
    raise CheckpointCorrupt(
        f"no committed checkpoint under {url} could be prefetched:\n  " + "\n  ".join(failures),
        step=done[-1],
    )


class _Once:
    """A callback called at most once (the first step planned; a fallback step is not)."""

    def __init__(self, fn: Callable[[int | None], None] | None) -> None:
        self.fn = fn

    def __call__(self, step: int | None) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn(step)


def _cache_error(where: Path, exc: OSError) -> OSError:
    return OSError(
        exc.errno or errno.EIO,
        f"cannot write the checkpoint cache at {where}: {exc.strerror or exc}",
    )


def _prefetch_step(
    fs: StripedFileSystem,
    root: str,
    url: str,
    cache: StepCache,
    ranks: list[int],
    connections: int,
    planned: Callable[[int | None], None],
) -> _Tally:
    directory = step_dir(root, cache.step)
    path = f"{directory}/{MANIFEST}"
    raw = _store(url, f"reading {path}", fs.cat_file, path)
    manifest = _parse(Manifest.from_json, raw, cache.step, path)
    if manifest.step_problem(cache.step):
        raise CheckpointCorrupt(
            f"step {cache.step}: {path} {manifest.step_problem(cache.step)}",
            step=cache.step,
            path=path,
        )
    tally = _Tally()
    try:
        if cache.prepare(raw):
            tally.cached()
        else:
            tally.fetched(len(raw))
    except OSError as exc:
        raise _CacheWriteError(exc) from exc

    def index(rank: int) -> RankIndex:
        where = f"{directory}/{index_name(rank)}"
        crc = manifest.ranks[rank]["index_crc32"]
        blob = cache.index(rank, crc)
        if blob is not None:
            tally.cached()
        else:
            blob = _store(url, f"reading {where}", fs.cat_file, where)
            if zlib.crc32(blob) != crc:
                raise CheckpointCorrupt(
                    f"step {cache.step}: {where} does not match the manifest's checksum",
                    step=cache.step,
                    path=where,
                )
            _local(cache.put, index_name(rank), blob)
            tally.fetched(len(blob))
        parsed = _parse(RankIndex.from_json, blob, cache.step, where)
        problem = index_disagreement(parsed, rank, manifest)
        if problem:
            raise CheckpointCorrupt(
                f"step {cache.step}: {where}: {problem}", step=cache.step, path=where
            )
        return parsed

    def objects(rank: int, idx: RankIndex) -> None:
        if cache.objects(rank, idx) is not None:
            tally.cached()
            return
        where = f"{directory}/{objects_name(rank)}"
        blob = _store(url, f"reading {where}", fs.cat_file, where)
        if len(blob) != idx.objects_size or zlib.crc32(blob) != idx.objects_crc32:
            raise CheckpointCorrupt(
                f"step {cache.step}: {where} does not match its index", step=cache.step, path=where
            )
        _local(cache.put, objects_name(rank), blob)
        tally.fetched(len(blob))

    def reserve(idx: RankIndex) -> Path | None:
        """The temporary file a load waits on while the data file is copied; None: the
        final file is there already (verified in ``data``)."""
        if (cache.dir / data_name(idx.rank)).exists():
            return None
        tmp = cache.temp_path(data_name(idx.rank))
        os.close(_local(create_private, tmp))
        return tmp

    def data(idx: RankIndex, tmp: Path | None) -> None:
        try:
            if tmp is None:
                if cache.data_ok(idx):
                    tally.cached()
                    return
                tmp = cache.temp_path(data_name(idx.rank))
                os.close(_local(create_private, tmp))
            where = f"{directory}/{data_name(idx.rank)}"
            source = _store(url, f"opening {where}", fs._resolve, fs._norm(where), fs.options)
            if source.size != idx.data_size:
                raise CheckpointCorrupt(
                    f"step {cache.step}: {where} holds {source.size} bytes, "
                    f"its index says {idx.data_size}",
                    step=cache.step,
                    path=where,
                )
            _download(url, where, source, tmp, connections)
            problem = _local(_check_data_file, tmp, idx)
            if problem is not None:
                raise CheckpointCorrupt(
                    f"step {cache.step}: {where} {problem}", step=cache.step, path=where
                )
            _local(os.replace, tmp, cache.dir / data_name(idx.rank))
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)  # a waiting load reads the store
        tally.fetched(idx.data_size)

    world = manifest.world_size
    with ThreadPoolExecutor(min(16, max(1, world)), thread_name_prefix="ckpt-prefetch") as pool:
        indexes = list(pool.map(index, range(world)))
        data_ranks, object_ranks = files_for_ranks(indexes, ranks)
        for future in [pool.submit(objects, r, indexes[r]) for r in sorted(object_ranks)]:
            future.result()  # small, and a load reads them first: before the load may start
        temps: dict[int, Path | None] = {}
        try:
            for r in sorted(data_ranks):
                temps[r] = reserve(indexes[r])
            planned(cache.step)
            work = [pool.submit(data, indexes[r], temps.pop(r)) for r in sorted(data_ranks)]
        finally:
            for tmp in temps.values():  # not handed to a copy (an error above)
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
        for future in work:
            future.result()
    return tally


def _local(fn: Callable[..., T], *args: Any) -> T:
    """A cache-side (local disk) operation: its OSError is the cache's, not the store's."""
    try:
        return fn(*args)
    except OSError as exc:
        raise _CacheWriteError(exc) from exc


def _download(url: str, where: str, source: Any, tmp: Path, connections: int) -> None:
    """The store file into ``tmp``, stripes in parallel (each verified by striped_fs)."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # made by ``reserve``
        os.ftruncate(fd, source.size)
    except OSError as exc:
        raise _CacheWriteError(exc) from exc

    def sink(offset: int, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as exc:
            raise _CacheWriteError(exc) from exc

    try:
        _store(url, f"reading {where}", fetch_pieces, source, 0, source.size, connections, sink)
    finally:
        os.close(fd)


def _parse(fn: Callable[..., T], raw: bytes, step: int, path: str) -> T:
    try:
        return fn(raw, path=path)
    except ValueError as exc:
        raise CheckpointCorrupt(f"step {step}: {exc}", step=step, path=path) from None


def open_cache(cache_dir: str | os.PathLike | bool | None, url: str) -> NodeCache | None:
    """The manager's cache: ``None`` means ``$BOOTSEER_CKPT_CACHE``; ``False`` or ``""`` none."""
    if cache_dir is None:
        cache_dir = cache_dir_from_env()
    if cache_dir is True:
        raise ValueError(f"cache_dir=True: pass a directory (None: ${CACHE_ENV}; False: none)")
    if cache_dir is False or not cache_dir:
        return None
    return NodeCache(cache_dir, url)
