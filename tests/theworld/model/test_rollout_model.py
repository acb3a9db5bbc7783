"""The model side of world rollouts (issue 36): world latents of 1 + N frames (the observed one, then N predicted) ->
world tokens in time order with a learned temporal embedding per frame, one SOW/EOW around them; N = 0 exactly as
before; the `no_rollout` baseline; caches with fewer / more world steps; a rollout stage trained, evaluated and used.
Rollout caches are made by hand (tests/_rollout_helpers.py) for these shape and order tests; what reads images
(evaluate, describe, the lmms-eval adapter) rolls out live through the tiny Video2World pipeline, and
tests/test_rollout_e2e.py trains on a cache the pipeline precomputed."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests._rollout_helpers import rollout_cache
from tests.conftest import ROOT, weights
from theworld.core.config import load_config
from theworld.core.errors import UserError
from theworld.infer import baselines
from theworld.model.config import ModelConfig, WorldConfig
from theworld.model.inputs import text_batch
from theworld.model.projector import WorldProjector
from theworld.model.text import ChatFormatter
from theworld.model.world import TheWorld

H = 32  # hidden size of the hand-made projectors


def projector(steps: int, pool: int = 1, arch: str = "mlp", seed: int = 0) -> WorldProjector:
    torch.manual_seed(seed)
    mean, std = torch.linspace(-1, 1, 16), torch.linspace(0.5, 1.5, 16)
    return WorldProjector(H, mean, std, pool=pool, arch=arch, num_world_steps=steps, max_world_steps=4)


def reference(p: WorldProjector, mean: torch.Tensor) -> torch.Tensor:
    """The projector as it was before rollouts, of one frame (B, C, 1, h, w): normalise, pool, project, markers."""
    z = (mean[:, :, 0].float() - p.latents_mean) / p.latents_std
    z = F.avg_pool2d(z, p.pool) if p.pool > 1 else z
    world = p.net(z.flatten(2).transpose(1, 2))
    b = len(mean)
    return torch.cat([p.sow.expand(b, 1, -1), world, p.eow.expand(b, 1, -1)], 1) * p.embed_scale


def latents(b: int, frames: int, side: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 16, frames, side, side, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- the projector


@pytest.mark.parametrize("pool", [1, 2])
def test_world_tokens_are_each_frames_tokens_in_time_order_with_its_temporal_row(pool):
    p, plain = projector(2, pool), projector(0, pool)
    assert all(torch.equal(v, p.state_dict()[k]) for k, v in plain.state_dict().items())  # same seed, same weights
    mean = latents(3, 3, side=4)
    with torch.no_grad():
        out = p(mean, torch.zeros_like(mean))
    per_frame = (4 // pool) ** 2
    assert out.shape == (3, 3 * per_frame + 2, H) and p.num_tokens(4, 4) == out.shape[1]
    assert p.num_tokens(4, 4, frames=1) == per_frame + 2 and plain.num_tokens(4, 4) == per_frame + 2
    s = p.embed_scale
    # one SOW first, one EOW last, nothing else equal to either marker
    assert torch.equal(out[:, 0], (p.sow * s).expand(3, -1)) and torch.equal(out[:, -1], (p.eow * s).expand(3, -1))
    body = out[:, 1:-1]
    assert not any(torch.allclose(body[:, i], out[:, 0]) or torch.allclose(body[:, i], out[:, -1]) for i in range(9))
    for k in range(3):  # frame k's tokens: the projector of that frame alone, plus temporal row k
        alone = reference(p, mean[:, :, k : k + 1])[:, 1:-1]
        block = body[:, k * per_frame : (k + 1) * per_frame]
        assert torch.allclose(block, alone + p.temporal[k] * s, atol=1e-5), k
    assert not torch.allclose(body[:, :per_frame], body[:, per_frame : 2 * per_frame])  # frames are told apart


def test_without_world_steps_the_projector_is_what_it_was():
    """N = 0: no temporal table (the parameter set and so the checkpoints are as before) and bit-identical output."""
    for arch in ("mlp", "linear"):
        p = projector(0, arch=arch)
        assert p.temporal is None and set(p.state_dict()) == {"sow", "eow", *(f"net.{k}" for k in p.net.state_dict())}
        mean = latents(2, 1)
        with torch.no_grad():
            assert torch.equal(p(mean, torch.zeros_like(mean)), reference(p, mean))
            assert torch.equal(p(mean[:, :, 0]), reference(p, mean))  # (B, C, h, w): one frame without a time axis
    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    assert not [n for n, _ in model.named_parameters() if "temporal" in n]


def test_more_frames_than_the_model_uses_are_cut_and_fewer_refused():
    p, mean = projector(2), latents(2, 5)
    logvar = torch.full_like(mean, -30.0)
    with torch.no_grad():
        assert torch.equal(p(mean, logvar), p(mean[:, :, :3], logvar[:, :, :3]))
        # latent mode sample: the noise a frame gets does not depend on the frames after it
        assert torch.equal(p(mean, logvar, "sample", [4, 5]), p(mean[:, :, :3], logvar[:, :, :3], "sample", [4, 5]))
    with pytest.raises(ValueError, match="hold 2 frame.* uses 3 .*num_world_steps = 2"):
        p(mean[:, :, :2])
    with pytest.raises(ValueError, match=r"frames must be in \[1, 3\]"):
        p(mean, frames=4)


def test_the_temporal_table_trains_with_the_projector():
    """A training step reaches the table's rows of the frames in play (and no other row); the optimiser has it with
    the projector, without weight decay; the trainable counts include it."""
    from train.optim import param_groups
    from train.params import part_counts

    world = WorldConfig(num_world_steps=2, max_world_steps=4)
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), world, seed=0)
    plain, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    hidden = model.gemma.config.get_text_config().hidden_size
    assert model.projector.temporal.shape == (5, hidden)
    counts, before = part_counts(model)["projector"], part_counts(plain)["projector"]
    assert counts["trainable"] == counts["total"] == before["trainable"] + 5 * hidden
    groups = param_groups(model, weight_decay=0.1)
    table = [g for g in groups if any(p is model.projector.temporal for p in g["params"])]
    assert len(table) == 1 and table[0]["part"] == "projector" and table[0]["weight_decay"] == 0.0
    fmt = ChatFormatter(processor)
    mean = model.projector.latents_mean[:, :, None] + latents(2, 3, side=8)
    mm = model.gemma.config.mm_tokens_per_image
    batch = text_batch(
        [fmt.encode("Describe the image.", c) for c in ("a red circle .", "two squares .")],
        fmt.pad_id,
        latent_mean=mean,
        latent_logvar=torch.zeros_like(mean),
        siglip=torch.randn(2, mm, hidden, generator=torch.Generator().manual_seed(1)),
    )
    model.train()
    model(batch).loss.backward()
    grad = model.projector.temporal.grad
    assert all(grad[k].abs().sum() > 0 for k in range(3)) and not grad[3:].any()
    start = model.projector.temporal.detach().clone()
    torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2).step()
    moved = (model.projector.temporal.detach() != start).any(-1)
    assert moved.tolist() == [True, True, True, False, False]


def test_no_rollout_is_the_model_given_the_observed_frame_alone():
    """The no_rollout condition: the world block of frame 0 with temporal row 0, i.e. the N = 0 model's world block
    of frame 0 plus row 0 (and exactly the N = 0 model when row 0 is zero)."""
    rollout, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(num_world_steps=2), seed=0)
    plain, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    fmt = ChatFormatter(processor)
    mean = rollout.projector.latents_mean[:, :, None] + latents(2, 3, side=8)
    hidden = rollout.gemma.config.get_text_config().hidden_size
    mm = rollout.gemma.config.mm_tokens_per_image
    siglip = torch.randn(2, mm, hidden, generator=torch.Generator().manual_seed(2))
    batch = text_batch(
        [fmt.encode("Describe the image.", c) for c in ("a red circle .", "two squares .")],
        fmt.pad_id,
        latent_mean=mean,
        latent_logvar=torch.zeros_like(mean),
        siglip=siglip,
    )
    cond = baselines.ROLLOUT_BASELINES["no_rollout"]
    rows = torch.arange(2)
    no_rollout = batch.with_inputs(**baselines.world_inputs(rollout, cond, mean, torch.zeros_like(mean), rows, rows))
    frame0 = batch.with_inputs(latent_mean=mean[:, :, :1], latent_logvar=torch.zeros_like(mean[:, :, :1]))
    with torch.no_grad():
        got = rollout.embed_inputs(no_rollout)["inputs_embeds"]
        want = plain.embed_inputs(frame0)["inputs_embeds"]
        n = 64  # one 8 x 8 frame
        assert got.shape == want.shape and rollout.embed_inputs(batch)["inputs_embeds"].shape[1] == got.shape[1] + 2 * n
        row0 = rollout.projector.temporal[0] * rollout.projector.embed_scale
        assert torch.allclose(got[:, 2 : 2 + n], want[:, 2 : 2 + n] + row0, atol=1e-5)  # BOS, SOW, then frame 0
        outside = torch.ones(got.shape[1], dtype=torch.bool)
        outside[2 : 2 + n] = False
        assert torch.equal(got[:, outside], want[:, outside])
        rollout.projector.temporal[0] = 0
        assert torch.allclose(rollout(no_rollout).loss, plain(frame0).loss, atol=1e-6)
        assert not torch.allclose(rollout(batch).loss, plain(frame0).loss, atol=1e-4)  # the future changes it


# ---------------------------------------------------------------------------------------------- baselines, configs


def test_no_rollout_is_a_baseline_of_rollout_stages_only():
    base = list(baselines.BASELINES)
    assert baselines.parse("all", 0) == baselines.parse("all") == base
    assert baselines.parse("all", 2) == base + ["no_rollout"]
    assert baselines.parse("no_rollout,no_world", 2) == ["no_world", "no_rollout"]
    assert baselines.parse("no_rollout") == ["no_rollout"]  # the stage not known yet: the name is checked only
    with pytest.raises(UserError, match="no_rollout .* this stage has none \\(world.num_world_steps 0\\)"):
        baselines.parse("no_rollout", 0)
    assert [c.name for c in baselines.conditions(baselines.parse("all", 2))][-1] == "no_rollout"


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


def test_the_rollout_configs_load():
    from precompute.config import PrecomputeConfig
    from train.config import TrainConfig

    tiny = load_config(TrainConfig, ROOT / "configs" / "stage1_rollout.yaml")
    real = load_config(TrainConfig, ROOT / "configs" / "real" / "stage1_rollout.yaml")
    for cfg, plain in ((tiny, "stage1.yaml"), (real, "real/stage1.yaml")):
        assert (cfg.world.num_world_steps, cfg.world.max_world_steps) == (2, 16)
        assert "rollout" in cfg.cache_dir and "rollout" in cfg.output_dir
        base = load_config(TrainConfig, ROOT / "configs" / plain)
        # otherwise the stage-1 config: the same models, image, freeze flags and training settings
        assert (cfg.model, cfg.image, cfg.freeze, cfg.train) == (base.model, base.image, base.freeze, base.train)
    pre = load_config(PrecomputeConfig, ROOT / "configs" / "real" / "precompute.yaml")
    assert (real.model.gemma, real.model.vae, real.image.resolution) == (pre.model.gemma, pre.model.vae, 512)


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


def test_train_memory_counts_the_rollout_world_tokens():
    from tools.memory_plan import activation_bytes, build_world
    from train.config import TrainConfig

    plain = load_config(TrainConfig, ROOT / "configs" / "real" / "stage1.yaml")
    rollout = load_config(TrainConfig, ROOT / "configs" / "real" / "stage1_rollout.yaml")
    a, b = build_world(plain), build_world(rollout)
    assert a.projector.num_tokens(64, 64) == 32 * 32 + 2 and b.projector.num_tokens(64, 64) == 3 * 32 * 32 + 2
    assert activation_bytes(rollout, b, 1) > activation_bytes(plain, a, 1)


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
