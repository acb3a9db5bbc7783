"""The cache fingerprint: everything that changes the cached numbers, how two fingerprints differ, and the check that
refuses a cache built otherwise."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from theworld.cache_format.layout import FORMAT_VERSION
from theworld.errors import CacheMismatch


def make_fingerprint(*, vae_model: str, vae, vae_dtype: str, resolution: int, resize: str,
                     gemma_model: str | None = None, gemma=None, image_processor=None) -> dict:
    """Everything that changes the cached numbers. `gemma` and its `image_processor` only when SigLIP features are
    cached.

    `vae` is the loaded AutoencoderKLWan, `gemma` the loaded Gemma3ForConditionalGeneration; their weights are hashed,
    so a changed checkpoint is caught even under the same name. The image processor's settings (size, mean/std,
    resampling) decide what the vision tower sees, so they count too.
    """
    from theworld.encoders import config_digest, weights_hash

    fp = {"format_version": FORMAT_VERSION,
          "vae": {"model": vae_model, "config": config_digest(dict(vae.config)), "weights": weights_hash(vae),
                  "dtype": vae_dtype},
          "image": {"resolution": resolution, "resize": resize, "normalisation": "[-1,1]"},
          "siglip": None}
    if resize == "bucket":  # the set is a function of the resolution in this code; a cache records the one it used
        from theworld.images import buckets

        fp["image"]["buckets"] = [list(b) for b in buckets(resolution)]
    if gemma is not None:
        inner = gemma.model
        vision = torch.nn.ModuleDict({"tower": inner.vision_tower, "projector": inner.multi_modal_projector})
        if image_processor is None:
            raise ValueError("a SigLIP fingerprint needs the image processor")
        fp["siglip"] = {"model": gemma_model, "config": config_digest(gemma.config.vision_config.to_dict()),
                        "weights": weights_hash(vision), "dtype": str(gemma.dtype).removeprefix("torch."),
                        "image_processor": config_digest({k: v for k, v in image_processor.to_dict().items()
                                                          if k not in ("image_processor_type", "processor_class")})}
    return fp


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


def check_fingerprint(cache_fp: dict, expected: dict, cache_dir: Path | str, fields: Iterable[str] | None = None) -> None:
    """Raise CacheMismatch naming the first differing field (only top-level `fields` are compared when given)."""
    if fields is not None:
        cache_fp = {k: cache_fp.get(k) for k in fields}
        expected = {k: expected.get(k) for k in fields}
    diff = fingerprint_diff(expected, cache_fp)
    if diff:
        f = diff[0]

        def get(d, dotted):
            for part in dotted.split("."):
                d = d.get(part) if isinstance(d, dict) else None
            return d

        more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else ""
        raise CacheMismatch(f"cache {cache_dir} was built with a different {f}: cache has {get(cache_fp, f)!r}, "
                            f"this config gives {get(expected, f)!r}{more}")
