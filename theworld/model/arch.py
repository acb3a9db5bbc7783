"""Facts about TheWorld's architecture, in one place: its trainable parts, the VAE's downsampling and the world pools,
the base models known offline (hub ids and their architectures) and the sizes the real-size benchmarks build.

Used by the model (freeze), the optimiser (learning-rate groups), sharding, the memory estimate, precompute's sizing,
the benchmarks and the model card.
"""

from __future__ import annotations

from dataclasses import dataclass

# The parts of TheWorld a config freezes, trains or gives a learning-rate factor (freeze.*,
# train.optimizer.lr_multipliers.*), in their optimiser-group order: each is the modules at these paths (attribute paths
# from TheWorld, which are also the prefixes of their parameter names).
PARTS: dict[str, tuple[str, ...]] = {
    "projector": ("projector",),
    "vision": ("gemma.model.vision_tower", "gemma.model.multi_modal_projector"),  # SigLIP tower + multimodal projector
    "language": ("gemma.model.language_model", "gemma.lm_head"),
    "vae": ("world_encoder",),
}
FREEZABLE = ("vision", "language", "vae")  # the projector always trains
# Modules of TheWorld that are no such part: the Video2World transformer of live rollouts (world.num_world_steps > 0),
# frozen always; counted with the parts, in no optimiser group.
NEVER_TRAINED: dict[str, tuple[str, ...]] = {"rollout": ("rollout",)}
# The parts that may carry LoRA adapters (config section lora) and the names of their linear layers: Gemma 3's
# decoder layers, SigLIP's encoder layers.
LORA_MODULES = {
    "language": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "vision": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}
# The stacks activation checkpointing wraps (train.hardware.activation_checkpointing.parts,
# theworld/model/recompute.py):
# Gemma's decoder layers, SigLIP's encoder layers, the VAE encoder's down blocks and mid block.
CHECKPOINT_PARTS = ("language", "vision", "vae")
# The attention implementations packed batches are built for (theworld/model/packing.py)
PACKED_ATTENTION = ("sdpa", "eager")


def part_of(param_name: str) -> str:
    """The part a parameter of TheWorld (a `named_parameters` name) belongs to."""
    for part, paths in (PARTS | NEVER_TRAINED).items():
        if any(param_name == p or param_name.startswith(p + ".") for p in paths):
            return part
    raise ValueError(f"parameter {param_name} belongs to no part of TheWorld")


VAE_FACTOR = 8  # the Wan 2.1 VAE's spatial downsampling: a latent cell per 8 x 8 pixels
POOLS = (1, 2, 4)  # world.pool: latent cells averaged per world token along each side
# Aspect-ratio bucket sides are multiples of the VAE's downsampling x the largest world.pool, so every pool divides
# every latent grid (theworld/model/images.py, `buckets`).
BUCKET_STEP = VAE_FACTOR * max(POOLS)


def latent_side(pixels: int) -> int:
    """Latent cells along a side of `pixels` pixels."""
    return pixels // VAE_FACTOR


# Token layout of a typical training sample, for estimates and benchmarks: prompt + chat template around the image,
# plus a caption of ~32 answer tokens.
TEXT_TOKENS = 64
ANSWER_TOKENS = 32

# Gemma 3 4B (google/gemma-3-4b-it's architecture) and the Wan 2.1 VAE at its defaults, at 512 px.
REAL = {
    "text": dict(
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=1024,
        vocab_size=262208,
        query_pre_attn_scalar=256,
    ),
    "vision": dict(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
        vision_use_head=False,
    ),
    "mm_tokens": 256,
    "resolution": 512,
    "vae": {},
}
# The same code at toy sizes (CPU smoke tests of the benchmarks).
TINY = {
    "text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=64,
        vocab_size=512,
        query_pre_attn_scalar=32,
    ),
    "vision": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    ),
    "mm_tokens": 4,
    "resolution": 64,
    "vae": dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1),
}


@dataclass(frozen=True)
class KnownGemma:
    mm_tokens: int  # image tokens per image
    hidden_size: int  # of the language model
    sizes: dict | None = None  # the whole architecture, where known (tools.memory_plan builds it offline)


# Hub ids usable offline when their config is not in the local Hugging Face cache.
KNOWN_GEMMA = {
    "google/gemma-3-4b-it": KnownGemma(256, 2560, REAL),
    "google/gemma-3-4b-pt": KnownGemma(256, 2560, REAL),
    "google/gemma-3-12b-it": KnownGemma(256, 3840),
    "google/gemma-3-27b-it": KnownGemma(256, 5376),
}
# Each holds the Wan 2.1 VAE (diffusers' AutoencoderKLWan defaults, REAL["vae"]): 16 latent channels.
KNOWN_VAE = {
    "nvidia/Cosmos-Predict2-2B-Video2World": 16,
    "nvidia/Cosmos-Predict2-14B-Video2World": 16,
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 16,
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": 16,
}


def gemma_config(sizes: dict):
    """Gemma3Config at `sizes` (e.g. REAL, TINY)."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    from theworld.model import gemma3

    text = Gemma3TextConfig(**sizes["text"], layer_types=gemma3.layer_types(sizes["text"]["num_hidden_layers"]))
    vision = SiglipVisionConfig(**sizes["vision"])
    vocab = sizes["text"]["vocab_size"]
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=sizes["mm_tokens"],
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        image_token_index=vocab - 1,
    )
