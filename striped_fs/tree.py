"""Which paths ``mv`` and ``rm`` act on, and in what order, so that no call loses data.

* A path that exists is taken literally, even when it holds glob characters
  (``ckpt[1].bin``); only a path that does not exist is expanded as a glob, and a glob that
  matches nothing is an error naming it, never a silent no-op.
* ``mv`` decides every destination before it moves anything (a glob, a list or an existing
  directory as destination means "into that directory", as ``cp`` does) and refuses two
  sources landing on one destination, or a directory moved into itself.
* One file at a time: the destination is committed before the source is removed, so a
  failure leaves each file whole at one of the two places.
* Every path handed to the target is literal: fsspec's own ``rm``/``copy`` would expand
  glob characters in a stripes directory's name (``.x[1].bin.stripes``) and remove the
  stripes of another file.
"""

from __future__ import annotations

import errno
import os
from glob import has_magic
from typing import TYPE_CHECKING

from fsspec import AbstractFileSystem

from .layout import is_stripes_dir_name, split_path

if TYPE_CHECKING:
    from .filesystem import StripedFileSystem


def sources(fs: StripedFileSystem, path: str | list[str]) -> tuple[list[str], bool]:
    """The existing paths ``path`` names, and whether a pattern was expanded to find them."""
    out: list[str] = []
    expanded = False
    for given in path if isinstance(path, list) else [path]:
        p = fs._norm(given)
        if is_stripes_dir_name(split_path(p.rstrip("/"))[1]):
            raise ValueError(
                f"{p}: names ending in .stripes and starting with a dot hold a "
                "striped file's stripes; remove or move the file itself"
            )
        if fs.target.exists(p):
            matches = [p]
        elif has_magic(p):
            matches = fs.glob(p)
            expanded = True
            if not matches:
                raise FileNotFoundError(errno.ENOENT, "no file or directory matches the pattern", p)
        else:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", p)
        out.extend(m for m in matches if m not in out)
    return out, expanded


def move_pairs(
    fs: StripedFileSystem, path1: str | list[str], path2: str | list[str]
) -> list[tuple[str, str]]:
    """(source, destination) for every path ``mv(path1, path2)`` moves, checked up front."""
    if isinstance(path2, list):
        if not isinstance(path1, list) or len(path1) != len(path2):
            raise ValueError(
                "mv: a list of destinations needs a list of sources of the same "
                f"length ({len(path2)} destinations given)"
            )
        srcs = [sources(fs, p) for p in path1]
        if any(expanded for _, expanded in srcs):
            raise ValueError(
                "mv: with a list of destinations, each source must be one "
                "existing path, not a pattern"
            )
        pairs = [(found[0], fs._norm(d)) for (found, _), d in zip(srcs, path2, strict=True)]
        for _, dst in pairs:
            if fs.target.isdir(dst):
                raise IsADirectoryError(
                    errno.EISDIR,
                    "destination is a directory; give the "
                    "file's full path, or one directory for all",
                    dst,
                )
    else:
        srcs, expanded = sources(fs, path1)
        dst = fs._norm(path2).rstrip("/")
        into = (
            isinstance(path1, list)
            or expanded
            or len(srcs) > 1
            or path2.endswith("/")
            or fs.target.isdir(dst)
        )
        pairs = [(s, f"{dst}/{split_path(s.rstrip('/'))[1]}" if into else dst) for s in srcs]
    _check_pairs(fs, pairs)
    return [(s, d) for s, d in pairs if s != d]


def _check_pairs(fs: StripedFileSystem, pairs: list[tuple[str, str]]) -> None:
    seen: dict[str, str] = {}
    for src, dst in pairs:
        if dst in seen:
            raise ValueError(
                f"mv: {seen[dst]} and {src} would both move to {dst}; "
                "move them one at a time to different names"
            )
        seen[dst] = src
        if dst.startswith(src.rstrip("/") + "/") and fs.target.isdir(src):
            raise ValueError(f"mv: cannot move the directory {src} into itself ({dst})")


def under(path: str, directories: list[str]) -> bool:
    return any(path.startswith(d.rstrip("/") + "/") for d in directories)


def remove_literal(target: AbstractFileSystem, path: str) -> None:
    """``target.rm(path, recursive=True)`` that never expands glob characters in ``path``."""
    if not has_magic(path):
        try:
            target.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        return
    try:
        found = target.find(path, withdirs=True, detail=True)
    except FileNotFoundError:
        return
    for name, info in sorted(found.items(), key=lambda kv: -kv[0].count("/")):
        if info["type"] == "directory":
            _rmdir_if_there(target, name)
        else:
            target.rm_file(name)
    _rmdir_if_there(target, path)


def _rmdir_if_there(target: AbstractFileSystem, path: str) -> None:
    try:
        if target.isdir(path):
            target.rmdir(path)
    except (FileNotFoundError, FileExistsError):
        pass  # object stores: a prefix is gone with its last key


def remove_empty_dirs(target: AbstractFileSystem, root: str) -> None:
    """Remove the directories under ``root`` (and ``root``) that hold nothing, deepest first;
    a directory with anything left in it stays."""
    if not target.isdir(root):
        return
    found = target.find(root, withdirs=True, detail=True)
    dirs = {name for name, info in found.items() if info["type"] == "directory"} | {root}
    for name in sorted(dirs, key=lambda n: -n.count("/")):
        try:
            target.rmdir(name)
        except OSError:
            pass  # not empty (or an object store's prefix): kept


def local_parent(path: str) -> None:
    """Create the local parent directory of ``path`` (a move or download into a new tree)."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
