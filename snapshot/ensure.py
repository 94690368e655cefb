"""``ensure``: the one call a container entrypoint makes. Verified, restored, or built once.

* The prefix already holds the intact environment of the key: a verification (stats only),
  or its marker alone with ``quick_verify`` (the files then checked beside the command).
* The store holds a snapshot of the key: restore it.
* Neither: one process builds it (installs at the prefix, packs, publishes); concurrent
  ``ensure`` calls of the same key wait for that snapshot instead of hammering the package
  index, and restore it. A lease with a heartbeat marks the builder; a builder that dies stops
  renewing it, and a waiter takes over. Whatever happens to leases, the manifest is created
  exclusively, so exactly one complete snapshot is published.
* The store cannot be reached: install locally, warn, and let the job start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard
from fsspec.callbacks import DEFAULT_CALLBACK, Callback

from .errors import SnapshotError, StoreUnavailable
from .install import default_commands, installer_version, run_command
from .key import EnvKey, compute_key
from .manifest import Manifest, Member, encode_toc
from .pack import PackResult, pack_tree, walk
from .restore import RestoreResult, read_marker, restore, verify, write_marker
from .store import SnapshotStore

log = logging.getLogger(__name__)

INSTALLING_TAG = ".bootseer-installing"


@dataclass
class PublishResult:
    published: bool  # False: another publisher won the race (its snapshot is the one)
    files: int
    bytes: int
    compressed_bytes: int
    chunks: int
    seconds: float


@dataclass
class EnsureResult:
    """``outcome``: verified | restored | built | installed-locally."""

    key: str
    prefix: str
    outcome: str
    seconds: float
    restore: RestoreResult | None = None
    publish: PublishResult | None = None
    installer: str | None = None
    warnings: list[str] = field(default_factory=list)
    files_checked: bool = True  # False: verified by its marker only (``quick_verify``)


def open_store(
    store: str | SnapshotStore | None, storage_options: dict[str, Any] | None = None
) -> SnapshotStore | None:
    if store is None or isinstance(store, SnapshotStore):
        return store
    return SnapshotStore(store, storage_options)


def ensure(
    spec_files: Sequence[str | os.PathLike] = (),
    *,
    prefix: str | os.PathLike,
    store: str | SnapshotStore | None,
    command: Sequence[str] | None = None,
    python: str | None = None,
    base_image: str | None = None,
    extras: Mapping[str, str] | None = None,
    installer: str = "auto",
    uv: str | os.PathLike | None = None,
    force: bool = False,
    replace: bool = False,
    storage_options: dict[str, Any] | None = None,
    lease_s: float = 60.0,
    wait_timeout_s: float = 3600.0,
    progress: Callback = DEFAULT_CALLBACK,
    key: EnvKey | None = None,
    quick_verify: bool = False,
) -> EnsureResult:
    """Make ``prefix`` hold the environment the inputs describe; see the module docstring.
    ``quick_verify``: an environment already there is verified by its marker alone (O(1))
    when bootseer's state there is private (``snapshot.verify``); the caller checks its
    files (``verify(prefix, key)``) beside the command when ``files_checked`` is False."""
    start = time.perf_counter()
    prefix = Path(os.path.abspath(prefix))
    env_key = key or compute_key(
        spec_files, command, python=python, base_image=base_image, extras=extras
    )
    # One ensure per prefix on a node at a time (8 ranks may run the same entrypoint): the
    # others wait here, then find the environment verified.
    with prefix_lock(prefix):
        clear_interrupted_install(prefix)
        checked = verify(prefix, env_key.key, quick=quick_verify)
        if checked.ok:
            log.info(
                "environment %s at %s verified (%d entries in %.2fs)",
                env_key.key,
                prefix,
                checked.checked,
                checked.seconds,
            )
            return EnsureResult(
                env_key.key,
                str(prefix),
                "verified",
                time.perf_counter() - start,
                files_checked=checked.files_checked,
            )
        warnings: list[str] = []
        snapshots = None
        try:
            snapshots = open_store(store, storage_options)
            manifest = snapshots.read_manifest(env_key.key) if snapshots else None
        except StoreUnavailable as exc:
            warnings.append(f"snapshot store unreachable, installing locally: {exc}")
            log.warning("%s", warnings[-1])
            snapshots, manifest = None, None
        if manifest is not None:
            return _restored(snapshots, env_key, prefix, force, replace, progress, start, manifest)
        build = dict(
            spec_files=spec_files,
            command=command,
            python=python,
            installer=installer,
            uv=uv,
            replace=replace,
        )
        if snapshots is None:
            name = install(env_key, prefix, **build)
            mark_local(prefix, env_key)
            return EnsureResult(
                env_key.key,
                str(prefix),
                "installed-locally",
                time.perf_counter() - start,
                installer=name,
                warnings=warnings,
            )
        publisher = uuid.uuid4().hex
        if not snapshots.try_lease(env_key.key, publisher):
            found = _wait_for_builder(snapshots, env_key.key, lease_s, wait_timeout_s)
            if found is not None:
                return _restored(snapshots, env_key, prefix, force, replace, progress, start, found)
            snapshots.try_lease(env_key.key, publisher)  # best effort; the commit decides
        if (manifest := snapshots.read_manifest(env_key.key)) is not None:
            # Published since the first look, by a builder that has just let go of its lease.
            snapshots.release_lease(env_key.key, publisher)
            return _restored(snapshots, env_key, prefix, force, replace, progress, start, manifest)
        renewer = _LeaseRenewer(snapshots, env_key.key, publisher, lease_s)
        try:
            name = install(env_key, prefix, **build)
            try:
                published = publish(snapshots, env_key, prefix, publisher=publisher, installer=name)
            except (SnapshotError, OSError) as exc:
                warnings.append(f"built {prefix} but could not publish it: {exc}")
                log.warning("%s", warnings[-1])
                mark_local(prefix, env_key)
                published = None
        finally:
            renewer.stop()
            snapshots.release_lease(env_key.key, publisher)
        return EnsureResult(
            env_key.key,
            str(prefix),
            "built",
            time.perf_counter() - start,
            publish=published,
            installer=name,
            warnings=warnings,
        )


def create(
    spec_files: Sequence[str | os.PathLike] = (),
    *,
    prefix: str | os.PathLike,
    store: str | SnapshotStore,
    command: Sequence[str] | None = None,
    python: str | None = None,
    base_image: str | None = None,
    extras: Mapping[str, str] | None = None,
    installer: str = "auto",
    uv: str | os.PathLike | None = None,
    replace: bool = False,
    storage_options: dict[str, Any] | None = None,
    key: EnvKey | None = None,
) -> EnsureResult:
    """Install at ``prefix`` and publish, whether or not the store has the key (a published
    snapshot is never replaced: the first one stays)."""
    start = time.perf_counter()
    prefix = Path(os.path.abspath(prefix))
    env_key = key or compute_key(
        spec_files, command, python=python, base_image=base_image, extras=extras
    )
    snapshots = open_store(store, storage_options)
    assert snapshots is not None
    with prefix_lock(prefix):
        clear_interrupted_install(prefix)
        name = install(
            env_key,
            prefix,
            spec_files=spec_files,
            command=command,
            python=python,
            installer=installer,
            uv=uv,
            replace=replace,
        )
        published = publish(snapshots, env_key, prefix, installer=name)
    return EnsureResult(
        env_key.key,
        str(prefix),
        "built",
        time.perf_counter() - start,
        publish=published,
        installer=name,
    )


def _restored(
    snapshots: SnapshotStore,
    env_key: EnvKey,
    prefix: Path,
    force: bool,
    replace: bool,
    progress: Callback,
    start: float,
    manifest: Manifest | None = None,
) -> EnsureResult:
    result = restore(
        snapshots,
        env_key.key,
        prefix,
        force=force,
        replace=replace,
        progress=progress,
        manifest=manifest,
    )
    log.info(
        "restored environment %s to %s: %d files, %.1f MB in %.2fs",
        env_key.key,
        prefix,
        result.files,
        result.bytes / 1e6,
        result.seconds,
    )
    return EnsureResult(
        env_key.key, str(prefix), "restored", time.perf_counter() - start, restore=result
    )


def _wait_for_builder(
    snapshots: SnapshotStore, key: str, lease_s: float, timeout_s: float
) -> Manifest | None:
    """Wait while another process builds ``key``: its manifest, or None when it is gone."""
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    last_log = 0.0
    while time.monotonic() < deadline:
        manifest = snapshots.read_manifest(key)
        if manifest is not None:
            return manifest
        lease = snapshots.read_lease(key)
        if lease is None:
            manifest = snapshots.read_manifest(key)  # published, then let go, since the
            if manifest is not None:  # look above
                return manifest
            log.warning("the builder of %s stopped without publishing; building here", key)
            return None
        if lease.age() > lease_s:
            log.warning(
                "the builder of %s (%s pid %d) stopped renewing its lease %.0fs ago; building here",
                key,
                lease.host,
                lease.pid,
                lease.age(),
            )
            snapshots.break_lease(key)
            return None
        if time.monotonic() - last_log > 30:
            log.info(
                "waiting for %s pid %d to publish environment %s (building for %.0fs)",
                lease.host,
                lease.pid,
                key,
                time.time() - lease.started,
            )
            last_log = time.monotonic()
        time.sleep(delay)
        delay = min(delay * 1.5, 5.0)
    log.warning("gave up waiting %.0fs for environment %s; building here", timeout_s, key)
    return None


class _LeaseRenewer:
    """Heartbeat of the builder's lease, every third of its length."""

    def __init__(self, snapshots: SnapshotStore, key: str, publisher: str, lease_s: float) -> None:
        self._stop = threading.Event()
        self._started = time.time()

        def run() -> None:
            while not self._stop.wait(lease_s / 3):
                try:
                    snapshots.renew_lease(key, publisher, self._started)
                except Exception as exc:  # noqa: BLE001 - a missed heartbeat is not fatal
                    log.warning("could not renew the lease of %s: %s", key, exc)

        self._thread = threading.Thread(target=run, name="snapshot-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# -- building --------------------------------------------------------------------------------


@contextlib.contextmanager
def prefix_lock(prefix: Path) -> Iterator[None]:
    """An exclusive flock on ``.<name>.bootseer-lock`` beside the prefix (node-local)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    path = prefix.with_name(f".{prefix.name}.bootseer-lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is preparing %s; waiting for it", prefix)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _installing_marker(prefix: Path) -> Path:
    return prefix.with_name(f".{prefix.name}{INSTALLING_TAG}")


def clear_interrupted_install(prefix: Path) -> bool:
    """A prefix left half-installed by a killed build is removed (its builder is gone)."""
    marker = _installing_marker(prefix)
    try:
        pid = int(json.loads(marker.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        if marker.exists():
            marker.unlink()
        return False
    if pid != os.getpid():
        try:
            os.kill(pid, 0)
            return False  # still running: leave it alone
        except ProcessLookupError:
            pass
        except PermissionError:
            return False
    log.warning("removing %s, left half-installed by an interrupted build (pid %d)", prefix, pid)
    shutil.rmtree(prefix, ignore_errors=True)
    old = prefix.with_name(f".{prefix.name}.bootseer-old-{pid}")
    if old.is_dir():  # the environment it had moved aside comes back
        os.rename(old, prefix)
        log.warning("put back the previous environment of %s", prefix)
    marker.unlink(missing_ok=True)
    return True


def install(
    env_key: EnvKey,
    prefix: Path,
    *,
    spec_files: Sequence[str | os.PathLike] = (),
    command: Sequence[str] | None = None,
    python: str | None = None,
    installer: str = "auto",
    uv: str | os.PathLike | None = None,
    replace: bool = False,
) -> str:
    """Install at ``prefix`` (the old environment is kept aside and put back on failure).
    Returns the installer's name."""
    old = None
    if os.path.lexists(prefix):
        if prefix.is_symlink() or not prefix.is_dir():
            raise SnapshotError(f"{prefix} exists and is not a directory")
        if any(prefix.iterdir()):
            if read_marker(prefix) is None and not replace:
                raise SnapshotError(
                    f"{prefix} exists and was not made by bootseer; pass --replace to swap it "
                    f"out (it is deleted), or choose another prefix"
                )
            old = prefix.with_name(f".{prefix.name}.bootseer-old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(prefix, old)
        else:
            prefix.rmdir()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    marker = _installing_marker(prefix)
    marker.write_text(json.dumps({"pid": os.getpid(), "key": env_key.key}))
    try:
        if command:
            name = "custom"
            steps = [list(command)]
        else:
            name, steps = default_commands(
                spec_files, prefix, python=python, installer=installer, uv=uv
            )
            name = installer_version(name, steps)
        log.info("installing environment %s at %s with %s", env_key.key, prefix, name)
        for step in steps:
            run_command(step, prefix=prefix)
        if not prefix.is_dir():
            raise SnapshotError(
                f"the install command finished but {prefix} does not exist; "
                f"it must install into {{prefix}} ($BOOTSEER_PREFIX)"
            )
    except BaseException:
        shutil.rmtree(prefix, ignore_errors=True)
        if old is not None:
            os.rename(old, prefix)
        marker.unlink(missing_ok=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    marker.unlink(missing_ok=True)
    return name


def publish(
    snapshots: SnapshotStore,
    env_key: EnvKey,
    prefix: Path,
    *,
    publisher: str | None = None,
    installer: str = "",
    chunk_size: int | None = None,
) -> PublishResult:
    """Pack ``prefix`` into the store under the key; exactly one concurrent publisher wins."""
    start = time.perf_counter()
    kwargs = {"chunk_size": chunk_size} if chunk_size else {}
    packed, manifest, won = publish_tree(
        snapshots,
        env_key,
        prefix,
        kind="prefix",
        publisher=publisher,
        installer=installer,
        **kwargs,
    )
    write_marker(
        prefix,
        env_key.key,
        prefix,
        packed.members,
        built_at=str(prefix),
        store_url=snapshots.url,
        published=True,
        publisher=manifest.publisher,
    )
    return PublishResult(
        won,
        packed.files,
        packed.bytes,
        manifest.compressed_size,
        len(packed.chunks),
        time.perf_counter() - start,
    )


def publish_tree(
    snapshots: SnapshotStore,
    env_key: EnvKey,
    root: Path,
    *,
    kind: str,
    publisher: str | None = None,
    installer: str = "",
    paths: list[str] | None = None,
    capture: dict[str, Any] | None = None,
    **pack_options: Any,
) -> tuple[PackResult, Manifest, bool]:
    """Pack ``root`` (or ``paths`` under it), upload chunks and TOC, commit the manifest;
    (pack, manifest, won). A loser's or a failed publisher's chunks are removed."""
    publisher = publisher or uuid.uuid4().hex
    key = env_key.key
    try:
        packed = pack_tree(
            root,
            lambda name, data: snapshots.put(key, name, data),
            publisher=publisher,
            paths=paths,
            prefix=str(root) if kind == "prefix" else None,
            **pack_options,
        )
        toc_raw = encode_toc(packed.members)
        toc = zstandard.ZstdCompressor(level=3).compress(toc_raw)
        toc_name = f"{publisher}/toc.json.zst"
        snapshots.put(key, toc_name, toc).result()
        manifest = Manifest(
            key=key,
            kind=kind,
            prefix=str(root),
            chunks=packed.chunks,
            toc={
                "name": toc_name,
                "sha256": hashlib.sha256(toc).hexdigest(),
                "size": len(toc),
                "raw_size": len(toc_raw),
            },
            stream_size=packed.stream_size,
            files=packed.files,
            bytes=packed.bytes,
            publisher=publisher,
            created=time.time(),
            host=socket.gethostname(),
            installer=installer,
            inputs=env_key.inputs,
            prefix_refs=packed.prefix_refs,
            capture=capture or {},
        )
        won = snapshots.commit(manifest)
    except BaseException:
        snapshots.discard_publisher(key, publisher)
        raise
    if not won:
        log.info("another process published snapshot %s first; discarding this copy", key)
        snapshots.discard_publisher(key, publisher)
    return packed, manifest, won


def mark_local(prefix: Path, env_key: EnvKey) -> None:
    """Mark an environment installed without a store, so later starts verify it."""
    members = [Member(e.path, e.kind, 0, 0) for e in walk(prefix)]
    write_marker(
        prefix, env_key.key, prefix, members, built_at=str(prefix), store_url=None, published=False
    )


__all__ = [
    "EnsureResult",
    "PublishResult",
    "create",
    "ensure",
    "install",
    "publish",
    "open_store",
    "clear_interrupted_install",
    "mark_local",
]
