"""A read-only mirror (an HTTP cache such as the cluster's nginx tier) for immutable objects.

A stripe object (``dir/.name.stripes/<version>/<index>``) never changes once written: its
version is a fresh random name per write, and a manifest names its stripes' checksums. So a
cache in front of the store can serve it to every node, and the origin sends each byte once.
The same holds for an environment snapshot's chunks (``snapshot.store``: a random publisher
directory, sha256 in the snapshot's manifest). Such a read (``immutable`` with a verifier) is
first a plain ``GET <mirror>/<bucket>/<key>`` with a ``Range`` header (no query string, no
signature: a request every node makes identically, which nginx caches); anything but
verified bytes sends the read to the origin, as if no mirror were configured.

The mirror is as untrusted as the origin: what it returns is checked with the read's own
verifier (a stripe's length and crc32 from the manifest, a chunk's sha256) before it is
used, and bytes that fail are dropped and fetched from the origin. Every fallback is counted
by cause and logged once per cause. Manifests, listings, plain files and writes never go to
the mirror.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from .errors import OptionError
from .redact import redact

log = logging.getLogger("striped_fs")

#: After a connection error or a timeout, stripe reads skip the mirror for this long (a mirror
#: that is down or hung costs one timeout per burst of reads, not one per stripe).
RETRY_AFTER_S = 30.0
#: Object stores whose paths are ``bucket/key``, which the mirror serves at ``/bucket/key``.
MIRRORED_PROTOCOLS = frozenset({"s3", "s3a"})
OPTION = "striped.mirror"
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def check_mirror_url(value: str, *, name: str = OPTION) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing slash; '' means no mirror.
    Refused, naming ``name``: another scheme, a query or fragment (a cache keys on the URI,
    and a query makes nginx pass the request through uncached), credentials (the mirror is
    read anonymously, and a URL's password would end up in logs)."""
    if not isinstance(value, str):
        raise OptionError(f"{name}={value!r}: expected a URL such as 'http://10.0.0.5:9000'")
    text = value.strip()
    if not text:
        return ""
    parts = urlsplit(text)
    fix = "give the cache's base URL, e.g. 'http://10.0.0.5:9000'"
    if parts.scheme not in ("http", "https"):
        raise OptionError(
            f"{name}={redact(text)!r}: the mirror must be an http:// or https:// URL "
            f"(got scheme {parts.scheme or 'none'!r}); {fix}"
        )
    if not parts.hostname:
        raise OptionError(f"{name}={redact(text)!r}: no host in the mirror URL; {fix}")
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise OptionError(
            f"{name}={redact(text)!r}: the mirror URL must have no query string or fragment "
            f"(the cache keys on the path; a query makes it pass requests through); {fix}"
        )
    if parts.username is not None or parts.password is not None:
        raise OptionError(
            f"{name}={redact(text)!r}: the mirror URL must hold no credentials (stripes are "
            f"read from it anonymously); {fix}"
        )
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise OptionError(f"{name}={redact(text)!r}: {exc}; {fix}") from None
    return text.rstrip("/")


class MirrorMiss(Exception):
    """The mirror did not give usable bytes; ``cause`` is the counter's name."""

    def __init__(self, cause: str, detail: str = "", *, down: bool = False) -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause
        self.detail = detail
        self.down = down  # unreachable or hung: skip the mirror for RETRY_AFTER_S


class Mirror:
    """The mirror of one striped filesystem: reads on the target's event loop (aiohttp, one
    session, created on that loop), counters and the log-once bookkeeping."""

    def __init__(self, base: str, timeout_s: float, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.base = check_mirror_url(base)
        if not self.base:
            raise OptionError(f"{OPTION}: an empty URL is no mirror")
        if not timeout_s > 0:
            raise OptionError(
                f"striped option 'mirror_timeout_s'={timeout_s!r}: must be > 0 seconds"
            )
        self.timeout_s = float(timeout_s)
        self.retry_after_s = retry_after_s
        self.reads = 0  # stripe reads the mirror served (verified)
        self.bytes = 0  # their bytes
        self.origin_bytes = 0  # bytes of mirrored-eligible reads that came from the origin
        self.fallbacks: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._down_until = 0.0
        self._session: Any = None

    # -- what callers use ----------------------------------------------------------------------
    def url(self, path: str) -> str:
        """``<base>/<bucket>/<key>``, percent-encoded the way a cache keys it."""
        return f"{self.base}/{quote(path.lstrip('/'), safe='/~-._')}"

    def stats(self) -> dict[str, Any]:
        """Counters for reports and tests: reads and bytes served, bytes that went to the
        origin instead, fallbacks by cause."""
        return {
            "reads": self.reads,
            "bytes": self.bytes,
            "origin_bytes": self.origin_bytes,
            "fallbacks": dict(self.fallbacks),
        }

    async def read_verified(
        self, path: str, start: int, end: int, verify: Callable[[bytes], None] | None, exact: bool
    ) -> bytes | None:
        """Bytes ``[start, end)`` of ``path`` from the mirror, checked by ``verify``; None
        (counted, logged once per cause) when the read must go to the origin. ``exact``: the
        range must come back whole (otherwise a shorter answer is left to ``verify``)."""
        if time.monotonic() < self._down_until:
            self._fallback(MirrorMiss("skipped (mirror down)"), path)
            return None
        try:
            data = await self._get(path, start, end)
            if exact and len(data) != end - start:
                raise MirrorMiss("short read", f"{len(data)} of {end - start} bytes")
            if verify is not None:
                try:
                    verify(data)
                except Exception as exc:  # noqa: BLE001 - whatever the verifier refuses
                    raise MirrorMiss("failed verification", str(exc)) from None
        except MirrorMiss as miss:
            self._fallback(miss, path)
            return None
        self.reads += 1
        self.bytes += len(data)
        return data

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Close the HTTP session on its loop (from any other thread)."""
        session, self._session = self._session, None
        if session is None or loop is None or not loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - closing is best effort; the process may be ending
            pass

    # -- machinery -------------------------------------------------------------------------------
    def _fallback(self, miss: MirrorMiss, path: str) -> None:
        self.fallbacks[miss.cause] += 1
        if miss.down:
            self._down_until = time.monotonic() + self.retry_after_s
        if miss.cause in self._logged:
            return
        self._logged.add(miss.cause)
        then = f"; reads skip it for {self.retry_after_s:.0f} s" if miss.down else ""
        log.warning(
            "striped mirror %s: %s reading %s%s; read from the origin instead%s "
            "(logged once per cause; counted in the mirror's stats)",
            redact(self.base),
            miss.cause,
            redact(path),
            f" ({redact(miss.detail)})" if miss.detail else "",
            then,
        )

    def _client(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s
                ),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding",),
            )
        return self._session

    async def _get(self, path: str, start: int, end: int) -> bytes:
        import aiohttp

        want = end - start
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        try:
            async with self._client().get(
                self.url(path), headers=headers, allow_redirects=False
            ) as resp:
                if resp.status == 206:
                    first = _range_start(resp.headers.get("Content-Range", ""))
                    if first != start:
                        resp.close()
                        raise MirrorMiss(
                            "wrong range",
                            f"asked bytes {start}-{end - 1}, got "
                            f"{resp.headers.get('Content-Range')!r}",
                        )
                elif resp.status == 200 and start == 0:
                    pass  # a server that ignores Range: its first ``want`` bytes will do
                elif resp.status == 200:
                    resp.close()
                    raise MirrorMiss("ignored Range", f"asked bytes {start}-{end - 1}")
                else:
                    resp.close()
                    kind = "5xx" if resp.status >= 500 else str(resp.status)
                    raise MirrorMiss(f"status {kind}", f"HTTP {resp.status}")
                if resp.headers.get("Content-Encoding", "identity") != "identity":
                    resp.close()
                    raise MirrorMiss("encoded body", resp.headers["Content-Encoding"])
                buf = bytearray()
                while len(buf) < want:
                    chunk = await resp.content.read(want - len(buf))
                    if not chunk:
                        break
                    buf += chunk
                if len(buf) >= want:
                    resp.close()  # anything past the range is not read (nor the connection reused)
                return bytes(buf)
        except MirrorMiss:
            raise
        except TimeoutError as exc:
            raise MirrorMiss("timeout", f"no answer in {self.timeout_s:g} s", down=True) from exc
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            raise MirrorMiss("unreachable", f"{type(exc).__name__}: {exc}", down=True) from exc
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            raise MirrorMiss("broken response", f"{type(exc).__name__}: {exc}") from exc
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise MirrorMiss("client error", f"{type(exc).__name__}: {exc}") from exc


def _range_start(header: str) -> int | None:
    m = _CONTENT_RANGE.match(header.strip())
    return int(m.group(1)) if m else None
