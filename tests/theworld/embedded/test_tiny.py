"""The tiny models: built once where THEWORLD_MODELS points, the same bytes on every machine, never half-written;
the tokenizer and chat template Gemma's processor uses."""

from __future__ import annotations

import os

import pytest

from theworld.core import atomic
from theworld.embedded import synthetic, tiny


def test_models_live_where_theworld_models_points(monkeypatch, tmp_path):
    monkeypatch.setenv("THEWORLD_MODELS", str(tmp_path))
    assert tiny.models_root() == tmp_path
    monkeypatch.delenv("THEWORLD_MODELS")
    assert tiny.models_root() == tiny.Path("cache/models")


def test_a_built_model_is_returned_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv("THEWORLD_MODELS", str(tmp_path))
    (tmp_path / tiny.TINY_VAE_DIR).mkdir()
    assert tiny.ensure(tiny.TINY_VAE_DIR) == tmp_path / tiny.TINY_VAE_DIR
    assert list((tmp_path / tiny.TINY_VAE_DIR).iterdir()) == []  # nothing was built into it


def test_gemma_builds_into_place_with_the_same_bytes_and_a_killed_build_is_cleared(monkeypatch, tmp_path):
    shipped = tiny.ensure(tiny.TINY_GEMMA_DIR)  # the session's (built here if this test runs first)
    monkeypatch.setenv("THEWORLD_MODELS", str(tmp_path))
    dead = tmp_path / atomic.partial_name(tiny.TINY_GEMMA_DIR, pid=2**22 + 7)  # no such process
    dead.mkdir()
    (dead / "half").write_bytes(b"x")
    path = tiny.ensure(tiny.TINY_GEMMA_DIR)
    assert path == tmp_path / tiny.TINY_GEMMA_DIR and sorted(os.listdir(tmp_path)) == [tiny.TINY_GEMMA_DIR]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (path / name).read_bytes() == (shipped / name).read_bytes(), name


def test_an_unknown_tiny_model_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("THEWORLD_MODELS", str(tmp_path))
    with pytest.raises(KeyError):
        tiny.ensure("tiny-nothing")


def test_the_tokenizer_round_trips_captions_and_renders_gemmas_turns():
    tok = tiny._build_tokenizer()
    caption = synthetic.scene(3, 5)[1]
    assert tok.decode(tok(caption)["input_ids"]) == caption
    assert tok.convert_ids_to_tokens(list(range(len(tiny.SPECIAL_TOKENS)))) == tiny.SPECIAL_TOKENS
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is here? "}]},
        {"role": "assistant", "content": "a red ball"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\n<start_of_image>What is here?<end_of_turn>\n"
        "<start_of_turn>model\na red ball<end_of_turn>\n<start_of_turn>model\n"
    )


def test_the_gemma_config_keeps_gemmas_query_scale_at_any_head_size():
    tok = tiny._build_tokenizer()
    config = tiny._gemma_config(tok, head_dim=16, num_hidden_layers=2)
    text = config.text_config
    assert text.query_pre_attn_scalar == 16 and text.num_hidden_layers == 2 and len(text.layer_types) == 2
    assert text.vocab_size == len(tok) and config.image_token_index == tok.convert_tokens_to_ids("<image_soft_token>")
    assert tiny._gemma_config(tok).text_config.query_pre_attn_scalar == 32
