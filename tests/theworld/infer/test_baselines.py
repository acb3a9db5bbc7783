"""The base_gemma baseline: the stage's Gemma before any training, read from where the stage's config names it. On a
stage whose Gemma trained, its column equals the base model's own scores (a fresh model from the same sections,
scored with no world block) and differs from no_world (the trained Gemma)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import base_args, train_inproc
from theworld.core.errors import UserError
from theworld.infer import baselines, benchmark_items


def test_base_gemma_equals_the_base_models_scores_on_a_stage_whose_gemma_trained(cache, tmp_path, capsys):
    from theworld import evaluate
    from theworld.infer.scoring import Scorer
    from theworld.model import stage_layout as layout
    from theworld.model.world import TheWorld

    out = tmp_path / "run"
    assert train_inproc(base_args(cache, out, steps=2, **{"freeze.language": "false", "train.eval.captions": 0})) == 0
    capsys.readouterr()  # the run's summary
    mc, recs = tmp_path / "mc" / "items.jsonl", tmp_path / "recs.jsonl"
    benchmark_items.make_synthetic(mc, 4)
    argv = ["--model", str(out), "--data", str(mc), "--baselines", "base_gemma,no_world", "--out", str(recs)]
    assert evaluate.main(argv + ["--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["baselines"]) == {"base_gemma", "no_world"}
    got = [json.loads(line)["outputs"] for line in recs.read_text().splitlines()]

    stage = layout.read_stage(layout.resolve(out))
    s = stage.sections
    base, processor = TheWorld.from_config(s.model, s.world, s.freeze, image=s.image)  # nothing trained loaded
    items = benchmark_items.read(mc)
    want = Scorer(base.eval(), processor, s.image, items).score(list(range(len(items))), [baselines.KNOWN["no_world"]])
    for g, w in zip(got, want):
        assert g["base_gemma"] == pytest.approx(w["no_world"], rel=1e-5, abs=1e-5)
        assert g["no_world"] != pytest.approx(g["base_gemma"], rel=1e-5, abs=1e-5)  # the stage's Gemma trained


def test_base_gemma_is_named_alone_and_refused_in_training():
    from theworld.core.errors import UserError
    from train.config import TrainConfig, load_config
    from train.eval.benchmarks import BenchmarkEval

    assert "base_gemma" not in baselines.parse("all", 0) and "base_gemma" not in baselines.parse("all", 2)
    assert baselines.parse("base_gemma,no_world") == ["no_world", "base_gemma"]
    cfg = load_config(TrainConfig, None, ["train.eval.benchmarks=[{path: x.jsonl, baselines: [base_gemma]}]"])
    with pytest.raises(UserError, match="base_gemma loads the base model once more"):
        BenchmarkEval.load(cfg)


def test_no_rollout_is_a_baseline_of_rollout_stages_only():
    base = list(baselines.BASELINES)
    assert baselines.parse("all", 0) == baselines.parse("all") == base
    assert baselines.parse("all", 2) == base + ["no_rollout"]
    assert baselines.parse("no_rollout,no_world", 2) == ["no_world", "no_rollout"]
    assert baselines.parse("no_rollout") == ["no_rollout"]  # the stage not known yet: the name is checked only
    with pytest.raises(UserError, match="no_rollout .* this stage has none \\(world.num_world_steps 0\\)"):
        baselines.parse("no_rollout", 0)
    assert [c.name for c in baselines.conditions(baselines.parse("all", 2))][-1] == "no_rollout"
