"""docs/robust.md shows the rule table and the action table as the code has them."""

from __future__ import annotations

from pathlib import Path

from bootseer.robust.classify import RULES
from bootseer.robust.policy import TABLE

DOC = Path(__file__).resolve().parent.parent / "docs" / "robust.md"


def table_rows(header: str) -> list[list[str]]:
    lines = DOC.read_text().splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.replace("\\|", "\0").strip("|").split("|")]
        rows.append([c.replace("\0", "|").replace("`", "") for c in cells])
    return rows


def test_the_rule_table_in_the_docs_is_the_codes():
    rows = table_rows("| # | rule | class | exit | needs cgroup OOM kill | pattern (last lines) |")
    assert [(r[1], r[2], r[3], r[4] == "yes", None if r[5] == "–" else r[5]) for r in rows] == [
        (r.name, r.failure_class, r.exit or "any failure", r.oom_kill, r.pattern) for r in RULES
    ]


def test_the_action_table_in_the_docs_is_the_codes():
    rows = table_rows("| class | action | after a recent update | on repeats (same node) | why |")
    expected = [
        (
            r.failure_class,
            r.action,
            r.on_update or "–",
            f"{r.escalate[0]}x: {r.escalate[1]}" if r.escalate else "–",
            r.why,
        )
        for r in TABLE
    ]
    assert [tuple(r) for r in rows] == expected
