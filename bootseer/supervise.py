"""Supervision of the command of ``bootseer run``: a container's PID 1 done right, plus restarts.

What it does, and why:

* The command runs in its own process group, so that a signal reaches all of it (a launcher
  such as torchrun and its workers) and so that what it leaves behind can be found and killed
  before a restart (a stale worker would still hold its GPU).
* SIGTERM, SIGINT, SIGHUP and SIGQUIT are forwarded to that group and stop the job: what the
  command then exits with is the wrapper's exit code, and nothing is restarted. A second one
  while waiting sends SIGKILL to the group and returns at once. SIGUSR2 and SIGWINCH are
  forwarded as they are; SIGUSR1 asks the processes that registered the client's stack dump
  (and only them: SIGUSR1 kills a process without a handler) to write their stacks.
* Zombies are reaped: as PID 1 that is the kernel's rule, elsewhere the wrapper makes itself a
  child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``) so orphans of the command come to it. The
  reaping (``waitpid(-1)``) only runs while the command runs: during the startup phases other
  threads wait for their own subprocesses (pip, uv), which a ``waitpid(-1)`` would steal.
* The exit code is the command's, or 128+N when signal N killed it.
* A crash (non-zero exit or death by a signal the wrapper did not forward) is restarted up to
  ``max_restarts`` times, after a backoff that doubles from ``backoff_s`` to ``backoff_max_s``;
  the ``before_attempt`` hook (the startup phases) runs again before every attempt.
* A hang is a silence of the control directory (no ``ready-*``/``heartbeat-*`` file changed)
  of ``timeout_s`` once the command has reported anything; before its first report the
  allowance is ``max(timeout_s, startup_s)`` (default 10 minutes), since loading a model,
  compiling and the first collective legitimately take long, while a start stuck forever is
  still caught. A hang: SIGUSR1 to the group (stack dumps into the trace directory), a wait of
  up to ``dump_wait_s`` for them, SIGKILL to the group, a ``hang`` span, and a restart.
* With an ``agent`` (:class:`bootseer.robust.agent.Agent`) the command's output goes through a
  tee (:class:`bootseer.tee.OutputTail`: unchanged to the wrapper's stdout/stderr, its last
  ``tail_lines`` lines kept); a crash is classified from its exit status and those lines, and
  the policy's verdict decides: stop at once (a deterministic user error, no progress across
  restarts) or restart. Its heartbeats feed the agent's detectors: a rank silent past the
  hang threshold is a hang (as above), a NaN/Inf kills the command at the step it came
  (SIGKILL: no chance to checkpoint the damaged state) and the verdict decides the restart.
* With a ``remote`` (:class:`bootseer.robust.remote.ControllerLink`) a hang, a crash, a
  NaN/Inf or a loss jump is published to the job's controller, and on its order (polled in
  the watch loop) every rank's process tree is dumped (py-spy, else the client's stack files);
  the command is killed only once its verdict came (or ``remote_wait_s`` passed), or when the
  controller orders the stop-time checks (they run on the stopped node), or at once for a NaN;
  the verdict decides stop or restart (this node evicted: stop).
* With ``versions`` (:class:`bootseer.robust.update.NodeVersions`, beside a ``remote``) every
  attempt runs the version pinned for its epoch (the newest incident with a verdict): its
  variables in the command's environment, its code directory as the working directory. An
  update incident (urgent, or its window passed) restarts the command at the next heartbeat
  after the verdict; such a restart has no backoff and does not count as a failure.

No configuration lives here: :mod:`bootseer.cli.run` turns the configuration into the policies
and the hook.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from striped_fs.privdir import PrivateDir, open_append

from .prestart import Standby, python_command
from .process import (
    alive,
    become_subreaper,
    exit_code,
    group_pids,
    signal_name,
    since_boot,
    started_at,
)
from .robust.detect import Beat
from .robust.ranks import RankWatch
from .tee import OutputTail
from .trace import Span, TraceWriter
from .variables import INCIDENT_HANDOFF, VERSION_HANDOFF

__all__ = [
    "AttemptEnd",
    "HangPolicy",
    "RestartPolicy",
    "StopRequested",
    "Supervisor",
    "become_subreaper",
    "exit_code",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
FORWARD_SIGNALS = (signal.SIGUSR2, signal.SIGWINCH)
HANDLED = (*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGUSR1, signal.SIGCHLD)
#: seconds the command's kill waits, after the verdict, for native dumps still being taken
NATIVE_GRACE_S = 1.0
# a parked spare's longest wait for the job's nodes to form the new round after a verdict
SPARE_REJOIN_WAIT_S = 60.0
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_CHECK_FAILED = 2  # a startup check found the node unfit: as a startup error


@dataclass(frozen=True)
class RestartPolicy:
    """How often and how fast a crashed command is started again."""

    max_restarts: int = 0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0

    def delay(self, restart: int) -> float:
        """Seconds before restart number ``restart`` (1 for the first)."""
        return min(self.backoff_s * 2 ** max(restart - 1, 0), self.backoff_max_s)


@dataclass(frozen=True)
class HangPolicy:
    """``timeout_s`` 0 turns hang detection off."""

    timeout_s: float = 0.0
    dump_wait_s: float = 5.0
    startup_s: float = 600.0  # allowance before the first ready/heartbeat, if longer


@dataclass
class AttemptEnd:
    """How an attempt ended: ``reason`` is exited, signaled, hang, nonfinite (a NaN/Inf
    heartbeat), stopped (a stop signal came), update (stopped for a version update),
    crashed (killed: it still ran long after one of its ranks died), check-failed (a check
    beside the command failed: the environment's files) or not-started (the command could
    not be executed)."""

    attempt: int
    code: int
    reason: str
    pid: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.reason == "hang":
            return "a hang"
        if self.reason == "nonfinite":
            return "a NaN/Inf"
        if self.reason == "update":
            return "a restart for a version update"
        if self.reason == "crashed":
            return "a rank's crash (the command killed after it)"
        if self.code > 128 and self.reason in ("signaled", "stopped"):
            return f"signal {signal_name(self.code - 128)}"
        return f"exit code {self.code}"


class StopRequested(Exception):
    """A stop signal arrived while no command ran (startup phases, backoff)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stderr(line: str) -> None:
    print(f"bootseer: {line}", file=sys.stderr, flush=True)


class _Signals:
    """Signals as bytes on a pipe (``signal.set_wakeup_fd``): the main loop waits on it with
    ``select`` and handles them in order, never inside a handler."""

    def __init__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the supervisor must run in the main thread (it owns signals)")
        self.rfd, self.wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_fd = signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._noop) for s in HANDLED}

    @staticmethod
    def _noop(signum: int, frame: Any) -> None:
        """The byte on the pipe is the event; the handler only keeps the default away."""

    def wake(self) -> None:
        """Ends a wait early (a byte 0, which is no signal)."""
        try:
            os.write(self.wfd, b"\0")
        except OSError:
            pass

    def wait(self, timeout: float, wake: Sequence[int] = ()) -> list[int]:
        """Signals that arrived, waiting up to ``timeout`` seconds for the first, or for one
        of the ``wake`` descriptors to become readable (a rank's pidfd: it exited)."""
        try:
            ready, _, _ = select.select([self.rfd, *wake], [], [], max(timeout, 0.0))
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            ready = [self.rfd]
        if not ready:
            return []
        if self.rfd not in ready:
            return []
        try:
            data = os.read(self.rfd, 512)
        except BlockingIOError:
            return []
        return [sig for sig in data if sig]

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.rfd)
        os.close(self.wfd)


class Supervisor:
    """Runs ``command`` until it succeeds, is stopped, or runs out of restarts; :meth:`run`
    returns the exit code for the wrapper.

    ``before_attempt(attempt)`` runs before every spawn (the startup phases) and returns
    variables for the command's environment; an exception from it ends the run (raised
    from :meth:`run`: a startup error is not a crash). ``trace`` receives the command_start,
    first_step, hang and restart spans (the hook writes its own). Stack dumps go to
    ``dump_dir`` (the trace directory)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        restart: RestartPolicy = RestartPolicy(),
        hang: HangPolicy = HangPolicy(),
        trace: TraceWriter | None = None,
        node: str | None = None,
        dump_dir: str | os.PathLike | None = None,
        control_dir: str | os.PathLike | None = None,
        ready_file: str | os.PathLike | None = None,
        before_attempt: Callable[[int], Mapping[str, str] | None] | None = None,
        kill_grace_s: float = 5.0,
        agent: Any = None,
        tail_lines: int = 200,
        remote: Any = None,
        remote_wait_s: float = 30.0,
        versions: Any = None,
        crash_grace_s: float = 15.0,
        preload: Sequence[str] = (),
        standby: bool = False,
        checks: Callable[[], Any] | None = None,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        if not command:
            raise ValueError("nothing to run: the command is empty")
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.restart = restart
        self.hang = hang
        self.trace = trace
        self.node = node or (trace.node if trace is not None else None) or os.uname().nodename
        self.dump_dir = Path(dump_dir) if dump_dir else (trace.dir if trace else None)
        self._own_control = control_dir is None
        self.control_dir = Path(control_dir) if control_dir else None
        self.ready_file = Path(ready_file) if ready_file else None
        self.before_attempt = before_attempt
        self.kill_grace_s = kill_grace_s
        self.log = log
        self.agent = agent  # a bootseer.robust.agent.Agent, or None: no classification
        # a bootseer.robust.remote.ControllerLink (needs the agent), or None: the node alone
        self.remote = remote if agent is not None else None
        self.remote_wait_s = remote_wait_s
        self.versions = versions if self.remote is not None else None
        self.tail = OutputTail(tail_lines) if agent is not None and tail_lines > 0 else None
        self.crash_grace_s = crash_grace_s  # a rank died: the launcher's time to end
        self.attempts: list[AttemptEnd] = []
        self._ranks: RankWatch | None = None  # the ranks' own processes (with the agent)
        self._early: Any = None  # this attempt's crash event, seen at a rank's death
        self._early_at = 0.0  # monotonic, of the first death of the incident
        self._early_wall = 0.0  # the same, wall clock
        self._early_boot = 0.0  # the same, seconds since boot (processes' start times)
        self._lingering: dict[int, tuple[int, float]] = {}  # pid -> (rank, since): raised,
        # still alive
        self._signals: _Signals | None = None
        self._stopping: int | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._status: int | None = None
        self._skip_rules: list[Any] = []  # ckpt.skip.SkipRule per NaN verdict, for restarts
        self._by_controller = ""  # the class of the controller's verdict on the last attempt
        # --preload: the next attempt's interpreter, started ahead with these modules imported
        self.preload = tuple(m for m in preload if m)
        self._python = python_command(self.command) if self.preload else None
        if self.preload and self._python is None:
            self.log(
                "--preload: the command is not `python -m MODULE ...` or `python SCRIPT "
                "...` (an `env NAME=VALUE` prefix allowed): it starts as usual"
            )
        self._standby: Standby | None = None
        self._version_id: str | None = None  # the running attempt's code version
        # a warm spare node (docs/robust.md, "Warm standby"): its launcher may wait parked at
        # the rendezvous for hours without a rank, which is neither a hang nor a failure
        self.spare = standby
        self._watching: _Progress | None = None  # the running attempt's ranks' signals
        # the warm start's checks beside the command: the first failure
        # (bootseer.deferred.DeferredFailure), or None
        self.checks = checks

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> int:
        self._signals = _Signals()
        become_subreaper()
        # the ranks' status and ready files: a fresh directory (0700, a name nobody can
        # guess), or a named one made 0700 or checked (this user's, 0700, not a link)
        if self.control_dir is None:
            made = PrivateDir.new(
                tempfile.gettempdir(), "bootseer-control-", what="the control directory"
            )
        else:
            made = PrivateDir.open(
                self.control_dir, what="the control directory (BOOTSEER_CONTROL_DIR)"
            )
        made.close()
        if self.control_dir is None:
            self.control_dir = Path(made.path)
        if self.ready_file is None:
            self.ready_file = self.control_dir / "ready"
        try:
            return self._run()
        except StopRequested as stop:
            code = self.attempts[-1].code if self.attempts else 128 + stop.signum
            self.log(f"stopped by {stop} before the command ran again; exit code {code}")
            return code
        finally:
            if self._standby is not None:
                self._standby.stop()
                self._standby = None
            if self.remote is not None and self.preload:
                self.remote.close()
            self._signals.close()
            self._signals = None
            if self._own_control:
                shutil.rmtree(self.control_dir, ignore_errors=True)

    def _run(self) -> int:
        attempt = 0
        while True:
            started = time.time()
            extra = self._startup(attempt)
            if (
                self.spare
                and self.remote is not None
                and (not self.attempts or self.attempts[-1].detail.get("parked"))
            ):
                self._spare_rejoin(self.attempts[-1] if self.attempts else None)
            end = self._attempt(attempt, started, extra)
            if self.spare and self._watching is not None and self._watching.last_change is None:
                end.detail["parked"] = True  # no rank of this node ever ran (a spare)
            self.attempts.append(end)
            if (
                end.reason in ("not-started", "check-failed")
                or self._stopping is not None
                or end.code == 0
            ):
                return end.code
            if self._judge(end) == "stop":
                self.log(
                    f"stopping after {end.describe()} (attempt {attempt}): the verdict "
                    f"is not to restart"
                )
                return end.code
            if end.reason != "update" and self._failures() > self.restart.max_restarts:
                self.log(
                    f"command failed with {end.describe()}; no restarts left "
                    f"({self.restart.max_restarts} allowed)"
                )
                return end.code
            attempt += 1
            self._backoff(attempt, end)

    def _judge(self, end: AttemptEnd) -> str:
        """The agent's local action after a failed attempt: stop or restart."""
        if self.agent is None:
            return "restart"
        verdict = end.detail.get("verdict")
        self._by_controller = ""
        if end.detail.get("parked") and not end.detail.get("remote"):
            # a spare's launcher that ended on its own ran no rank: not the job's failure, so
            # not published (an incident would stop every node); restarted here, counted
            self.log(
                f"standby: the parked launcher ended with {end.describe()}: restarting "
                "it on this node (the job is not involved)"
            )
            return "restart"
        if end.detail.get("remote"):
            return self.remote.local_action(self._skip_after(self._from_controller(verdict)))
        lines = self.tail.lines() if self.tail else []
        if verdict is None and self._early is not None:  # seen at the rank's death
            return self._judge_early(end, lines)
        if verdict is None and self.remote is not None:  # the controller decides, if it can
            event = self.agent.crash_event(end.code, lines)
            verdict = self._remote_verdict(event, end.attempt)
            if verdict is not None:
                return self.remote.local_action(self._skip_after(self._from_controller(verdict)))
            return self.agent.local_action(self._skip_after(self.agent.judge(event)))
        if verdict is None:  # a crash: classified from its exit and last lines
            verdict = self.agent.judge_crash(end.code, lines)
        return self.agent.local_action(self._skip_after(verdict))

    def _from_controller(self, verdict: Any) -> Any:
        """Notes that the controller decided (its class: the backoff depends on it)."""
        self._by_controller = getattr(verdict, "failure_class", None) or "controller"
        return verdict

    def _skip_after(self, verdict: Any) -> Any:
        """After a NaN verdict, every later attempt passes over the checkpoints the failed
        attempt saved from the NaN's step on (they hold the NaN: resuming from one NaNs again);
        said once, and handed down as ``BOOTSEER_CKPT_SKIP`` (ckpt/skip.py)."""
        from ckpt.skip import SkipRule

        from .robust.policy import nonfinite_step

        step = nonfinite_step(verdict) if verdict is not None else None
        if step is not None:
            self._skip_rules.append(
                SkipRule(
                    step,
                    time.time(),
                    f"{verdict.failure_class} verdict after attempt {len(self.attempts) - 1}",
                )
            )
            self.log(
                f"checkpoints saved from step {step} on by the failed attempt hold the "
                "non-finite value: the restart resumes from an earlier one"
            )
        return verdict

    def _judge_early(self, end: AttemptEnd, lines: list[str]) -> str:
        """A crash published when its rank died: the launcher's account refines its class
        (same detection time), and the verdict is the controller's or the node's."""
        self._take_refined(self.agent.refine(self._early, end.code, lines))
        if self.remote is not None:
            verdict = self._remote_verdict(self._early, end.attempt, published=True)
            if verdict is not None:
                return self.remote.local_action(self._skip_after(self._from_controller(verdict)))
        return self.agent.local_action(
            self._skip_after(self.agent.judge(self._early, written=True))
        )

    def _startup(self, attempt: int) -> Mapping[str, str]:
        """The hook in a thread, while the main thread keeps answering signals."""
        if self.before_attempt is None:
            return {}
        box: dict[str, Any] = {}
        hook = self.before_attempt
        signals = self._signals
        finished = threading.Event()

        def target() -> None:
            try:
                box["env"] = hook(attempt)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                box["error"] = exc
            finally:
                finished.set()
                signals.wake()

        thread = threading.Thread(target=target, name=f"bootseer-startup-{attempt}", daemon=True)
        thread.start()
        while not finished.is_set():
            self._stop_check(self._signals.wait(1.0))
        if "error" in box:
            raise box["error"]
        return box.get("env") or {}

    def _stop_check(self, signals: list[int]) -> None:
        for sig in signals:
            if sig in STOP_SIGNALS:
                raise StopRequested(sig)

    def _failures(self) -> int:
        """Attempts that failed (a restart for a version update is none, nor a parked spare's
        restart on a verdict)."""
        return sum(
            1
            for a in self.attempts
            if a.reason != "update" and not (a.detail.get("parked") and a.detail.get("remote"))
        )

    def _backoff(self, attempt: int, previous: AttemptEnd) -> None:
        if previous.reason == "update":
            delay = 0.0
            self.log(f"restarting on the updated version (attempt {attempt})")
        elif self._by_controller and self._by_controller != "storage_error":
            # every node restarts on one decision: waiting adds nothing (the no-progress rule
            # and max_restarts end loops); a store that is down needs the backoff's time
            delay = 0.0
            self.log(
                f"restarting on the controller's verdict after {previous.describe()} "
                f"(attempt {attempt}, restart {self._failures()}/"
                f"{self.restart.max_restarts})"
            )
        else:
            delay = self.restart.delay(self._failures())
            self.log(
                f"command failed with {previous.describe()}; restart {self._failures()}/"
                f"{self.restart.max_restarts} in {delay:.1f}s"
            )
        start = time.time()
        deadline = time.monotonic() + delay
        while (left := deadline - time.monotonic()) > 0:
            self._stop_check(self._signals.wait(left))
        self._reap()
        reason = previous.reason if previous.reason in ("hang", "nonfinite", "update") else "crash"
        if previous.reason == "verdict":  # stopped on the controller's order (a slow node, a
            reason = "controller"  # jump, a hang elsewhere), not a crash of its own
        detail: dict[str, Any] = {"reason": reason, "exit_code": previous.code}
        if previous.code > 128 and previous.reason in ("signaled", "hang"):
            detail["signal"] = signal_name(previous.code - 128)
        if "exited_at" in previous.detail:  # the end of the attempt, before its teardown
            detail["exited_at"] = previous.detail["exited_at"]
        self._record("restart", start, attempt=attempt, restart=attempt, delay_s=delay, **detail)

    def _spare_rejoin(self, previous: AttemptEnd | None) -> None:
        """A spare's launcher goes to the job's rendezvous, at its start and after each
        verdict it was parked through. A verdict that left the job a node short (one evicted,
        or gone without answering its dump) is what a spare is for: it joins at once.
        Otherwise it waits until the job's own nodes have formed the round (torch's
        rendezvous state, in the controller's store) and parks behind them: arriving first,
        it would take a node's place, and that node's in-memory checkpoints with it (at most
        ``SPARE_REJOIN_WAIT_S``, then it joins: a job short of a node needs it)."""
        verdict = previous.detail.get("verdict") if previous is not None else None
        evidence = getattr(verdict, "evidence", None) or {}
        # evicted now, or lost now (no answer); not `not_waited_for`: nodes gone in an earlier
        # incident, replaced since (run D's spare joined at once on every later verdict)
        short = [*getattr(verdict, "nodes", ()), *(evidence.get("missing_dumps") or ())]
        if short:
            self.log(
                f"standby: the verdict left the job without {', '.join(short)}: "
                "joining the new rendezvous at once"
            )
            return
        from .robust.standby import rendezvous_members

        run_id = self.env.get("PET_RDZV_ID") or f"bootseer-{self.remote.answered}"
        waited = time.monotonic()
        deadline = waited + SPARE_REJOIN_WAIT_S
        while time.monotonic() < deadline:
            try:
                members = rendezvous_members(self.remote.store, run_id)
            except Exception:  # noqa: BLE001 - torch's store or state: wait, then join
                members = None
            if members is not None and members["complete"]:
                self.log(
                    f"standby: the job's nodes formed rendezvous {run_id} in "
                    f"{time.monotonic() - waited:.1f}s: parking behind them"
                )
                return
            self._stop_check(self._signals.wait(0.5))
        self.log(
            f"standby: rendezvous {run_id} not complete after {SPARE_REJOIN_WAIT_S:.0f}s:"
            " joining it"
        )

    # -- one attempt -----------------------------------------------------------------------
    def _child_env(self, attempt: int, extra: Mapping[str, str]) -> dict[str, str]:
        env = dict(self.env)
        env.update(extra)
        env.pop("BOOTSEER_JOB_SECRET", None)  # the agent's: the command needs it not
        env["BOOTSEER_CONTROL_DIR"] = str(self.control_dir)
        env["BOOTSEER_READY_FILE"] = str(self.ready_file)
        env["BOOTSEER_ATTEMPT"] = str(attempt)
        env["BOOTSEER_NODE"] = self.node
        if self.remote is not None:  # the same on every node after a verdict: a restarted
            # launcher joins a fresh rendezvous (torchrun closes its own when it gives up)
            env[INCIDENT_HANDOFF] = str(self.remote.answered)
            # torchrun's --rdzv-id from the environment, when the command does not name one
            env.setdefault("PET_RDZV_ID", f"bootseer-{self.remote.answered}")
        if self.dump_dir is not None:
            env["BOOTSEER_TRACE_DIR"] = str(self.dump_dir)
        if self._skip_rules:
            from ckpt.skip import SKIP_ENV, to_env

            env[SKIP_ENV] = to_env(self._skip_rules)
        return env

    def _clear_control(self) -> None:
        """Signals of the previous attempt must not count for this one."""
        assert self.control_dir is not None and self.ready_file is not None
        for entry in os.scandir(self.control_dir):
            if entry.name.startswith(("ready", "heartbeat", "status", ".")):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
        try:
            self.ready_file.unlink()
        except OSError:
            pass

    def _version(self, attempt: int) -> Any:
        """The version of this attempt's epoch (None without ``versions``), said in a line
        and written to the trace as an ``update`` event."""
        if self.versions is None:
            return None
        from .robust.events import Event
        from .robust.update import describe

        version, pin = self.versions.resolve(self.remote.answered)
        line = describe(pin, version)
        self.log(f"attempt {attempt} runs {line}")
        if self.agent is not None:
            self.agent.write(
                Event(
                    "update",
                    "version",
                    node=self.node,
                    time=time.time(),
                    evidence={
                        "message": line,
                        "version": pin.id,
                        "previous": pin.previous,
                        "updated": pin.updated,
                        "cause": pin.cause,
                        "epoch": pin.epoch,
                        "attempt": attempt,
                        "workdir": version.workdir,
                        "env": sorted(version.env),
                    },
                )
            )
        return version

    def _attempt(self, attempt: int, started: float, extra: Mapping[str, str]) -> AttemptEnd:
        self._clear_control()
        version = self._version(attempt)
        env = self._child_env(attempt, extra)
        if version is not None:
            env.update(version.env)
            env[VERSION_HANDOFF] = version.id
        self._version_id = version.id if version is not None else None
        spawn_start = time.time()
        pipes = self._output_pipes()
        try:
            self._child = self._spawn(env, version.workdir if version else None, pipes)
        except OSError as exc:  # nothing ran: retrying would fail the same way
            for r, w in pipes:
                os.close(r)
                os.close(w)
            found = isinstance(exc, FileNotFoundError)
            why = "command not found" if found else f"cannot execute ({exc.strerror or exc})"
            self.log(f"{why}: {self.command[0]}")
            code = EXIT_NOT_FOUND if found else EXIT_NOT_EXECUTABLE
            self._record(
                "command_start",
                spawn_start,
                attempt=attempt,
                outcome="failed",
                command=self.command[0],
                error=why,
            )
            return AttemptEnd(attempt, code, "not-started")
        pid = self._child.pid
        for (r, w), target in zip(pipes, (1, 2), strict=False):
            os.close(w)
            self.tail.attach(r, target)
        if self.agent is not None:
            self.agent.start_attempt(attempt)
            self._ranks = RankWatch(self.control_dir, root=pid, skip_pids={pid})
        self._early = None
        self._lingering.clear()
        self._status = None
        # epoch: the controller's newest incident, the same on every node of this attempt
        # (a replacement node's attempt 0 joins the survivors' attempt 5): ETTR's job attempt
        epoch = {"epoch": self.remote.answered} if self.remote is not None else {}
        self._record(
            "command_start", spawn_start, attempt=attempt, command=self.command[0], pid=pid, **epoch
        )
        self.log(f"started {self.command[0]} (pid {pid}, attempt {attempt})")
        try:
            return self._watch(attempt, started)
        finally:
            if self._ranks is not None:
                self._ranks.close()
                self._ranks = None
            self._cleanup_group(pid)
            self._child.returncode = self._status if self._status is not None else -1
            self._child = None
            self._remove_empty_dumps()
            if self.tail is not None:  # its last lines, before the crash is classified
                self.tail.drain(2.0)

    def _spawn(
        self, env: dict[str, str], cwd: str | None, pipes: list[tuple[int, int]]
    ) -> subprocess.Popen[bytes]:
        """The attempt's command: the preloaded standby when one is waiting and can run it,
        else a new process."""
        standby, self._standby = self._standby, None
        if standby is not None and self._python is not None:
            proc, why = standby.take(
                self._python, env, cwd, [w for _, w in pipes], version=self._version_id
            )
            if proc is not None:
                self.log(
                    f"the command runs in the interpreter started ahead (pid {proc.pid}, "
                    f"{', '.join(standby.modules)} imported)"
                )
                return proc
            self.log(f"the interpreter started ahead is not used: {why}")
        return subprocess.Popen(
            self.command,
            env=env,
            process_group=0,
            cwd=cwd,
            stdout=pipes[0][1] if pipes else None,
            stderr=pipes[1][1] if pipes else None,
        )

    def _prestart(self) -> None:
        """Start the next attempt's interpreter (once the running one has stepped, so that
        its imports do not slow this attempt's start)."""
        if self.remote is not None and self.preload:
            self.remote.prepare_check()
        if self._python is None or self._standby is not None:
            return
        try:
            self._standby = Standby.start(
                self._python.python, self.preload, self.env, version=self._version_id
            )
        except OSError as exc:
            self.log(
                f"--preload: cannot start {self._python.python} ahead ({exc}); "
                "restarts start it as usual"
            )
            self._python = None

    def _output_pipes(self) -> list[tuple[int, int]]:
        """Pipes for the command's stdout and stderr when its output is teed, else none."""
        if self.tail is None:
            return []
        self.tail.clear()
        return [os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)]

    def _watch(self, attempt: int, started: float) -> AttemptEnd:
        """Wait for the command, forwarding signals and watching for a hang."""
        assert self._child is not None
        pid = self._child.pid
        watch = self._watching = _Progress(self.control_dir, self.ready_file)
        watch.began_wall = started
        first_ready = True
        timeout = self.hang.timeout_s
        poll = 0.25 if timeout <= 0 else min(0.25, timeout / 4)
        while True:
            wake = self._ranks.fds() if self._ranks and self._stopping is None else ()
            for sig in self._signals.wait(poll, wake):
                if self._on_signal(sig, pid):
                    return self._killed_now(attempt, pid)
            exited = self._reap()
            for rank, when in watch.scan():  # before an exit: a ready just before it counts
                launch = {"generation": watch.generation} if watch.generation else {}
                self._record(
                    "first_step",
                    watch.began_wall,
                    when,
                    rank=rank,
                    attempt=attempt,
                    pid=pid,
                    **launch,
                )
                if first_ready:
                    first_ready = False
                    self.log(
                        f"first step: rank {rank} ready {when - started:.1f}s after the "
                        f"start of attempt {attempt}"
                    )
                    self._prestart()
            if exited:
                code = exit_code(self._status)
                reason = (
                    "stopped"
                    if self._stopping is not None
                    else ("signaled" if os.WIFSIGNALED(self._status) else "exited")
                )
                self.log(
                    f"command exited with {AttemptEnd(attempt, code, reason).describe()} "
                    f"(attempt {attempt})"
                )
                return AttemptEnd(attempt, code, reason, pid, {"exited_at": time.time()})
            if (
                self.checks is not None
                and self._stopping is None
                and (failed := self.checks()) is not None
            ):
                return self._check_failed(attempt, pid, failed)
            if self._ranks is not None and self._stopping is None:
                self._rank_ends(attempt, pid, watch)
            if self.agent is not None and (end := self._agent_watch(attempt, pid, watch, started)):
                return end
            if self.remote is not None and self._stopping is None:
                self.remote.beat(attempt, watch.ranks)
                if (order := self.remote.dump_order()) and (
                    end := self._on_order(attempt, pid, watch, order, started)
                ):
                    return end
            if (
                timeout > 0
                and self._stopping is None
                and (end := self._silence(attempt, pid, watch, started))
            ):
                return end

    def _check_failed(self, attempt: int, pid: int, failed: Any) -> AttemptEnd:
        """A check beside the command (the environment's files) failed: the command is
        stopped before it trains on what the check found, and the job ends (exit 2)."""
        fix = getattr(failed, "fix", "") or (
            "the next start restores the environment (bootseer env verify shows every "
            "file that differs)"
        )
        self.log(f"error: {failed.describe()}: stopping the job; {fix}")
        self._signal_group(pid, signal.SIGKILL)
        self._wait_child(5.0)
        self._record(
            "check_failed",
            time.time(),
            attempt=attempt,
            outcome="failed",
            what=failed.what,
            reason=failed.reason,
            problems=list(failed.problems),
        )
        return AttemptEnd(
            attempt, EXIT_CHECK_FAILED, "check-failed", pid, {"exited_at": time.time()}
        )

    def _silence(
        self, attempt: int, pid: int, watch: _Progress, started: float
    ) -> AttemptEnd | None:
        """A hang of the control directory's silence: ``timeout_s`` once the ranks reported,
        the start allowance before; after a rank's death the launcher has the start
        allowance, from the death, to restart its ranks or to exit."""
        allowance = max(self.hang.timeout_s, self.hang.startup_s)
        if self._early is not None:
            silent = time.monotonic() - self._early_at
            if silent < allowance:
                return None
            self.log(
                f"the launcher neither restarted its ranks nor exited {silent:.0f}s after "
                f"rank {self._early.rank} died (the start allowance): a hang"
            )
            self._early = None  # the launcher's hang is the incident now
            return self._hang(attempt, pid, watch, silent, started, launcher=True)
        if watch.all_finishing() or (self.spare and watch.last_change is None):  # parked
            return None
        if watch.last_change is None:
            silent, limit = time.monotonic() - watch.began, allowance
        else:
            silent, limit = time.monotonic() - watch.last_change, self.hang.timeout_s
        return self._hang(attempt, pid, watch, silent, started) if silent >= limit else None

    def _on_signal(self, sig: int, pid: int) -> bool:
        """Handle one signal; True when the command must be killed now (a second stop)."""
        if sig == signal.SIGCHLD:
            return False
        name = signal.Signals(sig).name
        if sig in STOP_SIGNALS:
            if self._stopping is not None:
                self.log(f"{name} again: killing the command")
                return True
            self._stopping = sig
            self.log(f"{name}: forwarded to the command (send it again to kill it)")
            self._signal_group(pid, sig)
        elif sig == signal.SIGUSR1:
            files = self._request_dumps(pid, everyone=False)
            self.log(
                f"SIGUSR1: stack dump requested from {len(files)} process(es) into {self.dump_dir}"
            )
        else:
            self._signal_group(pid, sig)
        return False

    def _killed_now(self, attempt: int, pid: int) -> AttemptEnd:
        self._signal_group(pid, signal.SIGKILL)
        self._wait_child(5.0)
        code = exit_code(self._status) if self._status is not None else 128 + signal.SIGKILL
        return AttemptEnd(attempt, code, "stopped", pid)

    def _agent_watch(
        self, attempt: int, pid: int, watch: _Progress, started: float
    ) -> AttemptEnd | None:
        """Heartbeats through the agent's detectors: a NaN/Inf kills the command now, a rank
        silent past the threshold is a hang."""
        for doc in watch.take_beats():
            try:
                beat = Beat.from_doc(doc, self.node)
            except (KeyError, TypeError, ValueError):
                continue
            if self.remote is not None:
                if end := self._remote_metrics(attempt, pid, beat):
                    return end
                continue
            verdict = self.agent.observe(beat)
            if verdict is not None and self._stopping is None:
                self.log(
                    f"killing the command at step {beat.step} (attempt {attempt}): "
                    f"{verdict.failure_class}"
                )
                self._signal_group(pid, signal.SIGKILL)
                self._wait_child(5.0)
                code = exit_code(self._status) if self._status is not None else 137
                return AttemptEnd(
                    attempt, code, "nonfinite", pid, {"verdict": verdict, "exited_at": time.time()}
                )
        if (
            self._stopping is None
            and self._early is None
            and (event := self.agent.check_hang(time.time()))
        ):  # a crash explains a silence
            silent = float(event.evidence.get("silent_s", 0.0))
            return self._hang(attempt, pid, watch, silent, started, event=event)
        return None

    def _rank_ends(self, attempt: int, pid: int, watch: _Progress) -> None:
        """A rank that died while the command runs: the crash event at once (the trace, the
        controller), classified from what the rank left; a primary failure seen after a
        communication error is published too.

        The death is an incident to report, never on its own a reason to end the launcher:
        torchrun may restart its workers (``--max-restarts``) and wait in the rendezvous for
        a replacement node for as long as that node takes to come. The attempt ends when the
        launcher ends it (its exit: its own verdict) or on the controller's verdict. What
        bounds the wait: a rank whose exception is recorded while its process lives on (a
        thread holds it) is killed alone after ``crash_grace_s``, so its launcher sees it
        end; a launcher that neither restarts its ranks nor exits within the start
        allowance is a hang (:meth:`_watch`). New rank processes after the death mean the
        launcher restarted them: a ``relaunch`` span, and the detectors start afresh."""
        from .robust.classify import SECONDARY

        ends = self._ranks.poll()
        event = self.agent.rank_crash(ends)
        while self._ranks.ended_normally:
            self.agent.finish_rank(self._ranks.ended_normally.pop())
        for end in ends:
            if end.how == "exception" and alive(end.pid):
                self._lingering.setdefault(end.pid, (end.rank, time.monotonic()))
        first = self._early
        if event is not None and (
            first is None
            or (first.failure_class in SECONDARY and event.failure_class not in SECONDARY)
        ):
            if first is None:
                self._early_at, self._early_wall = time.monotonic(), time.time()
                self._early_boot = since_boot()
            self._early = event
            self.agent.write(event)
            what = (
                event.evidence.get("exception")
                or event.evidence.get("signal")
                or ("gone without a record" if event.evidence.get("provisional") else "")
            )
            self.log(
                f"crash: rank {event.rank} (pid {event.evidence.get('pid')}) "
                f"{event.failure_class}"
                + (f" ({what})" if what else "")
                + f" while the command runs (attempt {attempt}); its launcher decides"
            )
            if self.remote is not None:
                self.remote.publish(event)
        self._kill_lingering()
        newcomers, self._ranks.started = self._ranks.started, []
        born = [t for _, p, _ in newcomers if (t := started_at(p)) is not None]
        if self._early is not None and (new := [t for t in born if t > self._early_boot]):
            # the new ranks' start on the wall clock
            self._relaunched(attempt, pid, watch, time.time() - (since_boot() - min(new)))

    def _kill_lingering(self) -> None:
        """A rank that raised but whose process lives on past ``crash_grace_s`` gets SIGKILL,
        alone: its launcher, which sees only processes, then sees it end and decides."""
        now = time.monotonic()
        for rank_pid, (rank, since) in list(self._lingering.items()):
            if not alive(rank_pid):
                del self._lingering[rank_pid]
            elif now - since >= self.crash_grace_s:
                del self._lingering[rank_pid]
                self.log(
                    f"rank {rank} (pid {rank_pid}) raised {self.crash_grace_s:g}s ago and "
                    "its process still runs (a thread keeps it): killing that process, "
                    "so that its launcher sees its end"
                )
                try:
                    os.kill(rank_pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _relaunched(self, attempt: int, pid: int, watch: _Progress, began: float) -> None:
        """The launcher started new ranks after a crash: the incident is over without a
        restart of the command (a ``relaunch`` span from the death to the new ranks, the
        unit of ETTR's accounting inside an attempt); hang and metric detection start afresh,
        with the start allowance, and the new ranks' first steps are recorded."""
        early = self._early
        watch.relaunched(self._early_wall, began)
        self.agent.relaunched()
        now = min(began, time.time())
        self.log(
            f"the launcher restarted its ranks {now - self._early_wall:.1f}s after rank "
            f"{early.rank}'s crash ({early.failure_class}): recovered without a restart "
            f"of the command (attempt {attempt}, launch {watch.generation})"
        )
        reason = "hang" if early.kind == "hang" else "crash"
        self._record(
            "relaunch",
            self._early_wall,
            now,
            attempt=attempt,
            reason=reason,
            exited_at=self._early_wall,
            generation=watch.generation,
            pid=pid,
            failed_rank=early.rank,
            failure_class=early.failure_class,
        )
        self._early = None

    def _refine_early(self) -> None:
        """Under an order: a crash seen at a rank's death with no class of its own (gone
        without a record) waits up to ``crash_grace_s`` for the launcher's summary, so the
        controller gets the refined class with the dumps; a communication error (another
        node's failure, most likely) is refined only if the launcher already ended; a rank
        killed by a signal is refined from the lines so far (a rank that aborted said why
        before it died: gloo's "collective mismatch"), with its own exit code while the
        launcher runs."""
        from .robust.classify import SECONDARY

        early = self._early
        if early is None:
            return
        provisional = bool(early.evidence.get("provisional"))
        signalled = early.failure_class == "killed_by_signal" and not provisional
        if not (provisional or signalled or early.failure_class in SECONDARY):
            return
        ended = self._wait_child(self.crash_grace_s if provisional else 0.0)
        if not ended and not signalled:
            return
        if self.tail is not None and ended:
            self.tail.drain(2.0)
        code = exit_code(self._status) if ended else early.evidence.get("exit_code")
        self._take_refined(self.agent.refine(early, code, self.tail.lines() if self.tail else []))

    def _take_refined(self, better: Any) -> None:
        """The early crash event refined by the launcher's account (same detection time):
        kept, written to the trace and published (None: nothing better)."""
        if better is None:
            return
        self._early = better
        self.agent.write(better)
        if self.remote is not None:
            self.remote.publish(better)

    def _remote_metrics(self, attempt: int, pid: int, beat: Beat) -> AttemptEnd | None:
        """Under a controller a NaN/Inf or a jump goes to it. A NaN kills the command at once
        (no checkpoint of the damaged state), then the verdict (after the controller's checks)
        decides; a jump is published and the controller's order stops the job."""
        for event in self.agent.metric_events(beat):
            self.remote.publish(event)
            if event.kind != "nonfinite" or self._stopping is not None:
                continue
            self.log(
                f"killing the command at step {beat.step} (attempt {attempt}): "
                f"{event.failure_class}; the controller decides"
            )
            self._signal_group(pid, signal.SIGKILL)
            self._wait_child(5.0)
            code = exit_code(self._status) if self._status is not None else 137
            exited = time.time()
            verdict = self._remote_verdict(event, attempt, published=True)
            if verdict is None:
                return AttemptEnd(
                    attempt,
                    code,
                    "nonfinite",
                    pid,
                    {"verdict": self.agent.judge(event), "exited_at": exited},
                )
            return AttemptEnd(
                attempt,
                code,
                "nonfinite",
                pid,
                {"verdict": verdict, "remote": True, "exited_at": exited},
            )
        return None

    # -- hangs -----------------------------------------------------------------------------
    def _hang(
        self,
        attempt: int,
        pid: int,
        watch: _Progress,
        silent: float,
        started: float,
        event: Any = None,
        *,
        launcher: bool = False,
    ) -> AttemptEnd | None:
        """A hang: stacks dumped (the controller's order first, under one), then the ranks
        killed. Under a launcher that started the ranks (torchrun) only the ranks are killed
        and the launcher decides, as for a crash (it restarts them, or exits and this attempt
        ends with the hang's verdict): None. ``launcher``: the launcher itself hangs (it
        neither restarted its ranks nor exited): the command is killed."""
        before = (
            "before its first heartbeat"
            if watch.last_change is None
            else (f"after step {watch.last_step}" if watch.last_step is not None else "after ready")
        )
        ranks = {} if launcher or self._ranks is None else self._ranks.live()
        what = (
            (
                f"ranks {', '.join(map(str, sorted(set(ranks.values()))))} (their launcher "
                "then decides)"
            )
            if ranks
            else "the command"
        )
        self.log(
            f"hang: no heartbeat for {silent:.1f}s {before}; dumping stacks to "
            f"{self.dump_dir} and killing {what}"
        )
        hang_start = time.time() - silent
        detected = time.time()
        if self.remote is not None:  # the controller localizes across nodes first
            event = event or self._hang_event(watch, silent, detected)
            self.remote.publish(event)
            self.agent.write(event)
            order = self._wait_order()
            if order is not None and (
                end := self._on_order(
                    attempt,
                    pid,
                    watch,
                    order,
                    started,
                    event=event,
                    since=hang_start,
                    detected=detected,
                )
            ):
                return end
            self.log("the controller ordered no dump: the node acts alone")
        # a signal to everyone only when everyone is killed next: SIGUSR1 ends a launcher
        sizes = self._request_dumps(pid, everyone=not ranks)
        grown = self._wait_dumps(sizes)
        dumped = time.time()
        if ranks:
            return self._hung_ranks_killed(
                attempt, pid, watch, ranks, silent, hang_start, detected, dumped, grown, event
            )
        self._signal_group(pid, signal.SIGKILL)
        self._wait_child(5.0)
        code = exit_code(self._status) if self._status is not None else 128 + signal.SIGKILL
        self._record(
            "hang",
            hang_start,
            attempt=attempt,
            outcome="killed",
            timeout_s=self.hang.timeout_s,
            silent_s=round(silent, 3),
            last_step=watch.last_step,
            pid=pid,
            stacks=sorted(p.name for p in grown),
            detected_at=detected,
            dumped_at=dumped,
        )
        if grown:
            self.log(f"stacks: {', '.join(str(p) for p in sorted(grown))}")
        else:
            self.log("no stack dump arrived (does the command import bootseer?)")
        detail: dict[str, Any] = {"stacks": sorted(map(str, grown)), "exited_at": time.time()}
        if self.agent is not None:
            event = event or self._hang_event(watch, silent, detected)
            event = dataclasses.replace(
                event, evidence={**event.evidence, "stacks": sorted(p.name for p in grown)}
            )
            detail["verdict"] = self.agent.judge(event)
        return AttemptEnd(attempt, code, "hang", pid, detail)

    def _hung_ranks_killed(
        self,
        attempt: int,
        pid: int,
        watch: _Progress,
        ranks: dict[int, int],
        silent: float,
        hang_start: float,
        detected: float,
        dumped: float,
        grown: set[Path],
        event: Any,
    ) -> None:
        """The hung ranks' processes get SIGKILL, the launcher lives: the hang becomes the
        attempt's incident, ended by the launcher's restart of its ranks or by its exit."""
        self._kill_processes(pid, ranks)
        self._record(
            "hang",
            hang_start,
            attempt=attempt,
            outcome="ranks_killed",
            timeout_s=self.hang.timeout_s,
            silent_s=round(silent, 3),
            last_step=watch.last_step,
            pid=pid,
            stacks=sorted(p.name for p in grown),
            detected_at=detected,
            dumped_at=dumped,
            ranks=sorted(set(ranks.values())),
            generation=watch.generation,
        )
        if grown:
            self.log(f"stacks: {', '.join(str(p) for p in sorted(grown))}")
        event = event or self._hang_event(watch, silent, detected)
        event = dataclasses.replace(
            event,
            evidence={**event.evidence, "stacks": sorted(p.name for p in grown), "killed": "ranks"},
        )
        if self.agent is not None:
            self.agent.write(event)
        self._early = event
        self._early_at, self._early_wall = time.monotonic(), time.time()
        self._early_boot = since_boot()

    def _kill_processes(self, pid: int, ranks: dict[int, int]) -> None:
        """SIGKILL to each rank's process group (torchrun starts each worker in a session of
        its own: its dataloader workers go with it), or to the rank and its descendants when
        it shares the command's group (forked workers)."""
        from .robust.remote import descendants

        try:
            own = os.getpgid(pid)
        except ProcessLookupError:
            own = pid
        for rank_pid in ranks:
            try:
                group = os.getpgid(rank_pid)
            except ProcessLookupError:
                continue
            try:
                if group != own:
                    os.killpg(group, signal.SIGKILL)
                else:
                    for target in (rank_pid, *descendants(rank_pid)):
                        os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _hang_event(self, watch: _Progress, silent: float, detected: float) -> Any:
        """The hang event of the control directory's silence (a ready-only command)."""
        from .robust.events import Event

        return Event(
            "hang",
            "hang",
            node=self.node,
            step=watch.last_step,
            time=detected,
            evidence={
                "silent_s": round(silent, 3),
                "last_step": watch.last_step,
                "threshold_s": self.hang.timeout_s,
                "threshold_from": "configured",
            },
        )

    # -- the controller: dump everywhere, wait for the verdict, then stop ------------------
    def _wait_order(self) -> dict[str, Any] | None:
        """The controller's order to dump, within ``remote_wait_s``."""
        deadline = time.monotonic() + self.remote_wait_s
        while time.monotonic() < deadline:
            if (order := self.remote.dump_order(force=True)) is not None:
                return order
            if self._pause(self.remote.poll_s):
                return None
        return None

    def _remote_verdict(self, event: Any, attempt: int, published: bool = False) -> Any:
        """After a crash: the event to the controller, an empty dump when ordered (nothing
        runs any more), and its verdict (None: no answer in ``remote_wait_s``)."""
        if not published:
            self.remote.publish(event)
            self.agent.write(event)
        order = self._wait_order()
        if order is None:
            self.log("no order from the controller: the node decides alone")
            return None
        self.remote.answer(int(order["incident"]), [])
        verdict = self.remote.wait_verdict(int(order["incident"]), self.remote_wait_s, self._pause)
        if verdict is not None:
            self._note_verdict(verdict, attempt)
        return verdict

    def _note_verdict(self, verdict: Any, attempt: int) -> None:
        local = self.remote.local_action(verdict)
        verdict = dataclasses.replace(
            verdict,
            evidence={
                "incident": verdict.evidence.get("incident"),
                "local": local,
                "attempt": attempt,
                "from": "controller",
            },
        )
        self.agent.write(verdict)
        evicted = self.node in verdict.nodes and verdict.action == "replace_and_restart"
        self.log(
            f"controller verdict: {verdict.action} ({verdict.failure_class})"
            + (f" ranks {', '.join(map(str, verdict.ranks))}" if verdict.ranks else "")
            + (f" nodes {', '.join(verdict.nodes)}" if verdict.nodes else "")
            + f" -> here: {local}"
            + (" (this node is evicted)" if evicted else "")
        )

    def _on_order(
        self,
        attempt: int,
        pid: int,
        watch: _Progress,
        order: dict[str, Any],
        started: float,
        *,
        event: Any = None,
        since: float | None = None,
        detected: float | None = None,
    ) -> AttemptEnd | None:
        """Dump every process of this node's ranks (py-spy; else SIGUSR1 stack files), hand
        them to the controller, wait for its verdict, and only then kill the command."""
        from .robust.remote import dump_ranks

        if order.get("update"):
            return self._on_update(attempt, pid, watch, order)

        incident = int(order["incident"])
        detected = detected or time.time()
        self.log(f"controller: incident {incident} ({order.get('reason')}): dumping stacks")
        rank_pids = {
            r: int(v["pid"]) for r, v in watch.ranks.items() if isinstance(v.get("pid"), int)
        }
        processes, failed = dump_ranks(rank_pids, node=self.node, dump=self.remote.dump_tool)
        if failed or not rank_pids:  # the client's faulthandler files instead (only the
            # processes that registered one: SIGUSR1 kills the others, and no verdict yet)
            grown = self._wait_dumps(self._request_dumps(pid, everyone=False))
            for path in sorted(grown):
                stem = path.stem.rsplit("-", 2)
                rank = int(stem[1].removeprefix("rank")) if len(stem) == 3 else -1
                if rank in failed or not rank_pids:
                    processes.append(
                        {
                            "rank": rank,
                            "pid": int(stem[-1]),
                            "role": "main",
                            "node": self.node,
                            "source": "faulthandler",
                            "text": _last_dump(path),
                        }
                    )
        files = self._keep_dumps(processes, incident)
        self._refine_early()  # before the answer: the controller reads it with the dumps
        self.remote.answer(incident, processes, [p.name for p in files])
        dumped = time.time()
        native = self._native_dumps(
            incident,
            {
                p["rank"]: p["pid"]
                for p in processes
                if p["role"] == "main" and p["source"] == "py-spy"
            },
        )
        killed_for_check: list[float] = []

        def stop() -> None:  # the stop-time checks need the node: the command goes first
            native.join(NATIVE_GRACE_S)
            self._signal_group(pid, signal.SIGKILL)
            self._wait_child(5.0)
            killed_for_check.append(time.time())

        verdict = self.remote.wait_verdict(incident, self.remote_wait_s, self._pause, stop)
        decided = time.time()
        native.join(NATIVE_GRACE_S)
        self._signal_group(pid, signal.SIGKILL)
        self._wait_child(5.0)
        code = exit_code(self._status) if self._status is not None else 128 + signal.SIGKILL
        killed = killed_for_check[0] if killed_for_check else time.time()
        hang = (verdict.failure_class if verdict else (event.kind if event else "")) == "hang"
        self._record(
            "hang" if hang else "controller_stop",
            since or detected,
            attempt=attempt,
            outcome="killed",
            incident=incident,
            last_step=watch.last_step,
            pid=pid,
            stacks=[p.name for p in files],
            detected_at=detected,
            dumped_at=dumped,
            decided_at=decided,
            killed_at=killed,
        )
        detail: dict[str, Any] = {"stacks": [str(p) for p in files], "exited_at": killed}
        if verdict is None:  # no verdict in time: the node's own policy
            self.log(
                f"no verdict for incident {incident} in {self.remote_wait_s:.0f}s: the "
                "node decides alone"
            )
            detail["verdict"] = self.agent.judge(
                event or self._hang_event(watch, time.time() - (since or detected), detected)
            )
        else:
            self._note_verdict(verdict, attempt)
            detail.update(verdict=verdict, remote=True)
        return AttemptEnd(attempt, code, "hang" if hang else "verdict", pid, detail)

    def _on_update(
        self, attempt: int, pid: int, watch: _Progress, order: dict[str, Any]
    ) -> AttemptEnd | None:
        """An update incident: nothing to dump; after its verdict the command is stopped at
        a step boundary (its next heartbeat, at most ``remote_wait_s`` away) and restarted
        on the new version. No verdict: it runs on, on the version it has (never mixed)."""
        incident = int(order["incident"])
        self.log(f"controller: incident {incident}: {order.get('reason')}")
        self.remote.answer(incident, [])
        verdict = self.remote.wait_verdict(incident, self.remote_wait_s, self._pause)
        if verdict is None:
            self.log(f"no verdict for incident {incident}: the command runs on")
            return None
        decided, step = time.time(), watch.last_step
        deadline = time.monotonic() + self.remote_wait_s
        while watch.last_step == step and time.monotonic() < deadline:
            if self._pause(0.05) or self._reap():
                break
            watch.scan()
        self._signal_group(pid, signal.SIGKILL)
        self._wait_child(5.0)
        code = exit_code(self._status) if self._status is not None else 128 + signal.SIGKILL
        killed = time.time()
        self._record(
            "controller_stop",
            decided,
            killed,
            attempt=attempt,
            outcome="killed",
            incident=incident,
            update=order["update"],
            last_step=watch.last_step,
            step_before=step,
            pid=pid,
            decided_at=decided,
            killed_at=killed,
        )
        self._note_verdict(verdict, attempt)
        return AttemptEnd(
            attempt, code, "update", pid, {"verdict": verdict, "remote": True, "exited_at": killed}
        )

    def _native_dumps(self, incident: int, rank_pids: dict[int, int]) -> threading.Thread:
        """The ranks' trees dumped again with native frames, on a thread, after the answer:
        the controller decides on the Python stacks (0.1-0.6 s a node), and the native ones
        (seconds on a loaded node) go into its evidence when they are in by its verdict. The
        command is killed no later than ``NATIVE_GRACE_S`` after the verdict, finished or not."""
        from .robust.remote import dump_ranks

        def run() -> None:
            if not rank_pids:
                return
            try:
                processes, _ = dump_ranks(rank_pids, node=self.node, dump=self.remote.native_tool)
                processes = [p for p in processes if p["text"]]
                self._keep_dumps(processes, incident, suffix="-native")
                if processes:
                    self.remote.answer_native(incident, processes)
            except Exception as exc:  # noqa: BLE001 - evidence only: never the incident's end
                self.log(f"warning: native dumps for incident {incident}: {exc}")

        thread = threading.Thread(target=run, name="bootseer-native-dumps", daemon=True)
        thread.start()
        return thread

    def _keep_dumps(
        self, processes: list[dict[str, Any]], incident: int, suffix: str = ""
    ) -> list[Path]:
        """Each dump also as a file in the trace directory (evidence that outlives the
        store): ``dump-<node>-i<incident>-rank<r>-<pid><suffix>.txt``."""
        if self.dump_dir is None:
            return []
        kept = []
        for item in processes:
            path = self.dump_dir / (
                f"dump-{self.node}-i{incident}-rank{item['rank']}-{item['pid']}{suffix}.txt"
            )
            try:
                with open_append(self.dump_dir, path.name) as f:  # never through a link
                    f.truncate(0)
                    f.write(f"# {item['source']} {item['role']}\n{item['text']}")
                kept.append(path)
            except OSError as exc:
                self.log(f"warning: cannot keep the dump {path}: {exc}")
        return kept

    def _dump_files(self, pids: set[int]) -> dict[Path, int]:
        """This node's stack files of live processes of the group, with their sizes."""
        out: dict[Path, int] = {}
        if self.dump_dir is None:
            return out
        for pid in pids:
            pattern = f"stacks-{glob.escape(self.node)}-rank*-{pid}.txt"
            for path in self.dump_dir.glob(pattern):
                try:
                    out[path] = path.stat().st_size
                except OSError:
                    pass
        return out

    def _request_dumps(self, pid: int, *, everyone: bool) -> dict[Path, int]:
        """SIGUSR1 to the group (``everyone``: they are about to be killed anyway) or only to
        the processes with a registered dump file; their files and sizes before."""
        members = group_pids(pid)
        files = self._dump_files(members)
        if everyone:
            self._signal_group(pid, signal.SIGUSR1)
        else:
            for path in files:
                try:
                    os.kill(int(path.stem.rsplit("-", 1)[1]), signal.SIGUSR1)
                except (ProcessLookupError, ValueError):
                    pass
        return files

    def _wait_dumps(self, sizes: dict[Path, int]) -> set[Path]:
        """Until every expected file has grown and stopped growing, or ``dump_wait_s``."""
        deadline = time.monotonic() + self.hang.dump_wait_s
        grown: set[Path] = set()
        last: dict[Path, int] = dict(sizes)
        steady = 0
        while sizes and time.monotonic() < deadline:
            if self._pause(0.05):
                break  # stopped: the kill comes now, no restart after it
            now = {p: _size(p) for p in sizes}
            grown = {p for p, n in now.items() if n > sizes[p]}
            steady = steady + 1 if now == last else 0
            last = now
            if len(grown) == len(sizes) and steady >= 2:
                break
        return grown

    def _remove_empty_dumps(self) -> None:
        """Every client process leaves an empty stack file; only dumps are worth keeping."""
        if self.dump_dir is None:
            return
        for path in self.dump_dir.glob(f"stacks-{glob.escape(self.node)}-rank*.txt"):
            try:
                pid = int(path.stem.rsplit("-", 1)[1])
                if path.stat().st_size == 0 and not alive(pid):
                    path.unlink()
            except (OSError, ValueError):
                pass

    def _record(
        self,
        phase: str,
        start: float,
        end: float | None = None,
        *,
        rank: int | None = None,
        attempt: int = 0,
        outcome: str = "ok",
        **detail: Any,
    ) -> None:
        """A span of the node's trace (``rank`` for first_step). A trace that cannot be
        written is warned about, never a reason to lose the job."""
        if self.trace is None:
            return
        span = Span(
            self.trace.node,
            rank,
            phase,
            start,
            time.time() if end is None else end,
            0,
            outcome,
            attempt,
            detail,
        )
        try:
            self.trace.write(span)
        except OSError as exc:
            self.log(f"warning: cannot write the trace {self.trace.path}: {exc}")

    # -- processes -------------------------------------------------------------------------
    def _signal_group(self, pid: int, sig: int) -> None:
        """``sig`` to the command's process group; a SIGKILL or SIGTERM also to the groups of
        its descendants, found first: torchrun starts each worker in a session of its own,
        so a SIGKILL to torchrun's group alone would leave its ranks running, orphaned."""
        from .robust.remote import descendants

        groups = [pid]
        if sig in (signal.SIGKILL, signal.SIGTERM):
            for child in descendants(pid):
                try:
                    groups.append(os.getpgid(child))
                except ProcessLookupError:
                    continue
        for group in dict.fromkeys(groups):
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _reap(self) -> bool:
        """Reap every child that has exited; True once the command itself has."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if self._child is not None and pid == self._child.pid:
                self._status = status
        return self._status is not None

    def _wait_child(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._reap() and time.monotonic() < deadline:
            self._pause(0.02)
        return self._status is not None

    def _pause(self, timeout: float) -> bool:
        """Wait while the command is being killed; True when a stop signal arrived (the job
        then ends after this attempt: no restart)."""
        stop = False
        for sig in self._signals.wait(timeout):
            if sig in STOP_SIGNALS:
                stop = True
                if self._stopping is None:
                    self._stopping = sig
        self._reap()
        return stop

    def _cleanup_group(self, pgid: int) -> None:
        """What the command left running in its group is stopped: SIGTERM, a grace period,
        SIGKILL (a leftover worker would hold its GPU and ports across a restart)."""
        if not self._group_alive(pgid):
            return
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        while time.monotonic() < deadline:
            if self._pause(0.05):
                break
            if not self._group_alive(pgid):
                return
        self.log(f"killing what the command left running (process group {pgid})")
        self._signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while self._group_alive(pgid) and time.monotonic() < deadline:
            self._pause(0.02)

    def _group_alive(self, pgid: int) -> bool:
        self._reap()
        try:
            os.killpg(pgid, 0)  # the cheap answer first: nobody at all
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return bool(group_pids(pgid))


class _Progress:
    """Changes of the control directory's ready/heartbeat files (and of the ready file)."""

    def __init__(self, control_dir: Path | None, ready_file: Path | None) -> None:
        self.control_dir = control_dir
        self.ready_file = ready_file
        self.seen: dict[str, tuple[int, int, int]] = {}
        self.ready_ranks: set[int] = set()
        self.last_change: float | None = None  # monotonic
        self.last_step: int | None = None
        self.ranks: dict[int, dict[str, Any]] = {}  # the newest heartbeat of each rank
        self.finishing: set[int] = set()  # ranks that left their loop (client.finishing)
        self._beats: list[dict[str, Any]] = []
        self.began = time.monotonic()  # this launch of the ranks (the command's, or the
        self.began_wall = time.time()  # launcher's restart of them)
        self.generation = 0  # the launcher's restarts of its ranks in this attempt
        self.not_before = 0.0  # files written before this wall time are a dead launch's

    def relaunched(self, since: float, began: float) -> None:
        """The launcher started new ranks: their progress starts from nothing (the start
        allowance, their own first steps). ``since``: the death (wall clock); every file is
        read again, and counts only when written after it (a new rank may have written its
        ready before its launch was known)."""
        self.seen.clear()
        self.not_before = since
        self.ready_ranks.clear()
        self.last_change = None
        self.last_step = None
        self.ranks.clear()
        self.finishing.clear()
        self._beats.clear()
        self.began = time.monotonic() - max(0.0, time.time() - began)
        self.began_wall = began
        self.generation += 1

    def all_finishing(self) -> bool:
        """Every rank that beat said it left its training loop: the silence of its final
        save and teardown is not a hang."""
        return bool(self.ranks) and set(self.ranks) <= self.finishing

    def take_beats(self) -> list[dict[str, Any]]:
        """Heartbeat documents that changed since the last call (with their rank)."""
        beats, self._beats = self._beats, []
        return beats

    def scan(self) -> list[tuple[int, float]]:
        """New ready signals since the last scan: (rank, time)."""
        entries: list[tuple[str, str]] = []
        if self.control_dir is not None:
            try:
                with os.scandir(self.control_dir) as it:
                    entries = [
                        (e.name, e.path) for e in it if e.name.startswith(("ready-", "heartbeat-"))
                    ]
            except OSError:
                pass
        if self.ready_file is not None:
            entries.append(("ready", str(self.ready_file)))
        new_ready: list[tuple[int, float]] = []
        for name, path in entries:
            try:
                st = os.stat(path)
            except OSError:
                continue
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            if self.seen.get(path) == sig:
                continue
            self.seen[path] = sig
            doc = _read_json(path)
            when = doc.get("time")
            if isinstance(when, int | float) and when < self.not_before:
                continue  # a dead launch's rank wrote it (seen again after a relaunch)
            self.last_change = time.monotonic()
            kind, _, rank_text = name.partition("-")
            try:
                rank = int(rank_text) if rank_text else int(doc.get("rank", 0))
            except (TypeError, ValueError):
                rank = 0
            if kind == "heartbeat":
                step = doc.get("step")
                if isinstance(step, int):
                    self.last_step = step
                if "time" in doc:
                    self._beats.append({**doc, "rank": rank})
                    self.ranks[rank] = doc
                if doc.get("finishing") is True:
                    self.finishing.add(rank)
            elif rank not in self.ready_ranks:
                self.ready_ranks.add(rank)
                when = doc.get("time")
                new_ready.append(
                    (rank, float(when) if isinstance(when, int | float) else st.st_mtime)
                )
        return new_ready


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read() or "{}")
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _last_dump(path: Path, limit: int = 32 << 10) -> str:
    """A stack file's newest dumps, at most ``limit`` characters from its end, starting at
    a thread header (the parser keeps the last dump of a file)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    starts = [i for i in (tail.find("\nThread 0x"), tail.find("\nCurrent thread 0x")) if i >= 0]
    return tail[min(starts) + 1 :] if starts else tail


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
