"""A rollout stage end to end (issue 36): caches with fewer / more world steps than the stage, or rolled out with
other settings, refused or cut in one line; a rollout stage trained, evaluated and used (evaluate, describe, the
lmms-eval adapter). Rollout caches are made by hand (tests/_rollout_helpers.py); what reads images rolls out live
through the tiny Video2World pipeline, and tests/e2e/test_rollout_live.py trains on a cache the pipeline precomputed."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import yaml

from tests._rollout_helpers import rollout_cache
from tests.conftest import ROOT, weights
from theworld.core.config import load_config
from theworld.infer import baselines
from theworld.model.config import ModelConfig, WorldConfig
from theworld.model.world import TheWorld

# ---------------------------------------------------------------------------------------------- the projector


# ---------------------------------------------------------------------------------------------- baselines, configs


# ---------------------------------------------------------------------------------------------- caches and a stage


def _train_args(cache, out, **extra) -> list[str]:
    sets = {
        "cache_dir": cache,
        "output_dir": out,
        "train.max_steps": 3,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 8,
        "train.eval.samples": 8,
        "train.loader.num_workers": 0,
        "train.lr_schedule.warmup_steps": 1,
        "train.eval.every": 0,
        "train.eval.captions": 2,
        "train.eval.caption_tokens": 4,
        "trackers": "[]",
        "world.rollout.inference_steps": 2,  # the saved stage's live rollouts (evaluate, describe): two denoising steps
        **extra,
    }
    return ["--config", str(ROOT / "configs" / "stage1_rollout.yaml")] + [
        a for k, v in sets.items() for a in ("--set", f"{k}={v}")
    ]


@pytest.fixture(scope="module")
def rollout_caches(trained_run, tmp_path_factory):
    """The trained_run's synthetic cache with 1, 2 and 3 world steps (the predicted frames: `predicted_frames`)."""
    root = tmp_path_factory.mktemp("rollout_caches")
    return {n: rollout_cache(trained_run["cache"], root / f"steps{n}", n) for n in (1, 2, 3)}


def test_a_cache_with_fewer_world_steps_is_refused_in_one_line(rollout_caches, tmp_path, capsys):
    from train.config import DEFAULT_CACHE
    from train.loop import main

    assert main(_train_args(rollout_caches[1], tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "world.num_world_steps" in err[0] and "uses 2 predicted frame(s)" in err[0] and "holds 1" in err[0]
    assert "--set world.num_world_steps=2" in err[0]
    assert not (tmp_path / "run" / "final").exists()
    # a manifest whose world steps are no count, or disagree with its latents' frames, is a damaged cache
    manifest = rollout_caches[2] / "manifest.json"
    good = manifest.read_text()
    try:
        for steps, words in (("two", "'contents.world_steps' is not a count"), (3, "world_steps 3 .* have 3 frame")):
            m = json.loads(good)
            m["contents"]["world_steps"] = steps
            manifest.write_text(json.dumps(m))
            assert main(_train_args(rollout_caches[2], tmp_path / "run")) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and re.search(words, err[0]), err
    finally:
        manifest.write_text(good)
    # a mixture's latents are stacked into one batch: its caches hold the same number of world steps
    mixture = f"data=[{{cache: {rollout_caches[2]}, weight: 1}}, {{cache: {rollout_caches[3]}, weight: 1}}]"
    assert main(_train_args(DEFAULT_CACHE, tmp_path / "run") + ["--set", mixture]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world steps 2 vs 3" in err[0], err


def test_a_cache_rolled_out_with_other_settings_is_refused_by_key_with_both_values(rollout_caches, tmp_path, capsys):
    """The run's world.rollout is what it rolls out live and what its saved stage rolls out with later: a cache
    rolled out otherwise is refused, naming each differing key with both values, whether the run rolls out live (an
    unfrozen VAE) or reads cached latents only. The seed is the cache's in every live rollout: never compared."""
    import dataclasses
    import shutil

    from theworld.model.config import RolloutConfig
    from train.config import TrainConfig
    from train.data import cache as data
    from train.loop import main

    cache = tmp_path / "cache"
    shutil.copytree(rollout_caches[2], cache)
    manifest = cache / "manifest.json"
    m = json.loads(manifest.read_text())
    ours = dataclasses.asdict(RolloutConfig(inference_steps=2))  # what _train_args sets
    m["fingerprint"]["world"] = {"num_world_steps": 2, **ours, "seed": 5}  # as precompute records it
    manifest.write_text(json.dumps(m))
    config = str(ROOT / "configs" / "stage1_rollout.yaml")
    for sets in ({}, {"freeze.vae": "false"}, {"world.num_world_steps": 0}):  # the same settings; no rollouts
        data.open_cache(load_config(TrainConfig, config, _train_args(cache, tmp_path / "run", **sets)[3::2]))

    m["fingerprint"]["world"].update(inference_steps=35, prompt="a ball rolls: on", seed=9)
    manifest.write_text(json.dumps(m))
    for sets in ({}, {"freeze.vae": "false"}):
        assert main(_train_args(cache, tmp_path / "run", **sets)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "config key 'world.rollout'" in err[0], err
        words = [
            'was rolled out with inference_steps 35, prompt "a ball rolls: on", but this run gives inference_steps 2, '
            f"prompt {json.dumps(ours['prompt'])}",
            '--set world.rollout.inference_steps=35 --set world.rollout.prompt="a ball rolls: on"',
        ]
        assert all(w in err[0] for w in words) and "seed" not in err[0] and "fps" not in err[0], err
        assert not (tmp_path / "run").exists()
    m["fingerprint"]["world"].update(inference_steps=2, prompt=ours["prompt"])  # only the seed differs: trains
    manifest.write_text(json.dumps(m))
    data.open_cache(load_config(TrainConfig, config, _train_args(cache, tmp_path / "run")[3::2]))


@pytest.fixture(scope="module")
def rollout_run(rollout_caches, tmp_path_factory):
    from train.loop import main

    out = tmp_path_factory.mktemp("rollout_run") / "run"
    assert main(_train_args(rollout_caches[2], out)) == 0
    return out


@pytest.mark.slow
def test_a_rollout_stage_trains_evaluates_the_shuffled_world_gap_and_saves(rollout_run, trained_run):
    from tests.conftest import metrics

    ev = [m for m in metrics(rollout_run) if "eval_loss" in m]
    assert ev and math.isfinite(ev[-1]["eval_loss"]) and math.isfinite(ev[-1]["eval_loss_shuffled_world"])
    assert ev[-1]["eval_loss_shuffled_world"] != ev[-1]["eval_loss"]
    saved = weights(rollout_run)
    assert saved["projector.temporal"].shape[0] == 17  # max_world_steps 16 + the observed frame's row
    assert "projector.temporal" not in weights(trained_run["run"])  # a stage without rollouts has no table
    config = yaml.safe_load((rollout_run / "final" / "config.yaml").read_text())
    assert config["world"]["num_world_steps"] == 2
    fresh = TheWorld.new_projector(*_tiny_parts(), WorldConfig(num_world_steps=2), seed=0).temporal.detach()
    moved = (saved["projector.temporal"] != fresh).any(-1)
    assert moved[:3].all() and not moved[3:].any()  # the rows of the frames trained on, and no other
    model, _ = TheWorld.from_pretrained(rollout_run, device="cpu")
    assert model.projector.frames == 3 and torch.equal(model.projector.temporal, saved["projector.temporal"])


def _tiny_parts():
    from theworld.model.encoders import WorldEncoder

    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    return model.gemma, WorldEncoder(model.world_encoder.vae)


@pytest.mark.slow
def test_a_cache_with_more_world_steps_trains_on_its_first_ones_and_says_so_once(
    rollout_caches, rollout_run, tmp_path, capsys
):
    from train.loop import main

    capsys.readouterr()
    assert main(_train_args(rollout_caches[3], tmp_path / "run")) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "predicted frame(s) per sample" in line]
    assert len(notes) == 1 and "holds 3" in notes[0] and "training uses the first 2" in notes[0], notes
    # the same numbers as training on a cache of exactly those frames
    mine, exact = weights(tmp_path / "run"), weights(rollout_run)
    assert mine.keys() == exact.keys() and all(torch.equal(mine[k], exact[k]) for k in mine)


@pytest.mark.slow
def test_evaluate_and_describe_on_a_rollout_stage(rollout_run, rollout_caches, trained_run, tmp_path, capsys):
    from theworld import describe
    from theworld.evaluate import main

    data = trained_run["mc"]
    out = tmp_path / "out.jsonl"
    argv = ["--model", str(rollout_run), "--data", str(data), "--json", "--baselines", "all", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["baselines"]) == [*baselines.BASELINES, "no_rollout"]
    b = res["baselines"]["no_rollout"]
    assert {"accuracy", "difference", "p_value"} <= b.keys() and 0 <= b["p_value"] <= 1
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["outputs"]["no_rollout"] != r["outputs"]["model"] for r in records)  # the future counts
    generate = ["--protocol", "generate", "--max-new-tokens", "2"]
    assert main(argv[:4] + ["--json", "--baselines", "no_rollout", *generate]) == 0
    gen = json.loads(capsys.readouterr().out)
    assert gen["protocol"] == "generate" and list(gen["baselines"]) == ["no_rollout"]
    caption = ["--model", str(rollout_run), "--data", str(rollout_caches[2]), "--task", "caption", "--json"]
    caption += ["--limit", "2", "--max-new-tokens", "4"]  # two held-out samples, short captions: no score is checked
    assert main(caption) == 0
    assert json.loads(capsys.readouterr().out)["task"] == "caption"
    image = sorted((data.parent / "images").iterdir())[:2]
    argv = ["--model", str(rollout_run), "--image", *map(str, image), "--max-new-tokens", "3"]
    assert describe.main(argv + ["--shuffle-world"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    # --world-steps: 3 predicted frames where the stage trained on 2 (its temporal table has 16 rows), the unit said
    assert describe.main(argv + ["--world-steps", "3"]) == 0
    said = capsys.readouterr()
    assert len(said.out.splitlines()) == 2
    assert "world steps: 3 predicted latent frame(s)" in said.err
    assert "num_world_steps counts video frames: 12" in said.err
    assert describe.main(argv + ["--world-steps", "17"]) == 2
    assert "--world-steps: must be in [1, 16]" in capsys.readouterr().err
    # a stage without rollouts: no_rollout is not part of all, and asking for it is one line, exit 2
    assert main(["--model", str(trained_run["run"]), "--data", str(data), "--baselines", "no_rollout"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_rollout" in err[0] and "world.num_world_steps 0" in err[0]


@pytest.mark.slow
def test_the_lmms_eval_adapter_answers_a_rollout_stage_as_generate_does(rollout_run, trained_run):
    pytest.importorskip("lmms_eval", reason="the eval extra (pip install .[eval]) is not installed")
    from types import SimpleNamespace

    from theworld.lmms_adapter import TheWorldLMM

    image = str(sorted((trained_run["mc"].parent / "images").iterdir())[0])
    lmm = TheWorldLMM(str(rollout_run), device="cpu")
    assert lmm._inputs([image])["latent_mean"].shape[2] == 3  # the observed frame and the 2 predicted ones
    lmm.task_dict = {"task": {"val": [{"image": image}]}}
    visuals = lambda doc: [doc["image"]]  # noqa: E731
    request = SimpleNamespace(args=("What is it?", {"max_new_tokens": 3}, visuals, 0, "task", "val"))
    answer = lmm.generate_until([request])
    assert answer == [a.strip() for a in lmm.model.generate([image], "What is it?", max_new_tokens=3)]
