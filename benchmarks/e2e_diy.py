"""The do-it-yourself restart of the end-to-end scenario: the checkpoint copied by rclone.

What a capable team builds without bootseer (``bench_e2e.py``, methods ``diy`` and
``diy-warm``): the dependencies baked into the image, and the newest DCP checkpoint copied from
S3 to the node's disk by a parallel copy tool that starts with the restart, while the image is
pulled and the container starts. Each rank waits for the copy's status file
(``e2e_train.wait_for_copy``), then loads the local copy with DCP's ``FileSystemReader``.

The copy is ``rclone`` (s5cmd is not installed here), configured from the environment (no
config file) and tuned for the link: DCP writes one file per rank, so ``--transfers`` alone
gives two streams; ``--multi-thread-streams`` splits each file into ranged GETs and a lowered
``--multi-thread-cutoff`` lets the quick form's 125 MB files split too (the tuning is in
docs/e2e.md).

``CopyJob(...).start()`` runs list + copy on a thread and writes ``.copy-status.json`` last
(``wrap``: run rclone elsewhere, e.g. on a cluster node: ``bench_e2e_nodes.py``).
``python benchmarks/e2e_diy.py tune [--mb 128]`` times the copy of two files (DCP's two ranks)
through the scenario's shaped S3 link with a few tunings: how the defaults were chosen.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_train import COPY_STATUS

REMOTE = "e2e"  # the rclone remote's name, defined by RCLONE_CONFIG_E2E_* variables


@dataclass(frozen=True)
class RcloneTuning:
    """rclone's knobs for a many-connection download of a few large files."""

    transfers: int = 4  # files at once (DCP: one file per rank, + .metadata)
    streams: int = 8  # ranged GETs per file: 2 ranks x 8 = 16 connections
    cutoff: str = "32M"  # files above this are split (default 250M: quick's are not)
    checkers: int = 8

    def flags(self) -> list[str]:
        return [
            "--transfers",
            str(self.transfers),
            "--multi-thread-streams",
            str(self.streams),
            "--multi-thread-cutoff",
            self.cutoff,
            "--checkers",
            str(self.checkers),
        ]


def rclone_env(storage_options: dict[str, Any]) -> dict[str, str]:
    """The ``e2e`` remote from s3fs-style options (``key``, ``secret``, ``client_kwargs``):
    rclone reads ``RCLONE_CONFIG_<NAME>_<KEY>`` variables, so no config file holds the keys."""
    kwargs = storage_options.get("client_kwargs", {})
    endpoint = kwargs.get("endpoint_url")
    if not endpoint:
        raise ValueError(
            "rclone_env: storage options without client_kwargs.endpoint_url; "
            "pass the S3 endpoint the job uses"
        )
    prefix = f"RCLONE_CONFIG_{REMOTE.upper()}_"
    return {
        prefix + "TYPE": "s3",
        prefix + "PROVIDER": "Other",
        prefix + "ENDPOINT": endpoint,
        prefix + "REGION": kwargs.get("region_name", "us-east-1"),
        prefix + "ACCESS_KEY_ID": storage_options.get("key", ""),
        prefix + "SECRET_ACCESS_KEY": storage_options.get("secret", ""),
        prefix + "FORCE_PATH_STYLE": "true",
    }


def process_env(remote: dict[str, str]) -> dict[str, str]:
    """rclone's environment: this one plus the remote, without proxy settings (loopback stays
    loopback) and without ``AWS_CA_BUNDLE``, which rclone refuses for a plain-HTTP endpoint
    ("failed to load custom CA bundle")."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "AWS_CA_BUNDLE"}
    return {**env, **remote}


def list_argv(root: str) -> list[str]:
    """List the committed DCP steps under ``root`` (bucket/prefix): one ListObjects walk."""
    return [
        "rclone",
        "lsf",
        "-R",
        "--files-only",
        "--fast-list",
        "--include",
        "/step-*/.metadata",
        f"{REMOTE}:{root.strip('/')}",
    ]


def newest_step(listing: str) -> int | None:
    """The newest step in ``rclone lsf`` output whose ``.metadata`` exists (DCP writes it last,
    so it marks a complete checkpoint); None when there is none."""
    steps = [int(m.group(1)) for m in re.finditer(r"^step-(\d+)/\.metadata$", listing, re.M)]
    return max(steps) if steps else None


def copy_argv(root: str, step: int, dest: Path, tuning: RcloneTuning) -> list[str]:
    """``rclone copy`` of one step directory into ``dest/step-NNNNNNNN``."""
    name = f"step-{step:08d}"
    return [
        "rclone",
        "copy",
        f"{REMOTE}:{root.strip('/')}/{name}",
        str(dest / name),
        *tuning.flags(),
        "--no-traverse",
        "--stats",
        "0",
        "-v",
    ]


def write_status(dest: Path, status: dict[str, Any]) -> None:
    """The status file the ranks wait for, atomically (a rank never reads half of it)."""
    tmp = dest / (COPY_STATUS + ".partial")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, dest / COPY_STATUS)


@dataclass
class CopyJob:
    """rclone's list and copy of the newest checkpoint under ``root`` into ``dest``, on a
    thread; ``status`` (also written to ``dest``) once it ended, success or not."""

    root: str
    dest: Path
    env: dict[str, str]
    log: Path
    tuning: RcloneTuning = field(default_factory=RcloneTuning)
    status: dict[str, Any] = field(default_factory=dict)
    thread: threading.Thread | None = None
    proc: subprocess.Popen | None = None
    stopped: bool = False
    # how rclone is started: e.g. a cluster node's ``Node.argv`` (its network and cgroup);
    # None: on this host
    wrap: Callable[[list[str]], list[str]] | None = None

    def start(self) -> CopyJob:
        self.thread = threading.Thread(target=self._run, name="rclone-copy", daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> dict[str, Any]:
        if self.thread is not None:
            self.thread.join(timeout)
        return self.status

    def stop(self) -> None:
        """Kill rclone if it still runs (the harness failed), then wait for the thread."""
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.join(60)

    def _rclone(self, argv: list[str]) -> str:
        if self.stopped:
            raise RuntimeError("stopped")
        with open(self.log, "a") as logf:
            logf.write("$ " + " ".join(argv) + "\n")
            logf.flush()
            run = argv if self.wrap is None else self.wrap(argv)
            self.proc = subprocess.Popen(
                run, stdout=subprocess.PIPE, stderr=logf, text=True, env=process_env(self.env)
            )
            out, _ = self.proc.communicate()
        if self.proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:2])} exited {self.proc.returncode} (log {self.log})"
            )
        return out

    def _run(self) -> None:
        t0 = time.time()
        status: dict[str, Any] = {"ok": False, "started": t0}
        try:
            step = newest_step(self._rclone(list_argv(self.root)))
            if step is None:
                raise RuntimeError(f"no committed checkpoint under {REMOTE}:{self.root}")
            status["step"] = step
            argv = copy_argv(self.root, step, self.dest, self.tuning)
            status["argv"] = argv
            self._rclone(argv)
            files = [p for p in (self.dest / f"step-{step:08d}").rglob("*") if p.is_file()]
            status.update(ok=True, bytes=sum(p.stat().st_size for p in files), files=len(files))
        except Exception as exc:  # the ranks must hear of it, not wait for ever
            status["error"] = str(exc)
        status["ended"] = time.time()
        status["seconds"] = status["ended"] - t0
        self.status = status
        write_status(self.dest, status)


def tune(mb: int, out: Path) -> list[dict[str, Any]]:
    """Copy two ``mb`` MB objects through the e2e scenario's shaped S3 link with each candidate
    tuning (rclone's defaults first) and return the seconds of each."""
    import shutil as _shutil
    import tempfile

    from bench_e2e import LINKS

    from bootseer.testing.servers import MotoS3Server
    from bootseer.testing.shaper import ShaperProcess, ShaperSettings

    candidates = [
        ("rclone defaults (4 streams, cutoff 250M)", RcloneTuning(streams=4, cutoff="250M")),
        ("4 streams, cutoff 32M", RcloneTuning(streams=4)),
        ("8 streams, cutoff 32M (chosen)", RcloneTuning()),
        ("16 streams, cutoff 32M", RcloneTuning(streams=16)),
    ]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="rclone-tune-"))
    server = MotoS3Server(in_process=False)
    try:
        server.start()
        server.create_bucket("ckpt")
        client = server.boto3_client()
        for rank in range(2):
            client.put_object(
                Bucket="ckpt", Key=f"t/step-00000001/__{rank}_0.distcp", Body=os.urandom(mb << 20)
            )
        client.put_object(Bucket="ckpt", Key="t/step-00000001/.metadata", Body=b"m")
        with ShaperProcess("127.0.0.1", server.port, ShaperSettings.from_mb(*LINKS["s3"])) as proxy:
            env = rclone_env(server.storage_options(endpoint_url=f"http://{proxy.address}"))
            for name, tuning in candidates:
                dest = work / "dest"
                dest.mkdir()
                job = CopyJob("ckpt/t", dest, env, out.with_suffix(".log"), tuning)
                status = job.start().join(600)
                if not status.get("ok"):
                    raise RuntimeError(f"{name}: {status.get('error')}")
                rows.append(
                    {
                        "tuning": name,
                        "flags": tuning.flags(),
                        "seconds": status["seconds"],
                        "mb_s": status["bytes"] / 1e6 / status["seconds"],
                    }
                )
                print(f"{name}: {status['seconds']:.1f} s, {rows[-1]['mb_s']:.0f} MB/s", flush=True)
                _shutil.rmtree(dest)
    finally:
        server.close()
        _shutil.rmtree(work, ignore_errors=True)
    out.write_text(
        json.dumps({"mb_per_file": mb, "files": 2, "link": LINKS["s3"], "rows": rows}, indent=2)
        + "\n"
    )
    return rows


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    parser = argparse.ArgumentParser(prog="e2e_diy.py")
    parser.add_argument("cmd", choices=["tune"])
    parser.add_argument("--mb", type=int, default=128, help="size of each of the two files")
    parser.add_argument("--out", default="bench-results/rclone-tune.json")
    a = parser.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    tune(a.mb, Path(a.out))
