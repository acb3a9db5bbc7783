"""world.rollout.condition: question (theworld/model/rollout.py, precompute, training's live rollouts): each sample's
rollout is conditioned on its question, never on an answer; cached equals live; a cache made under the other rule is
refused in one line; the default (fixed) leaves fingerprints as they were (run hashes: tests/train/test_config.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load

from precompute import pipeline
from tests._precompute_helpers import gradient, make_cfg, png_bytes, read_cache_plain
from tests.conftest import ROOT
from theworld import cache_format as cf
from theworld.cache_format.fingerprint import fingerprint_for
from theworld.core.config import load_config
from theworld.core.errors import CacheMismatch
from theworld.model import encoders, images, rollout
from theworld.model.config import ImageConfig, ModelConfig, RolloutConfig, WorldConfig
from train.config import TrainConfig
from train.data.cache import check_rollout_settings
from train.data.loader import rollout_item

STEPS = 2
QUESTION = ["world.rollout.condition=question"]
ROLL = [f"world.num_world_steps={STEPS}", "world.rollout.inference_steps=2"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _folder(root, rows: list[tuple[str, str, str]]):
    """A folder source: one picture under each name, captions.jsonl of (name, question, answer)."""
    root.mkdir(parents=True)
    picture = png_bytes(gradient(40, 32))
    for name, _, _ in rows:
        (root / name).write_bytes(picture)
    lines = [json.dumps({"image": n, "prompt": q, "caption": a}) for n, q, a in rows]
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _build(tmp, name, rows, *extra):
    src = _folder(tmp / f"{name}-src", rows)
    out = tmp / name
    sets = ["source.type=folder", f"source.path={src}", *ROLL, *extra]
    manifest = pipeline.run(make_cfg(out, *sets, n=len(rows), shard=4))
    return out, manifest


def _predicted(cache) -> torch.Tensor:
    """The predicted frames of the cache's one sample."""
    (member,) = read_cache_plain(cache).values()
    return st_load(member["latent.safetensors"])["mean"][:, 1:]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """One picture under one name; the same question with two answers, and another question (what reached the text
    encoder is recorded)."""
    from transformers import T5EncoderModel

    tmp = tmp_path_factory.mktemp("question")
    seen: list[torch.Tensor] = []

    def hook(module, args):
        if isinstance(module, T5EncoderModel):
            seen.append(args[0].clone())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        a = _build(tmp, "a", [("x.png", "What is on the left?", "a red square")], *QUESTION)
    finally:
        handle.remove()
    b = _build(tmp, "b", [("x.png", "What is on the left?", "a blue circle")], *QUESTION)
    c = _build(tmp, "c", [("x.png", "What colour is the sky?", "a red square")], *QUESTION)
    fixed = _build(tmp, "fixed", [("x.png", "What is on the left?", "a red square")])
    return {"a": a, "b": b, "c": c, "fixed": fixed, "seen": seen}


def test_one_image_one_question_rolls_out_alike_whatever_the_answer(caches):
    (a, _), (b, _) = caches["a"], caches["b"]
    assert torch.equal(_predicted(a), _predicted(b))


def test_one_image_and_another_question_rolls_out_otherwise(caches):
    (a, _), (c, _) = caches["a"], caches["c"]
    assert (_predicted(a) - _predicted(c)).abs().max() > 1e-2


def test_the_question_and_not_the_seed_changes_the_rollout(caches):
    """Same pixels, same seeds: the question alone moves the predicted frames; the answer never reaches the model."""
    vae = encoders.load_vae("tiny", "float32")
    pipe = rollout.Rollout.load("tiny", "float32", vae, STEPS, RolloutConfig(2, condition="question"))
    px = images.load_for_vae(png_bytes(gradient(40, 32)), 32)[0][None].repeat(2, 1, 1, 1)
    same = pipe(px, [7, 7], ["What is on the left?", "What is on the left?"])
    other = pipe(px, [7, 7], ["What is on the left?", "What colour is the sky?"])
    torch.testing.assert_close(same[0], same[1], rtol=0, atol=0)
    torch.testing.assert_close(other[0], same[0], rtol=0, atol=0)
    assert (other[1] - other[0]).abs().max() > 1e-3  # tiny random T5 and transformer: a small, real change
    with pytest.raises(ValueError, match="one question per image"):
        pipe(px, [7, 7])


def test_the_text_encoder_sees_the_question_never_the_answer(caches):
    from diffusers.pipelines.cosmos.pipeline_cosmos2_video2world import DEFAULT_NEGATIVE_PROMPT
    from transformers import AutoTokenizer

    from theworld.embedded import tiny

    tok = AutoTokenizer.from_pretrained(tiny.ensure(tiny.TINY_ROLLOUT_DIR) / "tokenizer")
    texts = [tok.decode(row, skip_special_tokens=True) for ids in caches["seen"] for row in ids]
    assert sorted(set(texts)) == sorted({DEFAULT_NEGATIVE_PROMPT, "What is on the left?"})
    assert not any("red square" in t for t in texts)


def test_the_cache_records_the_rule_and_the_default_records_none(caches):
    (_, m), (_, fixed) = caches["a"], caches["fixed"]
    assert m["fingerprint"]["world"]["condition"] == "question"
    assert "condition" not in fixed["fingerprint"]["world"]  # as caches made before the rule existed
    world = WorldConfig(num_world_steps=STEPS)
    assert "condition" not in fingerprint_for(ModelConfig(), ImageConfig(resolution=32), world=world)["world"]
    assert rollout.cache_condition(m) == "question" and rollout.cache_condition(fixed) == "fixed"
    # the seed covers the question
    assert rollout.sample_seed(0, "x", "q1") != rollout.sample_seed(0, "x", "q2") != rollout.sample_seed(0, "x")


def test_cached_equals_live_in_the_model_and_in_the_training_loader(caches):
    from theworld.model.world import TheWorld

    cache, _ = caches["a"]
    reader = cf.CacheReader(cache)
    sample = reader.sample(0, tensors=False)
    item = rollout_item(reader, 0, sample)  # what a live training batch carries
    assert rollout.questions_of(item["rollout_questions"][None]) == ["What is on the left?"]
    world = WorldConfig(num_world_steps=STEPS, rollout=RolloutConfig(inference_steps=2, condition="question"))
    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), world)
    px = images.load_for_vae(sample.image, 32)[0][None]
    with torch.no_grad():
        mean, _ = model.world_latents(
            px, None, None, item["rollout_seeds"][None], rollout_questions=item["rollout_questions"][None]
        )
    torch.testing.assert_close(mean[0, :, 1:], _predicted(cache), rtol=0, atol=1e-3)
    with pytest.raises(ValueError, match="each row's question"):
        model.world_latents(px, None, None)


def _train_cfg(*sets):
    return load_config(TrainConfig, None, [f"world.num_world_steps={STEPS}", "world.rollout.inference_steps=2", *sets])


def test_a_run_whose_rule_differs_from_its_cache_is_refused_in_one_line(caches):
    question_cache, fixed_cache = cf.CacheReader(caches["a"][0]), cf.CacheReader(caches["fixed"][0])
    check_rollout_settings(_train_cfg(*QUESTION), question_cache)
    check_rollout_settings(_train_cfg(), fixed_cache)
    for cfg, reader, cache_has in (
        (_train_cfg(), question_cache, "question"),
        (_train_cfg(*QUESTION), fixed_cache, "fixed"),
    ):
        with pytest.raises(CacheMismatch) as e:
            check_rollout_settings(cfg, reader)
        msg = str(e.value)
        assert "\n" not in msg and f'condition "{cache_has}"' in msg
        assert f'--set world.rollout.condition="{cache_has}"' in msg


@pytest.mark.slow
def test_a_stage_with_live_question_rollouts_trains_from_a_question_cache(tmp_path, capsys):
    """freeze.vae: false encodes and rolls out live: each sample's question travels with its pixels through the
    loader's batch (as bytes) to the pipeline; a run under the other rule is refused before a step."""

    from train.loop import main

    rows = [(f"s{k}.png", f"Question number {k}?" + " and more" * k, f"answer {k}") for k in range(4)]
    cache, _ = _build(tmp_path, "q4", rows, *QUESTION)
    config = ROOT / "configs" / "stage1_rollout.yaml"
    sets = {
        "cache_dir": cache,
        "output_dir": tmp_path / "run",
        "image.resolution": 32,
        "world.rollout.inference_steps": 2,
        "world.rollout.condition": "question",
        "freeze.vae": "false",
        "train.max_steps": 1,
        "train.global_batch_size": 4,
        "train.micro_batch_size": 4,
        "train.eval.samples": 0,
        "train.eval.every": 0,
        "train.loader.num_workers": 0,
        "trackers": "[]",
    }
    argv = ["--config", str(config)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert main(argv) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in x and x["loss"] == x["loss"] for x in lines)
    capsys.readouterr()
    fixed = argv + ["--set", "world.rollout.condition=fixed", "--set", f"output_dir={tmp_path / 'run2'}"]
    assert main(fixed) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'condition "question"' in err[0]
