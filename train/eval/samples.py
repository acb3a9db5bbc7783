"""Captions generated at every eval for a fixed set of held-out samples: with their own world, with their eval partner's
(shuffled) world, next to the true caption. The model's own generation (theworld/infer/generate.py: KV cache, greedy)
runs on the cached inputs the eval loss reads, so what is shown is what the loss measured."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from theworld.infer.generate import Sampler, decode, left_align, stop_ids
from theworld.model.inputs import ModelInputs, prompt_only
from train.data.batches import Collate
from train.sharding import root_gathered

if TYPE_CHECKING:
    from train.components import Components
    from train.data.loader import DataContext
    from train.metrics import Metrics
    from train.step import LoopState


@dataclass
class Group:
    """Held-out samples of one latent shape, collated once."""

    positions: list[int]  # in the held-out split
    batch: object  # train.batches.Batch of (prompt, caption) rows with their partners' worlds
    prompt: ModelInputs  # the rows' prompts alone (prompt_only)


class CaptionSamples:
    """The first `n` held-out samples (the split is fixed by key hash, so the same ones at every eval and resume)."""

    def __init__(self, cfg, ctx: DataContext, n: int):
        self.cfg, self.ctx, self.n = cfg, ctx, n
        self.groups: list[Group] | None = None  # read at the first eval, after the run's start lines are out

    def _read(self) -> None:
        cfg, ctx, n = self.cfg, self.ctx, self.n
        dataset = ctx.dataset(cfg, ctx.eval_indices, 0, flip=False, partner=True)
        n = min(n, len(dataset))
        items = [dataset[i] for i in range(n)]
        first_turns = [it["text"][0] for it in items]  # (prompt, answer); a conversation is judged by its first turn
        self.captions = [answer for _, answer in first_turns]
        self.images = [_picture(ctx.reader, int(ctx.eval_indices[i])) for i in range(n)]
        self.max_new_tokens = cfg.train.eval.caption_tokens
        shapes = ctx.buckets[ctx.eval_indices[:n]]
        self.groups = []
        for shape in dict.fromkeys(shapes.tolist()):
            pos = [i for i in range(n) if shapes[i] == shape]
            prompt = prompt_only([ctx.formatter.prefix(first_turns[i][0]) for i in pos], ctx.formatter.pad_id)
            self.groups.append(Group(pos, Collate(ctx.formatter)([items[i] for i in pos]), prompt))

    @torch.no_grad()
    def run(self, components: Components) -> list[dict]:
        """One row per sample: caption, own_world, shuffled_world (greedy). Every process runs it (under FSDP each
        forward is a collective); the main process logs it."""
        if self.groups is None:
            self._read()
        model, acc = components.raw, components.accelerator
        rows: list[dict] = [{} for _ in self.captions]
        with model.evaluating(), root_gathered(model):  # generation calls the model's parts, not its forward
            for g in self.groups:
                batch, prompt = g.batch.to(acc.device), g.prompt.to(acc.device)
                for name, world in (("own_world", batch.own_world()), ("shuffled_world", batch.partner_world())):
                    for i, text in zip(g.positions, self._generate(model, acc, world.behind(prompt))):
                        rows[i][name] = text
        return [{"caption": c, **r} for c, r in zip(self.captions, rows)]

    def log(self, metrics: Metrics, state: LoopState, rows: list[dict]) -> None:
        metrics.log_samples(state.step, rows, self.images)

    def _generate(self, model, acc, inputs: ModelInputs) -> list[str]:
        with acc.autocast():
            fused = left_align(model.embed_inputs(inputs))
            tok = model.processor.tokenizer
            out = decode(
                model,
                fused,
                self.max_new_tokens,
                Sampler(False, 1.0, 1.0, None, acc.device),
                stop_ids(model),
                tok.pad_token_id,
            )
        return [tok.decode(row, skip_special_tokens=True).strip() for row in out]


def _picture(reader, index: int) -> np.ndarray | None:
    """The sample's picture (HWC uint8) when the cache kept it, for TensorBoard and W&B."""
    members, reader.members = reader.members, None  # training reads only what it needs, never the image
    try:
        image = reader.decode(index, reader.raw(index), tensors=False).image
    finally:
        reader.members = members
    if not image:
        return None
    from PIL import Image

    with Image.open(io.BytesIO(image)) as im:
        return np.asarray(im.convert("RGB"))
