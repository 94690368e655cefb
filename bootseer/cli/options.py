"""What several commands share: the command after ``--``, refused old flags, the trace."""

from __future__ import annotations

import argparse
from typing import Any

from .errors import CliError


def trailing_command(args: argparse.Namespace) -> list[str] | None:
    """The command given after ``--``, or None."""
    command = list(getattr(args, "command", None) or [])
    if command and command[0] == "--":
        command = command[1:]
    return command or None


class _Renamed(argparse.Action):
    """A flag of an earlier version: refused, naming the one that replaced it."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"{option_string} is now {self.new}: every setting has one flag, the same "
            "in every command (`bootseer config show` lists them)"
        )


def refuse_renamed_flags(parser: argparse.ArgumentParser, renamed: dict[str, str]) -> None:
    """Old flag -> new flag: the old one stays an error that names the new one (argparse would
    otherwise take it as an ambiguous abbreviation, or silently as a prefix of another)."""
    for old, new in renamed.items():
        parser.add_argument(old, action=_Renamed, new=new, dest=f"renamed_{old.lstrip('-')}")


def open_trace(cfg: Any) -> Any:
    """The trace writer of ``run.trace_dir`` (``run.node`` naming the file), or a clear error."""
    from ..trace import TraceWriter

    try:
        return TraceWriter(cfg.run.trace_dir, cfg.run.node or None)
    except OSError as exc:
        raise CliError(
            f"cannot write the trace to {cfg.run.trace_dir} (run.trace_dir, "
            f"--trace-dir): {exc.strerror or exc}"
        ) from None
