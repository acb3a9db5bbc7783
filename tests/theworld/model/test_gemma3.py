"""theworld/model/gemma3.py: the layer pattern of the released Gemma 3 sizes."""

from __future__ import annotations


def test_layer_types_follow_the_released_gemma3_pattern():
    from transformers import Gemma3TextConfig

    from theworld.model import gemma3

    for n in (6, 12, 26, 34, 48, 62):  # the released sizes' depths among them; transformers' own derivation
        assert gemma3.layer_types(n) == Gemma3TextConfig(num_hidden_layers=n).layer_types, n
    real = gemma3.layer_types(34)
    assert [i + 1 for i, t in enumerate(real) if t == "full_attention"] == [6, 12, 18, 24, 30]
    # below 6 layers the released rule has no global layer; the tiny models make their last one global
    assert gemma3.layer_types(1) == ["full_attention"]
    assert gemma3.layer_types(4) == ["sliding_attention"] * 3 + ["full_attention"]
