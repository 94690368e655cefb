"""Extract a checked TOC into a staging directory, chunk by chunk, in any order, in parallel.

Everything is created relative to directory file descriptors this module opened itself
(``mkdirat`` then ``openat(O_DIRECTORY | O_NOFOLLOW)``, component by component from the
staging root), files with ``O_CREAT | O_EXCL | O_NOFOLLOW``: nothing can be written through a
symlink, and nothing lands outside the staging root, even if a rule in :mod:`snapshot.safety`
were missed. The directory descriptors are a bounded cache (:class:`DirectoryHandles`): a
container's default limit is 1024 open files, and an environment has thousands of
directories. Python's ``tarfile`` is not used: it extracts one member at a time in stream
order, and restore wants many chunks at once.

Order: directories (``prepare``), file data as chunks arrive (``feed``, thread-safe), then
symlinks, hardlinks, and directory modes and mtimes deepest first (``finish``), so that
``.pyc`` files stay valid (their sources keep their mtimes) and no directory mtime is disturbed
by later creations.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from pathlib import Path

from .errors import UnsafeMemberError
from .manifest import Chunk, Member, iter_chunk_spans
from .safety import Plan

_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def default_handle_limit() -> int:
    """Directory descriptors kept open: a quarter of the soft open-file limit, 16 to 512."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 512
    return max(16, min(512, soft // 4))


class DirectoryHandles:
    """Descriptors of the staging tree's directories, opened from the root one component at a
    time with ``O_NOFOLLOW``, at most ``limit`` kept (least recently used closed first).

    A descriptor in use (``with handles.open(path) as fd``) is never closed under its user,
    whatever other threads open meanwhile; ``known`` are the only paths that may be opened
    (the snapshot's directories), anything else is an :class:`UnsafeMemberError`."""

    def __init__(self, root: Path, known: set[str], limit: int | None = None) -> None:
        self.known = known | {""}
        self.limit = max(2, limit if limit is not None else default_handle_limit())
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._busy: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._fds[""] = os.open(root, _DIR_FLAGS)
        self.opened = 1  # every open(2) made, for tests and the curious

    @contextlib.contextmanager
    def open(self, path: str) -> Iterator[int]:
        fd = self._acquire(path)
        try:
            yield fd
        finally:
            with self._lock:
                self._busy[path] -= 1
                self._evict()

    def _acquire(self, path: str) -> int:
        if path not in self.known:
            raise UnsafeMemberError(path, "not a directory of the snapshot")
        with self._lock:
            fd = self._fds.get(path)
            if fd is not None:
                self._fds.move_to_end(path)
                self._busy[path] += 1
                return fd
        parent, _, name = path.rpartition("/")
        with self.open(parent) as parent_fd:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        with self._lock:
            self.opened += 1
            if path in self._fds:  # another thread opened it meanwhile: use that one
                os.close(fd)
                fd = self._fds[path]
            else:
                self._fds[path] = fd
            self._busy[path] += 1
            self._evict()
            return fd

    def _evict(self) -> None:
        """Close the least recently used idle descriptors beyond the limit (lock held)."""
        if len(self._fds) <= self.limit:
            return
        for path in list(self._fds):
            if len(self._fds) <= self.limit:
                break
            if path and not self._busy[path]:
                os.close(self._fds.pop(path))
                del self._busy[path]

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, OrderedDict()
            self._busy.clear()
        for fd in fds.values():
            os.close(fd)


def _umask() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:  # pragma: no cover - not Linux
        pass
    return 0o022


class Extractor:
    """Writes a :class:`Plan` under ``root`` (an empty directory this process created)."""

    def __init__(self, root: str | os.PathLike, plan: Plan, chunks: list[Chunk]) -> None:
        self.root = Path(root)
        self.plan = plan
        self.chunks = chunks
        self._umask = _umask()
        self._dirs: DirectoryHandles | None = None
        self._pieces: dict[int, list[tuple[Member, int, int, int, bool]]] = defaultdict(list)
        self._spanning: dict[str, Member] = {}
        self._remaining: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_written = 0
        offsets = [c.offset for c in chunks]
        for member in plan.files:
            spans = list(
                iter_chunk_spans(chunks, member.offset, member.offset + member.size, offsets)
            )
            if len(spans) > 1:
                self._spanning[member.path] = member
                self._remaining[member.path] = len(spans)
            file_offset = 0
            for index, start, end in spans:
                self._pieces[index].append((member, start, end, file_offset, len(spans) > 1))
                file_offset += end - start
            if not spans:  # empty file
                self._pieces[-1].append((member, 0, 0, 0, False))

    # -- phases ------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create every directory, the empty files, and the files that span chunks."""
        self._dirs = DirectoryHandles(self.root, set())
        for member in self.plan.dirs:
            with self._parent(member.path) as (parent_fd, name):
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            self._dirs.known.add(member.path)
        for member, *_ in self._pieces.pop(-1, []):
            self._write_whole(member, memoryview(b""))
        for member in self._spanning.values():
            fd = self._create(member)
            try:
                os.ftruncate(fd, member.size)
            finally:
                os.close(fd)

    def feed(self, index: int, raw: bytes | memoryview) -> None:
        """Write every file piece that lives in chunk ``index`` (``raw`` is its plain bytes)."""
        view = memoryview(raw)
        for member, start, end, file_offset, spanning in self._pieces.get(index, ()):
            if spanning:
                self._write_piece(member, view[start:end], file_offset)
            else:
                self._write_whole(member, view[start:end])
            with self._lock:
                self.bytes_written += end - start

    def finish(self) -> None:
        """Links, then directory modes and mtimes, deepest first; closes every descriptor."""
        try:
            for member in self.plan.symlinks:
                with self._parent(member.path) as (parent_fd, name):
                    os.symlink(member.link, name, dir_fd=parent_fd)
                    os.utime(
                        name,
                        ns=(member.mtime_ns, member.mtime_ns),
                        dir_fd=parent_fd,
                        follow_symlinks=False,
                    )
            for member in self.plan.hardlinks:
                with (
                    self._parent(member.link) as (src_fd, src_name),
                    self._parent(member.path) as (dst_fd, dst_name),
                ):
                    os.link(
                        src_name,
                        dst_name,
                        src_dir_fd=src_fd,
                        dst_dir_fd=dst_fd,
                        follow_symlinks=False,
                    )
            assert self._dirs is not None
            for member in sorted(self.plan.dirs, key=lambda m: m.path.count("/"), reverse=True):
                with self._dirs.open(member.path) as fd:
                    os.fchmod(fd, member.mode)
                    os.utime(fd, ns=(member.mtime_ns, member.mtime_ns))
        finally:
            self.close()

    def close(self) -> None:
        dirs, self._dirs = self._dirs, None
        if dirs is not None:
            dirs.close()

    # -- helpers ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _parent(self, path: str) -> Iterator[tuple[int, str]]:
        """The descriptor of ``path``'s parent directory (held while in the block), and the
        last component of ``path``."""
        parent, _, name = path.rpartition("/")
        if self._dirs is None or parent not in self._dirs.known:
            raise UnsafeMemberError(path, f"parent {parent!r} is not a directory of the snapshot")
        with self._dirs.open(parent) as fd:
            yield fd, name

    def _create(self, member: Member) -> int:
        with self._parent(member.path) as (parent_fd, name):
            fd = os.open(name, _FILE_FLAGS, member.mode, dir_fd=parent_fd)
        if member.mode & self._umask:
            os.fchmod(fd, member.mode)
        return fd

    def _write_whole(self, member: Member, data: memoryview) -> None:
        fd = self._create(member)
        try:
            _write_all(fd, data, member.path)
            os.utime(fd, ns=(member.mtime_ns, member.mtime_ns))
        finally:
            os.close(fd)

    def _write_piece(self, member: Member, data: memoryview, file_offset: int) -> None:
        with self._parent(member.path) as (parent_fd, name):
            fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], file_offset + done)
            with self._lock:
                self._remaining[member.path] -= 1
                last = self._remaining[member.path] == 0
            if last:
                os.utime(fd, ns=(member.mtime_ns, member.mtime_ns))
        finally:
            os.close(fd)


def _write_all(fd: int, data: memoryview, path: str) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
