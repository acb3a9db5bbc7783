"""A fake Wan VAE for fast unit tests: deterministic, the same interface as diffusers.AutoencoderKLWan.

encode: (B, 3, 1, H, W) in [-1, 1] -> latent_dist with mean/logvar (B, 16, 1, H/8, W/8), a fixed linear map of 8x8
average-pooled pixels (so it depends on the picture and is exactly reproducible); decode maps back. Its one weight
is an nn.Parameter, so unfreezing it trains something.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import FrozenDict
from torch import nn


class FakeWanVAE(nn.Module):
    def __init__(self, z_dim: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.mix = nn.Parameter(torch.randn(z_dim, 3, generator=g))
        self.config = FrozenDict(
            z_dim=z_dim, latents_mean=[0.1] * z_dim, latents_std=[0.5] * z_dim, scale_factor_spatial=8, fake=True
        )

    def encode(self, x: torch.Tensor):
        pooled = F.avg_pool3d(x, (1, 8, 8))  # (B, 3, 1, h, w)
        mean = torch.einsum("zc,bcthw->bzthw", self.mix.to(x.dtype), pooled)
        logvar = torch.full_like(mean, -4.0) + 0.1 * mean
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean, logvar=logvar))

    def decode(self, z: torch.Tensor):
        pix = torch.einsum("zc,bzthw->bcthw", torch.linalg.pinv(self.mix).T.to(z.dtype), z)
        return SimpleNamespace(sample=F.interpolate(pix[:, :, 0], scale_factor=8).unsqueeze(2).clamp(-1, 1))
