"""Packed rows (theworld/model/packing.py): several samples in one row give the logits, loss and log-probabilities they
give one to a row, on multi-turn, two-image, rollout-shaped and LoRA batches; a sample never sees its neighbours; the
row plan's padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.theworld.model.test_objective import _cases, _inputs
from theworld.embedded.tiny import _gemma_config
from theworld.model import encoders, packing
from theworld.model.config import LoraConfig, WorldConfig
from theworld.model.text import ChatFormatter
from theworld.model.world import TheWorld


def _model(world: WorldConfig, lora: LoraConfig | None = None, attn: str = "sdpa") -> TheWorld:
    """A tiny TheWorld whose Gemma has a sliding-window layer (window 12, shorter than a world block) before its
    global one, so the per-sample window and the image tokens' two-way attention are both exercised."""
    from transformers import Gemma3ForConditionalGeneration

    _, processor = encoders.load_gemma("tiny", "float32")
    cfg = _gemma_config(processor.tokenizer, num_hidden_layers=2, sliding_window=12)
    cfg._attn_implementation = attn
    cfg.get_text_config()._attn_implementation = attn
    torch.manual_seed(0)
    gemma = Gemma3ForConditionalGeneration(cfg).eval()
    model = TheWorld.from_modules(gemma, encoders.load_vae("tiny", "float32"), world, lora=lora)
    if lora is not None:  # peft starts lora_B at zero: give the adapters something to say
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    model.processor = processor
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return {
        "plain": _model(WorldConfig()),
        "rollout": _model(WorldConfig(num_world_steps=2)),
        "lora": _model(WorldConfig(), LoraConfig(parts=["language"], r=4, alpha=8)),
        "eager": _model(WorldConfig(), attn="eager"),
    }


def _batch(models, case: str):
    """(model, unpacked inputs) of a case: 4 samples (the case's two rows, then again in the other order)."""
    model_name = {"rollout_shaped": "rollout", "lora": "lora", "eager": "eager"}.get(case, "plain")
    model = models[model_name]
    fmt = ChatFormatter(model.processor)
    rows, images, frames = _cases(fmt)["multi_turn" if case in ("lora", "eager") else case]
    return model, _inputs(model, rows + rows[::-1], fmt.pad_id, images, frames)


def _packed(inputs, rows):
    return dataclasses.replace(inputs, pack_rows=torch.tensor(rows))


def _real(inputs, logits):
    """The logits at every real (non-padding) position of the fused rows, in row order."""
    n_world = logits.shape[1] - inputs.input_ids.shape[1]
    mask = torch.cat([inputs.attention_mask[:, :1], inputs.attention_mask.new_ones(len(logits), n_world)], 1)
    mask = torch.cat([mask, inputs.attention_mask[:, 1:]], 1).bool()
    return logits[mask]


@pytest.mark.parametrize("case", ["multi_turn", "multi_image", "rollout_shaped", "lora", "eager"])
def test_packed_logits_loss_and_scores_equal_unpacked(models, case):
    model, inputs = _batch(models, case)
    with torch.no_grad():
        plain = model(inputs, return_logits=True)
        scores = model.answer_logprobs(inputs)
        for rows in ([0, 0, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0]):  # all in one row; two rows, either order
            packed = _packed(inputs, rows)
            out = model(packed, return_logits=True)
            assert (_real(inputs, out.logits) - _real(inputs, plain.logits)).abs().max() < 1e-5, rows
            assert out.num_tokens == plain.num_tokens
            assert torch.allclose(out.loss, plain.loss, atol=1e-6, rtol=1e-6)
            assert torch.allclose(model.answer_logprobs(packed), scores, atol=1e-4)


def test_packed_gradients_equal_unpacked(models):
    model, inputs = _batch(models, "lora")
    grads = []
    for batch in (inputs, _packed(inputs, [0, 0, 1, 1])):
        model.zero_grad()
        model(batch).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[0])
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_a_sample_never_attends_across_its_boundary(models):
    """Change one sample's text, world and image: in the row it shares, its neighbours' logits do not move."""
    model, inputs = _batch(models, "multi_turn")
    packed = _packed(inputs, [0, 0, 0, 0])
    changed = dataclasses.replace(
        packed,
        input_ids=packed.input_ids.clone(),
        latent_mean=packed.latent_mean.clone(),
        siglip=packed.siglip.clone(),
    )
    answer = inputs.labels[1] != -100  # its answer tokens become others (its image tokens stay where they are)
    changed.input_ids[1, answer] = (changed.input_ids[1, answer] + 7) % 200 + 20
    changed.latent_mean[1] += 1.0
    changed.siglip[1] += 1.0  # one image a row: block 1 is sample 1's
    with torch.no_grad():
        a, b = (_real(inputs, model(x, return_logits=True).logits) for x in (packed, changed))
    sizes = (inputs.attention_mask.sum(1) + model.projector.num_tokens(8, 8)).tolist()
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    moved = [(a[bounds[i] : bounds[i + 1]] - b[bounds[i] : bounds[i + 1]]).abs().max().item() for i in range(4)]
    assert moved[1] > 1e-3 and moved[0] == moved[2] == moved[3] == 0.0, moved


def test_the_plan_balances_rows_and_a_full_row_has_no_padding():
    assert packing.plan_rows([5, 3, 2], 10) == [0, 0, 0]
    assert packing.padding_share([5, 3, 2], [0, 0, 0]) == 0.0  # one full row
    rows = packing.plan_rows([6, 6, 4, 4, 2, 2], 12)
    fills = [sum(n for n, r in zip([6, 6, 4, 4, 2, 2], rows) if r == k) for k in range(max(rows) + 1)]
    assert sorted(fills) == [12, 12] and rows[0] == 0
    assert packing.plan_rows([30, 4, 4], 10) == [0, 1, 1]  # longer than a row: a row of its own
    assert packing.padding_share([4, 2], None) == 0.25  # unpacked: each row padded to the longest
    assert packing.plan_rows([3, 3, 3], 10) == packing.plan_rows([3, 3, 3], 10)


def test_under_sdpa_each_sample_attends_alone_and_unpacked_batches_keep_their_numerics():
    """sdpa packed rows give their layers each sample's place (row, first column, length) and its own mask (None
    where plain causal attention is the mask), not a row-wide mask; the switch to SEGMENTS leaves an unpacked batch's
    logits bitwise as they were."""
    model, inputs = _batch({"plain": _model(WorldConfig())}, "multi_turn")
    text = model.gemma.config.get_text_config()
    with torch.no_grad():
        before = model(inputs, return_logits=True).logits
        assert text._attn_implementation == "sdpa"
        fused = model.embed_inputs(inputs)
        rows = torch.tensor([0, 0, 1, 1])
        packed = packing.Packed(fused["attention_mask"], rows)
        masks = packed.masks(fused["token_type_ids"], text, torch.float32)
        model(_packed(inputs, rows.tolist()))
        after = model(inputs, return_logits=True).logits
    assert text._attn_implementation == packing.SEGMENTS and torch.equal(before, after)
    lengths = fused["attention_mask"].sum(1).tolist()
    places = [(r, s, n) for r, s, n, _ in masks["full_attention"].segments]
    assert places == [(0, 0, lengths[0]), (0, lengths[0], lengths[1]), (1, 0, lengths[2]), (1, lengths[2], lengths[3])]
    assert masks["full_attention"].width == packed.shape[1] == max(lengths[0] + lengths[1], lengths[2] + lengths[3])
    for (*_, n, full), (*_, _, sliding) in zip(masks["full_attention"].segments, masks["sliding_attention"].segments):
        assert full.shape == sliding.shape == (1, 1, n, n)  # image tokens: a mask of the sample's own size
        assert (
            full[0, 0].tril().equal(full[0, 0] & torch.ones(n, n, dtype=torch.bool).tril())
            and full.sum() > n * (n + 1) // 2
        )
        assert not sliding[0, 0, n - 1, : n - 12].any() and sliding[0, 0, n - 1, n - 12 :].all()  # the window of 12
    assert packing._sample_mask(torch.full((5,), -1), None) is None  # no image tokens: plain causal
    assert (
        packing._sample_mask(torch.full((5,), -1), 12) is None
        and packing._sample_mask(torch.full((13,), -1), 12) is not None
    )


def test_packed_gradients_equal_unpacked_under_activation_checkpointing():
    """Checkpointed layers rerun their attention in the backward, after the forward that switched to SEGMENTS."""
    from theworld.model import recompute

    lora = LoraConfig(parts=["language"], r=4, alpha=8, dropout=0.0)  # train mode: no dropout to differ by
    model, inputs = _batch({"lora": _model(WorldConfig(), lora)}, "lora")
    assert recompute.apply(model.train(), "full", parts=["language"])["language"] == 2
    grads = []
    for batch in (_packed(inputs, [0, 1, 1, 0]), inputs):
        model.zero_grad()
        model(batch).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[0])
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n
