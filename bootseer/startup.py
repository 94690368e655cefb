"""The startup phases of ``bootseer run``: the environment and the checkpoint prefetch.

They are independent, so they run at the same time (two threads). The command needs the
environment (its ``bin`` first on ``PATH``) but not the whole checkpoint: it starts as soon as
the environment is ready and the prefetch has *planned* its copy (the store listed, the step
chosen, its manifest, indexes and objects cached, a temporary file for every data file still
to come), or at once when the node's cache holds a committed step (``ckpt.held_step``: a
warm node, which cannot start fresh), while the data files keep arriving.
``CheckpointManager`` reads the node-local cache (``ckpt.cache_dir``, handed to the command
as ``BOOTSEER_CKPT_CACHE``) and waits for each file it needs until the prefetch renames it
into place, or reads the store when the prefetch gave it up; it never reads a partial file. So the command's own start (interpreter,
imports, process group, model) overlaps the tail of the prefetch. Each phase is a span of the
startup trace (bytes, outcome, the attempt; the prefetch's ``ready_s`` says when the command
could start). On a restart the same phases run again and take the warm path: the environment
is only verified, the cache already holds the checkpoint's files (a save writes its rank's
files there too), and a prefetch still running from the previous attempt is waited for.

Failures, and why they differ:

* The environment cannot be made: the job does not start (:class:`StartupError`). Running
  the command without its dependencies would only fail later and less clearly, and
  restarting would fail the same way.
* The checkpoint store cannot be reached: the job does not start either, unless fresh starts
  are allowed, because a job that silently starts from step 0 overwrites weeks of training
  with its first checkpoint. With ``allow_fresh_start`` it warns and the span says skipped.
* Any other prefetch failure (a damaged newest checkpoint, a full cache disk) only costs the
  cache: a warning, and the manager reads from the store as without a cache.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import default_state_dir
from .deferred import DeferredChecks, DeferredFailure
from .errors import CliError
from .progress import human_bytes
from .trace import Span, TraceWriter, remote_bytes, remote_of
from .variables import CKPT_CACHE_HANDOFF

__all__ = [
    "PhaseResult",
    "StartupError",
    "StartupPlan",
    "close_lazy_environments",
    "run_startup",
]


class StartupError(CliError):
    """A phase failed in a way that must keep the job from starting."""


@dataclass
class StartupPlan:
    """What the phases do; empty ``env_spec`` or ``ckpt_url`` skips that phase."""

    env_spec: list[str] = field(default_factory=list)
    env_prefix: str = ""
    env_store: str = ""
    env_base_image: str = ""
    env_uv: str = ""
    env_verify: str = "beside"  # a held environment's files: checked beside the command
    env_lazy: bool = False  # a fresh node mounts the snapshot instead of restoring it
    env_cache: str = ""  # the node-local chunk cache of lazy mounts
    ckpt_url: str = ""
    ckpt_cache_dir: str = ""
    ranks: list[int] = field(default_factory=lambda: [0])
    ckpt_connections: int = 16
    allow_fresh_start: bool = False
    storage_options: dict[str, Any] | None = None


@dataclass
class PhaseResult:
    """One phase's outcome: the span's fields and the variables the command needs."""

    phase: str
    outcome: str = "ok"
    bytes: int = 0
    summary: str = ""
    env: dict[str, str] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    bytes_by_remote: dict[str, int] = field(default_factory=dict)  # the span's, see trace.py


def _say(line: str) -> None:
    print(f"bootseer: {line}", file=sys.stderr, flush=True)


def environment_phase(
    plan: StartupPlan, base_env: Mapping[str, str], checks: DeferredChecks | None = None
) -> PhaseResult:
    """``snapshot.ensure``: verified, restored or built; the command runs inside it. With
    ``checks`` and ``env_verify = "beside"`` a held environment is verified by its marker and
    its files are checked beside the command (:mod:`bootseer.deferred`)."""
    result = PhaseResult("environment")
    if not plan.env_spec:
        result.outcome, result.summary = "skipped", "skipped (no env.spec)"
        result.detail["reason"] = "no env.spec"
        return result
    if not plan.env_prefix:
        raise StartupError(
            "environment: env.spec is set but env.prefix is not: say where "
            "the environment lives (--env-prefix or env.prefix)"
        )
    if plan.env_verify not in ("beside", "before"):
        raise StartupError(
            f"env.verify is {plan.env_verify!r}: use 'beside' (the files "
            "checked while the command runs) or 'before'"
        )
    from snapshot import ensure

    prefix = os.path.abspath(plan.env_prefix)
    if plan.env_lazy:
        lazy = _lazy_environment(plan, prefix, base_env)
        if lazy is not None:
            return lazy
    beside = checks is not None and plan.env_verify == "beside"
    try:
        done = ensure(
            plan.env_spec,
            prefix=prefix,
            store=plan.env_store or None,
            base_image=plan.env_base_image or None,
            uv=plan.env_uv or None,
            storage_options=plan.storage_options,
            quick_verify=beside,
        )
    except Exception as exc:
        raise StartupError(
            f"environment {prefix} from {', '.join(plan.env_spec)} could not be "
            f"made, the job does not start: {type(exc).__name__}: {exc}"
        ) from exc
    for warning in done.warnings:
        _say(f"warning: {warning}")
    if not done.files_checked and checks is not None:
        _check_beside(checks, prefix, done.key, plan.env_store)
        result.detail["files"] = "checked beside the command"
    moved = done.restore.bytes if done.restore is not None else 0
    result.bytes = moved
    result.detail.update(outcome=done.outcome, key=done.key, prefix=done.prefix)
    if done.restore is not None:
        result.detail["fetched_bytes"] = done.restore.compressed_bytes
        if plan.env_store:
            result.bytes_by_remote = remote_bytes(
                remote_of(plan.env_store), done.restore.compressed_bytes
            )
    if done.warnings:
        result.detail["warnings"] = list(done.warnings)
    result.summary = f"{done.outcome} {prefix}" + (f" ({human_bytes(moved)})" if moved else "")
    result.env = _env_vars(prefix, base_env)
    return result


#: Lazily mounted environments by prefix: they serve every attempt of the job and are
#: unmounted when ``bootseer run`` ends (:func:`close_lazy_environments`).
_lazy_mounts: dict[str, Any] = {}


def _env_vars(prefix: str, base_env: Mapping[str, str]) -> dict[str, str]:
    path = base_env.get("PATH", os.defpath)
    return {
        "PATH": f"{prefix}/bin{os.pathsep}{path}" if path else f"{prefix}/bin",
        "VIRTUAL_ENV": prefix,
    }


def _shared_mount(
    result: PhaseResult, key: str, prefix: str, base_env: Mapping[str, str]
) -> PhaseResult:
    """The environment another ``bootseer run`` on this node mounted lazily, used as is."""
    result.summary = f"mounted lazily {prefix} (by another process)"
    result.detail.update(outcome="mounted-lazily", key=key, prefix=prefix, shared=True)
    result.env = _env_vars(prefix, base_env)
    return result


def _lazy_environment(
    plan: StartupPlan, prefix: str, base_env: Mapping[str, str]
) -> PhaseResult | None:
    """``env.lazy``: mount the key's snapshot at the prefix (the chunks the job reads are
    fetched as it reads them, the read profile first, the rest behind); None when ensure's
    path applies instead: no store, no snapshot yet (it is built), the prefix already holds
    an environment (verified as usual), or the mount failed (a warning; the full restore)."""
    from snapshot import (
        SnapshotError,
        SnapshotStore,
        compute_key,
        mount_lazy,
        mounted_key,
        verify,
    )

    result = PhaseResult("environment")
    held = _lazy_mounts.get(prefix)
    if held is not None and held.proc.poll() is None:
        result.outcome, result.summary = "ok", f"mounted lazily {prefix} (since an earlier attempt)"
        result.detail.update(outcome="mounted-lazily", key=held.key, prefix=prefix, reused=True)
        result.env = _env_vars(prefix, base_env)
        return result
    if held is not None:  # its mount process died: the next mount clears the dead mount
        _lazy_mounts.pop(prefix, None)
    if not plan.env_store:
        return None
    key = ""
    try:
        key = compute_key(plan.env_spec, base_image=plan.env_base_image or None).key
        if mounted_key(prefix) == key[:16]:  # another wrapper on this node mounted it
            return _shared_mount(result, key, prefix, base_env)
        if verify(prefix, key, quick=True).ok:
            return None  # a warm node: ensure verifies it
        if os.path.isdir(prefix) and any(os.scandir(prefix)):
            return None  # something else is there: ensure replaces it (or says why not)
        store = SnapshotStore(plan.env_store, plan.storage_options)
        if store.read_manifest(key) is None:
            return None  # a miss: ensure builds and publishes it
        mounted = mount_lazy(
            plan.env_store,
            key,
            prefix,
            cache_dir=plan.env_cache or os.path.join(default_state_dir(os.environ), "envs"),
            storage_options=plan.storage_options,
        )
    except (SnapshotError, OSError) as exc:
        if key and mounted_key(prefix) == key[:16]:  # another wrapper's mount won the race
            return _shared_mount(result, key, prefix, base_env)
        _say(f"warning: environment {prefix}: lazy mount failed ({exc}); restoring it instead")
        return None
    _lazy_mounts[prefix] = mounted
    stats = mounted.stats()
    result.bytes = int(stats.get("bytes_fetched", 0))
    result.detail.update(
        outcome="mounted-lazily",
        key=key,
        prefix=prefix,
        profile_chunks=(stats.get("profile") or {}).get("chunks"),
        env_bytes=stats.get("stream_bytes"),
    )
    if plan.env_store and result.bytes:
        result.bytes_by_remote = remote_bytes(remote_of(plan.env_store), result.bytes)
    result.summary = f"mounted lazily {prefix} (key {key[:12]})"
    result.env = _env_vars(prefix, base_env)
    return result


def close_lazy_environments(say: Callable[[str], None] = _say) -> None:
    """Unmount the environments this process mounted lazily (the command has ended)."""
    while _lazy_mounts:
        prefix, mounted = _lazy_mounts.popitem()
        try:
            stats = mounted.close()
        except Exception as exc:  # noqa: BLE001 - reported; the job's exit code stands
            say(f"warning: could not unmount the lazy environment {prefix}: {exc}")
            continue
        fetched = int(stats.get("bytes_fetched", 0))
        say(
            f"environment: unmounted {prefix} ({human_bytes(fetched)} fetched, "
            f"{stats.get('chunks_read', 0)} of {stats.get('chunks', 0)} chunks read)"
        )


def checkpoint_phase(
    plan: StartupPlan, ready: Callable[[dict[str, str]], None] | None = None
) -> PhaseResult:
    """The newest committed checkpoint's files for this node's ranks into the local cache.

    ``ready(env)`` is called once the command may start beside the copy (the store listed,
    the step's metadata cached, the data files reserved); past that point a failure only
    costs the cache, since the command's load reads the store for what is missing."""
    result = PhaseResult("checkpoint_prefetch")
    if not plan.ckpt_url:
        result.outcome, result.summary = "skipped", "skipped (no ckpt.url)"
        result.detail["reason"] = "no ckpt.url"
        return result
    if not plan.ckpt_cache_dir:
        raise StartupError("checkpoint_prefetch: ckpt.url is set but ckpt.cache_dir is not")
    from ckpt import CheckpointStoreUnavailable, held_step, prefetch_latest

    result.detail.update(url=plan.ckpt_url, ranks=list(plan.ranks))
    started = time.time()

    def planned(step: int | None) -> None:
        if "ready_s" in result.detail:  # the command runs already
            return
        result.detail["ready_s"] = round(time.time() - started, 3)
        if ready is not None:
            ready(_cache_handoff(plan))

    # a warm node (``bootseer warmup``, or an earlier prefetch) holds a committed step: the
    # job cannot start fresh from here, so the command need not wait for the store (its
    # client's import and a listing: 0.8 s of a 8.6 s warm restart, benchmarks.md); the
    # load still takes the store's newest step, and checks every cached file against it
    held = None
    with contextlib.suppress(OSError):  # an unreadable cache only costs the cache, as before
        held = held_step(plan.ckpt_cache_dir, plan.ckpt_url, plan.ranks)
    if held is not None:
        result.detail["held_step"] = held
        planned(held)
        # the command's start (interpreters, imports) is on the critical path now, and the
        # plan's client import is CPU: yield to it (this thread and the pool it starts)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)

    try:
        done = prefetch_latest(
            plan.ckpt_url,
            plan.ckpt_cache_dir,
            plan.ranks,
            storage_options=plan.storage_options,
            connections=plan.ckpt_connections,
            on_planned=planned,
        )
    except CheckpointStoreUnavailable as exc:
        if "ready_s" in result.detail:  # the command runs already: only the cache is lost
            return _prefetch_failed(plan, result, exc)
        if not plan.allow_fresh_start:
            raise StartupError(
                f"checkpoint store {plan.ckpt_url} is unreachable, the job does not start "
                f"(it would start fresh and overwrite the run's checkpoints): {exc}. Fix the "
                f"store or its credentials, or pass --allow-fresh-start (run.allow_fresh_start)"
                f" to start without a checkpoint"
            ) from exc
        _say(
            f"warning: checkpoint store {plan.ckpt_url} is unreachable; starting fresh "
            f"(--allow-fresh-start): {exc}"
        )
        result.outcome, result.summary = "skipped", "skipped: store unreachable, fresh start"
        result.detail.update(reason="store unreachable, fresh start allowed", error=str(exc))
        return result
    except Exception as exc:  # noqa: BLE001 - the cache is an optimization: warn, go on
        return _prefetch_failed(plan, result, exc)
    result.bytes = done.bytes
    result.bytes_by_remote = remote_bytes(remote_of(plan.ckpt_url), done.bytes)
    result.detail.update(step=done.step, files=done.files, cached_already=done.cached_already)
    if done.step is None:
        result.summary = "no committed checkpoint yet (a fresh run)"
    else:
        result.summary = (
            f"step {done.step} for ranks {_ranks(plan.ranks)}: {done.files} "
            f"file(s), {human_bytes(done.bytes)} fetched, "
            f"{done.cached_already} already cached"
        )
    result.env = _cache_handoff(plan)
    return result


def _prefetch_failed(plan: StartupPlan, result: PhaseResult, exc: Exception) -> PhaseResult:
    _say(
        f"warning: checkpoint prefetch from {plan.ckpt_url} failed, the job reads the "
        f"store directly: {type(exc).__name__}: {exc}"
    )
    result.outcome, result.summary = "failed", f"failed ({type(exc).__name__})"
    result.detail["error"] = f"{type(exc).__name__}: {exc}"
    result.env = _cache_handoff(plan)
    return result


def _cache_handoff(plan: StartupPlan) -> dict[str, str]:
    """What tells the command's ``CheckpointManager`` where the node's cache is."""
    return {CKPT_CACHE_HANDOFF: os.path.abspath(plan.ckpt_cache_dir)}


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


#: Phases still running after their command started (the prefetch's tail): the next
def _check_beside(checks: DeferredChecks, prefix: str, key: str, store: str = "") -> None:
    """Every file of the environment checked while the command runs; a mismatch marks the
    environment damaged (the next start restores it) and the supervisor stops the job."""
    from snapshot import mark_damaged, verify
    from striped_fs import redact

    def damaged(failure: DeferredFailure) -> None:
        mark_damaged(prefix, failure.describe())

    store = redact(store) if store else ""
    now = f"bootseer env restore {key} --prefix {prefix}" + (f" --store {store}" if store else "")
    fix = (
        f"its marker is marked damaged, so the next start restores the environment from the "
        f"store instead of trusting it (or now: `{now}`); `bootseer env verify {prefix}` "
        f"lists every file that differs"
    )
    checks.start(f"environment {key} at {prefix}", lambda: verify(prefix, key), damaged, fix)


#: attempt waits for them, so two copies of one file never run at once.
_lingering: list[threading.Thread] = []


def run_startup(
    plan: StartupPlan,
    *,
    trace: TraceWriter | None = None,
    attempt: int = 0,
    base_env: Mapping[str, str] | None = None,
    say: Callable[[str], None] = _say,
    checks: DeferredChecks | None = None,
) -> dict[str, str]:
    """Both phases at once, traced; returns the variables the command needs as soon as the
    environment is ready and the prefetch has planned its copy (the copy goes on in its
    thread, and writes its span when it ends). Raises :class:`StartupError` as soon as a
    phase fails that way before that point (the other is abandoned: the job does not
    start anyway)."""
    base_env = os.environ if base_env is None else base_env
    for thread in list(_lingering):
        if thread.is_alive():
            say("waiting for the previous attempt's checkpoint prefetch to end")
            thread.join()
        _lingering.remove(thread)
    cond = threading.Condition()
    ready: dict[str, dict[str, str]] = {}  # phase -> its variables, once the command may start
    failed: list[BaseException] = []

    def signal_ready(name: str, env: dict[str, str]) -> None:
        with cond:
            ready.setdefault(name, dict(env))
            cond.notify_all()

    phases: list[tuple[str, Callable[[], PhaseResult]]] = [
        ("environment", lambda: environment_phase(plan, base_env, checks)),
        (
            "checkpoint_prefetch",
            lambda: checkpoint_phase(plan, lambda env: signal_ready("checkpoint_prefetch", env)),
        ),
    ]

    def run(name: str, fn: Callable[[], PhaseResult]) -> None:
        start = time.time()
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            result = PhaseResult(
                name, outcome="failed", error=exc, detail={"error": f"{type(exc).__name__}: {exc}"}
            )
        end = time.time()
        try:
            if trace is not None:  # detail may hold its own "outcome" (ensure's)
                trace.write(
                    Span(
                        trace.node,
                        trace.rank,
                        name,
                        start,
                        end,
                        result.bytes,
                        result.outcome,
                        attempt,
                        result.detail,
                        result.bytes_by_remote,
                    )
                )
            quiet = attempt > 0 and result.outcome == "skipped" and "error" not in result.detail
            if result.error is None and not quiet:  # an unconfigured phase is said once
                say(f"{name}: {result.summary} in {end - start:.2f}s")
        except BaseException as exc:  # noqa: BLE001 - e.g. the trace disk is full
            if result.error is None:
                result.error = exc
        finally:
            with cond:
                if result.error is not None and name not in ready:
                    failed.append(result.error)
                elif result.error is not None:  # after the command started: said, not fatal
                    say(f"warning: {name} failed after the command started: {result.error}")
                ready.setdefault(name, dict(result.env))
                cond.notify_all()

    threads = [
        threading.Thread(target=run, args=(name, fn), name=f"bootseer-{name}", daemon=True)
        for name, fn in phases
    ]
    for thread in threads:
        thread.start()
    with cond:
        while not failed and len(ready) < len(phases):
            cond.wait()
        if failed:
            raise failed[0]
        env: dict[str, str] = {}
        for name, _ in phases:
            env.update(ready[name])
    _lingering.extend(t for t in threads if t.is_alive())
    return env
