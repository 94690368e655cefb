"""A load is all or nothing (issue 27, point 1).

The defect: one digit of the newest step's striped manifest changed (``"stripe_size":65536``
to ``64536``) made ``load()`` fall back to the previous step, while the reads of the damaged
step, abandoned but still running (retrying a stripe that failed its checksum), went on
writing into the caller's tensors after ``load()`` had returned: 0-7 of 8 tensors wrong at the
return, up to 8 of 8 a few seconds later.

Here, on real files and real processes: every byte of the newest step's manifests and
indexes, and a sample of its first data stripe, is flipped in turn, and each load must return
the newest step or the previous one, bit for bit, with no read of it still running (the
backend has nothing in flight, no loader thread is alive). The digit edits themselves are
refused before any read of the damaged step starts (the tensor only that step holds keeps
its sentinel), on local disk and on S3, and the field is named. The damaged-shard resume runs
on 2 and 3 gloo ranks, several times, each rank process exiting cleanly (the SIGABRT seen
once in 11 runs was a read still running at teardown).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import ckpt_workers as W
import pytest
import torch

from ckpt import CheckpointManager
from ckpt.layout import MANIFEST, data_name, index_name, step_dir
from striped_fs import ManifestError
from striped_fs.layout import Manifest as StripeManifest
from striped_fs.layout import stripe_path, version_dir
from striped_fs.urls import url_to_fs

STRIPE = 64 * 1024
# The fuzz keeps the one refetch of a stripe that fails its checksum (the path of the defect)
# with a 1 ms backoff instead of 0.1 s: ~1500 such failures would otherwise sleep for minutes.
FAST_RETRY = {"striped": {"backoff_s": 0.001, "backoff_cap_s": 0.002}}


# -- states ------------------------------------------------------------------------------------


def model_state(step: int, *, extra: bool = False) -> dict[str, Any]:
    """The issue's shape: 8 model tensors (about 1.4 MB, 22 stripes of 64 KiB) and a step;
    ``extra`` adds a tensor that only this step holds."""
    g = torch.Generator().manual_seed(step)
    state: dict[str, Any] = {
        "model": {
            f"layer{i}.weight": torch.randn(40_000 + 1000 * i, generator=g) for i in range(8)
        },
        "step": step,
    }
    if extra:
        state["only_newest"] = torch.randn(5000, generator=g)
    return state


def small_state(step: int) -> dict[str, Any]:
    """Three tensors of three dtypes (three stripes) and an object: what the fuzz loads
    about two thousand times."""
    g = torch.Generator().manual_seed(step)
    return {
        "a": torch.randn(20_000, generator=g),
        "b": torch.randn(13, 1000, generator=g),
        "c": torch.randint(0, 1 << 40, (3000,), generator=g),
        "step": step,
    }


def blank_of(state: dict[str, Any], fill: float = 7.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = blank_of(value, fill)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.full_like(value, fill)
        else:
            out[key] = None
    return out


def differences(got: dict[str, Any], want: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys whose value in ``got`` is not ``want``'s, bit for bit."""
    out = []
    for key, value in want.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += differences(got[key], value, f"{name}/")
        elif isinstance(value, torch.Tensor):
            if not W.bit_equal(got[key], value):
                out.append(name)
        elif got[key] != value:
            out.append(f"{name} ({got[key]!r})")
    return out


def save_steps(url: str, states: dict[int, dict[str, Any]], **options: Any) -> None:
    with CheckpointManager(url, stripe_size=STRIPE, cache_dir=False, **options) as mgr:
        for step, state in states.items():
            mgr.save(step, state, block=True)


def nothing_still_reading(mgr: CheckpointManager) -> list[str]:
    """What of a finished load is still going: operations in flight on the backend (queued,
    running, sleeping before a retry) and loader threads alive. Empty: nothing can write
    into the state any more."""
    left = [f"{mgr.fs.backend.busy} backend operation(s) in flight"] if mgr.fs.backend.busy else []
    return left + [t.name for t in threading.enumerate() if t.name.startswith("ckpt-load")]


# -- the newest step's files, as they lie on disk ------------------------------------------------


def on_disk(url: str, step: int, name: str) -> tuple[Path, list[Path]]:
    """The striped file ``name`` of ``step``: its manifest and its stripe objects."""
    fs, root = url_to_fs(url)
    path = f"{step_dir(root, step)}/{name}"
    manifest = StripeManifest.from_bytes(fs.target.cat_file(path), path=path)
    return Path(path), [
        Path(stripe_path(path, manifest.version, i)) for i in range(manifest.stripe_count)
    ]


def flip(path: Path, offset: int, mask: int = 0x01) -> bytes:
    """Flip bits of one byte of ``path`` in place; returns the original bytes."""
    raw = path.read_bytes()
    damaged = bytearray(raw)
    damaged[offset] ^= mask
    path.write_bytes(bytes(damaged))
    return raw


# -- (a) byte flips -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("whole") / "fuzz")
    save_steps(url, {1: small_state(1), 2: small_state(2)})
    return url


def fuzz_targets(url: str) -> list[tuple[str, Path, list[int]]]:
    """(what, file, offsets): every byte of the newest step's manifests and indexes (the
    striped manifests and the stripes holding their JSON), and 48 bytes of its first data
    stripe (each flip there fails that stripe's checksum; all 65536 would only repeat it)."""
    targets = []
    for name in (MANIFEST, index_name(0)):
        manifest, (stripe,) = on_disk(url, 2, name)
        targets.append(
            (f"striped manifest of {name}", manifest, list(range(manifest.stat().st_size)))
        )
        targets.append((f"{name}", stripe, list(range(stripe.stat().st_size))))
    manifest, stripes = on_disk(url, 2, data_name(0))
    assert len(stripes) == 3
    targets.append(
        (f"striped manifest of {data_name(0)}", manifest, list(range(manifest.stat().st_size)))
    )
    size = stripes[0].stat().st_size
    targets.append(
        (
            f"stripe 0 of {data_name(0)}",
            stripes[0],
            sorted({0, 1, size - 1, *range(7, size, size // 45)}),
        )
    )
    return targets


def test_a_flipped_byte_in_the_newest_step_loads_it_or_the_previous_one_whole(
    fuzz_store: str,
) -> None:
    """Each flip: the load returns step 2 (a byte nothing depends on, such as a digit of
    ``created``) or step 1, and the state is that step's bit for bit, with nothing of the
    load still running when it returns."""
    logging.disable(logging.WARNING)  # ~2000 fallbacks, each warned about
    failures: list[str] = []
    outcomes = {1: 0, 2: 0}
    try:
        for what, path, offsets in fuzz_targets(fuzz_store):
            for offset in offsets:
                original = flip(path, offset)
                try:
                    state = blank_of(small_state(0))
                    with CheckpointManager(
                        fuzz_store, stripe_size=STRIPE, cache_dir=False, storage_options=FAST_RETRY
                    ) as mgr:
                        try:
                            step = mgr.load(state)
                        except Exception as exc:  # noqa: BLE001 - collected, then asserted
                            failures.append(f"{what} byte {offset}: {type(exc).__name__}: {exc}")
                            continue
                        left = nothing_still_reading(mgr)
                    wrong = differences(state, small_state(step)) if step in (1, 2) else ["step"]
                    if wrong or left:
                        failures.append(
                            f"{what} byte {offset}: step {step}, wrong {wrong}, "
                            f"still running {left}"
                        )
                    outcomes[step] = outcomes.get(step, 0) + 1
                finally:
                    path.write_bytes(original)
    finally:
        logging.disable(logging.NOTSET)
    assert not failures, f"{len(failures)} flip(s) failed:\n" + "\n".join(failures[:20])
    # most flips break step 2; a few (a digit of "created") leave it loadable
    assert outcomes[1] > 10 * outcomes[2] > 0, outcomes
    with CheckpointManager(fuzz_store, stripe_size=STRIPE, cache_dir=False) as mgr:
        state = blank_of(small_state(0))
        assert mgr.load(state) == 2 and differences(state, small_state(2)) == []


# -- (b) the digit edits ------------------------------------------------------------------


def edit_data_manifest(url: str, step: int, old: bytes, new: bytes) -> str:
    """Replace ``old`` with ``new`` in rank 0's data file manifest of ``step`` (byte for byte,
    nothing else touched); returns the data file's path."""
    manifest, _ = on_disk(url, step, data_name(0))
    raw = manifest.read_bytes()
    assert raw.count(old) == 1, raw
    manifest.write_bytes(raw.replace(old, new))
    return str(manifest)


@pytest.mark.parametrize("digits", ["64536", "65535", "65537"])
def test_a_stripe_size_digit_edit_is_refused_before_any_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, digits: str
) -> None:
    """The issue's reproduction: the load falls back to step 1, every tensor step 1's at
    the return and still a second later, nothing of step 2 running; step 2 was refused from
    its manifest and the listing of its stripes alone: the tensor only step 2 holds (not in
    step 1, so a non-strict load leaves it) keeps its sentinel, and the warning names the
    data file and the field."""
    plain, extra = str(tmp_path / "plain"), str(tmp_path / "extra")
    save_steps(plain, {1: model_state(1), 2: model_state(2)})
    save_steps(extra, {1: model_state(1), 2: model_state(2, extra=True)})
    edited = {}
    for url in (plain, extra):
        size = StripeManifest.from_bytes(
            on_disk(url, 2, data_name(0))[0].read_bytes(), path="data"
        ).size
        # the same stripe count either way: the manifest parses, the objects refuse it
        assert -(-size // int(digits)) == -(-size // STRIPE)
        edited[url] = edit_data_manifest(
            url, 2, b'"stripe_size":65536', f'"stripe_size":{digits}'.encode()
        )

    state = blank_of(model_state(0))
    with (
        CheckpointManager(plain, stripe_size=STRIPE, cache_dir=False) as mgr,
        caplog.at_level(logging.WARNING),
    ):
        assert mgr.load(state) == 1
        assert nothing_still_reading(mgr) == []
        assert differences(state, model_state(1)) == []
    time.sleep(1.0)  # what the defect did after the return (a retry's backoff is ~0.1 s)
    assert differences(state, model_state(1)) == []
    warned = [r.getMessage() for r in caplog.records if r.name == "ckpt"]
    assert any(
        "step 2" in w
        and data_name(0) in w
        and "'stripe_size'" in w
        and f"stripe_size {digits}" in w
        for w in warned
    ), warned
    # refused before reading: no stripe of step 2's data file was fetched, so none retried
    assert not [
        r for r in caplog.records if r.name == "striped_fs" and "retrying" in r.getMessage()
    ]
    assert edited[plain] in "\n".join(warned)

    state = blank_of(model_state(0, extra=True))
    with CheckpointManager(extra, stripe_size=STRIPE, cache_dir=False) as mgr:
        report = mgr.load_with_report(state, strict=False)
        assert nothing_still_reading(mgr) == []
    assert report.step == 1 and report.missing == ["only_newest"]
    assert differences(state["model"], model_state(1)["model"]) == []
    assert torch.equal(state["only_newest"], torch.full((5000,), 7.0))  # nothing of step 2 landed


def test_a_stripe_size_digit_edit_on_s3_is_refused_before_any_read(
    s3_bucket: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """The same on S3 (moto): the stripe objects' sizes come from one LIST of the version's
    prefix."""
    bucket, options = s3_bucket
    url, storage = f"s3://{bucket}/run", {"s3": options}
    save_steps(url, {1: model_state(1), 2: model_state(2)}, storage_options=storage)
    fs, root = url_to_fs(url, storage)
    path = f"{step_dir(root, 2)}/{data_name(0)}"
    raw = fs.target.cat_file(path)
    fs.target.pipe_file(path, raw.replace(b'"stripe_size":65536', b'"stripe_size":65535'))
    state = blank_of(model_state(0))
    with (
        CheckpointManager(url, storage_options=storage, cache_dir=False) as mgr,
        caplog.at_level(logging.WARNING),
    ):
        assert mgr.load(state) == 1
        assert nothing_still_reading(mgr) == []
    assert differences(state, model_state(1)) == []
    assert any(
        "'stripe_size'" in r.getMessage() and data_name(0) in r.getMessage()
        for r in caplog.records
        if r.name == "ckpt"
    ), caplog.text


def test_a_manifest_that_does_not_match_its_stripe_objects_names_the_field(tmp_path: Path) -> None:
    """``StripedSource.check_objects`` on crafted manifests of one striped file (3.5
    stripes): each disagreement with the objects is a ManifestError naming the file and the
    field; the true manifest passes."""
    fs, _ = url_to_fs(str(tmp_path))
    path = str(tmp_path / "file.bin")
    fs.pipe_file(path, bytes(range(256)) * (STRIPE * 7 // 2 // 256), stripe_size=STRIPE)
    true = StripeManifest.from_bytes(Path(path).read_bytes(), path=path)
    assert true.stripe_count == 4

    def refused(manifest: StripeManifest) -> ManifestError:
        Path(path).write_bytes(manifest.to_bytes())
        with pytest.raises(ManifestError) as err:
            fs._resolve(path, fs.options).check_objects()
        assert path in str(err.value)
        return err.value

    def variant(**fields: Any) -> StripeManifest:
        base = {
            "size": true.size,
            "stripe_size": true.stripe_size,
            "version": true.version,
            "checksums": true.checksums,
        }
        return StripeManifest(**{**base, **fields})

    err = refused(variant(stripe_size=STRIPE - 1))
    assert err.field == "stripe_size" and f"stripe_size {STRIPE - 1}" in str(err)
    err = refused(variant(size=true.size - 1))  # the last stripe one byte short
    assert err.field == "size" and err.stripe == 3
    err = refused(variant(version="0" * 32))
    assert err.field == "version"
    err = refused(variant(size=true.size - STRIPE // 2, checksums=true.checksums[:3]))
    assert err.field == "stripes" and "00000003" in str(err)  # a stripe nobody lists

    Path(path).write_bytes(true.to_bytes())
    second = Path(stripe_path(path, true.version, 1))
    kept = second.read_bytes()
    second.unlink()
    err = refused(true)
    assert err.field == "stripes" and "stripe 1" in str(err)
    second.write_bytes(kept)
    fs._resolve(path, fs.options).check_objects()  # as written: passes
    assert Path(version_dir(path, true.version)).is_dir()
    assert fs.cat_file(path) == bytes(range(256)) * (STRIPE * 7 // 2 // 256)


# -- (c) the damaged-shard resume on 2 and 3 gloo ranks ---------------------------------------------

RUNS = 3  # processes started per world: each run exits its ranks, the teardown the abort hit


@pytest.mark.parametrize("world", [2, 3])
def test_the_damaged_shard_resume_on_gloo_ranks_never_aborts(tmp_path: Path, world: int) -> None:
    """Rank W-1's shard of step 3 damaged, two ways: a flipped byte (a stripe checksum
    failure, retried once) and the issue's digit edit of its manifest. ``RUNS`` fresh groups
    of ``world`` processes each load both (twice): every rank process exits cleanly (a
    signal would raise here), every rank resumes from step 2, bit for bit step 2's state."""
    last = world - 1
    flipped, edited = str(tmp_path / "flipped"), str(tmp_path / "edited")
    for url in (flipped, edited):
        W.save_agree_steps(url, world, [1, 2, 3])
    W.flip_chunk_byte(flipped, 3, last, "w")
    fs, root = url_to_fs(edited)
    path = f"{step_dir(root, 3)}/{data_name(last)}"
    raw = fs.target.cat_file(path)
    fs.target.pipe_file(path, raw.replace(b'"stripe_size":65536', b'"stripe_size":65535'))
    actions = [
        {
            "op": "agree_load",
            "tag": f"{name}-{i}",
            "url": url,
            "step": None,
            "saved_world": world,
            "extra_key_on": [],
            "urls": {},
        }
        for i in range(2)
        for name, url in (("flipped", flipped), ("edited", edited))
    ]
    for run in range(RUNS):
        results = W.run_group(world, actions, tmp_path / f"run-{run}")  # raises on a signal
        for action in actions:
            got = results[action["tag"]]
            assert sorted(got) == list(range(world)), (run, action["tag"], got)
            for rank, r in sorted(got.items()):
                assert "error" not in r, (run, action["tag"], rank, r["error"])
                assert r.get("step") == 2, (run, action["tag"], rank, r)
                assert r["problems"] == [], (run, action["tag"], rank, r["problems"])
                assert any(
                    "step 3 " in w and f"by rank {last}:" in w and data_name(last) in w
                    for w in r["warnings"]
                ), (run, action["tag"], rank, r["warnings"])


def test_a_backoff_on_the_event_loop_ends_when_its_reads_are_abandoned() -> None:
    """s3fs reads retry on an event loop: their backoff must end at the cancel too, or the
    load's join after a failure waits out every abandoned read's delay (up to seconds)."""
    import asyncio

    from striped_fs.cancel import CancelToken, ReadCancelled

    token = CancelToken()
    threading.Timer(0.2, token.cancel).start()
    with pytest.raises(ReadCancelled):
        asyncio.run(token.sleep_async(600.0))  # the test's own timeout ends it otherwise
    asyncio.run(CancelToken().sleep_async(0.01))  # not cancelled: an ordinary sleep
