"""The asyncio OCI distribution client, :class:`RegistryClient`, and its verified blob
stream (:mod:`prefetch.registry` re-exports both and says what they do).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import random
import re
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp
from multidict import CIMultiDictProxy
from yarl import URL

from prefetch import mediatypes as mt
from prefetch._registry_errors import (
    DigestMismatch,
    PlatformNotFound,
    RangeNotSupported,
    RegistryAuthError,
    RegistryError,
    RegistryNotFound,
    RegistryProtocolError,
    RegistryUnavailable,
    _Ctx,
)
from prefetch._registry_helpers import (
    _RETRYABLE,
    DEFAULT_CHUNK,
    MAX_RETRY_AFTER_S,
    STREAM_UPLOAD_CHUNK,
    USER_AGENT,
    _drain,
    _error_detail,
    _next_link,
    _read_error_body,
    _read_upto,
    _regroup,
    _retry_after,
)
from prefetch.auth import (
    Challenge,
    Credentials,
    Redactor,
    TokenCache,
    basic_header,
    load_credentials,
    merge_scopes,
    parse_challenges,
)
from prefetch.oci import (
    Descriptor,
    Manifest,
    parse_platform,
    referrers_tag,
    select_platform,
)
from prefetch.reference import (
    DOCKER_HUB,
    DOCKER_HUB_API,
    Digester,
    Reference,
    compute_digest,
    is_digest,
    validate_digest,
    validate_repository,
)

# the facade's logger name: log configuration written for "prefetch.registry" keeps working
log = logging.getLogger("prefetch.registry")

T = TypeVar("T")

# -- the client ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Response:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    url: URL


def _is_loopback(host: str) -> bool:
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def _split_hostport(hostport: str) -> str:
    """The host part of ``host[:port]`` / ``[v6][:port]``."""
    if hostport.startswith("["):
        return hostport[1:].partition("]")[0]
    return hostport.rsplit(":", 1)[0] if hostport.count(":") == 1 else hostport


def _parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` -> (a, b, total or None for ``*``)."""
    if not value:
        return None
    m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value)
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


class BlobStream:
    """Async iterator over a blob's chunks, digest-verified at the end (the last ``__anext__``
    raises :class:`DigestMismatch` instead of ending when the bytes are wrong). Use it in an
    ``async with`` (or call :meth:`aclose`) when leaving the loop early, so the connection is
    released at once."""

    def __init__(self, gen: AsyncIterator[bytes], *inner: AsyncIterator[bytes]) -> None:
        self._gen = gen
        self._inner = inner

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        for gen in (self._gen, *self._inner):
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class RegistryClient:
    """Client for one registry. Use as ``async with RegistryClient(host) as client:`` (or call
    :meth:`close`); the HTTP session is created on first use, on the running loop.

    ``registry`` is ``host[:port]`` (``docker.io`` means Docker Hub); ``http://`` or
    ``https://`` in front forces the scheme. ``plain_http`` defaults to True on loopback
    hosts only. ``credentials`` (a :class:`~prefetch.auth.Credentials` or ``(user, password)``)
    win over the environment and docker's config.json. ``retries`` is the number of retries
    after the first attempt; backoff doubles from ``backoff_s`` up to ``max_backoff_s``, with
    jitter. ``timeout_s`` bounds each connect and each wait for data on a socket (not a whole
    transfer, which may be gigabytes). ``trust_env`` lets aiohttp read proxy settings (and
    ``.netrc``) from the environment; off by default.
    """

    def __init__(
        self,
        registry: str,
        *,
        plain_http: bool | None = None,
        credentials: Credentials | tuple[str, str] | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        timeout_s: float = 60.0,
        connections: int = 32,
        trust_env: bool = False,
    ) -> None:
        text = registry.strip().rstrip("/")
        scheme_forced: str | None = None
        for prefix in ("http://", "https://"):
            if text.lower().startswith(prefix):
                scheme_forced, text = prefix[:-3], text[len(prefix) :]
        if not text or "/" in text or any(c.isspace() for c in text):
            raise ValueError(
                f"invalid registry {registry!r}: expected HOST[:PORT] (e.g. 127.0.0.1:5000)"
            )
        if text == "index.docker.io":
            text = DOCKER_HUB
        if retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise ValueError("retries and backoff_s must be >= 0 and timeout_s > 0")
        self.registry = text
        api_host = DOCKER_HUB_API if text == DOCKER_HUB else text
        if plain_http is None:
            plain_http = (
                scheme_forced == "http"
                if scheme_forced
                else _is_loopback(_split_hostport(api_host))
            )
        self.plain_http = plain_http
        self.base_url = URL(f"{'http' if plain_http else 'https'}://{api_host}")
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.timeout_s = float(timeout_s)
        self.connections = int(connections)
        self.trust_env = trust_env
        self._credentials = load_credentials(text, credentials)
        self._redact = Redactor()
        if self._credentials is not None:
            self._redact.add(*self._credentials.secrets())
        self._tokens = TokenCache()
        self._challenge: Challenge | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._referrers_api: bool | None = None
        self.token_fetches = 0
        """How many tokens were asked of the token server (for tests and diagnostics)."""

    # -- lifecycle ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        auth = "anonymous" if self._credentials is None else f"user {self._credentials.username}"
        return f"RegistryClient({self.base_url}, {auth})"

    @property
    def credentials_source(self) -> str | None:
        """Where the credentials came from (argument, environment, docker config), or None."""
        return None if self._credentials is None else self._credentials.source

    def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed:
            if self._session_loop is not loop:
                raise RuntimeError(
                    "RegistryClient used from two event loops; create one client per loop "
                    "(or use SyncRegistry from synchronous code)"
                )
            return self._session
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.timeout_s,
            sock_connect=self.timeout_s,
            sock_read=self.timeout_s,
        )
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=self.connections),
            headers={"User-Agent": USER_AGENT},
            auto_decompress=False,  # blobs are digested as stored; never let aiohttp inflate
            trust_env=self.trust_env,
        )
        self._session_loop = loop
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    async def __aenter__(self) -> Self:
        self._ensure_session()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- errors -----------------------------------------------------------------------------------

    def _where(self, ctx: _Ctx) -> str:
        return f"{ctx.op}{ctx.target()} on registry {self.registry}"

    def _make(self, cls: type[RegistryError], ctx: _Ctx, text: str, **kw: Any) -> RegistryError:
        return cls(
            self._redact(f"{self._where(ctx)}: {text}"),
            registry=self.registry,
            repository=ctx.repo,
            reference=ctx.ref,
            **kw,
        )

    def _http_error(self, ctx: _Ctx, status: int, body: bytes) -> RegistryError:
        code, detail = _error_detail(body)
        what = f"HTTP {status}" + (f" {code}" if code else "") + (f" ({detail})" if detail else "")
        if status == 401:
            cls: type[RegistryError] = RegistryAuthError
            hint = self._auth_hint()
        elif status == 403:
            cls = RegistryAuthError
            hint = "the credentials lack permission for this repository or operation"
        elif status == 404:
            cls = RegistryNotFound
            hint = {
                "NAME_UNKNOWN": "the repository does not exist on this registry; check its name",
                "MANIFEST_UNKNOWN": "no such manifest or tag; check the reference and that the "
                "image was pushed to this registry",
                "BLOB_UNKNOWN": "the registry does not hold this blob in this repository",
                "BLOB_UPLOAD_UNKNOWN": "the upload session expired or was cancelled; retry",
            }.get(code or "", "check the repository name and the tag or digest")
        elif code in ("DIGEST_INVALID",):
            cls, hint = DigestMismatch, "the uploaded bytes do not match the digest"
        elif status == 416:
            cls, hint = RangeNotSupported, "the requested range is not satisfiable"
        elif status == 405:
            cls, hint = RegistryError, "the registry does not allow this operation (read-only?)"
        else:
            cls, hint = RegistryError, "the registry rejected the request; not retried"
        return self._make(cls, ctx, f"{what}: {hint}", status=status, code=code)

    def _auth_failed(self, ctx: _Ctx, challenges: list[Challenge]) -> RegistryError:
        bearer = next((c for c in challenges if c.scheme == "bearer"), None)
        what = "HTTP 401"
        if bearer is not None and bearer.error:
            what += f" ({bearer.error}"
            what += f" for {' '.join(bearer.scopes)})" if bearer.scopes else ")"
        if not challenges:
            what += " without a usable WWW-Authenticate challenge"
        insufficient = bearer is not None and bearer.error == "insufficient_scope"
        if self._credentials is not None and insufficient:
            hint = (
                f"user {self._credentials.username!r} (from {self._credentials.source}) lacks "
                "permission for this repository or operation"
            )
        else:
            hint = self._auth_hint()
        return self._make(RegistryAuthError, ctx, f"{what}: {hint}", status=401)

    def _auth_hint(self) -> str:
        if self._credentials is None:
            return (
                "the registry needs credentials: set BOOTSEER_REGISTRY_USERNAME and "
                f"BOOTSEER_REGISTRY_PASSWORD, or run 'docker login {self.registry}'"
            )
        return (
            f"the registry refused the credentials of user {self._credentials.username!r} "
            f"(from {self._credentials.source}) or they lack permission; check them"
        )

    def _unavailable(self, ctx: _Ctx, failure: BaseException | str, attempts: int) -> RegistryError:
        if isinstance(failure, BaseException):
            reason = (
                f"{type(failure).__name__}: {failure}" if str(failure) else type(failure).__name__
            )
        else:
            reason = failure
        status = None
        m = re.match(r"HTTP (\d+)", reason)
        if m:
            status = int(m.group(1))
        return self._make(
            RegistryUnavailable,
            ctx,
            f"gave up after {attempts} attempt{'s' if attempts != 1 else ''} "
            f"(last: {reason}); check that the registry at {self.base_url} is up and reachable "
            "(address, port, http/https), then retry",
            status=status,
        )

    # -- retries ------------------------------------------------------------------------------------

    def _backoff(self, attempt: int, retry_after: float | None = None) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * (2 ** max(0, attempt - 1)))
        delay *= 0.5 + random.random() / 2
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
        return delay

    async def _retrying(self, ctx: _Ctx, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` again (with backoff) when it fails with a connection-level error."""
        failures = 0
        while True:
            try:
                return await fn()
            except _RETRYABLE as exc:
                failures += 1
                if failures > self.retries:
                    raise self._unavailable(ctx, exc, failures) from exc
                wait = self._backoff(failures)
                log.debug(
                    "%s: %s; retry %d in %.2fs",
                    self._where(ctx),
                    self._redact(repr(exc)),
                    failures,
                    wait,
                )
                await asyncio.sleep(wait)

    # -- the request core ---------------------------------------------------------------------------

    def _url(self, path: str) -> URL:
        return URL(f"{self.base_url}{path}", encoded=False)

    async def _request(
        self,
        method: str,
        url: URL,
        ctx: _Ctx,
        *,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
        data: bytes | None = None,
        ok: Sequence[int] = (200,),
        retry: bool = True,
        read: bool = True,
        max_body: int | None = None,
    ) -> Any:
        """One logical request: auth, retries, status mapping. Returns a :class:`_Response`
        (body read, up to ``max_body``) or, with ``read=False``, the open aiohttp response,
        which the caller must release. Statuses not in ``ok`` raise."""
        session = self._ensure_session()
        attempts = self.retries + 1 if retry else 1
        attempt = 0
        auth_rounds = 0
        fresh = False  # the token sent was fetched for this very request
        while True:
            hdrs = dict(headers or {})
            sent_auth, fetched = await self._authorization(ctx)
            fresh = fresh or fetched
            if sent_auth:
                hdrs["Authorization"] = sent_auth
            failure: BaseException | str
            retry_after: float | None = None
            try:
                resp = await session.request(
                    method,
                    url,
                    headers=hdrs,
                    params=params,
                    data=data,
                    allow_redirects=True,
                )
            except aiohttp.ClientSSLError as exc:
                raise self._make(
                    RegistryUnavailable,
                    ctx,
                    f"TLS failed ({exc}); if the registry speaks plain HTTP, pass "
                    "plain_http=True (or an http:// registry address)",
                ) from exc
            except _RETRYABLE as exc:
                failure = exc
            else:
                status = resp.status
                log.debug("%s %s -> %d", method, self._redact(str(url)), status)
                if status == 401:
                    challenges = parse_challenges(resp.headers.getall("WWW-Authenticate", []))
                    await _drain(resp)
                    if auth_rounds < 2 and await self._on_challenge(
                        ctx, challenges, sent_auth, fresh
                    ):
                        auth_rounds += 1
                        fresh = True
                        continue
                    raise self._auth_failed(ctx, challenges)
                if status in ok:
                    if not read:
                        return resp
                    try:
                        body = await self._read_limited(resp, ctx, max_body)
                    except _RETRYABLE as exc:
                        failure = exc
                    else:
                        return _Response(status, resp.headers, body, resp.url)
                    finally:
                        resp.release()
                else:
                    body = await _read_error_body(resp)
                    if status == 429 or status >= 500:
                        code, detail = _error_detail(body)
                        failure = f"HTTP {status}" + (f" {code}" if code else "")
                        retry_after = _retry_after(resp.headers.get("Retry-After"))
                    else:
                        raise self._http_error(ctx, status, body)
            attempt += 1
            if attempt >= attempts:
                raise self._unavailable(ctx, failure, attempt) from (
                    failure if isinstance(failure, BaseException) else None
                )
            wait = self._backoff(attempt, retry_after)
            log.debug(
                "%s %s: %s; retry %d/%d in %.2fs",
                method,
                self._redact(str(url)),
                self._redact(str(failure)),
                attempt,
                attempts - 1,
                wait,
            )
            await asyncio.sleep(wait)

    async def _read_limited(
        self, resp: aiohttp.ClientResponse, ctx: _Ctx, limit: int | None
    ) -> bytes:
        if limit is None:
            return await resp.read()
        length = resp.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise self._make(
                RegistryProtocolError,
                ctx,
                f"response of {length} bytes exceeds the limit of {limit}",
            )
        buf = bytearray()
        async for chunk in resp.content.iter_chunked(64 * 1024):
            buf += chunk
            if len(buf) > limit:
                raise self._make(
                    RegistryProtocolError, ctx, f"response exceeds the limit of {limit} bytes"
                )
        return bytes(buf)

    # -- auth --------------------------------------------------------------------------------------

    async def _authorization(self, ctx: _Ctx) -> tuple[str | None, bool]:
        """The Authorization value for ``ctx`` (None: anonymous) and whether a token had to be
        fetched for it. Once the registry has asked for Bearer auth, tokens are fetched before
        the request instead of after a 401."""
        ch = self._challenge
        if ch is None:
            return None, False
        if ch.scheme == "basic":
            return (basic_header(self._credentials) if self._credentials else None), False
        realm, service = ch.realm or "", ch.service or ""
        token = self._tokens.get(realm, service, ctx.scopes)
        if token is not None:
            return f"Bearer {token}", False
        token = await self._fetch_token(ch, ctx.scopes, ctx)
        return f"Bearer {token}", True

    async def _on_challenge(
        self, ctx: _Ctx, challenges: list[Challenge], sent_auth: str | None, fresh: bool
    ) -> bool:
        """Learn from a 401; True when the request should be sent again."""
        bearer = next((c for c in challenges if c.scheme == "bearer" and c.realm), None)
        basic = next((c for c in challenges if c.scheme == "basic"), None)
        if bearer is not None:
            if sent_auth and sent_auth.startswith("Bearer "):
                self._tokens.discard(sent_auth[7:])  # refused: expired, revoked or too narrow
                if fresh and merge_scopes(ctx.scopes, bearer.scopes) == merge_scopes(ctx.scopes):
                    return False  # a token just issued for these scopes: asking again is futile
            self._challenge = Challenge(
                "bearer", {k: v for k, v in bearer.params.items() if k in ("realm", "service")}
            )
            scopes = merge_scopes(ctx.scopes, bearer.scopes)
            await self._fetch_token(self._challenge, scopes, ctx, also_for=ctx.scopes)
            return True
        if basic is not None:
            self._challenge = Challenge("basic", dict(basic.params))
            if self._credentials is None or (sent_auth and sent_auth.startswith("Basic ")):
                return False
            return True
        return False

    async def _fetch_token(
        self,
        ch: Challenge,
        scopes: Sequence[str],
        ctx: _Ctx,
        also_for: Sequence[str] | None = None,
    ) -> str:
        """Ask the token server for ``scopes``; cache the token under ``scopes`` (and under
        ``also_for``, the scopes of the request that needed it)."""
        realm, service = ch.realm or "", ch.service or ""
        try:
            realm_url = URL(realm)
        except ValueError:
            realm_url = URL()
        if realm_url.scheme not in ("http", "https") or not realm_url.host:
            raise self._make(
                RegistryProtocolError,
                ctx,
                f"the registry's token realm {realm!r} is not an http(s) URL",
            )
        if (
            realm_url.scheme == "http"
            and not self.plain_http
            and self._credentials is not None
            and not _is_loopback(realm_url.host)
        ):
            raise self._make(
                RegistryProtocolError,
                ctx,
                f"the registry (https) sends credentials to a plain-HTTP token realm "
                f"{realm_url.origin()}; refusing to expose them",
            )
        params: list[tuple[str, str]] = []
        if service:
            params.append(("service", service))
        params.extend(("scope", s) for s in scopes)
        headers: dict[str, str] = {}
        if self._credentials is not None:
            headers["Authorization"] = basic_header(self._credentials)
            params.append(("account", self._credentials.username))
        session = self._ensure_session()
        token_ctx = dataclasses.replace(ctx, op=f"{ctx.op} (token from {realm_url.origin()})")

        async def once() -> tuple[int, bytes, float | None]:
            async with session.get(realm_url, params=params, headers=headers) as resp:
                body = await _read_upto(resp, 1024 * 1024)
                return resp.status, body, _retry_after(resp.headers.get("Retry-After"))

        attempt = 0
        while True:
            failure: BaseException | str
            retry_after = None
            try:
                status, body, retry_after = await once()
            except _RETRYABLE as exc:
                failure = exc
            else:
                self.token_fetches += 1
                log.debug("token %s scopes=%s -> %d", realm_url.origin(), list(scopes), status)
                if status == 200:
                    token, ttl = self._parse_token(body, token_ctx)
                    self._tokens.put(realm, service, scopes, token, ttl)
                    if also_for is not None:
                        self._tokens.put(realm, service, also_for, token, ttl)
                    return token
                if status in (401, 403):
                    raise self._make(
                        RegistryAuthError,
                        token_ctx,
                        f"the token server refused (HTTP {status}) for scope "
                        f"{' '.join(scopes) or '(none)'}: {self._auth_hint()}",
                        status=status,
                    )
                if status != 429 and status < 500:
                    code, detail = _error_detail(body)
                    raise self._make(
                        RegistryAuthError,
                        token_ctx,
                        f"the token server answered HTTP {status} {detail or code or ''}".rstrip(),
                        status=status,
                    )
                failure = f"HTTP {status}"
            attempt += 1
            if attempt > self.retries:
                raise self._unavailable(token_ctx, failure, attempt)
            await asyncio.sleep(self._backoff(attempt, retry_after))

    def _parse_token(self, body: bytes, ctx: _Ctx) -> tuple[str, float]:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        token = None
        if isinstance(obj, dict):
            token = obj.get("token") or obj.get("access_token")
        if not isinstance(token, str) or not token:
            raise self._make(RegistryProtocolError, ctx, "the token server's answer has no token")
        self._redact.add(token)
        if isinstance(obj, dict):
            self._redact.add(obj.get("access_token"), obj.get("refresh_token"))
        ttl = 60.0
        expires = obj.get("expires_in") if isinstance(obj, dict) else None
        if isinstance(expires, (int, float)) and not isinstance(expires, bool) and expires > 0:
            ttl = float(expires)
        return token, ttl

    # -- ping, manifests ------------------------------------------------------------------------------

    async def ping(self) -> str | None:
        """Check that the registry speaks the distribution API (and that auth works);
        returns its ``Docker-Distribution-Api-Version`` header, if any."""
        ctx = _Ctx("ping")
        try:
            r = await self._request("GET", self._url("/v2/"), ctx)
        except RegistryNotFound as exc:
            raise self._make(
                RegistryProtocolError,
                ctx,
                f"{self.base_url}/v2/ answered 404: not an OCI registry",
                status=404,
            ) from exc
        return r.headers.get("Docker-Distribution-Api-Version")

    async def get_manifest(
        self,
        repo: str,
        ref_or_digest: str,
        accept: Sequence[str] | str = mt.DEFAULT_MANIFEST_ACCEPT,
    ) -> Manifest:
        """Fetch a manifest or index by tag or digest. Fetched by digest, its bytes are verified
        against it; by tag, against ``Docker-Content-Digest`` when the registry sends one."""
        manifest = await self._get_manifest(repo, ref_or_digest, accept)
        assert manifest is not None
        return manifest

    async def _get_manifest(
        self, repo: str, ref: str, accept: Sequence[str] | str, missing_ok: bool = False
    ) -> Manifest | None:
        ctx = _Ctx("get manifest", repo, ref)
        url = self._url(f"/v2/{repo}/manifests/{ref}")
        accept_text = accept if isinstance(accept, str) else ", ".join(accept)
        r = await self._request(
            "GET",
            url,
            ctx,
            headers={"Accept": accept_text},
            ok=(200, 404) if missing_ok else (200,),
            max_body=mt.MAX_MANIFEST_BYTES,
        )
        if r.status == 404:
            return None
        return self._manifest_from(ctx, r, ref)

    def _manifest_from(self, ctx: _Ctx, r: _Response, ref: str) -> Manifest:
        content_type = (r.headers.get("Content-Type") or "").split(";")[0].strip()
        declared: str | None = None
        try:
            obj = json.loads(r.body)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            raise self._make(RegistryProtocolError, ctx, "the manifest is not a JSON object")
        if isinstance(obj.get("mediaType"), str):
            declared = obj["mediaType"]
        if declared and content_type in mt.MANIFESTS and declared != content_type:
            raise self._make(
                RegistryProtocolError,
                ctx,
                f"Content-Type {content_type} disagrees with the manifest's mediaType {declared}",
            )
        media_type = declared or content_type
        if media_type not in mt.MANIFESTS:
            if obj.get("schemaVersion") == 1:
                raise self._make(
                    RegistryProtocolError,
                    ctx,
                    "docker schema 1 manifests are not supported; re-push the "
                    "image with a current client",
                )
            if not media_type:
                media_type = mt.OCI_INDEX if "manifests" in obj else mt.OCI_MANIFEST
        expected = ref if is_digest(ref) else r.headers.get("Docker-Content-Digest")
        if expected and is_digest(expected):
            actual = compute_digest(r.body, expected.partition(":")[0])
            if actual != expected:
                raise self._make(
                    DigestMismatch,
                    ctx,
                    f"manifest bytes digest to {actual}, expected {expected}: the registry or a "
                    "proxy returned wrong content",
                )
            digest = expected
        else:
            digest = compute_digest(r.body)
        return Manifest(media_type, r.body, digest)

    async def head_manifest(self, repo: str, ref_or_digest: str) -> Descriptor | None:
        """The descriptor of a manifest (HEAD; no body), or None when it does not exist."""
        ctx = _Ctx("head manifest", repo, ref_or_digest)
        url = self._url(f"/v2/{repo}/manifests/{ref_or_digest}")
        r = await self._request(
            "HEAD",
            url,
            ctx,
            ok=(200, 404),
            headers={"Accept": ", ".join(mt.DEFAULT_MANIFEST_ACCEPT)},
        )
        if r.status == 404:
            return None
        digest = r.headers.get("Docker-Content-Digest")
        length = r.headers.get("Content-Length", "")
        media_type = (r.headers.get("Content-Type") or "").split(";")[0].strip()
        if not digest or not is_digest(digest) or not length.isdigit():
            raise self._make(
                RegistryProtocolError,
                ctx,
                "HEAD lacks Docker-Content-Digest or Content-Length; use get_manifest",
            )
        return Descriptor(media_type, digest, int(length))

    async def resolve_image(
        self, reference: Reference | str, platform: str = "linux/amd64"
    ) -> Manifest:
        """The image manifest of ``reference`` for ``platform``: indexes (OCI index, docker
        manifest list, nested ones) are walked by platform; each chosen manifest is fetched by
        digest and checked against its descriptor's size. :class:`PlatformNotFound` lists the
        platforms an index offers. The reference's registry must be this client's."""
        ref = Reference.parse(reference) if isinstance(reference, str) else reference
        if ref.registry != self.registry:
            raise ValueError(
                f"reference {ref} is on registry {ref.registry}, this client talks to "
                f"{self.registry}"
            )
        parse_platform(platform)
        manifest = await self.get_manifest(ref.repository, ref.ref)
        for _depth in range(4):
            if not manifest.is_index:
                break
            ctx = _Ctx("resolve image", ref.repository, manifest.digest)
            try:
                entries = manifest.manifests
            except ValueError as exc:
                raise self._make(RegistryProtocolError, ctx, str(exc)) from None
            chosen = select_platform(entries, platform)
            if chosen is None:
                names = sorted(
                    {n for e in entries if (n := e.platform_name) and not n.startswith("unknown/")}
                )
                raise PlatformNotFound(
                    self._redact(
                        f"{self._where(_Ctx('resolve image', ref.repository, ref.ref))}: "
                        f"no manifest for platform {platform}; the index offers "
                        f"{', '.join(names) or 'no platforms'}: pass one of those"
                    ),
                    available=names,
                    registry=self.registry,
                    repository=ref.repository,
                    reference=ref.ref,
                )
            if chosen.size > mt.MAX_MANIFEST_BYTES:
                raise self._make(
                    RegistryProtocolError,
                    ctx,
                    f"index entry {chosen.digest} declares {chosen.size} bytes, "
                    f"more than a manifest may have",
                )
            sub = await self.get_manifest(ref.repository, chosen.digest)
            if sub.size != chosen.size:
                raise self._make(
                    RegistryProtocolError,
                    ctx,
                    f"manifest {chosen.digest} has {sub.size} bytes, the index says {chosen.size}",
                )
            manifest = sub
        if manifest.media_type not in mt.IMAGE_MANIFESTS:
            raise self._make(
                RegistryProtocolError,
                _Ctx("resolve image", ref.repository, ref.ref),
                f"{manifest.digest} is a {manifest.media_type or 'manifest of unknown type'}, "
                "not an image manifest",
            )
        return manifest

    async def put_manifest(self, repo: str, ref: str, data: bytes, media_type: str) -> str:
        """Push a manifest under a tag or its digest; returns its digest."""
        digest, _ = await self._put_manifest(repo, ref, data, media_type)
        return digest

    async def _put_manifest(
        self, repo: str, ref: str, data: bytes, media_type: str
    ) -> tuple[str, CIMultiDictProxy[str]]:
        ctx = _Ctx("put manifest", repo, ref, actions="pull,push")
        data = bytes(data)
        if len(data) > mt.MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest of {len(data)} bytes exceeds {mt.MAX_MANIFEST_BYTES}")
        algo = ref.partition(":")[0] if is_digest(ref) else "sha256"
        digest = compute_digest(data, algo)
        if is_digest(ref) and ref != digest:
            raise self._make(
                DigestMismatch, ctx, f"the manifest bytes digest to {digest}, not to the reference"
            )
        url = self._url(f"/v2/{repo}/manifests/{ref}")
        r = await self._request(
            "PUT", url, ctx, data=data, ok=(200, 201), headers={"Content-Type": media_type}
        )
        echoed = r.headers.get("Docker-Content-Digest")
        if echoed and is_digest(echoed) and echoed.partition(":")[0] == algo and echoed != digest:
            raise self._make(
                DigestMismatch,
                ctx,
                f"the registry stored digest {echoed}, the bytes digest to {digest}",
            )
        return digest, r.headers

    async def list_tags(self, repo: str, *, page_size: int | None = None) -> list[str]:
        """All tags of ``repo`` (pages followed through ``Link`` headers)."""
        ctx = _Ctx("list tags", repo)
        url: URL | None = self._url(f"/v2/{repo}/tags/list")
        params = {"n": str(page_size)} if page_size else None
        tags: list[str] = []
        for _page in range(100000):
            if url is None:
                break
            r = await self._request("GET", url, ctx, params=params, max_body=64 * 1024 * 1024)
            params = None
            try:
                obj = json.loads(r.body)
                page = obj.get("tags") or []
                if not isinstance(page, list) or not all(isinstance(t, str) for t in page):
                    raise ValueError("tags must be a list of strings")
            except (ValueError, AttributeError) as exc:
                raise self._make(RegistryProtocolError, ctx, f"bad tag list: {exc}") from None
            tags.extend(page)
            url = _next_link(r.headers.get("Link"), self.base_url)
        return tags

    # -- blobs: reads --------------------------------------------------------------------------------

    async def head_blob(self, repo: str, digest: str) -> int | None:
        """The blob's size, or None when the repository does not hold it."""
        validate_digest(digest)
        ctx = _Ctx("head blob", repo, digest)
        r = await self._request("HEAD", self._url(f"/v2/{repo}/blobs/{digest}"), ctx, ok=(200, 404))
        if r.status == 404:
            return None
        length = r.headers.get("Content-Length", "")
        if not length.isdigit():
            raise self._make(RegistryProtocolError, ctx, "HEAD blob without Content-Length")
        return int(length)

    def open_blob_stream(
        self,
        repo: str,
        digest: str,
        *,
        chunk_size: int = DEFAULT_CHUNK,
        expected_size: int | None = None,
    ) -> BlobStream:
        """Stream a blob in chunks of exactly ``chunk_size`` bytes (the last may be shorter).
        A broken connection resumes with a Range request from the byte it stopped at. The
        digest (and ``expected_size``) is checked before the last chunk is handed out: on a
        mismatch the stream raises :class:`DigestMismatch` instead."""
        validate_digest(digest)
        if chunk_size <= 0:
            raise ValueError("chunk_size must be > 0")
        raw = self._blob_chunks(repo, digest, chunk_size, expected_size)
        return BlobStream(_regroup(raw, chunk_size), raw)

    async def _blob_chunks(
        self, repo: str, digest: str, chunk_size: int, expected_size: int | None
    ) -> AsyncIterator[bytes]:
        ctx = _Ctx("get blob", repo, digest)
        url = self._url(f"/v2/{repo}/blobs/{digest}")
        digester = Digester.for_digest(digest)
        offset = 0
        total = expected_size
        failures = 0
        progress = 0  # offset at the last failure
        while True:
            headers = {"Range": f"bytes={offset}-"} if offset else None
            resp = await self._request("GET", url, ctx, headers=headers, ok=(200, 206), read=False)
            try:
                skip = 0
                if resp.status == 206:
                    cr = _parse_content_range(resp.headers.get("Content-Range"))
                    if cr is None or cr[0] != offset:
                        raise self._make(
                            RegistryProtocolError,
                            ctx,
                            f"asked for bytes from {offset}, got Content-Range "
                            f"{resp.headers.get('Content-Range')!r}",
                        )
                    if cr[2] is not None:
                        total = self._check_total(ctx, total, cr[2])
                else:
                    skip = offset  # the server ignored Range: drop what we already have
                    length = resp.headers.get("Content-Length", "")
                    if length.isdigit():
                        total = self._check_total(ctx, total, int(length))
                async for chunk in resp.content.iter_chunked(chunk_size):
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                        if not chunk:
                            continue
                    digester.update(chunk)
                    offset += len(chunk)
                    if total is not None and offset > total:
                        raise self._make(
                            DigestMismatch,
                            ctx,
                            f"the registry sent more than the blob's {total} bytes",
                        )
                    yield chunk
                if total is not None and offset < total:
                    raise aiohttp.ClientPayloadError(f"response ended at byte {offset} of {total}")
            except _RETRYABLE as exc:
                # The budget counts failures in a row without progress: a long transfer over a
                # flaky link goes on as long as each connection moves it forward.
                failures = 1 if offset > progress else failures + 1
                progress = offset
                if failures > self.retries:
                    raise self._unavailable(ctx, exc, failures) from exc
                wait = self._backoff(failures)
                log.debug(
                    "%s: broke off at byte %d (%s); resuming in %.2fs",
                    self._where(ctx),
                    offset,
                    exc,
                    wait,
                )
                await asyncio.sleep(wait)
                continue
            finally:
                resp.release()
            break
        actual = digester.digest()
        if actual != digest:
            raise self._make(
                DigestMismatch,
                ctx,
                f"the {offset} bytes received digest to {actual}: the registry's copy is "
                "corrupt or a proxy altered it; do not use this data",
            )

    def _check_total(self, ctx: _Ctx, known: int | None, total: int) -> int:
        if known is not None and known != total:
            raise self._make(
                RegistryProtocolError, ctx, f"blob size is {total} bytes, expected {known}"
            )
        return total

    async def get_blob(self, repo: str, digest: str, *, expected_size: int | None = None) -> bytes:
        """The whole blob in memory, verified against ``digest``."""
        parts: list[bytes] = []
        async with self.open_blob_stream(repo, digest, expected_size=expected_size) as stream:
            async for chunk in stream:
                parts.append(chunk)
        return b"".join(parts)

    async def get_blob_range(self, repo: str, digest: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a blob (``end`` exclusive, like a slice) with one HTTP Range
        request. The answer must be a 206 with exactly that range; a registry that ignores
        Range raises :class:`RangeNotSupported`. Not digest-verified (only whole blobs can be)."""
        validate_digest(digest)
        if start < 0 or end <= start:
            raise ValueError(f"invalid range [{start}, {end}): need 0 <= start < end")
        ctx = _Ctx(f"get blob range [{start}, {end})", repo, digest)
        url = self._url(f"/v2/{repo}/blobs/{digest}")
        want = end - start

        async def once() -> bytes:
            resp = await self._request(
                "GET",
                url,
                ctx,
                headers={"Range": f"bytes={start}-{end - 1}"},
                ok=(200, 206, 416),
                read=False,
            )
            try:
                if resp.status == 200:
                    raise self._make(
                        RangeNotSupported,
                        ctx,
                        "the registry ignored the Range header (HTTP 200 instead of 206); lazy "
                        "pulls need a registry (or proxy) that serves byte ranges of blobs",
                        status=200,
                    )
                if resp.status == 416:
                    cr = resp.headers.get("Content-Range", "")
                    size = cr.rpartition("/")[2] if "/" in cr else "unknown"
                    raise self._make(
                        RangeNotSupported,
                        ctx,
                        f"HTTP 416: range not satisfiable (blob size {size})",
                        status=416,
                    )
                cr_text = resp.headers.get("Content-Range")
                cr = _parse_content_range(cr_text)
                if cr is None or cr[0] != start or cr[1] != end - 1:
                    total = f" of a {cr[2]}-byte blob" if cr and cr[2] is not None else ""
                    raise self._make(
                        RangeNotSupported,
                        ctx,
                        f"the registry answered Content-Range {cr_text!r}{total}; "
                        "the range must lie inside the blob",
                        status=206,
                    )
                data = await resp.content.read(want + 1)
                while len(data) < want + 1:
                    more = await resp.content.read(want + 1 - len(data))
                    if not more:
                        break
                    data += more
                if len(data) != want:
                    if len(data) < want:
                        raise aiohttp.ClientPayloadError(
                            f"range response ended after {len(data)} of {want} bytes"
                        )
                    raise self._make(
                        RegistryProtocolError,
                        ctx,
                        f"range response longer than the {want} bytes asked",
                    )
                return data
            finally:
                resp.release()

        return await self._retrying(ctx, once)

    # -- blobs: uploads ----------------------------------------------------------------------------

    async def put_blob(
        self,
        repo: str,
        data: bytes | bytearray | memoryview | AsyncIterable[bytes],
        digest: str | None = None,
        *,
        chunk_size: int | None = None,
    ) -> str:
        """Upload a blob; returns its digest. Skipped when the repository already has it
        (needs ``digest`` for a stream).

        ``bytes`` without ``chunk_size``: monolithic (POST, then PUT ``?digest=`` with the
        body). With ``chunk_size``, or from an async iterable: chunked (POST, PATCH each chunk
        with ``Content-Range``, PUT ``?digest=``). ``digest`` is checked against the data
        before the upload is committed. Bytes are replayed on failure (the upload restarts);
        a stream cannot be, so a broken stream upload raises :class:`RegistryUnavailable`."""
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError("chunk_size must be > 0")
        if digest is not None:
            validate_digest(digest)
        ctx = _Ctx("put blob", repo, digest, actions="pull,push")
        if isinstance(data, (bytes, bytearray, memoryview)):
            payload = bytes(data)
            actual = compute_digest(payload, (digest or "sha256").partition(":")[0])
            if digest is not None and actual != digest:
                raise self._make(DigestMismatch, ctx, f"the data digests to {actual}; not uploaded")
            ctx = dataclasses.replace(ctx, ref=actual)
            return await self._upload(ctx, actual, lambda: payload, True, chunk_size)
        if not isinstance(data, AsyncIterable):
            raise TypeError("put_blob takes bytes or an async iterable of bytes")
        stream = data
        return await self._upload(
            ctx, digest, lambda: stream, False, chunk_size or STREAM_UPLOAD_CHUNK
        )

    async def _upload(
        self,
        ctx: _Ctx,
        digest: str | None,
        source: Callable[[], bytes | AsyncIterable[bytes]],
        replayable: bool,
        chunk_size: int | None,
        location: URL | None = None,
    ) -> str:
        """Upload with restarts: each attempt checks whether the blob arrived meanwhile, opens
        a session (unless ``location`` is one already open) and sends ``source()``."""
        repo = ctx.repo
        assert repo is not None
        failures = 0
        while True:
            if location is None:
                if digest is not None and await self.head_blob(repo, digest) is not None:
                    log.debug("%s: already present", self._where(ctx))
                    return digest
                _, location, min_chunk = await self._start_upload(ctx)
            else:
                min_chunk = 0
            try:
                return await self._upload_session(
                    ctx, location, source(), digest, chunk_size, min_chunk
                )
            except RegistryUnavailable as exc:
                failures += 1
                location = None
                if not replayable:
                    raise self._make(
                        RegistryUnavailable,
                        ctx,
                        f"the upload broke off ({exc}); its data came from a stream, which "
                        "cannot be replayed: upload again from bytes or a fresh stream",
                    ) from exc
                if failures > self.retries:
                    raise
                wait = self._backoff(failures)
                log.debug(
                    "%s: upload failed (%s); restarting in %.2fs", self._where(ctx), exc, wait
                )
                await asyncio.sleep(wait)

    async def _start_upload(
        self, ctx: _Ctx, params: Mapping[str, str] | None = None
    ) -> tuple[int, URL, int]:
        r = await self._request(
            "POST",
            self._url(f"/v2/{ctx.repo}/blobs/uploads/"),
            ctx,
            params=params,
            data=b"",
            ok=(201, 202),
        )
        location = r.headers.get("Location")
        if r.status == 202 and not location:
            raise self._make(RegistryProtocolError, ctx, "upload started without a Location")
        min_chunk = r.headers.get("OCI-Chunk-Min-Length", "")
        url = self.base_url.join(URL(location)) if location else r.url
        return r.status, url, int(min_chunk) if min_chunk.isdigit() else 0

    async def _upload_session(
        self,
        ctx: _Ctx,
        location: URL,
        source: bytes | AsyncIterable[bytes],
        digest: str | None,
        chunk_size: int | None,
        min_chunk: int,
    ) -> str:
        octet = {"Content-Type": "application/octet-stream"}
        if isinstance(source, bytes) and chunk_size is None:
            assert digest is not None
            put_url = location.update_query({"digest": digest})
            r = await self._request(
                "PUT", put_url, ctx, data=source, headers=octet, ok=(201,), retry=False
            )
            return self._check_committed(ctx, r, digest)
        size = max(chunk_size or STREAM_UPLOAD_CHUNK, min_chunk)
        algo = (digest or "sha256").partition(":")[0]
        digester = Digester(algo)
        offset = 0
        async for chunk in _regroup(source, size):
            digester.update(chunk)
            last = offset + len(chunk) - 1
            headers = {**octet, "Content-Range": f"{offset}-{last}"}
            r = await self._request(
                "PATCH", location, ctx, data=chunk, headers=headers, ok=(202, 204), retry=False
            )
            rng = r.headers.get("Range", "")
            m = re.fullmatch(r"(?:bytes=)?0-(\d+)", rng.strip())
            if m and int(m.group(1)) != last:
                raise self._make(
                    RegistryProtocolError,
                    ctx,
                    f"after sending bytes up to {last} the registry holds 0-{m.group(1)}",
                )
            new_location = r.headers.get("Location")
            if new_location:
                location = self.base_url.join(URL(new_location))
            offset = last + 1
        actual = digester.digest()
        if digest is not None and actual != digest:
            await self._cancel_upload(ctx, location)
            raise self._make(
                DigestMismatch, ctx, f"the streamed data digests to {actual}; upload cancelled"
            )
        put_url = location.update_query({"digest": actual})
        r = await self._request(
            "PUT", put_url, ctx, data=b"", headers=octet, ok=(201,), retry=False
        )
        return self._check_committed(ctx, r, actual)

    def _check_committed(self, ctx: _Ctx, r: _Response, digest: str) -> str:
        echoed = r.headers.get("Docker-Content-Digest")
        if echoed and is_digest(echoed) and echoed != digest:
            raise self._make(
                DigestMismatch, ctx, f"the registry committed {echoed} instead of {digest}"
            )
        return digest

    async def _cancel_upload(self, ctx: _Ctx, location: URL) -> None:
        try:
            await self._request("DELETE", location, ctx, ok=(200, 202, 204, 404), retry=False)
        except RegistryError as exc:
            log.debug("cancelling upload failed: %s", exc)

    async def mount_blob(
        self, repo: str, digest: str, from_repo: str, *, chunk_size: int | None = None
    ) -> bool:
        """Make ``digest`` of ``from_repo`` available in ``repo`` without sending it: True when
        the registry mounted it. When it opens an upload instead (HTTP 202: it cannot mount,
        e.g. no access or a different storage), the blob is copied through this client
        (streamed from ``from_repo``, verified) and False is returned."""
        validate_digest(digest)
        validate_repository(from_repo)
        ctx = _Ctx(
            "mount blob",
            repo,
            digest,
            actions="pull,push",
            extra_scopes=(f"repository:{from_repo}:pull",),
        )
        if await self.head_blob(repo, digest) is not None:
            return True
        status, location, _ = await self._start_upload(
            ctx, params={"mount": digest, "from": from_repo}
        )
        if status == 201:
            return True
        log.debug("%s: registry did not mount from %s; copying", self._where(ctx), from_repo)

        def source() -> AsyncIterable[bytes]:
            return self.open_blob_stream(from_repo, digest)

        copy_ctx = dataclasses.replace(ctx, op=f"copy blob from {from_repo} to", extra_scopes=())
        await self._upload(
            copy_ctx, digest, source, True, chunk_size or STREAM_UPLOAD_CHUNK, location=location
        )
        return False

    # -- referrers ------------------------------------------------------------------------------------

    async def get_referrers(
        self, repo: str, digest: str, artifact_type: str | None = None
    ) -> list[Descriptor]:
        """Manifests whose ``subject`` is ``digest``: from the referrers API, or, when the
        registry answers 404 there (no support), from the ``sha256-<hex>`` fallback tag.
        Filtered by ``artifact_type`` when given."""
        validate_digest(digest)
        ctx = _Ctx("get referrers", repo, digest)
        entries: list[Descriptor] | None = None
        if self._referrers_api is not False:
            url = self._url(f"/v2/{repo}/referrers/{digest}")
            params = {"artifactType": artifact_type} if artifact_type else None
            r = await self._request(
                "GET",
                url,
                ctx,
                params=params,
                ok=(200, 404),
                headers={"Accept": mt.OCI_INDEX},
                max_body=mt.MAX_MANIFEST_BYTES,
            )
            if r.status == 200:
                self._referrers_api = True
                entries = self._index_entries(ctx, r.body)
            else:
                self._referrers_api = False
        if entries is None:
            index = await self._get_manifest(
                repo, referrers_tag(digest), (mt.OCI_INDEX,), missing_ok=True
            )
            if index is None:
                return []
            entries = self._index_entries(ctx, index.data)
        if artifact_type is not None:
            entries = [e for e in entries if e.artifact_type == artifact_type]
        return entries

    def _index_entries(self, ctx: _Ctx, body: bytes) -> list[Descriptor]:
        try:
            obj = json.loads(body)
            items = obj.get("manifests") or []
            if not isinstance(items, list):
                raise ValueError("'manifests' must be a list")
            return [Descriptor.from_json(d, f"referrers[{i}]") for i, d in enumerate(items)]
        except (ValueError, AttributeError) as exc:
            raise self._make(RegistryProtocolError, ctx, f"bad referrers index: {exc}") from None

    async def put_referrer(
        self,
        repo: str,
        subject: Descriptor | Manifest,
        artifact_type: str,
        layers: Sequence[Descriptor | tuple[str, bytes]] = (),
        *,
        annotations: Mapping[str, str] | None = None,
    ) -> Descriptor:
        """Push an artifact (an OCI image manifest with ``artifactType``, the empty config and
        ``subject``) that refers to ``subject``; ``layers`` are descriptors of blobs already
        pushed, or ``(media_type, bytes)`` pushed here. When the registry does not process
        ``subject`` (no ``OCI-Subject`` header), the fallback tag's index is updated too
        (read, add, write: concurrent writers may race). Returns the artifact's descriptor."""
        if isinstance(subject, Manifest):
            subject = subject.descriptor
        subject = Descriptor(subject.media_type, subject.digest, subject.size)
        await self.put_blob(repo, mt.OCI_EMPTY_DATA, mt.OCI_EMPTY_DIGEST)
        empty = {"mediaType": mt.OCI_EMPTY, "digest": mt.OCI_EMPTY_DIGEST, "size": 2}
        layer_json: list[dict[str, Any]] = []
        for item in layers:
            if isinstance(item, Descriptor):
                layer_json.append(item.to_json())
            else:
                media_type, blob = item
                d = await self.put_blob(repo, blob)
                layer_json.append({"mediaType": media_type, "digest": d, "size": len(blob)})
        if not layer_json:
            layer_json.append(dict(empty))
        doc: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": mt.OCI_MANIFEST,
            "artifactType": artifact_type,
            "config": empty,
            "layers": layer_json,
            "subject": subject.to_json(),
        }
        if annotations:
            doc["annotations"] = dict(annotations)
        data = json.dumps(doc, separators=(",", ":")).encode()
        digest, headers = await self._put_manifest(
            repo, compute_digest(data), data, mt.OCI_MANIFEST
        )
        desc = Descriptor(
            mt.OCI_MANIFEST,
            digest,
            len(data),
            annotations=dict(annotations) if annotations else None,
            artifact_type=artifact_type,
        )
        if headers.get("OCI-Subject") != subject.digest:
            await self._add_to_fallback_index(repo, subject.digest, desc)
        return desc

    async def _add_to_fallback_index(self, repo: str, subject: str, desc: Descriptor) -> None:
        tag = referrers_tag(subject)
        ctx = _Ctx("update referrers fallback", repo, tag, actions="pull,push")
        entries: list[dict[str, Any]] = []
        index = await self._get_manifest(repo, tag, (mt.OCI_INDEX,), missing_ok=True)
        if index is not None:
            if index.media_type != mt.OCI_INDEX:
                raise self._make(
                    RegistryProtocolError,
                    ctx,
                    f"the fallback tag holds a {index.media_type}, not an OCI "
                    "index; delete that tag",
                )
            entries = [e.to_json() for e in self._index_entries(ctx, index.data)]
        if any(e.get("digest") == desc.digest for e in entries):
            return
        entries.append(desc.to_json())
        doc = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": entries}
        await self.put_manifest(
            repo, tag, json.dumps(doc, separators=(",", ":")).encode(), mt.OCI_INDEX
        )
