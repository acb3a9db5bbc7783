"""Rollout-shaped caches made by hand, so the model side's shape and order tests need no rollout precompute: latents
that hold the observed frame and N predicted ones (`contents.world_steps: N`), each a deterministic function of it.
What rolls out live, or must equal a real rollout, uses the tiny Video2World pipeline
(tests/e2e/test_rollout_live.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from theworld import cache_format as cf

PREDICTED_LOGVAR = -30.0  # a predicted frame's logvar: zero variance (the shared interface of issue 36)


def predicted_frames(mean: torch.Tensor, steps: int) -> torch.Tensor:
    """(..., C, steps, h, w) frames "predicted" after the observed latent `mean` (..., C, 1, h, w): a deterministic
    function of it (each step shifts the picture and fades it), so a sample's rollout is the same wherever it is made,
    and different samples' rollouts differ."""
    return torch.cat([mean.roll(k, dims=-1) * (1 - 0.2 * k) for k in range(1, steps + 1)], dim=-3)


def rollout_cache(src: Path, dst: Path, steps: int) -> Path:
    """A copy of the (single-frame) cache `src` at `dst` whose latents (and flipped latents) hold the observed frame,
    exactly as in `src`, followed by `steps` predicted ones; its manifest says contents.world_steps: steps."""
    reader = cf.CacheReader(src)
    sidecars = []
    for shard in range(reader.manifest["num_shards"]):
        samples = []
        for index in reader.samples_in([shard]).tolist():
            members = dict(reader.raw(index))
            for name in (cf.LATENT, cf.LATENT_FLIP):
                if name in members:
                    t = cf.st_load(members[name])
                    mean = torch.cat([t["mean"], predicted_frames(t["mean"].float(), steps).to(t["mean"].dtype)], 1)
                    logvar = None
                    if "logvar" in t:
                        future = torch.full_like(mean[:, 1:], PREDICTED_LOGVAR, dtype=t["logvar"].dtype)
                        logvar = torch.cat([t["logvar"], future], 1)
                    members[name] = cf.latent_blob(mean, logvar, t["mean"].dtype)
            samples.append((reader.key(index), members))
        sidecars.append(cf.write_shard(dst, shard, samples))
    m = reader.manifest
    known = {"format_version", "num_samples", "num_errors", "latent_shape", "latent_shapes", "latent_dtype"}
    known |= {"contents", "shards", "fingerprint"}
    cf.write_manifest(
        dst,
        sidecars,
        fingerprint=m["fingerprint"],
        latent_shape=None,
        latent_dtype=m["latent_dtype"],
        num_errors=m["num_errors"],
        contents={**m["contents"], "world_steps": steps},
        extra={k: v for k, v in m.items() if k not in known},
    )
    assert json.loads((dst / cf.MANIFEST).read_text())["contents"]["world_steps"] == steps
    return dst


def random_latents(b: int, frames: int, side: int = 4, seed: int = 0) -> torch.Tensor:
    """Seeded world latents of `b` samples and `frames` frames (16 channels, side x side)."""
    return torch.randn(b, 16, frames, side, side, generator=torch.Generator().manual_seed(seed))
