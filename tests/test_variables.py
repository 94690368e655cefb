"""Every ``BOOTSEER_*`` name the code uses is a configuration key's variable or a registered
variable (bootseer/variables.py), so that no bootseer command refuses a variable another
bootseer command set: ``bootseer run`` hands its job ``BOOTSEER_INCIDENT``,
``BOOTSEER_CKPT_SKIP`` and ``BOOTSEER_VERSION``, and until 2026-12 every bootseer command run
inside such a job exited 2 on them ("unknown environment variable")."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bootseer.config import _KEYS, ENV_PREFIX
from bootseer.variables import RESERVED_PREFIXES, RETIRED, VARIABLES, known_variable

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bootseer", "ckpt", "snapshot", "prefetch", "striped_fs")


def _literals() -> dict[str, list[str]]:
    """Every string constant in the packages that is a whole ``BOOTSEER_*`` name (not a
    prefix ending in ``_``, not inside a longer text), with where it is."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and node.value.startswith(ENV_PREFIX)
                    and not node.value.endswith("_")
                    and node.value.replace("_", "").isalnum()
                    and node.value.isupper()
                ):
                    found.setdefault(node.value, []).append(
                        f"{path.relative_to(ROOT)}:{node.lineno}"
                    )
    return found


def test_every_bootseer_name_in_the_code_is_a_key_or_a_registered_variable() -> None:
    keys = {s.env for s in _KEYS} | {a for s in _KEYS for a in s.aliases}
    unknown = {
        name: where
        for name, where in _literals().items()
        if name not in keys
        and not known_variable(name)
        and name not in RETIRED
        and not name.startswith(RESERVED_PREFIXES)
    }
    assert not unknown, f"register these in bootseer/variables.py (or make them keys): {unknown}"


def test_the_literal_scan_finds_the_hand_offs() -> None:
    """The scan itself works: it finds names set by bootseer run and by the libraries."""
    names = set(_literals())
    assert {"BOOTSEER_CONTROL_DIR", "BOOTSEER_CKPT_SKIP", "BOOTSEER_MEMCKPT_DIR"} <= names


def test_bootseer_commands_run_inside_a_job_that_bootseer_run_started(tmp_path: Path) -> None:
    """Every variable a job gets from bootseer run (after a NaN, a hot update, under a
    controller) is accepted by ``bootseer config show`` and listed with its role."""
    handed = {v.name: "x" for v in VARIABLES if v.role == "hand-off"}
    handed.update({"BOOTSEER_INCIDENT": "3", "BOOTSEER_VERSION": "v2", "BOOTSEER_CKPT_SKIP": "[]"})
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(handed)
    env["BOOTSEER_CKPT_CACHE"] = str(tmp_path / "cache")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "config",
            "show",
            "--state-dir",
            str(tmp_path / "state"),
            "--ckpt-cache-dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    for name in ("BOOTSEER_INCIDENT", "BOOTSEER_VERSION", "BOOTSEER_CKPT_SKIP"):
        assert name in run.stdout, run.stdout


@pytest.mark.parametrize("name", ["BOOTSEER_INCIDENT", "BOOTSEER_VERSION", "BOOTSEER_CKPT_SKIP"])
def test_each_hand_off_of_bootseer_run_is_registered(name: str) -> None:
    variable = known_variable(name)
    assert variable is not None and variable.role == "hand-off"
