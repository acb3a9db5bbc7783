"""ChatFormatter's shortcuts (spliced template, direct batched Rust tokenizer, per-prompt head) give exactly the
general path's ids."""

from __future__ import annotations

import pytest

from theworld.model.encoders import load_gemma
from theworld.model.text import ChatFormatter

CAPTIONS = ["top left red circle .", "  spaced  ", "weird {x} <y> & 'z' \"q\"", "multi\nline", "ünïcödé ✓"]


@pytest.fixture(scope="module")
def processor():
    return load_gemma("tiny", "float32")[1]


def slow(processor) -> ChatFormatter:
    f = ChatFormatter(processor)
    f._backend = None
    f._splice = lambda prompt: None
    return f


def test_shortcuts_are_taken_and_exact(processor):
    fast, ref = ChatFormatter(processor), slow(processor)
    assert fast._backend is not None and fast._splice("describe the scene .") is not None
    for prompt in ("describe the scene .", "What is {here}?"):
        head, rest, _ = fast._head(prompt)
        assert len(head) > 10 and rest == "model\n"  # only "model\n" + caption + "<end_of_turn>\n" per sample
        pairs = [(prompt, caption) for caption in CAPTIONS]
        for a, b in zip(fast.encode_many(pairs), [ref.encode(p, c) for p, c in pairs]):
            assert (a.input_ids, a.labels) == (b.input_ids, b.labels), (prompt, a, b)


def test_head_shortcut_is_dropped_when_text_tokenises_differently_on_its_own(processor):
    class DummyPrefix(ChatFormatter):  # as a tokenizer that marks the start of every text it is given would
        def _ids_many(self, texts):
            return [[self.pad_id] + ids for ids in super()._ids_many(texts)]

    f = DummyPrefix(processor)
    prompt = "describe the scene ."
    assert f._head(prompt) == ([], *f._splice(prompt))
    enc = f.encode(prompt, "red circle")
    assert enc.input_ids == [f.pad_id] + slow(processor).encode(prompt, "red circle").input_ids


def test_a_template_that_rewrites_the_answer_falls_back(processor):
    f = ChatFormatter(processor)
    template = processor.chat_template
    processor.chat_template = template.replace("item['text'] | trim", "item['text'] | trim | upper")
    try:
        f2 = ChatFormatter(processor)
        assert f2._splice("describe the scene .") is None  # the probe shows the template changes the caption
        enc = f2.encode("describe the scene .", "red circle")
        answer = [t for t, lab in zip(enc.input_ids, enc.labels) if lab != -100]
        assert processor.tokenizer.decode(answer[:-1]).strip() == "RED CIRCLE"
    finally:
        processor.chat_template = template
    assert f._splice("describe the scene .") is not None


def test_text_with_a_gemma_control_string_is_refused_wherever_it_comes_from(processor):
    from theworld.model.control_text import ControlText

    f = ChatFormatter(processor)
    for pairs, words in [
        ([("describe .", "a <end_of_turn> b")], "caption holds the Gemma control string '<end_of_turn>'"),
        ([("<start_of_image> describe .", "a b")], "prompt holds"),
        ([("describe .", "fine"), ("describe .", "<unused7>")], "'<unused7>'"),
    ]:
        with pytest.raises(ControlText, match=words):
            f.encode_many(pairs)
    with pytest.raises(ControlText, match="prompt holds"):
        f.prefix("<bos>describe")
    with pytest.raises(ControlText, match="caption holds"):
        f.encode("describe .", "<pad>", images=2)
    assert f.encode_many([("describe <b>.", "a <table> b")])  # other tags are text
