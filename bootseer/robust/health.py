"""Node health before every (re)start: free disk where the job writes, free memory, the GPU.

Why before every start and not only the first: a restart on a node whose disk filled up or
whose GPU fell off the bus fails again, later and less clearly (a checkpoint write dies with
ENOSPC mid-save, CUDA init fails after the model load). A failing check is an
:class:`~bootseer.robust.events.Event` of kind ``health`` with its evidence, and stops the
start with an error that names the resource and what to do.

Usage::

    from bootseer.robust.health import check_node

    results = check_node({"state.dir": "/var/lib/bootseer"}, min_free_disk=1 << 30,
                         min_free_memory=256 << 20, gpu=True, node="node-3")
    failed = [r for r in results if not r.ok]
    failed[0].message   # "disk: 12.0 KiB free on /var/lib/bootseer (state.dir), ..."
    failed[0].event()   # Event("health", "disk_full", evidence={...})
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..progress import human_bytes
from .events import Event

__all__ = ["CheckResult", "check_disk", "check_gpu", "check_memory", "check_node"]


@dataclass(frozen=True)
class CheckResult:
    """One check: its name, whether it passed (None: skipped), the message, the evidence."""

    check: str
    ok: bool | None
    message: str
    failure_class: str = "unhealthy"
    evidence: dict[str, Any] = field(default_factory=dict)
    node: str | None = None

    def event(self) -> Event:
        return Event(
            "health",
            self.failure_class,
            node=self.node,
            time=time.time(),
            evidence={"check": self.check, "message": self.message, **self.evidence},
        )


def _existing(path: str) -> str:
    """The path, or its nearest existing parent (the filesystem it will be created on)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_disk(
    paths: Mapping[str, str], min_free: int, node: str | None = None
) -> list[CheckResult]:
    """Free bytes (for an unprivileged writer: ``f_bavail``) on each filesystem of ``paths``
    (name -> directory), once per filesystem."""
    results, seen = [], set()
    for name, path in paths.items():
        if not path:
            continue
        where = _existing(path)
        st = os.statvfs(where)
        dev = os.stat(where).st_dev
        if dev in seen:
            continue
        seen.add(dev)
        free = st.f_bavail * st.f_frsize
        evidence = {
            "path": path,
            "key": name,
            "free_bytes": free,
            "min_free_bytes": min_free,
            "total_bytes": st.f_blocks * st.f_frsize,
        }
        if free >= min_free:
            results.append(
                CheckResult(
                    "disk",
                    True,
                    f"disk: {human_bytes(free)} free on {path}",
                    evidence=evidence,
                    node=node,
                )
            )
        else:
            results.append(
                CheckResult(
                    "disk",
                    False,
                    f"disk: {human_bytes(free)} free on {path} ({name}), "
                    f"{human_bytes(min_free)} needed (health.min_free_disk): free space there, "
                    f"or point {name} at a larger disk",
                    "disk_full",
                    evidence,
                    node,
                )
            )
    return results


def check_memory(
    min_free: int, node: str | None = None, meminfo: str = "/proc/meminfo"
) -> CheckResult:
    """``MemAvailable`` against ``min_free`` (the kernel's estimate of what can be allocated
    without swapping, page cache included)."""
    available = None
    with open(meminfo, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        return CheckResult(
            "memory", None, f"memory: {meminfo} has no MemAvailable; skipped", node=node
        )
    evidence = {"available_bytes": available, "min_free_bytes": min_free}
    if available >= min_free:
        return CheckResult(
            "memory",
            True,
            f"memory: {human_bytes(available)} available",
            evidence=evidence,
            node=node,
        )
    return CheckResult(
        "memory",
        False,
        f"memory: {human_bytes(available)} available, "
        f"{human_bytes(min_free)} needed (health.min_free_memory): stop what "
        "else runs on the node, or lower the threshold",
        "cpu_oom",
        evidence,
        node,
    )


GPU_QUERY = (
    "index,name,pci.bus_id,memory.used,memory.total,temperature.gpu,"
    "ecc.errors.uncorrected.volatile.total"
)


def check_gpu(
    node: str | None = None, nvidia_smi: str | None = None, timeout_s: float = 30.0
) -> CheckResult:
    """``nvidia-smi --query-gpu``: every GPU answers, none has uncorrected ECC errors.
    Skipped (``ok`` None) when nvidia-smi is not installed."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if exe is None:
        return CheckResult("gpu", None, "gpu: no nvidia-smi on PATH; skipped", node=node)
    try:
        proc = subprocess.run(
            [exe, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return CheckResult(
            "gpu",
            False,
            f"gpu: nvidia-smi did not answer in {timeout_s:.0f}s: "
            "the driver is stuck; drain the node",
            "cuda_error",
            {"nvidia_smi": exe},
            node,
        )
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    evidence: dict[str, Any] = {
        "nvidia_smi": exe,
        "exit_code": proc.returncode,
        "output": lines[:16],
        "stderr": proc.stderr.strip()[-2000:],
    }
    if proc.returncode != 0 or not lines:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        return CheckResult(
            "gpu",
            False,
            f"gpu: nvidia-smi failed (exit {proc.returncode}: "
            f"{said[0] if said else 'no GPU listed'}): check the driver and the "
            "GPUs, or drain the node",
            "cuda_error",
            evidence,
            node,
        )
    bad = [
        line
        for line in lines
        if (cells := [c.strip() for c in line.split(",")])
        and cells[-1].isdigit()
        and int(cells[-1]) > 0
    ]
    if bad:
        return CheckResult(
            "gpu",
            False,
            f"gpu: uncorrected ECC errors: {bad[0]}: drain the node for a GPU reset or replacement",
            "cuda_error",
            evidence,
            node,
        )
    return CheckResult(
        "gpu", True, f"gpu: {len(lines)} GPU(s) answer", evidence=evidence, node=node
    )


def check_node(
    paths: Mapping[str, str],
    *,
    min_free_disk: int,
    min_free_memory: int,
    gpu: bool = True,
    node: str | None = None,
) -> list[CheckResult]:
    """Every check whose threshold is set (0 turns one off), in a fixed order."""
    results: list[CheckResult] = []
    if min_free_disk > 0:
        results += check_disk(paths, min_free_disk, node)
    if min_free_memory > 0:
        results.append(check_memory(min_free_memory, node))
    if gpu:
        results.append(check_gpu(node))
    return results
