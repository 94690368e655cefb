"""``bootseer check``: the stop-time checks (collective self-test, bitwise alignment test)
between ``--nproc`` local processes, or between the ranks of the torchrun job it runs in."""

from __future__ import annotations

import argparse
import os
import sys

from .errors import CliError

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``check`` subcommand."""
    p = sub.add_parser(
        "check",
        help="collective self-test and bitwise alignment test between processes",
        description="Runs an all_reduce whose sums are checked exactly, measures all_reduce "
        "bandwidth, and runs one step of a fixed reference model on every "
        "participant (deterministic, single-threaded), naming the ranks whose "
        "output or gradient hashes differ from the majority. Inside a torchrun "
        "job (RANK, WORLD_SIZE, MASTER_ADDR set) every rank joins; otherwise "
        "--nproc local processes run it. Exit code 1 when a check fails.",
        epilog="examples: bootseer check --nproc 4 | torchrun --nproc-per-node 8 -m "
        "bootseer check --trace-dir /var/lib/bootseer/trace",
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="local processes when not under torchrun (default 2)"
    )
    p.add_argument(
        "--mib",
        type=float,
        default=16.0,
        help="MiB all-reduced for the bandwidth figure (default 16)",
    )
    p.add_argument(
        "--trace-dir",
        metavar="DIR",
        help="write the events and the verdict into this trace directory",
    )
    p.add_argument(
        "--node", help="this node's name in the trace (default: BOOTSEER_NODE, else the hostname)"
    )
    p.add_argument(
        "--store",
        metavar="HOST:PORT",
        help="the checks a controller ordered: meet the job's other nodes in its "
        "store and hand the result to the controller (needs --incident)",
    )
    p.add_argument("--job", default="job", help="the job's name in the store (default job)")
    p.add_argument("--incident", type=int, help="the incident whose check order to run")
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from ..robust.check import run_local, run_rank
    from ..robust.events import write_record
    from ..trace import default_node

    if args.mib <= 0:
        raise CliError(f"--mib {args.mib}: give a size above 0")
    nbytes = int(args.mib * 2**20)
    node = args.node or default_node()
    in_job = all(os.environ.get(v) for v in LAUNCHER_VARS)
    if args.store and args.incident is None:
        raise CliError("--store needs --incident: the incident whose check order to run")
    try:
        if args.store:
            from ..robust.check import run_for_incident

            report = run_for_incident(
                args.store, job=args.job, incident=args.incident, node=node, nbytes=nbytes
            )
            rank = 0 if report.results[0].node == node else 1  # the first node prints
        elif in_job:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            report = run_rank(rank, world, nbytes=nbytes, node=node)
        else:
            rank = 0
            report = run_local(args.nproc, nbytes=nbytes)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    except RuntimeError as exc:
        raise CliError(f"check could not run: {exc}") from None
    if rank == 0:
        print(report.text(), flush=True)
        if args.trace_dir:
            path = os.path.join(args.trace_dir, f"{node}.jsonl")
            for record in report.records():
                write_record(path, record)
            print(f"verdict written to {path}", file=sys.stderr)
    code = 0 if report.ok else 1
    if in_job or args.store:
        # Everything is written. gloo's threads can abort the interpreter's teardown after the
        # process group is gone ("terminate called without an active exception", rank 0
        # under torchrun, about one run in two on a loaded machine): leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
