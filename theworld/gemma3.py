"""Facts about the Gemma 3 architecture that the tiny models, the benchmarks and the memory plan share."""

from __future__ import annotations

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
