"""The untrusted-input rules of DESIGN.md, as they apply to image layers.

Every layer is untrusted, whoever built or pushed it. prefetch *presents* layers (FUSE, the
snapshotter) instead of extracting them into a staging directory, so its rules differ from
``snapshot/safety.py`` where the blueprint says they do (prefetch may not import snapshot;
see docs/decisions.md, "snapshot: untrusted-input rules live in each part"):

refused, naming the member and the rule
    * a member path that is absolute or has a ``..`` component;
    * a hardlink whose target lies outside the root (absolute, or with ``..``);
    * paths that no file system could present: NUL bytes, a path longer than PATH_MAX or a
      component longer than NAME_MAX.

presented as the image says
    * symlinks, absolute or relative, pointing anywhere: real images hold
      ``/etc/alternatives/...`` links; a symlink is data and is never followed here;
    * device nodes, FIFOs, setuid/setgid bits: the mount is ``nodev``/``nosuid`` unless the
      container runtime decides otherwise;
    * whiteouts (``.wh.*``, ``.wh..wh..opq``): ordinary entries, the mount layer reads them.

The rules run twice: when a layer is converted (the converter refuses the layer, so an unsafe
image is never published in bootseer's format) and when a TOC is parsed before a mount (a TOC
can be crafted by hand, whatever the converter would have written).

Tar member names arrive in many spellings of the same path (``./usr/bin/``, ``usr//bin``);
:func:`normalize_member_path` maps them to one form (``usr/bin``; the root itself is ``.``),
and the TOC stores only that form, which :func:`check_member_path` insists on.
"""

from __future__ import annotations

from .errors import PrefetchError

MAX_PATH = 4096  # PATH_MAX on Linux, including the terminating NUL the kernel counts
MAX_NAME = 255  # NAME_MAX: bytes in one path component
ROOT = "."


class UnsafeMemberError(PrefetchError, ValueError):
    """A layer member breaks an untrusted-input rule; ``member`` and ``rule`` name both."""

    def __init__(self, member: str, rule: str) -> None:
        super().__init__(f"refused layer member {member!r}: {rule}")
        self.member = member
        self.rule = rule


def _encoded_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


def normalize_member_path(name: str) -> str:
    """The one normalized spelling of a tar member name, or :class:`UnsafeMemberError`.

    ``./a//b/./c/`` becomes ``a/b/c``; ``./`` and ``.`` become ``.`` (the root). Absolute
    names and names with a ``..`` component are refused, never rewritten: GNU tar strips a
    leading ``/`` with a warning, but a layer that holds one was built to surprise someone.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeMemberError(str(name), "empty member path")
    if "\0" in name:
        raise UnsafeMemberError(name, "NUL byte in member path")
    if name.startswith("/"):
        raise UnsafeMemberError(name, "absolute member path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeMemberError(name, "'..' in member path")
    path = "/".join(parts) if parts else ROOT
    _check_lengths(name, path)
    return path


def check_member_path(path: str, *, allow_root: bool = True) -> str:
    """``path`` if it is already a normalized member path (as a TOC must hold it)."""
    if not isinstance(path, str) or not path:
        raise UnsafeMemberError(str(path), "empty member path")
    if "\0" in path:
        raise UnsafeMemberError(path, "NUL byte in member path")
    if path.startswith("/"):
        raise UnsafeMemberError(path, "absolute member path")
    if path == ROOT:
        if not allow_root:
            raise UnsafeMemberError(path, "the root itself is not allowed here")
        return path
    parts = path.split("/")
    if ".." in parts:
        raise UnsafeMemberError(path, "'..' in member path")
    if any(p in ("", ".") for p in parts):
        raise UnsafeMemberError(path, "member path is not normalized (empty or '.' component)")
    _check_lengths(path, path)
    return path


def _check_lengths(member: str, path: str) -> None:
    if _encoded_len(path) >= MAX_PATH:
        raise UnsafeMemberError(member, f"member path longer than {MAX_PATH - 1} bytes")
    for part in path.split("/"):
        if _encoded_len(part) > MAX_NAME:
            raise UnsafeMemberError(member, f"path component longer than {MAX_NAME} bytes")


def normalize_hardlink_target(member: str, target: str) -> str:
    """The normalized target of the hardlink ``member``; refused when it leaves the root."""
    try:
        path = normalize_member_path(target)
    except UnsafeMemberError as exc:
        raise UnsafeMemberError(
            member, f"hardlink target {target!r} lies outside the root ({exc.rule})"
        ) from None
    if path == ROOT:
        raise UnsafeMemberError(member, "hardlink to the root directory")
    return path


def check_hardlink_target(member: str, target: str) -> str:
    """``target`` if it is a normalized hardlink target inside the root (TOC form)."""
    try:
        return check_member_path(target, allow_root=False)
    except UnsafeMemberError as exc:
        raise UnsafeMemberError(
            member, f"hardlink target {target!r} lies outside the root ({exc.rule})"
        ) from None


def check_symlink_target(member: str, target: str) -> str:
    """Symlink targets are data and may point anywhere; only what no kernel accepts is
    refused (a NUL byte, more than PATH_MAX bytes)."""
    if not isinstance(target, str):
        raise UnsafeMemberError(member, "symlink target is not a string")
    if "\0" in target:
        raise UnsafeMemberError(member, "NUL byte in symlink target")
    if _encoded_len(target) >= MAX_PATH:
        raise UnsafeMemberError(member, f"symlink target longer than {MAX_PATH - 1} bytes")
    return target
