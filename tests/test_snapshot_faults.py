"""Snapshot faults, each injected for real: hostile snapshots, damaged chunks and manifests,
failing installs, restores and builds killed with SIGKILL, an unreachable store, binaries
that pin the build prefix.

Whatever happens, the prefix is either untouched (absent, or the older environment intact) or
the complete new environment, nothing lands outside the staging directory, and nothing half
made is published.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import bootseer_cli
from snapshot_helpers import (
    PY,
    StoreUnderTest,
    assert_env_works,
    assert_one_snapshot,
    ensure_env,
    leftovers,
    make_store,
    publish_crafted,
    run_in,
    scan,
    staging_dirs,
    tar_stream,
    use_test_index,
    wait_for,
    write_requirements,
)

from bootseer.testing.servers import free_port
from snapshot.errors import (
    CorruptSnapshotError,
    InstallError,
    RelocationError,
    SnapshotError,
    UnsafeMemberError,
)
from snapshot.key import compute_key
from snapshot.manifest import MAX_CHUNK_RAW
from snapshot.restore import read_marker, restore, verify
from snapshot.store import SnapshotStore

# -- crafted, hostile snapshots --------------------------------------------------------------


class Node:
    """A restore target ``<tmp>/node/venv`` with bait around it: ``outside`` (an empty
    directory beside the prefix), ``tmp_like`` (an absolute target elsewhere) and ``secret``
    (a file a hardlink would like to reach)."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = SnapshotStore(str(tmp_path / "store"))
        self.prefix = tmp_path / "node" / "venv"
        self.outside = tmp_path / "node" / "outside"
        self.tmp_like = tmp_path / "tmp-like"
        self.secret = tmp_path / "node" / "secret.txt"
        for d in (self.outside, self.tmp_like):
            d.mkdir(parents=True)
        self.secret.write_text("secret")

    def bait_untouched(self) -> None:
        assert list(self.outside.iterdir()) == []
        assert list(self.tmp_like.iterdir()) == []
        assert self.secret.read_text() == "secret" and self.secret.stat().st_nlink == 1
        assert staging_dirs(self.prefix) == []
        assert sorted(p.name for p in self.prefix.parent.iterdir()) == sorted(
            ["outside", "secret.txt"] + (["venv"] if self.prefix.exists() else [])
        )


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def hostile_cases(node: Node) -> dict[str, tuple[list[tuple], str, str]]:
    """name -> (entries, the member that must be named, a piece of the rule)."""
    out, tmp_like, secret = str(node.outside), str(node.tmp_like), str(node.secret)
    return {
        "dotdot": (
            [("d", "lib"), ("f", "lib/../../outside/evil", b"pwned")],
            "lib/../../outside/evil",
            "'..'",
        ),
        "dotdot-first": ([("f", "../outside/evil", b"pwned")], "../outside/evil", "'..'"),
        "absolute": (
            [("d", "lib"), ("f", f"{tmp_like}/evil", b"pwned")],
            f"{tmp_like}/evil",
            "absolute",
        ),
        "absolute-dir": ([("d", out)], out, "absolute"),
        "hardlink-dotdot": (
            [("f", "a", b"x"), ("h", "b", "../secret.txt")],
            "b",
            "outside the root",
        ),
        "hardlink-absolute": ([("f", "a", b"x"), ("h", "b", secret)], "b", "outside the root"),
        "hardlink-to-symlink": (
            [("l", "ln", secret), ("h", "b", "ln")],
            "b",
            "not an earlier regular file",
        ),
        "file-under-symlink": (
            [("d", "lib"), ("l", "lib/x", out), ("f", "lib/x/evil", b"pwned")],
            "lib/x/evil",
            "under the symlink",
        ),
        "dir-under-symlink": (
            [("l", "lib", tmp_like), ("d", "lib/sub"), ("f", "lib/sub/evil", b"pwned")],
            "lib/sub",
            "under the symlink",
        ),
        "link-then-file": (
            [("l", "evil", f"{out}/evil"), ("f", "evil", b"pwned")],
            "evil",
            "duplicate",
        ),
        "file-then-file": ([("f", "a", b"one"), ("f", "a", b"two")], "a", "duplicate"),
        "char-device": ([("d", "dev"), ("c", "dev/tty")], "dev/tty", "character device"),
        "block-device": ([("d", "dev"), ("b", "dev/sda")], "dev/sda", "block device"),
        "fifo": ([("p", "pipe")], "pipe", "FIFO"),
        "parent-is-a-file": (
            [("f", "a", b"x"), ("f", "a/b", b"y")],
            "a/b",
            "not an earlier directory",
        ),
    }


HOSTILE = [
    "dotdot",
    "dotdot-first",
    "absolute",
    "absolute-dir",
    "hardlink-dotdot",
    "hardlink-absolute",
    "hardlink-to-symlink",
    "file-under-symlink",
    "dir-under-symlink",
    "link-then-file",
    "file-then-file",
    "char-device",
    "block-device",
    "fifo",
    "parent-is-a-file",
]


def legit_snapshot(node: Node) -> str:
    members, stream = tar_stream(
        [
            ("d", "bin"),
            ("f", "bin/tool", b"#!/bin/sh\necho ok\n", 0o755),
            ("f", "data.txt", b"older environment\n"),
        ]
    )
    return publish_crafted(node.store, members, stream, prefix=node.prefix).key


@pytest.mark.parametrize("existing", [False, True], ids=["absent", "older-env"])
@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_member_is_refused_before_anything_is_written(node, case, existing):
    before = None
    if existing:
        restore(node.store, legit_snapshot(node), node.prefix)
        before = scan(node.prefix, exclude=())
    entries, member, rule = hostile_cases(node)[case]
    members, stream = tar_stream(entries)
    key = publish_crafted(node.store, members, stream, prefix=node.prefix).key
    with pytest.raises(UnsafeMemberError) as caught:
        restore(node.store, key, node.prefix)
    assert caught.value.member == member
    assert repr(member) in str(caught.value) and rule in caught.value.rule
    node.bait_untouched()
    if existing:
        assert scan(node.prefix, exclude=()) == before
    else:
        assert not os.path.lexists(node.prefix)


def test_data_beyond_the_stream_is_refused(node):
    members, stream = tar_stream([("d", "lib"), ("f", "lib/big", b"x" * 100)])
    big = members[1]
    members[1] = type(big)(
        big.path, big.kind, big.mode, big.mtime_ns, len(stream), big.offset, big.link
    )
    key = publish_crafted(node.store, members, stream, prefix=node.prefix).key
    with pytest.raises(UnsafeMemberError, match="beyond the tar stream") as caught:
        restore(node.store, key, node.prefix)
    assert caught.value.member == "lib/big"
    node.bait_untouched()
    assert not node.prefix.exists()


def test_links_pointing_outside_are_data_and_setid_bits_are_stripped(node, caplog):
    """Symlinks may point anywhere (a venv's bin/python does): restored as links, and
    nothing is written through them; setuid/setgid bits are dropped with a warning."""
    entries = [
        ("d", "bin"),
        ("l", "bin/python", sys.executable),
        ("l", "bin/to-tmp", str(node.tmp_like)),
        ("l", "up", "../outside"),
        ("f", "bin/suid", b"#!/bin/sh\n", 0o6755),
        ("d", "big"),
        ("f", "big/spans", bytes(range(256)) * 40, 0o600),
    ]
    members, stream = tar_stream(entries)
    key = publish_crafted(
        node.store, members, stream, prefix=node.prefix, chunk_size=3000
    ).key  # big/spans lies across four chunks
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        result = restore(node.store, key, node.prefix)
    assert result.chunks > 3
    assert os.readlink(node.prefix / "bin/python") == sys.executable
    assert os.readlink(node.prefix / "bin/to-tmp") == str(node.tmp_like)
    assert os.readlink(node.prefix / "up") == "../outside"
    assert (node.prefix / "up").resolve() == node.outside.resolve()
    assert (node.prefix / "bin/suid").stat().st_mode & 0o7777 == 0o755
    assert result.stripped_setid == ["bin/suid"]
    assert any("setuid" in r.getMessage() for r in caplog.records)
    spans = node.prefix / "big/spans"
    assert spans.read_bytes() == bytes(range(256)) * 40
    assert (
        spans.stat().st_mode & 0o777 == 0o600 and spans.stat().st_mtime_ns == members[-1].mtime_ns
    )
    node.bait_untouched()
    assert verify(node.prefix, key).ok


def test_a_directory_bootseer_did_not_make_is_only_replaced_when_asked(node):
    node.prefix.mkdir()
    (node.prefix / "notes.txt").write_text("the user's own files")
    before = scan(node.prefix, exclude=())
    key = legit_snapshot(node)
    with pytest.raises(SnapshotError, match="not made by bootseer; pass --replace"):
        restore(node.store, key, node.prefix)
    assert scan(node.prefix, exclude=()) == before
    node.bait_untouched()
    restore(node.store, key, node.prefix, replace=True)
    assert not (node.prefix / "notes.txt").exists()
    assert (node.prefix / "data.txt").read_text() == "older environment\n"
    node.bait_untouched()


# -- damaged manifests, TOCs and chunks ------------------------------------------------------


def _raw_size_beyond_limit(m: dict) -> None:
    m["chunks"][0]["raw_size"] = MAX_CHUNK_RAW + 1
    m["stream_size"] = MAX_CHUNK_RAW + 1


def _chunk_raw_size_lies(m: dict) -> None:
    m["chunks"][0]["raw_size"] -= 512
    m["stream_size"] -= 512


TAMPERING = {
    "chunk-raw-size-beyond-limit": (_raw_size_beyond_limit, "limit"),
    "toc-sha256": (lambda m: m["toc"].update(sha256="0" * 64), "does not match its sha256"),
    "toc-raw-size": (lambda m: m["toc"].update(raw_size=10), "frame declares"),
    "chunk-raw-size-lies": (_chunk_raw_size_lies, "frame declares"),
    "chunk-sha256": (lambda m: m["chunks"][0].update(sha256="f" * 64), "is corrupt"),
    "format-version": (lambda m: m.update(format_version=99), "format version 99"),
    "chunk-name": (lambda m: m["chunks"][0].update(name="../../etc/passwd"), "invalid name"),
    "relative-prefix": (lambda m: m.update(prefix="opt/venv"), "not an absolute path"),
}


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_damaged_manifest_or_toc_is_refused(node, case):
    tamper, message = TAMPERING[case]
    members, stream = tar_stream([("d", "lib"), ("f", "lib/a", b"a" * 5000)])
    key = publish_crafted(node.store, members, stream, prefix=node.prefix, tamper=tamper).key
    with pytest.raises(CorruptSnapshotError, match=message) as caught:
        restore(node.store, key, node.prefix)
    if case == "toc-sha256":
        assert caught.value.chunk is not None and caught.value.chunk.endswith("/toc.json.zst")
    if case in ("chunk-raw-size-lies", "chunk-sha256"):
        assert caught.value.chunk is not None and caught.value.chunk.endswith("/000000.tar.zst")
    node.bait_untouched()
    assert not node.prefix.exists()


def test_chunk_that_is_not_zstd_is_refused(node):
    """A publisher that lists the right sha256 of garbage: the decompressor refuses it."""
    members, stream = tar_stream([("f", "a", b"a" * 5000)])
    garbage = os.urandom(700)

    def swap(m: dict) -> None:
        node.store.put(m["key"], m["chunks"][0]["name"], garbage).result()
        m["chunks"][0].update(sha256=hashlib.sha256(garbage).hexdigest(), size=len(garbage))

    key = publish_crafted(node.store, members, stream, prefix=node.prefix, tamper=swap).key
    with pytest.raises(CorruptSnapshotError) as caught:
        restore(node.store, key, node.prefix)
    assert caught.value.chunk is not None and caught.value.chunk in str(caught.value)
    node.bait_untouched()
    assert not node.prefix.exists()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_corrupt_chunk_is_refused_and_the_prefix_untouched(
    kind, tmp_path, request, monkeypatch, package_index
):
    store = make_store(kind, tmp_path, request)
    use_test_index(monkeypatch)
    req_new = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    req_old = write_requirements(tmp_path, package_index, "tinyalpha==1.0")
    built = ensure_env(tmp_path / "builder" / "venv", store, [req_new])
    assert built.outcome == "built"
    chunk = assert_one_snapshot(store, built.key)[0]
    data = bytearray(store.read(f"{built.key}/{chunk}"))
    data[len(data) // 2] ^= 0x40
    store.write(f"{built.key}/{chunk}", bytes(data))

    fresh = tmp_path / "fresh" / "venv"
    with pytest.raises(CorruptSnapshotError) as caught:
        ensure_env(fresh, store, [req_new])
    assert caught.value.chunk == chunk and chunk in str(caught.value)
    assert not os.path.lexists(fresh) and leftovers(fresh) == []

    # A node that holds an older environment keeps it, byte for byte.
    node = tmp_path / "node" / "venv"
    old = ensure_env(node, store, [req_old])
    assert old.outcome == "built"
    before = scan(node, exclude=())
    with pytest.raises(CorruptSnapshotError) as caught:
        ensure_env(node, store, [req_new])
    assert caught.value.chunk == chunk
    assert scan(node, exclude=()) == before and leftovers(node) == []
    assert verify(node, old.key).ok
    out = run_in(node, "python", "-c", "import tinyalpha; print(tinyalpha.VALUE)").stdout
    assert out.strip() == "alpha-1.0"


# -- failing installs ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_failed_install_publishes_nothing_and_keeps_the_older_env(
    kind, tmp_path, request, monkeypatch, package_index
):
    store = make_store(kind, tmp_path, request)
    use_test_index(monkeypatch)
    prefix = tmp_path / "node" / "venv"

    missing = write_requirements(tmp_path, package_index, "no-such-package-bootseer")
    with pytest.raises(InstallError) as caught:
        ensure_env(prefix, store, [missing])
    assert caught.value.returncode != 0
    assert "no-such-package-bootseer" in caught.value.output_tail
    assert caught.value.output_tail.rstrip() in str(caught.value)
    assert store.objects() == []  # no manifest, no chunks, no lease
    assert not prefix.exists() and leftovers(prefix) == []

    old = ensure_env(prefix, store, [write_requirements(tmp_path, package_index, "tinyalpha==1.0")])
    before, objects = scan(prefix, exclude=()), store.objects()
    command = [
        "sh",
        "-c",
        "mkdir -p {prefix} && echo half > {prefix}/partial && "
        "echo boom && echo 'to stderr' >&2 && exit 3",
    ]
    with pytest.raises(InstallError) as caught:
        ensure_env(prefix, store, command=command)
    assert caught.value.returncode == 3
    assert caught.value.output_tail.splitlines() == ["boom", "to stderr"]
    assert "exit code 3" in str(caught.value) and "boom" in str(caught.value)
    assert store.objects() == objects
    assert scan(prefix, exclude=()) == before and leftovers(prefix) == []
    assert verify(prefix, old.key).ok
    assert run_in(prefix, "tinyalpha-cli").stdout.strip() == "alpha-cli-ok"


def test_failed_install_through_the_cli(tmp_path, monkeypatch):
    env = use_test_index(monkeypatch)
    store = tmp_path / "store"
    proc = bootseer_cli(
        "env",
        "ensure",
        "--prefix",
        str(tmp_path / "venv"),
        "--store",
        str(store),
        "--",
        "sh",
        "-c",
        "echo boom; exit 3",
        check=False,
        env=env,
    )
    assert proc.returncode == 2
    assert "bootseer: error: install command failed with exit code 3" in proc.stderr
    assert "boom" in proc.stderr and "Traceback" not in proc.stderr
    assert StoreUnderTest("local", str(store)).objects() == []


# -- SIGKILL ---------------------------------------------------------------------------------


def start_cli(log: Path, *args: str) -> subprocess.Popen:
    """``bootseer ARGS`` in a new session (its install commands die with it)."""
    with log.open("w") as out:
        return subprocess.Popen(
            [PY, "-m", "bootseer", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


BIG_FILES, BIG_FILE_MB = 30, 10  # 300 MB of random bytes: a restore takes about a second


@pytest.mark.slow
def test_restore_killed_leaves_the_prefix_untouched(tmp_path):
    store = str(tmp_path / "store")
    command = [
        "sh",
        "-c",
        f"{PY} -m venv --without-pip {{prefix}} && mkdir {{prefix}}/data && "
        f"for i in $(seq 1 {BIG_FILES}); do head -c {BIG_FILE_MB}M /dev/urandom "
        f"> {{prefix}}/data/blob$i; done",
    ]
    source = tmp_path / "builder" / "venv"
    built = ensure_env(source, store, command=command)
    assert built.outcome == "built" and built.publish.bytes > BIG_FILES * BIG_FILE_MB << 20
    source_tree = scan(source)

    older_cmd = ["sh", "-c", f"{PY} -m venv --without-pip {{prefix}} && echo old > {{prefix}}/old"]
    for trial, prefix in enumerate([tmp_path / "fresh" / "venv", tmp_path / "node" / "venv"]):
        older = None
        if trial == 1:
            older = ensure_env(prefix, store, command=older_cmd)
            before = scan(prefix, exclude=())
        log = tmp_path / f"restore-{trial}.log"
        proc = start_cli(
            log, "env", "ensure", "--prefix", str(prefix), "--store", store, "--", *command
        )
        # Killed once the first files have landed in the staging directory, long before the
        # last (a restore of this size takes about a second on 2 cores).
        staging = wait_for(
            lambda p=prefix: [s for s in staging_dirs(p) if any((s / "data").glob("blob*"))],
            60,
            "files in the staging directory",
        )
        kill_group(proc)
        assert proc.returncode == -signal.SIGKILL, log.read_text()
        assert staging_dirs(prefix) == staging  # left behind, holding part of the env
        if older is None:
            assert not os.path.lexists(prefix)
        else:
            assert scan(prefix, exclude=()) == before
            assert verify(prefix, older.key).ok

        again = ensure_env(prefix, store, command=command)
        assert again.outcome == "restored" and again.key == built.key
        assert staging_dirs(prefix) == [] and leftovers(prefix) == []
        tree = scan(prefix)
        assert {p: e.digest for p, e in tree.items() if p.startswith("data/")} == {
            p: e.digest for p, e in source_tree.items() if p.startswith("data/")
        }
        out = run_in(prefix, "python", "-c", "import sys; print(sys.prefix)").stdout
        assert out.strip() == str(prefix)
        assert verify(prefix, built.key).ok


@pytest.mark.slow
def test_build_killed_mid_install_is_cleared_and_its_lease_expires(tmp_path):
    store = StoreUnderTest("local", str(tmp_path / "store"))
    hold = tmp_path / "hold"
    hold.touch()
    command = [
        "sh",
        "-c",
        f"{PY} -m venv --without-pip {{prefix}} && echo half > "
        f"{{prefix}}/partial && while [ -e {hold} ]; do sleep 0.05; done && "
        f"echo complete > {{prefix}}/complete",
    ]
    key = compute_key([], command).key
    prefix = tmp_path / "node" / "venv"
    proc = start_cli(
        tmp_path / "build.log",
        "env",
        "ensure",
        "--prefix",
        str(prefix),
        "--store",
        store.url,
        "--lease",
        "1",
        "--",
        *command,
    )
    wait_for(lambda: (prefix / "partial").exists(), 60, "the install to start")
    assert store.layout()[key]["lock"]
    kill_group(proc)
    hold.unlink()
    assert (prefix / "partial").exists() and read_marker(prefix) is None  # half installed

    started = time.monotonic()
    result = ensure_env(prefix, store, command=command, lease_s=1.0)
    assert result.outcome == "built" and result.publish.published
    assert time.monotonic() - started < 20  # the dead builder's lease did not hold it up
    assert (prefix / "complete").read_text() == "complete\n"
    assert verify(prefix, key).ok and leftovers(prefix) == []
    assert_one_snapshot(store, key)

    # Another node of the same key now restores what the second builder published.
    other = tmp_path / "other" / "venv"
    assert ensure_env(other, store, command=command).outcome == "restored"
    assert (other / "complete").read_text() == "complete\n"


# -- the store cannot be reached --------------------------------------------------------------


def test_unreachable_store_installs_locally(tmp_path, monkeypatch, package_index, caplog):
    use_test_index(monkeypatch)
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    options = {
        "s3": {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
    }
    store = SnapshotStore("s3://bootseer-unreachable/envs", options, retries=0)
    prefix = tmp_path / "node" / "venv"
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        result = ensure_env(prefix, store, [req])
    assert result.outcome == "installed-locally" and result.installer
    assert len(result.warnings) == 1
    assert "snapshot store unreachable" in result.warnings[0]
    assert "s3://bootseer-unreachable/envs" in result.warnings[0]
    assert any("snapshot store unreachable" in r.getMessage() for r in caplog.records)
    assert_env_works(prefix)
    marker = read_marker(prefix)
    assert marker is not None and marker["published"] is False and marker["store"] is None
    assert leftovers(prefix) == []

    requests = package_index.total_requests
    again = ensure_env(prefix, store, [req])
    assert (again.outcome, again.key) == ("verified", result.key)
    assert package_index.total_requests == requests


# -- relocation refused ----------------------------------------------------------------------

WRITE_BINARY = """\
import sys
prefix = sys.argv[1]
with open(prefix + "/bin/tool.bin", "wb") as f:
    f.write(b"\\x7fELF\\x02\\x01\\x01\\x00" + b"\\x00" * 8 + prefix.encode() + b"/lib\\x00rest")
"""


def test_binary_embedding_the_prefix_refuses_relocation_unless_forced(tmp_path, monkeypatch):
    script = tmp_path / "write_binary.py"
    script.write_text(WRITE_BINARY)
    command = ["sh", "-c", f"{PY} -m venv --without-pip {{prefix}} && {PY} {script} {{prefix}}"]
    store_url = str(tmp_path / "store")
    source = tmp_path / "builder" / "venv"
    built = ensure_env(source, store_url, command=command)
    store = SnapshotStore(store_url)
    manifest = store.require_manifest(built.key)
    assert {"path": "bin/tool.bin", "kind": "binary"} in manifest.prefix_refs

    fetched: list[str] = []
    real_fetch = store.fetch
    monkeypatch.setattr(
        store, "fetch", lambda key, name, **kw: fetched.append(name) or real_fetch(key, name, **kw)
    )
    target = tmp_path / "elsewhere" / "venv"
    with pytest.raises(RelocationError) as caught:
        restore(store, built.key, target)
    assert caught.value.paths == ["bin/tool.bin"] and "bin/tool.bin" in str(caught.value)
    assert "--force" in str(caught.value)
    assert fetched == []  # refused before a byte was downloaded
    assert not target.parent.exists() or list(target.parent.iterdir()) == []
    with pytest.raises(RelocationError):
        ensure_env(target, store_url, command=command)
    assert not os.path.lexists(target) and staging_dirs(target) == []

    forced = restore(store, built.key, target, force=True)
    report = forced.relocation
    assert report is not None and report.skipped_binary == ["bin/tool.bin"]
    assert "pyvenv.cfg" in report.rewritten and "bin/activate" in report.rewritten
    assert "1 binary file(s) left unchanged" in report.summary()
    assert (target / "bin/tool.bin").read_bytes() == (source / "bin/tool.bin").read_bytes()
    assert str(source) not in (target / "pyvenv.cfg").read_text()
    assert verify(target, built.key).ok

    # The command line: refused with the reason, then forced.
    cli_target = tmp_path / "cli" / "venv"
    proc = bootseer_cli(
        "env", "restore", built.key, "--prefix", str(cli_target), "--store", store_url, check=False
    )
    assert proc.returncode == 2 and "bootseer: error: cannot restore to" in proc.stderr
    assert "bin/tool.bin" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.lexists(cli_target)
    proc = bootseer_cli(
        "env", "restore", built.key, "--prefix", str(cli_target), "--store", store_url, "--force"
    )
    assert "1 binary file(s) left unchanged" in proc.stderr
    assert (cli_target / "bin/tool.bin").exists()


def test_store_objects_are_left_alone_by_a_refused_restore(tmp_path):
    """A refused restore only reads: the store holds the same objects afterwards."""
    node = Node(tmp_path)
    members, stream = tar_stream([("f", "../outside/evil", b"pwned")])
    key = publish_crafted(node.store, members, stream, prefix=node.prefix).key
    store = StoreUnderTest("local", node.store.url)
    objects = store.objects()
    with pytest.raises(UnsafeMemberError):
        restore(node.store, key, node.prefix)
    assert store.objects() == objects
    assert json.loads(store.read(f"{key}/manifest.json"))["key"] == key


def test_no_store_installs_locally_without_a_warning(tmp_path, monkeypatch, package_index):
    use_test_index(monkeypatch)
    prefix = tmp_path / "venv"
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    result = ensure_env(prefix, None, [req])
    assert (result.outcome, result.warnings) == ("installed-locally", [])
    assert_env_works(prefix)
    assert ensure_env(prefix, None, [req]).outcome == "verified"
