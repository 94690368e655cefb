"""FUSE mount benchmark: what writing through ``bootseer fs mount`` costs, big files and small.

One run mounts a striped store (``--store file``: striped::file:// in a temporary directory;
``--store s3``: striped::s3:// on a moto server in its own process) and measures, each
``--repeat`` times (the median is reported):

1. ``dd`` of a ``--size`` random file into the mount (bs=1M; the time includes close(), which
   commits), and ``dd`` of it back out (the backing files are in the page cache);
2. ``rsync -a`` of ``--files`` small files (``--file-size`` each) into the mount, then again
   on the unchanged tree (what a second rsync costs: nothing to send when mtimes are kept);
3. ``touch f && cat f`` per file, the latency of one create-commit-lookup-read.

The same dd and rsync into a plain local directory are the floor. Every copy is checked:
the bytes read back through the mount equal the source. The mount runs the code on
PYTHONPATH (else this checkout's), so the same script measures another tree
(``PYTHONPATH=/old/tree``); the tree measured is printed.

``python benchmarks/bench_fuse.py [--store file|s3] [--size 256MiB] [--files 300]
[--repeat 3] [--results DIR]``; needs root (FUSE), rsync and dd. Everything it starts (mount,
moto, temporary directory) is removed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    ROOT,
    command_line,
    log,
    md_table,
    sigterm_as_interrupt,
    source_state,
)

MiB = 1 << 20


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": MiB, "gib": 1 << 30}
    for unit, factor in units.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _run(*cmd: str, timeout: float = 1800, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode not in ok:
        raise RuntimeError(f"{' '.join(cmd[:3])}... exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def _timed(fn: Callable[[], Any], repeat: int, before: Callable[[int], Any] | None = None
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


def _code_env() -> dict[str, str]:
    """The mount runs the tree on PYTHONPATH, else this checkout's (from a neutral working
    directory: ``python -m`` would otherwise import whatever tree the caller stands in)."""
    return {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}


def measured_tree(cwd: Path) -> str:
    r = subprocess.run([sys.executable, "-c", "import striped_fs; print(striped_fs.__file__)"],
                       capture_output=True, text=True, env=_code_env(), cwd=cwd, check=True)
    return str(Path(r.stdout.strip()).parents[1])


@contextlib.contextmanager
def _mounted(url: str, mnt: Path, options: dict[str, Any], log_file: Path) -> Iterator[None]:
    from striped_fs.fuse import unmount, wait_mounted

    with open(log_file, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bootseer", "fs", "mount", url, str(mnt), "--foreground",
             "--storage-options", json.dumps(options)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=_code_env(),
            cwd=mnt.parent)
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


def measure(args: argparse.Namespace, work: Path, target: Path, label: str) -> dict[str, Any]:
    """dd in/out, rsync twice and touch+cat into ``target`` (a mount or a local directory)."""
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

    src = work / "small"
    codes: list[int] = []
    run = {"i": 0}  # each timed first run goes to a directory of its own (no deletes timed)

    def rsync(dst: Path) -> None:  # 23 (some attributes not set): the old mount's failure
        codes.append(_run("rsync", "-a", f"{src}/", f"{dst}/", ok=(0, 23)).returncode)

    t, _ = _timed(lambda: rsync(target / f"small{run['i']}"), args.repeat,
                  before=lambda i: run.update(i=i))
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
        r = _run("sh", "-c", 'cd "$1" && i=0 f=0; while [ $i -lt "$2" ]; do { touch t$i && '
                             'cat t$i; } 2>/dev/null || f=$((f+1)); i=$((i+1)); done; echo $f',
                 "sh", str(tc), str(args.files))
        failures.append(int(r.stdout.split()[-1]))

    t, _ = _timed(touch_cat, args.repeat, before=lambda i: run.update(i=i))
    out["touch_cat_ms"] = round(t / args.files * 1000, 2)
    out["touch_cat_failed"] = f"{sum(failures)} of {args.files * args.repeat}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_fuse.py", description=__doc__.split("\n")[0])
    parser.add_argument("--store", choices=["file", "s3"], default="file")
    parser.add_argument("--size", type=_size, default=256 * MiB, help="dd file size (256MiB)")
    parser.add_argument("--files", type=int, default=300, help="small files for rsync (300)")
    parser.add_argument("--file-size", type=_size, default=4096, help="their size (4096)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--results", help="directory for fuse-<store>.json/.md")
    args = parser.parse_args(argv)
    for tool in ("rsync", "dd"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (scripts/system-packages installs it)")
    work = Path(tempfile.mkdtemp(prefix="bench-fuse-"))
    result: dict[str, Any] = {"command": command_line("bench_fuse.py"),
                              "source": source_state(["striped_fs", "bootseer/cli"]),
                              "pythonpath": os.environ.get("PYTHONPATH", ""),
                              "store": args.store, "size": args.size, "files": args.files,
                              "file_size": args.file_size, "repeat": args.repeat}
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            (work / "big.bin").write_bytes(os.urandom(args.size))
            _small_tree(work / "small", args.files, args.file_size)
            (work / "local").mkdir()
            log("floor: a plain local directory")
            result["local"] = measure(args, work, work / "local", "local directory")
            shutil.rmtree(work / "local")
            if args.store == "s3":
                from bootseer.testing.servers import MotoS3Server

                server = MotoS3Server(in_process=False)
                stack.callback(server.close)
                server.start()
                server.create_bucket("bench-fuse")
                url, options = "s3://bench-fuse", {"s3": server.storage_options()}
            else:
                (work / "store").mkdir()
                url, options = str(work / "store"), {}
            (work / "mnt").mkdir()
            result["measured_tree"] = measured_tree(work)
            log(f"the mount runs the code in {result['measured_tree']}")
            stack.enter_context(_mounted(url, work / "mnt", options, work / "mount.log"))
            log(f"the mount: bootseer fs mount {url}")
            result["mount"] = measure(args, work, work / "mnt", f"mount of striped {args.store}")
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if work.name.startswith("bench-fuse-") and work.parent == Path(tempfile.gettempdir()):
            shutil.rmtree(work, ignore_errors=True)
    m, loc = result["mount"], result["local"]
    keys = ["dd_write_mb_s", "dd_read_mb_s", "rsync_first_s", "rsync_first_files_s",
            "rsync_again_s", "rsync_exit_codes", "touch_cat_ms", "touch_cat_failed"]
    rows = [[k, str(m[k]), str(loc[k])] for k in keys]
    lines = [f"`{result['command']}` (code: {result['measured_tree']})", "",
             *md_table(["metric", m["target"], "local directory"], rows)]
    print("\n".join(lines))
    if args.results:
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"fuse-{args.store}.json").write_text(json.dumps(result, indent=2))
        (out / f"fuse-{args.store}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
