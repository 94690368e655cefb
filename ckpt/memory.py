"""The memory tier: every-step copies of a rank's state in shared memory the node agent owns.

    tier = MemoryTier(MemoryConfig("/dev/shm/bootseer-memckpt"), rank=rank, world_size=world)
    tier.save(step, state)                  # one copy into the free buffer; returns
    report = tier.load(state, durable_step=None)   # newest step every rank holds, or None

``CheckpointManager`` uses it when configured (``memory=``, or ``BOOTSEER_MEMCKPT_DIR`` set by
``bootseer run``): training code does not change. Each rank keeps two slot files
(``memory_slot``), written alternately, so the newest complete copy is never the one being
overwritten; the files live in a directory that ``bootseer run`` created and removes, so they
survive the trainer's crash or SIGKILL. After each commit the copy is pushed to the
agent of a node outside the rank's parallel groups, else the neighbouring node's
(``memory_place``, ``memory_peer``; the connection proves the job's token, and every message
and copy on it carries a MAC under it). A load takes, on every rank, the newest step
that every rank holds, from the nearest place: its own memory, else a peer's, else ``None``
(the caller falls back to the durable tier); a copy that fails its checksums is refused and
the ranks agree again without it (``agree``).
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from striped_fs import PrivateDir

from . import agree
from .agree import DAMAGED, OK, Outcome
from .errors import CheckpointError
from .flatten import walk
from .layout import align, dtype_name, dtype_of
from .loader import LoadReport
from .memory_env import (  # the hand-off's variables: bootseer run sets what from_env reads
    DIR_ENV,
    DURABLE_EVERY_ENV,
    DURABLE_OUTAGE_ENV,
    FRESH_ENV,
    LAYOUT_ENV,
    REPLICATION_ENV,
    REPLICATIONS,
    SERVER_ENV,
    TOKEN_ENV,
)
from .memory_peer import PeerClient, PeerError
from .memory_place import choose_peer, nodes_in_order, parse_layout
from .memory_slot import (
    BLOCK,
    HEADER,
    SlotDamaged,
    SlotFile,
    SlotHeader,
    block_hash,
    block_sums,
    newest,
    pack_meta,
    pad8,
    slot_paths,
)
from .memory_verify import MEMORY_DIR_WHAT, stamp_for
from .skip import poisoned, rules_from_env
from .tensors import PerRank, describe, is_tensor_leaf

log = logging.getLogger("ckpt")


@dataclass
class MemoryConfig:
    """Where the memory tier lives and whom it replicates to.

    ``directory``: the node agent's shared-memory directory (``bootseer run`` makes it 0700
    under /dev/shm). ``server``: this node's peer server (``HOST:PORT``), which the ranks
    exchange to find their peer; ``peer``: a fixed peer instead. ``layout``: the job's
    parallel groups (``{"dp": [[0, 1], [2, 3]], ...}``, as ``bootseer controller --layout``):
    each rank's copy goes to a node that shares none of its groups, else to the next node
    (``memory_place``). ``token``: the job's secret that peer connections prove they hold
    (default: ``BOOTSEER_MEMCKPT_TOKEN``; never logged). ``durable_every``:
    ``CheckpointManager.save`` also writes the durable tier every that many steps (``None``:
    every save, as without the memory tier). ``check_durable``: before loading from memory,
    ask the durable tier for a newer commit (one listing); ``False`` when the directory holds
    this run's copies only (``bootseer run``'s own directory), where memory is never older
    than the durable tier, so an in-place restart reads nothing over the network.
    ``replication``: ``"async"`` (the push to the peer overlaps the next step: a node lost
    within a push loses that step) or ``"sync"`` (``save`` returns only once the peer acked
    the step, at most ``push_wait_s``, else raises :class:`MemoryPushError`: the training
    thread pays the push time every step, and a lost node loses no step it moved past).
    ``durable_outage_s``: how long durable saves may fail on a transient store error
    (connections refused or reset, timeouts, a commit missing a rank's shard) before ``save``
    raises; until then each failure is logged and training goes on, because memory holds every
    step (0: raise the first failure, as without the memory tier). ``close`` and ``wait``
    always raise a failed last save."""

    directory: str
    server: str = ""
    peer: str = ""
    durable_every: int | None = None
    peer_timeout_s: float = 30.0
    check_durable: bool = True
    push_wait_s: float = 120.0  # wait()'s bound on the last copy's push to the peer
    layout: dict[str, list[list[int]]] | None = None
    replication: str = "async"
    durable_outage_s: float = 600.0
    token: str = field(default_factory=lambda: os.environ.get(TOKEN_ENV, ""), repr=False)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MemoryConfig | None:
        """The configuration ``bootseer run`` hands down, or ``None`` (no memory tier)."""
        env = dict(os.environ) if env is None else env
        if not env.get(DIR_ENV):
            return None
        every = env.get(DURABLE_EVERY_ENV, "")
        outage = env.get(DURABLE_OUTAGE_ENV, "")
        try:
            outage_s = float(outage) if outage else cls.durable_outage_s
        except ValueError:
            raise CheckpointError(
                f"{DURABLE_OUTAGE_ENV}={outage!r} is not a number of "
                "seconds (ckpt.durable_outage_s)"
            ) from None
        try:
            layout = parse_layout(env.get(LAYOUT_ENV, ""), where=LAYOUT_ENV)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        return cls(
            env[DIR_ENV],
            server=env.get(SERVER_ENV, ""),
            durable_every=int(every) if every else None,
            check_durable=env.get(FRESH_ENV) != "1",
            layout=layout,
            replication=env.get(REPLICATION_ENV) or "async",
            durable_outage_s=outage_s,
        )


class MemoryPushError(CheckpointError):
    """The copy to the peer failed or did not finish within ``push_wait_s``; the message names
    the peer, the step and what to check. This node's own memory still holds the step."""


class MemoryTierTooLarge(CheckpointError):
    """The state does not fit the node's shared memory twice plus the peer's share."""


@dataclass
class _Piece:
    """One tensor of the state, where its bytes sit in a copy."""

    key: str
    target: torch.Tensor
    at: int
    nbytes: int


class MemoryTier:
    """One rank's in-memory copies (docs/ckpt.md, "The memory tier")."""

    def __init__(
        self,
        config: MemoryConfig,
        *,
        rank: int,
        world_size: int,
        process_group: Any = None,
        trust_objects: bool = False,
        local_world_size: int | None = None,
    ) -> None:
        try:
            config.layout = parse_layout(config.layout, world_size, "the memory tier's layout")
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        if config.replication not in REPLICATIONS:
            raise CheckpointError(
                f"memory tier: replication {config.replication!r} is not one of "
                f"{', '.join(REPLICATIONS)}: set MemoryConfig.replication (ckpt."
                f"memory_replication, {REPLICATION_ENV}) to 'async' (the push overlaps the "
                "next step) or 'sync' (save returns once the peer holds the step)"
            )
        try:  # this user's own, 0700, not a link (striped_fs.privdir); its files by its fd
            where = PrivateDir.open(config.directory, create=False, what=MEMORY_DIR_WHAT)
        except FileNotFoundError:
            raise CheckpointError(
                f"memory tier directory {config.directory} does not exist: it is made by "
                f"bootseer run (ckpt.memory); create it (mode 0700) or unset {DIR_ENV}"
            ) from None
        except OSError as exc:
            raise CheckpointError(f"memory tier: {exc}") from None
        self.config = config
        self.sync = config.replication == "sync"
        self.sync_wait_s = 0.0  # the training thread's waits for the peer's ack (sync)
        self._sync_alone_said = False
        self.rank, self.world_size = rank, world_size
        self.process_group = process_group
        self.skip_rules = rules_from_env()  # copies saved after a NaN (ckpt/skip.py)
        self.trust_objects = trust_objects
        self.local_world_size = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        with where:
            try:  # a slot that is a link or another user's file: refused, never mapped
                self.slots = [
                    SlotFile(p, dir_fd=where.fd)
                    for p in slot_paths(config.directory, f"rank-{rank}")
                ]
            except OSError as exc:
                raise CheckpointError(f"memory tier: {exc}") from None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-memory-r{rank}")
        # pushes to the peer run on their own thread, so a push overlaps the next step's
        # copy; a slot is overwritten only once its own push is done
        self._pusher = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-memory-push-r{rank}")
        self._pushing: dict[int, Future[None]] = {}
        self._push_lock = threading.Lock()
        self._queued: tuple[Future[None], dict[str, Any]] | None = None  # not yet started
        self._last_job: tuple[int, Future[None], dict[str, Any]] | None = None  # newest push
        # each push: step, committed/start/end (time.time()), ok, error; the
        # evidence of what the peer held when a node is lost (bench memckpt's cluster trial)
        self.push_log: deque[dict[str, Any]] = deque(maxlen=64)
        self._push_error: dict[str, Any] | None = None  # the newest push's failure, unraised
        self.push_wait_s = 0.0  # the training thread's waits for a push (it overwrites its slot)
        self._pending: Future[None] | None = None
        self._newest: SlotFile | None = None
        self._budget_checked = 0
        self.enabled = True
        self._peers: list[str] | None = None  # every rank's node server, by rank
        self._peer: str | None = None  # the server keeping this rank's copy, once chosen
        self._client: PeerClient | None = None
        self._stream = None
        self.last_push: dict[str, Any] = {}
        # copies that failed while being loaded, on any rank: the state may be partly
        # overwritten by them, so "no checkpoint anywhere" must not become a fresh start
        self.damaged: list[str] = []

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, acked: bool | None = None) -> float:
        """Copy ``state`` into the free buffer; returns the seconds the caller waited.

        The checksums and the commit run on a background thread, the push to the peer on
        another; a save waits for the previous one's commit, and for the push of the slot it
        overwrites, before it starts. ``acked`` (default: ``replication == "sync"``): return
        only once the peer acked this step (:meth:`wait_acked`)."""
        started = time.perf_counter()
        self._settle()
        if self._peers is None:
            self._peers = self._exchange_servers()
        if not self.enabled:
            return 0.0
        leaves, objects = _split(state)
        placed, size = _place(leaves)
        if size > self._budget_checked and not self._check_budget(size):
            return 0.0
        slot = self.slots[1] if self._newest is self.slots[0] else self.slots[0]
        pushing = self._pushing.pop(id(slot), None)
        if pushing is not None:  # its push reads this slot's bytes: they must not change
            waited = time.perf_counter()  # under it (a push slower than a step: back-pressure)
            pushing.result()
            self.push_wait_s += time.perf_counter() - waited
        slot.ensure(HEADER + size + 4096)
        slot.invalidate()
        data = (
            torch.frombuffer(slot.map, dtype=torch.uint8, count=size, offset=HEADER)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        self._copy_in(placed, data)
        del data
        blob = b""
        if objects:
            out = io.BytesIO()
            torch.save(objects, out)
            blob = out.getvalue()
        entries = [_entry(p) for p in placed]
        stall = time.perf_counter() - started
        self._pending = self._executor.submit(self._commit, slot, step, size, entries, blob)
        if self.sync if acked is None else acked:
            stall += self.wait_acked(step)
        return stall

    def wait_acked(self, step: int, timeout_s: float | None = None) -> float:
        """Wait until the peer acked ``step`` (its commit, then its push), at most
        ``timeout_s`` (default ``config.push_wait_s``); returns the seconds waited. A push
        that failed or did not finish raises :class:`MemoryPushError` naming the peer and the
        step (replication ``"sync"``: the step the trainer moves past is on the peer)."""
        started = time.perf_counter()
        self._settle()
        job = self._last_job
        if not self.enabled or job is None or job[0] != step:
            if self.enabled and not self._sync_alone_said:
                self._sync_alone_said = True
                log.warning(
                    "memory tier: rank %d saves with replication sync but has no peer "
                    "(no ckpt.memory_listen on the nodes, MemoryConfig.server or "
                    ".peer): its copies are in this node's memory only",
                    self.rank,
                )
            return time.perf_counter() - started
        _, future, entry = job
        bound = self.config.push_wait_s if timeout_s is None else timeout_s
        _done, late = futures_wait([future], timeout=bound)
        waited = time.perf_counter() - started
        self.sync_wait_s += waited
        if late:
            raise self._late(step, entry["peer"], bound)
        if not entry.get("ok"):
            if self._push_error is not None and self._push_error["step"] == step:
                self._push_error = None  # raised here, not again by wait()
            error = entry.get("error") or repr(future.exception())
            raise self._failed(step, entry["peer"], error)
        return waited

    def _late(self, step: Any, peer: Any, bound: float) -> MemoryPushError:
        return MemoryPushError(
            f"memory tier: rank {self.rank}'s copy of step {step} to its peer {peer} has not "
            f"finished after {bound:g} s: the peer or the link is slow or hung. This node's "
            "memory holds the step; a lost node would fall back to an older copy. Check that "
            "peer's agent (bootseer run --ckpt-memory-listen) and the link, or raise "
            "MemoryConfig.push_wait_s"
        )

    def _failed(self, step: Any, peer: Any, error: str) -> MemoryPushError:
        return MemoryPushError(
            f"memory tier: rank {self.rank} could not copy step {step} to its peer {peer}: "
            f"{error}. This node's memory holds the step; a lost node would fall back to an "
            "older copy. Check that the peer's agent runs (bootseer run "
            f"--ckpt-memory-listen) with the job's token ({TOKEN_ENV})"
        )

    def _copy_in(self, placed: list[_Piece], data: torch.Tensor) -> None:
        """One copy of every tensor; CUDA tensors device-to-host on the tier's own stream
        into the (registered, so pinned) shared memory, waited for before returning."""
        on_gpu = [p for p in placed if p.target.is_cuda]
        for p in placed:
            if p.nbytes and not p.target.is_cuda:
                dst = data[p.at : p.at + p.nbytes].view(p.target.dtype).view(p.target.shape)
                dst.copy_(p.target)
        if on_gpu and torch.cuda.is_available():  # pragma: no cover - measured on a GPU
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            _pin(data)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for p in on_gpu:
                    dst = data[p.at : p.at + p.nbytes].view(p.target.dtype)
                    dst.view(p.target.shape).copy_(p.target, non_blocking=True)
            self._stream.synchronize()

    def _commit(
        self, slot: SlotFile, step: int, size: int, entries: list[dict[str, Any]], blob: bytes
    ) -> None:
        sums = block_sums(slot.view(HEADER, size)) if size else []
        meta = pack_meta({"entries": entries, "sums": sums}, blob)
        slot.ensure(HEADER + size + len(meta))
        slot.view(HEADER + size, len(meta))[:] = meta
        head = SlotHeader(
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            data_size=size,
            meta_size=len(meta),
            meta_crc32=zlib.crc32(meta),
            created=time.time(),
        )
        slot.commit(head)
        self._newest = slot
        peer = self._neighbour()
        if peer:
            self._queue_push(peer, slot, head)

    def _queue_push(self, peer: str, slot: SlotFile, head: SlotHeader) -> None:
        """One push runs at a time (one thread) and at most one waits behind it: the save of
        step n+1 waits for the push of step n-1 (it overwrites that slot), so a newer copy
        never finds an older one still waiting to start (docs/ckpt.md)."""
        entry: dict[str, Any] = {"step": head.step, "peer": peer, "committed": time.time()}
        with self._push_lock:
            future = self._pusher.submit(self._push, peer, slot, head, entry)
            self._queued = (future, entry)
            self._last_job = (head.step, future, entry)
            self._pushing[id(slot)] = future
            self.push_log.append(entry)

    def push_state(self) -> dict[str, Any]:
        """What the peer holds and what is on the way: ``acked`` (the newest step the peer
        committed), ``in_flight`` and ``queued`` (their log entries, or ``None``)."""
        with self._push_lock:
            entries = list(self.push_log)
            queued = self._queued[1] if self._queued is not None else None
        acked = [e["step"] for e in entries if e.get("ok")]
        running = [e for e in entries if "start" in e and "end" not in e]
        return {
            "acked": max(acked) if acked else None,
            "in_flight": running[-1] if running else None,
            "queued": queued,
        }

    def _push(
        self, peer: str, slot: SlotFile, head: SlotHeader, entry: dict[str, Any] | None = None
    ) -> None:
        entry = {} if entry is None else entry
        with self._push_lock:
            if self._queued is not None and self._queued[1] is entry:
                self._queued = None
        entry["start"] = time.time()
        started = time.perf_counter()
        try:
            if self._client is None or self._client.address != peer:
                self._client = self._connect(peer)
            self._client.push(slot, head)
            entry.update(end=time.time(), ok=True)
            self._push_error = None
            self.last_push = {
                "step": head.step,
                "peer": peer,
                "ok": True,
                "seconds": time.perf_counter() - started,
            }
        except (PeerError, OSError) as exc:
            entry.update(end=time.time(), ok=False, error=str(exc))
            self._push_error = {"step": head.step, "peer": peer, "error": str(exc)}
            if self.last_push.get("ok", True):
                log.warning(
                    "memory tier: rank %d could not copy step %d to its peer %s (%s); "
                    "its own memory holds it, training goes on, the next step tries "
                    "again",
                    self.rank,
                    head.step,
                    peer,
                    exc,
                )
            self.last_push = {"step": head.step, "peer": peer, "ok": False, "error": str(exc)}
            if self._client is not None:
                self._client.close()
                self._client = None

    def _connect(self, address: str) -> PeerClient:
        return PeerClient(address, timeout_s=self.config.peer_timeout_s, token=self.config.token)

    def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until the last save is committed and its push to the peer is done, at most
        ``timeout_s`` (default ``config.push_wait_s``) for the push; a push that failed or
        did not finish is raised here (:class:`MemoryPushError`, naming the peer): saves
        only warn, so that training goes on while a peer is away."""
        self._settle()
        bound = self.config.push_wait_s if timeout_s is None else timeout_s
        with self._push_lock:
            futures = [f for f in self._pushing.values() if not f.cancelled()]
        _done, late = futures_wait(futures, timeout=bound)
        if late:
            running = self.push_state()["in_flight"] or {}
            raise self._late(running.get("step", "?"), running.get("peer", self._peer), bound)
        failed, self._push_error = self._push_error, None
        if failed is not None:
            raise self._failed(failed["step"], failed["peer"], failed["error"])

    def close(self) -> None:
        try:
            self.wait()
        except MemoryPushError as exc:  # logged when it happened; closing must not lose the
            log.warning("%s", exc)  # node's copies over a peer that is away
        finally:
            self._executor.shutdown(wait=True)
            self._pusher.shutdown(wait=True)
            if self._client is not None:
                self._client.close()
            for slot in self.slots:  # the files stay: the agent owns them
                slot.close()

    def _check_budget(self, size: int) -> bool:
        """The node holds 2 copies of each of its ranks' state plus 2 of each peer rank's
        (assumed the same size): say so and turn the tier off when that does not fit."""
        st = os.statvfs(self.config.directory)
        free = st.f_bavail * st.f_frsize + sum(s.size for s in self.slots)
        need_rank = 4 * (HEADER + size)
        need_node = need_rank * self.local_world_size
        if need_node > st.f_bavail * st.f_frsize + self.local_world_size * sum(
            s.size for s in self.slots
        ):
            log.error(
                "memory tier: off. rank %d's state is %.1f MiB; the node needs %.1f MiB "
                "(%d ranks x 2 copies of their own + 2 of a peer's, assuming every rank "
                "of the node holds as much as this one: equal shards; LOCAL_WORLD_SIZE "
                "or MemoryTier(local_world_size=) sets the count) in %s, which has "
                "%.1f MiB free: enlarge it (e.g. the pod's /dev/shm), or save fewer "
                "ranks per node; the durable tier goes on",
                self.rank,
                size / 2**20,
                need_node / 2**20,
                self.local_world_size,
                self.config.directory,
                free / 2**20,
            )
            self.enabled = False
            return False
        if not self._budget_checked:
            log.info(
                "memory tier: rank %d state %.1f MiB; this rank holds %.1f MiB (2 copies "
                "+ 2 of a peer's) in %s",
                self.rank,
                size / 2**20,
                need_rank / 2**20,
                self.config.directory,
            )
        self._budget_checked = size
        return True

    # -- peers -----------------------------------------------------------------------------
    def _exchange_servers(self) -> list[str]:
        """Every rank's node server, gathered once (in rank order)."""
        group = agree.resolve_group(self.process_group, self.rank, self.world_size)
        mine = self.config.server
        if group is None:
            return [mine] if mine else []
        import torch.distributed as dist

        got: list[Any] = [None] * self.world_size
        dist.all_gather_object(got, mine, group=group)
        return [str(x) for x in got]

    def _nodes(self) -> list[str]:
        """The distinct servers, in the order of their lowest rank: the nodes."""
        return nodes_in_order(self._peers or [])

    def _neighbour(self) -> str:
        """The server that keeps this rank's copy: a node outside the rank's parallel groups
        (``config.layout``), else the next node (``memory_place.choose_peer``)."""
        if self.config.peer:
            return self.config.peer
        if self._peer is None:
            self._peer = choose_peer(self.rank, self._peers or [], self.config.layout)
            if self._peer:
                log.info("memory tier: rank %d copies to %s", self.rank, self._peer)
        return self._peer

    # -- loading ---------------------------------------------------------------------------
    def load(
        self, state: Any, durable_newer: Callable[[int], int | None] | None = None
    ) -> LoadReport | None:
        """Load the newest step every rank holds in memory into ``state``, all ranks the same;
        ``None`` when there is none, or when ``durable_newer(step)`` (the durable tier's newest
        commit after ``step``, asked once per rank) names a newer one on some rank: every rank
        then returns ``None``, and the caller loads the durable tier."""
        started = time.perf_counter()
        self._settle()
        group = agree.resolve_group(self.process_group, self.rank, self.world_size)
        exchange = agree.group_exchange(group) if group is not None else agree.alone
        spent: dict[str, float] = {}  # seconds by part of the call, for the report
        mark = time.perf_counter()
        if self._peers is None:
            self._peers = self._exchange_servers()
        spent["servers_s"] = time.perf_counter() - mark
        failed: set[tuple[int, str]] = set()
        use_peers = False
        checked_durable: set[int] = set()
        for _ in range(16):
            mark = time.perf_counter()
            mine = self._available(failed, use_peers)
            views = _gather(group, self.world_size, sorted(mine))
            spent["list_s"] = spent.get("list_s", 0.0) + time.perf_counter() - mark
            common = set.intersection(*(set(steps) for steps in views))
            if not common:
                if not use_peers and (self._nodes() or self.config.peer):
                    use_peers = True
                    continue
                log.info("memory tier: no step in memory on every rank; the durable tier loads")
                return None
            step = max(common)
            if durable_newer is not None and step not in checked_durable:
                checked_durable.add(step)
                mark = time.perf_counter()
                newer = [
                    d for d in _gather(group, self.world_size, durable_newer(step)) if d is not None
                ]
                spent["durable_s"] = spent.get("durable_s", 0.0) + time.perf_counter() - mark
                if newer:
                    log.info(
                        "memory tier: the durable tier's step %d is newer than step %d in "
                        "memory; the durable tier loads",
                        max(newer),
                        step,
                    )
                    return None
            source = mine[step]
            try:
                report = self._load_from(step, source, state)
                outcome = Outcome(self.rank, step, OK)
            except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange
                written = PARTLY_WRITTEN if getattr(exc, "partial", False) else ""
                report, outcome = (
                    None,
                    Outcome(
                        self.rank, step, DAMAGED, f"{written}{type(exc).__name__}: {exc}", source
                    ),
                )
                if source == "local" and isinstance(exc, SlotDamaged):
                    self._drop_local(step)  # a restart must not meet it again
            outcomes = exchange(outcome)
            if outcomes is None:
                assert report is not None
                self.resume_from(step)
                report.phases.update(spent)  # type: ignore[attr-defined]
                report.phases["load_call_s"] = time.perf_counter() - started  # type: ignore
                return report
            for o in outcomes:
                if o.status != OK and o.message.startswith(PARTLY_WRITTEN):
                    self.damaged.append(
                        f"rank {o.rank} step {o.step} ({o.path or 'memory'}): {o.message}"
                    )
                if o.status != OK:
                    log.warning(
                        "memory tier: step %d from %s cannot be loaded by rank %d: %s; "
                        "every rank tries again without it",
                        o.step,
                        o.path or "memory",
                        o.rank,
                        o.message,
                    )
            if outcome.status != OK:
                failed.add((step, source))
            use_peers = bool(self._nodes() or self.config.peer)  # the same step, elsewhere
        return None

    def _drop_local(self, step: int) -> None:
        """Clear the commit flag of this rank's local copy of ``step`` (it failed a check)."""
        for head, slot in newest(self.slots):
            if head.step == step:
                slot.invalidate()
                if self._newest is slot:
                    self._newest = None

    def resume_from(self, step: int | None) -> None:
        """The job goes on from ``step`` (loaded from either tier): copies of newer steps
        belong to the abandoned run and are dropped, so that no rank ever pairs one of them
        with another rank's copy of the new run; the next save keeps ``step``'s copy."""
        self._settle()
        self._newest = None
        for slot in self.slots:
            try:
                head = slot.header()
            except SlotDamaged:
                head = None
            if head is not None and step is not None and head.step == step:
                self._newest = slot
            elif head is not None and (step is None or head.step > step):
                slot.invalidate()

    def _available(self, failed: set[tuple[int, str]], use_peers: bool) -> dict[int, str]:
        """``{step: where}`` of the copies this rank could load; "local" is preferred. With
        ``use_peers`` every node's server is asked, this node's own included: when a spare
        takes an evicted node's place, torch numbers the nodes afresh and a rank can land on
        the node that held its copy for the peer (the soak: 4-6 steps recomputed while its
        own server was skipped)."""
        found: dict[int, str] = {}
        if use_peers:
            for addr in self._nodes() + ([self.config.peer] if self.config.peer else []):
                try:
                    with self._connect(addr) as client:
                        steps = client.listing(self.rank, self.world_size)
                except (PeerError, OSError) as exc:
                    log.info("memory tier: peer %s does not answer (%s)", addr, exc)
                    continue
                for s in steps:  # a peer's listing has no times: a rule counts it as old
                    if (s, f"peer:{addr}") not in failed and not poisoned(self.skip_rules, s, None):
                        found.setdefault(s, f"peer:{addr}")
        for head, _slot in newest(self.slots):
            if (
                (head.rank, head.world_size) == (self.rank, self.world_size)
                and (head.step, "local") not in failed
                and not poisoned(self.skip_rules, head.step, head.created)
            ):
                found[head.step] = "local"
        return found

    def _fetch_slot(self) -> SlotFile:
        """Where a copy fetched from a peer goes: an empty or dropped slot, else the one with
        the older copy, so a local copy that may still be needed is overwritten last."""
        held = {id(slot): head.step for head, slot in newest(self.slots)}
        empty = [slot for slot in self.slots if id(slot) not in held]
        return empty[0] if empty else min(self.slots, key=lambda slot: held[id(slot)])

    def _load_from(self, step: int, source: str, state: Any) -> LoadReport:
        started = time.perf_counter()
        fetch_s = 0.0
        if source.startswith("peer:"):
            slot = self._fetch_slot()
            _, size = _place(_split(state)[0])  # what this rank's copy must hold, before
            with self._connect(source[5:]) as client:  # its slot grows for a peer's header
                client.fetch(self.rank, step, slot, data_size=size, world_size=self.world_size)
            self._newest = slot
            fetch_s = time.perf_counter() - started
        for head, slot in newest(self.slots):
            if head.step == step:
                copied = time.perf_counter()
                report = load_slot(
                    slot, head, state, trust_objects=self.trust_objects, use_stamp=source == "local"
                )
                report.seconds = time.perf_counter() - started
                report.source = source  # type: ignore[attr-defined]
                report.phases = {
                    "fetch_s": fetch_s,  # type: ignore[attr-defined]
                    "copy_s": time.perf_counter() - copied,
                }
                return report
        raise SlotDamaged(f"rank {self.rank}: step {step} is no longer in {self.config.directory}")


PARTLY_WRITTEN = "state partly overwritten: "  # an outcome's message: the copy had begun


def _split(state: Any) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    leaves, objects = [], {}
    for key, value, _c, _s in walk(state):
        if is_tensor_leaf(value):
            leaves.append((key, describe(key, value).local))
        else:
            objects[key] = value.value if isinstance(value, PerRank) else value
    return leaves, objects


def _place(leaves: list[tuple[str, torch.Tensor]]) -> tuple[list[_Piece], int]:
    """Where each tensor's bytes go in a copy, and the data's size: a copy of this state
    has exactly that many data bytes."""
    placed, size = [], 0
    for key, tensor in leaves:
        placed.append(_Piece(key, tensor, size, tensor.numel() * tensor.element_size()))
        size = align(size + placed[-1].nbytes)
    return placed, pad8(size)


def _entry(p: _Piece) -> dict[str, Any]:
    return {
        "key": p.key,
        "dtype": dtype_name(p.target.dtype),
        "shape": list(p.target.shape),
        "at": p.at,
        "nbytes": p.nbytes,
    }


def _gather(group: Any, world_size: int, mine: Any) -> list[Any]:
    if group is None:
        return [mine]
    import torch.distributed as dist

    got: list[Any] = [None] * world_size
    dist.all_gather_object(got, mine, group=group)
    return got


def load_slot(
    slot: SlotFile,
    head: SlotHeader,
    state: Any,
    *,
    trust_objects: bool = False,
    use_stamp: bool = False,
) -> LoadReport:
    """Copy a committed slot into ``state`` in place, checking each data block's sum as it
    goes (the block is then in cache for the copy). With ``use_stamp`` (a copy in this node's
    own memory), a copy the node agent stamped good is copied without hashing and one it
    stamped damaged is refused unread (``memory_verify``). The state must hold the same keys,
    dtypes and local shapes as the copy (the same rank of the same layout); otherwise it is
    refused and nothing is written. A block that fails its sum raises :class:`SlotDamaged`:
    the state is then partly overwritten, and the caller loads another copy."""
    meta, blob = slot.meta(head)
    entries = {e["key"]: e for e in meta["entries"]}
    leaves, _ = _split(state)
    problems = []
    pieces = []
    for key, tensor in leaves:
        e = entries.pop(key, None)
        if e is None:
            problems.append(f"{key}: not in the memory copy")
        elif dtype_of(e["dtype"]) != tensor.dtype or list(tensor.shape) != e["shape"]:
            problems.append(
                f"{key}: copy {e['dtype']} {e['shape']}, state {tensor.dtype} {list(tensor.shape)}"
            )
        elif e["at"] + e["nbytes"] > head.data_size:
            problems.append(f"{key}: bytes {e['at']}+{e['nbytes']} beyond the data")
        else:
            pieces.append(_Piece(key, tensor, e["at"], e["nbytes"]))
    problems += [f"{k}: in the memory copy, not in the state" for k in entries]
    if problems:
        raise CheckpointError(
            f"memory copy {slot.path} (step {head.step}) does not match the "
            f"state: " + "; ".join(problems[:5])
        )
    src = (
        np.frombuffer(slot.map, dtype=np.uint8, count=head.data_size, offset=HEADER)
        if head.data_size
        else np.empty(0, dtype=np.uint8)
    )
    stamp = stamp_for(slot, head) if use_stamp else None
    if stamp is not None and not stamp.get("ok"):
        raise SlotDamaged(
            f"{slot.path}: step {head.step}: found damaged by the node agent's "
            f"check: {stamp.get('message')}"
        )
    if stamp is not None:
        _copy_plain(src, pieces)
    else:
        _copy_checked(src, pieces, meta["sums"], slot.path, head.step)
    report = LoadReport(step=head.step, bytes_read=head.data_size)
    report.verified = "agent" if stamp is not None else "hashed"  # type: ignore[attr-defined]
    report.loaded = [p.key for p in pieces]
    values = torch.load(io.BytesIO(blob), weights_only=not trust_objects) if blob else {}
    for key, value, container, where in walk(state):
        if is_tensor_leaf(value) or key not in values:
            continue
        if isinstance(value, PerRank):
            value.value = values[key]
        else:
            container[where] = values[key]
        report.loaded.append(key)
    return report


def _copy_checked(
    src: np.ndarray, pieces: list[_Piece], sums: list[int], path: str, step: int
) -> None:
    """Block by block: check the block's hash, then copy the parts of tensors it holds (the
    block is then in cache: the check costs little over the copy)."""
    flat = {id(p): _bytes_of(p.target) for p in pieces}
    later = [p for p in pieces if flat[id(p)] is None]
    order = sorted((p for p in pieces if flat[id(p)] is not None), key=lambda p: p.at)
    i = 0
    for b, want in enumerate(sums):
        lo, hi = b * BLOCK, min((b + 1) * BLOCK, len(src))
        if block_hash(src[lo:hi]) != want:
            damaged = SlotDamaged(
                f"{path}: step {step}: data block {b} (bytes {lo}..{hi}) fails its checksum"
            )
            damaged.partial = b > 0  # type: ignore[attr-defined] # blocks before it were copied
            raise damaged
        while i < len(order) and order[i].at < hi:
            p = order[i]
            a, e = max(lo, p.at), min(hi, p.at + p.nbytes)
            if a < e:
                flat[id(p)][a - p.at : e - p.at] = src[a:e]
            if p.at + p.nbytes <= hi:
                i += 1
            else:
                break
    whole = torch.from_numpy(src) if len(src) else None
    for p in later:  # not a plain CPU view (a GPU tensor, a strided one): after the checks
        if p.nbytes:
            assert whole is not None
            p.target.copy_(whole[p.at : p.at + p.nbytes].view(p.target.dtype).view(p.target.shape))


def _copy_plain(src: np.ndarray, pieces: list[_Piece]) -> None:
    """One copy per tensor, no hashing: the node agent has checked this copy's blocks."""
    whole = torch.from_numpy(src) if len(src) else None
    for p in pieces:
        if not p.nbytes:
            continue
        flat = _bytes_of(p.target)
        if flat is not None:
            flat[:] = src[p.at : p.at + p.nbytes]
        else:
            assert whole is not None
            p.target.copy_(whole[p.at : p.at + p.nbytes].view(p.target.dtype).view(p.target.shape))


def _bytes_of(t: torch.Tensor) -> np.ndarray | None:
    if t.is_cuda or not t.is_contiguous():
        return None
    try:
        return t.view(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None


def _pin(data: torch.Tensor) -> None:  # pragma: no cover - needs CUDA
    """Register the shared-memory mapping with CUDA once, so D2H copies into it are
    pinned-speed (cudaHostRegister); idempotent per address."""
    ptr, size = data.data_ptr(), data.numel()
    if (ptr, size) in _PINNED or not size:
        return
    torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    _PINNED.add((ptr, size))


_PINNED: set[tuple[int, int]] = set()
