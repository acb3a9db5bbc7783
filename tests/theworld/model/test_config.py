"""The model's config sections: each refuses a bad value in one line naming its key, and the freeze/LoRA rules."""

from __future__ import annotations

import pytest

from theworld.core.errors import UserError
from theworld.model import config as mc
from theworld.model.images import BUCKET_STEP


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"resolution": 12}, "positive multiple of 8"),
        ({"resolution": 0}, "positive multiple of 8"),
        ({"resolution": mc.ImageConfig.MAX_RESOLUTION + 8}, "at most 16384"),
        ({"resolution": BUCKET_STEP + 8, "resize": "bucket"}, f"multiple of {BUCKET_STEP} with image.resize: bucket"),
    ],
)
def test_an_image_size_the_vae_or_the_buckets_cannot_take_is_one_line(kw, words):
    with pytest.raises(UserError, match="image.resolution") as e:
        mc.ImageConfig(**kw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_image_sizes_that_fit_are_kept():
    assert mc.ImageConfig(BUCKET_STEP + 8).resolution == BUCKET_STEP + 8  # crop takes any multiple of 8
    assert mc.ImageConfig(2 * BUCKET_STEP, "bucket").resize == "bucket"


def test_world_steps_fit_the_temporal_table():
    assert mc.WorldSteps().max_world_steps == mc.DEFAULT_MAX_WORLD_STEPS
    assert mc.WorldConfig(num_world_steps=4, max_world_steps=4).num_world_steps == 4
    with pytest.raises(UserError, match=r"'world.num_world_steps': must be in \[0, world.max_world_steps = 4\]"):
        mc.WorldSteps(num_world_steps=5, max_world_steps=4)
    for bad in (0, mc.MAX_WORLD_STEPS + 1):
        with pytest.raises(UserError, match=rf"'world.max_world_steps': must be in \[1, 256\], got {bad}"):
            mc.check_world_steps(0, bad)
    with pytest.raises(UserError, match="'world.rollout.inference_steps'"):
        mc.RolloutConfig(inference_steps=10**6)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"parts": []}, "lora.parts"),
        ({"parts": ["language", "language"]}, "lora.parts"),
        ({"parts": ["vae"]}, "lora.parts"),
        ({"r": 0}, "lora.r"),
        ({"r": 10**6}, "lora.r"),
        ({"alpha": 0.0}, "lora.alpha"),
        ({"dropout": 1.0}, "lora.dropout"),
        ({"target_modules": ["fc1"]}, "lora.target_modules"),  # a vision layer, and only language is adapted
        ({"target_modules": []}, "lora.target_modules"),
        ({"quantize": "4bit"}, "lora.quantize"),
    ],
)
def test_a_bad_lora_value_is_one_line_naming_its_key(kw, key):
    with pytest.raises(UserError, match=f"config key '{key}'") as e:
        mc.LoraConfig(**kw)
    assert "\n" not in str(e.value)


def test_lora_targets_are_the_union_of_its_parts_layers():
    lora = mc.LoraConfig(parts=["language", "vision"], target_modules=["fc1", "q_proj"])
    assert lora.target_modules == ["fc1", "q_proj"]


def test_a_part_trains_when_unfrozen_or_adapted_and_never_both():
    frozen, lora = mc.FreezeConfig(), mc.LoraConfig()
    assert not mc.trains(frozen, None, "language") and mc.trains(frozen, lora, "language")
    assert mc.trains(mc.FreezeConfig(vision=False), None, "vision") and not mc.trains(frozen, lora, "vision")
    mc.check_lora(frozen, lora)
    mc.check_lora(mc.FreezeConfig(language=False), None)
    with pytest.raises(UserError, match="config key 'freeze.language': false trains the whole language model"):
        mc.check_lora(mc.FreezeConfig(language=False), lora)
