"""theworld/model/text.py: ChatFormatter's shortcuts (spliced template, direct batched Rust tokenizer, per-prompt head)
give exactly the general path's ids; multi-turn conversations carry labels on every model turn (checked against a
hand-built sequence) and are cut turn-wise to train.loader.max_length."""

from __future__ import annotations

import pytest

from theworld.model.encoders import load_gemma
from theworld.model.text import IGNORE, ChatFormatter

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


TURNS = [("what is it ?", "a red circle ."), ("where ?", "top left ."), ("and the colour ?", "red , mostly .")]


def hand_built(processor, turns) -> tuple[list[int], list[int]]:
    """Gemma 3's chat format written out segment by segment (each ends at a special token, so tokenising the
    segments alone gives the whole text's ids); the answers and their <end_of_turn> are labelled."""
    tok = processor.tokenizer
    ids, labels = [], []

    def add(text: str, supervised: bool) -> None:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        labels.extend(piece if supervised else [IGNORE] * len(piece))

    add("<bos>", False)
    for k, (user, model) in enumerate(turns):
        image = processor.full_image_sequence if k == 0 else ""
        add(f"<start_of_turn>user\n{image}{user}<end_of_turn>\n<start_of_turn>model\n", False)
        add(f"{model}<end_of_turn>", True)
        add("\n", False)
    return ids, labels


def test_labels_cover_every_model_turn_and_no_user_turn(processor):
    enc, kept = ChatFormatter(processor).encode_turns(TURNS)
    assert kept == 3
    assert (enc.input_ids, enc.labels) == hand_built(processor, TURNS)
    eot = processor.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    supervised = [t for t, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE]
    assert supervised.count(eot) == 3 and enc.input_ids[0] == processor.tokenizer.bos_token_id


def test_one_turn_is_what_encode_gives(processor):
    fmt = ChatFormatter(processor)
    enc, kept = fmt.encode_turns(TURNS[:1])
    ref = fmt.encode(*TURNS[0])
    assert kept == 1 and (enc.input_ids, enc.labels) == (ref.input_ids, ref.labels)
    both = fmt.encode_conversations([TURNS[:1], TURNS, TURNS[:2]])
    assert [e.input_ids for e in both] == [
        ref.input_ids,
        hand_built(processor, TURNS)[0],
        hand_built(processor, TURNS[:2])[0],
    ]


def test_max_length_drops_whole_turns_from_the_end(processor):
    lengths = [len(hand_built(processor, TURNS[:k])[0]) for k in (1, 2, 3)]
    for max_length, kept in (
        (lengths[2], 3),
        (lengths[2] - 1, 2),
        (lengths[1], 2),
        (lengths[1] - 1, 1),
        (lengths[0], 1),
    ):
        enc, n = ChatFormatter(processor, max_length=max_length).encode_turns(TURNS)
        assert n == kept and (enc.input_ids, enc.labels) == hand_built(processor, TURNS[:kept]), max_length
    # the first turn alone too long: kept, its answer cut as a single-turn sample's is
    short = ChatFormatter(processor, max_length=lengths[0] - 2)
    enc, n = short.encode_turns(TURNS)
    ref = short.encode(*TURNS[0])
    assert (
        n == 1 and len(enc.input_ids) == lengths[0] - 2 and (enc.input_ids, enc.labels) == (ref.input_ids, ref.labels)
    )


@pytest.fixture(scope="module")
def llava_cache(tmp_path_factory):
    """12 llava items at 32 px with the tiny models: every third a conversation of three turns, one of two."""
    import json

    from precompute.pipeline import run
    from tests._precompute_helpers import gradient, jpeg_bytes, make_cfg

    root = tmp_path_factory.mktemp("llava")
    items = []
    for i in range(12):
        (root / f"{i}.jpg").write_bytes(jpeg_bytes(gradient(30 + i, 24)))
        turns = TURNS if i % 3 == 0 else TURNS[:2] if i == 1 else TURNS[:1]
        conv = [{"from": f, "value": v} for u, m in turns for f, v in (("human", u), ("gpt", m))]
        conv[0]["value"] = "<image>\n" + conv[0]["value"]
        items.append({"id": f"item{i}", "image": f"{i}.jpg", "conversations": conv})
    (root / "chat.json").write_text(json.dumps(items))
    out = root / "cache"
    run(make_cfg(out, "source.type=llava", f"source.path={root}/chat.json", "cache.siglip=false"))
    return out


def test_truncation_report_counts_shortened_conversations_and_cut_answers(llava_cache, processor):
    from theworld import cache_format as cf
    from train.data.loader import truncation_report

    reader = cf.CacheReader(llava_cache)
    everything = __import__("numpy").arange(len(reader))
    lengths = [len(hand_built(processor, TURNS[:k])[0]) for k in (1, 2, 3)]
    report = truncation_report(ChatFormatter(processor, max_length=lengths[1]), reader, everything)
    assert (
        "4 conversation(s) shortened (4 turn(s) dropped from their ends), 0 sample(s) with the first answer cut, "
        "of 12 training samples" in report
    )
    report = truncation_report(ChatFormatter(processor, max_length=lengths[0] - 1), reader, everything)
    assert (
        "5 conversation(s) shortened (9 turn(s) dropped from their ends), 12 sample(s) with the first answer cut"
        in report
    )


def test_training_on_conversations_prints_what_max_length_drops(llava_cache, tmp_path, processor, capsys):
    from train.loop import main

    lengths = [len(hand_built(processor, TURNS[:k])[0]) for k in (1, 2, 3)]
    sets = {
        "cache_dir": llava_cache,
        "output_dir": tmp_path / "run",
        "model.dtype": "float32",
        "image.resolution": 32,
        "train.max_steps": 1,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.eval.samples": 2,
        "train.loader.num_workers": 0,
        "trackers": "[]",
        "train.loader.max_length": lengths[1],
    }
    assert main([a for k, v in sets.items() for a in ("--set", f"{k}={v}")]) == 0
    out = capsys.readouterr()
    assert (
        f"train.loader.max_length {lengths[1]}: " in out.out + out.err
        and "turn(s) dropped from their ends" in out.out + out.err
    )
