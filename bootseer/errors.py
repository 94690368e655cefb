"""The root of bootseer's own errors: one a person can act on, printed as one line.

Why here and not in :mod:`bootseer.cli.errors` (which re-exports it): modules below the
command line (:mod:`bootseer.startup`) raise it too, and importing it from ``bootseer.cli``
made them import the command line, which imports them (a cycle). This module imports
nothing, so anything may raise a :class:`CliError`.
"""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """Printed as ``bootseer: error: ...``; exit code 2 (:mod:`bootseer.cli.errors`)."""
