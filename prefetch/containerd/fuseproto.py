"""The Linux FUSE wire protocol, as much of it as a read-only tree needs (include/uapi/linux/
fuse.h): request and reply layouts, opcodes, INIT flags and the resend notification.

The snapshotter speaks it on ``/dev/fuse`` itself (fuseserver.py) because a connection must
outlive the process serving it: libfuse keeps node ids in process memory (libfuse 2's
high-level API aborts on a node id it did not hand out) and waits for an INIT the kernel sends
once per connection, so no libfuse on a node (2.9, 3.14) can resume a live connection. Layouts
are those of protocol 7.31 (Linux 5.4), which every kernel since speaks; the kernel adapts to a
server declaring a lower minor than its own.
"""

from __future__ import annotations

import stat
import struct
from typing import Any

MAJOR = 7
MINOR = 31  # what this server declares; the kernel's own may be higher
MIN_KERNEL_MINOR = 28  # FUSE_MAX_PAGES (Linux 4.20)
ROOT_ID = 1

# opcodes
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE = 8, 9, 10, 11, 12, 13, 14, 15, 16
STATFS, RELEASE, FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH = (
    17,
    18,
    20,
    21,
    22,
    23,
    24,
    25,
)
INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, ACCESS, CREATE, INTERRUPT = (
    26,
    27,
    28,
    29,
    30,
    34,
    35,
    36,
)
DESTROY, BATCH_FORGET, FALLOCATE, RENAME2, TMPFILE = 38, 42, 43, 45, 51
WRITES = frozenset(
    {
        SETATTR,
        SYMLINK,
        MKNOD,
        MKDIR,
        UNLINK,
        RMDIR,
        RENAME,
        LINK,
        WRITE,
        SETXATTR,
        REMOVEXATTR,
        CREATE,
        FALLOCATE,
        RENAME2,
        TMPFILE,
    }
)
NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

# INIT flags
ASYNC_READ = 1 << 0
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
INIT_EXT = 1 << 30
HAS_RESEND = 1 << 39  # kernel: a server may ask it to resend what a dead server had read
WANTED = ASYNC_READ | PARALLEL_DIROPS | MAX_PAGES | CACHE_SYMLINKS

FOPEN_KEEP_CACHE = 1 << 1
NOTIFY_RESEND = 7  # Linux 6.9
UNIQUE_RESEND = 1 << 63  # set in the unique of a request queued again

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags (flags2 follows at 16)
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # 64 bytes
# fuse_attr, 88 bytes: ino size blocks atime mtime ctime (seconds: u64 in fuse.h, read by the
# kernel as a signed time64_t, so packed signed: a time before 1970 is negative) their ns...
ATTR = struct.Struct("<QQQqqqIIIIIIIIII")
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsec nsec
ATTR_OUT = struct.Struct("<QI4x")  # attr_valid attr_valid_nsec
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
READ_IN = struct.Struct("<QQI")  # fh offset size (read_flags lock_owner flags follow)
GETXATTR_IN = struct.Struct("<I4x")  # size
GETXATTR_OUT = struct.Struct("<I4x")
DIRENT = struct.Struct("<QQII")  # ino off namelen type
KSTATFS = struct.Struct("<QQQQQIII28x")  # 80 bytes
UNKNOWN_INO = 0xFFFFFFFF


def encode_name(name: str) -> bytes:
    """A name or link target as the kernel gets it: the tree's names are UTF-8 with surrogate
    escapes for the bytes that are not (prefetch.lazyfs.FS_ENCODING), whatever the locale."""
    return name.encode("utf-8", "surrogateescape")


def decode_name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


class Request:
    """One request read from the device: its header fields and its argument bytes."""

    __slots__ = ("opcode", "unique", "nodeid", "uid", "gid", "pid", "body")

    def __init__(self, buf: memoryview) -> None:
        length, self.opcode, self.unique, self.nodeid, self.uid, self.gid, self.pid, _, _ = (
            IN_HEADER.unpack_from(buf)
        )
        self.body = bytes(buf[IN_HEADER.size : length])

    def name(self, offset: int = 0) -> str:
        """The NUL-terminated name at ``offset`` of the arguments."""
        end = self.body.index(b"\0", offset)
        return decode_name(self.body[offset:end])


def reply(unique: int, payload: bytes = b"", error: int = 0) -> list[bytes]:
    """The buffers of one reply (``error`` is a positive errno or 0)."""
    size = OUT_HEADER.size + (0 if error else len(payload))
    head = OUT_HEADER.pack(size, -error, unique)
    return [head] if error or not payload else [head, payload]


def notify_resend() -> bytes:
    """Ask the kernel to queue again every request a server read and did not answer."""
    return OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0)


def _split_ns(t: Any) -> tuple[int, int]:
    """ns as a timespec: seconds (negative before 1970) and 0 <= ns < 10**9."""
    return divmod(int(t), 1_000_000_000)


def attr(st: dict[str, Any], nodeid: int) -> bytes:
    """A fusepy-style stat dict (times in ns) as ``struct fuse_attr``."""
    a, an = _split_ns(st.get("st_atime", 0))
    m, mn = _split_ns(st.get("st_mtime", 0))
    c, cn = _split_ns(st.get("st_ctime", 0))
    mode = int(st.get("st_mode", 0))
    size = int(st.get("st_size", 0))
    blocks = int(st.get("st_blocks", (size + 511) // 512))
    return ATTR.pack(
        int(st.get("st_ino", nodeid)),
        size,
        blocks,
        a,
        m,
        c,
        an,
        mn,
        cn,
        mode,
        int(st.get("st_nlink", 1)),
        int(st.get("st_uid", 0)),
        int(st.get("st_gid", 0)),
        int(st.get("st_rdev", 0)) & 0xFFFFFFFF,
        0,
        0,
    )


def _valid(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def entry_out(
    nodeid: int, st: dict[str, Any] | None, entry_valid: float, attr_valid: float
) -> bytes:
    """A LOOKUP reply; ``st`` None (and nodeid 0) is a cached negative entry."""
    e, en = _valid(entry_valid)
    v, vn = _valid(attr_valid)
    body = attr(st, nodeid) if st is not None else bytes(ATTR.size)
    return ENTRY_OUT.pack(nodeid, 0, e, v, en, vn) + body


def attr_out(st: dict[str, Any], nodeid: int, attr_valid: float) -> bytes:
    v, vn = _valid(attr_valid)
    return ATTR_OUT.pack(v, vn) + attr(st, nodeid)


def open_out(fh: int, flags: int) -> bytes:
    return OPEN_OUT.pack(fh, flags, 0)


def statfs_out(st: dict[str, Any]) -> bytes:
    return KSTATFS.pack(
        *(
            int(st.get(k, 0))
            for k in (
                "f_blocks",
                "f_bfree",
                "f_bavail",
                "f_files",
                "f_ffree",
                "f_bsize",
                "f_namemax",
                "f_frsize",
            )
        )
    )


def dirents(entries: list[Any], offset: int, size: int) -> bytes:
    """READDIR's reply: ``entries[offset:]`` as ``struct fuse_dirent`` records, as many as fit
    in ``size`` bytes; each record's ``off`` is the index of the next entry. An entry is a
    name, or fusepy's ``(name, attrs or None, 0)``: its ``st_mode`` gives the record's type,
    by which overlayfs recognizes a whiteout in a lower layer, and its ``st_ino`` the inode."""
    out = bytearray()
    for i in range(offset, len(entries)):
        entry = entries[i]
        name, st = (entry, None) if isinstance(entry, str) else (entry[0], entry[1])
        raw = encode_name(name)
        record = DIRENT.size + len(raw)
        padded = (record + 7) & ~7
        if len(out) + padded > size:
            break
        ino = int(st.get("st_ino", UNKNOWN_INO)) if st else UNKNOWN_INO
        kind = stat.S_IFMT(int(st.get("st_mode", 0))) >> 12 if st else 0  # DT_* = S_IF* >> 12
        out += DIRENT.pack(ino, i + 1, len(raw), kind) + raw + bytes(padded - record)
    return bytes(out)


def init_reply(request: Request, *, max_write: int, max_pages: int) -> tuple[bytes, dict[str, Any]]:
    """The reply to the kernel's INIT, and what was agreed (kept with the connection so a
    successor knows it without an INIT of its own). Refuses a kernel older than 7.28."""
    major, minor, max_readahead, flags = INIT_IN.unpack_from(request.body)
    if flags & INIT_EXT and len(request.body) >= INIT_IN.size + 4:
        flags |= struct.unpack_from("<I", request.body, INIT_IN.size)[0] << 32
    if major != MAJOR or minor < MIN_KERNEL_MINOR:
        raise OSError(
            f"the kernel speaks FUSE {major}.{minor}; bootseer needs 7."
            f"{MIN_KERNEL_MINOR} or later (Linux 4.20)"
        )
    agreed = flags & WANTED
    payload = INIT_OUT.pack(
        MAJOR,
        min(minor, MINOR),
        max_readahead,
        agreed & 0xFFFFFFFF,
        0,
        0,
        max_write,
        1,
        max_pages,
        0,
        0,
        0,
    )
    return payload, {
        "minor": min(minor, MINOR),
        "kernel_minor": minor,
        "flags": agreed,
        "resend": bool(flags & HAS_RESEND),
    }
