"""The layout of a trained stage's folders, read by training (train/checkpoint.py), loading
(`TheWorld.from_pretrained`) and inference: one place for the file names and for what each holds.

    <output_dir>/checkpoint-<step>/trainable.safetensors  trainable parameters, by their model names
    <output_dir>/checkpoint-<step>/state.json             step, epoch, samples seen, data cursor, the cache's samples,
                                                          config hash, parent, sha256 of every other file (checked
                                                          before resuming)
    <output_dir>/checkpoint-<step>/optimizer.pt           AdamW state dict (tensors and numbers: weights_only=True)
    <output_dir>/checkpoint-<step>/rng.safetensors        torch CPU RNG state of the main process
    <output_dir>/checkpoint-<step>/ema.safetensors        EMA of the trainable weights (when train.ema > 0)
    <output_dir>/checkpoint-<step>/config.yaml            the resolved config (defines the model: SECTIONS)
    <output_dir>/final/                                   trainable.safetensors (+ ema), config.yaml, README.md,
                                                          prompt.txt (the prompt the training samples carried)

A stage folder (final/ or checkpoint-N/) holds the trained tensors and the run's resolved config; the base models come
from where that config names them (`tiny`, a local folder or a hub id).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from theworld import hub
from theworld.config import (
    FreezeConfig,
    ImageConfig,
    LoraConfig,
    ModelConfig,
    WorldConfig,
    check_lora,
    from_dict,
)
from theworld.errors import UserError
from theworld.text import DEFAULT_PROMPT

WEIGHTS = "trainable.safetensors"
EMA = "ema.safetensors"
CONFIG = "config.yaml"
STATE = "state.json"
OPTIMIZER = "optimizer.pt"
RNG = "rng.safetensors"
CARD = "README.md"
PROMPT = "prompt.txt"  # final/: the prompt the run trained with, the default of describe and caption evaluation
FINAL = "final"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
SECTIONS = ("model", "image", "world", "freeze", "lora")  # the parts of a run's config that define the model


@dataclass
class ModelSections:
    model: ModelConfig = field(default_factory=ModelConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    lora: LoraConfig | None = None  # adapters on frozen parts (theworld/lora.py)

    def __post_init__(self) -> None:
        check_lora(self.freeze, self.lora)


def resolve(path: str | Path) -> Path:
    """The folder holding the weights and config: `path` itself, or `path/final` for a run's output_dir; a hub repo id
    (user/name[@revision]) is its snapshot folder (theworld/hub.py)."""
    p = hub.resolve(path)
    if not p.is_dir():
        raise UserError(f"model {p}: not a folder (expected a final/ or checkpoint-N/ folder, or a run's output_dir)")
    folder = p if (p / WEIGHTS).is_file() else p / FINAL
    if not (folder / WEIGHTS).is_file():
        raise UserError(f"model {p}: no {WEIGHTS} there or in {p / FINAL} (expected a final/ or checkpoint-N/ "
                        "folder, or the output_dir of a finished run)")
    if not (folder / CONFIG).is_file():
        raise UserError(f"model {folder}: no {CONFIG} (a checkpoint written before checkpoints carried their config: "
                        f"use the run's final/ folder, or copy the run's config there as {CONFIG})")
    return folder


def read_yaml(folder: Path) -> dict:
    """A stage folder's config.yaml as a mapping; text that is not UTF-8, not YAML, nested too deeply or not a
    mapping is one line naming the file."""
    path = folder / CONFIG
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except RecursionError:
        raise UserError(f"{path} is nested too deeply to be a config") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level must be a mapping")
    return data


def read_config(folder: Path) -> ModelSections:
    path = folder / CONFIG
    data = read_yaml(folder)
    try:
        sections = from_dict(ModelSections, {k: data[k] for k in SECTIONS if k in data})
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    inside = folder / sections.model.gemma  # an exported folder holds its own Gemma (theworld.export)
    if not Path(sections.model.gemma).is_absolute() and (inside / "config.json").is_file():
        sections.model.gemma = str(inside.resolve())
    return sections


def trained_prompt(folder: Path) -> str:
    """The prompt the stage was trained with (final/prompt.txt), or DEFAULT_PROMPT for a folder without one (a
    checkpoint-N/, or a run from before the file existed)."""
    path = folder / PROMPT
    text = path.read_text(encoding="utf-8").strip("\n") if path.is_file() else ""
    return text or DEFAULT_PROMPT
