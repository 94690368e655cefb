"""Credentials never reach a terminal, a log or a file, at any verbosity: real ``bootseer``
commands at ``-vv`` (botocore's debug output included) against moto S3, with distinctive
credentials given in the URL, in the storage options and in the environment. Each command's
stdout, stderr and every file it wrote (traces, caches, mount logs) is searched for them.

moto accepts any key and secret, so the same credentials make one command succeed and, with a
missing bucket, another fail: the failure still names the store (``s3://***@bucket/...``) and
says what to check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import bootseer_cli, log_removed

from striped_fs.redact import redact_argv

URL_KEY = "AKIAURLCREDTEST00001"
URL_SECRET = "urlSecret/Never+Shown0123456789abcdefGH"
OPT_KEY = "AKIAOPTCREDTEST00002"
OPT_SECRET = "optSecretNeverShown0123456789abcdefghIJ"
OPT_TOKEN = "optSessionTokenNeverShown987654"
ENV_KEY = "AKIAENVCREDTEST00003"
ENV_SECRET = "envSecretNeverShown0123456789abcdefghKL"
ENV_TOKEN = "envSessionTokenNeverShown123456"
SECRETS = [
    URL_KEY,
    URL_SECRET,
    URL_SECRET.replace("/", "%2F"),
    OPT_KEY,
    OPT_SECRET,
    OPT_TOKEN,
    ENV_KEY,
    ENV_SECRET,
    ENV_TOKEN,
]


def _url(bucket: str, path: str) -> str:
    return f"s3://{URL_KEY}:{URL_SECRET.replace('/', '%2F')}@{bucket}/{path}"


@pytest.fixture
def store(s3_bucket, tmp_path):
    """(bucket, env for the CLI): the endpoint in BOOTSEER_STORAGE_OPTIONS, distinctive
    credentials (a session token too) in the AWS_* variables."""
    bucket, options = s3_bucket
    endpoint = options["client_kwargs"]["endpoint_url"]
    env = {
        "AWS_ACCESS_KEY_ID": ENV_KEY,
        "AWS_SECRET_ACCESS_KEY": ENV_SECRET,
        "AWS_SESSION_TOKEN": ENV_TOKEN,
        "AWS_SECURITY_TOKEN": ENV_TOKEN,
        "BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": {"endpoint_url": endpoint}}),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    (tmp_path / "tmp").mkdir()
    return bucket, env


def assert_clean(proc, *paths: Path) -> str:
    """No credential in the command's output or in any file under ``paths``; returns the
    output (stdout + stderr)."""
    output = proc.stdout + proc.stderr
    for secret in SECRETS:
        assert secret not in output, (
            f"{secret[:4]}... shown by bootseer {redact_argv(proc.args[3:])}"
        )
    for root in paths:
        for path in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
            data = path.read_bytes()
            for secret in SECRETS:
                assert secret.encode() not in data, (
                    f"a credential ({secret[:4]}...) written to {path}"
                )
    return output


def test_fs_commands_with_credentials_in_url_options_and_environment(store, tmp_path):
    bucket, env = store
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(300_000))
    # succeeds: key and secret from the URL (a '/' in the secret, percent-encoded)
    up = bootseer_cli(
        "-vv", "fs", "cp", str(src), _url(bucket, "d/x.bin"), "--stripe-size", "64KiB", env=env
    )
    out = assert_clean(up)
    assert "copied" in up.stdout
    assert "Authorization" in out and "Credential=***/" in out  # -vv debug output kept, scrubbed
    # succeeds: credentials (and a session token) in the storage options
    options = {
        "s3": {
            "endpoint_url": json.loads(env["BOOTSEER_STORAGE_OPTIONS"])["s3"]["endpoint_url"],
            "key": OPT_KEY,
            "secret": OPT_SECRET,
            "token": OPT_TOKEN,
        }
    }
    ls = bootseer_cli(
        "-vv", "fs", "ls", f"s3://{bucket}/d", "--storage-options", json.dumps(options), env=env
    )
    assert_clean(ls)
    assert f"{bucket}/d/x.bin" in ls.stdout and "X-Amz-Security-Token" in ls.stderr
    # succeeds: credentials from the environment only
    stat = bootseer_cli("-vv", "fs", "stat", f"s3://{bucket}/d/x.bin", env=env)
    assert_clean(stat)
    assert json.loads(stat.stdout)["size"] == 300_000
    # fails: the bucket does not exist; the store is named (redacted) with what to check
    missing = f"{bucket}-missing"
    bad = bootseer_cli("-vv", "fs", "stat", _url(missing, "d/x.bin"), env=env, check=False)
    assert_clean(bad)
    assert bad.returncode == 2
    assert f"bootseer: error: s3://***@{missing}/d/x.bin: " in bad.stderr
    assert "check the bucket and the path" in bad.stderr
    # fails: the same credentials given twice
    twice = bootseer_cli(
        "fs",
        "stat",
        _url(bucket, "d/x.bin"),
        "--storage-options",
        json.dumps(options),
        env=env,
        check=False,
    )
    assert_clean(twice)
    assert (
        twice.returncode == 2
        and "given both in the URL and in the s3 storage options" in twice.stderr
    )


def test_ckpt_env_config_warmup_and_run_never_show_credentials(store, tmp_path):
    bucket, env = store
    ckpt_url, env_url = _url(bucket, "ckpt"), _url(f"{bucket}-missing", "envs")
    outputs = [
        bootseer_cli("-vv", "ckpt", "ls", ckpt_url, env=env, check=False),
        bootseer_cli("-vv", "env", "ls", "--store", env_url, env=env, check=False),
        bootseer_cli("config", "show", "--ckpt-url", ckpt_url, "--env-store", env_url, env=env),
        bootseer_cli("config", "show", "--json", "--ckpt-url", ckpt_url, env=env),
    ]
    for proc in outputs:
        assert_clean(proc)
    assert f"s3://***@{bucket}/ckpt" in outputs[0].stderr
    shown = json.loads(outputs[3].stdout)["settings"]["ckpt"]["url"]
    assert (shown["value"], shown["source"]) == (f"s3://***@{bucket}/ckpt", "flag --ckpt-url")
    assert f'"s3://***@{bucket}/ckpt"' in outputs[2].stdout
    # warmup and run write traces and a cache: files, searched as well
    trace, cache = tmp_path / "trace", tmp_path / "cache"
    warm = bootseer_cli(
        "-vv",
        "warmup",
        "--ckpt-url",
        ckpt_url,
        "--ckpt-cache-dir",
        str(cache),
        "--ranks",
        "0",
        "--trace-dir",
        str(trace),
        env=env,
        check=False,
    )
    assert_clean(warm, trace)
    assert f"s3://***@{bucket}/ckpt" in warm.stdout
    dead = {
        **env,
        "BOOTSEER_STORAGE_OPTIONS": json.dumps(
            {"s3": {"endpoint_url": "http://127.0.0.1:9"}, "striped": {"retries": 0}}
        ),
    }
    run = bootseer_cli(
        "-vv",
        "run",
        "--ckpt-url",
        ckpt_url,
        "--ckpt-cache-dir",
        str(cache),
        "--trace-dir",
        str(trace),
        "--",
        "true",
        env=dead,
        check=False,
    )
    out = assert_clean(run, trace, Path(env["TMPDIR"]))
    if cache.exists():
        assert_clean(run, cache)
    assert run.returncode == 2 and f"checkpoint store s3://***@{bucket}/ckpt is unreachable" in out
    assert run.stderr.strip().splitlines()[-1].startswith("bootseer: error: checkpoint store")
    assert f"s3://***@{bucket}/ckpt" in "".join(p.read_text() for p in trace.glob("*.jsonl"))


def test_credentials_in_a_config_file_are_never_shown(store, tmp_path):
    """storage.options may come from the TOML file: its secrets are hidden like a flag's."""
    bucket, env = store
    endpoint = json.loads(env.pop("BOOTSEER_STORAGE_OPTIONS"))["s3"]["endpoint_url"]
    config = tmp_path / "bootseer.toml"
    config.write_text(
        f'[storage.options.s3]\nendpoint_url = "{endpoint}"\nkey = "{OPT_KEY}"\n'
        f'secret = "{OPT_SECRET}"\ntoken = "{OPT_TOKEN}"\n'
    )
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(1000))
    up = bootseer_cli(
        "-vv", "fs", "cp", str(src), f"s3://{bucket}/c/x.bin", "--config", str(config), env=env
    )
    assert "X-Amz-Security-Token" in assert_clean(up)  # the file's token was used, and hidden
    shows = [
        bootseer_cli("config", "show", *flags, env={**env, "BOOTSEER_CONFIG": str(config)})
        for flags in ([], ["--json"])
    ]
    for proc in shows:
        assert_clean(proc)
    options = json.loads(shows[1].stdout)["settings"]["storage"]["options"]
    assert options["source"] == f"file {config}"
    assert options["value"]["s3"]["endpoint_url"] == endpoint
    assert options["value"]["s3"]["secret"] != OPT_SECRET


@pytest.mark.usefixtures("fuse")
def test_background_mount_keeps_credentials_off_its_command_line_and_log(store, tmp_path):
    """The mount process outlives the command: its command line (readable by every local
    user) and its log file hold no credentials."""
    from striped_fs.fuse import is_mounted, unmount

    bucket, env = store
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    up = bootseer_cli(
        "-vv", "fs", "mount", _url(bucket, ""), str(mnt), "--read-only", env=env, check=False
    )
    try:
        assert up.returncode == 0, up.stderr
        assert_clean(up)
        assert f"mounted s3://***@{bucket}/" in up.stdout
        pid = int(up.stdout.split("(pid ", 1)[1].split(",", 1)[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        for secret in SECRETS:
            assert secret not in cmdline
        assert f"s3://{bucket}/" in cmdline
        os.listdir(mnt)  # some traffic for the log
        logs = list(Path(env["TMPDIR"]).glob("bootseer-fs-mount-*/*.log"))  # a private dir each
        assert logs
        assert_clean(up, *logs)  # while mounted: a clean unmount removes the log
    finally:
        if is_mounted(mnt):
            unmount(mnt, lazy=True)
    assert all(log_removed(log) for log in logs)
