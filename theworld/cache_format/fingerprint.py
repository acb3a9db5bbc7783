"""The cache fingerprint: everything that changes the cached numbers, how two fingerprints differ, and the check that
refuses a cache built otherwise."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from theworld.cache_format.migrations import FORMAT_VERSION
from theworld.core.errors import CacheMismatch
from theworld.model.config import DEFAULT_MAX_WORLD_STEPS

if TYPE_CHECKING:
    from theworld.model.config import ImageConfig, ModelConfig


def rollout_keys() -> list[str]:
    """world.rollout's settings, every one of them (RolloutConfig's fields)."""
    from theworld.model.config import RolloutConfig

    return [f.name for f in dataclasses.fields(RolloutConfig)]


# Settings a fingerprint (and a run hash) records only away from their default, so that caches and runs made before
# the setting existed keep theirs: world.rollout.condition (fixed: the one prompt of earlier releases).
ROLLOUT_DEFAULTS = {"condition": "fixed"}


def rollout_settings(rollout) -> dict:
    """world.rollout's settings as a cache records them (ROLLOUT_DEFAULTS left out at their default)."""
    return {
        k: getattr(rollout, k)
        for k in rollout_keys()
        if k not in ROLLOUT_DEFAULTS or getattr(rollout, k) != ROLLOUT_DEFAULTS[k]
    }


def recorded(world: dict, key: str):
    """A rollout setting of a cache's fingerprint `world` section (ROLLOUT_DEFAULTS where it records none)."""
    return world.get(key, ROLLOUT_DEFAULTS.get(key))


def fingerprint_for(
    model: ModelConfig,
    image: ImageConfig,
    *,
    siglip: bool = False,
    vae=None,
    gemma=None,
    processor=None,
    world=None,
    rollout=None,
    seed: int | None = None,
) -> dict:
    """The fingerprint of a cache built with these `model` and `image` config sections (`siglip`: with SigLIP
    features): the one rule the precompute that writes a cache and every check against one use.

    Without loaded models it holds the config's own values (format_version, image resolution and resize, vae model
    and dtype, siglip model): what can be checked before anything heavy loads (`check_fingerprint(partial=True)`).
    With the loaded `vae` (an AutoencoderKLWan) it is the full fingerprint a cache records: plus what this code derives
    from the image settings (normalisation, the bucket set) and the VAE's config digest and weight hash; with
    `siglip`, also `gemma` (Gemma3ForConditionalGeneration) and its `processor` are needed, for the vision tower's
    config digest, weight hash and dtype and the image processor's settings (size, mean/std, resampling decide what
    the tower sees). Weights are hashed, so a changed checkpoint is caught even under the same name.

    `world` (a config section with num_world_steps and rollout): with N > 0 predicted frames, a `world` field with N
    and every rollout setting (absent for N = 0, as in caches written before rollouts); with the loaded `rollout`
    (theworld.model.rollout.Rollout) also its transformer's config digest and weight hash, the scheduler's config and
    the
    text encoder's config digest, weight hash and the prompts' token ids; `seed`: the precompute seed the rollout
    noise came from (recorded, so the live path can reproduce it; a training config has no such seed, so a check
    without it leaves it out).
    """
    fp = {
        "format_version": FORMAT_VERSION,
        "vae": {"model": model.vae, "dtype": model.dtype},
        "image": {"resolution": image.resolution, "resize": image.resize},
        "siglip": {"model": model.gemma} if siglip else None,
    }
    steps = world.num_world_steps if world is not None else 0
    if steps:
        fp["world"] = {"num_world_steps": steps, **rollout_settings(world.rollout)}
        if seed is not None:
            fp["world"]["seed"] = seed
        if rollout is not None:
            fp["world"].update(rollout.identity())
    if vae is None:
        return fp
    from theworld.model.encoders import config_digest, weights_hash

    fp["vae"].update(config=config_digest(dict(vae.config)), weights=weights_hash(vae))
    fp["image"]["normalisation"] = "[-1,1]"
    if (
        image.resize == "bucket"
    ):  # the set is a function of the resolution in this code; a cache records the one it used
        from theworld.model.images import buckets

        fp["image"]["buckets"] = [list(b) for b in buckets(image.resolution)]
    if siglip:
        if gemma is None or processor is None:
            raise ValueError("a SigLIP fingerprint needs the loaded Gemma and its processor")
        import torch  # the models are loaded by now; the training config reads this module's defaults without it

        inner = gemma.model
        vision = torch.nn.ModuleDict({"tower": inner.vision_tower, "projector": inner.multi_modal_projector})
        settings = {
            k: v
            for k, v in processor.image_processor.to_dict().items()
            if k not in ("image_processor_type", "processor_class")
        }
        fp["siglip"].update(
            config=config_digest(gemma.config.vision_config.to_dict()),
            weights=weights_hash(vision),
            dtype=str(gemma.dtype).removeprefix("torch."),
            image_processor=config_digest(settings),
        )
    return fp


def fingerprint_overrides(fp: dict) -> list[str]:
    """The `--set` overrides that give a precompute config whose `fingerprint_for` has `fp`'s config values (what
    rebuilds, or checks, the cache `fp` came from)."""
    out = [
        f"model.vae={fp['vae']['model']}",
        f"model.dtype={fp['vae']['dtype']}",
        f"image.resolution={fp['image']['resolution']}",
        f"image.resize={fp['image']['resize']}",
        f"cache.siglip={'true' if fp.get('siglip') else 'false'}",
    ]
    if fp.get("siglip"):
        out.append(f"model.gemma={fp['siglip']['model']}")
    world = fp.get("world") or {}
    if world:  # strings as JSON, which is YAML: a prompt with a colon stays one string
        out.append(f"world.num_world_steps={world['num_world_steps']}")
        out.append(f"world.max_world_steps={max(DEFAULT_MAX_WORLD_STEPS, world['num_world_steps'])}")
        out += [f"world.rollout.{k}={json.dumps(world[k])}" for k in rollout_keys() if k in world]
        if "seed" in world:
            out.append(f"seed={world['seed']}")
    return out


def fingerprint_diff(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two fingerprints (nested dicts compared leaf by leaf)."""
    out = []
    for k in sorted(set(expected) | set(actual)):
        a, b = expected.get(k), actual.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def check_fingerprint(
    cache_fp: dict, expected: dict, cache_dir: Path | str, fields: Iterable[str] | None = None, partial: bool = False
) -> None:
    """Raise CacheMismatch naming the first differing field (only top-level `fields` are compared when given).

    `partial`: `expected` is `fingerprint_for` without models, so only the fields it holds are compared."""
    if fields is not None:
        cache_fp = {k: cache_fp.get(k) for k in fields}
        expected = {k: expected.get(k) for k in fields}
    if partial:
        cache_fp = _cut_to(cache_fp, expected)
    diff = fingerprint_diff(expected, cache_fp)
    if diff:
        f = diff[0]

        def get(d, dotted):
            for part in dotted.split("."):
                d = d.get(part) if isinstance(d, dict) else None
            return d

        more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else ""
        raise CacheMismatch(
            f"cache {cache_dir} was built with a different {f}: cache has {get(cache_fp, f)!r}, "
            f"this config gives {get(expected, f)!r}{more}"
        )


def _cut_to(actual, like: dict) -> dict:
    """`actual` cut to the keys of `like`, nested dicts alike; what it lacks is None."""
    actual = actual if isinstance(actual, dict) else {}
    return {k: _cut_to(actual.get(k), v) if isinstance(v, dict) else actual.get(k) for k, v in like.items()}
