"""Lazy environments: what ``import`` reads of an environment, and how soon it runs, lazily.

One environment (full: torch==2.13.0 CPU + numpy; ``--quick``: numpy alone, a smoke run, not
the figures) is built once with ``bootseer env create`` at a build prefix P and published to a
local store; P is then removed (a lazy mount cannot be relocated, so every method serves P).
Each method, after ``sync; echo 3 > drop_caches`` (root), into an empty P, from start until
``P/bin/python -c IMPORT`` exits 0:

* ``restore``: ``bootseer env restore KEY --prefix P`` (CLI), then the import;
* ``lazy-first``: ``mount_lazy`` with an empty chunk cache and no read profile (the profile is
  recorded by this start), the background fetch of the rest on, then the import;
* ``lazy-profiled``: the same with the profile ``lazy-first`` stored, another empty cache;
* ``lazy-on-demand``: an empty cache, no prefetch at all: the bytes fetched are what the
  import reads, at chunk granularity (the figure the <= 40% target is about); "read" is the
  file bytes the kernel asked the mount for (the import's reads and their readahead).

Printed and written (``DIR/env_lazy.json``, ``DIR/env_lazy.md``): the environment's size
(tar-stream bytes, stored bytes, chunks), per method the time to mount (or restore), to the
import's end, and the bytes fetched from the store when the import ended, against the size.
Figures are taken under the lead's load gate (``../shared/bin/quiet -- ...``), not here.

``python benchmarks/bench_env_lazy.py --results DIR [--quick] [--cache DIR] [--keep]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from _common import download_wheels, drop_caches, log, md_table, run_checked  # noqa: E402

TORCH = "torch==2.13.0"
MB = 1e6
METHODS = ("restore", "lazy-first", "lazy-profiled", "lazy-on-demand")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(Path.home())}
    env["PYTHONPATH"] = str(_ROOT)
    return {**env, **(extra or {})}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = bool(args.quick)
        cache = args.cache or os.environ.get("BOOTSEER_BENCH_CACHE") or "~/.cache/bootseer-bench"
        self.cache = Path(cache).expanduser().resolve()
        self.work = self.cache / "env-lazy-run"
        self.results = Path(args.results)
        self.import_code = "import numpy" if self.quick else "import torch, numpy"
        self.R: dict[str, Any] = {"quick": self.quick, "import": self.import_code, "runs": {}}
        self.bootseer = [sys.executable, "-m", "bootseer"]

    def run(self) -> None:
        from bootseer.testing.pypi import PackageIndex, installer_env

        reqs = ["numpy"] if self.quick else [TORCH, "numpy"]
        wheels = download_wheels(
            self.cache / ("wheels-lazy-quick" if self.quick else "wheels-lazy"), reqs
        )
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        self.prefix = self.work / "venv"
        self.store = str(self.work / "store")
        self.R["cold"] = os.geteuid() == 0
        with PackageIndex(wheels[0].parent) as index:
            req = self.work / "requirements.txt"
            req.write_text(f"--index-url {index.url}\n" + "".join(f"{r}\n" for r in reqs))
            log(f"building the environment ({', '.join(reqs)}) with `bootseer env create`")
            out = run_checked(
                [*self.bootseer, "env", "create", "--spec", str(req), "--prefix", str(self.prefix),
                 "--store", self.store, "--json"],
                env=installer_env(self.work / "pipcache", base=clean_env()),
                what="bootseer env create",
            )  # fmt: skip
        self.key = json.loads(out.stdout)["key"]
        from snapshot import SnapshotStore

        manifest = SnapshotStore(self.store).require_manifest(self.key)
        self.R["env"] = {
            "key": self.key,
            "files": manifest.files,
            "stream_bytes": manifest.stream_size,
            "stored_bytes": sum(c.size for c in manifest.chunks),
            "chunks": len(manifest.chunks),
            "chunk_raw_bytes": max(c.raw_size for c in manifest.chunks),
        }
        log(
            f"environment {self.key}: {manifest.files} files, {manifest.stream_size / MB:.0f} MB "
            f"({sum(c.size for c in manifest.chunks) / MB:.0f} MB stored) in {len(manifest.chunks)} chunks"
        )
        shutil.rmtree(self.prefix)
        for method in METHODS:
            self.R["runs"][method] = self.measure(method)
            self.clear_prefix()

    def clear_prefix(self) -> None:
        from snapshot import unmount_lazy

        unmount_lazy(self.prefix, lazy=True)
        shutil.rmtree(self.prefix, ignore_errors=True)

    def import_once(self) -> float:
        t0 = time.perf_counter()
        subprocess.run(
            [str(self.prefix / "bin/python"), "-c", self.import_code],
            check=True,
            env=clean_env({"PYTHONPATH": ""}),
            timeout=600,
        )
        return time.perf_counter() - t0

    def measure(self, method: str) -> dict[str, Any]:
        from snapshot import mount_lazy

        cold = drop_caches()
        log(f"{method}: {'cold' if cold else 'WARM (not root)'} page cache")
        t0 = time.perf_counter()
        row: dict[str, Any] = {"cold": cold}
        if method == "restore":
            run_checked(
                [*self.bootseer, "env", "restore", self.key, "--prefix", str(self.prefix),
                 "--store", self.store],
                env=clean_env(),
                what="bootseer env restore",
            )  # fmt: skip
            row["ready_s"] = time.perf_counter() - t0
            row["import_s"] = self.import_once()
            row["fetched_bytes"] = self.R["env"]["stored_bytes"]
        else:
            cache = self.work / f"cache-{method}"
            m = mount_lazy(
                self.store,
                self.key,
                self.prefix,
                cache_dir=cache,
                prefetch=method != "lazy-on-demand",
                record="always" if method == "lazy-first" else "never",
            )
            row["ready_s"] = time.perf_counter() - t0
            row["import_s"] = self.import_once()
            time.sleep(0.3)  # the mount writes its statistics every 0.2 s
            stats = m.stats()
            final = m.close()
            row["fetched_bytes"] = stats.get("bytes_fetched", 0)
            row["read_chunks"] = stats.get("chunks_read", 0)
            row["served_bytes"] = stats.get("bytes_served", 0)  # what the import read
            row["profile_chunks"] = (final.get("profile") or {}).get("chunks")
            row["stats"] = final
        row["total_s"] = row["ready_s"] + row["import_s"]
        row["fetched_ratio"] = row["fetched_bytes"] / self.R["env"]["stored_bytes"]
        log(
            f"{method}: ready {row['ready_s']:.2f}s, import {row['import_s']:.2f}s, fetched "
            f"{row['fetched_bytes'] / MB:.0f} MB ({100 * row['fetched_ratio']:.0f}% of the stored env)"
        )
        return row

    def report(self) -> None:
        env = self.R["env"]
        rows = [
            [
                m,
                f"{r['ready_s']:.2f}",
                f"{r['import_s']:.2f}",
                f"{r['total_s']:.2f}",
                f"{r['fetched_bytes'] / MB:.0f} MB ({100 * r['fetched_ratio']:.0f}%)",
                f"{r['served_bytes'] / MB:.0f} MB ({100 * r['served_bytes'] / env['stream_bytes']:.0f}%)"
                if "served_bytes" in r
                else "-",
            ]
            for m, r in self.R["runs"].items()
        ]
        head = [
            "method",
            "ready s",
            "import s",
            "total s",
            "fetched (of stored bytes)",
            "read (of tar bytes)",
        ]
        table = "\n".join(md_table(head, rows))
        text = (
            f"# lazy environments ({'quick: numpy only, a smoke run' if self.quick else 'full'})\n\n"
            f"`{self.import_code}` from an environment of {env['files']} files, "
            f"{env['stream_bytes'] / MB:.0f} MB ({env['stored_bytes'] / MB:.0f} MB stored, "
            f"{env['chunks']} chunks of up to {env['chunk_raw_bytes'] / 2**20:.0f} MiB); "
            f"{'cold' if self.R['cold'] else 'WARM'} page cache.\n\n{table}\n"
        )
        print(text)
        self.results.mkdir(parents=True, exist_ok=True)
        (self.results / "env_lazy.json").write_text(json.dumps(self.R, indent=1, default=str))
        (self.results / "env_lazy.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache", help="wheels and work trees (default ~/.cache/bootseer-bench)")
    parser.add_argument("--keep", action="store_true", help="keep the work trees")
    bench = Bench(parser.parse_args(argv))
    try:
        bench.run()
        bench.report()
    finally:
        with contextlib.suppress(Exception):
            bench.clear_prefix()
        if not bench.args.keep:
            shutil.rmtree(bench.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
