"""How the ``bootseer`` command reports a failure: the one place errors become messages.

:func:`translate_errors` wraps every command at the entry point (like torch elastic's
``@record``). A known error becomes one line, ``bootseer: error: ...``, that names the object
and the fix, with exit code 2; anything else is a bug and prints its traceback, exit code 1;
``-vv`` prints the traceback of a known error too (before its line). Every message is
redacted: a credential in an error's text never reaches the terminal.

Known errors:

- the libraries' roots: ``CheckpointError`` (ckpt), ``SnapshotError`` (snapshot),
  ``PrefetchError`` (prefetch), ``StripedError`` (striped_fs);
- bootseer's own: ``CliError`` (and ``StartupError``), ``ConfigError``, ``ReportError``,
  ``WarmupError`` and the robust layer's input errors;
- the environment: ``OSError`` (a path, a permission, the network) and the storage client's
  errors (botocore), named with the store the command works on and what to check;
- a plain ``ValueError``: bootseer's code still raises some for bad input (``--nproc 1``,
  ``HOST:PORT``), so it stays a one-line error (``-vv`` shows where it came from).

A library's classes are looked up in ``sys.modules``, never imported here: an error of a
module that was not loaded cannot have been raised, and ``bootseer fs`` does not pay for
importing torch, aiohttp or grpc.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections.abc import Iterator

from striped_fs import redact

# its home is below the command line (bootseer.startup raises it too); imported from here
from ..errors import CliError as CliError

#: Exit codes: a known error (bad input, an unreachable store...), and a bug.
EXIT_KNOWN = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130

#: (module, class): errors whose message already names the object and the fix.
KNOWN_ROOTS = (
    ("bootseer.errors", "CliError"),
    ("bootseer.config", "ConfigError"),
    ("bootseer.report", "ReportError"),
    ("bootseer.warmup", "WarmupError"),
    ("bootseer.robust.records", "RecordError"),
    ("bootseer.robust.update", "VersionError"),
    ("bootseer.robust.seal", "SealError"),
    ("bootseer.robust.wire", "WireError"),
    ("bootseer.colltrace.validate", "RingInvalid"),
    ("ckpt.errors", "CheckpointError"),
    ("snapshot.errors", "SnapshotError"),
    ("prefetch.errors", "PrefetchError"),
    ("striped_fs.errors", "StripedError"),
)

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
def translate_errors(args: argparse.Namespace) -> Iterator[None]:
    """Run a command: a failure leaves as ``SystemExit`` with its code, after its message
    (and, for a bug or under ``-vv``, its traceback) went to stderr."""
    try:
        yield
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as exc:
        raise SystemExit(report(exc, args)) from None


def report(exc: BaseException, args: argparse.Namespace) -> int:
    """Print ``exc`` the way a person should see it; returns the exit code."""
    message = person_facing(exc, args)
    if message is None or getattr(args, "verbose", 0) >= 2:
        traceback.print_exception(exc, file=sys.stderr)
    if message is None:
        text = redact(f"{type(exc).__name__}: {exc}")
        print(
            f"bootseer: error: unexpected {text} (a bug in bootseer: the traceback above "
            "says where; please report it)",
            file=sys.stderr,
        )
        return EXIT_BUG
    print(f"bootseer: error: {redact(message)}", file=sys.stderr)
    return EXIT_KNOWN


def person_facing(exc: BaseException, args: argparse.Namespace | None = None) -> str | None:
    """The one-line message for a known error (not yet redacted), None for a bug."""
    if is_store_failure(exc):
        return _naming_the_store(exc, store_of(args))
    if isinstance(exc, (*known_roots(), ValueError, OSError)):
        return str(exc) or type(exc).__name__
    return None


def known_roots() -> tuple[type[BaseException], ...]:
    """The classes of :data:`KNOWN_ROOTS` whose modules are loaded."""
    found = []
    for module, name in KNOWN_ROOTS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def is_store_failure(exc: BaseException) -> bool:
    """An OSError (a striped read that gave up included) or a storage client's error, not
    one of the roots that says what to do itself (a missing checkpoint, an unsafe path)."""
    if is_storage_client_error(exc):
        return True
    if not isinstance(exc, OSError):
        return False
    striped = sys.modules.get("striped_fs.errors")
    if striped is not None and isinstance(exc, striped.StripedIOError | striped.ShortReadError):
        return True
    return not isinstance(exc, known_roots())


def store_of(args: argparse.Namespace | None) -> str | None:
    """The store a command works on: the arguments it names in ``store_args`` (its parser's
    ``set_defaults(store_args=("url",))``), joined as ``SRC -> DST``."""
    names = getattr(args, "store_args", ()) if args is not None else ()
    values = [str(getattr(args, n)) for n in names if getattr(args, n, None)]
    return " -> ".join(values) or None


def _naming_the_store(exc: BaseException, store: str | None) -> str:
    """``STORE: what failed; what to check``. Without a store only the error's text: the
    hints are about stores, and would mislead for a local file of another command."""
    what = f"{type(exc).__name__}: {exc}" if is_storage_client_error(exc) else str(exc)
    what = what or type(exc).__name__
    if store is None:
        return what
    causes = (exc, exc.__cause__)  # a StripedIOError after retries: what it gave up on
    hint = next((h for kinds, h in _STORE_HINTS for c in causes if isinstance(c, kinds)), None)
    if hint is None and is_storage_client_error(exc):
        hint = "check the store's URL, credentials and endpoint_url"
    message = f"{store}: {what}"
    return f"{message}; {hint}" if hint else message


def is_storage_client_error(exc: BaseException) -> bool:
    """botocore's errors (not imported unless a store client already loaded them)."""
    bce = sys.modules.get("botocore.exceptions")
    return bce is not None and isinstance(exc, bce.BotoCoreError | bce.ClientError)
