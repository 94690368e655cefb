"""``bootseer ckpt``: list, verify, inspect and convert sharded checkpoints (and DCP ones)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..progress import human_bytes
from .errors import CliError

if TYPE_CHECKING:
    from ckpt import CheckpointManager

log = logging.getLogger("bootseer")

# ckpt (and torch) are imported by the commands, not here: every ``bootseer`` invocation
# builds this parser, and ``bootseer fs`` should not pay for importing torch.


def register(sub: argparse._SubParsersAction) -> None:
    ck = sub.add_parser("ckpt", help="sharded checkpoints: list, verify, inspect, convert (DCP)")
    ck_sub = ck.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", required=True)

    ls = ck_sub.add_parser("ls", help="checkpoints under a URL (committed and incomplete)")
    ls.add_argument("url", help="checkpoint root: path or URL (s3://b/run1, striped::file:///x)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    _options_arg(ls)
    ls.set_defaults(func=cmd_ls, store_args=("url",))

    verify = ck_sub.add_parser(
        "verify",
        help="read every byte and check every checksum",
        description="Check a committed checkpoint: its manifest and indexes against their rules "
        "(world size and ranks, shapes, offsets, byte ranges, every tensor covered "
        "exactly once), every stripe's and tensor's CRC-32, and each objects file's "
        "size and CRC-32. Objects are never deserialized: verify runs no unpickler, "
        "and says how many objects it left as bytes.",
    )
    verify.add_argument("url")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the step to verify (default: the newest)")
    which.add_argument("--all", action="store_true", help="verify every committed step")
    _options_arg(verify)
    verify.set_defaults(func=cmd_verify, store_args=("url",))

    inspect = ck_sub.add_parser("inspect", help="tensors, shapes and owners of one checkpoint")
    inspect.add_argument("url")
    inspect.add_argument("--step", type=int, help="the step to inspect (default: the newest)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    _options_arg(inspect)
    inspect.set_defaults(func=cmd_inspect, store_args=("url",))

    convert = ck_sub.add_parser(
        "convert",
        help="convert between torch.distributed.checkpoint (DCP) and bootseer",
        description="Convert a checkpoint in one process, holding the whole state in memory. "
        "--from dcp: SRC is a DCP checkpoint directory, DST a bootseer checkpoint "
        "root (written as step --step, default 0). --from bootseer: SRC is a "
        "bootseer root (step --step, default the newest), DST the DCP directory; "
        "DST is written as given: a path or s3:// URL gets plain DCP files, a "
        "striped:: URL the striped layout.",
    )
    convert.add_argument("src", help="path or URL to read")
    convert.add_argument("dst", help="path or URL to write")
    convert.add_argument(
        "--from",
        dest="source_format",
        required=True,
        choices=("dcp", "bootseer"),
        help="the format of SRC",
    )
    convert.add_argument(
        "--step",
        type=int,
        help="--from dcp: the step to write (default 0); "
        "--from bootseer: the step to read (default: the newest)",
    )
    convert.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing destination step / DCP checkpoint",
    )
    convert.add_argument(
        "--trust-objects",
        action="store_true",
        help="unpickle any object SRC holds, which can run code: only for a "
        "checkpoint you trust (default: only torch's weights-only "
        "allow-list; --from dcp: also DCP's metadata classes)",
    )
    _options_arg(convert)
    convert.set_defaults(func=cmd_convert, store_args=("src", "dst"))


def _options_arg(p: argparse.ArgumentParser) -> None:
    from ..config import add_config_arguments

    add_config_arguments(p, ("storage", "striped"))


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    from ..config import storage_options

    return storage_options(args.cfg)


def _manager(args: argparse.Namespace, url: str | None = None) -> CheckpointManager:
    from ckpt import CheckpointManager

    return CheckpointManager(url or args.url, storage_options=_storage_options(args))


def _steps(mgr: CheckpointManager) -> tuple[list[int], list[int]]:
    from ckpt import committed_steps

    return committed_steps(mgr.fs, mgr.root)


def _no_checkpoints(url: str, torn: list[int]) -> CliError:
    if torn:
        return CliError(
            f"no committed checkpoint under {url} (incomplete: "
            f"{', '.join(f'step-{s}' for s in torn)})"
        )
    return CliError(f"no checkpoints under {url}")


def _resolve_step(mgr: CheckpointManager, url: str, step: int | None) -> int:
    done, torn = _steps(mgr)
    if not done:
        raise _no_checkpoints(url, torn)
    if step is None:
        return done[-1]
    if step not in done:
        state = "is incomplete (no MANIFEST.json)" if step in torn else "does not exist"
        raise CliError(f"step {step} {state} under {url}; committed steps: {_step_list(done)}")
    return step


def _step_list(steps: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(s) for s in steps[-limit:])
    return shown if len(steps) <= limit else f"... {shown}"


def _when(created: float) -> str:
    return datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, run = [], []
    for r in sorted(set(ranks)):
        if run and r != run[-1] + 1:
            out.append(_run_text(run))
            run = []
        run.append(r)
    if run:
        out.append(_run_text(run))
    return ",".join(out)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


# -- ls ---------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    with _manager(args) as mgr:
        done, torn = _steps(mgr)
        if not done and not torn:
            raise _no_checkpoints(args.url, [])
        infos = {c.step: c for c in mgr.list()}
    rows = []
    for step in sorted({*done, *torn}):
        info = infos.get(step)
        if info is not None:
            rows.append(
                {
                    "step": step,
                    "committed": True,
                    "world_size": info.world_size,
                    "bytes": info.total_bytes,
                    "tensors": info.tensor_count,
                    "created": info.created,
                }
            )
        else:
            rows.append(
                {
                    "step": step,
                    "committed": False,
                    "note": "incomplete" if step in torn else "unreadable manifest",
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'STEP':>10}  {'RANKS':>5}  {'SIZE':>10}  {'TENSORS':>7}  CREATED")
    for row in rows:
        if row["committed"]:
            print(
                f"{row['step']:>10}  {row['world_size']:>5}  {human_bytes(row['bytes']):>10}  "
                f"{row['tensors']:>7}  {_when(row['created'])}"
            )
        else:
            print(f"{row['step']:>10}  {'-':>5}  {'-':>10}  {'-':>7}  ({row['note']})")
    committed = sum(r["committed"] for r in rows)
    print(f"{committed} committed, {len(rows) - committed} incomplete under {args.url}")
    return 0


# -- verify -----------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from ckpt import MANIFEST, CheckpointError, Manifest, step_dir

    failed = 0
    with _manager(args) as mgr:
        if args.all:
            steps, torn = _steps(mgr)
            if not steps:
                raise _no_checkpoints(args.url, torn)
        else:
            steps = [_resolve_step(mgr, args.url, args.step)]
        for step in steps:
            started = time.perf_counter()
            path = f"{step_dir(mgr.root, step)}/{MANIFEST}"
            try:
                manifest = Manifest.from_json(mgr.fs.cat_file(path), path=path)
                log.info(
                    "verifying step %d under %s: %d rank(s), %s",
                    step,
                    args.url,
                    manifest.world_size,
                    human_bytes(manifest.total_bytes),
                )
            except (ValueError, OSError):
                pass  # verify() reports what is wrong with the manifest
            try:
                report = mgr.verify(step)
                ok, checked, problems = report.ok, report.bytes_checked, report.problems
                unread = _not_deserialized(report.objects_not_deserialized, report.object_files)
            except (CheckpointError, OSError) as exc:
                ok, checked, problems, unread = False, 0, [str(exc)], ""
            seconds = time.perf_counter() - started
            if ok:
                print(
                    f"step {step}: ok ({human_bytes(checked)} checked in {seconds:.2f} s{unread})"
                )
            else:
                failed += 1
                print(f"step {step}: FAILED, {len(problems)} problem(s):")
                for problem in problems:
                    print(f"  {problem}")
                if unread:
                    print(f"  ({unread.removeprefix('; ')})")
    return 1 if failed else 0


def _not_deserialized(objects: int, files: int) -> str:
    """verify never unpickles: say what it left as bytes."""
    if not objects:
        return ""
    return (
        f"; {objects} object(s) in {files} objects file(s) checked by size and CRC-32, "
        "not deserialized"
    )


# -- inspect ----------------------------------------------------------------------------------


def describe(mgr: CheckpointManager, url: str, step: int) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data."""
    from ckpt import CheckpointError, CheckpointView, element_size

    try:
        view = CheckpointView(mgr.fs, mgr.root, step)
    except CheckpointError as exc:
        raise CliError(f"cannot inspect step {step} under {url}: {exc}") from None
    tensors = []
    for key in sorted(view.keys):
        info = view.keys[key]
        chunks = info.index.chunks
        itemsize = element_size(info.dtype)
        tensors.append(
            {
                "key": key,
                "kind": info.kind,
                "dtype": info.dtype,
                "shape": list(info.global_shape),
                "bytes": _numel(info.global_shape) * itemsize,
                "ranks": sorted({c.rank for c in chunks}),
                "chunks": len(chunks),
            }
        )
    objects = {idx.rank: idx.object_keys for idx in view.indexes}
    m = view.manifest
    return {
        "url": url,
        "step": step,
        "world_size": m.world_size,
        "total_bytes": m.total_bytes,
        "tensor_count": m.tensor_count,
        "created": m.created,
        "data_files": [
            {"rank": i.rank, "bytes": i.data_size, "objects_bytes": i.objects_size}
            for i in view.indexes
        ],
        "tensors": tensors,
        "objects": {str(r): keys for r, keys in objects.items()},
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def cmd_inspect(args: argparse.Namespace) -> int:
    with _manager(args) as mgr:
        step = _resolve_step(mgr, args.url, args.step)
        data = describe(mgr, args.url, step)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"step {step} under {args.url}: {data['world_size']} rank(s), "
        f"{human_bytes(data['total_bytes'])}, {data['tensor_count']} tensor(s), "
        f"created {_when(data['created'])}"
    )
    rows = [
        (
            t["key"],
            t["kind"],
            t["dtype"],
            "[" + ", ".join(map(str, t["shape"])) + "]",
            human_bytes(t["bytes"]),
            f"{_ranks(t['ranks'])} ({t['chunks']} chunk{'s' if t['chunks'] != 1 else ''})",
        )
        for t in data["tensors"]
    ]
    header = ("KEY", "KIND", "DTYPE", "SHAPE", "BYTES", "RANKS")
    widths = [max([len(header[i]), *(len(r[i]) for r in rows)]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for row in rows:
        print(
            "  ".join(
                c.ljust(w) if i != 4 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for rank, keys in data["objects"].items():
        groups[tuple(keys)].append(int(rank))
    print("objects:")
    for keys, ranks in sorted(groups.items(), key=lambda kv: min(kv[1])):
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
        print(f"  {label}: {', '.join(keys) if keys else '(none)'}")
    return 0


# -- convert ----------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from ckpt import CheckpointManager, bootseer_to_dcp, dcp_to_bootseer

    options = _storage_options(args)
    try:
        if args.source_format == "dcp":
            step = 0 if args.step is None else args.step
            if step < 0:
                raise CliError(f"--step {step}: steps are non-negative")
            result = dcp_to_bootseer(
                args.src,
                args.dst,
                step,
                options,
                overwrite=args.overwrite,
                trust_objects=args.trust_objects,
            )
        else:
            with CheckpointManager(args.src, storage_options=options) as mgr:
                step = _resolve_step(mgr, args.src, args.step)
            result = bootseer_to_dcp(
                args.src,
                args.dst,
                step,
                options,
                overwrite=args.overwrite,
                trust_objects=args.trust_objects,
            )
    except FileExistsError as exc:
        raise CliError(f"{exc} (pass --overwrite)") from None
    except RuntimeError as exc:
        raise CliError(f"cannot convert {args.src}: {exc}") from None
    kind = "DCP" if args.source_format == "dcp" else "bootseer"
    print(
        f"converted {kind} {args.src} -> {args.dst} (step {result.step}): {result.tensors} "
        f"tensor(s) {human_bytes(result.tensor_bytes)}, {result.objects} object(s) in "
        f"{result.seconds:.2f} s"
    )
    return 0
