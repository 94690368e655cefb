"""Every rank loads the same step: the newest committed step that every rank can load.

A load goes in rounds. In each, every rank tries one step (loading it in place, which
verifies what that rank reads: its indexes, the stripes of the byte ranges it needs, its
objects) and the ranks compare outcomes:

* with a process group, one ``all_reduce`` (MIN) of three integers says whether every rank
  loaded the same step. Only when not (a damaged file somewhere, ranks that listed different
  steps, an error) do the ranks ``all_gather_object`` their outcomes, so that every rank
  logs every failure and all take the same decision: the next round tries the newest step
  older than the failed one, together. A rank never leaves the rounds early: an error is
  an outcome too, raised on every rank after the exchange, so no rank waits for another
  in a collective that never comes;
* without one (one process, or ranks without ``torch.distributed``), a rank cannot hear the
  others: it takes a step only when every rank's files of it verify (``check_unread``), the
  same answer every rank computes alone.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("ckpt")

OK, DAMAGED, ERROR = 2, 1, 0  # ordered so that MIN over ranks is the worst outcome
NONE = -1  # a rank with no step left to try


@dataclass
class Outcome:
    """What one rank's try of one round came to."""

    rank: int
    step: int  # the step tried; NONE: no committed step left to try
    status: int  # OK, DAMAGED (the step cannot be loaded: fall back) or ERROR (raise)
    message: str = ""
    path: str = ""  # the file that failed


Exchange = Callable[[Outcome], "list[Outcome] | None"]


def resolve_group(group: Any, rank: int, world_size: int) -> Any:
    """The process group a load agrees over, or None.

    ``group=None``: torch.distributed's default group when it is initialized and its rank and
    size are the manager's (a manager of another world, e.g. a tool that loads on one rank of
    a running job, never enters a collective the other ranks do not); ``False``: none; a
    ``ProcessGroup``: that one."""
    if group is False:
        return None
    import torch.distributed as dist

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            return None
        return dist.group.WORLD
    if dist.get_world_size(group) != world_size or dist.get_rank(group) != rank:
        raise ValueError(
            f"process_group has rank {dist.get_rank(group)} of "
            f"{dist.get_world_size(group)}; the manager is rank {rank} of "
            f"{world_size}: pass the group of the ranks that load together"
        )
    return group


def agree_attempt(local: str, group: Any, rank: int, world_size: int) -> str:
    """The attempt id every rank of this run writes: rank 0's, made unique to this run.

    The environment's ids (``BOOTSEER_ATTEMPT``, torchelastic's restart count) are counted by
    each node's own agent: a node that replaced a lost one starts again at 0 while the
    survivors are at 1, so the ranks would write different attempts and rank 0's commit would
    wait for indexes that never come (a hang at the first save after a node replacement). Over
    a process group rank 0 decides, adding a random part, so that a rank 0 whose own count
    started again never reuses an earlier run's id. Without a group: ``local`` as it is."""
    resolved = resolve_group(group, rank, world_size)
    if resolved is None:
        return local
    import torch.distributed as dist

    box = [f"{local}:{uuid.uuid4().hex[:12]}" if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(resolved, 0), group=resolved)
    return str(box[0])


def group_exchange(group: Any) -> Exchange:
    """Compare outcomes over ``group``: ``None`` when every rank loaded the same step (one
    small all_reduce), else every rank's outcome, in rank order (one all_gather_object)."""
    import torch
    import torch.distributed as dist

    device = _device(group)

    def exchange(outcome: Outcome) -> list[Outcome] | None:
        summary = torch.tensor(
            [outcome.step, -outcome.step, outcome.status], dtype=torch.int64, device=device
        )
        dist.all_reduce(summary, op=dist.ReduceOp.MIN, group=group)
        low, minus_high, status = (int(x) for x in summary.tolist())
        if low == -minus_high and low >= 0 and status == OK:
            return None
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, asdict(outcome), group=group)
        return [Outcome(**o) for o in gathered]

    return exchange


def _device(group: Any) -> Any:
    """Where the group's collectives take tensors: the CPU for gloo, the current GPU for
    NCCL (the rule torch's object collectives follow)."""
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device

        kind = _get_object_coll_device(group)
    except (ImportError, AttributeError, ValueError):  # a torch without the helper
        kind = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def alone(outcome: Outcome) -> list[Outcome] | None:
    """The exchange of a rank that loads on its own."""
    return None if outcome.status == OK and outcome.step >= 0 else [outcome]


def warn(outcome: Outcome, url: str, alone: bool) -> str:
    """Log, on every rank, why a step is skipped; returns the line for ``LoadReport.skipped``."""
    who = (
        f"rank {outcome.rank}"
        if not alone
        else f"rank {outcome.rank} (checking every rank's files: no process group)"
    )
    log.warning(
        "checkpoint step %d under %s cannot be loaded by %s: %s; every rank falls back "
        "to an older committed step",
        outcome.step,
        url,
        who,
        outcome.message,
    )
    return f"step {outcome.step}: rank {outcome.rank}: {outcome.message}"
