"""`python -m train.loop --config CFG --plan [--samples N] [--gpus G]`: what a run will do, before anything loads.

No weights are loaded and no cache is read but its manifest: the model is built on the meta device from the base
models' configs (train/meta_model.py), so the trainable count is exact; the steps follow the trainer's own rule
(train/data/order.py: whole global batches of the training samples, train.epochs or train.max_steps); tokens are
counted from the sequence layout (world tokens from resolution, pool and frames, image tokens from Gemma's config, a
typical sample's text from theworld/model/arch.py); the time is at a rate measured on a GPU where one exists for the
configuration (docs/performance.md), and said to be missing otherwise.
"""

from __future__ import annotations

import torch

from theworld.cache_format.layout import load_manifest
from theworld.cache_format.storage import is_url
from theworld.core.errors import UserError
from theworld.model.arch import ANSWER_TOKENS, TEXT_TOKENS, latent_side
from theworld.model.encoders import DTYPES
from train import params
from train.config import TrainConfig
from train.data.order import steps_per_epoch, total_steps
from train.meta_model import base_gemma_config, build_world

# Stage-1 samples/s per H100 (only the projector trains, cached latents and SigLIP features, compiled decoder layers,
# flex attention, no activation checkpointing), Gemma 3 4B at 512 px by world.pool: docs/performance.md, "Real size on
# a GPU", `python -m tools.speed_real`, commit 5171566; micro-batches of MEASURED_MICRO (pool 2) and 4 (pool 1).
MEASURED_STAGE1 = {2: 23.90, 1: 6.90}
MEASURED_MICRO = {2: 8, 1: 4}
LATENT_CHANNELS = 16  # the Wan 2.1 VAE's z_dim
MEASURED_GEMMA = ("google/gemma-3-4b-it", "google/gemma-3-4b-pt")
GPUS = 8  # one node


def count_samples(cfg: TrainConfig) -> int:
    """The samples of the run's caches, from their manifests (local folders only)."""
    total = 0
    for cache, _ in cfg.caches():
        if is_url(cache):
            raise UserError(f"train.loop --plan: cache {cache} is a URL, not read here: give --samples N")
        try:
            total += int(load_manifest(cache)["num_samples"])
        except UserError:
            raise UserError(
                f"train.loop --plan: no finished cache at {cache} to count samples in: give --samples N "
                "(the precompute config's --plan counts its source)"
            ) from None
    return total


def measured_rate(cfg: TrainConfig) -> float | None:
    """Samples/s per GPU measured for this configuration, or None where none was."""
    f = cfg.freeze
    stage1 = f.vision and f.language and f.vae and cfg.lora is None and not cfg.world.num_world_steps
    if stage1 and cfg.model.gemma in MEASURED_GEMMA and cfg.image.resolution == 512:
        return MEASURED_STAGE1.get(cfg.world.pool)
    return None


def plan(cfg: TrainConfig, samples: int | None = None, gpus: int = GPUS) -> dict:
    """The run's figures: samples, steps, epochs, tokens, saves, trainable parameters, time (None: no rate)."""
    if gpus < 1:
        raise UserError(f"train.loop --plan: --gpus must be >= 1, got {gpus}")
    if samples is None:
        samples = count_samples(cfg)
    if samples < 1:
        raise UserError(f"train.loop --plan: --samples must be >= 1, got {samples}")
    t = cfg.train
    # a mixture by weight holds train.eval.samples out of each cache; the parts of one dataset, out of all of them
    held_out = t.eval.samples * (1 if cfg.joined else len(cfg.caches()))
    if samples <= held_out:
        raise UserError(f"config key 'train.eval.samples': {held_out} leaves nothing to train on ({samples} samples)")
    train_n = samples - held_out
    per_epoch = steps_per_epoch(train_n, t.global_batch_size)
    steps = total_steps(t, per_epoch)
    frames = 1 + cfg.world.num_world_steps
    world = frames * (latent_side(cfg.image.resolution) // cfg.world.pool) ** 2 + 2  # + start/end markers
    gemma = base_gemma_config(cfg.model.gemma)
    image = gemma.mm_tokens_per_image
    side = latent_side(cfg.image.resolution)
    elem = torch.finfo(DTYPES[cfg.model.dtype]).bits // 8  # precompute's cache.dtype, the model's by default
    latent_bytes = 2 * LATENT_CHANNELS * frames * side * side * elem  # mean and logvar
    siglip_bytes = image * gemma.text_config.hidden_size * elem
    seq = 1 + world + image + TEXT_TOKENS
    model = build_world(cfg)
    named = dict(model.named_parameters())
    trainable = sum(p.numel() for p in named.values() if p.requires_grad)
    total = sum(p.numel() for p in named.values())
    rate = measured_rate(cfg)
    seen = steps * t.global_batch_size
    return {
        "samples": samples,
        "held_out": held_out,
        "train_samples": train_n,
        "global_batch_size": t.global_batch_size,
        "steps_per_epoch": per_epoch,
        "steps": steps,
        "epochs": seen / train_n,
        "samples_seen": seen,
        "warmup_steps": t.lr_schedule.warmup_steps,
        "decay": t.lr_schedule.decay,
        "lr": t.optimizer.lr,
        "saves": steps // t.checkpoint.every,
        "save_every": t.checkpoint.every,
        "cache_bytes_per_sample": {"latents": latent_bytes, "siglip": siglip_bytes},
        "micro_per_gpu": t.global_batch_size / gpus,
        "tokens_per_sample": {"world": world, "image": image, "text": TEXT_TOKENS, "all": seq},
        "tokens": seen * seq,
        "answer_tokens": seen * ANSWER_TOKENS,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_share": trainable / total,
        "parts": params.describe(model),
        "gpus": gpus,
        "samples_per_s_per_gpu": rate,
        "measured_micro": MEASURED_MICRO.get(cfg.world.pool),
        "hours": None if rate is None else seen / (rate * gpus) / 3600,
    }


def _n(x: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.{1 if unit != 'B' else 2}f}{unit}"
    return str(x)


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f} GB" if b >= 1e8 else f"{b / 1e3:,.0f} kB"


def render(p: dict) -> str:
    tps, cb, n = p["tokens_per_sample"], p["cache_bytes_per_sample"], p["samples"]
    time = (
        f"time: {p['hours']:.1f} h on {p['gpus']} H100 at {p['samples_per_s_per_gpu']} samples/s per GPU (measured, "
        "docs/performance.md; GPUs assumed to scale linearly)"
        + (
            f"; measured at {p['measured_micro']} samples per GPU per step, this run gives each GPU "
            f"{p['micro_per_gpu']:g}: expect it slower"
            if p["micro_per_gpu"] < p["measured_micro"]
            else ""
        )
        if p["hours"] is not None
        else "time: no rate measured for this configuration (docs/performance.md measures stage 1 of Gemma 3 4B at "
        "512 px)"
    )
    lines = [
        f"samples: {p['samples']:,} ({p['held_out']:,} held out for eval, {p['train_samples']:,} trained on)",
        f"optimizer steps: {p['steps']:,} ({p['steps_per_epoch']:,} per epoch of {p['global_batch_size']} samples, "
        f"{p['epochs']:.2f} epochs, {p['samples_seen']:,} samples seen)",
        f"schedule: lr {p['lr']:g}, {p['warmup_steps']} warmup steps then {p['decay']} decay; "
        f"a checkpoint every {p['save_every']} steps ({p['saves']:,} saves)",
        f"tokens: {_n(p['tokens'])} ({tps['all']:,} per sample: {tps['world']:,} world, {tps['image']} image, "
        f"~{tps['text']} text), {_n(p['answer_tokens'])} answer tokens (~{ANSWER_TOKENS} per sample)",
        f"trainable: {_n(p['trainable_params'])} trainable ({p['trainable_share']:.2%}) of {_n(p['total_params'])}",
        p["parts"],
        f"cache: {_gb(cb['latents'])} of latents per sample (mean and logvar), {_gb(cb['siglip'])} of SigLIP features "
        f"where cached: {_gb(cb['latents'] * n)} and {_gb(cb['siglip'] * n)} for the {n:,} samples, plus the images "
        "(precompute's --plan measures them)",
        time,
    ]
    return "\n".join(lines) + "\n"
