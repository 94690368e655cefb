"""``bootseer run``: the wrapper as a container runs it (a real subprocess supervising tiny
commands from run_helpers.py), its faults injected one by one, and the training client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from run_helpers import (
    child,
    process_gone,
    read_until,
    run_wrapper,
    spans,
    start_wrapper,
    wait_for,
    wrapper_argv,
    wrapper_env,
    zombies_of,
)

from bootseer import client
from bootseer.supervise import AttemptEnd, RestartPolicy, Supervisor, exit_code
from bootseer.testing.servers import free_port

GUARD = 60  # seconds: only a guard against a wrapper that never returns


def phases(trace: Path, phase: str) -> list[dict]:
    return [s for s in spans(trace) if s["phase"] == phase]


# -- exit codes --------------------------------------------------------------------------------


def test_exit_code_is_the_commands(tmp_path):
    proc = run_wrapper(tmp_path / "trace", "--max-restarts", "0", command=child("exit", 3))
    assert proc.returncode == 3, proc.stderr
    assert "command exited with exit code 3" in proc.stderr


def test_killed_by_a_signal_is_128_plus_it(tmp_path):
    proc = run_wrapper(tmp_path / "trace", "--max-restarts", "0", command=child("kill-self"))
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "signal SIGKILL" in proc.stderr


def test_command_not_found_is_127_and_named(tmp_path):
    proc = run_wrapper(
        tmp_path / "trace", "--max-restarts", "3", command=["bootseer-no-such-command", "--flag"]
    )
    assert proc.returncode == 127
    assert "command not found: bootseer-no-such-command" in proc.stderr
    assert "Traceback" not in proc.stderr
    [start] = phases(tmp_path / "trace", "command_start")  # nothing retried
    assert start["outcome"] == "failed"
    assert not phases(tmp_path / "trace", "restart")


def test_nothing_to_run_is_a_usage_error(tmp_path):
    proc = run_wrapper(tmp_path / "trace", command=[])
    assert proc.returncode == 2
    assert "nothing to run" in proc.stderr


# -- signals -----------------------------------------------------------------------------------


def test_sigterm_is_forwarded_and_the_commands_exit_returned(tmp_path):
    started, marker = tmp_path / "started", tmp_path / "marker"
    wrapper = start_wrapper(tmp_path / "trace", command=child("trap-term", started, marker))
    try:
        wait_for(started.exists, "the command to start")
        wrapper.send_signal(signal.SIGTERM)
        _, err = wrapper.communicate(timeout=GUARD)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 0, err
    assert marker.read_text() == "got SIGTERM"
    assert "SIGTERM: forwarded to the command" in err
    assert len(phases(tmp_path / "trace", "command_start")) == 1  # a stop is not restarted


@pytest.mark.parametrize("name", ["SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR2"])
def test_other_signals_are_forwarded_too(tmp_path, name):
    started, marker = tmp_path / "started", tmp_path / "marker"
    wrapper = start_wrapper(tmp_path / "trace", command=child("trap-term", started, marker, name))
    try:
        wait_for(started.exists, "the command to start")
        wrapper.send_signal(getattr(signal, name))
        _, err = wrapper.communicate(timeout=GUARD)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 0, err
    assert marker.read_text() == f"got {name}"
    assert len(phases(tmp_path / "trace", "command_start")) == 1  # a clean exit: no restart


def test_what_the_command_leaves_running_is_stopped(tmp_path):
    pid_file = tmp_path / "sleeper"
    wrapper = start_wrapper(tmp_path / "trace", command=child("leave-behind", pid_file))
    try:
        _, err = wrapper.communicate(timeout=GUARD)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 0, err
    sleeper = int(pid_file.read_text())
    wait_for(lambda: process_gone(sleeper), "the left-behind sleeper to be stopped")


def test_a_second_sigterm_kills_a_command_that_ignores_the_first(tmp_path):
    started = tmp_path / "started"
    wrapper = start_wrapper(
        tmp_path / "trace", "--max-restarts", "3", command=child("ignore-term", started)
    )
    try:
        pid = int(
            wait_for(lambda: started.exists() and started.read_text(), "the command to start")
        )
        wrapper.send_signal(signal.SIGTERM)
        first = read_until(wrapper.stderr, "SIGTERM: forwarded to the command")
        assert Path(f"/proc/{pid}").exists()  # ignored: still running
        wrapper.send_signal(signal.SIGTERM)
        _, err = wrapper.communicate(timeout=GUARD)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 128 + signal.SIGKILL, first + err
    assert "SIGTERM again: killing the command" in err
    assert process_gone(pid)
    assert len(phases(tmp_path / "trace", "command_start")) == 1


def test_sigusr1_asks_for_stacks_without_killing(tmp_path):
    started, go = tmp_path / "started", tmp_path / "go"
    trace = tmp_path / "trace"
    wrapper = start_wrapper(trace, command=child("dump-on-demand", started, go))
    try:
        pid = int(
            wait_for(lambda: started.exists() and started.read_text(), "the command to start")
        )
        wrapper.send_signal(signal.SIGUSR1)
        dump = trace / f"stacks-testnode-rank0-{pid}.txt"
        wait_for(
            lambda: dump.exists() and "sleepy_forever_function_waits" in dump.read_text(),
            "the stack dump",
        )
        go.touch()
        _, err = wrapper.communicate(timeout=GUARD)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 0, err
    assert "stack dump requested from 1 process(es)" in err


def _unshare() -> list[str]:
    """A new PID namespace (and its /proc) where the wrapper is PID 1, as in a container."""
    argv = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        ok = subprocess.run([*argv, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("cannot create a PID namespace here (unshare needs root)")
    return argv


def test_as_pid_1_signals_reach_the_command_and_its_code_comes_back(tmp_path):
    unshare = _unshare()
    argv = wrapper_argv(tmp_path / "t1", "--max-restarts", "0", command=child("exit", 3))
    proc = subprocess.run(
        [*unshare, *argv], env=wrapper_env(), capture_output=True, text=True, timeout=GUARD
    )
    assert proc.returncode == 3, proc.stderr
    started, marker = tmp_path / "started", tmp_path / "marker"
    wrapper = subprocess.Popen(
        [*unshare, *wrapper_argv(tmp_path / "t2", command=child("trap-term", started, marker))],
        env=wrapper_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(started.exists, "the command to start")
        os.killpg(wrapper.pid, signal.SIGTERM)  # unshare passes it on; PID 1 has a handler
        _, err = wrapper.communicate(timeout=GUARD)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 0, err
    assert marker.read_text() == "got SIGTERM"
    assert json.loads(started.read_text())["ppid"] == 1  # the wrapper was PID 1


def test_a_stop_during_startup_ends_the_run_before_the_command(tmp_path):
    release = threading.Event()

    def slow_phases(attempt: int) -> dict[str, str]:
        os.kill(os.getpid(), signal.SIGTERM)  # docker stop while the checkpoint downloads
        release.wait(GUARD)
        return {}

    previous = signal.getsignal(signal.SIGTERM)
    marker = tmp_path / "marker"
    try:
        code = Supervisor(
            child("touch", marker), before_attempt=slow_phases, log=lambda line: None
        ).run()
    finally:
        release.set()
    assert code == 128 + signal.SIGTERM
    assert not marker.exists()
    assert signal.getsignal(signal.SIGTERM) is previous  # the handlers are given back


# -- zombies -----------------------------------------------------------------------------------


def test_orphans_are_reaped(tmp_path):
    grandchild, go = tmp_path / "grandchild", tmp_path / "go"
    wrapper = start_wrapper(tmp_path / "trace", command=child("double-fork", grandchild, go))
    try:
        info = json.loads(
            wait_for(lambda: grandchild.exists() and grandchild.read_text(), "the grandchild")
        )
        assert info["ppid"] == wrapper.pid  # the wrapper is its subreaper
        wait_for(lambda: process_gone(info["pid"]), "the orphan to be reaped")
        assert zombies_of(wrapper.pid) == []
        go.touch()
        _, err = wrapper.communicate(timeout=GUARD)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 0, err


# -- restarts ----------------------------------------------------------------------------------


def test_a_crash_is_restarted_and_traced(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(trace, "--max-restarts", "2", command=child("crash-once", counter))
    assert proc.returncode == 0, proc.stderr
    assert counter.read_text() == "2"
    assert "restart 1/2" in proc.stderr
    assert [s["attempt"] for s in phases(trace, "command_start")] == [0, 1]
    assert [s["attempt"] for s in phases(trace, "environment")] == [0, 1]  # phases rerun
    [restart] = phases(trace, "restart")
    assert restart["attempt"] == 1
    assert (restart["detail"]["reason"], restart["detail"]["exit_code"]) == ("crash", 5)
    [first] = phases(trace, "first_step")
    assert (first["attempt"], first["rank"]) == (1, 0)


def test_restarts_stop_at_the_limit(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(trace, "--max-restarts", "2", command=child("always-fail", counter))
    assert proc.returncode == 4, proc.stderr
    assert counter.read_text() == "3"  # the first start and two restarts
    assert "no restarts left (2 allowed)" in proc.stderr
    assert [s["attempt"] for s in phases(trace, "restart")] == [1, 2]


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(max_restarts=5, backoff_s=1.5, backoff_max_s=5.0)
    assert [policy.delay(n) for n in range(1, 5)] == [1.5, 3.0, 5.0, 5.0]


def test_exit_statuses_read_as_a_shell_does():
    assert exit_code(3 << 8) == 3
    assert exit_code(signal.SIGKILL) == 137
    assert AttemptEnd(0, 137, "signaled").describe() == "signal SIGKILL"
    assert AttemptEnd(0, 3, "exited").describe() == "exit code 3"


# -- the client and hangs ----------------------------------------------------------------------


def test_ready_gives_a_first_step_span(tmp_path):
    trace = tmp_path / "trace"
    proc = run_wrapper(trace, command=child("ready"))
    assert proc.returncode == 0, proc.stderr
    [first] = phases(trace, "first_step")
    [env] = phases(trace, "environment")
    [start] = phases(trace, "command_start")
    assert (first["rank"], first["attempt"], first["node"]) == (0, 0, "testnode")
    # from the start of the attempt (before its phases) to ready(): time to first step
    assert first["start"] <= env["start"] <= start["end"] <= first["end"]
    assert "first step: rank 0 ready" in proc.stderr
    assert not list(trace.glob("stacks-*"))  # empty dump files are cleaned up


@pytest.mark.parametrize("code", [0, 3])
def test_the_control_directory_is_removed_when_the_run_ends(tmp_path, code):
    """The ranks' ready/heartbeat/status files live in a private bootseer-control-* directory
    of TMPDIR: a run that ends, well or not, removes it with what the ranks wrote there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = 'echo "control=$BOOTSEER_CONTROL_DIR"; echo "{}" > "$BOOTSEER_CONTROL_DIR/ready-0"'
    proc = run_wrapper(
        tmp_path / "trace",
        "--max-restarts",
        "0",
        command=["sh", "-c", f"{script}; exit {code}"],
        env={"TMPDIR": str(tmp)},
    )
    assert proc.returncode == code, proc.stderr
    control = Path(proc.stdout.split("control=", 1)[1].splitlines()[0])
    assert control.parent == tmp and control.name.startswith("bootseer-control-"), control
    assert not control.exists() and list(tmp.iterdir()) == []


def test_a_hang_is_dumped_killed_and_restarted(tmp_path):
    trace, counter = tmp_path / "trace", tmp_path / "count"
    proc = run_wrapper(
        trace,
        "--hang-timeout",
        "1",
        "--dump-wait",
        "20",
        "--max-restarts",
        "1",
        command=child("hang-once", counter),
    )
    assert proc.returncode == 0, proc.stderr
    assert counter.read_text() == "2"
    assert "hang: no heartbeat for" in proc.stderr
    [hang] = phases(trace, "hang")
    assert (hang["attempt"], hang["outcome"], hang["detail"]["last_step"]) == (0, "killed", 1)
    [dump] = hang["detail"]["stacks"]
    text = (trace / dump).read_text()
    assert "sleepy_forever_function" in text
    assert process_gone(hang["detail"]["pid"])
    [restart] = phases(trace, "restart")
    assert (restart["attempt"], restart["detail"]["reason"]) == (1, "hang")
    assert [s["attempt"] for s in phases(trace, "first_step")] == [0, 1]


def test_client_is_a_no_op_outside_the_wrapper(tmp_path, monkeypatch):
    monkeypatch.delenv("BOOTSEER_CONTROL_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    client.ready()
    client.heartbeat(3)
    assert list(tmp_path.iterdir()) == []


def test_heartbeats_are_rate_limited_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOTSEER_CONTROL_DIR", str(tmp_path))
    monkeypatch.delenv("BOOTSEER_TRACE_DIR", raising=False)  # no SIGUSR1 hook in pytest
    monkeypatch.setattr(client, "_status_pid", 0)  # nor exit hooks (the status record)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(client, "_last_heartbeat", float("-inf"))
    clock = [1000.0]
    monkeypatch.setattr(client, "_clock", lambda: clock[0])
    client.heartbeat(1)
    client.heartbeat(2)  # within the second: dropped
    assert json.loads((tmp_path / "heartbeat-5").read_text())["step"] == 1
    clock[0] += 1.0
    client.heartbeat(3)
    assert json.loads((tmp_path / "heartbeat-5").read_text())["step"] == 3
    client.ready()
    assert json.loads((tmp_path / "ready-5").read_text())["rank"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heartbeat-5", "ready-5"]


# -- startup phases ----------------------------------------------------------------------------


def test_a_failing_environment_keeps_the_job_from_starting(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("--no-index\nbootseer-no-such-package-xyz\n")
    marker = tmp_path / "marker"
    proc = run_wrapper(
        tmp_path / "trace",
        "--env-spec",
        str(req),
        "--env-prefix",
        str(tmp_path / "venv"),
        "--env-store",
        str(tmp_path / "store"),
        command=child("touch", marker),
    )
    assert proc.returncode != 0
    assert not marker.exists()
    assert f"environment {tmp_path / 'venv'} from {req} could not be made" in proc.stderr
    assert "bootseer-no-such-package-xyz" in proc.stderr  # the installer's own words
    assert "Traceback" not in proc.stderr
    [env] = phases(tmp_path / "trace", "environment")
    assert env["outcome"] == "failed"
    assert not phases(tmp_path / "trace", "command_start")


def test_the_environment_is_on_the_commands_path(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("")
    out, prefix = tmp_path / "env.json", tmp_path / "venv"
    flags = [
        "--env-spec",
        str(req),
        "--env-prefix",
        str(prefix),
        "--env-store",
        str(tmp_path / "store"),
    ]
    proc = run_wrapper(tmp_path / "trace", *flags, command=["python", *child("touch", out)[1:]])
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    assert seen["VIRTUAL_ENV"] == str(prefix)
    assert (seen["BOOTSEER_ATTEMPT"], seen["BOOTSEER_NODE"]) == ("0", "testnode")
    assert seen["BOOTSEER_TRACE_DIR"] == str(tmp_path / "trace")
    assert seen["BOOTSEER_CONTROL_DIR"]
    assert seen["PATH"].split(os.pathsep)[0] == str(prefix / "bin")
    [env] = phases(tmp_path / "trace", "environment")
    assert env["detail"]["outcome"] == "built"
    proc = run_wrapper(tmp_path / "trace", *flags, command=child("exit", 0))  # the warm path
    assert phases(tmp_path / "trace", "environment")[-1]["detail"]["outcome"] == "verified"


def _unreachable_s3() -> dict[str, str]:
    options = {
        "s3": {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {
                "endpoint_url": f"http://127.0.0.1:{free_port()}",
                "region_name": "us-east-1",
            },
        },
        "striped": {"retries": 0},
    }
    return {"BOOTSEER_STORAGE_OPTIONS": json.dumps(options)}


def test_an_unreachable_checkpoint_store_fails_loudly(tmp_path):
    marker, url = tmp_path / "marker", "s3://bootseer-unreachable/run1"
    proc = run_wrapper(
        tmp_path / "trace",
        "--ckpt-url",
        url,
        "--ckpt-cache-dir",
        str(tmp_path / "cache"),
        command=child("touch", marker),
        env=_unreachable_s3(),
    )
    assert proc.returncode == 2
    assert not marker.exists()
    assert f"checkpoint store {url} is unreachable, the job does not start" in proc.stderr
    assert "--allow-fresh-start" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_warm_node_holding_a_committed_step_starts_its_command_before_the_store(tmp_path):
    """A node whose cache holds a committed step (``bootseer warmup``, an earlier prefetch)
    starts the command without waiting for the store (its client's import and a listing:
    0.8 s of the warm restart): the job cannot start fresh from there, and its load takes
    the store's newest step. So an unreachable store only costs the prefetch, said as a
    warning, and the command ran; with the record or a rank's index missing, the job does
    not start (the test above)."""
    from ckpt.cache import NodeCache
    from ckpt.layout import MANIFEST, index_name

    url, cache = "s3://bootseer-unreachable/run1", tmp_path / "cache"
    step = NodeCache(cache, url).root / "step-3"
    step.mkdir(parents=True)
    (step / index_name(0)).write_text("{}")

    def run(marker: Path) -> subprocess.CompletedProcess:
        return run_wrapper(
            tmp_path / f"trace-{marker.name}",
            "--ckpt-url",
            url,
            "--ckpt-cache-dir",
            str(cache),
            "--ranks",
            "0",
            command=child("touch-until", marker, tmp_path / f"trace-{marker.name}", "prefetch"),
            env=_unreachable_s3(),
        )

    proc = run(tmp_path / "no-record")  # the rank's index, no commit record: not held
    assert proc.returncode == 2 and not (tmp_path / "no-record").exists(), proc.stderr
    (step / MANIFEST).write_text("{}")
    proc = run(tmp_path / "held")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "held").exists()
    assert "checkpoint_prefetch" in proc.stderr and "warning" in proc.stderr
    [span] = phases(tmp_path / "trace-held", "checkpoint_prefetch")
    assert span["detail"]["held_step"] == 3 and span["outcome"] != "ok"
    assert "Traceback" not in proc.stderr


def test_an_unreadable_cache_still_only_costs_the_cache(tmp_path):
    """The warm check reads the node cache before anything else: a cache whose store
    directory is not a directory (a damaged disk, a stray file) must not stop the job, as
    the prefetch's own failure there never did: the command starts."""
    from ckpt.cache import NodeCache, held_step

    store, cache = tmp_path / "ckpt", tmp_path / "cache"
    store.mkdir()
    root = NodeCache(cache, str(store)).root
    root.parent.mkdir(parents=True)
    root.write_text("not a directory")
    with pytest.raises(OSError):
        held_step(cache, str(store), [0])
    marker = tmp_path / "ran"
    proc = run_wrapper(
        tmp_path / "trace",
        "--ckpt-url",
        str(store),
        "--ckpt-cache-dir",
        str(cache),
        "--ranks",
        "0",
        command=child("touch", marker),
    )
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()


def test_an_unreachable_checkpoint_store_with_fresh_starts_allowed(tmp_path):
    marker, url = tmp_path / "marker", "s3://bootseer-unreachable/run1"
    proc = run_wrapper(
        tmp_path / "trace",
        "--ckpt-url",
        url,
        "--ckpt-cache-dir",
        str(tmp_path / "cache"),
        "--allow-fresh-start",
        command=child("touch", marker),
        env=_unreachable_s3(),
    )
    assert proc.returncode == 0, proc.stderr
    assert marker.exists()
    assert "starting fresh" in proc.stderr
    [span] = phases(tmp_path / "trace", "checkpoint_prefetch")
    assert span["outcome"] == "skipped"
    assert "unreachable" in span["detail"]["reason"]


def test_the_latest_checkpoint_is_prefetched_for_the_command(tmp_path):
    torch = pytest.importorskip("torch")
    from ckpt import CheckpointManager

    store, cache, out = tmp_path / "ckpt", tmp_path / "cache", tmp_path / "out.json"
    with CheckpointManager(str(store)) as mgr:
        mgr.save(1, {"w": torch.ones(1000), "step": 1}, block=True)
        mgr.save(2, {"w": torch.full((1000,), 2.0), "step": 2}, block=True)
    trace = tmp_path / "trace"
    proc = run_wrapper(
        trace,
        "--ckpt-url",
        str(store),
        "--ckpt-cache-dir",
        str(cache),
        "--ranks",
        "0",
        command=child("ckpt-load", store, out),
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    assert seen["cache"] == str(cache)
    assert (seen["step"], seen["sum"]) == (2, 2000.0)
    assert seen["cached_files"] > 0  # the command read the node-local copy
    [span] = phases(trace, "checkpoint_prefetch")
    assert (span["outcome"], span["detail"]["step"]) == ("ok", 2)
    assert span["bytes"] > 0


def test_config_errors_name_the_key(tmp_path):
    proc = run_wrapper(tmp_path / "trace", "--max-restarts", "many", command=child("exit", 0))
    assert proc.returncode == 2
    assert "restart.max_restarts" in proc.stderr


def test_a_handed_over_cache_naming_another_directory_stops_the_start(tmp_path):
    """BOOTSEER_CKPT_CACHE is what run hands its command, not a setting (earlier versions of
    warmup read it): one naming another directory than ckpt.cache_dir would fill one cache
    while the job reads the other, so the start is refused, naming the setting to use."""
    marker, cache = tmp_path / "marker", tmp_path / "cache"
    proc = run_wrapper(
        tmp_path / "trace",
        "--ckpt-url",
        str(tmp_path / "store"),
        "--ckpt-cache-dir",
        str(cache),
        command=child("touch", marker),
        env={"BOOTSEER_CKPT_CACHE": str(tmp_path / "old-cache")},
    )
    assert proc.returncode == 2 and not marker.exists()
    assert (
        f"BOOTSEER_CKPT_CACHE={tmp_path / 'old-cache'} is what `bootseer run` hands" in proc.stderr
    )
    assert f"ckpt.cache_dir = '{cache}' (flag --ckpt-cache-dir)" in proc.stderr
    assert "set BOOTSEER_CKPT_CACHE_DIR" in proc.stderr and "Traceback" not in proc.stderr
    assert not cache.exists() and not (tmp_path / "old-cache").exists()


def test_a_parked_standby_is_no_hang_and_its_own_end_stays_on_its_node(tmp_path):
    """A spare's launcher waits at the rendezvous with no rank for as long as the job runs:
    past the startup allowance that is a hang for a job's node, not for a spare (``--standby``);
    and a parked launcher that ends on its own is restarted on its node, counted, never
    published (it ran no rank of the job)."""
    from bootseer.supervise import HangPolicy

    parked = [sys.executable, "-c", "import time; time.sleep(2.0)"]
    hang = HangPolicy(timeout_s=0.5, dump_wait_s=0.5, startup_s=1.0)
    said: list[str] = []
    job_node = Supervisor(parked, hang=hang, restart=RestartPolicy(0), log=said.append)
    assert job_node.run() != 0
    assert any("hang" in line for line in said), said
    spare = Supervisor(parked, hang=hang, restart=RestartPolicy(0), standby=True, log=said.append)
    assert spare.run() == 0
    assert spare.attempts[0].detail.get("parked") is True
    failing = Supervisor(
        [sys.executable, "-c", "raise SystemExit(3)"],
        hang=hang,
        restart=RestartPolicy(1, backoff_s=0.01),
        standby=True,
        agent=_agent(tmp_path),
        log=said.append,
    )
    assert failing.run() == 3
    assert len(failing.attempts) == 2  # one restart allowed: the spare's own end counts
    assert sum("the parked launcher ended with exit code 3" in line for line in said) == 2


def _agent(tmp_path: Path):
    from bootseer.robust.agent import Agent
    from bootseer.trace import TraceWriter

    return Agent(TraceWriter(tmp_path / "trace", "spare"), "spare")


def test_a_spare_joins_at_once_only_when_this_verdict_left_a_place(tmp_path, monkeypatch):
    """Evicted or lost in this incident: the spare joins at once. Nodes gone in an earlier
    incident (``not_waited_for``) were replaced since: the spare waits for the job's nodes
    to form the round (here none ever does: it joins when the wait ends)."""
    import datetime

    from torch.distributed import TCPStore

    import bootseer.supervise as supervise
    from bootseer.robust.events import Verdict
    from bootseer.robust.remote import ControllerLink

    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
    monkeypatch.setattr(supervise, "SPARE_REJOIN_WAIT_S", 0.5)
    said: list[str] = []
    spare = Supervisor(
        ["true"],
        standby=True,
        agent=_agent(tmp_path),
        remote=ControllerLink(store, "spare"),
        log=said.append,
    )
    spare._signals = supervise._Signals()
    try:
        for verdict, expect in (
            (Verdict("replace_and_restart", "hang", nodes=("node1",)), "at once"),
            (
                Verdict("restart_in_place", "gloo_error", evidence={"missing_dumps": ["node3"]}),
                "at once",
            ),
            (
                Verdict(
                    "restart_in_place", "python_exception", evidence={"not_waited_for": ["node3"]}
                ),
                "not complete after",
            ),
            (Verdict("restart_in_place", "python_exception"), "not complete after"),
        ):
            said.clear()
            spare._spare_rejoin(AttemptEnd(1, 137, "verdict", detail={"verdict": verdict}))
            assert any(expect in line for line in said), (verdict, said)
    finally:
        spare._signals.close()
