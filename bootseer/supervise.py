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

Here are the restart and watch loops; the pieces they call are :mod:`bootseer.command` and, in
``bootseer/robust/``, ``progress``, ``dumps``, ``incident``, ``hangs`` and ``dialogue``, typed
by ``seams`` (docs/architecture.md). Import the names from here, as before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from striped_fs import PrivateDir

from .command import (  # noqa: F401 (FORWARD_SIGNALS, HANDLED: importable from here as before)
    FORWARD_SIGNALS,
    HANDLED,
    STOP_SIGNALS,
    Processes,
)
from .command import Signals as _Signals
from .prestart import Standby, python_command
from .process import (  # noqa: F401 (group_pids: importable from here as before)
    become_subreaper,
    exit_code,
    group_pids,
    signal_name,
)
from .robust.detect import Beat
from .robust.dialogue import ControllerDialogue
from .robust.dumps import NATIVE_GRACE_S, StackDumps  # noqa: F401 (NATIVE_GRACE_S: as before)
from .robust.hangs import Hangs
from .robust.incident import Incident
from .robust.progress import Progress
from .robust.ranks import RankWatch
from .robust.seams import AgentSeam, AttemptEnd, RemoteSeam, VersionsSeam
from .tee import OutputTail
from .trace import Span, TraceWriter
from .variables import INCIDENT_HANDOFF, VERSION_HANDOFF

if TYPE_CHECKING:
    from .robust.events import Event
    from .robust.update import Version

__all__ = [
    "AttemptEnd",
    "HangPolicy",
    "RestartPolicy",
    "StopRequested",
    "Supervisor",
    "become_subreaper",
    "exit_code",
]

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


class StopRequested(Exception):
    """A stop signal arrived while no command ran (startup phases, backoff)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stderr(line: str) -> None:
    print(f"bootseer: {line}", file=sys.stderr, flush=True)


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
        dump_dir: str | os.PathLike[str] | None = None,
        control_dir: str | os.PathLike[str] | None = None,
        ready_file: str | os.PathLike[str] | None = None,
        before_attempt: Callable[[int], Mapping[str, str] | None] | None = None,
        kill_grace_s: float = 5.0,
        agent: AgentSeam | None = None,
        tail_lines: int = 200,
        remote: RemoteSeam | None = None,
        remote_wait_s: float = 30.0,
        versions: VersionsSeam | None = None,
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
        self._signals: _Signals | None = None
        # the pieces (docs/architecture.md): the command's processes, its stack dumps, the
        # attempt's incident while the launcher runs on, the controller dialogue, the hangs
        self._procs = Processes(kill_grace_s, log)
        self._dumps = StackDumps(self.node, self.dump_dir, hang.dump_wait_s, self._procs, log)
        self._incident = Incident(
            self.agent, self.remote, self._procs, self.tail, crash_grace_s, self._record, log
        )
        self._dialogue = (
            ControllerDialogue(
                self.remote,
                agent,
                node=self.node,
                wait_s=remote_wait_s,
                hang_timeout_s=hang.timeout_s,
                procs=self._procs,
                dumps=self._dumps,
                incident=self._incident,
                record=self._record,
                log=log,
            )
            if self.remote is not None and agent is not None
            else None
        )
        self._hangs = Hangs(
            node=self.node,
            timeout_s=hang.timeout_s,
            dump_dir=self.dump_dir,
            agent=self.agent,
            dialogue=self._dialogue,
            procs=self._procs,
            dumps=self._dumps,
            incident=self._incident,
            record=self._record,
            log=log,
        )
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
        self._watching: Progress | None = None  # the running attempt's ranks' signals
        # the warm start's checks beside the command: the first failure
        # (bootseer.deferred.DeferredFailure), or None
        self.checks = checks

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> int:
        self._signals = self._procs.signals = _Signals()
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
            self._signals = self._procs.signals = None
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
                or self._procs.stopping is not None
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
        agent = self.agent
        if agent is None:
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
        if verdict is None and (early := self._incident.event) is not None:  # at its death
            return self._judge_early(agent, early, end, lines)
        dialogue = self._dialogue
        if verdict is None and dialogue is not None:  # the controller decides, if it can
            event = agent.crash_event(end.code, lines)
            verdict = dialogue.verdict(event, end.attempt)
            if verdict is not None:
                return dialogue.remote.local_action(
                    self._skip_after(self._from_controller(verdict))
                )
            return agent.local_action(self._skip_after(agent.judge(event)))
        if verdict is None:  # a crash: classified from its exit and last lines
            verdict = agent.judge_crash(end.code, lines)
        return agent.local_action(self._skip_after(verdict))

    def _from_controller(self, verdict: Any) -> Any:
        """Notes that the controller decided (its class: the backoff depends on it)."""
        self._by_controller = getattr(verdict, "failure_class", None) or "controller"
        return verdict

    def _skip_after(self, verdict: Any) -> Any:
        """After a NaN verdict, every later attempt passes over the checkpoints the failed
        attempt saved from the NaN's step on (they hold the NaN: resuming from one NaNs again);
        said once, and handed down as ``BOOTSEER_CKPT_SKIP`` (ckpt/skip.py)."""
        from ckpt import SkipRule

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

    def _judge_early(
        self, agent: AgentSeam, early: Event, end: AttemptEnd, lines: list[str]
    ) -> str:
        """A crash published when its rank died (``early``): the launcher's account refines
        its class (same detection time), and the verdict is the controller's or the node's."""
        self._incident.take_refined(agent.refine(early, end.code, lines))
        early = self._incident.event or early
        if (dialogue := self._dialogue) is not None:
            verdict = dialogue.verdict(early, end.attempt, published=True)
            if verdict is not None:
                return dialogue.remote.local_action(
                    self._skip_after(self._from_controller(verdict))
                )
        return agent.local_action(self._skip_after(agent.judge(early, written=True)))

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
        self._procs.reap()
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
            from ckpt import SKIP_ENV, to_env

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

    def _version(self, attempt: int) -> Version | None:
        """The version of this attempt's epoch (None without ``versions``), said in a line
        and written to the trace as an ``update`` event."""
        if self.versions is None or self.remote is None:  # versions come with a remote
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
            child = self._procs.child = self._spawn(
                env, version.workdir if version else None, pipes
            )
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
        pid = child.pid
        for (r, w), target in zip(pipes, (1, 2), strict=False):
            os.close(w)
            self.tail.attach(r, target)
        if self.agent is not None:
            self.agent.start_attempt(attempt)
            self._ranks = RankWatch(self.control_dir, root=pid, skip_pids={pid})
        self._incident.reset()
        self._procs.status = None
        # epoch: the controller's newest incident, the same on every node of this attempt
        # (a replacement node's attempt 0 joins the survivors' attempt 5): ETTR's job attempt
        epoch: dict[str, Any] = {"epoch": self.remote.answered} if self.remote is not None else {}
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
            self._procs.cleanup_group(pid)
            child.returncode = self._procs.status if self._procs.status is not None else -1
            self._procs.child = None
            self._dumps.remove_empty()
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
        assert self._procs.child is not None
        pid = self._procs.child.pid
        watch = self._watching = Progress(self.control_dir, self.ready_file)
        watch.began_wall = started
        first_ready = True
        timeout = self.hang.timeout_s
        poll = 0.25 if timeout <= 0 else min(0.25, timeout / 4)
        while True:
            wake = self._ranks.fds() if self._ranks and self._procs.stopping is None else ()
            for sig in self._signals.wait(poll, wake):
                if self._on_signal(sig, pid):
                    return AttemptEnd(attempt, self._procs.kill(pid), "stopped", pid)
            exited = self._procs.reap()
            for rank, when in watch.scan():  # before an exit: a ready just before it counts
                launch: dict[str, Any] = (
                    {"generation": watch.generation} if watch.generation else {}
                )
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
            if exited and (status := self._procs.status) is not None:
                code = exit_code(status)
                reason = (
                    "stopped"
                    if self._procs.stopping is not None
                    else ("signaled" if os.WIFSIGNALED(status) else "exited")
                )
                self.log(
                    f"command exited with {AttemptEnd(attempt, code, reason).describe()} "
                    f"(attempt {attempt})"
                )
                return AttemptEnd(attempt, code, reason, pid, {"exited_at": time.time()})
            if (
                self.checks is not None
                and self._procs.stopping is None
                and (failed := self.checks()) is not None
            ):
                return self._check_failed(attempt, pid, failed)
            if self._ranks is not None and self._procs.stopping is None:
                self._incident.rank_ends(self._ranks, attempt, pid, watch)
            if self.agent is not None and (
                end := self._agent_watch(self.agent, attempt, pid, watch)
            ):
                return end
            if self._dialogue is not None and self._procs.stopping is None:
                if end := self._dialogue.poll(attempt, pid, watch):
                    return end
            if (
                timeout > 0
                and self._procs.stopping is None
                and (end := self._silence(attempt, pid, watch))
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
        self._procs.kill(pid)
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

    def _silence(self, attempt: int, pid: int, watch: Progress) -> AttemptEnd | None:
        """A hang of the control directory's silence: ``timeout_s`` once the ranks reported,
        the start allowance before; after a rank's death the launcher has the start
        allowance, from the death, to restart its ranks or to exit."""
        allowance = max(self.hang.timeout_s, self.hang.startup_s)
        if (early := self._incident.event) is not None:
            silent = time.monotonic() - self._incident.at
            if silent < allowance:
                return None
            self.log(
                f"the launcher neither restarted its ranks nor exited {silent:.0f}s after "
                f"rank {early.rank} died (the start allowance): a hang"
            )
            self._incident.event = None  # the launcher's hang is the incident now
            return self._hangs.handle(attempt, pid, watch, silent, self._ranks, launcher=True)
        if watch.all_finishing() or (self.spare and watch.last_change is None):  # parked
            return None
        if watch.last_change is None:
            silent, limit = time.monotonic() - watch.began, allowance
        else:
            silent, limit = time.monotonic() - watch.last_change, self.hang.timeout_s
        if silent < limit:
            return None
        return self._hangs.handle(attempt, pid, watch, silent, self._ranks)

    def _on_signal(self, sig: int, pid: int) -> bool:
        """Handle one signal; True when the command must be killed now (a second stop)."""
        if sig == signal.SIGCHLD:
            return False
        name = signal.Signals(sig).name
        if sig in STOP_SIGNALS:
            if self._procs.stopping is not None:
                self.log(f"{name} again: killing the command")
                return True
            self._procs.stopping = sig
            self.log(f"{name}: forwarded to the command (send it again to kill it)")
            self._procs.signal_group(pid, sig)
        elif sig == signal.SIGUSR1:
            files = self._dumps.request(pid, everyone=False)
            self.log(
                f"SIGUSR1: stack dump requested from {len(files)} process(es) into {self.dump_dir}"
            )
        else:
            self._procs.signal_group(pid, sig)
        return False

    def _agent_watch(
        self, agent: AgentSeam, attempt: int, pid: int, watch: Progress
    ) -> AttemptEnd | None:
        """Heartbeats through the agent's detectors: a NaN/Inf kills the command now, a rank
        silent past the threshold is a hang."""
        for doc in watch.take_beats():
            try:
                beat = Beat.from_doc(doc, self.node)
            except (KeyError, TypeError, ValueError):
                continue
            if self._dialogue is not None:
                if end := self._dialogue.metrics(attempt, pid, beat):
                    return end
                continue
            verdict = agent.observe(beat)
            if verdict is not None and self._procs.stopping is None:
                self.log(
                    f"killing the command at step {beat.step} (attempt {attempt}): "
                    f"{verdict.failure_class}"
                )
                code = self._procs.kill(pid)
                return AttemptEnd(
                    attempt, code, "nonfinite", pid, {"verdict": verdict, "exited_at": time.time()}
                )
        if (
            self._procs.stopping is None
            and self._incident.event is None
            and (event := agent.check_hang(time.time()))
        ):  # a crash explains a silence
            silent = float(event.evidence.get("silent_s", 0.0))
            return self._hangs.handle(attempt, pid, watch, silent, self._ranks, event=event)
        return None

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
