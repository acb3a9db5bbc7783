"""train/eval/benchmarks.py: the multiple-choice benchmarks evaluated during training."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from theworld.core.config import load_config
from theworld.core.errors import UserError


def test_train_benchmarks_ask_for_no_rollout_on_rollout_stages_only(tmp_path):
    from theworld.infer import benchmark_items
    from train.config import TrainConfig
    from train.eval.benchmarks import BenchmarkEval

    mc = tmp_path / "mc" / "items.jsonl"
    benchmark_items.make_synthetic(mc, 2)

    def bench(baselines_: str, *sets: str):
        sets = [f"train.eval.benchmarks=[{{path: {mc}, baselines: {baselines_}}}]", *sets]
        return BenchmarkEval.load(load_config(TrainConfig, ROOT / "configs" / "stage1.yaml", sets)).sets["items"]

    assert bench("[all]", "world.num_world_steps=2").baselines[-1] == "no_rollout"
    assert "no_rollout" not in bench("[all]").baselines
    assert bench("[no_rollout]", "world.num_world_steps=1").baselines == ["no_rollout"]
    with pytest.raises(UserError, match="config key 'train.eval.benchmarks': no_rollout .*world.num_world_steps 0"):
        bench("[no_rollout]")
