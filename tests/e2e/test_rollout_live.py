"""Live rollouts (issue 36 item 4) in training, evaluation and the no_rollout baseline: a loader batch carries each
sample's rollout seed (its cache's seed and its key), so a run that rolls out live (an unfrozen VAE) sees the rollouts
the cache holds; no_rollout on live images encodes without rolling out. End to end on a cache the tiny Video2World
pipeline precomputed: precompute -> inspect summary / compare-live -> a rollout stage trained and evaluated -> evaluate
with no_rollout -> the first-step loss of a run that rolls out live equals the cached run's."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.conftest import ROOT, metrics
from theworld.model import rollout
from theworld.model.config import ModelConfig, RolloutConfig, WorldConfig
from theworld.model.inputs import PARTNER, ModelInputs
from train import params
from train.data.batches import Batch
from train.data.order import rank_indices

STEPS = 2
FAST = [f"world.num_world_steps={STEPS}", "world.rollout.inference_steps=2"]  # two denoising steps: fast, still real


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads, and a busy machine's spinning OpenMP threads slow them many times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


# ------------------------------------------------------------------------------------------------- no cache needed


def test_rollout_seeds_cross_a_batch_and_a_partner_brings_its_own():
    ids = torch.ones(2, 3, dtype=torch.long)
    own, mate = torch.tensor([11, 2**62 + 5]), torch.tensor([7, 2**62 + 9])  # 63-bit seeds survive int64
    pixels = torch.zeros(2, 3, 16, 16, dtype=torch.uint8)
    inputs = ModelInputs(ids, ids, ids, images=pixels, rollout_seeds=own, partner={"images": pixels + 1})
    inputs.partner["rollout_seeds"] = mate
    back = Batch.of(inputs).to("cpu")
    assert back.rollout_seeds.dtype == torch.int64 and torch.equal(back.rollout_seeds, own)
    assert torch.equal(back.partner_world().rollout_seeds, mate)  # the shuffled world rolls out with its own seeds
    assert torch.equal(back.own_world().rollout_seeds, own)
    with pytest.raises(ValueError, match="no model input"):
        ModelInputs.from_tensors({**inputs.to_tensors(), PARTNER + "noise_seeds": mate})


def test_a_caches_rollout_seed_is_its_fingerprints_else_its_precompute_runs():
    config = {"config": {"seed": 3}}  # what precompute records of its run
    assert rollout.cache_seed({"fingerprint": {"world": {"seed": 5, "num_world_steps": 2}}, **config}) == 5
    assert rollout.cache_seed({"fingerprint": {"vae": {}}, **config}) == 3  # no rollouts: the run's seed
    assert rollout.cache_seed({"fingerprint": {}}) == 0  # the precompute default


def test_no_rollout_on_live_images_encodes_without_rolling_out():
    """The no_rollout baseline given images: the observed frame's encoding alone (no transformer call), the same
    world block as before this change (the full rollout's frame 0)."""
    from theworld.model.world import TheWorld

    world = WorldConfig(num_world_steps=STEPS, rollout=RolloutConfig(inference_steps=2))
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), world)
    model.eval()
    # the start line's counts take the rollout transformer too, never trainable (it once stopped such a run there)
    assert re.search(r", rollout 0 / [0-9.]+ [kM]$", params.describe(model)), params.describe(model)
    calls = []
    handle = model.rollout.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=gen)
    ids = torch.tensor([[2, 10, 11], [2, 12, 1]])
    siglip = torch.zeros(0, model.gemma.config.text_config.hidden_size)
    inputs = ModelInputs(ids, torch.ones_like(ids), images=pixels, siglip=siglip, rollout_seeds=torch.tensor([1, 2]))
    try:
        with torch.no_grad():
            alone = model.embed_inputs(inputs.with_inputs(use_rollout=False))
            assert not calls
            mean, logvar = model.world_latents(pixels, None, None, [1, 2])
            assert calls and mean.shape[2] == 1 + STEPS
            # what no_rollout computed before: the whole rollout, of which the projector used frame 0
            before = model.embed_inputs(
                inputs.with_inputs(images=None, latent_mean=mean, latent_logvar=logvar, use_rollout=False)
            )
    finally:
        handle.remove()
    assert alone.keys() == before.keys()
    for k in alone:
        torch.testing.assert_close(alone[k], before[k], rtol=0, atol=0)


# --------------------------------------------------------------------------------------- a precomputed rollout cache


@pytest.fixture(scope="module")
def rolled(tmp_path_factory):
    """24 synthetic samples (the stages' 2 batches of 8 and their 8 held out) rolled out 2 steps by the tiny pipeline
    (the documented command, in process: its main(argv); seed 7: not the default, so the live path has to read the
    cache's seed rather than assume it)."""
    from precompute.cosmos_latents import main

    cache = tmp_path_factory.mktemp("rolled") / "cache"
    sets = [f"output_dir={cache}", "source.num_samples=24", "shard_size=16", "batch_size=16", "num_workers=0", "seed=7"]
    assert main(["--config", str(ROOT / "configs" / "precompute.yaml"), *_sets(*sets, *FAST)]) == 0
    return cache


def _stage(cache, out, *extra: str) -> list[str]:
    sets = [
        f"cache_dir={cache}",
        f"output_dir={out}",
        "train.max_steps=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.eval.samples=8",
        "train.loader.num_workers=0",
        "train.lr_schedule.warmup_steps=1",
        "train.logging.every=1",
        "train.eval.every=2",
        "train.eval.captions=2",
        "train.eval.caption_tokens=2",
        "trackers=[]",
        "world.rollout.inference_steps=2",
        *extra,
    ]
    return ["--config", str(ROOT / "configs" / "stage1_rollout.yaml"), *_sets(*sets)]


@pytest.mark.slow
def test_a_live_batch_carries_each_samples_seed_from_its_cache(rolled, tmp_path):
    from transformers import AutoProcessor

    from theworld.core.config import load_config
    from theworld.model.encoders import resolve_gemma
    from train.config import TrainConfig
    from train.data import cache as data
    from train.data import loader

    assert rollout.cache_seed(json.loads((rolled / "manifest.json").read_text())) == 7
    args = _stage(rolled, tmp_path / "run", "freeze.vae=false")[2:]
    cfg = load_config(TrainConfig, str(ROOT / "configs" / "stage1_rollout.yaml"), args[1::2])
    reader, inputs = data.open_cache(cfg)
    assert not inputs.cached_latents
    ctx = loader.DataContext.build(cfg, reader, inputs, AutoProcessor.from_pretrained(resolve_gemma("tiny")))
    batch = next(iter(loader.build_train_loader(cfg, ctx, 0, 1, epoch=0))).to("cpu")
    keys = [reader.key(int(i)) for i in rank_indices(*_order(cfg, ctx))[: batch.size]]
    assert batch.rollout_seeds.tolist() == rollout.sample_seeds(7, keys)
    held = next(iter(loader.build_eval_loader(cfg, ctx, 0, 1))).to("cpu")
    assert held.rollout_seeds is not None and held.partner["rollout_seeds"].shape == held.rollout_seeds.shape
    # cached latents (a frozen VAE): nothing to roll out, no seeds
    cfg.freeze.vae = True
    reader, inputs = data.open_cache(cfg)
    ctx = loader.DataContext.build(cfg, reader, inputs, AutoProcessor.from_pretrained(resolve_gemma("tiny")))
    assert next(iter(loader.build_train_loader(cfg, ctx, 0, 1, epoch=0))).to("cpu").rollout_seeds is None


def _order(cfg, ctx):
    samples = ctx.epoch_samples(cfg.seed, 0)
    return samples, cfg.seed, 0, cfg.train.global_batch_size, 0, 1, 0, ctx.buckets[samples]


@pytest.mark.slow
def test_precompute_inspect_train_evaluate_and_live_equals_cached(rolled, tmp_path, capsys):
    """The commands in process (their main(argv)); the precompute ran in the fixture."""
    from precompute import inspect
    from theworld import evaluate
    from theworld.infer import benchmark_items
    from train.loop import main as train

    assert inspect.main(["summary", str(rolled), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["world_steps"] == STEPS and summary["latent_frames"] == 1 + STEPS
    assert inspect.main(["compare-live", str(rolled), "--n", "4", "--json"]) == 0
    live = json.loads(capsys.readouterr().out)
    assert live["n"] == 4 and live["world_steps"] == STEPS
    # a rollout stage on the cached rollouts, evaluated with the shuffled-world gap
    cached = tmp_path / "cached"
    capsys.readouterr()
    assert train(_stage(rolled, cached, "train.eval.every=0")) == 0  # the eval after its last step alone
    printed = capsys.readouterr()
    assert "parameters trainable / total: projector" in printed.err + printed.out
    assert ", rollout " not in printed.err + printed.out  # every batch cached: the pipeline is not even loaded
    ev = [m for m in metrics(cached) if "eval_loss" in m]
    assert ev and all(math.isfinite(m["eval_loss"]) and math.isfinite(m["eval_loss_shuffled_world"]) for m in ev)
    # does imagining the future help? no_rollout with its paired test
    mc = tmp_path / "mc" / "items.jsonl"
    benchmark_items.make_synthetic(mc, 6)
    capsys.readouterr()
    assert evaluate.main(["--model", str(cached), "--data", str(mc), "--baselines", "all", "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["baselines"]["no_rollout"]
    assert 0 <= b["p_value"] <= 1 and "accuracy" in b
    # the VAE trains (stage 4): every batch rolls out live, with the cache's seeds: the same first-step loss
    # (no captions: the last eval's held-out loss already rolls out live; its captions checked nothing here)
    stage4 = tmp_path / "live"
    live_args = _stage(
        rolled, stage4, "freeze.vae=false", "train.max_steps=1", "train.eval.every=0", "train.eval.captions=0"
    )
    assert train(live_args) == 0
    printed = capsys.readouterr()
    assert re.search(r", rollout 0 / [0-9.]+ [kM]", printed.err + printed.out)  # loaded, frozen
    first = {run: next(m["loss"] for m in metrics(run) if "loss" in m) for run in (cached, stage4)}
    assert abs(first[cached] - first[stage4]) <= 1e-3, first
