"""Multiple-choice scores with one prefix per item and world condition.

A choice's score is the summed log-probability of its answer tokens after the prefix (world tokens, image tokens,
question, the model turn's header), and every choice of an item shares that prefix. So the prefix runs once per item
and world condition into a transformers `DynamicCache`; the cache is then copied to one row per choice
(`batch_select_indices`) and all choices run at once from it. Masking is Gemma 3's own, as in generation
(theworld/infer/generate.py): the prefix goes through the language model with `token_type_ids` (image blocks
bidirectional) and is left-aligned, so every prefix ends in the last column; the choices are plain causal text
appended after it, right-padded, with positions continuing each row's prefix.
"""

from __future__ import annotations

import torch

from theworld.infer.generate import left_align
from theworld.model import objective
from theworld.model.gemma3 import kv_cache
from theworld.model.inputs import prompt_only, text_batch
from theworld.model.objective import IGNORE
from theworld.model.text import Encoded


def answer_logprobs(
    model,
    prefixes: list[list[int]],
    rows: list[Encoded],
    owner: list[int],
    siglip: torch.Tensor,
    greedy: bool = False,
    **world,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(len(rows),) float32: each row's summed log-probability of its answer tokens (objective.answer_logprobs), as
    `TheWorld.answer_logprobs` gives it for the whole row. Row r continues prefix `owner[r]`, and its token ids must
    start with that prefix's ids. `siglip`: the image features of every prefix, concatenated in prefix order;
    `world`: `ModelInputs`' world inputs (latent_mean, latent_logvar, ...), one row per prefix.
    `greedy`: also return, per row, whether every answer token is the most likely one there (lmms-eval's is_greedy)."""
    device = siglip.device
    tail = text_batch([_after(rows[r], prefixes[o]) for r, o in enumerate(owner)], 0).to(device)
    prompts = prompt_only(prefixes, 0, siglip=siglip, **world).to(device)  # padding is masked out
    fused = left_align(model.embed_inputs(prompts))
    cache = _new_cache(model)
    lm = model.gemma.model
    last = lm(**fused, **kv_cache(lm, cache), use_cache=True).last_hidden_state[:, -1]
    owner_t = torch.tensor(owner, device=device)
    cache.batch_select_indices(owner_t)  # one copy of its prefix's keys and values per choice
    mask = torch.cat([fused["attention_mask"][owner_t], tail.attention_mask], dim=1)
    pos = fused["position_ids"][owner_t, -1:] + 1 + torch.arange(tail.input_ids.shape[1], device=device)
    embeds = model.gemma.get_input_embeddings()(tail.input_ids).to(fused["inputs_embeds"].dtype)
    hidden = lm(
        inputs_embeds=embeds, attention_mask=mask, position_ids=pos, **kv_cache(lm, cache), use_cache=True
    ).last_hidden_state
    # token j of a choice is predicted by the hidden state before it: the prefix's last one for j = 0
    before = torch.cat([last[owner_t, None], hidden[:, :-1]], dim=1)
    return objective.answer_logprobs(before, tail.labels, model.logits, greedy)


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.gemma.config.get_text_config())


def _after(row: Encoded, prefix: list[int]) -> Encoded:
    """The part of `row` after `prefix`, which must be its start and hold none of its answer tokens."""
    n = len(prefix)
    if row.input_ids[:n] != prefix or any(label != IGNORE for label in row.labels[:n]):
        raise ValueError("a choice's tokens do not continue its item's prefix")
    return Encoded(row.input_ids[n:], row.labels[n:])
