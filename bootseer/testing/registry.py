"""The CNCF distribution registry (``docker-registry``) on loopback, with optional auth.

:class:`RegistryServer` runs ``docker-registry serve CONFIG.yml`` on 127.0.0.1 with a free port,
filesystem storage under ``root_dir/storage`` and deletes enabled. Authentication:

- ``htpasswd=(user, password)``: Basic auth (distribution's htpasswd provider; bcrypt hashes,
  made with the ``bcrypt`` package);
- ``token_auth=True``: Bearer tokens (docker's token spec). A :class:`TokenServer` (aiohttp on
  its own loop in a daemon thread) checks Basic credentials and issues ES256 JWTs for the
  requested scopes, signed with a key whose self-signed certificate is the registry's
  ``rootcertbundle``; anonymous requests get a token without access. With ``htpasswd`` too,
  those are the token server's credentials.

Like the servers in :mod:`bootseer.testing.servers`, this module does not import pytest; a
missing binary or package raises :class:`ComponentUnavailable`.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import datetime
import hashlib
import json
import os
import secrets
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Self

from bootseer.testing.process_server import (
    LOOPBACK,
    ComponentUnavailable,
    ProcessServer,
    http_ready,
)

__all__ = ["REGISTRY_BINARY", "RegistryServer", "TokenServer", "find_registry"]

REGISTRY_BINARY = "/usr/bin/docker-registry"
TOKEN_ISSUER = "bootseer-test-token-issuer"
TOKEN_SERVICE = "bootseer-test-registry"


def find_registry() -> str:
    """Path of the distribution registry binary; ComponentUnavailable when missing."""
    if os.access(REGISTRY_BINARY, os.X_OK):
        return REGISTRY_BINARY
    for name in ("docker-registry", "registry"):
        found = shutil.which(name)
        if found:
            return found
    raise ComponentUnavailable(
        "the CNCF distribution registry is not installed: apt-get install docker-registry"
    )


def _bcrypt_hash(password: str) -> str:
    try:
        import bcrypt
    except ImportError as exc:
        raise ComponentUnavailable(
            f"htpasswd auth needs bcrypt hashes; the bcrypt package is missing ({exc}): "
            "pip install bcrypt"
        ) from exc
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


# --------------------------------------------------------------------------------------------
# token server
# --------------------------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _libtrust_key_id(der_public_key: bytes) -> str:
    """docker/libtrust's key id: SHA-256 of the DER SubjectPublicKeyInfo, first 240 bits,
    base32, in groups of four joined by ':' (what distribution matches a JWT's ``kid`` to)."""
    digest = hashlib.sha256(der_public_key).digest()[:30]
    text = base64.b32encode(digest).decode("ascii").rstrip("=")
    return ":".join(text[i : i + 4] for i in range(0, len(text), 4))


class TokenServer:
    """A docker token-spec server on 127.0.0.1 (``GET /token``) for one user.

    ``users`` maps user names to passwords. Authenticated users get every action they ask
    for on any ``repository`` scope (or only those in ``grants``, ``{user: {repo: actions}}``);
    anonymous callers get a token with no access. Wrong credentials get HTTP 401.
    ``requests`` counts token requests, ``scopes_seen`` records the scopes asked for and
    ``issued`` the tokens handed out (tests check that they never leak into logs).
    """

    def __init__(
        self,
        users: dict[str, str],
        cert_dir: str | os.PathLike[str],
        *,
        grants: dict[str, dict[str, list[str]]] | None = None,
        expires_in: int = 300,
    ) -> None:
        try:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import NameOID
        except ImportError as exc:  # pragma: no cover - cryptography comes with moto
            raise ComponentUnavailable(
                f"token auth needs the cryptography package ({exc}): pip install cryptography"
            ) from exc
        self.users = dict(users)
        self.grants = grants
        self.expires_in = expires_in
        self.requests = 0
        self.scopes_seen: list[str] = []
        self.issued: list[str] = []
        self.port = 0
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TOKEN_ISSUER)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = Path(cert_dir) / "token-signing.crt"
        self.cert_path.parent.mkdir(parents=True, exist_ok=True)
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        spki = self._key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.key_id = _libtrust_key_id(spki)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def realm(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/token"

    # -- tokens -----------------------------------------------------------------------------

    def make_token(self, subject: str, access: list[dict[str, Any]]) -> str:
        """An ES256 JWT the registry accepts (issuer, audience, kid of the signing key)."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "kid": self.key_id}
        claims = {
            "iss": TOKEN_ISSUER,
            "sub": subject,
            "aud": TOKEN_SERVICE,
            "exp": now + self.expires_in,
            "nbf": now - 10,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing_input = (
            _b64url(json.dumps(header, separators=(",", ":")).encode())
            + "."
            + _b64url(json.dumps(claims, separators=(",", ":")).encode())
        )
        der = self._key.sign(signing_input.encode("ascii"), ec.ECDSA(hashes.SHA256()))
        r, s = decode_dss_signature(der)
        return signing_input + "." + _b64url(r.to_bytes(32, "big") + s.to_bytes(32, "big"))

    def _grant(self, user: str | None, scopes: list[str]) -> list[dict[str, Any]]:
        access: list[dict[str, Any]] = []
        if user is None:
            return access
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            if kind != "repository" or not name:
                continue
            wanted = [a for a in actions.split(",") if a]
            if self.grants is not None:
                allowed = set(self.grants.get(user, {}).get(name, []))
                wanted = [a for a in wanted if a in allowed or "*" in allowed]
            if wanted:
                access.append({"type": "repository", "name": name, "actions": wanted})
        return access

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        self.requests += 1
        scopes: list[str] = []
        for value in request.query.getall("scope", []):
            scopes.extend(s for s in value.split(" ") if s)
        self.scopes_seen.extend(scopes)
        if request.query.get("service") != TOKEN_SERVICE:
            return web.json_response({"details": "unknown service"}, status=400)
        user: str | None = None
        header = request.headers.get("Authorization", "")
        if header:
            scheme, _, value = header.partition(" ")
            try:
                name, sep, password = base64.b64decode(value).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                sep, name, password = "", "", ""
            known = self.users.get(name)
            if (
                scheme.lower() != "basic"
                or not sep
                or known is None
                or not secrets.compare_digest(known, password)
            ):
                return web.json_response(
                    {"details": "invalid credentials"},
                    status=401,
                    headers={"WWW-Authenticate": 'Basic realm="bootseer-test-token"'},
                )
            user = name
        token = self.make_token(user or "", self._grant(user, scopes))
        self.issued.append(token)
        issued = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return web.json_response(
            {
                "token": token,
                "access_token": token,
                "expires_in": self.expires_in,
                "issued_at": issued,
            }
        )

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is not None:
            return self
        from aiohttp import web

        loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()

        async def open_site() -> None:
            app = web.Application()
            app.router.add_get("/token", self._handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, LOOPBACK, 0)
            await site.start()
            self._runner = runner
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(open_site())
            except BaseException as exc:
                ready.set_exception(exc)
                loop.close()
                return
            ready.set_result(None)
            try:
                loop.run_forever()
            finally:
                if self._runner is not None:
                    loop.run_until_complete(self._runner.cleanup())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="bootseer-token-server", daemon=True)
        self._thread.start()
        try:
            ready.result(timeout=30)
        except BaseException:
            self._thread = self._loop = None
            raise
        return self

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        self._thread = self._loop = None
        if thread is None or loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


class RegistryServer(ProcessServer):
    """``docker-registry serve`` on 127.0.0.1 with storage under ``root_dir``.

    ``.host`` is ``127.0.0.1:PORT`` (what a client or an image reference uses), ``.url`` is
    ``http://127.0.0.1:PORT``. ``blob_path(digest)`` is the file that holds a blob's bytes
    (tests corrupt it to check digest verification). ``stop()`` terminates the process and
    waits; ``start()`` again reuses port and storage. Ready when ``/v2/`` answers with
    distribution's API version header (401 with auth on).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        htpasswd: tuple[str, str] | None = None,
        token_auth: bool = False,
        token_grants: dict[str, dict[str, list[str]]] | None = None,
        port: int | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        self.root_dir = Path(root_dir).resolve()
        super().__init__(
            port=port,
            name="docker-registry",
            ready=http_ready("/v2/", header="Docker-Distribution-Api-Version"),
            log_path=self.root_dir / "registry.log",
            cwd=self.root_dir,
            start_timeout=start_timeout,
            poll_interval=0.02,
        )
        self.htpasswd = htpasswd
        self.token_auth = token_auth
        self.token_grants = token_grants
        self.token_server: TokenServer | None = None
        self._binary = ""
        self._secret = secrets.token_hex(16)

    # -- properties -------------------------------------------------------------------------

    @property
    def storage_dir(self) -> Path:
        return self.root_dir / "storage"

    @property
    def config_path(self) -> Path:
        return self.root_dir / "config.yml"

    @property
    def credentials(self) -> tuple[str, str] | None:
        """The (user, password) the registry (or its token server) accepts, if any."""
        return self.htpasswd

    def blob_path(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes."""
        algo, _, hexpart = digest.partition(":")
        return self.storage_dir / "docker/registry/v2/blobs" / algo / hexpart[:2] / hexpart / "data"

    # -- config -----------------------------------------------------------------------------

    def config_text(self) -> str:
        """The registry's YAML configuration (JSON is YAML; written as such)."""
        config: dict[str, Any] = {
            "version": "0.1",
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage_dir)},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": {
                "addr": self.host,
                "secret": self._secret,
                "headers": {"X-Content-Type-Options": ["nosniff"]},
            },
            "health": {"storagedriver": {"enabled": False}},
        }
        if self.token_auth:
            assert self.token_server is not None
            config["auth"] = {
                "token": {
                    "realm": self.token_server.realm,
                    "service": TOKEN_SERVICE,
                    "issuer": TOKEN_ISSUER,
                    "rootcertbundle": str(self.token_server.cert_path),
                }
            }
        elif self.htpasswd is not None:
            config["auth"] = {
                "htpasswd": {
                    "realm": "bootseer-test-registry",
                    "path": str(self.root_dir / "htpasswd"),
                }
            }
        return json.dumps(config, indent=2) + "\n"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the registry and wait until ``/v2/`` answers (no-op when running)."""
        if self.running:
            return self
        self._binary = find_registry()
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.storage_dir.mkdir(exist_ok=True)
        if self.htpasswd is not None and not self.token_auth:
            user, password = self.htpasswd
            if ":" in user or "\n" in user:
                raise ValueError(f"htpasswd user name {user!r} may hold neither ':' nor newline")
            path = self.root_dir / "htpasswd"
            path.write_text(f"{user}:{_bcrypt_hash(password)}\n")
            path.chmod(0o600)
        if self.token_auth and self.token_server is None:
            users = {self.htpasswd[0]: self.htpasswd[1]} if self.htpasswd else {}
            self.token_server = TokenServer(
                users, self.root_dir / "token", grants=self.token_grants
            ).start()
        return super().start()

    def prepare(self) -> None:
        self.config_path.write_text(self.config_text())  # it names the port

    def argv(self) -> list[str]:
        return [self._binary, "serve", str(self.config_path)]

    def popen_env(self) -> dict[str, str]:
        # REGISTRY_* variables override the config file: none from the caller's environment
        return {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}

    def stop(self) -> None:
        """Terminate the registry (SIGTERM, SIGKILL after 10 s) and wait; idempotent. The
        token server keeps running (a restarted registry uses it again); ``close()`` stops
        both."""
        super().stop()

    def close(self) -> None:
        super().close()
        if self.token_server is not None:
            self.token_server.stop()
            self.token_server = None

    def __repr__(self) -> str:
        auth = "token" if self.token_auth else "htpasswd" if self.htpasswd else "no auth"
        state = "running" if self.running else "stopped"
        return f"RegistryServer({self.url}, {auth}, {state})"
