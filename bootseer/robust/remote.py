"""The agent's side of the controller (``bootseer run --controller HOST:PORT``): it registers
the node, publishes its events and a heartbeat summary, polls for the order to dump, answers
it with the stacks of every process of its ranks, and waits for the verdict before the
supervisor stops anything. Keys and limits: :mod:`.wire`.

Why polling: the store is the only channel (no port on the node), and a key read every
``poll_s`` (0.5 s) is one round trip; an order is seen within that.

Usage::

    link = ControllerLink.connect("10.0.0.5:29400", node="node-3")
    link.register()                                  # ExcludedNode if the job evicted it
    link.publish(event)
    link.beat(attempt, {0: {"step": 12, "time": t, "pid": 1234}})   # also answers samples
    order = link.dump_order()                        # {"incident": 4, ...} or None
    link.answer(order["incident"], dump_ranks({0: 1234}, node="node-3"))
    verdict = link.wait_verdict(order["incident"], timeout_s=30, stop=kill_the_command)
    link.local_action(verdict)                       # "stop" | "restart"

Beside the incidents the link answers two orders of the controller on its own:

* a fail-slow round's stack sample (``sample/request``): every rank's trainer dumped with
  ``py-spy dump --nonblocking`` (the process is not paused) in a thread, answered under
  ``node/<n>/sample/<k>``; each beat also carries every rank's recent step time;
* the stop-time checks (``check/<k>``, while the node waits for a verdict): ``stop`` kills the
  command, then ``bootseer check --store`` runs on this node with the other nodes of the job
  (:mod:`.check`), and its result goes to ``node/<n>/check/<k>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..prestart import Standby, python_command
from . import seal, wire
from .events import Event, Verdict
from .standby import ExcludedNode, check_admission

__all__ = [
    "STEP_WINDOW",
    "ControllerLink",
    "ExcludedNode",
    "descendants",
    "dump_ranks",
    "pyspy_text",
]

STEP_WINDOW = 8  # heartbeats (at most one a second) a rank's step time is measured over


LINK_ORDER_S = 30.0  # a link probe order older than this is not answered (its wait is over)
#: what ``bootseer check`` imports before its first collective
CHECK_PRELOAD = ("torch.distributed", "torch.nn", "bootseer.cli", "bootseer.robust.check")


def _end(proc: subprocess.Popen[bytes] | None) -> None:
    """A check process that is still running: terminated (its result is in or too late)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _address_of(store: Any) -> str | None:
    """``HOST:PORT`` of a TCPStore client (the checks' subprocess connects there)."""
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host and port else None


class ControllerLink:
    """One node's agent talking to the job's controller through the store."""

    def __init__(
        self,
        store: Any,
        node: str,
        *,
        job: str = "job",
        poll_s: float = 0.5,
        beat_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        address: str | None = None,
        check_timeout_s: float = 180.0,
    ) -> None:
        if not wire.valid_node(node):
            raise ValueError(
                f"node name {node!r} cannot be a controller key: use 1-63 "
                "letters, digits, '.', '_' or '-' (--node)"
            )
        seal.require_secret("bootseer run --controller")  # no record is trusted without it
        self._warned: set[str] = set()  # keys whose refused record was said once
        self.store = store
        self.node = node
        self.keys = wire.Keys(job)
        self.poll_s = poll_s
        self.beat_s = beat_s
        self.clock = clock
        self._last_poll = float("-inf")
        self._last_beat = float("-inf")
        self.answered = 0  # the newest incident this agent dumped for
        self._acked = 0  # the newest incident whose order this agent acknowledged
        self.dump_tool: Callable[[int], str] = pyspy_text  # pid -> its stacks (text)
        # the same processes again with native frames, after the answer (evidence only)
        self.native_tool: Callable[[int], str] = native_dump
        self.sample_tool: Callable[[int], str] = lambda pid: pyspy_text(pid, nonblocking=True)
        self.job = job
        self.address = address or _address_of(store)
        self.check_timeout_s = check_timeout_s
        self.checked = 0  # the newest incident this agent ran the checks for
        self._check_standby: Standby | None = None  # the checks' interpreter, started ahead
        self._steps: dict[int, deque[tuple[int, float]]] = {}
        self._sampled = 0  # the newest fail-slow round this agent answered
        self._sampler: threading.Thread | None = None
        self._probed = 0  # the newest link probe order this agent answered
        self._prober: threading.Thread | None = None
        self._last_link_poll = float("-inf")
        self.where = self.address or ""  # the store's address, for errors
        # the node's collective ring window (bootseer.colltrace.reader.Watch.window), shipped
        # under node/<n>/colltrace every colltrace_s and with each dump answer; None: off
        self.colltrace: Callable[[], dict[str, Any]] | None = None
        self.colltrace_s = 2.0
        self._last_ship = float("-inf")

    def _read(self, key: str) -> dict[str, Any] | None:
        """The record under ``key`` when it is sealed under the job's secret and valid
        (:func:`.wire.read`); else None, and a warning naming the key (once per key): a
        forged or damaged order is never acted on, and the agent goes on."""
        try:
            return wire.read(self.store, key, limit=wire.MAX_DUMP_BYTES)
        except wire.WireError as exc:
            if key not in self._warned:
                self._warned.add(key)
                print(
                    f"bootseer: controller: warning: {str(exc)[:400]}", file=sys.stderr, flush=True
                )
            return None

    @classmethod
    def connect(
        cls, address: str, node: str, *, job: str = "job", timeout_s: float = 30.0
    ) -> ControllerLink:
        return cls(wire.connect(address, timeout_s), node, job=job, address=address)

    def register(self) -> None:
        """Join the job's node list; refused when the controller evicted this node."""
        check_admission(
            self.store,
            self.node,
            job=self.keys.prefix.split("/")[1],
            where=self.where,
            log=lambda line: print(f"bootseer: controller: {line}", file=sys.stderr, flush=True),
        )
        if self.node not in (wire.get(self.store, self.keys.nodes) or b"").decode().split():
            self.store.append(self.keys.nodes, f"{self.node}\n")
        wire.put(
            self.store,
            self.keys.node(self.node, "info"),
            {"node": self.node, "pid": os.getpid(), "time": time.time()},
        )
        last = self._read(self.keys.verdict_last)
        self.answered = int(last["incident"]) if last else 0

    def publish(self, event: Event) -> int:
        """Write an event under this node's keys; its sequence number."""
        doc = json.loads(event.to_json())
        doc["node"] = self.node  # a node speaks for itself only
        i = int(self.store.add(self.keys.node(self.node, "events"), 0)) + 1
        wire.put(self.store, self.keys.event(self.node, i), doc)
        self.store.add(self.keys.node(self.node, "events"), 1)
        return i

    def beat(self, attempt: int, ranks: Mapping[int, Mapping[str, Any]]) -> None:
        """The node's heartbeat summary, at most once per ``beat_s``, with each rank's step
        time over its last heartbeats; and the answer to a fail-slow round's sample order."""
        for r, v in ranks.items():
            self._note_step(r, v.get("step"), v.get("time"))
        self._answer_sample(ranks)
        self._answer_link()
        self.ship_colltrace()
        now = self.clock()
        if now - self._last_beat < self.beat_s:
            return
        self._last_beat = now
        summary = {
            str(r): {
                **{k: v.get(k) for k in ("step", "time", "pid")},
                "step_time_s": self.step_time(r),
            }
            for r, v in sorted(ranks.items())[:256]
        }
        wire.put(
            self.store,
            self.keys.node(self.node, "beat"),
            {"node": self.node, "time": time.time(), "attempt": attempt, "ranks": summary},
        )

    def ship_colltrace(self, *, force: bool = False) -> bool:
        """This node's collective ring window into the store (at most every ``colltrace_s``
        unless ``force``), for the controller's verdict across nodes; a failure is dropped
        (the next one tries again): the tracer must never cost the job."""
        now = self.clock()
        if self.colltrace is None or (not force and now - self._last_ship < self.colltrace_s):
            return False
        self._last_ship = now
        try:
            doc = self.colltrace()
            wire.put(self.store, self.keys.node(self.node, "colltrace"), doc, wire.MAX_DUMP_BYTES)
        except (RuntimeError, OSError, ValueError, wire.WireError):
            return False
        return True

    def _note_step(self, rank: int, step: Any, when: Any) -> None:
        if not isinstance(step, int) or not isinstance(when, int | float):
            return
        seen = self._steps.setdefault(rank, deque(maxlen=STEP_WINDOW))
        if seen and step < seen[-1][0]:  # a new attempt counts from 0 again
            seen.clear()
        if not seen or step > seen[-1][0]:
            seen.append((step, float(when)))

    def step_time(self, rank: int) -> float | None:
        """Seconds per step of ``rank`` over its last :data:`STEP_WINDOW` heartbeats (the
        client's own times), or None before two are known."""
        seen = self._steps.get(rank)
        if not seen or len(seen) < 2 or seen[-1][0] == seen[0][0]:
            return None
        return round((seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0]), 6)

    # -- fail-slow samples -----------------------------------------------------------------
    def _answer_sample(self, ranks: Mapping[int, Mapping[str, Any]]) -> None:
        """A new round's sample order: the trainers dumped in a thread (the watch loop goes
        on), answered under this node's key."""
        if self._sampler is not None and self._sampler.is_alive():
            return
        order = self._read(self.keys.sample_request)
        round_ = int(order["round"]) if order else 0
        if round_ <= self._sampled:
            return
        self._sampled = round_
        pids = {r: int(v["pid"]) for r, v in ranks.items() if isinstance(v.get("pid"), int)}

        def sample() -> None:
            processes = []
            for rank, pid in sorted(pids.items()):
                try:
                    text = self.sample_tool(pid)
                except (RuntimeError, OSError):
                    continue
                processes.append(
                    {
                        "rank": rank,
                        "pid": pid,
                        "role": "main",
                        "source": "py-spy",
                        "text": text[: wire.MAX_STACK_CHARS],
                    }
                )
            answer: dict[str, Any] = {
                "node": self.node,
                "round": round_,
                "time": time.time(),
                "processes": processes,
            }
            try:
                wire.put(
                    self.store, self.keys.sample(self.node, round_), answer, wire.MAX_DUMP_BYTES
                )
            except (RuntimeError, OSError, wire.WireError):
                pass  # the next round asks again

        self._sampler = threading.Thread(
            target=sample, name=f"bootseer-sample-{round_}", daemon=True
        )
        self._sampler.start()

    def _answer_link(self) -> None:
        """The controller suspects a link: this node probes its own to the store, in a thread
        (the watch loop goes on), once per order; an order older than the controller's wait
        (``LINK_ORDER_S``) is not answered."""
        if not self.address or (self._prober is not None and self._prober.is_alive()):
            return
        now = self.clock()
        if now - self._last_link_poll < self.poll_s:  # one store read per poll, not per loop
            return
        self._last_link_poll = now
        order = self._read(self.keys.link_request)
        ident, asked_at = (int(order["id"]), float(order["time"])) if order else (0, 0.0)
        if ident <= self._probed:
            return
        self._probed = ident
        if time.time() - asked_at > LINK_ORDER_S:
            return

        def probe() -> None:
            answer = {
                "node": self.node,
                "id": ident,
                "time": time.time(),
                "probe": self.probe_link(),
            }
            with contextlib.suppress(RuntimeError, OSError, wire.WireError):
                wire.put(self.store, self.keys.link_probe(self.node, ident), answer)

        self._prober = threading.Thread(target=probe, name=f"bootseer-probe-{ident}", daemon=True)
        self._prober.start()

    def probe_link(self) -> dict[str, Any]:
        """Round trip and throughput of this node's link to the job's store
        (:mod:`bootseer.colltrace.probe`); a probe that fails says why (a saturated link may
        not even connect, which names it too)."""
        from ..colltrace.probe import measure

        try:
            return measure(str(self.address), node=self.node, timeout_s=30.0)
        except Exception as exc:  # noqa: BLE001 - the failure is the measurement
            return {"node": self.node, "error": f"{type(exc).__name__}: {exc}"[:300]}

    def dump_order(self, *, force: bool = False) -> dict[str, Any] | None:
        """An order to dump for an incident this node has not answered (polled at most every
        ``poll_s`` unless ``force``)."""
        now = self.clock()
        if not force and now - self._last_poll < self.poll_s:
            return None
        self._last_poll = now
        order = self._read(self.keys.dump_request)
        if order is None:
            return None
        incident = int(order["incident"])
        if incident <= self.answered:
            return None
        if incident > self._acked:  # at once, before the dumps: the controller then waits
            self._acked = incident  # for this node's answer, however long it takes
            wire.put(
                self.store,
                self.keys.dump_ack(self.node, incident),
                {"node": self.node, "incident": incident, "time": time.time()},
            )
        return order

    def answer(self, incident: int, processes: list[dict[str, Any]], files: list[str] = ()) -> None:
        """This node's dump for ``incident`` (texts cut to the limits of :mod:`.wire`), and
        its collective ring window as it is now (before the dump: the controller may close
        the incident as soon as the last dump is in)."""
        self.answered = max(self.answered, incident)
        self.ship_colltrace(force=True)
        wire.put(
            self.store,
            self.keys.dump(self.node, incident),
            {
                "node": self.node,
                "incident": incident,
                "time": time.time(),
                "processes": _within_limits(processes),
                "files": list(files)[:64],
            },
            wire.MAX_DUMP_BYTES,
        )

    def answer_native(self, incident: int, processes: list[dict[str, Any]]) -> None:
        """The same processes dumped again with native frames (``py-spy dump --native``:
        seconds on a loaded node, so after the answer the verdict waits for); the controller
        adds them to its verdict's evidence when they are in by then."""
        wire.put(
            self.store,
            self.keys.native_dump(self.node, incident),
            {
                "node": self.node,
                "incident": incident,
                "time": time.time(),
                "processes": _within_limits(processes),
            },
            wire.MAX_DUMP_BYTES,
        )

    def verdict(self, incident: int) -> Verdict | None:
        doc = self._read(self.keys.verdict(incident))
        return Verdict.from_doc(doc) if doc is not None else None

    def wait_verdict(
        self,
        incident: int,
        timeout_s: float,
        pause: Callable[[float], bool] | None = None,
        stop: Callable[[], None] | None = None,
    ) -> Verdict | None:
        """The verdict of ``incident``, polled every ``poll_s``; None after ``timeout_s`` or
        when ``pause`` (the supervisor's wait, answering signals) says to stop. An order to
        run the stop-time checks meanwhile: ``stop`` (kill the command), the checks in a
        process of their own (up to ``check_timeout_s``), and ``timeout_s`` counts again from
        their end. The verdict may come before that process has exited: it is not waited
        for (its result is in)."""
        deadline = time.monotonic() + timeout_s
        check: subprocess.Popen[bytes] | None = None
        check_deadline = 0.0
        try:
            while True:
                got = self.verdict(incident)
                if got is not None:
                    return got
                now = time.monotonic()
                if check is not None and (check.poll() is not None or now >= check_deadline):
                    code = check.poll()
                    check = _end(check)
                    deadline = now + timeout_s
                    self._check_failed(incident, code)
                if check is None and now >= deadline:
                    return None
                if check is None and (order := self.check_order(incident)) is not None:
                    if stop is not None:
                        stop()
                    check = self.start_check(order)
                    check_deadline = time.monotonic() + self.check_timeout_s
                    continue
                if pause(self.poll_s) if pause else time.sleep(self.poll_s):
                    return None
        finally:
            _end(check)

    # -- stop-time checks ------------------------------------------------------------------
    def check_order(self, incident: int) -> dict[str, Any] | None:
        """The controller's order to run the checks for ``incident`` with this node in it,
        once."""
        if incident <= self.checked:
            return None
        order = self._read(self.keys.check_request(incident))
        if not order or self.node not in (order.get("nodes") or []):
            return None
        return order

    def start_check(self, order: Mapping[str, Any]) -> subprocess.Popen[bytes]:
        """``bootseer check --store`` on this node, joining the job's other nodes through the
        store (its result goes to the store itself)."""
        incident = int(order["incident"])
        self.checked = max(self.checked, incident)
        argv = [
            sys.executable,
            "-m",
            "bootseer",
            "check",
            "--store",
            str(self.address),
            "--job",
            self.job,
            "--incident",
            str(incident),
            "--node",
            self.node,
        ]
        print(
            f"bootseer: controller: incident {incident}: running the stop-time checks "
            f"with {len(order.get('nodes') or [])} node(s)",
            file=sys.stderr,
            flush=True,
        )
        standby, self._check_standby = self._check_standby, None
        command = python_command(argv)
        if standby is not None and command is not None:
            proc, why = standby.take(command, os.environ, None, [])
            if proc is not None:
                return proc
            print(
                f"bootseer: controller: the checks' interpreter started ahead is not used: {why}",
                file=sys.stderr,
                flush=True,
            )
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    def prepare_check(self) -> None:
        """Start the stop-time checks' interpreter ahead, torch imported (``--preload``):
        an unclear crash's checks then start in a fraction of a second, not after every node
        has imported torch at once."""
        if self._check_standby is not None:
            return
        try:
            self._check_standby = Standby.start(sys.executable, CHECK_PRELOAD, os.environ)
        except OSError as exc:
            print(
                f"bootseer: controller: cannot start the checks' interpreter ahead ({exc})",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """Stop what this link started ahead."""
        if self._check_standby is not None:
            self._check_standby.stop()
            self._check_standby = None

    def _check_failed(self, incident: int, code: int | None) -> None:
        """A check process that ended without its result: said to the controller, which then
        waits no longer for this node."""
        if wire.get(self.store, self.keys.check_result(self.node, incident)) is not None:
            return
        why = "timed out" if code is None else f"exited with {code} without a result"
        wire.put(
            self.store,
            self.keys.check_result(self.node, incident),
            {
                "node": self.node,
                "incident": incident,
                "time": time.time(),
                "error": f"bootseer check on {self.node} {why}",
            },
        )

    def answer_check(self, incident: int, result: Mapping[str, Any]) -> None:
        """This node's check result (a :class:`.check.RankResult` as a dict) for the
        controller."""
        wire.put(
            self.store,
            self.keys.check_result(self.node, incident),
            {"node": self.node, "incident": incident, "time": time.time(), "result": dict(result)},
        )

    def local_action(self, verdict: Verdict) -> str:
        """``stop`` when the verdict stops the job or evicts this node, else ``restart``
        (``rollback`` too: the controller published the previous version before the verdict,
        and the restart runs it)."""
        if verdict.action == "stop":
            return "stop"
        if verdict.action == "replace_and_restart" and self.node in verdict.nodes:
            return "stop"
        return "restart"


# -- dumps -------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (dataloader workers, helpers), from /proc."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def _within_limits(processes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dumped processes cut to the wire's limits: each text to ``MAX_STACK_CHARS``, and as
    many as fit in one record."""
    kept, size = [], 0
    for item in processes:
        item = {**item, "text": str(item.get("text", ""))[: wire.MAX_STACK_CHARS]}
        size += len(item["text"]) + 200
        if size > wire.MAX_DUMP_BYTES - 4096:
            break
        kept.append(item)
    return kept


def pyspy_text(
    pid: int, timeout_s: float = 20.0, *, nonblocking: bool = False, native: bool = False
) -> str:
    """``py-spy dump`` of a live process (text); RuntimeError when py-spy cannot.
    ``nonblocking``: the process is not paused (a sample of a healthy job). ``native``: with
    the compiled frames (where inside gloo, NCCL or a C extension it waits); where py-spy
    cannot unwind them (another platform, a stripped build) the Python frames alone."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        raise RuntimeError("py-spy is not installed")
    argv = [exe, "dump", "--pid", str(pid), *(["--nonblocking"] if nonblocking else [])]
    for extra in (["--native"], []) if native and not nonblocking else ([],):
        try:
            done = subprocess.run(
                [*argv, *extra], capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"py-spy dump of pid {pid} took over {timeout_s} s") from None
        if done.returncode == 0 and "Thread" in done.stdout:
            return done.stdout
    raise RuntimeError(f"py-spy dump of pid {pid}: {(done.stderr or done.stdout).strip()}")


def native_dump(pid: int) -> str:
    """The controller's incident dump: blocking, with native frames where py-spy can."""
    return pyspy_text(pid, native=True)


def dump_ranks(
    rank_pids: Mapping[int, int], *, node: str, dump: Callable[[int], str] = pyspy_text
) -> tuple[list[dict[str, Any]], list[int]]:
    """Stacks of each rank's whole process tree (the rank ``main``, its descendants
    ``worker``), and the ranks whose main process could not be dumped this way. The
    processes are dumped at once, each on its own thread: a native dump (``dump=
    native_dump``) takes about 0.8 s on a quiet node (py-spy loads the libraries' symbols)
    and 4-6 s at load 7 on 2 cores, and one after the other they would add up."""
    trees = [
        (rank, i, p)
        for rank, pid in sorted(rank_pids.items())
        for i, p in enumerate([pid, *descendants(pid)])
    ]

    def one(p: int) -> str | None:
        try:
            return dump(p)
        except (RuntimeError, OSError):
            return None

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(trees)))) as pool:
        texts = list(pool.map(one, [p for _, _, p in trees]))
    processes: list[dict[str, Any]] = []
    failed = sorted(
        {rank for (rank, i, _), text in zip(trees, texts, strict=True) if i == 0 and text is None}
    )
    for (rank, i, p), text in zip(trees, texts, strict=True):
        if text is not None and rank not in failed:
            processes.append(
                {
                    "rank": rank,
                    "pid": p,
                    "role": "main" if i == 0 else "worker",
                    "node": node,
                    "source": "py-spy",
                    "text": text,
                }
            )
    return processes, failed
