"""The frame fetcher: on-demand reads jump the prefetch queue, adjacent frames coalesce into
one range request, a corrupted frame is refetched once then fails with EIO, and transient
errors are retried. The blob server here is a function over bytes that counts requests; the
registry itself is exercised in the image tests."""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from pathlib import Path

import pytest
import zstandard

from prefetch.cache import BlockCache
from prefetch.fetcher import Blob, FrameFetcher
from prefetch.toc import Frame


def _blob(n: int = 12, size: int = 64 << 10) -> tuple[Blob, bytes, list[bytes]]:
    comp = zstandard.ZstdCompressor(level=3)
    raws, out, frames, raw_off = [], b"", [], 0
    for i in range(n):
        raw = hashlib.sha256(str(i).encode()).digest() * (size // 32)
        data = comp.compress(raw)
        frames.append(
            Frame(i, len(out), len(data), raw_off, len(raw), hashlib.sha256(data).hexdigest())
        )
        out += data
        raws.append(raw)
        raw_off += len(raw)
    return Blob("sha256:" + hashlib.sha256(out).hexdigest(), frames), out, raws


class Server:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.requests: list[tuple[int, int]] = []
        self.fail_next = 0
        self.corrupt_always = False
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, digest: str, start: int, end: int) -> bytes:
        self.gate.wait(10)
        self.requests.append((start, end))
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionResetError("dropped")
        chunk = self.data[start:end]
        if self.corrupt_always:
            chunk = bytes([chunk[0] ^ 1]) + chunk[1:]
        return chunk


def test_prefetch_coalesces_and_reads_are_served_from_cache(tmp_path: Path) -> None:
    blob, data, raws = _blob()
    server = Server(data)
    fetcher = FrameFetcher(server, BlockCache(tmp_path), connections=1, merge_cap=1 << 30)
    server.gate.clear()  # hold the worker so the whole profile is queued before it starts
    fetcher.prefetch([(blob, i) for i in range(12)])
    server.gate.set()
    assert fetcher.wait_idle(10)
    # The one worker took frame 0 first (it was waiting), then the other 11 in one range.
    assert len(server.requests) <= 2
    assert [fetcher.frame(blob, i) for i in range(12)] == raws
    stats = fetcher.report()
    assert stats.frames_read == 12 and stats.cache_hits == 12 and stats.prefetched == 12
    assert stats.prefetched_unused == 0 and stats.bytes_fetched == len(data)
    fetcher.close()


def test_an_on_demand_read_jumps_the_queue(tmp_path: Path) -> None:
    blob, data, raws = _blob()
    server = Server(data)
    fetcher = FrameFetcher(server, BlockCache(tmp_path), connections=1, merge_cap=1)
    server.gate.clear()
    fetcher.prefetch([(blob, i) for i in range(11)])  # 0..10 queued in order
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fetcher.frame(blob, 11)))
    reader.start()
    server.gate.set()
    reader.join(10)
    assert got == [raws[11]]
    # Frame 11 was fetched right after the frame the worker already held, before 1..10.
    order = [
        blob.frames.index(next(f for f in blob.frames if f.c_offset == s))
        for s, _ in server.requests
    ]
    assert order.index(11) <= 1
    fetcher.close()


def test_transient_errors_are_retried_and_corruption_fails_with_eio(tmp_path: Path) -> None:
    blob, data, raws = _blob(n=3)
    server = Server(data)
    server.fail_next = 2
    fetcher = FrameFetcher(server, BlockCache(tmp_path / "a"), connections=2, backoff_s=0.01)
    assert fetcher.frame(blob, 1) == raws[1]
    assert fetcher.stats.retries == 2
    fetcher.close()

    bad = Server(data)
    bad.corrupt_always = True
    fetcher = FrameFetcher(bad, BlockCache(tmp_path / "b"), connections=1, backoff_s=0.01)
    with pytest.raises(OSError) as info:
        fetcher.frame(blob, 0)
    assert info.value.errno == errno.EIO and "sha256" in str(info.value)
    assert len(bad.requests) == 2  # fetched, refetched once, then failed: never wrong bytes
    fetcher.close()


def test_a_dead_server_fails_after_bounded_retries(tmp_path: Path) -> None:
    blob, data, _ = _blob(n=2)
    server = Server(data)
    server.fail_next = 100
    fetcher = FrameFetcher(server, BlockCache(tmp_path), connections=1, retries=3, backoff_s=0.01)
    with pytest.raises(OSError) as info:
        fetcher.frame(blob, 0)
    assert info.value.errno == errno.EIO and len(server.requests) == 4
    server.fail_next = 0  # the registry is back: the next read works
    assert fetcher.frame(blob, 0)
    fetcher.close()


def test_a_read_of_a_frame_in_flight_waits_for_it_instead_of_fetching_again(tmp_path: Path) -> None:
    blob, data, raws = _blob(n=2)
    server = Server(data)
    fetcher = FrameFetcher(server, BlockCache(tmp_path), connections=1, merge_cap=1)
    server.gate.clear()
    fetcher.prefetch([(blob, 0)])  # the worker takes it and blocks in the request
    deadline = time.monotonic() + 5
    while fetcher._queued and time.monotonic() < deadline:
        time.sleep(0.01)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fetcher.frame(blob, 0)))
    reader.start()
    time.sleep(0.05)
    server.gate.set()
    reader.join(10)
    assert got == [raws[0]]
    assert len(server.requests) == 1  # one request: the read joined the prefetch in flight
    fetcher.close()
