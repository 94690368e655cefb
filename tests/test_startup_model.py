"""The startup model (benchmarks/startup_model.py) on synthetic sweeps: a sweep made from a
known truth is fitted back, the validation rule passes on it and fails on a sweep whose
largest count disagrees, the shared-bandwidth queue and the cache tier give the figures
their formulas say, the store terms take PyTorch's anchor beyond the sweep, and the script's
CLI writes its JSON, markdown and PNG. The sweep itself is a benchmark (never run here)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import startup_model as sm  # noqa: E402

MB = 1e6
NODE_RATE, SERVICE_RATE = 50 * MB, 160 * MB  # 400mbit, 1280mbit
FRESH = {"registry": 40 * MB, "s3": 190 * MB, "index": 0.0}
SURVIVOR = {"registry": 0.0, "s3": 17 * MB, "index": 0.0}
JITTER = (0.97, 1.0, 1.03, 0.99, 1.02, 0.98, 1.01, 1.0)  # each rank around its median


def _truth(n: int, ranks_per_node: int = 1, cpus: int = 2) -> dict[str, float]:
    """The segments of a restart at N nodes on a machine where every rank shares its cores:
    x = ranks per core; the survivors' checkpoint reads queue at the services' 160 MB/s."""
    x = max(1.0, n * ranks_per_node / cpus)
    queue = max(0.0, (n - 1) * SURVIVOR["s3"] / SERVICE_RATE - SURVIVOR["s3"] / NODE_RATE)
    return {
        "fresh_path_s": 30.0,
        "rendezvous_s": 4.0 + 0.5 * n,
        "import": 3.0 * x,
        "process_group_init_s": 0.5 + 0.1 * n * ranks_per_node,
        "load": 2.0 + x + queue,
        "first_step_s": 0.5 + 0.2 * x,
    }


def _entry(n: int, ranks_per_node: int = 1, scale_max: float = 1.0) -> dict[str, Any]:
    t = _truth(n, ranks_per_node)
    keys = [f"node{i}/r{i * ranks_per_node + j}" for i in range(n) for j in range(ranks_per_node)]
    imports = {k: t["import"] * JITTER[i % len(JITTER)] for i, k in enumerate(keys)}
    loads = {k: t["load"] * JITTER[(i + 3) % len(JITTER)] for i, k in enumerate(keys)}
    seg = {
        "fresh_path_s": t["fresh_path_s"],
        "rendezvous_s": t["rendezvous_s"],
        "import_s": max(imports.values()),
        "process_group_init_s": t["process_group_init_s"],
        "load_s": max(loads.values()),
        "first_step_s": t["first_step_s"],
    }
    total = sum(seg.values()) * scale_max
    per_node = {
        f"node{i}": {
            "role": "fresh" if i == n - 1 else "survivor",
            "first_step_s": total,
            "phases": {},
            "bytes": {o: int(FRESH[o] if i == n - 1 else SURVIVOR[o]) for o in sm.ORIGINS},
            "through_cache": None,
        }
        for i in range(n)
    }
    return {
        "ttfs": {"p50_s": total, "p90_s": total, "p99_s": total, "max_s": total},
        "segments": {**seg, "workers_s": total - seg["fresh_path_s"] - seg["rendezvous_s"]},
        "per_rank": {
            "import_s": imports,
            "process_group_init_s": {},
            "load_s": loads,
            "first_step_s": {},
        },
        "per_node": per_node,
        "torch": {},
        "ranks": {k: total for k in keys},
    }


def _sweep(
    counts: tuple[int, ...] = (2, 4, 8),
    methods: tuple[str, ...] = ("bootseer",),
    ranks_per_node: int = 1,
) -> dict[str, Any]:
    return {
        "suite": "e2e-sweep",
        "quick": True,
        "sweep": list(counts),
        "ranks_per_node": ranks_per_node,
        "model": "tiny",
        "machine": {"cpus": 2, "ram_bytes": 2**34},
        "links": {"node": {"rate": "400mbit", "delay_ms": 1.0}, "services": {"rate": "1280mbit"}},
        "serve_rates": {
            str(n): {o: {"rate_Bps": min(n * NODE_RATE, SERVICE_RATE)} for o in sm.ORIGINS}
            for n in counts
        },
        "runs": {
            str(n): {"nodes": n, "methods": {m: _entry(n, ranks_per_node) for m in methods}}
            for n in counts
        },
    }


def _write(tmp_path: Path, sweep: dict[str, Any]) -> Path:
    path = tmp_path / "e2e-sweep.json"
    path.write_text(json.dumps(sweep))
    return path


def test_growth_fits_pick_the_form_with_the_lower_residual() -> None:
    lin = sm.fit_growth([(2, 2.0), (4, 3.0), (8, 5.0)])
    assert (lin.form, lin.a, lin.b) == ("lin", pytest.approx(1.0), pytest.approx(0.5))
    log = sm.fit_growth(
        [(2, 1 + 2 * math.log(2)), (4, 1 + 2 * math.log(4)), (8, 1 + 2 * math.log(8))]
    )
    assert (log.form, log.a, log.b) == ("log", pytest.approx(1.0), pytest.approx(2.0))
    assert log(4096) == pytest.approx(1 + 2 * math.log(4096))
    assert sm.fit_growth([(2, 2.0), (4, 3.0)]).form == "lin"  # two points: both exact
    assert sm.fit_growth([(2, 5.0), (4, 1.0)], "lin")(100) == 0.0  # never below zero


def test_the_max_of_n_draws_is_the_order_statistic_of_the_lognormal() -> None:
    d = sm.Lognormal(10.0, 0.2)
    assert d.max_of(1, 0.5) == pytest.approx(10.0)
    # the median of the max of n: F^-1(0.5^(1/n))
    z = sm.statistics.NormalDist().inv_cdf(0.5 ** (1 / 8))
    assert d.max_of(8, 0.5) == pytest.approx(10.0 * math.exp(0.2 * z))
    grows = [d.max_of(n, 0.5) for n in (1, 8, 512, 32768, 2**20)]
    assert grows == sorted(grows) and math.isfinite(d.max_of(2**20, 1 - 1e-15))


def test_the_queue_adds_only_what_n_nodes_at_the_origin_take_beyond_a_node_s_link() -> None:
    # 7 survivors x 17 MB at 160 MB/s: 0.74 s, a node alone 0.34 s: 0.40 s more
    assert sm.queue_delay(7 * 17 * MB, 17 * MB, SERVICE_RATE, NODE_RATE) == pytest.approx(
        7 * 17 / 160 - 17 / 50
    )
    assert sm.queue_delay(2 * 17 * MB, 17 * MB, SERVICE_RATE, NODE_RATE) == 0.0  # fits
    # a cache tier serves the demand at its rate and sends the origin its misses
    assert sm.queue_delay(
        4096 * 40 * MB, 40 * MB, SERVICE_RATE, NODE_RATE, 1250 * MB, 40 * MB
    ) == pytest.approx(4096 * 40 / 1250 - 40 / 50)


def test_a_cache_tier_shortens_a_cold_start_but_not_the_survivors_checkpoint_reads() -> None:
    t = sm.Traffic(dict(FRESH), dict(SURVIVOR))
    plain = sm.Setting("x", 8, lambda n: 1.0, NODE_RATE, {o: SERVICE_RATE for o in sm.ORIGINS})
    cached = sm.Setting("x", 8, lambda n: 1.0, NODE_RATE, plain.origin_rates, 1250 * MB)
    pre, load = t.queues(plain, 4096, "cold")
    assert load == 0.0 and pre == pytest.approx(
        4096 * 40 / 160 - 40 / 50 + 4096 * 190 / 160 - 190 / 50
    )
    pre_c, _ = t.queues(cached, 4096, "cold")
    # the image and the environment (190 - 17 MB) miss once; each node's shard every time
    assert pre_c == pytest.approx(
        4096 * 40 / 1250 - 40 / 50 + max(4096 * 190 / 1250, (173 + 4096 * 17) / 160) - 190 / 50
    )
    assert pre_c < pre
    assert (
        t.queues(cached, 4096, "restart")[1]
        == t.queues(plain, 4096, "restart")[1]
        == pytest.approx(4095 * 17 / 160 - 17 / 50)
    )


def test_calibrated_on_2_and_4_the_model_predicts_8_within_15_percent(tmp_path: Path) -> None:
    sweep = sm.read_sweep(_write(tmp_path, _sweep(methods=("baseline", "diy", "bootseer"))))
    v = sm.validate(sweep)
    assert v["calibrated_on"] == [2, 4] and v["predicted"] == 8 and v["ok"] is True
    truth = sum(
        _entry(8)["segments"][k]
        for k in (
            "fresh_path_s",
            "rendezvous_s",
            "import_s",
            "process_group_init_s",
            "load_s",
            "first_step_s",
        )
    )
    for r in v["methods"].values():
        assert r["measured_max_s"] == pytest.approx(truth)
        assert abs(r["error"]) <= 0.15 and r["ok"]
    lines = sm.check_lines(v)
    assert len(lines) == 3 and all("within 15%: pass" in line for line in lines)
    fitted = sm.calibrate(sweep, "bootseer", [2, 4, 8])  # the truth's terms come back
    assert (fitted.rendezvous.a, fitted.rendezvous.b) == (pytest.approx(4.0), pytest.approx(0.5))
    # the ranks' medians (their jitter is within 3%), the fresh node's and the survivors'
    for population in (fitted.imports.fresh, fitted.imports.survivor):
        assert population(1.0) == pytest.approx(3.0, rel=0.03)
        assert population(4.0) == pytest.approx(12.0, rel=0.03)
    assert 0.05 <= fitted.imports.sigma < 0.1
    assert fitted.fresh.median == pytest.approx(30.0)
    # the survivors' loads without their queue at N=8; the fresh node's (no queue) as measured
    assert fitted.loads.survivor(4.0) == pytest.approx(6.0, rel=0.03)
    assert fitted.loads.fresh(4.0) == pytest.approx(_truth(8)["load"], rel=0.03)


def test_a_sweep_whose_largest_count_disagrees_fails_the_check(tmp_path: Path) -> None:
    raw = _sweep()
    raw["runs"]["8"]["methods"]["bootseer"] = _entry(8, scale_max=1.5)
    v = sm.validate(sm.read_sweep(_write(tmp_path, raw)))
    assert v["ok"] is False and v["methods"]["bootseer"]["error"] < -0.15
    assert "OUTSIDE 15%: FAIL" in sm.check_lines(v)[0]


def test_beyond_the_sweep_the_store_terms_grow_by_tcpstore_s_published_cost(tmp_path: Path) -> None:
    sweep = sm.read_sweep(_write(tmp_path, _sweep()))
    fitted = sm.calibrate(sweep, "bootseer", [2, 4, 8])
    anchor = sm.Setting("c", 8, lambda n: 1.0, NODE_RATE, sweep.origin_rates, growth="anchor")
    fit = sm.Setting("c", 8, lambda n: 1.0, NODE_RATE, sweep.origin_rates, growth="fit")
    t = fitted.terms(anchor, 4096, "restart")
    # gloo's init: the level measured at 8 ranks + 100 s / 98,304 clients for the rest
    assert t["process_group_init_s"] == pytest.approx(0.5 + 0.1 * 8 + 100 / 98304 * (32768 - 8))
    assert t["rendezvous_s"] == pytest.approx(4.0 + 0.5 * 8 + 100 / 98304 * (4096 - 8))
    assert fitted.terms(fit, 4096, "restart")["rendezvous_s"] == pytest.approx(4 + 0.5 * 4096)
    p = [fitted.predict(anchor, n, "cold") for n in (2, 64, 4096)]
    assert [r["p50_s"] for r in p] == sorted(r["p50_s"] for r in p)
    assert all(r["p99_s"] >= r["p50_s"] for r in p)


def test_an_old_or_short_sweep_is_refused_with_what_to_do(tmp_path: Path) -> None:
    raw = _sweep()
    del raw["runs"]["4"]["methods"]["bootseer"]["segments"]["import_s"]
    with pytest.raises(sm.ModelError, match=r"bootseer at N=4: no 'import_s'.*rerun"):
        sm.read_sweep(_write(tmp_path, raw))
    with pytest.raises(sm.ModelError, match="needs two or more"):
        sm.read_sweep(_write(tmp_path, _sweep(counts=(4,))))
    with pytest.raises(sm.ModelError, match="no such sweep"):
        sm.read_sweep(tmp_path / "missing.json")
    (tmp_path / "e2e-sweep.json").write_text("{not json")
    with pytest.raises(sm.ModelError, match="not a sweep's JSON"):
        sm.read_sweep(tmp_path / "e2e-sweep.json")
    v = sm.validate(sm.read_sweep(_write(tmp_path, _sweep(counts=(2, 4)))))
    assert v["ok"] is None and "needs three" in v["why"]
    assert sm.parse_nodes("2..4096") == [2**k for k in range(1, 13)]
    with pytest.raises(sm.ModelError, match="--nodes '8..2'"):
        sm.parse_nodes("8..2")
    assert sm.parse_rate("400mbit") == NODE_RATE and sm.parse_rate("1280mbit") == SERVICE_RATE


def test_published_figures_are_data_with_their_sources() -> None:
    for name, entry in sm.PUBLISHED.items():
        assert entry["source"] and entry["points"], name
    assert sm.PUBLISHED["tcpstore_libuv"]["points"] == [{"ranks": 98304, "seconds": 100.0}]
    seconds = [p["seconds"] for p in sm.PUBLISHED["bootseer_characterization"]["points"]]
    assert seconds == [45.0, 500.0]


def test_the_script_writes_its_results_and_prints_the_check(tmp_path: Path) -> None:
    raw = _sweep(methods=("baseline", "diy", "bootseer"))
    path = _write(tmp_path, raw)
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "startup_model.py"),
            "--sweep",
            str(path),
            "--results",
            str(out),
            "--nodes",
            "2..64",
            "--cache-rate",
            "1250",
            "--trials",
            "500",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("within 15%: pass") == 3
    res = json.loads((out / "startup-model.json").read_text())
    assert res["validation"]["ok"] is True
    rows = res["predictions"]["cold"]["cache"]["bootseer"]
    assert [x["nodes"] for x in rows] == [2, 4, 8, 16, 32, 64]
    assert [x["ranks"] for x in rows] == [16, 32, 64, 128, 256, 512]
    plain = res["predictions"]["cold"]["no_cache"]["bootseer"]
    assert rows[-1]["p50_s"] < plain[-1]["p50_s"]  # 64 fresh nodes: the tier helps
    assert (out / "startup-model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "startup-model.md").read_text()
    assert "## validation" in md and "arXiv:2507.12619" in md and "| 64 " in md

    bad = copy.deepcopy(raw)
    bad["suite"] = "e2e-nodes"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "startup_model.py"),
            "--sweep",
            str(_write(tmp_path, bad)),
            "--results",
            str(tmp_path / "bad"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "not an e2e-sweep.json" in r.stderr
    assert not (tmp_path / "bad").exists()
