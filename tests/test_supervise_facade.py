"""``bootseer.supervise`` after its cut (docs/decisions.md, "supervise: cut at its seams"):
every name imported from it before still is, and the pieces in ``bootseer/robust/`` reach
the supervisor's objects only through ``robust/seams.py``, never by importing them."""

from __future__ import annotations

import ast
from pathlib import Path

import bootseer.supervise as supervise
from bootseer import command
from bootseer.robust import dumps, seams

ROOT = Path(__file__).resolve().parents[1]
PIECES = ("seams", "progress", "dumps", "incident", "hangs", "dialogue")


def test_every_name_imported_from_supervise_before_still_is() -> None:
    for name in supervise.__all__:
        assert hasattr(supervise, name), name
    assert supervise.AttemptEnd is seams.AttemptEnd
    assert supervise._Signals is command.Signals  # tests open the signals by this name
    assert supervise.NATIVE_GRACE_S == dumps.NATIVE_GRACE_S == 1.0
    assert supervise.STOP_SIGNALS == command.STOP_SIGNALS
    for name in (
        "FORWARD_SIGNALS",
        "HANDLED",
        "SPARE_REJOIN_WAIT_S",
        "EXIT_NOT_FOUND",
        "EXIT_NOT_EXECUTABLE",
        "EXIT_CHECK_FAILED",
        "group_pids",
    ):
        assert hasattr(supervise, name), name


def test_the_pieces_import_neither_the_supervisor_nor_its_processes() -> None:
    for piece in PIECES:
        path = ROOT / "bootseer" / "robust" / f"{piece}.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                target = "." * node.level + (node.module or "")
                assert target not in ("..supervise", "..command"), (piece, target)
                assert node.module not in ("bootseer.supervise", "bootseer.command"), piece
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name not in ("bootseer.supervise", "bootseer.command"), piece
