"""What a run trains with, built once: the accelerator (over the launched processes), the model (freeze flags, fp32
trainable weights, checkpointing, attention kernel, compile), sharded or DDP-wrapped, the optimiser and schedule
(train/optim.py) and the EMA: everything `Components` holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from theworld.core.errors import UserError
from theworld.core.process_group import check_group, launched_processes, use_cpu
from theworld.model.world import TheWorld, compile_language_layers
from train import sharding
from train.config import accumulation_steps
from train.optim import build_optimizer, lr_factor

if TYPE_CHECKING:  # for annotations only: accelerate and the processor class load slowly
    from accelerate import Accelerator
    from transformers import Gemma3Processor

    from train.config import TrainConfig


@dataclass(frozen=True)
class Launch:
    """The config's launch-dependent values, resolved once by `resolve_launch` before anything heavy."""

    sharding: sharding.ShardingChoice
    processes: int  # what the launcher started; the accelerator's group is checked against it
    accum: int  # micro-batches per optimisation step on each process


def resolve_launch(cfg: TrainConfig) -> Launch:
    """The one place the config changes after loading: train.hardware.sharding from the config or the launcher's FSDP
    variables (taken out of the environment, before Accelerator() would act on them itself) and train.micro_batch_size
    for the launched processes (`auto` resolved), so that every later use (loaders, the checkpoints' config hash) sees
    them."""
    check_attention(
        cfg.train.hardware.attention
    )  # before the accelerator and the models: a refusal should cost nothing
    choice = sharding.resolve(cfg.train.hardware)
    cfg.train.hardware.sharding = choice.mode
    processes = launched_processes()
    return Launch(choice, processes, accumulation_steps(cfg, processes))


def make_accelerator(cfg: TrainConfig, launch: Launch | None = None) -> Accelerator:
    """`launch`: what `resolve_launch(cfg)` returned, when the caller resolved it earlier."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    launch = launch or resolve_launch(cfg)
    backend = sharding.process_group_backend(launch.sharding, use_cpu(), launch.processes)
    accelerator = Accelerator(
        cpu=use_cpu(),
        mixed_precision=cfg.train.hardware.mixed_precision,
        log_with=list(cfg.trackers) or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=cfg.output_dir),
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend)] if backend else None,
    )
    check_group(accelerator.num_processes)  # torchrun or a config file: N processes train as one group, never N runs
    accelerator.sharding_choice = launch.sharding  # build() reports where the choice came from
    return accelerator


def build_model(cfg: TrainConfig) -> tuple[TheWorld, Gemma3Processor]:
    """TheWorld in train mode, freeze flags applied, trainable weights in fp32, checkpointing as configured. The rollout
    pipeline loads only for what rolls out live: an unfrozen VAE's batches, or train.eval.benchmarks' images (with a
    frozen VAE every batch brings the cache's latents, and the Video2World transformer would only take memory)."""
    live = not cfg.freeze.vae or bool(cfg.train.eval.benchmarks)
    model, processor = TheWorld.from_config(
        cfg.model, cfg.world, cfg.freeze, seed=cfg.seed, lora=cfg.lora, rollout=live
    )
    return ready_for_training(model, cfg), processor


def ready_for_training(model: TheWorld, cfg: TrainConfig) -> TheWorld:
    """The train.* settings that act on the model itself, in place."""
    model.cast_trainable_to_fp32()
    ac = cfg.train.hardware.activation_checkpointing
    model.activation_checkpointing(ac.mode, ac.every_n, ac.parts)
    set_language_attention(model.gemma, cfg.train.hardware.attention)
    if cfg.train.hardware.compile:
        compile_language_layers(model.gemma)
    return model.train()


def check_attention(attention: str) -> None:
    """Whether this machine can run the `train.hardware.attention` kernel."""
    if attention == "flex_attention" and not torch.cuda.is_available():
        raise UserError(
            "config key 'train.hardware.attention': flex_attention needs a CUDA GPU (PyTorch's FlexAttention has "
            "no CPU backward); use sdpa"
        )


def set_language_attention(gemma: torch.nn.Module, attention: str) -> None:
    """The language model's attention kernel (the vision tower keeps its own: it runs on 256 patches, unmasked)."""
    check_attention(attention)
    gemma.set_attn_implementation({"text_config": attention})


@dataclass
class Components:
    cfg: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module  # as prepared by accelerate (DDP-wrapped under several processes)
    raw: TheWorld  # the unwrapped model
    processor: Gemma3Processor
    optimizer: torch.optim.Optimizer
    lr_fn: Callable[[int], float]
    params: list[torch.nn.Parameter]  # trainable, in a fixed order (DTensors when sharded)
    accum: int
    ema: list[torch.Tensor] | None = None
    # FSDP2 (train.hardware.sharding, train.hardware.cpu_offload): parameters, gradients, optimizer state and EMA are
    # DTensors
    sharded: bool = False
    sharding: str = "sharding ddp"  # what the run prints about it

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes


def build(
    cfg: TrainConfig, accelerator: Accelerator, accum: int, built: tuple[TheWorld, Gemma3Processor | None] | None = None
) -> Components:
    """Model sharded or DDP-wrapped (train.hardware.sharding), optimiser over trainable parameters only, schedule,
    optional EMA. `built`: a model (and processor) made by `build_model` and then given its init_from weights, or made
    elsewhere (e.g. the real architecture with random weights for tools.speed_stages)."""
    model, processor = built or build_model(cfg)
    choice = getattr(accelerator, "sharding_choice", None) or sharding.ShardingChoice(
        cfg.train.hardware.sharding, "train.hardware.sharding"
    )
    sharded = choice.sharded(accelerator.num_processes)
    if sharded:  # the optimiser is built over the DTensor parameters fully_shard leaves; the model is not prepared
        n_units = sharding.shard(
            model, accelerator.device, accelerator.num_processes, cfg.train.hardware.mixed_precision, choice.offload
        )
        wrapped, optimizer = model, accelerator.prepare(build_optimizer(cfg.train.optimizer, model))
    else:
        n_units = 0
        wrapped, optimizer = accelerator.prepare(model, build_optimizer(cfg.train.optimizer, model))
    params = [p for p in model.parameters() if p.requires_grad]
    # after prepare, which moves the parameters to the device: the EMA lives next to them (sharded like them)
    ema = [p.detach().clone().float() for p in params] if cfg.train.optimizer.ema > 0 else None
    return Components(
        cfg,
        accelerator,
        wrapped,
        model,
        processor,
        optimizer,
        lr_factor(cfg.train.lr_schedule, cfg.train.max_steps),
        params,
        accum,
        ema,
        sharded,
        choice.describe(accelerator.num_processes, n_units),
    )
