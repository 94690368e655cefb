"""The node agent's check of the memory tier's local copies, off the trainer's critical path.

When ``bootseer run`` (re)starts the command, it verifies each rank's newest complete copy in
its directory beside the launch (torchrun, imports and the rendezvous take seconds; the
hash of a 201 MB copy takes tens of milliseconds in the agent's own process) and leaves a
stamp next to the slot file (``<slot>.stamp``, JSON)::

    verify_copies("/dev/shm/bootseer-memckpt-x")   # -> [Verdict(path, step, ok, message)]
    stamp_for(slot, head)                           # the trainer: the stamp of this copy, or None

A stamp is bound to one copy: its step and a digest (XXH3-64) of the copy's header and of its
meta, which holds the block-hash table (and the header the meta's CRC-32 and the commit time),
so a stamp never applies to another copy or to one rewritten after the check; a slot's writer
removes the stamp when it starts a new copy there (``SlotFile.invalidate``). The trainer's
load of a copy stamped good is a plain copy (``ckpt.memory.load_slot``); a copy stamped
damaged is refused without reading it, naming what the agent found; an unstamped one is hashed
as before. The window this leaves: a byte flipped between the agent's check and the load is
not seen (as a flip in a tensor after any load is not).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

import xxhash

from striped_fs import PrivateDir, UnsafePath, open_owned

from .memory_slot import HEADER, STAMP_SUFFIX, SlotDamaged, SlotFile, SlotHeader, newest

MEMORY_DIR_WHAT = "the memory tier's directory (ckpt.memory_dir, BOOTSEER_MEMCKPT_DIR)"


@dataclass
class Verdict:
    """What the agent found in one copy."""

    path: str
    step: int
    ok: bool
    message: str = ""
    seconds: float = 0.0


def stamp_path(slot_path: str) -> str:
    return slot_path + STAMP_SUFFIX


def copy_digest(slot: SlotFile, head: SlotHeader) -> str:
    """The identity of one committed copy: XXH3-64 of its header and its meta (block hashes,
    object blob), hex. A rewrite changes the header's commit time and meta CRC-32."""
    h = xxhash.xxh3_64(json.dumps(head.to_json(), sort_keys=True).encode())
    h.update(slot.view(HEADER + head.data_size, head.meta_size))
    return h.hexdigest()


def stamp_for(slot: SlotFile, head: SlotHeader) -> dict | None:
    """The agent's stamp of exactly this copy (``{"ok": bool, "message": ...}``), or ``None``
    when there is none, it is unreadable, not this user's regular file (a planted one is
    never read), or it names another copy."""
    try:
        fd = open_owned(slot.name + STAMP_SUFFIX, dir_fd=slot.dir_fd, where=stamp_path(slot.path))
        with os.fdopen(fd, encoding="utf-8") as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(stamp, dict)
        or stamp.get("step") != head.step
        or stamp.get("digest") != copy_digest(slot, head)
    ):
        return None
    return stamp


def _write_stamp(slot: SlotFile, stamp: dict) -> None:
    """Through the slot's directory descriptor: a new file (O_EXCL, no link followed),
    renamed over the old stamp."""
    where = PrivateDir(os.path.dirname(slot.path), slot.dir_fd)
    where.write_atomic(slot.name + STAMP_SUFFIX, json.dumps(stamp).encode())


def verify_slot(slot: SlotFile, head: SlotHeader) -> Verdict:
    """Check every block of one copy and stamp it good or damaged; a copy rewritten while it
    was checked (the header or meta changed) is left unstamped (the trainer hashes it)."""
    started = time.perf_counter()
    try:
        digest = copy_digest(slot, head)
        meta, _blob = slot.meta(head)
        slot.check_data(head, meta["sums"])
        ok, message = True, ""
    except SlotDamaged as exc:
        ok, message = False, str(exc)
    try:
        again = slot.header()
        same = again is not None and again.step == head.step and copy_digest(slot, again) == digest
    except (SlotDamaged, ValueError):
        same = False
    verdict = Verdict(slot.path, head.step, ok, message, time.perf_counter() - started)
    if same:
        _write_stamp(
            slot,
            {"step": head.step, "digest": digest, "ok": ok, "message": message, "at": time.time()},
        )
    else:
        verdict.message = "rewritten while checked: not stamped"
    return verdict


def verify_copies(directory: str) -> list[Verdict]:
    """Verify and stamp the newest complete copy of every rank in ``directory`` (the agent's
    own ranks: ``rank-N.0``/``.1``; the peers' copies are checked on receipt). The directory
    must be this user's own (0700, not a link: ``striped_fs.privdir``); a slot that is not
    this user's regular file is a verdict "refused", never read nor stamped."""
    verdicts = []
    with PrivateDir.open(directory, create=False, what=MEMORY_DIR_WHAT) as where:
        present = set(where.names())
        bases = sorted({n[:-2] for n in present if re.fullmatch(r"rank-\d+\.[01]", n)})
        for base in bases:
            slots = []
            try:
                for k in (0, 1):
                    if f"{base}.{k}" in present:
                        try:
                            slots.append(
                                SlotFile(where.where(f"{base}.{k}"), readonly=True, dir_fd=where.fd)
                            )
                        except UnsafePath as exc:
                            verdicts.append(
                                Verdict(where.where(f"{base}.{k}"), -1, False, f"refused: {exc}")
                            )
                        except FileNotFoundError:
                            continue
                found = newest(slots)
                if found:
                    verdicts.append(verify_slot(slot=found[0][1], head=found[0][0]))
            finally:
                for slot in slots:
                    slot.close()
    return verdicts
