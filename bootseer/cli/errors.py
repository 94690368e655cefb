"""Errors meant for a person: printed without a traceback."""


class CliError(Exception):
    """Printed as ``bootseer: error: ...``; exit code 2."""
