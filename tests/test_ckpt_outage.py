"""A durable store's outage behind the memory tier: training goes on, nothing is lost, and an
outage past its bound, a permanent failure or a failed last save still reach the caller.

The store is moto's S3 server over real HTTP, stopped and started again on its port.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointManager, CheckpointSaveError
from ckpt.errors import CommitTimeout
from ckpt.memory import DURABLE_OUTAGE_ENV, MemoryConfig
from ckpt.outage import transient_save_failure


def _storage(options: dict) -> dict:
    return {"s3": options, "striped": {"retries": 1, "backoff_s": 0.02, "concurrency": 2}}


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((50_000,), float(step)), "b": torch.arange(8.0) + step}


def _shm(tmp_path: Path) -> str:
    """The memory tier's directory, as ``bootseer run`` makes it."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    return str(shm)


def _save_until(mgr: CheckpointManager, steps: range, done) -> int:
    """Save every step of ``steps`` (50 ms apart) until ``done()``; the last step saved."""
    for step in steps:
        mgr.save(step, _state(step))
        if done():
            return step
        time.sleep(0.05)
    raise AssertionError(f"{done} never held over steps {steps.start}..{steps.stop}")


def _saved_once(
    s3_bucket: tuple[str, dict], memory: MemoryConfig | bool
) -> tuple[CheckpointManager, dict]:
    """A manager on the test's bucket (over striped::s3) that has made step 0 durable."""
    bucket, options = s3_bucket
    mgr = CheckpointManager(
        f"striped::s3://{bucket}/run", storage_options=_storage(options), memory=memory
    )
    mgr.save(0, _state(0), block=True)
    return mgr, options


def test_a_store_outage_is_ridden_out_behind_the_memory_tier(
    tmp_path: Path, s3_server, s3_bucket, caplog: pytest.LogCaptureFixture
) -> None:
    bucket, options = s3_bucket
    url = f"striped::s3://{bucket}/run"
    shm = _shm(tmp_path)
    memory = MemoryConfig(shm, durable_every=2, durable_outage_s=120)
    caplog.set_level(logging.INFO, logger="ckpt")
    with CheckpointManager(url, storage_options=_storage(options), memory=memory) as mgr:
        mgr.save(0, _state(0), block=True)
        assert mgr.latest() == 0
        s3_server.stop()
        try:
            # the durable save of step 2 fails in the background; saves go on, none raises
            last = _save_until(mgr, range(1, 400), lambda: "training goes on" in caplog.text)
        finally:
            s3_server.start()
        # the store is back: the next durable save commits, and says how long it was out
        last = _save_until(mgr, range(last + 1, last + 400), lambda: "is back" in caplog.text)
        mgr.wait()
        durable = mgr.latest()
        assert durable is not None and durable > 2
    fails = [r for r in caplog.records if "training goes on" in r.getMessage()]
    assert fails and all(r.levelno == logging.WARNING for r in fails)
    # a restart resumes from the newest step in memory, bit for bit; the durable tier holds
    # one committed after the outage
    with CheckpointManager(url, storage_options=_storage(options), memory=MemoryConfig(shm)) as mgr:
        target = _state(-1)
        assert mgr.load(target) == last
        assert all(torch.equal(target[k], v) for k, v in _state(last).items())
    with CheckpointManager(url, storage_options=_storage(options), memory=False) as mgr:
        target = _state(-1)
        assert mgr.load(target) == durable
        assert all(torch.equal(target[k], v) for k, v in _state(durable).items())


def test_while_the_store_fails_a_save_in_flight_is_not_waited_for(
    tmp_path: Path, s3_server, s3_bucket, caplog: pytest.LogCaptureFixture
) -> None:
    """A working store keeps the durable cadence (a due save waits for the previous one);
    once a durable save failed, one still in flight (the store hanging, 1 s each way here) is
    skipped: the training thread never waits on a failing store."""
    from bootseer.testing.shaper import Shaper, ShaperSettings

    bucket, _ = s3_bucket
    caplog.set_level(logging.INFO, logger="ckpt")
    with Shaper("127.0.0.1", s3_server.port, ShaperSettings()) as shaper:
        options = s3_server.storage_options(endpoint_url=f"http://{shaper.address}")
        memory = MemoryConfig(_shm(tmp_path), durable_every=1, durable_outage_s=120)
        with CheckpointManager(
            f"striped::s3://{bucket}/run", storage_options=_storage(options), memory=memory
        ) as mgr:
            for step in range(3):  # the store works: every save durable, none skipped
                mgr.save(step, _state(step))
            mgr.wait()
            assert mgr.latest() == 2 and "skipped" not in caplog.text
            shaper.set_refuse(True)
            shaper.drop_active()
            last = _save_until(mgr, range(3, 400), lambda: "training goes on" in caplog.text)
            shaper.set_refuse(False)
            shaper.update(ShaperSettings(latency_s=1.0))  # up again, but each request slow
            last = _save_until(
                mgr,
                range(last + 1, last + 400),
                lambda: "skipped: the store is failing" in caplog.text,
            )
            shaper.update(ShaperSettings())
            _save_until(mgr, range(last + 1, last + 400), lambda: "is back" in caplog.text)


def test_an_outage_past_its_bound_is_raised_naming_it(tmp_path: Path, s3_server, s3_bucket) -> None:
    mgr, options = _saved_once(
        s3_bucket, MemoryConfig(_shm(tmp_path), durable_every=1, durable_outage_s=0.5)
    )
    s3_server.stop()
    try:
        with pytest.raises(CheckpointSaveError, match="ckpt.durable_outage_s") as err:
            _save_until(mgr, range(1, 400), lambda: False)
        message = str(err.value)
        assert "since step 1" in message and "memory tier holds step" in message
        assert options["key"] not in message and options["secret"] not in message
    finally:
        s3_server.start()
        mgr.close()  # nothing in flight: the raise started no new save


def test_a_permanent_failure_is_raised_at_the_next_save(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's directory should be")
    memory = MemoryConfig(_shm(tmp_path), durable_every=1, durable_outage_s=600)
    mgr = CheckpointManager(f"file://{blocker}/run", memory=memory)
    mgr.save(0, _state(0))
    while mgr._pending is not None and not mgr._pending.done():
        time.sleep(0.01)
    with pytest.raises(CheckpointSaveError, match="step 0"):
        mgr.save(1, _state(1))
    mgr.close()


def test_the_last_save_failing_is_raised_by_close_within_the_bound(
    tmp_path: Path, s3_server, s3_bucket
) -> None:
    mgr, _ = _saved_once(
        s3_bucket, MemoryConfig(_shm(tmp_path), durable_every=1, durable_outage_s=600)
    )
    s3_server.stop()
    try:
        mgr.save(1, _state(1))
        with pytest.raises(CheckpointSaveError, match="step 1"):
            mgr.close()
    finally:
        s3_server.start()


def test_without_the_memory_tier_the_first_failure_is_raised(
    tmp_path: Path, s3_server, s3_bucket
) -> None:
    mgr, _ = _saved_once(s3_bucket, False)
    s3_server.stop()
    try:
        handle = mgr.save(1, _state(1))
        while not handle.done():
            time.sleep(0.01)
        with pytest.raises(CheckpointSaveError, match="step 1"):
            mgr.save(2, _state(2))
    finally:
        s3_server.start()
        mgr.close()


def test_which_failures_are_transient() -> None:
    refused = CheckpointSaveError("checkpoint step 3 failed: refused", step=3)
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert transient_save_failure(refused)
    assert transient_save_failure(CommitTimeout("step 3: rank(s) [1] did not report", step=3))
    missing = CheckpointSaveError("checkpoint step 3 failed", step=3)
    missing.__cause__ = FileNotFoundError("no such bucket")
    assert not transient_save_failure(missing)
    assert not transient_save_failure(CheckpointSaveError("bug", step=3))


def test_the_bound_comes_from_the_agent_and_bad_values_are_refused(tmp_path: Path) -> None:
    from ckpt import CheckpointError
    from ckpt.memory import DIR_ENV

    env = {DIR_ENV: str(tmp_path), DURABLE_OUTAGE_ENV: "90"}
    config = MemoryConfig.from_env(env)
    assert config is not None and config.durable_outage_s == 90.0
    assert MemoryConfig.from_env({DIR_ENV: str(tmp_path)}).durable_outage_s == 600.0
    with pytest.raises(CheckpointError, match=f"{DURABLE_OUTAGE_ENV}='ten'"):
        MemoryConfig.from_env({**env, DURABLE_OUTAGE_ENV: "ten"})
