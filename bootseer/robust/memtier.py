"""The node agent's side of the memory tier: it owns the memory the copies live in.

``bootseer run`` with ``ckpt.memory`` makes a private directory in shared memory (0700, under
/dev/shm unless ``ckpt.memory_dir`` names one), serves the peers' copies from it when
``ckpt.memory_listen`` is set (``ckpt.PeerServer``, a thread of the agent), and hands both
to the job (``ckpt.memory_handoff``: ``BOOTSEER_MEMCKPT_DIR``, ``BOOTSEER_MEMCKPT_SERVER``).
The server answers only connections that prove they hold the job's secret (``BOOTSEER_MEMCKPT_TOKEN``
in the agent's environment, the same on every node; the job inherits it), checks a MAC under
it on every message and copy after that proof (``ckpt.memory_wire``), and binds only the
address ``ckpt.memory_listen`` names, never a wildcard. The trainer
writes its copies there; they outlive the trainer's crash or SIGKILL, because the agent, not
the trainer, holds the directory, and are removed when the run ends. Each time the agent
(re)starts the command it checks each rank's newest copy on a thread beside the launch
(:meth:`NodeMemory.check_copies`, ``ckpt.memory_verify``), so that the trainer's load of a
copy stamped good is a plain copy, and one stamped damaged is never loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

from striped_fs import PrivateDir

SHM = "/dev/shm"


class NodeMemory:
    """The directory and the peer server of one ``bootseer run``; :meth:`close` ends both."""

    def __init__(
        self,
        directory: str = "",
        listen: str = "",
        durable_every: int = 0,
        log: Any = None,
        layout: str = "",
        replication: str = "async",
        durable_outage_s: float = 600.0,
    ) -> None:  # MemoryConfig's default
        from ckpt import check_memory_settings, memory_handoff

        check_memory_settings(layout, replication, listen)  # refused before anything is made
        host, _, port = listen.rpartition(":")
        self._made = not directory
        self._log = log
        self.checking: threading.Thread | None = None
        # made 0700 here, or (a named one that exists) this user's own, 0700, not a link;
        # unnamed: a fresh one with a name nobody can guess (striped_fs.privdir)
        if directory:
            where = PrivateDir.open(directory, what="ckpt.memory_dir")
        else:
            where = PrivateDir.new(
                SHM if os.path.isdir(SHM) else tempfile.gettempdir(),
                "bootseer-memckpt-",
                what="the memory tier's directory",
            )
        self.directory = where.path if not directory else directory
        self.server = None
        with where:
            if listen:
                where.subdir("peers", what="the memory tier's directory of peer copies").close()
        if listen:
            from ckpt import PeerServer  # numpy, cryptography: only for a node that serves

            peers = os.path.join(self.directory, "peers")
            try:
                self.server = PeerServer(peers, host, int(port), own=self.directory).start()
            except (OSError, ValueError):
                self.close()  # the directory made for this run goes too
                raise
        self.env = memory_handoff(
            self.directory,
            fresh=self._made,  # only this run's copies: never older than the durable tier
            server=self.server.address if self.server is not None else "",
            durable_every=durable_every,
            durable_outage_s=durable_outage_s,
            layout=layout,
            replication=replication,
        )
        if log is not None:
            st = os.statvfs(self.directory)
            log(
                f"memory tier: copies in {self.directory} ({st.f_bavail * st.f_frsize / 2**30:.1f}"
                f" GiB free; each rank needs 4x its state: 2 own copies, 2 of a peer's)"
                + (f", peers served at {self.server.address}" if self.server else "")
            )

    def check_copies(self) -> threading.Thread:
        """Verify and stamp every rank's newest copy on a thread (beside the launch); the
        verdicts go to the log. Returns the thread (tests join it)."""
        from ckpt import verify_copies

        def run() -> None:
            try:
                verdicts = verify_copies(self.directory)
            except Exception as exc:  # noqa: BLE001 - unstamped copies are hashed by the trainer
                self._say(
                    f"memory tier: the check of the copies failed ({exc}); the "
                    "trainer checks them as it loads"
                )
                return
            for v in verdicts:
                self._say(
                    f"memory tier: {os.path.basename(v.path)} step {v.step}: "
                    f"{'good' if v.ok else 'DAMAGED'} ({v.seconds:.3f} s)"
                    + (f": {v.message}" if v.message else "")
                )

        self.checking = threading.Thread(target=run, name="memtier-check", daemon=True)
        self.checking.start()
        return self.checking

    def _say(self, message: str) -> None:
        if self._log is not None:
            self._log(message)

    def close(self) -> None:
        if self.checking is not None:
            self.checking.join(timeout=60)
        if self.server is not None:
            self.server.close()
            self.server = None
        base = os.path.basename(self.directory)
        if (
            self._made
            and base.startswith("bootseer-memckpt-")
            and os.path.dirname(self.directory)
            in map(os.path.realpath, (SHM, tempfile.gettempdir()))
        ):
            shutil.rmtree(self.directory, ignore_errors=True)
