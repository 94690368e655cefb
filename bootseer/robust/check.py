"""Stop-time checks (``bootseer check``): a collective self-test and a bitwise alignment test
between the processes of a job, naming the ranks that disagree.

Why both: after an unclear crash or a NaN the suspect is the hardware, and the two faults
that matter look different. A broken link or NIC corrupts or stalls collectives (the
self-test: all_reduce sums checked exactly, bandwidth measured); a GPU or CPU that computes
wrong bits passes every collective yet trains garbage (the alignment test: every rank runs one
step of the same small model, same weights and input, deterministic and single-threaded, and
hashes outputs and gradients; the ranks outside the majority are named). ByteRobust runs the
same pair before it evicts machines.

Usage::

    from bootseer.robust.check import run_local

    report = run_local(3)              # 3 gloo processes on this machine
    report.ok, report.suspects         # False, (1,)
    print(report.text())

Inside a torchrun job (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set) every rank calls
:func:`run_rank` with ``init="env://"``; each gets the same :class:`CheckReport`.
Fault injection for tests: ``BOOTSEER_CHECK_FAULT`` = ``alignment:R`` (rank R's weights one
ulp off), ``sum:R`` (rank R's reduced sum off by one), comma-separated; ``R`` = ``*`` is every
rank that sees the variable (one node's environment: that node computes wrong bits).

Ordered by the controller (:mod:`.controller`, after a NaN or an unclear crash), every node's
agent runs ``bootseer check --store HOST:PORT --job J --incident K --node N``
(:func:`run_for_incident`): the ranks are the order's nodes, the process group meets in the
job's own store, and each node writes its :class:`RankResult` under its own key, from which
the controller builds the :class:`CheckReport`.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from .events import Event, Verdict

__all__ = [
    "CHECK_FAULT",
    "CheckReport",
    "RankResult",
    "link_suspects",
    "parse_faults",
    "reference_step",
    "ring_edges",
    "run_for_incident",
    "run_local",
    "run_rank",
]

#: Test hook: faults to inject (see the module docstring).
CHECK_FAULT = "BOOTSEER_CHECK_FAULT"
SUM_NUMEL = 1 << 16  # elements of the exact-sum test (int64)
LINK_BYTES = 2 << 20  # the neighbour-link test's all_reduce
LINK_RUNS = 3
LINK_FACTOR = 4.0  # a link this many times slower than the fastest one is slow...
LINK_FLOOR_S = 0.025  # ...and slower than this (scheduling noise on a loaded host stays below)


ANY_RANK = -1  # ``*`` in a fault: every rank that reads it


def parse_faults(text: str | None) -> dict[str, set[int]]:
    """``"alignment:1,sum:2"`` -> ``{"alignment": {1}, "sum": {2}}``; ``*`` is
    :data:`ANY_RANK` (anything else refused)."""
    faults: dict[str, set[int]] = {"alignment": set(), "sum": set()}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        kind, _, rank = item.partition(":")
        if kind not in faults or not (rank.isdigit() or rank == "*"):
            raise ValueError(
                f"{CHECK_FAULT}={text!r}: each fault is alignment:RANK or "
                f"sum:RANK (RANK a number or *), comma-separated"
            )
        faults[kind].add(ANY_RANK if rank == "*" else int(rank))
    return faults


def _hit(faults: dict[str, set[int]], kind: str, rank: int) -> bool:
    return rank in faults[kind] or ANY_RANK in faults[kind]


@dataclass
class RankResult:
    """What one rank measured and computed."""

    rank: int
    node: str
    sum_errors: int  # elements of the all_reduce result that differ from the exact sum
    output_hash: str
    grad_hash: str
    seconds: float  # one all_reduce of the bandwidth buffer (median of the runs)
    nbytes: int
    # the neighbour links this rank measured: {"A-B": seconds} for ring neighbours A, B (an
    # all_reduce of LINK_BYTES between the two alone, median of LINK_RUNS)
    links: dict[str, float] = field(default_factory=dict)


def reference_step(perturb: bool = False, device: str = "cpu") -> tuple[str, str]:
    """One forward and backward step of a fixed small model on fixed input, deterministic
    and single-threaded; the sha256 of its output and of its gradients. ``perturb``: one
    weight one ulp off (the test's stand-in for a unit computing wrong bits). ``device``:
    where the step computes (``"cuda"``: the GPU is the unit under test; the inputs are made
    on the CPU, so every device starts from the same bits)."""
    import torch

    if device != "cpu":  # deterministic cuBLAS needs a fixed workspace (read at first use)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Only for the GPU: on one CPU thread these ops are deterministic already, and the
        # switch imports torch's compiler packages (torch 2.13: 1.6 s of CPU per rank).
        torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(20250917)
    shapes = [(64, 32), (64,), (8, 64), (8,)]
    params = [torch.randn(s, generator=gen, dtype=torch.float32) for s in shapes]
    x = torch.randn(16, 32, generator=gen)
    target = torch.randn(16, 8, generator=gen)
    if perturb:
        flat = params[0].view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
    params = [p.to(device).requires_grad_(True) for p in params]
    x, target = x.to(device), target.to(device)
    w1, b1, w2, b2 = params
    out = torch.tanh(x @ w1.T + b1) @ w2.T + b2
    loss = torch.nn.functional.mse_loss(out, target)
    loss.backward()
    grads = hashlib.sha256()
    for p in params:
        grads.update(p.grad.cpu().numpy().tobytes())
    return hashlib.sha256(out.detach().cpu().numpy().tobytes()).hexdigest(), grads.hexdigest()


def _exact_sum_test(rank: int, world: int, corrupt: bool) -> int:
    import torch
    import torch.distributed as dist

    base = torch.arange(SUM_NUMEL, dtype=torch.int64)
    t = base * (rank + 1) + rank
    dist.all_reduce(t)
    expected = base * (world * (world + 1) // 2) + world * (world - 1) // 2
    if corrupt:
        t[SUM_NUMEL // 2] += 1
    return int((t != expected).sum())


def ring_edges(world: int) -> list[list[tuple[int, int]]]:
    """The ring's neighbour pairs in rounds of disjoint pairs (every rank in at most one pair
    per round, so a round's pairs run at once): 2 rounds, 3 when ``world`` is odd."""
    if world < 2:
        return []
    if world == 2:
        return [[(0, 1)]]
    edges = [(i, (i + 1) % world) for i in range(world)]
    rounds = [edges[0 : world - world % 2 : 2], edges[1 : world - world % 2 : 2]]
    if world % 2:
        rounds.append([edges[-1]])
    return [r for r in rounds if r]


def _neighbour_links(rank: int, world: int, nbytes: int = 0, runs: int = 0) -> dict[str, float]:
    """All_reduce between each pair of ring neighbours alone: the seconds of the pairs this
    rank is in. Why pairs: a job-wide collective runs at the pace of its slowest link, so it
    shows that one is slow, never which; a node whose links to both neighbours are slow
    while others are not is the one (:func:`link_suspects`)."""
    import torch
    import torch.distributed as dist

    nbytes, runs = nbytes or LINK_BYTES, runs or LINK_RUNS
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    mine: dict[str, float] = {}
    for pairs in ring_edges(world):
        groups = {pair: dist.new_group(list(pair)) for pair in pairs}  # every rank calls it
        for pair, group in groups.items():
            if rank not in pair:
                continue
            dist.all_reduce(buf, group=group)  # warm-up: the pair's connection
            times = []
            for _ in range(runs):
                dist.barrier(group=group)
                start = time.perf_counter()
                dist.all_reduce(buf, group=group)
                times.append(time.perf_counter() - start)
            mine[f"{pair[0]}-{pair[1]}"] = sorted(times)[len(times) // 2]
        dist.barrier()  # the next round's pairs start together
    return mine


def link_suspects(
    results: list[RankResult], *, factor: float = LINK_FACTOR, floor_s: float = LINK_FLOOR_S
) -> tuple[tuple[int, ...], dict[str, float]]:
    """The ranks whose every neighbour link is slow (over ``factor`` x the fastest link and
    over ``floor_s``) while some link is not, and every link's seconds (the slower of the two
    ends' readings). Two ranks have one link: a slow one cannot be pinned on either."""
    links: dict[str, float] = {}
    for r in results:
        for pair, seconds in (r.links or {}).items():
            links[pair] = max(seconds, links.get(pair, 0.0))
    if len(results) < 3 or not links:
        return (), links
    fastest = min(links.values())
    slow = {pair for pair, t in links.items() if t > max(factor * fastest, floor_s)}
    if not slow or len(slow) == len(links):
        return (), links
    suspects = []
    for r in results:
        own = [pair for pair in links if r.rank in map(int, pair.split("-"))]
        if own and all(pair in slow for pair in own):
            suspects.append(r.rank)
    return tuple(sorted(suspects)), links


def _bandwidth(nbytes: int, runs: int = 3) -> float:
    import torch
    import torch.distributed as dist

    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    dist.all_reduce(buf)  # warm-up: connections, allocation
    times = []
    for _ in range(runs):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@dataclass
class CheckReport:
    """Every rank's results and the verdict: which ranks failed which test."""

    results: list[RankResult]
    sum_suspects: tuple[int, ...] = ()
    alignment_suspects: tuple[int, ...] = ()
    alignment_majority: tuple[str, str] | None = None
    no_majority: bool = False
    link_suspects: tuple[int, ...] = ()
    links: dict[str, float] = field(default_factory=dict)  # "A-B" -> seconds
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_results(cls, results: list[RankResult]) -> CheckReport:
        results = sorted(results, key=lambda r: r.rank)
        votes = Counter((r.output_hash, r.grad_hash) for r in results)
        (top, n), *rest = votes.most_common()
        no_majority = bool(rest) and rest[0][1] == n
        slow, links = link_suspects(results)
        return cls(
            results,
            link_suspects=slow,
            links=links,
            sum_suspects=tuple(r.rank for r in results if r.sum_errors),
            alignment_suspects=()
            if no_majority
            else tuple(r.rank for r in results if (r.output_hash, r.grad_hash) != top),
            alignment_majority=None if no_majority else top,
            no_majority=no_majority,
        )

    @property
    def suspects(self) -> tuple[int, ...]:
        return tuple(
            sorted(set(self.sum_suspects) | set(self.alignment_suspects) | set(self.link_suspects))
        )

    @property
    def ok(self) -> bool:
        return not self.suspects and not self.no_majority

    def bandwidth(self) -> tuple[float, float, float]:
        """(seconds, algorithm bandwidth, bus bandwidth) in s and bytes/s: the slowest rank."""
        seconds = max(r.seconds for r in self.results)
        nbytes, n = self.results[0].nbytes, len(self.results)
        alg = nbytes / seconds if seconds > 0 else 0.0
        return seconds, alg, alg * 2 * (n - 1) / n

    def _named(self, ranks: tuple[int, ...]) -> str:
        by = {r.rank: r.node for r in self.results}
        return ", ".join(f"rank {r} (node {by[r]})" for r in ranks)

    def text(self) -> str:
        n = len(self.results)
        seconds, alg, bus = self.bandwidth()
        lines = [f"check: {n} ranks over gloo"]
        if self.sum_suspects:
            lines.append(
                f"collective: all_reduce of {SUM_NUMEL} int64 sums WRONG on "
                f"{self._named(self.sum_suspects)}"
            )
        else:
            lines.append(
                f"collective: all_reduce of {SUM_NUMEL} int64: sums exact on all {n} ranks"
            )
        mib = self.results[0].nbytes / 2**20
        lines.append(
            f"bandwidth: all_reduce of {mib:.1f} MiB in {seconds * 1e3:.2f} ms: "
            f"algbw {alg / 1e9:.3f} GB/s, busbw {bus / 1e9:.3f} GB/s"
        )
        if self.links:
            pairs = ", ".join(f"{pair} {t * 1e3:.1f} ms" for pair, t in sorted(self.links.items()))
            lines.append(
                f"neighbour links: all_reduce of {LINK_BYTES / 2**20:.0f} MiB per pair: "
                f"{pairs}"
                + (
                    f"; SLOW on every link of {self._named(self.link_suspects)}"
                    if self.link_suspects
                    else ""
                )
            )
        if self.no_majority:
            lines.append(
                "alignment: no majority among the reference step's hashes: "
                + "; ".join(f"rank {r.rank} {r.output_hash[:12]}" for r in self.results)
            )
        elif self.alignment_suspects:
            out, grad = self.alignment_majority or ("", "")
            verb = "differs" if len(self.alignment_suspects) == 1 else "differ"
            lines.append(
                f"alignment: {self._named(self.alignment_suspects)} {verb} from the "
                f"majority (output {out[:12]}, gradients {grad[:12]})"
            )
        else:
            out, grad = self.alignment_majority or ("", "")
            lines.append(
                f"alignment: all {n} ranks bit-identical (output {out[:12]}, gradients {grad[:12]})"
            )
        lines.append(
            "verdict: ok"
            if self.ok
            else f"verdict: FAILED: evict {self._named(self.suspects) or 'nobody (no majority)'}"
        )
        return "\n".join(lines)

    def records(self, now: float | None = None) -> list[Event | Verdict]:
        """An event per failed check and the verdict, for the trace."""
        now = time.time() if now is None else now
        by = {r.rank: r for r in self.results}
        events: list[Event | Verdict] = []
        for rank in self.sum_suspects:
            events.append(
                Event(
                    "health",
                    "collective_error",
                    node=by[rank].node,
                    rank=rank,
                    time=now,
                    evidence={"check": "all_reduce_sum", "wrong_elements": by[rank].sum_errors},
                )
            )
        for rank in self.alignment_suspects:
            events.append(
                Event(
                    "health",
                    "alignment_mismatch",
                    node=by[rank].node,
                    rank=rank,
                    time=now,
                    evidence={
                        "check": "bitwise_alignment",
                        "output": by[rank].output_hash,
                        "gradients": by[rank].grad_hash,
                        "majority": list(self.alignment_majority or ()),
                    },
                )
            )
        for rank in self.link_suspects:
            own = {p: t for p, t in self.links.items() if rank in map(int, p.split("-"))}
            events.append(
                Event(
                    "health",
                    "slow_link",
                    node=by[rank].node,
                    rank=rank,
                    time=now,
                    evidence={
                        "check": "link_bandwidth",
                        "links": own,
                        "fastest_s": min(self.links.values()),
                    },
                )
            )
        seconds, alg, bus = self.bandwidth()
        evidence = {
            "results": [asdict(r) for r in self.results],
            "bandwidth": {"seconds": seconds, "algbw_bytes_s": alg, "busbw_bytes_s": bus},
            "no_majority": self.no_majority,
        }
        nodes = tuple(sorted({by[r].node for r in self.suspects}))
        events.append(
            Verdict(
                "continue" if self.ok else "replace_and_restart",
                "check",
                nodes=nodes,
                ranks=self.suspects,
                time=now,
                reason="all checks passed"
                if self.ok
                else self.text().splitlines()[-1].removeprefix("verdict: "),
                evidence=evidence,
            )
        )
        return events


def run_rank(
    rank: int,
    world: int,
    *,
    init: str | None = "env://",
    nbytes: int = 16 << 20,
    node: str | None = None,
    fault: str | None = None,
    timeout_s: float = 120.0,
    store: Any = None,
) -> CheckReport:
    """This rank's part of both tests; every rank gets the whole report. ``store``: meet
    there (a c10d store) instead of ``init``."""
    import torch.distributed as dist

    faults = parse_faults(os.environ.get(CHECK_FAULT) if fault is None else fault)
    node = node or os.environ.get("BOOTSEER_NODE") or os.uname().nodename
    dist.init_process_group(
        "gloo",
        init_method=None if store is not None else init,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        errors = _exact_sum_test(rank, world, _hit(faults, "sum", rank))
        seconds = _bandwidth(nbytes)
        links = _neighbour_links(rank, world)
        out, grad = reference_step(perturb=_hit(faults, "alignment", rank))
        mine = RankResult(rank, node, errors, out, grad, seconds, nbytes, links)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, asdict(mine))
    finally:
        dist.destroy_process_group()
    return CheckReport.from_results([RankResult(**g) for g in gathered])


def run_for_incident(
    address: str,
    *,
    job: str,
    incident: int,
    node: str,
    nbytes: int = 16 << 20,
    timeout_s: float = 120.0,
) -> CheckReport:
    """This node's part of the checks the controller ordered for ``incident``: the order's
    nodes are the ranks, the process group meets in the job's store (under the incident's
    prefix, so a rerun never meets an old one), and this node's result goes to its key."""
    from torch.distributed import PrefixStore

    from . import wire
    from .remote import ControllerLink

    keys = wire.Keys(job)
    client = wire.connect_torch(address, timeout_s)
    data = wire.get(client, keys.check_request(incident))
    if data is None:
        raise ValueError(
            f"no check order for incident {incident} of job {job} in the store "
            f"at {address}: the controller writes it (bootseer controller)"
        )
    nodes = list(wire.decode(data, key=keys.check_request(incident)).get("nodes") or [])
    if node not in nodes:
        raise ValueError(
            f"node {node} is not in the check order of incident {incident} "
            f"({', '.join(nodes)}): --node must be this node's name"
        )
    group = PrefixStore(f"{keys.prefix}check/{incident}/pg/", client)
    report = run_rank(
        nodes.index(node), len(nodes), store=group, nbytes=nbytes, node=node, timeout_s=timeout_s
    )
    mine = report.results[nodes.index(node)]
    ControllerLink(client, node, job=job, address=address).answer_check(incident, asdict(mine))
    return report


def _spawned(rank: int, world: int, port: int, nbytes: int, fault: str | None, queue: Any) -> None:
    try:
        report = run_rank(rank, world, init=f"tcp://127.0.0.1:{port}", nbytes=nbytes, fault=fault)
        if rank == 0:
            queue.put(("ok", [asdict(r) for r in report.results]))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which says it
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def run_local(
    nproc: int, *, nbytes: int = 16 << 20, fault: str | None = None, timeout_s: float = 300.0
) -> CheckReport:
    """Both tests between ``nproc`` processes of this machine (spawned, gloo on loopback)."""
    import multiprocessing as mp
    import queue as queue_mod

    if nproc < 2:
        raise ValueError(f"--nproc {nproc}: a check between processes needs at least 2")
    parse_faults(os.environ.get(CHECK_FAULT) if fault is None else fault)  # refuse early
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        ctx.Process(
            target=_spawned,
            args=(r, nproc, port, nbytes, fault, results),
            name=f"bootseer-check-{r}",
            daemon=True,
        )
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    try:
        try:
            status, payload = results.get(timeout=timeout_s)
        except queue_mod.Empty:
            raise RuntimeError(f"the check did not finish in {timeout_s:.0f}s") from None
        if status != "ok":
            raise RuntimeError(f"the check failed: {payload}")
        return CheckReport.from_results([RankResult(**r) for r in payload])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
