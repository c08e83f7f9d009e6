"""Optimizer and learning-rate schedules (the paper's Appendix A: Adam (0.9, 0.98) and fairseq's
inverse-square-root schedule with linear warmup from 1e-7).

`build_scheduler("inverse_sqrt", ...)` is fairseq's schedule; every other name goes to
`transformers.get_scheduler` (`linear`, `cosine`, `constant_with_warmup`, ...), as in
Transformers' example scripts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from transformers import SchedulerType, get_scheduler

# Schedules built from the warmup and the number of updates alone: not those driven by a validation
# metric, nor those that need options the recipes do not have (a minimum rate, decay steps).
_NOT_OFFERED = ("inverse_sqrt", "reduce_lr_on_plateau", "greedy", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                "warmup_stable_decay")
SCHEDULER_TYPES = ("inverse_sqrt", *(kind.value for kind in SchedulerType if kind.value not in _NOT_OFFERED))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: parameters with `ndim < 2` (biases, norm weights) get none."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8) -> torch.optim.AdamW:
    """Adam with decoupled weight decay (fairseq's `adam`), betas (0.9, 0.98) as in the paper."""
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


def inverse_sqrt_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                          warmup_init_lr: float = 1e-7) -> LambdaLR:
    """fairseq's `inverse_sqrt`: linear warmup from `warmup_init_lr` to the optimizer's lr over
    `warmup_steps` updates, then lr * sqrt(warmup_steps / step).

    Written here because `transformers.get_inverse_sqrt_schedule` warms up from 0, so its first
    update is lost, and it has no `warmup_init_lr`; after warmup the two agree (tested).
    """
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be at least 1; got {warmup_steps}")
    lrs = [group["lr"] for group in optimizer.param_groups]
    if any(lr <= 0 for lr in lrs):
        raise ValueError(f"the optimizer's learning rate must be positive; got {lrs}")

    def factor(step: int, base_lr: float) -> float:
        if step < warmup_steps:
            return (warmup_init_lr + step * (base_lr - warmup_init_lr) / warmup_steps) / base_lr
        return math.sqrt(warmup_steps / step)

    return LambdaLR(optimizer, [lambda step, lr=lr: factor(step, lr) for lr in lrs])


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int,
                    warmup_init_lr: float = 1e-7) -> LRScheduler:
    """The schedule `name`, stepped once per optimizer update."""
    if name not in SCHEDULER_TYPES:
        raise ValueError(f"unknown lr_scheduler_type {name!r}; valid: {list(SCHEDULER_TYPES)}")
    if name == "inverse_sqrt":
        return inverse_sqrt_schedule(optimizer, num_warmup_steps, warmup_init_lr)
    return get_scheduler(name, optimizer, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
