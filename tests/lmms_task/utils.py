"""A local lmms-eval task over a JSONL multiple-choice file (`image`: absolute path, `question`, `choices`, `answer`:
index), asked as a lettered prompt (generate) or scored choice by choice (loglikelihood). Used by
tests/test_lmms_adapter.py; the same prompt and letter rule are used for the reference there."""

import re
import string

from PIL import Image


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc):
    lines = [doc["question"]] + [f"({k}) {c}" for k, c in zip(string.ascii_uppercase, doc["choices"])]
    return "\n".join(lines + ["Answer with the option's letter from the given choices directly."])


def doc_to_question(doc):
    return doc["question"]


def doc_to_choice(doc):
    return doc["choices"]


def read_letter(text, n):
    m = re.search(rf"\b([{string.ascii_uppercase[:n]}])\b", text)
    return None if m is None else ord(m.group(1)) - ord("A")


def process_results(doc, results):
    return {"accuracy": float(read_letter(results[0], len(doc["choices"])) == doc["answer"])}
