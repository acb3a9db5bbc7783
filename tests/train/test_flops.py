"""train/flops.py against a hand count, MFU's formula and the device table, and the throughput figures of a log line
(train/metrics.py): tokens/s, padding share, mfu only with a peak."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from train.flops import FlopCounter, mfu, peak_tflops
from train.metrics import peak_memory, throughput

TEXT = SimpleNamespace(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    sliding_window=64,
    vocab_size=512,
    layer_types=["sliding_attention", "full_attention"],
)
VISION = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=1, image_size=32, patch_size=8)


def counter(**kw) -> FlopCounter:
    base = dict(
        text=TEXT,
        vision=None,
        mm_tokens=4,
        language_trains=False,
        vision_trains=False,
        vision_weights_train=False,
        projector_params=16 * 64,
    )
    return FlopCounter(**{**base, **kw})


def test_stage1_step_flops_equal_a_hand_count():
    # per layer: q 64x64, k 64x32, v 64x32, o 64x64 = 12288; MLP 3 x 64 x 128 = 24576; two layers: P = 73728
    # attention per token at 100 tokens a row: 4 x 2 heads x 32 x (64 on the local layer + 100 on the global) = 41984
    # frozen language model: forward 2P + A = 189440, input gradients 2P + 2A = 231424: 420864 per token
    # the head on 10 answer tokens: forward and input gradient, 2 x (2 x 512 x 64) = 131072 each
    # the projector (16 -> 64) on 20 world tokens: 6 x 1024 each
    hand = 200 * 420864 + 10 * 131072 + 20 * 6 * 1024
    assert counter().step(tokens=200, rows=2, answer_tokens=10, images=0, world_tokens=20) == hand == 85_606_400


def test_trained_language_model_adds_its_weight_gradients_and_live_images_their_tower():
    frozen = counter().step(200, 2, 10, 0, 20)
    # weight gradients: 2P per token, and the head's 2 x 512 x 64 per answer token
    assert counter(language_trains=True).step(200, 2, 10, 0, 20) - frozen == 200 * 2 * 73728 + 10 * 65536
    # SigLIP forward per image: 16 patches x (patch embedding 3 x 8 x 8 x 32 + a layer's 4 x 32^2 + 2 x 32 x 64)
    # + the multimodal projector 4 tokens x 32 x 64, doubled; attention 4 x 32 x 16 x 16
    weights = 16 * (6144 + 8192) + 4 * 32 * 64
    per_image = 2 * weights + 4 * 32 * 16 * 16
    assert counter(vision=VISION).step(200, 2, 10, 3, 20) - frozen == 3 * per_image
    trains = counter(vision=VISION, vision_trains=True, vision_weights_train=True).step(200, 2, 10, 3, 20) - frozen
    assert trains == 3 * (per_image + 2 * weights + 2 * 4 * 32 * 16 * 16 + 2 * weights)


def test_mfu_formula_and_device_peaks():
    assert mfu(1e15, 2.0, 250.0, 2) == pytest.approx(1.0)
    assert mfu(989e12 * 0.5, 1.0, 989.0, 1) == pytest.approx(0.5)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("Some Future GPU") is None
    assert peak_tflops("Some Future GPU", configured=123.0) == 123.0


def out(real: int, positions: int) -> dict:
    return dict(real_tokens=real, positions=positions, rows=4, tokens=8, images=0, world_tokens=40)


def test_throughput_line():
    line = throughput([out(300, 400), out(100, 100)], seconds=2.0)
    assert line == {"tokens_per_s": 200.0, "padding_share": pytest.approx(0.2)}  # no peak: no mfu
    c = counter()
    with_peak = throughput([out(400, 400)], seconds=0.5, flops=c, peak=1e-3, processes=2)
    assert with_peak["padding_share"] == 0.0  # a full row has no padding
    assert with_peak["mfu"] == pytest.approx(c.step(400, 4, 8, 0, 40) / 0.5 / (1e9 * 2))
    assert peak_memory()["peak_memory_gb"] > 0  # this process's peak resident memory on a CPU


def test_token_counts_of_a_padded_and_a_packed_batch():
    """train.step.token_counts: real tokens by the attention mask plus each sample's world block; all positions are
    the padded batch's, or the packed rows' (a row filled to the full width has no padding)."""
    import torch

    from theworld.model.inputs import ModelInputs
    from train.step import token_counts

    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    model = SimpleNamespace(projector=SimpleNamespace(num_tokens=lambda h, w: 2))
    latents = torch.zeros(3, 16, 1, 2, 2)

    def counts(rows):
        inputs = ModelInputs(input_ids=torch.zeros_like(mask), attention_mask=mask, latent_mean=latents, pack_rows=rows)
        return token_counts(model, inputs).tolist()

    assert counts(None) == [10 + 6, 3 * (6 + 2), 6]  # padded to the longest: 24 slots for 16 real tokens
    assert counts(torch.tensor([0, 1, 1])) == [16, 2 * 8, 6]  # rows of 8 and 4 + 4: two full rows, no padding
    assert counts(torch.tensor([0, 0, 1])) == [16, 2 * 12, 6]  # rows of 12 and 4: the second padded to 12
