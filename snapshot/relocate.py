"""Restore a snapshotted environment to another prefix: find, then rewrite, references to it.

Two phases, so that the restorer never re-reads the whole tree:

1. **Pack time** (:func:`classify_reference`, called on every regular file's bytes, or
   :func:`scan_tree` over a directory): decide whether the file mentions the build prefix and
   what kind of file it is. The result, a list of :class:`PrefixRef`, goes into the manifest
   as plain JSON objects ``{"path": ..., "kind": ...}`` (:meth:`PrefixRef.to_json` /
   :meth:`PrefixRef.from_json`).
2. **Restore time** (:func:`relocate`, after extraction into a staging directory that will be
   renamed to the new prefix): rewrite the ``"text"`` references, refuse (or with ``force``
   skip) the ``"binary"`` ones, ignore the ``"pyc"`` ones.

A *reference* is an occurrence of the prefix that is a whole path or the start of one:

* the byte after it is not a file-name byte ``[A-Za-z0-9_.-]``, so ``/opt/venv`` matches
  ``/opt/venv/bin``, ``"/opt/venv"``, ``/opt/venv:`` and end of data, never ``/opt/venv2``;
* it is not the tail of a longer path: ``/opt/venv`` inside ``/data/opt/venv`` is not a
  reference (the file-name bytes just before it are themselves preceded by ``/``), while
  ``-I/opt/venv/include``, ``prefix=/opt/venv`` and ``file:///opt/venv`` are.

Kinds:

* ``"pyc"``: ``*.pyc`` files. They embed the path of their source as ``co_filename``, but
  importlib replaces it with the actual source path when it loads the file
  (``_bootstrap_external._compile_bytecode`` calls ``_imp._fix_co_filename``), and a pyc is
  validated against its source's mtime and size (or hash), never against its own path. So they
  are harmless where they are, and rewriting them would corrupt the marshalled code (the
  lengths change). Never rewritten, never refused.
* ``"text"``: files without a NUL byte (scripts, ``pyvenv.cfg``, ``activate*``, ``.pth``,
  ``RECORD``, ``direct_url.json``, sources...): rewritten at the byte level, so text that is
  not UTF-8 is fine. Python shebangs are regenerated the way pip (distlib) writes them: a
  plain ``#!/new/bin/python`` line when it fits in 127 bytes and has no space, else the
  ``/bin/sh`` trampoline; both forms are recognised on input.
* ``"binary"``: everything else (shared objects, executables). A path inside a binary cannot
  be rewritten safely (lengths, RPATHs, checksums), so :func:`relocate` refuses them with a
  :class:`~snapshot.errors.RelocationError` unless ``force`` is given.
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshot.errors import (
    CorruptSnapshotError,
    RelocationError,
    SnapshotError,
    UnsafeMemberError,
)

__all__ = [
    "KIND_BINARY",
    "KIND_PYC",
    "KIND_TEXT",
    "KINDS",
    "MAX_SHEBANG_LENGTH",
    "PrefixRef",
    "RelocationReport",
    "classify_reference",
    "relocate",
    "binary_refusal",
    "rewrite_path",
    "scan_tree",
]

KIND_TEXT = "text"
KIND_BINARY = "binary"
KIND_PYC = "pyc"
KINDS = frozenset({KIND_TEXT, KIND_BINARY, KIND_PYC})

MAX_SHEBANG_LENGTH = 127
"""Longest ``#!...\\n`` line written as a plain shebang (distlib's limit on Linux, which was
the kernel's BINPRM_BUF_SIZE before 5.1); longer Python shebangs become the trampoline."""

_NAME_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_SLASH = ord("/")
_LEFT_SCAN_LIMIT = 255  # a path component is at most 255 bytes (NAME_MAX)
_BINARY_LIST_LIMIT = 10

# Characters refused in a new prefix: they would be expanded or would end the quoting in the
# activate scripts (VIRTUAL_ENV="..."), in pyvenv.cfg, or in the shebang trampoline.
_UNSAFE_PREFIX_CHARS = frozenset("\0\n\r\"'$`\\")


@dataclass(frozen=True, slots=True)
class PrefixRef:
    """One file of the snapshot that mentions the build prefix.

    ``path`` is relative to the prefix, POSIX-style, normalized (``bin/pip``); ``kind`` is one
    of :data:`KINDS`. In the manifest it is the plain JSON object ``{"path": .., "kind": ..}``.
    """

    path: str
    kind: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "kind": self.kind}

    @classmethod
    def from_json(cls, obj: Any) -> PrefixRef:
        """Parse one manifest entry; raises CorruptSnapshotError on anything malformed."""
        if isinstance(obj, PrefixRef):
            return obj
        if not isinstance(obj, Mapping):
            raise CorruptSnapshotError(f"prefix reference is not an object: {obj!r}")
        path, kind = obj.get("path"), obj.get("kind")
        if not isinstance(path, str) or not path:
            raise CorruptSnapshotError(f"prefix reference has no valid 'path': {obj!r}")
        if kind not in KINDS:
            raise CorruptSnapshotError(
                f"prefix reference {path!r} has unknown kind {kind!r} "
                f"(expected one of {sorted(KINDS)})"
            )
        return cls(path=path, kind=kind)


@dataclass
class RelocationReport:
    """What :func:`relocate` did; every list holds ref paths relative to the root."""

    old_prefix: str
    new_prefix: str
    rewritten: list[str] = field(default_factory=list)
    """Text files whose content changed."""
    unchanged: list[str] = field(default_factory=list)
    """Text refs in which no reference was found (or a second name of an already done file)."""
    skipped_binary: list[str] = field(default_factory=list)
    """Binary refs left as they are (only with ``force``): they still mention the old prefix."""
    shebangs_converted: list[str] = field(default_factory=list)
    """Scripts whose shebang changed form (plain line <-> ``/bin/sh`` trampoline)."""
    long_shebangs: list[str] = field(default_factory=list)
    """Non-Python scripts whose rewritten ``#!`` line is over 127 bytes (left as a plain line:
    fine on Linux >= 5.1, truncated by older kernels)."""
    pyc_invalidated: list[str] = field(default_factory=list)
    """Cached ``__pycache__/*.pyc`` of rewritten ``.py`` files, removed so they are recompiled
    (their header matches the preserved source mtime, so they would otherwise be used stale)."""

    @property
    def changed(self) -> bool:
        return bool(self.rewritten or self.pyc_invalidated)

    def summary(self) -> str:
        text = (
            f"relocated {self.old_prefix} -> {self.new_prefix}: "
            f"{len(self.rewritten)} file(s) rewritten, "
            f"{len(self.shebangs_converted)} shebang(s) converted"
        )
        if self.pyc_invalidated:
            text += f", {len(self.pyc_invalidated)} stale pyc removed"
        if self.skipped_binary:
            text += (
                f", {len(self.skipped_binary)} binary file(s) left unchanged "
                f"(still mention {self.old_prefix})"
            )
        return text


# --------------------------------------------------------------------------------------------
# Finding references
# --------------------------------------------------------------------------------------------


def _check_prefix(prefix: str | bytes, what: str) -> bytes:
    raw = os.fsencode(prefix)
    if (
        not raw.startswith(b"/")
        or raw == b"/"
        or b"\0" in raw
        or posixpath.normpath(raw) != raw
        or raw.startswith(b"//")
    ):
        raise ValueError(
            f"{what} must be a normalized absolute path other than '/', got {prefix!r}"
        )
    return raw


@functools.lru_cache(maxsize=8)
def _prefix_pattern(prefix: bytes) -> re.Pattern[bytes]:
    _check_prefix(prefix, "prefix")
    # Only used on buffers without .find (memoryview): a literal search, no copy.
    return re.compile(re.escape(prefix))


_NUL_PATTERN = re.compile(b"\0")


def _is_boundary(data: bytes | memoryview, start: int, end: int) -> bool:
    """True when the occurrence data[start:end] of the prefix is a whole path or its start."""
    if end < len(data) and data[end] in _NAME_BYTES:
        return False  # /opt/venv2, /opt/venv.old
    j = start
    lowest = max(0, start - _LEFT_SCAN_LIMIT)
    while j > lowest and data[j - 1] in _NAME_BYTES:
        j -= 1
    # /data/opt/venv: the name bytes before the match follow a '/', so it is a deeper path.
    # -I/opt/venv, x=/opt/venv, file:///opt/venv: not preceded by a path component.
    return not (j < start and j > 0 and data[j - 1] == _SLASH)


def _occurrences(data: bytes | memoryview, prefix: bytes) -> Iterator[int]:
    """Start offsets of the boundary-matched references to ``prefix`` in ``data``."""
    n = len(prefix)
    if isinstance(data, memoryview):
        pattern = _prefix_pattern(prefix)
        pos = 0
        while (m := pattern.search(data, pos)) is not None:
            i = m.start()
            if _is_boundary(data, i, i + n):
                yield i
            pos = i + 1
        return
    i = data.find(prefix)
    while i >= 0:
        if _is_boundary(data, i, i + n):
            yield i
        i = data.find(prefix, i + 1)


def _has_nul(data: bytes | memoryview) -> bool:
    if isinstance(data, memoryview):
        return _NUL_PATTERN.search(data) is not None
    return b"\0" in data


def classify_reference(relpath: str, data: bytes | memoryview, prefix: bytes) -> str | None:
    """Pack-time check of one regular file: None if it does not refer to ``prefix``, else its kind.

    ``data`` is the whole content; ``bytes`` (or ``bytearray``) are searched with
    ``bytes.find`` (memchr speed), a ``memoryview`` with a literal regex search, which is as
    fast and copies nothing. The boundary rules are in the module docstring.
    """
    _prefix_pattern(prefix)  # validates the prefix (cached)
    if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
        data = data.cast("B")
    if next(_occurrences(data, prefix), None) is None:
        return None
    if relpath.endswith(".pyc"):
        # co_filename is fixed up by importlib on load; see the module docstring.
        return KIND_PYC
    if _has_nul(data):
        return KIND_BINARY
    return KIND_TEXT


def scan_tree(root: Path, prefix: str) -> list[PrefixRef]:
    """Walk ``root`` (not following symlinks) and classify every regular file against ``prefix``.

    ``prefix`` is the path the tree is (or was built) at, which need not be ``root``. Returns
    the refs sorted by path.
    """
    raw = _check_prefix(prefix, "prefix")
    refs: list[PrefixRef] = []
    stack = [(os.fspath(root), "")]
    while stack:
        directory, rel = stack.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                relpath = f"{rel}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, relpath + "/"))
                elif entry.is_file(follow_symlinks=False):
                    with open(entry.path, "rb") as f:
                        data = f.read()
                    kind = classify_reference(relpath, data, raw)
                    if kind is not None:
                        refs.append(PrefixRef(relpath, kind))
    refs.sort(key=lambda r: r.path)
    return refs


def _replace_refs(data: bytes, old: bytes, new: bytes) -> bytes:
    out: list[bytes] = []
    last = 0
    for i in _occurrences(data, old):
        out.append(data[last:i])
        out.append(new)
        last = i + len(old)
    if not out:
        return data
    out.append(data[last:])
    return b"".join(out)


def rewrite_path(value: str, old_prefix: str, new_prefix: str) -> str:
    """Rewrite the references to ``old_prefix`` in one string (a symlink target, say)."""
    raw = os.fsencode(value)
    out = _replace_refs(
        raw, _check_prefix(old_prefix, "old prefix"), _check_prefix(new_prefix, "new prefix")
    )
    return value if out is raw else os.fsdecode(out)


# --------------------------------------------------------------------------------------------
# Shebangs
# --------------------------------------------------------------------------------------------

_PLAIN_SHEBANG = re.compile(rb"#![ \t]*([^ \t\n]+)([^\n]*)")
_TRAMPOLINE_HEAD = b"#!/bin/sh\n"
_TRAMPOLINE_EXEC = re.compile(rb"'''exec' (\"[^\"\n]*\"|[^ \t\n\"]+)([^\n]*?) \"\$0\" \"\$@\"")
_TRAMPOLINE_TAIL = b"' '''"


def _build_shebang(executable: bytes, post_interp: bytes) -> bytes:
    """The first line(s) pip's distlib writes for ``executable`` (see ``_build_shebang``)."""
    if b" " in executable and not executable.startswith(b'"'):
        executable = b'"' + executable + b'"'
    if b" " not in executable and len(executable) + len(post_interp) + 3 <= MAX_SHEBANG_LENGTH:
        return b"#!" + executable + post_interp + b"\n"
    return (
        _TRAMPOLINE_HEAD
        + b"'''exec' "
        + executable
        + post_interp
        + b' "$0" "$@"\n'
        + _TRAMPOLINE_TAIL
        + b"\n"
    )


def _python_header(data: bytes) -> tuple[bytes, bytes, int, bool] | None:
    """(executable, post_interp, header length, is_trampoline) of a Python script's shebang."""
    if data.startswith(_TRAMPOLINE_HEAD):
        lines = data.split(b"\n", 3)
        if len(lines) >= 3 and lines[2] == _TRAMPOLINE_TAIL:
            m = _TRAMPOLINE_EXEC.fullmatch(lines[1])
            if m is not None:
                exe = m.group(1)
                if exe.startswith(b'"'):
                    exe = exe[1:-1]
                end = sum(len(line) + 1 for line in lines[:3])
                return exe, m.group(2), min(end, len(data)), True
        return None
    if not data.startswith(b"#!"):
        return None
    nl = data.find(b"\n")
    line = data if nl < 0 else data[:nl]
    m = _PLAIN_SHEBANG.fullmatch(line)
    if m is None:
        return None
    return m.group(1), m.group(2), len(data) if nl < 0 else nl + 1, False


def _rewrite_text(data: bytes, old: bytes, new: bytes) -> tuple[bytes, bool, bool]:
    """(new content, shebang form converted, non-Python shebang too long)."""
    header = _python_header(data)
    if header is not None:
        exe, args, end, was_trampoline = header
        basename = exe.rpartition(b"/")[2]
        if (
            basename.startswith(b"python")
            and exe.startswith(old)
            and exe[len(old) : len(old) + 1] in (b"", b"/")
        ):
            new_header = _build_shebang(new + exe[len(old) :], _replace_refs(args, old, new))
            rest = _replace_refs(data[end:], old, new)
            converted = new_header.startswith(_TRAMPOLINE_HEAD) != was_trampoline
            return new_header + rest, converted, False
    out = _replace_refs(data, old, new)
    first = out.split(b"\n", 1)[0]
    too_long = (
        out.startswith(b"#!")
        and len(first) + 1 > MAX_SHEBANG_LENGTH
        and first != data.split(b"\n", 1)[0]
    )
    return out, False, too_long


# --------------------------------------------------------------------------------------------
# Restore-time rewrite
# --------------------------------------------------------------------------------------------


def _check_ref_path(path: str) -> None:
    if "\0" in path:
        raise UnsafeMemberError(path, "contains a NUL byte")
    if path.startswith("/"):
        raise UnsafeMemberError(path, "absolute path in a prefix reference")
    parts = path.split("/")
    if ".." in parts:
        raise UnsafeMemberError(path, "'..' in a prefix reference")
    if path in ("", ".") or posixpath.normpath(path) != path:
        raise UnsafeMemberError(path, "prefix reference is not a normalized relative path")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_parent(root_fd: int, path: str) -> int:
    """Open the directory holding ``path`` below root_fd, refusing symlinked components."""
    fd = os.dup(root_fd)
    try:
        for part in path.split("/")[:-1]:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise CorruptSnapshotError(
                    f"manifest lists prefix reference {path!r} but the restored tree has no "
                    f"directory {part!r} on its way"
                ) from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeMemberError(
                        path, f"component {part!r} is a symlink or not a directory"
                    ) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _lstat_regular(dir_fd: int, name: str, path: str) -> os.stat_result:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise CorruptSnapshotError(
            f"manifest lists prefix reference {path!r} but the restored tree has no such file"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeMemberError(path, "prefix reference is a symlink (never written through)")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeMemberError(path, "prefix reference is not a regular file")
    return st


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _rewrite_file(dir_fd: int, name: str, path: str, data: bytes, st: os.stat_result) -> None:
    if st.st_nlink > 1:
        # Hard-linked: write in place so that every name sees the new content.
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.ftruncate(fd, 0)
            _write_all(fd, data)
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fd)
        return
    tmp = f".relocate-{os.getpid()}-{os.urandom(4).hex()}.tmp"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        try:
            _write_all(fd, data)
            if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(fd, st.st_uid, st.st_gid)
                except PermissionError:
                    pass
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def _drop_cached_pyc(dir_fd: int, name: str, path: str) -> list[str]:
    """Remove ``__pycache__/<stem>.*.pyc`` next to a rewritten ``<stem>.py``."""
    # <stem>.<cache tag>[.opt-N].pyc, as importlib.util.cache_from_source names them.
    pattern = re.compile(re.escape(name[:-3]) + r"\.[A-Za-z0-9_-]+(\.opt-[0-9]+)?\.pyc")
    try:
        cache_fd = os.open("__pycache__", _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return []
    removed = []
    parent = posixpath.dirname(path)
    try:
        st = os.fstat(cache_fd)
        for entry in os.listdir(cache_fd):
            if pattern.fullmatch(entry):
                os.unlink(entry, dir_fd=cache_fd)
                removed.append(posixpath.join(parent, "__pycache__", entry))
        if removed:
            os.utime(cache_fd, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(cache_fd)
    return removed


def binary_refusal(binaries: list[str], old: str, new: str) -> RelocationError:
    shown = "\n  ".join(binaries[:_BINARY_LIST_LIMIT])
    more = len(binaries) - _BINARY_LIST_LIMIT
    if more > 0:
        shown += f"\n  ... and {more} more"
    return RelocationError(
        f"cannot restore to {new}: the snapshot was built at {old} and {len(binaries)} "
        f"binary file(s) embed that path, which cannot be rewritten:\n  {shown}\n"
        f"Restore to {old}, rebuild the snapshot at {new}, or pass --force to restore to "
        f"{new} anyway with those files unchanged (they will still refer to {old}).",
        paths=list(binaries),
    )


def relocate(
    root: Path, old_prefix: str, new_prefix: str, refs: Iterable[PrefixRef], *, force: bool = False
) -> RelocationReport:
    """Rewrite the references to ``old_prefix`` in the tree at ``root`` to ``new_prefix``.

    ``root`` is the extracted tree (typically a staging directory later renamed to
    ``new_prefix``); ``refs`` come from the manifest (:class:`PrefixRef`, or the JSON objects
    themselves) and are untrusted. All refs are checked before anything changes:

    * each path must be a normalized relative path (no ``..``, not absolute), else
      :class:`~snapshot.errors.UnsafeMemberError`;
    * ``"binary"`` refs raise :class:`~snapshot.errors.RelocationError` unless ``force``,
      in which case they are left unchanged and listed in ``skipped_binary``;
    * each ``"text"`` ref must be a regular file reached without any symlink, else
      :class:`~snapshot.errors.UnsafeMemberError` (or CorruptSnapshotError if missing).

    Rewritten files keep their mode, owner (when permitted) and atime/mtime, and are replaced
    atomically (temp file + ``os.replace`` in the same directory; hard-linked files are
    rewritten in place); the parent directories keep their mtimes. An error after the checks
    (I/O) leaves the tree partly rewritten: discard it.
    """
    old = _check_prefix(old_prefix, "old prefix")
    new = _check_prefix(new_prefix, "new prefix")
    report = RelocationReport(old_prefix=old_prefix, new_prefix=new_prefix)
    if old == new:
        return report
    bad = sorted(set(os.fsdecode(new)) & _UNSAFE_PREFIX_CHARS)
    if bad:
        raise SnapshotError(
            f"cannot restore to {new_prefix!r}: a prefix containing {bad!r} cannot be written "
            f"safely into activate scripts and shebangs; choose another path"
        )

    parsed = [PrefixRef.from_json(r) for r in refs]
    for ref in parsed:
        _check_ref_path(ref.path)
    binaries = sorted({r.path for r in parsed if r.kind == KIND_BINARY})
    if binaries and not force:
        raise binary_refusal(binaries, old_prefix, new_prefix)
    report.skipped_binary = binaries

    texts = sorted({r.path for r in parsed if r.kind == KIND_TEXT})
    by_dir: dict[str, list[str]] = {}
    for path in texts:
        by_dir.setdefault(posixpath.dirname(path), []).append(path)

    root_fd = os.open(os.fspath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # Check pass: every text ref is a regular file reached without symlinks.
        for paths in by_dir.values():
            dir_fd = _open_parent(root_fd, paths[0])
            try:
                for path in paths:
                    _lstat_regular(dir_fd, posixpath.basename(path), path)
            finally:
                os.close(dir_fd)
        # Rewrite pass.
        seen: set[tuple[int, int]] = set()
        for paths in by_dir.values():
            dir_fd = _open_parent(root_fd, paths[0])
            try:
                dir_st = os.fstat(dir_fd)
                touched = False
                for path in paths:
                    name = posixpath.basename(path)
                    fd = os.open(
                        name,
                        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                        dir_fd=dir_fd,
                    )
                    try:
                        st = os.fstat(fd)
                        if not stat.S_ISREG(st.st_mode):
                            raise UnsafeMemberError(path, "prefix reference is not a regular file")
                        data = _read_all(fd)
                    finally:
                        os.close(fd)
                    if (st.st_dev, st.st_ino) in seen:
                        report.unchanged.append(path)
                        continue
                    seen.add((st.st_dev, st.st_ino))
                    if b"\0" in data:
                        raise CorruptSnapshotError(
                            f"prefix reference {path!r} is listed as text but holds NUL bytes: "
                            f"the manifest does not match the snapshot"
                        )
                    out, converted, too_long = _rewrite_text(data, old, new)
                    if out == data:
                        report.unchanged.append(path)
                        continue
                    _rewrite_file(dir_fd, name, path, out, st)
                    touched = True
                    report.rewritten.append(path)
                    if converted:
                        report.shebangs_converted.append(path)
                    if too_long:
                        report.long_shebangs.append(path)
                    if name.endswith(".py"):
                        report.pyc_invalidated.extend(_drop_cached_pyc(dir_fd, name, path))
                if touched:
                    os.utime(dir_fd, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))
            finally:
                os.close(dir_fd)
    finally:
        os.close(root_fd)
    return report
