"""The training side of ``bootseer run``: ``ready()`` and ``heartbeat(step)``.

Training code tells the wrapper that its start is over (the first step) and that it still
makes progress::

    import bootseer

    for step in range(start, steps):
        train_step()
        if step == start:
            bootseer.ready()          # startup ends here: the trace's first_step span
        bootseer.heartbeat(step, loss=loss, grad_norm=norm)  # at most one write a second
    bootseer.finishing(step)          # the final save and teardown are not a hang

Both write small files (atomic replace, JSON ``{"step", "time", "pid", "rank"}``, plus
``"loss"`` and ``"grad_norm"`` when given) into the control directory the wrapper gives the
child (``BOOTSEER_CONTROL_DIR``): ``ready-<rank>`` and ``heartbeat-<rank>``, the rank from ``RANK`` (0 without it). Without that variable (not under
``bootseer run``) both return at once. Neither ever raises into the training loop.

A silence is a hang; the metrics feed :mod:`bootseer.robust.detect` (NaN/Inf, 5x jumps). A
NaN or Inf loss or grad norm skips the rate limit, so the step it happened at is on disk at
once, and every later heartbeat of the process carries it as ``"first_nonfinite"`` (a
reader that polls slower than the steps still sees it). JSON has no NaN: non-finite values
are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (:func:`bootseer.robust.events.metric` reads both forms back).

The first ``ready()`` or ``heartbeat()`` of a rank's main process also writes its status record
``status-<rank>`` (``{"state": "running", "pid", "rank", "time"}``) and hooks its end, so the
wrapper watches the rank's process itself and sees a crash the moment it happens (not when
the launcher exits, seconds later): an uncaught exception (``sys.excepthook``) rewrites the
record as ``"state": "exception"`` with the exception's type, message and last traceback
lines before the process dies; an exception that ends a thread
(``threading.excepthook``) is kept in the record as ``"thread_exception"`` (the process may
live on); a normal interpreter exit (``atexit``) writes ``"state": "exited"``. A rank that
torchrun forks (``--run-path --start-method fork``: the workers start from the launcher's
imported torch) ends through multiprocessing, which runs neither hook: its finalizer reads
the exception in flight instead. The previous
hooks still run (the traceback is still printed). Forked or spawned children (DataLoader
workers) never write their rank's record.

Under the wrapper, importing this module also registers a SIGUSR1 handler (``faulthandler``)
that writes the Python stack of every thread to
``$BOOTSEER_TRACE_DIR/stacks-<node>-rank<r>-<pid>.txt``: the wrapper sends SIGUSR1 before it
kills a hung child, so the hang leaves its stacks behind. A SIGUSR1 handler the program had
already installed keeps running after the dump (``chain=True``).

With ``BOOTSEER_COLLTRACE_ENABLED`` (``bootseer run`` with ``[colltrace] enabled``), importing
this module (``import bootseer.client``, or the first ``ready()``/``heartbeat()``) also turns
on the collective tracer (:func:`bootseer.colltrace.enable`); import it before the first
collective to trace them all, or call ``bootseer.colltrace.enable()`` yourself.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import math
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import IO, Any

__all__ = ["finishing", "heartbeat", "install_stack_dump", "ready", "stack_file_name"]

CONTROL_ENV = "BOOTSEER_CONTROL_DIR"
TRACE_ENV = "BOOTSEER_TRACE_DIR"
READY_FILE_ENV = "BOOTSEER_READY_FILE"
IMAGE_READY = "/.bootseer/ready"
HEARTBEAT_INTERVAL_S = 1.0

_lock = threading.Lock()
_last_heartbeat = float("-inf")  # monotonic time of the last heartbeat written
_dump_file: IO[str] | None = None  # kept open: faulthandler writes to its descriptor
_dump_path: str | None = None  # its path
_dump_pid: int | None = None
_image_told = False
_clock = time.monotonic
_first_nonfinite: dict[str, Any] | None = None  # the first NaN/Inf heartbeat of this process
_colltrace_tried = False
_status_pid: int | None = None  # the process that owns its rank's status record
_status: dict[str, Any] = {}
STATUS_LINES = 100  # traceback lines kept in the record (a chained error is long)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _node() -> str:
    return os.environ.get("BOOTSEER_NODE") or socket.gethostname()


def stack_file_name(node: str, rank: int, pid: int) -> str:
    """The file a process's stacks go to (the wrapper parses the pid back out of it)."""
    return f"stacks-{node}-rank{rank}-{pid}.txt"


def _write(path: str, doc: dict[str, Any]) -> None:
    """Atomic replace, so the wrapper never reads half a file."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{os.getpid()}.tmp"
    with os.fdopen(_create_new(tmp), "w", encoding="utf-8") as f:
        f.write(json.dumps(doc))
    os.replace(tmp, path)


def _create_new(path: str) -> int:
    """A new file 0600 at ``path`` (an earlier one of this name removed first), created
    exclusively: never through a link planted there. The wrapper made the directories 0700
    (or checked them); this keeps a write from ever following a link all the same, without
    importing more than ``os`` into the training process."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _doc(step: Any) -> dict[str, Any]:
    if step is not None:
        try:
            step = int(step)  # a numpy or tensor scalar is welcome too
        except (TypeError, ValueError):
            step = None
    return {"step": step, "time": time.time(), "pid": os.getpid(), "rank": _rank()}


def _metric(value: Any) -> float | str | None:
    """A float for JSON, non-finite ones as strings (JSON has no NaN); None when absent or
    not a number (a metric must never break training)."""
    if value is None:
        return None
    try:
        number = float(value)  # a Python float, a numpy or a 0-d tensor (.item() sync)
    except (TypeError, ValueError, RuntimeError):
        return None
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return number


def _colltrace() -> None:
    """The collective tracer, when ``bootseer run`` asks for it (once; never raises)."""
    global _colltrace_tried
    if _colltrace_tried or not os.environ.get("BOOTSEER_COLLTRACE_ENABLED"):
        return
    _colltrace_tried = True
    from .colltrace import enable_from_env

    enable_from_env()


def ready() -> None:
    """The first training step is reached: the end of startup (and a heartbeat).

    Also ends the profile recording of a lazily pulled bootseer image (``/.bootseer/ready``
    exists in such containers; reading it is the signal), with or without the wrapper."""
    global _image_told
    try:
        if not _image_told:
            _image_told = True
            if os.path.exists(IMAGE_READY):
                with open(IMAGE_READY, "rb") as f:
                    f.read()
        _colltrace()
        control = os.environ.get(CONTROL_ENV)
        if not control:
            return
        install_stack_dump()
        _install_status(control)
        doc = _doc(None)
        _write(os.path.join(control, f"ready-{_rank()}"), doc)
        extra = os.environ.get(READY_FILE_ENV)  # a configured file (a readiness probe's)
        if extra and os.path.dirname(os.path.abspath(extra)) != os.path.abspath(control):
            _write(extra, doc)
    except Exception:  # noqa: BLE001 - a signal to the wrapper must never break training
        pass


def heartbeat(step: int | None = None, loss: Any = None, grad_norm: Any = None) -> None:
    """Progress, with the step's loss and grad norm when given: written at most once a
    second (cheap to call every step), except that a NaN or Inf metric is written at once."""
    global _last_heartbeat
    control = os.environ.get(CONTROL_ENV)
    if not control:
        return
    try:
        now = _clock()
        metrics = {
            k: m
            for k, v in (("loss", loss), ("grad_norm", grad_norm))
            if (m := _metric(v)) is not None
        }
        urgent = any(isinstance(m, str) for m in metrics.values())
        global _first_nonfinite
        if urgent and _first_nonfinite is None:
            _first_nonfinite = {"step": _doc(step)["step"], **metrics}
        if not urgent and now - _last_heartbeat < HEARTBEAT_INTERVAL_S:
            return
        with _lock:
            if not urgent and now - _last_heartbeat < HEARTBEAT_INTERVAL_S:
                return
            _last_heartbeat = now
        install_stack_dump()
        _install_status(control)
        doc = {**_doc(step), **metrics}
        if _first_nonfinite is not None:  # sticky: a reader polling slower still sees it
            doc["first_nonfinite"] = _first_nonfinite
        _write(os.path.join(control, f"heartbeat-{_rank()}"), doc)
    except Exception:  # noqa: BLE001 - see ready()
        pass


def finishing(step: int | None = None) -> None:
    """The training loop is done: what follows (the final checkpoint, closing the process
    group, the launcher's teardown) may take longer than any step, and the agent no longer
    reads this rank's silence as a hang. Its end is still watched: a crash after this is a
    crash. Written at once (no rate limit); never raises."""
    global _last_heartbeat
    control = os.environ.get(CONTROL_ENV)
    if not control:
        return
    try:
        _install_status(control)
        with _lock:
            _last_heartbeat = _clock()
        doc = {**_doc(step), "finishing": True}
        if _first_nonfinite is not None:
            doc["first_nonfinite"] = _first_nonfinite
        _write(os.path.join(control, f"heartbeat-{_rank()}"), doc)
    except Exception:  # noqa: BLE001 - see ready()
        pass


def _install_status(control: str) -> None:
    """The rank's status record and the hooks that rewrite it at its end (once per process;
    never in a forked child, whose parent owns the record)."""
    global _status_pid
    if _status_pid is not None:
        return
    _status_pid = os.getpid()
    _status.update(_doc(None), state="running", path=os.path.join(control, f"status-{_rank()}"))
    _status.pop("step", None)
    previous, previous_thread = sys.excepthook, threading.excepthook

    def on_exception(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        _end_status("exception", kind, exc, tb)
        previous(kind, exc, tb)

    def on_thread_exception(args: Any) -> None:
        if args.exc_type is not SystemExit:
            _end_status(
                "thread_exception",
                args.exc_type,
                args.exc_value,
                args.exc_traceback,
                thread=getattr(args.thread, "name", None),
            )
        previous_thread(args)

    sys.excepthook = on_exception
    threading.excepthook = on_thread_exception
    atexit.register(_end_status, "exited")
    if multiprocessing.parent_process() is not None:
        # a rank forked or spawned by torchrun (``--run-path --start-method fork``) ends
        # through multiprocessing: its launcher catches the exception and calls sys.exit(1),
        # so neither sys.excepthook nor atexit runs; its finalizers do
        multiprocessing.util.Finalize(None, _end_as_a_process_child, exitpriority=100)
    _save_status()


def _end_as_a_process_child() -> None:
    """The record at the end of a multiprocessing child: the exception in flight (the
    launcher's ``SystemExit(1)`` carries the rank's own as its context), else a normal end."""
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit) and exc.code not in (0, None) and exc.__context__ is not None:
        exc = exc.__context__
    if exc is None or isinstance(exc, SystemExit):
        _end_status("exited")
    else:
        _end_status("exception", type(exc), exc, exc.__traceback__)


def _save_status() -> None:
    try:
        _write(_status["path"], {k: v for k, v in _status.items() if k != "path"})
    except Exception:  # noqa: BLE001 - a record must never break training or its end
        pass


def _end_status(
    state: str,
    kind: type[BaseException] | None = None,
    exc: BaseException | None = None,
    tb: Any = None,
    *,
    thread: str | None = None,
) -> None:
    """The record at the rank's end: what ended it, before the process is gone."""
    if _status_pid != os.getpid():
        return
    try:
        info: dict[str, Any] = {}
        if kind is not None:
            name = (
                kind.__qualname__
                if kind.__module__ in ("builtins", "__main__")
                else f"{kind.__module__}.{kind.__qualname__}"
            )
            text = "".join(traceback.format_exception(kind, exc, tb))
            info = {
                "exception": name,
                "message": str(exc)[:500],
                "lines": text.splitlines()[-STATUS_LINES:],
                "time": time.time(),
            }
        if state == "thread_exception":
            _status["thread_exception"] = {**info, "thread": thread}
        elif state == "exception":
            _status.update(info, state="exception")
        elif _status.get("state") == "running":  # atexit after an exception keeps it
            _status.update(state="exited", time=time.time())
        else:
            return
        _save_status()
    except Exception:  # noqa: BLE001 - see _save_status
        pass


def install_stack_dump() -> str | None:
    """Register the SIGUSR1 stack dump of this process (once per process; a forked child
    registers its own file). Returns the file, or None when not under the wrapper."""
    global _dump_file, _dump_pid, _dump_path
    if _dump_pid == os.getpid():
        return _dump_path if _dump_file is not None else None
    trace_dir = os.environ.get(TRACE_ENV)
    if not trace_dir or not os.environ.get(CONTROL_ENV):
        return None
    with _lock:
        if _dump_pid == os.getpid():
            return _dump_path if _dump_file is not None else None
        _dump_pid = os.getpid()
        try:
            previous = signal.getsignal(signal.SIGUSR1)
            os.makedirs(trace_dir, exist_ok=True)
            path = os.path.join(trace_dir, stack_file_name(_node(), _rank(), os.getpid()))
            f = os.fdopen(_create_new(path), "w", encoding="utf-8")  # lives with the process
            # chain only to a handler the program installed: chaining to SIG_DFL would kill it
            chain = callable(previous)
            faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=chain)
            old, _dump_file, _dump_path = _dump_file, f, path
            if old is not None:
                old.close()  # the parent's file, inherited by a fork
            return path
        except Exception:  # noqa: BLE001 - no dump is better than a broken start
            return None


def _after_fork() -> None:
    """A forked child (a DataLoader worker) dumps into its own file, not its parent's."""
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    if _dump_pid is not None and _dump_pid != os.getpid():
        install_stack_dump()


os.register_at_fork(after_in_child=_after_fork)
if os.environ.get(CONTROL_ENV):
    install_stack_dump()
_colltrace()
