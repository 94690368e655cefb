"""Read profiles of lazy environments: which chunks a start read, in first-access order.

A :class:`Recorder` is the fetcher's ``on_access`` hook; it keeps each chunk's first read
until it is stopped (``profile_s`` after the mount, or the unmount). The profile is stored
beside the snapshot (``<store>/<key>/profile.json``) and the next mount of the key queues
those chunks first, before the background fetch of the rest.

A profile is untrusted input, like everything in the store: it is read only when it is at
most :data:`MAX_PROFILE_BYTES`, must name this key, and every entry must name a chunk of this
snapshot by index *and* sha256. A profile that breaks a rule is ignored whole (the mount goes
on without one, with a warning). What it can do at worst is waste bandwidth by naming chunks
nobody reads: it only orders fetches, and every chunk is still checked against the manifest
before a byte of it is served.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import SnapshotError
from .manifest import Manifest
from .store import SnapshotStore

log = logging.getLogger(__name__)

PROFILE_FORMAT = "bootseer-env-profile/1"
PROFILE_NAME = "profile.json"
MAX_PROFILE_BYTES = 4 << 20
"""Largest profile read: 100k chunks' entries (a 1 TB environment in 8 MiB chunks)."""


class ProfileError(SnapshotError, ValueError):
    """A stored profile breaks a rule: it is ignored."""


@dataclass
class ReadProfile:
    key: str
    chunks: list[tuple[int, str]] = field(default_factory=list)  # (index, sha256), in order
    recorded: float = 0.0
    duration_s: float = 0.0

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": PROFILE_FORMAT,
                "key": self.key,
                "recorded": self.recorded,
                "duration_s": round(self.duration_s, 3),
                "chunks": [[i, sha] for i, sha in self.chunks],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, manifest: Manifest) -> ReadProfile:
        """Parse and check an untrusted profile against ``manifest`` (module docstring)."""
        if len(raw) > MAX_PROFILE_BYTES:
            raise ProfileError(f"profile is {len(raw)} bytes, over {MAX_PROFILE_BYTES}")
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"profile is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"not a {PROFILE_FORMAT} profile")
        if doc.get("key") != manifest.key:
            raise ProfileError(f"profile names key {str(doc.get('key'))[:80]!r}")
        rows = doc.get("chunks")
        if not isinstance(rows, list) or len(rows) > len(manifest.chunks):
            raise ProfileError("profile chunks missing, or more than the snapshot has")
        chunks: list[tuple[int, str]] = []
        seen: set[int] = set()
        for row in rows:
            if not (
                isinstance(row, list)
                and len(row) == 2
                and isinstance(row[0], int)
                and not isinstance(row[0], bool)
                and 0 <= row[0] < len(manifest.chunks)
                and row[1] == manifest.chunks[row[0]].sha256
            ):
                raise ProfileError(
                    f"profile entry {str(row)[:100]} names no chunk of {manifest.key}"
                )
            if row[0] in seen:
                raise ProfileError(f"profile names chunk {row[0]} twice")
            seen.add(row[0])
            chunks.append((row[0], row[1]))
        recorded, duration = doc.get("recorded", 0.0), doc.get("duration_s", 0.0)
        return cls(
            manifest.key,
            chunks,
            float(recorded) if isinstance(recorded, int | float) else 0.0,
            float(duration) if isinstance(duration, int | float) else 0.0,
        )

    def summary(self, manifest: Manifest) -> dict[str, Any]:
        raw = sum(manifest.chunks[i].raw_size for i, _ in self.chunks)
        comp = sum(manifest.chunks[i].size for i, _ in self.chunks)
        return {
            "chunks": len(self.chunks),
            "of_chunks": len(manifest.chunks),
            "bytes": comp,
            "raw_bytes": raw,
            "coverage": raw / manifest.stream_size if manifest.stream_size else 0.0,
        }


class Recorder:
    """First reads of chunks (thread-safe), until stopped."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._order: list[int] = []
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._started = time.monotonic()

    def __call__(self, i: int) -> None:
        with self._lock:
            if self._stopped or i in self._seen:
                return
            self._seen.add(i)
            self._order.append(i)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> ReadProfile:
        with self._lock:
            self._stopped = True
            return ReadProfile(
                self.manifest.key,
                [(i, self.manifest.chunks[i].sha256) for i in self._order],
                time.time(),
                time.monotonic() - self._started,
            )


def load_profile(store: SnapshotStore, manifest: Manifest) -> ReadProfile | None:
    """The stored profile of ``manifest``'s key, checked; None when there is none or it breaks
    a rule (logged: a lazy start without a profile is slower, never wrong)."""
    path = store.path(manifest.key, PROFILE_NAME)
    try:
        size = int(store.target.info(path).get("size") or 0)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("could not read the read profile %s (%s); mounting without", path, exc)
        return None
    if size > MAX_PROFILE_BYTES:
        log.warning(
            "ignoring the read profile %s: %d bytes, over %d", path, size, MAX_PROFILE_BYTES
        )
        return None
    try:
        raw = store.fetch(manifest.key, PROFILE_NAME, size=size).result() if size else b""
        return ReadProfile.from_bytes(raw, manifest)
    except ProfileError as exc:
        log.warning("ignoring the read profile %s: %s", path, exc)
    except OSError as exc:
        log.warning("could not read the read profile %s (%s); mounting without", path, exc)
    return None


def save_profile(store: SnapshotStore, profile: ReadProfile) -> None:
    """Store ``profile`` beside its snapshot (replacing an older one)."""
    store.put(profile.key, PROFILE_NAME, profile.to_bytes()).result()
