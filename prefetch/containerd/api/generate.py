"""Regenerates the committed Python code next to the .proto files in this folder.

The generated ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` are committed rather than built
at install time: build-time generation breaks editable installs and would tie every install to
grpcio-tools. ``python -m prefetch.containerd.api.generate`` rewrites them in place (``make
protos``); ``--check`` generates into a temporary folder and exits 1, naming each file that
differs from, is missing from or is left over in the committed tree (the drift test runs it).

protoc runs from the repository root with ``-I .``, so that imports read
``prefetch/containerd/api/...`` and the generated modules import each other as
``prefetch.containerd.api...`` packages.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

API_DIR = Path(__file__).resolve().parent
REPO_ROOT = API_DIR.parents[2]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto files, relative to the repository root (the form protoc is given)."""
    return sorted(p.relative_to(REPO_ROOT) for p in API_DIR.rglob("*.proto"))


def generated_files(root: Path) -> set[Path]:
    """Generated files under ``root``'s copy of this folder, relative to ``root``."""
    base = root / API_DIR.relative_to(REPO_ROOT)
    return {
        p.relative_to(root)
        for p in base.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def run_protoc(out_dir: Path) -> None:
    """Generates messages, type stubs and gRPC stubs for every .proto into ``out_dir``."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("needs grpcio-tools (pip install -e '.[test]')") from exc
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    includes = ["-I", str(REPO_ROOT), "-I", str(well_known)]
    protos = proto_files()
    # gRPC stubs only where there is a service: types/*.proto would get empty modules.
    with_services = [
        p for p in protos if re.search(r"^service\s", (REPO_ROOT / p).read_text(), re.MULTILINE)
    ]
    runs = [
        [f"--python_out={out_dir}", f"--pyi_out={out_dir}", *map(str, protos)],
        [f"--grpc_python_out={out_dir}", *map(str, with_services)],
    ]
    for run in runs:
        if protoc.main(["grpc_tools.protoc", *includes, *run]) != 0:
            raise SystemExit("protoc failed (see above)")


def check() -> list[str]:
    """Differences between freshly generated code and the committed files, one line each."""
    with tempfile.TemporaryDirectory(prefix="bootseer-protos-") as tmp:
        fresh_root = Path(tmp)
        run_protoc(fresh_root)
        fresh, committed = generated_files(fresh_root), generated_files(REPO_ROOT)
        problems = [f"missing: {p}" for p in sorted(fresh - committed)]
        problems += [f"stale (no .proto generates it): {p}" for p in sorted(committed - fresh)]
        problems += [
            f"differs: {p}"
            for p in sorted(fresh & committed)
            if not filecmp.cmp(fresh_root / p, REPO_ROOT / p, shallow=False)
        ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefetch.containerd.api.generate", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed generated code is out of date"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("generated protobuf code is out of date: run `make protos`", file=sys.stderr)
            return 1
        print(f"generated code is up to date ({len(proto_files())} .proto files)")
        return 0
    run_protoc(REPO_ROOT)
    print(f"generated code for {len(proto_files())} .proto files under {API_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
