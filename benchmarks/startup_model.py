"""A startup model to 4,096 nodes, calibrated on the node sweep (issue 29; docs/benchmarks.md,
"A startup model to 4,096 nodes").

``python benchmarks/startup_model.py --sweep DIR/e2e-sweep.json [--nodes 2..4096]
[--results DIR] [--cache-rate MB/s]`` (or ``bootseer bench model``: the sweep in ``--results``).
Writes ``startup-model.json``, ``startup-model.md`` and ``startup-model.png``.

The sweep (``bench_e2e_sweep.py``) measured, per method and node count N, the restart after a
lost node as a chain of job-level segments that add up to the job's time to its first step,
each rank's share of them, every node's bytes from each origin, the origins' serve rates and
the links. The model puts the time back together for any N:

    T(N) = F + Q_pre(N) + R(N) + max_M(I) + P(M) + max_M(W [+ Q_load(N)]) + S

* ``F``: the fresh node's path (loss to its torchrun start: replacement, pull, container,
  environment), O(1) per node: a lognormal whose median and spread are those measured; the
  job waits for the slowest of its fresh nodes (one in a restart, every node in a cold start).
* ``Q_pre``, ``Q_load``: the shared-bandwidth queue. An origin serving ``D`` bytes to many
  nodes at once at its aggregate rate ``S_o`` needs ``D / S_o``; a node alone needs its own
  ``b / L`` (its link), which the measured phases already hold. The queue adds
  ``max(0, D / S_o - b / L)`` per origin: the fresh nodes' bytes before the rendezvous, the
  survivors' checkpoint reads in the load. A cache tier of aggregate rate ``C`` (registry and
  S3, as the cluster's nginx tier) serves ``D`` at ``C`` and sends the origin only its misses
  (bytes every fresh node shares, the image and the environment, once; checkpoint shards,
  distinct per node, every time): ``max(D / C, misses / S_o)``.
* ``R(N)``, ``P(M)``: torchrun's c10d rendezvous (N agents) and gloo's ``init_process_group``
  (M = N x ranks per node), each fitted as ``a + b*N`` or ``a + b*log N`` on the sweep's
  counts (``--form``; auto: the lower residual, linear with two counts). Beyond the largest
  measured count the cluster form keeps the measured level and adds PyTorch's published
  per-client cost of the TCPStore with libuv (98,304 ranks initialized in about 100 s; the
  fixture's own slope is its 2 shared cores more than its store); ``--growth fit`` extrapolates
  the fit instead.
* ``I``, ``W``: each rank's ``import torch`` and its model build plus checkpoint load, O(1) per
  rank, in two populations: the fresh nodes' ranks and the survivors' (who read S3 in the
  load, and wait in the queue ``Q_load``). Each median is fitted against the ranks per core
  (``a + b*x``: on the sweep's machine every rank of every node shares its cores, so these
  stretch with N there; a real node has its own, ``x = 1``); the spread is a lognormal fitted
  to the ranks' durations around their run's median; the job waits for the slowest of its M
  ranks: the max of M draws, drawn exactly as ``F^-1(U^(1/M))``.
* ``S``: the first step itself (a collective), fitted against the ranks per core.

``p50`` and ``p99`` are over restarts (Monte Carlo, fixed seed, the same draws for every N).
Validation: calibrated on every count but the largest (2 and 4), the model on the sweep's own
machine predicts the largest (8); the check is ``|p50 - measured| <= 15%`` of the measured
max over the ranks, printed per method. The published curves (Bootseer's characterization,
MegaScale's initialization, PyTorch's TCPStore and gloo figures) are data here, each with its
source (``PUBLISHED``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import md_table  # noqa: E402

SUITE = "startup-model"
ORIGINS = ("registry", "s3", "index")
CACHED = ("registry", "s3")  # what the cache tier fronts (bootseer.testing.cluster_cache)
TOLERANCE = 0.15
TRIALS = 4000
SEED = 29
MIN_SIGMA = 0.05

# The published figures the model is drawn beside, as data, each with its source. Times are
# seconds; "gpus"/"ranks" as the source counts them.
PUBLISHED: dict[str, dict[str, Any]] = {
    "bootseer_characterization": {
        "what": "median job startup overhead against job scale, production LLM jobs before "
        "Bootseer",
        "source": "Li et al., BootSeer: Analyzing and Mitigating Initialization Bottlenecks in "
        "Large-Scale LLM Training, arXiv:2507.12619 (ByteDance, 2025), "
        "characterization of startup overhead against job scale",
        "note": "approximate: about 45 s at 1-10 GPUs, growing to about 500 s beyond 3,000 GPUs",
        "points": [
            {"gpus_from": 1, "gpus_to": 10, "seconds": 45.0},
            {"gpus_from": 3000, "gpus_to": None, "seconds": 500.0},
        ],
    },
    "megascale_initialization": {
        "what": "training-job initialization after MegaScale's optimizations (at most)",
        "source": "Jiang et al., MegaScale: Scaling Large Language Model Training to More Than "
        "10,000 GPUs, NSDI '24, section 3.5 (initialization)",
        "points": [
            {"gpus": 2048, "seconds_at_most": 5.0},
            {"gpus": 10000, "seconds_at_most": 30.0, "beyond": True},
        ],
    },
    "tcpstore_libuv": {
        "what": "TCPStore initialization with the libuv backend (PyTorch 2.4's default)",
        "source": "PyTorch tutorial 'Introduction to Libuv TCPStore Backend' "
        "(pytorch/tutorials, intermediate_source/TCPStore_libuv_backend.rst)",
        "points": [{"ranks": 98304, "seconds": 100.0}],
    },
    "gloo_init": {
        "what": "ProcessGroupGloo init with the store's batched gets (before: without)",
        "source": "pytorch/gloo pull request #408 (2025): '2k job ~18 s, 4k ~25 s, 8k ~85 s' "
        "(before: 2k ~82 s, 4k ~393 s)",
        "points": [
            {"ranks": 2048, "seconds": 18.0},
            {"ranks": 4096, "seconds": 25.0},
            {"ranks": 8192, "seconds": 85.0},
        ],
        "before": [{"ranks": 2048, "seconds": 82.0}, {"ranks": 4096, "seconds": 393.0}],
    },
}
ANCHOR = PUBLISHED["tcpstore_libuv"]["points"][0]
ANCHOR_S_PER_CLIENT = ANCHOR["seconds"] / ANCHOR["ranks"]


class ModelError(ValueError):
    """The sweep cannot be modelled; the message says what is missing and what to do."""


# -- pieces --------------------------------------------------------------------------------------
@dataclass
class Growth:
    """``a + b*x`` (lin) or ``a + b*ln x`` (log), least squares; ``residual``: RMS (s)."""

    a: float
    b: float
    form: str
    residual: float = 0.0

    def __call__(self, x: float) -> float:
        return max(0.0, self.a + self.b * (x if self.form == "lin" else math.log(x)))


def fit_growth(points: Sequence[tuple[float, float]], form: str = "auto") -> Growth:
    """The growth through ``(x, seconds)`` points; ``auto``: lin and log both fitted, the
    lower residual wins (with two points both are exact: lin)."""
    if len({x for x, _ in points}) < 2:
        if points and form != "auto":
            return Growth(points[0][1], 0.0, form)
        if points:
            return Growth(points[0][1], 0.0, "lin")
        raise ModelError("no points to fit a growth on")
    if form == "auto":
        fits = [fit_growth(points, f) for f in ("lin", "log")]
        if len(points) < 3:
            return fits[0]
        return min(fits, key=lambda g: g.residual)
    xs = [x if form == "lin" else math.log(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    rms = math.sqrt(statistics.fmean([(a + b * x - y) ** 2 for x, y in zip(xs, ys, strict=True)]))
    return Growth(a, b, form, rms)


@dataclass
class Lognormal:
    """A per-node (or per-rank) time: ``median * exp(sigma * Z)``."""

    median: float
    sigma: float

    def max_of(self, n: int, u: float) -> float:
        """The slowest of ``n`` draws, for the uniform ``u``: ``F^-1(u^(1/n))``."""
        if self.median <= 0:
            return 0.0
        u = min(max(u, 1e-12), 1 - 1e-12)
        tail = max(-math.expm1(math.log(u) / n), 1e-300)  # 1 - u^(1/n), without rounding to 0
        z = -statistics.NormalDist().inv_cdf(tail)
        return self.median * math.exp(self.sigma * z)


def log_spread(groups: Sequence[Sequence[float]], floor: float = MIN_SIGMA) -> float:
    """The lognormal sigma of values around their own group's median (a group: one run's
    ranks, or the runs' values of a per-node time), at least ``floor``."""
    logs = [math.log(v / statistics.median(g)) for g in groups if g for v in g if v > 0]
    return max(floor, statistics.stdev(logs)) if len(logs) >= 2 else floor


def queue_delay(
    demand: float,
    node_bytes: float,
    origin_rate: float,
    node_rate: float,
    cache_rate: float | None = None,
    misses: float | None = None,
) -> float:
    """Seconds a node waits beyond its own transfer when ``demand`` bytes in all share an
    origin (aggregate ``origin_rate``, B/s), or a cache tier of ``cache_rate`` in front of it
    that sends the origin ``misses`` bytes."""
    if demand <= 0:
        return 0.0
    served = (
        demand / origin_rate
        if cache_rate is None
        else max(demand / cache_rate, (demand if misses is None else misses) / origin_rate)
    )
    return max(0.0, served - node_bytes / node_rate)


_RATE = re.compile(r"^\s*([\d.]+)\s*([kmg]?)(bit|bps|b)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """tc's rates (``400mbit``: bits per second; ``50mbps``: bytes) to bytes per second."""
    m = _RATE.match(str(text))
    if not m:
        raise ModelError(f"rate {text!r}: write it as tc does, e.g. '400mbit'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    unit = (m.group(3) or "bit").lower()
    return float(m.group(1)) * scale / (8 if unit == "bit" else 1)


def parse_nodes(text: str) -> list[int]:
    """``2..4096`` (powers of two from 2 to 4096) or ``2,16,128``."""
    if ".." in text:
        lo, _, hi = text.partition("..")
        if not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi):
            raise ModelError(f"--nodes {text!r}: give A..B with 1 <= A <= B, e.g. 2..4096")
        out, n = [], int(lo)
        while n <= int(hi):
            out.append(n)
            n *= 2
        return out
    items = [s.strip() for s in text.split(",")]
    if not all(s.isdigit() and int(s) >= 1 for s in items):
        raise ModelError(f"--nodes {text!r}: give node counts like 2,16,128 or a range 2..4096")
    return sorted({int(s) for s in items})


# -- the sweep, read ---------------------------------------------------------------------------
@dataclass
class Measured:
    """One method at one node count, as the sweep measured it."""

    nodes: int
    segments: dict[str, float]
    imports: dict[str, list[float]]  # each rank's import torch, by its node's role
    loads: dict[str, list[float]]  # each rank's model build + checkpoint load, by role
    first_step_s: float
    max_s: float
    fresh_bytes: dict[str, float]
    survivor_bytes: dict[str, float]


def _need(entry: dict[str, Any], key: str, where: str) -> Any:
    if key not in entry or entry[key] is None:
        raise ModelError(
            f"{where}: no {key!r} in the sweep (a sweep from before the "
            "process-group milestones?): rerun `bench_e2e.py --sweep`"
        )
    return entry[key]


def measured(entry: dict[str, Any], nodes: int, where: str) -> Measured:
    seg, per_rank = _need(entry, "segments", where), _need(entry, "per_rank", where)
    for key in (
        "fresh_path_s",
        "rendezvous_s",
        "import_s",
        "process_group_init_s",
        "load_s",
        "first_step_s",
    ):
        _need(seg, key, where)
    roles = {
        node: "survivor" if v.get("role") == "survivor" else "fresh"
        for node, v in entry["per_node"].items()
    }

    def by_role(values: dict[str, float]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"fresh": [], "survivor": []}
        for key, v in values.items():
            node = key.rsplit("/", 1)[0]
            if node not in roles:
                raise ModelError(f"{where}: rank {key} of no node in per_node")
            out[roles[node]].append(float(v))
        return out

    imports = by_role(_need(per_rank, "import_s", where))
    loads = by_role(_need(per_rank, "load_s", where))
    fresh = [v for n, v in entry["per_node"].items() if roles[n] == "fresh"]
    surv = [v for n, v in entry["per_node"].items() if roles[n] == "survivor"]
    if not fresh or not imports["fresh"]:
        raise ModelError(f"{where}: no fresh (or restarted) node with ranks in per_node")

    def mean_bytes(nodes_: list[dict[str, Any]]) -> dict[str, float]:
        return {
            o: statistics.fmean([v["bytes"].get(o, 0) for v in nodes_]) if nodes_ else 0.0
            for o in ORIGINS
        }

    return Measured(
        nodes,
        {k: float(v) for k, v in seg.items() if isinstance(v, int | float)},
        imports,
        loads,
        float(seg["first_step_s"]),
        float(entry["ttfs"]["max_s"]),
        mean_bytes(fresh),
        mean_bytes(surv),
    )


@dataclass
class Sweep:
    """What the model takes from ``e2e-sweep.json``."""

    path: str
    quick: bool
    ranks_per_node: int
    cpus: int
    node_rate: float
    origin_rates: dict[str, float]
    runs: dict[str, dict[int, Measured]]  # method -> N -> measured
    warnings: list[str] = field(default_factory=list)

    @property
    def counts(self) -> list[int]:
        return sorted({n for by_n in self.runs.values() for n in by_n})


def read_sweep(path: str | Path) -> Sweep:
    try:
        R = json.loads(Path(path).read_text())  # noqa: N806 - as the sweep names it
    except FileNotFoundError:
        raise ModelError(
            f"{path}: no such sweep; run `python benchmarks/bench_e2e.py --sweep "
            "2,4,8 --results DIR` first (DIR/e2e-sweep.json)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a sweep's JSON ({exc})") from None
    if not isinstance(R, dict) or R.get("suite") != "e2e-sweep":
        raise ModelError(
            f"{path}: not an e2e-sweep.json (its suite is "
            f"{R.get('suite') if isinstance(R, dict) else type(R).__name__!r})"
        )
    warnings: list[str] = []
    try:
        node_rate = parse_rate(R["links"]["node"]["rate"])
        service_rate = parse_rate(R["links"]["services"]["rate"])
        rates = {}
        for origin in ORIGINS:
            seen = [
                r[origin]["rate_Bps"] for r in (R.get("serve_rates") or {}).values() if origin in r
            ]
            if seen:
                rates[origin] = max(seen)  # the most the origin served to any N at once
            else:
                rates[origin] = service_rate
                warnings.append(
                    f"no measured serve rate of {origin}: the services link's "
                    f"{R['links']['services']['rate']} taken instead"
                )
        runs: dict[str, dict[int, Measured]] = {}
        for n_text, by_n in R["runs"].items():
            for method, entry in by_n["methods"].items():
                n = int(n_text)
                runs.setdefault(method, {})[n] = measured(entry, n, f"{path}: {method} at N={n}")
        sweep = Sweep(
            str(path),
            bool(R.get("quick")),
            int(R["ranks_per_node"]),
            int(R["machine"]["cpus"]),
            node_rate,
            rates,
            runs,
            warnings,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ModelError(
            f"{path}: the sweep lacks {exc} (rerun the sweep with this tree)"
        ) from None
    if len(sweep.counts) < 2:
        raise ModelError(
            f"{path}: the sweep measured {sweep.counts or 'no'} node count(s); "
            "the model needs two or more (three to validate)"
        )
    return sweep


# -- the model -------------------------------------------------------------------------------------
@dataclass
class Setting:
    """Where the model is evaluated: the sweep's machine (every rank on its cores) or a
    cluster (each node its own cores)."""

    name: str
    ranks_per_node: int
    load: Callable[[int], float]  # nodes -> ranks per core seen by the per-rank phases
    node_rate: float
    origin_rates: dict[str, float]
    cache_rate: float | None = None
    growth: str = "fit"  # "fit": the fitted growth anywhere; "anchor": splice the TCPStore's


def fixture_setting(sweep: Sweep) -> Setting:
    r, cpus = sweep.ranks_per_node, sweep.cpus
    return Setting(
        "the sweep's machine",
        r,
        lambda n: max(1.0, n * r / cpus),
        sweep.node_rate,
        dict(sweep.origin_rates),
    )


@dataclass
class Traffic:
    """A method's bytes per node from each origin: the fresh node's (before the rendezvous)
    and a survivor's (its checkpoint read in the load)."""

    fresh: dict[str, float]
    survivor: dict[str, float]

    def shared(self, origin: str) -> float:
        """Bytes every fresh node reads alike (the image, the environment): all of the
        registry's, and from S3 what a fresh node reads beyond a survivor (its shard)."""
        if origin == "s3":
            return max(0.0, self.fresh["s3"] - self.survivor["s3"])
        return self.fresh[origin] if origin == "registry" else 0.0

    def queues(self, setting: Setting, nodes: int, scenario: str) -> tuple[float, float]:
        """The shared-bandwidth waits at ``nodes``: before the rendezvous (the fresh nodes'
        bytes) and in the load (the survivors' reads). A restart's tier already holds what
        the first start read through it (the shared bytes); a cold start's misses them once."""
        fresh = nodes if scenario == "cold" else 1
        pre = load = 0.0
        for o in ORIGINS:
            rate, b = setting.origin_rates[o], self.fresh[o]
            cache = setting.cache_rate if o in CACHED else None
            shared = self.shared(o)
            misses = fresh * (b - shared) + (shared if scenario == "cold" else 0.0)
            pre += queue_delay(fresh * b, b, rate, setting.node_rate, cache, misses)
            demand = (nodes - fresh) * self.survivor[o]
            load += queue_delay(demand, self.survivor[o], rate, setting.node_rate, cache, demand)
        return pre, load


@dataclass
class RankPhase:
    """A per-rank time in two populations, the fresh node's ranks and the survivors' (the
    fresh node's ranks read a cold disk, or their prefetched cache, where the survivors'
    read S3): each median fitted against the ranks per core, one spread."""

    fresh: Growth
    survivor: Growth
    sigma: float

    def slowest(
        self,
        x: float,
        fresh_ranks: int,
        survivor_ranks: int,
        u_fresh: float,
        u_survivor: float,
        survivor_extra: float = 0.0,
    ) -> float:
        """The slowest rank of both populations (``survivor_extra``: the survivors' queue)."""
        f = Lognormal(self.fresh(x), self.sigma).max_of(fresh_ranks, u_fresh)
        if not survivor_ranks:
            return f
        return max(
            f,
            Lognormal(self.survivor(x), self.sigma).max_of(survivor_ranks, u_survivor)
            + survivor_extra,
        )


def fit_rank_phase(
    runs: Sequence[tuple[float, dict[str, list[float]]]], min_sigma: float
) -> RankPhase:
    """From ``(ranks per core, {role: each rank's seconds})`` per run: the medians' growth per
    population (the fresh one's where no survivor ran) and the spread of the ranks around
    their run's and population's median (groups of two ranks or more)."""
    fresh = fit_growth([(x, statistics.median(v["fresh"])) for x, v in runs if v["fresh"]], "lin")
    pts = [(x, statistics.median(v["survivor"])) for x, v in runs if v["survivor"]]
    survivor = fit_growth(pts, "lin") if pts else fresh
    groups = [g for _, v in runs for g in (v["fresh"], v["survivor"]) if len(g) >= 2]
    return RankPhase(fresh, survivor, log_spread(groups, min_sigma))


@dataclass
class Fitted:
    """One method calibrated on some node counts."""

    method: str
    counts: list[int]
    fresh: Lognormal
    imports: RankPhase
    loads: RankPhase  # the survivors' without their queue
    first_step: Growth
    rendezvous: Growth  # against N (agents)
    process_group: Growth  # against M (ranks)
    last_nodes: int
    last_ranks: int
    traffic: Traffic

    def queues(self, setting: Setting, nodes: int, scenario: str) -> tuple[float, float]:
        return self.traffic.queues(setting, nodes, scenario)

    def store_term(self, g: Growth, clients: int, last: int, setting: Setting) -> float:
        if setting.growth == "fit" or clients <= last:
            return g(clients)
        return g(last) + ANCHOR_S_PER_CLIENT * (clients - last)

    def terms(self, setting: Setting, nodes: int, scenario: str) -> dict[str, float]:
        """The model's deterministic terms at ``nodes`` (the random ones at their median)."""
        ranks = nodes * setting.ranks_per_node
        x = setting.load(nodes)
        pre, load = self.queues(setting, nodes, scenario)
        return {
            "queue_pre_s": pre,
            "queue_load_s": load,
            "rendezvous_s": self.store_term(self.rendezvous, nodes, self.last_nodes, setting),
            "process_group_init_s": self.store_term(
                self.process_group, ranks, self.last_ranks, setting
            ),
            "import_median_s": self.imports.survivor(x),
            "import_fresh_median_s": self.imports.fresh(x),
            "load_median_s": self.loads.survivor(x),
            "load_fresh_median_s": self.loads.fresh(x),
            "first_step_s": self.first_step(x),
            "fresh_median_s": self.fresh.median,
        }

    def predict(
        self,
        setting: Setting,
        nodes: int,
        scenario: str = "restart",
        draws: Sequence[Sequence[float]] | None = None,
    ) -> dict[str, Any]:
        """p50 and p99 of the job's time to its first step at ``nodes`` over restarts."""
        t = self.terms(setting, nodes, scenario)
        rpn, x = setting.ranks_per_node, setting.load(nodes)
        fresh = nodes if scenario == "cold" else 1
        fresh_ranks, survivor_ranks = fresh * rpn, (nodes - fresh) * rpn
        fixed = t["queue_pre_s"] + t["rendezvous_s"] + t["process_group_init_s"] + t["first_step_s"]
        totals = sorted(
            self.fresh.max_of(fresh, uf)
            + fixed
            + self.imports.slowest(x, fresh_ranks, survivor_ranks, uif, uis)
            + self.loads.slowest(x, fresh_ranks, survivor_ranks, ulf, uls, t["queue_load_s"])
            for uf, uif, uis, ulf, uls in draws or uniforms()
        )
        return {
            "nodes": nodes,
            "ranks": nodes * rpn,
            "scenario": scenario,
            "p50_s": quantile(totals, 0.50),
            "p99_s": quantile(totals, 0.99),
            "terms": t,
        }


def uniforms(trials: int = TRIALS, seed: int = SEED) -> list[tuple[float, ...]]:
    """The same draws for every N and method (the fresh path; import and load, fresh and
    survivor ranks): smooth curves, differences that are the model's, not the dice's."""
    rng = random.Random(seed)
    return [tuple(rng.random() for _ in range(5)) for _ in range(trials)]


def quantile(sorted_values: Sequence[float], q: float) -> float:
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def calibrate(
    sweep: Sweep,
    method: str,
    counts: Sequence[int],
    form: str = "auto",
    min_sigma: float = MIN_SIGMA,
) -> Fitted:
    """``method`` fitted on the sweep's ``counts`` (queues taken out of what they hold)."""
    by_n = sweep.runs[method]
    missing = [n for n in counts if n not in by_n]
    if missing:
        raise ModelError(f"{method}: the sweep has no run at N={missing}")
    runs = [by_n[n] for n in counts]
    traffic = Traffic(
        {o: statistics.fmean([m.fresh_bytes[o] for m in runs]) for o in ORIGINS},
        {o: statistics.fmean([m.survivor_bytes[o] for m in runs]) for o in ORIGINS},
    )
    setting = fixture_setting(sweep)
    r = sweep.ranks_per_node
    fresh_vals, imports, loads, step_pts, rdzv_pts, pg_pts = [], [], [], [], [], []
    for m in runs:
        pre, queue = traffic.queues(setting, m.nodes, "restart")
        x = setting.load(m.nodes)
        fresh_vals.append(max(1e-3, m.segments["fresh_path_s"] - pre))
        imports.append((x, m.imports))
        loads.append(
            (
                x,
                {
                    "fresh": m.loads["fresh"],
                    "survivor": [max(1e-3, v - queue) for v in m.loads["survivor"]],
                },
            )
        )
        step_pts.append((x, m.segments["first_step_s"]))
        rdzv_pts.append((m.nodes, m.segments["rendezvous_s"]))
        pg_pts.append((m.nodes * r, m.segments["process_group_init_s"]))
    return Fitted(
        method,
        list(counts),
        Lognormal(
            math.exp(statistics.fmean([math.log(v) for v in fresh_vals])),
            log_spread([fresh_vals], min_sigma),
        ),
        fit_rank_phase(imports, min_sigma),
        fit_rank_phase(loads, min_sigma),
        fit_growth(step_pts, "lin"),
        fit_growth(rdzv_pts, form),
        fit_growth(pg_pts, form),
        max(counts),
        max(counts) * r,
        traffic,
    )


def validate(
    sweep: Sweep, form: str = "auto", tolerance: float = TOLERANCE, min_sigma: float = MIN_SIGMA
) -> dict[str, Any]:
    """Calibrated on every count but the largest, predict the largest on the sweep's machine:
    per method the p50 against the measured max over the ranks, within ``tolerance``."""
    counts = sweep.counts
    if len(counts) < 3:
        return {
            "ok": None,
            "why": f"the sweep has {len(counts)} node counts: validation "
            "needs three (calibrate on two, predict the third)",
            "methods": {},
        }
    calib, target = counts[:-1], counts[-1]
    setting, draws = fixture_setting(sweep), uniforms()
    out: dict[str, Any] = {
        "calibrated_on": calib,
        "predicted": target,
        "tolerance": tolerance,
        "methods": {},
    }
    for method, by_n in sorted(sweep.runs.items()):
        if target not in by_n or any(n not in by_n for n in calib):
            continue
        fitted = calibrate(sweep, method, calib, form, min_sigma)
        p = fitted.predict(setting, target, "restart", draws)
        meas = by_n[target].max_s
        err = (p["p50_s"] - meas) / meas
        out["methods"][method] = {
            "predicted_p50_s": p["p50_s"],
            "predicted_p99_s": p["p99_s"],
            "measured_max_s": meas,
            "error": err,
            "ok": abs(err) <= tolerance,
        }
    out["ok"] = bool(out["methods"]) and all(v["ok"] for v in out["methods"].values())
    return out


def check_lines(v: dict[str, Any]) -> list[str]:
    """The validation, one line per method (the script prints them)."""
    if v["ok"] is None:
        return [f"validation: not done: {v['why']}"]
    calib = " and ".join(map(str, v["calibrated_on"]))
    return [
        f"validation: {m}: calibrated on N = {calib}, predicted {r['predicted_p50_s']:.1f} s "
        f"(p50; p99 {r['predicted_p99_s']:.1f} s) at N = {v['predicted']}, measured "
        f"{r['measured_max_s']:.1f} s: {r['error']:+.1%} "
        f"({'within' if r['ok'] else 'OUTSIDE'} {v['tolerance']:.0%}: "
        f"{'pass' if r['ok'] else 'FAIL'})"
        for m, r in v["methods"].items()
    ]


# -- the run ---------------------------------------------------------------------------------------
def cluster_setting(sweep: Sweep, args: argparse.Namespace) -> Setting:
    g, cpus = args.gpus_per_node, args.cpus_per_node
    rates = dict(sweep.origin_rates)
    for item in args.origin_rate or []:
        origin, _, mbs = item.partition("=")
        if origin not in ORIGINS or not re.fullmatch(r"[\d.]+", mbs):
            raise ModelError(
                f"--origin-rate {item!r}: give ORIGIN=MB/s, ORIGIN one of {', '.join(ORIGINS)}"
            )
        rates[origin] = float(mbs) * 1e6
    return Setting(
        f"a cluster of nodes with {g} ranks each",
        g,
        (lambda n: 1.0) if not cpus else (lambda n: max(1.0, g / cpus)),
        args.node_rate * 1e6 if args.node_rate else sweep.node_rate,
        rates,
        None,
        args.growth,
    )


def model(sweep: Sweep, args: argparse.Namespace) -> dict[str, Any]:
    """Everything the script writes: the fit on every count, the validation, the predictions."""
    counts = sweep.counts
    methods = [m for m in sweep.runs if all(n in sweep.runs[m] for n in counts)]
    if not methods:
        raise ModelError(f"{sweep.path}: no method ran at every node count {counts}")
    draws = uniforms(args.trials)
    fixture = fixture_setting(sweep)
    base = cluster_setting(sweep, args)
    variants = {"no_cache": base}
    if args.cache_rate:
        variants["cache"] = Setting(
            base.name + ", a cache tier",
            base.ranks_per_node,
            base.load,
            base.node_rate,
            base.origin_rates,
            args.cache_rate * 1e6,
            base.growth,
        )
    fitted = {m: calibrate(sweep, m, counts, args.form, args.min_sigma) for m in methods}
    out: dict[str, Any] = {
        "suite": SUITE,
        "quick": sweep.quick,
        "sweep": sweep.path,
        "counts": counts,
        "sweep_ranks_per_node": sweep.ranks_per_node,
        "command": os.environ.get("BOOTSEER_BENCH_COMMAND")
        or shlex.join(["python", "benchmarks/startup_model.py", *args.argv]),
        "parameters": {
            "gpus_per_node": args.gpus_per_node,
            "cpus_per_node": args.cpus_per_node,
            "node_rate_Bps": base.node_rate,
            "origin_rates_Bps": base.origin_rates,
            "cache_rate_Bps": None if not args.cache_rate else args.cache_rate * 1e6,
            "growth": args.growth,
            "form": args.form,
            "trials": args.trials,
            "min_sigma": args.min_sigma,
            "anchor_s_per_client": ANCHOR_S_PER_CLIENT,
        },
        "fitted": {m: _fitted_dict(f) for m, f in fitted.items()},
        "validation": validate(sweep, args.form, TOLERANCE, args.min_sigma),
        "in_sample": {
            m: [
                {
                    "nodes": n,
                    "measured_max_s": sweep.runs[m][n].max_s,
                    **_short(f.predict(fixture, n, "restart", draws)),
                }
                for n in counts
            ]
            for m, f in fitted.items()
        },
        "predictions": {
            scenario: {
                variant: {
                    m: [_short(f.predict(s, n, scenario, draws)) for n in args.node_list]
                    for m, f in fitted.items()
                }
                for variant, s in variants.items()
            }
            for scenario in ("restart", "cold")
        },
        "published": PUBLISHED,
        "warnings": sweep.warnings,
    }
    return out


def _short(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodes": p["nodes"],
        "ranks": p["ranks"],
        "p50_s": p["p50_s"],
        "p99_s": p["p99_s"],
        "terms": p["terms"],
    }


def _fitted_dict(f: Fitted) -> dict[str, Any]:
    d = asdict(f)
    return {k: v for k, v in d.items() if k != "method"}


# -- the report ------------------------------------------------------------------------------------
def render(out: dict[str, Any]) -> list[str]:
    size = "quick" if out["quick"] else "full"
    p = out["parameters"]
    lines = [
        f"# startup model to {max(r['nodes'] for r in _rows(out))} nodes, from the node "
        f"sweep ({size} scenario)",
        "",
        f"- command: `{out['command']}`",
        f"- sweep: {out['sweep']} (N = {', '.join(map(str, out['counts']))})",
        f"- predicted cluster: {p['gpus_per_node']} ranks per node, "
        + (
            "each rank on a core of its own"
            if not p["cpus_per_node"]
            else f"{p['cpus_per_node']} cores per node"
        )
        + f"; node link {p['node_rate_Bps'] / 1e6:.0f} MB/s; origins "
        + ", ".join(f"{o} {r / 1e6:.0f} MB/s" for o, r in p["origin_rates_Bps"].items())
        + (
            "; no cache tier"
            if not p["cache_rate_Bps"]
            else f"; cache tier {p['cache_rate_Bps'] / 1e6:.0f} MB/s (the `cache` rows)"
        )
        + f"; store growth beyond the sweep: {p['growth']}",
        "",
    ]
    lines += ["## validation", "", *[f"- {line}" for line in check_lines(out["validation"])], ""]
    head = ["method", "N", "measured max", "model p50", "model p99"]
    lines += [
        "## the fit on every count, on the sweep's machine",
        "",
        *_table(
            head,
            [
                [
                    m,
                    r["nodes"],
                    f"{r['measured_max_s']:.1f} s",
                    f"{r['p50_s']:.1f} s",
                    f"{r['p99_s']:.1f} s",
                ]
                for m, rows in out["in_sample"].items()
                for r in rows
            ],
        ),
        "",
    ]
    lines += [
        "## fitted inputs",
        "",
        *_table(
            [
                "method",
                "fresh path median (sigma)",
                "import: fresh / survivor ranks (sigma)",
                "build + load: fresh / survivor ranks (sigma)",
                "first step",
                "rendezvous",
                "gloo init",
                "fresh node MB (registry/S3/index)",
                "a survivor MB",
            ],
            [
                [
                    m,
                    f"{f['fresh']['median']:.1f} s ({f['fresh']['sigma']:.2f})",
                    f"{_g(f['imports']['fresh'])} / {_g(f['imports']['survivor'])} "
                    f"({f['imports']['sigma']:.2f})",
                    f"{_g(f['loads']['fresh'])} / {_g(f['loads']['survivor'])} "
                    f"({f['loads']['sigma']:.2f})",
                    _g(f["first_step"]),
                    _g(f["rendezvous"], "N"),
                    _g(f["process_group"], "M"),
                    "/".join(f"{f['traffic']['fresh'][o] / 1e6:.1f}" for o in ORIGINS),
                    "/".join(f"{f['traffic']['survivor'][o] / 1e6:.1f}" for o in ORIGINS),
                ]
                for m, f in out["fitted"].items()
            ],
        ),
        "",
    ]
    for scenario, what in (
        ("restart", "a node lost and replaced (the sweep's scenario)"),
        ("cold", "every node fresh (a job's cold start)"),
    ):
        lines += [f"## predicted: {what}", ""]
        for variant, by_m in out["predictions"][scenario].items():
            methods = list(by_m)
            rows = [
                [
                    r["nodes"],
                    r["ranks"],
                    *[f"{by_m[m][i]['p50_s']:.0f} / {by_m[m][i]['p99_s']:.0f}" for m in methods],
                ]
                for i, r in enumerate(by_m[methods[0]])
            ]
            lines += [
                f"{variant.replace('_', ' ')}: p50 / p99 seconds",
                "",
                *_table(["nodes", "ranks", *methods], rows),
                "",
            ]
    lines += [
        "## published figures the model is drawn beside",
        "",
        *[
            f"- {k}: {v['what']}; {v['source']}" + (f" ({v['note']})" if v.get("note") else "")
            for k, v in out["published"].items()
        ],
        "",
    ]
    lines += [f"- WARNING: {w}" for w in out.get("warnings", [])]
    return lines


def _rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for v in out["predictions"]["restart"].values() for rows in v.values() for r in rows]


def _g(g: dict[str, Any], var: str = "x") -> str:
    x = var if g["form"] == "lin" else f"ln {var}"
    return f"{g['a']:.2f} + {g['b']:.3f}*{x}"


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return md_table(head, [[str(c) for c in r] for r in rows])


def plot(out: dict[str, Any], path: Path) -> None:
    """The predictions beside the published curves (GPUs = ranks on the x axis)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 6.5), sharey=True)
    colors = {"baseline": "tab:red", "diy": "tab:orange", "bootseer": "tab:blue"}
    pub = out["published"]
    for ax, scenario, title in (
        (axes[0], "restart", "a node lost and replaced"),
        (axes[1], "cold", "every node fresh (cold start)"),
    ):
        for variant, by_m in out["predictions"][scenario].items():
            style = "-" if variant == "no_cache" else ":"
            for m, rows in by_m.items():
                xs = [r["ranks"] for r in rows]
                c = colors.get(m, None)
                ax.plot(
                    xs,
                    [r["p50_s"] for r in rows],
                    style,
                    color=c,
                    marker="o",
                    ms=3,
                    label=f"{m} p50" + ("" if variant == "no_cache" else " (cache tier)"),
                )
                ax.plot(
                    xs,
                    [r["p99_s"] for r in rows],
                    style,
                    color=c,
                    lw=0.8,
                    alpha=0.6,
                    label=f"{m} p99" + ("" if variant == "no_cache" else " (cache tier)"),
                )
        any_rows = next(iter(out["predictions"][scenario]["no_cache"].values()))
        xs = [r["ranks"] for r in any_rows]
        ax.plot(
            xs,
            [r["terms"]["rendezvous_s"] + r["terms"]["process_group_init_s"] for r in any_rows],
            "--",
            color="grey",
            label="model: rendezvous + process-group init",
        )
        for pt in pub["bootseer_characterization"]["points"]:
            hi = pt["gpus_to"] or max(xs + [pt["gpus_from"] * 4])
            ax.plot([pt["gpus_from"], hi], [pt["seconds"]] * 2, color="black", lw=3, alpha=0.5)
        ax.plot(
            [],
            [],
            color="black",
            lw=3,
            alpha=0.5,
            label="Bootseer characterization (median startup)",
        )
        for pt in pub["megascale_initialization"]["points"]:
            ax.plot(pt["gpus"], pt["seconds_at_most"], "v", color="green", ms=9)
        ax.plot([], [], "v", color="green", label="MegaScale initialization (at most)")
        ax.plot(
            [p["ranks"] for p in pub["gloo_init"]["points"]],
            [p["seconds"] for p in pub["gloo_init"]["points"]],
            "s",
            color="purple",
            label="gloo PG init (gloo#408)",
        )
        ax.plot(
            ANCHOR["ranks"],
            ANCHOR["seconds"],
            "*",
            color="brown",
            ms=11,
            label="TCPStore libuv init",
        )
        for m, rows in out["in_sample"].items():
            ax.plot(
                [r["nodes"] * out["sweep_ranks_per_node"] for r in rows],
                [r["measured_max_s"] for r in rows],
                "x",
                color=colors.get(m),
                ms=8,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (ranks)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time to the first step (s)")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=5, frameon=False)
    fig.suptitle("startup model (x: the sweep's measured restarts) beside published figures")
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="startup_model.py", description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", required=True, help="e2e-sweep.json (bench_e2e.py --sweep)")
    parser.add_argument(
        "--results", default=None, help="where startup-model.* go (default: beside the sweep)"
    )
    parser.add_argument("--nodes", default="2..4096", help="2..4096 (powers of two) or 2,16,128")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="ranks per node of the predicted cluster (default 8)",
    )
    parser.add_argument(
        "--cpus-per-node",
        type=int,
        default=None,
        help="its cores (default: a core per rank at least)",
    )
    parser.add_argument(
        "--node-rate", type=float, default=None, help="a node's link, MB/s (default the sweep's)"
    )
    parser.add_argument(
        "--origin-rate",
        action="append",
        default=None,
        metavar="ORIGIN=MB/s",
        help="an origin's aggregate rate (default: the sweep's probe)",
    )
    parser.add_argument(
        "--cache-rate",
        type=float,
        default=None,
        help="a cache tier's aggregate rate, MB/s (default: none; given, the "
        "predictions come with and without it)",
    )
    parser.add_argument(
        "--growth",
        choices=("anchor", "fit"),
        default="anchor",
        help="the store terms beyond the sweep (default anchor: the measured "
        "level + TCPStore's published per-client cost)",
    )
    parser.add_argument(
        "--form",
        choices=("auto", "lin", "log"),
        default="auto",
        help="a + b*N or a + b*log N for the rendezvous and the gloo init",
    )
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument(
        "--min-sigma",
        type=float,
        default=MIN_SIGMA,
        help=f"the least spread of a lognormal (default {MIN_SIGMA})",
    )
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # the harness's
    parser.add_argument("--no-plot", action="store_true", help="no PNG")
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        args.node_list = parse_nodes(args.nodes)
        for name in ("gpus_per_node", "trials"):
            if getattr(args, name) < 1:
                raise ModelError(
                    f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more"
                )
        if args.cache_rate is not None and args.cache_rate <= 0:
            raise ModelError(f"--cache-rate {args.cache_rate}: give a rate in MB/s above 0")
        sweep = read_sweep(args.sweep)
        out = model(sweep, args)
    except ModelError as exc:
        parser.error(str(exc))
    results = Path(args.results) if args.results else Path(args.sweep).resolve().parent
    results.mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        plot(out, results / f"{SUITE}.png")
        out["plot"] = str(results / f"{SUITE}.png")
    lines = render(out)
    (results / f"{SUITE}.md").write_text("\n".join(lines) + "\n")
    (results / f"{SUITE}.json").write_text(json.dumps(out, indent=2) + "\n")
    for line in check_lines(out["validation"]):
        print(line)
    print(f"startup model: {results / SUITE}.json, .md" + ("" if args.no_plot else ", .png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
