"""``bootseer bench`` runs every suite, each as a child process, and says which failed and why.

The smoke form of each suite (``--smoke``: a smaller ``--quick``, whose sizes docs/benchmarks.md
quotes) runs through ``bootseer bench`` and must leave its results (JSON and markdown) with
figures in them, marked quick and smoke; e2e's quick form is the run test_e2e.py asserts on
(conftest's ``e2e_bench``: its job is minutes, never run twice). A suite that fails for real
(its cache path is a file) makes the command exit 1 after the others ran, with the reason and
the suite's last output lines printed and in ``summary.md``. SIGTERM stops the running suite
and everything in its process group. What the suites measure is docs/benchmarks.md's business:
no figure here is compared with anything but zero.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import need

from bootseer.cli.bench import SMOKE_SUITES, SUITES, missing_results, results_state
from bootseer.supervise import group_pids
from bootseer.testing.servers import fuse_available

ROOT = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, "-m", "bootseer", "bench"]

# What each suite needs besides root (drop_caches, chroot, mounts; e2e: e2e_helpers), and its
# quick form's figures: named values that must be positive numbers in its JSON.
TOOLS: dict[str, tuple[str, ...]] = {
    "striped": ("nginx",),
    "ckpt": (),
    "snapshot": ("zstd", "tar"),
    "prefetch": ("docker-registry", "curl", "tar", "gzip", "chroot"),
    "containerd": (
        "docker-registry",
        "curl",
        "tar",
        "gzip",
        "chroot",
        "containerd",
        "ctr",
        "runc",
        "containerd-shim-runc-v2",
    ),
    "fuse": ("rsync", "dd"),
    "restart": (),
    "update": (),
    "memckpt": (),
    "colltrace": (),
}
NEEDS_FUSE = ("striped", "prefetch", "containerd", "fuse", "restart")
HOST_BASE = ("prefetch", "containerd")  # their image base: a copy of Debian's python3.11


def missing_for(suite: str) -> str | None:
    if os.geteuid() != 0:
        return "the benchmark suites need root (drop_caches, chroot, mounts, containerd)"
    for tool in TOOLS[suite]:
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/system-packages installs it)"
    if suite in HOST_BASE:
        dpkg = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", "python3.11"],
            capture_output=True,
            text=True,
            check=False,
        )
        if not dpkg.stdout.endswith(" installed"):
            return "--base host copies Debian's python3.11 package, which is not installed"
    return fuse_available() if suite in NEEDS_FUSE else None


def _runs(runs: dict[str, list[dict[str, Any]]], *methods: str) -> dict[str, Any]:
    return {f"{m} total s": runs[m][0]["total"] for m in methods}


FIGURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "striped": lambda r: {
        "http striped MB/s": r["http"]["striped"]["mb_s"],
        "http single MB/s": r["http"]["single_stream"]["mb_s"],
        "s3 striped write MB/s": r["s3"]["striped_write"]["mb_s"],
        "s3 striped read MB/s": r["s3"]["striped_read"]["mb_s"],
        "peak RSS": r["rss"]["stream"]["peak_rss"],
    },
    "ckpt": lambda r: {
        "state bytes": r["state_bytes"],
        "dd write s": r["floors"]["write"],
        "bootseer load s": r["local"][0]["ours_load"][0],
        "DCP load s": r["local"][0]["dcp_load"][0],
        "s3 bootseer save s": r["s3"][0]["s3_ours_save"],
    },
    "snapshot": lambda r: _runs(r["settings"]["local"]["runs"], *r["settings"]["local"]["runs"]),
    "prefetch": lambda r: _runs(r["runs"], "full", "lazy", "profile", "floor"),
    "containerd": lambda r: _runs(r["runs"], "default", "lazy", "profile", "floor"),
    "fuse": lambda r: {
        f"{store} {side} {k}": r["stores"][store][side][k]
        for store in ("file", "s3")
        for side in ("mount", "local")
        for k in ("dd_write_mb_s", "dd_read_mb_s", "rsync_first_s", "touch_cat_ms")
    },
    "restart": lambda r: (
        {
            f"{sig} {what} {stat}": r["signals"][sig][what][stat]
            for sig in ("SIGTERM", "SIGKILL")
            for what in ("gap_s", "start_s")
            for stat in ("median", "p90")
        }
        | {
            "floor start s": r["floor_start_s"]["median"],
            "takeovers succeeded": r["takeovers"]["succeeded"],
        }
    ),
    "update": lambda r: {
        "in-place downtime s": r["inplace_s"]["median"],
        "peer downtime s": r["peer_s"]["median"],
        "floor s": r["floor_s"]["median"],
    },
    "memckpt": lambda r: (
        {f"{where} load s": r["load"][where][0]["load_s"] for where in ("local", "peer", "durable")}
        | {
            "memcpy s": r["load"]["local"][0]["memcpy_s"],
            "loaded step": r["load"]["local"][0]["step"],
        }
    ),
    "e2e": lambda r: (
        {f"{m} to first step s": r["runs"][m]["total"] for m in ("bootseer", "inplace")}
        | {"bootseer loaded step": r["runs"]["bootseer"]["loaded_step"]}
    ),
    "colltrace": lambda r: {
        "traced op us": r["micro"]["op_us_traced"],
        "traced step ms": r["overhead"]["iter_ms_on"],
        "ring bytes": r["overhead"]["ring_bytes"][0],
        "sleep verdict s": r["faults"]["sleep"]["p50_s"],
        "kill verdict s": r["faults"]["kill"]["p50_s"],
    },
}


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache for the module's suites (the image prefetch builds serves containerd), as a
    developer's ~/.cache/bootseer-bench serves later runs; removed at the end."""
    cache = tmp_path_factory.mktemp("bench-cache")
    yield cache
    left = mounts_under(cache)
    assert not left, f"a suite left mounts under its cache: {left}"
    shutil.rmtree(cache)


def processes_mentioning(text: str) -> set[int]:
    """Live processes whose command line contains ``text``."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline:
            found.add(int(name))
    return found - {os.getpid()}


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # gone meanwhile
        return None
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def run_smoke_form(
    suite: str, cache: Path, work: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``bootseer bench SUITE --smoke``: its exit and output, and its results directory."""
    results = work / "results"
    run = subprocess.run(
        [
            *BENCH,
            suite,
            "--smoke",
            "--base",
            "host",
            "--results",
            str(results),
            "--cache",
            str(cache),
        ],
        capture_output=True,
        text=True,
        timeout=1150,
        check=False,
        cwd=ROOT,
    )
    return run, results


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("suite", SMOKE_SUITES)
def test_each_suite_smoke_form_leaves_its_results_through_bootseer_bench(
    suite: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``--smoke``: the quick form smaller still (the quick forms' figures are quoted in
    docs/benchmarks.md, so --quick itself stays). e2e's quick form is checked the same way in
    test_e2e.py, beside the run it shares (conftest's e2e_bench), so that parallel test workers
    never run that job twice. robust's quick form trains 5 minutes per mode (15 with restarts
    on this machine): its short forms are tests/test_robust_faults.py, its logic
    tests/test_bench_robust.py."""
    need(missing_for(suite))
    cache = request.getfixturevalue("bench_cache")
    run, results = run_smoke_form(suite, cache, tmp_path)
    check_quick_results(suite, run, results, cache, smoke=True)


def check_quick_results(
    suite: str,
    run: subprocess.CompletedProcess[str],
    results: Path,
    cache: Path,
    *,
    smoke: bool = False,
) -> None:
    """What every suite's quick (``smoke``: smoke) form run through ``bootseer bench`` must
    leave behind."""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "1 of 1 suites wrote their results" in run.stdout

    report = json.loads((results / f"{suite}.json").read_text())
    assert report["quick"] is True  # never mistaken for the documented figures
    assert report.get("smoke", False) is smoke
    flags = "--quick --smoke" if smoke else "--quick"
    assert report["command"].startswith(f"bootseer bench {suite} --results {results} {flags}")
    assert not report.get("errors")
    figures = FIGURES[suite](report)
    bad = {
        k: v
        for k, v in figures.items()
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0
    }
    assert figures and not bad, f"{suite}: figures missing or not positive: {bad or figures}"

    if smoke and suite in ("prefetch", "containerd", "snapshot"):  # said, as it is not cold
        assert any("--smoke keeps the page cache" in w for w in report["warnings"]), report
    if suite == "fuse":  # every rsync exited 0 and every touch+cat read its file back
        for store in report["stores"].values():
            runs = store["files"] * report["config"]["repeat"]
            assert store["mount"]["rsync_exit_codes"] == [0] * 2 * report["config"]["repeat"]
            assert store["mount"]["touch_cat_failed"] == f"0 of {runs}"
    if suite == "restart":  # every restart took the held connection over, nothing left behind
        rounds = 2 * report["config"]["repeat"]  # SIGTERM and SIGKILL each
        assert report["takeovers"] == {
            "rounds": rounds,
            "succeeded": rounds,
            "listing_equal": rounds,
        }
        assert all(
            len(s["rounds"]) == report["config"]["repeat"] for s in report["signals"].values()
        )
        assert not processes_mentioning(str(cache))  # snapshotters and their FUSE holders

    md = (results / f"{suite}.md").read_text()
    assert ("quick, smoke" if smoke else "quick") in md.splitlines()[0]
    assert re.search(r"^\|.*\d+\.\d+ ?(s|MB/s|MiB|MB)\b", md, re.M), md
    summary = (results / "summary.md").read_text()
    assert md.strip() in summary
    assert "FAILED" not in summary
    assert not mounts_under(results.parent) and not mounts_under(cache)


def test_smoke_is_refused_for_a_suite_without_a_smoke_form(tmp_path: Path) -> None:
    """e2e and robust have no smoke form: ``--smoke`` naming them (or all suites) exits 2
    before any suite runs, saying which and what to do, rather than running their quick form
    under a smoke label."""
    for suites, lacking in ((["ckpt", "e2e"], "e2e"), ([], "e2e, robust")):
        run = subprocess.run(
            [*BENCH, *suites, "--smoke", "--results", str(tmp_path / "results")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
        )
        assert run.returncode == 2, run.stdout + run.stderr
        assert f"--smoke: no smoke form for {lacking}; name suites" in run.stderr, run.stderr
        assert "or use --quick" in run.stderr
        assert "bootseer bench: ckpt (" not in run.stdout  # nothing ran
        assert not (tmp_path / "results").exists()


def test_a_failed_suite_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    need(None if os.geteuid() == 0 else "the benchmark suites need root")
    not_a_dir = tmp_path / "cache-is-a-file"
    not_a_dir.write_text("not a directory\n")
    results = tmp_path / "results"
    run = subprocess.run(
        [*BENCH, "--quick", "--results", str(results)],
        env={**os.environ, "BOOTSEER_BENCH_CACHE": str(not_a_dir)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )

    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    summary = (results / "summary.md").read_text()
    for suite in SUITES:  # each ran (after the ones before it failed), each failed for real
        assert f"bootseer bench: {suite} (python benchmarks/bench_{suite}.py" in run.stdout
        assert f"bootseer bench: {suite} FAILED: exit 1; its last output lines:" in run.stderr
        assert f"## {suite}: FAILED (exit 1)" in summary
    block = run.stderr.split("bootseer bench: striped FAILED")[1].split("bootseer bench: ckpt")[0]
    assert str(not_a_dir) in block and "FileExistsError" in block  # the why, in its tail
    assert f"0 of {len(SUITES)} suites wrote their results" in run.stdout


def test_sigterm_stops_the_running_suite_and_its_process_group(tmp_path: Path) -> None:
    need(missing_for("striped"))
    results = tmp_path / "results"
    proc = subprocess.Popen(
        [
            *BENCH,
            "striped",
            "ckpt",
            "--quick",
            "--results",
            str(results),
            "--cache",
            str(tmp_path / "cache"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    pgid = None
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:  # until the suite has started its servers
            lines.append(line)
            if "== 1. unshaped ceiling" in line:
                break
        # the suite: the harness's child (its forked helpers share its command line)
        suite = [
            pid
            for pid in processes_mentioning(f"bench_striped.py --results {results}")
            if parent_of(pid) == proc.pid
        ]
        assert len(suite) == 1, "".join(lines)
        pgid = os.getpgid(suite[0])
        assert pgid == suite[0] != os.getpgid(proc.pid)  # in a session of its own
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=400)
    finally:
        for group in (proc.pid, pgid):
            if group is not None and group_pids(group):
                os.killpg(group, signal.SIGKILL)
        proc.wait()
    output = "".join(lines) + rest

    assert proc.returncode == 130, output[-4000:]
    assert "interrupted; stopping bench_striped.py" in output
    assert "interrupted: everything started has been stopped and removed" in output  # its own
    deadline = time.monotonic() + 10  # the group was killed; let the kernel reap it
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_pids(pgid)
    assert not processes_mentioning(str(tmp_path))
    assert not mounts_under(tmp_path)
    summary = (results / "summary.md").read_text()
    assert "## striped: FAILED (interrupted" in summary
    assert "## ckpt: not run (interrupted)" in summary
    assert "bootseer bench: ckpt (" not in output


def test_results_count_only_when_this_run_wrote_them(tmp_path: Path) -> None:
    """A suite that exits 0 without writing (the old re-exec bug) or leaves an earlier run's
    files in place has failed: the files are checked against their state before the run."""
    (tmp_path / "snapshot.json").write_text('{"quick": true}\n')
    (tmp_path / "snapshot.md").write_text("# snapshot benchmark\n")
    before = results_state(tmp_path, "snapshot")
    assert "left from an earlier run" in missing_results(tmp_path, "snapshot", before)
    assert missing_results(tmp_path, "prefetch", {}) == "it wrote no prefetch.json"

    # rewritten (other sizes: the check does not rest on the clock's resolution)
    (tmp_path / "snapshot.json").write_text('{"quick": true, "runs": {}}\n')
    (tmp_path / "snapshot.md").write_text("# snapshot benchmark (quick run)\n")
    assert missing_results(tmp_path, "snapshot", before) is None
    (tmp_path / "snapshot.json").write_text("[1, 2]")
    assert missing_results(tmp_path, "snapshot", {}) == "snapshot.json is not a JSON object"
    (tmp_path / "snapshot.json").write_text('{"cut off')
    assert "is not valid JSON" in missing_results(tmp_path, "snapshot", {})


@pytest.mark.parametrize(
    "script", ["bench_snapshot.py", "bench_prefetch.py", "bench_containerd.py"]
)
def test_a_suite_called_with_measured_libraries_loaded_reruns_itself(script: str) -> None:
    """Its ``main()`` in a process that has imported what it measures re-executes the same
    script in a fresh interpreter (it once started ``_common.py`` instead: no results, exit 0)."""
    code = (
        f"import sys, runpy, numpy; sys.argv = [{script!r}, '--help']; "
        f"runpy.run_path('benchmarks/{script}', run_name='__main__')"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"re-running {script} in a fresh interpreter" in run.stdout
    assert f"usage: {script}" in run.stdout  # the script's own parser answered


@pytest.mark.timeout(300)
def test_ckpt_ranks_stop_when_their_rendezvous_port_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The port bench_ckpt picked was taken before rank 0 bound it (another process on a busy
    CI machine): rank 0 fails with EADDRINUSE, and the other ranks used to wait for it for
    torch's 30-minute rendezvous timeout. Now they are stopped and the phase is tried again on
    another port; here the port is taken every time, so the phase fails, naming why."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_ckpt

    with socket.socket() as holder:  # a real listener on the port every attempt is given
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        monkeypatch.setattr(bench_ckpt, "free_port", lambda: holder.getsockname()[1])
        cfg = {**bench_ckpt.QUICK, "dir": str(tmp_path), "out": str(tmp_path / "out")}
        with pytest.raises(RuntimeError, match="its rendezvous port was taken each time"):
            bench_ckpt.launch("local", 2, cfg, tmp_path)

    out = capsys.readouterr()
    assert out.out.count("again on another port") == bench_ckpt.PORT_TRIES - 1
    assert out.err.count("EADDRINUSE") >= bench_ckpt.PORT_TRIES  # each rank 0's own error
    assert not processes_mentioning(str(tmp_path))  # no rank left waiting


@pytest.mark.timeout(300)
def test_restart_suite_fails_when_a_takeover_fails(
    tmp_path: Path, bench_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A successor that did not take the held connection over (injected: the second one's log
    is read as not saying so) fails the run: exit 1, the error and a FAIL row in its results,
    and still nothing left running or mounted."""
    need(missing_for("restart"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_restart

    real = bench_restart.Node.took_over
    calls = []

    def second_fails(node: Any) -> bool:
        calls.append(real(node))  # the real answer, kept to show the run itself was sound
        return calls[-1] and len(calls) != 2

    monkeypatch.setattr(bench_restart.Node, "took_over", second_fails)
    monkeypatch.setenv("BOOTSEER_BENCH_CACHE", str(bench_cache))  # short: unix socket paths
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    code = bench_restart.main(["--results", str(tmp_path / "results"), "--repeat", "1"])

    assert code == 1
    assert calls == [True, True]  # one SIGTERM and one SIGKILL round, both real takeovers
    report = json.loads((tmp_path / "results" / "restart.json").read_text())
    assert report["takeovers"] == {"rounds": 2, "succeeded": 1, "listing_equal": 2}
    assert [r["took_over"] for s in report["signals"].values() for r in s["rounds"]] == [
        True,
        False,
    ]
    assert report["errors"] and "1 takeover(s) failed" in report["errors"][0]
    md = (tmp_path / "results" / "restart.md").read_text()
    assert re.search(r"^\| takeovers of the held connection +\| 1 of 2 .*\| FAIL", md, re.M), md
    assert "- ERROR: 1 takeover(s) failed" in md
    assert not processes_mentioning(str(bench_cache))
    assert not mounts_under(bench_cache)
    assert not list(bench_cache.glob("restart-run-*"))  # its work directory removed
