"""``bootseer ckpt``: ls, verify, inspect and convert, on real checkpoints (local and S3)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_helpers import bootseer_cli
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from bootseer.cli import main
from ckpt import CheckpointManager, FlatShard, PerRank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def bootseer_inprocess(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The same entry point in this process (no torch import per call): (code, out, err)."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    out = capsys.readouterr()
    return exited.value.code, out.out, out.err


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),  # 8 KiB: several 4 KiB stripes
            "b": torch.arange(7).to(torch.bfloat16),
        },
        "flat": FlatShard(torch.arange(6, dtype=torch.int64) + 6 * rank, 6 * rank, 12),
        "epoch": step,
        "rng": PerRank(rank),
    }


def save_two_ranks(
    url: str, step: int, *, ranks: tuple[int, ...] = (0, 1), storage_options: dict | None = None
) -> None:
    """A 2-rank save from one process; leaving rank 0 out leaves the step uncommitted."""
    managers = [
        CheckpointManager(
            url,
            rank=r,
            world_size=2,
            stripe_size="4KiB",
            storage_options=storage_options,
            commit_timeout_s=30,
        )
        for r in ranks
    ]
    for mgr, rank in zip(managers, ranks, strict=True):
        mgr.save(step, _state(rank, step))  # rank 0 commits once rank 1's shard is durable
    for mgr in reversed(managers):
        mgr.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Steps 10 and 20 committed (2 ranks), step 30 torn (only rank 1 wrote)."""
    root = tmp_path / "run"
    save_two_ranks(str(root), 10)
    save_two_ranks(str(root), 20)
    save_two_ranks(str(root), 30, ranks=(1,))
    return root


def test_ls_lists_committed_and_incomplete_steps(run_dir):
    out = bootseer_cli("ckpt", "ls", str(run_dir)).stdout.splitlines()
    assert out[0].split() == ["STEP", "RANKS", "SIZE", "TENSORS", "CREATED"]
    rows = {line.split()[0]: line.split() for line in out[1:4]}
    assert rows["10"][1] == "2" and rows["10"][4] == "3" and rows["20"][1:2] == ["2"]
    assert rows["30"][-1] == "(incomplete)"
    assert out[-1] == f"2 committed, 1 incomplete under {run_dir}"
    listing = json.loads(bootseer_cli("ckpt", "ls", f"file://{run_dir}", "--json").stdout)
    assert [(r["step"], r["committed"]) for r in listing] == [(10, True), (20, True), (30, False)]
    assert listing[0]["world_size"] == 2 and listing[0]["tensors"] == 3
    assert listing[0]["bytes"] > 8 * 1024 and listing[2]["note"] == "incomplete"


def test_verify_ok_then_a_flipped_byte_in_a_stripe_is_named(run_dir):
    ok = bootseer_cli("ckpt", "verify", str(run_dir), "--all")
    assert "step 10: ok" in ok.stdout and "step 20: ok" in ok.stdout
    assert "verifying step 20" in ok.stderr  # a progress line per step

    stripes = run_dir / "step-10" / ".rank-00000.data.stripes"
    (version,) = os.listdir(stripes)
    assert len(os.listdir(stripes / version)) >= 2
    victim = stripes / version / "00000001"
    data = bytearray(victim.read_bytes())
    data[123] ^= 0x10
    victim.write_bytes(bytes(data))

    bad = bootseer_cli("ckpt", "verify", str(run_dir), "--step", "10", check=False)
    assert bad.returncode == 1, bad.stderr
    assert "step 10: FAILED" in bad.stdout
    assert "rank-00000.data" in bad.stdout and "stripe 1" in bad.stdout
    assert f"{version}/00000001" in bad.stdout and "Traceback" not in bad.stderr
    # the newest step is untouched: verify without --step checks it and passes
    assert "step 20: ok" in bootseer_cli("ckpt", "verify", str(run_dir)).stdout
    every = bootseer_cli("ckpt", "verify", str(run_dir), "--all", check=False)
    assert every.returncode == 1 and "step 20: ok" in every.stdout


def test_inspect_table_and_json(run_dir):
    out = bootseer_cli("ckpt", "inspect", str(run_dir), "--step", "10").stdout
    lines = out.splitlines()
    assert lines[0].startswith(f"step 10 under {run_dir}: 2 rank(s)")
    assert lines[1].split() == ["KEY", "KIND", "DTYPE", "SHAPE", "BYTES", "RANKS"]
    table = {line.split()[0]: line for line in lines[2:5]}
    assert set(table) == {"flat", "model/b", "model/w"}
    assert table["model/w"].split()[1:4] == ["tensor", "float32", "[64,"]
    # replicated and small (<= ckpt.staging.SMALL_REPLICA_BYTES): a copy in every rank's file
    assert "8.0 KiB" in table["model/w"] and "0-1 (2 chunks)" in table["model/w"]
    assert table["flat"].split()[1:4] == ["flat", "int64", "[12]"]
    assert "0-1 (2 chunks)" in table["flat"]
    assert "bfloat16" in table["model/b"]
    assert lines[5:] == ["objects:", "  ranks 0-1: epoch, rng"]

    data = json.loads(bootseer_cli("ckpt", "inspect", str(run_dir), "--json").stdout)
    assert data["step"] == 20 and data["world_size"] == 2  # the newest by default
    tensors = {t["key"]: t for t in data["tensors"]}
    assert tensors["model/w"]["shape"] == [64, 32] and tensors["model/w"]["bytes"] == 8192
    assert tensors["flat"]["ranks"] == [0, 1] and tensors["flat"]["chunks"] == 2
    assert tensors["model/w"]["ranks"] == [0, 1]  # replicated and small: a copy per rank
    assert data["objects"] == {"0": ["epoch", "rng"], "1": ["epoch", "rng"]}
    assert [f["rank"] for f in data["data_files"]] == [0, 1]


def test_convert_dcp_to_bootseer_and_back_via_cli(tmp_path, capsys):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 7}
    src = f"striped::file://{tmp_path}/dcp"
    dcp.save(state, storage_writer=FsspecWriter(src), no_dist=True)

    ours = str(tmp_path / "ours")
    to_ours = bootseer_cli("ckpt", "convert", src, ours, "--from", "dcp", "--step", "5")
    assert f"converted DCP {src} -> {ours} (step 5)" in to_ours.stdout
    assert "reading DCP checkpoint" in to_ours.stderr  # progress lines
    code, listing, _ = bootseer_inprocess(capsys, "ckpt", "ls", ours, "--json")
    assert code == 0 and [(r["step"], r["world_size"]) for r in json.loads(listing)] == [(5, 1)]
    code, inspected, _ = bootseer_inprocess(capsys, "ckpt", "inspect", ours, "--json")
    assert {t["key"] for t in json.loads(inspected)["tensors"]} == {
        "model.weight",
        "model.bias",
        "optim.state.0.momentum_buffer",
        "optim.state.1.momentum_buffer",
    }

    out = tmp_path / "dcp-out"  # a plain path: standard DCP files
    back = bootseer_cli("ckpt", "convert", ours, str(out), "--from", "bootseer")
    assert "(step 5)" in back.stdout and sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]
    target = {
        "model": torch.nn.Linear(16, 8).state_dict(),
        "optim": {
            "state": {
                0: {"momentum_buffer": torch.zeros(8, 16)},
                1: {"momentum_buffer": torch.zeros(8)},
            },
            "param_groups": [{}],
        },
        "epoch": 0,
    }
    target["optim"]["param_groups"] = [dict(state["optim"]["param_groups"][0], lr=0.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v)
    for i in (0, 1):
        assert torch.equal(
            target["optim"]["state"][i]["momentum_buffer"],
            state["optim"]["state"][i]["momentum_buffer"],
        )
    assert target["optim"]["param_groups"][0]["lr"] == 0.5 and target["epoch"] == 7

    code, _, err = bootseer_inprocess(
        capsys, "ckpt", "convert", ours, str(out), "--from", "bootseer"
    )
    assert code == 2 and f"{out} already holds a DCP checkpoint" in err and "--overwrite" in err
    code, _, _ = bootseer_inprocess(
        capsys, "ckpt", "convert", ours, str(out), "--from", "bootseer", "--overwrite"
    )
    assert code == 0


def test_ls_and_verify_on_s3_with_storage_options(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/runs/a"
    save_two_ranks(url, 4, storage_options={"s3": options})
    env = {"BOOTSEER_STORAGE_OPTIONS": json.dumps({"s3": options})}
    listing = json.loads(bootseer_cli("ckpt", "ls", url, "--json", env=env).stdout)
    assert [(r["step"], r["world_size"], r["tensors"]) for r in listing] == [(4, 2, 3)]
    verified = bootseer_cli(
        "ckpt", "verify", f"striped::{url}", "--storage-options", json.dumps({"s3": options})
    )
    assert "step 4: ok" in verified.stdout


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    proc = bootseer_cli("ckpt", "ls", str(tmp_path / "nothing"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"bootseer: error: no checkpoints under {tmp_path / 'nothing'}"
    proc = bootseer_cli("ckpt", "convert", "a", "b", "--from", "tensorflow", check=False)
    assert proc.returncode == 2 and "invalid choice: 'tensorflow'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt", "ls", "{empty}"], "no checkpoints under {empty}"),
        (["ckpt", "verify", "{empty}"], "no checkpoints under {empty}"),
        (["ckpt", "inspect", "{empty}"], "no checkpoints under {empty}"),
        (
            ["ckpt", "convert", "{empty}", "{tmp}/x", "--from", "bootseer"],
            "no checkpoints under {empty}",
        ),
        (
            ["ckpt", "convert", "{empty}", "{tmp}/x", "--from", "dcp"],
            "no DCP checkpoint at {empty} (no .metadata file)",
        ),
        (
            ["ckpt", "verify", "{run}", "--step", "99"],
            "step 99 does not exist under {run}; committed steps: 10, 20",
        ),
        (
            ["ckpt", "inspect", "{run}", "--step", "30"],
            "step 30 is incomplete (no MANIFEST.json) under {run}",
        ),
        (
            ["ckpt", "convert", "{run}", "{tmp}/x", "--from", "bootseer", "--step", "7"],
            "step 7 does not exist under {run}",
        ),
        (["ckpt", "convert", "{run}", "{tmp}/x", "--from", "onnx"], "invalid choice: 'onnx'"),
        (["ckpt", "convert", "{run}", "{tmp}/x"], "the following arguments are required: --from"),
        (["ckpt", "convert", "{run}", "{run}", "--from", "dcp"], "no DCP checkpoint at {run}"),
        (
            ["ckpt", "ls", "{run}", "--storage-options", "{{nope"],
            "storage.options in flag --storage-options: not valid JSON",
        ),
        (["ckpt", "ls", "nosuch://bucket/run"], "unknown protocol 'nosuch'"),
        (["ckpt", "verify", "{run}/step-30"], "no checkpoints under {run}/step-30"),
    ],
)
def test_bad_input_gets_a_clear_message(args, message, run_dir, tmp_path, capsys):
    fill = {"run": str(run_dir), "empty": str(tmp_path / "empty"), "tmp": str(tmp_path)}
    code, _out, err = bootseer_inprocess(capsys, *(a.format(**fill) for a in args))
    assert code == 2
    assert message.format(**fill) in err, err
