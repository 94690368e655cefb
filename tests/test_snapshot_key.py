"""snapshot.key: the environment fingerprint is insensitive to formatting, sensitive to meaning."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from snapshot import FORMAT_VERSION
from snapshot import key as keymod
from snapshot.errors import SnapshotError
from snapshot.key import (
    EnvKey,
    SpecFileError,
    compute_key,
    normalize_requirement,
    normalize_spec_file,
    parse_extras,
    python_identity,
)

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def key_of(path: Path, **kw) -> str:
    return compute_key([path], **kw).key


REQS = """\
torch==2.13.0
numpy>=1.26
--index-url https://download.pytorch.org/whl/cu124
Pillow[Foo,bar]>=10 ; python_version < "3.12"
"""

REQS_REFORMATTED = """\
# pinned for the cluster
   --index-url=https://download.pytorch.org/whl/cu124

pillow [BAR, foo] >= 10;python_version<'3.12'   # inline comment
NumPy >= 1.26
torch == 2.13.0 \\
    # trailing comment line

"""


# --- requirements files ---------------------------------------------------------------------


def test_requirements_formatting_does_not_change_key(tmp_path: Path) -> None:
    a = write(tmp_path / "a" / "requirements.txt", REQS)
    b = write(tmp_path / "b" / "requirements.txt", REQS_REFORMATTED)
    assert normalize_spec_file(a) == normalize_spec_file(b)
    assert key_of(a) == key_of(b)


def test_requirement_normalization() -> None:
    assert normalize_requirement("torch == 2.13.0") == "torch==2.13.0"
    assert normalize_requirement("Foo_Bar.baz") == normalize_requirement("foo-bar-baz")
    assert normalize_requirement("x[B, a]>=1, <2") == "x[a,b]<2,>=1"
    assert normalize_requirement('x; python_version<"3.12"') == normalize_requirement(
        "x ; python_version < '3.12'"
    )
    assert normalize_requirement("./local/pkg") == "./local/pkg"
    assert (
        normalize_requirement("pkg @ https://h/p.whl ; sys_platform=='linux'")
        == 'pkg @ https://h/p.whl ; sys_platform == "linux"'
    )


def test_version_pin_changes_key(tmp_path: Path) -> None:
    a = write(tmp_path / "a" / "requirements.txt", "torch==2.13.0\n")
    b = write(tmp_path / "b" / "requirements.txt", "torch==2.13.1\n")
    c = write(tmp_path / "c" / "requirements.txt", "torch==2.13.0 ; sys_platform == 'linux'\n")
    assert len({key_of(a), key_of(b), key_of(c)}) == 3


def test_options_and_hashes(tmp_path: Path) -> None:
    a = write(
        tmp_path / "a" / "req.txt",
        "--pre\nfoo==1.0 --hash=sha256:bbb \\\n    --hash=sha256:aaa\n-f ./wheels\n",
    )
    b = write(
        tmp_path / "b" / "req.txt",
        "--find-links=./wheels\nFoo == 1.0 --hash sha256:aaa --hash=sha256:bbb\n--pre\n",
    )
    na = normalize_spec_file(a)
    assert na == normalize_spec_file(b)
    assert na["options"] == ["--find-links=./wheels", "--pre"]
    assert na["entries"] == ["foo==1.0 --hash=sha256:aaa --hash=sha256:bbb"]
    c = write(tmp_path / "c" / "req.txt", "foo==1.0 --hash=sha256:aaa\n--pre\n-f ./wheels\n")
    d = write(tmp_path / "d" / "req.txt", "foo==1.0 --hash=sha256:aaa --hash=sha256:bbb\n")
    assert len({key_of(a), key_of(c), key_of(d)}) == 3


def test_includes_followed_and_cycles_guarded(tmp_path: Path) -> None:
    write(tmp_path / "base.txt", "numpy==1.26.4\n-r requirements.txt\n")
    write(tmp_path / "sub" / "constraints.txt", "urllib3<2\n")
    top = write(
        tmp_path / "requirements.txt", "torch==2.13.0\n-r base.txt\n-c sub/constraints.txt\n"
    )
    spec = normalize_spec_file(top)
    assert spec["entries"] == ["torch==2.13.0"]
    by_path = {inc["path"]: inc for inc in spec["includes"]}
    assert by_path["constraints.txt"]["option"] == "--constraint"
    assert by_path["constraints.txt"]["entries"] == ["urllib3<2"]
    base = by_path["base.txt"]
    assert base["option"] == "--requirement"
    assert base["entries"] == ["numpy==1.26.4"]
    assert base["includes"] == [
        {
            "option": "--requirement",
            "path": "requirements.txt",
            "kind": "requirements",
            "cycle": True,
        }
    ]
    before = key_of(top)
    write(tmp_path / "sub" / "constraints.txt", "urllib3<3\n")
    assert key_of(top) != before

    self_ref = write(tmp_path / "self" / "requirements.txt", "-r requirements.txt\nfoo\n")
    assert normalize_spec_file(self_ref)["includes"][0]["cycle"] is True


def test_missing_include_names_both_files(tmp_path: Path) -> None:
    top = write(tmp_path / "requirements.txt", "-r nope.txt\n")
    with pytest.raises(SpecFileError, match=r"requirements\.txt.*nope\.txt"):
        normalize_spec_file(top)


# --- uv.lock and pyproject -------------------------------------------------------------------

UV_LOCK = """\
version = 1
requires-python = ">=3.11"

[[package]]
name = "numpy"
version = "1.26.4"
source = { registry = "https://pypi.org/simple" }
wheels = [{ url = "https://example/numpy.whl", hash = "sha256:abc" }]
"""

UV_LOCK_REFORMATTED = """\
# generated by uv
requires-python = '>=3.11'
version = 1

[[package]]
source = {registry="https://pypi.org/simple"}
version = "1.26.4"
name = "numpy"

  [[package.wheels]]
  hash = "sha256:abc"
  url = "https://example/numpy.whl"
"""


def test_uv_lock_formatting_insensitive(tmp_path: Path) -> None:
    a = write(tmp_path / "a" / "uv.lock", UV_LOCK)
    b = write(tmp_path / "b" / "uv.lock", UV_LOCK_REFORMATTED)
    c = write(tmp_path / "c" / "uv.lock", UV_LOCK.replace("1.26.4", "1.26.5"))
    na = normalize_spec_file(a)
    assert na["kind"] == "uv.lock" and na["entries"] == ["numpy==1.26.4"]
    assert na == normalize_spec_file(b)
    assert key_of(a) == key_of(b) != key_of(c)


def test_invalid_toml_names_file(tmp_path: Path) -> None:
    bad = write(tmp_path / "uv.lock", "version = = 1\n")
    with pytest.raises(SpecFileError, match=r"uv\.lock.*not valid TOML"):
        compute_key([bad])


PYPROJECT = """\
[build-system]
requires = ["setuptools>=65"]

[project]
name = "My_Proj"
version = "0.1"
description = "{desc}"
requires-python = ">=3.11"
dependencies = [{deps}]

[project.optional-dependencies]
test = ["pytest>=8", "Moto[Server]>=5"]

[tool.ruff]
line-length = {line}
"""


def test_pyproject_ignores_description_and_tools(tmp_path: Path) -> None:
    deps = '"torch==2.13.0", "numpy>=1.26"'
    a = write(tmp_path / "a" / "pyproject.toml", PYPROJECT.format(desc="one", deps=deps, line=100))
    b = write(
        tmp_path / "b" / "pyproject.toml",
        PYPROJECT.format(desc="two", deps='"NumPy >= 1.26", "torch == 2.13.0"', line=80),
    )
    c = write(
        tmp_path / "c" / "pyproject.toml",
        PYPROJECT.format(desc="one", deps='"torch==2.13.1", "numpy>=1.26"', line=100),
    )
    na = normalize_spec_file(a)
    assert na["kind"] == "pyproject" and na["name"] == "my-proj"
    assert na["dependencies"] == ["numpy>=1.26", "torch==2.13.0"]
    assert na["optional_dependencies"] == {"test": ["moto[server]>=5", "pytest>=8"]}
    assert na["build_requires"] == ["setuptools>=65"]
    assert key_of(a) == key_of(b) != key_of(c)


def test_other_file_hashed_by_content(tmp_path: Path) -> None:
    a = write(tmp_path / "a" / "environment.yml", "dependencies: [numpy]\n")
    b = write(tmp_path / "b" / "environment.yml", "dependencies: [numpy]\n")
    c = write(tmp_path / "c" / "environment.yml", "dependencies: [scipy]\n")
    assert normalize_spec_file(a)["kind"] == "file"
    assert key_of(a) == key_of(b) != key_of(c)


def test_missing_spec_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "requirements-gpu.txt"
    with pytest.raises(SpecFileError, match="requirements-gpu.txt.*does not exist"):
        compute_key([missing])
    assert issubclass(SpecFileError, SnapshotError) and issubclass(SpecFileError, ValueError)


def test_spec_file_order_matters(tmp_path: Path) -> None:
    a = write(tmp_path / "a.txt", "foo\n")
    b = write(tmp_path / "b.txt", "bar\n")
    assert compute_key([a, b]).key != compute_key([b, a]).key


# --- other inputs ----------------------------------------------------------------------------


def test_other_inputs_change_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    req = write(tmp_path / "requirements.txt", "torch==2.13.0\n")
    base = key_of(req)
    keys = {
        base,
        key_of(req, install_command=["pip", "install", "-r", "requirements.txt"]),
        key_of(req, install_command=["pip", "install", "--no-deps", "-r", "requirements.txt"]),
        key_of(req, install_command=["uv", "pip", "install", "-r", "requirements.txt"]),
        key_of(req, extras={"cuda": "12.4"}),
        key_of(req, extras={"cuda": "12.6"}),
        key_of(req, base_image="sha256:" + "1" * 64),
        key_of(req, capture=["/opt/tools"]),
        key_of(req, capture=["/opt/tools", "/usr/local/lib"]),
    }
    assert len(keys) == 9
    assert key_of(req, extras={"b": "2", "a": "1"}) == key_of(req, extras={"a": "1", "b": "2"})
    assert key_of(req, capture=["/b", "/a/../a"]) == key_of(req, capture=["/a", "/b"])

    ident = python_identity()
    monkeypatch.setattr(keymod, "python_identity", lambda python=None: {**ident, "soabi": "x"})
    assert key_of(req) != base


def test_base_image_comes_from_the_caller_or_the_config_never_the_library_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = write(tmp_path / "requirements.txt", "torch==2.13.0\n")
    digest = "registry.example/train@sha256:" + "a" * 64
    assert compute_key([req]).inputs["base_image"] is None
    flagged = compute_key([req], base_image=digest)
    assert flagged.inputs["base_image"] == digest
    for name in ("BOOTSEER_BASE_IMAGE", "BOOTSEER_ENV_BASE_IMAGE"):  # the library reads neither
        monkeypatch.setenv(name, digest)
        assert compute_key([req]).inputs["base_image"] is None
        monkeypatch.delenv(name)
    assert compute_key([req], base_image="other").inputs["base_image"] == "other"

    # bootseer passes the key env.base_image: its variable, or its flag, gives the same key.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}
    argv = [sys.executable, "-m", "bootseer", "env", "key", "--spec", str(req), "--json"]
    by_var = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=True,
        env={**env, "BOOTSEER_ENV_BASE_IMAGE": digest},
    )
    by_flag = subprocess.run(
        [*argv, "--base-image", digest], capture_output=True, text=True, check=True, env=env
    )
    assert json.loads(by_var.stdout)["key"] == json.loads(by_flag.stdout)["key"] == flagged.key
    old = subprocess.run(
        argv, capture_output=True, text=True, env={**env, "BOOTSEER_BASE_IMAGE": digest}
    )
    assert old.returncode == 2 and "use BOOTSEER_ENV_BASE_IMAGE" in old.stderr


def test_python_identity_fields_and_errors(tmp_path: Path) -> None:
    ident = python_identity()
    assert ident["version"] == ".".join(map(str, sys.version_info[:3]))
    assert ident["implementation"] == sys.implementation.name
    assert ident["cache_tag"] == sys.implementation.cache_tag
    for field in ("soabi", "platform", "libc", "machine"):
        assert field in ident
    assert python_identity(sys.executable) == ident
    with pytest.raises(SnapshotError, match="no-such-python"):
        python_identity(str(tmp_path / "no-such-python"))
    failing = write(tmp_path / "failing-python", "#!/bin/sh\necho broken >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(SnapshotError, match=r"failing-python.*exit code 3"):
        python_identity(str(failing))


def test_parse_extras() -> None:
    assert parse_extras(["cuda=12.4", "driver = 550.54", "empty="]) == {
        "cuda": "12.4",
        "driver": "550.54",
        "empty": "",
    }
    assert parse_extras(["cuda=12.4", "cuda=12.4"]) == {"cuda": "12.4"}
    for bad, why in [("cuda", "NAME=VALUE"), ("=12.4", "name"), ("a b=1", "name")]:
        with pytest.raises(ValueError, match=re.escape(repr(bad)) + ".*" + why):
            parse_extras([bad])
    with pytest.raises(ValueError, match="already given"):
        parse_extras(["cuda=12.4", "cuda=12.6"])


def test_install_command_string_rejected() -> None:
    with pytest.raises(TypeError, match="list of arguments"):
        compute_key([], "pip install torch")  # type: ignore[arg-type]


# --- output ----------------------------------------------------------------------------------


def test_inputs_describe_and_json(tmp_path: Path) -> None:
    req = write(tmp_path / "requirements.txt", "torch==2.13.0\n--pre\n-r more.txt\n")
    write(tmp_path / "more.txt", "numpy>=1.26\n")
    k = compute_key(
        [req],
        ["pip", "install", "-r", "requirements.txt"],
        base_image="sha256:" + "b" * 64,
        extras={"cuda": "12.4"},
        capture=["/opt/tools"],
    )
    assert isinstance(k, EnvKey)
    assert list(k.inputs) == [
        "format_version",
        "python",
        "spec",
        "install_command",
        "base_image",
        "extras",
        "capture",
    ]
    assert k.inputs["format_version"] == FORMAT_VERSION
    assert k.inputs["install_command"] == ["pip", "install", "-r", "requirements.txt"]
    assert str(tmp_path) not in json.dumps(k.inputs)  # no absolute spec paths in the key
    text = k.describe()
    assert text.startswith(f"key: {k.key}\n")
    for needle in [
        "format_version: 1",
        f"python: {sys.implementation.name}",
        python_identity()["version"],
        "spec[0]: requirements.txt (requirements)",
        "requirement: torch==2.13.0",
        "option: --pre",
        "include: --requirement more.txt",
        "requirement: numpy>=1.26",
        "install_command: pip install -r requirements.txt",
        "base_image: sha256:bbbb",
        "extras: cuda=12.4",
        "capture: /opt/tools",
    ]:
        assert needle in text, needle
    for name in k.inputs:
        assert re.search(rf"^{name}(\[\d+\])?: ", text, re.M), name
    assert "install_command: default" in compute_key([req]).describe()
    data = k.to_json()
    assert data["key"] == k.key and data["inputs"] == k.inputs
    data["inputs"]["extras"]["cuda"] = "0"
    assert k.inputs["extras"]["cuda"] == "12.4"
    assert json.loads(json.dumps(data))["key"] == k.key


def test_key_is_path_component_and_stable_across_processes(tmp_path: Path) -> None:
    req = write(tmp_path / "requirements.txt", REQS)
    lock = write(tmp_path / "uv.lock", UV_LOCK)
    args = dict(
        install_command=["pip", "install", "-r", "requirements.txt"],
        extras={"cuda": "12.4", "a": "b"},
        capture=["/opt/x", "/opt/a"],
    )
    here = compute_key([req, lock], **args)
    assert re.fullmatch(r"[0-9a-f]{40}", here.key)
    assert here.key not in (".", "..") and os.sep not in here.key
    code = (
        "import json, sys\n"
        "from snapshot.key import compute_key\n"
        "a = json.loads(sys.argv[1])\n"
        "print(compute_key(a.pop('files'), **a).key)\n"
    )
    env = {
        **os.environ,
        "PYTHONHASHSEED": "12345",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    # The other process sees the files under another path (a symlinked checkout).
    other = tmp_path / "elsewhere"
    other.symlink_to(tmp_path, target_is_directory=True)
    payload = json.dumps(
        {"files": [str(other / "requirements.txt"), str(other / "uv.lock")], **args}
    )
    out = subprocess.run(
        [sys.executable, "-c", code, payload],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(other),
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == here.key
