"""The startup trace: one JSON object per line, one file per node and rank.

Written by ``bootseer run`` and ``bootseer warmup`` (a span per startup phase and attempt),
read by ``bootseer report``. Times are Unix seconds (float), so the files of many nodes can be
lined up; a span's ``bytes`` says how much the phase moved, ``outcome`` is ``ok``, ``failed``,
``skipped`` or ``killed``, and ``attempt`` counts restarts (0 for the first start)::

    {"node": "node-3", "rank": 5, "phase": "environment", "start": 1763700000.12,
     "end": 1763700002.95, "bytes": 194400000, "outcome": "ok", "attempt": 0,
     "detail": {"outcome": "restored"}, "bytes_by_remote": {"s3": 61300000}}

``bytes_by_remote`` (optional; absent or ``{}`` when the phase read nothing from a remote)
says which remote the phase received bytes from, and how many: the registry for image
blocks (:data:`REMOTE_REGISTRY`), a store by its URL's protocol for snapshots and checkpoints
(:func:`remote_of`: ``s3``, ``hdfs``, ``http``, ``file``). They are bytes received over the
wire, so they can differ from ``bytes`` (an environment's ``bytes`` are the unpacked ones).
``bootseer warmup``'s spans carry ``"warmup": true`` in their detail: they fill a node before
the job and belong to no attempt of it.

Phases used: ``environment``, ``checkpoint_prefetch``, ``image_prefetch`` (warmup),
``command_start`` (the child is spawned), ``first_step`` (from the start of the attempt to
``bootseer.ready()``), ``restart`` (the backoff before an attempt), ``hang`` (no heartbeat).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from striped_fs import TRACE_WHAT, PrivateDir, open_append, redact

OUTCOMES = ("ok", "failed", "skipped", "killed")
#: The ``bytes_by_remote`` name of the OCI registry (image blocks).
REMOTE_REGISTRY = "registry"


def remote_of(url: str) -> str:
    """The ``bytes_by_remote`` name of the store behind an fsspec URL: its innermost protocol
    (``striped::s3://b/x`` -> ``s3``), ``file`` for a plain path. Named by kind, not by
    bucket, so that a report can add up what every node asked of the same service."""
    from fsspec.core import split_protocol

    protocol, _ = split_protocol(url.split("::")[-1])
    return protocol or "file"


def remote_bytes(remote: str, nbytes: int) -> dict[str, int]:
    """A span's ``bytes_by_remote`` for one remote: empty when nothing came from it."""
    return {remote: nbytes} if nbytes else {}


def checked_remote_bytes(value: Any) -> dict[str, int]:
    """A checked ``bytes_by_remote``: names to byte counts >= 0."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"bytes_by_remote must be an object of remote -> bytes, got {value!r}")
    out: dict[str, int] = {}
    for name, n in value.items():
        if not isinstance(name, str) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"bytes_by_remote: {name!r}: expected an integer >= 0, got {n!r}")
        out[name] = n
    return out


@dataclass
class Span:
    node: str
    rank: int | None
    phase: str
    start: float
    end: float
    bytes: int = 0
    outcome: str = "ok"
    attempt: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    bytes_by_remote: dict[str, int] = field(default_factory=dict)  # remote -> bytes received

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_json(self) -> str:
        return json.dumps(redact(asdict(self)), separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, line: str) -> Span:
        doc = json.loads(line)
        if not isinstance(doc, dict):
            raise ValueError("a trace line must be a JSON object")
        missing = [k for k in ("node", "phase", "start", "end") if k not in doc]
        if missing:
            raise ValueError(f"trace line lacks {', '.join(missing)}")
        return cls(
            node=str(doc["node"]),
            rank=doc.get("rank"),
            phase=str(doc["phase"]),
            start=float(doc["start"]),
            end=float(doc["end"]),
            bytes=int(doc.get("bytes", 0)),
            outcome=str(doc.get("outcome", "ok")),
            attempt=int(doc.get("attempt", 0)),
            detail=dict(doc.get("detail") or {}),
            bytes_by_remote=checked_remote_bytes(doc.get("bytes_by_remote")),
        )


def default_node() -> str:
    return os.environ.get("BOOTSEER_NODE") or socket.gethostname()


class TraceWriter:
    """Appends spans to ``<dir>/<node>[-rank<r>].jsonl`` (thread-safe; each line is flushed,
    so a killed process loses at most the span it was in)."""

    def __init__(
        self, trace_dir: str | os.PathLike, node: str | None = None, rank: int | None = None
    ) -> None:
        self.dir = Path(trace_dir)
        # made 0700, or checked: this user's, written by nobody else, not a link (others
        # may read a trace; nobody else may plant a link where the agent writes dumps)
        PrivateDir.open(self.dir, what=TRACE_WHAT, readable=True).close()
        self.node = node or default_node()
        self.rank = rank
        name = self.node if rank is None else f"{self.node}-rank{rank}"
        self.path = self.dir / f"{name}.jsonl"
        self._lock = threading.Lock()

    def write(self, span: Span) -> Span:
        with self._lock, open_append(self.dir, self.path.name) as f:
            f.write(span.to_json() + "\n")
        return span

    def record(
        self,
        phase: str,
        start: float,
        end: float | None = None,
        *,
        attempt: int = 0,
        bytes: int = 0,
        outcome: str = "ok",
        bytes_by_remote: dict[str, int] | None = None,
        **detail: Any,
    ) -> Span:
        return self.write(
            Span(
                self.node,
                self.rank,
                phase,
                start,
                time.time() if end is None else end,
                bytes,
                outcome,
                attempt,
                detail,
                checked_remote_bytes(bytes_by_remote),
            )
        )

    @contextmanager
    def span(self, phase: str, *, attempt: int = 0, **detail: Any) -> Iterator[dict[str, Any]]:
        """Times the block; the yielded dict may set ``bytes``, ``outcome``,
        ``bytes_by_remote`` and detail keys.
        An exception marks the span failed (and propagates)."""
        info: dict[str, Any] = dict(detail)
        start = time.time()
        try:
            yield info
        except BaseException as exc:
            info.setdefault("outcome", "failed")
            info.setdefault("error", f"{type(exc).__name__}: {exc}")
            raise
        finally:
            outcome = info.pop("outcome", "ok")
            nbytes = int(info.pop("bytes", 0))
            remotes = info.pop("bytes_by_remote", None)
            self.record(
                phase,
                start,
                attempt=attempt,
                bytes=nbytes,
                outcome=outcome,
                bytes_by_remote=remotes,
                **info,
            )


def write_trace_file(directory: str | os.PathLike[str], name: str, text: str) -> None:
    """``text`` as the file ``name`` of the trace directory (a stack dump kept as evidence),
    replacing what it held: the directory made 0700 or checked, never through a link."""
    with open_append(directory, name) as f:
        f.truncate(0)
        f.write(text)


def trace_lines(paths: Iterable[str | os.PathLike]) -> Iterator[tuple[Path, int, str]]:
    """Every non-empty line of these files or directories (``*.jsonl``): (file, number, line)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("*.jsonl")))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"trace path {p} does not exist")
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield file, n, line


def read_traces(paths: Iterable[str | os.PathLike]) -> tuple[list[Span], list[str]]:
    """Every span under these files or directories (``*.jsonl``), and one warning per line
    that could not be read (a torn last line of a killed process is expected). Lines of
    other records (``{"record": "event" | "verdict", ...}``: :mod:`bootseer.robust.events`)
    are not spans and are passed over."""
    spans: list[Span] = []
    warnings: list[str] = []
    for file, n, line in trace_lines(paths):
        if line.startswith('{"record":'):
            continue
        try:
            spans.append(Span.from_json(line))
        except (ValueError, TypeError) as exc:
            warnings.append(f"{file}:{n}: skipped ({exc})")
    return spans, warnings
