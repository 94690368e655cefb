"""Snapshotter restart benchmark: how long readers of the lazy mount wait while the snapshotter
restarts (docs/containerd.md, "Restarts and upgrades").

One node-like set-up, no registry or containerd needed: ``bootseer snapshotter`` on a private
root (it mounts ``ROOT/lazy`` and starts its FUSE holder), then per round: the snapshotter is
stopped (``SIGTERM`` or ``SIGKILL``), a reader lists ``ROOT/lazy`` (the mount's root is never
cached by the kernel, so the listing waits for a server), a new snapshotter is started on the
same root and takes the connection over from the holder. Measured per round:

* ``gap``: from the signal to the reader's listing returning (what a running container sees);
* ``start``: from the new process's start to its socket serving gRPC (what containerd sees).

``python benchmarks/bench_restart.py [--repeat N]`` prints the medians and each round; the
machine's load average is printed with them (two busy CPUs make every figure higher). Run as
root (FUSE). Everything lives in a private temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _start(root: Path, address: str, log: Path) -> tuple[subprocess.Popen, float]:
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bootseer", "snapshotter", "--root",
                                 str(root), "--address", address, "--no-push-profiles",
                                 "--no-prefetch"], stdout=out, stderr=out,
                                start_new_session=True)
    while not os.path.exists(address):
        if proc.poll() is not None or time.monotonic() - started > 120:
            raise RuntimeError(f"the snapshotter did not start:\n{log.read_text()}")
        time.sleep(0.005)
    return proc, time.monotonic() - started


def _round(root: Path, address: str, log: Path, proc: subprocess.Popen, sig: int
           ) -> tuple[subprocess.Popen, float, float]:
    lazy = root / "lazy"
    done: list[float] = []
    stopped = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=60)
    if os.path.exists(address):  # a killed process leaves its socket behind
        os.unlink(address)
    reader = threading.Thread(target=lambda: (os.listdir(lazy), done.append(time.monotonic())))
    reader.start()
    new, start_s = _start(root, address, log)
    reader.join(timeout=120)
    if not done:
        raise RuntimeError(f"the reader never got an answer:\n{log.read_text()}")
    return new, done[0] - stopped, start_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bootseer-restart-bench-"))
    root, address, log = tmp / "root", str(tmp / "run" / "sn.sock"), tmp / "sn.log"
    proc = None
    try:
        proc, first_s = _start(root, address, log)
        print(f"first start (mount new): {first_s:.3f} s")
        results: dict[str, list[tuple[float, float]]] = {"SIGTERM": [], "SIGKILL": []}
        for _ in range(args.repeat):
            for name, sig in (("SIGTERM", signal.SIGTERM), ("SIGKILL", signal.SIGKILL)):
                proc, gap, start_s = _round(root, address, log, proc, sig)
                results[name].append((gap, start_s))
        load = os.getloadavg()[0]
        for name, rounds in results.items():
            gaps, starts = [g for g, _ in rounds], [s for _, s in rounds]
            print(f"{name}: readers waited {statistics.median(gaps):.3f} s (median of "
                  f"{', '.join(f'{g:.3f}' for g in gaps)}); new process serving after "
                  f"{statistics.median(starts):.3f} s (median)")
        print(f"load average {load:.2f} on {os.cpu_count()} CPUs; taken over "
              f"{log.read_text().count('taking over the lazy mount')} times")
        return 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        from striped_fs.fuse import is_mounted, unmount

        if is_mounted(root / "lazy"):
            unmount(root / "lazy", lazy=True)  # the holder lets go and exits (idle)
        if tmp.name.startswith("bootseer-restart-bench-"):  # the directory made above
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
