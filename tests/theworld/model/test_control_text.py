"""theworld/model/control_text.py: Gemma's control strings, refused in captions and prompts, cover the tokenizer's
special tokens."""

from __future__ import annotations


def test_control_string_list_covers_the_tokenizers_special_tokens():
    """theworld.model.control_text is a written list (precompute must not need Gemma's tokenizer): it names every
    special
    token of the tiny Gemma tokenizer, which is built with the real one's control tokens."""
    from theworld.model import encoders
    from theworld.model.control_text import find_control_string

    _, processor = encoders.load_gemma("tiny", "float32")
    tok = processor.tokenizer
    special = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values() if t.special}
    assert {"<start_of_image>", "<end_of_turn>", "<image_soft_token>"} <= special
    assert all(find_control_string(f"a {s} b") == s for s in special)
