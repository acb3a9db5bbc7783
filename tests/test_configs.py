"""Every shipped config loads as it is, and the run hash that checkpoints record covers what it should."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from precompute.config import PrecomputeConfig
from theworld.config import load_config
from train.config import RESUME_NEUTRAL, TrainConfig, neutral, neutral_keys, run_hash

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TRAIN_CONFIGS = sorted(CONFIGS.glob("stage[0-9].yaml")) + sorted((CONFIGS / "real").glob("stage[0-9].yaml"))
LORA_CONFIGS = [CONFIGS / "stage3_lora.yaml", CONFIGS / "real" / "stage3_lora.yaml"]
PRECOMPUTE_CONFIGS = [CONFIGS / "precompute.yaml", CONFIGS / "real" / "precompute.yaml"]


def test_the_shipped_set_is_complete():
    assert [p.name for p in TRAIN_CONFIGS] == [f"stage{i}.yaml" for i in (1, 2, 3, 4)] * 2


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_train_configs_load(path):
    cfg = load_config(TrainConfig, path)
    stage = int(path.stem[-1])
    # stage N+1 starts from stage N's final weights; stage 1 starts from the base models
    assert (cfg.init_from is None) == (stage == 1)
    if stage > 1:
        assert f"stage{stage - 1}" in str(cfg.init_from)
    # progressive unfreezing: stage 2 adds the vision side, stage 3 the language model, stage 4 the VAE
    assert (cfg.freeze.vision, cfg.freeze.language, cfg.freeze.vae) == (stage < 2, stage < 3, stage < 4)


@pytest.mark.parametrize("path", LORA_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_lora_stage3_configs_load(path):
    """Stage 3 with LoRA: the vision side trains whole, the language model through adapters on frozen weights."""
    cfg = load_config(TrainConfig, path)
    assert "stage2" in str(cfg.init_from) and cfg.lora.parts == ["language"]
    assert (cfg.freeze.vision, cfg.freeze.language, cfg.freeze.vae) == (False, True, True)
    assert cfg.train.sharding == "ddp"


@pytest.mark.parametrize("path", PRECOMPUTE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_precompute_configs_load(path):
    cfg = load_config(PrecomputeConfig, path)
    assert cfg.image.resolution % 8 == 0


def test_real_configs_share_the_cache_they_read():
    """The real stages and the real precompute agree on the models and the resolution the cache is built at."""
    pre = load_config(PrecomputeConfig, CONFIGS / "real" / "precompute.yaml")
    for path in sorted((CONFIGS / "real").glob("stage*.yaml")):
        cfg = load_config(TrainConfig, path)
        assert (cfg.model.gemma, cfg.model.vae, cfg.image.resolution) == (
            pre.model.gemma,
            pre.model.vae,
            pre.image.resolution,
        ), path.name


def _another_value(value):
    """A different value of the same type, written as --set takes it."""
    if isinstance(value, bool):
        return str(not value).lower()
    if isinstance(value, int):  # down where it can: thread and worker counts are bounded by the machine's cores
        return str(value - 1 if value > 1 else value + 1)
    if isinstance(value, float):
        return str(value + 0.5)
    if isinstance(value, list):
        return "[]" if value else "[x.jsonl]"
    if value is None:  # train.gradient_checkpointing once read: the earlier switch (true agrees with mode full)
        return "true"
    return {"auto": "4", "ddp": "fsdp", "fsdp": "ddp", "none": "full"}.get(value, "x")


def test_run_hash_ignores_resume_neutral_keys_and_sees_the_rest(tmp_path):
    base = load_config(TrainConfig, CONFIGS / "stage1.yaml")
    neutral = []
    for k in RESUME_NEUTRAL:
        if k.startswith("train."):
            value = getattr(base.train, k.split(".")[1])
            leaves = vars(value) if dataclasses.is_dataclass(value) else {"": value}  # a section: each of its keys
            neutral += [f"{k}{'.' + n if n else ''}={_another_value(v)}" for n, v in leaves.items()]
    neutral += ["wandb.project=x", "hub.model_id=someone/x", "hub.strategy=every_save"]
    neutral += [f"output_dir={tmp_path}", "trackers=[]", "resume=null"]
    assert run_hash(load_config(TrainConfig, CONFIGS / "stage1.yaml", neutral)) == run_hash(base)
    for change in ("train.lr=0.5", "seed=1", "world.pool=2", "train.max_steps=7", "freeze.vae=false"):
        assert run_hash(load_config(TrainConfig, CONFIGS / "stage1.yaml", [change])) != run_hash(base), change


def test_layer_types_follow_the_released_gemma3_pattern():
    from transformers import Gemma3TextConfig

    from theworld import gemma3

    for n in (6, 12, 26, 34, 48, 62):  # the released sizes' depths among them; transformers' own derivation
        assert gemma3.layer_types(n) == Gemma3TextConfig(num_hidden_layers=n).layer_types, n
    real = gemma3.layer_types(34)
    assert [i + 1 for i, t in enumerate(real) if t == "full_attention"] == [6, 12, 18, 24, 30]
    # below 6 layers the released rule has no global layer; the tiny models make their last one global
    assert gemma3.layer_types(1) == ["full_attention"]
    assert gemma3.layer_types(4) == ["sliding_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("stage", [1, 2, 3, 4])
def test_real_configs_build_on_the_meta_device_with_the_real_shapes(stage):
    """configs/real at the real architecture's shapes (offline, no weights): 512 px latents of 64 x 64, world tokens
    per pool as docs/training.md gives them (the world block: start marker, tokens, end marker), the projector's output
    at Gemma 3 4B's hidden size."""
    import torch

    from tools.memory_plan import build_world

    cfg = load_config(TrainConfig, CONFIGS / "real" / f"stage{stage}.yaml")
    model = build_world(cfg, device="meta")
    text = model.gemma.config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers, cfg.image.resolution) == (2560, 34, 512)
    latent = torch.zeros(1, 16, 1, cfg.image.resolution // 8, cfg.image.resolution // 8, device="meta")
    for pool, block in ((1, 4098), (2, 1026), (4, 258)):
        model.projector.pool = pool
        assert tuple(model.projector(latent, latent, "mean", None).shape) == (1, block, 2560), pool
    assert cfg.world.pool == 2


@dataclasses.dataclass
class _Section:
    often: int = neutral(1)
    lr: float = 0.1


@dataclasses.dataclass
class _Config:
    section: _Section = dataclasses.field(default_factory=_Section)
    out: str = neutral("runs")
    seed: int = 0


def test_resume_neutral_keys_are_declared_on_the_fields():
    assert neutral_keys(_Config) == ("section.often", "out")
    assert "train.log_every" in RESUME_NEUTRAL and "train.lr" not in RESUME_NEUTRAL
