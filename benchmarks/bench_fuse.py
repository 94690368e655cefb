"""FUSE mount benchmark: what writing through ``bootseer fs mount`` costs, big files and small.

One run measures a plain local directory (the peer), then a mount of each striped store
(``--stores file,s3``: striped::file:// in the run's work directory, and striped::s3:// on a
moto server in its own process, unshaped), each ``--repeat`` times (medians reported):

1. ``dd`` of a ``--size`` random file into the target (bs=1M; the time includes close(),
   which commits), and ``dd`` of it back out (the backing files are in the page cache);
2. ``rsync -a`` of ``--files`` small files (``--file-size`` each) into the target, then again
   on the unchanged tree (what a second rsync costs: nothing to send when mtimes are kept);
3. ``touch f && cat f`` per file, the latency of one create-commit-lookup-read.

Every copy is checked: the bytes read back equal the source, and a failed ``touch && cat``
or an rsync that did not exit 0 fails the run's verdict. The mount runs the code on
PYTHONPATH (else this checkout's), so the same script measures another tree
(``PYTHONPATH=/old/tree``); the tree measured is printed.

``python benchmarks/bench_fuse.py --results DIR [--quick] [--stores file,s3] [--size 256MiB]
[--files 300] [--repeat 3]`` or ``bootseer bench fuse [--quick]``; writes ``DIR/fuse.json``
and ``DIR/fuse.md``. ``--quick``: 16 MiB, 40 files (10 on S3), one run each, a smoke run of
seconds. Needs root (FUSE), rsync and dd. The work directory is made under
``~/.cache/bootseer-bench`` (``BOOTSEER_BENCH_CACHE``); it, the mounts and moto are removed on
exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_smoke_flag,
    code_env,
    command_line,
    final_table,
    log,
    run_bench,
    smoke_implies_quick,
    source_state,
    verdict,
    work_dir,
)

MiB = 1 << 20


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": MiB, "gib": 1 << 30}
    for unit, factor in units.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _run(
    *cmd: str, timeout: float = 1800, ok: tuple[int, ...] = (0,)
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode not in ok:
        raise RuntimeError(f"{' '.join(cmd[:3])}... exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def _timed(
    fn: Callable[[], Any], repeat: int, before: Callable[[int], Any] | None = None
) -> tuple[float, list[float]]:
    """Median and all wall times of ``fn`` (``before(i)`` runs untimed first)."""
    times = []
    for i in range(repeat):
        if before is not None:
            before(i)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def measured_tree(cwd: Path) -> str:
    r = subprocess.run(
        [sys.executable, "-c", "import striped_fs; print(striped_fs.__file__)"],
        capture_output=True,
        text=True,
        env=code_env(),
        cwd=cwd,
        check=True,
    )
    return str(Path(r.stdout.strip()).parents[1])


@contextlib.contextmanager
def _mounted(url: str, mnt: Path, options: dict[str, Any], log_file: Path) -> Iterator[None]:
    from striped_fs.fuse import unmount, wait_mounted

    with open(log_file, "ab") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bootseer",
                "fs",
                "mount",
                url,
                str(mnt),
                "--foreground",
                "--storage-options",
                json.dumps(options),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=code_env(),
            cwd=mnt.parent,
        )
    try:
        wait_mounted(mnt, 60, proc)
        yield
    finally:
        with contextlib.suppress(Exception):
            unmount(mnt, timeout=30)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        with contextlib.suppress(Exception):
            unmount(mnt, lazy=True)


def _small_tree(src: Path, files: int, size: int) -> None:
    rng = os.urandom
    for i in range(files):
        d = src / f"d{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}").write_bytes(rng(size))
        # an older tree than the copy (as sources are): a copy that does not keep the time
        # differs from it even at rsync's one-second granularity
        os.utime(d / f"f{i:05d}", ns=(1_000_000_000_123_456_789,) * 2)


def _same_tree(a: Path, b: Path) -> bool:
    for p in a.rglob("*"):
        if p.is_file() and p.read_bytes() != (b / p.relative_to(a)).read_bytes():
            return False
    return True


def measure(
    args: argparse.Namespace, work: Path, src: Path, target: Path, label: str
) -> dict[str, Any]:
    """dd in/out, rsync of the tree ``src`` twice and touch+cat into ``target`` (a mount or a
    local directory)."""
    out: dict[str, Any] = {"target": label}
    big = work / "big.bin"
    back = work / "back.bin"

    def dd_in() -> None:
        _run("dd", f"if={big}", f"of={target / 'big.bin'}", "bs=1M")

    def dd_out() -> None:
        _run("dd", f"if={target / 'big.bin'}", f"of={back}", "bs=1M")

    t, all_t = _timed(dd_in, args.repeat)
    out["dd_write_mb_s"] = round(args.size / t / 1e6, 1)
    out["dd_write_s"] = [round(x, 3) for x in all_t]
    t, all_t = _timed(dd_out, args.repeat)
    out["dd_read_mb_s"] = round(args.size / t / 1e6, 1)
    out["dd_read_s"] = [round(x, 3) for x in all_t]
    if back.read_bytes() != big.read_bytes():
        raise RuntimeError(f"{label}: the file read back differs from the one written")
    back.unlink()

    codes: list[int] = []
    run = {"i": 0}  # each timed first run goes to a directory of its own (no deletes timed)

    def rsync(dst: Path) -> None:  # 23 (some attributes not set): the old mount's failure
        codes.append(_run("rsync", "-a", f"{src}/", f"{dst}/", ok=(0, 23)).returncode)

    t, _ = _timed(
        lambda: rsync(target / f"small{run['i']}"), args.repeat, before=lambda i: run.update(i=i)
    )
    out["rsync_first_s"] = round(t, 3)
    out["rsync_first_files_s"] = round(args.files / t, 1)
    last = target / f"small{run['i']}"
    t, _ = _timed(lambda: rsync(last), args.repeat)
    out["rsync_again_s"] = round(t, 3)
    out["rsync_exit_codes"] = codes
    if not _same_tree(src, last):
        raise RuntimeError(f"{label}: the rsync'ed tree differs from its source")
    failures: list[int] = []

    def touch_cat() -> None:  # failures are counted: the old mount lost about half
        tc = target / f"tc{run['i']}"
        tc.mkdir()
        r = _run(
            "sh",
            "-c",
            'cd "$1" && i=0 f=0; while [ $i -lt "$2" ]; do { touch t$i && '
            "cat t$i; } 2>/dev/null || f=$((f+1)); i=$((i+1)); done; echo $f",
            "sh",
            str(tc),
            str(args.files),
        )
        failures.append(int(r.stdout.split()[-1]))

    t, _ = _timed(touch_cat, args.repeat, before=lambda i: run.update(i=i))
    out["touch_cat_ms"] = round(t / args.files * 1000, 2)
    out["touch_cat_failed"] = f"{sum(failures)} of {args.files * args.repeat}"
    return out


STORES = ("file", "s3")
FULL = {"size": 256 * MiB, "files": 300, "repeat": 3}
QUICK = {"size": 16 * MiB, "files": 40, "repeat": 1}
QUICK_S3_FILES = 10  # a file over moto costs ~0.3 s to rsync on 2 cores: keep the smoke run short
WORK_PREFIX = "fuse-run-"


class Bench:
    """One run: the local directory, then each store's mount (``run_bench``'s protocol)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = smoke_implies_quick(args)
        self.quick = bool(args.quick)
        self.stores = [s for s in args.stores.split(",") if s]
        bad = [s for s in self.stores if s not in STORES]
        if bad or not self.stores:
            raise SystemExit(
                f"bench_fuse.py: --stores {args.stores!r}: each must be one of "
                f"{', '.join(STORES)} (comma-separated)"
            )
        base = QUICK if self.quick else FULL
        self.size = args.size or base["size"]
        self.files = args.files or base["files"]
        self.repeat = args.repeat or base["repeat"]
        self.results_dir = Path(args.results)
        self.stack = contextlib.ExitStack()
        self.errors: list[str] = []
        self.R: dict[str, Any] = {
            "suite": "fuse",
            "quick": self.quick,
            "smoke": self.smoke,
            "command": command_line("bench_fuse.py"),
            "source": source_state(["striped_fs", "bootseer/cli", "benchmarks/bench_fuse.py"]),
            "pythonpath": os.environ.get("PYTHONPATH", ""),
            "machine": {"cpus": os.cpu_count()},
            "config": {
                "stores": self.stores,
                "size": self.size,
                "files": self.files,
                "file_size": args.file_size,
                "repeat": self.repeat,
            },
            "stores": {},
            "errors": self.errors,
        }

    def _files_for(self, store: str) -> int:
        if self.quick and store == "s3" and not self.args.files:
            return QUICK_S3_FILES
        return self.files

    def run(self) -> None:
        work = work_dir(WORK_PREFIX, self.stack)  # a file at the cache: FileExistsError, exit 1
        log(
            f"bench fuse: {'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run; dd {self.size // MiB} MiB, "
            f"{self.files} files of {self.args.file_size} B, repeat {self.repeat}; "
            f"stores {', '.join(self.stores)}; work {work}"
        )
        (work / "big.bin").write_bytes(os.urandom(self.size))
        self.R["measured_tree"] = measured_tree(work)
        log(f"the mount runs the code in {self.R['measured_tree']}")
        for store in self.stores:
            files = self._files_for(store)
            src = work / f"small-{files}"
            if not src.exists():
                _small_tree(src, files, self.args.file_size)
            local = work / f"local-{store}"
            local.mkdir()
            log(f"peer: a plain local directory ({files} files)")
            peer = measure(self._params(files), work, src, local, "local directory")
            shutil.rmtree(local)
            if store == "s3":
                from bootseer.testing.servers import MotoS3Server

                server = MotoS3Server(in_process=False)
                self.stack.callback(server.close)
                server.start()
                server.create_bucket("bench-fuse")
                url, options = "s3://bench-fuse", {"s3": server.storage_options()}
            else:
                (work / "store").mkdir()
                url, options = str(work / "store"), {}
            mnt = work / f"mnt-{store}"
            mnt.mkdir()
            log(f"the mount: bootseer fs mount {url} ({files} files)")
            with _mounted(url, mnt, options, work / "mount.log"):
                ours = measure(self._params(files), work, src, mnt, f"mount of striped {store}")
            self.R["stores"][store] = {"url": url, "files": files, "mount": ours, "local": peer}

    def _params(self, files: int) -> argparse.Namespace:
        return argparse.Namespace(size=self.size, files=files, repeat=self.repeat)

    def rows(self) -> list[list[str]]:
        out: list[list[str]] = []
        for store, r in self.R["stores"].items():
            m, p, n = r["mount"], r["local"], r["files"]
            tc_total = n * self.repeat
            out += [
                [
                    f"{store}: dd write into the mount, MB/s",
                    f"{m['dd_write_mb_s']:.1f}",
                    f"local {p['dd_write_mb_s']:.1f}",
                    "-",
                    "info",
                ],
                [
                    f"{store}: dd read back, MB/s",
                    f"{m['dd_read_mb_s']:.1f}",
                    f"local {p['dd_read_mb_s']:.1f}",
                    "bytes equal",
                    "pass",
                ],
                [
                    f"{store}: rsync -a of {n} files, first, s",
                    f"{m['rsync_first_s']:.3f}",
                    f"local {p['rsync_first_s']:.3f}",
                    "rsync exits 0",
                    verdict(all(c == 0 for c in m["rsync_exit_codes"])),
                ],
                [
                    f"{store}: the same rsync again, unchanged tree, s",
                    f"{m['rsync_again_s']:.3f}",
                    f"local {p['rsync_again_s']:.3f}",
                    f"< first ({m['rsync_first_s']:.3f} s)",
                    verdict(m["rsync_again_s"] < m["rsync_first_s"]),
                ],
                [
                    f"{store}: touch f && cat f, ms per file",
                    f"{m['touch_cat_ms']:.2f}",
                    f"local {p['touch_cat_ms']:.2f}",
                    f"0 of {tc_total} fail",
                    verdict(m["touch_cat_failed"] == f"0 of {tc_total}"),
                ],
            ]
        return out

    def report(self) -> None:
        table = final_table(self.R, self.rows())
        if self.quick:
            self.R.setdefault("warnings", []).append(
                "--quick: small sizes, one run each: a smoke test, not the figures"
            )
        self.write_files(table)

    def write_files(self, table: list[str] | None = None) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.R["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        (self.results_dir / "fuse.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )
        src = self.R["source"]
        md = [
            f"# FUSE mount benchmark ({'quick, smoke' if self.smoke else 'quick' if self.quick else 'full'} run)",
            "",
            f"- command: `{self.R['command']}` ({self.R['finished']})",
            f"- code measured: {self.R.get('measured_tree', '?')}, commit "
            f"{src.get('commit', '?')[:12]}"
            + (
                f", local changes in {', '.join(src['local_changes'])}"
                if src.get("local_changes")
                else ""
            ),
            f"- dd: {self.size // MiB} MiB, bs=1M; rsync and touch+cat: files of "
            f"{self.args.file_size} B; {self.repeat} run(s) each, medians; S3: moto, unshaped",
            "",
            *(table or ["(no results: the run failed before its report)"]),
        ]
        md += [f"- WARNING: {w}" for w in self.R.get("warnings", [])]
        md += [f"- ERROR: {e}" for e in self.errors]
        (self.results_dir / "fuse.md").write_text("\n".join(md) + "\n")
        log(f"wrote {self.results_dir / 'fuse.json'} and {self.results_dir / 'fuse.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_fuse.py", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench-results", help="directory for fuse.json/.md")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 MiB, 40 files (10 on S3), one run each: a smoke run",
    )
    parser.add_argument("--stores", default=",".join(STORES), help="file,s3 (both)")
    parser.add_argument("--size", type=_size, help="dd file size (256MiB; quick 16MiB)")
    parser.add_argument("--files", type=int, help="small files for rsync (300; quick 40)")
    parser.add_argument("--file-size", type=_size, default=4096, help="their size (4096)")
    parser.add_argument("--repeat", type=int, help="runs of each measure (3; quick 1)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    for tool in ("rsync", "dd"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (scripts/system-packages installs it)")
    bench = Bench(args)
    return run_bench(bench, done_key="final_table", report_inside=False, log_fn=log)


if __name__ == "__main__":
    sys.exit(main())
