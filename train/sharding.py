"""`train.sharding: fsdp`: PyTorch FSDP2 (`fully_shard`) applied the way torchtitan does it, and the few operations
that differ when parameters are DTensors (gradient clipping, gathering whole tensors for a save, scattering them back
on resume). See docs/training.md, "Sharding".

Each Gemma decoder layer, each SigLIP encoder layer and the VAE's encoder and decoder are one FSDP unit; the root unit
holds the rest (embeddings, tied lm_head, norms, the world projector). Under `train.mixed_precision: bf16` units compute
in bf16 from fp32 master weights and reduce gradients in fp32. With one process nothing is sharded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

FSDP_ENV = "ACCELERATE_USE_FSDP"  # what `accelerate launch --use_fsdp` and an accelerate config with FSDP export


@dataclass
class Plan:
    mode: str  # "ddp" or "fsdp": what the run does
    source: str  # what asked for it

    def describe(self, world_size: int, units: int = 0) -> str:
        if self.mode == "fsdp" and world_size > 1:
            return f"sharding fsdp (FSDP2 fully_shard, {units} units over {world_size} processes; from {self.source})"
        if self.mode == "fsdp":
            return f"sharding fsdp with 1 process: unsharded (from {self.source})"
        return "sharding ddp" + (" (replicated)" if world_size > 1 else " (1 process)")


def resolve(cfg) -> Plan:
    """fsdp when the config or the accelerate launch configuration asks for it. The accelerate variable is taken out
    of the environment: Accelerator must not also wrap the model (its own FSDP path is CUDA-only and applies its own
    wrapping policy); train.loop shards it here instead, the same way on every device."""
    from_launcher = os.environ.pop(FSDP_ENV, "false").lower() in ("true", "1")
    if cfg.train.sharding == "fsdp":
        return Plan("fsdp", "train.sharding")
    if from_launcher:
        return Plan("fsdp", f"the accelerate launch configuration ({FSDP_ENV})")
    return Plan("ddp", "train.sharding")


def units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units below the root: the VAE's encoder and decoder (the decoder never runs, so it is never gathered),
    the SigLIP encoder layers, the Gemma decoder layers."""
    inner = model.gemma.model
    vision = getattr(inner.vision_tower, "vision_model", inner.vision_tower)
    vae = model.world_encoder.vae if model.world_encoder is not None else None
    halves = [m for m in (getattr(vae, "encoder", None), getattr(vae, "decoder", None)) if isinstance(m, nn.Module)]
    return [*halves, *vision.encoder.layers, *inner.language_model.layers]


def mixed_precision_policy(mixed_precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "bf16":  # fp32 master weights and fp32 gradient reduction; bf16 compute
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: nn.Module, device: torch.device, world_size: int, mixed_precision: str) -> int:
    """fully_shard each unit, then the root, in place over all processes; returns the number of units."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    kwargs = {"mesh": mesh, "mp_policy": mixed_precision_policy(mixed_precision)}
    blocks = units(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return len(blocks) + 1


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def whole(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor on the CPU where `keep` (the main process), None elsewhere. For a sharded tensor this is a
    collective: every process calls it, in the same order."""
    if is_sharded(t):
        t = t.full_tensor()
    return t.detach().cpu().contiguous() if keep else None


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> float:
    """The global gradient norm before clipping, grads scaled in place (torchtitan's DTensor-aware clipping)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if is_sharded(total):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def missing_forwards(sharded: bool, mine: int, device: torch.device) -> int:
    """Under FSDP every forward is a collective, so a process with fewer eval batches than another (the held-out
    samples need not split evenly) runs this many extra, discarded, batches to keep the others company. A collective
    itself: call it on every process before the first eval forward."""
    if not sharded:
        return 0
    import torch.distributed as dist

    n = torch.tensor([mine], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item()) - mine
