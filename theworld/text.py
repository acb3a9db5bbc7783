"""The processor side: (prompt, caption) -> token ids with labels on the answer only, and right-padded batches.

Labels are built from token ids: the prompt is rendered with the chat template up to the model turn, the full
conversation is rendered, and the prompt's ids must be a prefix of the full ids; everything after the prefix up to and
including the model turn's <end_of_turn> is the answer. A text-only re-render would miss the expanded image tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


class ChatFormatter:
    """Tokenises (prompt, caption) pairs with one image, the way Gemma 3's processor and chat template do.

    This runs for every sample in the loader workers, so two self-checked shortcuts keep it cheap: the conversation
    is rendered once per prompt with a sentinel answer and the caption is spliced in (used only if the template
    treats a probe caption the same way), and the Rust tokenizer is called directly (only if it gives the same ids
    as the Python wrapper). Either check failing falls back to the slow, general path.
    """

    SENTINEL = "\ue000answer\ue000"  # private-use characters: no tokenizer or template gives them meaning
    PROBE = "  a <probe> & 'caption'\n with {braces} and \"quotes\"  "

    def __init__(self, processor, max_length: int | None = None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_length = max_length
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.tokenizer.image_token)
        self.end_of_turn_id = self.tokenizer.convert_tokens_to_ids("<end_of_turn>")
        self.pad_id = self.tokenizer.pad_token_id
        self._prefix_cache: dict[str, list[int]] = {}
        self._splice_cache: dict[str, tuple[str, str] | None] = {}
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        probe = self._render(self._conversation("describe .", self.PROBE), False)
        self._backend = backend if backend is not None and self._slow_ids(probe) == self._fast_ids(backend, probe) \
            else None

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return text.replace(self.tokenizer.boi_token, self.processor.full_image_sequence)

    def _slow_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already has <bos>

    @staticmethod
    def _fast_ids(backend, text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    def _ids(self, text: str) -> list[int]:
        return self._fast_ids(self._backend, text) if self._backend is not None else self._slow_ids(text)

    @staticmethod
    def _conversation(prompt: str, caption: str | None = None) -> list[dict]:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        if caption is not None:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": caption}]})
        return msgs

    def _splice(self, prompt: str) -> tuple[str, str] | None:
        """(text before the answer, text after it) for this prompt, if splicing reproduces the template."""
        if prompt not in self._splice_cache:
            parts = self._render(self._conversation(prompt, self.SENTINEL), False).split(self.SENTINEL)
            ok = len(parts) == 2 and self._render(self._conversation(prompt, self.PROBE), False) == \
                parts[0] + self.PROBE.strip() + parts[1]
            self._splice_cache[prompt] = (parts[0], parts[1]) if ok else None
        return self._splice_cache[prompt]

    def conversation_text(self, prompt: str, caption: str) -> str:
        """The rendered conversation (image tokens expanded) with `caption` as the model's answer."""
        splice = self._splice(prompt)
        if splice is None:
            return self._render(self._conversation(prompt, caption), False)
        return splice[0] + caption.strip() + splice[1]

    def prefix(self, prompt: str) -> list[int]:
        if prompt not in self._prefix_cache:
            self._prefix_cache[prompt] = self._ids(self._render(self._conversation(prompt), True))
        return self._prefix_cache[prompt]

    def encode(self, prompt: str, caption: str) -> Encoded:
        prefix = self.prefix(prompt)
        full = self._ids(self.conversation_text(prompt, caption))
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
    # numpy fills a row from a Python list several times faster than torch.tensor builds one
    ids = np.full((len(items), n), pad_id, dtype=np.int64)
    labels = np.full((len(items), n), IGNORE, dtype=np.int64)
    mask = np.zeros((len(items), n), dtype=np.int64)
    for i, e in enumerate(items):
        k = len(e.input_ids)
        ids[i, :k] = e.input_ids
        labels[i, :k] = e.labels
        mask[i, :k] = 1
    ids, mask, labels = torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(labels)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
