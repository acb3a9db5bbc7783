"""theworld/model/inputs.py: ModelInputs round-trips through named tensors; prompt-only batches."""

from __future__ import annotations

import pytest
import torch

from theworld.model.inputs import PARTNER, ModelInputs, prompt_only, text_batch
from theworld.model.text import IGNORE, Encoded

I = IGNORE  # noqa: E741 - short, for the tables below


def test_model_inputs_round_trip_through_named_tensors_with_a_partner():
    g = torch.Generator().manual_seed(0)
    text = text_batch([Encoded([1, 2, 3], [I, 2, 3]), Encoded([1, 4], [I, 4])], 0)
    mean, other = torch.randn(2, 16, 1, 2, 2, generator=g), torch.randn(2, 16, 1, 2, 2, generator=g)
    inputs = text.with_inputs(latent_mean=mean, siglip=torch.randn(2, 4, 8, generator=g))
    inputs.partner, inputs.paired = {"latent_mean": other}, torch.tensor([True, False])
    tensors = inputs.to_tensors()
    assert set(tensors) == {"input_ids", "attention_mask", "labels", "latent_mean", "siglip", "paired"} | {
        PARTNER + "latent_mean"
    }
    back = ModelInputs.from_tensors(tensors)
    assert all(torch.equal(back.to_tensors()[k], t) for k, t in tensors.items())
    assert back.partner.keys() == {"latent_mean"} and back.size == 2
    # the model is given a batch without its partner; the shuffled-world batch has the partner's world only
    assert back.own_world().partner is None and back.own_world().paired is None
    shuffled = back.partner_world()
    assert torch.equal(shuffled.latent_mean, other) and torch.equal(shuffled.siglip, inputs.siglip)
    assert shuffled.partner is None and torch.equal(shuffled.labels, text.labels)
    assert text.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]] and text.labels.tolist() == [[I, 2, 3], [I, 4, I]]
    with pytest.raises(ValueError, match="batch key 'latents' is no model input"):
        ModelInputs.from_tensors({**tensors, "latents": mean})
    with pytest.raises(ValueError, match="'partner:siglip' is no model input"):
        ModelInputs.from_tensors({**tensors, PARTNER + "siglip": mean})
    with pytest.raises(ValueError, match="'labels' is no world or image input"):
        inputs.with_inputs(labels=text.labels)


def test_prompt_only_rows_are_the_prefixes_right_padded_without_labels():
    prompts = prompt_only([[2, 5, 6], [2, 7]], pad_id=0, latent_mean=torch.zeros(2, 16, 1, 2, 2))
    assert prompts.input_ids.tolist() == [[2, 5, 6], [2, 7, 0]] and prompts.labels is None
    assert prompts.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]] and prompts.latent_mean.shape[0] == 2
    answered = text_batch([Encoded([2, 5, 6, 8], [I, I, I, 8])], 0)
    behind = answered.behind(prompt_only([[2, 5, 6]], 0))
    assert behind.labels is None and behind.input_ids.tolist() == [[2, 5, 6]]
