"""The ``bootseer`` command: one entry point whose subcommands reach every part."""

from __future__ import annotations

import argparse
import logging
import sys

from striped_fs import install_log_redaction, protect_process, register_options

from .. import __version__
from . import check as check_cmd
from . import ckpt as ckpt_cmd
from . import config as config_cmd
from . import controller as controller_cmd
from . import env as env_cmd
from . import fs as fs_cmd
from . import image as image_cmd
from . import report as report_cmd
from . import run as run_cmd
from . import snapshotter as snapshotter_cmd
from . import warmup as warmup_cmd
from .errors import translate_errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bootseer", description="Fast, safe restarts for large PyTorch training jobs."
    )
    parser.add_argument("--version", action="version", version=f"bootseer {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    fs_cmd.register(sub)
    ckpt_cmd.register(sub)
    env_cmd.register(sub)
    image_cmd.register(sub)
    snapshotter_cmd.register(sub)
    run_cmd.register(sub)
    warmup_cmd.register(sub)
    config_cmd.register(sub)
    report_cmd.register(sub)
    check_cmd.register(sub)
    controller_cmd.register(sub)
    from . import bench, demo

    demo.register(sub)
    bench.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before anything can print: credentials given in arguments or the environment are
    # registered, and stdout/stderr (errors, tracebacks, every log line at any -v) redacted.
    protect_process(argv)
    parser = build_parser()
    # Everything after the first "--" is a command to run (env ensure -- CMD, image record --
    # CMD): split it off here, since argparse cannot mix options after a positional with a
    # trailing command.
    tail = None
    if "--" in argv:
        at = argv.index("--")
        argv, tail = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    if tail is not None:
        if not getattr(args, "takes_command", False):
            parser.error(f"unexpected arguments after --: {' '.join(tail)}")
        args.command = tail
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # -vv shows botocore's debug output (requests with their Authorization headers): every
    # record is redacted before it is formatted, so the debug output stays useful.
    install_log_redaction()
    if not getattr(args, "func", None):
        parser.print_help()
        raise SystemExit(2)
    # The one place a failure becomes a message (bootseer/cli/errors.py): a known error is one
    # line and exit code 2, anything else its traceback and 1; -vv shows every traceback.
    with translate_errors(args):
        from ..config import config_from_args

        # Every command checks the configuration file and the BOOTSEER_* variables, and reads
        # its settings from the result: one resolution for all of them.
        args.cfg = config_from_args(args)
        register_options(args.cfg.storage.options)  # a config file's secrets: never printed
        code = args.func(args)
    raise SystemExit(code or 0)
