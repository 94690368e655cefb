"""The memory tier's hand-off (``ckpt/memory_env.py``): what ``bootseer run`` sets is what
``MemoryConfig.from_env`` reads, the run's settings are refused before anything exists, and
the agent's side loads neither torch nor numpy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import modules_loaded_by

from ckpt import check_memory_settings, memory_handoff

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = '{"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}'


def test_what_the_agent_hands_on_is_what_the_trainer_reads(tmp_path: Path) -> None:
    from ckpt.memory import MemoryConfig

    env = memory_handoff(
        str(tmp_path),
        fresh=True,
        server="10.0.0.5:7070",
        durable_every=100,
        durable_outage_s=90,
        layout=LAYOUT,
        replication="sync",
    )
    config = MemoryConfig.from_env(env)
    assert config is not None
    assert (config.directory, config.server, config.durable_every) == (
        str(tmp_path),
        "10.0.0.5:7070",
        100,
    )
    assert config.check_durable is False  # a fresh directory is never older than durable
    assert config.layout == json.loads(LAYOUT)
    assert (config.replication, config.durable_outage_s) == ("sync", 90.0)


def test_the_defaults_hand_on_only_the_directory_and_the_outage_bound(tmp_path: Path) -> None:
    from ckpt.memory import MemoryConfig

    env = memory_handoff(str(tmp_path), fresh=False)
    assert env == {
        "BOOTSEER_MEMCKPT_DIR": str(tmp_path),
        "BOOTSEER_MEMCKPT_DURABLE_OUTAGE_S": "600.0",
    }
    config = MemoryConfig.from_env(env)
    assert config is not None and config.check_durable and config.durable_every is None
    assert (config.server, config.layout, config.replication) == ("", None, "async")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"layout": '{"tp": 3}'}, "ckpt.memory_layout: dimension 'tp'"),
        ({"replication": "eventually"}, "ckpt.memory_replication 'eventually' is not one of"),
        ({"listen": "7070"}, "ckpt.memory_listen '7070' is not HOST:PORT"),
        ({"listen": "10.0.0.5:7070"}, "set BOOTSEER_MEMCKPT_TOKEN to the job's secret"),
    ],
    ids=["layout", "replication", "listen", "token"],
)
def test_a_setting_the_tier_cannot_run_with_is_refused_naming_the_key(
    settings: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_memory_settings(**settings, environ={})


def test_a_listener_with_the_token_passes() -> None:
    check_memory_settings(
        LAYOUT, "sync", "10.0.0.5:7070", environ={"BOOTSEER_MEMCKPT_TOKEN": "a" * 32}
    )


def test_the_agents_side_loads_neither_torch_nor_numpy() -> None:
    code = (
        "from ckpt import check_memory_settings, memory_handoff\n"
        "check_memory_settings('', 'async', '')\n"
        "memory_handoff('/dev/shm/x', fresh=True)"
    )
    assert modules_loaded_by(code, ("torch", "numpy")) == []
