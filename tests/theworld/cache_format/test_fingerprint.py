"""theworld/cache_format/fingerprint.py: what a fingerprint covers; the config fingerprint is the full one cut to
the config's values."""

from __future__ import annotations

import pytest

from theworld import cache_format as cf


def test_siglip_fingerprint_covers_the_image_processor_settings():
    from theworld.model import encoders
    from theworld.model.config import ImageConfig, ModelConfig

    gemma, processor = encoders.load_gemma("tiny", "float32")
    vae = encoders.load_vae("tiny", "float32")

    def fp():
        return cf.fingerprint_for(
            ModelConfig(gemma="tiny", vae="tiny", dtype="float32"),
            ImageConfig(resolution=64, resize="crop"),
            siglip=True,
            vae=vae,
            gemma=gemma,
            processor=processor,
        )

    before = fp()
    assert before == fp()
    processor.image_processor.image_mean = [0.0, 0.0, 0.0]  # what the vision tower sees changes
    assert cf.fingerprint_diff(before, fp()) == ["siglip.image_processor"]


@pytest.mark.parametrize("resize,siglip", [("crop", False), ("bucket", True)])
def test_the_config_fingerprint_is_the_full_one_cut_to_the_config_values(resize, siglip, tmp_path):
    """fingerprint_for without models (checked before anything loads) agrees with the full one wherever it has a
    field, and fingerprint_overrides maps a cache's fingerprint back to a config giving the same values."""
    from precompute.config import PrecomputeConfig
    from theworld.core.config import load_config
    from theworld.core.errors import CacheMismatch
    from theworld.model import encoders
    from theworld.model.config import ImageConfig, ModelConfig

    model, image = ModelConfig(gemma="tiny", vae="tiny", dtype="float32"), ImageConfig(resolution=128, resize=resize)
    gemma, processor = encoders.load_gemma("tiny", "float32") if siglip else (None, None)
    full = cf.fingerprint_for(
        model, image, siglip=siglip, vae=encoders.load_vae("tiny", "float32"), gemma=gemma, processor=processor
    )
    cheap = cf.fingerprint_for(model, image, siglip=siglip)
    assert cheap == {
        "format_version": cf.FORMAT_VERSION,
        "vae": {"model": "tiny", "dtype": "float32"},
        "image": {"resolution": 128, "resize": resize},
        "siglip": {"model": "tiny"} if siglip else None,
    }
    cf.check_fingerprint(full, cheap, tmp_path, partial=True)
    with pytest.raises(CacheMismatch, match="different image.resolution: cache has 128, this config gives 64"):
        cf.check_fingerprint(
            full,
            cf.fingerprint_for(model, ImageConfig(resolution=64, resize=resize), siglip=siglip),
            tmp_path,
            partial=True,
        )
    with pytest.raises(CacheMismatch, match=r"different image\.(buckets|normalisation)"):  # the full check: every field
        cf.check_fingerprint(full, cheap, tmp_path)
    cfg = load_config(PrecomputeConfig, None, cf.fingerprint_overrides(full))
    assert cf.fingerprint_for(cfg.model, cfg.image, siglip=cfg.cache.siglip) == cheap
