"""train.config: settings that would do nothing, or something else than they say, are refused in one line."""

from __future__ import annotations

import json

import pytest

from tests.conftest import (
    ROOT,
    train_config,
)
from theworld.core.config import load_config
from theworld.core.errors import UserError
from train.config import TrainConfig, run_hash


@pytest.mark.parametrize(
    "sets",
    [
        ["train.hardware.activation_checkpointing.parts=[]"],
        ["train.hardware.activation_checkpointing={mode: selective, every_n: 3, parts: []}"],
    ],
)
def test_activation_checkpointing_of_no_part_is_refused_naming_the_way_out(sets):
    with pytest.raises(UserError) as e:
        load_config(TrainConfig, None, sets)
    line = str(e.value)
    assert "'train.hardware.activation_checkpointing.parts': []" in line and "checkpoints nothing" in line
    assert "use mode none" in line and "\n" not in line


def test_no_part_with_mode_none_says_the_same_thing_twice_and_loads():
    cfg = load_config(TrainConfig, None, ["train.hardware.activation_checkpointing={mode: none, parts: []}"])
    assert not any(cfg.train.hardware.activation_checkpointing.wraps(p) for p in ("language", "vision", "vae"))


def test_mixture_weights_far_apart_and_a_cache_listed_twice_are_refused(tmp_path, trained_run, capsys):
    cache = trained_run["cache"]
    (tmp_path / "alias").symlink_to(cache)
    for data, words in (
        (f"[{{cache: {cache}, weight: 1.0e-30}}, {{cache: {tmp_path / 'c2'}, weight: 1}}]", ["times apart"]),
        (f"[{{cache: {cache}, weight: 3.0e38}}, {{cache: {tmp_path / 'c2'}, weight: 1}}]", ["times apart"]),
        (f"[{{cache: {cache}}}, {{cache: {tmp_path / 'alias'}}}]", ["listed twice", "the same folder"]),
        (f"[{{cache: {cache}}}, {{cache: {cache}/.}}]", ["listed twice"]),
    ):
        with pytest.raises(UserError, match="config key 'data'") as e:
            train_config(f"data={data}")
        assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("name", ["a/b", "team:x", "", "p#1"])
def test_wandb_names_are_checked_in_the_config(name):
    for key in ("wandb.project", "wandb.entity"):
        with pytest.raises(UserError, match=f"'{key}'"):
            train_config(f"{key}={json.dumps(name)}")


def test_micro_batch_auto_keeps_the_shipped_numbers_and_a_bad_value_gets_a_suggestion():
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from train.config import TrainConfig, accumulation_steps

    def micro(path, world, *sets):
        cfg = load_config(TrainConfig, path, list(sets))
        return cfg.train.micro_batch_size, accumulation_steps(cfg, world), cfg.train.micro_batch_size

    for stage in range(1, 5):  # 1 process: what the configs gave before auto (32 of 32; real: 8 of 256)
        assert micro(ROOT / "configs" / f"stage{stage}.yaml", 1) == ("auto", 1, 32)
        assert micro(ROOT / "configs" / f"stage{stage}.yaml", 2) == ("auto", 1, 16)
        assert micro(ROOT / "configs" / "real" / f"stage{stage}.yaml", 1) == ("auto", 32, 8)
        assert micro(ROOT / "configs" / "real" / f"stage{stage}.yaml", 8) == ("auto", 4, 8)
    assert micro(None, 3, "train.global_batch_size=36", "train.max_micro_batch_size=5")[2] == 4  # 12 per process
    assert micro(None, 1, "train.global_batch_size=7")[2] == 7
    with pytest.raises(UserError, match=r"'train.micro_batch_size': 32 .* use 16 \(or auto\)"):
        micro(None, 2, "train.global_batch_size=32", "train.micro_batch_size=32")
    with pytest.raises(UserError, match=r"'train.micro_batch_size': 5 .* use 4 \(or auto\)"):
        micro(None, 1, "train.global_batch_size=32", "train.micro_batch_size=5")
    with pytest.raises(UserError, match=r"'train.global_batch_size': 32 does not split over 3 processes; .* 33 or 30"):
        micro(None, 3, "train.global_batch_size=32")
    for bad in ("0", "-8", "big", "1.5"):
        with pytest.raises(UserError, match="train.micro_batch_size"):
            load_config(TrainConfig, None, [f"train.micro_batch_size={bad}"])


def test_world_steps_change_the_run_hash_only_with_rollouts():
    """world.num_world_steps is not resume-neutral; with N = 0 the other world-step keys change nothing (and runs
    keep the hash they had before the keys existed)."""
    from train.config import TrainConfig, run_hash

    cfg = lambda *sets: load_config(TrainConfig, ROOT / "configs" / "stage1.yaml", list(sets))  # noqa: E731
    base = run_hash(cfg())
    assert run_hash(cfg("world.max_world_steps=8", "world.rollout.guidance_scale=3.0")) == base
    two = run_hash(cfg("world.num_world_steps=2"))
    assert two != base and run_hash(cfg("world.num_world_steps=3")) != two
    assert run_hash(cfg("world.num_world_steps=2", "world.max_world_steps=8")) != two


def test_the_default_rollout_condition_leaves_the_run_hash_as_it_was():
    rollouts = ["world.num_world_steps=2", "world.rollout.inference_steps=2"]
    fixed = run_hash(train_config(*rollouts))
    assert run_hash(train_config(*rollouts, "world.rollout.condition=fixed")) == fixed
    assert run_hash(train_config(*rollouts, "world.rollout.condition=question")) != fixed
