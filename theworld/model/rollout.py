"""World rollouts: Cosmos-Predict2's Video2World pipeline imagines the latent frames after an image.

With `world.num_world_steps: N > 0`, diffusers' `Cosmos2VideoToWorldPipeline` (its transformer, scheduler, T5 text
encoder and tokenizer from the same spec as `model.vae`; the VAE already loaded is shared) denoises a video of
1 + N * (the VAE's temporal factor) frames conditioned on the image and a text, never a sample's caption (that would
leak the answer into the world tokens), and stops at its latents (`output_type="latent"`). The text is
`world.rollout.condition`'s: `fixed`, the run's one rollout prompt, encoded once per run; `question`, each sample's
question (`question_of`: the text of its turns before the first answer), encoded per sample, as the original code
conditioned its rollouts on the user's question. A sample's latents are then (C, 1 + N, h, w): frame 0 the observed
frame's VAE posterior exactly as without rollouts, frames 1..N the predicted ones, un-normalised into that same raw
VAE space.

Each sample's noise (the pipeline's draw of the conditioning latent and of the initial noise) comes from a generator
seeded with `sample_seed(seed, key)` (with `question`: `sample_seed(seed, key, question)`, so the seed covers the
question too), so a rerun, another process count, another batch and the live path of
`TheWorld.world_latents` reproduce it. Precompute and `inspect compare-live` use the cache's `seed` (precompute's).

The guardrail: NVIDIA's Open Model License asks for its `cosmos_guardrail` safety checker, so every spec but the
embedded `tiny` one (random weights, not NVIDIA's model) needs it installed; its text check runs on the rollout prompt
(the pipeline itself only checks prompts given as text, and here it is given embeddings). Predicted frames are never
decoded to video here, so its video check has nothing to check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from theworld.core import location
from theworld.core.device import default_device
from theworld.core.errors import UserError
from theworld.embedded import tiny
from theworld.model import encoders

# Predicted frames have no posterior: their stored logvar is this, a variance of exp(-30) ~ 1e-13, so world.latent:
# sample draws (to float precision) their mean.
PREDICTED_LOGVAR = -30.0
PARTS = ("transformer", "scheduler", "text_encoder", "tokenizer")  # the pipeline subfolders a rollout spec needs
TRANSFORMER_CLASS = "CosmosTransformer3DModel"
SPATIAL_MULTIPLE = 16  # the pipeline's height/width rule (the transformer's 2x2 patches of 8x latents)


CONDITIONS = ("fixed", "question")  # world.rollout.condition


def sample_seed(seed: int, key: str, question: str | None = None) -> int:
    """The 63-bit seed of sample `key`'s rollout noise in a run seeded `seed`: a pure function of the two (and, for
    rollouts conditioned on questions, of the sample's `question`)."""
    text = f"rollout:{seed}:{key}" if question is None else f"rollout:{seed}:{key}:question:{question}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_seeds(seed: int, keys: Sequence[str], questions: Sequence[str] | None = None) -> list[int]:
    if questions is None:
        return [sample_seed(seed, k) for k in keys]
    return [sample_seed(seed, k, q) for k, q in zip(keys, questions, strict=True)]


def question_of(sample) -> str:
    """A sample's rollout prompt under world.rollout.condition: question: the text of its turns before the first
    answer, which is its first user turn (its prompt); no answer, and no later turn, enters it."""
    return sample.turns[0][0]


def sample_inputs(condition: str, seed: int, samples: Sequence) -> tuple[list[int], list[str] | None]:
    """Each sample's rollout seed and, with `condition` question, its question: the one rule precompute, `inspect
    compare-live` and training's live rollouts share (samples with `key` and `turns`)."""
    questions = [question_of(s) for s in samples] if condition == "question" else None
    return sample_seeds(seed, [s.key for s in samples], questions), questions


def cache_condition(manifest: dict) -> str:
    """The rule a cache's rollouts were conditioned with (caches that record none: fixed)."""
    from theworld.cache_format.fingerprint import recorded

    return recorded((manifest.get("fingerprint") or {}).get("world") or {}, "condition")


def questions_tensor(questions: Sequence[str]) -> torch.Tensor:
    """Questions as one (B, L) uint8 tensor of their UTF-8 bytes, zero-padded: how they travel in a batch."""
    rows = [torch.tensor(list(q.encode()), dtype=torch.uint8) for q in questions]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True) if rows else torch.zeros(0, 0, dtype=torch.uint8)


def questions_of(t: torch.Tensor) -> list[str]:
    """The inverse of `questions_tensor`."""
    return [bytes(r[r != 0].tolist()).decode() for r in t.cpu()]


def cache_seed(manifest: dict) -> int:
    """The seed a cache's rollouts were drawn with (its fingerprint's `world.seed`), or for a cache without them the
    seed its precompute run had (its recorded config's), which a rollout cache of the same run would have used: with
    the samples' keys, what reproduces (or would have produced) the cache's rollouts live."""
    world = (manifest.get("fingerprint") or {}).get("world") or {}
    if "seed" in world:
        return int(world["seed"])
    return int((manifest.get("config") or {}).get("seed", 0))


def pixel_seeds(pixels: torch.Tensor, seed: int = 0, questions: Sequence[str] | None = None) -> list[int]:
    """Seeds for rows without a sample key (an image given to describe or generate): each from its pixels' bytes
    (and its question, for rollouts conditioned on questions)."""
    rows = pixels.detach().to("cpu", torch.uint8 if pixels.dtype == torch.uint8 else torch.float32).contiguous()
    keys = [hashlib.sha256(r.numpy().tobytes()).hexdigest() for r in rows]
    return sample_seeds(seed, keys, questions)


def check_settings(num_world_steps: int, rollout, resolution: int | None = None) -> None:
    """The rollout settings a run with `num_world_steps` predicted frames needs (nothing to check for 0)."""
    if not num_world_steps:
        return
    if rollout.condition == "fixed" and (not isinstance(rollout.prompt, str) or not rollout.prompt.strip()):
        raise UserError(
            "config key 'world.rollout.prompt': empty, but the Video2World pipeline conditions every rollout on it "
            "(world.num_world_steps > 0): give a caption-free description of how scenes continue"
        )
    if rollout.inference_steps < 1:
        raise UserError(f"config key 'world.rollout.inference_steps': must be >= 1, got {rollout.inference_steps}")
    if not 0 <= rollout.guidance_scale < math.inf:
        raise UserError(
            f"config key 'world.rollout.guidance_scale': must be a finite number >= 0, got {rollout.guidance_scale}"
        )
    if rollout.fps < 1:
        raise UserError(f"config key 'world.rollout.fps': must be >= 1, got {rollout.fps}")
    if resolution is not None and resolution % SPATIAL_MULTIPLE:
        raise UserError(
            f"config key 'image.resolution': rollouts need a multiple of {SPATIAL_MULTIPLE} (the Video2World "
            f"transformer's 2x2 patches of the VAE's 8x latents), got {resolution}"
        )


def resolve(spec: str) -> tuple[str, str]:
    """(folder or hub id, subfolder prefix) of the Video2World pipeline behind `model.vae` spec `spec`, refused in
    one line when it has no Video2World transformer."""
    if location.is_tiny(spec):
        return str(tiny.ensure(tiny.TINY_ROLLOUT_DIR)), ""
    encoders.check_available(spec, "model.vae", "transformer/config.json")
    p = Path(spec)
    if p.is_dir() and not (p / "transformer" / "config.json").is_file():
        raise no_transformer(spec, "no transformer/config.json")
    return spec, ""


def no_transformer(spec: str, why: str) -> UserError:
    return UserError(
        f"model.vae: {spec!r} has no Video2World transformer ({why}), which world.num_world_steps > 0 needs: "
        "give the pipeline's folder or hub id (nvidia/Cosmos-Predict2-2B-Video2World), or world.num_world_steps: 0"
    )


def at_inference(world, steps: int, stage: str):
    """`world` (a stage's world section) rolling out `steps` predicted latent frames at inference (`--world-steps`):
    any number the stage's learned temporal table has rows for, refused in one line otherwise."""
    if not world.num_world_steps:
        raise UserError(
            f"--world-steps: {stage} was trained without world rollouts (world.num_world_steps 0), so it has no "
            "temporal table to place predicted frames with"
        )
    if not 1 <= steps <= world.max_world_steps:
        raise UserError(
            f"--world-steps: must be in [1, {world.max_world_steps}] (the rows of {stage}'s temporal table, "
            f"world.max_world_steps), got {steps}; the observed frame alone is --baselines no_rollout"
        )
    return dataclasses.replace(world, num_world_steps=steps)


def steps_line(steps: int, temporal_factor: int) -> str:
    """What `steps` world steps are here, with the count the plan and the original code give the same rollout (they
    count video frames after the image: 1 + N video frames there, 1 + N latent frames here)."""
    return (
        f"world steps: {steps} predicted latent frame(s) after the image (the pipeline generates 1 + {temporal_factor}"
        f" x {steps} = {1 + temporal_factor * steps} video frames; the plan's num_world_steps counts video frames: "
        f"{temporal_factor * steps} there)"
    )


class _TinyNoGuardrail:
    """The embedded tiny model's stand-in for the safety checker the pipeline refuses to run without: the tiny
    weights are random, not NVIDIA's model, so its licence's guardrail does not apply (docs/precompute.md)."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True


def _guardrail(spec: str, prompts: list[str]):
    if location.is_tiny(spec):
        return _TinyNoGuardrail()
    from diffusers.utils import is_cosmos_guardrail_available

    if not is_cosmos_guardrail_available():
        raise UserError(
            f"model.vae: {spec!r} rollouts need NVIDIA's guardrail (its Open Model License asks for it): "
            "pip install cosmos_guardrail"
        )
    from cosmos_guardrail import CosmosSafetyChecker

    checker = CosmosSafetyChecker()
    for p in prompts:
        if not checker.check_text_safety(p):
            raise UserError(f"world.rollout: the Cosmos guardrail refuses the prompt {p[:80]!r}")
    return checker


def _check_transformer(spec: str, path: str, prefix: str) -> None:
    """The transformer's config, before anything heavy loads: a Video2World transformer this install can run."""
    from diffusers import CosmosTransformer3DModel
    from diffusers.utils import is_torchvision_available

    try:
        config = CosmosTransformer3DModel.load_config(path, subfolder=prefix + "transformer")
    except encoders.load_errors() as e:
        raise encoders.cannot_load("model.vae", spec, e) from None
    if config.get("_class_name") not in (None, TRANSFORMER_CLASS):
        raise no_transformer(spec, f"its transformer is a {config.get('_class_name')}")
    if config.get("concat_padding_mask", True) and not is_torchvision_available():
        # the transformer resizes its padding mask with torchvision
        raise UserError(f"model.vae: {spec!r}'s Video2World transformer needs torchvision: pip install torchvision")


def _load_parts(spec: str, path: str, prefix: str, dtype: torch.dtype) -> dict:
    """The pipeline's parts but the VAE from `resolve(spec)`'s (path, prefix)."""
    from diffusers import CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer, T5EncoderModel

    try:
        parts = {
            "transformer": CosmosTransformer3DModel.from_pretrained(
                path, subfolder=prefix + "transformer", torch_dtype=dtype
            ),
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder=prefix + "scheduler"),
            "text_encoder": T5EncoderModel.from_pretrained(path, subfolder=prefix + "text_encoder", dtype=dtype),
            "tokenizer": AutoTokenizer.from_pretrained(path, subfolder=prefix + "tokenizer"),
        }
    except encoders.load_errors() as e:
        raise encoders.cannot_load("model.vae", spec, e) from None
    return parts


def _encode_on(pipe, device: torch.device, prompt: str, negative: str | None, guidance: bool):
    """The pipeline's encode_prompt with its text encoder moved to `device` for the call (and back)."""
    text = pipe.text_encoder
    text.to(device)
    try:
        return pipe.encode_prompt(prompt, negative, do_classifier_free_guidance=guidance, device=device)
    finally:
        text.to("cpu")


class Rollout(nn.Module):
    """The frozen Video2World pipeline of one run: `forward(pixels, seeds)` -> each image's N predicted latent frames,
    (B, C, N, h, w) float32 in the VAE's raw latent space. The transformer is a submodule (frozen, counted apart from
    the trained parts: arch.NEVER_TRAINED); whoever holds the Rollout places it (TheWorld's `.to` or device map,
    precompute's `_load_models`), it never moves itself to its input, which would undo a device map; the VAE is the
    caller's, shared; the prompt embeddings are buffers, computed once, and the text encoder is let go after computing
    them. With `condition: question` the text encoder stays, a submodule placed with the rest, and encodes each
    sample's question (one at a time: a row's embedding does not depend on its batch-mates)."""

    def __init__(
        self,
        pipe,
        prompt_embeds,
        negative_embeds,
        num_world_steps: int,
        settings,
        text_identity: dict,
        text_encoder: nn.Module | None = None,
        guard=None,
    ):
        super().__init__()
        self.pipe = pipe
        self.text_identity = text_identity
        self.text_encoder = text_encoder.requires_grad_(False).eval() if text_encoder is not None else None
        self.guard = guard
        self.transformer = pipe.transformer.requires_grad_(False).eval()
        self.register_buffer("prompt_embeds", prompt_embeds, persistent=False)
        self.register_buffer("negative_embeds", negative_embeds, persistent=False)
        self.num_world_steps = num_world_steps
        self.settings = settings
        vae = pipe.vae.config
        self.register_buffer("latents_mean", torch.tensor(vae.latents_mean).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("latents_std", torch.tensor(vae.latents_std).view(1, -1, 1, 1, 1), persistent=False)

    @classmethod
    def load(cls, spec: str, dtype: str, vae: nn.Module, num_world_steps: int, settings) -> Rollout:
        """The pipeline for `model.vae` spec `spec` in `dtype` around the loaded `vae`, its prompt (and, with
        guidance, negative prompt) encoded once."""
        from diffusers import Cosmos2VideoToWorldPipeline
        from diffusers.pipelines.cosmos.pipeline_cosmos2_video2world import DEFAULT_NEGATIVE_PROMPT

        check_settings(num_world_steps, settings)
        encoders._quiet_hf()
        path, prefix = resolve(spec)
        _check_transformer(spec, path, prefix)
        guidance = settings.guidance_scale > 1.0
        negative = settings.negative_prompt
        fixed = [] if settings.condition == "question" else [settings.prompt]  # questions: checked as they come
        guard = _guardrail(spec, fixed + ([negative] if guidance and negative else []))  # before 15 GB
        parts = _load_parts(spec, path, prefix, encoders.DTYPES[dtype])
        pipe = Cosmos2VideoToWorldPipeline(vae=vae, safety_checker=guard, **parts)
        pipe.set_progress_bar_config(disable=True)
        text = parts["text_encoder"]
        # the text side's identity from its weights and the prompts' token ids, not from the embeddings: those differ
        # in the last bits between devices, and a cache built on a GPU must check out on a CPU
        texts = fixed + ([DEFAULT_NEGATIVE_PROMPT if negative is None else negative] if guidance else [])
        ids = parts["tokenizer"](texts)["input_ids"] if texts else []
        text_identity = {
            "config": encoders.config_digest(text.config.to_dict()),
            "weights": encoders.weights_hash(text),
            "tokens": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        }
        device = default_device()  # T5-XXL on a CPU takes minutes
        if settings.condition == "question":  # each sample's question is encoded as it comes; the negative now
            with torch.no_grad():
                negative_embeds = _encode_on(pipe, device, texts[0], None, False)[0].cpu() if guidance else None
            return cls(pipe, None, negative_embeds, num_world_steps, settings, text_identity, text, guard)
        with torch.no_grad():
            prompt, negative_embeds = _encode_on(pipe, device, settings.prompt, negative, guidance)
        negative_embeds = negative_embeds.cpu() if negative_embeds is not None else None
        pipe.text_encoder = None  # the embeddings are all a run needs of it (T5-XXL: ~9 GB in bf16)
        return cls(pipe, prompt.cpu(), negative_embeds, num_world_steps, settings, text_identity)

    @property
    def num_frames(self) -> int:
        """Video frames the pipeline generates so that its latent has 1 + N frames."""
        return 1 + self.num_world_steps * self.pipe.vae_scale_factor_temporal

    def identity(self) -> dict:
        """What of the loaded pipeline changes the predicted frames, for the cache fingerprint: the transformer's
        config and weights, the scheduler's config, the text encoder's config and weights and the prompts' token
        ids."""
        return {
            "transformer": {
                "config": encoders.config_digest(dict(self.transformer.config)),
                "weights": encoders.weights_hash(self.transformer),
            },
            "scheduler": encoders.config_digest(dict(self.pipe.scheduler.config)),
            "text_encoder": self.text_identity,
        }

    @property
    def condition(self) -> str:
        return self.settings.condition

    def _question_embeds(self, questions: Sequence[str]) -> torch.Tensor:
        """(B, L, D) prompt embeddings of each row's question, each encoded alone."""
        device = next(self.text_encoder.parameters()).device
        rows = []
        for q in questions:
            if not self.guard.check_text_safety(q):
                raise UserError(
                    f"world.rollout.condition question: the Cosmos guardrail refuses the question {q[:80]!r}"
                )
            rows.append(self.pipe.encode_prompt(q, None, do_classifier_free_guidance=False, device=device)[0])
        return torch.cat(rows)

    @torch.no_grad()
    def forward(
        self, pixels: torch.Tensor, seeds: Sequence[int], questions: Sequence[str] | None = None
    ) -> torch.Tensor:
        """(B, C, N, h, w) float32 predicted latent frames of (B, 3, H, W) images (uint8, or float in [-1, 1]), each
        row's noise from a generator seeded with its entry of `seeds`; with `condition: question`, each row
        conditioned on its entry of `questions`."""
        if len(seeds) != len(pixels):
            raise ValueError(f"rollouts need one seed per image: {len(seeds)} seeds for {len(pixels)} images")
        if self.condition == "question" and (questions is None or len(questions) != len(pixels)):
            raise ValueError("world.rollout.condition question: rollouts need one question per image")
        b, _, height, width = pixels.shape
        image = pixels.float() / 255.0 if pixels.dtype == torch.uint8 else (pixels.float() + 1) / 2
        # CPU generators: a sample's noise is the same on every device; one per sample (the pipeline then draws each
        # row's conditioning latent and noise from its own), so batch-mates do not change it
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        negative = self.negative_embeds.expand(b, -1, -1) if self.negative_embeds is not None else None
        s = self.settings
        latents = self.pipe(
            image=image,
            prompt_embeds=(
                self._question_embeds(questions)
                if self.condition == "question"
                else self.prompt_embeds.expand(b, -1, -1)
            ),
            negative_prompt_embeds=negative,
            height=height,
            width=width,
            num_frames=self.num_frames,
            num_inference_steps=s.inference_steps,
            guidance_scale=s.guidance_scale,
            fps=s.fps,
            generator=generators,
            output_type="latent",
        ).frames
        sigma_data = self.pipe.scheduler.config.sigma_data
        # the pipeline's normalised latents back into the VAE's raw space, as the pipeline does before decoding
        raw = latents.float() * self.latents_std / sigma_data + self.latents_mean
        return raw[:, :, 1:]


def with_predicted(
    mean: torch.Tensor, logvar: torch.Tensor | None, predicted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean, logvar) of the observed frame (B, C, 1, h, w) followed by the predicted frames (B, C, N, h, w): frame 0
    keeps its values (and its gradient), predicted frames get PREDICTED_LOGVAR."""
    predicted = predicted.to(mean.device, mean.dtype)
    out_mean = torch.cat([mean, predicted], dim=2)
    if logvar is None:
        return out_mean, None
    return out_mean, torch.cat([logvar, torch.full_like(predicted, PREDICTED_LOGVAR).to(logvar.dtype)], dim=2)


def observed_and_predicted(
    encoder: nn.Module,
    rollout: Rollout,
    pixels: torch.Tensor,
    seeds: Sequence[int],
    questions: Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, logvar), each (B, C, 1 + N, h, w): the world encoder's posterior of each image, then its rollout."""
    mean, logvar = encoder(pixels)
    return with_predicted(mean, logvar, rollout(pixels, seeds, questions))
