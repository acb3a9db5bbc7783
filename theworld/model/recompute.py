"""Activation checkpointing of TheWorld's layer stacks (train.hardware.activation_checkpointing): Gemma's decoder
layers, SigLIP's encoder layers and the Wan VAE encoder's blocks recompute their activations in the backward.

- `full`: a wrapped layer keeps only its input (torch.utils.checkpoint, non-reentrant).
- `selective`: torchtitan's op-level selective checkpointing: a wrapped layer also keeps the outputs of the ops in
  SAVE_OPS (matmuls, attention kernels, convolutions, FSDP's reduce-scatter), the costly ones to recompute, and
  recomputes the cheap rest (norms, activations, rotary embeddings, residual adds), through
  torch.utils.checkpoint.create_selective_checkpoint_contexts.
- `every_n`: layers 0, N, 2N, ... of each stack are wrapped, the rest keep everything.

The math is unchanged (the same ops run on the same values; dropout replays its RNG state), so the gradients equal
those without checkpointing and the setting is resume-neutral.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

from theworld.model.arch import CHECKPOINT_PARTS

MODES = ("none", "full", "selective")


def _save_ops() -> list:
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    ops = [getattr(aten, n).default for n in names if hasattr(aten, n)]
    if hasattr(torch.ops, "_c10d_functional"):  # FSDP2's gradient reduce-scatter, never worth running twice
        ops.append(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return ops


SAVE_OPS = _save_ops()


def checkpoint_fn(mode: str) -> Callable:
    """The function a wrapped layer runs its forward through: `fn(forward, *args)`."""
    if mode == "selective":
        context = functools.partial(create_selective_checkpoint_contexts, SAVE_OPS)
        return functools.partial(checkpoint, use_reentrant=False, context_fn=context)
    return functools.partial(checkpoint, use_reentrant=False)


def stacks(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The layers of each part of TheWorld that checkpointing wraps, in forward order."""
    gemma = model.gemma.model
    vision = getattr(gemma.vision_tower, "vision_model", gemma.vision_tower)
    out = {"language": list(gemma.language_model.layers), "vision": list(vision.encoder.layers)}
    if model.world_encoder is not None:
        encoder = model.world_encoder.vae.encoder
        out["vae"] = [*encoder.down_blocks, encoder.mid_block]
    return out


def apply(model: nn.Module, mode: str, every_n: int = 1, parts: Iterable[str] = CHECKPOINT_PARTS) -> dict[str, int]:
    """Wrap the layers of `parts` (`mode` none unwraps every layer); returns how many layers of each part are
    wrapped."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: one of {MODES}")
    parts = set(parts) if mode != "none" else set()
    fn = checkpoint_fn(mode)
    wrapped = {}
    for part, layers in stacks(model).items():
        on = [part in parts and i % every_n == 0 for i in range(len(layers))]
        for layer, flag in zip(layers, on):
            _set(layer, fn if flag else None)
        wrapped[part] = sum(on)
    return wrapped


def _set(layer: nn.Module, fn: Callable | None) -> None:
    if isinstance(layer, GradientCheckpointingLayer):
        # a transformers GradientCheckpointingLayer: its own wrapper checkpoints `forward` (module hooks, FSDP2's
        # among them, stay outside) in training mode with gradients on, and drops a KV cache it would write twice
        layer.gradient_checkpointing = fn is not None
        layer._gradient_checkpointing_func = fn or checkpoint
        return
    layer.__dict__.pop("forward", None)  # back to the class's forward
    if fn is not None:
        layer._checkpoint_fn = fn
        # bound to the layer (not a closure over it): a deepcopy of the model gets a forward bound to the copy
        layer.forward = types.MethodType(_checkpointed_forward, layer)


def _checkpointed_forward(self: nn.Module, x, *args, **kwargs):
    """The class's forward run through `self._checkpoint_fn` when training with gradients on; a call with a temporal
    feature cache (a multi-frame VAE encode, which mutates the cache) runs as it is, since the recomputation would
    update it twice."""
    forward = type(self).forward  # also under FSDP2, whose per-module subclass inherits it
    if kwargs.get("feat_cache") is not None or not (self.training and torch.is_grad_enabled()):
        return forward(self, x, *args, **kwargs)
    return self._checkpoint_fn(functools.partial(forward, self, **kwargs), x, *args)
