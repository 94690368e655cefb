"""A small gloo job with one injected collective fault, for the colltrace tests and benchmark.

``python -m bootseer.testing.colltrace_job --world 3 --dir RINGS --fault sleep --rank 1
--at 20`` imports torch once, forks ``world`` ranks (each its own process group
member on loopback, tracing into ``RINGS``), and runs steps of a little Python compute and two
all_reduces (groups ``grp-a`` then ``grp-b``). At step ``--at`` rank ``--rank`` does:

* ``sleep``: sleeps ``--hold`` seconds before grp-a's all_reduce (never issues it meanwhile);
* ``slow``: from then on four threads spin beside the training thread (a CPU hog in its process);
* ``kill``: issues grp-a's all_reduce (asynchronously) and SIGKILLs itself while it is in
  flight (the others issue theirs once it is dead);
* ``stop``: issues grp-a's all_reduce (asynchronously) and SIGSTOPs itself (the others issue
  theirs once it is stopped: issued everywhere, completed nowhere);
* ``mismatch``: all_reduces 8 elements where the others reduce 4;
* ``deadlock``: grp-b's all_reduce before grp-a's (the others: a, then b);
* ``fsdp``: no fault: after the steps, one FSDP2 step of a tiny model and a DCP save to
  ``--ckpt`` (and the Flight Recorder's buffer into the ring directory when
  ``TORCH_FR_BUFFER_SIZE`` is set);
* ``none``: no fault.

Each rank prints ``injected <fault> rank <r> at <time>`` when it injects; the job runs
``--steps`` steps (then exits 0) unless a fault stops it, or until the file ``--until`` names
exists (every rank stops after the same step).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

FAULTS = ("none", "sleep", "slow", "kill", "stop", "mismatch", "deadlock", "fsdp")


def _compute(ms: float) -> None:
    """``ms`` of this thread's CPU time (not wall time: a loaded machine stretches the step,
    the work stays the same; a thread contending for the GIL slows it)."""
    end = time.thread_time() + ms / 1000
    x = 0
    while time.thread_time() < end:
        for i in range(200):
            x += i * i


def _hog() -> None:
    x = 0
    while True:
        for i in range(1000):
            x += i


def _ring_dir(args: argparse.Namespace) -> str:
    """The job's ring directory (``--dir``, else the one ``bootseer run`` hands over)."""
    import bootseer.colltrace as colltrace

    return args.dir or os.environ.get(colltrace.DIR_ENV) or str(colltrace.default_dir())


def _wait_marker(marker: str, states: tuple[str, ...], timeout_s: float = 120.0) -> None:
    """Until the rank that wrote ``marker`` (its pid) is in one of ``states`` (its /proc
    state letter; '' = gone): its op is in flight, alone."""
    from bootseer.colltrace.analyze import proc_state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(marker) as f:
                pid = int(f.read() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid:
            st = proc_state(pid)
            if (st[0] if st else "") in states:
                return
        time.sleep(0.01)


def _say(args: argparse.Namespace, rank: int) -> None:
    print(f"injected {args.fault} rank {rank} at {time.time():.6f}", flush=True)


def rank_main(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    import bootseer.colltrace as colltrace

    os.environ.setdefault("RANK", str(rank))
    if os.environ.get("BOOTSEER_CONTROL_DIR"):  # under bootseer run: the SIGUSR1 stack dump
        import bootseer.client  # noqa: F401
    if args.trace:
        colltrace.enable(args.dir, capacity=args.capacity)
    if args.torchrun:  # torchrun's rendezvous gave RANK, WORLD_SIZE and the store
        dist.init_process_group("gloo")
        args.world = dist.get_world_size()
    else:
        # a file store in the ring directory unless a port is given: no port to race for
        init = (
            f"tcp://127.0.0.1:{args.port}"
            if args.port
            else f"file://{os.path.abspath(os.path.join(_ring_dir(args), '.store'))}"
        )
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.world)
    ranks = list(range(args.world))
    a = dist.new_group(ranks, group_desc="grp-a")
    b = dist.new_group(ranks, group_desc="grp-b")
    t = torch.ones(args.numel)
    me = rank == args.rank
    times: list[float] = []
    cpu0 = 0.0
    if args.alternate:
        from bootseer.colltrace.recorder import Recorder

        alt = Recorder(args.dir, capacity=args.capacity)
    per_mode: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for step in range(args.steps):
        times.append(time.perf_counter())
        if step == 5:
            cpu0 = time.process_time()  # every thread of the process: gloo's too
        if args.alternate:  # blocks of steps traced and not, in turns, on every rank at once
            on = (step // args.alternate) % 2 == 0
            if args.alternate_control:
                pass
            elif on and not alt.installed:
                alt.install()
            elif not on and alt.installed:
                alt.uninstall(close=False)  # the same ring when it comes back
            wall, cpu = time.perf_counter(), time.process_time()
        _compute(args.work_ms)
        if step == args.at and me:
            if args.fault == "sleep":
                _say(args, rank)
                time.sleep(args.hold)
            elif args.fault == "slow":
                for _ in range(4):
                    threading.Thread(target=_hog, daemon=True).start()
                _say(args, rank)
            elif args.fault in ("kill", "stop"):  # the others issue theirs once it is
                work = dist.all_reduce(t, group=a, async_op=True)  # dead or stopped
                _say(args, rank)
                with open(os.path.join(_ring_dir(args), f".{args.fault}"), "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
                work.wait()  # continued (SIGCONT): the op completes, the step goes on
                dist.all_reduce(t, group=b)
                continue
            elif args.fault == "mismatch":
                _say(args, rank)
                dist.all_reduce(torch.ones(8), group=a)
                dist.all_reduce(t, group=b)
                continue
            elif args.fault == "deadlock":
                _say(args, rank)
                dist.all_reduce(t, group=b)
                dist.all_reduce(t, group=a)
                continue
        elif step == args.at and args.fault in ("kill", "stop"):
            _wait_marker(
                os.path.join(_ring_dir(args), f".{args.fault}"),
                ("", "Z", "X") if args.fault == "kill" else ("T", "t"),
            )
        # --until: rank 0 adds 1 to grp-a's sum once the file exists; every rank reads the
        # sum and stops after the same step (the op pattern unchanged)
        t.fill_(2.0 if args.until and rank == 0 and os.path.exists(args.until) else 1.0)
        dist.all_reduce(t, group=a)
        stop = bool(args.until) and float(t[0]) > args.world
        dist.all_reduce(t, group=b)
        if args.alternate and step >= 5:
            per_mode[on].append((time.perf_counter() - wall, time.process_time() - cpu))
        if stop:
            break
    if rank == 0 and args.alternate:
        med = {
            m: [1000 * sorted(x[i] for x in v)[len(v) // 2] for i in (0, 1)]
            for m, v in per_mode.items()
            if v
        }
        print(
            f"alt_ms on {med[True][0]:.4f} off {med[False][0]:.4f} cpu_on "
            f"{med[True][1]:.4f} cpu_off {med[False][1]:.4f} steps "
            f"{len(per_mode[True])} {len(per_mode[False])}",
            flush=True,
        )
    if rank == 0 and len(times) > 6:
        steps = [b - a for a, b in zip(times[5:], times[6:], strict=False)]
        cpu = (time.process_time() - cpu0) / (len(times) - 5)
        print(
            f"iter_ms {1000 * sorted(steps)[len(steps) // 2]:.4f} mean "
            f"{1000 * sum(steps) / len(steps):.4f} cpu_ms {1000 * cpu:.4f}",
            flush=True,
        )
    if args.fault == "fsdp":
        _fsdp(args, rank)
        if os.environ.get("TORCH_FR_BUFFER_SIZE"):  # the Flight Recorder's view, beside
            _write_settled_dump(args.dir, rank)
    dist.destroy_process_group()


def _write_settled_dump(directory: str, rank: int) -> None:
    """The Flight Recorder's dump once every entry it holds is marked completed (5 s at most).

    gloo marks an entry completed from the work's own thread after the caller's ``wait()``
    returned, so a dump taken right after the last collective can still show it running
    (a full CI run caught one); the test compares the completed view.
    """
    from bootseer.colltrace.flight import dump, write_dump

    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        doc = dump() or {}
        if all(e.get("state") == "completed" or e.get("retired") for e in doc.get("entries") or []):
            break
        time.sleep(0.05)
    write_dump(directory, rank)


def _fsdp(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(2, 8)).sum()
    loss.backward()
    opt.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=args.ckpt)


class Trial:
    """One injected fault, watched: when it was injected, what the reader found, and when."""

    def __init__(
        self,
        fault: str,
        directory: str,
        *,
        world: int = 3,
        rank: int = 1,
        at: int = 20,
        port: int | None = None,
        work_ms: float = 20.0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        import subprocess

        self.fault, self.rank, self.directory = fault, rank, directory
        self.port = port  # None: the job's file store (no port to race for)
        cmd = [
            sys.executable,
            "-m",
            "bootseer.testing.colltrace_job",
            "--world",
            str(world),
            *(["--port", str(port)] if port else []),
            "--dir",
            directory,
            "--fault",
            fault,
            "--rank",
            str(rank),
            "--at",
            str(at),
            "--work-ms",
            str(work_ms),
            *(extra or []),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.injected: float | None = None
        self._passes: list[tuple[float, list[object]]] = []  # (pass ended, its findings)
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            if line.startswith("injected ") and self.injected is None:
                self.injected = float(line.split(" at ")[1])

    def record(self, findings: list[object]) -> None:
        """Keep one pass's findings with the time the pass ended (see :func:`split`)."""
        self._passes.append((time.time(), findings))

    @property
    def found(self) -> list[object]:
        """Findings of passes that ended at or after the injection's stamp."""
        return split(self._passes, self.injected)[1]

    @property
    def before(self) -> list[object]:
        """Findings of passes that ended before the injection: false alarms."""
        return split(self._passes, self.injected)[0]

    def ended_clean(self) -> bool:
        """The job ended and never injected (its output read to the end first)."""
        if self.proc.poll() is None:
            return False
        self._reader.join(timeout=10)  # the injection's line may still be in the pipe
        return self.injected is None

    def watch(
        self, watch: object, timeout_s: float, *, until: object = None, poll_s: float = 0.5
    ) -> list[object]:
        """Poll ``watch`` (a :class:`bootseer.colltrace.reader.Watch`) until a finding after
        the injection satisfies ``until`` (default: any), the job ends, or the timeout. The
        findings of passes that ended after the injection; earlier ones go to
        :attr:`before`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.record(watch.poll(force=True))  # type: ignore[attr-defined]
            if self.injected is not None and any(until(f) if until else True for f in self.found):  # type: ignore[operator]
                break
            if self.ended_clean():
                break
            time.sleep(poll_s)
        return self.found

    def stop(self) -> None:
        """SIGKILL the job's process group (the launcher and its ranks), reap the launcher."""
        try:  # the group too: ranks outlive a launcher that exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


class Probes:
    """:mod:`bootseer.colltrace.probe` on each cluster host (its own network namespace, its
    own link), started at once: torch imported and the store connected, as a node agent
    holding its store link would be; :meth:`measure` has them all measure then."""

    def __init__(self, hosts: list[Any], address: str) -> None:
        import subprocess

        self.procs = {
            h.name: h.popen(
                [
                    sys.executable,
                    "-m",
                    "bootseer.colltrace.probe",
                    "--store",
                    address,
                    "--node",
                    h.name,
                    "--on-stdin",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for h in hosts
        }

    def measure(self, timeout_s: float = 180.0) -> dict[str, dict[str, Any]]:
        """host name -> measures (``{"error": ...}`` for a host whose probe could not)."""
        import json

        for proc in self.procs.values():  # after its "ready" line: connected
            assert proc.stdout is not None and proc.stdin is not None
            _readline(proc.stdout, timeout_s)
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write("go\n")
                proc.stdin.flush()
        out: dict[str, dict[str, Any]] = {}
        for name, proc in self.procs.items():  # its result line, not its exit (torch's
            assert proc.stdout is not None  # teardown takes seconds under load)
            line = _readline(proc.stdout, timeout_s)
            try:  # a probe that could not measure prints its error as its result
                out[name] = json.loads(line)
            except ValueError:
                proc.kill()
                _, stderr = proc.communicate(timeout=30)
                raise RuntimeError(
                    f"probe on {name} exited {proc.returncode}: {stderr[-1000:]}"
                ) from None
        return out

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _readline(stream: Any, timeout_s: float) -> str:
    """One line of a child's output within ``timeout_s`` ('' after it)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        return stream.readline() if sel.select(timeout_s) else ""


def probe_hosts(
    hosts: list[Any], address: str, timeout_s: float = 180.0
) -> dict[str, dict[str, Any]]:
    """:class:`Probes` started and measured at once: host name -> measures."""
    probes = Probes(hosts, address)
    try:
        return probes.measure(timeout_s)
    finally:
        probes.close()


def split(
    passes: list[tuple[float, list[object]]], injected: float | None
) -> tuple[list[object], list[object]]:
    """(before, after) the injection's stamp, by when each pass ended. Why not by whether the
    stamp had been read when the pass began: the stamp comes through a pipe and a thread, and
    a killed rank's verdict is there 0.2 s after it, often before the line is read (the
    quick benchmark's kill trial then filed its only verdict as a false alarm). A pass that
    ended after the stamp may have read the fault: it counts after (a false alarm there
    counts against the verdict, never for it)."""
    before = [f for t, fs in passes if injected is None or t < injected for f in fs]
    after = [f for t, fs in passes if injected is not None and t >= injected for f in fs]
    return before, after


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="a TCP store on this port (default: a file store in the ring directory)",
    )
    p.add_argument(
        "--torchrun",
        action="store_true",
        help="one rank per process under torchrun (no fork, no --port)",
    )
    p.add_argument("--numel", type=int, default=4, help="elements per all_reduce")
    p.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="trace in blocks of N steps, in turns with N untraced (overhead)",
    )
    p.add_argument(
        "--alternate-control",
        action="store_true",
        help="with --alternate: the same blocks, the tracer never installed (an "
        "A/A control: the spread the alternation shows with no tracer)",
    )
    p.add_argument("--dir", required=True, help="ring directory")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--rank", type=int, default=1, help="the rank the fault is injected into")
    p.add_argument("--at", type=int, default=20, help="the step of the fault")
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument(
        "--until", default="", help="stop (exit 0) after the step in which this file exists"
    )
    p.add_argument("--work-ms", type=float, default=20.0)
    p.add_argument("--hold", type=float, default=600.0)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--ckpt", default="", help="fsdp: the DCP checkpoint directory")
    p.add_argument("--no-trace", dest="trace", action="store_false")
    args = p.parse_args(argv)
    if args.torchrun:
        rank_main(args, int(os.environ["RANK"]))
        return 0
    os.makedirs(_ring_dir(args), mode=0o700, exist_ok=True)  # the file store lives there
    import torch  # noqa: F401 - once, before the fork: every rank starts warm
    import torch.distributed  # noqa: F401

    pids = []
    for rank in range(args.world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(args, rank)
            except BaseException as exc:  # noqa: BLE001 - report, exit non-zero
                print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        pids.append(pid)
        print(f"rank {rank} pid {pid}", flush=True)
    code = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        code = code or os.waitstatus_to_exitcode(status)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
