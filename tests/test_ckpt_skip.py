"""Checkpoints saved after a NaN by the attempt that hit it are passed over on restart
(ckpt/skip.py), in both tiers, while the new attempt's own saves of the same steps count."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointManager
from ckpt.memory import MemoryConfig
from ckpt.skip import SKIP_ENV, SkipRule, poisoned, rules_from_env, to_env


def test_rules_round_trip_and_a_malformed_value_is_ignored(caplog) -> None:
    rules = [SkipRule(12, 1000.5, "nonfinite verdict"), SkipRule(40, 2000.0)]
    assert rules_from_env({SKIP_ENV: to_env(rules)}) == rules
    assert rules_from_env({}) == []
    assert rules_from_env({SKIP_ENV: '[{"step": 3}]'}) == []
    assert SKIP_ENV in caplog.text
    assert poisoned(rules, 11, 0.0) is None
    assert "step 12 was saved after a non-finite value at step 12" in poisoned(rules, 12, 999.0)
    assert poisoned(rules, 12, 1001.0) is None  # saved by the new attempt
    assert poisoned(rules, 45, None) is not None  # no time known: counted as before


@pytest.mark.parametrize("tier", ["durable", "memory"])
def test_steps_from_the_nan_on_are_passed_over_until_saved_again(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/durable"
    (shm := tmp_path / "shm").mkdir(mode=0o700)
    memory = MemoryConfig(str(shm), durable_every=100) if tier == "memory" else False
    nan = 5 if tier == "memory" else 4  # memory holds the newest two copies: steps 4 and 5

    def manager() -> CheckpointManager:
        return CheckpointManager(url, memory=memory, keep=None)

    with manager() as mgr:
        for step in range(6):  # memory: the durable tier holds step 0 only
            mgr.save(
                step,
                {"w": torch.full((64,), float(step) if step < nan else float("nan"))},
                block=True,
            )
    monkeypatch.setenv(SKIP_ENV, to_env([SkipRule(nan, time.time(), "test")]))
    state = {"w": torch.zeros(64)}
    with manager() as mgr:
        if tier == "durable":
            assert mgr.latest() == nan - 1
        report = mgr.load_with_report(state)
        assert report.step == nan - 1
        assert torch.equal(state["w"], torch.full((64,), float(nan - 1)))
        if tier == "memory":
            assert report.source == "local"  # type: ignore[attr-defined]
        time.sleep(0.01)
        mgr.save(nan, {"w": torch.full((64,), 44.0)}, block=True)  # the new attempt's own
    with manager() as mgr:
        assert mgr.load(state) == nan and torch.equal(state["w"], torch.full((64,), 44.0))
