"""`train.hardware.sharding: fsdp`: PyTorch FSDP2 (`fully_shard`) applied the way torchtitan does it, and the few
operations that differ when parameters are DTensors (gradient clipping, gathering whole tensors for a save, scattering
them back on resume). See docs/training.md, "Sharding".

Each Gemma decoder layer, each SigLIP encoder layer and the VAE's encoder and decoder are one FSDP unit; the root unit
holds the rest (embeddings, tied lm_head, norms, the world projector). Under `train.hardware.mixed_precision: bf16`
units compute in bf16 from fp32 master weights and reduce gradients in fp32. With one process nothing is sharded, unless
`train.hardware.cpu_offload` asks for FSDP2's host offload: then the one process shards over a process group of one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from train.config import HardwareConfig

FSDP_ENV = "ACCELERATE_USE_FSDP"  # what `accelerate launch --use_fsdp` and an accelerate config with FSDP export
OFFLOAD_ENV = "FSDP_OFFLOAD_PARAMS"  # and `--fsdp_offload_params true` / `fsdp_offload_params: true`
WITH_HOST = "cuda:nccl,cpu:gloo"  # a GPU process group that also runs collectives on host tensors


@dataclass
class ShardingChoice:
    mode: str  # "ddp" or "fsdp": what the run does
    source: str  # what asked for it
    offload: bool = False  # FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state in host memory

    def sharded(self, world_size: int) -> bool:
        """Whether fully_shard is applied: over several processes, or over one for the offload."""
        return self.mode == "fsdp" and (world_size > 1 or self.offload)

    def describe(self, world_size: int, units: int = 0) -> str:
        off = "; parameters, gradients and optimizer state offloaded to host memory" if self.offload else ""
        if self.sharded(world_size):
            return (
                f"sharding fsdp (FSDP2 fully_shard, {units} units over {world_size} process(es){off}; "
                f"from {self.source})"
            )
        if self.mode == "fsdp":
            return f"sharding fsdp with 1 process: unsharded (from {self.source})"
        return "sharding ddp" + (" (replicated)" if world_size > 1 else " (1 process)")


def resolve(hardware: HardwareConfig) -> ShardingChoice:
    """fsdp when the config or the accelerate launch configuration asks for it, with host offload when either asks for
    that. The accelerate variables are taken out of the environment: Accelerator must not also wrap the model (its own
    FSDP path is CUDA-only and applies its own wrapping policy); train.loop shards it here instead, the same way on
    every device."""
    truthy = ("true", "1")
    from_launcher = os.environ.pop(FSDP_ENV, "false").lower() in truthy
    offload_launcher = os.environ.pop(OFFLOAD_ENV, "false").lower() in truthy
    if hardware.sharding == "fsdp":
        choice = ShardingChoice("fsdp", "train.hardware.sharding")
    elif from_launcher:
        choice = ShardingChoice("fsdp", f"the accelerate launch configuration ({FSDP_ENV})")
    else:
        choice = ShardingChoice("ddp", "train.hardware.sharding")
    choice.offload = hardware.cpu_offload or (offload_launcher and choice.mode == "fsdp")
    if hardware.cpu_offload and choice.mode != "fsdp":
        from theworld.core.errors import UserError

        raise UserError(
            "config key 'train.hardware.cpu_offload': host offload is part of FSDP; set train.hardware.sharding: fsdp "
            "(or launch with FSDP)"
        )
    return choice


def process_group_backend(choice: ShardingChoice, cpu: bool, processes: int) -> str | None:
    """The backend Accelerate should give the launcher's process group, when not its default. Offloaded shards are
    host tensors, and the collectives on them (a save's gather, the gradient norm) need gloo beside NCCL, as
    accelerate and torchtitan set up for CPU offload (accelerate would, from the launcher variables `resolve`
    removes). One process gets no group from Accelerate: `shard` makes its own."""
    return WITH_HOST if choice.offload and not cpu and processes > 1 else None


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


def shard(model: nn.Module, device: torch.device, world_size: int, mixed_precision: str, offload: bool = False) -> int:
    """fully_shard each unit, then the root, in place over all processes; returns the number of units. With offload
    the sharded parameters (and so their gradients and the optimizer state built over them) live in host memory,
    pinned when a GPU copies them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if world_size == 1:
        _group_of_one(WITH_HOST if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (world_size,))
    kwargs = {
        "mesh": mesh,
        "mp_policy": mixed_precision_policy(mixed_precision),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy(),
    }
    blocks = units(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # FSDP2 makes whichever unit runs forward first the root of the tree. An eval at step 0 runs the caption samples'
    # generation (the model's parts: a vision layer before the root's own forward), which would make that layer its
    # own root and the eval loss's root forward fail; settle the tree now, before anything runs.
    model._get_fsdp_state()._lazy_init()
    return len(blocks) + 1


def _group_of_one(backend: str) -> None:
    """A one-process group for FSDP when the launcher made none (a plain `python -m train.loop`, or accelerate with
    one process); train.loop destroys it at the end like accelerate's own."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@contextlib.contextmanager
def root_gathered(model: nn.Module) -> Iterator[None]:
    """FSDP2 gathers the root's own parameters (embeddings, lm_head, the VAE's convolutions outside its encoder, the
    projector) in the root's `forward`; code that calls the model's parts directly (generation at eval) gathers them
    for its block with this, and they are resharded after. No-op for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


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
