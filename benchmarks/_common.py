"""Small pieces every benchmark script uses: its command line, the commit it measured, a
markdown table, and SIGTERM as Ctrl-C (so that a killed run still stops what it started).

Benchmarks import only the standard library in the harness process (what they measure runs in
children), and so does this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The job's secret the controller's store records are sealed with (bootseer.robust.seal): a
# random one per benchmark run unless given; every child (controller, agents) inherits it.
os.environ.setdefault("BOOTSEER_JOB_SECRET", secrets.token_hex(32))

ROOT = Path(__file__).resolve().parents[1]
_T0 = time.monotonic()


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return [
        line(head),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
        *[line(r) for r in rows],
    ]


def command_line(script: str) -> str:
    """How this run was started: the ``bootseer bench ...`` command that ran this suite (the
    harness says so in ``BOOTSEER_BENCH_COMMAND``), else ``python benchmarks/<script> ...``."""
    return os.environ.get("BOOTSEER_BENCH_COMMAND") or " ".join(
        ["python", f"benchmarks/{script}", *sys.argv[1:]]
    )


def source_state(paths: list[str]) -> dict[str, Any]:
    """The commit measured, and whether the measured code had local changes (read-only git)."""
    state: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        state["commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", *paths],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        state["local_changes"] = [line[3:] for line in dirty.splitlines()]
    return state


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


def reexec(script: str, argv: list[str]) -> int:
    """Run ``script`` (the caller's ``__file__``) with ``argv`` in a fresh interpreter: its
    ``main()`` was called in a process that already has the measured tools' libraries loaded
    (imports would be warm). ``bootseer bench`` starts each suite fresh, so only an in-process
    caller gets here; a fresh interpreter that still has them loaded is an error, not a loop."""
    if os.environ.get("BOOTSEER_BENCH_REEXEC") == script:
        log(
            f"{script}: the measured tools' libraries are loaded even in a fresh interpreter "
            "(an import at module level?); refusing to measure warm imports"
        )
        return 2
    log(
        f"re-running {Path(script).name} in a fresh interpreter (this one has the measured "
        "tools' libraries loaded)"
    )
    proc = subprocess.Popen(
        [sys.executable, script, *argv], env={**os.environ, "BOOTSEER_BENCH_REEXEC": script}
    )
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the child cleans up on SIGTERM as on Ctrl-C
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        return 130


KEEP_CACHES_ENV = "BOOTSEER_BENCH_KEEP_CACHES"  # "1": --smoke, for the children too


def keeps_page_cache() -> bool:
    """Whether this run keeps the page cache (``--smoke``): every drop evicts torch's libraries
    for every process on the machine, the tests beside the run included, which then read them
    back from disk; a smoke run's figures are not cold figures anyway."""
    return os.environ.get(KEEP_CACHES_ENV) == "1"


def drop_caches() -> bool:
    """``sync; echo 3 > drop_caches``; whether the page cache was dropped (False: not root, or
    :func:`keeps_page_cache`)."""
    if keeps_page_cache():
        return False
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fs_type(path: Path) -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return " on ".join(out) if out else "?"
    return "?"


def final_table(report: dict[str, Any], rows: list[list[str]]) -> list[str]:
    """The suite's table of figures (metric, bootseer, peer, limit, verdict): kept in
    ``report["final_table"]``, printed, and returned as markdown lines."""
    report["final_table"] = [
        dict(zip(["metric", "bootseer", "peer", "limit", "verdict"], r, strict=True)) for r in rows
    ]
    table = md_table(["metric", "bootseer", "peer", "limit/target", "pass/fail"], rows)
    print("", flush=True)
    for line in table:
        print(line)
    return table


def write_report_json(results_dir: Path, suite: str, report: dict[str, Any]) -> None:
    """``DIR/<suite>.json``, stamped with the time it was finished."""
    import datetime

    results_dir.mkdir(parents=True, exist_ok=True)
    report["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    (results_dir / f"{suite}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def repeat_args(
    prog: str, doc: str, suite: str, full: int, quick: int, argv: list[str] | None
) -> Any:
    """The command line of a suite that repeats rounds: ``--results``, ``--quick``, ``--smoke``,
    ``--repeat`` (at least 1; resolved to ``full`` or ``quick`` when not given)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--results", default="bench-results", help=f"for {suite}.json/.md")
    parser.add_argument("--quick", action="store_true", help=f"{quick} round(s): smoke")
    parser.add_argument("--repeat", type=int, help=f"rounds ({full}; quick {quick})")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    smoke_implies_quick(args)
    if args.repeat is not None and args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give at least 1 round")
    args.repeat = args.repeat or (quick if args.quick else full)
    return args


def load_text(machine: dict[str, Any]) -> str:
    """The load averages (1, 5, 15 min) before the run, and after it when known."""
    load = ", ".join(f"{x:.2f}" for x in machine["load_before"])
    if "load_after" in machine:
        load += f" before, {', '.join(f'{x:.2f}' for x in machine['load_after'])} after"
    return load


def cache_dir() -> Path:
    """The suites' cache and work directory: ``BOOTSEER_BENCH_CACHE``, else
    ``~/.cache/bootseer-bench``."""
    return Path(os.environ.get("BOOTSEER_BENCH_CACHE") or Path.home() / ".cache" / "bootseer-bench")


def work_dir(prefix: str, stack: contextlib.ExitStack) -> Path:
    """A private work directory ``CACHE/<prefix>XXXX`` for one run, removed when ``stack``
    closes (only it: never the cache around it). A file where the cache should be raises
    FileExistsError (the suite exits 1)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=cache))

    def remove() -> None:
        if work.parent == cache and work.name.startswith(prefix):  # the directory made here
            shutil.rmtree(work, ignore_errors=True)

    stack.callback(remove)
    return work


def code_env() -> dict[str, str]:
    """The environment of a measured child: the tree on PYTHONPATH, else this checkout's (so
    that the same script measures another tree with ``PYTHONPATH=/old/tree``)."""
    return {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def mem_total() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def run_checked(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    what: str,
    cwd: str | None = None,
    timeout: float = 3600,
) -> subprocess.CompletedProcess:
    """A set-up command (not timed); its own session, killed with its children on Ctrl-C."""
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {proc.returncode}): {(err or out).strip()[-3000:]}"
        )
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def version_of(argv: list[str]) -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        text = (out.stdout or out.stderr).strip().splitlines()
        return text[0].strip() if text else "?"
    return "not found"


def run_bench(bench: Any, *, done_key: str, report_inside: bool = True, log_fn: Any = None) -> int:
    """Run a benchmark object (``stack``, ``run()``, ``report()``, ``errors``, ``R``,
    ``write_files()``): Ctrl-C and SIGTERM stop everything it started, a crash is recorded,
    and partial results are written. Exit status: 130 interrupted, 1 on errors, else 0.

    ``report_inside``: report while the servers of ``bench.stack`` still run (the report reads
    their state), or after they are stopped."""
    say = log_fn or log
    interrupted = False
    with sigterm_as_interrupt():
        try:
            with bench.stack:
                bench.run()
                if report_inside:
                    bench.report()
            if not report_inside:
                bench.report()
        except KeyboardInterrupt:
            interrupted = True
            say("interrupted: everything started has been stopped and removed")
        except Exception as exc:  # noqa: BLE001 - recorded, and partial results still written
            import traceback

            bench.errors.append(f"crashed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        finally:
            if interrupted or bench.errors and done_key not in bench.R:
                with contextlib.suppress(Exception):
                    bench.write_files()
    if interrupted:
        return 130
    return 1 if bench.errors else 0


def download_wheels(wheel_dir: Path, requirements: list[str]) -> list[Path]:
    """``pip download`` the requirements' wheels into ``wheel_dir`` once (this machine's pip
    configuration: the CPU torch wheel comes from its find-links); the files, from a stamp
    on later calls."""
    import re

    stamp = wheel_dir / ".complete.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        meta = json.loads(stamp.read_text())
        files = [wheel_dir / f for f in meta["files"]]
        if meta["requirements"] == requirements and files and all(f.is_file() for f in files):
            return files
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading wheels once: pip download {' '.join(requirements)} -d {wheel_dir}")
    before = set(wheel_dir.glob("*.whl"))
    out = run_checked(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            *requirements,
            "-d",
            str(wheel_dir),
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
        ],
        what="pip download",
    )
    saved = {
        m.group(1).strip()
        for m in re.finditer(r"(?:Saved|File was already downloaded) (.+)", out.stdout)
    }
    files = sorted({Path(s).resolve() for s in saved} | (set(wheel_dir.glob("*.whl")) - before))
    files = [f for f in files if f.suffix == ".whl" and f.parent == wheel_dir.resolve()]
    if not files:
        files = sorted(wheel_dir.glob("*.whl"))
    stamp.write_text(json.dumps({"requirements": requirements, "files": [f.name for f in files]}))
    return files


SMOKE_HELP = (
    "smaller than --quick, and implies it: the fewest rounds and smallest sizes that still run "
    "every code path (tests/test_bench_harness.py's form); marked smoke in the results"
)


def add_smoke_flag(parser: Any) -> None:
    """``--smoke`` on a suite's parser; :func:`smoke_implies_quick` after parsing."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def smoke_implies_quick(args: Any) -> bool:
    """``--smoke`` is a smaller ``--quick``: every quick mark (JSON ``quick``, the markdown's
    title) stays, and ``smoke`` is added beside it; the page cache is never dropped
    (:func:`keeps_page_cache`). Whether this is a smoke run."""
    args.smoke = bool(getattr(args, "smoke", False))
    if args.smoke:
        args.quick = True
        os.environ[KEEP_CACHES_ENV] = "1"  # the page cache is kept (keeps_page_cache)
    return args.smoke
