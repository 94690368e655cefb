"""The one redaction (``striped_fs.redact``): what it hides, what it keeps, and the places that
use it (URL credentials, errors, log records, traces). The command line end to end, against
a real S3 server, is in test_cli_credentials.py."""

from __future__ import annotations

import json
import logging

import pytest

from striped_fs.redact import (
    RedactingFilter,
    RedactingStream,
    is_secret_env,
    redact,
    redact_argv,
    redact_options,
    register_environ,
)

KEY_ID = "AKIAREDACTTEST000001"
SECRET = "rEdAcTsEcReT/0123456789+abcdefghijklmnop"


@pytest.mark.parametrize(
    "text, shown",
    [
        (f"s3://{KEY_ID}:{SECRET.replace('/', '%2F')}@bucket/ckpt", "s3://***@bucket/ckpt"),
        (f"striped::s3://{KEY_ID}:{SECRET}@bucket/ckpt", "striped::s3://***@bucket/ckpt"),
        (f"s3://{KEY_ID}@bucket/k", "s3://***@bucket/k"),  # on object stores the user is the key id
        ("https://user:hunter2@index.example/simple", "https://***@index.example/simple"),
        # kept: a user name without password elsewhere, image digests, '@' in paths
        ("hdfs://alice@namenode:8020/ckpt", "hdfs://alice@namenode:8020/ckpt"),
        ("oci://127.0.0.1:5000/repo@sha256:00ff", "oci://127.0.0.1:5000/repo@sha256:00ff"),
        ("http://127.0.0.1:8080/v2/a@b", "http://127.0.0.1:8080/v2/a@b"),
        # names of credentials, in every spelling logs use
        (
            '{"secret": "abc", "token": null, "tokens": 3}',
            '{"secret": "***", "token": null, "tokens": 3}',
        ),
        (
            "S3FileSystem(key=x, secret=abc, token=def)",
            "S3FileSystem(key=x, secret=***, token=***)",
        ),
        (
            "AWS_SECRET_ACCESS_KEY=abc AWS_SESSION_TOKEN='def'",
            "AWS_SECRET_ACCESS_KEY=*** AWS_SESSION_TOKEN='***'",
        ),
        (
            "?X-Amz-Credential=AK%2F1&X-Amz-Signature=00aa&X-Amz-Security-Token=tt&x=1",
            "?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***&x=1",
        ),
        # botocore at -vv: the prepared request, the canonical request, the signature
        (
            "headers={'Authorization': b'AWS4-HMAC-SHA256 Credential="
            + KEY_ID
            + "/20260101/us-east-1/"
            "s3/aws4_request, SignedHeaders=host;x-amz-date, Signature=" + "ab" * 32 + "', "
            "'X-Amz-Security-Token': b'FwoGZXIvYXdzEJr', 'X-Amz-Date': b'20260101T000000Z'}",
            "headers={'Authorization': b'AWS4-HMAC-SHA256 Credential=***/20260101/us-east-1/s3/"
            "aws4_request, SignedHeaders=host;x-amz-date, Signature=***', "
            "'X-Amz-Security-Token': b'***', 'X-Amz-Date': b'20260101T000000Z'}",
        ),
        ("{'Authorization': 'Basic dXNlcjpwYXNz'}", "{'Authorization': '***'}"),
        (
            "host:127.0.0.1\nx-amz-security-token:FwoGZXIvYXdz\nx-amz-date:2026",
            "host:127.0.0.1\nx-amz-security-token:***\nx-amz-date:2026",
        ),
        ("Authorization: Bearer eyJhbGciOi", "Authorization: ***"),
        ("Signature:\n" + "0f" * 32, "Signature:\n***"),
        (f"InvalidAccessKeyId for {KEY_ID}", "InvalidAccessKeyId for ***"),
        # a generic "key" is not a credential outside storage options (snapshot keys, JSON)
        ('{"key": "3f2a9c", "kind": "venv"}', '{"key": "3f2a9c", "kind": "venv"}'),
    ],
)
def test_redact_text(text, shown):
    assert redact(text) == shown


def test_every_credential_name_passes_the_quick_check():
    from striped_fs.redact import _STEMS, SECRET_NAMES

    assert all(any(stem in name for stem in _STEMS) for name in SECRET_NAMES)


def test_redact_structures_and_options():
    span = {
        "detail": {"url": f"s3://{KEY_ID}:x@b/c", "password": "pw", "key": "3f2a"},
        "list": ("ok", "secret=abc"),
    }
    assert redact(span) == {
        "detail": {"url": "s3://***@b/c", "password": "***", "key": "3f2a"},
        "list": ("ok", "secret=***"),
    }
    options = {
        "s3": {
            "key": KEY_ID,
            "secret": SECRET,
            "endpoint_url": "http://127.0.0.1:9",
            "client_kwargs": {
                "aws_secret_access_key": SECRET,
                "aws_session_token": "tok",
                "region_name": "us-east-1",
            },
            "username": "u",
            "password": "p",
            "anon": False,
        }
    }
    assert redact_options(options) == {
        "s3": {
            "key": "***",
            "secret": "***",
            "endpoint_url": "http://127.0.0.1:9",
            "client_kwargs": {
                "aws_secret_access_key": "***",
                "aws_session_token": "***",
                "region_name": "us-east-1",
            },
            "username": "***",
            "password": "***",
            "anon": False,
        }
    }


def test_redact_argv_for_logged_command_lines():
    options = json.dumps({"s3": {"key": KEY_ID, "secret": SECRET, "endpoint_url": "http://e"}})
    argv = [
        "ctr",
        "run",
        "--env",
        f"BOOTSEER_STORAGE_OPTIONS={options}",
        "--env",
        f"AWS_SECRET_ACCESS_KEY={SECRET}",
        "--env",
        "PYTHONUNBUFFERED=1",
        "--storage-options",
        options,
        f"--storage-options={options}",
        f"s3://{KEY_ID}:{SECRET}@b/c",
    ]
    shown = " ".join(redact_argv(argv))
    assert KEY_ID not in shown and SECRET not in shown
    assert "PYTHONUNBUFFERED=1" in shown and '"endpoint_url": "http://e"' in shown
    assert "AWS_SECRET_ACCESS_KEY=***" in shown and "s3://***@b/c" in shown


def test_environment_credentials_are_registered_and_scrubbed_verbatim():
    env = {
        "AWS_ACCESS_KEY_ID": "AKIAENVREGISTERED001",
        "AWS_SECRET_ACCESS_KEY": "envSecret123",
        "HF_TOKEN": "hf_registeredtoken",
        "BOOTSEER_REGISTRY_PASSWORD": "registryPw99",
        "TOKENIZERS_PARALLELISM": "false",
        "MY_URL": "https://bob:bobsPassword1@host/x",
        "BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": {"key": "optKeyRegistered"}}),
    }
    assert not is_secret_env("TOKENIZERS_PARALLELISM") and is_secret_env("HF_TOKEN")
    register_environ(env)
    text = (
        "AKIAENVREGISTERED001 envSecret123 hf_registeredtoken registryPw99 bobsPassword1 "
        "optKeyRegistered false"
    )
    assert redact(text) == "*** *** *** *** *** *** false"


def test_filter_redacts_message_arguments_and_traceback():
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Collect()
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test_redact.filter")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("store %s unreachable", f"s3://{KEY_ID}:{SECRET}@b/c")
        try:
            raise OSError(f"cannot reach s3://{KEY_ID}:{SECRET}@b/c")
        except OSError:
            logger.exception("failed with %r", {"secret": SECRET})
    finally:
        logger.removeHandler(handler)
    text = "\n".join(records)
    assert KEY_ID not in text and SECRET not in text
    assert "store s3://***@b/c unreachable" in text and "OSError: cannot reach s3://***@b/c" in text


def test_stream_wrapper_redacts_writes(capsys):
    import sys

    stream = RedactingStream(sys.stdout)
    stream.write(f"copied to s3://{KEY_ID}:{SECRET}@b/c\n")
    assert capsys.readouterr().out == "copied to s3://***@b/c\n"
    assert stream.isatty() == sys.stdout.isatty()  # everything else is the wrapped stream's


def test_url_credentials_become_storage_options(s3_bucket):
    """``s3://KEY:SECRET@bucket/path`` reaches s3fs as key/secret (percent-decoded), and the
    path it returns carries no credentials; credentials given twice are refused."""
    from striped_fs import OptionError
    from striped_fs.urls import split_credentials, url_to_fs

    bucket, options = s3_bucket
    endpoint = {k: v for k, v in options.items() if k not in ("key", "secret")}
    url = f"s3://{KEY_ID}:{SECRET.replace('/', '%2F')}@{bucket}/dir/f.bin"
    fs, path = url_to_fs(url, {"s3": endpoint})
    assert path == f"{bucket}/dir/f.bin"
    assert (fs.target.key, fs.target.secret) == (KEY_ID, SECRET)
    fs.pipe_file(path, b"through the URL's credentials")
    assert fs.cat_file(path) == b"through the URL's credentials"
    assert split_credentials(f"striped::{url}", {"s3": endpoint}) == (
        f"striped::s3://{bucket}/dir/f.bin",
        {"s3": {**endpoint, "key": KEY_ID, "secret": SECRET}},
    )
    assert split_credentials("/local/path", None) == ("/local/path", {})
    with pytest.raises(
        OptionError,
        match=r"s3://\*\*\*@.*given both in the URL and in the s3 "
        r"storage options \(key, secret\)",
    ) as err:
        url_to_fs(url, {"s3": options})
    assert KEY_ID not in str(err.value) and SECRET not in str(err.value)


def test_library_errors_and_traces_never_show_credentials(tmp_path):
    from bootseer.trace import Span, TraceWriter
    from ckpt.errors import CheckpointNotFound, CheckpointStoreUnavailable
    from snapshot.errors import SnapshotNotFound, StoreUnavailable
    from striped_fs import StripedIOError

    url = f"s3://{KEY_ID}:{SECRET}@bucket/x"
    errors = [
        CheckpointNotFound(f"no committed checkpoint under {url}"),
        CheckpointStoreUnavailable(f"store {url} down", url=url),
        SnapshotNotFound(f"no snapshot in {url}"),
        StoreUnavailable(f"{url} unreachable"),
        StripedIOError(f"{url}: failed", path="bucket/x"),
    ]
    for exc in errors:
        shown = f"{exc} {exc!r} {getattr(exc, 'url', '')}"
        assert KEY_ID not in shown and SECRET not in shown and "s3://***@bucket/x" in shown
    assert isinstance(errors[0], FileNotFoundError) and isinstance(errors[2], FileNotFoundError)
    writer = TraceWriter(tmp_path, "node")
    writer.write(Span("node", None, "checkpoint_prefetch", 0.0, 1.0, detail={"url": url}))
    written = writer.path.read_text()
    assert KEY_ID not in written and SECRET not in written and "s3://***@bucket/x" in written
