"""The world projector: VAE posterior -> world tokens in Gemma's input-embedding space."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from theworld.arch import POOLS


class WorldProjector(nn.Module):
    """(mean, logvar) of shape (B, 16, 1, h, w) -> [SOW, W1..WN, EOW] of shape (B, N + 2, H), N = (h/pool)*(w/pool).

    Gemma multiplies its token embeddings by sqrt(H); world tokens and markers get the same factor on top of weights
    initialised at the embedding table's std, so at step 0 they sit at the scale of the text they are mixed with.
    """

    def __init__(
        self,
        hidden_size: int,
        latents_mean: torch.Tensor,
        latents_std: torch.Tensor,
        *,
        latent_channels: int = 16,
        pool: int = 1,
        arch: str = "mlp",
        embed_std: float = 0.02,
    ):
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool}")
        self.pool, self.arch = pool, arch
        self.embed_scale = math.sqrt(hidden_size)
        self.register_buffer("latents_mean", latents_mean.float().reshape(1, -1, 1, 1), persistent=False)
        self.register_buffer("latents_std", latents_std.float().reshape(1, -1, 1, 1), persistent=False)
        if arch == "mlp":
            self.net = nn.Sequential(
                nn.Linear(latent_channels, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size)
            )
        elif arch == "linear":
            self.net = nn.Sequential(nn.Linear(latent_channels, hidden_size))
        else:
            raise ValueError(f"arch must be 'mlp' or 'linear', got {arch!r}")
        self.sow = nn.Parameter(torch.randn(hidden_size) * embed_std)
        self.eow = nn.Parameter(torch.randn(hidden_size) * embed_std)
        last = self.net[-1]
        # Normalised latent channels have unit variance, so a fan-in scaled init gives outputs of std ~embed_std.
        nn.init.normal_(last.weight, std=embed_std / math.sqrt(last.in_features) * (2.0 if arch == "mlp" else 1.0))
        nn.init.zeros_(last.bias)

    def latent(
        self, mean: torch.Tensor, logvar: torch.Tensor, mode: str = "mean", noise_seeds: list[int] | None = None
    ) -> torch.Tensor:
        """z = mean, or mean + exp(logvar / 2) * eps with each sample's eps drawn from a generator seeded with its
        entry of `noise_seeds`: a sample's noise does not depend on which other samples share its batch."""
        if mode == "mean":
            return mean
        if mode != "sample":
            raise ValueError(f"latent mode must be 'mean' or 'sample', got {mode!r}")
        if noise_seeds is None or len(noise_seeds) != len(mean):
            raise ValueError("latent mode 'sample' needs one noise seed per sample")
        eps = torch.stack(
            [
                torch.randn(
                    mean.shape[1:],
                    generator=torch.Generator(mean.device).manual_seed(s),
                    device=mean.device,
                    dtype=torch.float32,
                )
                for s in noise_seeds
            ]
        )
        return mean.float() + torch.exp(0.5 * logvar.float()) * eps

    def num_tokens(self, h: int, w: int) -> int:
        return (h // self.pool) * (w // self.pool) + 2

    def forward(
        self,
        mean: torch.Tensor,
        logvar: torch.Tensor | None = None,
        mode: str = "mean",
        noise_seeds: list[int] | None = None,
    ) -> torch.Tensor:
        z = self.latent(mean, logvar, mode, noise_seeds).float()
        if z.dim() == 5:  # (B, C, T=1, h, w): one image is a one-frame video
            z = z[:, :, 0]
        z = (z - self.latents_mean) / self.latents_std
        if self.pool > 1:
            z = F.avg_pool2d(z, self.pool)
        tokens = z.flatten(2).transpose(1, 2)  # (B, N, C), row-major over the latent grid
        dtype = self.net[0].weight.dtype
        world = self.net(tokens.to(dtype))
        b = world.shape[0]
        sow, eow = self.sow.expand(b, 1, -1), self.eow.expand(b, 1, -1)
        return torch.cat([sow, world, eow], dim=1) * self.embed_scale
