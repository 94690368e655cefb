"""``bootseer run --preload``: the next attempt runs in an interpreter started ahead with the
job's modules imported (``bootseer.prestart``), with the attempt's own environment, working
directory, arguments and output, and the command starts as before when that cannot be."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from robust_helpers import scenario_env

from bootseer.prestart import PythonCommand, python_command
from bootseer.robust.agent import Agent
from bootseer.robust.detect import HangDetector
from bootseer.supervise import HangPolicy, RestartPolicy, Supervisor
from bootseer.trace import TraceWriter


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["python3", "-m", "torch.distributed.run", "--nnodes", "2", "t.py"],
            PythonCommand("python3", "torch.distributed.run", None, ("--nnodes", "2", "t.py")),
        ),
        (
            ["/v/bin/python", "train.py", "--lr", "1"],
            PythonCommand("/v/bin/python", None, "train.py", ("--lr", "1")),
        ),
        (
            ["env", "A=1", "B=x=y", "python", "-m", "m"],
            PythonCommand("python", "m", None, (), (("A", "1"), ("B", "x=y"))),
        ),
        (["python", "-u", "train.py"], None),  # interpreter options: started as usual
        (["python", "-c", "print(1)"], None),
        (["python", "-m"], None),
        (["sh", "-c", "python train.py"], None),
        (["torchrun", "train.py"], None),
        (["python"], None),
    ],
)
def test_which_commands_a_standby_runs(command: list[str], expected: PythonCommand | None) -> None:
    assert python_command(command) == expected


_JOB = """
import json, os, sys, time
import bootseer
attempt = int(os.environ["BOOTSEER_ATTEMPT"])
record = {"attempt": attempt, "pid": os.getpid(), "name": __name__, "argv": sys.argv,
          "cwd": os.getcwd(), "decimal_before": "decimal" in sys.modules,
          "mark": os.environ.get("JOB_MARK")}
with open(os.path.join(sys.argv[1], f"attempt-{attempt}.json"), "w") as f:
    json.dump(record, f)
print(f"out of attempt {attempt}", flush=True)
print(f"err of attempt {attempt}", file=sys.stderr, flush=True)
bootseer.ready()
if attempt == 0:
    time.sleep(1.0)  # the agent sees the first step and starts the next interpreter
    raise ValueError("first attempt fails")
"""


def _run(tmp_path: Path, preload: list[str]) -> tuple[Supervisor, list[str], list[dict]]:
    job = tmp_path / "job.py"
    job.write_text(_JOB)
    trace = TraceWriter(tmp_path / "trace", "solo")
    logs: list[str] = []
    agent = Agent(trace, "solo", hang=HangDetector(60.0), log=logs.append)
    sup = Supervisor(
        ["env", "JOB_MARK=set", sys.executable, str(job), str(tmp_path), "x"],
        env=scenario_env(),
        trace=trace,
        restart=RestartPolicy(1, 0.0),
        hang=HangPolicy(0.0),
        agent=agent,
        preload=preload,
        log=logs.append,
    )
    assert sup.run() == 0, logs
    return sup, logs, [json.loads((tmp_path / f"attempt-{a}.json").read_text()) for a in (0, 1)]


def test_a_restart_runs_in_the_interpreter_started_ahead(tmp_path: Path) -> None:
    sup, logs, (first, second) = _run(tmp_path, ["decimal"])
    assert not first["decimal_before"]  # a fresh interpreter: nothing preloaded
    assert second["decimal_before"]  # imported before the attempt began
    started = [line for line in logs if "runs in the interpreter started ahead" in line]
    assert started == [
        f"the command runs in the interpreter started ahead (pid {second['pid']}, decimal imported)"
    ], logs
    # the attempt's own environment, arguments, directory and name, as `python job.py` has
    assert second["mark"] == "set" and second["name"] == "__main__"
    assert second["argv"] == [str(tmp_path / "job.py"), str(tmp_path), "x"]
    assert second["cwd"] == first["cwd"]
    # its output goes through the attempt's pipes (the lines a crash is classified from)
    assert "out of attempt 1" in sup.tail.lines() and "err of attempt 1" in sup.tail.lines()
    assert sup.attempts[1].pid == second["pid"]


def test_a_standby_that_cannot_import_is_not_used(tmp_path: Path) -> None:
    _, logs, (_, second) = _run(tmp_path, ["decimal", "no_such_module_bootseer"])
    assert not second["decimal_before"]  # started as usual
    assert any(
        "the interpreter started ahead is not used: exited before it was ready" in line
        for line in logs
    ), logs
