"""One optimisation step on already-loaded micro-batches (the held-out loss: train/eval/heldout.py). The loop state
lives in `LoopState`.

The loss is normalised by the number of answer tokens in the whole global batch (all micro-batches, all processes),
counted and all-reduced before the forward passes, so accumulation and process count leave the gradient unchanged.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from theworld.model import objective
from theworld.model.arch import latent_side
from theworld.model.world import PROFILE_LABELS
from train import sharding
from train.data.batches import Batch
from train.data.order import noise_seeds, rank_offset, seed_of

if TYPE_CHECKING:
    from train.components import Components


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row: the run stops."""


@dataclass
class LoopState:
    """Everything mutable in a run; with the weights and optimiser state it defines where the run is."""

    step: int = 0  # optimiser steps taken (skipped non-finite steps count: their batch is consumed)
    samples_seen: int = 0
    tokens_seen: int = 0
    nonfinite_steps: int = 0
    nonfinite_in_a_row: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    last_eval: dict | None = None
    parent: str | None = None  # init_from of this run
    history: list = field(default_factory=list)  # checkpoints this run resumed from
    eval_history: list = field(default_factory=list)  # [step, eval_loss] of every eval (train/eval/plateau.py)
    plateau_step: int | None = None  # the first eval that found the eval loss plateaued
    wandb_run_id: str | None = None  # the W&B run this run logs to (a resumed run continues it)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LoopState:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def optimization_step(components: Components, state: LoopState, micro_batches: list[Batch]) -> dict:
    """Forward/backward over this process's micro-batches of one global batch, clip, AdamW step (unless non-finite),
    EMA update. Advances `state`. Returns {loss, grad_norm, lr, skipped, tokens}."""
    accelerator, cfg = components.accelerator, components.cfg
    device = accelerator.device
    local = sum(b.num_tokens for b in micro_batches)
    n_global = torch.tensor([local], dtype=torch.long, device=device)
    if components.world_size > 1:
        n_global = accelerator.reduce(n_global, reduction="sum")
    n = max(int(n_global.item()), 1)  # the loss per answer token of the global batch (objective.per_token)
    lr = cfg.train.optimizer.lr * components.lr_fn(state.step)
    for g in components.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_multiplier", 1.0)  # train.optimizer.lr_multipliers of the group's part
    # a sample's position in the global batch
    first = rank_offset(cfg.train.global_batch_size, components.rank, components.world_size)
    if cfg.lora is not None and cfg.lora.dropout > 0:  # masks a pure function of (seed, step, rank): exact resume
        torch.manual_seed(seed_of("lora-dropout", cfg.seed, state.step, components.rank))
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    counts = torch.zeros(4, dtype=torch.float64, device=device)  # throughput only: see `token_counts`
    for i, mb in enumerate(micro_batches):
        seeds = noise_seeds(cfg.seed, state.step, first, mb.size) if components.raw.latent_mode == "sample" else None
        inputs = mb.to(device).with_inputs(noise_seeds=seeds)
        counts[:3] += token_counts(components.raw, inputs)
        counts[3] += 0 if inputs.pixel_values is None else len(inputs.pixel_values)  # images SigLIP encodes live
        first += mb.size
        # FSDP reduce-scatters after every micro-batch: skipping it would keep whole unsharded gradients around
        sync = i == len(micro_batches) - 1 or components.sharded
        with contextlib.nullcontext() if sync else accelerator.no_sync(components.model):
            out = components.model(inputs, num_items=n)
            # DDP and FSDP average gradients over processes; each process's share is loss_sum_r / n: undo the mean.
            with record_function(PROFILE_LABELS["backward"]):
                accelerator.backward(out.loss * components.world_size)
        loss_sum += out.loss_sum.detach().float()
    if components.world_size > 1:
        loss_sum = accelerator.reduce(loss_sum, reduction="sum")
        counts = accelerator.reduce(counts, reduction="sum")
    loss = objective.per_token(float(loss_sum), n)
    max_norm = cfg.train.optimizer.grad_clip if cfg.train.optimizer.grad_clip > 0 else float("inf")
    grad_norm = (
        sharding.clip_grad_norm_(components.params, max_norm)
        if components.sharded
        else float(accelerator.clip_grad_norm_(components.params, max_norm))
    )
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        with record_function(PROFILE_LABELS["optimizer"]):
            components.optimizer.step()
        if components.ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(
                    components.ema,
                    [p.detach().float() for p in components.params],
                    1.0 - ema_decay(cfg.train.optimizer.ema, cfg.train.optimizer.ema_warmup_steps, state.step),
                )
        state.nonfinite_in_a_row = 0
        state.first_loss = loss if state.first_loss is None else state.first_loss
        state.last_loss = loss
    else:
        state.nonfinite_steps += 1
        state.nonfinite_in_a_row += 1
    components.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.samples_seen += cfg.train.global_batch_size
    state.tokens_seen += int(n_global.item())
    if state.nonfinite_in_a_row >= cfg.train.max_nonfinite:
        raise NonFiniteError(
            f"{state.nonfinite_in_a_row} non-finite steps in a row (last at step {state.step}: "
            f"loss {loss}, grad norm {grad_norm}); lower train.optimizer.lr or check the data"
        )
    real, positions, world, images = (int(x) for x in counts.tolist())
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "skipped": not finite,
        "tokens": int(n_global.item()),
        "rows": cfg.train.global_batch_size,
        "real_tokens": real,  # the global batch's, world blocks included
        "positions": positions,  # real tokens and padding
        "world_tokens": world,
        "images": images,
    }


def token_counts(model, inputs) -> torch.Tensor:
    """(real tokens, all positions, world tokens) of a micro-batch's fused sequences, as a float64 tensor on its
    device: its text tokens by the attention mask, each sample's world block in full; all positions are the padded
    batch's, or the packed rows' (a sync to size them)."""
    world = 0
    if inputs.use_world:
        if inputs.latent_mean is not None:
            h, w = inputs.latent_mean.shape[-2:]
        else:
            h, w = (latent_side(n) for n in inputs.images.shape[-2:])
        world = model.projector.num_tokens(h, w)
    rows, length = inputs.input_ids.shape
    lengths = inputs.attention_mask.sum(1, dtype=torch.float64) + world
    real = lengths.sum()
    if inputs.pack_rows is None:
        slots = torch.tensor(rows * (length + world), dtype=torch.float64, device=real.device)
    else:  # packed (theworld/model/packing.py): the rows it fills, each as wide as the fullest
        packed = inputs.pack_rows.to(real.device)
        fills = torch.zeros(int(packed.max()) + 1, dtype=torch.float64, device=real.device).index_add_(
            0, packed, lengths
        )
        slots = len(fills) * fills.max()
    world_tokens = torch.tensor(rows * world, dtype=torch.float64, device=real.device)
    return torch.stack([real, slots, world_tokens])


def ema_decay(decay: float, warmup_steps: int, step: int) -> float:
    """The EMA decay applied after the update of step `step` (0-based): `decay`, ramped up linearly from 0 over the
    first `warmup_steps` steps so that the average is not anchored to the initial weights. A pure function of the step:
    resuming needs nothing saved."""
    return decay * min(1.0, step / warmup_steps) if warmup_steps else decay
