"""Environment snapshots end to end: build on a miss, verify, repair, restore on another node.

Real installs (uv, and pip where pip is the point) from the local PEP 503 index, real stores
(a local directory, and S3 on moto over HTTP), real venvs run afterwards.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard
from cli_helpers import bootseer_cli
from snapshot_helpers import (
    SITE,
    Entry,
    StoreUnderTest,
    assert_env_works,
    assert_one_snapshot,
    decompress_chunks,
    ensure_env,
    hardlink_groups,
    leftovers,
    make_store,
    run_in,
    scan,
    tree_differences,
    use_test_index,
    uv_venv_command,
    write_requirements,
)

from bootseer.testing.pypi import PackageIndex, build_test_wheels
from snapshot.ensure import EnsureResult
from snapshot.restore import verify

TINYBETA_WHEEL = "tinybeta-0.1-py3-none-any.whl"


def current_umask() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))


@pytest.mark.parametrize("kind, installer", [("local", "uv"), ("local", "pip"), ("s3", "uv")])
def test_build_verify_repair_and_restore_on_another_node(
    kind, installer, tmp_path, request, monkeypatch, package_index
):
    store = make_store(kind, tmp_path, request)
    use_test_index(monkeypatch)
    req = write_requirements(tmp_path, package_index, "tinybeta", "tinydata")
    node_a = tmp_path / "node-a" / "venv"

    # A miss: installed with the requested installer, packed, published.
    built = ensure_env(node_a, store, [req], installer=installer)
    assert built.outcome == "built", built
    assert built.installer is not None and built.installer.startswith(installer)
    assert built.publish is not None and built.publish.published and not built.warnings
    assert_one_snapshot(store, built.key)
    assert_env_works(node_a)
    assert verify(node_a, built.key).ok
    assert package_index.downloads(TINYBETA_WHEEL) == 1
    assert leftovers(node_a) == []
    prefix_mode = node_a.stat().st_mode & 0o7777
    assert prefix_mode == 0o777 & ~current_umask()

    # The same start again: verified from stats alone; the index hears nothing.
    requests = package_index.total_requests
    again = ensure_env(node_a, store, [req], installer=installer)
    assert (again.outcome, again.key) == ("verified", built.key)

    # A file deleted, then a file changed: the next start restores from the store.
    blob = node_a / SITE / "tinydata" / "blob.bin"
    blob_data, blob_mtime = blob.read_bytes(), blob.stat().st_mtime_ns
    blob.unlink()
    assert not verify(node_a, built.key).ok
    repaired = ensure_env(node_a, store, [req], installer=installer)
    assert repaired.outcome == "restored" and repaired.restore is not None
    assert repaired.restore.relocation is None  # same prefix: nothing to rewrite
    assert blob.read_bytes() == blob_data and blob.stat().st_mtime_ns == blob_mtime
    assert_env_works(node_a)

    init = node_a / SITE / "tinybeta" / "__init__.py"
    original = init.read_bytes()
    init.write_bytes(original + b"raise SystemExit('tampered')\n")
    assert run_in(node_a, "tinybeta-cli", check=False).returncode != 0
    assert ensure_env(node_a, store, [req], installer=installer).outcome == "restored"
    assert init.read_bytes() == original
    assert_env_works(node_a)
    assert ensure_env(node_a, store, [req], installer=installer).outcome == "verified"
    assert package_index.total_requests == requests
    assert leftovers(node_a) == []
    assert node_a.stat().st_mode & 0o7777 == prefix_mode  # not mkdtemp's 0700

    # Another node, another prefix (another length, too): restored and relocated.
    node_b = tmp_path / "node-b" / "environment"
    other = ensure_env(node_b, store, [req], installer=installer)
    assert other.outcome == "restored" and other.restore is not None
    assert other.restore.relocation is not None
    assert "bin/tinybeta-cli" in other.restore.relocation.rewritten
    assert_env_works(node_b)
    script = (node_b / "bin" / "tinybeta-cli").read_text()
    assert script.splitlines()[0] == f"#!{node_b}/bin/python"
    assert str(node_a) not in script
    activated = subprocess.run(
        [
            "sh",
            "-c",
            '. "$1/bin/activate" && printf "%s\\n" "$VIRTUAL_ENV" && command -v python',
            "sh",
            str(node_b),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert activated.stdout.split() == [str(node_b), f"{node_b}/bin/python"]
    link = node_b / "bin" / "python"
    assert link.is_symlink() and os.readlink(link) == os.readlink(node_a / "bin" / "python")
    assert not os.readlink(link).startswith(str(node_a))  # the base interpreter, outside
    assert node_b.stat().st_mode & 0o7777 == prefix_mode
    assert ensure_env(node_b, store, [req], installer=installer).outcome == "verified"

    # And through the command line, by key.
    node_c = tmp_path / "node-c" / "venv"
    proc = bootseer_cli("env", "restore", built.key, "--prefix", str(node_c), *store.cli_args())
    assert f"restored {built.key} to {node_c}: " in proc.stderr
    assert "relocated" in proc.stderr
    assert_env_works(node_c)
    assert verify(node_c, built.key).ok

    assert package_index.total_requests == requests
    assert package_index.downloads(TINYBETA_WHEEL) == 1
    assert_one_snapshot(store, built.key)


# -- one rich environment, restored elsewhere and compared entry by entry ------------------

DEMO = "share/demo"
EXTRA_STEPS = (
    f"mkdir -p {{prefix}}/{DEMO}/empty {{prefix}}/{DEMO}/sub",
    f"printf 'hello hardlink' > {{prefix}}/{DEMO}/a.txt",
    f"ln {{prefix}}/{DEMO}/a.txt {{prefix}}/{DEMO}/b.txt",
    f"chmod 0640 {{prefix}}/{DEMO}/a.txt",
    f"printf 'root={{prefix}}/share\\n' > {{prefix}}/{DEMO}/paths.cfg",
    f"printf 'home={{prefix}}\\n' > {{prefix}}/{DEMO}/linked.cfg",
    f"ln {{prefix}}/{DEMO}/linked.cfg {{prefix}}/{DEMO}/linked-too.cfg",
    "printf '#!/bin/sh\\necho tool-ok\\n' > {prefix}/bin/tool",
    "chmod 0750 {prefix}/bin/tool",
    f": > {{prefix}}/{DEMO}/empty.dat",
    f"chmod 0600 {{prefix}}/{DEMO}/empty.dat",
    f"ln -s a.txt {{prefix}}/{DEMO}/rel-link",
    f"ln -s /nonexistent/bootseer-dangling {{prefix}}/{DEMO}/dangling",
    f"ln -s {{prefix}}/{DEMO}/a.txt {{prefix}}/{DEMO}/abs-inside",
    f"touch -d '2001-02-03 04:05:06.123456789' {{prefix}}/{DEMO}/a.txt",
    f"touch -h -d '2002-02-03 04:05:06.987654321' {{prefix}}/{DEMO}/rel-link",
    f"chmod 0700 {{prefix}}/{DEMO}/empty",
    f"touch -d '2003-01-01 00:00:00.5' {{prefix}}/{DEMO}/sub",
)


@dataclass
class Rich:
    store: StoreUnderTest
    command: list[str]
    source: Path
    tree: dict[str, Entry]
    built: EnsureResult
    root: Path


@pytest.fixture(scope="module")
def rich(tmp_path_factory) -> Rich:
    """A uv venv with the test packages plus hardlinks, symlinks (relative, dangling,
    absolute into the prefix), odd modes and nanosecond mtimes, built and published once."""
    root = tmp_path_factory.mktemp("rich")
    build_test_wheels(root / "wheels")
    with pytest.MonkeyPatch.context() as mp, PackageIndex(root / "wheels") as index:
        use_test_index(mp)
        req = write_requirements(root, index, "tinybeta", "tinydata")
        command = uv_venv_command(req, *EXTRA_STEPS)
        store = StoreUnderTest("local", str(root / "store"))
        source = root / "build" / "venv"
        built = ensure_env(source, store, command=command)
    assert built.outcome == "built", built
    return Rich(store, command, source, scan(source), built, root)


def expected_at(rich: Rich, new: Path) -> dict[str, Entry]:
    """The source tree as it must look at ``new``: absolute links into the prefix follow it."""
    old = str(rich.source)
    return {
        path: dataclasses.replace(e, link=str(new) + e.link[len(old) :])
        if e.kind == "l" and (e.link == old or e.link.startswith(old + "/"))
        else e
        for path, e in rich.tree.items()
    }


def test_restore_elsewhere_reproduces_every_entry(rich, tmp_path):
    new = tmp_path / "elsewhere" / "env"
    result = ensure_env(new, rich.store, command=rich.command)
    assert result.outcome == "restored" and result.key == rich.built.key
    report = result.restore.relocation
    assert report is not None and not report.skipped_binary and not report.pyc_invalidated
    assert {"bin/tinybeta-cli", "bin/activate", f"{DEMO}/paths.cfg"} <= set(report.rewritten)
    tree = scan(new)
    # A rewritten file's other names (hardlinks) changed with it.
    changed = set(report.rewritten) | {
        p for g in hardlink_groups(tree) if g & set(report.rewritten) for p in g
    }
    assert f"{DEMO}/linked-too.cfg" in changed

    # Same paths, kinds, modes, mtimes (ns), link targets and hardlink identity; contents
    # byte-equal except in the rewritten files.
    assert tree_differences(expected_at(rich, new), tree, content_differs=changed) == []
    assert hardlink_groups(tree) == {
        frozenset({f"{DEMO}/a.txt", f"{DEMO}/b.txt"}),
        frozenset({f"{DEMO}/linked.cfg", f"{DEMO}/linked-too.cfg"}),
    }
    assert tree[f"{DEMO}/a.txt"].nlink == 2
    assert tree[f"{DEMO}/a.txt"].mode == 0o640 and tree[f"{DEMO}/empty.dat"].mode == 0o600
    assert tree[f"{DEMO}/empty"].mode == 0o700
    assert tree[f"{DEMO}/a.txt"].mtime_ns % 1_000_000_000 == 123_456_789
    assert tree[f"{DEMO}/rel-link"].mtime_ns == rich.tree[f"{DEMO}/rel-link"].mtime_ns

    # The rewritten files differ exactly by the prefix; nothing else mentions the old one.
    old, new_b = str(rich.source).encode(), str(new).encode()
    for path in changed:
        before = (rich.source / path).read_bytes()
        assert (new / path).read_bytes() == before.replace(old, new_b), path
    assert (new / DEMO / "paths.cfg").read_text() == f"root={new}/share\n"
    assert (new / DEMO / "linked-too.cfg").read_text() == f"home={new}\n"
    assert os.readlink(new / DEMO / "abs-inside") == f"{new}/{DEMO}/a.txt"
    assert os.readlink(new / DEMO / "dangling") == "/nonexistent/bootseer-dangling"
    assert (new / DEMO / "rel-link").read_text() == "hello hardlink"
    python = new / "bin" / "python"
    assert python.is_symlink() and os.readlink(python) == os.readlink(rich.source / "bin/python")

    # The environment works there.
    assert_env_works(new)
    assert run_in(new, "tool").stdout == "tool-ok\n"
    assert (new / "bin" / "tool").stat().st_mode & 0o777 == 0o750
    assert verify(new, rich.built.key).ok


def test_restored_pyc_files_are_used_as_they_are(rich, tmp_path):
    new = tmp_path / "pyc" / "venv"
    assert ensure_env(new, rich.store, command=rich.command).outcome == "restored"
    site = new / SITE
    before = scan(site)
    pycs = [p for p in before if p.endswith(".pyc")]
    assert any(p.startswith("tinybeta/__pycache__/") for p in pycs), pycs
    proc = run_in(new, "python", "-v", "-c", "import tinybeta, tinydata, tinyalpha")
    for package in ("tinybeta", "tinydata", "tinyalpha"):
        # importlib's verbose line for a cached module whose pyc is valid for its source
        assert f"{site}/{package}/__pycache__/__init__." in proc.stderr
        assert any(
            line.endswith(f"matches {site}/{package}/__init__.py")
            for line in proc.stderr.splitlines()
        ), package
    # Python wrote nothing: every pyc has its content and mtime, no file was added.
    assert scan(site) == before


def test_chunks_are_one_plain_zstd_tar_stream(rich, tmp_path):
    """The format promise of snapshot/manifest.py: ``cat *.tar.zst | zstd -d | tar -x``."""
    store = rich.store.open()
    manifest = store.require_manifest(rich.built.key)
    publisher_dir = Path(rich.store.url) / rich.built.key / manifest.publisher
    expected = rich.tree

    # Python's zstandard and tarfile.
    out_py = tmp_path / "py"
    out_py.mkdir()
    stream = decompress_chunks(store, manifest)
    assert len(stream) == manifest.stream_size
    with tarfile.open(fileobj=io.BytesIO(stream), mode="r:") as tar:
        tar.extractall(out_py, filter="fully_trusted")
    assert (
        tree_differences(
            expected, scan(out_py), mtime_resolution_ns=1_000_000_000, check_link_mtimes=False
        )
        == []
    )

    # The system's cat, zstd and tar.
    if not (shutil.which("zstd") and shutil.which("tar")):
        pytest.skip("zstd or tar not installed: the system-tools half needs both")
    out_sh = tmp_path / "sh"
    out_sh.mkdir()
    chunks = sorted(p.name for p in publisher_dir.glob("*.tar.zst"))
    assert chunks == [c.name.split("/")[1] for c in manifest.chunks]
    subprocess.run(
        [
            "sh",
            "-c",
            'cat "$1"/*.tar.zst | zstd -d -q | tar -x -p -C "$2"',
            "sh",
            str(publisher_dir),
            str(out_sh),
        ],
        check=True,
        timeout=60,
    )
    assert (
        tree_differences(
            expected, scan(out_sh), mtime_resolution_ns=1_000_000_000, check_link_mtimes=False
        )
        == []
    )


def test_chunks_decompress_independently(rich):
    """Each chunk is a whole zstd frame of its slice of the stream (restore needs any chunk
    in any order)."""
    store = rich.store.open()
    manifest = store.require_manifest(rich.built.key)
    whole = decompress_chunks(store, manifest)
    for chunk in manifest.chunks:
        data = store.fetch(manifest.key, chunk.name).result()
        raw = zstandard.ZstdDecompressor().decompress(data)
        assert raw == whole[chunk.offset : chunk.offset + chunk.raw_size]
