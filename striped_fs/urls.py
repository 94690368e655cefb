"""Turn what a person types (``./x``, ``s3://b/k``, ``striped::http://h/f``) into a striped fs."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote

import fsspec

from .errors import OptionError
from .filesystem import StripedFileSystem
from .redact import redact, register_options, register_secret, register_url

# Protocols whose fsspec implementation is known to work under striped (hdfs via pyarrow).
KNOWN_TARGETS = {"file", "local", "memory", "s3", "s3a", "http", "https", "hdfs", "viewfs"}
# Object stores whose credentials may be given in the URL (``s3://KEY:SECRET@bucket/path``).
_KEY_IN_URL = {"s3", "s3a"}
# A bucket name holds neither ":" nor "@", so a secret written with a bare "/" still parses.
_USERINFO = re.compile(r"^(?P<scheme>[a-z0-9]+)://(?P<user>[^/@:]*)(?::(?P<password>[^@]*))?@")


def to_striped_url(url: str) -> str:
    """``s3://b/k`` -> ``striped::s3://b/k``; a bare path becomes an absolute ``file://`` URL."""
    if url.startswith("striped::"):
        return url
    if "://" not in url and "::" not in url:
        return f"striped::file://{os.path.abspath(url)}"
    return f"striped::{url}"


def url_to_fs(
    url: str, storage_options: dict[str, Any] | None = None, **stripe_options: Any
) -> tuple[StripedFileSystem, str]:
    """A :class:`StripedFileSystem` and the path inside it for ``url``.

    ``storage_options`` are fsspec's, keyed by protocol (``{"s3": {"endpoint_url": ...}}``);
    ``stripe_options`` (``stripe_size``, ``concurrency``...) configure the striping.
    """
    striped = to_striped_url(url)
    target = striped[len("striped::") :]
    protocol = target.split("://", 1)[0] if "://" in target else "file"
    if protocol not in KNOWN_TARGETS and protocol not in fsspec.available_protocols():
        raise OptionError(
            f"{redact(url)}: unknown protocol {protocol!r}; use a path or one of "
            f"{', '.join(sorted(KNOWN_TARGETS))} (e.g. striped::s3://bucket/key)"
        )
    options = storage_options or {}
    register_options(options)
    register_url(url)
    if protocol in _KEY_IN_URL:
        target, options = _credentials_from_url(url, target, protocol, options)
        striped = f"striped::{target}"
    striped_kw = {
        **options.get("striped", {}),
        **{k: v for k, v in stripe_options.items() if v is not None},
    }
    # Options for protocols this URL does not use (s3 options while copying a local file)
    # are dropped: fsspec would hand them to the outermost filesystem.
    kwargs = {protocol: options[protocol]} if protocol in options else {}
    fs, path = fsspec.core.url_to_fs(striped, striped=striped_kw, **kwargs)
    if not isinstance(fs, StripedFileSystem):  # pragma: no cover - defensive
        raise OptionError(f"{redact(url)}: did not resolve to a striped filesystem")
    return fs, path


def split_credentials(
    url: str,
    storage_options: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """``s3://KEY:SECRET@bucket/k`` -> (``s3://bucket/k``, storage options with the key and
    secret under ``s3``); any other URL comes back as it is. For handing a URL to another
    process without its credentials on the command line."""
    options = dict(storage_options or {})
    prefix = "striped::" if url.startswith("striped::") else ""
    target = url[len(prefix) :]
    protocol = target.split("://", 1)[0] if "://" in target else "file"
    if protocol not in _KEY_IN_URL:
        return url, options
    target, options = _credentials_from_url(url, target, protocol, options)
    return prefix + target, options


def _credentials_from_url(
    url: str, target: str, protocol: str, options: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """``s3://KEY:SECRET@bucket/k`` -> (``s3://bucket/k``, options with ``key``/``secret``).

    The key and secret are percent-decoded (a secret holding ``/`` or ``@`` must be written
    ``%2F``/``%40``), registered for redaction, and never stay in the URL, so no path, message
    or log line derived from it can show them.
    """
    match = _USERINFO.match(target)
    if match is None:
        return target, options
    key, secret = unquote(match["user"]), unquote(match["password"] or "")
    register_secret(match["user"], match["password"], key, secret)
    given = options.get(protocol) or {}
    clash = sorted({"key", "secret", "username", "password"} & set(given))
    if clash:
        raise OptionError(
            f"{redact(url)}: credentials are given both in the URL and in the {protocol} "
            f"storage options ({', '.join(clash)}); give them in one place"
        )
    creds = {"key": key, **({"secret": secret} if secret else {})}
    bare = f"{match['scheme']}://{target[match.end() :]}"
    return bare, {**options, protocol: {**given, **creds}}
