"""theworld/infer/letters.py: the generate protocol's prompt and letter reader, as lmms-eval reads letters."""

from __future__ import annotations

import pytest

from theworld.infer import letters

LMMS_EXAMPLES = [
    ("A answer1", "A"),
    ("A) answer2", "A"),
    ("(B) answer", "B"),
    ("C", "C"),
    ("(C)", "C"),
    ("A.", "A"),
    ("The correct answer is (B).", "B"),
    ("I think the answer is C because ...", "C"),
]


MORE = ["", "none of them", "b", " (d) ", "Answer: D", "E", "(E) no", "answers are A and (C)", "The ball.", "\n\nB\n"]


@pytest.mark.parametrize("text,letter", LMMS_EXAMPLES)
def test_the_letter_reader_on_lmms_evals_own_examples(text, letter):
    assert letters.read_letter(text, 4) == ord(letter) - ord("A")


def test_the_letter_reader_agrees_with_lmms_eval_where_it_is_installed():
    utils = pytest.importorskip("lmms_eval.tasks.blink.utils")
    for text in [t for t, _ in LMMS_EXAMPLES] + MORE:
        theirs = utils._extract_answer_letter(text, "ABCD")
        ours = letters.read_letter(text, 4)
        assert (theirs or None) == (None if ours is None else "ABCD"[ours]), text


def test_the_prompt_is_lmms_evals_instruction_then_the_benchmarks_prompt():
    assert (
        letters.mc_prompt("q?", ["x", "y"], "BLINK'S OWN")
        == "Note: You only need to respond with A, B without providing any additional information.\nBLINK'S OWN"
    )
    assert letters.mc_prompt("q?", ["x", "y", "z"]).endswith(
        "q?\nSelect from the following choices.\n(A) x\n(B) y\n(C) z"
    )


# lmms_eval/tasks/blink/utils.py, _extract_answer_letter's docstring (all with 26 valid letters there; 4 here)
