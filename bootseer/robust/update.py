"""Lazy hot update and rollback: a new version of the job's code or environment, published
to the job's c10d store, is run by every node from the next restart on, at once when urgent,
or forced after a window; the version before it is kept, and a failure that follows the
update rolls it back.

What a version is, and why so little: ``bootseer run`` supervises one command line that the
operator wrote (``torchrun ... train.py``), so a version changes what that line runs, not the
line: a **code directory** (``workdir``, the command's working directory: a checkout of a
revision, on shared storage or put on every node beforehand) and **environment variables**
(``env``: ``PYTHONPATH``, a data path, a flag the training script reads). Both are explicit,
checked on publish, and the same bytes on every node; the command also gets
``BOOTSEER_VERSION``. The implicit version ``base`` is the job as configured (no change).

Why every node runs the same version in one attempt: the version is not chosen by each node
when it restarts (a publish between two nodes' restarts would mix them) but pinned per
*epoch*, the newest incident with a verdict (``BOOTSEER_INCIDENT``, the same on every node):
the first node that starts epoch E writes ``version/at/E`` with a compare-and-set, and every
other node of that epoch reads what it wrote. A new version therefore takes effect only at
an epoch, i.e. after a verdict that restarts every node: a failure's (lazy), or an update
incident the controller opens itself (urgent, or the window passed).

Keys (:mod:`.wire`, under ``bootseer/<job>/``): ``version/<id>`` (immutable),
``version/current`` (what the next epoch runs), ``version/at/<E>`` and ``version/running``
(what epoch E runs and the newest such pin).

Usage::

    store = wire.connect("10.0.0.5:29400")
    publish(store, "job", Version("v2", workdir="/code/rev-8f3a", env={"LR": "3e-4"}),
            urgent=False, window_s=24 * 3600)       # lazy, forced after a day
    versions = NodeVersions(store, "node-3", job="job")
    version, pin = versions.resolve(epoch=4)         # what this node runs after incident 4
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import seal, wire

__all__ = [
    "BASE",
    "NodeVersions",
    "Pin",
    "Published",
    "Version",
    "VersionError",
    "current",
    "describe",
    "get_version",
    "known_versions",
    "mark_forced",
    "parse_env",
    "pin_epoch",
    "publish",
    "roll_back",
    "running",
]

RESERVED = ("current", "running", "at")  # key names beside the versions
_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_VARS = 64
MAX_VALUE = 4096


class VersionError(ValueError):
    """A version that is malformed, unknown, or cannot be applied on this node."""


@dataclass(frozen=True)
class Version:
    """What a version changes: the command's working directory and variables."""

    id: str
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    time: float = 0.0

    def check(self, where: str = "") -> Version:
        """The version itself, or a :class:`VersionError` naming it and what is wrong."""
        what = f"version {self.id!r}{where}"
        if not wire.valid_node(self.id) or self.id in RESERVED:
            raise VersionError(
                f"{what}: an id is 1-63 letters, digits, '.', '_' or '-', and "
                f"not one of {', '.join(RESERVED)}: e.g. v2 or rev-8f3a"
            )
        if self.workdir is not None and (
            not isinstance(self.workdir, str) or not os.path.isabs(self.workdir)
        ):
            raise VersionError(
                f"{what}: workdir {self.workdir!r} must be an absolute path "
                "(every node resolves it on its own)"
            )
        if not isinstance(self.env, Mapping) or len(self.env) > MAX_VARS:
            raise VersionError(f"{what}: env must map at most {MAX_VARS} names to strings")
        for name, value in self.env.items():
            if not isinstance(name, str) or not _VAR.match(name):
                raise VersionError(
                    f"{what}: {name!r} is not a variable name (letters, "
                    "digits, '_', not starting with a digit)"
                )
            if name.startswith("BOOTSEER_"):
                raise VersionError(
                    f"{what}: {name} belongs to bootseer run, a version cannot set it"
                )
            if not isinstance(value, str) or len(value) > MAX_VALUE or "\0" in value:
                raise VersionError(
                    f"{what}: the value of {name} must be a string of at "
                    f"most {MAX_VALUE} characters without NUL"
                )
        return self

    def to_doc(self) -> dict[str, Any]:
        return {"id": self.id, "workdir": self.workdir, "env": dict(self.env), "time": self.time}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], where: str = "") -> Version:
        unknown = set(doc) - {"id", "workdir", "env", "time"}
        if unknown:
            raise VersionError(f"version{where}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            got = cls(
                str(doc["id"]),
                doc.get("workdir"),
                dict(doc.get("env") or {}),
                float(doc.get("time") or 0.0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise VersionError(f"version{where}: not a version record ({exc})") from None
        return got.check(where)


BASE = Version("base")  # the job as configured: nothing changed


@dataclass(frozen=True)
class Published:
    """``version/current``: the version the next epoch runs, and how urgently."""

    id: str
    previous: str | None = None
    seq: int = 0
    time: float = 0.0
    urgent: bool = False
    window_s: float | None = None  # force a restart this long after ``time``; None: never
    cause: str = "publish"  # or "rollback"
    forced: int | None = None  # the update incident the controller opened for it
    bad: str | None = None  # the version a rollback left

    def due(self, now: float) -> str | None:
        """Why it must be applied now (``urgent``, ``window``), or None: lazily."""
        if self.urgent:
            return "urgent"
        if self.window_s is not None and now - self.time >= self.window_s:
            return "window"
        return None


@dataclass(frozen=True)
class Pin:
    """``version/at/<epoch>``: what every node runs after incident ``epoch``."""

    id: str
    epoch: int
    previous: str | None = None  # what ran before, kept for rollback
    updated: bool = False  # this epoch changed the version
    cause: str = "publish"  # publish, rollback or base
    seq: int = 0
    node: str = ""
    time: float = 0.0


def _doc(key: str, obj: Any) -> bytes:
    """``obj`` sealed for ``key`` (:mod:`.seal`)."""
    return wire.sealed(key, dataclasses.asdict(obj))


def _read(store: Any, key: str, cls: type, fields: tuple[str, ...]) -> Any:
    data = wire.get(store, key)
    if data is None:
        return None
    try:
        doc = wire.decode(data, key=key)
        got = cls(**{k: doc[k] for k in fields if k in doc})
        if not wire.valid_node(got.id):
            raise ValueError(f"id {got.id!r}")
        return got
    except (wire.WireError, TypeError, ValueError) as exc:
        raise VersionError(
            f"{key}: not a {cls.__name__.lower()} record ({exc}); publish "
            "again (bootseer controller publish) to replace it"
        ) from None


def current(store: Any, keys: wire.Keys) -> Published | None:
    """The published version (None: nothing published yet)."""
    return _read(
        store, keys.version_current, Published, tuple(f.name for f in dataclasses.fields(Published))
    )


def running(store: Any, keys: wire.Keys, epoch: int | None = None) -> Pin | None:
    """The pin of ``epoch``, or the newest pin (None: no node started yet)."""
    key = keys.version_running if epoch is None else keys.version_at(epoch)
    return _read(store, key, Pin, tuple(f.name for f in dataclasses.fields(Pin)))


def get_version(store: Any, keys: wire.Keys, version_id: str) -> Version:
    """A published version by id (``base`` always exists)."""
    if version_id == BASE.id:
        return BASE
    Version(version_id).check()
    data = wire.get(store, keys.version(version_id))
    if data is None:
        known = ", ".join(known_versions(store, keys))
        raise VersionError(
            f"version {version_id!r} is unknown in job "
            f"{keys.prefix.split('/')[1]} (known: {known}): publish it with "
            "--workdir and/or --env first"
        )
    try:
        doc = wire.decode(data, key=keys.version(version_id))
    except wire.WireError as exc:
        raise VersionError(str(exc)) from None
    got = Version.from_doc(doc, f" at {keys.version(version_id)}")
    if got.id != version_id:
        raise VersionError(f"{keys.version(version_id)}: the record names version {got.id!r}")
    return got


def known_versions(store: Any, keys: wire.Keys) -> list[str]:
    data = wire.get(store, keys.prefix + "versions") or b""
    return ["base", *dict.fromkeys(data.decode(errors="replace").split())]


def publish(
    store: Any,
    job: str,
    version: Version | str,
    *,
    urgent: bool = False,
    window_s: float | None = None,
    now: float | None = None,
) -> Published:
    """Make ``version`` the one the next epoch runs. A :class:`Version` is stored first (an
    id already stored must have the same content: versions are immutable); a plain id
    publishes a version stored before (a rollback by hand). Returns ``version/current``."""
    keys = wire.Keys(job)
    seal.require_secret("bootseer controller publish")  # nodes refuse an unsealed version
    now = time.time() if now is None else now
    if window_s is not None and not window_s >= 0:
        raise VersionError(f"window {window_s!r}: seconds, 0 or more")
    if isinstance(version, Version):
        version = dataclasses.replace(version.check(), time=version.time or now)
        try:
            stored = get_version(store, keys, version.id)
        except VersionError:
            stored = None
        if stored is not None and (stored.workdir, dict(stored.env)) != (
            version.workdir,
            dict(version.env),
        ):
            raise VersionError(
                f"version {version.id!r} is already published with other "
                f"content (workdir {stored.workdir!r}, env "
                f"{sorted(stored.env)}): versions are immutable, use a new id"
            )
        if stored is None:
            wire.put(store, keys.version(version.id), version.to_doc())
            store.append(keys.prefix + "versions", f"{version.id}\n")
        version_id = version.id
    else:
        version_id = get_version(store, keys, version).id
    try:
        before = current(store, keys)
    except VersionError:
        before = None  # a damaged record is replaced by this publish
    try:
        pinned = running(store, keys)
    except VersionError:
        pinned = None
    previous = pinned.id if pinned else (before.id if before else BASE.id)
    # above the running pin's too: a publication with a lower number is a replay (pin_epoch)
    seq = max(before.seq if before else 0, pinned.seq if pinned else 0) + 1
    doc = Published(
        version_id, previous=previous, seq=seq, time=now, urgent=urgent, window_s=window_s
    )
    store.set(keys.version_current, _doc(keys.version_current, doc))
    return doc


def pin_epoch(
    store: Any, keys: wire.Keys, epoch: int, node: str, log: Callable[[str], None] = lambda _: None
) -> Pin:
    """The version of ``epoch``: the one pinned by the first node, or pinned now from
    ``version/current``. A damaged ``version/current`` is refused (said through ``log``)
    and the running version pinned instead: nothing changes, nothing is lost."""
    key = keys.version_at(epoch)
    expected: str | bytes = ""
    try:
        if (got := running(store, keys, epoch)) is not None:
            return got
    except VersionError as exc:  # forged or damaged (not sealed): this node pins it again
        log(f"warning: {exc}; pinned again from {keys.version_current}")
        expected = wire.get(store, key) or ""
    try:
        before = running(store, keys)
    except VersionError as exc:
        log(f"warning: {exc}")
        before = None
    try:
        published = current(store, keys)
        if published is not None and before is not None and published.seq < before.seq:
            raise VersionError(
                f"{keys.version_current}: publication {published.seq} is older "
                f"than the running one ({before.seq}): a replayed record, "
                "refused"
            )
        if published is not None:
            get_version(store, keys, published.id)  # it must exist before anyone runs it
    except VersionError as exc:
        log(f"warning: {exc}; this epoch keeps version {before.id if before else BASE.id}")
        published = None
    run_id = published.id if published else (before.id if before else BASE.id)
    old = before.id if before else BASE.id
    changed = run_id != old
    cause = (
        published.cause
        if published and changed
        else (before.cause if before and not changed else "base")
    )
    pin = Pin(
        run_id,
        epoch,
        previous=old if changed else (before.previous if before else None),
        updated=changed,
        cause=cause,
        seq=published.seq if published else 0,
        node=node,
        time=time.time(),
    )
    store.compare_set(key, expected, _doc(key, pin).decode())
    won = running(store, keys, epoch)
    if won is None:
        raise VersionError(f"{key}: not set after the compare-and-set: the store lost it")
    if won == pin:
        store.set(keys.version_running, _doc(keys.version_running, pin))
    return won


def roll_back(
    store: Any, keys: wire.Keys, pin: Pin, incident: int, now: float | None = None
) -> Published:
    """Publish ``pin.previous`` again because ``pin.id`` failed after its update."""
    before = current(store, keys)
    doc = Published(
        pin.previous or BASE.id,
        previous=None,
        seq=(before.seq if before else 0) + 1,
        time=time.time() if now is None else now,
        cause="rollback",
        bad=pin.id,
        forced=incident,
    )
    store.set(keys.version_current, _doc(keys.version_current, doc))
    return doc


def mark_forced(store: Any, keys: wire.Keys, published: Published, incident: int) -> bool:
    """Record that update incident ``incident`` applies ``published``, unless it changed."""
    old = wire.get(store, keys.version_current)
    new = _doc(keys.version_current, dataclasses.replace(published, forced=incident))
    return old is not None and store.compare_set(keys.version_current, old, new) == new


class NodeVersions:
    """A node's side: which version to run in an epoch, and the variables and directory
    that apply it."""

    def __init__(
        self,
        store: Any,
        node: str,
        *,
        job: str = "job",
        log: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.store = store
        self.node = node
        self.keys = wire.Keys(job)
        self.log = log

    def resolve(self, epoch: int) -> tuple[Version, Pin]:
        """The version every node runs in ``epoch``; a :class:`VersionError` when this node
        cannot run it (its workdir is missing here): refusing beats running another one."""
        pin = pin_epoch(self.store, self.keys, epoch, self.node, self.log)
        version = get_version(self.store, self.keys, pin.id)
        if version.workdir is not None and not os.path.isdir(version.workdir):
            raise VersionError(
                f"version {version.id!r}: its workdir {version.workdir} does not "
                f"exist on node {self.node}: put the code there (every node "
                "runs the same version) or publish another version"
            )
        return version, pin


def describe(pin: Pin, version: Version) -> str:
    """One line for the log and the trace."""
    where = f" in {version.workdir}" if version.workdir else ""
    env = f", env {', '.join(sorted(version.env))}" if version.env else ""
    if not pin.updated:
        return f"version {pin.id}{where}{env} (epoch {pin.epoch})"
    return f"version {pin.previous} -> {pin.id}{where}{env} ({pin.cause}, epoch {pin.epoch})"


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` arguments as a dict (a :class:`VersionError` naming a bad one)."""
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise VersionError(f"--env {pair!r}: expected NAME=VALUE, e.g. LR=3e-4")
        env[name] = value
    return env
