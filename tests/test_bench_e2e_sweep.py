"""The node sweep (benchmarks/bench_e2e_sweep.py, ``bootseer bench e2e --sweep 2,4,8``; its
bad arguments are refused by name in test_bench_e2e_nodes.py): a restart's spans become job-level
segments that add up to the job's time (with gloo's ``init_process_group`` split out of the
launch), one N's results become the sweep's entry, the origins' probe reads real bytes from
the cluster's registry, S3 and index, and ``bootseer bench`` passes ``--sweep`` on and runs
the model on a sweep's results. The sweep itself is a benchmark, never run here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_bench_e2e_nodes import KILL, _ev, _report, _restart, _run

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_e2e_nodes import rank_list  # noqa: E402
from bench_e2e_sweep import parse_sweep, render, sweep_runs  # noqa: E402
from e2e_nodes_spans import (  # noqa: E402
    harness_spans,
    node_phases,
    paced_by,
    rank_totals,
    restart_segments,
    summarize,
)

from bootseer.testing.cluster import Cluster, Link  # noqa: E402

PG = {("node1", 3): 0.7}  # node1's rank 3 imports torch in 0.7 s, the others in 0.6 s


def _with_pg(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The restart of test_bench_e2e_nodes with each worker's ``init_process_group`` logged:
    import 0.6 s (r3: 0.7 s), 0.2 s in the call, the load from 1.0 s after the start."""
    out = list(events)
    for e in events:
        if e["event"] == "process_start" and e["t"] > KILL:
            imp = PG.get((e["node"], e["rank"]), 0.6)
            out += [
                _ev("pg_init_start", e["t"] + imp, e["node"], e["rank"], e["pid"]),
                _ev("pg_init_end", e["t"] + imp + 0.2, e["node"], e["rank"], e["pid"]),
            ]
    return out


def test_the_restart_s_segments_add_up_to_the_job_s_time_to_its_first_step() -> None:
    events, run = _with_pg(_restart()), _run()
    spans = harness_spans(run, events)
    seg = restart_segments(run, spans)
    # the loss to node1's torchrun (16.5 s), to the last worker's start (node0: 19.0 s), to
    # the last init_process_group call (19.6), its return (19.8), the last load's end
    # (20.5), the last rank's first step less its digest (20.8)
    assert {
        k: seg[k]
        for k in (
            "fresh_path_s",
            "rendezvous_s",
            "import_s",
            "process_group_init_s",
            "load_s",
            "first_step_s",
        )
    } == pytest.approx(
        {
            "fresh_path_s": 16.5,
            "rendezvous_s": 2.5,
            "import_s": 0.6,
            "process_group_init_s": 0.2,
            "load_s": 0.7,
            "first_step_s": 0.3,
        }
    )
    assert seg["workers_s"] == pytest.approx(1.8) and seg["ranks"] == 4
    assert seg["per_rank"]["import_s"] == pytest.approx(
        {"node0/r0": 0.6, "node0/r1": 0.6, "node1/r2": 0.6, "node1/r3": 0.7}
    )
    assert seg["per_rank"]["load_s"]["node1/r3"] == pytest.approx(0.6)  # 19.4 -> 20.0
    assert seg["per_rank"]["first_step_s"]["node1/r3"] == pytest.approx(0.3)
    assert max(rank_totals(run, events).values()) == pytest.approx(20.8)
    # the launch is split: import, init_process_group, the model; the pacing node still the
    # fresh one, and the split's phases come after its rendezvous
    r3 = [
        (s.phase, round(s.start - KILL, 6), round(s.end - KILL, 6))
        for s in spans
        if s.node == "node1"
        and s.rank == 3
        and s.phase in ("launch", "process_group_init", "model_build")
    ]
    assert r3 == [
        ("launch", 18.5, 19.2),
        ("process_group_init", 19.2, 19.4),
        ("model_build", 19.4, 19.5),
    ]
    phases = node_phases(spans, "node1", KILL)
    assert phases["process_group_init"] == pytest.approx(0.2)
    assert sum(phases.values()) == pytest.approx(20.3)
    node, why = paced_by({n: {"phases": node_phases(spans, n, KILL)} for n in ("node0", "node1")})
    assert node == "node1" and "process_group_init" not in why and "model_build" not in why


def test_without_the_init_milestones_the_workers_are_one_segment() -> None:
    """A job image from before ``pg_init_*``: one launch per worker, no split (the model
    refuses such a sweep by name, tests/test_startup_model.py)."""
    run, events = _run(), _restart()
    seg = restart_segments(run, harness_spans(run, events))
    assert seg["import_s"] is None and seg["process_group_init_s"] is None
    assert seg["fresh_path_s"] + seg["rendezvous_s"] + seg["workers_s"] == pytest.approx(20.8)


def test_one_n_s_results_become_the_sweep_s_entry(tmp_path: Path) -> None:
    events = _with_pg(_restart())
    run = _run()
    run.bytes["node1"]["s3-cache"] = 4000  # a run through a cache tier: its own field
    out = summarize(
        _report(tmp_path, run, events), run, rank_totals(run, events), harness_spans(run, events)
    )
    out.update(report_dir=str(tmp_path / "t"), bit_identical=True, cache=None)
    entry = sweep_runs({"nodes": 2, "runs": {"baseline": out}}, "/r/e2e-sweep-n2")
    e = entry["methods"]["baseline"]
    assert e["ttfs"] == pytest.approx({"p50_s": 20.55, "p90_s": 20.8, "p99_s": 20.8, "max_s": 20.8})
    assert e["paced_by"]["node"] == "node1" and e["paced_by"]["role"] == "fresh"
    assert e["paced_by"]["phases"]["environment"] == pytest.approx(10.0)
    assert e["per_node"]["node0"] == {
        "role": "survivor",
        "first_step_s": pytest.approx(20.8),
        "phases": e["per_node"]["node0"]["phases"],
        "bytes": {"registry": 0, "s3": 300, "index": 0},
        "through_cache": None,
    }
    assert e["per_node"]["node1"]["bytes"] == {"registry": 5000, "s3": 200, "index": 9000}
    assert e["per_node"]["node1"]["through_cache"] == {"s3": 4000}
    assert e["torch"] == pytest.approx(
        {
            "rendezvous_s": 2.5,
            "process_group_init_s": 0.2,
            "process_group_init_rank_p50_s": 0.2,
            "process_group_init_rank_max_s": 0.2,
        }
    )
    assert sum(
        e["segments"][k]
        for k in (
            "fresh_path_s",
            "rendezvous_s",
            "import_s",
            "process_group_init_s",
            "load_s",
            "first_step_s",
        )
    ) == pytest.approx(e["ttfs"]["max_s"])
    assert e["timeline"] == str(tmp_path / "t" / "timeline.png")
    R = {
        "quick": True,
        "sweep": [2, 4],
        "ranks_per_node": 1,
        "model": "tiny",  # noqa: N806
        "lost_node": "the last node of each N",
        "command": "bench_e2e.py --sweep 2,4",
        "machine": {"cpus": 2, "ram_bytes": 2**33, "containerd": "containerd 1.6"},
        "links": {"node": {"rate": "400mbit", "delay_ms": 1.0}, "services": {"rate": "1280mbit"}},
        "runs": {"2": entry, "4": entry},
        "serve_rates": {"2": {"s3": {"rate_Bps": 1e8}}},
        "warnings": [],
        "errors": [],
    }
    text = "\n".join(render(R))
    row = r"\| baseline +\| 20\.[56] s +\| 20\.8 s +\| 20\.8 s +\| 20\.8 s +\| node1 \(fresh\) +\|"
    assert len(re.findall(r"^\| 2 +" + row, text, re.M)) == 1
    assert len(re.findall(r"^\| 4 +" + row, text, re.M)) == 1
    assert re.search(r"^\| 2 +\| - +\| 100\.0 +\| - +\|$", text, re.M)  # s3's rate only
    assert "- N=2: /r/e2e-sweep-n2" in text


def test_sweep_counts_and_rank_lists() -> None:
    assert parse_sweep("8, 2,4") == [2, 4, 8]
    assert [rank_list(3, 1), rank_list(3, 2), rank_list(1, 4)] == ["3", "6-7", "4-7"]


def test_bootseer_bench_passes_the_sweep_and_runs_the_model_on_its_results(tmp_path: Path) -> None:
    results = tmp_path / "results"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bootseer",
            "bench",
            "e2e",
            "--sweep",
            "1,2",
            "--ranks-per-node",
            "1",
            "--results",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--sweep 1,2 --ranks-per-node 1" in r.stdout
    assert "--sweep '1,2': 1 nodes: each count must be 2 to 8" in r.stderr
    assert "e2e FAILED: exit 2" in r.stderr

    r = subprocess.run(
        [sys.executable, "-m", "bootseer", "bench", "model", "--results", str(results)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert r.returncode == 1 and "model FAILED: exit 2" in r.stderr
    assert f"{results / 'e2e-sweep.json'}: no such sweep" in r.stdout + r.stderr

    from test_startup_model import _sweep

    (results / "e2e-sweep.json").write_text(json.dumps(_sweep()))
    r = subprocess.run(
        [sys.executable, "-m", "bootseer", "bench", "model", "--results", str(results)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 of 1 suites wrote their results" in r.stdout and "within 15%: pass" in r.stdout
    out = json.loads((results / "startup-model.json").read_text())
    assert out["command"].startswith(f"bootseer bench model --results {results}")
    summary = (results / "summary.md").read_text()
    assert "# startup model to 4096 nodes" in summary
    assert "![model](startup-model.png)" in summary


def test_the_probe_reads_every_origin_at_once_and_checks_the_bytes(tmp_path: Path) -> None:
    """On a real 2-node cluster: the registry's blob, S3's object and the index's file read
    by both nodes at once, each node's bytes counted by its proxy; bytes other than those put
    there are an error, not a rate."""
    import hashlib

    from e2e_sweep_probe import ORIGINS, read_at_once, stage

    size = 1 << 20
    with Cluster(
        2,
        link=Link(rate="400mbit", delay_ms=1.0),
        service_link=Link(rate="1280mbit"),
        services=("registry", "s3", "index"),
        workdir=tmp_path,
    ) as c:
        payload = c.dir / "probe.bin"
        payload.write_bytes(os.urandom(size))
        digest = hashlib.sha256(payload.read_bytes()).hexdigest()
        where = stage(c, payload, digest)
        for origin in ORIGINS:
            r = read_at_once(c, origin, where[origin], digest, size)
            assert (r["nodes"], r["bytes_per_node"]) == (2, size)
            assert r["rate_Bps"] == pytest.approx(2 * size / r["seconds"])
            assert set(r["counted_bytes"]) == {"node0", "node1"}
            assert all(b >= size for b in r["counted_bytes"].values()), r  # + the headers
        (c.services.index_dir / "bootseerprobe-0.0.0-py3-none-any.whl").write_bytes(
            b"x" * size
        )  # the index now serves other bytes of the same size
        with pytest.raises(
            RuntimeError,
            match=r"probe index: read other bytes than the "
            r"1048576 put there: node0 \(1048576 bytes",
        ):
            read_at_once(c, "index", where["index"], digest, size)
