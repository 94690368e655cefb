"""One look at the store per node and launch: the newest commit, read once for the node's ranks.

Why: every rank of a restart asks the store which step is the newest committed one and reads
its commit record (``MANIFEST.json``), and a training script asks twice (``latest()``, then
``load()``). With eight ranks a node that is sixteen listings, sixteen existence checks and
sixteen commit records per restart, where one answers them all: a survivor's load should read
from the store the commit record and the files it lacks, once (issue 29). So the first of the
node's ranks to look takes the node's sighting lock, lists the store and reads the commit
record, and leaves both in the node cache (``SIGHT-<launch>.json`` and its commit record
beside it); the node's other ranks of the same launch, and its own ``load()`` after its
``latest()``, take them from there.

When it is used, and why that is safe:

* Only by the ranks of one launch: ``<launch>`` is a digest of torchrun's run id, its agent
  (the workers' parent: its pid and start time, so a torchrun started again is another
  launch) and the restart count. Without torchrun's variables there is no sighting.
* Only for a manager's first load (its ``latest()`` and ``load()`` before the load returns)
  and never after it saved: a job that later looks for newer steps (an evaluator polling
  the store) asks the store every time.
* Only while it is young (:data:`SIGHTING_TTL_S`): ranks of one restart look within seconds
  of each other.
* A sighting that cannot be read, does not parse, or whose commit record does not match its
  digest is ignored (the rank looks at the store itself). The cache is its owner's alone
  (0700), as the cached shards are, and a sighting changes only which step a rank proposes:
  the ranks still agree on one step over the process group, and every file is still checked
  against the commit record, so a stale sighting costs at most an older step, never mixed
  steps or unchecked bytes.

Usage (what ``CheckpointManager`` does)::

    sight = NodeSighting.for_launch(cache.root)   # None outside a torchrun launch
    newest, manifest = sight.look(lambda: look_at_store())
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from striped_fs import make_dir, write_private

from .cache import lock_within

log = logging.getLogger("ckpt")

__all__ = ["SIGHTING_TTL_S", "NodeSighting", "launch_token"]

#: A sighting older than this is not used (ranks of one restart look within seconds).
SIGHTING_TTL_S = 60.0
_LOCK = ".sight.lock"
_LOCK_WAIT_S = 120.0  # a looker stuck on the store: the others stop waiting and look themselves


def launch_token(env: Mapping[str, str] | None = None) -> str | None:
    """This worker's launch (torchrun's run id, its agent and the restart count), or None
    outside torchrun."""
    env = os.environ if env is None else env
    count, run_id = env.get("TORCHELASTIC_RESTART_COUNT"), env.get("TORCHELASTIC_RUN_ID")
    if count is None or run_id is None:
        return None
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat", "rb") as f:
            stat = f.read()
        started = stat.rsplit(b")", 1)[1].split()[19].decode()  # field 22: start time
    except (OSError, IndexError):
        return None
    text = f"{run_id}\n{parent}\n{started}\n{count}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class NodeSighting:
    """The node's look at one store for one launch (see the module docstring)."""

    def __init__(self, root: Path, token: str, ttl_s: float = SIGHTING_TTL_S) -> None:
        self.root = root
        self.doc_path = root / f"SIGHT-{token}.json"
        self.manifest_path = root / f"SIGHT-{token}.MANIFEST.json"
        self.ttl_s = ttl_s

    @classmethod
    def for_launch(cls, root: Path) -> NodeSighting | None:
        token = launch_token()
        return None if token is None else cls(root, token)

    def look(
        self, at_store: Callable[[], tuple[int | None, bytes | None]]
    ) -> tuple[int | None, bytes | None]:
        """(newest committed step, its commit record): the node's sighting when one is
        there and sound, else ``at_store()``'s answer, left for the node's other ranks."""
        with self._locked():
            seen = self.read()
            if seen is not None:
                return seen
            newest, manifest = at_store()
            if newest is None or manifest is not None:  # a commit gone meanwhile: not shared
                self.remove_old()
                self._write(newest, manifest)
            return newest, manifest

    def read(self) -> tuple[int | None, bytes | None] | None:
        """The sighting, or None when absent or too old, or not sound (logged at info)."""
        try:
            raw = self.doc_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.debug("checkpoint cache: cannot read %s (%s)", self.doc_path, exc)
            return None
        try:
            doc = json.loads(raw)
            newest, digest, seen = doc["newest"], doc["manifest_sha256"], float(doc["time"])
            if newest is not None and (type(newest) is not int or newest < 0):  # bool too
                raise ValueError(f"newest {newest!r} is not a step")
            if not 0 <= time.time() - seen <= self.ttl_s:
                return None
            if newest is None:
                return None, None
            manifest = self.manifest_path.read_bytes()
            if hashlib.sha256(manifest).hexdigest() != digest:
                raise ValueError("the commit record beside it does not match its digest")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.info("checkpoint cache: sighting %s not used (%s)", self.doc_path, exc)
            return None
        return newest, manifest

    def _write(self, newest: int | None, manifest: bytes | None) -> None:
        try:
            digest = None
            if manifest is not None:
                write_private(self.manifest_path, manifest)
                digest = hashlib.sha256(manifest).hexdigest()
            doc = {"newest": newest, "manifest_sha256": digest, "time": time.time()}
            write_private(self.doc_path, json.dumps(doc).encode())
        except OSError as exc:  # the sharing is lost, nothing else
            log.warning("checkpoint cache: cannot leave the sighting %s (%s)", self.doc_path, exc)

    @contextlib.contextmanager
    def _locked(self, poll: float = 0.01) -> Iterator[None]:
        """The node's sighting lock (``flock``: a holder that dies lets go); one that
        cannot be had within ``_LOCK_WAIT_S`` costs the sharing only."""
        fd: int | None = None
        try:
            make_dir(self.root, tighten=True)
            fd = lock_within(self.root / _LOCK, _LOCK_WAIT_S, poll)
        except OSError as exc:
            log.warning("checkpoint cache: cannot lock %s (%s)", self.root / _LOCK, exc)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def remove_old(self) -> None:
        """Sightings of earlier launches go once ten times the TTL old (never one in use)."""
        now = time.time()
        with contextlib.suppress(OSError):
            for path in self.root.glob("SIGHT-*"):
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > 10 * self.ttl_s:
                        path.unlink()
