"""The fingerprint (cache key) of a dependency environment.

A snapshot can be reused only where it is exactly what the install would have produced, so
the key covers everything that determines the environment's content: the requirement and lock
files (normalized, so that comments, blank lines, case and order where pip ignores it do not
cause a needless rebuild), the install command, the interpreter's version, ABI and platform
tags, the base image digest when known, the snapshot format version, the captured paths and
any extra inputs the user names (a CUDA version, a driver...).

The key must be the same on every machine and checkout for the same inputs: spec files are
recorded by base name and content (never their absolute path), dicts are serialized with
sorted keys, and nothing depends on the process (hash seed, cwd, environment): the base image
comes only from the caller (``bootseer`` passes the key ``env.base_image``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapshot import FORMAT_VERSION
from snapshot.errors import SnapshotError

__all__ = [
    "KEY_LENGTH",
    "EnvKey",
    "SpecFileError",
    "compute_key",
    "normalize_requirement",
    "normalize_spec_file",
    "parse_extras",
    "python_identity",
]

KEY_LENGTH = 40
"""Hex characters of sha256 kept in a key: 160 bits, plenty against collisions, short paths."""


class SpecFileError(SnapshotError, ValueError):
    """A spec file is missing, unreadable or unparsable: the key cannot be computed."""


# --------------------------------------------------------------------------------------------
# EnvKey
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvKey:
    """A computed key and every input that went into it (so a miss can be explained)."""

    key: str
    """First ``KEY_LENGTH`` hex chars of sha256 over the canonical JSON of ``inputs``."""
    inputs: dict[str, Any]
    """Every input, JSON-serializable, in a stable order (see ``compute_key``)."""

    def __hash__(self) -> int:
        return hash(self.key)

    def to_json(self) -> dict[str, Any]:
        """A deep copy as ``{"key": ..., "inputs": ...}``, for manifests and ``--json`` output."""
        return {"key": self.key, "inputs": copy.deepcopy(self.inputs)}

    def describe(self) -> str:
        """Human text: the key, then one line per input (spec files with their entries)."""
        lines = [f"key: {self.key}"]
        for name, value in self.inputs.items():
            if name == "python" and isinstance(value, Mapping):
                lines.append(f"python: {_describe_python(value)}")
            elif name == "spec":
                if not value:
                    lines.append("spec: (none)")
                for i, spec in enumerate(value):
                    lines.append(f"spec[{i}]: {_spec_title(spec)}")
                    lines.extend(_describe_spec_body(spec, "    "))
            elif name == "install_command":
                shown = value if isinstance(value, str) else shlex.join(value)
                lines.append(f"install_command: {shown}")
            elif name == "extras":
                shown = ", ".join(f"{k}={v}" for k, v in value.items()) if value else "(none)"
                lines.append(f"extras: {shown}")
            elif name == "capture":
                lines.append(f"capture: {', '.join(value) if value else '(none)'}")
            elif value is None:
                lines.append(f"{name}: (none)")
            else:
                lines.append(f"{name}: {_compact(value)}")
        return "\n".join(lines) + "\n"


def _compact(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _describe_python(ident: Mapping[str, Any]) -> str:
    head = f"{ident.get('implementation', '?')} {ident.get('version', '?')}"
    rest = [
        f"{k}={_compact(v) if v not in (None, '') else '-'}"
        for k, v in ident.items()
        if k not in ("implementation", "version")
    ]
    return " ".join([head, *rest])


def _spec_title(spec: Mapping[str, Any]) -> str:
    title = f"{spec.get('path')} ({spec.get('kind')})"
    if spec.get("option"):
        title = f"{spec['option']} {title}"
    if spec.get("cycle"):
        title += " [include cycle: not followed again]"
    if spec.get("content"):
        title += f" {spec['content']}"
    return title


def _describe_spec_body(spec: Mapping[str, Any], indent: str) -> list[str]:
    out: list[str] = []
    kind = spec.get("kind")
    if kind == "requirements":
        out += [f"{indent}option: {o}" for o in spec.get("options", [])]
        out += [f"{indent}requirement: {e}" for e in spec.get("entries", [])]
        for inc in spec.get("includes", []):
            out.append(f"{indent}include: {_spec_title(inc)}")
            out += _describe_spec_body(inc, indent + "    ")
    elif kind == "uv.lock":
        out += [f"{indent}package: {e}" for e in spec.get("entries", [])]
    elif kind == "pyproject":
        for field in ("name", "version", "requires_python"):
            out.append(f"{indent}{field}: {spec.get(field) or '(none)'}")
        out += [f"{indent}dependency: {e}" for e in spec.get("dependencies", [])]
        for group, deps in spec.get("optional_dependencies", {}).items():
            out += [f"{indent}optional[{group}]: {e}" for e in deps]
        for group, deps in spec.get("dependency_groups", {}).items():
            out += [f"{indent}group[{group}]: {_compact(e)}" for e in deps]
        out += [f"{indent}build-system: {e}" for e in spec.get("build_requires", [])]
        for k, v in spec.get("tool_uv", {}).items():
            out.append(f"{indent}tool.uv.{k}: {_compact(v)}")
    return out


# --------------------------------------------------------------------------------------------
# Requirement normalization
# --------------------------------------------------------------------------------------------

_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_MARKER_TOKEN_RE = re.compile(
    r"'[^']*'|\"[^\"]*\"|===|==|!=|<=|>=|~=|<|>|\(|\)|[A-Za-z0-9_.\-*+!]+|\S"
)
_ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")


def _canonical_name(name: str) -> str:
    """PEP 503: lowercase, runs of ``-_.`` become one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _normalize_marker(marker: str) -> str:
    tokens = _MARKER_TOKEN_RE.findall(marker.strip())
    out = []
    for tok in tokens:
        if tok[0] == "'" and '"' not in tok:
            tok = '"' + tok[1:-1] + '"'
        out.append(tok)
    return " ".join(out).replace("( ", "(").replace(" )", ")")


def _normalize_specifiers(spec: str) -> str:
    spec = re.sub(r"\s+", "", spec)
    if spec.startswith("(") and spec.endswith(")"):
        spec = spec[1:-1]
    parts = sorted({p for p in spec.split(",") if p})
    return ",".join(parts)


def normalize_requirement(req: str) -> str:
    """One PEP 508 requirement in a canonical spelling, so equal meanings compare equal.

    A small normalizer, not a full PEP 508 parser: the name is PEP 503-normalized, extras are
    normalized and sorted, whitespace is removed from version specifiers (whose comma-separated
    clauses are sorted), the marker's whitespace and quotes are canonicalized. Anything that
    does not start with a project name (a path, a URL, an archive file) is kept verbatim.
    """
    req = req.strip()
    m = _NAME_RE.match(req)
    head = re.split(r"[\s\[;<>=!~(@]", req, maxsplit=1)[0]
    if (
        m is None
        or m.end() != len(head)
        or any(c in head for c in "/\\:")
        or head.lower().endswith(_ARCHIVE_SUFFIXES)
    ):
        return re.sub(r"\s+", " ", req)
    name = _canonical_name(m.group(0))
    rest = req[m.end() :].lstrip()
    extras = ""
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            return re.sub(r"\s+", " ", req)
        names = sorted({_canonical_name(e.strip()) for e in rest[1:close].split(",") if e.strip()})
        extras = f"[{','.join(names)}]" if names else ""
        rest = rest[close + 1 :].lstrip()
    marker = ""
    if rest.startswith("@"):
        url_part = rest[1:].strip()
        mm = re.search(r"\s;", url_part)
        if mm:
            url_part, marker = url_part[: mm.start()], url_part[mm.end() :]
        body = f" @ {url_part.strip()}"
    else:
        spec, sep, marker = rest.partition(";")
        body = _normalize_specifiers(spec)
    out = f"{name}{extras}{body}"
    if marker.strip():
        # A URL needs a space before ";" (pip would read it as part of the URL otherwise).
        sep = " ; " if body.startswith(" @ ") else "; "
        out += f"{sep}{_normalize_marker(marker)}"
    return out


# --------------------------------------------------------------------------------------------
# Requirements files
# --------------------------------------------------------------------------------------------

_COMMENT_RE = re.compile(r"(^|\s+)#.*$")
_SHORT_OPTIONS = {
    "-i": "--index-url",
    "-f": "--find-links",
    "-r": "--requirement",
    "-c": "--constraint",
    "-e": "--editable",
}
_FLAG_OPTIONS = {"--pre", "--no-index", "--prefer-binary", "--require-hashes"}
_INCLUDE_OPTIONS = {"--requirement", "--constraint"}


def _logical_lines(text: str) -> list[str]:
    """pip's preprocessing: join backslash continuations, then drop comments and blanks."""
    joined: list[str] = []
    pending: list[str] = []
    for line in text.splitlines():
        if not line.endswith("\\") or _COMMENT_RE.match(line):
            if _COMMENT_RE.match(line):
                line = " " + line
            if pending:
                pending.append(line)
                joined.append("".join(pending))
                pending = []
            else:
                joined.append(line)
        else:
            pending.append(line[:-1])
    if pending:
        joined.append("".join(pending))
    out = []
    for line in joined:
        line = _COMMENT_RE.sub("", line).strip()
        if line:
            out.append(line)
    return out


def _parse_option(line: str) -> tuple[str, str | None]:
    """``-i URL`` / ``--index-url=URL`` / ``-rfile`` -> (long name, value or None)."""
    token, _, rest = line.partition(" ")
    token = token.strip()
    rest = rest.strip()
    if not token.startswith("--") and len(token) > 2:
        token, rest = token[:2], (token[2:].lstrip("=") + " " + rest).strip()
    if "=" in token:
        token, _, value = token.partition("=")
        rest = (value + " " + rest).strip()
    name = _SHORT_OPTIONS.get(token, token)
    if name in _FLAG_OPTIONS and not rest:
        return name, None
    return name, (re.sub(r"\s+", " ", rest) if rest else None)


def _split_requirement_options(line: str) -> tuple[str, list[str]]:
    """Split trailing per-requirement options (``--hash=...``) off, as pip does."""
    tokens = line.split()
    i = next((n for n, tok in enumerate(tokens) if tok.startswith("-")), None)
    if i is None:
        return line, []
    req = " ".join(tokens[:i])
    opts: list[str] = []
    j = i
    while j < len(tokens):
        tok = tokens[j]
        if (
            "=" in tok
            or not tok.startswith("--")
            or j + 1 >= len(tokens)
            or tokens[j + 1].startswith("-")
        ):
            opts.append(tok)
            j += 1
        else:
            opts.append(f"{tok}={tokens[j + 1]}")
            j += 2
    hashes = sorted({o for o in opts if o.startswith("--hash=")})
    others = [o for o in opts if not o.startswith("--hash=")]
    return req, others + hashes


def _normalize_requirements(path: Path, stack: tuple[str, ...]) -> dict[str, Any]:
    text = _read_text(path)
    entries: set[str] = set()
    options: set[str] = set()
    includes: list[dict[str, Any]] = []
    here = os.path.realpath(path)
    for line in _logical_lines(text):
        if line.startswith("-"):
            name, value = _parse_option(line)
            if name in _INCLUDE_OPTIONS and value:
                includes.append(_follow_include(path, name, value, stack + (here,)))
            elif name == "--editable" and value:
                entries.add(f"--editable {value}")
            else:
                options.add(name if value is None else f"{name}={value}")
            continue
        req, opts = _split_requirement_options(line)
        entries.add(" ".join([normalize_requirement(req), *opts]))
    includes.sort(key=lambda d: json.dumps(d, sort_keys=True))
    return {
        "path": path.name,
        "kind": "requirements",
        "options": sorted(options),
        "entries": sorted(entries),
        "includes": includes,
    }


def _follow_include(
    parent: Path, option: str, value: str, stack: tuple[str, ...]
) -> dict[str, Any]:
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value):
        # pip can fetch a URL; we cannot fingerprint its content, so record the URL itself.
        return {"option": option, "path": value, "kind": "url"}
    target = Path(value) if os.path.isabs(value) else parent.parent / value
    if not target.is_file():
        raise SpecFileError(
            f"{parent}: {option} {value}: included file {target} does not exist; "
            f"fix the path (it is relative to {parent.parent}) or create the file"
        )
    if os.path.realpath(target) in stack:
        return {"option": option, "path": target.name, "kind": "requirements", "cycle": True}
    return {"option": option, **_normalize_requirements(target, stack)}


# --------------------------------------------------------------------------------------------
# Spec files
# --------------------------------------------------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SpecFileError(
            f"spec file {path} does not exist: pass the path of an existing requirements, "
            f"uv.lock or pyproject.toml file"
        ) from None
    except IsADirectoryError:
        raise SpecFileError(f"spec file {path} is a directory: pass a file inside it") from None
    except OSError as e:
        raise SpecFileError(f"spec file {path} cannot be read: {e}") from e


def _read_text(path: Path) -> str:
    data = _read_bytes(path)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SpecFileError(
            f"spec file {path} is not UTF-8 text ({e}); re-encode it as UTF-8"
        ) from None


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(_read_text(path))
    except tomllib.TOMLDecodeError as e:
        raise SpecFileError(f"spec file {path} is not valid TOML ({e}); fix its syntax") from None


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _spec_kind(path: Path) -> str:
    name = path.name.lower()
    if name == "uv.lock":
        return "uv.lock"
    if name == "pyproject.toml":
        return "pyproject"
    if (
        path.suffix.lower() in (".txt", ".in", ".pip")
        or "requirements" in name
        or "constraints" in name
    ):
        return "requirements"
    return "file"


def _normalize_uv_lock(path: Path) -> dict[str, Any]:
    data = _load_toml(path)
    packages = data.get("package", [])
    entries = set()
    if isinstance(packages, list):
        for pkg in packages:
            if isinstance(pkg, dict) and "name" in pkg:
                name = _canonical_name(str(pkg["name"]))
                entries.add(f"{name}=={pkg['version']}" if "version" in pkg else name)
    return {
        "path": path.name,
        "kind": "uv.lock",
        "content": _sha256(_canonical_json(data).encode()),
        "entries": sorted(entries),
    }


def _req_list(value: Any, where: str, path: Path) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecFileError(f"{path}: {where} must be a list of requirement strings")
    return sorted({normalize_requirement(v) for v in value})


_UV_KEYS = (
    "sources",
    "index",
    "constraint-dependencies",
    "override-dependencies",
    "dev-dependencies",
    "default-groups",
)


def _normalize_pyproject(path: Path) -> dict[str, Any]:
    data = _load_toml(path)
    project = data.get("project", {}) or {}
    build = data.get("build-system", {}) or {}
    if not isinstance(project, dict) or not isinstance(build, dict):
        raise SpecFileError(f"{path}: [project] and [build-system] must be tables")
    optional = project.get("optional-dependencies", {}) or {}
    if not isinstance(optional, dict):
        raise SpecFileError(f"{path}: project.optional-dependencies must be a table")
    groups_in = data.get("dependency-groups", {}) or {}
    groups: dict[str, list[Any]] = {}
    if isinstance(groups_in, dict):
        for group in sorted(groups_in, key=_canonical_name):
            items = groups_in[group] or []
            reqs = sorted({normalize_requirement(i) for i in items if isinstance(i, str)})
            tables = sorted((i for i in items if isinstance(i, dict)), key=_canonical_json)
            groups[_canonical_name(group)] = [*reqs, *tables]
    tool = data.get("tool", {}) or {}
    uv = tool.get("uv", {}) if isinstance(tool, dict) else {}
    tool_uv = {k: uv[k] for k in _UV_KEYS if isinstance(uv, dict) and k in uv}
    name = project.get("name")
    requires_python = project.get("requires-python")
    return {
        "path": path.name,
        "kind": "pyproject",
        "name": _canonical_name(name) if isinstance(name, str) else None,
        "version": project.get("version"),
        "requires_python": (
            _normalize_specifiers(requires_python) if isinstance(requires_python, str) else None
        ),
        "dependencies": _req_list(project.get("dependencies"), "project.dependencies", path),
        "optional_dependencies": {
            _canonical_name(g): _req_list(optional[g], f"project.optional-dependencies.{g}", path)
            for g in sorted(optional, key=_canonical_name)
        },
        "dependency_groups": groups,
        "build_requires": _req_list(build.get("requires"), "build-system.requires", path),
        "tool_uv": json.loads(_canonical_json(tool_uv)),
    }


def normalize_spec_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The meaning of one spec file, independent of formatting and of where it lives.

    Kind by name: ``uv.lock`` (TOML, parsed: formatting and comments do not count),
    ``pyproject.toml`` (only what determines the environment: name, version,
    requires-python, dependencies, optional and dependency groups, build requires and the
    ``[tool.uv]`` sources/indexes/constraints), requirements files (``*.txt``, ``*.in``,
    ``*.pip`` or a name containing "requirements"/"constraints": comments, blanks, order,
    spelling normalized, ``-r``/``-c`` includes followed) and any other file, hashed as bytes.
    The result holds the base name, never the absolute path.
    """
    p = Path(os.fspath(path))
    kind = _spec_kind(p)
    if kind == "requirements":
        return _normalize_requirements(p, ())
    if kind == "uv.lock":
        return _normalize_uv_lock(p)
    if kind == "pyproject":
        return _normalize_pyproject(p)
    return {"path": p.name, "kind": "file", "content": _sha256(_read_bytes(p))}


# --------------------------------------------------------------------------------------------
# Interpreter identity
# --------------------------------------------------------------------------------------------

# Runs in this process for the current interpreter, and with ``python -c`` for another one,
# so both give the same fields. Keep it compatible with old Pythons (no f-strings needed).
_IDENTITY_SCRIPT = """
def _bootseer_identity():
    import platform, sys, sysconfig
    libc, libc_version = platform.libc_ver()
    return {
        "version": platform.python_version(),
        "implementation": sys.implementation.name,
        "cache_tag": sys.implementation.cache_tag,
        "soabi": sysconfig.get_config_var("SOABI"),
        "abiflags": getattr(sys, "abiflags", ""),
        "platform": sysconfig.get_platform(),
        "libc": (libc + " " + libc_version).strip(),
        "machine": platform.machine(),
    }
"""


@functools.lru_cache(maxsize=1)
def _identity_here() -> tuple[tuple[str, Any], ...]:
    ns: dict[str, Any] = {}
    exec(_IDENTITY_SCRIPT, ns)
    return tuple(ns["_bootseer_identity"]().items())


@functools.lru_cache(maxsize=16)
def _query_interpreter(python: str) -> tuple[tuple[str, Any], ...]:
    code = (
        _IDENTITY_SCRIPT
        + "\nimport json, sys\nsys.stdout.write(json.dumps(_bootseer_identity()))\n"
    )
    try:
        proc = subprocess.run(
            [python, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise SnapshotError(
            f"cannot run the interpreter {python!r} to identify it ({e}); "
            f"pass the path of a working Python"
        ) from e
    if proc.returncode != 0:
        raise SnapshotError(
            f"the interpreter {python!r} failed (exit code {proc.returncode}) while reporting "
            f"its version and ABI: {proc.stderr.strip()[-2000:]}"
        )
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SnapshotError(
            f"the interpreter {python!r} printed no identity: {proc.stdout[-500:]!r}"
        ) from None
    return tuple(data.items())


def python_identity(python: str | None = None) -> dict[str, Any]:
    """Version, implementation, ABI and platform tags of the interpreter the env is built with.

    These decide which wheels pip picks and whether compiled extensions load, so they are part
    of the key. ``None`` (or a path to this very interpreter) is answered in-process; another
    interpreter is asked with a subprocess. Raises ``SnapshotError`` naming it if it can't run.
    """
    if python is None:
        return dict(_identity_here())
    resolved = python if os.sep in python else (shutil.which(python) or python)
    if (
        os.path.exists(resolved)
        and sys.executable
        and (os.path.realpath(resolved) == os.path.realpath(sys.executable))
    ):
        return dict(_identity_here())
    return dict(_query_interpreter(resolved))


# --------------------------------------------------------------------------------------------
# Key
# --------------------------------------------------------------------------------------------

_EXTRA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def parse_extras(items: Sequence[str]) -> dict[str, str]:
    """``["cuda=12.4", "driver=550"]`` -> dict, for ``--extra NAME=VALUE`` flags.

    Raises ``ValueError`` naming the bad item (no ``=``, a bad name, a name given twice with
    different values): a silently dropped input would make two different environments share
    a key.
    """
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"extra key input {item!r} must look like NAME=VALUE (e.g. cuda=12.4)")
        if not _EXTRA_NAME_RE.match(name):
            raise ValueError(
                f"extra key input {item!r}: the name {name!r} must be letters, digits, "
                f"'_', '.' or '-' (e.g. cuda=12.4)"
            )
        value = value.strip()
        if name in out and out[name] != value:
            raise ValueError(f"extra key input {item!r}: {name!r} already given as {out[name]!r}")
        out[name] = value
    return out


def compute_key(
    spec_files: Sequence[str | os.PathLike[str]] = (),
    install_command: Sequence[str] | None = None,
    *,
    python: str | None = None,
    base_image: str | None = None,
    extras: Mapping[str, str] | None = None,
    capture: Sequence[str] = (),
) -> EnvKey:
    """Fingerprint everything that determines the environment's content.

    ``spec_files`` keep their order (it can matter to the install); ``install_command`` is
    recorded verbatim, ``None`` meaning the default install; ``python`` is the interpreter
    the env is built with (default: this one); ``base_image`` is the base image's digest
    (None: unknown); ``extras`` are user-named inputs (e.g. ``{"cuda": "12.4"}``);
    ``capture`` are the paths a capture-mode snapshot records, made absolute and sorted.
    """
    if isinstance(install_command, str | bytes):
        raise TypeError(
            "install_command must be a list of arguments, not a string; "
            "use shlex.split() on a command line"
        )
    if isinstance(spec_files, str | bytes | os.PathLike):
        spec_files = [spec_files]  # type: ignore[list-item]
    if isinstance(capture, str | bytes):
        capture = [capture]
    base_image = (base_image or "").strip() or None
    extras_in = dict(extras or {})
    for k, v in extras_in.items():
        if not isinstance(k, str) or not isinstance(v, str) or not _EXTRA_NAME_RE.match(k):
            raise ValueError(
                f"extra key input {k!r}={v!r}: name and value must be strings, "
                f"the name letters, digits, '_', '.' or '-'"
            )
    inputs: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "python": python_identity(python),
        "spec": [normalize_spec_file(p) for p in spec_files],
        "install_command": "default"
        if install_command is None
        else [str(a) for a in install_command],
        "base_image": base_image,
        "extras": {k: extras_in[k] for k in sorted(extras_in)},
        "capture": sorted({os.path.abspath(os.fspath(p)) for p in capture}),
    }
    # Round-trip so that ``inputs`` holds exactly what is hashed (JSON types only), in the
    # order above; the hash itself is over the sorted-keys form.
    inputs = json.loads(json.dumps(inputs, ensure_ascii=True, default=str))
    canonical = _canonical_json(inputs)
    digest = hashlib.sha256(canonical.encode("ascii")).hexdigest()[:KEY_LENGTH]
    return EnvKey(key=digest, inputs=inputs)
