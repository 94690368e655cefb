"""``bootseer bench``: run the benchmark suites in ``benchmarks/`` of a source checkout.

Each suite runs as a child process, ``python benchmarks/bench_<suite>.py``, in its own session:
a fresh interpreter, so that no suite measures with another's libraries already imported, and
one suite's crash or leftover processes cannot reach the next. Ctrl-C or SIGTERM is forwarded
to the running suite as SIGTERM (the suites stop and remove what they started), and its process
group is killed after it exits. A suite failed when it exits non-zero or leaves no results of
this run (``<suite>.json`` and ``.md``); the others still run, the failure is printed with the
suite's last output lines, ``summary.md`` says why, and the command exits 1 (130 interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

SUITES = (
    "striped",
    "ckpt",
    "snapshot",
    "prefetch",
    "containerd",
    "fuse",
    "restart",
    "update",
    "memckpt",
    "colltrace",
    "e2e",
    "robust",
)
# run only when named: the startup model reads a sweep's results (``e2e --sweep``) in --results
NAMED_ONLY = ("model",)
RESULT_FILES = {"model": "startup-model"}  # a suite whose results are named otherwise
# the suites with a --smoke form (e2e's quick form is the run test_e2e.py shares, robust's
# short forms are tests/test_robust_faults.py, model only reads a sweep)
SMOKE_SUITES = tuple(s for s in SUITES if s not in ("e2e", "robust"))
TAKES_BASE = ("prefetch", "containerd", "e2e")  # the suites that build an image from a base
TAIL_LINES = 25
STOP_GRACE_S = 300.0  # a suite's own clean-up after SIGTERM (unmounts, containerd tasks)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (results: docs/benchmarks.md)")
    p.add_argument(
        "suites",
        nargs="*",
        choices=[*SUITES, *NAMED_ONLY, []],
        default=[],
        help=f"which suites (default all: {', '.join(SUITES)}; model only when "
        "named: the startup model of DIR/e2e-sweep.json)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, for a smoke run (marked quick in the results)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="smaller still (implies --quick): the fewest rounds and smallest sizes that run "
        "every code path, the form tests/test_bench_harness.py runs; marked smoke in the "
        f"results, never figures; suites: {', '.join(SMOKE_SUITES)}",
    )
    p.add_argument(
        "--results",
        default="bench-results",
        help="directory for the results: JSON, markdown tables, PNG charts",
    )
    p.add_argument(
        "--cache",
        default=None,
        help="cache and work directory of every suite (BOOTSEER_BENCH_CACHE; "
        "default ~/.cache/bootseer-bench)",
    )
    p.add_argument(
        "--base",
        choices=("auto", "debootstrap", "host"),
        default=None,
        help=f"image base for {', '.join(TAKES_BASE)} (host: a copy of this host's "
        "Debian python3.11, no mirror needed)",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="e2e's restart paths, comma-separated, of baseline, diy, diy-warm, "
        "bootseer (default all)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="e2e on N nodes of a cluster of network namespaces (writes e2e-nodes.*)",
    )
    p.add_argument(
        "--sweep",
        default=None,
        help="e2e on each node count of a list, e.g. 2,4,8 (writes e2e-sweep.*, "
        "the input of `bootseer bench model`)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="e2e with --nodes or --sweep: ranks per node (default 2; sweep 1)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="robust: training minutes per mode (default 20; --quick 5)",
    )
    p.add_argument(
        "--classes",
        default=None,
        help="robust: fault classes, comma-separated (default all; "
        "sigkill,exception: crash detection alone)",
    )
    p.set_defaults(func=run)


def benchmarks_dir() -> Path:
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "benchmarks").is_dir():
            return base / "benchmarks"
    raise FileNotFoundError("benchmarks/ not found: run `bootseer bench` from a source checkout")


@dataclass
class Child:
    """How a child process ended: its exit status (``-N``: killed by signal N), its last
    output lines, and whether we stopped it because we were interrupted."""

    code: int
    tail: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def status(self) -> int:
        """Ours to exit with: 130 when interrupted, 128+N when killed by signal N."""
        if self.interrupted:
            return 130
        return 128 - self.code if self.code < 0 else self.code


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller handles its own signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _copy_output(stream: IO[bytes], tail: deque[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_child(argv: list[str], *, env: dict[str, str] | None = None) -> Child:
    """Run ``argv`` in its own session, its output copied to ours. Ctrl-C or SIGTERM here is
    forwarded to it as SIGTERM, with ``STOP_GRACE_S`` to clean up (a second one kills it);
    whatever is left in its process group is killed when it has exited."""
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    reader = threading.Thread(target=_copy_output, args=(proc.stdout, tail), daemon=True)
    reader.start()
    interrupted = False
    with _sigterm_as_interrupt():
        try:
            try:
                proc.wait()
            except KeyboardInterrupt:
                interrupted = True
                print(
                    f"bootseer bench: interrupted; stopping {Path(argv[1]).name} "
                    f"(SIGTERM, up to {STOP_GRACE_S:.0f} s to clean up)",
                    flush=True,
                )
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except (subprocess.TimeoutExpired, KeyboardInterrupt):
                    _kill_group(proc.pid)
                    proc.wait()
        finally:
            _kill_group(proc.pid)
            reader.join(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
    return Child(proc.returncode, list(tail), interrupted)


FileState = tuple[int, int, int] | None  # inode, mtime (ns), size; None: no such file


def _file_state(path: Path) -> FileState:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def results_state(results: Path, suite: str) -> dict[str, FileState]:
    """The state of ``suite``'s result files, taken before it runs (see :func:`missing_results`)."""
    return {ext: _file_state(results / f"{suite}.{ext}") for ext in ("json", "md")}


def missing_results(results: Path, suite: str, before: dict[str, FileState]) -> str | None:
    """Why ``suite`` left no results of this run in ``results`` (None: it did). ``before``:
    :func:`results_state` before the run, so that an earlier run's files do not count."""
    for ext in ("json", "md"):
        path = results / f"{suite}.{ext}"
        now = _file_state(path)
        if now is None:
            return f"it wrote no {path.name}"
        if now == before.get(ext):
            return f"{path.name} is left from an earlier run (this run did not write it)"
        if now[2] == 0:
            return f"{path.name} is empty"
    try:
        report = json.loads((results / f"{suite}.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{suite}.json is not valid JSON ({exc})"
    if not isinstance(report, dict):
        return f"{suite}.json is not a JSON object"
    return None


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


@dataclass
class Outcome:
    """One suite's run: ``why`` is None when it exited 0 with its results written."""

    suite: str
    why: str | None
    tail: list[str] = field(default_factory=list)
    files: str = ""  # the results' names (``<files>.md``): the suite's own unless told

    def __post_init__(self) -> None:
        self.files = self.files or self.suite


def run_suite(
    directory: Path, suite: str, args: argparse.Namespace, env: dict[str, str]
) -> tuple[Outcome, bool]:
    """One suite as a child process; its outcome, and whether we were interrupted."""
    results = Path(args.results)
    argv = [
        "--results",
        args.results,
        *(["--quick"] if args.quick or getattr(args, "smoke", False) else []),
        *(["--smoke"] if getattr(args, "smoke", False) else []),
        *(["--base", args.base] if args.base and suite in TAKES_BASE else []),
        *(["--methods", args.methods] if args.methods and suite == "e2e" else []),
        *(["--nodes", str(args.nodes)] if getattr(args, "nodes", None) and suite == "e2e" else []),
        *(["--sweep", args.sweep] if getattr(args, "sweep", None) and suite == "e2e" else []),
        *(
            ["--ranks-per-node", str(args.ranks_per_node)]
            if getattr(args, "ranks_per_node", None) is not None and suite == "e2e"
            else []
        ),
        *(
            ["--minutes", str(args.minutes)]
            if getattr(args, "minutes", None) and suite == "robust"
            else []
        ),
        *(
            ["--classes", args.classes]
            if getattr(args, "classes", None) and suite == "robust"
            else []
        ),
    ]
    env = {**env, "BOOTSEER_BENCH_COMMAND": shlex.join(["bootseer", "bench", suite, *argv])}
    files = (
        "e2e-sweep"
        if "--sweep" in argv
        else "e2e-nodes"
        if "--nodes" in argv
        else RESULT_FILES.get(suite, suite)
    )  # the results' names
    before = results_state(results, files)
    print(
        f"bootseer bench: {suite} ({shlex.join(['python', f'benchmarks/bench_{suite}.py', *argv])})",
        flush=True,
    )
    child = run_child([sys.executable, str(directory / f"bench_{suite}.py"), *argv], env=env)
    if child.interrupted:
        why: str | None = f"interrupted ({_exit_text(child.code)})"
    elif child.code != 0:
        why = _exit_text(child.code)
    else:
        missing = missing_results(results, files, before)
        why = f"exit 0, but {missing}" if missing else None
    return Outcome(suite, why, child.tail, files), child.interrupted


def run(args: argparse.Namespace) -> int:
    """Every suite asked for, in order; 0 when each wrote its results, 1 when one failed,
    130 when interrupted (the suites after it are not run)."""
    suites = list(dict.fromkeys(args.suites or SUITES))
    no_smoke = [s for s in suites if s not in SMOKE_SUITES]
    if getattr(args, "smoke", False) and no_smoke:
        print(
            f"bootseer bench: --smoke: no smoke form for {', '.join(no_smoke)}; name suites "
            f"that have one ({', '.join(SMOKE_SUITES)}) or use --quick",
            file=sys.stderr,
        )
        return 2
    directory = benchmarks_dir()
    os.makedirs(args.results, exist_ok=True)
    env = dict(os.environ)
    if args.cache:
        env["BOOTSEER_BENCH_CACHE"] = str(Path(args.cache).expanduser().resolve())
    outcomes: list[Outcome] = []
    interrupted = False
    for suite in suites:
        outcome, interrupted = run_suite(directory, suite, args, env)
        outcomes.append(outcome)
        if outcome.why:
            print(f"bootseer bench: {suite} FAILED: {outcome.why}", flush=True)
        if interrupted:
            break
    not_run = suites[len(outcomes) :]
    write_summary(Path(args.results), outcomes, not_run)
    failed = [o for o in outcomes if o.why]
    for o in failed:
        print(f"bootseer bench: {o.suite} FAILED: {o.why}; its last output lines:", file=sys.stderr)
        for line in o.tail:
            print(f"  | {line}", file=sys.stderr)
    if not_run:
        print(f"bootseer bench: not run (interrupted): {', '.join(not_run)}", file=sys.stderr)
    print(
        f"bootseer bench: {len(outcomes) - len(failed)} of {len(suites)} suites wrote their "
        f"results; {Path(args.results).resolve()} (summary.md, <suite>.json, <suite>.md, charts)",
        flush=True,
    )
    if interrupted:
        return 130
    return 1 if failed else 0


def write_summary(results: Path, outcomes: list[Outcome], not_run: list[str]) -> None:
    """``summary.md``: every suite's markdown report in the order run, and its chart; a failed
    suite's reason and last output lines instead."""
    parts = ["# bootseer bench results", ""]
    for o in outcomes:
        if o.why is None:
            parts.append((results / f"{o.files}.md").read_text())
            chart = results / f"{o.files}.png"
            if chart.exists():
                parts.append(f"![{o.suite}]({chart.name})\n")
            continue
        parts += [
            f"## {o.suite}: FAILED ({o.why})",
            "",
            "Its last output lines:",
            "",
            "```",
            *o.tail,
            "```",
            "",
        ]
    parts += [f"## {suite}: not run (interrupted)\n" for suite in not_run]
    (results / "summary.md").write_text("\n".join(parts))
