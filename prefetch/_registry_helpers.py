"""The registry client's limits and its small HTTP helpers (bodies read to a bound, error
details, ``Retry-After``, ``Link`` pagination, re-chunking an upload); :mod:`prefetch.registry`
re-exports the public limits.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import re
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
)

import aiohttp
from yarl import URL

USER_AGENT = "bootseer-prefetch"
DEFAULT_CHUNK = 1024 * 1024
"""Read size of blob streams."""
STREAM_UPLOAD_CHUNK = 16 * 1024 * 1024
"""PATCH size when uploading from an async iterable without an explicit ``chunk_size``."""
MAX_RETRY_AFTER_S = 300.0
"""Longest ``Retry-After`` honoured; a longer one is cut to this."""
_ERROR_BODY_LIMIT = 4096

_RETRYABLE = (
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    asyncio.TimeoutError,
    ConnectionError,
)


# -- helpers -----------------------------------------------------------------------------------------


async def _read_upto(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or its first ``limit`` bytes (``content.read(n)`` may return less)."""
    buf = bytearray()
    while len(buf) < limit:
        chunk = await resp.content.read(limit - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


async def _drain(resp: aiohttp.ClientResponse) -> None:
    try:
        await _read_upto(resp, _ERROR_BODY_LIMIT)
    except _RETRYABLE:
        pass
    finally:
        resp.release()


async def _read_error_body(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await _read_upto(resp, _ERROR_BODY_LIMIT)
    except _RETRYABLE:
        return b""
    finally:
        resp.release()


def _error_detail(body: bytes) -> tuple[str | None, str | None]:
    """(first error code, its message) of a distribution error body ``{"errors": [...]}``."""
    try:
        obj = json.loads(body)
        first = obj["errors"][0]
        code = first.get("code")
        message = first.get("message")
        return (str(code) if code else None, str(message)[:200] if message else None)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        text = body.decode("utf-8", "replace").strip()
        return None, (text[:200] or None) if text and not text.startswith("<") else None


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _next_link(link: str | None, base: URL) -> URL | None:
    if not link:
        return None
    for part in link.split(","):
        m = re.match(r'\s*<([^>]*)>\s*;\s*rel="?next"?', part)
        if m:
            return base.join(URL(m.group(1)))
    return None


async def _regroup(source: bytes | AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """Chunks of exactly ``size`` bytes (the last may be shorter)."""
    if isinstance(source, bytes):
        for i in range(0, len(source), size):
            yield source[i : i + size]
        return
    buf = bytearray()
    async for piece in source:
        if not isinstance(piece, (bytes, bytearray, memoryview)):
            raise TypeError(f"upload stream yielded {type(piece).__name__}, expected bytes")
        if not buf and len(piece) == size:
            yield bytes(piece)
            continue
        buf += piece
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)
