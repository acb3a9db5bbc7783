"""The generate protocol's two ends: the prompt a multiple-choice item is asked with, and the letter read back from
the model's answer.

Both follow lmms-eval's BLINK task (lmms_eval/tasks/blink/utils.py and its _default_template_yaml), so an accuracy
from here can sit next to one from the harness:
- the prompt is the instruction line `Note: You only need to respond with A, B, C without providing any additional
  information.` (lmms-eval's default `pre_prompt`, listing this item's letters), then BLINK's `prompt` column as given;
  a JSONL item (no prompt column) gets its question and lettered choices in BLINK's own layout instead of that column;
- the letter is read by `read_letter`, lmms-eval's `_extract_answer_letter` rule for rule, accepting only this item's
  letters. An answer with no readable letter is wrong, and counted as `unparsed`.
"""

from __future__ import annotations

import re
import string

INSTRUCTION = "Note: You only need to respond with {} without providing any additional information.\n"


def letters(n: int) -> str:
    return string.ascii_uppercase[:n]


def blink_style_prompt(question: str, choices: list[str]) -> str:
    """A question in the layout of BLINK's `prompt` column: the question, a line, then `(A) choice` per choice."""
    return "\n".join(
        [question.strip(), "Select from the following choices."]
        + [f"({k}) {c}" for k, c in zip(letters(len(choices)), choices)]
    )


def mc_prompt(question: str, choices: list[str], prompt: str | None = None) -> str:
    """What the model is asked: the instruction line, then the item's own prompt (BLINK) or one built from its
    question and choices."""
    body = prompt if prompt is not None else blink_style_prompt(question, choices)
    return INSTRUCTION.format(", ".join(letters(len(choices)))) + body


def read_letter(text: str, n_choices: int) -> int | None:
    """The choice index the answer names, or None. lmms-eval's rule, in order: a first line that is (almost) only a
    letter; else the last "answer is (X)"; else the last "(X)"; else a leading letter."""
    text = text.strip()
    valid = re.escape(letters(n_choices))
    first_line = text.split("\n", 1)[0].strip()
    if len(first_line) <= 4 and (m := re.match(rf"^\(?([{valid}])\)?[\.\s:,)]*$", first_line, flags=re.IGNORECASE)):
        return _index(m.group(1))
    stated = re.findall(rf"answers?(?:\s+is)?\s*[:\-]?\s*\(?([{valid}])\)?(?![A-Za-z])", text, flags=re.IGNORECASE)
    for found in (stated, re.findall(rf"\(([{valid}])\)", text)):
        if found:
            return _index(found[-1])
    m = re.match(rf"[\(\s]*([{valid}])[\)\.\s]*", text, flags=re.IGNORECASE)
    return _index(m.group(1)) if m else None


def _index(letter: str) -> int:
    return ord(letter.upper()) - ord("A")
