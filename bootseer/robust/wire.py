"""The controller's wire format: keys in torch's c10d store (the one torchrun's rendezvous
uses), every value one JSON document, every size bounded, every node record checked to name
the node whose keys hold it.

Why the store: the job needs no other service, the store outlives a controller restart (the
controller keeps no state of its own), and every agent already reaches it. Keys, under
``bootseer/<job>/``:

=============================  ========  ============================================
key                            writer    value
=============================  ========  ============================================
``nodes``                      agents    node names, one per line (``append``)
``node/<n>/info``              agent n   ``{"node", "pid", "time"}``
``node/<n>/beat``              agent n   ``{"node", "time", "attempt", "ranks": {r: {"step", "time", "pid"}}}``
``node/<n>/events``            agent n   counter: events written so far (``add``)
``node/<n>/event/<i>``         agent n   an :class:`~.events.Event` record (``node`` = n)
``node/<n>/dump/<k>``          agent n   ``{"node", "incident", "time", "processes": [...]}``
``incident``                   ctl       counter: incidents opened so far (``add``)
``dump/request``               ctl       ``{"incident", "time", "reason"}``: dump now
``verdict/<k>``                ctl       a :class:`~.events.Verdict` record (``evidence.incident`` = k)
``verdict/last``               ctl       the newest incident with a verdict
``ctl/seen/<n>``               ctl       the last event of node n the controller consumed
``ctl/open``                   ctl       the incident being localized (resumed after a restart)
``excluded``                   ctl       ``{"nodes": [...]}``: evicted nodes
``sample/request``             ctl       ``{"round", "time"}``: a fail-slow round's stack sample
``sample/count``               ctl       counter: sample orders so far (``add``)
``node/<n>/sample/<k>``        agent n   ``{"node", "round", "time", "processes": [...]}``
``ctl/failslow``               ctl       the fail-slow rounds so far (resumed after a restart)
``check/<k>``                  ctl       ``{"incident", "nodes", "time"}``: run ``bootseer check``
``node/<n>/check/<k>``         agent n   ``{"node", "incident", "result"}``: its check result
``version/<id>``               publish   a :class:`~.update.Version` (immutable once written)
``version/current``            publish   the version to run next (:class:`~.update.Published`)
``version/at/<E>``             agents    the version every node runs after incident E (first wins)
``version/running``            agents    the newest ``version/at/<E>``
=============================  ========  ============================================

Every value but the counters (``add``) and the name lists (``append``: ``nodes``,
``versions``) is sealed (:mod:`.seal`: HMAC-SHA256 under the job's secret, bound to its key)
and checked by its kind's validator (:mod:`.records`) before it is used: :func:`put` writes,
:func:`read` and :func:`decode` read; a record that fails either is a :class:`WireError`
naming the key, which every reader logs once and skips.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from . import records, seal

__all__ = [
    "MAX_DUMP_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_STACK_CHARS",
    "Keys",
    "WireError",
    "connect",
    "connect_torch",
    "decode",
    "encode",
    "parse_address",
    "put",
    "read",
    "sealed",
    "valid_node",
]

MAX_RECORD_BYTES = 64 << 10  # an event, a beat, a verdict
MAX_STACK_CHARS = 32 << 10  # one process's dump text
MAX_DUMP_BYTES = 512 << 10  # one node's whole dump answer
MAX_NODES = 4096
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class WireError(ValueError):
    """A value in the store that is not what its key promises."""


def valid_node(name: object) -> bool:
    """A node name as keys may hold it: 1-63 of letters, digits, ``.``, ``_``, ``-``."""
    return isinstance(name, str) and bool(_NODE.match(name))


class Keys:
    """Key names of one job (``job`` is the rendezvous id, so several jobs share a store)."""

    def __init__(self, job: str = "job") -> None:
        if not valid_node(job):
            raise ValueError(f"job name {job!r}: use 1-63 letters, digits, '.', '_' or '-'")
        self.prefix = f"bootseer/{job}/"
        self.nodes = self.prefix + "nodes"
        self.incident = self.prefix + "incident"
        self.dump_request = self.prefix + "dump/request"
        self.verdict_last = self.prefix + "verdict/last"
        self.open = self.prefix + "ctl/open"
        self.excluded = self.prefix + "excluded"
        self.sample_request = self.prefix + "sample/request"
        self.sample_count = self.prefix + "sample/count"
        self.failslow = self.prefix + "ctl/failslow"
        self.link_request = self.prefix + "link/request"

    def node(self, node: str, what: str) -> str:
        return f"{self.prefix}node/{node}/{what}"

    def event(self, node: str, i: int) -> str:
        return self.node(node, f"event/{i}")

    def dump(self, node: str, incident: int) -> str:
        return self.node(node, f"dump/{incident}")

    def dump_ack(self, node: str, incident: int) -> str:
        """The node saw the order (before it dumps): it is alive, wait for its answer."""
        return self.node(node, f"ack/{incident}")

    def native_dump(self, node: str, incident: int) -> str:
        return self.node(node, f"native/{incident}")

    def verdict(self, incident: int) -> str:
        return f"{self.prefix}verdict/{incident}"

    def seen(self, node: str) -> str:
        return f"{self.prefix}ctl/seen/{node}"

    def sample(self, node: str, round_: int) -> str:
        return self.node(node, f"sample/{round_}")

    def link_probe(self, node: str, ident: int) -> str:
        return self.node(node, f"link/{ident}")

    def check_request(self, incident: int) -> str:
        return f"{self.prefix}check/{incident}"

    def check_result(self, node: str, incident: int) -> str:
        return self.node(node, f"check/{incident}")

    def version(self, version_id: str) -> str:
        return f"{self.prefix}version/{version_id}"

    @property
    def version_current(self) -> str:
        return f"{self.prefix}version/current"

    @property
    def version_running(self) -> str:
        return f"{self.prefix}version/running"

    def version_at(self, epoch: int) -> str:
        return f"{self.prefix}version/at/{epoch}"


def encode(doc: dict[str, Any], limit: int = MAX_RECORD_BYTES) -> bytes:
    data = json.dumps(doc, separators=(",", ":"), default=str).encode()
    if len(data) > limit:
        raise WireError(f"a record of {len(data)} bytes is over the limit of {limit}")
    return data


_NODE_KINDS = {"info": "info", "beat": "beat", "colltrace": "colltrace"}
_NODE_NUMBERED = {
    "event": ("event", None),
    "dump": ("dump", "incident"),
    "ack": ("dump_ack", "incident"),
    "native": ("native_dump", "incident"),
    "sample": ("sample", "round"),
    "link": ("link_probe", "id"),
    "check": ("check_result", "incident"),
}
_FIXED = {
    "dump/request": "dump_order",
    "verdict/last": "verdict_last",
    "ctl/open": "open",
    "ctl/failslow": "failslow",
    "excluded": "excluded",
    "sample/request": "sample_order",
    "link/request": "link_order",
    "version/current": "published",
    "version/running": "pin",
}


def kind_of(key: str) -> tuple[str | None, dict[str, Any]]:
    """The record kind a key holds (:mod:`.records`) and the values its name fixes (the
    node, the incident, round or probe number, the version id): a record must say the same.
    ``(None, {})`` for a key bootseer does not know."""
    parts = key.split("/", 2)
    if len(parts) < 3 or parts[0] != "bootseer":
        return None, {}
    rest = parts[2]
    if rest in _FIXED:
        return _FIXED[rest], {}
    bits = rest.split("/")
    if bits[0] == "node" and len(bits) == 3 and bits[2] in _NODE_KINDS:
        return _NODE_KINDS[bits[2]], {"node": bits[1]}
    if bits[0] == "node" and len(bits) == 4 and bits[2] in _NODE_NUMBERED and bits[3].isdigit():
        kind, field = _NODE_NUMBERED[bits[2]]
        return kind, {"node": bits[1], **({field: int(bits[3])} if field else {})}
    if len(bits) == 2 and bits[1].isdigit() and bits[0] in ("verdict", "check"):
        return (
            ("verdict", {"evidence.incident": int(bits[1])})
            if bits[0] == "verdict"
            else ("check_order", {"incident": int(bits[1])})
        )
    if bits[0] == "version" and len(bits) == 3 and bits[1] == "at" and bits[2].isdigit():
        return "pin", {"epoch": int(bits[2])}
    if bits[0] == "version" and len(bits) == 2:
        return "version", {"id": bits[1]}
    return None, {}


def sealed(key: str, doc: dict[str, Any], limit: int = MAX_RECORD_BYTES) -> bytes:
    """``doc`` as the sealed value of ``key`` (:mod:`.seal`)."""
    return seal.seal(key, encode(doc, limit))


def put(store: Any, key: str, doc: dict[str, Any], limit: int = MAX_RECORD_BYTES) -> None:
    """Write ``doc`` sealed under ``key``."""
    store.set(key, sealed(key, doc, limit))


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]!r} is not finite")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def decode(
    data: bytes,
    *,
    key: str,
    node: str | None = None,
    limit: int = MAX_RECORD_BYTES,
    kind: str | None = None,
    expect: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One value read back: sealed for ``key`` under the job's secret, a JSON object of at
    most ``limit`` bytes with finite numbers only, for a node's key naming that node (a node
    may only speak for itself), and a valid record of its key's kind (:func:`kind_of`, or
    ``kind``) with the values its key fixes (and ``expect``). :class:`WireError` naming the
    key otherwise."""
    if len(data) > limit + seal.OVERHEAD:
        raise WireError(f"{key}: {len(data)} bytes, over the limit of {limit}")
    try:
        body = seal.open_sealed(key, bytes(data))
    except seal.SealError as exc:
        raise WireError(str(exc)) from None
    try:
        doc = json.loads(body, parse_float=_finite, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"{key}: not JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise WireError(f"{key}: not a JSON object")
    if node is not None and doc.get("node") != node:
        raise WireError(
            f"{key}: the record names node {str(doc.get('node'))[:63]!r}, not "
            f"{node!r} whose key holds it: refused"
        )
    inferred, fixed = kind_of(key)
    kind = kind or inferred
    if kind is not None:
        try:
            records.check(kind, doc, key, {**fixed, **(expect or {})})
        except records.RecordError as exc:
            raise WireError(f"not a {kind} record: {exc}") from None
    return doc


def read(
    store: Any,
    key: str,
    *,
    node: str | None = None,
    limit: int = MAX_RECORD_BYTES,
    kind: str | None = None,
    expect: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The record under ``key`` (see :func:`decode`), None when the key is not set."""
    data = get(store, key)
    return (
        None
        if data is None
        else decode(data, key=key, node=node, limit=limit, kind=kind, expect=expect)
    )


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a store (ValueError naming the value otherwise)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"controller address {text!r}: expected HOST:PORT, e.g. 10.0.0.5:29400")
    return host.strip("[]"), int(port)


def connect(address: str, timeout_s: float = 30.0) -> Any:
    """A client of the store at ``HOST:PORT``: :class:`.store_client.StoreClient`, which
    speaks torch's c10d protocol without importing torch (the agent and the controller need
    nothing else of it) and bounds every reply."""
    from .store_client import StoreClient

    host, port = parse_address(address)
    return StoreClient(host, port, timeout_s=timeout_s)


def connect_torch(address: str, timeout_s: float = 30.0) -> Any:
    """torch's own TCPStore client of ``HOST:PORT``, for what needs a ``torch.distributed``
    Store (a process group that meets in the job's store: ``bootseer check``)."""
    from torch.distributed import TCPStore

    host, port = parse_address(address)
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def get(store: Any, key: str) -> bytes | None:
    """The value of ``key``, or None when it is not set (never blocks)."""
    if not store.check([key]):
        return None
    return store.get(key)
