"""DDP's gradient all_reduces into the ring: a communication hook that issues them from Python.

Why: ``DistributedDataParallel``'s reducer calls the process group from C++, so its gradient
all_reduces never pass the patched ``ProcessGroup`` methods (:mod:`.recorder`), and a DDP job
would show no collective at all in the ring. With the tracer on, each DDP module gets, before
its first forward (``_lazy_init``), a hook that does what the reducer does without one:
scale the bucket by ``1 / world`` (a multiplication, as the reducer does: the parameters stay
bit-identical to an untraced run, tested at a world of 3) and ``dist.all_reduce`` it
asynchronously, which the recorder records.

Left alone: a module whose script registered its own hook first (a Python hook's
``dist.*`` calls are recorded anyway; a built-in C++ hook is not), DDP's Python reducer
(compiled DDP) and ``_delay_all_reduce_all_params``. A script that registers its hook after
the first forward gets it run by the tracer's hook (DDP takes one hook per module): a Python
hook as it is, a built-in one as torch's Python equivalent (``default_hooks``). Not caught:
DDP's constructor checks and buffer broadcasts (``_broadcast_coalesced``, C++).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["install", "uninstall"]

_ORIGINALS: dict[str, Callable[..., Any]] = {}


class _HookState:
    """The traced hook's state: the module's group, and a hook the script registered late."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.late: tuple[Callable[..., Any], Any] | None = None


def _traced_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    # unannotated: DDP checks a hook's annotations against dist.GradBucket and Future
    if state.late is not None:
        hook, late_state = state.late
        return hook(late_state, bucket)
    import torch.distributed as dist

    tensor = bucket.buffer()
    tensor.mul_(1.0 / state.group.size())
    work = dist.all_reduce(tensor, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _builtin_equivalent(kind: Any) -> Callable[..., Any]:
    """torch's Python hook for a built-in hook type (state: the process group)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if kind == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return default_hooks.allreduce_hook


def _attach(ddp: Any) -> None:
    if (
        getattr(ddp, "_bootseer_hook", None) is not None
        or ddp._use_python_reducer
        or getattr(ddp, "_delay_all_reduce_all_params", False)
    ):
        return
    if ddp._get_ddp_logging_data().get("comm_hook"):  # the script's own, registered first
        return
    state = _HookState(ddp.process_group)
    _ORIGINALS["register_comm_hook"](ddp, state, _traced_allreduce)
    ddp._bootseer_hook = state


def install() -> None:
    """Patch ``DistributedDataParallel`` (idempotent); :func:`uninstall` gives it back."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if "register_comm_hook" not in _ORIGINALS:
        _patch_registration(DDP)
    if "_lazy_init" in _ORIGINALS:
        return
    _ORIGINALS["_lazy_init"] = DDP._lazy_init

    def _lazy_init(self: Any) -> None:
        _attach(self)
        _ORIGINALS["_lazy_init"](self)

    DDP._lazy_init = _lazy_init


def _patch_registration(DDP: Any) -> None:  # noqa: N803 - the class
    """A hook registered after the tracer's is run by it (DDP takes one per module). Stays
    patched after :func:`uninstall`: a module hooked while the tracer was on still takes a
    script's late hook; a module without the tracer's hook passes straight through."""
    _ORIGINALS.update(
        register_comm_hook=DDP.register_comm_hook,
        _register_builtin_comm_hook=DDP._register_builtin_comm_hook,
    )

    def register_comm_hook(self: Any, state: Any, hook: Callable[..., Any]) -> None:
        traced = getattr(self, "_bootseer_hook", None)
        if traced is None:
            return _ORIGINALS["register_comm_hook"](self, state, hook)
        self._check_comm_hook(hook)
        traced.late = (hook, state)
        return None

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        traced = getattr(self, "_bootseer_hook", None)
        if traced is None:
            return _ORIGINALS["_register_builtin_comm_hook"](self, comm_hook_type)
        traced.late = (_builtin_equivalent(comm_hook_type), self.process_group)
        return None

    register_comm_hook.__doc__ = DDP.register_comm_hook.__doc__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook


def uninstall() -> None:
    """New DDP modules get no hook (hooks already attached stay: they issue
    ``dist.all_reduce``, recorded only while the tracer is installed)."""
    original = _ORIGINALS.pop("_lazy_init", None)
    if original is not None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._lazy_init = original
