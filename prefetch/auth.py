"""Registry authentication pieces: credentials, ``WWW-Authenticate`` challenges, a token cache.

The network part (asking a token server) lives in :mod:`prefetch.registry`; this module is pure.

Credentials come, first found wins, from: the explicit argument; the environment
(``BOOTSEER_REGISTRY_USERNAME`` / ``BOOTSEER_REGISTRY_PASSWORD``); docker's ``config.json``
(``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``, ``auths.<host>``). Credential
helpers (``credHelpers``, ``credsStore``) are not run: they are external programs.

Secrets never reach a log line, ``repr`` or exception message: :class:`Credentials` hides its
password, and :class:`Redactor` scrubs every known secret from text that leaves the client.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from striped_fs import redact_text, register_secret

__all__ = [
    "Challenge",
    "Credentials",
    "Redactor",
    "TokenCache",
    "basic_header",
    "load_credentials",
    "merge_scopes",
    "parse_challenges",
]

log = logging.getLogger(__name__)

ENV_USERNAME = "BOOTSEER_REGISTRY_USERNAME"
ENV_PASSWORD = "BOOTSEER_REGISTRY_PASSWORD"

TOKEN_DEFAULT_TTL_S = 60.0
"""Lifetime of a token whose response says nothing (the docker token spec's default)."""
TOKEN_EXPIRY_MARGIN_S = 10.0
"""A cached token is renewed this long before it expires, so it never expires in flight."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Username and password (or personal access token) for one registry."""

    username: str
    password: str = dataclasses.field(repr=False)
    source: str = "argument"

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password=<hidden>, source={self.source!r})"

    def secrets(self) -> list[str]:
        """Strings that must never be shown: the password and the Basic header value."""
        return [self.password, basic_header(self).partition(" ")[2]]


def basic_header(creds: Credentials) -> str:
    """``Authorization`` value for Basic auth."""
    raw = f"{creds.username}:{creds.password}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")


# -- credential discovery ----------------------------------------------------------------------


def _docker_config_path() -> Path:
    base = os.environ.get("DOCKER_CONFIG")
    if base:
        return Path(base) / "config.json"
    return Path.home() / ".docker" / "config.json"


def _host_keys(host: str) -> list[str]:
    """The spellings of ``host`` that may key ``auths`` in docker's config."""
    keys = [host]
    if host in ("docker.io", "index.docker.io", "registry-1.docker.io"):
        keys = [
            "https://index.docker.io/v1/",
            "index.docker.io",
            "docker.io",
            "registry-1.docker.io",
        ]
    return keys


def _normalise_key(key: str) -> str:
    """``https://host:port/v1/`` -> ``host:port``."""
    key = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", key.strip())
    return key.split("/", 1)[0]


def _from_docker_config(host: str, path: Path) -> Credentials | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.debug("cannot read docker config %s: %s", path, exc.strerror or exc)
        return None
    try:
        config = json.loads(text)
    except ValueError:
        log.debug("docker config %s is not valid JSON; ignored", path)
        return None
    if not isinstance(config, dict):
        return None
    wanted = {_normalise_key(k) for k in _host_keys(host)}
    helpers = config.get("credHelpers")
    if isinstance(helpers, dict) and any(_normalise_key(k) in wanted for k in helpers):
        log.debug(
            "docker config %s names a credential helper for %s; helpers are not run", path, host
        )
    elif config.get("credsStore"):
        log.debug("docker config %s has a credsStore; credential stores are not run", path)
    auths = config.get("auths")
    if not isinstance(auths, dict):
        return None
    for key, entry in auths.items():
        if not isinstance(entry, dict) or _normalise_key(str(key)) not in wanted:
            continue
        user, password = entry.get("username"), entry.get("password")
        if isinstance(user, str) and isinstance(password, str) and user:
            return Credentials(user, password, source=f"docker config {path}")
        encoded = entry.get("auth")
        if isinstance(encoded, str) and encoded:
            try:
                decoded = base64.b64decode(encoded, validate=False).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                log.debug("docker config %s: auth entry for %s is not base64; ignored", path, key)
                continue
            user, sep, password = decoded.partition(":")
            if sep and user:
                return Credentials(user, password, source=f"docker config {path}")
            log.debug(
                "docker config %s: auth entry for %s is not user:password; ignored", path, key
            )
        if entry.get("identitytoken"):
            log.debug("docker config %s: identity tokens are not supported (entry %s)", path, key)
    return None


def load_credentials(
    host: str, explicit: Credentials | tuple[str, str] | None = None
) -> Credentials | None:
    """Credentials for ``host``: explicit argument, environment, then docker's config.json."""
    if explicit is not None:
        if isinstance(explicit, Credentials):
            return explicit
        user, password = explicit
        return Credentials(str(user), str(password), source="argument")
    user = os.environ.get(ENV_USERNAME)
    password = os.environ.get(ENV_PASSWORD)
    if user and password is not None:
        return Credentials(user, password, source="environment")
    return _from_docker_config(host, _docker_config_path())


# -- challenges ----------------------------------------------------------------------------------

_PARAM_RE = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')


@dataclasses.dataclass(frozen=True)
class Challenge:
    """One ``WWW-Authenticate`` challenge: scheme (lower case) and its parameters."""

    scheme: str
    params: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def realm(self) -> str | None:
        return self.params.get("realm")

    @property
    def service(self) -> str | None:
        return self.params.get("service")

    @property
    def scopes(self) -> tuple[str, ...]:
        """The challenge's ``scope`` split on spaces (several scopes per challenge)."""
        return tuple(s for s in self.params.get("scope", "").split(" ") if s)

    @property
    def error(self) -> str | None:
        return self.params.get("error")


def parse_challenges(headers: Iterable[str]) -> list[Challenge]:
    """Parse ``WWW-Authenticate`` header values (RFC 7235, the subset registries send):
    ``Bearer realm="...",service="...",scope="..."`` and ``Basic realm="..."``."""
    out: list[Challenge] = []
    for header in headers:
        text = header.strip()
        while text:
            m = re.match(r"([A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]*)\s*", text)
            if not m:
                break
            scheme = m.group(1).lower()
            text = text[m.end() :]
            params: dict[str, str] = {}
            while True:
                pm = _PARAM_RE.match(text)
                if not pm:
                    break
                value = pm.group(2)
                if value is not None:
                    value = re.sub(r"\\(.)", r"\1", value)
                else:
                    value = pm.group(3) or ""
                params[pm.group(1).lower()] = value
                text = text[pm.end() :]
            out.append(Challenge(scheme, params))
            text = text.lstrip(", ")
    return out


# -- scopes ---------------------------------------------------------------------------------------


def merge_scopes(*groups: Iterable[str]) -> tuple[str, ...]:
    """Token scopes (``type:name:actions``) merged per resource, actions sorted:
    ``repository:a:push,pull`` + ``repository:a:pull`` -> ``repository:a:pull,push``. Registries
    list actions in any order, so scopes are only compared in this form."""
    merged: dict[tuple[str, str], set[str]] = {}
    for group in groups:
        for scope in group:
            head, sep, actions = scope.rpartition(":")
            kind, sep2, name = head.partition(":")
            if not sep or not sep2:
                merged.setdefault((scope, ""), set())
                continue
            merged.setdefault((kind, name), set()).update(a for a in actions.split(",") if a)
    out = []
    for (kind, name), actions in sorted(merged.items()):
        out.append(f"{kind}:{name}:{','.join(sorted(actions))}" if name else kind)
    return tuple(out)


# -- tokens ---------------------------------------------------------------------------------------


class TokenCache:
    """Bearer tokens by (realm, service, scopes), each kept until shortly before it expires."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._tokens: dict[tuple[str, str, tuple[str, ...]], tuple[str, float]] = {}
        self._clock = clock or time.monotonic

    @staticmethod
    def key(realm: str, service: str, scopes: Iterable[str]) -> tuple[str, str, tuple[str, ...]]:
        return (realm, service, merge_scopes(scopes))

    def get(self, realm: str, service: str, scopes: Iterable[str]) -> str | None:
        key = self.key(realm, service, scopes)
        hit = self._tokens.get(key)
        if hit is None:
            return None
        token, expires_at = hit
        if self._clock() >= expires_at - TOKEN_EXPIRY_MARGIN_S:
            del self._tokens[key]
            return None
        return token

    def put(
        self, realm: str, service: str, scopes: Iterable[str], token: str, ttl_s: float
    ) -> None:
        self._tokens[self.key(realm, service, scopes)] = (token, self._clock() + ttl_s)

    def discard(self, token: str) -> None:
        """Forget ``token`` under every key (the registry refused it)."""
        for key in [k for k, (t, _) in self._tokens.items() if t == token]:
            del self._tokens[key]

    def __len__(self) -> int:
        return len(self._tokens)


class Redactor:
    """Replaces every registered secret in a text by ``***``, and whatever else
    :func:`striped_fs.redact.redact_text` knows to be a credential. Registered secrets are
    known process-wide too, so bootseer's log filter scrubs them from any record."""

    def __init__(self) -> None:
        self._secrets: set[str] = set()

    def add(self, *secrets: str | None) -> None:
        for secret in secrets:
            if secret and len(secret) >= 3:
                self._secrets.add(secret)
                register_secret(secret)

    def __call__(self, text: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):
            if secret in text:
                text = text.replace(secret, "***")
        return redact_text(text)
