"""A Python interpreter started ahead of the next attempt, with the job's heavy modules
already imported, that becomes that attempt's command.

Why: a restart's first seconds go to imports. On the soak's 4 nodes x 2 ranks (2 cores),
a rank's ``torch.optim.AdamW(...)`` alone imports ``torch._dynamo`` (sympy and all) for
seconds, and torchrun imports torch before it can rendezvous. With ``bootseer run
--preload torch.distributed.run,torch._dynamo`` the agent starts ``python -m bootseer.prestart``
once the attempt has stepped: it imports those modules while the job trains and then waits.
At the next restart the agent hands it the attempt (argv, environment, working directory and
output pipes, over a socket pair) and it runs the command in-process, as ``python -m MOD``
or ``python SCRIPT`` would; torchrun started with ``--run-path --start-method fork`` then
forks its ranks from it, imports included.

Only commands of the forms ``[env NAME=VALUE ...] PYTHON -m MODULE ARGS`` and ``[env
NAME=VALUE ...] PYTHON SCRIPT ARGS`` are started this way (PYTHON: an interpreter whose
name starts with ``python``, without options of its own); any other command, a standby that
died or failed an import, or a code version that changed since it was started (a hot update)
starts the command as before. What the standby imported was imported under the agent's
environment, not the attempt's (which differs in ``BOOTSEER_*`` variables and what the
version sets): preload modules whose import does not read those.

Usage::

    bootseer run --preload torch.distributed.run,torch._dynamo -- \\
        python -m torch.distributed.run --run-path --start-method fork ... train.py
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PythonCommand", "Standby", "python_command"]

READY = b"ready\n"
MAX_REQUEST = 16 << 20  # argv + environment as JSON


@dataclass(frozen=True)
class PythonCommand:
    """A command that a standby interpreter can run: ``python -m module`` or ``python
    script``, with the variables an ``env`` prefix sets."""

    python: str
    module: str | None
    script: str | None
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def python_command(command: Sequence[str]) -> PythonCommand | None:
    """``command`` as a :class:`PythonCommand`, or None when a standby cannot run it."""
    argv = list(command)
    env: list[tuple[str, str]] = []
    if argv and os.path.basename(argv[0]) == "env":
        argv.pop(0)
        while argv and "=" in argv[0] and not argv[0].startswith(("-", "=")):
            name, _, value = argv.pop(0).partition("=")
            env.append((name, value))
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python"):
        return None
    if argv[1] == "-m":
        if len(argv) < 3 or argv[2].startswith("-"):
            return None
        return PythonCommand(argv[0], argv[2], None, tuple(argv[3:]), tuple(env))
    if argv[1].startswith("-"):  # interpreter options (-u, -X, -c): started as before
        return None
    return PythonCommand(argv[0], None, argv[1], tuple(argv[2:]), tuple(env))


class Standby:
    """One interpreter started with ``modules`` imported, used at most once.

    ``Standby.start(...)`` spawns it in a process group of its own (as the supervisor starts a
    command); :meth:`take` hands it an attempt and returns its ``Popen``, or None when it
    cannot run it (then start the command as usual)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        python: str,
        modules: tuple[str, ...],
        version: str | None,
    ) -> None:
        self.proc, self.sock, self.python = proc, sock, python
        self.modules, self.version = modules, version
        self.ready = False

    @classmethod
    def start(
        cls,
        python: str,
        modules: Sequence[str],
        env: Mapping[str, str],
        *,
        version: str | None = None,
    ) -> Standby:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [python, "-m", "bootseer.prestart", str(theirs.fileno()), *modules],
                env=dict(env),
                pass_fds=(theirs.fileno(),),
                process_group=0,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours, python, tuple(modules), version)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, timeout: float) -> str | None:
        """None once it has imported everything, else why not."""
        if self.ready:
            return None
        self.sock.settimeout(timeout)
        try:
            got = self.sock.recv(len(READY))
        except TimeoutError:
            return f"not ready after {timeout:.0f} s"
        except OSError as exc:
            return f"unreachable ({exc})"
        if got != READY:
            return "exited before it was ready (an import failed: see its output above)"
        self.ready = True
        return None

    def take(
        self,
        command: PythonCommand,
        env: Mapping[str, str],
        cwd: str | None,
        outputs: Sequence[int],
        *,
        version: str | None = None,
        timeout: float = 120.0,
    ) -> tuple[subprocess.Popen[bytes] | None, str]:
        """Hand it the attempt: ``(its Popen, "")``, or ``(None, why not)`` (it is then
        stopped). ``outputs``: the write ends of the attempt's stdout and stderr pipes, or
        none (it keeps the agent's)."""
        why = ""
        if command.python != self.python:
            why = f"the command's interpreter {command.python} is not the standby's"
        elif version != self.version:
            why = "the code version changed since it started"
        else:
            why = self._wait_ready(timeout) or ""
        if not why:
            request = {
                "env": {**env, **dict(command.env)},
                "cwd": cwd or os.getcwd(),
                "module": command.module,
                "script": command.script,
                "args": list(command.args),
            }
            data = json.dumps(request).encode() + b"\n"
            try:
                self.sock.settimeout(timeout)
                if outputs:
                    socket.send_fds(self.sock, [data[:1]], list(outputs))
                    self.sock.sendall(data[1:])
                else:
                    self.sock.sendall(data)
            except OSError as exc:
                why = f"unreachable ({exc})"
        if why:
            self.stop()
            return None, why
        self.sock.close()
        return self.proc, ""

    def stop(self) -> None:
        """Kill it (unused, or refused) and reap it if it is still ours to reap."""
        self.sock.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            self.proc.wait(5)


# -- the standby's side ----------------------------------------------------------------------


def _receive(sock: socket.socket) -> tuple[dict, list[int]]:
    first, fds, _, _ = socket.recv_fds(sock, 1, 2)
    if not first:
        raise SystemExit(0)  # the agent closed it: not needed
    data = bytearray(first)
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        if not chunk or len(data) > MAX_REQUEST:
            raise SystemExit(f"bootseer prestart: the request was cut short ({len(data)} bytes)")
        data += chunk
    return json.loads(data), fds


def _become(request: dict, fds: list[int]) -> None:
    """This process becomes the attempt's command: its outputs, directory, environment."""
    for fd, target in zip(fds, (1, 2), strict=False):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    client = sys.modules.get("bootseer.client")
    if client is not None:  # imported under the agent's environment: hook the attempt's
        client.install_stack_dump()


def main(argv: Sequence[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    for name in argv[1:]:
        importlib.import_module(name)
    sock.sendall(READY)
    request, fds = _receive(sock)
    sock.close()
    _become(request, fds)
    args = request["args"]
    if request["module"]:
        sys.argv = [request["module"], *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        script = str(Path(request["script"]).absolute())
        sys.argv = [request["script"], *args]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
