"""Errors meant for a person: printed without a traceback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from striped_fs.redact import redact


class CliError(Exception):
    """Printed as ``bootseer: error: ...``; exit code 2."""


_STORE_HINTS = (
    (
        FileNotFoundError,
        "check the bucket and the path (and endpoint_url in --storage-options "
        "or BOOTSEER_STORAGE_OPTIONS for a non-AWS store)",
    ),
    (
        PermissionError,
        "check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, "
        "key/secret in --storage-options, or s3://KEY:SECRET@bucket/...",
    ),
    (
        (ConnectionError, TimeoutError),
        "check endpoint_url in --storage-options "
        "(BOOTSEER_STORAGE_OPTIONS) and that the store is up",
    ),
)


@contextlib.contextmanager
def naming_the_store(url: str) -> Iterator[None]:
    """Turn a storage failure into a CliError that names the store (URL without credentials),
    says what failed and what to check."""
    try:
        yield
    except CliError:
        raise
    except Exception as exc:
        if not isinstance(
            exc, OSError | ConnectionError | TimeoutError
        ) and not is_storage_client_error(exc):
            raise
        causes = (exc, exc.__cause__)  # a StripedIOError after retries: what it gave up on
        hint = next((h for kinds, h in _STORE_HINTS for c in causes if isinstance(c, kinds)), None)
        if hint is None and is_storage_client_error(exc):
            hint = "check the store's URL, credentials and endpoint_url"
        message = f"{redact(url)}: {exc}"
        raise CliError(f"{message}; {hint}" if hint else message) from None


def is_storage_client_error(exc: BaseException) -> bool:
    """botocore's errors (not imported unless a store client already loaded them)."""
    import sys

    bce = sys.modules.get("botocore.exceptions")
    return bce is not None and isinstance(exc, bce.BotoCoreError | bce.ClientError)
