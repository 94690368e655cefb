"""``bootseer env``: what each subcommand prints, its exit code, and clear errors."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest
from cli_helpers import bootseer_cli
from snapshot_helpers import (
    SITE,
    StoreUnderTest,
    assert_env_works,
    make_store,
    use_test_index,
    write_requirements,
)

from bootseer.testing.servers import free_port
from snapshot.key import compute_key
from snapshot.restore import verify


@pytest.fixture
def cli_env(monkeypatch) -> dict[str, str]:
    """The environment of a CLI run: only the test index, no store from the shell."""
    return use_test_index(monkeypatch)


def test_key_prints_every_input(tmp_path, cli_env, package_index):
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata>=0.3")
    args = ["--spec", str(req), "--extra", "cuda=12.4", "--base-image", "sha256:abc123"]
    text = bootseer_cli("env", "key", *args, env=cli_env).stdout
    expected = compute_key([req], base_image="sha256:abc123", extras={"cuda": "12.4"})
    lines = text.splitlines()
    assert lines[0] == f"key: {expected.key}"
    names = [line.split(":", 1)[0] for line in lines if line and not line.startswith(" ")]
    assert names == ["key", *(("spec[0]" if n == "spec" else n) for n in expected.inputs)]
    assert f"python: cpython {expected.inputs['python']['version']}" in text
    assert f"spec[0]: {req.name} (requirements)" in text
    assert f"    option: --index-url={package_index.url}" in lines
    assert "    requirement: tinybeta" in lines and "    requirement: tinydata>=0.3" in lines
    assert "install_command: default" in lines
    assert "base_image: sha256:abc123" in lines and "extras: cuda=12.4" in lines
    assert "capture: (none)" in lines

    as_json = json.loads(bootseer_cli("env", "key", *args, "--json", env=cli_env).stdout)
    assert as_json == expected.to_json()

    # A custom command is an input, shown as it would be typed; {prefix} stays literal.
    text = bootseer_cli("env", "key", "--", "sh", "-c", "make {prefix}", env=cli_env).stdout
    assert "install_command: sh -c 'make {prefix}'" in text.splitlines()
    assert "spec: (none)" in text.splitlines()
    assert text.splitlines()[0] == f"key: {compute_key([], ['sh', '-c', 'make {prefix}']).key}"


def test_ensure_verify_ls_gc_rm(tmp_path, cli_env, package_index):
    store = StoreUnderTest("local", str(tmp_path / "store"))
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    prefix = tmp_path / "node" / "venv"
    ensure = ["env", "ensure", "--spec", str(req), "--prefix", str(prefix), "--store", store.url]

    proc = bootseer_cli(*ensure, env=cli_env)
    match = re.search(
        rf"^env ([0-9a-f]+): built at {re.escape(str(prefix))} in [0-9.]+s "
        rf"\(installed with uv[^)]*\) \(published\)$",
        proc.stderr,
        re.M,
    )
    assert match, proc.stderr
    key = match.group(1)
    assert key == compute_key([req]).key
    assert_env_works(prefix)

    again = json.loads(bootseer_cli(*ensure, "--json", env=cli_env).stdout)
    assert (again["key"], again["outcome"], again["prefix"]) == (key, "verified", str(prefix))

    # verify: exit 0 when intact, 2 otherwise, with the reason and the problems.
    out = bootseer_cli("env", "verify", str(prefix), "--key", key).stdout
    assert out.startswith(f"{prefix}: intact: intact (key {key}, ")
    other = bootseer_cli("env", "verify", str(prefix), "--key", "0" * 40, check=False)
    assert other.returncode == 2 and "NOT OK: holds another environment" in other.stdout
    nothing = bootseer_cli("env", "verify", str(tmp_path / "nowhere"), check=False)
    assert nothing.returncode == 2 and "NOT OK: no bootseer environment there" in nothing.stdout
    blob = prefix / SITE / "tinydata" / "blob.bin"
    data = blob.read_bytes()
    blob.unlink()
    damaged = bootseer_cli("env", "verify", str(prefix), check=False)
    assert damaged.returncode == 2, damaged.stdout
    assert "NOT OK: 1 file(s) missing, changed or extra" in damaged.stdout
    assert f"  {SITE}/tinydata/blob.bin: missing" in damaged.stdout.splitlines()
    restored = bootseer_cli(*ensure, env=cli_env)
    assert f"env {key}: restored at {prefix}" in restored.stderr and "fetched" in restored.stderr
    assert blob.read_bytes() == data

    # ls: a table, or JSON.
    listing = bootseer_cli("env", "ls", "--store", store.url).stdout.splitlines()
    assert listing[0].split() == ["KEY", "CREATED", "FILES", "SIZE", "STORED", "WHAT"]
    assert len(listing) == 2 and listing[1].startswith(key)
    assert f"{prefix} (uv" in listing[1]
    (entry,) = json.loads(bootseer_cli("env", "ls", "--store", store.url, "--json").stdout)
    assert (entry["key"], entry["kind"], entry["prefix"]) == (key, "prefix", str(prefix))
    assert entry["files"] > 10 and entry["bytes"] > 65536
    assert 0 < entry["compressed_bytes"] < entry["bytes"]
    assert abs(entry["created"] - time.time()) < 120

    # gc: a dry run lists and deletes nothing; a dead publisher's chunks go; the young
    # snapshot stays.
    objects = store.objects()
    dry = bootseer_cli("env", "gc", "--store", store.url, "--older-than", "0", "--dry-run")
    assert dry.stdout.splitlines() == [f"would remove {store.url}/{key}"]
    assert "would remove 1 item(s)" in dry.stderr
    assert store.objects() == objects
    dead = Path(store.url) / key / uuid.uuid4().hex
    dead.mkdir()
    (dead / "000000.tar.zst").write_bytes(b"left by a killed publisher")
    old = time.time() - 7200
    os.utime(dead / "000000.tar.zst", (old, old))
    swept = bootseer_cli("env", "gc", "--store", store.url, "--older-than", "1h")
    assert swept.stdout.splitlines() == [f"removed {dead}"]
    assert "removed 1 item(s)" in swept.stderr
    assert store.objects() == objects

    # rm, then nothing is left and a second rm is an error.
    assert bootseer_cli("env", "rm", key, "--store", store.url).stdout == f"removed {key}\n"
    assert (
        bootseer_cli("env", "ls", "--store", store.url).stdout == f"no snapshots in {store.url}\n"
    )
    assert store.objects() == []
    again = bootseer_cli("env", "rm", key, "--store", store.url, check=False)
    assert again.returncode == 2 and f"bootseer: error: no snapshot {key}" in again.stderr
    # The environment itself is untouched by the store's removal.
    assert verify(prefix, key).ok


def test_ensure_with_a_custom_command_and_the_store_from_the_environment(tmp_path, cli_env):
    store = tmp_path / "store"
    env = {**cli_env, "BOOTSEER_ENV_STORE": str(store)}
    prefix = tmp_path / "venv"
    command = ["sh", "-c", 'mkdir -p {prefix}/bin && echo "$BOOTSEER_PREFIX" > {prefix}/where']
    proc = bootseer_cli("env", "ensure", "--prefix", str(prefix), "--json", "--", *command, env=env)
    result = json.loads(proc.stdout)
    assert result["outcome"] == "built" and result["installer"] == "custom"
    assert (prefix / "where").read_text() == f"{prefix}\n"
    assert result["key"] == compute_key([], command).key
    other = tmp_path / "other"
    proc = bootseer_cli("env", "ensure", "--prefix", str(other), "--json", "--", *command, env=env)
    assert json.loads(proc.stdout)["outcome"] == "restored"
    assert (other / "where").read_text() == f"{other}\n"  # a text reference, relocated


def test_unreachable_store_warns_and_installs_locally(tmp_path, cli_env, package_index):
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    options = {
        "s3": {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {
                "endpoint_url": f"http://127.0.0.1:{free_port()}",
                "region_name": "us-east-1",
            },
        },
        "striped": {"retries": 0},
    }
    prefix = tmp_path / "venv"
    proc = bootseer_cli(
        "env",
        "ensure",
        "--spec",
        str(req),
        "--prefix",
        str(prefix),
        "--store",
        "s3://bootseer-unreachable/envs",
        "--storage-options",
        json.dumps(options),
        env=cli_env,
    )
    assert "bootseer: warning: snapshot store unreachable, installing locally" in proc.stderr
    assert "failed after 1 attempt(s)" in proc.stderr  # the "striped" retries reach the store
    assert f": installed-locally at {prefix}" in proc.stderr
    assert_env_works(prefix)


@pytest.mark.parametrize(
    "args, message",
    [
        (["env", "ls"], "no snapshot store: pass --store URL or set BOOTSEER_ENV_STORE"),
        (["env", "gc", "--older-than", "1d"], "no snapshot store"),
        (
            ["env", "ensure", "--capture", "/opt/x", "--prefix", "{tmp}/p", "--", "true"],
            "--capture and --prefix exclude each other",
        ),
        (["env", "ensure", "--prefix", "{tmp}/p", "--store", "{tmp}/s"], "nothing to install"),
        (["env", "ensure", "--store", "{tmp}/s", "--", "true"], "--prefix is required"),
        (["env", "gc", "--store", "{tmp}/s", "--older-than", "soon"], "--older-than 'soon'"),
        (["env", "gc", "--store", "{tmp}/s", "--older-than", "-5"], "--older-than '-5'"),
        (
            [
                "env",
                "ensure",
                "--spec",
                "{tmp}/missing.txt",
                "--prefix",
                "{tmp}/p",
                "--store",
                "{tmp}/s",
            ],
            "{tmp}/missing.txt",
        ),
        (["env", "key", "--spec", "{tmp}/missing.txt"], "{tmp}/missing.txt"),
        (["env", "key", "--extra", "cuda"], "must look like NAME=VALUE"),
        (
            ["env", "restore", "not-a-key", "--prefix", "{tmp}/p", "--store", "{tmp}/s"],
            "'not-a-key' is not a snapshot key",
        ),
        (
            ["env", "restore", "0123456789abcdef", "--prefix", "{tmp}/p", "--store", "{tmp}/s"],
            "no snapshot 0123456789abcdef in {tmp}/s",
        ),
        (
            ["env", "ls", "--store", "{tmp}/s", "--storage-options", "{not json"],
            "storage.options in flag --storage-options: not valid JSON",
        ),
        (["env", "ls", "--store", "nosuch://bucket/envs"], "unknown protocol 'nosuch'"),
    ],
)
def test_errors_are_one_line_and_exit_2(args, message, tmp_path, cli_env):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = bootseer_cli(*args, check=False, env=cli_env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("bootseer: error: ")]
    assert len(errors) == 1, proc.stderr
    assert message.replace("{tmp}", str(tmp_path)) in errors[0]
    assert not (tmp_path / "p").exists() and not (tmp_path / "s").exists()


def test_ls_gc_rm_on_s3(tmp_path, cli_env, request):
    store = make_store("s3", tmp_path, request)
    prefix = tmp_path / "venv"
    command = ["sh", "-c", "mkdir -p {prefix}/bin && echo hi > {prefix}/bin/hi"]
    result = json.loads(
        bootseer_cli(
            "env",
            "ensure",
            "--prefix",
            str(prefix),
            "--json",
            *store.cli_args(),
            "--",
            *command,
            env=cli_env,
        ).stdout
    )
    key = result["key"]
    (entry,) = json.loads(bootseer_cli("env", "ls", "--json", *store.cli_args()).stdout)
    assert (entry["key"], entry["files"], entry["prefix"]) == (key, 1, str(prefix))
    # A publisher killed before its commit left chunks under a key with no manifest.
    orphan_key, publisher = "ab" * 20, uuid.uuid4().hex
    store.write(f"{orphan_key}/{publisher}/000000.tar.zst", b"orphan")
    assert [
        e["key"] for e in json.loads(bootseer_cli("env", "ls", "--json", *store.cli_args()).stdout)
    ] == [key]

    swept = bootseer_cli("env", "gc", "--older-than", "1h", *store.cli_args())
    assert swept.stdout == "" and "removed 0 item(s)" in swept.stderr  # all too young
    swept = bootseer_cli("env", "gc", "--older-than", "0", *store.cli_args())
    removed = sorted(swept.stdout.splitlines())
    assert len(removed) == 2, swept.stdout
    assert any(line.endswith(f"/envs/{key}") for line in removed)
    assert any(line.endswith(f"/envs/{orphan_key}/{publisher}") for line in removed)
    assert store.objects() == []
    assert bootseer_cli("env", "ls", *store.cli_args()).stdout == f"no snapshots in {store.url}\n"
    assert verify(prefix, key).ok
