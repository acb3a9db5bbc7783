"""Parameter counts per part of TheWorld (train.optimizer.lr_multipliers' parts), for the run's start line."""

from __future__ import annotations

import torch

from theworld.model.arch import NEVER_TRAINED, PARTS, part_of
from theworld.model.lora import is_adapter  # a part's adapter parameters are counted as "(LoRA n)"


def human(n: int) -> str:
    """6.6 M, 4.3 B, 512 (one decimal; k, M, B)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def part_counts(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """{part: {trainable, total, adapter}} in the order of arch.PARTS, then arch.NEVER_TRAINED (whole counts, also for
    sharded DTensors)."""
    out = {part: {"trainable": 0, "total": 0, "adapter": 0} for part in (*PARTS, *NEVER_TRAINED)}
    for name, p in model.named_parameters():
        c = out[part_of(name)]
        c["total"] += p.numel()
        if p.requires_grad:
            c["trainable"] += p.numel()
            c["adapter"] += p.numel() if is_adapter(name) else 0
    return out


def describe(model: torch.nn.Module) -> str:
    """'parameters trainable / total: projector 6.6 M / 6.6 M, vision 0 / 417.1 M, language 29.0 M / 4.3 B (LoRA
    29.0 M), vae 0 / 127.0 M'."""
    parts = []
    for part, c in part_counts(model).items():
        if c["total"]:
            lora = f" (LoRA {human(c['adapter'])})" if c["adapter"] else ""
            parts.append(f"{part} {human(c['trainable'])} / {human(c['total'])}{lora}")
    return "parameters trainable / total: " + ", ".join(parts)
