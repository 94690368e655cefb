"""``bootseer controller``: the job's controller (:mod:`bootseer.robust.controller`) on a
stable host, with the c10d store that torchrun's rendezvous and the agents use;
``bootseer controller publish``: a new version of the job's code or environment
(:mod:`bootseer.robust.update`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from .errors import CliError


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``controller`` subcommand."""
    p = sub.add_parser(
        "controller",
        help="the job's controller: localize failures across nodes, decide",
        description="Watches the events that every node's agent (bootseer run --controller) "
        "publishes in the job's c10d store; on a crash, hang, NaN, loss jump or "
        "slow node it orders every node to dump its stacks, aggregates them, and "
        "writes a verdict (suspect ranks, nodes to evict, evidence) that the "
        "agents wait for before they stop anything. Fail-slow rounds (step times "
        "and stack samples) run every --failslow-interval seconds; after a NaN, a "
        "jump or an unclear crash every node runs bootseer check before the "
        "verdict. Stateless: kill it and start it again. "
        "With --port it hosts the store (started in a process of its own that "
        "outlives the controller) unless one already serves that port. "
        "'bootseer controller publish' publishes a new version of the job's code "
        "or environment (see its --help).",
        epilog="example: bootseer controller --port 29400 --trace-dir /var/lib/bootseer/ctl "
        "--exclusion /var/lib/bootseer/excluded.json; then on every node: bootseer "
        "run --controller HOST:29400 -- torchrun --rdzv-backend c10d --rdzv-endpoint "
        "HOST:29400 --rdzv-conf is_host=false ...",
    )
    where = p.add_mutually_exclusive_group()  # one of them: checked in cmd_controller
    where.add_argument("--port", type=int, help="host the store on this port (0.0.0.0)")
    where.add_argument("--store", metavar="HOST:PORT", help="use a store that runs elsewhere")
    p.add_argument(
        "--job",
        default="job",
        help="the job's name in the store (torchrun's --rdzv-id; default job)",
    )
    p.add_argument(
        "--trace-dir", metavar="DIR", help="events and verdicts go to DIR/controller.jsonl"
    )
    p.add_argument(
        "--exclusion",
        metavar="FILE",
        help="the exclusion list evicted nodes are added to (bootseer.robust.policy)",
    )
    p.add_argument(
        "--layout",
        metavar="JSON",
        help="the job's parallel groups, e.g. "
        "'{\"dp\": [[0, 1], [2, 3]]}': the failure domain to evict",
    )
    p.add_argument(
        "--dump-wait",
        type=float,
        default=10.0,
        help="seconds to wait for every node's dump before deciding (default 10)",
    )
    p.add_argument(
        "--failslow-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a fail-slow round (step times and a stack sample of every rank) "
        "every SECONDS while no incident is open; 0 = off (default 10)",
    )
    p.add_argument(
        "--check-wait",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="seconds to wait for every node's stop-time check result after a "
        "NaN, a loss jump or an unclear crash (default 180)",
    )
    p.set_defaults(func=cmd_controller)
    pub = p.add_subparsers(dest="controller_command", metavar="SUBCOMMAND").add_parser(
        "publish",
        help="publish a version of the job's code or environment",
        description="Stores a version (a code directory the command runs in, variables for "
        "its environment) in the job's store and makes it the one every node "
        "runs from the next restart on (lazy), at once (--urgent), or after "
        "--window seconds without a restart. The version before it is kept: a "
        "failure that follows the update rolls it back. Versions are immutable; "
        "publishing a known id alone (no --workdir/--env) makes it current again.",
        epilog="example: bootseer controller publish --store 10.0.0.5:29400 --id rev-8f3a "
        "--workdir /shared/code/rev-8f3a --env LR=3e-4 --window 86400",
    )
    pub.add_argument("--store", metavar="HOST:PORT", required=True, help="the job's store")
    pub.add_argument("--job", default="job", help="the job's name in the store (default job)")
    pub.add_argument(
        "--id",
        required=True,
        dest="version_id",
        help="the version's id: 1-63 letters, digits, '.', '_', '-'",
    )
    pub.add_argument(
        "--workdir",
        help="absolute path of the code directory the command runs in, the same on every node",
    )
    pub.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for the command's environment (repeatable)",
    )
    when = pub.add_mutually_exclusive_group()
    when.add_argument(
        "--urgent", action="store_true", help="restart every node on it now (at its next step)"
    )
    when.add_argument(
        "--window",
        type=float,
        metavar="SECONDS",
        help="force the restart this long after publishing if none came",
    )
    pub.set_defaults(func=cmd_publish)


def cmd_publish(args: argparse.Namespace) -> int:
    from ..robust import seal, update, wire

    try:
        seal.require_secret("bootseer controller publish")
        wire.Keys(args.job)
        wire.parse_address(args.store)
        if args.workdir is not None or args.env:
            workdir = os.path.abspath(args.workdir) if args.workdir else None
            if workdir is not None and not os.path.isdir(workdir):
                raise update.VersionError(
                    f"version {args.version_id!r}: --workdir {workdir} is "
                    "not a directory here: put the code there first"
                )
            version: update.Version | str = update.Version(
                args.version_id, workdir, update.parse_env(args.env)
            ).check()
        else:  # a known version made current again: its id is checked before the store
            version = update.Version(args.version_id).check().id
        if args.window is not None and not args.window >= 0:
            raise update.VersionError(f"--window {args.window}: seconds, 0 or more")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    store = _connect(args.store)
    try:
        doc = update.publish(store, args.job, version, urgent=args.urgent, window_s=args.window)
    except update.VersionError as exc:
        raise CliError(str(exc)) from None
    when = (
        "urgent: every node restarts on it now"
        if doc.urgent
        else f"at the next restart, forced after {doc.window_s:g} s"
        if doc.window_s is not None
        else "at the next restart"
    )
    print(
        f"published version {doc.id} in job {args.job} (replacing {doc.previous}; "
        f"publication {doc.seq}): {when}",
        flush=True,
    )
    return 0


def _connect(address: str) -> object:
    from ..robust import wire

    try:
        return wire.connect(address, timeout_s=30)
    except (RuntimeError, OSError) as exc:
        raise CliError(f"cannot reach the store at {address}: {exc}") from None


def cmd_controller(args: argparse.Namespace) -> int:
    from ..robust import seal, wire
    from ..robust.controller import Controller

    try:
        seal.require_secret("bootseer controller")
    except seal.SealError as exc:
        raise CliError(str(exc)) from None
    layout = None
    if args.layout:
        try:
            layout = json.loads(args.layout)
            if not isinstance(layout, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise CliError(
                f"--layout {args.layout!r} is not a JSON object of groups ({exc}):"
                " e.g. '{\"dp\": [[0, 1], [2, 3]]}'"
            ) from None
    if (args.port is None) == (args.store is None):
        raise CliError(
            "bootseer controller needs --port PORT (host the store) or --store "
            "HOST:PORT (use one that runs elsewhere)"
        )
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise CliError(f"--port {args.port}: use 1-65535")
        address = f"127.0.0.1:{args.port}"
        if not _listening(args.port):
            _start_store(args.port, Path(args.trace_dir) if args.trace_dir else None)
    else:
        address = args.store
        wire.parse_address(address)
    store = _connect(address)
    trace = Path(args.trace_dir) / "controller.jsonl" if args.trace_dir else None
    if args.failslow_interval < 0 or args.check_wait <= 0:
        raise CliError(
            f"--failslow-interval {args.failslow_interval} / --check-wait "
            f"{args.check_wait}: give seconds (0 turns the rounds off)"
        )
    ctl = Controller(
        store,
        job=args.job,
        trace_path=trace,
        exclusion=args.exclusion,
        layout=layout,
        dump_wait_s=args.dump_wait,
        failslow_interval_s=args.failslow_interval,
        check_wait_s=args.check_wait,
    )
    try:
        excluded = ctl.publish_exclusions()
    except ValueError as exc:  # an unreadable exclusion file: refused, left as it is
        raise CliError(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"READY controller of job {args.job} at {address} (pid {os.getpid()}); "
        f"{len(ctl.nodes())} node(s) registered"
        + (f"; excluded: {', '.join(excluded)}" if excluded else ""),
        flush=True,
    )
    ctl.run(stop)
    return 0


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _start_store(port: int, log_dir: Path | None) -> None:
    """The store in a session of its own: it outlives this controller (a restarted one
    finds the job's state in it)."""
    log = subprocess.DEVNULL
    if log_dir:  # made 0700 or checked (this user's, nobody else writes it), no link followed
        from striped_fs import open_append

        log = open_append(log_dir, "store.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bootseer.robust.store_host", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("READY"):
        raise CliError(
            f"the store did not start on port {port} (exit {proc.poll()}): is the "
            "port taken by something else?"
        )
    print(
        f"bootseer controller: store started on port {port} (pid {proc.pid})",
        file=sys.stderr,
        flush=True,
    )
