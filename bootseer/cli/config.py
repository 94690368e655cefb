"""``bootseer config show``: the effective configuration and where each value came from.

The question it answers is "which value will ``bootseer run`` use, and why": it takes the same
``--config FILE``, environment and flags as ``bootseer run`` and prints every key with its value
and its source (default, file, env variable or flag)::

    bootseer config show --config /etc/bootseer.toml --max-restarts 5
    bootseer config show --json
"""

from __future__ import annotations

import argparse
import json
import sys

from striped_fs.redact import redact

from ..config import Config, add_config_arguments, config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``config`` and its ``show`` subcommand."""
    config = sub.add_parser("config", help="the effective configuration: show")
    config_sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    show = config_sub.add_parser(
        "show", help="print every key with its value and where it came from",
        description="Prints the configuration bootseer run would use with the same file, "
                    "environment and flags: defaults < TOML file (--config, else "
                    "$BOOTSEER_CONFIG) < BOOTSEER_<SECTION>_<KEY> variables < flags.")
    add_config_arguments(show)
    show.add_argument("--json", action="store_true",
                      help='machine-readable: {section: {key: {"value", "source"}}}')
    show.set_defaults(func=cmd_show)


def _literal(value: object) -> str:
    """A value as it would be written in the TOML file (strings quoted, lists bracketed),
    credentials hidden (``s3://KEY:SECRET@bucket`` shows as ``s3://***@bucket``)."""
    return json.dumps(redact(value))


def cmd_show(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # a ConfigError is a ValueError: main prints it, exit 2
    if args.json:
        doc: dict[str, dict[str, dict[str, object]]] = {}
        for s in cfg.settings():
            section, name = s.key.split(".", 1)
            doc.setdefault(section, {})[name] = {"value": redact(s.value), "source": s.source}
        print(json.dumps(doc, indent=1))
        return 0
    if sys.stdout.isatty():
        _print_rich(cfg)
    else:
        _print_plain(cfg)
    return 0


def _print_plain(cfg: Config) -> None:
    print(f"config file: {cfg.path or 'none'}")
    rows = [("KEY", "VALUE", "SOURCE")]
    rows += [(s.key, _literal(s.value), s.source) for s in cfg.settings()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for key, value, source in rows:
        print(f"{key:{widths[0]}}  {value:{widths[1]}}  {source}")


def _print_rich(cfg: Config) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"config file: {cfg.path or 'none'}", title_justify="left")
    for column in ("key", "value", "source"):
        table.add_column(column)
    for s in cfg.settings():
        style = "dim" if s.source == "default" else ""
        # Text, not str: values such as ["a"] must not be read as rich markup.
        table.add_row(Text(s.key), Text(_literal(s.value)), Text(s.source, style=style))
    Console().print(table)
