"""Model, optimiser and schedule set-up: everything `Components` holds, built once per run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from theworld.errors import UserError
from theworld.launch import check_group, use_cpu
from theworld.model import TheWorld, compile_language_layers

# Parameter names that never get weight decay besides biases and norm weights (all 1-D tensors).
NO_DECAY_NAMES = ("projector.sow", "projector.eow")


def make_accelerator(cfg):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    check_attention(cfg.train.attention)  # before the accelerator and the models: a refusal should cost nothing
    acc = Accelerator(cpu=use_cpu(), mixed_precision=cfg.train.mixed_precision, log_with=list(cfg.trackers) or None,
                      project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=cfg.output_dir))
    check_group(acc.num_processes)  # torchrun or a config file: N processes train as one group, never N runs
    return acc


def build_model(cfg) -> tuple[TheWorld, object]:
    """TheWorld in train mode, freeze flags applied, trainable weights in fp32, checkpointing as configured."""
    model, processor = TheWorld.from_config(cfg.model, cfg.world, cfg.freeze, seed=cfg.seed)
    model.cast_trainable_to_fp32()
    model.gradient_checkpointing(cfg.train.gradient_checkpointing)
    set_language_attention(model.gemma, cfg.train.attention)
    if cfg.train.compile:
        compile_language_layers(model.gemma)
    model.train()
    return model, processor


def check_attention(attention: str) -> None:
    """Whether this machine can run the `train.attention` kernel."""
    if attention == "flex_attention" and not torch.cuda.is_available():
        raise UserError("config key 'train.attention': flex_attention needs a CUDA GPU (PyTorch's FlexAttention has "
                        "no CPU backward); use sdpa")


def set_language_attention(gemma: torch.nn.Module, attention: str) -> None:
    """The language model's attention kernel (the vision tower keeps its own: it runs on 256 patches, unmasked)."""
    check_attention(attention)
    gemma.set_attn_implementation({"text_config": attention})


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name in NO_DECAY_NAMES or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr,
                             betas=tuple(cfg.train.betas))


def lr_factor(cfg) -> Callable[[int], float]:
    """The schedule as a pure function of the step (transformers' own warmup + cosine/linear/constant lambdas)."""
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.train.schedule]
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler(name, dummy, num_warmup_steps=cfg.train.warmup_steps,
                          num_training_steps=cfg.train.max_steps)
    return sched.lr_lambdas[0]


@dataclass
class Components:
    cfg: object
    accelerator: object
    model: torch.nn.Module  # as prepared by accelerate (DDP-wrapped under several processes)
    raw: TheWorld  # the unwrapped model
    processor: object
    optimizer: torch.optim.Optimizer
    lr_fn: Callable[[int], float]
    params: list[torch.nn.Parameter]  # trainable, in a fixed order
    accum: int
    ema: list[torch.Tensor] | None = None

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes


def build(cfg, accelerator, accum: int, init_from: Callable[[TheWorld], None] | None = None) -> Components:
    """Model (+ init_from weights), optimiser over trainable parameters only, schedule, optional EMA, prepared."""
    model, processor = build_model(cfg)
    if init_from is not None:
        init_from(model)
    optimizer = build_optimizer(cfg, model)
    params = [p for p in model.parameters() if p.requires_grad]
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    # after prepare, which moves the parameters to the device: the EMA lives next to them
    ema = [p.detach().clone().float() for p in params] if cfg.train.ema > 0 else None
    return Components(cfg, accelerator, wrapped, model, processor, optimizer, lr_factor(cfg), params, accum, ema)
