"""Gemma 3's control strings: text that its tokenizer turns into a control token wherever it appears.

A caption or prompt holding one would be tokenised as a turn marker, an image placeholder or a padding token instead
of as text (an `<image_soft_token>` in a caption makes the image-token count disagree with the image features, so
training stops at that sample on every rerun). This is the one rule: precompute records such samples as errors, the
cache writer marks a shard whose captions and prompts all pass it with TEXT_RULE in its sidecar, training refuses a
cache whose unmarked shards hold one, the benchmark reader and theworld.describe refuse such questions and prompts,
and ChatFormatter refuses such text wherever it comes from.

The set is Gemma 3's special tokens: the ones `tokenizer.all_special_tokens` and the `special=True` added tokens of
the released tokenizer (`google/gemma-3-4b-it`) name, plus its reserved `<unusedN>` tokens. Its ordinary added tokens
(HTML tags such as `<table>`, runs of spaces) are left alone: they tokenise the same text either way.
"""

from __future__ import annotations

import re

CONTROL_STRINGS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "[@BOS@]",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
TEXT_RULE = "gemma3-control-strings"  # a sidecar's "text_rule": its shard's captions and prompts pass this rule
_PATTERN = re.compile("|".join(re.escape(s) for s in CONTROL_STRINGS) + r"|<unused\d+>")


def find_control_string(text: str) -> str | None:
    """The first Gemma control string in `text`, or None."""
    m = _PATTERN.search(text)
    return m.group(0) if m else None


class ControlText(ValueError):
    """A caption, prompt, question or choice holding a Gemma control string."""


def control_problem(text: str, what: str) -> str | None:
    """Why `text` (a caption, prompt...: `what`) cannot be given to Gemma as text, or None."""
    control = find_control_string(text)
    return None if control is None else f"{what} holds the Gemma control string {control!r}"


# Longer text is refused wherever it enters (captions and prompts in precompute, questions, choices and prompts at
# inference): tens of thousands of tokens are not a caption, and one such text makes a batch of that length.
MAX_TEXT_CHARS = 1 << 16


def text_problem(text: str, what: str) -> str | None:
    """Why `text` cannot be given to Gemma as one caption, prompt, question or choice (too long, or holding a control
    string), or None."""
    if len(text) > MAX_TEXT_CHARS:
        return f"{what} too long: {len(text)} characters (> {MAX_TEXT_CHARS})"
    return control_problem(text, what)


def check_text(text: str, what: str) -> str:
    """`text`, or ControlText naming the control string it holds."""
    if problem := control_problem(text, what):
        raise ControlText(problem)
    return text
