"""A host of the cluster: a network namespace with an address on the switch, a UTS namespace
(its host name) and a cgroup that holds every process it runs.

Why a cgroup and the namespaces together: a lost machine loses all its processes at once,
whatever they forked (``kill`` writes ``cgroup.kill``), and a process that left the cgroup
(runc moves containers) is still found by its namespaces. Mounts stay the machine's: every
program of a node sees the mounts the others made (containerd and its snapshotter need that),
and teardown finds them under the host's directory.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .cgroup import Cgroup, KillMethod
from .netns import (
    create_netns,
    create_uts,
    delete_netns,
    entered,
    mounts_under,
    netns_path,
    nsenter_argv,
    processes_in,
)
from .servers import DUMMY_AWS_KEY, DUMMY_AWS_REGION, DUMMY_AWS_SECRET
from .switch import HOST_IFNAME, Switch

__all__ = ["Host", "HostDead", "wait_for_line"]

_PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "ftp_proxy"}
# Runs as the program's first instruction: join the host's cgroup, then become the program.
_JOIN_CGROUP = 'echo $$ > "$0" && exec "$@"'


class HostDead(RuntimeError):
    """The host was killed (``Cluster.kill_node``): replace it before running anything on it."""


def wait_for_line(proc: subprocess.Popen, prefix: str, what: str, timeout_s: float) -> str:
    """The first line of ``proc``'s stdout starting with ``prefix`` (a child's "I am ready"
    line); raises naming ``what`` when it exits first or stays silent for ``timeout_s``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what} was not ready after {timeout_s:.0f} s")
        if select.select([proc.stdout], [], [], left)[0]:
            line = proc.stdout.readline()
            if isinstance(line, bytes):
                line = line.decode(errors="replace")
            if not line:
                raise RuntimeError(f"{what} exited with code {proc.wait()} before it was ready")
            if line.startswith(prefix):
                return line.strip()


MAX_TMPDIR_LEN = 64
"""Longest host ``TMPDIR`` given: a unix socket path has at most 107 bytes, and
multiprocessing puts ``pymp-XXXXXXXX/listener-XXXXXXXX`` in it (a deep ``workdir`` keeps
the inherited one)."""


class Host:
    """One machine: ``name`` (its host name), ``address`` on the switch, ``netns`` (the
    network namespace's name), a cgroup, and ``root``, its private directory."""

    def __init__(
        self,
        name: str,
        address: str,
        netns: str,
        root: Path,
        cgroup: Cgroup,
        kill_method: KillMethod = "auto",
    ) -> None:
        self.name = name
        self.address = address
        self.netns = netns
        self.root = root
        self.uts = root / "uts"
        self.cgroup = cgroup
        self.kill_method: KillMethod = kill_method
        self.alive = False
        self._procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.address}, netns={self.netns})"

    @property
    def netns_path(self) -> Path:
        """``/run/netns/NAME``: for ``nsenter --net=`` or ``setns``."""
        return netns_path(self.netns)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tmp(self) -> Path:
        """The host's own temporary directory (its programs' ``TMPDIR``), removed with
        ``root``: what they leave there when the host is killed (torchelastic's and
        multiprocessing's directories, ``bootseer run``'s control directory) goes with it."""
        return self.root / "tmp"

    def _create(self, switch: Switch, port: str, link: Any) -> None:
        self.root.mkdir(mode=0o700)
        self.logs.mkdir()
        self.tmp.mkdir(mode=0o700)
        create_netns(self.netns)
        switch.connect(port, self.netns, self.address, link)
        create_uts(self.uts, self.name)
        self.cgroup.create()
        self.alive = True

    # -- running programs ----------------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a program on this host gets: this process's, without HTTP proxies
        (nothing outside the cluster is reachable), ``TMPDIR`` the host's :attr:`tmp` (when
        its path is short enough for the sockets made in it), with gloo and tensorpipe bound to the
        host's interface and dummy S3 credentials; ``extra`` on top."""
        env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
        if len(str(self.tmp)) <= MAX_TMPDIR_LEN:  # else unix sockets made in it would not fit
            env["TMPDIR"] = str(self.tmp)
        env.update(
            GLOO_SOCKET_IFNAME=HOST_IFNAME,
            TP_SOCKET_IFNAME=HOST_IFNAME,
            AWS_ACCESS_KEY_ID=DUMMY_AWS_KEY,
            AWS_SECRET_ACCESS_KEY=DUMMY_AWS_SECRET,
            AWS_DEFAULT_REGION=DUMMY_AWS_REGION,
            AWS_EC2_METADATA_DISABLED="true",
        )
        env.update(extra or {})
        return env

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run on this host: its namespaces, then its cgroup, then exec
        (the pid stays the program's)."""
        if not self.alive:
            raise HostDead(
                f"{self.name} was killed: replace it (Cluster.replace_node) before "
                f"running {list(argv)[:1]} on it"
            )
        return [
            *nsenter_argv(self.netns_path, self.uts),
            "/bin/sh",
            "-c",
            _JOIN_CGROUP,
            str(self.cgroup.procs_file),
            *argv,
        ]

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start ``argv`` on this host (``subprocess.Popen`` arguments; ``env`` is added to
        :meth:`env`). The host's teardown kills and reaps it."""
        proc = subprocess.Popen(self.argv(argv), env=self.env(env), **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to the end (text output captured unless told otherwise);
        ``check`` raises with its stderr when it fails."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        proc = subprocess.run(
            self.argv(argv), env=self.env(env), timeout=timeout, check=False, **kwargs
        )
        if check and proc.returncode != 0:
            err = (
                proc.stderr
                if isinstance(proc.stderr, str)
                else (proc.stderr or b"").decode(errors="replace")
            )
            raise RuntimeError(
                f"{self.name}: {' '.join(argv)} exited {proc.returncode}: {err.strip()[-2000:]}"
            )
        return proc

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread on this host for the body: a socket opened inside reaches what
        the host reaches for its whole life; a child started inside runs on the host (move it
        into the cgroup with :meth:`adopt`). Other threads are not affected."""
        with entered(self.netns_path, self.uts):
            yield

    def adopt(self, pid: int) -> None:
        """Put a process started inside :meth:`entered` into this host's cgroup."""
        self.cgroup.adopt(pid)

    # -- losing it -----------------------------------------------------------------------

    def kill(self, timeout_s: float = 30.0) -> None:
        """Every process of the host gets SIGKILL at once; returns when none is left."""
        self.alive = False
        self._kill_groups(timeout_s)
        self._kill_leftovers(self._held_inodes(), timeout_s)

    def _outside_groups(self) -> list[Cgroup]:
        """Subclasses: cgroup2 groups of this host's processes outside its own group (runc
        moves containers out)."""
        return []

    def _kill_groups(self, timeout_s: float = 30.0) -> None:
        self.cgroup.kill(self.kill_method, timeout_s)
        for group in self._outside_groups():
            group.kill(self.kill_method, timeout_s)

    def _held_inodes(self) -> set[int]:
        return {os.stat(p).st_ino for p in (self.netns_path, self.uts) if p.exists()}

    @staticmethod
    def _kill_leftovers(inodes: set[int], timeout_s: float) -> None:
        """Processes that left the cgroup but not the namespaces (containers) die too."""
        deadline = time.monotonic() + timeout_s
        while pids := processes_in(inodes):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} survived SIGKILL for {timeout_s:.0f} s")
            time.sleep(0.02)

    def _reap(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def _release(self) -> None:
        """Subclasses: stop what this process runs for the host (proxies, server objects)."""

    def close(self, switch: Switch, port: str) -> list[str]:
        """Remove everything of the host: processes, mounts under ``root``, its namespaces,
        its veth pair, its cgroup, ``root``. Returns what could not be removed. Namespaces
        are held open meanwhile, so a process found in them is surely this host's."""
        problems: list[str] = []
        held = [os.open(p, os.O_RDONLY) for p in (self.netns_path, self.uts) if p.exists()]
        inodes = {os.fstat(fd).st_ino for fd in held}
        try:
            for step in (
                self._kill_groups,
                lambda: self._kill_leftovers(inodes, 30.0),
                self._reap,
                self._release,
            ):
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - teardown goes on; say what is left
                    problems.append(f"{self.name}: {exc}")
            self.alive = False
            for point in mounts_under(self.root):
                proc = subprocess.run(
                    ["umount", "-l", str(point)], capture_output=True, text=True, check=False
                )
                if proc.returncode != 0:
                    problems.append(f"{self.name}: umount {point}: {proc.stderr.strip()}")
            switch.disconnect(port)
            delete_netns(self.netns)
            try:
                self.cgroup.remove()
            except OSError as exc:
                problems.append(f"{self.name}: cgroup {self.cgroup.path}: {exc}")
            if left := processes_in(inodes):
                problems.append(f"{self.name}: processes {left} still in its namespaces")
        finally:
            for fd in held:
                os.close(fd)
        if self.root.exists() and not mounts_under(self.root):
            shutil.rmtree(self.root, ignore_errors=True)
        return problems
