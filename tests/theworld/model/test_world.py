"""TheWorld model semantics on the tiny embedded Gemma 3 and Wan VAE."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests._rollout_helpers import random_latents
from theworld.embedded import synthetic
from theworld.infer import baselines
from theworld.model import images
from theworld.model.config import FreezeConfig, ModelConfig, WorldConfig
from theworld.model.inputs import text_batch
from theworld.model.objective import IGNORE
from theworld.model.text import ChatFormatter
from theworld.model.world import TheWorld, compile_language_layers

CAPTIONS = [
    "top left red circle .",
    "top right blue square . bottom left green cross . bottom right white triangle .",
    "top left purple cross . bottom right yellow square .",
]


def build(world: WorldConfig | None = None, freeze: FreezeConfig | None = None):
    return TheWorld.from_config(ModelConfig(dtype="float32"), world or WorldConfig(), freeze or FreezeConfig(), seed=0)


@pytest.fixture(scope="module")
def tiny():
    return build()


def batch_for(model, processor, captions=CAPTIONS, seed=0):
    fmt = ChatFormatter(processor)
    batch = text_batch([fmt.encode(synthetic.PROMPT, c) for c in captions], fmt.pad_id)
    pixels = torch.stack([images.to_uint8_tensor(synthetic.scene(seed, i)[0]) for i in range(len(captions))])
    with torch.no_grad():
        mean, logvar = model.world_encoder(pixels)
    siglip = torch.randn(
        len(captions), 4, model.gemma.config.text_config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    return batch, pixels, mean, logvar, siglip


def per_row_loss(model, batch, mean, logvar, siglip):
    out = model(batch.with_inputs(latent_mean=mean, latent_logvar=logvar, siglip=siglip), return_logits=True)
    n_world = out.logits.shape[1] - batch.input_ids.shape[1]
    labels = torch.cat([batch.labels[:, :1], torch.full((len(mean), n_world), IGNORE), batch.labels[:, 1:]], 1)
    ce = F.cross_entropy(out.logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none", ignore_index=IGNORE)
    return out, ce.sum(1) / (labels[:, 1:] != IGNORE).sum(1)


def test_labels_cover_exactly_the_answer(tiny):
    model, processor = tiny
    fmt = ChatFormatter(processor)
    tok = processor.tokenizer
    enc = [fmt.encode(synthetic.PROMPT, c) for c in CAPTIONS]
    batch = text_batch(enc, fmt.pad_id)
    assert len({len(e.input_ids) for e in enc}) == 3  # rows really differ in length
    for row, caption in enumerate(CAPTIONS):
        ids, labels, mask = batch.input_ids[row], batch.labels[row], batch.attention_mask[row]
        answer = labels[labels != IGNORE].tolist()
        assert tok.decode(answer[:-1]).strip() == caption
        assert answer[-1] == tok.convert_tokens_to_ids("<end_of_turn>")
        # the answer is a contiguous span right after "<start_of_turn>model\n", and padding is masked and unlabelled
        first = int((labels != IGNORE).nonzero()[0])
        assert tok.decode(ids[:first]).endswith("<start_of_turn>model\n")
        assert (ids[mask == 0] == fmt.pad_id).all() and (labels[mask == 0] == IGNORE).all()
        assert int(mask.sum()) == len(enc[row].input_ids) and mask[: int(mask.sum())].all()
        # image tokens present, none labelled
        is_image = ids == model.image_token_id
        assert int(is_image.sum()) == 4 and (labels[is_image] == IGNORE).all()


def test_fused_sequence_layout(tiny):
    model, processor = tiny
    batch, _, mean, logvar, siglip = batch_for(model, processor)
    world = model.projector(mean, logvar)
    fused = model.fuse(batch.input_ids, batch.attention_mask, world, siglip)
    n_world = world.shape[1]
    assert n_world == 8 * 8 + 2  # 64 px -> 8x8 latent -> 64 tokens, plus start/end of world
    emb = model.gemma.get_input_embeddings()
    text = emb(batch.input_ids)
    e = fused["inputs_embeds"]
    assert torch.equal(e[:, 0], text[:, 0])  # BOS first
    assert torch.allclose(e[:, 1 : 1 + n_world], world)  # then SOW, W1..WN, EOW
    assert torch.allclose(e[:, 1], model.projector.sow * model.projector.embed_scale)
    assert torch.allclose(e[:, n_world], model.projector.eow * model.projector.embed_scale)
    # the rest is the text, with the SigLIP features scattered into the image-token positions
    rest, is_image = e[:, 1 + n_world :], batch.input_ids[:, 1:] == model.image_token_id
    assert torch.allclose(rest[~is_image], text[:, 1:][~is_image])
    assert torch.allclose(rest[is_image].view(3, 4, -1), siglip)
    # per-row positions: 0..len-1 over real tokens, mask and token types aligned
    lengths = batch.attention_mask.sum(1) + n_world
    for row in range(3):
        n = int(lengths[row])
        assert fused["attention_mask"][row, :n].all() and not fused["attention_mask"][row, n:].any()
        assert torch.equal(fused["position_ids"][row, :n], torch.arange(n))
    assert torch.equal(fused["token_type_ids"][:, 1 + n_world :].bool(), is_image)
    assert not fused["token_type_ids"][:, : 1 + n_world].any()


def test_world_latents_reach_the_loss(tiny):
    model, processor = tiny
    batch, _, mean, logvar, siglip = batch_for(model, processor)
    model.zero_grad()
    out, rows = per_row_loss(model, batch, mean, logvar, siglip)
    out.loss.backward()
    grads = [p.grad for p in model.projector.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("projector."))
    perm = torch.tensor([1, 2, 0])
    with torch.no_grad():
        _, shuffled = per_row_loss(model, batch, mean[perm], logvar[perm], siglip)
    assert ((rows.detach() - shuffled).abs() > 1e-4).all()
    # loss normalisation: the summed CE over answer tokens divided by the (caller's) global count
    assert torch.allclose(out.loss, out.loss_sum / out.num_tokens)
    half = model(batch.with_inputs(latent_mean=mean, latent_logvar=logvar, siglip=siglip), num_items=2 * out.num_tokens)
    assert torch.allclose(half.loss, out.loss / 2)


def test_live_vae_and_cached_latents_give_the_same_loss(tiny):
    model, processor = tiny
    batch, pixels, mean, logvar, siglip = batch_for(model, processor)
    with torch.no_grad():
        cached = model(batch.with_inputs(latent_mean=mean, latent_logvar=logvar, siglip=siglip)).loss
        live = model(batch.with_inputs(images=pixels, siglip=siglip)).loss
    assert torch.equal(cached, live)


def test_sample_mode_is_reproducible_per_sample_and_differs_from_mean(tiny):
    model, processor = tiny
    _, _, mean, logvar, _ = batch_for(model, processor)
    proj = model.projector
    a = proj(mean, logvar, "sample", [3, 4, 5])
    b = proj(mean, logvar, "sample", [3, 4, 5])
    c = proj(mean, logvar, "sample", [6, 4, 5])
    m = proj(mean, logvar, "mean")
    assert torch.equal(a, b) and not torch.equal(a[0], c[0]) and not torch.equal(a, m)
    # a sample's noise is its seed's alone: the same on its own as in a batch
    assert torch.equal(a[1:2], proj(mean[1:2], logvar[1:2], "sample", [4]))
    assert torch.equal(a[1:], c[1:])
    # the noise is exp(logvar / 2) * eps: with a huge negative logvar, sampling collapses onto the mean
    assert torch.allclose(proj(mean, torch.full_like(logvar, -60.0), "sample", [3, 4, 5]), m, atol=1e-6)
    with pytest.raises(ValueError, match="one noise seed per sample"):
        proj(mean, logvar, "sample", [3])


@pytest.mark.parametrize("pool,tokens", [(1, 64), (2, 16), (4, 4)])
def test_pool_sets_the_number_of_world_tokens(tiny, pool, tokens):
    model, processor = tiny
    _, _, mean, logvar, _ = batch_for(model, processor)
    proj = model.projector
    from theworld.model.projector import WorldProjector

    pooled = WorldProjector(128, proj.latents_mean.flatten(), proj.latents_std.flatten(), pool=pool)
    out = pooled(mean, logvar)
    assert out.shape == (3, tokens + 2, 128)
    # pooling is an average over pool x pool latent cells, taken after normalisation
    z = (mean[:, :, 0] - proj.latents_mean) / proj.latents_std
    expected = pooled.net(F.avg_pool2d(z, pool).flatten(2).transpose(1, 2)) * pooled.embed_scale
    assert torch.allclose(out[:, 1:-1], expected, atol=1e-6)


def test_projector_output_sits_at_the_text_embedding_scale(tiny):
    model, processor = tiny
    batch, _, mean, logvar, _ = batch_for(model, processor)
    with torch.no_grad():
        world = model.projector(mean, logvar)[:, 1:-1]
        text = model.gemma.get_input_embeddings()(batch.input_ids)
    ratio = world.pow(2).mean().sqrt() / text.pow(2).mean().sqrt()
    assert 0.2 < float(ratio) < 5.0


@pytest.mark.parametrize("vision,language,vae", list(itertools.product([True, False], repeat=3)))
def test_every_freeze_combination_trains_exactly_the_expected_parts(tiny, vision, language, vae):
    model, _ = tiny
    model.set_freeze(FreezeConfig(vision=vision, language=language, vae=vae))
    try:
        expect_prefixes = ["projector."]
        if not vision:
            expect_prefixes += ["gemma.model.vision_tower.", "gemma.model.multi_modal_projector."]
        if not language:
            expect_prefixes += ["gemma.model.language_model.", "gemma.lm_head."]
        if not vae:
            expect_prefixes += ["world_encoder.vae."]
        for name, p in model.named_parameters():
            on_path = not TheWorld.OFF_PATH.match(name)
            assert p.requires_grad == (name.startswith(tuple(expect_prefixes)) and on_path), name
    finally:
        model.set_freeze(FreezeConfig())


def test_the_parameters_that_stay_frozen_are_exactly_those_the_loss_never_reaches():
    """DDP fails on a parameter that trains but gets no gradient. With every parameter trainable and every input
    live, the ones the loss never reaches are exactly OFF_PATH's, and the freeze flags leave only those frozen."""
    model, processor = build(freeze=FreezeConfig(vision=False, language=False, vae=False))
    off_path = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert off_path == {n for n, _ in model.named_parameters() if TheWorld.OFF_PATH.match(n)}
    model.requires_grad_(True)
    batch, pixels, _, _, _ = batch_for(model, processor)
    pixel_values = processor.image_processor(images=list(pixels), return_tensors="pt")["pixel_values"]
    model(batch.with_inputs(images=pixels, pixel_values=pixel_values)).loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is None} == off_path
    assert any(n.startswith("world_encoder.vae.encoder.") and "time_conv" in n for n in off_path)


def test_trainable_save_load_round_trip_is_exact(tmp_path):
    model, _ = build(freeze=FreezeConfig(vision=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    path = tmp_path / "trainable.safetensors"
    model.save_trainable(path)
    fresh, _ = build(freeze=FreezeConfig(vision=False))
    report = fresh.load_trainable(path)
    assert report.new == [] and report.ignored == [] and len(report.loaded) == len(model.trainable_state_dict())
    for (n, a), (m, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    # a stage-1 file into a stage-2 model: projector loaded, vision parts reported as new
    stage1, _ = build()
    stage1.save_trainable(tmp_path / "s1.safetensors")
    report = fresh.load_trainable(tmp_path / "s1.safetensors", strict=False)
    assert all(n.startswith("projector.") for n in report.loaded) and report.loaded
    assert report.new and all("vision_tower" in n or "multi_modal" in n for n in report.new)


def test_load_trainable_rejects_wrong_shapes(tmp_path):
    from safetensors.torch import save_file

    from theworld.core.errors import UserError

    model, _ = build()
    bad = dict(model.trainable_state_dict())
    bad["projector.sow"] = torch.zeros(7)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(UserError, match="projector.sow"):
        model.load_trainable(tmp_path / "bad.safetensors")


def test_tiny_gemma_saved_and_reloaded_gives_identical_logits(tmp_path):
    from transformers import Gemma3ForConditionalGeneration

    from theworld.model.encoders import load_gemma

    gemma, processor = load_gemma("tiny", "float32")
    gemma.save_pretrained(tmp_path / "copy")
    processor.save_pretrained(tmp_path / "copy")
    again, processor2 = load_gemma(str(tmp_path / "copy"), "float32")
    assert isinstance(again, Gemma3ForConditionalGeneration)
    ids = torch.tensor([processor.tokenizer("<bos>top left red circle .", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.equal(gemma(input_ids=ids).logits, again(input_ids=ids).logits)
    assert processor2.tokenizer("a red cross").input_ids == processor.tokenizer("a red cross").input_ids


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-wan-vae"])
def test_tiny_models_are_deterministic(tmp_path, monkeypatch, name):
    """Two builds from scratch give the same files (weights bit for bit, tokenizer, configs), so every machine's
    `tiny` is the same model."""
    from safetensors.torch import load_file

    from theworld.embedded import tiny

    builds = []
    for root in (tmp_path / "first", tmp_path / "second"):
        monkeypatch.setenv("THEWORLD_MODELS", str(root))
        builds.append(tiny.ensure(name))
    files = sorted(p.name for p in builds[0].iterdir())
    assert files == sorted(p.name for p in builds[1].iterdir()) and any(f.endswith(".safetensors") for f in files)
    for f in files:
        a, b = builds[0] / f, builds[1] / f
        if f.endswith(".safetensors"):
            ta, tb = load_file(str(a)), load_file(str(b))
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f
        else:
            assert a.read_bytes() == b.read_bytes(), f


def test_bf16_base_models_with_fp32_projector():
    model, processor = TheWorld.from_config(ModelConfig(dtype="bfloat16"), WorldConfig(), FreezeConfig(), seed=0)
    assert model.gemma.dtype == torch.bfloat16 and model.world_encoder.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.projector.parameters())
    batch, pixels, mean, logvar, siglip = batch_for(model, processor)
    out = model(batch.with_inputs(images=pixels, siglip=siglip.bfloat16()))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.projector.net[0].weight.grad.dtype == torch.float32
    # unfreezing a part gives it fp32 master weights; frozen parts stay bf16
    model.set_freeze(FreezeConfig(vision=False))
    model.cast_trainable_to_fp32()
    assert model.gemma.model.vision_tower.dtype == torch.float32
    assert model.gemma.model.language_model.embed_tokens.weight.dtype == torch.bfloat16


def test_gradient_checkpointing_gives_the_same_gradients():
    model, processor = build(freeze=FreezeConfig(language=False))
    batch, _, mean, logvar, siglip = batch_for(model, processor)
    model.train()
    grads = []
    for enable in (False, True):
        model.zero_grad()
        model.gradient_checkpointing(enable)
        model(batch.with_inputs(latent_mean=mean, latent_logvar=logvar, siglip=siglip)).loss.backward()
        grads.append(model.projector.net[0].weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_language_layers_give_the_same_loss_and_gradients(checkpointing):
    """train.hardware.compile: per-layer torch.compile (traced through aot_eager here: the same graph capture and
    autograd as on a GPU, without a C++ toolchain) changes neither the loss nor the projector's gradients, with or
    without gradient checkpointing around the compiled layers."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, processor = build()
    batch, _, mean, logvar, siglip = batch_for(model, processor)
    model.train()
    model.gradient_checkpointing(checkpointing)
    results = []
    for compiled in (False, True):
        if compiled:
            assert compile_language_layers(model.gemma, backend="aot_eager") == len(
                model.gemma.model.language_model.layers
            )
        model.zero_grad()
        loss = model(batch.with_inputs(latent_mean=mean, latent_logvar=logvar, siglip=siglip)).loss
        loss.backward()
        results.append((loss.detach(), model.projector.net[0].weight.grad.clone()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 1  # the layers really ran through a captured graph


@pytest.fixture(scope="module")
def bucketed():
    from theworld.model.config import ImageConfig, ModelConfig, WorldConfig
    from theworld.model.world import TheWorld

    image = ImageConfig(resolution=96, resize="bucket")
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), image=image)
    return model.eval(), processor, image


def _scenes_of_two_aspect_ratios(root) -> list:
    from theworld.embedded import synthetic

    paths = []
    for i, size in enumerate([(128, 64), (64, 128)]):
        img = synthetic.scene(3, i, size=64)[0].resize(size)
        paths.append(root / f"{i}.png")
        img.save(paths[-1])
    return paths


def test_a_bucketed_model_describes_images_of_any_aspect_ratio_as_it_would_one_by_one(tmp_path, bucketed):
    from theworld.model import images

    model, _, image = bucketed
    paths = _scenes_of_two_aspect_ratios(tmp_path)
    assert len({images.input_size(p, image.resolution, image.resize) for p in paths}) == 2
    together = model.generate(paths, "describe", max_new_tokens=2)
    assert together == [model.generate([p], "describe", max_new_tokens=2)[0] for p in paths]
    shuffled = model.generate(paths, "describe", max_new_tokens=2, world_images=paths[::-1])  # each the other's world
    assert shuffled[0] == model.generate(paths[:1], "describe", max_new_tokens=2, world_images=paths[1:])[0]


def test_a_bucketed_model_scores_items_of_any_aspect_ratio_batched_as_one_by_one(tmp_path, bucketed):
    from theworld.infer import benchmark_items
    from theworld.infer.scoring import Scorer

    model, processor, image = bucketed
    paths = _scenes_of_two_aspect_ratios(tmp_path)
    items = [benchmark_items.Item(f"item {i}", [p], "which?", ["red", "green"], i) for i, p in enumerate(paths)]
    scorer = Scorer(model, processor, image, items)
    batched = scorer.score([0, 1])
    alone = [scorer.score([i])[0] for i in range(2)]
    for together, one in zip(batched, alone):
        assert set(together) == {"model", "shuffled_world"}, together
        for cond in together:
            assert together[cond] == pytest.approx(one[cond], abs=1e-4)
    assert batched[0]["model"] != batched[0]["shuffled_world"]  # the partner's world: another picture, another shape


def test_no_rollout_is_the_model_given_the_observed_frame_alone():
    """The no_rollout condition: the world block of frame 0 with temporal row 0, i.e. the N = 0 model's world block
    of frame 0 plus row 0 (and exactly the N = 0 model when row 0 is zero)."""
    rollout, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(num_world_steps=2), seed=0)
    plain, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
    fmt = ChatFormatter(processor)
    mean = rollout.projector.latents_mean[:, :, None] + random_latents(2, 3, side=8)
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
