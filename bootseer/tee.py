"""The command's output, passed through unchanged and its last lines kept for the crash
classifier (:mod:`bootseer.robust.classify`).

Why a tee and not a log file read afterwards: the command's output is the container's log
(the terminal, ``kubectl logs``), so it must reach the wrapper's own stdout/stderr at once
and byte for byte; the classifier only needs the last lines, so memory stays bounded: at most
``lines`` lines of at most ``line_bytes`` bytes per stream, whatever the command prints. The
streams are kept apart and given back stdout's first, stderr's last: two pipes read by two
threads have no common order, and a traceback (stderr) must stay at the end, where the
classifier looks, even when stdout's last chunk is read after it.

Usage::

    tail = OutputTail(lines=200)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tail.attach(proc.stdout.fileno(), 1)     # copied to fd 1 as it comes
    tail.attach(proc.stderr.fileno(), 2)
    proc.wait(); tail.drain(timeout=2.0)
    tail.lines()                              # ["Traceback ...", "SyntaxError: ..."]
"""

from __future__ import annotations

import os
import threading
from collections import deque

__all__ = ["OutputTail"]


class OutputTail:
    """Copies pipes to file descriptors unbuffered and keeps each one's last lines."""

    def __init__(self, lines: int = 200, line_bytes: int = 4096) -> None:
        if lines < 1:
            raise ValueError(f"the tail must keep at least one line (got {lines})")
        self.line_bytes = line_bytes
        self.max_lines = lines
        self._streams: list[deque[str]] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def attach(self, source_fd: int, target_fd: int) -> None:
        """Copy ``source_fd`` (a pipe's read end, closed at EOF) to ``target_fd``."""
        with self._lock:
            kept: deque[str] = deque(maxlen=self.max_lines)
            self._streams.append(kept)
        thread = threading.Thread(
            target=self._copy,
            args=(source_fd, target_fd, kept),
            name=f"bootseer-tee-{target_fd}",
            daemon=True,
        )
        thread.start()
        self._threads.append(thread)

    def drain(self, timeout: float = 2.0) -> bool:
        """Wait until every pipe reached EOF (a process that inherited it may keep it open:
        then give up after ``timeout``); True when all are done."""
        for thread in self._threads:
            thread.join(timeout)
        alive = [t for t in self._threads if t.is_alive()]
        self._threads = alive
        return not alive

    def lines(self) -> list[str]:
        """The last lines of each stream, oldest first, the streams in the order they were
        attached (a last line without its newline included)."""
        with self._lock:
            return [line for kept in self._streams for line in kept]

    def clear(self) -> None:
        """Forget the streams and their lines (a new attempt attaches its own)."""
        with self._lock:
            self._streams = []

    def _keep(self, kept: deque[str], raw: bytes) -> None:
        text = raw[: self.line_bytes].decode("utf-8", errors="replace").rstrip("\r")
        with self._lock:
            kept.append(text)

    def _copy(self, source_fd: int, target_fd: int, kept: deque[str]) -> None:
        partial = b""
        writable = True
        try:
            while chunk := _read(source_fd):
                if writable:
                    writable = _write_all(target_fd, chunk)
                *whole, partial = (partial + chunk).split(b"\n")
                for line in whole:
                    self._keep(kept, line)
                partial = partial[: self.line_bytes]  # a line without end stays bounded
            if partial:
                self._keep(kept, partial)
        finally:
            os.close(source_fd)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def _write_all(fd: int, data: bytes) -> bool:
    """False once the target is gone (a closed terminal): the command must not block on a
    full pipe because nobody reads the wrapper's output, so reading goes on."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        except OSError:
            return False
    return True
