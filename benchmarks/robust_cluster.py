"""The soak's job on the cluster fixture, in one of two modes, and what an operator does.

* ``bootseer``: ``bootseer controller`` on the services host; on every node ``bootseer run
  --controller`` (the agent: crash classes, hang and NaN detection, dumps, verdicts) around
  ``torchrun --max-restarts 0`` (the agent restarts it, under a fresh rendezvous id per
  incident).
* ``peer``: plain ``torchrun --max-restarts N`` on every node: its own restarts and the
  collective timeout, nothing else; the job raises on a non-finite gradient itself.

Why one class for both: the two runs differ only in what supervises torchrun, so the same
fault on the same cluster is measured the same way. The operator's part is the same in both:
a launcher that exited (its node lost, evicted or out of restarts) is started again, on a
fresh node when its node was lost or evicted (an evicted node gets a new agent name: a new
machine, since the old name stays on the exclusion list).

Every launcher's output goes to ``<out>/logs/<agent>.log`` with the arrival time of each line
(``<unix time> <line>``): the peer's detection time is the line where torchrun notices.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bootseer.testing.cluster import Cluster, HostDead, Node
from bootseer.testing.cluster_host import wait_for_line
from ckpt.memory_peer import TOKEN_ENV

HERE = Path(__file__).resolve().parent
JOB = HERE / "robust_job.py"
STORE_PORT = 29400  # the cluster's c10d store (the "rendezvous" service)
MODES = ("bootseer", "peer")
MEMORY_PORT = 7070  # each node's memory-tier peer server, on its own address
# how torchrun starts the workers, the same in both modes (the job's launch, not bootseer's):
# "fork" forks them from torchrun with torch imported (8 ranks ready in ~1 s here, against
# ~6 s for "exec", a fresh interpreter per rank importing torch on 2 cores)
LAUNCHES = {"fork": ("--run-path", "--start-method", "fork"), "exec": ()}
# what the job's start imports, in the interpreter bootseer starts ahead: torchrun itself,
# torch._dynamo (AdamW's constructor imports it: seconds, sympy included) and the
# checkpoint manager's store client
PRELOAD = "torch.distributed.run,torch._dynamo,ckpt,s3fs"


def _stamp_lines(stream: Any, path: Path) -> None:
    with open(path, "a") as log:
        for raw in iter(stream.readline, b""):
            log.write(f"{time.time():.3f} {raw.decode('utf-8', 'replace').rstrip()}\n")
            log.flush()


class SoakJob:
    """The job on ``cluster`` (started, with the "s3" and "rendezvous" services): ``start()``,
    then ``tend()`` now and then (restarts what exited), ``close()``."""

    def __init__(
        self,
        cluster: Cluster,
        out: Path,
        mode: str,
        *,
        nproc: int = 2,
        hang_timeout_s: float = 10.0,
        pg_timeout_s: float = 60.0,
        peer_restarts: int = 1000,
        step_time_s: float = 0.3,
        save_every: int = 20,
        dump_wait_s: float = 10.0,
        launch: str = "fork",
        memory: bool = True,
        preload: bool = True,
        spares: int = 0,
        log: Any = print,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: choose one of {MODES}")
        self.c, self.out, self.mode, self.nproc = cluster, out, mode, nproc
        self.hang_timeout_s, self.pg_timeout_s = hang_timeout_s, pg_timeout_s
        self.peer_restarts, self.step_time_s, self.save_every = (
            peer_restarts,
            step_time_s,
            save_every,
        )
        self.dump_wait_s = dump_wait_s
        if launch not in LAUNCHES:
            raise ValueError(f"launch {launch!r}: choose one of {tuple(LAUNCHES)}")
        self.launch_args = LAUNCHES[launch]
        # bootseer's memory tier: a save every step into the node's memory and a peer's, the
        # durable tier every save_every steps (the peer has no such tier: S3 every save_every)
        self.memory = memory and mode == "bootseer"
        self.token = secrets.token_hex(16)
        # bootseer's interpreter started ahead with the job's heavy imports (--preload)
        self.preload = PRELOAD if preload and mode == "bootseer" else ""
        self.log = log
        # warm spares: the cluster's last `spares` nodes, parked at the rendezvous (bootseer
        # run --standby; torchrun alone parks the same launcher in torch's redundancy list);
        # a lost or evicted node's replacement is started as a spare too
        if not 0 <= spares < len(cluster.nodes):
            raise ValueError(f"spares={spares}: the cluster has {len(cluster.nodes)} nodes")
        self.spares = spares
        self.job_nodes = len(cluster.nodes) - spares
        self.spare_ids = set(range(self.job_nodes, len(cluster.nodes)))
        self.controller: subprocess.Popen | None = None
        self.launchers: dict[int, subprocess.Popen] = {}
        self.agent_names: dict[int, str] = {}
        self.relaunches: list[dict[str, Any]] = []  # {"time", "node", "why", "as"}
        self.lost_at: dict[int, float] = {}
        self.down: set[str] = set()  # services taken down (a replacement node meets them too)
        self._readers: list[threading.Thread] = []
        for sub in ("logs", "faults", "trace", "ctl"):
            (out / sub).mkdir(parents=True, exist_ok=True)

    @property
    def world(self) -> int:
        return self.job_nodes * self.nproc

    def node_of_rank(self, rank: int) -> int:
        """The index of the node whose newest process of ``rank`` runs there (the job's
        ``pid-<rank>`` file), else the rank's node at the start."""
        try:
            host = json.loads((self.out / f"pid-{rank}").read_text())["host"]
        except (OSError, ValueError, KeyError):
            return rank // self.nproc
        return next((i for i, n in enumerate(self.c.nodes) if n.name == host), rank // self.nproc)

    # -- starting ----------------------------------------------------------------------------

    def start(self) -> None:
        bucket = self.c.services.create_bucket(f"soak-{self.mode}")
        self.ckpt = f"s3://{bucket}/run"
        if self.mode == "bootseer":
            self._start_controller()
        for i in range(len(self.c.nodes)):
            self.launch(i)

    def _start_controller(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "bootseer",
            "controller",
            "--store",
            f"127.0.0.1:{STORE_PORT}",
            "--trace-dir",
            str(self.out / "ctl"),
            "--exclusion",
            str(self.out / "excluded.json"),
            "--dump-wait",
            str(self.dump_wait_s),
        ]
        with open(self.out / "logs" / "controller.err", "ab") as err:
            self.controller = self.c.services.popen(argv, stdout=subprocess.PIPE, stderr=err)
        wait_for_line(self.controller, "READY", "the controller", 120)
        reader = threading.Thread(
            target=_stamp_lines,
            daemon=True,
            args=(self.controller.stdout, self.out / "logs" / "controller.log"),
        )
        reader.start()
        self._readers.append(reader)

    def _job_argv(self, node: Node) -> list[str]:
        opts = json.dumps({"s3": self.c.services.storage_options()})
        argv = [
            str(JOB),
            "--out",
            str(self.out),
            "--ckpt",
            self.ckpt,
            "--storage-options",
            opts,
            "--local-dir",
            str(node.dirs.work / "job"),
            "--step-time",
            str(self.step_time_s),
            "--save-every",
            "1" if self.memory else str(self.save_every),
            "--pg-timeout",
            str(self.pg_timeout_s),
        ]
        return [*argv, "--nan-guard"] if self.mode == "peer" else argv

    def launch(self, i: int) -> None:
        """Start node ``i``'s launcher (the agent, or torchrun alone)."""
        node = self.c.nodes[i]
        name = node.name if node.generation == 1 else f"{node.name}-g{node.generation}"
        nodes = self.job_nodes
        spare = ["--standby"] if i in self.spare_ids else []
        if self.mode == "peer":
            argv = node.torchrun(
                self._job_argv(node),
                nnodes=f"{nodes}:{nodes}",
                nproc_per_node=self.nproc,
                rdzv_id="peer",
                max_restarts=self.peer_restarts,
                launch=self.launch_args,
            )
        else:
            # no --rdzv-id: bootseer run hands torchrun a fresh one per verdict (PET_RDZV_ID)
            run = node.torchrun(
                self._job_argv(node),
                nnodes=f"{nodes}:{nodes}",
                nproc_per_node=self.nproc,
                rdzv_id=None,
                max_restarts=0,
                launch=self.launch_args,
            )
            argv = [
                sys.executable,
                "-m",
                "bootseer",
                "run",
                "--controller",
                f"{self.c.services.controller}:{STORE_PORT}",
                "--node",
                name,
                "--hang-timeout",
                str(self.hang_timeout_s),
                "--state-dir",
                str(self.out / f"state-{name}"),
                "--trace-dir",
                str(self.out / "trace"),
                "--min-free-disk",
                "0",
                "--min-free-memory",
                "0",
                "--max-restarts",
                "1000",
                "--max-no-progress",
                "0",
                "--backoff",
                "1",
                "--backoff-max",
                "4",
                *spare,
                *self._memory_flags(node),
                *(["--preload", self.preload] if self.preload else []),
                "--",
                *run,
            ]
        env = {TOKEN_ENV: self.token} if self.memory else None
        proc = node.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        reader = threading.Thread(
            target=_stamp_lines, daemon=True, args=(proc.stdout, self.out / "logs" / f"{name}.log")
        )
        reader.start()
        self._readers.append(reader)
        self.launchers[i], self.agent_names[i] = proc, name

    def _memory_flags(self, node: Node) -> list[str]:
        if not self.memory:
            return []
        # the copies in the node's own directory (off its disk, removed with the node): a
        # node killed by a fault or the teardown leaves nothing in the host's /dev/shm
        return [
            "--ckpt-memory",
            "--ckpt-memory-dir",
            str(node.dirs.run / "memckpt"),
            "--ckpt-memory-listen",
            f"{node.address}:{MEMORY_PORT}",
            "--ckpt-durable-every",
            str(self.save_every),
        ]

    # -- the operator ------------------------------------------------------------------------

    def verdicts(self) -> list[dict[str, Any]]:
        return read_records(self.out / "ctl" / "controller.jsonl", "verdict")

    def evicted(self) -> set[str]:
        return {n for v in self.verdicts() for n in v.get("nodes", [])}

    def tend(self) -> list[str]:
        """Start again what exited: a lost or evicted node is replaced by a fresh one first.
        Returns what was done, in words."""
        done = []
        for i, proc in list(self.launchers.items()):
            node = self.c.nodes[i]
            if node.alive and proc.poll() is None:
                continue
            name = self.agent_names[i]
            if not node.alive or name in self.evicted():
                why = "lost" if not node.alive else "evicted"
                with contextlib.suppress(HostDead):
                    node.kill()
                self.c.replace_node(i)
                for service in self.down:
                    self.c.service_down(service)
                if self.mode == "bootseer" and why == "lost":
                    self._wait_for_verdict_after(self.lost_at.get(i, 0.0))
                if self.spares:  # a spare took its place (or will): the new node is a spare
                    self.spare_ids.add(i)
            else:
                why = f"its launcher exited ({proc.returncode})"
            self.launch(i)
            self.relaunches.append(
                {"time": time.time(), "node": name, "why": why, "as": self.agent_names[i]}
            )
            done.append(f"{name} {why}: started {self.agent_names[i]}")
            self.log(f"operator: {done[-1]}")
        return done

    def service_down(self, name: str, down: bool = True) -> None:
        """A service down for every node, the ones that replace them included (or back)."""
        (self.down.add if down else self.down.discard)(name)
        self.c.service_down(name, down)

    def lose_node(self, i: int) -> None:
        """Node ``i`` is lost: every process on it killed at once (the operator replaces it)."""
        self.lost_at[i] = time.time()
        self.c.kill_node(i)

    def _wait_for_verdict_after(self, since: float, timeout_s: float = 60.0) -> None:
        """A fresh agent takes the newest incident's rendezvous id: wait for the verdict of
        the incident the loss opened (the survivors' next rendezvous)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(v.get("time", 0) >= since for v in self.verdicts()):
                return
            time.sleep(0.5)

    def close(self) -> None:
        for proc in (*self.launchers.values(), *([self.controller] if self.controller else [])):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in (*self.launchers.values(), *([self.controller] if self.controller else [])):
            with contextlib.suppress(Exception):
                proc.wait(timeout=30)


def read_records(path: Path, record: str | None = None) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (of one ``record`` kind); a torn last line is skipped."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        with contextlib.suppress(ValueError):
            d = json.loads(line)
            if isinstance(d, dict) and (record is None or d.get("record") == record):
                found.append(d)
    return found
