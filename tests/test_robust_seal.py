"""The controller's store attacked from outside: records crafted byte by byte by the test and
written into a real TCPStore, read by the real controller and agent.

Every record that can change what a node runs, loads or evicts is sealed (HMAC-SHA256 under
``BOOTSEER_JOB_SECRET``, bound to its key: :mod:`bootseer.robust.seal`) and validated by its
kind (:mod:`bootseer.robust.records`); a record that fails either is skipped with a warning
naming its key, and the reader stays up. conftest gives the session a job secret.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from bootseer.robust import controller as controller_mod
from bootseer.robust import seal, update, wire
from bootseer.robust.controller import Controller, _processes
from bootseer.robust.events import Event
from bootseer.robust.remote import ControllerLink
from bootseer.robust.stacks import localize
from tests.robust_helpers import scenario_env

OTHER = b"another-job-secret-0123456789abcdef"  # a secret that is not the job's
K = wire.Keys("job")


@pytest.fixture()
def store(tcp_store):
    return tcp_store


def S(key: str, body: bytes, secret: bytes | None = None) -> bytes:  # noqa: N802
    """``body`` sealed for ``key`` (under the job's secret unless ``secret``)."""
    return seal.seal(key, body, secret)


def _j(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


# -- the seal itself --------------------------------------------------------------------------


def test_seal_is_bound_to_the_key_and_the_secret() -> None:
    key = K.dump_request
    body = b'{"incident":3,"time":1.0}'
    data = S(key, body)
    assert data[:4] == b"bs1." and data[68:69] == b"." and data[69:] == body
    assert seal.open_sealed(key, data) == body
    for other_key in (K.verdict(3), "bootseer/other/dump/request"):
        with pytest.raises(seal.SealError, match="MAC is not the job's for this key"):
            seal.open_sealed(other_key, data)
    with pytest.raises(seal.SealError, match="MAC is not the job's"):
        seal.open_sealed(key, S(key, body, OTHER))
    flipped = bytearray(data)
    flipped[-2] ^= 1
    with pytest.raises(seal.SealError, match="MAC is not the job's"):
        seal.open_sealed(key, bytes(flipped))
    with pytest.raises(seal.SealError, match="not a sealed record"):
        seal.open_sealed(key, body)
    with pytest.raises(seal.MissingSecret, match="no job secret"):
        _open_without_secret(key, data)
    with pytest.raises(seal.MissingSecret, match="at least 16"):
        seal.job_secret({"BOOTSEER_JOB_SECRET": "short"})
    assert seal.job_secret({}) is None


def _open_without_secret(key: str, data: bytes) -> bytes:
    old = os.environ.pop(seal.SECRET_ENV)
    try:
        return seal.open_sealed(key, data)
    finally:
        os.environ[seal.SECRET_ENV] = old


def test_without_a_secret_the_controller_the_agent_and_publish_refuse_to_start(
    store, monkeypatch, tmp_path
) -> None:
    monkeypatch.delenv(seal.SECRET_ENV)
    with pytest.raises(seal.MissingSecret, match="bootseer controller needs the job's secret"):
        Controller(store)
    with pytest.raises(seal.MissingSecret, match="bootseer run --controller needs"):
        ControllerLink(store, "node-a")
    with pytest.raises(seal.MissingSecret, match="publish needs the job's secret"):
        update.publish(store, "job", update.Version("v2", env={"A": "1"}))
    assert wire.get(store, K.version_current) is None
    env = {k: v for k, v in scenario_env().items() if k != seal.SECRET_ENV}
    for argv in (
        ["controller", "--store", f"127.0.0.1:{store.port}"],
        [
            "controller",
            "publish",
            "--store",
            f"127.0.0.1:{store.port}",
            "--id",
            "v9",
            "--urgent",
            "--env",
            f"BASH_ENV={tmp_path}/evil.sh",
        ],
        [
            "run",
            "--controller",
            f"127.0.0.1:{store.port}",
            "--node",
            "n0",
            "--state-dir",
            str(tmp_path / "s"),
            "--trace-dir",
            str(tmp_path / "t"),
            "--min-free-disk",
            "0",
            "--min-free-memory",
            "0",
            "--",
            "true",
        ],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "bootseer", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 2, (argv, done.stderr)
        assert "needs the job's secret in BOOTSEER_JOB_SECRET" in done.stderr
    assert wire.get(store, K.version_current) is None and wire.get(store, K.nodes) is None


# -- 36 crafted records, each read by its real reader ---------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    reader: str  # who reads it: see _READERS
    key: Callable[[], str]
    data: Callable[[str], bytes]  # the key -> the bytes written


A_DUMP = K.dump("node-a", 1)
_ANSWER = b'{"node":"node-a","incident":1,"time":1.0,"processes":[]}'

CASES = [
    # a node's dump answer, read by the controller when it closes incident 1
    Case(
        "files_is_7",
        "dump",
        lambda: A_DUMP,
        lambda k: S(k, (b'{"node":"node-a","incident":1,"time":1.0,"processes":[],"files":7}')),
    ),
    Case(
        "processes_is_a_string",
        "dump",
        lambda: A_DUMP,
        lambda k: S(k, (b'{"node":"node-a","incident":1,"time":1.0,"processes":"ps"}')),
    ),
    Case(
        "rank_is_a_string",
        "dump",
        lambda: A_DUMP,
        lambda k: S(
            k, (b'{"node":"node-a","incident":1,"time":1.0,"processes":[{"rank":"0","text":"T"}]}')
        ),
    ),
    Case(
        "time_is_NaN",
        "dump",
        lambda: A_DUMP,
        lambda k: S(k, (b'{"node":"node-a","incident":1,"time":NaN,"processes":[]}')),
    ),
    Case(
        "huge_count",
        "dump",
        lambda: A_DUMP,
        lambda k: S(
            k,
            (
                b'{"node":"node-a","incident":1,"time":1.0,"processes":['
                + b",".join([b'{"rank":0}'] * 5000)
                + b"]}"
            ),
        ),
    ),
    Case(
        "huge_string",
        "dump",
        lambda: A_DUMP,
        lambda k: S(
            k,
            (
                b'{"node":"node-a","incident":1,"time":1.0,"processes":[{"rank":0,"text":"'
                + b"x" * 40000
                + b'"}]}'
            ),
        ),
    ),
    Case("not_json", "dump", lambda: A_DUMP, lambda k: S(k, b'\xff\xfe{"node":"node-a"')),
    Case(
        "json_array",
        "dump",
        lambda: A_DUMP,
        lambda k: S(k, (b'[{"node":"node-a","incident":1,"processes":[]}]')),
    ),
    Case(
        "processes_missing",
        "dump",
        lambda: A_DUMP,
        lambda k: S(k, (b'{"node":"node-a","incident":1,"time":1.0}')),
    ),
    Case("no_mac", "dump", lambda: A_DUMP, lambda k: _ANSWER),
    Case("wrong_mac", "dump", lambda: A_DUMP, lambda k: S(k, _ANSWER, OTHER)),
    Case(
        "replayed_from_incident_2",
        "dump",
        lambda: A_DUMP,
        lambda k: S(
            K.dump("node-a", 2), b'{"node":"node-a","incident":2,"time":1.0,"processes":[]}'
        ),
    ),
    Case(
        "replayed_from_node_b",
        "dump",
        lambda: A_DUMP,
        lambda k: S(
            K.dump("node-b", 1), b'{"node":"node-b","incident":1,"time":1.0,"processes":[]}'
        ),
    ),
    Case(
        "incident_not_the_keys",
        "dump",
        lambda: A_DUMP,
        lambda k: S(k, (b'{"node":"node-a","incident":2,"time":1.0,"processes":[]}')),
    ),
    Case(
        "negative_pid",
        "dump",
        lambda: A_DUMP,
        lambda k: S(
            k, (b'{"node":"node-a","incident":1,"time":1.0,"processes":[{"rank":0,"pid":-5}]}')
        ),
    ),
    Case(
        "nested_20000_deep",
        "dump",
        lambda: A_DUMP,
        lambda k: S(
            k,
            (
                b'{"node":"node-a","incident":1,"time":1.0,"processes":'
                + b"[" * 20000
                + b"]" * 20000
                + b"}"
            ),
        ),
    ),
    # the dump order, read by every agent
    Case(
        "incident_1e999",
        "order",
        lambda: K.dump_request,
        lambda k: S(k, b'{"incident":1e999,"time":1.0,"reason":"x"}'),
    ),
    Case(
        "incident_negative",
        "order",
        lambda: K.dump_request,
        lambda k: S(k, b'{"incident":-1,"time":1.0}'),
    ),
    Case(
        "incident_a_string",
        "order",
        lambda: K.dump_request,
        lambda k: S(k, b'{"incident":"7","time":1.0}'),
    ),
    Case(
        "incident_40_digits",
        "order",
        lambda: K.dump_request,
        lambda k: S(k, b'{"incident":' + b"9" * 40 + b',"time":1.0}'),
    ),
    Case("incident_missing", "order", lambda: K.dump_request, lambda k: S(k, b'{"time":1.0}')),
    Case("incident_true", "order", lambda: K.dump_request, lambda k: S(k, b'{"incident":true}')),
    Case(
        "order_no_mac",
        "order",
        lambda: K.dump_request,
        lambda k: b'{"incident":5,"time":1.0,"reason":"forged"}',
    ),
    # verdicts, read by the agent waiting for incident 1
    Case(
        "verdict_no_mac_evicting",
        "verdict",
        lambda: K.verdict(1),
        lambda k: (
            b'{"action":"replace_and_restart","class":"gpu_oom","nodes":["node-a"],'
            b'"evidence":{"incident":1}}'
        ),
    ),
    Case(
        "verdict_nodes_is_7",
        "verdict",
        lambda: K.verdict(1),
        lambda k: S(
            k, (b'{"action":"replace_and_restart","class":"x","nodes":7,"evidence":{"incident":1}}')
        ),
    ),
    Case(
        "verdict_replayed_from_2",
        "verdict",
        lambda: K.verdict(1),
        lambda k: S(
            K.verdict(2),
            b'{"action":"replace_and_restart","class":"x","nodes":["node-a"],'
            b'"evidence":{"incident":2}}',
        ),
    ),
    Case(
        "verdict_without_evidence",
        "verdict",
        lambda: K.verdict(1),
        lambda k: S(k, b'{"action":"stop","class":"x"}'),
    ),
    # the other orders an agent answers on its own
    Case(
        "sample_round_1.5",
        "sample",
        lambda: K.sample_request,
        lambda k: S(k, b'{"round":1.5,"time":1.0}'),
    ),
    Case(
        "link_time_Infinity",
        "link",
        lambda: K.link_request,
        lambda k: S(k, b'{"id":3,"time":Infinity}'),
    ),
    Case(
        "check_5000_nodes",
        "check",
        lambda: K.check_request(1),
        lambda k: S(
            k, (b'{"incident":1,"time":1.0,"nodes":[' + b",".join([b'"node-a"'] * 5000) + b"]}")
        ),
    ),
    Case(
        "check_no_mac",
        "check",
        lambda: K.check_request(1),
        lambda k: b'{"incident":1,"time":1.0,"nodes":["node-a"]}',
    ),
    # a version: what every node runs
    Case(
        "publish_bash_env_no_mac",
        "version",
        lambda: K.version_current,
        lambda k: b'{"id":"v9","previous":"base","seq":9,"time":1.0,"urgent":true}',
    ),
    Case(
        "publish_urgent_a_string",
        "version",
        lambda: K.version_current,
        lambda k: S(k, (b'{"id":"v9","seq":9,"time":1.0,"urgent":"yes","window_s":-1}')),
    ),
    # the exclusion list, and the controller's own state
    Case(
        "excluded_no_mac",
        "excluded",
        lambda: K.excluded,
        lambda k: b'{"nodes":["node-a"],"reasons":{"node-a":"forged"}}',
    ),
    Case(
        "event_rank_a_string",
        "event",
        lambda: K.event("node-b", 1),
        lambda k: S(
            k, (b'{"kind":"crash","class":"gpu_oom","node":"node-b","rank":"0","time":1.0}')
        ),
    ),
    Case(
        "open_events_is_7",
        "open",
        lambda: K.open,
        lambda k: S(k, b'{"incident":1,"time":1.0,"events":7}'),
    ),
]


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _incident_with_two_nodes(
    store, logs: list[str]
) -> tuple[Controller, FakeClock, ControllerLink, ControllerLink]:
    """node-a and node-b registered, node-b's crash opened incident 1, node-b answered and
    node-a acknowledged the order (alive: the controller waits for its answer)."""
    clock = FakeClock()
    ctl = Controller(
        store,
        log=logs.append,
        clock=clock,
        failslow_interval_s=0,
        dump_wait_s=5.0,
        settle_s=0.0,
        crash_window_s=0.0,
    )
    a, b = ControllerLink(store, "node-a"), ControllerLink(store, "node-b")
    a.register()
    b.register()
    b.publish(Event("crash", "python_exception", node="node-b", rank=1, time=clock.now))
    assert ctl.step() is None and int(store.add(K.incident, 0)) == 1
    assert a.dump_order(force=True)["incident"] == 1  # its ack
    assert b.dump_order(force=True)["incident"] == 1
    b.answer(1, [])
    return ctl, clock, a, b


def _close(ctl: Controller, clock: FakeClock) -> Any:
    clock.now += 10.0
    for _ in range(3):
        if (verdict := ctl.step()) is not None:
            return verdict
    raise AssertionError("no verdict")


def _read_dump(store, case: Case, capsys) -> None:
    logs: list[str] = []
    ctl, clock, _, _ = _incident_with_two_nodes(store, logs)
    store.set(A_DUMP, case.data(A_DUMP))
    verdict = _close(ctl, clock)  # written, whatever node-a's answer was
    assert wire.read(store, K.verdict(1))["action"] == verdict.action == "restart_in_place"
    assert "node-a" not in verdict.nodes and verdict.evidence["missing_dumps"] == ["node-a"]
    assert sorted(verdict.evidence["dumps"]) == ["node-b"]  # the record was not used
    assert any(A_DUMP in w for w in ctl.warnings), ctl.warnings


def _agent(store) -> ControllerLink:
    link = ControllerLink(store, "node-a")
    link.register()
    link.sample_tool = lambda pid: "Thread 1 (idle)"
    link.probe_link = lambda: {"node": "node-a", "rtt_s": 0.001}  # type: ignore[method-assign]
    return link


def _warned(capsys, key: str) -> None:
    err = capsys.readouterr().err
    assert f"warning: {key}" in err or f"record: {key}" in err, err
    assert os.environ[seal.SECRET_ENV] not in err


def _read_order(store, case: Case, capsys) -> None:
    link = _agent(store)
    assert link.dump_order(force=True) is None
    assert link.dump_order(force=True) is None  # said once
    assert not any(wire.get(store, K.dump_ack("node-a", i)) for i in (1, 5, 7))
    err = capsys.readouterr().err
    assert err.count(K.dump_request) == 1, err


def _read_verdict(store, case: Case, capsys) -> None:
    link = _agent(store)
    assert link.verdict(1) is None
    assert link.wait_verdict(1, timeout_s=0.0) is None
    _warned(capsys, K.verdict(1))


def _read_sample(store, case: Case, capsys) -> None:
    link = _agent(store)
    link.beat(0, {0: {"step": 3, "time": time.time(), "pid": os.getpid()}})
    assert link._sampler is None and link._sampled == 0
    _warned(capsys, K.sample_request)


def _read_link(store, case: Case, capsys) -> None:
    link = _agent(store)
    link.beat(0, {0: {"step": 3, "time": time.time(), "pid": os.getpid()}})
    assert link._prober is None and link._probed == 0
    _warned(capsys, K.link_request)


def _read_check(store, case: Case, capsys) -> None:
    link = _agent(store)
    assert link.check_order(1) is None
    _warned(capsys, K.check_request(1))


def _read_version(store, case: Case, capsys) -> None:
    said: list[str] = []
    store.set(K.version("v9"), _j({"id": "v9", "env": {"BASH_ENV": "/tmp/evil.sh"}}))
    versions = update.NodeVersions(store, "node-a", log=said.append)
    version, pin = versions.resolve(0)
    assert (version.id, version.env, pin.id) == ("base", {}, "base")
    assert any(K.version_current in s for s in said), said
    logs: list[str] = []
    ctl = Controller(store, log=logs.append, failslow_interval_s=0)
    assert ctl.step() is None and int(store.add(K.incident, 0)) == 0  # no update incident
    assert wire.get(store, K.dump_request) is None
    assert any(K.version_current in w for w in ctl.warnings)


def _read_excluded(store, case: Case, capsys) -> None:
    _agent(store)  # not refused: a forged list keeps nobody out (nor lets anyone in)
    _warned(capsys, K.excluded)
    logs: list[str] = []
    assert Controller(store, log=logs.append).excluded() == []


def _read_event(store, case: Case, capsys) -> None:
    ControllerLink(store, "node-b").register()
    store.add(K.node("node-b", "events"), 1)
    logs: list[str] = []
    ctl = Controller(store, log=logs.append, failslow_interval_s=0)
    assert ctl.step() is None and int(store.add(K.incident, 0)) == 0
    assert int(store.add(K.seen("node-b"), 0)) == 1  # skipped for good
    assert any(K.event("node-b", 1) in w for w in ctl.warnings)


def _read_open(store, case: Case, capsys) -> None:
    link = ControllerLink(store, "node-b")
    link.register()
    logs: list[str] = []
    ctl = Controller(store, log=logs.append, failslow_interval_s=0)
    assert ctl.step() is None
    assert any(K.open in w for w in ctl.warnings)
    link.publish(Event("crash", "gpu_oom", node="node-b", rank=0, time=time.time()))
    ctl.step()  # a genuine event opens a genuine incident over it
    assert wire.read(store, K.open)["events"][0]["class"] == "gpu_oom"


_READERS = {
    "dump": _read_dump,
    "order": _read_order,
    "verdict": _read_verdict,
    "sample": _read_sample,
    "link": _read_link,
    "check": _read_check,
    "version": _read_version,
    "excluded": _read_excluded,
    "event": _read_event,
    "open": _read_open,
}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_crafted_record_is_skipped_and_the_reader_stays_up(store, capsys, case: Case) -> None:
    key = case.key()
    store.set(key, case.data(key))
    _READERS[case.reader](store, case, capsys)


def test_there_are_at_least_26_crafted_shapes() -> None:
    assert len(CASES) >= 26 and len({c.name for c in CASES}) == len(CASES)


def test_a_replayed_older_publication_is_not_applied(store, tmp_path) -> None:
    """Every sealed record can be read off the wire and written back later: an older
    ``version/current`` (sealed, genuine) put back after a newer one ran is refused."""
    update.publish(store, "job", update.Version("v2", str(tmp_path), {"A": "2"}))
    old = store.get(K.version_current)
    said: list[str] = []
    versions = update.NodeVersions(store, "node-a", log=said.append)
    assert versions.resolve(1)[0].id == "v2"
    update.publish(store, "job", update.Version("v3", str(tmp_path), {"A": "3"}), urgent=True)
    assert versions.resolve(2)[0].id == "v3"
    store.set(K.version_current, old)  # the replay
    version, pin = versions.resolve(3)
    assert (version.id, pin.updated) == ("v3", False)
    assert any("older than the running one" in s for s in said), said


def test_a_forged_epoch_pin_is_pinned_again(store, tmp_path) -> None:
    store.set(K.version_at(4), b'{"id":"v9","epoch":4}')
    said: list[str] = []
    version, pin = update.NodeVersions(store, "node-a", log=said.append).resolve(4)
    assert (version.id, pin.epoch) == ("base", 4)
    assert wire.read(store, K.version_at(4))["id"] == "base"
    assert any("not a sealed record" in s for s in said)


def test_a_poisoned_incident_is_closed_and_the_next_one_is_handled(store, monkeypatch) -> None:
    """An exception while an incident is open (here: the stack analysis raising) is logged;
    after three passes the incident is closed with a restart_in_place verdict saying why, and
    the next incident gets its own verdict."""
    logs: list[str] = []
    ctl, clock, a, b = _incident_with_two_nodes(store, logs)
    a.answer(1, [])

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(controller_mod, "localize", boom)
    clock.now += 10.0
    results = [ctl.safe_step() for _ in range(5)]
    verdict = next(v for v in results if v is not None)
    assert (verdict.action, verdict.evidence["rule"]) == ("restart_in_place", "controller_error")
    assert "OverflowError: cannot convert float infinity" in verdict.reason
    assert wire.read(store, K.verdict(1))["evidence"]["incident"] == 1
    assert wire.get(store, K.open) is None
    monkeypatch.undo()
    clock.now += 1.0
    b.publish(Event("crash", "gpu_oom", node="node-b", rank=1, time=clock.now))
    assert ctl.safe_step() is None and wire.read(store, K.open)["incident"] == 2
    for link in (a, b):
        assert link.dump_order(force=True)["incident"] == 2
        link.answer(2, [])
    clock.now += 10.0
    second = next(v for v in (ctl.safe_step() for _ in range(3)) if v is not None)
    assert second.evidence["incident"] == 2 and second.failure_class == "gpu_oom"


# -- a fuzzer per record kind ------------------------------------------------------------------

_POOL: list[Any] = [
    7,
    -1,
    0,
    1.5,
    1e308,
    -1e308,
    2**63,
    10**30,
    "",
    "x" * 5000,
    "node-a",
    [],
    [7],
    {},
    {"a": 1},
    None,
    True,
    False,
    [[[[]]]],
    "nan",
    "1e999",
]


def _mutate_doc(rng: random.Random, doc: Any, depth: int = 0) -> Any:
    """A JSON-level mutation: a field replaced, removed, added, or a nested one changed."""
    if isinstance(doc, dict) and doc and depth < 4 and rng.random() < 0.8:
        doc = dict(doc)
        name = rng.choice(list(doc))
        op = rng.random()
        if op < 0.15:
            del doc[name]
        elif op < 0.25:
            doc[rng.choice(["extra", "files", "nodes", "incident", "rank"])] = rng.choice(_POOL)
        elif op < 0.55:
            doc[name] = _mutate_doc(rng, doc[name], depth + 1)
        else:
            doc[name] = rng.choice(_POOL)
        return doc
    if isinstance(doc, list) and doc and depth < 4 and rng.random() < 0.7:
        doc = list(doc)
        i = rng.randrange(len(doc))
        doc[i] = _mutate_doc(rng, doc[i], depth + 1)
        return doc
    return rng.choice(_POOL)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """A byte-level mutation of a sealed value (what a forger without the secret can do)."""
    data = bytearray(data)
    op = rng.random()
    if op < 0.4:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif op < 0.6:
        del data[rng.randrange(len(data)) :]
    elif op < 0.8:
        i = rng.randrange(len(data))
        data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:
        data = bytearray(data[seal.OVERHEAD :])  # the body alone, MAC stripped
    return bytes(data)


_PROC = {
    "rank": 0,
    "pid": 11,
    "role": "main",
    "source": "py-spy",
    "text": 'Thread 11 (idle): "MainThread"\n    train (train.py:3)\n',
}
KIND_SAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    "dump": (
        A_DUMP,
        {"node": "node-a", "incident": 1, "time": 1.0, "processes": [_PROC], "files": ["/tmp/x"]},
    ),
    "dump_order": (K.dump_request, {"incident": 1, "time": 1.0, "reason": "crash"}),
    "verdict": (
        K.verdict(1),
        {
            "action": "replace_and_restart",
            "class": "gpu_oom",
            "nodes": ["node-a"],
            "ranks": [0],
            "reason": "r",
            "time": 1.0,
            "evidence": {"incident": 1},
        },
    ),
    "sample_order": (K.sample_request, {"round": 1, "time": 1.0}),
    "link_order": (K.link_request, {"id": 1, "time": 1.0}),
    "check_order": (K.check_request(1), {"incident": 1, "time": 1.0, "nodes": ["node-a"]}),
    "published": (
        K.version_current,
        {
            "id": "v2",
            "previous": "base",
            "seq": 1,
            "time": 1.0,
            "urgent": True,
            "window_s": None,
            "cause": "publish",
        },
    ),
    "excluded": (K.excluded, {"nodes": ["node-b"], "reasons": {"node-b": "oom"}}),
    "event": (
        K.event("node-b", 1),
        {
            "kind": "crash",
            "class": "gpu_oom",
            "node": "node-b",
            "rank": 0,
            "step": 3,
            "time": 1.0,
            "evidence": {},
        },
    ),
    "open": (
        K.open,
        {
            "incident": 1,
            "time": 1.0,
            "reason": "r",
            "events": [
                {"kind": "crash", "class": "gpu_oom", "node": "node-b", "rank": 0, "time": 1.0}
            ],
        },
    ),
}


def _consume(store, kind: str, key: str, link: ControllerLink, ctl: Controller) -> bool:
    """The real reader of ``kind`` over what ``key`` holds now; whether it acted on it."""
    if kind == "dump":
        doc = ctl._read(key, "node-a", wire.MAX_DUMP_BYTES)
        if doc is not None:
            processes, _ = _processes({"node-a": doc})
            localize(processes, None)
        return doc is not None
    if kind == "dump_order":
        link.answered = link._acked = 0
        return link.dump_order(force=True) is not None
    if kind == "verdict":
        got = link.verdict(1)
        return got is not None and link.local_action(got) in ("stop", "restart")
    if kind in ("sample_order", "link_order"):
        link._sampled = link._probed = 0
        link._last_link_poll = float("-inf")
        link.beat(0, {0: {"step": 3, "time": time.time(), "pid": os.getpid()}})
        started = link._sampler if kind == "sample_order" else link._prober
        link._sampler = link._prober = None
        if started is not None:
            started.join(5)
        return started is not None
    if kind == "check_order":
        link.checked = 0
        return link.check_order(1) is not None
    if kind == "published":
        try:
            return update.current(store, K) is not None
        except update.VersionError:
            return False
    if kind == "excluded":
        from bootseer.robust.standby import ExcludedNode, check_admission

        try:
            check_admission(store, "node-b")
        except ExcludedNode:
            return True
        return False
    if kind in ("event", "open"):  # the whole pass of the controller
        ctl._cursors.clear()
        for done in (K.seen("node-b"), K.incident, K.dump_request, K.verdict_last):
            store.delete_key(done)
        ctl.step()
        acted = wire.get(store, K.dump_request) is not None
        if kind == "event":
            store.delete_key(K.open)
        return acted and kind == "event"  # an open incident is only resumed: no new order
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", sorted(KIND_SAMPLES))
def test_fuzzed_records_never_raise_out_of_their_reader(store, capsys, kind: str) -> None:
    """200 mutations of a valid sealed record per kind: byte-level ones (no secret) are never
    acted on; JSON-level ones re-sealed under the job's secret (a writer's bug, not a forger)
    never raise out of the reader."""
    rng = random.Random(f"seal-{kind}")
    key, doc = KIND_SAMPLES[kind]
    if kind == "link_order":  # an order older than LINK_ORDER_S is not answered
        doc = {**doc, "time": time.time()}
    logs: list[str] = []
    link = _agent(store)
    ControllerLink(store, "node-b").register()
    if kind == "event":
        store.add(K.node("node-b", "events"), 1)
    ctl = Controller(store, log=logs.append, failslow_interval_s=0)
    valid = wire.sealed(key, doc, wire.MAX_DUMP_BYTES)
    store.set(key, valid)
    assert _consume(store, kind, key, link, ctl) or kind == "open"  # the genuine one is used
    if kind == "open":  # resumed, and closed (its wait is long over)
        assert wire.read(store, K.verdict(1))["evidence"]["incident"] == 1
    refused = 0
    for i in range(200):
        if i % 2 == 0:
            data = _mutate_bytes(rng, valid)
            if data == valid:
                continue
            store.set(key, data)
            assert not _consume(store, kind, key, link, ctl), data[:120]
            refused += 1
        else:
            body = json.dumps(_mutate_doc(rng, doc), separators=(",", ":")).encode()
            store.set(key, seal.seal(key, body))
            _consume(store, kind, key, link, ctl)  # may act, must not raise
    assert refused >= 90
    capsys.readouterr()


# -- live: bootseer controller and bootseer run, attacked through their store -----------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(
    what: str, check: Callable[[], Any], procs: list[subprocess.Popen], timeout_s: float = 120.0
) -> Any:
    """Polls ``check`` until it is truthy; fails naming ``what`` when a process exits first
    or it does not come (a bound on a hang, not a timed assertion)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := check():
            return got
        for proc in procs:
            assert proc.poll() is None, (
                f"{proc.args[:4]} exited with {proc.returncode} while waiting for {what}"
            )
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout_s:.0f} s")


COMMAND = """import json, os, sys, time
out = sys.argv[1]
with open(os.path.join(out, f"attempt-{os.environ['BOOTSEER_ATTEMPT']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
time.sleep(600)
"""


def test_live_forged_publish_and_poisoned_dumps_are_ignored_then_a_genuine_incident_is_handled(
    tmp_path,
) -> None:
    """The defects of issue 27 on the real processes: a publish with ``BASH_ENV`` from a
    process without the secret (by the CLI and by hand), a dump order with incident ``1e999``
    (unsealed and sealed), and a node's dump answer with ``"files": 7``. The controller and
    ``bootseer run`` stay up, the command never runs on the forged version, and a crash
    incident and then a genuine urgent publish are both handled."""
    from torch.distributed import TCPStore

    from bootseer.testing.cluster_host import wait_for_line

    port, out = _free_port(), tmp_path / "out"
    out.mkdir()
    (tmp_path / "cmd.py").write_text(COMMAND)
    evil = tmp_path / "evil.sh"
    evil.write_text(f"touch {tmp_path}/pwned\n")
    env = scenario_env()
    ctl = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bootseer",
            "controller",
            "--port",
            str(port),
            "--trace-dir",
            str(tmp_path / "ctl"),
            "--dump-wait",
            "10",
            "--failslow-interval",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "ctl.log", "w"),  # noqa: SIM115
        text=True,
        env=env,
    )
    run = None
    store_pid = None
    try:
        started = wait_for_line(ctl, "READY", "the controller", 60)
        assert "READY controller" in started
        client = TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bootseer",
                "run",
                "--controller",
                f"127.0.0.1:{port}",
                "--node",
                "n0",
                "--state-dir",
                str(tmp_path / "state"),
                "--trace-dir",
                str(tmp_path / "trace"),
                "--min-free-disk",
                "0",
                "--min-free-memory",
                "0",
                "--max-restarts",
                "5",
                "--backoff",
                "0.2",
                "--controller-wait",
                "10",
                "--",
                sys.executable,
                str(tmp_path / "cmd.py"),
                str(out),
            ],
            stderr=open(tmp_path / "run.log", "w"),
            env=env,
        )  # noqa: SIM115
        procs = [ctl, run]
        _until("attempt 0", lambda: (out / "attempt-0.json").exists(), procs)

        # 1. a publish with BASH_ENV, by the CLI without the secret: refused, nothing written
        no_secret = {k: v for k, v in env.items() if k != seal.SECRET_ENV}
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "bootseer",
                "controller",
                "publish",
                "--store",
                f"127.0.0.1:{port}",
                "--id",
                "v9",
                "--urgent",
                "--env",
                f"BASH_ENV={evil}",
            ],
            capture_output=True,
            text=True,
            env=no_secret,
            timeout=120,
        )
        assert cli.returncode == 2 and "BOOTSEER_JOB_SECRET" in cli.stderr
        assert wire.get(client, K.version_current) is None
        # ... and by hand, byte by byte, as a holder of the port would
        client.set(
            K.version("v9"),
            b'{"id":"v9","workdir":null,"env":{"BASH_ENV":"'
            + str(evil).encode()
            + b'"},"time":1.0}',
        )
        client.set(
            K.version_current, b'{"id":"v9","previous":"base","seq":99,"time":1.0,"urgent":true}'
        )
        # 2. a dump order with incident 1e999: unsealed, then sealed (a writer's bug)
        client.set(K.dump_request, b'{"incident":1e999,"time":1.0,"reason":"forged"}')
        _until(
            "the agent's warning",
            lambda: (
                "warning: bootseer/job/dump/request: not a "
                "sealed record" in (tmp_path / "run.log").read_text()
            ),
            procs,
        )
        _until(
            "the controller's warning",
            lambda: (
                "bootseer/job/version/current: not a "
                "published record" in (tmp_path / "ctl.log").read_text()
            ),
            procs,
        )
        client.set(K.dump_request, S(K.dump_request, b'{"incident":1e999,"time":1.0}'))
        assert int(client.add(K.incident, 0)) == 0  # the forged publish opened nothing

        # 3. incident 1: node n1 (the test, holding the secret) crashes; its dump answer is
        # poisoned ("files": 7), after acknowledging the order (so it is waited for)
        n1 = ControllerLink(client, "n1")
        n1.register()
        client.set(
            K.dump_ack("n1", 1), S(K.dump_ack("n1", 1), b'{"node":"n1","incident":1,"time":1.0}')
        )
        client.set(
            K.dump("n1", 1),
            S(K.dump("n1", 1), (b'{"node":"n1","incident":1,"time":1.0,"processes":[],"files":7}')),
        )
        n1.publish(Event("crash", "python_exception", node="n1", rank=1, time=time.time()))
        first = _until("the verdict of incident 1", lambda: wire.read(client, K.verdict(1)), procs)
        assert (first["action"], first["class"]) == ("restart_in_place", "python_exception")
        assert first["evidence"]["missing_dumps"] == ["n1"] and "n0" in first["evidence"]["dumps"]
        restarted = json.loads(
            _until(
                "attempt 1",
                lambda: (out / "attempt-1.json").exists() and (out / "attempt-1.json").read_text(),
                procs,
            )
        )
        assert restarted["BOOTSEER_VERSION"] == "base" and "BASH_ENV" not in restarted
        assert seal.SECRET_ENV not in restarted  # the command never gets the secret

        # 4. a genuine urgent publish: incident 2, the node restarts on it
        ok = subprocess.run(
            [
                sys.executable,
                "-m",
                "bootseer",
                "controller",
                "publish",
                "--store",
                f"127.0.0.1:{port}",
                "--id",
                "v2",
                "--urgent",
                "--env",
                "FOO=bar",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert ok.returncode == 0, ok.stderr
        second = _until("the verdict of incident 2", lambda: wire.read(client, K.verdict(2)), procs)
        assert (second["class"], second["evidence"]["update"]) == ("update", {"version": "v2"})
        updated = json.loads(
            _until(
                "attempt 2",
                lambda: (out / "attempt-2.json").exists() and (out / "attempt-2.json").read_text(),
                procs,
            )
        )
        assert (updated["BOOTSEER_VERSION"], updated["FOO"]) == ("v2", "bar")
        assert "BASH_ENV" not in updated and not (tmp_path / "pwned").exists()
        assert ctl.poll() is None and run.poll() is None  # both stayed up throughout
        log = (tmp_path / "ctl.log").read_text()
        assert "bootseer/job/node/n1/dump/1" in log and os.environ[seal.SECRET_ENV] not in log
        assert os.environ[seal.SECRET_ENV] not in (tmp_path / "run.log").read_text()
        store_pid = int(log.split("store started on port")[1].split("(pid ")[1].split(")")[0])
    finally:
        for proc in (run, ctl):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if store_pid is None:
            text = (tmp_path / "ctl.log").read_text()
            if "store started on port" in text:
                store_pid = int(
                    text.split("store started on port")[1].split("(pid ")[1].split(")")[0]
                )
        if store_pid is not None:
            os.kill(store_pid, signal.SIGTERM)
