"""The command line's one error translator: a known error is one line and exit code 2, a bug
its traceback and 1, ``-vv`` every traceback; no credential in any of them."""

from __future__ import annotations

import errno

import pytest
from cli_helpers import bootseer_cli

import bootseer.cli.fs as fs_cmd
from bootseer.cli import main
from bootseer.cli.errors import CliError

SECRET = "wJalrXUtnFEMI-not-a-real-secret"
URL_WITH_KEY = f"s3://AKIDEXAMPLE:{SECRET}@bucket/run1"


def run_inprocess(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``bootseer ARGS`` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr().err


def failing_stat(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    """``bootseer fs stat`` raises ``exc`` (the parser picks the command up when main builds
    it, so the patched function is the one that runs)."""

    def cmd_stat(args):
        raise exc

    monkeypatch.setattr(fs_cmd, "cmd_stat", cmd_stat)


def test_a_known_error_is_one_line_with_exit_code_2(tmp_path):
    missing = tmp_path / "not-here.bin"
    proc = bootseer_cli("fs", "stat", str(missing), check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"bootseer: error: {missing}: ")
    assert "check the bucket and the path" in lines[0]  # the fix, named


def test_minus_vv_prints_the_traceback_of_a_known_error_too(tmp_path):
    missing = tmp_path / "not-here.bin"
    proc = bootseer_cli("-vv", "fs", "stat", str(missing), check=False)
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    assert "FileNotFoundError" in proc.stderr
    # the message stays the last line, where a person (and a script) looks for it
    assert proc.stderr.strip().splitlines()[-1].startswith(f"bootseer: error: {missing}: ")


def test_minus_v_alone_does_not(capsys, monkeypatch):
    failing_stat(monkeypatch, CliError("the thing is wrong; do this"))
    code, err = run_inprocess(capsys, "-v", "fs", "stat", "x")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "bootseer: error: the thing is wrong; do this"


def test_an_unexpected_exception_prints_its_traceback_with_exit_code_1(capsys, monkeypatch):
    failing_stat(monkeypatch, ZeroDivisionError("division by zero in the stat"))
    code, err = run_inprocess(capsys, "fs", "stat", "x")
    assert code == 1
    assert "Traceback (most recent call last)" in err and "in cmd_stat" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("bootseer: error: unexpected ZeroDivisionError: division by zero")
    assert "a bug in bootseer" in last


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: CliError(f"cannot use {URL_WITH_KEY}"), id="CliError"),
        pytest.param(lambda: ValueError(f"bad value {URL_WITH_KEY}"), id="ValueError"),
        pytest.param(
            lambda: OSError(errno.EIO, f"broken {URL_WITH_KEY}"), id="OSError-named-store"
        ),
        pytest.param(lambda: _prefetch().RegistryAuthError(f"{URL_WITH_KEY}"), id="Prefetch"),
        pytest.param(lambda: KeyError(URL_WITH_KEY), id="bug"),
    ],
)
@pytest.mark.parametrize("verbose", [[], ["-vv"]])
def test_a_credential_in_an_error_is_redacted(capsys, monkeypatch, make, verbose):
    """The message, the traceback under -vv and a bug's traceback: none shows the secret."""
    failing_stat(monkeypatch, make())
    code, err = run_inprocess(capsys, *verbose, "fs", "stat", URL_WITH_KEY)
    assert code in (1, 2)
    assert SECRET not in err
    assert "s3://***@bucket/run1" in err


def test_a_secret_from_the_storage_options_is_redacted(capsys, monkeypatch):
    token = "tok-9f8e7d6c5b4a-never-shown"
    failing_stat(monkeypatch, CliError(f"the store refused token {token}"))
    code, err = run_inprocess(
        capsys, "fs", "stat", "x", "--storage-options", f'{{"s3": {{"token": "{token}"}}}}'
    )
    assert code == 2 and token not in err and "the store refused token ***" in err


def _prefetch():
    import prefetch

    return prefetch


@pytest.mark.parametrize(
    "make, root",
    [
        (lambda: _prefetch().NotConvertedError("sha256:ab", "plain gzip"), "PrefetchError"),
        (lambda: _ckpt().CheckpointCorrupt("stripe 3 of w is bad", step=7), "CheckpointError"),
        (lambda: _snapshot().SnapshotNotFound("no snapshot for key k"), "SnapshotError"),
        (lambda: _striped().MountError("mountpoint '/m' is not a directory"), "StripedError"),
        (lambda: _striped().OptionError("striped_fs option 'stripe_size'=0"), "StripedError"),
    ],
    ids=["prefetch", "ckpt", "snapshot", "striped-mount", "striped-option"],
)
def test_each_library_root_is_a_one_line_error(capsys, monkeypatch, make, root):
    exc = make()
    assert root in {c.__name__ for c in type(exc).__mro__}
    failing_stat(monkeypatch, exc)
    code, err = run_inprocess(capsys, "fs", "stat", "x")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"bootseer: error: {exc}"]  # its own message, as is


def _ckpt():
    import ckpt.errors

    return ckpt.errors


def _snapshot():
    import snapshot.errors

    return snapshot.errors


def _striped():
    import striped_fs.errors

    return striped_fs.errors


def test_prefetch_errors_have_one_root_and_keep_their_old_bases():
    import prefetch
    from prefetch.containerd import errors as containerd_errors
    from prefetch.containerd.holder import HolderError
    from prefetch.containerd.metadata import SchemaVersionError
    from prefetch.errors import PrefetchError
    from prefetch.members import ConvertError
    from prefetch.profile import ProfileError
    from prefetch.registry import PlatformNotFound, RegistryAuthError, RegistryError
    from prefetch.safety import UnsafeMemberError
    from prefetch.toc import LayerFormatError, NotConvertedError, UnsafeLayerError

    assert prefetch.PrefetchError is PrefetchError
    for cls in (
        RegistryError,
        RegistryAuthError,
        PlatformNotFound,
        LayerFormatError,
        NotConvertedError,
        UnsafeLayerError,
        UnsafeMemberError,
        ConvertError,
        ProfileError,
        containerd_errors.ContainerdError,
        containerd_errors.NotFoundError,
        HolderError,
        SchemaVersionError,
    ):
        assert issubclass(cls, PrefetchError), cls
        if cls is not containerd_errors.NotFoundError:  # gRPC codes' classes stay in their module
            assert getattr(prefetch, cls.__name__) is cls  # exported from the package
    for cls in (ConvertError, ProfileError, UnsafeMemberError, UnsafeLayerError):
        assert issubclass(cls, ValueError), cls  # callers catch these as ValueError
    for cls in (HolderError, SchemaVersionError):
        assert issubclass(cls, RuntimeError), cls
    # an unsafe layer member is still caught by either of its bases, and by the root
    with pytest.raises(UnsafeMemberError):
        raise UnsafeLayerError("sha256:ab", "../x", "no '..'")
    with pytest.raises(PrefetchError, match="refused member '../x'"):
        raise UnsafeLayerError("sha256:ab", "../x", "no '..'")


def test_striped_errors_have_one_root_and_keep_their_old_bases():
    import striped_fs
    from striped_fs import config, fuse, privdir
    from striped_fs.cancel import ReadCancelled
    from striped_fs.errors import (
        ManifestError,
        MountError,
        MountTimeout,
        OptionError,
        ShortReadError,
        StripeChecksumError,
        StripedError,
        StripedIOError,
        UnsafePath,
    )

    # the old import paths name the same classes
    assert fuse.MountError is MountError and fuse.MountTimeout is MountTimeout
    assert config.OptionError is OptionError and privdir.UnsafePath is UnsafePath
    assert striped_fs.StripedError is StripedError and striped_fs.MountError is MountError
    old_bases = {
        StripedIOError: OSError,
        StripeChecksumError: OSError,
        ManifestError: OSError,
        ShortReadError: ConnectionError,
        OptionError: ValueError,
        UnsafePath: PermissionError,
        MountError: RuntimeError,
        MountTimeout: TimeoutError,
    }
    for cls, base in old_bases.items():
        assert issubclass(cls, StripedError) and issubclass(cls, base), cls
    err = StripedIOError("stripe 2 unreadable", path="b/f", stripe=2)
    assert (err.errno, str(err)) == (errno.EIO, "stripe 2 unreadable")  # OSError's shape kept
    # a cancelled read is a state, not a failure: a StripedError handler must not take it
    assert not issubclass(ReadCancelled, StripedError)


def test_library_roots_are_found_without_importing_the_libraries():
    """The translator looks classes up in sys.modules: ``bootseer fs`` loads no torch,
    aiohttp or grpc to report an error."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from bootseer.cli import main\n"
        "try:\n"
        "    main(['fs', 'stat', '/definitely/not/here'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 2, e.code\n"
        "heavy = [m for m in ('torch', 'aiohttp', 'grpc') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
