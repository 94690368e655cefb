"""Give a fresh optimizer its state tensors, so a checkpoint can be loaded into them in place.

Optimizers create their state lazily at the first step, so a freshly built optimizer's
``state_dict()`` has nothing to load into. This runs one step with zero gradients and a
learning rate of 0 (parameters do not move), then restores gradients and learning rates.
"""

from __future__ import annotations

import torch


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    saved_grads = {}
    for group in optimizer.param_groups:
        group["lr"] = (
            0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
        )
        for p in group["params"]:
            if p.requires_grad and p not in optimizer.state:
                saved_grads[p] = p.grad
                p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad
