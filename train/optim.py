"""The optimiser and its schedule: AdamW over parameter groups by part (train.optimizer.lr_multipliers) and decay, and
the learning-rate factor as a pure function of the step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from theworld.model.arch import PARTS, part_of

if TYPE_CHECKING:
    from train.config import LrSchedule, OptimizerConfig

# Parameter names that never get weight decay besides biases and norm weights (all 1-D tensors): the world markers and
# the temporal table (embeddings, like position embeddings; the rows of frames a run does not use stay as initialised)
NO_DECAY_NAMES = ("projector.sow", "projector.eow", "projector.temporal")


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether weight decay applies: not to biases, norm weights (all 1-D), the world markers and the temporal table."""
    return not (p.ndim < 2 or name in NO_DECAY_NAMES or "norm" in name.lower())


def param_groups(model: torch.nn.Module, weight_decay: float, multipliers=None) -> list[dict]:
    """One AdamW group per (part, decay / no decay), in the order of `PARTS`; each group carries its part's
    `lr_multiplier` (train.optimizer.lr_multipliers), applied on top of the scheduled rate at every step."""
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((part_of(name), decays(name, p)), []).append(p)
    order = list(PARTS)
    return [
        {
            "params": ps,
            "weight_decay": weight_decay if decay else 0.0,
            "part": part,
            "lr_multiplier": getattr(multipliers, part) if multipliers is not None else 1.0,
        }
        for (part, decay), ps in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), not kv[0][1]))
    ]


def build_optimizer(opt: OptimizerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over `model`'s trainable parameters as `train.optimizer` says."""
    return torch.optim.AdamW(
        param_groups(model, opt.weight_decay, opt.lr_multipliers), lr=opt.lr, betas=tuple(opt.betas)
    )


def lr_factor(schedule: LrSchedule, max_steps: int) -> Callable[[int], float]:
    """`train.lr_schedule` over a run of `max_steps` as a pure function of the step (transformers' own warmup +
    cosine/linear/constant lambdas)."""
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[schedule.decay]
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler(name, dummy, num_warmup_steps=schedule.warmup_steps, num_training_steps=max_steps)
    return sched.lr_lambdas[0]
