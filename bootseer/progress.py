"""Progress for long operations: a rich bar on a terminal, periodic log lines otherwise.

It is an fsspec ``Callback``, so any fsspec call that takes ``callback=`` reports through it.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

from fsspec.callbacks import Callback

log = logging.getLogger("bootseer")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class ByteProgress(Callback):
    """Bytes moved for one labelled task; ``with ByteProgress("cp x"): ...``."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        interval_s: float = 5.0,
        force_terminal: bool | None = None,
    ) -> None:
        super().__init__(size=total)
        self.label = label
        self.interval_s = interval_s
        self._tty = sys.stderr.isatty() if force_terminal is None else force_terminal
        self._started = time.monotonic()
        self._last_log = self._started
        self._bar = None
        self._task = None

    def __enter__(self) -> ByteProgress:
        if self._tty:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.size)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif exc_type is None:
            self._log_line(final=True)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def set_size(self, size: int) -> None:
        self.size = size
        if self._bar is not None:
            self._bar.update(self._task, total=size)

    def call(self, *args, **kwargs) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.value)
        elif time.monotonic() - self._last_log >= self.interval_s:
            self._log_line()

    def _log_line(self, final: bool = False) -> None:
        self._last_log = time.monotonic()
        rate = self.value / max(self.elapsed_s, 1e-9)
        of = f" of {human_bytes(self.size)}" if self.size else ""
        pct = f" ({100 * self.value / self.size:.0f}%)" if self.size else ""
        state = "done" if final else "progress"
        log.info(
            "%s: %s %s%s%s, %s/s, %.1f s",
            self.label,
            state,
            human_bytes(self.value),
            of,
            pct,
            human_bytes(rate),
            self.elapsed_s,
        )
