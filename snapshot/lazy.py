"""Serve an environment snapshot lazily: a read-only FUSE mount at the prefix, chunks fetched
when the job reads them, the read profile of an earlier start prefetched first.

    from snapshot import SnapshotStore, mount_lazy
    with mount_lazy("s3://bucket/envs", key, "/opt/venv", cache_dir="/var/lib/bootseer/envs"):
        subprocess.run(["/opt/venv/bin/python", "train.py"])

:func:`mount_lazy` starts a child process (``python -m snapshot.lazy``, its settings on
stdin, never on the command line where ``ps`` shows credentials) and returns once the prefix
is mounted: the manifest and the TOC were read and every member checked
(:class:`snapshot.lazyview.LazyView`), nothing else fetched. The child then queues the read
profile's chunks (:mod:`snapshot.lazyprofile`), then every other chunk (the node ends with a
complete copy in its cache, ``env.cache``); a read jumps that queue (:mod:`snapshot.lazyfetch`).
It records the chunks this start reads and stores them as the key's profile when none was
there (or when asked), at ``profile_s`` or at the unmount, whichever comes first.

The mount is read-only, ``nodev,nosuid``, ``default_permissions`` (the kernel checks the
snapshot's modes), owned by the mounting user, and the kernel keeps pages, attributes and
negative lookups (the snapshot never changes under the mount): a page read once is served at
kernel speed. A read whose chunk cannot be had (corrupt twice, the store lost beyond
``read_timeout_s``) fails with EIO, never with wrong bytes. A killed child leaves a dead mount
(ENOTCONN): :func:`unmount_lazy` and the next :func:`mount_lazy` clear it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from striped_fs import MountError, is_mounted, load_fusepy, unmount, wait_mounted

from .errors import SnapshotError
from .lazycache import ChunkCache
from .lazyfetch import DEFAULT_READ_TIMEOUT_S, ChunkFetcher, ChunkUnavailable
from .lazyprofile import Recorder, load_profile, save_profile
from .lazyview import LazyView, Node, check_prefix
from .manifest import DIR, FILE, SYMLINK, iter_chunk_spans
from .restore import fetch_toc
from .store import SnapshotStore

log = logging.getLogger(__name__)

# fusepy, or striped_fs's stand-in when libfuse is missing (mount_lazy says so)
_FUSE = load_fusepy()
Operations: type = _FUSE.Operations
FuseOSError: type[OSError] = _FUSE.FuseOSError


DEFAULT_PROFILE_S = 60.0
MOUNT_TIMEOUT_S = 60.0


# -- the file system ------------------------------------------------------------------------------


class LazyEnvOperations(Operations):  # type: ignore[misc]
    """fusepy operations over a :class:`LazyView` (read-only: fusepy's defaults answer every
    write with EROFS)."""

    use_ns = True

    def __init__(self, view: LazyView, fetcher: ChunkFetcher) -> None:
        self.view = view
        self.fetcher = fetcher
        self.uid, self.gid = os.getuid(), os.getgid()
        self._offsets = [c.offset for c in view.manifest.chunks]

    def _node(self, path: str) -> Node:
        node = self.view.lookup(path)
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        node = self._node(path)
        st: dict[str, Any] = {
            "st_mode": node.st_mode,
            "st_ino": node.ino,
            "st_nlink": node.nlink,
            "st_uid": self.uid,
            "st_gid": self.gid,
            "st_atime": node.mtime_ns,
            "st_mtime": node.mtime_ns,
            "st_ctime": node.mtime_ns,
        }
        if node.kind == DIR:
            st["st_nlink"] = 2 + sum(1 for c in node.children.values() if c.kind == DIR)
            st["st_size"] = 4096
        elif node.kind == SYMLINK:
            st["st_size"] = len(os.fsencode(node.link))
        else:
            st["st_size"] = node.size
        st["st_blocks"] = (st["st_size"] + 511) // 512
        return st

    def readdir(self, path: str, fh: Any) -> list[tuple[str, dict[str, int] | None, int]]:
        node = self._node(path)
        if node.kind != DIR:
            raise FuseOSError(errno.ENOTDIR)
        return [
            (".", None, 0),
            ("..", None, 0),
            *(
                (name, {"st_mode": child.st_mode, "st_ino": child.ino}, 0)
                for name, child in sorted(node.children.items())
            ),
        ]

    def readlink(self, path: str) -> str:
        node = self._node(path)
        if node.kind != SYMLINK:
            raise FuseOSError(errno.EINVAL)
        return node.link

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise FuseOSError(errno.EROFS)
        if self._node(path).kind == DIR:
            raise FuseOSError(errno.EISDIR)
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        node = self._node(path)
        if node.kind != FILE:
            raise FuseOSError(errno.EINVAL)
        size = max(0, min(size, node.size - offset))
        if size == 0:
            return b""
        start = node.offset + offset
        parts = []
        try:
            for i, lo, hi in iter_chunk_spans(
                self.view.manifest.chunks, start, start + size, self._offsets
            ):
                parts.append(bytes(memoryview(self.fetcher.chunk(i))[lo:hi]))
        except ChunkUnavailable as exc:
            log.error("read of %s [%d, +%d): %s", path, offset, size, exc.strerror)
            raise FuseOSError(errno.EIO) from None
        except Exception as exc:  # noqa: BLE001 - a reader gets EIO, the log says why
            log.error("read of %s [%d, +%d) failed: %r", path, offset, size, exc)
            raise FuseOSError(errno.EIO) from None
        data = b"".join(parts)
        self.fetcher.stats.bytes_served += len(data)
        if len(data) != size:
            log.error(
                "read of %s [%d, +%d): the chunks hold %d bytes", path, offset, size, len(data)
            )
            raise FuseOSError(errno.EIO)
        return data

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        self._node(path)
        raise FuseOSError(errno.ENODATA)

    def listxattr(self, path: str) -> list[str]:
        self._node(path)
        return []

    def access(self, path: str, amode: int) -> int:
        self._node(path)
        if amode & os.W_OK:
            raise FuseOSError(errno.EROFS)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        blocks = (self.view.bytes + 4095) // 4096
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": blocks,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": len(self.view.nodes),
            "f_ffree": 0,
            "f_namemax": 255,
        }


# -- the mount process ----------------------------------------------------------------------------


@dataclass
class LazySettings:
    """What the mount process is told (on its stdin, as JSON)."""

    store: str
    key: str
    prefix: str
    cache_dir: str
    storage_options: dict[str, Any] | None = None
    stats_path: str = ""
    prefetch: bool = True  # the profile, then the rest
    record: str = "auto"  # "auto": store a profile when none was there; "always"; "never"
    profile_s: float = DEFAULT_PROFILE_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    connections: int = 8
    allow_other: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _write_stats(path: str, data: dict[str, Any]) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not write the mount's statistics to %s: %s", path, exc)


def serve(settings: LazySettings) -> int:
    """Mount ``settings.key`` at ``settings.prefix`` and serve it until unmounted (the child
    process; SIGTERM, SIGINT and SIGHUP unmount cleanly)."""
    from striped_fs import run_fuse

    started = time.monotonic()
    store = SnapshotStore(settings.store, settings.storage_options)
    manifest = store.require_manifest(settings.key)
    check_prefix(manifest, settings.prefix)
    view = LazyView(manifest, fetch_toc(store, manifest))
    cache = ChunkCache(settings.cache_dir)
    profile = (
        load_profile(store, manifest) if settings.prefetch or settings.record == "auto" else None
    )
    recorder = (
        Recorder(manifest)
        if settings.record == "always" or (settings.record == "auto" and profile is None)
        else None
    )
    fetcher = ChunkFetcher(
        store,
        manifest,
        cache,
        connections=settings.connections,
        read_timeout_s=settings.read_timeout_s,
        on_access=recorder,
    )
    done = threading.Event()
    info: dict[str, Any] = {
        "key": manifest.key,
        "prefix": settings.prefix,
        "pid": os.getpid(),
        "chunks": len(manifest.chunks),
        "stream_bytes": manifest.stream_size,
        "stored_bytes": sum(c.size for c in manifest.chunks),
        "files": view.files,
        "profile": profile.summary(manifest) if profile is not None else None,
        "recording": recorder is not None,
        "view_s": round(time.monotonic() - started, 3),
    }

    def finish_profile() -> None:
        if recorder is None or recorder.stopped:
            return
        recorded = recorder.stop()
        try:
            save_profile(store, recorded)
            info["profile_saved"] = recorded.summary(manifest)
            log.info("stored the read profile of %s: %d chunks", manifest.key, len(recorded.chunks))
        except (OSError, SnapshotError) as exc:
            log.warning("could not store the read profile of %s: %s", manifest.key, exc)

    def report() -> None:
        last = None
        deadline = started + settings.profile_s
        while not done.wait(0.2):
            if time.monotonic() >= deadline:
                finish_profile()
            now = {**info, **fetcher.stats.as_dict()}
            if now != last:
                _write_stats(settings.stats_path, now)
                last = now

    def start_prefetch() -> None:
        if not settings.prefetch:
            return
        if profile is not None:
            info["profile_queued"] = fetcher.prefetch(i for i, _ in profile.chunks)
        fetcher.fetch_rest()

    threading.Thread(target=report, name="env-lazy-report", daemon=True).start()
    options: dict[str, Any] = {
        "foreground": True,
        "nothreads": False,
        "ro": True,
        "fsname": f"bootseer-env:{manifest.key[:16]}",
        "subtype": "bootseer",
        "use_ino": True,
        "max_read": 1 << 20,
        "default_permissions": True,
        "kernel_cache": True,
        "entry_timeout": 3600.0,
        "attr_timeout": 3600.0,
        "negative_timeout": 3600.0,
        "nodev": True,
        "nosuid": True,
    }
    if settings.allow_other:
        options["allow_other"] = True
    # The first chunks are queued at once: they travel while libfuse mounts.
    threading.Thread(target=start_prefetch, name="env-lazy-prefetch", daemon=True).start()
    try:
        run_fuse(LazyEnvOperations(view, fetcher), settings.prefix, options)
    finally:
        done.set()
        fetcher.close()
        finish_profile()
        info["complete"] = fetcher.complete()
        info["unmounted"] = True
        _write_stats(settings.stats_path, {**info, **fetcher.stats.as_dict()})
    return 0


def serve_lazy(store: str, key: str, prefix: str, **settings: Any) -> int:
    """Serve snapshot ``key`` at ``prefix`` in this process until unmounted (``bootseer env
    mount --foreground``); ``settings`` are :class:`LazySettings` fields."""
    prefix = os.path.abspath(prefix)
    prepare_prefix(prefix)
    return serve(LazySettings(store=store, key=key, prefix=prefix, **settings))


def main() -> int:
    """``python -m snapshot.lazy`` with :class:`LazySettings` as JSON on stdin."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        settings = LazySettings(**json.loads(sys.stdin.read()))
        return serve(settings)
    except (SnapshotError, MountError) as exc:
        print(f"bootseer env mount: {exc}", file=sys.stderr)
        return 2


# -- the parent's side ----------------------------------------------------------------------------


@dataclass
class LazyMount:
    """A lazy environment mounted by a child process: :meth:`close` unmounts it."""

    prefix: str
    key: str
    proc: subprocess.Popen[bytes]
    stats_path: str
    _tmpdir: str = ""
    started: float = field(default_factory=time.monotonic)
    _final: dict[str, Any] | None = None

    def stats(self) -> dict[str, Any]:
        """The child's latest statistics (bytes fetched, chunks read, profile...)."""
        if self._final is not None:
            return dict(self._final)
        try:
            with open(self.stats_path, encoding="utf-8") as f:
                data: dict[str, Any] = json.load(f)
                return data
        except (OSError, ValueError):
            return {}

    def wait_complete(self, timeout_s: float) -> bool:
        """Wait until every chunk is in the node-local cache (the background fetch ended)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats.get("local_chunks", 0) >= stats.get("chunks", 1) > 0:
                return True
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def close(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Unmount (lazily when files are still open), reap the child; its final stats. When
        the unmount cannot be done from here (a container without fusermount or umount), the
        child is stopped instead: its libfuse unmounts on SIGTERM."""
        failed: SnapshotError | None = None
        try:
            if self.proc.poll() is None:
                try:
                    unmount_lazy(self.prefix, lazy=True)
                except SnapshotError as exc:
                    failed = exc
                    self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
        finally:
            # the log's pump thread reads stderr to its end and closes it: closing it here
            # while that read blocks would wait on its lock for as long as the child lives
            if is_mounted(self.prefix) and _dead(self.prefix):  # ours, its process gone
                unmount_lazy(self.prefix, lazy=True)
        if failed is not None and is_mounted(self.prefix):
            raise failed
        if self._final is None:
            self._final = self.stats()
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
        return dict(self._final)

    def __enter__(self) -> LazyMount:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dead(prefix: str) -> bool:
    try:
        os.stat(prefix)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO)
    return False


def mounted_key(prefix: str | os.PathLike[str]) -> str | None:
    """The key prefix (16 hex digits) of the live lazy environment mounted at ``prefix``, None
    when there is none (nothing mounted, another file system, or a dead mount)."""
    target = os.path.abspath(prefix)
    escaped = "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in target)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 10 or fields[4] != escaped or "-" not in fields:
            continue
        source = fields[fields.index("-") + 2]
        if source.startswith("bootseer-env:") and not _dead(target):
            return source.split(":", 1)[1]
    return None


def prepare_prefix(prefix: str) -> None:
    """``prefix`` as an empty directory to mount on: a dead mount left by a killed mount
    process is cleared; a live one, or a directory with files in it, is refused."""
    if is_mounted(prefix):
        if not _dead(prefix):
            raise SnapshotError(
                f"{prefix} is already mounted; unmount it first (`bootseer env unmount {prefix}`)"
            )
        log.info("clearing the dead mount at %s (its mount process is gone)", prefix)
        unmount(prefix, lazy=True)
    if os.path.lexists(prefix):
        if os.path.islink(prefix) or not os.path.isdir(prefix):
            raise SnapshotError(f"{prefix} exists and is not a directory; choose another prefix")
        if any(os.scandir(prefix)):
            raise SnapshotError(
                f"{prefix} is not empty; a lazy environment mounts on an empty directory "
                f"(remove it, or use `bootseer env ensure`/`restore`, which replace it)"
            )
    else:
        os.makedirs(prefix, exist_ok=True)


def mount_lazy(
    store: str,
    key: str,
    prefix: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    prefetch: bool = True,
    record: str = "auto",
    profile_s: float = DEFAULT_PROFILE_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    connections: int = 8,
    timeout_s: float = MOUNT_TIMEOUT_S,
    stats_path: str | os.PathLike[str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
) -> LazyMount:
    """Mount snapshot ``key`` of ``store`` at ``prefix`` lazily (module docstring); returns
    once the mount is up. SnapshotError when the snapshot cannot be mounted (its message is the
    child's: the member and rule refused, the store unreachable...). The child's log goes to
    ours, or to ``log_path`` (a mount that outlives its caller: ``bootseer env mount``)."""
    if record not in ("auto", "always", "never"):
        raise ValueError(f"record={record!r}: use 'auto', 'always' or 'never'")
    prefix = os.path.abspath(prefix)
    prepare_prefix(prefix)
    tmpdir = ""
    if stats_path is None:
        tmpdir = tempfile.mkdtemp(prefix="bootseer-env-mount-")
        stats_path = os.path.join(tmpdir, "stats.json")
    settings = LazySettings(
        store=store,
        key=key,
        prefix=prefix,
        cache_dir=os.fspath(cache_dir),
        storage_options=storage_options,
        stats_path=os.fspath(stats_path),
        prefetch=prefetch,
        record=record,
        profile_s=profile_s,
        read_timeout_s=read_timeout_s,
        connections=connections,
    )
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_file = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snapshot.lazy"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=log_file if log_file is not None else subprocess.PIPE,
            env=env,
            start_new_session=True,  # a ^C of the job's terminal does not unmount under it
        )
    finally:
        if log_file is not None:
            log_file.close()
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(settings.to_json()).encode())
    proc.stdin.close()
    proc.stdin = None  # closed: communicate() must not flush it (it reads the error)
    try:
        wait_mounted(prefix, timeout_s, proc)
    except MountError as exc:
        if log_path is not None:
            exc = MountError(f"{exc}; its log ({log_path}) ends:\n{_tail(log_path)}")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if is_mounted(prefix):
            unmount(prefix, lazy=True)
        if tmpdir:  # the stats file of a mount that never came up
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise SnapshotError(f"could not mount snapshot {key} at {prefix}: {exc}") from exc
    _drain(proc)
    return LazyMount(prefix, key, proc, os.fspath(stats_path), tmpdir)


def _tail(path: str | os.PathLike[str], limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return "(unreadable)"


def _drain(proc: subprocess.Popen[bytes]) -> None:
    """Copy the mount process's log to ours, so that its pipe never fills and blocks it."""
    stream = proc.stderr
    if stream is None:
        return

    def pump() -> None:
        try:
            for line in iter(stream.readline, b""):
                sys.stderr.write("env-mount: " + line.decode("utf-8", "replace"))
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                stream.close()

    threading.Thread(target=pump, name="env-lazy-log", daemon=True).start()


def unmount_lazy(prefix: str | os.PathLike[str], *, lazy: bool = False) -> bool:
    """Unmount a lazy environment (a dead one, left by a killed mount process, too); False
    when nothing was mounted there. ``lazy`` detaches it even while files are open."""
    prefix = os.path.abspath(prefix)
    if not is_mounted(prefix):
        return False
    try:
        unmount(prefix, lazy=lazy or _dead(prefix))
    except MountError as exc:
        raise SnapshotError(
            f"could not unmount {prefix}: {exc}; is a process still using it? "
            f"(`bootseer env unmount --lazy {prefix}` detaches it anyway)"
        ) from exc
    return True


@contextmanager
def mounted(store: str, key: str, prefix: str, **kwargs: Any) -> Iterator[LazyMount]:
    """:func:`mount_lazy` as a context manager: unmounted on exit."""
    m = mount_lazy(store, key, prefix, **kwargs)
    try:
        yield m
    finally:
        m.close()


if __name__ == "__main__":
    sys.exit(main())
