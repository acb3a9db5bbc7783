"""The embedded default: a tiny seeded Gemma 3 (with a locally built tokenizer and processor), a tiny Wan VAE and,
for world rollouts only, the tiny rest of a Video2World pipeline (transformer, scheduler, T5 text encoder, tokenizer).

No download is possible on our machines or in CI, so `model.gemma: tiny` / `model.vae: tiny` build these once, save
them with `save_pretrained` under `cache/models/`, and from then on load them through the same `from_pretrained` code a
hub id or a local checkpoint goes through. Building is deterministic, so every machine gets identical weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from theworld.core import atomic
from theworld.embedded import synthetic
from theworld.model import gemma3

TINY_GEMMA_DIR = "tiny-gemma3"
TINY_VAE_DIR = "tiny-wan-vae"
# Built only when a run asks for rollouts (world.num_world_steps > 0), so N = 0 runs (make demo) never build it; laid
# out as a diffusers pipeline folder without vae/ (the pipeline shares the tiny VAE).
TINY_ROLLOUT_DIR = "tiny-cosmos-video2world"
SEED = 1234
# Large enough that the tied output embedding does not cap the logits: with the default 0.02 the logit length is
# capped near 0.02 * hidden, which caps what any projector can achieve at hidden 128.
INITIALIZER_RANGE = 0.05
SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
# Gemma 3's chat template, reduced to what we use: text and image content, user/model turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def models_root() -> Path:
    """Where tiny models live: $THEWORLD_MODELS, else cache/models/ of the working directory."""
    return Path(os.environ.get("THEWORLD_MODELS", "cache/models"))


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["user\nmodel\n", "\n\n", *synthetic.VOCABULARY, *(f" {w}" for w in synthetic.VOCABULARY)]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
    )


def _gemma_config(tokenizer, initializer_range: float = INITIALIZER_RANGE, **text_sizes):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    sizes = {
        **dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            sliding_window=64,
        ),
        **text_sizes,
    }
    # Real Gemma 3 scales queries by head_dim**-0.5 (query_pre_attn_scalar 256 = head_dim). Keep that ratio: with q/k
    # RMS-normalised, the default 256 at head_dim 32 would cap attention logits at 2, too flat to read world tokens.
    sizes.setdefault("query_pre_attn_scalar", sizes["head_dim"])
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        **sizes,
        layer_types=gemma3.layer_types(sizes["num_hidden_layers"]),
        max_position_embeddings=2048,
        initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    ids = tokenizer.convert_tokens_to_ids
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        initializer_range=initializer_range,
    )


def build_tiny_gemma(out_dir: Path, **text_sizes) -> None:
    """Save a seeded random Gemma 3 + processor to out_dir (text_sizes override the tiny text-model sizes)."""
    from transformers import Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    torch.manual_seed(SEED)
    tokenizer = _build_tokenizer()
    config = _gemma_config(tokenizer, **text_sizes)
    model = Gemma3ForConditionalGeneration(config).eval()
    # A random model's multimodal projector is zero: image features would be all zero. Give it the scale of a
    # token embedding so the image path carries signal, as a trained one does.
    with torch.no_grad():
        w = model.model.multi_modal_projector.mm_input_projection_weight
        w.normal_(0.0, INITIALIZER_RANGE * config.text_config.hidden_size**0.5 / w.shape[0] ** 0.5)
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=config.mm_tokens_per_image,
    )
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def build_tiny_vae(out_dir: Path) -> None:
    from diffusers import AutoencoderKLWan

    from theworld.model.images import to_uint8_tensor

    torch.manual_seed(SEED)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1).eval()
    # The config's latents_mean/std are the real Wan VAE's statistics; a random VAE's latents live elsewhere.
    # Measure its own on synthetic scenes so the projector's per-channel normalisation means what it means for real.
    pixels = torch.stack([to_uint8_tensor(synthetic.scene(SEED, i)[0]) for i in range(64)])
    with torch.no_grad():
        mean = vae.encode((pixels.float() / 127.5 - 1).unsqueeze(2)).latent_dist.mean
    vae.register_to_config(
        latents_mean=mean.mean(dim=(0, 2, 3, 4)).tolist(), latents_std=mean.std(dim=(0, 2, 3, 4)).tolist()
    )
    vae.save_pretrained(out_dir)


def _build_t5_tokenizer():
    """A byte-level BPE tokenizer (any text round-trips) with T5's special tokens, trained on the words the tiny
    model meets: the rollout prompts and the synthetic captions."""
    from diffusers.pipelines.cosmos.pipeline_cosmos2_video2world import DEFAULT_NEGATIVE_PROMPT
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from theworld.model.config import ROLLOUT_PROMPT

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [ROLLOUT_PROMPT, DEFAULT_NEGATIVE_PROMPT, *synthetic.VOCABULARY, *(f" {w}" for w in synthetic.VOCABULARY)]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<pad>", "</s>", "<unk>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="right"
    )


def build_tiny_rollout(out_dir: Path) -> None:
    """A seeded random Cosmos-Predict2 transformer (17 input channels: the VAE's 16 and the condition mask), the
    pipeline's scheduler and a tiny T5 encoder + tokenizer, saved as pipeline subfolders."""
    from diffusers import CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(SEED)
    tokenizer = _build_t5_tokenizer()
    text = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    # concat_padding_mask: False (the real model's True resizes the mask with torchvision, which we do not install;
    # the pipeline's padding mask is all zeros for an unpadded image)
    transformer = CosmosTransformer3DModel(
        in_channels=17,
        out_channels=16,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        mlp_ratio=2.0,
        text_embed_dim=text.d_model,
        adaln_lora_dim=4,
        max_size=(32, 64, 64),
        patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0),
        concat_padding_mask=False,
        extra_pos_embed_type="learnable",
    ).eval()
    T5EncoderModel(text).eval().save_pretrained(out_dir / "text_encoder")
    tokenizer.save_pretrained(out_dir / "tokenizer")
    transformer.save_pretrained(out_dir / "transformer")
    FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True, shift=1.0).save_pretrained(out_dir / "scheduler")


def ensure(name: str) -> Path:
    """Path of tiny model `name` (TINY_GEMMA_DIR, TINY_VAE_DIR or TINY_ROLLOUT_DIR), building it first if absent.

    Built into a temporary folder and renamed into place, so concurrent processes (accelerate launch) and a killed
    build never leave a half-written model behind.
    """
    target = models_root() / name
    if target.exists():
        return target
    builders = {TINY_GEMMA_DIR: build_tiny_gemma, TINY_VAE_DIR: build_tiny_vae, TINY_ROLLOUT_DIR: build_tiny_rollout}
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale(target.parent, name)  # a build killed by kill -9
    full = lambda tmp: f"no space left on device building the tiny model {name} in {tmp}"
    try:
        with atomic.folder(target, full) as tmp:
            builders[name](tmp)
            tmp.chmod(0o755)
    except OSError:
        if not target.exists():  # a real failure, not a lost race with another process
            raise
    return target
