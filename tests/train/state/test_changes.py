"""train.state.changes: what a resume changed, named; a resume that would change the model is refused before any
model loads."""

from __future__ import annotations

import pytest

from tests.conftest import (
    base_args,
    train_inproc,
)
from theworld.core.config import load_config, to_yaml
from theworld.core.errors import UserError
from train.config import TrainConfig
from train.state import changes


def _cfg(tmp_path, *sets: str) -> TrainConfig:
    return load_config(TrainConfig, None, [f"output_dir={tmp_path / 'run'}", "train.max_steps=10", *sets])


def _checkpoint(tmp_path, cfg: TrainConfig, text: str | None = None):
    ckpt = tmp_path / "run" / "checkpoint-4"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.yaml").write_text(text if text is not None else to_yaml(cfg))
    return ckpt


def test_another_number_of_world_steps_is_refused_on_resume_naming_both(tmp_path):
    ckpt = _checkpoint(tmp_path, _cfg(tmp_path, "world.num_world_steps=3"))
    with pytest.raises(UserError) as e:
        changes.check_resume(_cfg(tmp_path, "world.num_world_steps=1"), ckpt, 4)
    line = str(e.value)
    assert "'world.num_world_steps'" in line and "trained with 3, this run gives 1" in line and "\n" not in line
    assert "another output_dir" in line and "--set world.num_world_steps=3" in line
    changes.check_resume(_cfg(tmp_path, "world.num_world_steps=3"), ckpt, 4)  # the same: resumes


def test_a_checkpoint_from_before_world_steps_counts_as_zero(tmp_path):
    old = to_yaml(_cfg(tmp_path)).replace("  num_world_steps: 0\n", "")
    ckpt = _checkpoint(tmp_path, None, old)
    with pytest.raises(UserError, match="trained with 0, this run gives 2"):
        changes.check_resume(_cfg(tmp_path, "world.num_world_steps=2"), ckpt, 4)


def test_the_changes_are_named_by_todays_keys_with_both_values_and_neutral_keys_left_out(tmp_path):
    then = _cfg(tmp_path, "train.optimizer.lr=0.02", "train.loader.num_workers=0")
    flat_then = to_yaml(then).replace("  optimizer:\n    lr: 0.02\n", "  lr: 0.02\n  optimizer:\n")
    saved = changes.saved_config(_checkpoint(tmp_path, None, flat_then))
    now = _cfg(tmp_path, "train.optimizer.lr=0.05", "train.max_steps=12", "train.loader.num_workers=1")
    got = changes.config_changes(saved, now)
    assert ("train.optimizer.lr", 0.02, 0.05) in got and ("train.max_steps", 10, 12) in got
    assert not [k for k, *_ in got if k.startswith("train.loader.num_workers")]  # resume-neutral
    assert changes.describe(got).startswith("train.max_steps 10 -> 12") or "train.optimizer.lr 0.02 -> 0.05" in (
        changes.describe(got)
    )


def test_a_checkpoint_saved_with_the_top_level_storage_keys_compares_them_under_the_storage_section(tmp_path):
    import yaml

    then = yaml.safe_load(to_yaml(_cfg(tmp_path)))
    del then["storage"]  # as release 4 saved it: the keys at the top level
    then |= {"cache_shuffle_window": 4, "cache_prefetch_shards": 1, "cache_local_dir": "/old", "storage_options": {}}
    saved = changes.saved_config(_checkpoint(tmp_path, None, yaml.safe_dump(then)))
    assert changes.config_changes(saved, _cfg(tmp_path, "storage.shuffle_window=4")) == []  # the rest: neutral
    assert changes.config_changes(saved, _cfg(tmp_path, "storage.shuffle_window=2")) == [
        ("storage.shuffle_window", 4, 2)
    ]


def test_a_finished_run_refuses_another_cache_but_not_keys_that_change_nothing(tmp_path):
    ckpt = _checkpoint(tmp_path, _cfg(tmp_path, "cache_dir=cache/a", "train.max_steps=4"))
    with pytest.raises(UserError, match=r"holds a finished run \(step 4\) trained with other settings: cache_dir"):
        changes.check_resume(_cfg(tmp_path, "cache_dir=cache/b", "train.max_steps=4"), ckpt, 4)
    # rollout settings without rollouts, an eval setting, a moved output_dir: the same weights, not refused
    same = _cfg(tmp_path, "cache_dir=cache/a", "train.max_steps=4", "world.rollout.inference_steps=9")
    changes.check_resume(same, ckpt, 4)
    changes.check_resume(_cfg(tmp_path, "cache_dir=cache/b", "train.max_steps=6"), ckpt, 4)  # extended: goes on


def test_resuming_under_another_resolved_micro_batch_or_sharding_does_not_warn_of_another_config(
    cache, tmp_path, capsys
):
    out = tmp_path / "run"
    common = {"train.checkpoint.every": 2, "train.micro_batch_size": "auto"}
    assert train_inproc(base_args(cache, out, steps=2, **common, **{"train.max_micro_batch_size": 4})) == 0
    capsys.readouterr()
    # auto now resolves to 8 (as it does when a 2-process run resumes on 1), and the launcher asks for no FSDP
    assert train_inproc(base_args(cache, out, steps=2, **common, **{"train.max_micro_batch_size": 8})) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "different config" not in err
    assert train_inproc(base_args(cache, out, steps=2, **common, **{"train.optimizer.lr": "2e-2"})) == 0
    assert "written under a different config" in capsys.readouterr().err  # a change of the numbers still warns
