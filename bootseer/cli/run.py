"""``bootseer run [config flags] -- CMD...``: the container entrypoint wrapper.

The startup phases (environment, checkpoint prefetch) run concurrently, CMD starts when the
environment is ready and the prefetch has planned its copy (the load waits for each file it
needs) and is supervised (signals forwarded, zombies reaped, exit code propagated,
restarts after a crash or a hang), and every step goes to the startup trace. The parts:
:mod:`bootseer.startup` (the phases), :mod:`bootseer.supervise` (the process), the client in
:mod:`bootseer.client`; this module only turns the configuration into them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
from typing import TYPE_CHECKING, Any

from .errors import CliError
from .options import open_trace

if TYPE_CHECKING:
    from ..robust.remote import ControllerLink

SHM = "/dev/shm"

#: The keys `bootseer run` takes flags for (the file and the environment may set any key).
RUN_KEYS = (
    "state",
    "run",
    "restart",
    "hang",
    "health",
    "controller",
    "env.spec",
    "env.prefix",
    "env.store",
    "env.base_image",
    "env.uv",
    "env.verify",
    "env.lazy",
    "env.cache",
    "ckpt",
    "storage",
    "striped",
    "colltrace",
)


def register(sub: argparse._SubParsersAction) -> None:
    from ..config import add_config_arguments

    run = sub.add_parser(
        "run",
        help="the container entrypoint: startup phases, then CMD, supervised",
        usage="bootseer run [--config FILE] [configuration flags] -- CMD [ARGS...]",
        description="Prepare the environment and prefetch the latest checkpoint for this "
        "node's ranks (concurrently), then run CMD as soon as the environment is "
        "ready (its load waits for the files still being copied): signals forwarded, zombies "
        "reaped, its exit code returned, restarted after a crash or a hang, and "
        "every phase in the startup trace.",
        epilog="example: bootseer run --config /etc/bootseer.toml -- torchrun "
        "--nproc-per-node 8 train.py",
    )
    add_config_arguments(run, RUN_KEYS)
    run.set_defaults(func=cmd_run, takes_command=True)


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command if isinstance(args.command, list) else []
    if not command:
        raise CliError("nothing to run: bootseer run [options] -- CMD [ARGS...]")
    from ..config import check_ckpt_cache_handoff, parse_ranks
    from ..deferred import DeferredChecks
    from ..robust.agent import Agent
    from ..robust.detect import HangDetector
    from ..startup import StartupPlan, close_lazy_environments, run_startup
    from ..supervise import HangPolicy, RestartPolicy, Supervisor
    from ..trace import default_node

    cfg = args.cfg
    if cfg.ckpt.url:  # the phase fills ckpt.cache_dir, and hands it over
        check_ckpt_cache_handoff(cfg)
    node = cfg.run.node or default_node()
    ckpt, env = cfg.ckpt, cfg.env
    plan = StartupPlan(
        env_spec=list(env.spec),
        env_prefix=env.prefix,
        env_store=env.store,
        env_base_image=env.base_image,
        env_uv=env.uv,
        env_verify=env.verify,
        env_lazy=env.lazy,
        env_cache=env.cache,
        ckpt_url=ckpt.url,
        ckpt_cache_dir=ckpt.cache_dir,
        ranks=parse_ranks(ckpt.ranks, os.environ) if ckpt.url else [],
        ckpt_connections=ckpt.connections,
        allow_fresh_start=cfg.run.allow_fresh_start,
        storage_options=_options(cfg) or None,
    )
    trace = open_trace(cfg)
    base_env = dict(os.environ)

    checks = DeferredChecks()  # the warm start's file checks, beside the command

    def before_attempt(attempt: int) -> dict[str, str]:
        if memory is not None:  # the copies' check runs beside the launch (ckpt.memory_verify)
            memory.check_copies()  # type: ignore[attr-defined]
        node_check(cfg, trace, node, attempt)
        checks.reset()
        extra = run_startup(plan, trace=trace, attempt=attempt, base_env=base_env, checks=checks)
        return {**extra, **colltrace.child_env(attempt)} if colltrace else extra

    hang = HangPolicy(cfg.hang.timeout_s, cfg.hang.dump_wait_s, cfg.hang.startup_s)
    detector = None
    if hang.timeout_s > 0:
        detector = HangDetector(hang.timeout_s)
    elif cfg.hang.learn:
        detector = HangDetector(None, initial_s=hang.startup_s)
    remote = _controller_link(cfg, node)
    versions = None
    if remote is not None:  # what each attempt runs: the version pinned for its epoch
        from ..robust.update import NodeVersions

        versions = NodeVersions(
            remote.store,
            node,
            job=cfg.controller.job,  # type: ignore[attr-defined]
            log=lambda line: print(f"bootseer: {line}", file=sys.stderr, flush=True),
        )

    colltrace = _colltrace_watch(cfg, trace, node)
    try:
        memory = _node_memory(cfg, base_env)
    except CliError:
        _drop_rings(cfg, colltrace)
        raise
    agent = Agent(
        trace, node, hang=detector, max_no_progress=cfg.restart.max_no_progress, colltrace=colltrace
    )
    if remote is not None and colltrace is not None:  # the rings' window to the controller
        remote.colltrace = colltrace.window  # type: ignore[attr-defined]
    supervisor = Supervisor(
        command,
        env=base_env,
        trace=trace,
        node=node,
        dump_dir=trace.dir,
        ready_file=cfg.run.ready_file or None,
        before_attempt=before_attempt,
        restart=RestartPolicy(
            cfg.restart.max_restarts, cfg.restart.backoff_s, cfg.restart.backoff_max_s
        ),
        hang=hang,
        agent=agent,
        tail_lines=cfg.run.log_tail_lines,
        remote=remote,
        remote_wait_s=cfg.controller.wait_s,
        versions=versions,
        crash_grace_s=cfg.hang.crash_grace_s,
        checks=checks.failure,
        preload=[m.strip() for m in cfg.run.preload.split(",")],
        standby=cfg.run.standby,
    )
    try:
        code = supervisor.run()
    except CliError as exc:  # a startup phase failed: the job does not start
        _exit_if_lingering(f"bootseer: error: {exc}", 2)
        raise
    finally:
        close_lazy_environments()
        if memory is not None:
            memory.close()
        _drop_rings(cfg, colltrace)
    _exit_if_lingering(None, code)
    return code


def _drop_rings(cfg: argparse.Namespace, colltrace: object | None) -> None:
    """The job's ring directory goes with the run when it is in /dev/shm (not named)."""
    if colltrace is not None and not cfg.colltrace.dir:
        colltrace.close()  # type: ignore[attr-defined]
        shutil.rmtree(colltrace.base, ignore_errors=True)  # type: ignore[attr-defined]


def _node_memory(cfg: argparse.Namespace, env: dict[str, str]) -> object | None:
    """The memory tier's directory and peer server, owned by this agent (ckpt.memory)."""
    if not cfg.ckpt.memory:
        return None
    from ..robust.memtier import NodeMemory

    try:
        memory = NodeMemory(
            cfg.ckpt.memory_dir,
            cfg.ckpt.memory_listen,
            cfg.ckpt.durable_every,
            layout=cfg.ckpt.memory_layout,
            replication=cfg.ckpt.memory_replication,
            durable_outage_s=cfg.ckpt.durable_outage_s,
            log=lambda m: print(f"bootseer: {m}", file=sys.stderr, flush=True),
        )
    except (OSError, ValueError) as exc:
        raise CliError(f"memory tier (ckpt.memory): {exc}") from None
    env.update(memory.env)
    return memory


def _colltrace_watch(cfg: argparse.Namespace, trace: object, node: str) -> object | None:
    """The reader of the ranks' collective rings ([colltrace] enabled), or None."""
    ct = cfg.colltrace
    if not ct.enabled:
        return None
    if not 0 < ct.poll_s <= 2:
        raise CliError(
            f"[colltrace] poll_s = {ct.poll_s}: the reader must pass at least every "
            "2 s; give a value in (0, 2]"
        )
    from striped_fs import PrivateDir

    from ..colltrace.analyze import Analyzer
    from ..colltrace.reader import Watch

    # the job's own directory, made here (0700, exclusively) with a name nobody can guess,
    # in colltrace.dir (made 0700 or checked) or /dev/shm; the ranks get it from the
    # environment (BOOTSEER_COLLTRACE_DIR, one directory per attempt inside)
    parent = ct.dir or (SHM if os.path.isdir(SHM) else tempfile.gettempdir())
    try:
        job = PrivateDir.new(parent, "bootseer-colltrace-", what="colltrace.dir")
    except OSError as exc:
        raise CliError(f"[colltrace] cannot make the ring directory in {parent}: {exc}") from None
    job.close()
    return Watch(
        job.path,
        trace_dir=trace.dir,
        node=node,  # type: ignore[attr-defined]
        poll_s=ct.poll_s,
        analyzer=Analyzer(stuck_s=ct.stuck_s, straggler_s=ct.straggler_s, node=node),
    )


def _controller_link(cfg: argparse.Namespace, node: str) -> ControllerLink | None:
    """The link to the job's controller, registered; None without ``controller.address``."""
    if not cfg.controller.address:
        return None
    from ..robust.remote import ControllerLink, ExcludedNode
    from ..robust.seal import SealError, require_secret

    try:
        require_secret("bootseer run --controller")
    except SealError as exc:
        raise CliError(str(exc)) from None
    try:
        link = ControllerLink.connect(
            cfg.controller.address, node, job=cfg.controller.job, timeout_s=cfg.controller.wait_s
        )
        link.register()
    except ExcludedNode as exc:
        raise CliError(str(exc)) from None
    except (ValueError, RuntimeError, OSError) as exc:  # TCPStore raises these
        raise CliError(
            f"cannot reach the controller's store at {cfg.controller.address} "
            f"(controller.address): {exc}"
        ) from None
    print(
        f"bootseer: controller: node {node} registered at {cfg.controller.address} "
        f"(job {cfg.controller.job})",
        file=sys.stderr,
        flush=True,
    )
    return link


def node_check(cfg: argparse.Namespace, trace: object, node: str, attempt: int) -> None:
    """The node's health before a (re)start: a failed check is an event in the trace and a
    :class:`~bootseer.startup.StartupError` naming the resource (the job does not start)."""
    from ..robust.events import write_record
    from ..robust.health import check_node
    from ..startup import StartupError

    paths = {
        "state.dir": cfg.state.dir,
        "ckpt.cache_dir": cfg.ckpt.cache_dir,
        "run.trace_dir": cfg.run.trace_dir,
    }
    results = check_node(
        paths,
        min_free_disk=cfg.health.min_free_disk,
        min_free_memory=cfg.health.min_free_memory,
        gpu=cfg.health.gpu,
        node=node,
    )
    failed = [r for r in results if r.ok is False]
    for result in failed:
        try:
            write_record(trace.path, result.event())  # type: ignore[attr-defined]
        except OSError as exc:  # the full disk may be the trace's own
            print(f"bootseer: warning: cannot write the trace: {exc}", file=sys.stderr)
    if failed:
        raise StartupError(
            f"node check failed before attempt {attempt}, the job does not "
            "start: " + "; ".join(r.message for r in failed)
        )
    if attempt == 0:
        print(
            "bootseer: node check: " + "; ".join(r.message for r in results),
            file=sys.stderr,
            flush=True,
        )


def _exit_if_lingering(message: str | None, code: int) -> None:
    """A phase abandoned by a stop or by the other phase's failure may still run in a
    non-daemon worker thread (the prefetch's pool), which the interpreter would wait for
    at exit: leave without waiting."""
    if not any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        return
    if message:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _options(cfg: Any) -> dict[str, Any]:
    """``storage.options`` with ``striped.mirror`` merged in."""
    from ..config import storage_options

    return storage_options(cfg)
