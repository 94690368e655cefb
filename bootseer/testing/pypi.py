"""A real PEP 503 "simple" package index of real wheels, on loopback, for tests and benchmarks.

:func:`build_wheel` writes a valid pure-Python wheel with :mod:`zipfile` alone (no setuptools,
no network), byte-identical for identical inputs. :class:`PackageIndex` serves a directory of
wheels over HTTP on 127.0.0.1 so that real ``pip`` and ``uv`` install from it. Listings are
regenerated on every request, so wheels added while it runs show up. :func:`installer_env`
gives an environment in which pip and uv use nothing but the ``--index-url`` they are given
(no config files, no ``PIP_*``/``UV_*`` variables from the developer's shell).

This module must not import pytest: the benchmarks use it too. Serve a directory by hand with
``python -m bootseer.testing.pypi WHEEL_DIR [--port N] [--build-test-wheels]``.
"""

from __future__ import annotations

import argparse
import base64
import collections
import hashlib
import html
import http.server
import os
import re
import signal
import sys
import threading
import urllib.parse
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from bootseer.testing.servers import LOOPBACK, ConnectionTracking

__all__ = [
    "TEST_WHEELS",
    "TINYDATA_BLOB",
    "TINYDATA_DIGEST",
    "PackageIndex",
    "WheelSpec",
    "build_test_wheels",
    "build_wheel",
    "installer_env",
    "main",
    "normalize_project",
    "wheel_filename",
]

# Fixed timestamp for every zip member: the zip format cannot go earlier than 1980.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_GENERATOR = "bootseer.testing.pypi"


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def normalize_project(name: str) -> str:
    """PEP 503 normalized project name: runs of ``-_.`` become ``-``, lowercased."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_name(name: str) -> str:
    """Distribution name as it appears in wheel and .dist-info names (``-_.`` runs -> ``_``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_filename(name: str, version: str) -> str:
    """``{name}-{version}-py3-none-any.whl`` with the name escaped per the wheel spec."""
    return f"{_wheel_name(name)}-{version.replace('-', '_')}-py3-none-any.whl"


def _check_member(path: str) -> str:
    """A relative, forward-slash path inside the wheel; rejects absolute paths and ``..``."""
    norm = path.replace("\\", "/")
    parts = norm.split("/")
    if not norm or norm.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad path inside a wheel: {path!r}")
    return norm


# --------------------------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def build_wheel(
    dest_dir: str | os.PathLike[str],
    name: str,
    version: str,
    *,
    modules: Mapping[str, str] | None = None,
    console_scripts: Mapping[str, str] | None = None,
    requires: Sequence[str] = (),
    data_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write ``dest_dir/{name}-{version}-py3-none-any.whl`` and return its path.

    ``modules`` maps paths inside the wheel (``"pkg/__init__.py"``) to source text,
    ``data_files`` maps paths to bytes (package data), ``console_scripts`` maps script names to
    ``"module:function"``, ``requires`` are ``Requires-Dist`` requirement strings. Members are
    written in a fixed order with fixed timestamps and permissions, so identical inputs give
    byte-identical wheels.
    """
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    dist_info = f"{_wheel_name(name)}-{version.replace('-', '_')}.dist-info"

    members: dict[str, bytes] = {}
    for path, text in sorted((modules or {}).items()):
        members[_check_member(path)] = text.encode("utf-8")
    for path, data in sorted((data_files or {}).items()):
        member = _check_member(path)
        if member in members:
            raise ValueError(f"{path!r} given both as a module and as a data file")
        members[member] = bytes(data)
    if any(m.split("/", 1)[0] == dist_info for m in members):
        raise ValueError(f"modules and data files must not write into {dist_info}/")

    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        f"Summary: test package {name} {version}",
        *(f"Requires-Dist: {req}" for req in requires),
    ]
    members[f"{dist_info}/METADATA"] = ("\n".join(metadata) + "\n\n").encode("utf-8")
    wheel = [
        "Wheel-Version: 1.0",
        f"Generator: {_GENERATOR}",
        "Root-Is-Purelib: true",
        "Tag: py3-none-any",
    ]
    members[f"{dist_info}/WHEEL"] = ("\n".join(wheel) + "\n").encode("utf-8")
    if console_scripts:
        lines = ["[console_scripts]"]
        lines += [f"{script} = {target}" for script, target in sorted(console_scripts.items())]
        members[f"{dist_info}/entry_points.txt"] = ("\n".join(lines) + "\n").encode("utf-8")

    record_path = f"{dist_info}/RECORD"
    record = [f"{path},{_record_hash(data)},{len(data)}" for path, data in members.items()]
    record.append(f"{record_path},,")
    members[record_path] = ("\n".join(record) + "\n").encode("utf-8")

    target = dest / wheel_filename(name, version)
    tmp = target.with_name(target.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for path, data in members.items():
            info = zipfile.ZipInfo(path, date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, so that external_attr holds the mode
            info.external_attr = (0o100644 & 0xFFFF) << 16
            zf.writestr(info, data, compresslevel=6)
    os.replace(tmp, target)  # a concurrent index request never sees a half-written wheel
    return target


@dataclass(frozen=True)
class WheelSpec:
    """The arguments of one :func:`build_wheel` call."""

    name: str
    version: str
    modules: Mapping[str, str] = field(default_factory=dict)
    console_scripts: Mapping[str, str] = field(default_factory=dict)
    requires: Sequence[str] = ()
    data_files: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def filename(self) -> str:
        return wheel_filename(self.name, self.version)

    def build(self, dest_dir: str | os.PathLike[str]) -> Path:
        return build_wheel(
            dest_dir,
            self.name,
            self.version,
            modules=self.modules,
            console_scripts=self.console_scripts,
            requires=self.requires,
            data_files=self.data_files,
        )


def _tinydata_blob() -> bytes:
    """64 KiB of deterministic pseudo-random bytes (a sha256 counter stream)."""
    return b"".join(hashlib.sha256(b"tinydata-%d" % i).digest() for i in range(65536 // 32))


TINYDATA_BLOB: bytes = _tinydata_blob()
"""The package-data file ``tinydata/blob.bin`` of the ``tinydata 0.3`` test wheel."""
TINYDATA_DIGEST: str = hashlib.sha256(TINYDATA_BLOB).hexdigest()
"""What ``tinydata.DIGEST`` is once installed."""


def _alpha(version: str) -> WheelSpec:
    source = f'VALUE = "alpha-{version}"\n\n\ndef main():\n    print("alpha-cli-ok")\n'
    return WheelSpec(
        "tinyalpha",
        version,
        modules={"tinyalpha/__init__.py": source},
        console_scripts={"tinyalpha-cli": "tinyalpha:main"},
    )


TEST_WHEELS: tuple[WheelSpec, ...] = (
    _alpha("1.0"),
    _alpha("2.0"),
    WheelSpec(
        "tinybeta",
        "0.1",
        modules={
            "tinybeta/__init__.py": (
                "from tinyalpha import VALUE as ALPHA\n"
                "\n"
                'BETA = "beta-0.1"\n'
                "\n\n"
                "def main():\n"
                '    print("beta-cli-ok " + ALPHA)\n'
            )
        },
        console_scripts={"tinybeta-cli": "tinybeta:main"},
        requires=("tinyalpha>=1.0",),
    ),
    WheelSpec(
        "tinydata",
        "0.3",
        modules={
            "tinydata/__init__.py": (
                "import hashlib\n"
                "from pathlib import Path\n"
                "\n"
                'BLOB = Path(__file__).with_name("blob.bin").read_bytes()\n'
                "DIGEST = hashlib.sha256(BLOB).hexdigest()\n"
            )
        },
        data_files={"tinydata/blob.bin": TINYDATA_BLOB},
    ),
)
"""The wheels of the ``package_index`` test fixture:

- ``tinyalpha 1.0`` / ``2.0``: ``VALUE = "alpha-<version>"``; script ``tinyalpha-cli`` prints
  ``alpha-cli-ok``;
- ``tinybeta 0.1``: requires ``tinyalpha>=1.0``; script ``tinybeta-cli`` prints
  ``beta-cli-ok <tinyalpha.VALUE>``;
- ``tinydata 0.3``: package data ``tinydata/blob.bin`` (:data:`TINYDATA_BLOB`);
  ``tinydata.DIGEST`` is its sha256 hex (:data:`TINYDATA_DIGEST`).
"""


def build_test_wheels(dest_dir: str | os.PathLike[str]) -> list[Path]:
    """Build every :data:`TEST_WHEELS` wheel into ``dest_dir``; returns their paths."""
    return [spec.build(dest_dir) for spec in TEST_WHEELS]


# --------------------------------------------------------------------------------------------
# Installer environment
# --------------------------------------------------------------------------------------------


def installer_env(
    cache_dir: str | os.PathLike[str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """An environment in which ``pip`` and ``uv`` use only the index given on their command
    line (``--index-url URL``): every ``PIP_*`` and ``UV_*`` variable of ``base`` (default
    ``os.environ``) is dropped, config files are off (``PIP_CONFIG_FILE=/dev/null``,
    ``UV_NO_CONFIG=1``), loopback bypasses proxies, uv never downloads a Python.

    With ``cache_dir`` both tools cache there (``PIP_CACHE_DIR``, ``UV_CACHE_DIR``); without it
    pip caches nothing (``PIP_NO_CACHE_DIR=1``) and uv gets ``UV_NO_CACHE=1`` (uv still needs a
    cache directory for its scratch files: it uses a temporary one).
    """
    src = os.environ if base is None else base
    env = {k: v for k, v in src.items() if not k.startswith(("PIP_", "UV_"))}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PIP_NO_COLOR="1",
        UV_NO_CONFIG="1",
        UV_PYTHON_DOWNLOADS="never",
        UV_NO_PROGRESS="1",
    )
    if cache_dir is not None:
        env["PIP_CACHE_DIR"] = os.fspath(cache_dir)
        env["UV_CACHE_DIR"] = os.fspath(cache_dir)
    else:
        env["PIP_NO_CACHE_DIR"] = "1"
        env["UV_NO_CACHE"] = "1"
    for var in ("NO_PROXY", "no_proxy"):
        hosts = [h for h in env.get(var, "").split(",") if h]
        hosts += [h for h in (LOOPBACK, "localhost") if h not in hosts]
        env[var] = ",".join(hosts)
    return env


# --------------------------------------------------------------------------------------------
# The index server
# --------------------------------------------------------------------------------------------


def _project_of(filename: str) -> str | None:
    """Normalized project name of a wheel file name, or None for anything else."""
    if not filename.endswith(".whl") or filename.startswith("."):
        return None
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    return normalize_project(parts[0])


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _IndexHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "bootseer-pypi/1"
    timeout = 60  # an idle keep-alive connection does not hold a thread forever

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, head: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        index = self.server.index
        index._count(self.command, path)
        if path in ("/", "/simple"):
            return self._redirect("/simple/")
        if path == "/simple/":
            return self._send(200, "text/html; charset=utf-8", index._root_page(), head)
        if path.startswith("/simple/"):
            name = path[len("/simple/") :]
            if name.endswith("/"):
                name = name[:-1]
            if not name or "/" in name:
                return self._send(404, "text/plain", b"not found\n", head)
            norm = normalize_project(name)
            if norm != name or not path.endswith("/"):
                return self._redirect(f"/simple/{norm}/")
            page = index._project_page(norm)
            if page is None:
                return self._send(404, "text/plain", b"no such project\n", head)
            return self._send(200, "text/html; charset=utf-8", page, head)
        if path.startswith("/files/"):
            filename = path[len("/files/") :]
            if filename.endswith(".metadata"):
                data = index._metadata_file(filename[: -len(".metadata")])
                if data is None:
                    return self._send(404, "text/plain", b"no such file\n", head)
                return self._send(200, "text/plain; charset=utf-8", data, head)
            data = index._file(filename)
            if data is None:
                return self._send(404, "text/plain", b"no such file\n", head)
            return self._send(200, "application/octet-stream", data, head)
        return self._send(404, "text/plain", b"not found\n", head)

    def _redirect(self, location: str) -> None:
        self.send_response(301)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send(self, status: int, ctype: str, body: bytes, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)


class _IndexHTTPServer(ConnectionTracking, http.server.ThreadingHTTPServer):
    """Remembers open connections so that stop() can cut idle keep-alive ones."""

    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, addr: tuple[str, int], index: PackageIndex) -> None:
        self.index = index
        super().__init__(addr, _Handler)


@dataclass(frozen=True)
class _WheelInfo:
    key: tuple[int, int, int]  # (st_ino, st_mtime_ns, st_size) the rest was computed for
    sha256: str
    metadata: bytes | None  # the .dist-info/METADATA member (PEP 658), None if unreadable


def _read_metadata(path: Path) -> bytes | None:
    try:
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                parts = name.split("/")
                if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "METADATA":
                    return zf.read(name)
    except (OSError, zipfile.BadZipFile):
        return None
    return None


class PackageIndex:
    """A PEP 503 simple index of the wheels in ``wheel_dir``, served on 127.0.0.1.

    - ``/simple/``: one link per project;
    - ``/simple/<normalized-name>/``: one link per wheel, ``/files/<filename>#sha256=<hex>``
      (other spellings of the name redirect to the normalized one);
    - ``/files/<filename>``: the wheel;
    - ``/files/<filename>.metadata``: its core metadata (PEP 658/714, as PyPI serves it: the
      links carry ``data-core-metadata``/``data-dist-info-metadata``, so pip and uv resolve
      from it without downloading the wheel); off with ``metadata=False``.

    Listings are read from ``wheel_dir`` on every request. ``requests`` counts requests per
    URL path (query strings dropped, any method), ``method_requests`` per ``(method, path)``;
    :meth:`downloads` is the number of GETs of one wheel; :meth:`reset_counts` clears them.
    With ``port=None`` the OS picks a free port.
    """

    def __init__(
        self,
        wheel_dir: str | os.PathLike[str],
        port: int | None = None,
        *,
        metadata: bool = True,
    ) -> None:
        self.wheel_dir = Path(wheel_dir)
        self.host = LOOPBACK
        self.port = port if port is not None else 0
        self.serve_metadata = metadata
        self.requests: collections.Counter[str] = collections.Counter()
        self.method_requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self._infos: dict[str, _WheelInfo] = {}
        self._server: _IndexHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- addresses ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The index URL for ``--index-url``: ``http://127.0.0.1:PORT/simple/``."""
        return f"{self.base_url}/simple/"

    @property
    def running(self) -> bool:
        return self._server is not None

    # -- request accounting -------------------------------------------------------------------

    def _count(self, method: str, path: str) -> None:
        with self._lock:
            self.requests[path] += 1
            self.method_requests[(method, path)] += 1

    @property
    def total_requests(self) -> int:
        with self._lock:
            return sum(self.requests.values())

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.method_requests.clear()

    def downloads(self, filename: str) -> int:
        """How many times ``/files/<filename>`` was fetched (GET; HEAD probes not counted)."""
        with self._lock:
            return self.method_requests[("GET", f"/files/{filename}")]

    # -- content ------------------------------------------------------------------------------

    def _wheels(self) -> dict[str, list[Path]]:
        projects: dict[str, list[Path]] = {}
        try:
            entries = sorted(self.wheel_dir.iterdir())
        except OSError:
            return projects
        for entry in entries:
            project = _project_of(entry.name)
            if project is not None and entry.is_file():
                projects.setdefault(project, []).append(entry)
        return projects

    def _info(self, path: Path) -> _WheelInfo:
        """sha256 and core metadata of a wheel, recomputed when the file changes."""
        st = path.stat()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            cached = self._infos.get(path.name)
        if cached is not None and cached.key == key:
            return cached
        info = _WheelInfo(key, hashlib.sha256(path.read_bytes()).hexdigest(), _read_metadata(path))
        with self._lock:
            self._infos[path.name] = info
        return info

    @staticmethod
    def _page(title: str, links: list[tuple[str, str, dict[str, str]]]) -> bytes:
        def anchor(href: str, text: str, attrs: dict[str, str]) -> str:
            extra = "".join(f' {k}="{html.escape(v)}"' for k, v in attrs.items())
            return f'    <a href="{html.escape(href)}"{extra}>{html.escape(text)}</a><br/>\n'

        body = "".join(anchor(*link) for link in links)
        page = (
            "<!DOCTYPE html>\n<html>\n  <head>\n"
            '    <meta name="pypi:repository-version" content="1.0">\n'
            f"    <title>{html.escape(title)}</title>\n  </head>\n  <body>\n"
            f"{body}  </body>\n</html>\n"
        )
        return page.encode("utf-8")

    def _root_page(self) -> bytes:
        links = [(f"/simple/{p}/", p, {}) for p in sorted(self._wheels())]
        return self._page("Simple index", links)

    def _project_page(self, project: str) -> bytes | None:
        files = self._wheels().get(project)
        if not files:
            return None
        links = []
        for path in files:
            try:
                info = self._info(path)
            except OSError:
                continue
            attrs = {}
            if self.serve_metadata and info.metadata is not None:
                meta_hash = "sha256=" + hashlib.sha256(info.metadata).hexdigest()
                attrs = {"data-core-metadata": meta_hash, "data-dist-info-metadata": meta_hash}
            quoted = urllib.parse.quote(path.name)
            links.append((f"/files/{quoted}#sha256={info.sha256}", path.name, attrs))
        return self._page(f"Links for {project}", links)

    def _path_of(self, filename: str) -> Path | None:
        if "/" in filename or "\\" in filename or _project_of(filename) is None:
            return None
        return self.wheel_dir / filename

    def _file(self, filename: str) -> bytes | None:
        path = self._path_of(filename)
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError:
            return None

    def _metadata_file(self, filename: str) -> bytes | None:
        path = self._path_of(filename)
        if path is None or not self.serve_metadata:
            return None
        try:
            return self._info(path).metadata
        except OSError:
            return None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        if self._server is not None:
            return self
        server = _IndexHTTPServer((LOOPBACK, self.port), self)
        self.port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},  # stop() returns within this
            name=f"pypi-index-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        if thread is not None:
            thread.join(timeout=10)
        server.server_close()
        server.cut_connections()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self.url if self.running else "stopped"
        return f"PackageIndex({str(self.wheel_dir)!r}, {state})"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bootseer.testing.pypi",
        description="Serve a directory of wheels as a PEP 503 simple index on 127.0.0.1.",
    )
    parser.add_argument("wheel_dir", type=Path, help="directory holding *.whl files")
    parser.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    parser.add_argument(
        "--build-test-wheels",
        action="store_true",
        help="first build the test wheels (tinyalpha, tinybeta, tinydata) into WHEEL_DIR",
    )
    args = parser.parse_args(argv)
    if args.build_test_wheels:
        for path in build_test_wheels(args.wheel_dir):
            print(f"built {path}", flush=True)
    if not args.wheel_dir.is_dir():
        parser.error(f"not a directory: {args.wheel_dir}")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with PackageIndex(args.wheel_dir, port=args.port) as index:
        print(index.url, flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
