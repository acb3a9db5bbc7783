"""Generation for `TheWorld.generate` (it takes the model as an argument and imports nothing of it): the fused
prefix (world tokens, image tokens, prompt) runs once into a transformers `DynamicCache`, then one token per step.

Masking is Gemma 3's own: the prefix goes through `Gemma3Model` with `token_type_ids`, which makes each image block
bidirectional as in training; decoding steps are plain causal text. Rows are fused right-padded (as in training) and
then left-aligned, so every row's last prefix token sits in the last column and new tokens append to all rows at once;
each row keeps positions 0..len-1 and padding is masked out, so a row gets the tokens it would get alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from theworld.core.errors import UserError
from theworld.model import images as imagelib
from theworld.model.gemma3 import kv_cache
from theworld.model.inputs import ModelInputs, prompt_only
from theworld.model.rollout import questions_tensor


def prepare(model, images: list, prompts: list[str], world_images: list | None = None) -> ModelInputs:
    """Model inputs (right-padded prompt ids, VAE pixels, SigLIP pixel values) for one image per prompt."""
    if model.processor is None:
        raise ValueError("generate needs the model's processor: build it with from_config or from_pretrained")
    cfg, formatter = model.image_config, model.formatter

    def load(image, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return imagelib.for_model(
                imagelib.to_bytes(image), cfg.resolution, cfg.resize, model.processor.image_processor
            )
        except (OSError, imagelib.BadImage) as e:
            raise UserError(f"{what}: {e}") from None

    loaded = [load(im, f"image {_name(im, i)}") for i, im in enumerate(images)]
    prefixes = [formatter.prefix(p) for p in prompts]
    pixels = torch.stack([px for px, _ in loaded])
    if world_images is not None:
        pixels = torch.stack([load(im, f"world image {_name(im, i)}")[0] for i, im in enumerate(world_images)])
    # world.rollout.condition: question: each image rolls out on its prompt (a world image's too: the row's question)
    questions = questions_tensor(prompts) if getattr(model.rollout, "condition", "fixed") == "question" else None
    return prompt_only(
        prefixes,
        formatter.pad_id,
        images=pixels,
        pixel_values=torch.stack([pv for _, pv in loaded]),
        rollout_questions=questions,
    )


def _shape_groups(model, images: list, world_images: list | None) -> list[list[int]]:
    """Indices of the images grouped by (VAE input size, world image's input size)."""
    cfg = model.image_config

    def size(image, i: int, what: str) -> tuple[int, int]:
        try:
            return imagelib.input_size(image, cfg.resolution, cfg.resize)
        except (OSError, imagelib.BadImage) as e:
            raise UserError(f"{what} {_name(image, i)}: {e}") from None

    keys = [
        (size(im, i, "image"), None if world_images is None else size(world_images[i], i, "world image"))
        for i, im in enumerate(images)
    ]
    return imagelib.same_shape_groups(keys)


def _name(image, i: int) -> str:
    return str(image) if isinstance(image, (str, Path)) else f"#{i}"


def left_align(fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded fused inputs -> the same rows left-padded (each row rolled right by its padding)."""
    mask = fused["attention_mask"]
    n = mask.shape[1]
    shift = n - mask.sum(1, keepdim=True)
    idx = (torch.arange(n, device=mask.device) - shift) % n
    out = {}
    for k, v in fused.items():
        index = idx if v.dim() == 2 else idx.unsqueeze(-1).expand_as(v)
        out[k] = v.gather(1, index)
    return out


class Sampler:
    """Greedy, or temperature / top-p sampling through transformers' own logits warpers."""

    def __init__(self, do_sample: bool, temperature: float, top_p: float, seed: int | None, device):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        self.do_sample = do_sample
        if do_sample:
            if not temperature > 0 or not 0 < top_p <= 1:
                raise UserError(f"sampling needs temperature > 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
            self.warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
            self.generator = torch.Generator(device)
            self.generator.manual_seed(seed if seed is not None else torch.seed())

    def __call__(self, generated: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(-1)
        probs = torch.softmax(self.warpers(generated, logits), dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]


def stop_ids(model) -> list[int]:
    tok = model.processor.tokenizer
    ids = {tok.convert_tokens_to_ids("<end_of_turn>"), tok.eos_token_id}
    eos = model.gemma.generation_config.eos_token_id if model.gemma.generation_config is not None else None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(i for i in ids if i is not None and i >= 0)


@torch.no_grad()
def decode(
    model,
    fused: dict[str, torch.Tensor],
    max_new_tokens: int,
    sampler: Sampler,
    stop: list[int],
    pad_id: int,
    use_cache: bool = True,
) -> list[list[int]]:
    """New token ids of each row of left-aligned fused inputs, up to and without the stop token."""
    from transformers import DynamicCache

    lm, embed = model.gemma.model, model.gemma.get_input_embeddings()
    embeds, mask, pos, types = (fused[k] for k in ("inputs_embeds", "attention_mask", "position_ids", "token_type_ids"))
    b, device = embeds.shape[0], embeds.device
    cache = DynamicCache(config=model.gemma.config.get_text_config()) if use_cache else None
    stop_t = torch.tensor(stop, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    generated = torch.zeros(b, 0, dtype=torch.long, device=device)
    step = {"inputs_embeds": embeds, "position_ids": pos, "token_type_ids": types}
    for _ in range(max_new_tokens):
        hidden = lm(**step, attention_mask=mask, **kv_cache(lm, cache), use_cache=use_cache).last_hidden_state
        token = sampler(generated, model.logits(hidden[:, -1]).float())
        token = torch.where(done, torch.full_like(token, pad_id), token)
        generated = torch.cat([generated, token[:, None]], dim=1)
        done |= torch.isin(token, stop_t)
        if bool(done.all()):
            break
        new = {
            "inputs_embeds": embed(token[:, None]).to(embeds.dtype),
            "position_ids": pos[:, -1:] + 1,
            "token_type_ids": torch.zeros_like(token[:, None]),
        }
        mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
        pos = torch.cat([pos, new["position_ids"]], dim=1)
        if use_cache:  # the new token only; it is text, so the plain causal mask applies (as in transformers)
            step = {"inputs_embeds": new["inputs_embeds"], "position_ids": new["position_ids"]}
        else:  # the whole sequence again, image blocks marked as in the first step
            step = {k: torch.cat([step[k], new[k]], dim=1) for k in step}
    out = []
    for row in generated.tolist():
        ends = [i for i, t in enumerate(row) if t in stop]
        out.append(row[: ends[0]] if ends else row)
    return out


def generate(
    model,
    images: list,
    prompts: str | list[str],
    *,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    use_cache: bool = True,
    world_images: list | None = None,
    seed: int | None = None,
) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts] * len(images)
    if len(prompts) != len(images) or (world_images is not None and len(world_images) != len(images)):
        raise ValueError(
            f"{len(images)} images, {len(prompts)} prompts"
            + ("" if world_images is None else f", {len(world_images)} world images")
        )
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not images:
        return []
    groups = _shape_groups(model, images, world_images)
    if len(groups) > 1:  # a bucketed model's images of several aspect ratios: one generation per input shape
        out: list[str] = [""] * len(images)
        for g in groups:
            texts = generate(
                model,
                [images[i] for i in g],
                [prompts[i] for i in g],
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=temperature,
                top_p=top_p,
                use_cache=use_cache,
                world_images=None if world_images is None else [world_images[i] for i in g],
                seed=seed,
            )
            for i, text in zip(g, texts):
                out[i] = text
        return out
    device = model.input_device
    inputs = prepare(model, images, prompts, world_images).to(device)
    with torch.no_grad(), model.evaluating(keep_mode=True):  # inference reads the posterior mean, as eval does
        fused = left_align(model.embed_inputs(inputs))
    sampler = Sampler(do_sample, temperature, top_p, seed, device)
    tok = model.processor.tokenizer
    ids = decode(model, fused, max_new_tokens, sampler, stop_ids(model), tok.pad_token_id, use_cache)
    return [decode_text(tok, row) for row in ids]


def decode_text(tok, ids: list[int]) -> str:
    """The whole sequence decoded at once; when generation stopped inside a character (a UTF-8 character spans up to
    four byte tokens), the incomplete character is left out instead of ending the text in U+FFFD."""
    text = tok.decode(ids, skip_special_tokens=True)
    for cut in range(1, min(4, len(ids) + 1)):
        if not text.endswith("\ufffd"):
            break
        text = tok.decode(ids[:-cut], skip_special_tokens=True)
    return text.rstrip("\ufffd").strip()
