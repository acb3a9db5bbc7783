"""Packed rows: several samples share one row of the language model's input, each attending only within itself.

The plan (`plan_rows`, run in the loader's workers) gives each sample of a micro-batch a row: as few rows as the
samples' total length needs at `pack_length` tokens a row, filled longest-first into the emptiest row, so rows end up
about equally full and little is padded. The model fuses every sample as it does unpacked (its world block after its
BOS, its image features in its image tokens), then `Packed` moves the fused samples into their rows, each with its own
position ids from 0, and builds the attention masks Gemma 3's layers take: block-diagonal causal, with the sliding
window counted in the sample's own positions and its image tokens attending to each other both ways (what
transformers' own masks do for one sample a row). The language model's output goes back to the unpacked layout, so the
loss and the log-probabilities are computed exactly as without packing (theworld/model/objective.py).

Under sdpa the attention runs sample by sample (`Segments`): each sample's queries against its own keys, through
transformers' sdpa function, so a row costs the sum of its samples' squared lengths, not its width squared; the linear
layers still run on the full rows. Under eager the rows take 4D block-diagonal masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from theworld.model.arch import PACKED_ATTENTION

# sdpa that also takes a packed batch's `Segments` in place of a mask; any other mask goes to sdpa itself, and the
# masks are sdpa's, so an unpacked batch computes exactly what it computes under "sdpa"
SEGMENTS = "theworld_segments"


def plan_rows(lengths: Sequence[int], pack_length: int) -> list[int]:
    """Each sample's row (rows numbered by their first sample). As many rows as the samples that fit a row need
    (their total over `pack_length`, rounded up), then longest first (ties in sample order) each sample goes into the
    emptiest row it fits in, a new row when none has room: rows come out about equally full, and a sample longer
    than `pack_length` gets a row of its own. A pure function of the lengths."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    fills = [0] * -(-sum(n for n in lengths if n <= pack_length) // pack_length)
    row_of = [0] * len(lengths)
    for i in order:
        fits = [r for r, f in enumerate(fills) if f + lengths[i] <= pack_length]
        if fits:
            r = min(fits, key=lambda r: (fills[r], r))
        else:
            r = len(fills)
            fills.append(0)
        fills[r] += lengths[i]
        row_of[i] = r
    first: dict[int, int] = {}  # rows by their first sample: a row's number does not depend on the fill order
    for r in row_of:
        first.setdefault(r, len(first))
    return [first[r] for r in row_of]


def padding_share(lengths: Sequence[int], rows: Sequence[int] | None) -> float:
    """The share of a batch's token slots that are padding: rows padded to the fullest (unpacked: each sample a row,
    padded to the longest)."""
    rows = list(range(len(lengths))) if rows is None else list(rows)
    fills = [0] * (max(rows) + 1)
    for n, r in zip(lengths, rows):
        fills[r] += n
    slots = len(fills) * max(fills)
    return 1.0 - sum(lengths) / slots if slots else 0.0


class Packed:
    """The fused sequences of B right-padded samples (`TheWorld.fuse`'s output) laid out in their rows."""

    def __init__(self, mask: torch.Tensor, rows: torch.Tensor):
        """`mask`: (B, L) the fused attention mask (1 on a sample's tokens); `rows`: (B,) each sample's row."""
        device = mask.device
        rows = rows.to(device)
        lengths = mask.sum(1)
        n_rows = int(rows.max()) + 1
        fills = torch.zeros(n_rows, dtype=lengths.dtype, device=device).index_add_(0, rows, lengths)
        self.shape = (n_rows, int(fills.max()))
        b = torch.arange(len(rows), device=device)
        earlier = (rows[:, None] == rows[None, :]) & (b[None, :] < b[:, None])  # earlier samples of the same row
        offsets = (earlier * lengths[None, :]).sum(1)
        self.src = mask.bool().nonzero(as_tuple=True)  # (sample, token) of every real token
        sample, token = self.src
        self.dst = (rows[sample], offsets[sample] + token)  # (row, column) it moves to
        self.places = (rows, offsets, lengths)  # each sample's row, first column and length
        width = self.shape[1]
        # padding: one segment of its own per row (it attends to itself, so no row of a mask is empty)
        self.segment = (len(rows) + torch.arange(n_rows, device=device))[:, None].repeat(1, width)
        self.segment[self.dst] = sample
        self.positions = torch.zeros(self.shape, dtype=torch.long, device=device)
        self.positions[self.dst] = token

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) unpacked -> (rows, width, ...) packed, zeros on padding (differentiable)."""
        out = x.new_zeros(*self.shape, *x.shape[2:])
        return out.index_put(self.dst, x[self.src])

    def unpack(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(rows, width, ...) packed -> the unpacked layout of `like` (B, L, ...), zeros on padding."""
        out = y.new_zeros(*like.shape[:2], *y.shape[2:])
        return out.index_put(self.src, y[self.dst])

    def masks(self, token_types: torch.Tensor, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Gemma 3's two 4D masks ({layer type: (rows, 1, width, width)}) for the packed rows, in the format of the
        text config's attention implementation. `token_types`: (B, L) the fused token types (1 on image tokens)."""
        from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

        impl = config._attn_implementation or "eager"
        if impl in ("sdpa", SEGMENTS):
            return self.segments(token_types, config)
        if impl not in PACKED_ATTENTION:
            raise ValueError(
                f"packed batches need the attention implementation sdpa or eager, not {impl!r}: "
                "set train.loader.packing: false"
            )
        blocks = get_block_sequence_ids_for_mask(self.pack(token_types))
        seg, pos = self.segment, self.positions
        q, k = (lambda t: t[:, :, None]), (lambda t: t[:, None, :])  # noqa: E731 - query rows, key columns
        image = (q(blocks) == k(blocks)) & (q(blocks) >= 0)  # an image's tokens see each other both ways
        full = (q(seg) == k(seg)) & ((k(pos) <= q(pos)) | image)
        out = {"full_attention": full}
        if config.sliding_window is not None and "sliding_attention" in config.layer_types:
            out["sliding_attention"] = full & (k(pos) > q(pos) - config.sliding_window)
        if impl == "eager":  # an additive mask
            zero = torch.zeros((), dtype=dtype, device=self.positions.device)
            return {t: zero.masked_fill(~m, torch.finfo(dtype).min)[:, None] for t, m in out.items()}
        return {t: m[:, None] for t, m in out.items()}

    def segments(self, token_types: torch.Tensor, config) -> dict[str, Segments]:
        """Per layer type, each sample's place in its row and its own mask (None where plain causal attention is
        the mask: no image tokens and, in a sliding layer, no longer than the window)."""
        from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

        blocks = get_block_sequence_ids_for_mask(token_types)
        window = config.sliding_window if "sliding_attention" in config.layer_types else None
        out: dict[str, list] = {"full_attention": [], "sliding_attention": []}
        for b, (row, start, n) in enumerate(zip(*(t.tolist() for t in self.places))):
            full = _sample_mask(blocks[b, :n], None)
            out["full_attention"].append((row, start, n, full))
            out["sliding_attention"].append((row, start, n, _sample_mask(blocks[b, :n], window) if window else full))
        return {t: Segments(segs, self.shape[1]) for t, segs in out.items()}


def _sample_mask(blocks: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """(1, 1, n, n) bool: one sample's attention (causal, its image tokens both ways, within `window`), or None
    where that is plain causal attention."""
    n = len(blocks)
    image = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    if not image.any() and (window is None or n <= window):
        return None
    pos = torch.arange(n, device=blocks.device)
    mask = (pos[None, :] <= pos[:, None]) | image
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    return mask[None, None]


class Segments:
    """Where each sample of a packed batch sits ((row, start, length, its mask or None) each) and the rows' width:
    what a packed batch gives its attention layers in place of a mask (`segment_attention`)."""

    def __init__(self, segments: list[tuple[int, int, int, torch.Tensor | None]], width: int):
        self.segments, self.width = segments, width

    def attend(self, module, query, key, value, **kwargs) -> torch.Tensor:
        """(rows, width, heads, head_dim): each sample's queries attend to its own keys (zeros on padding)."""
        by_row: dict[int, list] = {}
        for row, _, n, mask in self.segments:  # a row's samples in column order
            by_row.setdefault(row, []).append((n, mask))
        out = []
        # unbind and split, not indexing: their backward is one stack / cat, an index's a zero tensor per sample
        for row, (q, k, v) in enumerate(zip(*(t.unbind(0) for t in (query, key, value)))):
            lengths = [n for n, _ in by_row[row]]
            pad = self.width - sum(lengths)
            parts = [
                sdpa_attention_forward(module, qs[None], ks[None], vs[None], mask, **kwargs)[0]
                for (_, mask), qs, ks, vs in zip(by_row[row], *(t.split([*lengths, pad], dim=1) for t in (q, k, v)))
            ]
            if pad:
                parts.append(parts[0].new_zeros(1, pad, *parts[0].shape[2:]))
            out.append(torch.cat(parts, 1))
        return torch.cat(out)


def segment_attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function registered as SEGMENTS: per sample for a packed batch, else sdpa."""
    if isinstance(attention_mask, Segments):
        return attention_mask.attend(module, query, key, value, **kwargs), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_segments(config) -> None:
    """Switch a text config's sdpa to SEGMENTS, for good: the switch has to outlive the forward, since activation
    checkpointing reruns the layers in the backward, and it leaves unpacked batches' numerics as they are."""
    if config._attn_implementation == "sdpa":
        config._attn_implementation = SEGMENTS


AttentionInterface.register(SEGMENTS, segment_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENTS, sdpa_mask)
