"""The processor side: (prompt, caption) -> token ids with labels on the answer only (a conversation of several
turns: on every answer, `ChatFormatter.encode_turns`); theworld/model/inputs.py pads them into batches.

Labels are built from token ids: the prompt is rendered with the chat template up to the model turn, the full
conversation is rendered, and the prompt's ids must be a prefix of the full ids; what is the answer after that prefix
is the supervision rule's (theworld/model/objective.py). A text-only re-render would miss the expanded image tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from theworld.model import objective
from theworld.model.control_text import check_text
from theworld.model.objective import IGNORE  # noqa: F401 - its users long imported it from here


class PromptTooLong(ValueError):
    """The prompt alone fills max_length: nothing of the answer could be supervised."""


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


class ChatFormatter:
    """Tokenises (prompt, caption) pairs with one image, the way Gemma 3's processor and chat template do.

    This runs for every sample in the loader workers, so three self-checked shortcuts keep it cheap, each used only if
    it reproduces the slow, general path on probe captions (otherwise that path is used):
    - the conversation is rendered once per prompt with a sentinel answer and the caption is spliced in;
    - the Rust tokenizer is called directly, a batch at a time and without offsets;
    - the per-prompt text up to its last special token (<bos>, the turn markers, the image block) is tokenised once:
      a tokenizer splits its input at special tokens before anything else, so the text after one is tokenised on its
      own whatever precedes it. Only the rest ("model\n", the caption, "<end_of_turn>\n") is tokenised per sample.
    """

    SENTINEL = "\ue000answer\ue000"  # private-use characters: no tokenizer or template gives them meaning
    PROBE = "  a <probe> & 'caption'\n with {braces} and \"quotes\"  "
    HEAD_PROBES = (
        PROBE.strip(),
        "x",
        "12 ÷ 3 = four",
        "\u00e9t\u00e9 \u6771\u4eac .",
        "model\nmodel",
        "<end_of_turn> !",
    )

    def __init__(self, processor, max_length: int | None = None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_length = max_length
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.tokenizer.image_token)
        self.end_of_turn_id = self.tokenizer.convert_tokens_to_ids("<end_of_turn>")
        self.pad_id = self.tokenizer.pad_token_id
        self._prefix_cache: dict[tuple[str, int], list[int]] = {}
        self._splice_cache: dict[str, tuple[str, str] | None] = {}
        self._head_cache: dict[str, tuple[list[int], str, str] | None] = {}
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        probe = self._render(self._conversation("describe .", self.PROBE), False)
        self._backend = (
            backend
            if backend is not None and [self._slow_ids(probe)] * 2 == self._fast_ids_many(backend, [probe, probe])
            else None
        )

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return text.replace(self.tokenizer.boi_token, self.processor.full_image_sequence)

    def _slow_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already has <bos>

    @staticmethod
    def _fast_ids_many(backend, texts: list[str]) -> list[list[int]]:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no character offsets
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def _ids_many(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:
            return self._fast_ids_many(self._backend, texts)
        return [self._slow_ids(t) for t in texts]

    def _ids(self, text: str) -> list[int]:
        return self._ids_many([text])[0]

    @staticmethod
    def _conversation(prompt: str, caption: str | None = None, images: int = 1) -> list[dict]:
        msgs = [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": prompt}]}]
        if caption is not None:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": caption}]})
        return msgs

    def _splice(self, prompt: str) -> tuple[str, str] | None:
        """(text before the answer, text after it) for this prompt, if splicing reproduces the template."""
        if prompt not in self._splice_cache:
            parts = self._render(self._conversation(prompt, self.SENTINEL), False).split(self.SENTINEL)
            ok = (
                len(parts) == 2
                and self._render(self._conversation(prompt, self.PROBE), False)
                == parts[0] + self.PROBE.strip() + parts[1]
            )
            self._splice_cache[prompt] = (parts[0], parts[1]) if ok else None
        return self._splice_cache[prompt]

    def conversation_text(self, prompt: str, caption: str) -> str:
        """The rendered conversation (image tokens expanded) with `caption` as the model's answer."""
        splice = self._splice(prompt)
        if splice is None:
            return self._render(self._conversation(prompt, caption), False)
        return splice[0] + caption.strip() + splice[1]

    def _head(self, prompt: str) -> tuple[list[int], str, str] | None:
        """For a prompt the caption can be spliced into: (ids of the text before the answer up to its last special
        token, the text after that token, the text after the answer); None if it cannot be spliced."""
        if prompt not in self._head_cache:
            splice = self._splice(prompt)
            self._head_cache[prompt] = None if splice is None else (*self._split_head(*splice), splice[1])
        return self._head_cache[prompt]

    def _split_head(self, before: str, after: str) -> tuple[list[int], str]:
        """(ids of `before` up to its last special token, the text after that token) if tokenising that text on its
        own reproduces the whole conversation's ids for the probe captions; else ([], before)."""
        if self._backend is None:
            return [], before
        enc = self._backend.encode(before, add_special_tokens=False)
        special = set(self._backend.get_added_tokens_decoder())
        last = max((i for i, t in enumerate(enc.ids) if t in special), default=None)
        if last is None:
            return [], before
        ids, rest = enc.ids[: last + 1], before[enc.offsets[last][1] :]
        tails = self._ids_many([rest + c + after for c in self.HEAD_PROBES])
        whole = self._ids_many([before + c + after for c in self.HEAD_PROBES])
        return (ids, rest) if [ids + tail for tail in tails] == whole else ([], before)

    def conversation_ids(self, pairs: list[tuple[str, str]]) -> list[list[int]]:
        """Token ids of conversation_text for each (prompt, caption), tokenising only what differs per sample."""
        heads, tails = [], []
        for prompt, caption in pairs:
            head = self._head(prompt)
            if head is None:
                heads.append([])
                tails.append(self.conversation_text(prompt, caption))
            else:
                ids, rest, after = head
                heads.append(ids)
                tails.append(rest + caption.strip() + after)
        return [h + t for h, t in zip(heads, self._ids_many(tails))]

    def prefix(self, prompt: str, images: int = 1) -> list[int]:
        """Ids of the user turn with `images` images before the prompt, up to the model turn's header (what
        generation continues)."""
        if (prompt, images) not in self._prefix_cache:
            check_text(prompt, "prompt")
            text = self._render(self._conversation(prompt, images=images), True)
            self._prefix_cache[prompt, images] = self._ids(text)
        return self._prefix_cache[prompt, images]

    def encode(self, prompt: str, caption: str, images: int = 1) -> Encoded:
        if images == 1:
            return self.encode_many([(prompt, caption)])[0]
        # several images (multiple-choice benchmarks): the general path, with no per-prompt shortcuts
        check_text(caption, "caption")
        full = self._ids(self._render(self._conversation(prompt, caption, images), False))
        return self._label(prompt, full, images)

    def encode_many(self, pairs: list[tuple[str, str]]) -> list[Encoded]:
        """Text holding a Gemma control string raises control_text.ControlText: it would not be read as text."""
        for prompt, caption in pairs:
            check_text(prompt, "prompt"), check_text(caption, "caption")
        return [self._label(prompt, full) for (prompt, _), full in zip(pairs, self.conversation_ids(pairs))]

    def _label(self, prompt: str, full: list[int], images: int = 1) -> Encoded:
        """Labels on the answer after the prompt's ids (objective.answer_stop), cut to max_length."""
        prefix = self.prefix(prompt, images)
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template's prompt is not a token prefix of the full conversation")
        stop = objective.answer_stop(full, len(prefix), len(full), self.end_of_turn_id)
        labels = objective.answer_labels(full, [(len(prefix), stop)])
        if self.max_length is not None and len(full) > self.max_length:
            if self.max_length <= len(prefix):
                raise PromptTooLong(f"prompt alone is {len(prefix)} tokens, over max_length {self.max_length}")
            full, labels = objective.truncated(full, labels, self.max_length, self.end_of_turn_id)
        return Encoded(full, labels)

    # ------------------------------------------------------------------------------------------------------------------
    # Conversations of several turns (the image in the first user turn)

    @staticmethod
    def _turn_messages(turns: Sequence[tuple[str, str]], answered: bool = True) -> list[dict]:
        """Chat messages of `turns`; answered=False leaves the last turn's answer out (what generation continues)."""
        msgs = []
        for k, (user, model) in enumerate(turns):
            image = [{"type": "image"}] if k == 0 else []
            msgs.append({"role": "user", "content": image + [{"type": "text", "text": user}]})
            if answered or k < len(turns) - 1:
                msgs.append({"role": "assistant", "content": [{"type": "text", "text": model}]})
        return msgs

    def encode_turns(self, turns: Sequence[tuple[str, str]]) -> tuple[Encoded, int]:
        """(ids with labels on every model turn's answer and its <end_of_turn>, the number of turns kept).

        With max_length, whole turns are dropped from the end until the conversation fits; the first turn is always
        kept (if it alone is too long, its answer is cut as encode's is). A user turn is never supervised."""
        if len(turns) == 1:
            return self.encode_many([tuple(turns[0])])[0], 1
        for k, (user, model) in enumerate(turns, start=1):
            check_text(user, f"turn {k} prompt"), check_text(model, f"turn {k} answer")
        full = self._ids(self._render(self._turn_messages(turns), False))
        spans, ends = [], []  # per turn: supervised [start, stop); where the conversation up to it ends
        for k in range(1, len(turns) + 1):
            opened = self._ids(self._render(self._turn_messages(turns[:k], answered=False), True))
            closed = self._ids(self._render(self._turn_messages(turns[:k]), False))
            if full[: len(closed)] != closed or closed[: len(opened)] != opened:
                raise ValueError("the chat template's earlier turns are not a token prefix of the conversation")
            stop = objective.answer_stop(closed, len(opened), len(closed), self.end_of_turn_id, f"answer {k}")
            spans.append((len(opened), stop))
            ends.append(len(closed))
        kept = len(turns) if self.max_length is None else sum(1 for e in ends if e <= self.max_length)
        if kept == 0:
            return self.encode_many([tuple(turns[0])])[0], 1
        full = full[: ends[kept - 1]]
        return Encoded(full, objective.answer_labels(full, spans[:kept])), kept

    def encode_conversations(self, conversations: Sequence[Sequence[tuple[str, str]]]) -> list[Encoded]:
        """encode_turns for each conversation; the single-turn ones a batch at a time through encode_many."""
        single = [i for i, c in enumerate(conversations) if len(c) == 1]
        out: list[Encoded | None] = [None] * len(conversations)
        for i, enc in zip(single, self.encode_many([tuple(conversations[i][0]) for i in single])):
            out[i] = enc
        for i, c in enumerate(conversations):
            if out[i] is None:
                out[i] = self.encode_turns(c)[0]
        return out
