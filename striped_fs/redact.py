"""Credentials never leave the process: one redaction for every message, log and file.

``redact(x)`` is the one function: text, or any structure of dicts/lists/tuples holding text
(a trace span, a JSON document), comes back with every credential it can recognise replaced by
``***``:

* the user-info part of a URL that carries a password (``s3://KEY:SECRET@bucket/k`` becomes
  ``s3://***@bucket/k``), and any user-info on object-store schemes (there the user *is* the
  access key id);
* values named like a credential, in ``name=value``, ``name: value``, ``"name": "value"`` or
  ``{'name': b'value'}`` form: ``secret``, ``password``, ``token``, ``aws_secret_access_key``,
  ``aws_session_token``, ... and the HTTP headers ``Authorization``, ``X-Amz-Security-Token``,
  ``X-Amz-Signature``, ``X-Amz-Credential`` (botocore's ``-vv`` debug output prints requests
  with these headers, canonical requests and signatures);
* AWS access key ids (``AKIA…``/``ASIA…``), ``Credential=<key id>/…`` scopes and
  ``Signature:`` lines;
* every value registered as a secret: storage options' credentials (including ``key``),
  a URL's user and password, and the environment's credential variables (AWS_*, registry
  passwords). These are removed wherever they appear, whatever surrounds them.

``redact_options`` hides the credentials of fsspec storage options (``key``, ``secret``,
``token``, ``client_kwargs.aws_secret_access_key``, ...) by key name before they are shown.

The command line installs :class:`RedactingFilter` on its log handlers and wraps its stdout and
stderr with :class:`RedactingStream` (:func:`protect_process`), so third-party debug output is
scrubbed too. A library user gets the same for their own handlers with
:func:`install_log_redaction`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

REDACTED = "***"

# Option and field names whose values are credentials wherever they appear (case-insensitive).
SECRET_NAMES = frozenset(
    {
        "secret",
        "password",
        "passwd",
        "token",
        "access_token",
        "refresh_token",
        "session_token",
        "security_token",
        "aws_secret_access_key",
        "aws_access_key_id",
        "aws_session_token",
        "aws_security_token",
        "secret_access_key",
        "access_key_id",
        "secret_key",
        "access_key",
        "client_secret",
        "account_key",
        "sas_token",
        "api_key",
        "private_key",
        "credentials",
        "authorization",
        "proxy-authorization",
        "x-amz-security-token",
        "x-amz-signature",
        "x-amz-credential",
        "bootseer_registry_password",
    }
)
# Storage options also carry the access key id as ``key`` (s3fs) or ``username``: only there is
# that generic name a credential (elsewhere "key" is, say, a snapshot key).
OPTION_SECRET_NAMES = SECRET_NAMES | {"key", "username"}
# Environment variables whose values are credentials, besides any name containing SECRET,
# PASSWORD, TOKEN or a *_KEY of an access/secret/api/private key.
SECRET_ENV = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "BOOTSEER_REGISTRY_PASSWORD",
    }
)
_SECRET_ENV_RE = re.compile(
    r"(^|_)(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIALS?)(_|$)|(ACCESS|SECRET|API|PRIVATE)_KEY"
)
# Schemes whose user name alone is a credential (the access key id).
_KEY_SCHEMES = {"s3", "s3a", "s3n", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"}
MIN_SECRET_LEN = 8  # shorter values are hidden by name or position only, not verbatim

_names = "|".join(sorted((re.escape(n) for n in SECRET_NAMES), key=len, reverse=True))
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*)://([^\s/@'\"<>]+)@")
# On object stores a bucket holds no ":", so "s3://KEY:SEC/RET@bucket" is a secret with a bare /
_KEY_URL_USERINFO = re.compile(
    rf"(?i)\b({'|'.join(sorted(_KEY_SCHEMES))})://([^\s/@'\"<>:]*:[^\s@'\"<>]*)@"
)
# "name": "value", 'name': b'value', name='value', name: "value"
_QUOTED = re.compile(rf"""(?ix)(?<![\w-])(['"]?)({_names})\1(\s*[:=]\s*b?)(['"])(.*?)\4""")
# name=value (kwargs, query strings, env dumps): up to a separator
_ASSIGNED = re.compile(rf"""(?ix)(?<![\w-])({_names})=(?!['"])([^\s&,;'")}}\]]+)""")
# Name: value (HTTP headers, botocore's canonical requests): to the end of the line
_HEADER = re.compile(
    r"(?im)^(\s*(?:authorization|proxy-authorization|x-amz-security-token)"
    r"\s*:[ \t]*)(?!['\"])(\S.*)$"
)
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|AIPA|ANPA|ANVA|AGPA|ABIA|ACCA)[A-Z0-9]{16}\b")
_CREDENTIAL = re.compile(r"(?i)\b(Credential=)([^/\s,'\"&]+)")
_SIGNATURE = re.compile(r"(?i)\b(Signature[=:]\s*)([0-9a-f]{16,})")

# Every name in SECRET_NAMES, and "credential"/"signature", contains one of these (tested).
_STEMS = ("secret", "passw", "token", "key", "credential", "authoriz", "signature", "x-amz-")

_lock = threading.Lock()
_known: OrderedDict[str, None] = OrderedDict()  # registered secrets, newest last
_MAX_KNOWN = 4096
_pattern: re.Pattern[str] | None = None


def register_secret(*values: Any) -> None:
    """Remember values that must never be shown (a password, a key id, a token)."""
    global _pattern
    added = False
    with _lock:
        for value in values:
            if not isinstance(value, str) or len(value) < MIN_SECRET_LEN:
                continue
            for form in {value, unquote(value)}:
                if len(form) >= MIN_SECRET_LEN and form not in _known:
                    _known[form] = None
                    added = True
        while len(_known) > _MAX_KNOWN:
            _known.popitem(last=False)
        if added:
            _pattern = re.compile(
                "|".join(re.escape(s) for s in sorted(_known, key=len, reverse=True))
            )


def register_options(options: Any) -> None:
    """Register the credentials held in fsspec storage options (any nesting)."""
    if isinstance(options, Mapping):
        for name, value in options.items():
            if (
                isinstance(name, str)
                and name.lower() in OPTION_SECRET_NAMES
                and isinstance(value, str)
            ):
                register_secret(value)
            else:
                register_options(value)
    elif isinstance(options, list | tuple):
        for value in options:
            register_options(value)


def register_url(text: str) -> None:
    """Register the user and password of every URL in ``text`` that carries them."""
    for pattern in (_KEY_URL_USERINFO, _URL_USERINFO):
        for match in pattern.finditer(text):
            user, _, password = match.group(2).partition(":")
            register_secret(user, password)


def register_environ(environ: Mapping[str, str] | None = None) -> None:
    """Register the environment's credentials: AWS_* keys and tokens, registry passwords, any
    variable named like a secret, URLs with passwords and BOOTSEER_STORAGE_OPTIONS."""
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if is_secret_env(name):
            register_secret(value)
        elif name == "BOOTSEER_STORAGE_OPTIONS":
            register_text(value)
        elif "://" in value and "@" in value:
            register_url(value)


def register_text(text: str) -> None:
    """Register what a command-line argument or variable holds: URLs with user-info, or
    storage options as JSON."""
    register_url(text)
    if text.lstrip().startswith("{"):
        try:
            register_options(json.loads(text))
        except ValueError:
            pass


def is_secret_env(name: str) -> bool:
    upper = name.upper()
    return upper in SECRET_ENV or bool(_SECRET_ENV_RE.search(upper))


def _userinfo(match: re.Match[str]) -> str:
    scheme, info = match.group(1), match.group(2)
    if ":" in info or scheme.lower() in _KEY_SCHEMES:
        return f"{scheme}://{REDACTED}@"
    return match.group(0)


def _quoted(match: re.Match[str]) -> str:
    value = match[5]
    # An AWS signature header keeps its shape (scope, signed headers) for debugging: only the
    # key id and the signature go. Any other credential value goes whole.
    shown = (
        _SIGNATURE.sub(
            lambda m: f"{m[1]}{REDACTED}", _CREDENTIAL.sub(lambda m: f"{m[1]}{REDACTED}", value)
        )
        if value.startswith("AWS4-HMAC-SHA256 ")
        else REDACTED
    )
    return f"{match[1]}{match[2]}{match[1]}{match[3]}{match[4]}{shown}{match[4]}"


def redact_text(text: str) -> str:
    """``text`` with every credential it holds replaced by ``***``."""
    if len(text) < 6:  # a newline, a progress tick: nothing fits (cheap for every write)
        return text
    pattern = _pattern
    if pattern is not None:
        text = pattern.sub(REDACTED, text)
    if "@" in text:
        text = _KEY_URL_USERINFO.sub(lambda m: f"{m[1]}://{REDACTED}@", text)
        text = _URL_USERINFO.sub(_userinfo, text)
    text = _AWS_KEY_ID.sub(REDACTED, text)
    low = text.lower()
    # The patterns below only apply near these words: skip them on ordinary lines.
    if any(stem in low for stem in _STEMS):
        text = _QUOTED.sub(_quoted, text)
        text = _ASSIGNED.sub(lambda m: f"{m[1]}={REDACTED}", text)
        text = _HEADER.sub(lambda m: f"{m[1]}{REDACTED}", text)
        text = _CREDENTIAL.sub(lambda m: f"{m[1]}{REDACTED}", text)
        text = _SIGNATURE.sub(lambda m: f"{m[1]}{REDACTED}", text)
    return text


def redact(value: Any) -> Any:
    """Text, or dicts/lists/tuples of it, with credentials replaced by ``***``; values under a
    credential's name (``secret``, ``password``, ``token``, ...) are hidden whole."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            k: _hidden(v) if isinstance(k, str) and k.lower() in SECRET_NAMES else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    return value


def redact_options(options: Any) -> Any:
    """Storage options as they may be shown: every credential (``key``, ``secret``,
    ``token``, ``client_kwargs.aws_secret_access_key``, ...) hidden, the rest kept."""
    if isinstance(options, Mapping):
        return {
            k: _hidden(v)
            if isinstance(k, str) and k.lower() in OPTION_SECRET_NAMES
            else redact_options(v)
            for k, v in options.items()
        }
    if isinstance(options, list | tuple):
        return type(options)(redact_options(v) for v in options)
    return redact(options)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line as it may be logged: ``NAME=value`` assignments of credential variables
    and ``--storage-options``/BOOTSEER_STORAGE_OPTIONS JSON hidden, URLs scrubbed."""
    shown: list[str] = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and name.upper() == name:
            shown.append(f"{name}={_redact_env_value(name, value)}")
        elif shown and shown[-1] == "--storage-options":
            shown.append(_redact_json_options(arg))
        elif arg.startswith("--storage-options="):
            shown.append("--storage-options=" + _redact_json_options(arg.split("=", 1)[1]))
        else:
            shown.append(redact_text(arg))
    return shown


def _redact_env_value(name: str, value: str) -> str:
    if is_secret_env(name):
        return REDACTED
    if name == "BOOTSEER_STORAGE_OPTIONS":
        return _redact_json_options(value)
    return redact_text(value)


def _redact_json_options(text: str) -> str:
    try:
        return json.dumps(redact_options(json.loads(text)))
    except ValueError:
        return REDACTED


def _hidden(value: Any) -> Any:
    return REDACTED if value not in (None, "") else value


class RedactingFilter(logging.Filter):
    """A handler filter: the record's message, arguments, traceback and stack are redacted
    before any formatter sees them (install it on handlers, which see every record that
    reaches them, not on loggers, whose filters skip records of their children)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format is the handler's error to report
            return True
        record.msg, record.args = redact_text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def install_log_redaction(handlers: Iterable[logging.Handler] | None = None) -> None:
    """Add :class:`RedactingFilter` to ``handlers`` (default: the root logger's), once."""
    for handler in logging.getLogger().handlers if handlers is None else handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


class RedactingStream:
    """A text stream whose writes are redacted (every other attribute is the wrapped
    stream's: ``isatty``, ``fileno``, ``buffer``...)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact_text(text) if isinstance(text, str) else text)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def protect_process(argv: Iterable[str] = ()) -> None:
    """For a command-line entry point: register the credentials given in ``argv`` and the
    environment, and redact everything written to stdout and stderr (prints, tracebacks,
    warnings, log handlers writing there)."""
    import sys

    register_environ()
    for arg in argv:
        register_text(arg)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
