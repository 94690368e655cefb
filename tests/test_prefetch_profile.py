"""Profiles: first-access order recorded once per frame, serialized and checked, and turned
into a prefetch plan (profile order; everything when the profile covers most of the image)."""

from __future__ import annotations

import pytest

from prefetch.fetcher import Blob
from prefetch.profile import Profile, ProfileError, Recorder, plan_prefetch
from prefetch.toc import Frame


def _blob(digest: str, sizes: list[int]) -> Blob:
    frames, off = [], 0
    for i, size in enumerate(sizes):
        frames.append(Frame(i, off, size, i * 100, 100, "0" * 64))
        off += size
    return Blob(digest, frames)


def test_recorder_keeps_first_accesses_in_order_until_stopped() -> None:
    a, b = _blob("sha256:" + "a" * 64, [10] * 5), _blob("sha256:" + "b" * 64, [10] * 5)
    rec = Recorder("sha256:" + "f" * 64)
    for blob, i, t in [(a, 3, 0.1), (b, 0, 0.2), (a, 3, 0.3), (a, 1, 0.4)]:
        rec(blob, i, t)
    profile = rec.stop()
    rec(b, 4, 0.5)  # after the ready signal: not part of the start
    assert [(d[7], i) for d, i, _ in profile.frames] == [("a", 3), ("b", 0), ("a", 1)]
    again = Profile.from_bytes(profile.to_bytes())
    assert again.frames == profile.frames and again.image == profile.image


def test_malformed_profiles_are_refused() -> None:
    for raw in (
        b"nope",
        b'{"format": "other"}',
        b'{"format": "bootseer-profile/1", "frames": [["x", -1, 0]]}',
    ):
        with pytest.raises(ProfileError):
            Profile.from_bytes(raw)


def test_plan_follows_the_profile_and_goes_full_when_it_covers_most() -> None:
    a = _blob("sha256:" + "a" * 64, [10] * 10)
    sparse = Profile(
        "img",
        [(a.digest, 7, 0.0), (a.digest, 2, 0.1), ("sha256:gone", 0, 0.2), (a.digest, 99, 0.3)],
    )
    plan, full = plan_prefetch(sparse, [a])
    assert [i for _, i in plan] == [7, 2] and not full
    dense = Profile("img", [(a.digest, i, 0.0) for i in (9, 8, 7, 6, 5, 4, 3, 2)])
    plan, full = plan_prefetch(dense, [a])
    assert full and [i for _, i in plan] == [9, 8, 7, 6, 5, 4, 3, 2, 0, 1]
