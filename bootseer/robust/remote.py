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
    order = link.dump_order()                        # {"incident": 4, ...} or None
    link.answer(order["incident"], dump_ranks({0: 1234}, node="node-3"))
    verdict = link.wait_verdict(order["incident"], timeout_s=30)
    link.local_action(verdict)                       # "stop" | "restart"
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import wire
from .events import Event, Verdict
from .standby import ExcludedNode, check_admission

__all__ = ["ControllerLink", "ExcludedNode", "descendants", "dump_ranks", "pyspy_text"]


class ControllerLink:
    """One node's agent talking to the job's controller through the store."""

    def __init__(self, store: Any, node: str, *, job: str = "job", poll_s: float = 0.5,
                 beat_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not wire.valid_node(node):
            raise ValueError(f"node name {node!r} cannot be a controller key: use 1-63 "
                             "letters, digits, '.', '_' or '-' (--node)")
        self.store = store
        self.node = node
        self.keys = wire.Keys(job)
        self.poll_s = poll_s
        self.beat_s = beat_s
        self.clock = clock
        self._last_poll = float("-inf")
        self._last_beat = float("-inf")
        self.answered = 0  # the newest incident this agent dumped for
        self.dump_tool: Callable[[int], str] = pyspy_text  # pid -> its stacks (text)
        self.where = ""  # the store's address, for errors

    @classmethod
    def connect(cls, address: str, node: str, *, job: str = "job",
                timeout_s: float = 30.0) -> ControllerLink:
        link = cls(wire.connect(address, timeout_s), node, job=job)
        link.where = address
        return link

    def register(self) -> None:
        """Join the job's node list; refused when the controller evicted this node."""
        check_admission(self.store, self.node, job=self.keys.prefix.split("/")[1],
                        where=self.where)
        if self.node not in (wire.get(self.store, self.keys.nodes) or b"").decode().split():
            self.store.append(self.keys.nodes, f"{self.node}\n")
        self.store.set(self.keys.node(self.node, "info"), wire.encode(
            {"node": self.node, "pid": os.getpid(), "time": time.time()}))
        last = wire.get(self.store, self.keys.verdict_last)
        self.answered = int(json.loads(last)["incident"]) if last else 0

    def publish(self, event: Event) -> int:
        """Write an event under this node's keys; its sequence number."""
        doc = json.loads(event.to_json())
        doc["node"] = self.node  # a node speaks for itself only
        i = int(self.store.add(self.keys.node(self.node, "events"), 0)) + 1
        self.store.set(self.keys.event(self.node, i), wire.encode(doc))
        self.store.add(self.keys.node(self.node, "events"), 1)
        return i

    def beat(self, attempt: int, ranks: Mapping[int, Mapping[str, Any]]) -> None:
        """The node's heartbeat summary, at most once per ``beat_s``."""
        now = self.clock()
        if now - self._last_beat < self.beat_s:
            return
        self._last_beat = now
        summary = {str(r): {k: v.get(k) for k in ("step", "time", "pid")}
                   for r, v in sorted(ranks.items())[:256]}
        self.store.set(self.keys.node(self.node, "beat"), wire.encode(
            {"node": self.node, "time": time.time(), "attempt": attempt, "ranks": summary}))

    def dump_order(self, *, force: bool = False) -> dict[str, Any] | None:
        """An order to dump for an incident this node has not answered (polled at most every
        ``poll_s`` unless ``force``)."""
        now = self.clock()
        if not force and now - self._last_poll < self.poll_s:
            return None
        self._last_poll = now
        data = wire.get(self.store, self.keys.dump_request)
        if data is None:
            return None
        try:
            order = wire.decode(data, key=self.keys.dump_request)
            incident = int(order["incident"])
        except (wire.WireError, KeyError, TypeError, ValueError):
            return None
        return order if incident > self.answered else None

    def answer(self, incident: int, processes: list[dict[str, Any]],
               files: list[str] = ()) -> None:
        """This node's dump for ``incident`` (texts cut to the limits of :mod:`.wire`)."""
        self.answered = max(self.answered, incident)
        kept, size = [], 0
        for item in processes:
            item = {**item, "text": str(item.get("text", ""))[:wire.MAX_STACK_CHARS]}
            size += len(item["text"]) + 200
            if size > wire.MAX_DUMP_BYTES - 4096:
                break
            kept.append(item)
        self.store.set(self.keys.dump(self.node, incident), wire.encode(
            {"node": self.node, "incident": incident, "time": time.time(), "processes": kept,
             "files": list(files)[:64]}, wire.MAX_DUMP_BYTES))

    def verdict(self, incident: int) -> Verdict | None:
        data = wire.get(self.store, self.keys.verdict(incident))
        if data is None:
            return None
        try:
            return Verdict.from_doc(wire.decode(data, key=self.keys.verdict(incident),
                                                limit=wire.MAX_DUMP_BYTES))
        except (wire.WireError, KeyError, TypeError, ValueError):
            return None

    def wait_verdict(self, incident: int, timeout_s: float,
                     pause: Callable[[float], bool] | None = None) -> Verdict | None:
        """The verdict of ``incident``, polled every ``poll_s``; None after ``timeout_s`` or
        when ``pause`` (the supervisor's wait, answering signals) says to stop."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.verdict(incident)
            if got is not None or time.monotonic() >= deadline:
                return got
            if pause(self.poll_s) if pause else time.sleep(self.poll_s):
                return None

    def local_action(self, verdict: Verdict) -> str:
        """``stop`` when the verdict stops the job or evicts this node, else ``restart``."""
        if verdict.action in ("stop", "rollback"):
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


def pyspy_text(pid: int, timeout_s: float = 20.0) -> str:
    """``py-spy dump`` of a live process (text); RuntimeError when py-spy cannot."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        raise RuntimeError("py-spy is not installed")
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"py-spy dump of pid {pid} took over {timeout_s} s") from None
    if done.returncode != 0 or "Thread" not in done.stdout:
        raise RuntimeError(f"py-spy dump of pid {pid}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def dump_ranks(rank_pids: Mapping[int, int], *, node: str,
               dump: Callable[[int], str] = pyspy_text) -> tuple[list[dict[str, Any]], list[int]]:
    """Stacks of each rank's whole process tree (the rank ``main``, its descendants
    ``worker``), and the ranks whose main process could not be dumped this way."""
    processes: list[dict[str, Any]] = []
    failed: list[int] = []
    for rank, pid in sorted(rank_pids.items()):
        for i, p in enumerate([pid, *descendants(pid)]):
            try:
                text = dump(p)
            except (RuntimeError, OSError):
                if i == 0:
                    failed.append(rank)
                    break
                continue
            processes.append({"rank": rank, "pid": p, "role": "main" if i == 0 else "worker",
                              "node": node, "source": "py-spy", "text": text})
    return processes, failed
