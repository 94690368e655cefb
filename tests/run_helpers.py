"""Tiny commands for ``bootseer run`` to supervise, and the test side of running the wrapper.

As a script: ``python run_helpers.py SCENARIO ARGS...`` (the command under test); imported:
:func:`start_wrapper` and friends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

HELPERS = str(Path(__file__).resolve())
ROOT = Path(__file__).resolve().parent.parent


# -- the test side -----------------------------------------------------------------------------


def wrapper_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The wrapper's environment: no BOOTSEER_* configuration and no launcher variables of
    the developer's shell."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("BOOTSEER_")
        and k
        not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["BOOTSEER_NODE"] = "testnode"
    if "BOOTSEER_JOB_SECRET" in os.environ:  # conftest's: the store's records are sealed
        env["BOOTSEER_JOB_SECRET"] = os.environ["BOOTSEER_JOB_SECRET"]
    env.update(extra or {})
    return env


def wrapper_argv(trace_dir: Path, *flags: str, command: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bootseer",
        "run",
        "--trace-dir",
        str(trace_dir),
        "--backoff",
        "0",
        *flags,
        "--",
        *command,
    ]


def child(scenario: str, *args: Any) -> list[str]:
    """The command line of a scenario of this file."""
    return [sys.executable, HELPERS, scenario, *map(str, args)]


def start_wrapper(
    trace_dir: Path, *flags: str, command: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        wrapper_argv(trace_dir, *flags, command=command),
        env=wrapper_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_wrapper(
    trace_dir: Path,
    *flags: str,
    command: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        wrapper_argv(trace_dir, *flags, command=command),
        env=wrapper_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll until ``predicate()`` is truthy (the timeout only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def read_until(stream: IO[str], text: str) -> str:
    """Lines of a wrapper's stderr up to the one containing ``text`` (what the wrapper has
    done so far, without guessing at timings)."""
    seen = []
    for line in stream:
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{text!r} never came; got:\n{''.join(seen)}")


def spans(trace_dir: Path) -> list[dict[str, Any]]:
    """The spans of a trace directory (the agent's event and verdict records left out)."""
    out: list[dict[str, Any]] = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        out += [
            doc
            for line in path.read_text().splitlines()
            if line.strip()
            if "record" not in (doc := json.loads(line))
        ]
    return out


def process_gone(pid: int) -> bool:
    """Not even a zombie is left."""
    return not Path(f"/proc/{pid}").exists()


def zombies_of(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        if fields[0] == "Z" and int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


# -- the command side --------------------------------------------------------------------------


def _counter(path: str) -> int:
    """How many times this has run before (a file counter across attempts)."""
    p = Path(path)
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    return n


def sleepy_forever_function() -> None:
    """The hung training step: its name must show up in the stack dump."""
    while True:
        time.sleep(3600)


def main(argv: list[str]) -> int:
    scenario, args = argv[0], argv[1:]
    if scenario == "exit":
        return int(args[0])
    if scenario == "kill-self":
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "touch":
        Path(args[0]).write_text(json.dumps(dict(os.environ)))
        return 0
    if scenario == "touch-until":  # marker, directory, text: touch, then wait (<= 60 s) for
        Path(args[0]).write_text(json.dumps(dict(os.environ)))  # a file there that holds text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            args[2] in p.read_text(errors="replace") for p in Path(args[1]).glob("*") if p.is_file()
        ):
            time.sleep(0.05)
        return 0
    if scenario == "trap-term":  # started-file, marker[, signal name (default SIGTERM)]
        trapped = getattr(signal, args[2]) if len(args) > 2 else signal.SIGTERM

        def on_term(signum: int, frame: Any) -> None:
            Path(args[1]).write_text(f"got {signal.Signals(signum).name}")
            sys.exit(0)

        signal.signal(trapped, on_term)
        Path(args[0]).write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))
        while True:
            time.sleep(1)
    if scenario == "leave-behind":  # pid-file: start a sleeper in our group, then exit 0
        import subprocess

        sleeper = subprocess.Popen(["sleep", "600"])
        Path(args[0]).write_text(str(sleeper.pid))
        return 0
    if scenario == "ignore-term":  # started-file
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(args[0]).write_text(str(os.getpid()))
        while True:
            time.sleep(1)
    if scenario == "double-fork":  # grandchild-file, go-file
        middle = os.fork()
        if middle == 0:
            parent = os.getpid()
            grandchild = os.fork()
            if grandchild == 0:
                while os.getppid() == parent:  # until the middle one is gone: reparented
                    time.sleep(0.01)
                Path(args[0]).write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))
                os._exit(0)
            os._exit(0)
        os.waitpid(middle, 0)
        while not Path(args[1]).exists():
            time.sleep(0.02)
        return 0
    if scenario == "crash-once":  # counter-file
        import bootseer

        if _counter(args[0]) == 0:
            return 5
        bootseer.ready()
        return 0
    if scenario == "always-fail":  # counter-file
        _counter(args[0])
        return 4
    if scenario == "ready":
        import bootseer

        bootseer.ready()
        bootseer.heartbeat(0)
        return 0
    if scenario == "hang-once":  # counter-file
        import bootseer

        first = _counter(args[0]) == 0
        bootseer.ready()
        bootseer.heartbeat(1)
        if first:
            sleepy_forever_function()
        return 0
    if scenario == "dump-on-demand":  # started-file, go-file
        import bootseer.client  # noqa: F401 - registers the SIGUSR1 dump

        Path(args[0]).write_text(str(os.getpid()))
        while not Path(args[1]).exists():
            sleepy_forever_function_waits(args[1])
        return 0
    if scenario == "ckpt-load":  # checkpoint-url, out-file: resume the way training does
        import torch

        from ckpt import CheckpointManager

        state = {"w": torch.zeros(1000), "step": -1}
        with CheckpointManager(args[0]) as mgr:  # the cache comes from $BOOTSEER_CKPT_CACHE
            report = mgr.load_with_report(state)
        Path(args[1]).write_text(
            json.dumps(
                {
                    "cache": os.environ.get("BOOTSEER_CKPT_CACHE"),
                    "step": state["step"],
                    "sum": float(state["w"].sum()),
                    "cached_files": report.cached_files,
                }
            )
        )
        return 0
    if scenario == "ckpt-save-crash-load":  # url, out-file: attempt 0 saves and dies,
        import torch  # attempt 1 resumes (an in-place restart)

        from ckpt import CheckpointManager

        with CheckpointManager(args[0]) as mgr:  # the cache comes from $BOOTSEER_CKPT_CACHE
            if os.environ.get("BOOTSEER_ATTEMPT") == "0":
                mgr.save(
                    3, {"w": torch.arange(250_000, dtype=torch.float32), "step": 3}, block=True
                )
                os._exit(1)  # a crash right after a commit
            state = {"w": torch.zeros(250_000), "step": -1}
            report = mgr.load_with_report(state)
        Path(args[1]).write_text(
            json.dumps(
                {
                    "step": state["step"],
                    "equal": bool(
                        torch.equal(state["w"], torch.arange(250_000, dtype=torch.float32))
                    ),
                    "cached_files": report.cached_files,
                    "cached_bytes": report.cached_bytes,
                }
            )
        )
        return 0
    raise SystemExit(f"unknown scenario {scenario}")


def sleepy_forever_function_waits(go: str) -> None:
    time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
