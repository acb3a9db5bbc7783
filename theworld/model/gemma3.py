"""Facts about Gemma 3 that the tiny and real small models, the benchmarks and the memory plan share: the attention
pattern, and gemma-3-4b-it's vocabulary layout and chat template."""

from __future__ import annotations

import functools
import inspect
from typing import Any

SLIDING_PATTERN = 6  # every 6th decoder layer attends globally, the other five within the sliding window


def layer_types(num_layers: int) -> list[str]:
    """Gemma 3's attention pattern, as transformers derives it for the released models: layer i (0-based) is global
    iff (i + 1) % 6 == 0, so the real 34-layer 4B model has global layers 6, 12, 18, 24, 30 (1-based) and ends on four
    sliding ones. A model of fewer than 6 layers would have no global layer at all; there the last layer is global,
    so that a tiny model, like every released Gemma 3, has a layer that sees the whole sequence (the world block
    included)."""
    types = ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention" for i in range(num_layers)]
    if num_layers and "full_attention" not in types:
        types[-1] = "full_attention"
    return types


# gemma-3-4b-it's vocabulary: its tokenizer's 262144 pieces, then <image_soft_token> (the placeholder each image's
# soft tokens are scattered into), and an embedding padded to 262208 rows. Token ids are the released tokenizer's.
VOCAB_SIZE = 262208
BOS_ID, START_OF_TURN_ID, END_OF_TURN_ID = 2, 105, 106
IMAGE_TOKENS = {  # the tokenizer's extra special tokens (as the released processor names them) and their ids
    "boi_token": ("<start_of_image>", 255999),
    "eoi_token": ("<end_of_image>", 256000),
    "image_token": ("<image_soft_token>", 262144),
}
# The chat template of gemma-3-4b-it (its chat_template.json, verbatim): a system message becomes a prefix of the first
# user turn, "assistant" is written "model", each image is one <start_of_image> (the processor expands it).
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


@functools.cache
def _cache_keyword(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def kv_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The KV cache as the keyword `model`'s forward takes it: `cache` since transformers 5.24 deprecated
    `past_key_values` (to be removed in 5.40), `past_key_values` in the releases before (the project allows >= 5.0)."""
    return {_cache_keyword(type(model).forward): cache}
