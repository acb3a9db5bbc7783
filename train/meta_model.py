"""TheWorld as train.loop builds it (freeze flags, LoRA, frozen weights in model.dtype, trainable ones in fp32), from
the base models' configs alone: on the meta device it holds shapes and no weights, which is what the memory plan
(tools.memory_plan) and `train.loop --plan` count. A hub id that is not in the local Hugging Face cache falls back to
its architecture in theworld/model/arch.py (Gemma 3 4B, the Wan 2.1 VAE); nothing is downloaded.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from theworld.core import location
from theworld.core.errors import UserError, one_line
from theworld.model.arch import KNOWN_GEMMA, KNOWN_VAE, REAL, gemma_config
from theworld.model.encoders import DTYPES, _quiet_hf, cannot_load, load_errors, resolve_gemma, resolve_vae
from theworld.model.world import TheWorld
from train.config import TrainConfig

# Hub ids whose whole architecture is known offline (theworld.model.arch): Gemma 3 4B.
BUILDABLE_GEMMA = {k: v.sizes for k, v in KNOWN_GEMMA.items() if v.sizes is not None}

MAX_LAYERS = 1024


def _on_disk(spec: str) -> bool:
    """`tiny` or a local folder: its config is read from disk, not looked up by hub id."""
    where = location.model(spec)
    return isinstance(where, location.Tiny) or (isinstance(where, location.Local) and where.path.is_dir())


def base_gemma_config(spec: str):
    """The Gemma 3 config of `model.gemma` spec `spec`, offline: tiny, a local folder, the HF cache or arch.py."""
    from transformers import AutoConfig, Gemma3Config

    if _on_disk(spec):
        try:
            config = AutoConfig.from_pretrained(resolve_gemma(spec))
        except load_errors() as e:
            raise cannot_load("model.gemma", spec, e) from None
        if not isinstance(config, Gemma3Config):
            raise UserError(f"model.gemma: {spec!r} holds a {type(config).__name__}, not a Gemma 3 config")
        for part in ("text_config", "vision_config"):  # the estimate builds every layer (on `meta`)
            layers = getattr(getattr(config, part), "num_hidden_layers", 0)
            if layers > MAX_LAYERS:
                raise UserError(
                    f"model.gemma: {spec!r} has {layers} layers in its {part}, more than any model this estimates "
                    f"({MAX_LAYERS})"
                )
        return config
    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError):
        if spec in BUILDABLE_GEMMA:
            return gemma_config(BUILDABLE_GEMMA[spec])
    raise UserError(
        f"model.gemma: no config for {spec!r} offline (known architectures: {', '.join(BUILDABLE_GEMMA)}); "
        "give a local folder"
    )


def base_vae_config(spec: str) -> dict:
    """The VAE config of `model.vae` spec `spec`, offline (the Wan 2.1 defaults for a known hub id not cached)."""
    from diffusers import AutoencoderKLWan

    warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*")  # huggingface_hub, on a cache miss
    if not _on_disk(spec) and spec in KNOWN_VAE:
        try:
            return AutoencoderKLWan.load_config(spec, subfolder="vae", local_files_only=True)
        except load_errors():
            return _wan_defaults()
    path, subfolder = resolve_vae(spec)
    try:
        config = AutoencoderKLWan.load_config(path, subfolder=subfolder, local_files_only=True)
    except load_errors() as e:
        if Path(path).is_dir():  # the user's folder: say what is wrong with it
            raise cannot_load("model.vae", spec, e) from None
        raise UserError(
            f"model.vae: no config for {spec!r} offline (known architectures: {', '.join(KNOWN_VAE)}); "
            "give a local folder"
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"model.vae: {spec!r} has a config.json holding a JSON {type(config).__name__}, not a config")
    return config


def _wan_defaults() -> dict:
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        return dict(AutoencoderKLWan(**REAL["vae"]).config)


def _build(key: str, spec: str, make):
    """A model from its config, or one line naming the config that cannot make one (a negative or mistyped size)."""
    try:
        return make()
    except (*load_errors(), RuntimeError) as e:
        raise UserError(f"{key}: cannot build {spec!r} from its config.json: {one_line(e, 300)}") from None


def build_world(cfg: TrainConfig, device: str = "meta") -> TheWorld:
    """TheWorld as train.loop builds it (freeze flags, frozen weights in model.dtype, trainable in fp32), from the
    base models' configs alone: on `meta` it holds shapes only; elsewhere random weights."""
    from diffusers import AutoencoderKLWan
    from transformers import Gemma3ForConditionalGeneration

    _quiet_hf()
    gemma_cfg, vae_cfg = base_gemma_config(cfg.model.gemma), base_vae_config(cfg.model.vae)
    dtype = DTYPES[cfg.model.dtype]
    with torch.device(device):
        gemma = _build("model.gemma", cfg.model.gemma, lambda: Gemma3ForConditionalGeneration(gemma_cfg).to(dtype))
        vae = _build("model.vae", cfg.model.vae, lambda: AutoencoderKLWan.from_config(vae_cfg).to(dtype))
        model = TheWorld.from_modules(gemma, vae, cfg.world, cfg.freeze, seed=cfg.seed, lora=cfg.lora)
    model.cast_trainable_to_fp32()
    return model
