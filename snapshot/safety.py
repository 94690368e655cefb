"""The untrusted-input rules of DESIGN.md, applied to a snapshot's table of contents.

Every snapshot is untrusted, whoever published it. Before a byte is written, the whole TOC is
checked here: member paths must be relative and free of ``..``; no member may sit under a
symlink member; hardlinks must point at a regular file inside the root; device nodes and FIFOs
are refused; setuid/setgid bits are stripped with a warning. Symlinks themselves are data and
may point anywhere (a venv's ``bin/python`` points at the system interpreter). ``.bootseer``,
where bootseer keeps its own state in a prefix, is reserved: no member may be it or lie under
it, in any spelling a case-insensitive or normalizing filesystem maps to the same name.

The extractor adds the kernel-level half of the rule: it creates everything relative to
directory file descriptors it made itself, with ``O_NOFOLLOW``/``O_EXCL``, so even a check
missed here cannot write through a link. prefetch has its own rules module (it presents layers
instead of extracting them); see docs/decisions.md.
"""

from __future__ import annotations

import functools
import logging
import re
import stat
import unicodedata
from dataclasses import dataclass, field

from .errors import UnsafeMemberError
from .manifest import DIR, FILE, HARDLINK, SYMLINK, Member

log = logging.getLogger(__name__)

DEVICE_KINDS = {"c": "character device", "b": "block device", "p": "FIFO"}
MAX_PATH = 4096
MAX_NAME = 255
PERMISSION_BITS = 0o7777
PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID
STATE_DIR = ".bootseer"
"""bootseer's own directory in a prefix (marker, verification TOC): reserved, never packed."""
_DOS_SHORT_NAME = re.compile(r"bootse~[0-9]+")


@dataclass
class Plan:
    """A checked TOC, split by kind in the order the extractor creates them."""

    dirs: list[Member] = field(default_factory=list)
    files: list[Member] = field(default_factory=list)
    symlinks: list[Member] = field(default_factory=list)
    hardlinks: list[Member] = field(default_factory=list)
    stripped: list[str] = field(default_factory=list)  # members that lost setuid/setgid bits

    @property
    def regular_bytes(self) -> int:
        return sum(m.size for m in self.files)


def check_path(path: str) -> str:
    """``path`` if it is a normalized relative member path, else :class:`UnsafeMemberError`."""
    if not isinstance(path, str) or not path:
        raise UnsafeMemberError(str(path), "empty member path")
    if "\0" in path:
        raise UnsafeMemberError(path, "NUL byte in member path")
    if path.startswith("/"):
        raise UnsafeMemberError(path, "absolute member path")
    parts = path.split("/")
    if ".." in parts:
        raise UnsafeMemberError(path, "'..' in member path")
    if any(p in ("", ".") for p in parts):
        raise UnsafeMemberError(path, "member path is not normalized (empty or '.' component)")
    if len(path) > MAX_PATH or any(
        len(p.encode("utf-8", "surrogateescape")) > MAX_NAME for p in parts
    ):
        raise UnsafeMemberError(path, "member path too long")
    return path


@functools.lru_cache(maxsize=4096)
def is_reserved(name: str) -> bool:
    """Is the path component ``name`` :data:`STATE_DIR` on some filesystem? Case-insensitive
    ones (vfat, NTFS/SMB, ext4 casefold) fold case and Unicode compatibility forms, HFS+
    ignores format characters such as zero-width joiners, Windows drops trailing dots and
    spaces and answers to 8.3 short names: every such spelling is refused, not only ours."""
    kept = "".join(c for c in name if unicodedata.category(c) != "Cf")
    folded = unicodedata.normalize("NFKC", kept).casefold().rstrip(". ")
    return folded == STATE_DIR or bool(_DOS_SHORT_NAME.fullmatch(folded))


def check_reserved(path: str) -> None:
    """Refuse a member that is, or lies under, the reserved state directory."""
    top = path.partition("/")[0]
    if is_reserved(top):
        same = "" if top == STATE_DIR else f" ({top!r} is that name on some filesystems)"
        raise UnsafeMemberError(
            path,
            f"reserved: {STATE_DIR!r} holds bootseer's own state "
            f"(marker, verification TOC){same}; a snapshot may not "
            f"hold it",
        )


def plan_extraction(members: list[Member], stream_size: int, *, reserve_state: bool = True) -> Plan:
    """Check every member against the rules; nothing is written until this returns.
    ``reserve_state``: the tree is a prefix, which gets bootseer's state directory."""
    plan = Plan()
    kinds: dict[str, str] = {}
    for member in members:
        path = check_path(member.path)
        if reserve_state:
            check_reserved(path)
        if member.kind in DEVICE_KINDS:
            raise UnsafeMemberError(
                path, f"{DEVICE_KINDS[member.kind]} not allowed in a dependency snapshot"
            )
        if path in kinds:
            raise UnsafeMemberError(path, "duplicate member (a later one would replace it)")
        parent = path.rpartition("/")[0]
        if parent:
            parent_kind = kinds.get(parent)
            if parent_kind == SYMLINK:
                raise UnsafeMemberError(path, f"member under the symlink {parent!r}")
            if parent_kind != DIR:
                raise UnsafeMemberError(
                    path, f"parent directory {parent!r} is not an earlier directory member"
                )
        mode = member.mode & PERMISSION_BITS
        if member.mode & ~PERMISSION_BITS:
            raise UnsafeMemberError(path, f"mode {member.mode:o} has non-permission bits")
        if mode & PRIVILEGE_BITS and member.kind != SYMLINK:
            plan.stripped.append(path)
            mode &= ~PRIVILEGE_BITS
            member = Member(
                path, member.kind, mode, member.mtime_ns, member.size, member.offset, member.link
            )
        if member.kind == FILE:
            if member.offset + member.size > stream_size:
                raise UnsafeMemberError(
                    path,
                    f"data [{member.offset}, {member.offset + member.size}) lies beyond "
                    f"the tar stream ({stream_size} bytes)",
                )
            plan.files.append(member)
        elif member.kind == DIR:
            plan.dirs.append(member)
        elif member.kind == SYMLINK:
            if not member.link or "\0" in member.link or len(member.link) > MAX_PATH:
                raise UnsafeMemberError(path, "invalid symlink target")
            plan.symlinks.append(member)
        elif member.kind == HARDLINK:
            target = member.link
            try:
                check_path(target)
            except UnsafeMemberError as exc:
                raise UnsafeMemberError(
                    path, f"hardlink target {target!r} lies outside the root ({exc.rule})"
                ) from None
            if kinds.get(target) != FILE:
                raise UnsafeMemberError(
                    path, f"hardlink target {target!r} is not an earlier regular file member"
                )
            plan.hardlinks.append(member)
        else:  # pragma: no cover - Member.from_row admits only known kinds
            raise UnsafeMemberError(path, f"unknown member kind {member.kind!r}")
        kinds[path] = member.kind
    if plan.stripped:
        log.warning(
            "stripped setuid/setgid bits from %d member(s) of the snapshot, e.g. %s",
            len(plan.stripped),
            plan.stripped[0],
        )
    return plan
