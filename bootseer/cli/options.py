"""Arguments several commands share: fsspec storage options as JSON, and the command after
``--`` (one parser each, so every command reports a bad value the same way)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .errors import CliError


def parse_storage_options(text: str | None, what: str = "--storage-options") -> dict[str, Any]:
    """``{"s3": {...}}`` from JSON text (empty or None: no options)."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise CliError(f'{what} must be a JSON object keyed by protocol, e.g. {{"s3": {{...}}}}')
    return options


def trailing_command(args: argparse.Namespace) -> list[str] | None:
    """The command given after ``--``, or None."""
    command = list(getattr(args, "command", None) or [])
    if command and command[0] == "--":
        command = command[1:]
    return command or None
