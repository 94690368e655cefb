"""``bootseer controller``: the job's controller (:mod:`bootseer.robust.controller`) on a
stable host, with the c10d store that torchrun's rendezvous and the agents use."""

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
        "controller", help="the job's controller: localize failures across nodes, decide",
        description="Watches the events that every node's agent (bootseer run --controller) "
                    "publishes in the job's c10d store; on a crash, hang, NaN or slow node "
                    "it orders every node to dump its stacks, aggregates them, and writes a "
                    "verdict (suspect ranks, nodes to evict, evidence) that the agents wait "
                    "for before they stop anything. Stateless: kill it and start it again. "
                    "With --port it hosts the store (started in a process of its own that "
                    "outlives the controller) unless one already serves that port.",
        epilog="example: bootseer controller --port 29400 --trace-dir /var/lib/bootseer/ctl "
               "--exclusion /var/lib/bootseer/excluded.json; then on every node: bootseer "
               "run --controller HOST:29400 -- torchrun --rdzv-backend c10d --rdzv-endpoint "
               "HOST:29400 --rdzv-conf is_host=false ...")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="host the store on this port (0.0.0.0)")
    where.add_argument("--store", metavar="HOST:PORT", help="use a store that runs elsewhere")
    p.add_argument("--job", default="job", help="the job's name in the store (torchrun's "
                                                "--rdzv-id; default job)")
    p.add_argument("--trace-dir", metavar="DIR",
                   help="events and verdicts go to DIR/controller.jsonl")
    p.add_argument("--exclusion", metavar="FILE", help="the exclusion list evicted nodes are "
                                                       "added to (bootseer.robust.policy)")
    p.add_argument("--layout", metavar="JSON", help='the job\'s parallel groups, e.g. '
                   '\'{"dp": [[0, 1], [2, 3]]}\': the failure domain to evict')
    p.add_argument("--dump-wait", type=float, default=10.0,
                   help="seconds to wait for every node's dump before deciding (default 10)")
    p.set_defaults(func=cmd_controller)


def cmd_controller(args: argparse.Namespace) -> int:
    from ..robust import wire
    from ..robust.controller import Controller

    layout = None
    if args.layout:
        try:
            layout = json.loads(args.layout)
            if not isinstance(layout, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise CliError(f"--layout {args.layout!r} is not a JSON object of groups ({exc}):"
                           ' e.g. \'{"dp": [[0, 1], [2, 3]]}\'') from None
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise CliError(f"--port {args.port}: use 1-65535")
        address = f"127.0.0.1:{args.port}"
        if not _listening(args.port):
            _start_store(args.port, Path(args.trace_dir) if args.trace_dir else None)
    else:
        address = args.store
        wire.parse_address(address)
    try:
        store = wire.connect(address, timeout_s=30)
    except (RuntimeError, OSError) as exc:
        raise CliError(f"cannot reach the store at {address}: {exc}") from None
    trace = Path(args.trace_dir) / "controller.jsonl" if args.trace_dir else None
    ctl = Controller(store, job=args.job, trace_path=trace, exclusion=args.exclusion,
                     layout=layout, dump_wait_s=args.dump_wait)
    try:
        excluded = ctl.publish_exclusions()
    except ValueError as exc:  # an unreadable exclusion file: refused, left as it is
        raise CliError(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"READY controller of job {args.job} at {address} (pid {os.getpid()}); "
          f"{len(ctl.nodes())} node(s) registered"
          + (f"; excluded: {', '.join(excluded)}" if excluded else ""), flush=True)
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
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / "store.log", "ab") if log_dir else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "bootseer.robust.store_host", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("READY"):
        raise CliError(f"the store did not start on port {port} (exit {proc.poll()}): is the "
                       "port taken by something else?")
    print(f"bootseer controller: store started on port {port} (pid {proc.pid})",
          file=sys.stderr, flush=True)
