"""Where a checkpoint's files live and what its index and manifest say.

```
<url>/step-<N>/rank-<r>.data          raw tensor bytes, 64-byte aligned (striped file)
<url>/step-<N>/rank-<r>.objects       non-tensor state of rank r (torch.save, optional)
<url>/step-<N>/rank-<r>.index.json    what rank r wrote; its presence marks r's shard durable
<url>/step-<N>/MANIFEST.json          written last, by rank 0: the commit point
```
A ``step-<N>`` directory without ``MANIFEST.json`` does not exist for readers.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: `bootseer run` prefetches before torch exists
    import torch

    from striped_fs import StripedFileSystem

FORMAT_VERSION = 1
ALIGN = 64
MANIFEST = "MANIFEST.json"
_STEP_RE = re.compile(r"^step-(\d+)$")

# The dtypes a checkpoint may hold, with their element sizes. Names, not torch objects: the
# layout is read by processes that never import torch (the node-local cache's prefetch).
ELEMENT_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ELEMENT_SIZES:
        raise ValueError(f"dtype {dtype} is not supported in checkpoints")
    return name


def dtype_of(name: str) -> torch.dtype:
    import torch

    if name not in ELEMENT_SIZES:
        raise ValueError(f"unknown dtype {name!r} in checkpoint index")
    return getattr(torch, name)


def element_size(name: str) -> int:
    try:
        return ELEMENT_SIZES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in checkpoint index") from None


def step_dir(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step-{step}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def data_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def objects_name(rank: int) -> str:
    return f"rank-{rank:05d}.objects"


def index_name(rank: int) -> str:
    return f"rank-{rank:05d}.index.json"


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class ChunkRecord:
    """One stored chunk: where it sits in the global tensor and in the rank's data file."""

    key: str
    kind: str
    dtype: str
    global_shape: list[int]
    offsets: list[int]
    shape: list[int]
    byte_offset: int
    nbytes: int
    crc32: int


@dataclass
class RankIndex:
    step: int
    rank: int
    world_size: int
    data_size: int
    chunks: list[ChunkRecord]
    tensor_keys: list[str]  # every tensor key this rank holds, written by it or not
    replicated_keys: list[str]
    object_keys: list[str]
    objects_size: int = 0
    objects_crc32: int = 0
    attempt: str = ""  # which run of the job wrote it: the commit only mixes one attempt
    format: int = FORMAT_VERSION
    created: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> RankIndex:
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {body.get('format')!r}, expected {FORMAT_VERSION}")
            body["chunks"] = [ChunkRecord(**c) for c in body["chunks"]]
            index = cls(**body)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}: malformed checkpoint index ({exc})") from exc
        for c in index.chunks:
            if c.byte_offset < 0 or c.nbytes < 0 or c.byte_offset + c.nbytes > index.data_size:
                raise ValueError(f"{path}: chunk {c.key} lies outside the data file "
                                 f"({c.byte_offset}+{c.nbytes} > {index.data_size})")
            elem = element_size(c.dtype)
            count = 1
            for s in c.shape:
                count *= s
            if count * elem != c.nbytes or len(c.shape) != len(c.global_shape) != len(c.offsets):
                raise ValueError(f"{path}: chunk {c.key} declares {c.nbytes} bytes for shape {c.shape}")
        return index


@dataclass
class Manifest:
    step: int
    world_size: int
    ranks: list[dict[str, Any]]  # rank, data_size, index crc32
    total_bytes: int
    tensor_count: int
    format: int = FORMAT_VERSION
    created: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> Manifest:
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {body.get('format')!r}, expected {FORMAT_VERSION}")
            return cls(**body)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: malformed checkpoint manifest ({exc})") from exc


def committed_steps(fs: StripedFileSystem, root: str) -> tuple[list[int], list[int]]:
    """(committed steps, uncommitted step directories), both ascending."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return [], []
    steps = sorted(s for e in entries if e["type"] == "directory"
                   and (s := parse_step(e["name"])) is not None)
    done, torn = [], []
    for s in steps:
        (done if fs.exists(f"{step_dir(root, s)}/{MANIFEST}") else torn).append(s)
    return done, torn
