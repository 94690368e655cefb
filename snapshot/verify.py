"""Does a prefix hold the intact environment its marker names? The O(1) check and the full one.

The marker (``.bootseer/env.json``) names the key and the prefix the environment was written
for; the verification record (``.bootseer/toc.json.zst``) lists every member as written:
``[path, kind, size, mtime_ns, mode]`` (``mode`` -1: not compared; records of older versions
have four fields and no mode).

* ``verify(prefix, key, quick=True)``: the marker alone (the key, the prefix, not marked
  damaged, the record present), O(1). It is trusted so only when bootseer's state is private:
  the state directory, the marker and the record owned by this user or root and writable by
  nobody else (:func:`snapshot.state.state_not_private`); otherwise the full check runs now.
* ``verify(prefix, key)``: every member's type, size, mtime and mode (the files the
  interpreter reads at its start first: ``pyvenv.cfg``, ``bin/``, the top of
  ``site-packages`` with its ``.pth`` files), then every directory read for entries the
  snapshot does not hold. Stats and directory reads only, no file contents: a change that
  keeps a file's size and mtime (``touch -d``) is not seen (the snapshot records no
  per-file digests; docs/snapshot.md, "Verification").

Extra entries: the interpreter writes bytecode into ``__pycache__`` directories, so a regular
file there (without setuid/setgid) is not a mismatch; anything else the snapshot does not hold
(a ``.pth`` file, a module, a setuid binary, a link, a device) is.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CorruptSnapshotError
from .manifest import DIR, FILE, HARDLINK, MAX_TOC_RAW, SYMLINK, Member
from .safety import PERMISSION_BITS, PRIVILEGE_BITS, STATE_DIR
from .state import has_state, read_state, state_not_private
from .zframe import inflate

MARKER = "env.json"
VERIFY_TOC = "toc.json.zst"
MAX_MARKER = 1 << 20
NO_MODE = -1
PYCACHE = "__pycache__"

__all__ = [
    "MARKER",
    "VERIFY_TOC",
    "VerifyResult",
    "read_marker",
    "verify",
    "verify_rows",
]


@dataclass
class VerifyResult:
    """Whether ``prefix`` holds the environment of ``key``, intact (types, sizes, mtimes,
    modes, no extra entries). ``files_checked`` False: trusted by its marker alone."""

    ok: bool
    reason: str
    key: str | None = None
    checked: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    files_checked: bool = True


def read_marker(prefix: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of the environment at ``prefix``; None when there is none, or it is
    reached through a link (:mod:`snapshot.state`)."""
    raw = read_state(prefix, MARKER, MAX_MARKER)
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def verify_rows(root: Path, members: list[Member], changed: Any) -> list[list[Any]]:
    """The verification record of ``root``: ``[path, kind, size, mtime_ns, mode]`` per member.

    ``changed is True``: stat every member (a tree bootseer did not write). Otherwise the
    members are what the extractor wrote (setuid/setgid stripped, :mod:`snapshot.safety`),
    except the files a relocation (``changed``, a ``RelocationReport``) rewrote or removed."""
    restat: set[str] = set()
    removed: set[str] = set()
    if changed is not True and changed is not None:
        restat, removed = set(changed.rewritten), set(changed.pyc_invalidated)
    rows: list[list[Any]] = []
    for m in members:
        if m.path in removed:
            continue
        if m.kind in (SYMLINK, HARDLINK):  # a link's mode means nothing; a hardlink's is its
            rows.append([m.path, m.kind, 0, 0, NO_MODE])  # target's, compared there
        elif changed is True or m.path in restat:
            try:
                st = os.lstat(root / m.path)
            except FileNotFoundError:
                continue
            size, mtime = (st.st_size, st.st_mtime_ns) if m.kind == FILE else (0, 0)
            rows.append([m.path, m.kind, size, mtime, stat.S_IMODE(st.st_mode)])
        else:
            mode = m.mode & PERMISSION_BITS & ~PRIVILEGE_BITS
            size, mtime = (m.size, m.mtime_ns) if m.kind == FILE else (0, 0)
            rows.append([m.path, m.kind, size, mtime, mode])
    return rows


def _starts_first(path: str) -> bool:
    """Read by the interpreter before the command's first import: checked first."""
    if path == "pyvenv.cfg" or path.startswith("bin/"):
        return True
    return path.rpartition("/")[0].endswith("site-packages")  # .pth files, sitecustomize


def verify(
    prefix: str | os.PathLike, key: str | None = None, *, quick: bool = False, limit: int = 20
) -> VerifyResult:
    """Check that ``prefix`` holds the intact environment of ``key`` (any key if None); see
    the module docstring. ``limit``: stop after that many problems."""
    start = time.perf_counter()
    prefix = Path(prefix)
    marker = read_marker(prefix)
    if marker is None:
        return VerifyResult(False, "no bootseer environment there")
    found = marker.get("key")
    if key is not None and found != key:
        return VerifyResult(False, f"holds another environment ({found})", key=found)
    if marker.get("prefix") != str(prefix):
        return VerifyResult(False, f"was restored for {marker.get('prefix')}, not here", key=found)
    if marker.get("damaged"):
        return VerifyResult(False, f"a check found it damaged ({marker['damaged']})", key=found)
    if quick:
        if not has_state(prefix, VERIFY_TOC):
            return VerifyResult(False, "its verification record is missing", key=found)
        if state_not_private(prefix, (MARKER, VERIFY_TOC)) is None:
            return VerifyResult(
                True,
                "marker matches (files checked beside the command)",
                key=found,
                seconds=time.perf_counter() - start,
                files_checked=False,
            )
        # bootseer's state there could have been written by someone else: not trusted
        # alone; the files are checked now, before the command (as with env.verify=before)
    try:
        data = read_state(prefix, VERIFY_TOC, MAX_TOC_RAW)
        if data is None:
            raise OSError("missing, not a regular file, or reached through a link")
        rows = json.loads(inflate(data, "verification TOC", declared=None, limit=MAX_TOC_RAW))
        if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) in (4, 5) and isinstance(r[0], str) for r in rows
        ):
            raise ValueError("not a list of [path, kind, size, mtime_ns, mode] rows")
    except (OSError, ValueError, CorruptSnapshotError) as exc:
        return VerifyResult(False, f"its verification record is unreadable ({exc})", key=found)
    problems: list[str] = []
    for problem in _problems(str(prefix), rows):
        problems.append(problem)
        if len(problems) >= limit:
            break
    elapsed = time.perf_counter() - start
    if problems:
        more = "+" if len(problems) >= limit else ""
        return VerifyResult(
            False,
            f"{len(problems)}{more} file(s) missing, changed or extra",
            key=found,
            checked=len(rows),
            problems=problems,
            seconds=elapsed,
        )
    return VerifyResult(True, "intact", key=found, checked=len(rows), seconds=elapsed)


_WANT = {FILE: stat.S_ISREG, HARDLINK: stat.S_ISREG, DIR: stat.S_ISDIR, SYMLINK: stat.S_ISLNK}


def _problems(prefix: str, rows: list[list[Any]]) -> Iterator[str]:
    """Every member (the interpreter's first reads first), then every directory's entries."""
    base = prefix + "/"
    first = [r for r in rows if _starts_first(r[0])]
    rest = [r for r in rows if not _starts_first(r[0])]
    real_dirs = [""]  # the directories whose entries are read next: real ones, not links
    for row in first + rest:
        path, kind = row[0], row[1]
        if kind not in _WANT:
            yield f"{path}: unknown kind {kind!r} in the verification record"
            continue
        try:
            st = os.lstat(base + path)
        except OSError:
            yield f"{path}: missing"
            continue
        mode = stat.S_IMODE(st.st_mode)
        want_mode = row[4] if len(row) > 4 else NO_MODE
        if not _WANT[kind](st.st_mode):
            yield f"{path}: wrong type"
            continue
        if kind == DIR:
            real_dirs.append(path)
        if kind == FILE and (st.st_size != row[2] or st.st_mtime_ns != row[3]):
            yield f"{path}: changed (size or mtime)"
        elif mode & PRIVILEGE_BITS and kind in (FILE, HARDLINK) and want_mode != mode:
            yield f"{path}: setuid/setgid bit set (mode {mode:04o}), not the snapshot's"
        elif want_mode != NO_MODE and mode != want_mode:
            yield f"{path}: changed (mode {mode:04o}, the snapshot's {want_mode:04o})"
    yield from _extras(prefix, {r[0] for r in rows}, real_dirs)


def _extras(prefix: str, known: set[str], dirs: list[str]) -> Iterator[str]:
    """Entries of the environment's directories that the record does not list."""
    for rel in dirs:
        try:
            entries = list(os.scandir(prefix + "/" + rel if rel else prefix))
        except OSError:
            continue  # a missing or replaced directory was reported above
        in_cache = rel.rpartition("/")[2] == PYCACHE
        for entry in entries:
            path = f"{rel}/{entry.name}" if rel else entry.name
            if path in known or (not rel and entry.name == STATE_DIR):
                continue
            yield from _extra(entry, path, in_cache)


def _extra(entry: os.DirEntry[str], path: str, in_cache: bool) -> Iterator[str]:
    """Is an entry the snapshot does not hold a mismatch? Bytecode in ``__pycache__`` is not."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return  # gone since the directory was read
    mode = stat.S_IMODE(st.st_mode)
    if mode & PRIVILEGE_BITS and stat.S_ISREG(st.st_mode):  # on a directory: group inheritance
        yield f"{path}: extra setuid/setgid file (mode {mode:04o}), not in the snapshot"
    elif stat.S_ISREG(st.st_mode) and in_cache:
        return
    elif stat.S_ISDIR(st.st_mode) and entry.name == PYCACHE:
        try:
            inner = list(os.scandir(entry.path))
        except OSError:
            return
        for child in inner:
            yield from _extra(child, f"{path}/{child.name}", True)
    else:
        yield f"{path}: extra {_kind_name(st.st_mode)}, not in the snapshot"


def _kind_name(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "special file (device, FIFO or socket)"
