"""prefetch.registry after its cut into private modules: the same names, the same objects.

The client was one 1,700-line file; it is now ``prefetch/_registry_{errors,helpers,client,
sync}.py`` behind ``prefetch/registry.py``. What callers import from ``prefetch.registry`` must
keep working, must be the very object the code raises or returns (``except RegistryError`` has
to catch what the client raises), and must say ``prefetch.registry`` when printed or pickled.
"""

from __future__ import annotations

import importlib
import inspect
import pickle

import prefetch.registry as registry

#: ``prefetch.registry.__all__`` before the cut
ALL_BEFORE = {
    "BlobStream",
    "Descriptor",
    "DigestMismatch",
    "Manifest",
    "PlatformNotFound",
    "RangeNotSupported",
    "RegistryAuthError",
    "RegistryClient",
    "RegistryError",
    "RegistryNotFound",
    "RegistryProtocolError",
    "RegistryUnavailable",
    "SyncRegistry",
    "parse_platform",
    "referrers_tag",
    "run_sync",
    "select_platform",
}
#: its public constants, outside ``__all__`` but importable
CONSTANTS_BEFORE = {
    "DEFAULT_CHUNK": 1024 * 1024,
    "STREAM_UPLOAD_CHUNK": 16 * 1024 * 1024,
    "MAX_RETRY_AFTER_S": 300.0,
    "USER_AGENT": "bootseer-prefetch",
}
PRIVATE = ("_registry_errors", "_registry_helpers", "_registry_client", "_registry_sync")


def test_the_facade_exports_what_the_module_did() -> None:
    assert set(registry.__all__) == ALL_BEFORE
    for name in ALL_BEFORE:
        assert getattr(registry, name) is not None
    for name, value in CONSTANTS_BEFORE.items():
        assert getattr(registry, name) == value


def test_every_public_name_of_the_private_modules_is_the_facades_object() -> None:
    """A public class or function added to a private module and not exported fails here; an
    export that is a copy (not the object the client raises) fails too."""
    for short in PRIVATE:
        module = importlib.import_module(f"prefetch.{short}")
        for name, obj in vars(module).items():
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if obj.__module__ not in ("prefetch.registry", module.__name__):
                continue  # imported from elsewhere (prefetch.oci, the standard library)
            assert getattr(registry, name, None) is obj, f"{short}.{name} not re-exported"
            assert name in registry.__all__, f"{short}.{name} not in __all__"


def test_the_names_say_prefetch_registry_and_pickle_by_it() -> None:
    for name in ALL_BEFORE - {"Descriptor", "Manifest", "parse_platform", "referrers_tag"}:
        if name == "select_platform":
            continue
        assert getattr(registry, name).__module__ == "prefetch.registry", name
    assert registry.Descriptor.__module__ == "prefetch.oci"  # its home, as before
    err = registry.RegistryNotFound("registry.example: repository app unknown")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is registry.RegistryNotFound and str(back) == str(err)
    assert isinstance(back, registry.RegistryError)


def test_the_client_raises_the_facades_classes() -> None:
    """An error raised inside a private module is caught by the facade's name."""
    client = importlib.import_module("prefetch._registry_client")
    assert client.RegistryError is registry.RegistryError
    assert client.RegistryClient is registry.RegistryClient
    sync = importlib.import_module("prefetch._registry_sync")
    assert sync.RegistryClient is registry.RegistryClient
