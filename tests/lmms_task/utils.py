"""A local lmms-eval task over a JSONL multiple-choice file (`image`: absolute path, `question`, `choices`, `answer`:
index), asked as a lettered prompt (generate) or scored choice by choice (loglikelihood). Used by
tests/theworld/test_lmms_adapter.py. The prompt and the letter rule are theworld.evaluate's generate protocol
(theworld/infer/letters.py, lmms-eval's BLINK rule), so the two accuracies are comparable item for item."""

from PIL import Image

from theworld.infer import letters


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc):
    return letters.mc_prompt(doc["question"], doc["choices"])


def doc_to_question(doc):
    return doc["question"]


def doc_to_choice(doc):
    return doc["choices"]


def read_letter(text, n):
    return letters.read_letter(text, n)


def process_results(doc, results):
    return {"accuracy": float(read_letter(results[0], len(doc["choices"])) == doc["answer"])}
