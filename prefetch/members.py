"""Tar members as a TOC records them: the one mapping from tar headers to TOC entries.

The converter derives every TOC entry from the tar stream with :func:`tar_entry` (it never
copies a TOC it was given), and the lazy read path checks every TOC entry against the tar
header it points at with the same function (:func:`verify_entries`, called by
:meth:`prefetch.toc.LayerIndex.verify_frame` when the frame holding the header is
decompressed). Both read headers with Python's ``tarfile`` (the same parser, the same
quirks: PAX and GNU long names and links, PAX and old GNU sparse files, base-256 numbers), so
what a lazy view shows of a member is what a plain unpack of the blob shows.

The rules a verified TOC satisfies, each named in the error that breaks it:

* the header chain at an entry's ``header`` offset parses, and the member it describes is the
  entry: name (after normalization), type, size, link target, mode, uid/gid, user/group names,
  mtime, device numbers, xattrs, sparse map and data offset (:data:`~prefetch.toc.RULE_MATCH`);
* the member ends exactly where the next entry's headers start, and the last one where an
  end-of-archive block (or the end of the stream) lies: no member is left out, none is
  invented in a gap (:data:`~prefetch.toc.RULE_COMPLETE`);
* a global PAX header may only carry keys no member takes anything from (``comment`` and the
  like): one that sets a path, size, owner, time, charset, xattr or sparse map for every later
  member would make each member depend on all the headers before it, which a lazy reader does
  not read. The converter refuses such a layer; the verifier refuses a chain holding one.

The fast path (:func:`_quick_match`) reads a plain one-block ustar/GNU header with one struct
unpack, byte comparisons and integer conversions (the checksum through ``zlib.adler32``), several
times cheaper than ``tarfile``; it
only ever *accepts* a header whose every field it compared, and sends anything else (extension
headers, base-256 numbers, a signed checksum, a mismatch) to ``tarfile``, which decides and
names the difference.
"""

from __future__ import annotations

import struct
import tarfile
import zlib
from collections.abc import Callable, Iterable
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from typing import Any

from .errors import PrefetchError
from .safety import (
    ROOT,
    UnsafeMemberError,
    check_symlink_target,
    normalize_hardlink_target,
    normalize_member_path,
)
from .toc import (
    MAX_HEADER_CHAIN,
    MAX_ID,
    MAX_MTIME_NS,
    RULE_COMPLETE,
    RULE_MATCH,
    TAR_BLOCK,
    TocEntry,
    TocMismatchError,
)

ENCODING, ERRORS = "utf-8", "surrogateescape"  # how the converter opens every tar stream

TYPES = {
    tarfile.REGTYPE: "reg",
    tarfile.AREGTYPE: "reg",
    tarfile.CONTTYPE: "reg",
    tarfile.GNUTYPE_SPARSE: "reg",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char",
    tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}
XATTR_PREFIX = "SCHILY.xattr."
# What tarfile or tar_entry takes from a PAX header into a member (global ones included).
_MEMBER_KEYS = frozenset(tarfile.PAX_FIELDS) | {"hdrcharset"}
_MEMBER_PREFIXES = ("GNU.sparse.", XATTR_PREFIX)


class ConvertError(PrefetchError, ValueError):
    """The input is not a tar stream bootseer can convert (corrupt, truncated, odd types)."""


def _mtime_ns(info: tarfile.TarInfo) -> int:
    """The member's mtime in ns as Go's archive/tar reads it (so containerd): a PAX time's
    digits past the ninth are dropped (truncated toward zero, not rounded)."""
    text = info.pax_headers.get("mtime")
    if text is not None:
        try:
            return int(Decimal(text).scaleb(9).to_integral_value(rounding=ROUND_DOWN))
        except (InvalidOperation, ValueError):
            pass
    return int(Decimal(str(info.mtime)).scaleb(9).to_integral_value(rounding=ROUND_DOWN))


def tar_entry(info: tarfile.TarInfo, header_offset: int, end: int) -> TocEntry:
    """The TOC entry of a member ``tarfile`` read, whose header chain starts at
    ``header_offset`` and whose member ends at ``end`` (where the next one starts). Raises :class:`UnsafeMemberError` (a rule of :mod:`prefetch.safety`)
    or :class:`ConvertError` (a member bootseer does not present)."""
    raw_name = info.name
    kind = TYPES.get(info.type)
    if kind is None:
        raise ConvertError(f"layer member {raw_name!r}: unsupported tar member type {info.type!r}")
    name = normalize_member_path(raw_name)
    if name == ROOT and kind != "dir":
        raise UnsafeMemberError(raw_name, f"the root is a {kind} member, not a directory")
    link = ""
    if kind == "hardlink":
        link = normalize_hardlink_target(raw_name, info.linkname)
    elif kind == "symlink":
        link = check_symlink_target(raw_name, info.linkname)
    for what, value in (
        ("uid", info.uid),
        ("gid", info.gid),
        ("devmajor", info.devmajor),
        ("devminor", info.devminor),
    ):
        if not 0 <= value <= MAX_ID:
            raise ConvertError(f"layer member {raw_name!r}: {what} {value} out of range")
    mtime_ns = _mtime_ns(info)
    if not -MAX_MTIME_NS <= mtime_ns <= MAX_MTIME_NS:
        raise ConvertError(
            f"layer member {raw_name!r}: mtime {mtime_ns} ns is out of range "
            "(Go's archive/tar, and so containerd, refuses it too)"
        )
    xattrs = {}
    for key, value in info.pax_headers.items():
        if key.startswith(XATTR_PREFIX) and len(key) > len(XATTR_PREFIX):
            xattrs[key[len(XATTR_PREFIX) :]] = value.encode(ENCODING, ERRORS)
    sparse = None
    size = 0
    if kind == "reg":
        size = info.size
        if info.sparse is not None:
            sparse = tuple((int(o), int(n)) for o, n in info.sparse)
    if info.offset_data - header_offset > MAX_HEADER_CHAIN:
        raise ConvertError(
            f"layer member {raw_name!r}: {info.offset_data - header_offset} "
            f"bytes of headers (at most {MAX_HEADER_CHAIN})"
        )
    entry = TocEntry(
        name=name,
        type=kind,
        mode=info.mode & 0o7777,
        uid=info.uid,
        gid=info.gid,
        uname=info.uname or "",
        gname=info.gname or "",
        size=size,
        mtime_ns=mtime_ns,
        link=link,
        devmajor=info.devmajor if kind in ("char", "block") else 0,
        devminor=info.devminor if kind in ("char", "block") else 0,
        xattrs=xattrs,
        offset=info.offset_data,
        header_offset=header_offset,
        sparse=sparse,
    )
    if entry.data_end > end:
        raise ConvertError(
            f"layer member {raw_name!r}: its data ({entry.stored_size} bytes "
            f"from byte {entry.offset}) runs past the member's end ({end})"
        )
    return entry


def global_header_problem(pax_headers: dict[str, str]) -> str | None:
    """What is wrong with the global PAX headers read so far, or None (see the module)."""
    bad = sorted(k for k in pax_headers if k in _MEMBER_KEYS or k.startswith(_MEMBER_PREFIXES))
    if bad:
        return (
            f"a global pax header sets {', '.join(bad)} for every later member (not "
            "supported: each member must be readable on its own)"
        )
    return None


# --- reading one member's headers ---------------------------------------------------------------


class _HeaderStream:
    """What ``tarfile.TarInfo.fromtarfile`` uses of a TarFile (fileobj, offset, global PAX
    headers, encoding), reading tar-stream bytes from ``start`` but never past ``limit``."""

    encoding = ENCODING
    errors = ERRORS

    def __init__(self, read: Callable[[int, int], bytes], start: int, limit: int) -> None:
        self._read = read
        self.pos = start
        self.offset = start
        self.limit = limit
        self.pax_headers: dict[str, str] = {}
        self.fileobj = self

    def read(self, n: int = -1) -> bytes:
        end = self.limit if n is None or n < 0 else min(self.limit, self.pos + n)
        data = self._read(self.pos, end) if end > self.pos else b""
        self.pos += len(data)
        return data

    def tell(self) -> int:
        return self.pos


def read_member(
    read: Callable[[int, int], bytes], start: int, limit: int
) -> tuple[tarfile.TarInfo, int]:
    """The member whose header chain starts at tar offset ``start`` (reading no byte at or
    past ``limit``) and the offset where the next member's headers start. Raises
    ``tarfile.HeaderError`` (and ValueError) for what does not parse."""
    stream = _HeaderStream(read, start, limit)
    info = tarfile.TarInfo.fromtarfile(stream)  # type: ignore[arg-type]
    problem = global_header_problem(stream.pax_headers)
    if problem is not None:
        raise ValueError(problem)
    return info, stream.offset


# --- the fast path --------------------------------------------------------------------------------

_QUICK_TYPES = {
    b"0": "reg",
    b"\0": "reg",
    b"7": "reg",
    b"1": "hardlink",
    b"2": "symlink",
    b"3": "char",
    b"4": "block",
    b"5": "dir",
    b"6": "fifo",
}
# name mode uid gid size mtime chksum type linkname magic+version uname gname major minor prefix
_USTAR = struct.Struct("100s8s8s8s12s12s8s1s100s8s32s32s8s8s155s")


def _nul(field: bytes) -> bytes:
    p = field.find(b"\0")
    return field if p < 0 else field[:p]


def _octal(field: bytes) -> int:
    """tarfile's ``nti`` for an octal field, or ValueError (base-256 numbers, a NUL inside
    the digits: tarfile decides those). Where this returns a number, nti returns the same."""
    return int(field.rstrip(b"\0 ") or b"0", 8)


def _byte_sum(block: bytes) -> int:
    # adler32's low half is 1 + the byte sum mod 65521; 256 bytes sum to at most 65280, so
    # two halves give the exact sum of 512 bytes at C speed.
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


def _text(value: str) -> bytes:
    return value.encode(ENCODING, ERRORS)


def _quick_match(block: bytes, entry: TocEntry) -> bool:
    """True when ``block`` is a plain one-block header (no extension headers) that tarfile
    and :func:`tar_entry` read as exactly ``entry``; False: let tarfile decide. Fields are
    compared as bytes where the TOC's form is the header's (names are utf-8 with surrogate
    escapes, a bijection), and normalized only when they differ."""
    (
        name,
        mode,
        uid,
        gid,
        size,
        mtime,
        chksum,
        kind_byte,
        link,
        _,
        uname,
        gname,
        major,
        minor,
        prefix,
    ) = _USTAR.unpack_from(block)
    kind = _QUICK_TYPES.get(kind_byte)
    if kind != entry.type or entry.sparse is not None or entry.xattrs:
        return False
    try:
        if _octal(chksum) != _byte_sum(block) - sum(chksum) + 256:
            return False  # a signed checksum, or a bad one: tarfile decides
        if (
            _octal(mode) & 0o7777 != entry.mode
            or _octal(uid) != entry.uid
            or _octal(gid) != entry.gid
            or _octal(mtime) * 1_000_000_000 != entry.mtime_ns
            or _nul(uname) != _text(entry.uname)
            or _nul(gname) != _text(entry.gname)
        ):
            return False
        devices = _octal(major), _octal(minor)  # tarfile reads every number field
        size_value = _octal(size)
        name = _nul(name)
        if kind == "dir":
            name = name.rstrip(b"/")
        elif name.endswith(b"/"):
            return False  # an old-style directory (or an odd name): tarfile decides
        prefix = _nul(prefix)
        if prefix:
            name = prefix + b"/" + name
        expected = _text(entry.name)  # normalized (the TOC check insists), so "./" + it is too
        if (
            name != expected
            and name != b"./" + expected
            and normalize_member_path(name.decode(ENCODING, ERRORS)) != entry.name
        ):
            return False
        if kind == "reg":
            return size_value == entry.size
        if kind == "symlink":
            return _nul(link) == _text(entry.link)
        if kind == "hardlink":
            target, expected = _nul(link), _text(entry.link)
            return (
                target in (expected, b"./" + expected)
                or normalize_hardlink_target(
                    name.decode(ENCODING, ERRORS), target.decode(ENCODING, ERRORS)
                )
                == entry.link
            )
        if kind in ("char", "block"):
            return devices == (entry.devmajor, entry.devminor)
        return True
    except (ValueError, UnsafeMemberError):
        return False


# --- verification ---------------------------------------------------------------------------------

_FIELDS = (
    "name",
    "type",
    "size",
    "link",
    "offset",
    "mode",
    "uid",
    "gid",
    "uname",
    "gname",
    "mtime_ns",
    "devmajor",
    "devminor",
    "xattrs",
    "sparse",
    "header_offset",
)


def _mismatch(index: Any, entry: TocEntry, rule: str, what: str) -> TocMismatchError:
    return TocMismatchError(index.digest, entry.name, rule, what)


def _check_entry(index: Any, entry: TocEntry, tar: Any) -> int:
    """Check one entry against the tar (see the module); returns where its member ends."""
    h = entry.header_offset
    if entry.offset == h + TAR_BLOCK:
        block = tar.block(h)
        if block is not None and _quick_match(block, entry):
            return entry.offset + (
                -(-entry.size // TAR_BLOCK) * TAR_BLOCK if entry.type == "reg" else 0
            )
    limit = min(entry.offset, h + MAX_HEADER_CHAIN, index.tar_size)
    try:
        info, end = read_member(tar.read, h, limit)
        actual = tar_entry(info, h, end)
    except (tarfile.TarError, ValueError, UnsafeMemberError) as exc:
        raise _mismatch(
            index, entry, RULE_MATCH, f"the tar header at byte {h} does not describe it ({exc})"
        ) from None
    if actual != entry:
        diffs = [
            f"{f} is {getattr(entry, f)!r} in the TOC, {getattr(actual, f)!r} in the tar"
            for f in _FIELDS
            if getattr(entry, f) != getattr(actual, f)
        ]
        raise _mismatch(
            index, entry, RULE_MATCH, f"the tar header at byte {h} differs: " + "; ".join(diffs)
        )
    return end


def _check_trailer(index: Any, entry: TocEntry | None, end: int, tar: Any) -> None:
    """After the last member: the end of the stream or an end-of-archive (zero) block."""
    if end == index.tar_size:
        return
    block = tar.read(end, end + TAR_BLOCK)
    if len(block) == TAR_BLOCK and block.count(0) == TAR_BLOCK:
        return
    member = entry or TocEntry(name="(before the first member)", type="dir")
    raise _mismatch(
        index,
        member,
        RULE_COMPLETE,
        f"the tar stream holds more after byte {end} than an end-of-archive block "
        f"(a member the TOC leaves out, or a truncated stream)",
    )


def verify_entries(index: Any, positions: Iterable[int], tar: Any) -> None:
    """Check ``index.entries[k]`` for each ``k`` in ``positions`` against the tar bytes that
    ``tar`` (``block(start)``, ``read(start, end)``) gives; with no entries at all, check that
    the stream is empty (see :meth:`prefetch.toc.LayerIndex.verify_frame`)."""
    entries = index.entries
    if not entries:
        _check_trailer(index, None, 0, tar)
        return
    last = len(entries) - 1
    for k in positions:
        entry = entries[k]
        end = _check_entry(index, entry, tar)
        if k == last:
            _check_trailer(index, entry, end, tar)
        elif end != entries[k + 1].header_offset:
            raise _mismatch(
                index,
                entry,
                RULE_COMPLETE,
                f"its member ends at byte {end}, the next TOC entry "
                f"({entries[k + 1].name!r}) starts at {entries[k + 1].header_offset}"
                " (a member left out, or an entry invented)",
            )
