"""torch.distributed.checkpoint (DCP) over ``striped::`` URLs, and DCP <-> ours conversion.

DCP users keep their API: ``FsspecWriter``/``FsspecReader`` on a ``striped::`` URL write and
read the striped layout (local disk and S3, one process and two gloo processes), and
``ckpt.dcp`` converts both ways bit-exactly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import ckpt
from ckpt.dcp import bootseer_to_dcp, dcp_to_bootseer, flatten_like_dcp, unflatten_like_dcp
from striped_fs.urls import url_to_fs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# -- a small model + optimizer state ------------------------------------------------------------


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


def _trained_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    for _ in range(2):
        model(torch.randn(4, 12)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {
            "epoch": seed,
            "tag": f"run-{seed}",
            "half": torch.randn(7).bfloat16(),
            "ids": torch.arange(6, dtype=torch.int64).view(2, 3) * (seed + 1),
        },
    }
    return model, opt, state


def _fresh_state() -> dict[str, Any]:
    """A state of the same structure with different values everywhere (seed 1)."""
    return _trained_state(1)[2]


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact structural equality (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(
            a.view(torch.uint8) if a.dtype != torch.bool and a.dim() else a,
            b.view(torch.uint8) if b.dtype != torch.bool and b.dim() else b,
        ), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(map(str, a)) == set(map(str, b)), path
        by_str = {str(k): v for k, v in b.items()}
        for k, v in a.items():
            _assert_same(v, by_str[str(k)], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _assert_striped(url: str, names: list[str], storage_options: dict | None = None) -> None:
    fs, root = url_to_fs(url, storage_options)
    for name in names:
        info = fs.info(f"{root}/{name}")
        assert info.get("striped") is True, f"{name} is not in the striped layout: {info}"


# -- (a) DCP users keep their API ---------------------------------------------------------------


def test_dcp_roundtrip_on_striped_local_dir(tmp_path):
    url = f"striped::file://{tmp_path}/dcp"
    _, _, state = _trained_state(0)
    dcp.save(state, storage_writer=FsspecWriter(url))
    assert sorted(os.listdir(tmp_path / "dcp")) == [
        "..metadata.stripes",
        ".__0_0.distcp.stripes",
        ".metadata",
        "__0_0.distcp",
    ]
    _assert_striped(url, [".metadata", "__0_0.distcp"])

    model, opt, target = _trained_state(1)
    with pytest.raises(AssertionError):
        _assert_same(state, target)  # the target really starts out different
    dcp.load(target, storage_reader=FsspecReader(url))
    _assert_same(state, target)
    # the loaded state drives a real model and optimizer
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    _assert_same(state["model"], model.state_dict())

    # the checkpoint_id form picks FsspecWriter/FsspecReader for a striped:: URL by itself
    by_id = f"striped::file://{tmp_path}/by-id"
    dcp.save(state, checkpoint_id=by_id)
    _assert_striped(by_id, [".metadata", "__0_0.distcp"])
    target = _fresh_state()
    dcp.load(target, checkpoint_id=by_id)
    _assert_same(state, target)


def test_dcp_roundtrip_on_striped_s3(s3_bucket):
    bucket, options = s3_bucket
    url = f"striped::s3://{bucket}/runs/dcp"
    _, _, state = _trained_state(0)
    # fsspec options go through FsspecWriter/FsspecReader kwargs, keyed by protocol
    dcp.save(state, storage_writer=FsspecWriter(url, s3=options, striped={"stripe_size": "4KiB"}))
    _assert_striped(url, [".metadata", "__0_0.distcp"], {"s3": options})
    fs, root = url_to_fs(url, {"s3": options})
    assert fs.info(f"{root}/__0_0.distcp")["stripes"] > 1  # really split into stripes
    target = _fresh_state()
    dcp.load(target, storage_reader=FsspecReader(url, s3=options))
    _assert_same(state, target)


_WORKER = textwrap.dedent("""
    import os, sys, warnings
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    url = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    state = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),          # sharded: half per rank
        "b": torch.linspace(0, 1, 9, dtype=torch.float64),       # replicated, written once
        "meta": {"step": 17, "name": "two-ranks"},
    }
    dcp.save(state, storage_writer=FsspecWriter(url))
    dist.barrier()
    target = {
        "w": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
        "b": torch.zeros(9, dtype=torch.float64),
        "meta": {"step": 0, "name": ""},
    }
    dcp.load(target, storage_reader=FsspecReader(url))
    assert torch.equal(target["w"].full_tensor(), full), "sharded tensor differs"
    assert torch.equal(target["b"], state["b"]), "replicated tensor differs"
    assert target["meta"] == {"step": 17, "name": "two-ranks"}, target["meta"]
    dist.barrier()  # nobody tears gloo down while the other rank still uses it
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)
    os._exit(0)  # skip C++ static destructors at exit (gloo can abort there)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dcp_two_gloo_processes_on_striped(tmp_path):
    url = f"striped::file://{tmp_path}/dcp2"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, url],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0 and f"rank {rank} ok" in out, out[-3000:]
    names = sorted(n for n in os.listdir(tmp_path / "dcp2") if not n.startswith("."))
    assert names == ["__0_0.distcp", "__1_0.distcp"]
    _assert_striped(url, [".metadata", *names])
    # one process reads the 2-rank checkpoint back whole (resharding through DCP's planner)
    whole = {"w": torch.zeros(10, 6), "b": torch.zeros(9, dtype=torch.float64), "meta": {}}
    whole["meta"] = {"step": 0, "name": ""}
    dcp.load(whole, storage_reader=FsspecReader(url), no_dist=True)
    assert torch.equal(whole["w"], torch.arange(60, dtype=torch.float32).view(10, 6))
    assert whole["meta"] == {"step": 17, "name": "two-ranks"}
    # ... and so does the converter, assembling the shards into one tensor of ours
    dcp_to_bootseer(url, f"{tmp_path}/ours", step=17)
    full = ckpt.CheckpointManager(f"{tmp_path}/ours").load_full(17)
    assert torch.equal(full["w"], whole["w"]) and torch.equal(full["b"], whole["b"])
    assert full["meta.step"] == 17 and full["meta.name"] == "two-ranks"


# -- (b) conversion both ways -------------------------------------------------------------------


def test_convert_dcp_to_ours_to_dcp_is_bit_exact(tmp_path):
    _, _, state = _trained_state(0)
    src = f"{tmp_path}/dcp-src"  # plain DCP files (a path: written as given)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    src_meta = dcp.FileSystemReader(src).read_metadata()

    ours = f"{tmp_path}/ours"
    result = dcp_to_bootseer(src, ours, step=40)
    assert result.step == 40 and result.tensors == 4 + 3 * 4 + 2 and result.objects > 5
    mgr = ckpt.CheckpointManager(ours)
    assert [c.step for c in mgr.list()] == [40] and mgr.verify(40).ok
    full = mgr.load_full(40)
    # FQNs become the flat keys of our checkpoint, unchanged
    assert set(full) == set(src_meta.state_dict_metadata)
    _assert_same(state["model"]["0.weight"], full["model.0.weight"])
    _assert_same(state["optim"]["state"][1]["exp_avg_sq"], full["optim.state.1.exp_avg_sq"])
    assert full["optim.param_groups.0.params"] == [0, 1, 2, 3]
    assert full["optim.param_groups.0.betas"] == (0.9, 0.999)
    assert full["extra.tag"] == "run-0"

    # loading the converted checkpoint into live nested state with CheckpointManager
    target = _fresh_state()
    flat, mapping = flatten_like_dcp(target)
    assert mgr.load(flat) == 40
    _assert_same(state, unflatten_like_dcp(flat, mapping))

    # back to DCP, striped this time; keys and bytes identical to the original
    back = f"striped::file://{tmp_path}/dcp-back"
    result = bootseer_to_dcp(ours, back)
    assert result.step == 40 and result.tensors == len(
        [m for m in src_meta.state_dict_metadata.values() if hasattr(m, "chunks")]
    )
    _assert_striped(back, [".metadata", "__0_0.distcp"])
    back_meta = FsspecReader(back).read_metadata()
    assert set(back_meta.state_dict_metadata) == set(src_meta.state_dict_metadata)
    target = _fresh_state()
    dcp.load(target, storage_reader=FsspecReader(back), no_dist=True)
    _assert_same(state, target)


def test_a_converted_checkpoint_loads_into_nested_state_as_it_is(tmp_path):
    """No flatten_like_dcp by hand: the converted checkpoint says its keys are DCP FQNs, and
    load flattens the nested state the way DCP does, filling tensors in place and putting
    objects back where they were (the optimizer's integer keys stay integers)."""
    _, _, state = _trained_state(0)
    src = f"{tmp_path}/dcp-src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    dcp_to_bootseer(src, f"{tmp_path}/ours", step=40)

    model, opt, target = _trained_state(1)
    weights = target["model"]["0.weight"]
    with ckpt.CheckpointManager(f"{tmp_path}/ours") as mgr:
        assert mgr.load(target) == 40
    _assert_same(state, target)
    assert target["model"]["0.weight"] is weights  # filled in place
    assert sorted(target["optim"]["state"]) == [0, 1, 2, 3]  # no "0".."3" added beside them
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    _assert_same(state["optim"], opt.state_dict())


def test_convert_ours_saved_nested_to_dcp_loads_into_the_same_structure(tmp_path):
    """A checkpoint saved by CheckpointManager from nested state gets DCP's own FQNs."""
    _, _, state = _trained_state(0)
    with ckpt.CheckpointManager(f"{tmp_path}/ours") as mgr:
        mgr.save(3, state, block=True)
    bootseer_to_dcp(f"{tmp_path}/ours", f"{tmp_path}/plain-dcp", step=3)
    target = _fresh_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=dcp.FileSystemReader(f"{tmp_path}/plain-dcp"), no_dist=True)
    _assert_same(state, target)


def test_convert_refuses_to_overwrite_and_names_missing_sources(tmp_path):
    _, _, state = _trained_state(0)
    src = f"striped::file://{tmp_path}/dcp"
    dcp.save(state, storage_writer=FsspecWriter(src), no_dist=True)
    dcp_to_bootseer(src, f"{tmp_path}/ours", step=1)
    with pytest.raises(FileExistsError, match="step 1 already exists"):
        dcp_to_bootseer(src, f"{tmp_path}/ours", step=1)
    dcp_to_bootseer(src, f"{tmp_path}/ours", step=1, overwrite=True)
    with pytest.raises(FileExistsError, match="already holds a DCP checkpoint"):
        bootseer_to_dcp(f"{tmp_path}/ours", src)
    with pytest.raises(ckpt.CheckpointNotFound, match=f"no DCP checkpoint at {tmp_path}/nope"):
        dcp_to_bootseer(f"{tmp_path}/nope", f"{tmp_path}/ours2", step=1)
    with pytest.raises(ckpt.CheckpointNotFound, match="no committed checkpoint under"):
        bootseer_to_dcp(f"{tmp_path}/empty", f"{tmp_path}/x")
    with pytest.raises(ckpt.CheckpointNotFound, match="step 9 is not a committed checkpoint"):
        bootseer_to_dcp(f"{tmp_path}/ours", f"{tmp_path}/x", step=9)


def test_convert_reports_a_corrupt_dcp_stripe_by_name(tmp_path):
    _, _, state = _trained_state(0)
    src = f"striped::file://{tmp_path}/dcp"
    dcp.save(state, storage_writer=FsspecWriter(src, striped={"stripe_size": "4KiB"}), no_dist=True)
    stripes = tmp_path / "dcp" / ".__0_0.distcp.stripes"
    (version,) = os.listdir(stripes)
    victim = stripes / version / "00000000"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"reading DCP checkpoint .* failed: "
        r"StripeChecksumError: stripe 0 of .*__0_0\.distcp .* is corrupt",
    ):
        dcp_to_bootseer(src, f"{tmp_path}/ours", step=1)
    assert ckpt.CheckpointManager(f"{tmp_path}/ours").latest() is None  # nothing committed
