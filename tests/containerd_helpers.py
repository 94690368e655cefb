"""A runnable test image (the host's sh, cat, ls and sha256sum with their libraries, in three
layers with a whiteout, an opaque directory and a hardlink), and the snapshotter started the
way a node runs it: ``bootseer snapshotter`` in its own process."""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from test_prefetch_image import _push_gzip_image

TOOLS = ("sh", "cat", "ls", "sha256sum", "test", "sleep")  # sleep: a container that stays up
BIG = os.urandom(3 << 20)  # spans several frames of the converted layer
HELLO = b"hello from layer two\n"


def _add(
    tar: tarfile.TarFile,
    name: str,
    data: bytes | None = None,
    *,
    mode: int = 0o644,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime, info.linkname = kind, mode, 1_700_000_000, link
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _libraries(binary: str) -> set[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libs = set()
    for line in out.splitlines():
        for part in line.split():
            if part.startswith("/"):
                libs.add(part)
    return libs


def add_programs(tar: tarfile.TarFile, tools: tuple[str, ...], dirs: tuple[str, ...] = ()) -> None:
    """The host's ``tools`` as ``bin/<tool>`` with the shared libraries they load, their
    directories (0755) and ``dirs`` too."""
    files: dict[str, bytes] = {}
    for tool in tools:
        path = shutil.which(tool)
        assert path, f"{tool} is not installed"
        real = os.path.realpath(path)
        files[f"bin/{tool}"] = Path(real).read_bytes()
        for lib in _libraries(real):
            files[lib.lstrip("/")] = Path(os.path.realpath(lib)).read_bytes()
    leaves = {str(Path(name).parent) for name in files} | set(dirs)
    parents = {
        "/".join(Path(d).parts[:i]) for d in leaves for i in range(1, len(Path(d).parts) + 1)
    }
    for d in sorted(parents):
        _add(tar, d, kind=tarfile.DIRTYPE, mode=0o755)
    for name in sorted(files):
        _add(tar, name, files[name], mode=0o755)


def runnable_layers(salt: bytes = b"") -> list[bytes]:
    """Three tar layers: tools + libraries; an app layer deleting and replacing lower files;
    a layer with a big file. A ``salt`` goes to ``/etc/image-id`` in the base layer: images
    of different salts share no layer (every chain ID differs)."""
    base = io.BytesIO()
    with tarfile.open(fileobj=base, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_programs(tar, TOOLS, ("etc", "data", "data/old"))
        if salt:
            _add(tar, "etc/image-id", salt)
        _add(tar, "etc/removed.txt", b"deleted by layer two\n")
        _add(tar, "data/old/a", b"hidden by an opaque directory\n")
    app = io.BytesIO()
    with tarfile.open(fileobj=app, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "app", kind=tarfile.DIRTYPE, mode=0o755)
        _add(tar, "app/hello.txt", HELLO)
        _add(tar, "app/link", kind=tarfile.LNKTYPE, link="app/hello.txt")
        _add(tar, "etc/.wh.removed.txt", b"")
        _add(tar, "data/old", kind=tarfile.DIRTYPE, mode=0o755)
        _add(tar, "data/old/.wh..wh..opq", b"")
        _add(tar, "data/old/b", b"new\n")
    big = io.BytesIO()
    with tarfile.open(fileobj=big, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "app/big.bin", BIG)
    return [base.getvalue(), app.getvalue(), big.getvalue()]


# What the test command prints inside the container, for the image above.
SCRIPT = (
    "cat /app/hello.txt /app/link; ls /data/old; "
    "test -e /etc/removed.txt && echo still-there || echo removed; "
    "sha256sum /app/big.bin"
)


def expected_output() -> str:
    import hashlib

    return (
        HELLO.decode() * 2 + "b\nremoved\n" + f"{hashlib.sha256(BIG).hexdigest()}  /app/big.bin\n"
    )


def push_images(host: str, repo: str = "app/run", salt: bytes = b"") -> tuple[str, str]:
    """(plain gzip image, its bootseer conversion) as ``repo:v1`` and ``repo:lazy`` in the
    registry at ``host`` (``salt``: see :func:`runnable_layers`)."""
    from prefetch.image import convert_image

    _push_gzip_image(host, repo, "v1", runnable_layers(salt))
    src, dst = f"{host}/{repo}:v1", f"{host}/{repo}:lazy"
    convert_image(src, dst, frame_size=256 << 10)
    return src, dst


def holder_pid(address: str) -> int:
    """The pid of the FUSE holder listening at ``address`` (its socket's peer credentials)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(address)
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid


@dataclass
class SnapshotterProcess:
    """``bootseer snapshotter`` in a child process (a node's daemon)."""

    root: Path
    address: str
    log_path: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    umask: int = -1  # the process's umask (-1: this one's)
    env: dict[str, str] | None = None  # added to this process's environment

    def start(self, timeout_s: float = 30.0) -> SnapshotterProcess:
        if os.path.exists(self.address):
            os.unlink(self.address)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "snapshotter",
                    "--root",
                    str(self.root),
                    "--address",
                    self.address,
                    *self.extra,
                ],
                stdout=log,
                stderr=log,
                start_new_session=True,
                umask=self.umask,
                env={**os.environ, **(self.env or {})},
            )
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.address):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the snapshotter did not start:\n{self.log()}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def holder_address(self) -> str:
        """The FUSE holder the snapshotter starts when none runs (beside its socket)."""
        return os.path.join(os.path.dirname(self.address), "fuse-holder.sock")

    def close(self) -> None:
        """Stop, and take down the lazy mount, which a stop leaves to the FUSE holder; the
        holder then exits. A holder still there after that (a container still using the
        mount) is killed, which ends the connection, and reported."""
        from striped_fs.fuse import is_mounted, unmount

        self.stop()
        if is_mounted(self.root / "lazy"):
            unmount(self.root / "lazy", lazy=True)
        deadline = time.monotonic() + 15
        while os.path.exists(self.holder_address):
            if time.monotonic() > deadline:
                os.kill(holder_pid(self.holder_address), signal.SIGKILL)
                raise AssertionError(f"the FUSE holder did not exit:\n{self.log()}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
