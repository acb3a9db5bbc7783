"""The processor side: (prompt, caption) -> token ids with labels on the answer only, and right-padded batches.

Labels are built from token ids: the prompt is rendered with the chat template up to the model turn, the full
conversation is rendered, and the prompt's ids must be a prefix of the full ids; everything after the prefix up to and
including the model turn's <end_of_turn> is the answer. A text-only re-render would miss the expanded image tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


class ChatFormatter:
    """Tokenises (prompt, caption) pairs with one image, the way Gemma 3's processor and chat template do."""

    def __init__(self, processor, max_length: int | None = None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_length = max_length
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.tokenizer.image_token)
        self.end_of_turn_id = self.tokenizer.convert_tokens_to_ids("<end_of_turn>")
        self.pad_id = self.tokenizer.pad_token_id
        self._prefix_cache: dict[str, list[int]] = {}

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        text = text.replace(self.tokenizer.boi_token, self.processor.full_image_sequence)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already has <bos>

    @staticmethod
    def _user(prompt: str) -> dict:
        return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}

    def prefix(self, prompt: str) -> list[int]:
        if prompt not in self._prefix_cache:
            self._prefix_cache[prompt] = self._ids([self._user(prompt)], generation_prompt=True)
        return self._prefix_cache[prompt]

    def encode(self, prompt: str, caption: str) -> Encoded:
        prefix = self.prefix(prompt)
        answer_msg = {"role": "assistant", "content": [{"type": "text", "text": caption}]}
        full = self._ids([self._user(prompt), answer_msg], generation_prompt=False)
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template's prompt is not a token prefix of the full conversation")
        answer = full[len(prefix):]
        ends = [i for i, t in enumerate(answer) if t == self.end_of_turn_id]
        if not ends:
            raise ValueError("no <end_of_turn> after the answer")
        n_answer = ends[-1] + 1
        labels = [IGNORE] * len(prefix) + answer[:n_answer] + [IGNORE] * (len(answer) - n_answer)
        if self.max_length is not None and len(full) > self.max_length:
            # Keep the end-of-turn as the last supervised token so a truncated answer still teaches when to stop.
            keep = self.max_length
            if keep <= len(prefix):
                raise ValueError(f"prompt alone is {len(prefix)} tokens, over max_length {self.max_length}")
            full, labels = full[:keep], labels[:keep]
            full[-1] = labels[-1] = self.end_of_turn_id
        return Encoded(full, labels)


def collate_text(items: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: input_ids, attention_mask, labels (padding is IGNORE)."""
    n = max(len(e.input_ids) for e in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)
    labels = torch.full((len(items), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), n), dtype=torch.long)
    for i, e in enumerate(items):
        k = len(e.input_ids)
        ids[i, :k] = torch.tensor(e.input_ids)
        labels[i, :k] = torch.tensor(e.labels)
        mask[i, :k] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
