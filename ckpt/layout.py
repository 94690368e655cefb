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

import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .flatten import KINDS as CONTAINER_KINDS

if TYPE_CHECKING:  # torch is imported lazily: `bootseer run` prefetches before torch exists
    import torch

    from striped_fs import StripedFileSystem

FORMAT_VERSION = 1  # MANIFEST.json
# rank-R.index.json: 2 added ``containers`` (which levels of the state were lists or
# int-keyed dicts) and ``key_style`` ("dcp": keys are DCP FQNs); 1 is still read.
INDEX_FORMAT = 2
INDEX_FORMATS = (1, 2)
KEY_STYLES = ("", "dcp")
ALIGN = 64
# Bounds on what an index or manifest may declare (docs/ckpt.md, "What is checked"): every
# length is checked against these and against the bytes before anything is allocated.
MAX_WORLD_SIZE = 1 << 20
MAX_NDIM = 64
MAX_BYTES = 1 << 62  # any size, offset or tensor extent: products stay within torch's int64
_U32 = (1 << 32) - 1
MAX_TIME = 253_402_300_799  # 9999-12-31T23:59:59Z
KINDS = ("tensor", "dtensor", "flat")
# A layout of one tensor's chunks that needs more cells than this to check is refused
# (chunks written by ckpt always form a grid of one cell each and never get near it).
MAX_TILING_CELLS = 1 << 22
MANIFEST = "MANIFEST.json"
_STEP_RE = re.compile(r"^step-(\d+)$")

# The dtypes a checkpoint may hold, with their element sizes. Names, not torch objects: the
# layout is read by processes that never import torch (the node-local cache's prefetch).
ELEMENT_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
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
    format: int = INDEX_FORMAT
    created: float = field(default_factory=time.time)
    # {container key: "list" | "int"}: the levels of the state that were not dicts keyed by
    # strings (ckpt.flatten.container_kinds); None in format 1 indexes
    containers: dict[str, str] | None = None
    key_style: str = ""  # "dcp": converted from DCP, keys are DCP FQNs (flat)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> RankIndex:
        """Parse and check an index: every declared length, offset and count against the
        rules below, each refusal naming the file, the chunk and the rule."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError(f"a JSON {type(body).__name__}, expected an object")
            if body.get("format") not in INDEX_FORMATS:
                raise ValueError(
                    f"format {body.get('format')!r}, expected one of "
                    f"{list(INDEX_FORMATS)} (a newer bootseer wrote it?)"
                )
            if not isinstance(body.get("chunks"), list) or not all(
                isinstance(c, dict) for c in body["chunks"]
            ):
                raise ValueError("chunks must be a list of objects")
            body["chunks"] = [ChunkRecord(**c) for c in body["chunks"]]
            index = cls(**body)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}: malformed checkpoint index ({exc})") from exc
        index._check(path)
        return index

    def _check(self, path: str) -> None:
        world = _int(path, "world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _int(path, "step", self.step)
        _int(path, "rank", self.rank, 0, world - 1)
        _int(path, "data_size", self.data_size)
        _int(path, "objects_size", self.objects_size)
        _int(path, "objects_crc32", self.objects_crc32, 0, _U32)
        for name in ("tensor_keys", "replicated_keys", "object_keys"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"{path}: {name} must be a list of strings")
        if not isinstance(self.attempt, str):
            raise ValueError(f"{path}: attempt must be a string")
        if self.key_style not in KEY_STYLES:
            raise ValueError(
                f"{path}: key_style {self.key_style!r} (rule: one of {list(KEY_STYLES)})"
            )
        if self.containers is not None and not (
            isinstance(self.containers, dict)
            and all(isinstance(k, str) and v in CONTAINER_KINDS for k, v in self.containers.items())
        ):
            raise ValueError(f"{path}: containers must map keys to one of {list(CONTAINER_KINDS)}")
        _time(path, self.created)
        for c in self.chunks:
            _check_chunk(path, c, self.data_size)
        # Disjoint byte ranges: what a reader allocates for the chunks is then bounded by the
        # data file's size, which it checks against the file before allocating.
        end, previous = 0, None
        for c in sorted((c for c in self.chunks if c.nbytes), key=lambda c: c.byte_offset):
            if c.byte_offset < end:
                raise ValueError(
                    f"{path}: chunk {c.key!r} at bytes {c.byte_offset}+{c.nbytes} "
                    f"overlaps chunk {previous!r} (rule: chunks occupy disjoint "
                    "byte ranges of the data file)"
                )
            end, previous = c.byte_offset + c.nbytes, c.key


def _int(path: str, what: str, value: Any, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{path}: {what} is {value!r} (rule: an integer in [{lo}, {hi}])")
    return value


def _time(path: str, value: Any) -> None:
    """A ``created`` time that tools can print (a number of seconds up to year 9999)."""
    if type(value) not in (int, float) or not 0 <= value <= MAX_TIME:
        raise ValueError(
            f"{path}: created is {value!r} (rule: seconds since the epoch in [0, {MAX_TIME}])"
        )


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_chunk(path: str, c: ChunkRecord, data_size: int) -> None:
    """One chunk against the rules: known kind and dtype; shape, offsets and global shape
    lists of non-negative integers of one length; the chunk inside the global tensor; its
    byte range inside the data file and exactly as long as its shape says.

    Every load checks every chunk, so the common case is one pass of cheap tests; a chunk
    that fails any of them is explained, rule by rule, by ``_explain_chunk``."""
    elem = ELEMENT_SIZES.get(c.dtype) if type(c.dtype) is str else None
    g, o, n = c.global_shape, c.offsets, c.shape
    if (
        elem is not None
        and type(c.key) is str
        and c.kind in KINDS
        and type(g) is list
        and type(o) is list
        and type(n) is list
        and len(g) == len(o) == len(n) <= MAX_NDIM
        and type(c.byte_offset) is int
        and type(c.nbytes) is int
        and type(c.crc32) is int
        and 0 <= c.byte_offset
        and 0 <= c.nbytes
        and c.byte_offset + c.nbytes <= data_size
        and 0 <= c.crc32 <= _U32
    ):
        total = count = elem
        for gd, od, nd in zip(g, o, n, strict=True):
            if (
                type(gd) is not int
                or type(od) is not int
                or type(nd) is not int
                or od < 0
                or nd < 0
                or od + nd > gd
            ):
                break
            total *= gd
            count *= nd
        else:
            if total <= MAX_BYTES and count == c.nbytes:
                return
    _explain_chunk(path, c, data_size)


def _explain_chunk(path: str, c: ChunkRecord, data_size: int) -> None:
    """Raise the first rule of ``_check_chunk`` that ``c`` breaks."""
    if not isinstance(c.key, str):
        raise ValueError(f"{path}: a chunk's key is {c.key!r} (rule: a string)")
    where = f"{path}: chunk {c.key!r}"
    if c.kind not in KINDS:
        raise ValueError(f"{where}: kind {c.kind!r} (rule: one of {', '.join(KINDS)})")
    if c.dtype not in ELEMENT_SIZES:
        raise ValueError(f"{where}: unknown dtype {c.dtype!r} (rule: one of the supported dtypes)")
    dims = (c.global_shape, c.offsets, c.shape)
    if not all(isinstance(d, list) and all(type(x) is int for x in d) for d in dims):
        raise ValueError(f"{where}: global_shape, offsets and shape must be lists of integers")
    if not len(c.global_shape) == len(c.offsets) == len(c.shape) <= MAX_NDIM:
        raise ValueError(
            f"{where}: global shape {c.global_shape}, offsets {c.offsets} and shape "
            f"{c.shape} (rule: the same number of dimensions, at most {MAX_NDIM})"
        )
    for g, o, n in zip(c.global_shape, c.offsets, c.shape, strict=True):
        if g < 0 or o < 0 or n < 0 or o + n > g:
            raise ValueError(
                f"{where}: offsets {c.offsets} and shape {c.shape} (rule: a "
                f"chunk lies inside its global shape {c.global_shape})"
            )
    elem = ELEMENT_SIZES[c.dtype]
    if numel(c.global_shape) * elem > MAX_BYTES:
        raise ValueError(
            f"{where}: global shape {c.global_shape} of {c.dtype} (rule: at most {MAX_BYTES} bytes)"
        )
    _int(where, "byte_offset", c.byte_offset)
    _int(where, "nbytes", c.nbytes)
    _int(where, "crc32", c.crc32, 0, _U32)
    if c.byte_offset + c.nbytes > data_size:
        raise ValueError(
            f"{where}: bytes {c.byte_offset}+{c.nbytes} (rule: inside the data "
            f"file, whose index says {data_size} bytes)"
        )
    if numel(c.shape) * elem != c.nbytes:
        raise ValueError(
            f"{where}: {c.nbytes} bytes for shape {c.shape} of {c.dtype} (rule: "
            f"nbytes = elements x {elem})"
        )
    raise AssertionError(f"{where}: _check_chunk and _explain_chunk disagree")  # pragma: no cover


def tiling_problem(
    global_shape: Sequence[int], boxes: Iterable[tuple[Sequence[int], Sequence[int]]]
) -> str | None:
    """None when the chunks (offsets, shape), each inside ``global_shape``, cover every
    element of the tensor exactly once (identical boxes are replicas and count once);
    otherwise what is wrong, naming the region: the first uncovered one, or an overlap.

    The boxes' start and end coordinates cut each dimension into intervals; each box covers
    a block of those cells. Chunks written by ckpt cover one cell each (a grid), which is
    checked in O(n); other layouts are checked cell by cell up to ``MAX_TILING_CELLS``.
    """
    unique = {(tuple(o), tuple(s)) for o, s in boxes if numel(s)}
    if numel(global_shape) == 0:
        return None
    # the usual cases, cheaply: one chunk holding the whole tensor; 1-D shards end to end
    if len(unique) == 1:
        ((offsets, shape),) = unique
        if shape == tuple(global_shape) and not any(offsets):
            return None
    elif len(global_shape) == 1:
        end = 0
        for (start,), (size,) in sorted(unique):
            if start != end:
                break
            end += size
        else:
            if end == global_shape[0]:
                return None
    distinct = sorted(unique)
    cuts = [
        sorted({0, g, *(o[d] for o, _ in distinct), *(o[d] + s[d] for o, s in distinct)})
        for d, g in enumerate(global_shape)
    ]
    at = [{x: i for i, x in enumerate(c)} for c in cuts]
    spans = [[(at[d][o[d]], at[d][o[d] + s[d]]) for d in range(len(cuts))] for o, s in distinct]
    total = numel([len(c) - 1 for c in cuts])

    def region(cell: tuple[int, ...]) -> str:
        return (
            f"offsets {[cuts[d][i] for d, i in enumerate(cell)]} shape "
            f"{[cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)]}"
        )

    single = all(hi - lo == 1 for span in spans for lo, hi in span)
    if single:  # a grid: a cell is one box, so distinct boxes never share one
        seen = {tuple(lo for lo, _ in span) for span in spans}
    else:
        if sum(numel([hi - lo for lo, hi in span]) for span in spans) > MAX_TILING_CELLS:
            return (
                f"its {len(distinct)} chunks form a layout too fragmented to check (rule: "
                f"at most {MAX_TILING_CELLS} cells)"
            )
        seen = set()
        for span in spans:
            for cell in itertools.product(*(range(lo, hi) for lo, hi in span)):
                if cell in seen:
                    return f"chunks overlap at {region(cell)} (rule: every element stored once)"
                seen.add(cell)
    if len(seen) == total:
        return None
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        if cell not in seen:  # found within len(seen) + 1 steps
            return (
                f"no chunk stores the elements at {region(cell)} (rule: the chunks cover "
                "the whole tensor)"
            )
    return None  # pragma: no cover - len(seen) < total means a cell is missing


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
        """Parse and check a manifest: the world size is positive, bounded and equal to the
        ranks listed, which are 0..world_size-1 each once (returned in rank order)."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError(f"a JSON {type(body).__name__}, expected an object")
            if body.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {body.get('format')!r}, expected {FORMAT_VERSION}")
            manifest = cls(**body)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: malformed checkpoint manifest ({exc})") from exc
        manifest._check(path)
        return manifest

    def _check(self, path: str) -> None:
        _int(path, "step", self.step)
        _int(path, "total_bytes", self.total_bytes)
        _int(path, "tensor_count", self.tensor_count)
        _time(path, self.created)
        world = _int(path, "world_size", self.world_size, 1, MAX_WORLD_SIZE)
        if not isinstance(self.ranks, list) or len(self.ranks) != world:
            count = len(self.ranks) if isinstance(self.ranks, list) else self.ranks
            raise ValueError(
                f"{path}: world_size {world} but {count} rank(s) listed (rule: "
                "world_size equals the number of ranks listed)"
            )
        for entry in self.ranks:
            if (
                not isinstance(entry, dict)
                or not {"rank", "data_size", "index_crc32"} <= entry.keys()
            ):
                raise ValueError(
                    f"{path}: rank entry {entry!r} (rule: an object with rank, "
                    "data_size and index_crc32)"
                )
            _int(path, "a rank", entry["rank"], 0, world - 1)
            _int(path, f"data_size of rank {entry['rank']}", entry["data_size"])
            _int(path, f"index_crc32 of rank {entry['rank']}", entry["index_crc32"], 0, _U32)
        listed = [e["rank"] for e in self.ranks]
        if len(set(listed)) != world:
            twice = sorted(r for r, n in Counter(listed).items() if n > 1)
            missing = sorted(set(range(world)) - set(listed))
            raise ValueError(
                f"{path}: rank(s) {twice} listed twice, {missing} missing (rule: "
                f"ranks 0..{world - 1} each listed once)"
            )
        self.ranks = sorted(self.ranks, key=lambda e: e["rank"])

    def step_problem(self, step: int) -> str | None:
        """What is wrong with this manifest as the commit record of ``step-<step>/``."""
        if self.step != step:
            return f"says step {self.step} (rule: a manifest commits its own step directory)"
        return None


def index_disagreement(index: RankIndex, rank: int, manifest: Manifest) -> str | None:
    """What rank ``rank``'s index says that its manifest contradicts, with the rule."""
    if index.rank != rank:
        return f"rank {index.rank} (rule: rank-R's index is rank R's)"
    if index.world_size != manifest.world_size:
        return (
            f"world_size {index.world_size}, the manifest's is {manifest.world_size} "
            "(rule: one world size)"
        )
    if index.step != manifest.step:
        return f"step {index.step}, the manifest's is {manifest.step} (rule: one step)"
    if index.data_size != manifest.ranks[rank]["data_size"]:
        return (
            f"data_size {index.data_size}, the manifest's is "
            f"{manifest.ranks[rank]['data_size']} (rule: one data size)"
        )
    return None


def newest_committed(fs: StripedFileSystem, root: str, at_most: int | None = None) -> Iterator[int]:
    """The committed steps (not above ``at_most``), newest first, each checked (its
    ``MANIFEST.json`` exists) only when the caller asks for it: a load that takes the newest
    makes one listing and one check, not one check per step the store keeps (each rank of
    each restart pays them)."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return
    steps = sorted(
        (
            s
            for e in entries
            if e["type"] == "directory" and (s := parse_step(e["name"])) is not None
        ),
        reverse=True,
    )
    for s in steps:
        if (at_most is None or s <= at_most) and fs.exists(f"{step_dir(root, s)}/{MANIFEST}"):
            yield s


def committed_steps(fs: StripedFileSystem, root: str) -> tuple[list[int], list[int]]:
    """(committed steps, uncommitted step directories), both ascending."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return [], []
    steps = sorted(
        s for e in entries if e["type"] == "directory" and (s := parse_step(e["name"])) is not None
    )
    done, torn = [], []
    for s in steps:
        (done if fs.exists(f"{step_dir(root, s)}/{MANIFEST}") else torn).append(s)
    return done, torn
