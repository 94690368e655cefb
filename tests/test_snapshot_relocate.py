"""snapshot.relocate: find prefix references at pack time, rewrite them at restore time.

Uses real venvs (``python -m venv``, pip installed offline by ensurepip): one is built per
module at OLD and copied for each test.
"""

from __future__ import annotations

import json
import os
import py_compile
import shutil
import stat
import subprocess
import sys
from importlib.util import cache_from_source
from pathlib import Path

import pytest

from snapshot.errors import RelocationError, SnapshotError, UnsafeMemberError
from snapshot.relocate import (
    MAX_SHEBANG_LENGTH,
    PrefixRef,
    RelocationReport,
    classify_reference,
    relocate,
    rewrite_path,
    scan_tree,
)

PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE = f"lib/{PY}/site-packages"


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv with pip at OLD = <tmp>/old, plus a module whose source names OLD."""
    old = tmp_path_factory.mktemp("reloc") / "old"
    subprocess.run(
        [sys.executable, "-m", "venv", str(old)], check=True, capture_output=True, timeout=120
    )
    src = old / SITE / "where_mod.py"
    src.write_text(f'WHERE = "{old}/share"\n')
    py_compile.compile(str(src), cfile=cache_from_source(str(src)), doraise=True)
    return old


@pytest.fixture(scope="module")
def base_refs(base_venv: Path) -> list[PrefixRef]:
    return scan_tree(base_venv, str(base_venv))


def copy_venv(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, symlinks=True)
    return dst


def text_paths(refs: list[PrefixRef]) -> list[str]:
    return [r.path for r in refs if r.kind == "text"]


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under root (symlinks not followed): content or target, mode, mtime."""
    state: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                body: object = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                body = p.read_bytes()
            else:
                body = None
            state[str(p.relative_to(root))] = (body, st.st_mode, st.st_mtime_ns)
    return state


def run(*cmd: str | Path, **kw) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], check=True, capture_output=True, text=True, timeout=60, **kw
    )
    return out.stdout


def pip_version(prefix: Path) -> str:
    # Executed directly, so the kernel (or /bin/sh, for the trampoline) reads the shebang.
    return run(prefix / "bin" / "pip", "--version", env={"PATH": "/usr/bin:/bin"})


# --- pack time ------------------------------------------------------------------------------


def test_scan_finds_real_venv_references(base_venv: Path, base_refs: list[PrefixRef]) -> None:
    kinds = {r.path: r.kind for r in base_refs}
    for path in (
        "bin/pip",
        "bin/pip3",
        "bin/activate",
        "bin/activate.fish",
        "pyvenv.cfg",
        f"{SITE}/where_mod.py",
    ):
        assert kinds.get(path) == "text", path
    pycs = [p for p, k in kinds.items() if k == "pyc"]
    assert pycs and all(p.endswith(".pyc") for p in pycs)
    assert "binary" not in kinds.values()
    assert not any(p.startswith(("bin/python", "lib64")) for p in kinds)  # symlinks: not files
    assert [r.path for r in base_refs] == sorted(kinds)
    # Manifest form: plain JSON objects.
    encoded = json.dumps([r.to_json() for r in base_refs])
    assert [PrefixRef.from_json(o) for o in json.loads(encoded)] == base_refs


def test_classify_boundaries() -> None:
    old = b"/opt/venv"

    def kind(data: bytes, name: str = "f") -> str | None:
        got = classify_reference(name, data, old)
        assert classify_reference(name, memoryview(data), old) == got  # no-copy path agrees
        return got

    assert kind(b"x = '/opt/venv2/x'\n") is None
    assert kind(b"/opt/venvs /opt/venv.old /opt/venv_x /opt/venv-1") is None
    assert kind(b"/data/opt/venv/bin and http://h/opt/venv") is None  # tails of longer paths
    assert kind(b"nothing here") is None
    for hit in (
        b"/opt/venv/x",
        b'"/opt/venv"',
        b"'/opt/venv'",
        b"/opt/venv\n",
        b"/opt/venv:",
        b"/opt/venv",
        b"-I/opt/venv/include",
        b"prefix=/opt/venv",
        b"file:///opt/venv",
        b"/opt/venv2 then /opt/venv/bin",
        b"\xff\xfe /opt/venv latin-1 \xe9",
    ):
        assert kind(hit) == "text", hit
    assert kind(b"\x7fELF\0\0/opt/venv/lib\0") == "binary"
    assert kind(b"\x7fELF\0\0/opt/venv2/lib\0") is None
    assert kind(b"\xe3\0\0/opt/venv/lib/x.py", "a/__pycache__/x.cpython-311.pyc") == "pyc"
    with pytest.raises(ValueError):
        classify_reference("f", b"", b"opt/venv")
    with pytest.raises(ValueError):
        classify_reference("f", b"", b"/opt/venv/")


def test_prefix_ref_from_json_rejects_garbage() -> None:
    for bad in (
        [],
        {"path": "a"},
        {"path": "", "kind": "text"},
        {"path": "a", "kind": "elf"},
        {"path": 3, "kind": "text"},
    ):
        with pytest.raises(SnapshotError):
            PrefixRef.from_json(bad)


def test_rewrite_path_for_symlink_targets() -> None:
    assert rewrite_path("/opt/venv/lib", "/opt/venv", "/srv/env") == "/srv/env/lib"
    assert rewrite_path("/opt/venv2/lib", "/opt/venv", "/srv/env") == "/opt/venv2/lib"
    assert rewrite_path("../lib", "/opt/venv", "/srv/env") == "../lib"


# --- restore time ---------------------------------------------------------------------------


def test_relocate_real_venv(base_venv: Path, base_refs: list[PrefixRef], tmp_path: Path) -> None:
    old = str(base_venv)
    # Extract into a staging directory, relocate, then rename into place (the restore order).
    staging = copy_venv(base_venv, tmp_path / ".staging-new")
    new = tmp_path / "srv" / "envs" / "new"
    before = tree_state(staging)
    bin_mtime = (staging / "bin").stat().st_mtime_ns

    report = relocate(staging, old, str(new), base_refs)

    assert isinstance(report, RelocationReport)
    assert set(report.rewritten) == set(text_paths(base_refs))
    assert report.skipped_binary == [] and report.shebangs_converted == []
    assert (staging / "bin").stat().st_mtime_ns == bin_mtime
    after = tree_state(staging)
    assert not [n for n in after if ".relocate-" in n]  # no temp files left
    for path in report.rewritten:
        assert after[path][1:] == before[path][1:], path  # mode and mtime kept
        assert old.encode() not in after[path][0], path
        assert str(new).encode() in after[path][0], path
    pyc_path = cache_from_source(f"{SITE}/where_mod.py")
    assert report.pyc_invalidated == [pyc_path] and pyc_path not in after
    untouched = set(before) - set(report.rewritten) - {pyc_path}
    assert {p: after[p] for p in untouched} == {p: before[p] for p in untouched}

    new.parent.mkdir(parents=True)
    staging.rename(new)
    assert (new / "bin" / "pip").read_bytes().startswith(f"#!{new}/bin/{PY}\n".encode())
    assert f"from {new}/{SITE}/pip " in pip_version(new)
    assert run(new / "bin" / "python", "-c", "import sys; print(sys.prefix)").strip() == str(new)
    assert run("bash", "-c", f'source "{new}/bin/activate" && echo "$VIRTUAL_ENV"').strip() == str(
        new
    )
    assert f"command = {sys.executable} -m venv {new}" in (new / "pyvenv.cfg").read_text()
    assert (
        run(new / "bin" / "python", "-c", "import where_mod; print(where_mod.WHERE)").strip()
        == f"{new}/share"
    )
    # grep: no text file of the relocated tree mentions OLD any more.
    grep = subprocess.run(["grep", "-rIl", "--", old, str(new)], capture_output=True, text=True)
    assert grep.returncode == 1, grep.stdout


def test_same_length_prefix_drops_stale_pyc(base_venv: Path, base_refs: list[PrefixRef]) -> None:
    # Same length and preserved source mtime: the pyc header still matches the rewritten
    # source, so without invalidation Python would import the stale constant.
    new = base_venv.parent / "new"
    assert len(str(new)) == len(str(base_venv))
    copy_venv(base_venv, new)
    try:
        report = relocate(new, str(base_venv), str(new), base_refs)
        assert report.pyc_invalidated
        assert (
            run(new / "bin" / "python", "-c", "import where_mod; print(where_mod.WHERE)").strip()
            == f"{new}/share"
        )
    finally:
        shutil.rmtree(new)


def long_prefix(tmp_path: Path, name: str = "venv") -> Path:
    prefix = tmp_path / ("d" * 60) / ("e" * 60) / name
    assert len(f"#!{prefix}/bin/{PY}\n") > MAX_SHEBANG_LENGTH
    return prefix


def test_long_prefix_uses_trampoline_and_back(
    base_venv: Path, base_refs: list[PrefixRef], tmp_path: Path
) -> None:
    long_new = copy_venv(base_venv, long_prefix(tmp_path))
    report = relocate(long_new, str(base_venv), str(long_new), base_refs)
    assert {"bin/pip", "bin/pip3"} <= set(report.shebangs_converted)
    head = (long_new / "bin" / "pip").read_bytes().split(b"\n")[:3]
    assert head == [b"#!/bin/sh", f"'''exec' {long_new}/bin/{PY} \"$0\" \"$@\"".encode(), b"' '''"]
    assert f"from {long_new}/{SITE}/pip " in pip_version(long_new)
    assert os.stat(long_new / "bin" / "pip").st_mode & 0o111

    # The snapshot is now built at the long prefix: back to a short one, the trampoline's
    # path is rewritten and it becomes the plain shebang pip would have written.
    refs = scan_tree(long_new, str(long_new))
    assert {r.path: r.kind for r in refs}["bin/pip"] == "text"
    short = copy_venv(long_new, tmp_path / "short")
    report = relocate(short, str(long_new), str(short), refs)
    assert "bin/pip" in report.shebangs_converted
    assert (short / "bin" / "pip").read_bytes() == (base_venv / "bin" / "pip").read_bytes().replace(
        str(base_venv).encode(), str(short).encode()
    )
    assert f"from {short}/{SITE}/pip " in pip_version(short)


def test_long_to_long_and_spaces(
    base_venv: Path, base_refs: list[PrefixRef], tmp_path: Path
) -> None:
    long_a = copy_venv(base_venv, long_prefix(tmp_path, "a"))
    relocate(long_a, str(base_venv), str(long_a), base_refs)
    refs = scan_tree(long_a, str(long_a))
    # A path with a space: distlib quotes it and always uses the trampoline.
    spaced = copy_venv(long_a, tmp_path / "with space" / "env")
    report = relocate(spaced, str(long_a), str(spaced), refs)
    assert "bin/pip" not in report.shebangs_converted  # trampoline -> trampoline
    head = (spaced / "bin" / "pip").read_bytes().split(b"\n")[:2]
    assert head == [b"#!/bin/sh", f'\'\'\'exec\' "{spaced}/bin/{PY}" "$0" "$@"'.encode()]
    assert f"from {spaced}/{SITE}/pip " in pip_version(spaced)
    # And from the quoted trampoline back to a short plain one.
    refs = scan_tree(spaced, str(spaced))
    short = copy_venv(spaced, tmp_path / "s")
    relocate(short, str(spaced), str(short), refs)
    assert (short / "bin" / "pip").read_bytes().startswith(f"#!{short}/bin/{PY}\n".encode())
    assert f"from {short}/{SITE}/pip " in pip_version(short)


def test_boundary_in_files(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    (old / "not_ref.txt").write_text(f"{old}2/x {tmp_path}/x{old}\n")
    (old / "ref.txt").write_text(f'{old}2/x "{old}" {old}/x -L{old}/lib {old}')
    refs = scan_tree(old, str(old))
    assert refs == [PrefixRef("ref.txt", "text")]
    shutil.copytree(old, new)
    relocate(new, str(old), str(new), refs)
    assert (new / "ref.txt").read_text() == f'{old}2/x "{new}" {new}/x -L{new}/lib {new}'
    assert (new / "not_ref.txt").read_text() == (old / "not_ref.txt").read_text()


def test_binary_refused_unless_force(base_venv: Path, tmp_path: Path) -> None:
    old = str(base_venv)
    tree = copy_venv(base_venv, tmp_path / "new")
    libdir = tree / SITE / "native"
    libdir.mkdir()
    so = libdir / "_ext.so"
    so.write_bytes(b"\x7fELF\x02\x01\0\0" + f"RPATH={old}/lib\0".encode() + b"\0" * 16)
    refs = scan_tree(tree, old)
    assert {r.path: r.kind for r in refs}[f"{SITE}/native/_ext.so"] == "binary"
    before = tree_state(tree)

    with pytest.raises(RelocationError) as info:
        relocate(tree, old, str(tree), refs)
    err = info.value
    assert err.paths == [f"{SITE}/native/_ext.so"]
    msg = str(err)
    assert f"{SITE}/native/_ext.so" in msg and old in msg and str(tree) in msg
    assert "--force" in msg
    assert tree_state(tree) == before  # nothing changed

    report = relocate(tree, old, str(tree), refs, force=True)
    assert report.skipped_binary == [f"{SITE}/native/_ext.so"]
    assert "bin/pip" in report.rewritten
    assert so.read_bytes() == before[f"{SITE}/native/_ext.so"][0]
    assert "--force" not in report.summary() and "1 binary" in report.summary()


def test_binary_error_lists_first_ten(tmp_path: Path) -> None:
    refs = [PrefixRef(f"lib/b{i:02}.so", "binary") for i in range(25)]
    with pytest.raises(RelocationError) as info:
        relocate(tmp_path, "/opt/venv", "/srv/venv", refs)
    assert len(info.value.paths) == 25
    msg = str(info.value)
    assert "lib/b09.so" in msg and "lib/b10.so" not in msg and "15 more" in msg


@pytest.mark.parametrize(
    "bad",
    [
        "../outside.txt",
        "/OUTSIDE",
        "link",
        "evil/victim.txt",
        f"lib64/{PY}/x.py",
        "bin//pip",
        "./bin/pip",
        "bin/",
        "",
        "fifo",
        "missing.txt",
    ],
)
def test_unsafe_refs_change_nothing(base_venv: Path, tmp_path: Path, bad: str) -> None:
    outside_dir = tmp_path / "outside"
    outside_dir.mkdir()
    victim = outside_dir / "victim.txt"
    victim.write_text(f"{base_venv}/bin\n")
    (tmp_path / "outside.txt").write_text(f"{base_venv}/bin\n")
    tree = copy_venv(base_venv, tmp_path / "tree")
    (tree / f"lib/{PY}/x.py").write_text(f"{base_venv}\n")
    (tree / "link").symlink_to("../outside.txt")
    (tree / "evil").symlink_to(outside_dir)
    os.mkfifo(tree / "fifo")
    if bad == "/OUTSIDE":
        bad = str(tmp_path / "outside.txt")
    # The bad ref comes last: earlier good refs must not have been rewritten either.
    refs = [PrefixRef("bin/pip", "text"), PrefixRef("pyvenv.cfg", "text"), PrefixRef(bad, "text")]
    before, outside_before = tree_state(tree), tree_state(tmp_path / "outside")
    with pytest.raises(SnapshotError) as info:
        relocate(tree, str(base_venv), str(tmp_path / "new"), refs)
    assert repr(bad) in str(info.value)
    if bad != "missing.txt":
        assert isinstance(info.value, UnsafeMemberError)
    assert tree_state(tree) == before
    assert tree_state(tmp_path / "outside") == outside_before
    assert (tmp_path / "outside.txt").read_text() == f"{base_venv}/bin\n"


def test_same_prefix_is_a_no_op(
    base_venv: Path, base_refs: list[PrefixRef], tmp_path: Path
) -> None:
    tree = copy_venv(base_venv, tmp_path / "tree")
    before = tree_state(tree)
    refs = base_refs + [PrefixRef("lib/x.so", "binary")]  # not even refused
    report = relocate(tree, str(base_venv), str(base_venv), refs)
    assert not report.changed and report.rewritten == [] and report.skipped_binary == []
    assert tree_state(tree) == before


def test_bad_new_prefix(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="choose another path"):
        relocate(tmp_path, "/opt/venv", '/srv/"quoted"', [])
    with pytest.raises(ValueError):
        relocate(tmp_path, "/opt/venv", "relative/path", [])


def test_hard_links_rewritten_once(tmp_path: Path) -> None:
    old, new = "/opt/venv", str(tmp_path / "new")
    (tmp_path / "a").write_text("/opt/venv/bin\n")
    os.link(tmp_path / "a", tmp_path / "b")
    refs = [PrefixRef("a", "text"), PrefixRef("b", "text")]
    report = relocate(tmp_path, old, new, refs)
    assert report.rewritten == ["a"] and report.unchanged == ["b"]
    assert (tmp_path / "b").read_text() == f"{new}/bin\n"
    assert os.stat(tmp_path / "a").st_ino == os.stat(tmp_path / "b").st_ino
