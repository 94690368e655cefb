"""Authenticated records in the job's c10d store: HMAC-SHA256 under the job's secret.

Why: torch's TCPStore has no authentication. Whoever reaches its port could write
``version/current`` (a node restarted on a version with ``BASH_ENV=...`` ran that file as
the node's user), a verdict (evict any node), a dump order or a forged dump answer. Every
bootseer record is therefore sealed by its writer and opened by its reader; a record whose
MAC fails is refused (the reader warns naming the key and carries on).

A sealed value is ``bs1.<64 hex MAC>.<body>``: the body is the record's JSON, unchanged, and
the MAC is HMAC-SHA256(secret, ``bootseer-store-v1`` NUL key NUL body). The key is inside the
MAC, and every key of an incident, a round, a probe or an event names its number, so a sealed
record cannot be replayed under another key, incident or node; the readers also check that
the number inside the body is the key's (:mod:`.records`).

The secret: ``BOOTSEER_JOB_SECRET``, the same on the controller, every node and whoever
publishes (at least 16 characters; e.g. a Kubernetes Secret). Without it nothing is sealed
nor trusted: the controller, ``bootseer run --controller`` and ``publish`` refuse to start
(:func:`require_secret`), so the default is that no unauthenticated record can make a node
run code, load a state or evict a node. The secret is never logged nor put in a message.
torch's own rendezvous keys are not sealed (torch reads them).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

__all__ = [
    "MIN_SECRET",
    "SECRET_ENV",
    "MissingSecret",
    "SealError",
    "job_secret",
    "mac",
    "open_sealed",
    "require_secret",
    "seal",
]

SECRET_ENV = "BOOTSEER_JOB_SECRET"
MIN_SECRET = 16
PREFIX = b"bs1."
_DOMAIN = b"bootseer-store-v1\0"
_MAC_HEX = 64
OVERHEAD = len(PREFIX) + _MAC_HEX + 1  # bytes a seal adds to a record


class SealError(ValueError):
    """A record that is not sealed, or whose MAC is not the job's for its key."""


class MissingSecret(SealError):
    """No job secret configured: nothing can be sealed nor trusted."""


def job_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from ``BOOTSEER_JOB_SECRET`` (None when unset or empty); one shorter
    than :data:`MIN_SECRET` is refused with :class:`MissingSecret`."""
    value = (os.environ if env is None else env).get(SECRET_ENV, "")
    if not value:
        return None
    if len(value) < MIN_SECRET:
        raise MissingSecret(
            f"{SECRET_ENV} is {len(value)} characters: use at least "
            f"{MIN_SECRET} random ones (e.g. python -c 'import secrets; "
            "print(secrets.token_hex(32))')"
        )
    return value.encode()


def require_secret(what: str, env: Mapping[str, str] | None = None) -> bytes:
    """The job's secret, or :class:`MissingSecret` saying ``what`` needs it and how to set
    it."""
    secret = job_secret(env)
    if secret is None:
        raise MissingSecret(
            f"{what} needs the job's secret in {SECRET_ENV}: the same value on the "
            "controller, on every node (bootseer run --controller) and for bootseer "
            "controller publish, at least 16 random characters (e.g. python -c 'import "
            "secrets; print(secrets.token_hex(32))'; on Kubernetes the Secret bootseer-job, "
            "deploy/kubernetes/jobset.yaml). Without it no record of the job's store can be "
            "trusted: the store has no authentication of its own (docs/security.md)"
        )
    return secret


def mac(secret: bytes, key: str, body: bytes) -> str:
    """HMAC-SHA256 of ``body`` bound to ``key`` (hex)."""
    return hmac.new(secret, _DOMAIN + key.encode() + b"\0" + body, hashlib.sha256).hexdigest()


def seal(key: str, body: bytes, secret: bytes | None = None) -> bytes:
    """``body`` sealed for ``key`` (the value to store)."""
    secret = secret if secret is not None else require_secret(f"writing {key}")
    return PREFIX + mac(secret, key, body).encode() + b"." + body


def open_sealed(key: str, data: bytes, secret: bytes | None = None) -> bytes:
    """The body of a value sealed for ``key``; :class:`SealError` when it is not sealed,
    its MAC is not the job's for this key, or no secret is configured."""
    secret = secret if secret is not None else job_secret()
    if secret is None:
        raise MissingSecret(f"{key}: no job secret ({SECRET_ENV}) to check the record: refused")
    if (
        not isinstance(data, bytes | bytearray)
        or len(data) < OVERHEAD
        or not data.startswith(PREFIX)
        or data[OVERHEAD - 1 : OVERHEAD] != b"."
    ):
        raise SealError(f"{key}: not a sealed record (no MAC): refused")
    got, body = bytes(data[len(PREFIX) : OVERHEAD - 1]), bytes(data[OVERHEAD:])
    if not hmac.compare_digest(got, mac(secret, key, body).encode()):
        raise SealError(
            f"{key}: the MAC is not the job's for this key (forged, replayed "
            f"from another key, or another {SECRET_ENV}): refused"
        )
    return body
