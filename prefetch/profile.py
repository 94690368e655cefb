"""Hot-block profiles: which frames a start reads, in first-access order.

A :class:`Recorder` is the fetcher's ``on_access`` hook: the first on-demand access of each
frame is kept with its time since the mount, until :meth:`Recorder.stop` (a ready signal or a
timeout). The resulting :class:`Profile` is keyed by the image manifest's digest and names
frames by layer digest and index, so it stays valid for the image whatever tag points at it.

:func:`plan_prefetch` turns a profile into the fetcher's work list; when the profile covers
most of an image (``full_fetch_ratio``, default 0.8 of the compressed bytes), fetching every
frame in blob order is cheaper than the scattered profile order (fewer, larger ranges), so the
plan becomes "profile frames first, then everything else": the rule the issue asks to state.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import PrefetchError
from .fetcher import Blob

FORMAT = "bootseer-profile/1"
ARTIFACT_TYPE = "application/vnd.bootseer.profile.v1+json"
MAX_PROFILE_ENTRIES = 1_000_000


class ProfileError(PrefetchError, ValueError):
    """A stored profile is malformed: it is ignored (a lazy start without profile)."""


@dataclass
class Profile:
    image: str  # the image manifest digest
    frames: list[tuple[str, int, float]] = field(default_factory=list)  # (layer, frame, t)
    recorded: float = 0.0
    duration_s: float = 0.0

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "image": self.image,
                "recorded": self.recorded,
                "duration_s": self.duration_s,
                "frames": [[d, i, round(t, 4)] for d, i, t in self.frames],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Profile:
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"profile is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ProfileError(f"not a {FORMAT} profile")
        frames = doc.get("frames")
        if not isinstance(frames, list) or len(frames) > MAX_PROFILE_ENTRIES:
            raise ProfileError("profile frames missing or too many")
        parsed = []
        for row in frames:
            if not (
                isinstance(row, list)
                and len(row) == 3
                and isinstance(row[0], str)
                and isinstance(row[1], int)
                and row[1] >= 0
                and isinstance(row[2], int | float)
            ):
                raise ProfileError(f"malformed profile entry {str(row)[:100]}")
            parsed.append((row[0], row[1], float(row[2])))
        return cls(
            str(doc.get("image", "")),
            parsed,
            float(doc.get("recorded", 0.0)),
            float(doc.get("duration_s", 0.0)),
        )


class Recorder:
    """Collects first accesses (thread-safe) until stopped."""

    def __init__(self, image: str) -> None:
        self.image = image
        self._frames: list[tuple[str, int, float]] = []
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._started = time.monotonic()

    def __call__(self, blob: Blob, frame: int, t: float) -> None:
        with self._lock:
            key = (blob.digest, frame)
            if self._stopped or key in self._seen:
                return
            self._seen.add(key)
            self._frames.append((blob.digest, frame, t))

    def stop(self) -> Profile:
        with self._lock:
            self._stopped = True
            return Profile(
                self.image, list(self._frames), time.time(), time.monotonic() - self._started
            )


def plan_prefetch(
    profile: Profile, blobs: Sequence[Blob], *, full_fetch_ratio: float = 0.8
) -> tuple[list[tuple[Blob, int]], bool]:
    """(work list, full) for the fetcher: the profile's frames in first-access order, then, if
    they cover at least ``full_fetch_ratio`` of the image's compressed bytes, every other frame
    in blob order. Frames of layers the image no longer has are skipped."""
    by_digest = {b.digest: b for b in blobs}
    plan: list[tuple[Blob, int]] = []
    seen: set[tuple[str, int]] = set()
    covered = 0
    for digest, i, _ in profile.frames:
        blob = by_digest.get(digest)
        if blob is None or not 0 <= i < len(blob.frames) or (digest, i) in seen:
            continue
        seen.add((digest, i))
        plan.append((blob, i))
        covered += blob.frames[i].c_size
    total = sum(f.c_size for b in blobs for f in b.frames)
    full = total > 0 and covered >= full_fetch_ratio * total
    if full:
        for blob in blobs:
            plan.extend((blob, i) for i in range(len(blob.frames)) if (blob.digest, i) not in seen)
    return plan, full


def profile_summary(profile: Profile, blobs: Sequence[Blob]) -> dict[str, Any]:
    total = sum(f.c_size for b in blobs for f in b.frames)
    by_digest = {b.digest: b for b in blobs}
    hot = sum(
        by_digest[d].frames[i].c_size
        for d, i, _ in profile.frames
        if d in by_digest and 0 <= i < len(by_digest[d].frames)
    )
    return {
        "frames": len(profile.frames),
        "hot_bytes": hot,
        "image_bytes": total,
        "coverage": hot / total if total else 0.0,
        "duration_s": profile.duration_s,
    }
