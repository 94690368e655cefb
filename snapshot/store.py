"""Where snapshots live: any fsspec URL, reached through striped_fs's retrying backend.

Layout under the store URL::

    <key>/manifest.json               the commit point, created exclusively (one winner)
    <key>/<publisher>/NNNNNN.tar.zst  chunks of one publisher's pack
    <key>/<publisher>/toc.json.zst    its table of contents
    <key>/lock.json                   a lease: "publisher X is installing this key"

Chunks go under a per-publisher directory so that concurrent publishers of one key never
write the same object; the manifest is created with create-if-absent semantics (a hard link on
a local or shared POSIX filesystem, ``If-None-Match: *`` on S3), so exactly one complete
snapshot wins and the losers delete their chunks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from striped_fs import RetryPolicy, redact, url_to_fs

from .errors import SnapshotError, SnapshotNotFound, StoreUnavailable
from .manifest import MANIFEST_NAME, Manifest

log = logging.getLogger(__name__)

LOCK_NAME = "lock.json"
_KEY = re.compile(r"^[0-9a-f]{16,64}$")
_PUBLISHER = re.compile(r"^[0-9a-f]{32}$")


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise SnapshotError(
            f"{key!r} is not a snapshot key (hex, as printed by `bootseer env key`)"
        )
    return key


def _sha256_check(expected: str) -> Callable[[bytes], None]:
    """The cache tier's answer for an object the manifest names by ``expected`` (sha256)."""

    def check(data: bytes) -> None:
        got = hashlib.sha256(data).hexdigest()
        if got != expected:
            raise ValueError(f"sha256 {got[:16]}..., the manifest says {expected[:16]}...")

    return check


@dataclass(frozen=True)
class Lease:
    """Who is building a key, and when they last said so."""

    publisher: str
    host: str
    pid: int
    started: float
    heartbeat: float

    def age(self) -> float:
        return time.time() - self.heartbeat


class SnapshotStore:
    """Snapshots under ``url`` (``/shared/envs``, ``s3://bucket/envs``, ``hdfs://nn/envs``)."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        concurrency: int = 16,
        retries: int | None = None,
    ) -> None:
        self.url = redact(url)  # for messages and markers: never the credentials
        overrides: dict[str, Any] = {"concurrency": concurrency}
        if retries is not None:
            overrides["retries"] = retries
        try:
            self.fs, self.root = url_to_fs(url, storage_options, **overrides)
        except (ValueError, ImportError) as exc:
            raise SnapshotError(f"snapshot store {url}: {exc}") from exc
        self.target = self.fs.target
        self.backend = self.fs.backend
        # The filesystem's options: defaults, environment, storage_options["striped"], and
        # the overrides above (so that {"striped": {"retries": 0}} reaches the store too).
        self.retry = RetryPolicy.from_options(self.fs.options)
        self.root = self.root.rstrip("/")

    # -- paths ---------------------------------------------------------------------------
    def path(self, key: str, name: str = "") -> str:
        base = f"{self.root}/{check_key(key)}"
        return f"{base}/{name}" if name else base

    # -- reading -------------------------------------------------------------------------
    def read_manifest(self, key: str) -> Manifest | None:
        """The committed manifest of ``key``, None when absent; StoreUnavailable when the
        store cannot be asked."""
        path = self.path(key, MANIFEST_NAME)
        try:
            raw = self.backend.read_object(
                path, what=f"snapshot manifest {key}", retry=self.retry
            ).result()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(
                f"snapshot store {self.url} unreachable while reading {path}: {exc}"
            ) from exc
        return Manifest.from_bytes(raw, where=f"{self.url}/{key}/{MANIFEST_NAME}")

    def require_manifest(self, key: str) -> Manifest:
        manifest = self.read_manifest(key)
        if manifest is None:
            raise SnapshotNotFound(
                f"no snapshot {key} in {self.url}; build it with `bootseer "
                f"env ensure` or `bootseer env create`"
            )
        if manifest.key != key:
            raise SnapshotError(f"{self.url}/{key}: manifest names key {manifest.key}")
        return manifest

    def fetch(
        self, key: str, name: str, *, size: int | None = None, sha256: str | None = None
    ) -> Future[bytes]:
        """The object ``name`` of ``key``; with ``size`` (what the manifest declares), only
        its first ``size`` bytes: an object the store made longer is never read whole.

        With ``size`` and ``sha256`` (a chunk or the TOC: named by the committed manifest,
        written once under its publisher's random directory, so never changed) the read may
        come from the cluster's cache tier (striped's ``mirror`` option): the tier's answer is
        used only if its size and sha256 are the manifest's, otherwise the store is read. The
        store's answer comes back unchecked here: the caller checks every answer, as without
        a tier (in its own threads, not on the I/O loop)."""
        path = self.path(key, name)
        what = f"snapshot {key} {name}"
        if size is None:
            return self.backend.read_object(path, what=what, retry=self.retry)
        if sha256 is None:
            return self.backend.read_range(path, 0, size, what=what, retry=self.retry)
        return self.backend.read_range(
            path,
            0,
            size,
            what=what,
            retry=self.retry,
            immutable=True,
            mirror_verify=_sha256_check(sha256),
        )

    # -- writing -------------------------------------------------------------------------
    def put(self, key: str, name: str, data: bytes) -> Future[None]:
        path = self.path(key, name)
        if self.backend.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return self.backend.write_object(
            path, data, what=f"snapshot {key} {name}", retry=self.retry, durable=True
        )

    def commit(self, manifest: Manifest) -> bool:
        """Create ``<key>/manifest.json`` unless it exists: True if this publisher won."""
        path = self.path(manifest.key, MANIFEST_NAME)
        data = manifest.to_bytes()
        try:
            self._create_exclusive(path, data)
        except FileExistsError:
            return False
        current = self.read_manifest(manifest.key)
        return current is not None and current.publisher == manifest.publisher

    def _create_exclusive(self, path: str, data: bytes) -> None:
        if self.backend.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            self.backend.write_object(
                tmp, data, what=f"snapshot {os.path.basename(path)}", retry=self.retry, durable=True
            ).result()
            try:
                os.link(tmp, path)  # fails with EEXIST: the atomic create-if-absent
            finally:
                os.unlink(tmp)
            fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        if hasattr(self.target, "_call_s3"):  # s3fs: a conditional PUT
            try:
                self.target.pipe_file(path, data, mode="create")
            except OSError as exc:
                if isinstance(exc, FileExistsError) or exc.errno == errno.EINVAL:
                    raise FileExistsError(path) from exc
                raise StoreUnavailable(
                    f"snapshot store {self.url}: cannot write {path}: {exc}"
                ) from exc
            return
        # Other filesystems have no create-if-absent: check, write, and read back (a
        # concurrent publisher may still overwrite; the survivor is still one whole snapshot).
        if self.target.exists(path):
            raise FileExistsError(path)
        self.backend.write_object(path, data, what="snapshot manifest", retry=self.retry).result()

    def discard_publisher(self, key: str, publisher: str) -> None:
        """Remove one publisher's chunks (a lost race, a failed pack)."""
        if not _PUBLISHER.match(publisher):
            raise SnapshotError(f"invalid publisher id {publisher!r}")
        path = self.path(key, publisher)
        try:
            self.target.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s (run `bootseer env gc`): %s", path, exc)

    # -- the lease of whoever is building a key ---------------------------------------------
    def try_lease(self, key: str, publisher: str) -> bool:
        now = time.time()
        lease = {
            "publisher": publisher,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": now,
            "heartbeat": now,
        }
        try:
            self._create_exclusive(self.path(key, LOCK_NAME), json.dumps(lease).encode())
        except FileExistsError:
            return False
        return True

    def renew_lease(self, key: str, publisher: str, started: float) -> None:
        lease = {
            "publisher": publisher,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": started,
            "heartbeat": time.time(),
        }
        self.put(key, LOCK_NAME, json.dumps(lease).encode()).result()

    def read_lease(self, key: str) -> Lease | None:
        try:
            raw = self.target.cat_file(self.path(key, LOCK_NAME))
            data = json.loads(raw)
            return Lease(
                str(data["publisher"]),
                str(data["host"]),
                int(data["pid"]),
                float(data["started"]),
                float(data["heartbeat"]),
            )
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            return None  # a torn or foreign lease counts as none

    def release_lease(self, key: str, publisher: str) -> None:
        lease = self.read_lease(key)
        if lease is not None and lease.publisher != publisher:
            return
        try:
            self.target.rm_file(self.path(key, LOCK_NAME))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not release the lease of %s: %s", key, exc)

    def break_lease(self, key: str) -> None:
        try:
            self.target.rm_file(self.path(key, LOCK_NAME))
        except (FileNotFoundError, OSError):
            pass

    # -- listing and removal ---------------------------------------------------------------
    def keys(self) -> list[str]:
        try:
            entries = self.target.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreUnavailable(f"snapshot store {self.url} unreachable: {exc}") from exc
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted(n for n in names if _KEY.match(n))

    def list(self) -> list[Manifest]:
        """Committed snapshots (keys with a manifest), oldest first."""
        found = []
        for key in self.keys():
            try:
                manifest = self.read_manifest(key)
            except SnapshotError as exc:
                log.warning("skipping %s/%s: %s", self.url, key, exc)
                continue
            if manifest is not None:
                found.append(manifest)
        return sorted(found, key=lambda m: m.created)

    def remove(self, key: str) -> None:
        """Delete a snapshot: the manifest first (it stops being visible), then the chunks."""
        path = self.path(key)
        try:
            self.target.rm_file(self.path(key, MANIFEST_NAME))
        except FileNotFoundError:
            if not self.target.exists(path):
                raise SnapshotNotFound(f"no snapshot {key} in {self.url}") from None
        self.target.rm(path, recursive=True)

    def gc(self, older_than_s: float, *, dry_run: bool = False) -> list[str]:
        """Remove snapshots created more than ``older_than_s`` ago, and chunk directories no
        manifest references (killed or losing publishers) older than that. Returns paths."""
        cutoff = time.time() - older_than_s
        removed: list[str] = []
        for key in self.keys():
            try:
                manifest = self.read_manifest(key)
            except SnapshotError:
                manifest = None
            if manifest is not None and manifest.created < cutoff:
                removed.append(self.path(key))
                if not dry_run:
                    self.remove(key)
                continue
            keep = set()
            if manifest is not None:
                keep.add(manifest.toc["name"].split("/")[0])
            for entry in self.target.ls(self.path(key), detail=True):
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                if not _PUBLISHER.match(name) or name in keep:
                    continue
                if _newest(self.target, entry["name"]) < cutoff:
                    removed.append(entry["name"])
                    if not dry_run:
                        self.target.rm(entry["name"], recursive=True)
            if manifest is None and not dry_run and self.backend.is_local:
                try:
                    os.rmdir(self.path(key))  # nothing left of a key no one published
                except OSError:
                    pass
        return removed


def _newest(fs: Any, path: str) -> float:
    newest = 0.0
    for info in fs.find(path, detail=True).values():
        mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
        if hasattr(mtime, "timestamp"):
            mtime = mtime.timestamp()
        try:
            newest = max(newest, float(mtime or 0))
        except (TypeError, ValueError):
            continue
    return newest
