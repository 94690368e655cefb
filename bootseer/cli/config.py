"""``bootseer config show``: the effective configuration and where each value came from.

The question it answers is "which value will a bootseer command use, and why": it takes the
same ``--config FILE``, environment and flags as every command and prints every key with its
variable, its flag, its value and its source (default, file, env variable or flag), then the
variables bootseer knows that are not settings (hand-offs to the programs it starts,
credentials, fsspec's defaults for ``striped://``) with their values in this environment::

    bootseer config show --config /etc/bootseer.toml --max-restarts 5
    bootseer config show --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from striped_fs import redact, redact_options

from ..config import SCHEMA, Config, add_config_arguments
from ..variables import VARIABLES


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``config`` and its ``show`` subcommand."""
    config = sub.add_parser("config", help="the effective configuration: show")
    config_sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    show = config_sub.add_parser(
        "show",
        help="print every key with its variable, flag, value and source, and the "
        "variables that are not settings",
        description="Prints the configuration every bootseer command would use with the same "
        "file, environment and flags: defaults < TOML file (--config, else "
        "$BOOTSEER_CONFIG) < BOOTSEER_<SECTION>_<KEY> variables < flags.",
    )
    add_config_arguments(show)
    show.add_argument(
        "--json",
        action="store_true",
        help='machine-readable: {"config_file", "settings": {section: {key: '
        '{"value", "source", "variable", "flag"}}}, "variables": [...]}',
    )
    show.set_defaults(func=cmd_show)


def _shown(key: str, value: Any) -> Any:
    """A value as it may be printed: credentials hidden (``s3://***@bucket``, storage
    options' ``secret``...)."""
    return redact_options(value) if key == "storage.options" else redact(value)


def _literal(key: str, value: Any) -> str:
    """A value as it would be written in the TOML file (strings quoted, lists bracketed)."""
    return json.dumps(_shown(key, value))


def _variables(env: dict[str, str] | os._Environ) -> list[dict[str, str | None]]:
    """The known non-key variables (and any other FSSPEC_STRIPED* set here), with their value
    in this environment (None: unset; secrets hidden)."""
    rows = []
    names = {v.name for v in VARIABLES}
    extra = sorted(n for n in env if n.startswith("FSSPEC_STRIPED") and n not in names)
    for v in VARIABLES:
        value = env.get(v.name)
        rows.append(
            {
                "name": v.name,
                "role": v.role,
                "meaning": v.meaning,
                "value": None if value is None else "***" if v.secret else redact(value),
            }
        )
    for name in extra:
        rows.append(
            {
                "name": name,
                "role": "fsspec",
                "meaning": "fsspec's default for striped:// (an option of striped_fs)",
                "value": redact(env[name]),
            }
        )
    return rows


def cmd_show(args: argparse.Namespace) -> int:
    cfg: Config = args.cfg  # a ConfigError is a ValueError: main prints it, exit 2
    if args.json:
        settings: dict[str, dict[str, dict[str, object]]] = {}
        for s in cfg.settings():
            section, name = s.key.split(".", 1)
            spec = SCHEMA[section][name]
            settings.setdefault(section, {})[name] = {
                "value": _shown(s.key, s.value),
                "source": s.source,
                "variable": spec.env,
                "flag": spec.flag_form,
            }
        print(
            json.dumps(
                {
                    "config_file": cfg.path,
                    "settings": settings,
                    "variables": _variables(os.environ),
                },
                indent=1,
            )
        )
        return 0
    if sys.stdout.isatty():
        _print_rich(cfg)
    else:
        _print_plain(cfg)
    return 0


def _rows(cfg: Config) -> list[tuple[str, ...]]:
    rows = []
    for s in cfg.settings():
        section, name = s.key.split(".", 1)
        spec = SCHEMA[section][name]
        rows.append((s.key, spec.env, spec.flag_form, _literal(s.key, s.value), s.source))
    return rows


def _variable_rows() -> list[tuple[str, ...]]:
    return [
        (
            str(v["name"]),
            str(v["role"]),
            "unset" if v["value"] is None else str(v["value"]),
            str(v["meaning"]),
        )
        for v in _variables(os.environ)
    ]


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print(
            "  ".join(f"{cell:{w}}" for cell, w in zip(row[:-1], widths, strict=True))
            + f"  {row[-1]}"
        )


def _print_plain(cfg: Config) -> None:
    print(f"config file: {cfg.path or 'none'}")
    _table([("KEY", "VARIABLE", "FLAG", "VALUE", "SOURCE"), *_rows(cfg)])
    print()
    print("variables that are not settings (their value in this environment):")
    _table([("NAME", "ROLE", "VALUE", "MEANING"), *_variable_rows()])


def _print_rich(cfg: Config) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    table = Table(title=f"config file: {cfg.path or 'none'}", title_justify="left")
    for column in ("key", "variable", "flag", "value", "source"):
        table.add_column(column)
    for key, var, flag, value, source in _rows(cfg):
        style = "dim" if source == "default" else ""
        # Text, not str: values such as ["a"] must not be read as rich markup.
        table.add_row(Text(key), Text(var), Text(flag), Text(value), Text(source, style=style))
    console.print(table)
    other = Table(title="variables that are not settings", title_justify="left")
    for column in ("name", "role", "value", "meaning"):
        other.add_column(column)
    for row in _variable_rows():
        other.add_row(*(Text(cell) for cell in row))
    console.print(other)
