"""Loading a trained stage for inference: `TheWorld.from_pretrained(path)`.

`path` is a `final/` or `checkpoint-N/` folder, or a run's output_dir (its `final/`). Such a folder holds the trained
tensors and the run's resolved `config.yaml`; the base models come from where that config names them (`tiny`, a
local folder or a hub id), through the same `from_pretrained` code training uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from theworld.config import FreezeConfig, ImageConfig, ModelConfig, WorldConfig, from_dict
from theworld.errors import UserError

WEIGHTS = "trainable.safetensors"
EMA = "ema.safetensors"
CONFIG = "config.yaml"
SECTIONS = ("model", "image", "world", "freeze")  # the parts of a run's config that define the model


@dataclass
class ModelSections:
    model: ModelConfig = field(default_factory=ModelConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)


def resolve(path: str | Path) -> Path:
    """The folder holding the weights and config: `path` itself, or `path/final` for a run's output_dir."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"model {p}: not a folder (expected a final/ or checkpoint-N/ folder, or a run's output_dir)")
    folder = p if (p / WEIGHTS).is_file() else p / "final"
    if not (folder / WEIGHTS).is_file():
        raise UserError(f"model {p}: no {WEIGHTS} there or in {p / 'final'} (expected a final/ or checkpoint-N/ "
                        "folder, or the output_dir of a finished run)")
    if not (folder / CONFIG).is_file():
        raise UserError(f"model {folder}: no {CONFIG} (a checkpoint written before checkpoints carried their config: "
                        f"use the run's final/ folder, or copy the run's config there as {CONFIG})")
    return folder


def read_config(folder: Path) -> ModelSections:
    path = folder / CONFIG
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level must be a mapping")
    try:
        return from_dict(ModelSections, {k: data[k] for k in SECTIONS if k in data})
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def load(path: str | Path, *, ema: bool = False, device: str | torch.device | None = None):
    """(TheWorld, processor) ready for inference: trained tensors loaded (or their EMA), eval mode, base models in
    the config's model.dtype, world latents from the posterior mean, on `device` (default: cuda when available)."""
    from theworld.model import TheWorld

    folder = resolve(path)
    cfg = read_config(folder)
    weights = folder / (EMA if ema else WEIGHTS)
    if ema and not weights.is_file():
        raise UserError(f"model {folder}: no {EMA} (the run had train.ema: 0)")
    model, processor = TheWorld.from_config(cfg.model, cfg.world, cfg.freeze, image=cfg.image)
    model.load_trainable(weights, strict=True)  # the run's freeze flags define the set it must hold exactly
    model.requires_grad_(False)
    model.latent_mode = "mean"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), processor
