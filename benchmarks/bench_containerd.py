"""containerd benchmark: the training image started by containerd, from the start of the pull to
the container's first output line.

The image, the registry, the shaping proxy and the conversion are bench_prefetch's (the same
debootstrap + python3 + torch 2.13.0 image, one gzip layer, converted every run; the registry
behind the shaper: 1 ms, 10 MB/s per connection, 160 MB/s total). Each method runs on a fresh
node: its own containerd (root, state, socket) and, for bootseer, its own ``bootseer
snapshotter`` (empty root: no block cache, no local profile) registered as the proxy plugin
``bootseer``; the daemons are started before the clock, as on a node. The page cache is dropped
before each method (the registry's blobs are read back in: the registry is not this node).
The container runs ``python3 -c "import torch; torch.ones(1); print(...)"``; the clock stops at
the first line ``ctr run`` prints.

1. ``default``: ``ctr images pull --plain-http`` (containerd's overlayfs snapshotter: one
   stream per layer, single-threaded gunzip, unpack), then ``ctr run``;
2. ``lazy``: ``bootseer image pull`` (the CLI, a cold Python process) through the bootseer
   snapshotter started with ``--no-prefetch --no-push-profiles``, then ``ctr run --snapshotter
   bootseer``;
3. ``record`` (info): the same with a recording snapshotter; the container opens
   ``/.bootseer/ready`` after its first line, and the profile is pushed to the registry;
4. ``profile``: a fresh node again; the snapshotter finds the profile in the registry at pull
   time and prefetches it; then ``ctr run``;
5. ``floor``: ``ctr run`` again on the default node, the image already unpacked, page cache
   dropped.

Targets (reported, never asserted): with profile <= 1.3x the floor and >= 3x faster than the
default pull. ``python benchmarks/bench_containerd.py --results DIR [--quick] [--repeat N]`` or
``bootseer bench containerd``; needs root, containerd, runc and FUSE. Writes
``DIR/containerd.json`` and ``DIR/containerd.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefetch as bp  # noqa: E402
from _common import add_smoke_flag, command_line, log, md_table, reexec, run_bench  # noqa: E402

from bootseer.testing.containerd import ContainerdServer  # noqa: E402

SUITE = "containerd"
VS_FLOOR, VS_DEFAULT = 1.3, 3.0
METHODS = ("default", "lazy", "profile", "floor")
LABELS = {
    "default": "containerd default: ctr images pull (overlayfs) + ctr run",
    "lazy": "bootseer lazy, no profile (fresh node)",
    "record": "bootseer, recording the profile (info)",
    "profile": "bootseer with profile (fresh node, empty cache)",
    "floor": "floor: image already unpacked, ctr run, cold page cache",
}
FIRST_LINE = "bootseer-bench-first-line"
NAMESPACE = "bench"
STEP_TIMEOUT_S = 900.0


class Node:
    """A containerd (and maybe a bootseer snapshotter) with their own roots and sockets."""

    def __init__(self, work: Path, tag: str, snapshotter_args: tuple[str, ...] | None) -> None:
        self.dir = work / tag
        self.dir.mkdir(parents=True)
        self.sock_dir = tempfile.mkdtemp(prefix="bsb-")
        self.snapshotter: subprocess.Popen | None = None
        proxies = {}
        if snapshotter_args is not None:
            self.address = os.path.join(self.sock_dir, "sn.sock")
            self.sn_log = open(self.dir / "snapshotter.log", "ab")  # noqa: SIM115
            self.snapshotter = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bootseer",
                    "snapshotter",
                    "--root",
                    str(self.dir / "snapshotter"),
                    "--address",
                    self.address,
                    *snapshotter_args,
                ],
                stdout=self.sn_log,
                stderr=self.sn_log,
                start_new_session=True,
                env=bp.clean_env(),
            )
            deadline = time.monotonic() + 60
            while not os.path.exists(self.address):
                if self.snapshotter.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the snapshotter did not start (log {self.dir / 'snapshotter.log'})"
                    )
                time.sleep(0.05)
            proxies["bootseer"] = self.address
        self.containerd = ContainerdServer(
            self.dir / "containerd", NAMESPACE, proxy_snapshotters=proxies
        ).start()

    def ctr(self, *args: str) -> list[str]:
        return ["ctr", "--address", self.containerd.address, "--namespace", NAMESPACE, *args]

    def snapshotter_log(self) -> str:
        path = self.dir / "snapshotter.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self.containerd.stop()
        if self.snapshotter is not None and self.snapshotter.poll() is None:
            self.snapshotter.send_signal(signal.SIGTERM)
            try:
                self.snapshotter.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.snapshotter.kill()
            lazy = self.dir / "snapshotter" / "lazy"
            if bp.is_mounted(lazy):
                bp.unmount(lazy, lazy=True)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


class Bench(bp.Bench):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.work = self.cache / "containerd-run"
        self.R["suite"] = SUITE
        self.R["command"] = command_line("bench_containerd.py")
        self.R["runs"] = {m: [] for m in (*METHODS, "record")}
        self.R["targets"] = {
            "profile_vs_floor_max": VS_FLOOR,
            "default_over_profile_min": VS_DEFAULT,
        }
        self.nodes: list[Node] = []
        bp.LABELS.update(LABELS)  # measure() logs the method's label

    def setup(self) -> None:
        for tool in ("containerd", "ctr", "runc", "containerd-shim-runc-v2"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed (apt: containerd runc)")
        super().setup()
        self.R["machine"]["containerd"] = bp.version_of(["containerd", "--version"])
        self.gzip_ref = f"{self.shaper.address}/{self.repo}:gzip"
        self.command = self.code + f"; print({FIRST_LINE!r}, flush=True)"

    def cleanup(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()
        self.nodes.clear()
        super().cleanup()

    def node(self, tag: str, snapshotter_args: tuple[str, ...] | None = None) -> Node:
        node = Node(self.work, tag, snapshotter_args)
        self.nodes.append(node)
        return node

    def retire(self, node: Node) -> None:
        node.close()
        self.nodes.remove(node)

    # -- one start ----------------------------------------------------------------------------
    def start(
        self,
        node: Node,
        pull: list[str] | None,
        ref: str,
        snapshotter: str,
        tag: str,
        code: str | None = None,
    ) -> dict[str, Any]:
        """Pull (when ``pull``), then ``ctr run``; seconds to the first output line."""
        logp = self.work / f"{tag}.log"
        out: dict[str, Any] = {}
        with open(logp, "ab") as logf:
            t0 = time.perf_counter()
            if pull is not None:
                r = subprocess.run(
                    pull,
                    stdout=logf,
                    stderr=logf,
                    timeout=STEP_TIMEOUT_S,
                    env=bp.clean_env(),
                    check=False,
                )
                if r.returncode != 0:
                    raise RuntimeError(f"pull exited {r.returncode} (log {logp})")
                out["pull"] = time.perf_counter() - t0
            run = subprocess.Popen(
                node.ctr(
                    "run",
                    "--rm",
                    "--snapshotter",
                    snapshotter,
                    ref,
                    f"{tag}-c",
                    "/usr/bin/python3",
                    "-c",
                    code or self.command,
                ),
                stdout=subprocess.PIPE,
                stderr=logf,
                text=True,
            )
            assert run.stdout is not None
            first = run.stdout.readline()
            out["total"] = time.perf_counter() - t0
            rest = run.stdout.read()
            rc = run.wait(timeout=STEP_TIMEOUT_S)
            logf.write((first + rest).encode())
        if FIRST_LINE not in first or rc != 0:
            raise RuntimeError(f"the container printed {first!r} and exited {rc} (log {logp})")
        out["run"] = out["total"] - out.get("pull", 0.0)
        log(
            f"  {out['total']:.2f} s"
            + (
                f" (pull {out['pull']:.2f} s, run to first line {out['run']:.2f} s)"
                if "pull" in out
                else ""
            )
        )
        return out

    def bootseer_pull(self, node: Node, ref: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "bootseer",
            "image",
            "pull",
            ref,
            "--address",
            node.containerd.address,
            "--namespace",
            NAMESPACE,
        ]

    # -- methods ------------------------------------------------------------------------------
    def default(self, rnd: int) -> dict[str, Any]:
        node = self.node(f"default-r{rnd}")
        self.go_cold([self.gzip_blob])
        out = self.start(
            node,
            node.ctr("images", "pull", "--plain-http", self.gzip_ref),
            self.gzip_ref,
            "overlayfs",
            f"default-r{rnd}",
        )
        self.default_node = node  # the floor runs on it
        return out

    def floor(self, rnd: int) -> dict[str, Any]:
        node = getattr(self, "default_node", None)
        if node is None:
            raise RuntimeError("no node with the image unpacked (the default pull failed)")
        self.go_cold([])
        try:
            return self.start(node, None, self.gzip_ref, "overlayfs", f"floor-r{rnd}")
        finally:
            self.retire(node)
            self.default_node = None

    def lazy(self, rnd: int, method: str = "lazy") -> dict[str, Any]:
        args = {
            "lazy": ("--no-prefetch", "--no-push-profiles"),
            "record": ("--record-timeout", "600"),
            "profile": (),
        }[method]
        node = self.node(f"{method}-r{rnd}", args)
        try:
            self.go_cold(self.lazy_blobs)
            code = self.command
            if method == "record":
                code += "; open('/.bootseer/ready').read()"
            out = self.start(
                node,
                self.bootseer_pull(node, self.lazy_ref),
                self.lazy_ref,
                "bootseer",
                f"{method}-r{rnd}",
                code,
            )
            text = node.snapshotter_log()
            if method == "record":
                t0 = time.perf_counter()
                while "recorded " not in node.snapshotter_log():
                    if time.perf_counter() - t0 > 60:
                        raise RuntimeError(
                            "no profile was recorded (snapshotter log "
                            f"{node.dir / 'snapshotter.log'})"
                        )
                    time.sleep(0.2)
                time.sleep(2.0)  # the push follows the local copy
                text = node.snapshotter_log()
                out["recorded"] = [ln for ln in text.splitlines() if "recorded " in ln][-1]
            if method == "profile":
                lines = [ln for ln in text.splitlines() if "prefetching" in ln]
                if not lines:
                    raise RuntimeError("the snapshotter found no profile to prefetch")
                out["prefetch"] = lines[-1].split("INFO ", 1)[-1]
            return out
        finally:
            self.retire(node)

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        recorded = False
        for rnd in range(self.repeat):
            self.measure("default", rnd, self.default)
            self.measure("floor", rnd, self.floor)
            self.measure("lazy", rnd, self.lazy)
            if not recorded:
                recorded = self.measure("record", rnd, lambda r: self.lazy(r, "record")) is not None
            if recorded:
                self.measure("profile", rnd, lambda r: self.lazy(r, "profile"))
            else:
                self.errors.append("profile: skipped, no profile was recorded")
        if not self.cold:
            self.R["warnings"].append(
                "--smoke keeps the page cache: WARM figures"
                if self.smoke
                else "the page cache could not be dropped: WARM figures"
            )

    def rows(self) -> list[list[str]]:
        p, fl, de, la = (self.median(m) for m in ("profile", "floor", "default", "lazy"))

        def t(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f} s"

        def verdict(ok: bool | None) -> str:
            return "n/a" if ok is None else ("PASS" if ok else "MISS")

        rows = []
        ratio = p / fl if p and fl else None
        rows.append(
            [
                LABELS["profile"] + " vs floor",
                t(p),
                f"floor {t(fl)}",
                "n/a" if ratio is None else f"{ratio:.2f}x of floor",
                f"<= {VS_FLOOR:g}x",
                verdict(None if ratio is None else ratio <= VS_FLOOR),
            ]
        )
        ratio = de / p if p and de else None
        rows.append(
            [
                LABELS["profile"] + " vs containerd default",
                t(p),
                f"default {t(de)}",
                "n/a" if ratio is None else f"{ratio:.1f}x faster",
                f">= {VS_DEFAULT:g}x",
                verdict(None if ratio is None else ratio >= VS_DEFAULT),
            ]
        )
        for method in ("default", "lazy", "record", "profile", "floor"):
            ok = [r for r in self.R["runs"][method] if not r.get("error")]
            if not ok:
                continue
            r0 = ok[-1]
            detail = (
                f"pull {r0['pull']:.2f} s, then run to first line {r0['run']:.2f} s"
                if "pull" in r0
                else ""
            )
            if r0.get("prefetch"):
                detail += f"; {r0['prefetch']}"
            if r0.get("recorded"):
                detail += "; " + r0["recorded"].split("INFO ", 1)[-1]
            value = self.median(method) if method != "record" else r0["total"]
            rows.append([LABELS[method], t(value), detail, "", "", "info"])
        if la is not None and p:
            rows.append(
                ["lazy without profile / with profile", f"{la / p:.2f}x", "", "", "", "info"]
            )
        return rows

    def report(self) -> None:
        head = ["metric", "bootseer", "peer / reference", "ratio", "target", "result"]
        table = md_table(head, self.rows())
        self.R["table"] = table
        self.R["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        img = self.R.get("image", {})
        lines = [
            f"# containerd benchmark ({self.form()} run)",
            "",
            f"- command: `{self.R['command']}`",
            f"- machine: {self.R['machine']['cpus']} CPUs, "
            f"{self.R['machine']['ram_bytes'] / 2**30:.1f} GiB RAM, "
            f"{self.R['machine'].get('containerd', '')}",
            f"- image: {img.get('what')}, one gzip layer "
            f"{img.get('gzip_bytes', 0) / 1e6:.0f} MB, {img.get('bytes', 0) / 1e6:.0f} MB "
            "in files",
            f"- link: registry behind the shaper, {bp.LINK.describe()}",
            f"- {'cold node: page cache dropped before each method' if self.cold else 'WARM (--smoke keeps the page cache)' if self.smoke else 'WARM'}",
            f'- startup: pull start to the first line of `python3 -c "{self.command}"` '
            "in the container",
            "",
            *table,
        ]
        lines += [f"- WARNING: {w}" for w in self.R["warnings"]]
        lines += [f"- ERROR: {e}" for e in self.errors]
        print("\n".join(lines))
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / f"{SUITE}.md").write_text("\n".join(lines) + "\n")
        self.write_files()

    def write_files(self, table: list[str] | None = None) -> None:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / f"{SUITE}.json").write_text(
            json.dumps(self.R, indent=2, default=str) + "\n"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--helper"]:
        return bp.helper_main(argv[1], argv[2])
    if any(name in sys.modules for name in bp._MAPPED_BY_TOOLS):
        return reexec(__file__, argv)
    parser = argparse.ArgumentParser(prog="bench_containerd.py", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="numpy only (no torch)")
    add_smoke_flag(parser)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cache", help="cache dir (default ~/.cache/bootseer-bench)")
    parser.add_argument("--base", choices=("auto", "debootstrap", "host"), default="auto")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    return run_bench(Bench(args), done_key="finished")


if __name__ == "__main__":
    sys.exit(main())
