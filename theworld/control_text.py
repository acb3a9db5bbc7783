"""Gemma 3's control strings: text that its tokenizer turns into a control token wherever it appears.

A caption or prompt holding one would be tokenised as a turn marker, an image placeholder or a padding token instead
of as text (an `<image_soft_token>` in a caption makes the image-token count disagree with the image features, so
training stops at that sample on every rerun). Precompute refuses such samples; this is the one list it checks.

The set is Gemma 3's special tokens: the ones `tokenizer.all_special_tokens` and the `special=True` added tokens of
the released tokenizer (`google/gemma-3-4b-it`) name, plus its reserved `<unusedN>` tokens. Its ordinary added tokens
(HTML tags such as `<table>`, runs of spaces) are left alone: they tokenise the same text either way.
"""
from __future__ import annotations

import re

CONTROL_STRINGS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]", "<start_of_turn>", "<end_of_turn>",
                   "<start_of_image>", "<end_of_image>", "<image_soft_token>")
_PATTERN = re.compile("|".join(re.escape(s) for s in CONTROL_STRINGS) + r"|<unused\d+>")


def find_control_string(text: str) -> str | None:
    """The first Gemma control string in `text`, or None."""
    m = _PATTERN.search(text)
    return m.group(0) if m else None
