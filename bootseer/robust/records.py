"""One typed validator per kind of record in the job's store, run before a record is used.

Why: a record the controller or an agent reads is data from another machine; a value of
the wrong type (``"files": 7``), a number that is not one (``1e999`` parses as infinity,
``int()`` of it raises ``OverflowError``), a count of a million, or a field missing ended
``bootseer controller`` or ``bootseer run`` with an exception (and a restarted controller
died again on the same incident). Each kind below says its fields' types, ranges and
lengths; :func:`check` refuses anything else with a :class:`RecordError` naming the key and
the field, and the reader skips the record (logged once) and carries on.

Types: :class:`Int` (a JSON integer, never a bool, within ``lo..hi``), :class:`Num` (an
integer or a finite float), :class:`Str` (at most ``max_len`` characters), :class:`Bool`,
:class:`List` (at most ``max_items``, each checked), :class:`Map` (string keys, at most
``max_items``, each value checked), :class:`Obj` (named fields, each checked; other fields
are left as they are and never used), :class:`Any` (anything JSON, within the record's size
limit). ``null=True``: the field may be ``null``; ``need=True``: it must be present.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any as _Any

__all__ = ["KINDS", "RecordError", "check"]

MAX_INT = 2**53  # integers beyond JSON's safe range are no counter, pid, step or rank
MAX_TEXT = 32 << 10
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class RecordError(ValueError):
    """A record that is not what its kind promises."""


@dataclass(frozen=True, kw_only=True)  # so that a kind's first argument is positional
class Spec:
    null: bool = False
    need: bool = False

    def check(self, value: _Any, path: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def _fail(path: str, what: str, value: _Any) -> RecordError:
    shown = repr(value)
    return RecordError(f"{path}: {what}, got {shown[:60] + '...' if len(shown) > 60 else shown}")


@dataclass(frozen=True)
class Int(Spec):
    lo: int = 0
    hi: int = MAX_INT

    def check(self, value: _Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, "expected an integer", value)
        if not self.lo <= value <= self.hi:
            raise _fail(path, f"expected {self.lo}..{self.hi}", value)


@dataclass(frozen=True)
class Num(Spec):
    lo: float = -1e18
    hi: float = 1e18

    def check(self, value: _Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(path, "expected a number", value)
        if not math.isfinite(value) or not self.lo <= value <= self.hi:
            raise _fail(path, f"expected a finite number in {self.lo:g}..{self.hi:g}", value)


@dataclass(frozen=True)
class Str(Spec):
    max_len: int = 1024
    node: bool = False  # a node (or version) name: 1-63 letters, digits, '.', '_', '-'

    def check(self, value: _Any, path: str) -> None:
        if not isinstance(value, str):
            raise _fail(path, "expected a string", value)
        if len(value) > self.max_len:
            raise _fail(
                path, f"expected at most {self.max_len} characters ({len(value)})", value[:20]
            )
        if self.node and not _NODE.match(value):
            raise _fail(path, "expected a node name (1-63 letters, digits, '.', '_', '-')", value)


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, value: _Any, path: str) -> None:
        if not isinstance(value, bool):
            raise _fail(path, "expected true or false", value)


@dataclass(frozen=True)
class Any(Spec):
    def check(self, value: _Any, path: str) -> None:
        return None


@dataclass(frozen=True)
class List(Spec):
    item: Spec = field(default_factory=Any)
    max_items: int = 4096

    def check(self, value: _Any, path: str) -> None:
        if not isinstance(value, list):
            raise _fail(path, "expected a list", value)
        if len(value) > self.max_items:
            raise _fail(path, f"expected at most {self.max_items} items ({len(value)})", "...")
        for i, item in enumerate(value):
            _one(self.item, item, f"{path}[{i}]")


@dataclass(frozen=True)
class Map(Spec):
    value: Spec = field(default_factory=Any)
    max_items: int = 4096
    key_len: int = 256

    def check(self, value: _Any, path: str) -> None:
        if not isinstance(value, dict):
            raise _fail(path, "expected an object", value)
        if len(value) > self.max_items:
            raise _fail(path, f"expected at most {self.max_items} entries ({len(value)})", "...")
        for k, v in value.items():
            if len(k) > self.key_len:
                raise _fail(path, f"a name over {self.key_len} characters", k[:20])
            _one(self.value, v, f"{path}.{k}")


@dataclass(frozen=True)
class Obj(Spec):
    fields: Mapping[str, Spec] = field(default_factory=dict)

    def check(self, value: _Any, path: str) -> None:
        if not isinstance(value, dict):
            raise _fail(path, "expected an object", value)
        for name, spec in self.fields.items():
            if name not in value:
                if spec.need:
                    raise RecordError(f"{path}.{name}: missing")
                continue
            _one(spec, value[name], f"{path}.{name}")


def _one(spec: Spec, value: _Any, path: str) -> None:
    if value is None and spec.null:
        return
    spec.check(value, path)


# -- the kinds ----------------------------------------------------------------------------------

_T = Num(lo=0.0, hi=1e11)  # a wall-clock time (seconds since 1970)
_ID = Int(lo=1)  # an incident, a round, a probe order
_NODE_NAME = Str(max_len=63, node=True)
_PROCESS = Obj(
    {
        "rank": Int(hi=1 << 20, need=True),
        "pid": Int(hi=1 << 31, null=True),
        "role": Str(max_len=32),
        "source": Str(max_len=32),
        "node": Str(max_len=63, null=True),
        "text": Str(max_len=MAX_TEXT),
    }
)
_PROCESSES = List(_PROCESS, max_items=4096, need=True)
_EVENT = Obj(
    {
        "kind": Str(max_len=32, need=True),
        "class": Str(max_len=128, need=True),
        "node": Str(max_len=63, null=True),
        "rank": Int(hi=1 << 20, null=True),
        "step": Int(lo=-MAX_INT, null=True),
        "time": Num(lo=-1e11, hi=1e11),
        "evidence": Map(null=True),
    }
)
_NODES = List(_NODE_NAME, max_items=4096)
_CHECK_ORDER = Obj(
    {"incident": _ID, "nodes": List(_NODE_NAME, max_items=4096, need=True), "time": _T}
)

#: record kind -> its validator (the key names in :mod:`.wire`)
KINDS: dict[str, Obj] = {
    "info": Obj({"node": _NODE_NAME, "pid": Int(hi=1 << 31), "time": _T}),
    "beat": Obj(
        {
            "node": _NODE_NAME,
            "time": Num(lo=0.0, hi=1e11, need=True),
            "attempt": Int(hi=1 << 20),
            "ranks": Map(
                Obj(
                    {
                        "step": Num(null=True),
                        "time": Num(null=True),
                        "pid": Int(hi=1 << 31, null=True),
                        "step_time_s": Num(null=True),
                    }
                ),
                max_items=256,
            ),
        }
    ),
    "event": _EVENT,
    "dump_order": Obj(
        {
            "incident": Int(lo=1, need=True),
            "time": _T,
            "reason": Str(max_len=2048),
            "update": Str(max_len=63, node=True),
        }
    ),
    "dump_ack": Obj({"node": _NODE_NAME, "incident": Int(lo=1, need=True), "time": _T}),
    "dump": Obj(
        {
            "node": _NODE_NAME,
            "incident": Int(lo=1, need=True),
            "time": _T,
            "processes": _PROCESSES,
            "files": List(Str(max_len=4096), max_items=64),
        }
    ),
    "native_dump": Obj(
        {"node": _NODE_NAME, "incident": Int(lo=1, need=True), "time": _T, "processes": _PROCESSES}
    ),
    "verdict": Obj(
        {
            "action": Str(max_len=64, need=True),
            "class": Str(max_len=128, need=True),
            "nodes": _NODES,
            "ranks": List(Int(hi=1 << 20), max_items=1 << 16),
            "reason": Str(max_len=MAX_TEXT),
            "time": _T,
            "evidence": Obj(
                {
                    "incident": Int(lo=1, need=True),
                    "missing_dumps": List(Str(max_len=63)),
                    "not_waited_for": List(Str(max_len=63)),
                },
                need=True,
            ),
        }
    ),
    "verdict_last": Obj({"incident": Int(lo=1, need=True), "time": Num(lo=0.0, need=True)}),
    "open": Obj(
        {
            "incident": Int(lo=1, need=True),
            "time": Num(lo=0.0, need=True),
            "reason": Str(max_len=4096),
            "events": List(_EVENT, max_items=4096, need=True),
            "update": Str(max_len=63, node=True),
            "answered_at": Num(lo=0.0),
            "check": _CHECK_ORDER,
            "not_waited_for": _NODES,
            "silent": _NODES,
        }
    ),
    "excluded": Obj(
        {
            "nodes": List(_NODE_NAME, max_items=4096, need=True),
            "reasons": Map(Str(max_len=200), max_items=4096),
            "list": Str(max_len=4096),
        }
    ),
    "sample_order": Obj({"round": Int(lo=1, need=True), "time": _T}),
    "sample": Obj(
        {"node": _NODE_NAME, "round": Int(lo=1, need=True), "time": _T, "processes": _PROCESSES}
    ),
    "failslow": Obj(
        {
            "asked": Int(),
            "count": Int(),
            "history": List(
                Map(List(Str(max_len=64), max_items=16), max_items=1 << 16), max_items=1024
            ),
            "runs": Map(Int(), max_items=1 << 16),
            "nodes": Map(Str(max_len=63), max_items=1 << 16),
            "job_times": List(Num(), max_items=1024),
        }
    ),
    "check_order": Obj({**_CHECK_ORDER.fields, "incident": Int(lo=1, need=True)}),
    "check_result": Obj(
        {
            "node": _NODE_NAME,
            "incident": Int(lo=1, need=True),
            "time": _T,
            "error": Str(max_len=4096),
            "result": Map(max_items=64),
        }
    ),
    "link_order": Obj({"id": Int(lo=1, need=True), "time": Num(lo=0.0, hi=1e11, need=True)}),
    "link_probe": Obj(
        {
            "node": _NODE_NAME,
            "id": Int(lo=1, need=True),
            "time": _T,
            "probe": Map(max_items=256, need=True),
        }
    ),
    "colltrace": Obj(
        {
            "node": _NODE_NAME,
            "time": Num(lo=0.0, hi=1e11),
            "ranks": List(Map(max_items=4096), max_items=4096),
        }
    ),
    "version": Obj(
        {
            "id": Str(max_len=63, node=True, need=True),
            "workdir": Str(max_len=4096, null=True),
            "env": Map(Str(max_len=4096), max_items=64, key_len=128),
            "time": Num(),
        }
    ),
    "published": Obj(
        {
            "id": Str(max_len=63, node=True, need=True),
            "previous": Str(max_len=63, null=True),
            "seq": Int(),
            "time": Num(),
            "urgent": Bool(),
            "window_s": Num(lo=0.0, null=True),
            "cause": Str(max_len=32),
            "forced": Int(null=True),
            "bad": Str(max_len=63, null=True),
        }
    ),
    "pin": Obj(
        {
            "id": Str(max_len=63, node=True, need=True),
            "epoch": Int(need=True),
            "previous": Str(max_len=63, null=True),
            "updated": Bool(),
            "cause": Str(max_len=32),
            "seq": Int(),
            "node": Str(max_len=63),
            "time": Num(),
        }
    ),
}


def check(kind: str, doc: _Any, key: str, expect: Mapping[str, _Any] | None = None) -> None:
    """``doc`` (read under ``key``) is a valid ``kind`` record, with the values ``expect``
    names (the incident, round or node its key says); :class:`RecordError` otherwise."""
    KINDS[kind].check(doc, key)
    for name, want in (expect or {}).items():
        got: _Any = doc
        for part in name.split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if got != want or isinstance(got, bool) != isinstance(want, bool):
            shown = repr(got)[:40]
            raise RecordError(f"{key}: its {name} is {shown}, the key's is {want!r}: refused")
