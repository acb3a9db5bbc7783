"""configs/recipes/: the plan's runs as written load and plan (train.loop --plan; no weights, no data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precompute.config import PrecomputeConfig
from tests._precompute_helpers import gradient, jpeg_bytes
from tests._source_helpers import chat_item
from theworld.core.config import load_config
from train import plan
from train.config import TrainConfig

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"
# recipe: (samples the plan states, optimizer steps, lr, warmup, save every)
TRAIN = {
    "datacomp_small_stage1": (100_000, 18_750, 1e-4, 500, 50),
    "llava_cc3m_stage1": (595_375, 37_082, 1e-4, 500, 50),
    "llava_instruct_stage3": (157_712, 9_729, 1e-5, 300, 50),
    "llava_instruct_stage4": (157_712, 9_729, 5e-6, 200, 50),
}


def test_every_recipe_is_tested():
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert names == set(TRAIN) | {"datacomp_small_precompute", "llava_cc3m_precompute", "llava_instruct_precompute"}


@pytest.mark.parametrize("name", sorted(TRAIN))
def test_train_recipe_plans_the_plans_run(name):
    """Each stage at the plan's effective batch of 16, warmup then linear decay, a save every 50 steps; the
    DataComp-Small stage plans 100,000 / 16 x 3 = 18,750 optimizer steps."""
    samples, steps, lr, warmup, every = TRAIN[name]
    cfg = load_config(TrainConfig, RECIPES / f"{name}.yaml")
    p = plan.plan(cfg, samples, gpus=8)
    assert (p["steps"], p["global_batch_size"], p["lr"], p["warmup_steps"], p["decay"]) == (
        steps,
        16,
        lr,
        warmup,
        "linear",
    )
    assert p["save_every"] == every and p["saves"] == steps // every
    assert p["tokens_per_sample"]["world"] == 32 * 32 + 2 and p["tokens_per_sample"]["image"] == 256


def test_datacomp_stage1_trains_only_the_projector_as_counted():
    p = plan.plan(load_config(TrainConfig, RECIPES / "datacomp_small_stage1.yaml"), 100_000)
    assert (p["held_out"], p["epochs"], p["samples_seen"]) == (0, 3.0, 300_000)
    assert p["trainable_params"] == 6_604_800  # Linear(16, 2560), GELU, Linear(2560, 2560) and the two markers
    assert p["hours"] == pytest.approx(300_000 / (23.90 * 8) / 3600)


@pytest.mark.parametrize("name", ["llava_cc3m_precompute", "llava_instruct_precompute"])
def test_llava_precompute_recipes_load_the_released_layout(name, tmp_path):
    root = tmp_path / "release"
    (root / "images").mkdir(parents=True)
    (root / "images" / "GCC_train_000000000.jpg").write_bytes(jpeg_bytes(gradient(30, 24)))
    (root / "chat.json").write_text(json.dumps([chat_item(0)]))
    overrides = [f"source.path={root}/chat.json", f"source.image_root={root}/images", f"output_dir={tmp_path}/c"]
    cfg = load_config(PrecomputeConfig, RECIPES / f"{name}.yaml", overrides)
    assert (cfg.source.type, cfg.image.resolution, cfg.model.gemma) == ("llava", 512, "google/gemma-3-4b-it")


def test_datacomp_precompute_recipe_reads_the_metadata_through_urls():
    cfg = load_config(PrecomputeConfig, RECIPES / "datacomp_small_precompute.yaml")
    assert (cfg.source.type, cfg.source.num_samples) == ("urls", 100_000)
