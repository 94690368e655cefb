"""The local PEP 503 index of bootseer.testing.pypi: real wheels, real pip and uv, 127.0.0.1 only."""

from __future__ import annotations

import base64
import hashlib
import http.client
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from bootseer.testing.pypi import (
    TEST_WHEELS,
    TINYDATA_BLOB,
    TINYDATA_DIGEST,
    PackageIndex,
    build_test_wheels,
    build_wheel,
    installer_env,
    normalize_project,
    wheel_filename,
)

TEST_PACKAGES = ("tinyalpha", "tinybeta", "tinydata")


def run(cmd: Sequence[str | Path], env: dict[str, str], timeout: float = 120) -> str:
    """Run ``cmd``; fail the test with its output when it exits non-zero. Returns stdout."""
    proc = subprocess.run(
        [str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}",
            pytrace=False,
        )
    return proc.stdout


def get(index: PackageIndex, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One request to the index with http.client (never through a proxy)."""
    conn = http.client.HTTPConnection(index.host, index.port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def hrefs(page: bytes) -> list[str]:
    return re.findall(r'href="([^"]+)"', page.decode("utf-8"))


# -- wheels -----------------------------------------------------------------------------------


def test_build_wheel_is_deterministic(tmp_path: Path) -> None:
    first = build_test_wheels(tmp_path / "a")
    second = build_test_wheels(tmp_path / "b")
    assert [p.name for p in first] == [spec.filename for spec in TEST_WHEELS]
    for one, two in zip(first, second, strict=True):
        assert one.read_bytes() == two.read_bytes(), one.name
    # Rebuilding over an existing file gives the same bytes too; other inputs, other bytes.
    again = TEST_WHEELS[0].build(tmp_path / "a")
    assert again.read_bytes() == second[0].read_bytes()
    other = build_wheel(tmp_path / "c", "tinyalpha", "1.0", modules={"tinyalpha/__init__.py": ""})
    assert other.read_bytes() != first[0].read_bytes()


def test_wheel_contents_follow_the_spec(tmp_path: Path) -> None:
    path = build_wheel(
        tmp_path,
        "My.Odd-Name",
        "1.2.3",
        modules={"my_odd_name/__init__.py": "X = 1\n", "my_odd_name/cli.py": "def main(): pass\n"},
        console_scripts={"odd-cli": "my_odd_name.cli:main"},
        requires=["tinyalpha>=1.0", "tinydata; python_version >= '3'"],
        data_files={"my_odd_name/data/x.bin": b"\x00\x01"},
    )
    assert (
        path.name == "my_odd_name-1.2.3-py3-none-any.whl" == wheel_filename("My.Odd-Name", "1.2.3")
    )
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        assert all(info.date_time == (1980, 1, 1, 0, 0, 0) for info in zf.infolist())
        files = {name: zf.read(name) for name in names}
    dist_info = "my_odd_name-1.2.3.dist-info"
    assert names[-1] == f"{dist_info}/RECORD"
    metadata = files[f"{dist_info}/METADATA"].decode()
    assert "Metadata-Version: 2.1\n" in metadata
    assert "Name: My.Odd-Name\n" in metadata and "Version: 1.2.3\n" in metadata
    assert "Requires-Dist: tinyalpha>=1.0\n" in metadata
    assert "Requires-Dist: tinydata; python_version >= '3'\n" in metadata
    wheel = files[f"{dist_info}/WHEEL"].decode()
    for line in ("Wheel-Version: 1.0", "Root-Is-Purelib: true", "Tag: py3-none-any"):
        assert line in wheel.splitlines()
    assert files[f"{dist_info}/entry_points.txt"].decode().splitlines() == [
        "[console_scripts]",
        "odd-cli = my_odd_name.cli:main",
    ]
    assert files["my_odd_name/data/x.bin"] == b"\x00\x01"
    # RECORD lists every other member with its urlsafe-b64 sha256 and size, itself unhashed.
    record = {}
    for line in files[f"{dist_info}/RECORD"].decode().splitlines():
        name, digest, size = line.rsplit(",", 2)
        record[name] = (digest, size)
    assert set(record) == set(names)
    assert record[f"{dist_info}/RECORD"] == ("", "")
    for name, data in files.items():
        if name.endswith("/RECORD"):
            continue
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert record[name] == (f"sha256={expected}", str(len(data))), name


def test_build_wheel_rejects_escaping_paths(tmp_path: Path) -> None:
    for bad in ("../evil.py", "/abs.py", "pkg//x.py", ""):
        with pytest.raises(ValueError):
            build_wheel(tmp_path, "bad", "1.0", modules={bad: ""})


def test_tinydata_blob_is_fixed() -> None:
    assert len(TINYDATA_BLOB) == 64 * 1024
    assert hashlib.sha256(TINYDATA_BLOB).hexdigest() == TINYDATA_DIGEST
    assert len(set(TINYDATA_BLOB)) == 256  # pseudo-random, not a fill pattern


# -- the index --------------------------------------------------------------------------------


def test_index_serves_pep503_pages_and_counts_requests(package_index: PackageIndex) -> None:
    index = package_index
    assert index.url == f"http://127.0.0.1:{index.port}/simple/"
    assert index.total_requests == 0

    status, headers, body = get(index, "/simple/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert hrefs(body) == [f"/simple/{p}/" for p in TEST_PACKAGES]

    status, _, body = get(index, "/simple/tinyalpha/")
    assert status == 200
    links = hrefs(body)
    assert [link.split("#")[0] for link in links] == [
        "/files/tinyalpha-1.0-py3-none-any.whl",
        "/files/tinyalpha-2.0-py3-none-any.whl",
    ]
    for link in links:
        file_path, fragment = link.split("#")
        status, headers, data = get(index, file_path)
        assert status == 200 and int(headers["content-length"]) == len(data)
        assert fragment == "sha256=" + hashlib.sha256(data).hexdigest()
        assert data == (index.wheel_dir / file_path.rsplit("/", 1)[1]).read_bytes()

    # PEP 658/714 core metadata next to each wheel, announced with its hash.
    page = body.decode()
    metadata_path = "/files/tinyalpha-2.0-py3-none-any.whl.metadata"
    status, _, metadata = get(index, metadata_path)
    assert status == 200 and b"Name: tinyalpha\nVersion: 2.0\n" in metadata
    meta_hash = "sha256=" + hashlib.sha256(metadata).hexdigest()
    assert f'data-core-metadata="{meta_hash}"' in page
    assert f'data-dist-info-metadata="{meta_hash}"' in page

    # Other spellings redirect to the normalized name; unknown things are 404.
    status, headers, _ = get(index, "/simple/TinyAlpha")
    assert status == 301 and headers["location"] == "/simple/tinyalpha/"
    assert get(index, "/simple/nothere/")[0] == 404
    assert get(index, "/files/nothere-1.0-py3-none-any.whl")[0] == 404
    assert get(index, "/files/..%2Fsecret")[0] == 404
    head_status, head_headers, head_body = get(index, "/simple/", method="HEAD")
    assert head_status == 200 and head_body == b"" and int(head_headers["content-length"]) > 0

    assert index.requests["/simple/"] == 2
    assert index.requests["/simple/tinyalpha/"] == 1
    assert index.downloads("tinyalpha-2.0-py3-none-any.whl") == 1
    assert index.requests[metadata_path] == 1
    assert index.requests["/simple/nothere/"] == 1
    assert index.method_requests[("HEAD", "/simple/")] == 1
    assert index.total_requests == 10
    index.reset_counts()
    assert index.total_requests == 0


def test_index_lists_wheels_added_after_start(package_index: PackageIndex) -> None:
    build_wheel(package_index.wheel_dir, "Late_Comer", "0.9", modules={"late_comer.py": ""})
    (package_index.wheel_dir / "notes.txt").write_text("not a wheel")
    _, _, body = get(package_index, "/simple/")
    assert "/simple/late-comer/" in hrefs(body)
    assert normalize_project("Late_Comer") == "late-comer"
    _, _, body = get(package_index, "/simple/late-comer/")
    assert [h.split("#")[0] for h in hrefs(body)] == ["/files/late_comer-0.9-py3-none-any.whl"]


def test_index_without_metadata(tmp_path: Path) -> None:
    build_test_wheels(tmp_path)
    with PackageIndex(tmp_path, metadata=False) as index:
        _, _, body = get(index, "/simple/tinydata/")
        assert b"data-core-metadata" not in body and b"data-dist-info-metadata" not in body
        assert get(index, "/files/tinydata-0.3-py3-none-any.whl.metadata")[0] == 404


def test_index_stops_and_restarts(tmp_path: Path) -> None:
    build_test_wheels(tmp_path)
    index = PackageIndex(tmp_path)
    with index:
        assert index.running and get(index, "/simple/")[0] == 200
        port = index.port
    assert not index.running
    with pytest.raises(OSError):
        http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/simple/")


def test_installer_env_drops_machine_configuration(tmp_path: Path) -> None:
    base = {
        "PATH": "/usr/bin",
        "PIP_FIND_LINKS": "/opt/wheels",
        "PIP_EXTRA_INDEX_URL": "file:///opt/pypi/simple",
        "PIP_NO_INDEX": "1",
        "UV_INDEX_URL": "https://example.invalid/simple",
        "NO_PROXY": "internal.example",
    }
    env = installer_env(base=base)
    assert env["PATH"] == "/usr/bin"
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "UV_INDEX_URL"):
        assert var not in env
    assert env["PIP_CONFIG_FILE"] == "/dev/null" and env["UV_NO_CONFIG"] == "1"
    assert env["PIP_NO_CACHE_DIR"] == "1" and env["UV_NO_CACHE"] == "1"
    assert env["NO_PROXY"].split(",") == ["internal.example", "127.0.0.1", "localhost"]
    cached = installer_env(tmp_path, base=base)
    assert cached["PIP_CACHE_DIR"] == cached["UV_CACHE_DIR"] == str(tmp_path)
    assert "PIP_NO_CACHE_DIR" not in cached and "UV_NO_CACHE" not in cached


# -- real pip ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pip_venv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One venv with pip (ensurepip, offline) for the module's pip tests."""
    venv = tmp_path_factory.mktemp("pip-venv") / "venv"
    run([sys.executable, "-m", "venv", venv], env=installer_env())
    return venv


@pytest.fixture
def pip_venv(pip_venv_dir: Path) -> Iterator[Path]:
    """The shared venv, without any test package installed."""
    pip = pip_venv_dir / "bin" / "pip"
    run([pip, "uninstall", "-y", *TEST_PACKAGES], env=installer_env())
    yield pip_venv_dir


def pip_install(venv: Path, index: PackageIndex, *reqs: str) -> str:
    cmd = [venv / "bin" / "pip", "install", "--no-cache-dir", "--index-url", index.url, *reqs]
    return run(cmd, env=installer_env())


def test_pip_installs_with_dependencies(pip_venv: Path, package_index: PackageIndex) -> None:
    out = pip_install(pip_venv, package_index, "tinybeta", "tinydata")
    assert "Successfully installed tinyalpha-2.0 tinybeta-0.1 tinydata-0.3" in out
    env = installer_env()
    assert run([pip_venv / "bin" / "tinybeta-cli"], env).strip() == "beta-cli-ok alpha-2.0"
    assert run([pip_venv / "bin" / "tinyalpha-cli"], env).strip() == "alpha-cli-ok"
    digest = run(
        [pip_venv / "bin" / "python", "-c", "import tinydata; print(tinydata.DIGEST)"], env
    )
    assert digest.strip() == TINYDATA_DIGEST
    # Everything came through the index: the newest tinyalpha, never the older one.
    assert package_index.requests["/simple/tinybeta/"] >= 1
    assert package_index.requests["/simple/tinyalpha/"] >= 1
    assert package_index.downloads("tinyalpha-2.0-py3-none-any.whl") == 1
    assert package_index.downloads("tinyalpha-1.0-py3-none-any.whl") == 0


def test_pip_installs_pinned_version(pip_venv: Path, package_index: PackageIndex) -> None:
    out = pip_install(pip_venv, package_index, "tinyalpha==1.0", "tinybeta")
    assert "Successfully installed tinyalpha-1.0 tinybeta-0.1" in out
    env = installer_env()
    assert run([pip_venv / "bin" / "tinybeta-cli"], env).strip() == "beta-cli-ok alpha-1.0"
    assert package_index.downloads("tinyalpha-2.0-py3-none-any.whl") == 0


def test_pip_sees_nothing_but_the_index(pip_venv: Path, package_index: PackageIndex) -> None:
    """A project the index lacks is not found anywhere else (find-links, extra indexes)."""
    proc = subprocess.run(
        [pip_venv / "bin" / "pip", "install", "--no-cache-dir", "--index-url", package_index.url]
        + ["pip-index-probe-does-not-exist"],
        env=installer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "No matching distribution found" in proc.stderr
    # With the machine's config (find-links, extra indexes) pip would list those here.
    assert f"Looking in indexes: {package_index.url}\n" in proc.stdout
    assert "Looking in links" not in proc.stdout + proc.stderr
    assert package_index.requests["/simple/pip-index-probe-does-not-exist/"] >= 1


# -- real uv ----------------------------------------------------------------------------------


def find_uv() -> str | None:
    try:
        import uv  # type: ignore[import-not-found]

        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError):
        pass
    return shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")


def test_uv_pip_installs_from_the_index(tmp_path: Path, package_index: PackageIndex) -> None:
    uv = find_uv()
    if uv is None:
        pytest.skip("uv is not installed (pip install uv)")
    env = installer_env(cache_dir=tmp_path / "uv-cache")
    venv = tmp_path / "uv-venv"
    run([uv, "venv", "--python", sys.executable, venv], env)
    python = venv / "bin" / "python"
    install = [uv, "pip", "install", "--python", python, "--index-url", package_index.url]
    run([*install, "tinybeta", "tinydata"], env)
    assert run([venv / "bin" / "tinybeta-cli"], env).strip() == "beta-cli-ok alpha-2.0"
    digest = run([python, "-c", "import tinydata; print(tinydata.DIGEST)"], env)
    assert digest.strip() == TINYDATA_DIGEST
    assert package_index.requests["/simple/tinyalpha/"] >= 1
    assert package_index.downloads("tinyalpha-2.0-py3-none-any.whl") == 1

    run([*install, "tinyalpha==1.0"], env)
    assert run([venv / "bin" / "tinybeta-cli"], env).strip() == "beta-cli-ok alpha-1.0"
    assert package_index.downloads("tinyalpha-1.0-py3-none-any.whl") == 1
