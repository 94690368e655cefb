"""Lazy hot update and rollback (:mod:`bootseer.robust.update`): two ``bootseer run`` agents
on loopback with a ``bootseer controller`` over one c10d store. One job goes through the
whole life of versions (module-scoped: one job for the CI budget), and each test checks one
part of it: a lazy publish taken at the next restart and not before, an urgent one at once, a
windowed one forced after its window, a bad one rolled back; every node on the same version
in every attempt. Also, on the same store in this process: bad versions refused, a damaged
record refused without losing the running version, a second failure after a rollback
escalating as the policy table says."""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from robust_helpers import scenario_env

from bootseer.robust import update, wire
from bootseer.robust.controller import Controller
from bootseer.robust.events import Event
from bootseer.robust.remote import ControllerLink
from bootseer.robust.seal import seal

NODES = ("node0", "node1")
JOB = "upd"
WINDOW_S = 3.0

# the training script of every version: records which code directory runs it and with which
# variables, heartbeats, and ends when the test says so; ``BAD`` raises after its first step
TRAIN = """
import json, os, time
from pathlib import Path
import bootseer
out = Path(os.environ["UPDATE_OUT"])
node, attempt = os.environ["BOOTSEER_NODE"], os.environ["BOOTSEER_ATTEMPT"]
record = {"node": node, "attempt": int(attempt), "version": os.environ.get("BOOTSEER_VERSION"),
          "code": Path(__file__).resolve().parent.name, "flavour": os.environ.get("FLAVOUR"),
          "incident": os.environ.get("BOOTSEER_INCIDENT"), "rdzv": os.environ.get("PET_RDZV_ID")}


def put(name, text):  # atomic: the test polls these files
    tmp = out / f".{name}.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, out / name)


put(f"start-{node}-{attempt}.json", json.dumps(record))
step = 0
while True:
    bootseer.heartbeat(step)
    if step == 0:
        bootseer.ready()
    put(f"step-{node}-{attempt}", str(step))
    if BAD and step == 1:
        raise ValueError(f"version {record['version']} cannot read its config")
    if (out / f"crash-{node}-{attempt}").exists():
        raise RuntimeError("injected crash")
    if (out / "finish").exists() and step >= 2:
        break
    time.sleep(0.1)
    step += 1
put(f"done-{node}-{attempt}.json", json.dumps({**record, "steps": step}))
"""


def _code(root: Path, name: str, bad: bool = False) -> Path:
    path = root / "code" / name
    path.mkdir(parents=True)
    (path / "train.py").write_text(f"BAD = {bad}\n{TRAIN}")
    return path


@pytest.fixture(scope="module")
def store():
    from torch.distributed import TCPStore

    s = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    yield s
    del s


def _bootseer(*argv: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bootseer", *argv],
        capture_output=True,
        text=True,
        env=scenario_env(),
        timeout=120,
        **kw,
    )


def _publish(store, *argv: str) -> subprocess.CompletedProcess:
    return _bootseer(
        "controller", "publish", "--store", f"127.0.0.1:{store.port}", "--job", JOB, *argv
    )


def _wait(what: str, ready, out: Path, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")}
            raise AssertionError(f"no {what} in {timeout_s} s: {logs}")
        time.sleep(0.1)
    return got


def _starts(out: Path, attempt: int) -> dict[str, dict[str, Any]] | None:
    """Both nodes' start records of ``attempt``, once both exist."""
    paths = {n: out / f"start-{n}-{attempt}.json" for n in NODES}
    if not all(p.exists() for p in paths.values()):
        return None
    return {n: json.loads(p.read_text()) for n, p in paths.items()}


def _step(out: Path, node: str, attempt: int) -> int:
    try:
        return int((out / f"step-{node}-{attempt}").read_text() or -1)
    except (OSError, ValueError):
        return -1


def _running(out: Path, attempt: int, steps: int = 2) -> bool:
    return all(_step(out, n, attempt) >= steps for n in NODES)


def _records(path: Path, record: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [d for d in map(json.loads, path.read_text().splitlines()) if d.get("record") == record]


@pytest.fixture(scope="module")
def life(store, tmp_path_factory) -> dict[str, Any]:
    """One job through four versions; what each test checks, recorded as it happened."""
    root = tmp_path_factory.mktemp("update")
    out = root / "out"
    out.mkdir()
    base = _code(root, "base")
    codes = {v: _code(root, v, bad=v == "v5") for v in ("v2", "v3", "v4", "v5")}
    seen: dict[str, Any] = {"out": out, "root": root}
    ctl = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bootseer",
            "controller",
            "--store",
            f"127.0.0.1:{store.port}",
            "--job",
            JOB,
            "--trace-dir",
            str(out / "ctl"),
            "--dump-wait",
            "15",
        ],
        stdout=subprocess.PIPE,
        stderr=open(out / "ctl.log", "w"),
        text=True,  # noqa: SIM115
        env=scenario_env(),
    )
    agents: dict[str, subprocess.Popen] = {}
    try:
        assert ctl.stdout is not None and ctl.stdout.readline().startswith("READY")
        for node in NODES:
            log = open(out / f"{node}.log", "w")  # noqa: SIM115
            with log:
                agents[node] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bootseer",
                        "run",
                        "--controller",
                        f"127.0.0.1:{store.port}",
                        "--job",
                        JOB,
                        "--node",
                        node,
                        "--state-dir",
                        str(root / f"state-{node}"),
                        "--trace-dir",
                        str(out / "trace"),
                        "--min-free-disk",
                        "0",
                        "--min-free-memory",
                        "0",
                        "--max-restarts",
                        "3",
                        "--backoff",
                        "0.2",
                        "--controller-wait",
                        "30",
                        "--",
                        sys.executable,
                        "train.py",
                    ],
                    cwd=base,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=scenario_env({"UPDATE_OUT": str(out)}),
                )
        # (a) lazy: published while both run, taken only at the next restart (a crash)
        _wait("attempt 0 running", lambda: _running(out, 0), out)
        pub = _publish(store, "--id", "v2", "--workdir", str(codes["v2"]), "--env", "FLAVOUR=two")
        seen["publish_v2"] = pub
        at = {n: _step(out, n, 0) for n in NODES}
        _wait(
            "25 more steps after the publication (the controller passes every 0.25 s)",
            lambda: all(_step(out, n, 0) >= at[n] + 25 for n in NODES),
            out,
        )
        seen["before_restart"] = {a: _starts(out, a) for a in (0, 1)}
        keys = wire.Keys(JOB)
        seen["incidents_before"] = (int(store.add(keys.incident, 0)), wire.get(store, keys.open))
        (out / "crash-node1-0").touch()
        seen[1] = _wait("attempt 1 on both nodes", lambda: _starts(out, 1), out)
        # (b) urgent: at once
        _wait("attempt 1 running", lambda: _running(out, 1), out)
        seen["publish_v3"] = update.publish(
            store, JOB, update.Version("v3", str(codes["v3"])), urgent=True
        )  # the API (the CLI: (a) and (c))
        seen[2] = _wait("attempt 2 on both nodes", lambda: _starts(out, 2), out)
        # (c) forced after its window
        _wait("attempt 2 running", lambda: _running(out, 2), out)
        seen["publish_v4"] = _publish(
            store,
            "--id",
            "v4",
            "--workdir",
            str(codes["v4"]),
            "--env",
            "FLAVOUR=four",
            "--window",
            str(WINDOW_S),
        )
        seen["v4_published"] = update.current(store, wire.Keys(JOB))
        seen[3] = _wait("attempt 3 on both nodes", lambda: _starts(out, 3), out)
        # (d) a bad version: it crashes after the update, is rolled back, the job finishes
        _wait("attempt 3 running", lambda: _running(out, 3), out)
        seen["publish_v5"] = update.publish(
            store, JOB, update.Version("v5", str(codes["v5"])), urgent=True
        )
        seen[4] = _wait("attempt 4 on both nodes", lambda: _starts(out, 4), out)
        seen[5] = _wait("attempt 5 on both nodes", lambda: _starts(out, 5), out)
        (out / "finish").touch()
        seen["codes"] = {n: agents[n].wait(timeout=120) for n in NODES}
        seen["logs"] = {n: (out / f"{n}.log").read_text() for n in NODES}
        return seen
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        ctl.send_signal(signal.SIGTERM)
        try:
            ctl.wait(timeout=30)
        except subprocess.TimeoutExpired:
            ctl.kill()
            ctl.wait()


def _ctl_verdicts(life: dict[str, Any]) -> list[dict[str, Any]]:
    return _records(life["out"] / "ctl" / "controller.jsonl", "verdict")


def test_a_lazy_version_is_taken_at_the_next_restart_and_not_before(life) -> None:
    assert life["publish_v2"].returncode == 0, life["publish_v2"].stderr
    assert "published version v2 in job upd (replacing base" in life["publish_v2"].stdout
    before = life["before_restart"]
    assert before[1] is None  # 25 steps on both nodes after the publication: no restart,
    assert life["incidents_before"] == (0, None)  # and no incident opened for it
    assert {r["version"] for r in before[0].values()} == {"base"}
    assert {r["code"] for r in before[0].values()} == {"base"}
    # the crash on node1 restarted both nodes, and both came back on v2: its directory,
    # its variables
    for record in life[1].values():
        assert (record["version"], record["code"], record["flavour"]) == ("v2", "v2", "two")
    first = _ctl_verdicts(life)[0]
    assert (first["class"], first["action"]) == ("python_exception", "restart_in_place")


def test_an_urgent_version_restarts_every_node_at_once(life) -> None:
    assert (life["publish_v3"].id, life["publish_v3"].previous) == ("v3", "v2")
    for record in life[2].values():
        assert (record["version"], record["code"], record["flavour"]) == ("v3", "v3", None)
    update_verdicts = [v for v in _ctl_verdicts(life) if v["class"] == "update"]
    urgent = [v for v in update_verdicts if v["evidence"]["update"]["version"] == "v3"]
    assert len(urgent) == 1 and "published urgent" in urgent[0]["reason"]
    assert sorted(urgent[0]["evidence"]["answered"]) == list(NODES)
    # the restart was the update's, not a failure: no crash between attempts 1 and 2
    assert (
        "v3" in life["logs"]["node0"]
        and "restarting on the updated version" in life["logs"]["node0"]
    )
    assert str(urgent[0]["evidence"]["incident"]) == life[2]["node0"]["incident"]


def test_a_windowed_version_is_forced_after_its_window(life) -> None:
    assert life["publish_v4"].returncode == 0, life["publish_v4"].stderr
    assert "forced after 3 s" in life["publish_v4"].stdout
    for record in life[3].values():
        assert (record["version"], record["code"], record["flavour"]) == ("v4", "v4", "four")
    forced = [
        v
        for v in _ctl_verdicts(life)
        if v["class"] == "update" and v["evidence"]["update"]["version"] == "v4"
    ]
    assert len(forced) == 1 and "not run 3 s after its publication" in forced[0]["reason"]
    assert forced[0]["time"] >= life["v4_published"].time + WINDOW_S  # not before the window


def test_a_bad_version_is_rolled_back_and_the_job_finishes_on_the_previous(life) -> None:
    assert life["publish_v5"].urgent
    assert {r["version"] for r in life[4].values()} == {"v5"}
    rollback = [v for v in _ctl_verdicts(life) if v["action"] == "rollback"]
    assert len(rollback) == 1, _ctl_verdicts(life)
    assert rollback[0]["class"] == "python_exception"
    assert rollback[0]["evidence"]["primary"]["evidence"]["exception"] == "ValueError"
    assert rollback[0]["evidence"]["update"] == {
        "failed": "v5",
        "rolled_back_to": "v4",
        "epoch": int(life[4]["node0"]["incident"]),
    }
    for record in life[5].values():  # back on v4, every node
        assert (record["version"], record["code"], record["flavour"]) == ("v4", "v4", "four")
    assert life["codes"] == {"node0": 0, "node1": 0}, life["logs"]
    for node in NODES:
        done = json.loads((life["out"] / f"done-{node}-5.json").read_text())
        assert done["version"] == "v4" and done["steps"] >= 2


def test_every_attempt_runs_one_version_on_every_node_and_the_trace_says_which(life) -> None:
    expected = ["base", "v2", "v3", "v4", "v5", "v4"]
    for attempt, version in enumerate(expected):
        starts = _starts(life["out"], attempt)
        assert starts is not None and {r["version"] for r in starts.values()} == {version}
        assert len({r["incident"] for r in starts.values()}) == 1  # the same epoch
        # and torchrun's rendezvous id of that epoch (PET_RDZV_ID), fresh after each verdict
        assert {r["rdzv"] for r in starts.values()} == {
            f"bootseer-{r['incident']}" for r in starts.values()
        }
    for node in NODES:
        updates = [
            e
            for e in _records(life["out"] / "trace" / f"{node}.jsonl", "event")
            if e["kind"] == "update"
        ]
        assert [e["evidence"]["version"] for e in updates] == expected
        assert [e["evidence"]["cause"] for e in updates if e["evidence"]["updated"]] == [
            "publish",
            "publish",
            "publish",
            "publish",
            "rollback",
        ]
    report = _bootseer(
        "report",
        str(life["out"] / "trace"),
        str(life["out"] / "ctl"),
        "--out",
        str(life["root"] / "report"),
    )
    assert report.returncode == 0, report.stderr
    assert "version v5 -> v4 in " in report.stdout and "(rollback, epoch 5)" in report.stdout
    assert "version v4 published urgent" not in report.stdout
    assert "version v3 published urgent: every node restarts on it" in report.stdout
    assert "version v5 rolled back to v4" in report.stdout


# -- refusals and the policy, on the store in this process ------------------------------------


def test_malformed_and_unknown_versions_are_refused_naming_them(store, tmp_path) -> None:
    bad_id = _publish(store, "--id", "v/2", "--env", "A=1")
    assert bad_id.returncode == 2 and "version 'v/2': an id is 1-63 letters" in bad_id.stderr
    unknown = _publish(store, "--id", "v9")
    assert unknown.returncode == 2
    assert "version 'v9' is unknown in job upd (known: base" in unknown.stderr
    got = _publish(store, "--id", "v8", "--workdir", str(tmp_path / "nowhere"))
    assert got.returncode == 2 and "is not a directory here" in got.stderr, got.stderr
    with pytest.raises(update.VersionError, match="--env 'LR': expected NAME=VALUE"):
        update.parse_env(["A=1", "LR"])  # the CLI's --env (a process each costs CI time)
    for env, message in (
        ({"BOOTSEER_NODE": "x"}, "BOOTSEER_NODE belongs to bootseer run"),
        ({"1X": "x"}, "'1X' is not a variable name"),
        ({"A": "x\0"}, "the value of A must be a string"),
    ):
        with pytest.raises(update.VersionError, match=message):
            update.Version("v8", env=env).check()
    with pytest.raises(update.VersionError, match="workdir 'code/v8' must be an absolute"):
        update.Version("v8", workdir="code/v8").check()
    keys = wire.Keys("refusals")
    update.publish(store, "refusals", update.Version("v2", str(tmp_path), {"A": "1"}))
    with pytest.raises(update.VersionError, match="'v2' is already published with other"):
        update.publish(store, "refusals", update.Version("v2", str(tmp_path), {"A": "2"}))
    store.set(
        keys.version("v3"),
        seal(keys.version("v3"), json.dumps({"id": "v3", "cmd": ["rm", "-rf"]}).encode()),
    )
    with pytest.raises(update.VersionError, match=r"version at .*version/v3: unknown field"):
        update.get_version(store, keys, "v3")
    assert update.current(store, keys).id == "v2"  # what was published before is intact


def test_a_damaged_current_record_keeps_the_running_version(store, tmp_path) -> None:
    keys = wire.Keys("damaged")
    update.publish(store, "damaged", update.Version("v2", str(tmp_path), {"A": "1"}))
    said: list[str] = []
    versions = update.NodeVersions(store, "n0", job="damaged", log=said.append)
    version, pin = versions.resolve(0)
    assert (version.id, pin.previous, pin.updated) == ("v2", "base", True)
    store.set(keys.version_current, seal(keys.version_current, b"{not json"))
    version, pin = versions.resolve(1)  # the next epoch: refused, v2 kept
    assert (version.id, pin.updated, pin.epoch) == ("v2", False, 1)
    assert any("bootseer/damaged/version/current: not a published record" in s for s in said)
    # a version whose code is not on this node: bootseer run refuses to start it
    gone = wire.Keys("gone")
    store.set(
        gone.version("v2"),
        seal(
            gone.version("v2"),
            json.dumps({"id": "v2", "workdir": str(tmp_path / "missing"), "env": {}}).encode(),
        ),
    )
    store.set(
        gone.version_current,
        seal(gone.version_current, json.dumps({"id": "v2", "seq": 1}).encode()),
    )
    run = _bootseer(
        "run",
        "--controller",
        f"127.0.0.1:{store.port}",
        "--job",
        "gone",
        "--node",
        "n1",
        "--state-dir",
        str(tmp_path / "state"),
        "--trace-dir",
        str(tmp_path / "trace"),
        "--min-free-disk",
        "0",
        "--min-free-memory",
        "0",
        "--",
        "touch",
        str(tmp_path / "ran"),
    )
    assert run.returncode == 2, run.stderr
    assert f"version 'v2': its workdir {tmp_path}/missing does not exist on node n1" in run.stderr
    assert not (tmp_path / "ran").exists()


def test_after_a_rollback_a_second_failure_escalates_as_the_table_says(store) -> None:
    """v2 fails with a user error right after its update: rollback to base; base fails the
    same way: the table's ``stop`` (no rollback of a rollback)."""
    job = "escalate"
    keys = wire.Keys(job)
    now = [100.0]
    links = [ControllerLink(store, n, job=job) for n in ("n0", "n1")]
    for link in links:
        link.register()
    ctl = Controller(store, job=job, clock=lambda: now[0], settle_s=0, log=lambda _: None)
    update.publish(store, job, update.Version("v2", env={"A": "1"}), now=90.0)
    versions = update.NodeVersions(store, "n0", job=job)
    assert versions.resolve(0)[1].updated

    def incident(k: int) -> Any:
        now[0] += 1  # after the last verdict: a new incident
        links[1].publish(
            Event(
                "crash", "user_error", node="n1", time=now[0], evidence={"exception": "ImportError"}
            )
        )
        ctl.step()
        for link in links:
            link.answer(k, [])
        now[0] += 1
        ctl.step()
        verdict = ctl.step()
        assert verdict is not None
        return verdict

    first = incident(1)
    assert first.action == "rollback" and first.evidence["update"]["rolled_back_to"] == "base"
    assert links[0].local_action(first) == "restart"  # the restart runs the rolled-back one
    version, pin = versions.resolve(1)
    assert (version.id, pin.cause, pin.previous) == ("base", "rollback", "v2")
    assert update.current(store, keys).bad == "v2"
    second = incident(2)
    assert (second.action, second.failure_class) == ("stop", "user_error")
    assert "update" not in second.evidence


def test_a_publication_between_two_nodes_restarts_never_mixes_versions(store) -> None:
    """The race the pin exists for: node0 starts epoch 1, v3 is published, node1 starts
    epoch 1: both run v2; v3 waits for the next epoch, where both run it."""
    job = "race"
    update.publish(store, job, update.Version("v2", env={"A": "2"}))
    n0, n1 = (update.NodeVersions(store, n, job=job) for n in ("n0", "n1"))
    assert n0.resolve(1)[0].id == "v2"
    update.publish(store, job, update.Version("v3", env={"A": "3"}), urgent=True)
    version, pin = n1.resolve(1)
    assert (version.id, dict(version.env), pin.node) == ("v2", {"A": "2"}, "n0")
    assert [n.resolve(2)[0].id for n in (n1, n0)] == ["v3", "v3"]
    assert update.running(store, wire.Keys(job)).previous == "v2"


def test_a_restarted_controller_finishes_an_update_incident_and_never_reopens_it(store) -> None:
    job = "resume"
    links = [ControllerLink(store, n, job=job) for n in ("n0", "n1")]
    for link in links:
        link.register()
    versions = [update.NodeVersions(store, link.node, job=job) for link in links]
    assert versions[0].resolve(0)[0].id == "base"  # the job runs: epoch 0 is pinned
    update.publish(store, job, update.Version("v2", env={"A": "2"}), urgent=True)
    first = Controller(store, job=job, log=lambda _: None)
    assert first.step() is None  # the update incident is opened
    order = links[0].dump_order(force=True)
    assert (order["incident"], order["update"]) == (1, "v2")
    del first  # "killed" before any node answered
    for link in links:
        link.answer(1, [])
    second = Controller(store, job=job, log=lambda _: None)
    verdict = second.step()
    assert (verdict.action, verdict.failure_class) == ("restart_in_place", "update")
    assert verdict.evidence["answered"] == ["n0", "n1"]
    assert [v.resolve(1)[0].id for v in versions] == ["v2", "v2"]
    assert second.step() is None and int(store.add(wire.Keys(job).incident, 0)) == 1
