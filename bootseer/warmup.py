"""``bootseer warmup``: fill a node ahead of the job, every part at once.

Three optional parts, run concurrently (threads; each is I/O-bound):

* image: the image's hot frames (its recorded profile) into the node's block cache, as
  ``bootseer image prefetch`` does; a later lazy mount reads them locally;
* environment: the dependency environment restored from its snapshot, or verified when the
  prefix already holds it. Restore only: warmup never installs (a missing snapshot is a
  failure that says so; the job's ``bootseer env ensure`` builds and publishes it once);
* checkpoint: the newest committed checkpoint's shards for the node's ranks into the
  node-local checkpoint cache (``ckpt.prefetch_latest``), which ``CheckpointManager.load``
  reads transparently.

A failed part does not stop the others; each is reported (what, bytes, seconds, outcome or
error). Idempotent: a second warmup finds everything in place, moves (almost) nothing, and
says so.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .progress import human_bytes
from .trace import REMOTE_REGISTRY, TraceWriter, remote_bytes, remote_of

PHASES = {
    "image": "image_prefetch",
    "environment": "environment",
    "checkpoint": "checkpoint_prefetch",
}
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class WarmupError(Exception):
    """A part could not do its job; the message says what to do."""


@dataclass
class PartResult:
    """One part's outcome: ``ok`` with what it did, or the error that stopped it."""

    part: str  # image | environment | checkpoint
    what: str  # the image reference, the prefix, the checkpoint URL
    ok: bool = True
    bytes: int = 0  # moved over the network (or into the cache)
    seconds: float = 0.0
    outcome: str = ""
    warm_already: bool = False  # nothing heavy to do: everything was in place
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    bytes_by_remote: dict[str, int] = field(default_factory=dict)  # the span's, see trace.py

    @property
    def phase(self) -> str:
        return PHASES[self.part]


@dataclass
class Part:
    """A part to run: its name, what it warms, and the call that does it."""

    name: str
    what: str
    run: Callable[[], PartResult]


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    out: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


# -- the parts -----------------------------------------------------------------------------------


def warm_image(
    ref: str,
    cache_dir: str | os.PathLike,
    *,
    platform: str = "linux/amd64",
    connections: int = 16,
    everything: bool = False,
) -> PartResult:
    """Hot frames of a converted image into the block cache (``bootseer image prefetch``)."""
    from prefetch import load_profile, open_image, plan_prefetch, profile_summary

    image = open_image(ref, cache_dir, platform=platform, connections=connections)
    try:
        profile = None if everything else load_profile(image)
        if everything:
            plan = [(b, i) for b in image.blobs for i in range(len(b.frames))]
            scope = "every frame of the image"
        elif profile is None:
            return PartResult(
                "image",
                ref,
                outcome="no hot-block profile stored for the image: "
                "nothing to prefetch (record one with `bootseer image record`, "
                "or pass --image-all)",
                detail={"profile": False},
            )
        else:
            plan, full = plan_prefetch(profile, image.blobs)
            coverage = profile_summary(profile, image.blobs)["coverage"]
            scope = (
                f"the profile's hot frames ({coverage:.0%} of the image"
                f"{', then the rest' if full else ''})"
            )
        fetcher = image.lazy.fetcher
        queued = fetcher.prefetch(plan)
        if not fetcher.wait_idle():
            raise WarmupError("the image prefetch did not finish")
        stats = fetcher.report()
        if stats.failures:
            raise WarmupError(
                f"{stats.failures} range request(s) to the registry failed "
                f"({stats.prefetched} of {queued} frame(s) fetched); see the log"
            )
        if queued == 0:
            outcome = f"all {len(plan)} frame(s) of {scope} already cached"
        else:
            outcome = (
                f"prefetched {stats.prefetched} frame(s) of {scope} "
                f"({len(plan) - queued} already cached) into {cache_dir}"
            )
        return PartResult(
            "image",
            ref,
            bytes=stats.bytes_fetched,
            outcome=outcome,
            warm_already=queued == 0,
            bytes_by_remote=remote_bytes(REMOTE_REGISTRY, stats.bytes_fetched),
            detail={"frames": len(plan), "fetched": stats.prefetched, "requests": stats.requests},
        )
    finally:
        image.close()


def warm_environment(
    spec_files: Sequence[str | os.PathLike],
    prefix: str | os.PathLike,
    store: str | None,
    *,
    command: Sequence[str] | None = None,
    extras: Mapping[str, str] | None = None,
    base_image: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> PartResult:
    """Verify or restore the environment at ``prefix``: ``ensure`` without its build step."""
    from snapshot import (
        SnapshotStore,
        clear_interrupted_install,
        compute_key,
        prefix_lock,
        restore,
        verify,
    )

    env_key = compute_key(spec_files, command, base_image=base_image, extras=extras)
    key = env_key.key
    where = Path(os.path.abspath(prefix))
    with prefix_lock(where):  # the same lock as `bootseer env ensure`: never both at once
        clear_interrupted_install(where)
        checked = verify(where, key)
        if checked.ok:
            return PartResult(
                "environment",
                str(where),
                warm_already=True,
                outcome=f"environment {key} verified ({checked.checked} entries): already in place",
                detail={"key": key, "action": "verified"},
            )
        if not store:
            raise WarmupError(
                f"{where} does not hold environment {key} ({checked.reason}) and "
                "no snapshot store was given (--env-store or BOOTSEER_ENV_STORE)"
            )
        snapshots = SnapshotStore(store, storage_options)
        if snapshots.read_manifest(key) is None:
            raise WarmupError(
                f"the store {store} holds no snapshot of environment {key}: warmup restores, it "
                "does not install (the job's `bootseer env ensure` builds and publishes it once)"
            )
        result = restore(snapshots, key, where)
    return PartResult(
        "environment",
        str(where),
        bytes=result.compressed_bytes,
        bytes_by_remote=remote_bytes(remote_of(store), result.compressed_bytes),
        outcome=f"restored environment {key}: {result.files} files, {human_bytes(result.bytes)}",
        detail={
            "key": key,
            "action": "restored",
            "files": result.files,
            "unpacked_bytes": result.bytes,
        },
    )


def warm_checkpoint(
    url: str,
    cache_dir: str | os.PathLike,
    ranks: Sequence[int],
    *,
    storage_options: dict[str, Any] | None = None,
    connections: int = 16,
) -> PartResult:
    """The newest committed checkpoint's shards for ``ranks`` into the node-local cache."""
    from ckpt import prefetch_latest

    result = prefetch_latest(
        url, cache_dir, ranks, storage_options=storage_options, connections=connections
    )
    detail = {
        "step": result.step,
        "files": result.files,
        "cached_already": result.cached_already,
        "ranks": format_ranks(ranks),
    }
    if result.step is None:
        return PartResult(
            "checkpoint",
            url,
            outcome="no committed checkpoint yet: nothing to prefetch",
            detail=detail,
        )
    if result.files == 0:
        return PartResult(
            "checkpoint",
            url,
            warm_already=True,
            detail=detail,
            outcome=f"step {result.step} already cached for ranks "
            f"{format_ranks(ranks)} ({result.cached_already} file(s) "
            "verified)",
        )
    return PartResult(
        "checkpoint",
        url,
        bytes=result.bytes,
        detail=detail,
        bytes_by_remote=remote_bytes(remote_of(url), result.bytes),
        outcome=f"cached step {result.step} for ranks {format_ranks(ranks)}: "
        f"{result.files} file(s) ({result.cached_already} already there) "
        f"into {result.path}",
    )


# -- running them --------------------------------------------------------------------------------


def run_parts(parts: Sequence[Part], trace: TraceWriter | None = None) -> list[PartResult]:
    """Run every part at once; a failure is recorded in its result, never raised. Each part
    becomes a trace span (phases image_prefetch, environment, checkpoint_prefetch)."""

    def one(part: Part) -> PartResult:
        wall, started = time.time(), time.perf_counter()
        try:
            result = part.run()
        except Exception as exc:  # noqa: BLE001 - reported with the part, the others go on
            result = PartResult(
                part.name, part.what, ok=False, error=f"{type(exc).__name__}: {exc}"
            )
        result.seconds = time.perf_counter() - started
        if trace is not None:
            detail = {
                k: v
                for k, v in result.detail.items()
                if k not in ("attempt", "bytes", "outcome", "what", "result")
            }
            trace.record(
                result.phase,
                wall,
                wall + result.seconds,
                bytes=result.bytes,
                outcome="ok" if result.ok else "failed",
                bytes_by_remote=result.bytes_by_remote,
                warmup=True,
                what=result.what,
                result=result.outcome if result.ok else result.error,
                warm_already=result.warm_already,
                **detail,
            )
        return result

    if not parts:
        return []
    with ThreadPoolExecutor(len(parts), thread_name_prefix="warmup") as pool:
        return list(pool.map(one, parts))


def summary_lines(results: Sequence[PartResult]) -> list[str]:
    """One line per part: name, ok/FAILED, bytes, seconds, what, outcome (or the error)."""
    lines = []
    for r in results:
        status = "ok" if r.ok else "FAILED"
        text = r.outcome if r.ok else f"error: {r.error}"
        lines.append(
            f"{r.part:<11} {status:<6} {human_bytes(r.bytes):>10} {r.seconds:7.2f}s  "
            f"{r.what}: {text}"
        )
    return lines
