"""The recorder: every collective and point-to-point op a process issues, into its ring.

Interception point: the methods of ``torch._C._distributed_c10d.ProcessGroup`` (``allreduce``,
``all_gather_single``, ``send``, ...). Every ``torch.distributed`` function ends in one of them
(``dist.all_reduce`` calls ``group.allreduce``, the object collectives call ``all_gather`` and
``broadcast``), and so do FSDP2 (``dist.all_gather_single``/``reduce_scatter_single``) and DCP
(``all_gather_object``, ``broadcast_object_list``, ``barrier``), whatever the backend. Patching
the class once catches every group; a function-level patch would miss the callers that bound
``dist.all_reduce`` before the patch. Not caught: functional collectives
(``torch.distributed._functional_collectives``, ``torch.ops._c10d_functional.*``: DTensor
redistribute, tensor parallelism, compiled graphs), which call the C++ process group without
passing through Python. DDP's reducer does too: :mod:`.ddp` gives each DDP module a hook that
issues its gradient all_reduces from Python.

Completion: a synchronous op (``opts.asyncOp`` false) is waited on by the wrapper itself,
on the caller's thread, which then records it: torch's own function waits on the work at once
anyway (``dist.all_reduce``: ``work = group.allreduce(...); work.wait()``), so the op ends at
the same moment and the second ``wait()`` returns at once; no object is made per op. A p2p op
and a work without a future (gloo's ``send``/``recv`` and ``reduce_scatter_single``) are
returned wrapped in a thin :class:`_TracedWork` whose ``wait()`` records the completion; an
asynchronous op's completion comes from its future (``add_done_callback``, run by the
backend's thread when the op finishes or fails), so an op that nobody waits on yet still
shows as completed. Measured: a future's callback costs a GIL hand-off between threads per op
(docs/benchmarks.md).

Off (never enabled, or :func:`disable`) the class is untouched: no cost at all.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from .ddp import install as install_ddp
from .ddp import uninstall as uninstall_ddp
from .ring import DTYPE_CODE, FLAG_P2P, OP_CODE, Ring

__all__ = ["Recorder", "PATCHED", "active"]

#: ProcessGroup method -> (op name in the ring, index of the argument that holds the payload)
PATCHED: dict[str, tuple[str, int | None]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce_coalesced", 0),
    "broadcast": ("broadcast", 0),
    "reduce": ("reduce", 0),
    "allgather": ("all_gather", 1),
    "all_gather_single": ("all_gather_single", 1),
    "_allgather_base": ("all_gather_single", 1),
    "allgather_coalesced": ("all_gather_coalesced", 1),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter_single", 1),
    "_reduce_scatter_base": ("reduce_scatter_single", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 1),
    "alltoall": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all_single", 1),
    "alltoall_base": ("all_to_all_single", 1),
    "barrier": ("barrier", None),
    "monitored_barrier": ("monitored_barrier", None),
    "gather": ("gather", 1),
    "scatter": ("scatter", 0),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recv_anysource", 0),
}
_P2P = {"send", "recv", "recv_anysource"}

_active: Recorder | None = None
_lock = threading.Lock()


def active() -> Recorder | None:
    """The enabled recorder of this process, or None."""
    return _active


def _payload(x: Any, dtypes: dict[Any, int]) -> tuple[int, int, int]:
    """(elements, bytes, dtype code) of a tensor or a (nested) list of tensors."""
    if type(x) is list and len(x) == 1:  # the common case: dist.* passes [tensor]
        x = x[0]
    numel = getattr(x, "numel", None)
    if numel is not None:
        n = numel()
        return n, n * x.element_size(), dtypes.get(x.dtype, 0)
    if isinstance(x, list | tuple):
        total = nbytes = 0
        code = 0
        for item in x:
            a, b, c = _payload(item, dtypes)
            total += a
            nbytes += b
            code = code or c
        return total, nbytes, code
    return 0, 0, 0


class Recorder:
    """Patches ``ProcessGroup`` and writes one ring record per op (see the module doc)."""

    def __init__(
        self, directory: str | os.PathLike, *, capacity: int = 4096, node: str | None = None
    ) -> None:
        import torch

        self.directory = Path(directory)
        self.capacity = capacity
        self.node = node or os.environ.get("BOOTSEER_NODE") or socket.gethostname()
        self.ring: Ring | None = None
        self.refused = ""  # why the ring could not be made (its directory refused): untraced
        self._numbers = itertools.count()
        self._groups: dict[Any, tuple[int, Any, list[int]]] = {}  # pg -> (id, seq counter, ranks)
        self._p2p: dict[tuple[int, int, int], Any] = {}  # (group, peer, send?) -> counter
        self._originals: dict[str, Callable[..., Any]] = {}
        self._dtypes = {
            getattr(torch, name): code
            for name, code in DTYPE_CODE.items()
            if isinstance(getattr(torch, name, None), torch.dtype)
        }
        self._pg_class = None

    # -- on and off ----------------------------------------------------------------------
    def install(self) -> None:
        from torch._C._distributed_c10d import ProcessGroup

        self._pg_class = ProcessGroup
        for method, (op, arg) in PATCHED.items():
            # the raw class attribute (pybind's instancemethod), so that restoring it binds
            original = ProcessGroup.__dict__.get(method)
            if original is None:
                continue
            self._originals[method] = original
            setattr(ProcessGroup, method, self._wrap(original, OP_CODE[op], arg, method in _P2P))
        install_ddp()  # DDP's reducer calls the group from C++: its gradients via a hook

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def uninstall(self, *, close: bool = True) -> None:
        """Give the methods back; ``close=False`` keeps the ring for a later :meth:`install`."""
        if self._originals:
            uninstall_ddp()
        for method, original in self._originals.items():
            setattr(self._pg_class, method, original)
        self._originals.clear()
        if close and self.ring is not None:
            self.ring.close()

    # -- the hot path ----------------------------------------------------------------------
    def _wrap(
        self, original: Callable[..., Any], op: int, arg: int | None, p2p: bool
    ) -> Callable[..., Any]:
        recorder = self
        dtypes = self._dtypes
        now = time.time_ns

        def traced(pg: Any, *args: Any, **kwargs: Any) -> Any:
            entry = recorder._groups.get(pg)
            if entry is None:
                entry = recorder._new_group(pg)
            gid, counter, ranks = entry
            numel, nbytes, dtype = (
                (0, 0, 0) if arg is None or len(args) <= arg else _payload(args[arg], dtypes)
            )
            peer = -1
            if p2p:
                peer = args[1] if op != OP_CODE["recv_anysource"] and len(args) > 1 else -1
                key = (gid, peer, op == OP_CODE["send"])
                counter = recorder._p2p.get(key) or recorder._p2p.setdefault(
                    key, itertools.count(1)
                )
                if 0 <= peer < len(ranks):
                    peer = ranks[peer]
            ring = recorder.ring
            if ring is None:  # its directory was refused: untraced, never an error here
                return original(pg, *args, **kwargs)
            n = next(recorder._numbers)
            off = ring.write(
                n, gid, op, FLAG_P2P if p2p else 0, dtype, next(counter), numel, nbytes, now(), peer
            )
            try:
                work = original(pg, *args, **kwargs)
            except BaseException:
                ring.complete(off, n, now(), failed=True)
                raise
            if work is None:  # a blocking call (monitored_barrier): done on return
                ring.complete(off, n, now())
                return work
            if p2p:  # isend/irecv: the caller waits when it wants; gloo's have no future
                return _traced_work(work, ring, off, n)
            if getattr(args[-1] if args else None, "asyncOp", True) is False:
                # a synchronous op: torch waits on it at once, on this thread; waiting here
                # first records the completion with no object per op and no hand-off of the
                # GIL to the backend's thread that a future's callback would cost
                try:
                    work.wait()
                except BaseException:
                    ring.complete(off, n, now(), failed=True)
                    raise
                ring.complete(off, n, now())
                return work
            try:
                work.get_future().add_done_callback(partial(_done, ring, off, n))
            except RuntimeError:  # no future (gloo's reduce_scatter): completed at wait()
                return _traced_work(work, ring, off, n)
            return work

        traced.__name__ = getattr(original, "__name__", "traced")
        traced.__doc__ = getattr(original, "__doc__", None)
        return traced

    def _new_group(self, pg: Any) -> tuple[int, Any, list[int]]:
        """First op on a group: its table entry (and the ring, on the first op at all)."""
        import torch.distributed as dist

        with _lock:
            if pg in self._groups:
                return self._groups[pg]
            if self.ring is None and not self.refused:
                rank = (
                    dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
                )
                world = (
                    dist.get_world_size()
                    if dist.is_initialized()
                    else int(os.environ.get("WORLD_SIZE", "1"))
                )
                try:
                    self.ring = Ring(
                        self.directory, rank, world, capacity=self.capacity, node=self.node
                    )
                except (OSError, ValueError) as exc:  # a refused directory: no tracing,
                    self.refused = str(exc)  # and the collective itself goes on
                    print(f"bootseer: colltrace: not recording: {exc}", file=sys.stderr, flush=True)
            try:
                ranks = list(dist.get_process_group_ranks(pg))
            except Exception:  # noqa: BLE001 - a group torch does not register (internal)
                ranks = []
            name = str(getattr(pg, "group_name", "") or f"pg{len(self._groups)}")
            desc = str(getattr(pg, "group_desc", "") or "")
            gid = len(self._groups) + 1
            try:
                grank = pg.rank()
            except Exception:  # noqa: BLE001
                grank = -1
            if self.ring is not None:
                self.ring.add_group(
                    gid, {"name": name, "desc": desc, "ranks": ranks, "rank": grank}
                )
            entry = (gid, itertools.count(1), ranks)
            self._groups[pg] = entry
            return entry


def _done(ring: Ring, off: int, n: int, fut: Any) -> None:
    failed = False
    try:
        fut.value()
    except Exception:  # noqa: BLE001 - the op failed (a peer died): recorded as failed
        failed = True
    ring.complete(off, n, time.time_ns(), failed)


_WORK_CLASS: Any = None


def _traced_work(work: Any, ring: Ring, off: int, n: int) -> Any:
    """A Work that records the completion when waited on (gloo's p2p works have no future)."""
    global _WORK_CLASS
    if _WORK_CLASS is None:
        from torch._C._distributed_c10d import Work

        class _TracedWork(Work):
            def __init__(self, inner: Any, ring: Ring, off: int, n: int) -> None:
                super().__init__()
                self._inner, self._at = inner, (ring, off, n)

            def wait(self, timeout: Any = None) -> bool:
                ring, off, n = self._at
                try:
                    ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
                except BaseException:
                    ring.complete(off, n, time.time_ns(), failed=True)
                    raise
                ring.complete(off, n, time.time_ns())
                return ok

            def is_completed(self) -> bool:
                return self._inner.is_completed()

            def is_success(self) -> bool:
                return self._inner.is_success()

            def exception(self) -> Any:
                return self._inner.exception()

            def source_rank(self) -> int:
                return self._inner.source_rank()

            def result(self) -> Any:
                return self._inner.result()

            def synchronize(self) -> None:
                self._inner.synchronize()

        _WORK_CLASS = _TracedWork
    return _WORK_CLASS(work, ring, off, n)
