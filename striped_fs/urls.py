"""Turn what a person types (``./x``, ``s3://b/k``, ``striped::http://h/f``) into a striped fs."""

from __future__ import annotations

import os
from typing import Any

import fsspec

from .config import OptionError
from .filesystem import StripedFileSystem

# Protocols whose fsspec implementation is known to work under striped (hdfs via pyarrow).
KNOWN_TARGETS = {"file", "local", "memory", "s3", "s3a", "http", "https", "hdfs", "viewfs"}


def to_striped_url(url: str) -> str:
    """``s3://b/k`` -> ``striped::s3://b/k``; a bare path becomes an absolute ``file://`` URL."""
    if url.startswith("striped::"):
        return url
    if "://" not in url and "::" not in url:
        return f"striped::file://{os.path.abspath(url)}"
    return f"striped::{url}"


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None,
              **stripe_options: Any) -> tuple[StripedFileSystem, str]:
    """A :class:`StripedFileSystem` and the path inside it for ``url``.

    ``storage_options`` are fsspec's, keyed by protocol (``{"s3": {"endpoint_url": ...}}``);
    ``stripe_options`` (``stripe_size``, ``concurrency``...) configure the striping.
    """
    striped = to_striped_url(url)
    target = striped[len("striped::"):]
    protocol = target.split("://", 1)[0] if "://" in target else "file"
    if protocol not in KNOWN_TARGETS and protocol not in fsspec.available_protocols():
        raise OptionError(
            f"{url}: unknown protocol {protocol!r}; use a path or one of "
            f"{', '.join(sorted(KNOWN_TARGETS))} (e.g. striped::s3://bucket/key)")
    options = storage_options or {}
    striped_kw = {**options.get("striped", {}),
                  **{k: v for k, v in stripe_options.items() if v is not None}}
    # Options for protocols this URL does not use (s3 options while copying a local file)
    # are dropped: fsspec would hand them to the outermost filesystem.
    kwargs = {protocol: options[protocol]} if protocol in options else {}
    fs, path = fsspec.core.url_to_fs(striped, striped=striped_kw, **kwargs)
    if not isinstance(fs, StripedFileSystem):  # pragma: no cover - defensive
        raise OptionError(f"{url}: did not resolve to a striped filesystem")
    return fs, path
