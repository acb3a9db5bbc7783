"""Model FLOPs of a training step and model FLOPs utilisation (MFU), from the model's config and what trains.

Counted as PaLM (appendix B) and torchtitan count them: a matmul of an (m, k) input with a (k, n) weight is 2mkn FLOPs
forward; its backward is as much again for the input's gradient and as much again for the weight's, the latter only
where the weight trains. Attention adds, per token and layer, 4 * heads * head_dim * context forward (the scores and
their weighted sum; `context` the sequence length, the sliding window on Gemma 3's local layers) and twice that
backward. Only what the step computes counts, from the model's config:

- the language model: every token's layers forward and their input gradients backward (the world projector below it
  always trains), the weight gradients where `freeze.language` is false (LoRA adapters' few FLOPs are left out); the
  output head only on the answer tokens, whose logits the loss computes;
- the vision tower + multimodal projector per image, when image tokens are computed live: forward, and backward where
  it trains (unfrozen or with adapters);
- the world projector per world token. The VAE's convolutions are not counted (world latents are cached in all but
  the runs that train the VAE).

MFU = the step's model FLOPs / its time / (the device's dense bf16 peak x processes); the peak from `PEAK_TFLOPS` by
the CUDA device name, or `train.hardware.peak_tflops`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' datasheets; the first name found in the
# device's name wins, so the more specific names come first.
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM
    "H200": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
}


def peak_tflops(device_name: str, configured: float = 0.0) -> float | None:
    """The peak MFU is measured against: `configured` (train.hardware.peak_tflops) when > 0, else the table's entry
    for the device, None for a device it does not know."""
    if configured > 0:
        return configured
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


def mfu(flops: float, seconds: float, peak: float, processes: int) -> float:
    """Model FLOPs utilisation: `flops` done by `processes` devices in `seconds`, against `peak` TFLOP/s each."""
    return flops / seconds / (peak * 1e12 * processes)


def _layer_matmul_params(tc) -> int:
    """Weights of one Gemma 3 decoder layer that multiply every token: q, k, v, o and the gated MLP's three."""
    h, hd = tc.hidden_size, tc.head_dim
    attention = h * hd * (2 * tc.num_attention_heads + 2 * tc.num_key_value_heads)
    return attention + 3 * h * tc.intermediate_size


def _attention(tc, seq: float) -> float:
    """Forward attention FLOPs per token of a sequence of `seq` tokens, over all layers (local layers see at most
    their sliding window)."""
    types = getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers
    window = getattr(tc, "sliding_window", None) or seq
    per_context = 4 * tc.num_attention_heads * tc.head_dim
    return sum(per_context * (min(seq, window) if t == "sliding_attention" else seq) for t in types)


def _vision_image(vc, mm_tokens: int, text_hidden: int) -> tuple[float, float]:
    """(matmul FLOPs forward per image / 2, i.e. weights x tokens, and attention FLOPs forward per image) of SigLIP
    and the multimodal projector."""
    h, patches = vc.hidden_size, (vc.image_size // vc.patch_size) ** 2
    layer = 4 * h * h + 2 * h * vc.intermediate_size
    weights_x_tokens = patches * (3 * vc.patch_size**2 * h + vc.num_hidden_layers * layer) + mm_tokens * h * text_hidden
    attention = vc.num_hidden_layers * 4 * h * patches * patches
    return weights_x_tokens, attention


@dataclass(frozen=True)
class FlopCounter:
    """What a step's FLOPs depend on, settled once per run."""

    text: object  # the language model's config (Gemma3TextConfig)
    vision: object | None  # SigLIP's config; None: image tokens are read from the cache
    mm_tokens: int  # image tokens per image
    language_trains: bool  # weight gradients of the language model
    vision_trains: bool  # backward through SigLIP (unfrozen or with adapters)
    vision_weights_train: bool  # and its weight gradients (unfrozen)
    projector_params: int  # weights of the world projector's matmuls

    @classmethod
    def of(cls, model, freeze, lora, cached_siglip: bool) -> FlopCounter:
        """From a TheWorld (`model`), its freeze flags and lora section, and whether image tokens are cached."""
        from theworld.model.config import trains

        cfg = model.gemma.config
        proj = sum(p.numel() for n, p in model.projector.named_parameters() if n.endswith("weight") and p.dim() == 2)
        return cls(
            text=cfg.get_text_config(),
            vision=None if cached_siglip else cfg.vision_config,
            mm_tokens=cfg.mm_tokens_per_image,
            language_trains=not freeze.language,
            vision_trains=trains(freeze, lora, "vision"),
            vision_weights_train=not freeze.vision,
            projector_params=proj,
        )

    def step(self, tokens: int, rows: int, answer_tokens: int, images: int, world_tokens: int) -> float:
        """Model FLOPs of a step over `rows` sequences holding `tokens` real tokens in all (world block included),
        `answer_tokens` of them scored, `images` images and `world_tokens` world tokens."""
        tc = self.text
        seq = tokens / max(rows, 1)
        linear = _layer_matmul_params(tc) * tc.num_hidden_layers
        forward = 2 * linear + _attention(tc, seq)
        backward = 2 * linear + 2 * _attention(tc, seq) + (2 * linear if self.language_trains else 0)
        head = 2 * tc.vocab_size * tc.hidden_size  # forward; its input gradient as much, its weight's if it trains
        total = tokens * (forward + backward) + answer_tokens * head * (3 if self.language_trains else 2)
        if self.vision is not None and images:
            wt, att = _vision_image(self.vision, self.mm_tokens, tc.hidden_size)
            per_image = 2 * wt + att
            if self.vision_trains:
                per_image += 2 * wt + 2 * att + (2 * wt if self.vision_weights_train else 0)
            total += images * per_image
        return total + world_tokens * 6 * self.projector_params
