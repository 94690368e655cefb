"""Configuration: precedence and sources, every validation error, ``bootseer config show``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bootseer.config import (
    SCHEMA,
    Config,
    ConfigError,
    add_config_arguments,
    check_ckpt_cache_handoff,
    config_from_args,
    default_state_dir,
    load_config,
    parse_ranks,
)
from bootseer.variables import VARIABLES

ALL_KEYS = [f"{sec}.{name}" for sec, keys in SCHEMA.items() for name in keys]


def write(tmp_path: Path, text: str, name: str = "bootseer.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def from_flags(argv: list[str], env: dict[str, str] | None = None) -> Config:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv), env=env or {})


def clean_env() -> dict[str, str]:
    """The test runner's environment without BOOTSEER_* (a developer's own settings)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("BOOTSEER_")}


def bootseer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bootseer", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean_env(), **(env or {})},
    )


# --- defaults, access, precedence -------------------------------------------------------------


def test_defaults_and_access() -> None:
    cfg = load_config(env={})
    assert cfg.path is None
    assert [s.key for s in cfg.settings()] == ALL_KEYS
    assert all(s.source == "default" for s in cfg.settings())
    assert cfg.get("restart.max_restarts") == 3
    assert cfg.restart.max_restarts == 3
    assert cfg.section("hang").timeout_s == 0.0
    state = default_state_dir()
    assert (
        cfg.state.dir
        == state
        == ("/var/lib/bootseer" if os.geteuid() == 0 else os.path.expanduser("~/.cache/bootseer"))
    )
    assert cfg.run.trace_dir == f"{state}/trace"
    assert cfg.ckpt.cache_dir == f"{state}/ckpt" and cfg.image.cache == f"{state}/images"
    # not under state.dir: containerd's CRI reports the image filesystem at this path
    assert cfg.snapshotter.root == "/var/lib/containerd/io.containerd.snapshotter.v1.bootseer"
    assert cfg.storage.options == {} and cfg.snapshotter.cache_size == 64 << 30
    assert cfg.env.spec == [] and cfg.run.allow_fresh_start is False
    assert cfg.as_dict()["restart"] == {
        "max_restarts": 3,
        "backoff_s": 5.0,
        "backoff_max_s": 60.0,
        "max_no_progress": 3,
    }
    assert set(cfg.as_dict()) == set(SCHEMA)
    cfg.get("env.spec").append("x")  # a copy: the config cannot be changed through it
    assert cfg.env.spec == []
    with pytest.raises(AttributeError):
        cfg.restart = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.nosuch  # noqa: B018
    with pytest.raises(KeyError, match="max_restarts"):
        cfg.get("restart.max_restart")


def test_precedence_default_file_env_flag(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[restart]
max_restarts = 7
backoff_s = 1
[hang]
timeout_s = 10.0
[env]
spec = ["requirements.txt"]
""",
    )
    env = {"BOOTSEER_RESTART_BACKOFF_S": "2.5", "BOOTSEER_HANG_TIMEOUT_S": "20"}
    cfg = from_flags(["--config", str(path), "--hang-timeout", "30"], env=env)
    assert cfg.path == str(path)
    expect = {
        "restart.backoff_max_s": (60.0, "default"),
        "restart.max_restarts": (7, f"file {path}"),
        "env.spec": (["requirements.txt"], f"file {path}"),
        "restart.backoff_s": (2.5, "env BOOTSEER_RESTART_BACKOFF_S"),
        "hang.timeout_s": (30.0, "flag --hang-timeout"),
    }
    for key, (value, source) in expect.items():
        assert (cfg.get(key), cfg.source(key)) == (value, source), key
    assert isinstance(cfg.restart.backoff_s, float)


def test_config_file_from_environment(tmp_path: Path) -> None:
    a = write(tmp_path, "[restart]\nmax_restarts = 1\n", "a.toml")
    b = write(tmp_path, "[restart]\nmax_restarts = 2\n", "b.toml")
    cfg = load_config(env={"BOOTSEER_CONFIG": str(a)})
    assert cfg.restart.max_restarts == 1 and cfg.source("restart.max_restarts") == f"file {a}"
    assert load_config(b, env={"BOOTSEER_CONFIG": str(a)}).restart.max_restarts == 2
    assert load_config(env={"BOOTSEER_CONFIG": ""}).path is None


def test_environment_values_parsed_from_text() -> None:
    env = {
        "BOOTSEER_RUN_ALLOW_FRESH_START": "yes",
        "BOOTSEER_RESTART_MAX_RESTARTS": " 5 ",
        "BOOTSEER_HANG_DUMP_WAIT_S": "0.5",
        "BOOTSEER_ENV_SPEC": f"a.txt, b.txt{os.pathsep}pyproject.toml",
        "BOOTSEER_CKPT_RANKS": "0-3",
        "BOOTSEER_ENV_STORE": "s3://b/envs",
    }
    cfg = load_config(env=env)
    assert cfg.run.allow_fresh_start is True
    assert cfg.restart.max_restarts == 5
    assert cfg.hang.dump_wait_s == 0.5
    assert cfg.env.spec == ["a.txt", "b.txt", "pyproject.toml"]
    assert cfg.ckpt.ranks == "0-3" and cfg.env.store == "s3://b/envs"
    assert cfg.source("env.spec") == "env BOOTSEER_ENV_SPEC"


@pytest.mark.parametrize(
    "text,value",
    [("1", True), ("0", False), ("true", True), ("False", False), ("YES", True), ("no", False)],
)
def test_environment_bools(text: str, value: bool) -> None:
    assert load_config(env={"BOOTSEER_RUN_ALLOW_FRESH_START": text}).run.allow_fresh_start is value


def test_node_alias() -> None:
    cfg = load_config(env={"BOOTSEER_NODE": "n1"})
    assert (cfg.run.node, cfg.source("run.node")) == ("n1", "env BOOTSEER_NODE")
    cfg = load_config(env={"BOOTSEER_NODE": "n1", "BOOTSEER_RUN_NODE": "n2"})
    assert (cfg.run.node, cfg.source("run.node")) == ("n2", "env BOOTSEER_RUN_NODE")


def test_known_variables_that_are_not_keys_are_accepted() -> None:
    env = {v.name: "x" for v in VARIABLES if v.name not in ("BOOTSEER_NODE", "BOOTSEER_CONFIG")}
    env.update(
        {
            "BOOTSEER_BENCH_CACHE": "/b",
            "BOOTSEER_E2E_TAG": "t",
            "HOME": "/root",
            "BOOTSEER_CKPT_CACHE": "/var/lib/bootseer/ckpt",
        }
    )
    assert all(s.source == "default" for s in load_config(env=env).settings())


@pytest.mark.parametrize(
    "var,message",
    [
        ("BOOTSEER_RUN", "unknown environment variable BOOTSEER_RUN"),
        (
            "BOOTSEER_CHECKPOINT_URL",
            "unknown environment variable BOOTSEER_CHECKPOINT_URL (did you "
            "mean 'BOOTSEER_CKPT_URL'?)",
        ),
        (
            "BOOTSEER_CKPT_CACHE_DIRECTORY",
            "section [ckpt] has no key 'cache_directory' (did you mean 'BOOTSEER_CKPT_CACHE_DIR'?",
        ),
        (
            "BOOTSEER_STRIPE_SIZE",
            "environment variable BOOTSEER_STRIPE_SIZE is no longer read: use "
            "FSSPEC_STRIPED_STRIPE_SIZE",
        ),
        ("BOOTSEER_STRIPE_CONCURRENCY", "use FSSPEC_STRIPED_CONCURRENCY"),
        (
            "BOOTSEER_BASE_IMAGE",
            "BOOTSEER_BASE_IMAGE is no longer read: use BOOTSEER_ENV_BASE_IMAGE",
        ),
        ("BOOTSEER_UV", "BOOTSEER_UV is no longer read: use BOOTSEER_ENV_UV"),
    ],
)
def test_unknown_and_retired_variables_are_refused_by_name(var: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={var: "1"})
    assert message in str(info.value)


def test_paths_derive_from_the_state_dir(tmp_path: Path) -> None:
    cfg = load_config(env={"BOOTSEER_STATE_DIR": str(tmp_path)})
    derived = "state.dir (env BOOTSEER_STATE_DIR)"
    for key, under in (
        ("run.trace_dir", "trace"),
        ("ckpt.cache_dir", "ckpt"),
        ("image.cache", "images"),
    ):
        assert (cfg.get(key), cfg.source(key)) == (str(tmp_path / under), derived), key
    # the snapshotter's root is where containerd's CRI looks, whatever state.dir says
    assert cfg.source("snapshotter.root") == "default"
    path = write(
        tmp_path, f'[state]\ndir = "{tmp_path}/s"\n[ckpt]\ncache_dir = "/c"\n[image]\ncache = ""\n'
    )
    cfg = from_flags(["--config", str(path), "--trace-dir", "/t"])
    assert (cfg.ckpt.cache_dir, cfg.source("ckpt.cache_dir")) == ("/c", f"file {path}")
    assert (cfg.run.trace_dir, cfg.source("run.trace_dir")) == ("/t", "flag --trace-dir")
    assert cfg.image.cache == f"{tmp_path}/s/images"  # '' in the file: derived
    assert cfg.source("image.cache") == f"state.dir (file {path})"
    assert from_flags(["--state-dir", "/n"]).ckpt.cache_dir == "/n/ckpt"


def test_storage_options_from_file_variable_and_flag(tmp_path: Path) -> None:
    path = write(tmp_path, '[storage.options.s3]\nendpoint_url = "http://file:9000"\n')
    assert load_config(path, env={}).storage.options == {"s3": {"endpoint_url": "http://file:9000"}}
    env = {"BOOTSEER_STORAGE_OPTIONS": '{"s3": {"endpoint_url": "http://env:9000"}}'}
    cfg = load_config(path, env=env)
    assert cfg.storage.options["s3"]["endpoint_url"] == "http://env:9000"
    assert cfg.source("storage.options") == "env BOOTSEER_STORAGE_OPTIONS"
    cfg = from_flags(["--storage-options", '{"striped": {"stripe_size": "1MiB"}}'], env=env)
    assert cfg.storage.options == {"striped": {"stripe_size": "1MiB"}}
    cfg.get("storage.options")["s3"] = {}  # a copy
    assert "s3" not in cfg.storage.options
    with pytest.raises(
        ConfigError, match="storage.options in env BOOTSEER_STORAGE_OPTIONS: not valid JSON"
    ):
        load_config(env={"BOOTSEER_STORAGE_OPTIONS": "{nope"})
    with pytest.raises(
        ConfigError,
        match="storage.options in flag --storage-options: expected a table keyed by protocol",
    ):
        from_flags(["--storage-options", '{"endpoint_url": "http://x"}'])


def test_a_ckpt_cache_handoff_naming_another_cache_is_refused(tmp_path: Path) -> None:
    env = {"BOOTSEER_STATE_DIR": str(tmp_path), "BOOTSEER_CKPT_CACHE": str(tmp_path / "ckpt")}
    check_ckpt_cache_handoff(load_config(env=env), env)  # the same directory: fine
    env["BOOTSEER_CKPT_CACHE"] = "/elsewhere"
    with pytest.raises(ConfigError) as info:
        check_ckpt_cache_handoff(load_config(env=env), env)
    assert "BOOTSEER_CKPT_CACHE=/elsewhere is what `bootseer run` hands its command" in str(
        info.value
    )
    assert f"ckpt.cache_dir = '{tmp_path}/ckpt' (state.dir (env BOOTSEER_STATE_DIR))" in str(
        info.value
    )
    assert "set BOOTSEER_CKPT_CACHE_DIR" in str(info.value)


def test_flags_only_given_ones_override(tmp_path: Path) -> None:
    path = write(tmp_path, "[run]\nallow_fresh_start = true\n[env]\nspec = ['x.txt']\n")
    cfg = from_flags(["--config", str(path)])
    assert cfg.run.allow_fresh_start is True and cfg.env.spec == ["x.txt"]
    assert cfg.source("run.allow_fresh_start") == f"file {path}"
    cfg = from_flags(
        [
            "--config",
            str(path),
            "--no-allow-fresh-start",
            "--env-spec",
            "a.txt",
            "--env-spec",
            "b.txt",
            "--max-restarts",
            "0",
            "--ranks",
            "0,1,4",
            "--ckpt-url",
            "s3://b/ckpt",
            "--trace-dir",
            "/t",
        ]
    )
    assert cfg.run.allow_fresh_start is False
    assert cfg.source("run.allow_fresh_start") == "flag --no-allow-fresh-start"
    assert cfg.env.spec == ["a.txt", "b.txt"] and cfg.source("env.spec") == "flag --env-spec"
    assert (cfg.restart.max_restarts, cfg.ckpt.ranks, cfg.ckpt.url, cfg.run.trace_dir) == (
        0,
        "0,1,4",
        "s3://b/ckpt",
        "/t",
    )
    assert (
        from_flags(["--allow-fresh-start"]).source("run.allow_fresh_start")
        == "flag --allow-fresh-start"
    )


def test_overrides_in_code() -> None:
    cfg = load_config(
        env={},
        overrides={"restart.max_restarts": 9, "hang.timeout_s": None},
        override_sources={"restart.max_restarts": "flag --max-restarts"},
    )
    assert (cfg.restart.max_restarts, cfg.source("restart.max_restarts")) == (
        9,
        "flag --max-restarts",
    )
    assert cfg.source("hang.timeout_s") == "default"
    with pytest.raises(ConfigError, match="unknown key 'restart.max_retries'"):
        load_config(env={}, overrides={"restart.max_retries": 1})


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "[restart]\nmax_retries = 1\n",
            "unknown key 'restart.max_retries' in {path} (did you mean 'restart.max_restarts'? "
            "known: restart.max_restarts, restart.backoff_s, restart.backoff_max_s, "
            "restart.max_no_progress)",
        ),
        (
            "[restat]\nmax_restarts = 1\n",
            "unknown section [restat] in {path} (did you mean 'restart'?",
        ),
        (
            "max_restarts = 1\n",
            "unknown key 'max_restarts' in {path}: keys belong in a section "
            "(put it under [restart])",
        ),
        ("restart = 1\n", "restart in {path}: expected a table [restart], got 1"),
        (
            '[restart]\nmax_restarts = "three"\n',
            "restart.max_restarts in {path}: expected an integer >= 0, got 'three'",
        ),
        (
            "[restart]\nmax_restarts = -1\n",
            "restart.max_restarts in {path}: expected an integer >= 0, got -1",
        ),
        (
            "[restart]\nmax_restarts = 2.5\n",
            "restart.max_restarts in {path}: expected an integer >= 0, got 2.5",
        ),
        (
            "[restart]\nmax_restarts = true\n",
            "restart.max_restarts in {path}: expected an integer >= 0, got True",
        ),
        (
            "[hang]\ntimeout_s = -0.5\n",
            "hang.timeout_s in {path}: expected a number >= 0, got -0.5",
        ),
        ("[hang]\ntimeout_s = inf\n", "hang.timeout_s in {path}: expected a number >= 0, got inf"),
        (
            '[run]\nallow_fresh_start = "yes"\n',
            "run.allow_fresh_start in {path}: expected true or false, got 'yes'",
        ),
        ("[run]\ntrace_dir = 3\n", "run.trace_dir in {path}: expected a path (string), got 3"),
        ("[env]\nspec = [1, 2]\n", "env.spec in {path}: expected a list of strings, got [1, 2]"),
        ('[ckpt]\nranks = "0-x"\n', "ckpt.ranks in {path}: expected a rank list like '0-7'"),
        ("[restart]\nmax_restarts = \n", "config file {path}: invalid TOML: "),
    ],
)
def test_file_errors_name_key_and_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert message.format(path=path) in str(info.value)


def test_toml_syntax_error_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[restart]\nmax_restarts = 1\nbackoff_s = = 2\n")
    with pytest.raises(ConfigError, match=r"line 3") as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_missing_file_names_file_and_origin(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"config file {missing}: not found"):
        load_config(missing, env={})
    with pytest.raises(ConfigError, match=rf"{missing} \(from BOOTSEER_CONFIG\): not found"):
        load_config(env={"BOOTSEER_CONFIG": str(missing)})
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path, env={})


def test_empty_file_and_sections_keep_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "# nothing yet\n[restart]\n[hang]\n")
    cfg = load_config(path, env={})
    assert cfg.path == str(path) and cfg.as_dict() == load_config(env={}).as_dict()
    assert all(s.source == "default" for s in cfg.settings())


@pytest.mark.parametrize(
    "var,text,message",
    [
        (
            "BOOTSEER_RESTART_MAX_RESTARTS",
            "three",
            "restart.max_restarts in env BOOTSEER_RESTART_MAX_RESTARTS: expected an integer >= 0, "
            "got 'three'",
        ),
        (
            "BOOTSEER_RESTART_MAX_RESTARTS",
            "-2",
            "env BOOTSEER_RESTART_MAX_RESTARTS: expected an integer >= 0, got '-2'",
        ),
        (
            "BOOTSEER_RESTART_BACKOFF_S",
            "5s",
            "restart.backoff_s in env BOOTSEER_RESTART_BACKOFF_S: expected a number >= 0, got '5s'",
        ),
        (
            "BOOTSEER_RUN_ALLOW_FRESH_START",
            "maybe",
            "run.allow_fresh_start in env BOOTSEER_RUN_ALLOW_FRESH_START: expected one of "
            "1/0/true/false/yes/no, got 'maybe'",
        ),
        (
            "BOOTSEER_CKPT_RANKS",
            "3-1",
            "ckpt.ranks in env BOOTSEER_CKPT_RANKS: expected a rank list",
        ),
        (
            "BOOTSEER_RESTART_MAX_RETRIES",
            "1",
            "unknown environment variable BOOTSEER_RESTART_MAX_RETRIES: section [restart] has no key "
            "'max_retries' (did you mean 'BOOTSEER_RESTART_MAX_RESTARTS'?",
        ),
        ("BOOTSEER_HANG_TIMEOUT", "1", "unknown environment variable BOOTSEER_HANG_TIMEOUT"),
    ],
)
def test_environment_errors_name_variable(var: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={var: text})
    assert message in str(info.value)


def test_flag_errors_name_flag() -> None:
    with pytest.raises(
        ConfigError,
        match="restart.max_restarts in flag --max-restarts: expected an integer >= 0, got 'three'",
    ):
        from_flags(["--max-restarts", "three"])
    with pytest.raises(ConfigError, match="hang.timeout_s in flag --hang-timeout"):
        from_flags(["--hang-timeout", "-1"])


# --- ranks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,env,ranks",
    [
        ("0-3,8", {}, [0, 1, 2, 3, 8]),
        ("0,1,4", {}, [0, 1, 4]),
        ("5", {}, [5]),
        (" 8-9 , 0 ", {}, [0, 8, 9]),
        ("0-2,1-3", {}, [0, 1, 2, 3]),
        ("2", {"RANK": "7"}, [2]),  # explicit text wins over the environment
        ("", {"LOCAL_WORLD_SIZE": "4", "NODE_RANK": "2"}, [8, 9, 10, 11]),
        ("", {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "RANK": "3"}, [2, 3]),
        ("", {"LOCAL_WORLD_SIZE": "4", "RANK": "3"}, [3]),  # no node rank: the process's own rank
        ("", {"RANK": "5"}, [5]),
        ("", {}, [0]),
    ],
)
def test_parse_ranks(text: str, env: dict[str, str], ranks: list[int]) -> None:
    assert parse_ranks(text, env) == ranks


def test_parse_ranks_without_a_fallback_never_guesses() -> None:
    assert parse_ranks("", {"RANK": "3"}, fallback=False) == [3]
    assert parse_ranks("", {"LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}, fallback=False) == [2, 3]
    for env in ({}, {"LOCAL_WORLD_SIZE": "8"}):
        with pytest.raises(ConfigError, match="says which ranks this node serves"):
            parse_ranks("", env, fallback=False)


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "0,,1", "1.5", "0-3;8"])
def test_parse_ranks_bad_text(text: str) -> None:
    with pytest.raises(ConfigError, match=f"bad rank list {text!r}"):
        parse_ranks(text, {})


@pytest.mark.parametrize(
    "env,var",
    [
        ({"LOCAL_WORLD_SIZE": "0", "NODE_RANK": "0"}, "LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "8", "NODE_RANK": "x"}, "NODE_RANK"),
        ({"RANK": "-1"}, "RANK"),
    ],
)
def test_parse_ranks_bad_environment(env: dict[str, str], var: str) -> None:
    with pytest.raises(ConfigError, match=f"env {var}: expected an integer"):
        parse_ranks("", env)


# --- the command ------------------------------------------------------------------------------


def test_show_lists_every_key_variable_flag_value_and_source(tmp_path: Path) -> None:
    path = write(tmp_path, '[restart]\nmax_restarts = 7\n[env]\nspec = ["req.txt"]\n')
    proc = bootseer(
        "config",
        "show",
        "--config",
        str(path),
        "--hang-timeout",
        "30",
        env={
            "BOOTSEER_CKPT_URL": "s3://b/ckpt",
            "BOOTSEER_STATE_DIR": "/n",
            "BOOTSEER_CKPT_CACHE": "/n/ckpt",
        },
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"config file: {path}"
    assert out[1].split() == ["KEY", "VARIABLE", "FLAG", "VALUE", "SOURCE"]
    rows = {line.split()[0]: line.split(None, 4)[1:] for line in out[2 : 2 + len(ALL_KEYS)]}
    assert list(rows) == ALL_KEYS
    assert rows["restart.max_restarts"] == [
        "BOOTSEER_RESTART_MAX_RESTARTS",
        "--max-restarts",
        "7",
        f"file {path}",
    ]
    assert rows["env.spec"][2:] == ['["req.txt"]', f"file {path}"]
    assert rows["hang.timeout_s"][1:] == ["--hang-timeout", "30.0", "flag --hang-timeout"]
    assert rows["ckpt.url"][2:] == ['"s3://b/ckpt"', "env BOOTSEER_CKPT_URL"]
    assert rows["ckpt.cache_dir"] == [
        "BOOTSEER_CKPT_CACHE_DIR",
        "--ckpt-cache-dir",
        '"/n/ckpt"',
        "state.dir (env BOOTSEER_STATE_DIR)",
    ]
    assert rows["run.allow_fresh_start"][1] == "--[no-]allow-fresh-start"
    assert rows["restart.backoff_s"][2:] == ["5.0", "default"]
    # Then every variable that is not a setting, with its value here.
    tail = out[2 + len(ALL_KEYS) :]
    assert tail[0] == "" and tail[1].startswith("variables that are not settings")
    variables = {line.split()[0]: line.split(None, 3)[1:] for line in tail[3:]}
    assert list(variables) == [v.name for v in VARIABLES]
    assert variables["BOOTSEER_CKPT_CACHE"][:2] == ["hand-off", "/n/ckpt"]
    assert "ckpt.cache_dir" in variables["BOOTSEER_CKPT_CACHE"][2]
    assert variables["FSSPEC_STRIPED_STRIPE_SIZE"][:2] == ["fsspec", "unset"]


def test_show_json(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[run]\nallow_fresh_start = true\n[storage.options.s3]\n"
        'endpoint_url = "http://h:9000"\nsecret = "hunter2-secret"\n',
    )
    proc = bootseer(
        "config",
        "show",
        "--json",
        env={
            "BOOTSEER_CONFIG": str(path),
            "BOOTSEER_REGISTRY_PASSWORD": "pw-xyzzy",
            "FSSPEC_STRIPED_STRIPE_SIZE": "16MiB",
            "FSSPEC_STRIPED_RETRIES": "2",
        },
    )
    assert proc.returncode == 0, proc.stderr
    assert "hunter2-secret" not in proc.stdout and "pw-xyzzy" not in proc.stdout
    doc = json.loads(proc.stdout)
    assert doc["config_file"] == str(path)
    settings = doc["settings"]
    assert [f"{sec}.{name}" for sec, keys in settings.items() for name in keys] == ALL_KEYS
    assert settings["run"]["allow_fresh_start"] == {
        "value": True,
        "source": f"file {path}",
        "variable": "BOOTSEER_RUN_ALLOW_FRESH_START",
        "flag": "--[no-]allow-fresh-start",
    }
    assert settings["env"]["spec"]["value"] == [] and settings["env"]["spec"]["source"] == "default"
    assert settings["storage"]["options"]["value"]["s3"]["endpoint_url"] == "http://h:9000"
    shown = {v["name"]: v for v in doc["variables"]}
    assert shown["BOOTSEER_REGISTRY_PASSWORD"]["value"] == "***"
    assert shown["FSSPEC_STRIPED_STRIPE_SIZE"]["value"] == "16MiB"
    assert shown["FSSPEC_STRIPED_RETRIES"]["role"] == "fsspec"  # any striped option fsspec sets
    assert shown["BOOTSEER_CKPT_CACHE"] == {
        "name": "BOOTSEER_CKPT_CACHE",
        "role": "hand-off",
        "value": None,
        "meaning": next(v.meaning for v in VARIABLES if v.name == "BOOTSEER_CKPT_CACHE"),
    }


#: One invocation of every command that has settings; each must refuse a bad configuration
#: before it does anything.
COMMANDS = [
    ["run", "--", "true"],
    ["warmup"],
    ["config", "show"],
    ["env", "ls"],
    ["env", "key"],
    ["image", "prefetch", "reg/x:1"],
    ["fs", "ls", "/nonexistent"],
    ["ckpt", "ls", "/nowhere"],
    ["snapshotter"],
    ["report", "/nonexistent"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_refuses_an_unknown_variable_or_key(tmp_path: Path, argv: list[str]) -> None:
    env = {"BOOTSEER_STATE_DIR": str(tmp_path / "state")}
    typo = bootseer(*argv, env={**env, "BOOTSEER_CKPT_CACHE_DIRR": "/x"})
    assert typo.returncode == 2, typo.stderr
    assert typo.stderr.startswith(
        "bootseer: error: unknown environment variable "
        "BOOTSEER_CKPT_CACHE_DIRR: section [ckpt] has no key "
        "'cache_dirr' (did you mean 'BOOTSEER_CKPT_CACHE_DIR'?"
    ), typo.stderr
    retired = bootseer(*argv, env={**env, "BOOTSEER_STRIPE_SIZE": "1MiB"})
    assert retired.returncode == 2 and "use FSSPEC_STRIPED_STRIPE_SIZE" in retired.stderr
    path = write(tmp_path, "[ckpt]\ncache_directory = '/x'\n")
    bad_key = bootseer(*argv, env={**env, "BOOTSEER_CONFIG": str(path)})
    assert bad_key.returncode == 2, bad_key.stderr
    assert bad_key.stderr.startswith(
        f"bootseer: error: unknown key 'ckpt.cache_directory' in "
        f"{path} (did you mean 'ckpt.cache_dir'?"
    ), bad_key.stderr
    for proc in (typo, retired, bad_key):
        assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "state").exists()  # refused before anything was made


def test_show_bad_file_exits_2_with_message(tmp_path: Path) -> None:
    path = write(tmp_path, "[restart]\nmax_retries = 1\n")
    proc = bootseer("config", "show", "--config", str(path))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"bootseer: error: unknown key 'restart.max_retries' in {path}")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    proc = bootseer("config", "show", env={"BOOTSEER_RESTART_MAX_RESTARTS": "three"})
    assert proc.returncode == 2 and "BOOTSEER_RESTART_MAX_RESTARTS" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_one_config_file_serves_every_command(tmp_path: Path) -> None:
    """The job's file configures `bootseer env` and `bootseer fs` as it does run and warmup:
    [env] makes the environment's key, [storage.options] reaches the stores."""
    from snapshot.key import compute_key

    req = write(tmp_path, "tinybeta==1.0\n", "requirements.txt")
    digest = "registry.example/base@sha256:" + "b" * 64
    path = write(
        tmp_path,
        f'[env]\nspec = ["{req}"]\nbase_image = "{digest}"\n'
        '[storage.options.striped]\nstripe_size = "64KiB"\n',
    )
    env = {"BOOTSEER_CONFIG": str(path)}
    key = bootseer("env", "key", "--json", env=env)
    assert key.returncode == 0, key.stderr
    assert json.loads(key.stdout)["key"] == compute_key([req], base_image=digest).key

    src, dst = tmp_path / "in.bin", tmp_path / "store" / "out.bin"
    src.write_bytes(os.urandom(300_000))
    dst.parent.mkdir()
    copied = bootseer("fs", "cp", str(src), f"file://{dst}", env=env)
    assert copied.returncode == 0, copied.stderr
    stat = bootseer("fs", "stat", f"file://{dst}", env=env)
    info = json.loads(stat.stdout)
    assert (info["striped"], info["stripe_size"], info["size"]) == (True, 64 << 10, 300_000)


def test_capture_mode_records_under_state_dir_and_leaves_the_jobs_env_keys(tmp_path: Path) -> None:
    """`env ensure --capture` snapshots a setup command: the job's [env] spec and prefix (from
    a file or a variable) describe another environment and are not used; its record goes to
    state.dir, which the library gets as an argument."""
    tool, state = tmp_path / "tool", tmp_path / "state"
    tool.mkdir()
    env = {
        "BOOTSEER_STATE_DIR": str(state),
        "BOOTSEER_ENV_PREFIX": str(tmp_path / "venv"),
        "BOOTSEER_ENV_SPEC": str(tmp_path / "requirements.txt"),
    }
    setup = ["--", "sh", "-c", f"echo built > {tool}/f"]
    done = bootseer("env", "ensure", "--capture", str(tool), "--json", *setup, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"] == "installed-locally"  # no store configured
    assert (tool / "f").read_text() == "built\n" and not (tmp_path / "venv").exists()
    assert (state / "captures" / f"{result['key']}.json").is_file()
    again = bootseer("env", "ensure", "--capture", str(tool), "--json", *setup, env=env)
    assert json.loads(again.stdout)["outcome"] == "verified"  # read back from state.dir
    both = bootseer(
        "env", "ensure", "--capture", str(tool), "--prefix", str(tmp_path / "v"), *setup, env=env
    )
    assert both.returncode == 2 and "--capture and --prefix exclude each other" in both.stderr
