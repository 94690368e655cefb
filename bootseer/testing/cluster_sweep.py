"""What a cluster leaves when its owner dies without ``close()`` (SIGKILL, a lost session), and
how the next cluster removes it.

Why a record per cluster: a killed test process runs no teardown, and its namespaces, mounts,
cgroup and daemons outlive it. Each cluster writes ``/run/bootseer-clusters/PREFIX.json`` (its
owner's pid and start time, its directory and cgroup) before it builds anything, and removes it
once ``close()`` left nothing. :func:`sweep_stale` removes the remains of every cluster whose
owner is gone; a cluster whose owner lives (another test run on the machine) is never touched.
``Cluster.start()`` sweeps first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from .cgroup import Cgroup, cgroup2_root, groups_named
from .cluster_node import RUNC_ROOT
from .netns import NETNS_DIR, delete_netns, mounts_under, processes_in

__all__ = ["RECORDS", "forget", "record", "remove_remains", "sweep_stale"]

RECORDS = Path("/run/bootseer-clusters")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None: no such process); with the
    pid it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def record(prefix: str, directory: Path, cgroup: Path) -> Path:
    """Say that this process owns cluster ``prefix`` (before anything of it exists)."""
    RECORDS.mkdir(mode=0o700, exist_ok=True)
    path = RECORDS / f"{prefix}.json"
    path.write_text(
        json.dumps(
            {
                "prefix": prefix,
                "pid": os.getpid(),
                "start": _start_time(os.getpid()),
                "dir": str(directory),
                "cgroup": str(cgroup),
            }
        )
    )
    return path


def forget(prefix: str) -> None:
    """The cluster is gone: drop its record."""
    (RECORDS / f"{prefix}.json").unlink(missing_ok=True)


def _owner_alive(rec: dict[str, Any]) -> bool:
    return _start_time(int(rec["pid"])) == rec["start"]


def remove_remains(rec: dict[str, Any]) -> list[str]:
    """Remove every trace of the cluster ``rec`` describes: its processes (its cgroup and its
    containers' groups, then anything still in its namespaces), mounts under its directory,
    network namespaces, cgroups, runc state, directory. Returns what could not be removed."""
    prefix, directory = rec["prefix"], Path(rec["dir"])
    problems: list[str] = []
    names = (
        [p.name for p in NETNS_DIR.iterdir() if p.name.startswith(f"{prefix}-")]
        if NETNS_DIR.is_dir()
        else []
    )
    held = []
    for name in names:
        with contextlib.suppress(OSError):
            held.append(os.open(NETNS_DIR / name, os.O_RDONLY))
    try:
        inodes = {os.fstat(fd).st_ino for fd in held}
        cgroup = Cgroup(Path(rec["cgroup"]))
        containers = [Cgroup(p) for p in groups_named(f"{prefix}-")]  # runc's, per node
        for group in [cgroup, *(g for g in containers if g.path.parent == cgroup2_root())]:
            try:
                group.kill()
            except Exception as exc:  # noqa: BLE001 - go on; say what is left
                problems.append(f"cgroup {group.path}: {exc}")
        for pid in processes_in(inodes, kinds=("net",)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for point in mounts_under(directory):
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
        for name in names:
            delete_netns(name)
        for group in [cgroup, *containers]:
            try:
                group.remove()
            except OSError as exc:
                problems.append(f"cgroup {group.path}: {exc}")
    finally:
        for fd in held:
            os.close(fd)
    if RUNC_ROOT.is_dir():
        for state in RUNC_ROOT.iterdir():
            if state.name.startswith(f"{prefix}-"):
                shutil.rmtree(state, ignore_errors=True)
    # only the cluster's own private directory, never a parent (e.g. /tmp)
    if directory.name.startswith(f"{prefix}-") and not mounts_under(directory):
        shutil.rmtree(directory, ignore_errors=True)
    if not problems:
        forget(prefix)
    return problems


def sweep_stale() -> list[str]:
    """Remove the remains of every cluster whose owner process is gone; returns their prefixes
    (a record that cannot be read is skipped: it may be being written)."""
    swept = []
    if not RECORDS.is_dir():
        return swept
    for path in sorted(RECORDS.glob("bsc-*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not _owner_alive(rec):
            remove_remains(rec)
            swept.append(rec["prefix"])
    return swept
