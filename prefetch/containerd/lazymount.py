"""The snapshotter's lazy mount across its restarts: the connection the FUSE holder kept is
taken over when it still serves ``<root>/lazy``; otherwise (a first start, a mount taken down,
or both the holder and the snapshotter gone at once) what is left there is detached and a new
mount made. Either way the connection is left with the holder again, so that the next restart
finds it.

Nothing here touches the mount itself: a held connection nobody serves yet would block the
caller (its identity is checked through mountinfo and the descriptor's poll state).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from striped_fs import is_mounted, unmount

from .fuseserver import HANDOFF_VERSION, Connection, alive, mount_device
from .holder import HolderClient
from .views import mount_views

log = logging.getLogger(__name__)


@dataclass
class LazyMount:
    conn: Connection
    resumed: bool  # a predecessor's connection, taken over


def open_lazy_mount(lazy_dir: Path, holder: HolderClient, *, wait_s: float = 30.0) -> LazyMount:
    """Take over or make the lazy mount at ``lazy_dir``; raises holder.HolderError when
    another snapshotter still serves it after ``wait_s`` (one per root; a predecessor that is
    stopping is waited for) or no holder can be reached."""
    name = str(lazy_dir)
    held = holder.take(name, wait_s)
    if held is not None:
        fd, meta = held
        why = _unusable(fd, meta, lazy_dir)
        if why is None:
            conn = Connection(fd, name, meta)
            holder.keep(name, fd, meta, deposit=False)
            log.info(
                "taking over the lazy mount at %s (mounted by pid %s)", name, meta.get("mounted_by")
            )
            return LazyMount(conn, True)
        log.warning(
            "the connection the FUSE holder kept for %s cannot be served (%s): mounting anew",
            name,
            why,
        )
        os.close(fd)
        holder.drop(name)
    if is_mounted(lazy_dir):  # a mount nobody holds: a dead one, or an older version's
        log.info("detaching the lazy mount a previous snapshotter left at %s", lazy_dir)
        unmount(lazy_dir, lazy=True)
    os.makedirs(lazy_dir, 0o700, exist_ok=True)
    conn = mount_views(name)
    conn.meta.update(handoff=HANDOFF_VERSION, mounted_by=os.getpid())
    try:
        holder.keep(name, conn.fd, conn.meta)
    except BaseException:  # not kept: it would not survive this process
        unmount(lazy_dir, lazy=True)
        conn.close()
        raise
    return LazyMount(conn, False)


def _unusable(fd: int, meta: dict[str, Any], lazy_dir: Path) -> str | None:
    if meta.get("handoff") != HANDOFF_VERSION:
        return (
            f"it was served by a version speaking handoff {meta.get('handoff')}, this one "
            f"speaks {HANDOFF_VERSION}; running containers on lazy layers lose their files"
        )
    if not alive(fd):
        return "the connection ended"
    dev = mount_device(str(lazy_dir))
    if dev != meta.get("dev"):
        return f"{lazy_dir} is now {dev or 'not mounted'}, not the held mount {meta.get('dev')}"
    return None
