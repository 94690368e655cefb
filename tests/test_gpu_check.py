"""``benchmarks/gpu_check.py`` in its CPU form, the form that runs where no GPU is lent.

Every check runs on CPU tensors (the same code paths as on CUDA, small sizes), each
measurement that needs CUDA is skipped with one ``skip:`` line, the run exits 0, and its JSON
and Markdown hold the same rows. A check that hangs is killed at its own deadline with its
process group, and the next check still runs. No figure is compared with anything (speed is
the benchmarks' business); the verdicts about content must pass: loads bitwise equal, the rank
that skipped the all_reduce named with its op, the perturbed alignment run caught, a native
frame in the dump.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import need

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
RUN_ON_CPU = (
    "ckpt",
    "memory",
    "colltrace-times",
    "colltrace-overhead",
    "colltrace-hang",
    "alignment",
    "health",
    "stack",
)
#: the checks whose CUDA measurement the CPU form replaces, each said in one line
SAYS_SKIP = (
    "ckpt",
    "memory",
    "colltrace-times",
    "colltrace-overhead",
    "colltrace-hang",
    "alignment",
    "stack",
)


def gpu_check(
    results: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--results", str(results), "--cpu", *args],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


@pytest.fixture(scope="module")
def cpu_form(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
    results = tmp_path_factory.mktemp("gpu-check") / "results"
    run = gpu_check(results)
    report = json.loads((results / "gpu_check.json").read_text())
    return run, report, (results / "gpu_check.md").read_text()


def figures(report: dict[str, Any], check: str) -> dict[str, Any]:
    return report["checks"][check]["result"]["figures"]


def test_every_check_runs_on_cpu_and_each_cuda_part_is_skipped_in_one_line(cpu_form) -> None:
    run, report, _ = cpu_form
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert report["form"] == "cpu" and report["errors"] == []
    assert {n: e["status"] for n, e in report["checks"].items()} == {
        **dict.fromkeys(RUN_ON_CPU, "ok"),
        "nccl-ranks": "skipped",
    }
    assert all(report["checks"][n]["result"]["done"] for n in RUN_ON_CPU)
    lines = run.stdout.splitlines()
    assert "skip: nccl-ranks: needs CUDA (this machine has none)" in lines
    for name in SAYS_SKIP:
        said = [ln for ln in lines if ln.lstrip().startswith(f"[{name}] skip: {name}: ")]
        assert len(said) == 1 and "CUDA" in said[0], (name, said)


def test_the_content_verdicts_pass_and_every_row_has_its_peer_or_floor(cpu_form) -> None:
    _, report, _ = cpu_form
    rows = {r["metric"]: r for r in report["final_table"]}
    assert all(
        r["peer"] and r["limit"] and r["verdict"] in ("pass", "FAIL", "info", "noise")
        for r in rows.values()
    ), rows
    for metric in (
        "ckpt: load into CPU tensors",
        "memory: load from the memory tier into CPU tensors",
        "colltrace-times: Flight Recorder through bootseer.colltrace.flight.dump() (gloo)",
        "alignment: bitwise alignment on cpu",
    ):
        assert rows[metric]["verdict"] == "pass", rows[metric]
    load = figures(report, "ckpt")["load"]
    assert load["ours_equal"] is True and load["dcp_equal"] is True
    assert figures(report, "memory")["load"]["equal"] is True
    align = figures(report, "alignment")
    assert align["identical"] is True and align["suspects"] == [3]
    assert align["hashes"]["perturbed"] != align["hashes"]["run 1"]
    # the overheads are measured beside their A/A control (their value is not judged here)
    assert {"overhead", "control"} <= set(figures(report, "memory")["overhead"])
    assert {"overhead", "control"} <= set(figures(report, "colltrace-overhead")["overhead"])


def test_the_rank_that_skipped_the_all_reduce_is_named_with_its_op(cpu_form) -> None:
    _, report, _ = cpu_form
    hang = figures(report, "colltrace-hang")
    assert hang["named"] is True and hang["wrong"] == [] and hang["backend"] == "gloo"
    first = next(f for f in hang["findings"] if f["ranks"] and f["seen"] >= hang["injected"])
    assert (first["ranks"], first["op"], first["group"], first["seq"]) == (
        [1],
        "all_reduce",
        "grp-a",
        13,
    )
    metric = next(m for m in (r["metric"] for r in report["final_table"]) if "hang:" in m)
    assert next(r for r in report["final_table"] if r["metric"] == metric)["verdict"] == "pass"


def test_the_stack_dump_shows_a_native_frame_under_the_loop(cpu_form) -> None:
    _, report, _ = cpu_form
    need(None if report["env"]["py_spy"] else "py-spy is not installed (a bootseer dependency)")
    last = figures(report, "stack")["dumps"][-1]
    assert last["hits"] and "_matmul_loop (gpu_check_robust.py)" in last["python"], last


def test_the_health_check_says_why_it_skipped_without_nvidia_smi(cpu_form) -> None:
    run, report, _ = cpu_form
    if report["env"]["nvidia_smi"]:
        pytest.skip("nvidia-smi is on this machine: the parse runs (the GPU form's row)")
    assert "skip: health: gpu: no nvidia-smi on PATH; skipped" in run.stdout
    assert figures(report, "health")["result"]["ok"] is None


def test_the_markdown_holds_the_json_rows_and_skip_lines(cpu_form) -> None:
    _, report, md = cpu_form
    lines = md.splitlines()
    assert lines[0].startswith("# GPU check (CPU form")
    table = [ln for ln in lines if ln.startswith("| ")]
    for row in report["final_table"]:
        cells = [row["metric"], row["bootseer"], row["peer"], row["limit"], row["verdict"]]
        assert any([c.strip() for c in ln.strip("|").split(" | ")] == cells for ln in table), cells
    for skip in report["skips"]:
        assert f"- {skip}" in lines
    assert any(ln.startswith("| colltrace-hang") and "| ok" in ln for ln in table)


def test_a_hung_check_is_killed_at_its_deadline_and_the_next_one_runs(tmp_path: Path) -> None:
    results = tmp_path / "results"
    run = gpu_check(
        results,
        "--parts",
        "colltrace-times,health",
        "--timeout",
        "colltrace-times=5",
        env={"GPU_CHECK_FAULT": "colltrace-times:hang"},
    )
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    report = json.loads((results / "gpu_check.json").read_text())
    hung, after = report["checks"]["colltrace-times"], report["checks"]["health"]
    assert hung["status"] == "timeout" and "killed with its process group" in hung["why"]
    assert "GPU_CHECK_FAULT says hang" in "\n".join(hung["output_tail"])
    assert (
        not Path(f"/proc/{hung['pid']}").exists()
        or b"gpu_check_colltrace" not in Path(f"/proc/{hung['pid']}/cmdline").read_bytes()
    )
    assert after["status"] == "ok" and after["result"]["done"] is True
    assert report["errors"] == [f"colltrace-times: {hung['why']}"]
    md = (results / "gpu_check.md").read_text()
    assert "| colltrace-times: the check" in md and "timed out after 5 s" in md
