"""Loading the base models (Gemma 3, the Cosmos/Wan VAE) and the world encoder that runs the VAE.

`tiny`, a local folder and a hub id all go through `from_pretrained`; only where the weights come from differs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from theworld import tiny
from theworld.errors import UserError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _quiet_hf() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()


def resolve_gemma(spec: str) -> str:
    return str(tiny.ensure(tiny.TINY_GEMMA_DIR)) if spec == "tiny" else spec


def resolve_vae(spec: str) -> tuple[str, str | None]:
    """(path or hub id, subfolder) for a VAE spec: tiny, a VAE folder, a pipeline folder with vae/, or a hub id."""
    if spec == "tiny":
        return str(tiny.ensure(tiny.TINY_VAE_DIR)), None
    p = Path(spec)
    if p.is_dir():
        if (p / "config.json").is_file():
            return spec, None
        if (p / "vae" / "config.json").is_file():
            return spec, "vae"
        raise UserError(f"model.vae: {spec} has neither config.json nor vae/config.json")
    return spec, "vae"  # a hub id: the pipeline repo (nvidia/Cosmos-Predict2-2B-Video2World) keeps the VAE in vae/


def load_gemma(spec: str, dtype: str = "bfloat16"):
    """(Gemma3ForConditionalGeneration, Gemma3Processor) from `tiny`, a local folder or a hub id."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    _quiet_hf()
    path = resolve_gemma(spec)
    try:
        model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=DTYPES[dtype])
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"model.gemma: cannot load {spec!r}: {str(e).splitlines()[0]}") from None
    return model.eval(), processor


def load_vae(spec: str, dtype: str = "bfloat16"):
    from diffusers import AutoencoderKLWan

    _quiet_hf()
    path, subfolder = resolve_vae(spec)
    try:
        vae = AutoencoderKLWan.from_pretrained(path, subfolder=subfolder, torch_dtype=DTYPES[dtype])
    except (OSError, ValueError, EnvironmentError) as e:
        raise UserError(f"model.vae: cannot load {spec!r}: {str(e).splitlines()[0]}") from None
    return vae.eval()


def weights_hash(module: nn.Module) -> str:
    """sha256 over parameter names, dtypes, shapes and bytes: two modules hash equal iff their weights are equal."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def config_digest(config: dict) -> str:
    drop = {"_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash", "torch_dtype", "dtype"}
    clean = {k: v for k, v in config.items() if k not in drop}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()[:16]


class WorldEncoder(nn.Module):
    """The Cosmos (Wan 2.1) VAE as an image -> posterior (mean, logvar) function, batched.

    Input: (B, 3, H, W) uint8 RGB (what the loaders produce) or float already in [-1, 1]. Output: mean and logvar,
    each (B, 16, 1, H/8, W/8) in the VAE's dtype. Runs under no_grad while the VAE is frozen.
    """

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        cfg = vae.config
        self.register_buffer("latents_mean", torch.tensor(cfg.latents_mean, dtype=torch.float32), persistent=False)
        self.register_buffer("latents_std", torch.tensor(cfg.latents_std, dtype=torch.float32), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    @property
    def frozen(self) -> bool:
        return not any(p.requires_grad for p in self.vae.parameters())

    @staticmethod
    def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [0, 255] -> float [-1, 1] (float input is assumed to be in [-1, 1] already)."""
        return pixels.float() / 127.5 - 1.0 if pixels.dtype == torch.uint8 else pixels

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.to_unit_range(pixels).to(self.dtype).unsqueeze(2)  # frame axis: one image is a 1-frame video
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            posterior = self.vae.encode(x).latent_dist
        return posterior.mean, posterior.logvar

