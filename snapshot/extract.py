"""Extract a checked TOC into a staging directory, chunk by chunk, in any order, in parallel.

Everything is created relative to directory file descriptors this module opened itself
(``mkdirat`` then ``openat(O_DIRECTORY | O_NOFOLLOW)``), files with ``O_CREAT | O_EXCL |
O_NOFOLLOW``: nothing can be written through a symlink, and nothing lands outside the staging
root, even if a rule in :mod:`snapshot.safety` were missed. Python's ``tarfile`` is not used:
it extracts one member at a time in stream order, and restore wants many chunks at once.

Order: directories (``prepare``), file data as chunks arrive (``feed``, thread-safe), then
symlinks, hardlinks, and directory modes and mtimes deepest first (``finish``), so that
``.pyc`` files stay valid (their sources keep their mtimes) and no directory mtime is disturbed
by later creations.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

from .errors import UnsafeMemberError
from .manifest import Chunk, Member, iter_chunk_spans
from .safety import Plan

_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
        self._dir_fds: dict[str, int] = {}
        self._pieces: dict[int, list[tuple[Member, int, int, int, bool]]] = defaultdict(list)
        self._spanning: dict[str, Member] = {}
        self._remaining: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_written = 0
        offsets = [c.offset for c in chunks]
        for member in plan.files:
            spans = list(iter_chunk_spans(chunks, member.offset, member.offset + member.size,
                                          offsets))
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
        self._dir_fds[""] = os.open(self.root, _DIR_FLAGS)
        for member in self.plan.dirs:
            parent_fd, name = self._parent(member.path)
            os.mkdir(name, 0o700, dir_fd=parent_fd)
            self._dir_fds[member.path] = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
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
                parent_fd, name = self._parent(member.path)
                os.symlink(member.link, name, dir_fd=parent_fd)
                os.utime(name, ns=(member.mtime_ns, member.mtime_ns), dir_fd=parent_fd,
                         follow_symlinks=False)
            for member in self.plan.hardlinks:
                src_fd, src_name = self._parent(member.link)
                dst_fd, dst_name = self._parent(member.path)
                os.link(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd,
                        follow_symlinks=False)
            for member in sorted(self.plan.dirs, key=lambda m: m.path.count("/"), reverse=True):
                fd = self._dir_fds[member.path]
                os.fchmod(fd, member.mode)
                os.utime(fd, ns=(member.mtime_ns, member.mtime_ns))
        finally:
            self.close()

    def close(self) -> None:
        fds, self._dir_fds = self._dir_fds, {}
        for fd in fds.values():
            os.close(fd)

    # -- helpers ---------------------------------------------------------------------
    def _parent(self, path: str) -> tuple[int, str]:
        parent, _, name = path.rpartition("/")
        try:
            return self._dir_fds[parent], name
        except KeyError:
            raise UnsafeMemberError(path, f"parent {parent!r} is not a directory of the "
                                          f"snapshot") from None

    def _create(self, member: Member) -> int:
        parent_fd, name = self._parent(member.path)
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
        parent_fd, name = self._parent(member.path)
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
