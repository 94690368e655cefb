"""The packages' ``__init__.py`` are their contracts (docs/architecture.md): every name they
export resolves to the object it names, the lazy ones too, and exporting stays cheap:
``import bootseer.cli`` (every ``bootseer`` invocation) loads none of the heavy libraries the
lazy names stand in front of. tests/test_architecture.py checks, by ``ast``, that the other
packages take only these names."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from conftest import modules_loaded_by

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("striped_fs", "ckpt", "snapshot", "prefetch")
#: what the lazy names defer: a command that needs none of them must not pay for them
HEAVY = ("torch", "numpy", "aiohttp", "grpc", "fuse", "cryptography", "xxhash")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not have: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{package}.__all__ repeats a name"


def test_the_lazy_names_are_exported_and_are_the_modules_own_objects() -> None:
    import ckpt
    import prefetch
    import snapshot

    assert set(ckpt._LAZY) <= set(ckpt.__all__)
    assert set(prefetch.__all__) == {"PrefetchError", *prefetch._LAZY}
    assert set(snapshot._LAZY_EXPORTS) <= set(snapshot.__all__)
    from ckpt.loader import CheckpointView
    from prefetch.containerd.cri import CRIClient
    from prefetch.lazyfs import mount

    assert ckpt.CheckpointView is CheckpointView
    assert prefetch.CRIClient is CRIClient and prefetch.mount_image is mount


def test_redact_is_the_function_and_its_module_still_imports() -> None:
    """``striped_fs.redact`` names both a module and its function; the package binds the
    function, and ``from striped_fs.redact import ...`` still finds the module."""
    import striped_fs
    from striped_fs.redact import redact, redact_text

    assert striped_fs.redact is redact and callable(striped_fs.redact)
    assert striped_fs.redact_text is redact_text
    shown = striped_fs.redact("https://user:hunter2-not-shown@host/x")
    assert "hunter2-not-shown" not in shown and "host/x" in shown


def test_importing_the_command_line_and_the_libraries_loads_no_heavy_library() -> None:
    code = "import bootseer.cli, ckpt, prefetch, snapshot, striped_fs"
    assert modules_loaded_by(code, HEAVY) == []
