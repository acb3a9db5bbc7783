"""Model, optimiser and schedule set-up: everything `Components` holds, built once per run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from theworld.errors import UserError
from theworld.launch import check_group, launched_processes, use_cpu
from theworld.model import TheWorld, compile_language_layers
from train import sharding

if TYPE_CHECKING:  # for annotations only: accelerate and the processor class load slowly
    from accelerate import Accelerator
    from transformers import Gemma3Processor

    from train.config import TrainConfig

# Parameter names that never get weight decay besides biases and norm weights (all 1-D tensors).
NO_DECAY_NAMES = ("projector.sow", "projector.eow")


def make_accelerator(cfg: TrainConfig, plan: sharding.Plan | None = None) -> Accelerator:
    """`plan`: what `sharding.resolve(cfg)` returned, when the caller checked it earlier."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    check_attention(cfg.train.attention)  # before the accelerator and the models: a refusal should cost nothing
    plan = plan or sharding.resolve(cfg)  # before Accelerator(), which would act on the launcher's FSDP request itself
    cfg.train.sharding = plan.mode
    backend = sharding.process_group_backend(plan, use_cpu(), launched_processes())
    accelerator = Accelerator(cpu=use_cpu(), mixed_precision=cfg.train.mixed_precision,
                              log_with=list(cfg.trackers) or None,
                              project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                                                  logging_dir=cfg.output_dir),
                              kwargs_handlers=[InitProcessGroupKwargs(backend=backend)] if backend else None)
    check_group(accelerator.num_processes)  # torchrun or a config file: N processes train as one group, never N runs
    accelerator.sharding_plan = plan  # build() reports where the choice came from
    return accelerator


def build_model(cfg: TrainConfig) -> tuple[TheWorld, Gemma3Processor]:
    """TheWorld in train mode, freeze flags applied, trainable weights in fp32, checkpointing as configured."""
    model, processor = TheWorld.from_config(cfg.model, cfg.world, cfg.freeze, seed=cfg.seed, lora=cfg.lora)
    return ready_for_training(model, cfg), processor


def ready_for_training(model: TheWorld, cfg: TrainConfig) -> TheWorld:
    """The train.* settings that act on the model itself, in place."""
    model.cast_trainable_to_fp32()
    model.gradient_checkpointing(cfg.train.gradient_checkpointing)
    set_language_attention(model.gemma, cfg.train.attention)
    if cfg.train.compile:
        compile_language_layers(model.gemma)
    return model.train()


def check_attention(attention: str) -> None:
    """Whether this machine can run the `train.attention` kernel."""
    if attention == "flex_attention" and not torch.cuda.is_available():
        raise UserError("config key 'train.attention': flex_attention needs a CUDA GPU (PyTorch's FlexAttention has "
                        "no CPU backward); use sdpa")


def set_language_attention(gemma: torch.nn.Module, attention: str) -> None:
    """The language model's attention kernel (the vision tower keeps its own: it runs on 256 patches, unmasked)."""
    check_attention(attention)
    gemma.set_attn_implementation({"text_config": attention})


# Which part (train.lr_multipliers key) a parameter belongs to, by name prefix.
PARTS = (("projector.", "projector"), ("gemma.model.vision_tower.", "vision"),
         ("gemma.model.multi_modal_projector.", "vision"), ("gemma.model.language_model.", "language"),
         ("gemma.lm_head.", "language"), ("world_encoder.", "vae"))


def part_of(name: str) -> str:
    for prefix, part in PARTS:
        if name.startswith(prefix):
            return part
    raise ValueError(f"parameter {name} belongs to no part of TheWorld")


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether weight decay applies: not to biases, norm weights (all 1-D) and the world markers."""
    return not (p.ndim < 2 or name in NO_DECAY_NAMES or "norm" in name.lower())


def param_groups(model: torch.nn.Module, weight_decay: float, multipliers=None) -> list[dict]:
    """One AdamW group per (part, decay / no decay), in the order of `PARTS`; each group carries its part's
    `lr_multiplier` (train.lr_multipliers), applied on top of the scheduled rate at every step."""
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((part_of(name), decays(name, p)), []).append(p)
    order = list(dict.fromkeys(part for _, part in PARTS))
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0, "part": part,
             "lr_multiplier": getattr(multipliers, part) if multipliers is not None else 1.0}
            for (part, decay), ps in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), not kv[0][1]))]


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.train.weight_decay, cfg.train.lr_multipliers), lr=cfg.train.lr,
                             betas=tuple(cfg.train.betas))


def lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    """The schedule as a pure function of the step (transformers' own warmup + cosine/linear/constant lambdas)."""
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.train.schedule]
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler(name, dummy, num_warmup_steps=cfg.train.warmup_steps,
                          num_training_steps=cfg.train.max_steps)
    return sched.lr_lambdas[0]


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
    sharded: bool = False  # FSDP2 (train.sharding, train.cpu_offload): parameters, gradients, optimizer state and EMA
    # are DTensors
    sharding: str = "sharding ddp"  # what the run prints about it

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes


def build(cfg: TrainConfig, accelerator: Accelerator, accum: int, init_from: Callable[[TheWorld], None] | None = None,
          check: Callable[[TheWorld, Gemma3Processor], None] | None = None,
          built: tuple[TheWorld, Gemma3Processor | None] | None = None) -> Components:
    """Model (+ init_from weights, then `check(model, processor)` on the whole weights), sharded or DDP-wrapped
    (train.sharding), optimiser over trainable parameters only, schedule, optional EMA. `built`: a model (and
    processor) made elsewhere, e.g. the real architecture with random weights for train.bench_stages."""
    model, processor = built or build_model(cfg)
    if init_from is not None:
        init_from(model)
    if check is not None:
        check(model, processor)
    plan = getattr(accelerator, "sharding_plan", None) or sharding.Plan(cfg.train.sharding, "train.sharding")
    sharded = plan.sharded(accelerator.num_processes)
    if sharded:  # the optimiser is built over the DTensor parameters fully_shard leaves; the model is not prepared
        n_units = sharding.shard(model, accelerator.device, accelerator.num_processes, cfg.train.mixed_precision,
                                 plan.offload)
        wrapped, optimizer = model, accelerator.prepare(build_optimizer(cfg, model))
    else:
        n_units = 0
        wrapped, optimizer = accelerator.prepare(model, build_optimizer(cfg, model))
    params = [p for p in model.parameters() if p.requires_grad]
    # after prepare, which moves the parameters to the device: the EMA lives next to them (sharded like them)
    ema = [p.detach().clone().float() for p in params] if cfg.train.ema > 0 else None
    return Components(cfg, accelerator, wrapped, model, processor, optimizer, lr_factor(cfg), params, accum, ema,
                      sharded, plan.describe(accelerator.num_processes, n_units))
