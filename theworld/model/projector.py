"""The world projector: VAE posterior -> world tokens in Gemma's input-embedding space."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from theworld.model.arch import POOLS
from theworld.model.config import DEFAULT_MAX_WORLD_STEPS


class WorldProjector(nn.Module):
    """(mean, logvar) of shape (B, 16, F, h, w) -> [SOW, W1..WN, EOW] of shape (B, N + 2, H), N = F * (h/pool)*(w/pool).

    F = 1 + num_world_steps frames: the observed image's latent, then the world model's predicted ones (a rollout).
    Each frame is pooled and projected on its own; with rollouts, a learned temporal embedding (row k of a table of
    max_world_steps + 1 rows: row 0 the observed frame, row k the k-th predicted one) is added to each frame's tokens.
    The frames' tokens follow each other in time order (frame 0's row-major grid first) inside one SOW ... EOW. With
    num_world_steps 0 there is no table at all: the projector (and its checkpoints) are what they were before rollouts.

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
        num_world_steps: int = 0,
        max_world_steps: int = DEFAULT_MAX_WORLD_STEPS,
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
        self.frames = 1 + num_world_steps  # latent frames per sample the projector uses
        # created last, so the other weights start as a projector without rollouts starts (same seed, same values)
        self.temporal = (
            nn.Parameter(torch.randn(max_world_steps + 1, hidden_size) * embed_std) if num_world_steps else None
        )

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

    def num_tokens(self, h: int, w: int, frames: int | None = None) -> int:
        """The world block's length (markers included) for an h x w latent grid and `frames` frames (default: the
        projector's 1 + num_world_steps)."""
        return world_tokens(h, w, self.pool, frames or self.frames)

    def first_frames(
        self, mean: torch.Tensor, logvar: torch.Tensor | None, frames: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first `frames` latent frames of (B, C, T, h, w) latents (a cache with more world steps than the
        model uses gives its first ones); fewer than `frames` is an error."""
        if mean.dim() == 4:  # (B, C, h, w): one image without a time axis
            mean, logvar = mean[:, :, None], None if logvar is None else logvar[:, :, None]
        if mean.shape[2] < frames:
            raise ValueError(
                f"world latents hold {mean.shape[2]} frame(s) per sample; this projector uses {frames} (the observed "
                f"frame and world.num_world_steps = {self.frames - 1} predicted ones)"
            )
        if mean.shape[2] == frames:
            return mean, logvar
        return mean[:, :, :frames], None if logvar is None else logvar[:, :, :frames]

    def forward(
        self,
        mean: torch.Tensor,
        logvar: torch.Tensor | None = None,
        mode: str = "mean",
        noise_seeds: list[int] | None = None,
        frames: int | None = None,
    ) -> torch.Tensor:
        """`frames`: how many of the latents' frames to use, from the first (default 1 + num_world_steps; 1: the
        observed frame alone with temporal row 0, the no_rollout baseline)."""
        frames = self.frames if frames is None else frames
        if not 1 <= frames <= self.frames:
            raise ValueError(f"frames must be in [1, {self.frames}] for this projector, got {frames}")
        # sliced before any noise is drawn: a frame's noise does not depend on how many frames follow it in the cache
        mean, logvar = self.first_frames(mean, logvar, frames)
        z = self.latent(mean, logvar, mode, noise_seeds).float()
        b = z.shape[0]
        z = z.transpose(1, 2).flatten(0, 1)  # (B * F, C, h, w): each frame on its own, in time order per sample
        z = (z - self.latents_mean) / self.latents_std
        if self.pool > 1:
            z = F.avg_pool2d(z, self.pool)
        tokens = z.flatten(2).transpose(1, 2)  # (B * F, n, C), row-major over the latent grid
        dtype = self.net[0].weight.dtype
        world = self.net(tokens.to(dtype))
        if self.temporal is not None:
            world = world.unflatten(0, (b, frames)) + self.temporal[:frames, None].to(world.dtype)
        world = world.reshape(b, -1, world.shape[-1])  # (B, F * n, H): frame 0's tokens, then frame 1's, ...
        sow, eow = self.sow.expand(b, 1, -1), self.eow.expand(b, 1, -1)
        return torch.cat([sow, world, eow], dim=1) * self.embed_scale


def world_tokens(h: int, w: int, pool: int, frames: int) -> int:
    """The world block's length (its two markers included) for `frames` h x w latent frames pooled by `pool`."""
    return frames * (h // pool) * (w // pool) + 2
