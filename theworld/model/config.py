"""The model's config sections, shared by every command that builds TheWorld: the base models, the image, the world
pathway (with its world-steps keys, which precompute's `world:` section shares), the freeze flags and LoRA. The
engine that loads them is theworld/core/config.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from theworld.core.config import check_sizes
from theworld.core.errors import UserError
from theworld.model.arch import BUCKET_STEP, LORA_MODULES, VAE_FACTOR


@dataclass
class ModelConfig:
    gemma: str = "tiny"  # "tiny", a local folder, or a hub id such as google/gemma-3-4b-it
    vae: str = "tiny"  # "tiny", a local folder (the VAE or a pipeline with vae/), or a hub id (subfolder vae)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # frozen base models; the projector stays fp32


@dataclass
class ImageConfig:
    resolution: int = 64
    # crop: short side to `resolution`, then center crop; squash: whole picture to R x R; bucket: the aspect-ratio
    # bucket of ~R^2 pixels nearest the picture's shape (theworld.model.images.buckets), then center crop
    resize: Literal["crop", "squash", "bucket"] = "crop"
    MAX_RESOLUTION = 16384  # (a class constant, not a key) one R x R x 3 float image is then 3 GB

    def __post_init__(self) -> None:
        if self.resolution <= 0 or self.resolution % VAE_FACTOR:
            raise UserError(
                f"image.resolution: must be a positive multiple of {VAE_FACTOR} (the VAE downsamples "
                f"{VAE_FACTOR}x), got {self.resolution}"
            )
        if self.resolution > self.MAX_RESOLUTION:
            raise UserError(f"config key 'image.resolution': at most {self.MAX_RESOLUTION}, got {self.resolution}")
        if self.resize == "bucket" and self.resolution % BUCKET_STEP:
            raise UserError(
                f"image.resolution: must be a multiple of {BUCKET_STEP} with image.resize: bucket (bucket "
                f"sides are multiples of 8 x the largest world.pool 4), got {self.resolution}"
            )


DEFAULT_PROMPT = "Describe the image."  # for samples that carry no prompt of their own (precompute, describe)
ROLLOUT_PROMPT = "The scene continues naturally from this moment, filmed by a steady camera."


@dataclass
class RolloutConfig:
    """How Cosmos-Predict2's Video2World pipeline (diffusers' `Cosmos2VideoToWorldPipeline`) imagines the frames after
    an image; the defaults are the pipeline's own. `condition: fixed`: one prompt for the run; `question`: each
    sample's question (the text of its turns before the first answer), as the original code did. Never the caption:
    that would leak the answer into the world tokens."""

    inference_steps: int = 35
    guidance_scale: float = 7.0
    prompt: str = ROLLOUT_PROMPT
    negative_prompt: str | None = None  # None: the pipeline's DEFAULT_NEGATIVE_PROMPT
    fps: int = 16
    # fixed: `prompt` for every sample; question: each sample's own question (`prompt` unused), cached per sample
    condition: Literal["fixed", "question"] = "fixed"

    def __post_init__(self) -> None:
        check_sizes(self, "world.rollout")


MAX_WORLD_STEPS = 256  # (the limit of world.max_world_steps) each step is a latent frame the transformer denoises


def check_world_steps(num_world_steps: int, max_world_steps: int) -> None:
    """`world.num_world_steps` predicted frames fit the learned temporal table of `world.max_world_steps` rows."""
    if not 1 <= max_world_steps <= MAX_WORLD_STEPS:
        raise UserError(f"config key 'world.max_world_steps': must be in [1, {MAX_WORLD_STEPS}], got {max_world_steps}")
    if not 0 <= num_world_steps <= max_world_steps:
        raise UserError(
            f"config key 'world.num_world_steps': must be in [0, world.max_world_steps = {max_world_steps}] "
            f"(0: the observed frame only), got {num_world_steps}"
        )


DEFAULT_MAX_WORLD_STEPS = 16  # world.max_world_steps: the learned temporal table's rows after the observed frame


@dataclass
class WorldSteps:
    """The world-steps keys: how many frames the Video2World pipeline predicts after each image
    (theworld/model/rollout.py) and with which settings. Precompute's `world:` section is this; training's adds the
    world pathway's own keys (WorldConfig)."""

    num_world_steps: int = 0  # frames the world model predicts after each image (0: the observed frame only)
    max_world_steps: int = DEFAULT_MAX_WORLD_STEPS  # the temporal table: row 0 the observed frame, row k the k-th
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        check_world_steps(self.num_world_steps, self.max_world_steps)


@dataclass
class WorldConfig(WorldSteps):
    latent: Literal["mean", "sample"] = "mean"
    pool: Literal[1, 2, 4] = 1
    projector: Literal["mlp", "linear"] = "mlp"


@dataclass
class FreezeConfig:
    vision: bool = True  # SigLIP tower + multimodal projector
    language: bool = True  # language model + lm_head
    vae: bool = True


@dataclass
class LoraConfig:
    """LoRA adapters on a part's linear layers (through peft): the part's base weights stay frozen. Defaults follow
    common practice for Gemma 3 (docs/training.md, "LoRA")."""

    parts: list[str] = field(default_factory=lambda: ["language"])
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: list(LORA_MODULES["language"]))
    quantize: Literal["none", "4bit"] = "none"  # 4bit: QLoRA bases through bitsandbytes (CUDA only; refused here)

    def __post_init__(self) -> None:
        if not self.parts or len(set(self.parts)) != len(self.parts) or set(self.parts) - set(LORA_MODULES):
            raise UserError(
                f"config key 'lora.parts': one or more of {list(LORA_MODULES)}, each once, got {self.parts}"
            )
        if self.r <= 0:
            raise UserError(f"config key 'lora.r': must be positive, got {self.r}")
        check_sizes(self, "lora")
        if not self.alpha > 0:
            raise UserError(f"config key 'lora.alpha': must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"config key 'lora.dropout': must be in [0, 1), got {self.dropout}")
        known = sorted({m for part in self.parts for m in LORA_MODULES[part]})
        if not self.target_modules or set(self.target_modules) - set(known):
            raise UserError(
                f"config key 'lora.target_modules': names of linear layers of lora.parts {self.parts}, "
                f"among {known}; got {self.target_modules}"
            )
        if self.quantize == "4bit":
            import torch

            if not torch.cuda.is_available():
                raise UserError(
                    "config key 'lora.quantize': 4bit (QLoRA) needs a CUDA GPU (bitsandbytes' 4-bit "
                    "kernels); this machine has none: use quantize: none"
                )
            raise UserError(
                "config key 'lora.quantize': 4bit (QLoRA through bitsandbytes) is not supported yet; "
                "use quantize: none (bf16 base weights)"
            )


def trains(freeze: FreezeConfig, lora: LoraConfig | None, part: str) -> bool:
    """Whether any weight of `part` trains: unfrozen, or carrying LoRA adapters (its inputs must then be computed
    live, never read from a cache of its outputs)."""
    return not getattr(freeze, part) or (lora is not None and part in lora.parts)


def check_lora(freeze: FreezeConfig, lora: LoraConfig | None) -> None:
    """A LoRA part keeps its base weights frozen: fully training it too would be two answers to one question."""
    for part in lora.parts if lora else ():
        if not getattr(freeze, part):
            raise UserError(
                f"config key 'freeze.{part}': false trains the whole {part} model, and lora.parts lists "
                f"{part} (adapters on frozen base weights); choose one: freeze.{part}: true for LoRA, "
                f"or remove {part} from lora.parts for a full fine-tune"
            )
