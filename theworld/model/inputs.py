"""`ModelInputs`: what the model is given for a batch, and (through `labels`) what it is judged on.

The training loader produces it (train/data/batches.py packs it for the trip from a loader worker), and every consumer
takes it: the training step and the eval loss (train/step.py), `TheWorld.forward` / `embed_inputs` /
`answer_logprobs`, the evaluation conditions (theworld/infer/baselines.py) and scorer, generation, the caption samples
and the lmms-eval adapter. Its field names are the batch's key names (`from_tensors` / `to_tensors`), written here
only. `text_batch` right-pads tokenised rows; `prompt_only` builds the batch of prompts that generation and prefix
scoring continue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from theworld.model.objective import IGNORE
from theworld.model.text import Encoded

PARTNER = "partner:"  # prefix of a held-out batch's partner-world keys (train/data/cache.py, the shuffled-world loss)
TEXT = ("input_ids", "attention_mask", "labels")
WORLD = ("latent_mean", "latent_logvar", "images")  # what a row's world tokens are made from
# a live rollout's noise seeds travel with the pixels they roll out (a partner's world brings its own)
PARTNER_FIELDS = (*WORLD, "rollout_seeds", "rollout_questions")
IMAGE = ("pixel_values", "siglip")  # what its image tokens are made from


@dataclass
class ModelInputs:
    """A batch of B right-padded rows. World inputs: cached VAE posteriors (latent_mean, latent_logvar:
    (B, C, frames, h, w): the observed frame, then world.num_world_steps predicted ones) or uint8 pixels the loaded
    VAE encodes (images: (B, 3, H, W)). Image inputs: cached SigLIP features (siglip: one (tokens, hidden) block per
    image, all images in row order) or SigLIP pixel values."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L): 1 on real tokens
    labels: torch.Tensor | None = (
        None  # (B, L): answer tokens, IGNORE elsewhere (theworld/model/objective.py); None: prompts
    )
    latent_mean: torch.Tensor | None = None
    latent_logvar: torch.Tensor | None = None
    images: torch.Tensor | None = None
    use_world: bool = True  # False: no world block at all (no SOW, world or EOW tokens: the no_world baseline)
    use_rollout: bool = True  # False: the observed frame's tokens alone, without the predicted frames (no_rollout)
    pixel_values: torch.Tensor | None = None
    siglip: torch.Tensor | None = None
    noise_seeds: list[int] | None = None  # one per row: latent mode "sample" draws each row's noise from its seed
    # (B,) int64, one per row: a live rollout's noise (TheWorld.world_latents; rollout.sample_seed(seed, key) with
    # the cache's seed and the sample's key reproduces a cache); a tensor, so that it crosses from a worker in a Batch
    rollout_seeds: torch.Tensor | None = None
    # (B, L) uint8: each row's question as zero-padded UTF-8 bytes (rollout.questions_tensor), for a live rollout
    # under world.rollout.condition: question
    rollout_questions: torch.Tensor | None = None
    # held-out batches: each row's partner's world inputs (PARTNER_FIELDS names), and whether the row has a partner
    partner: dict[str, torch.Tensor] | None = None
    paired: torch.Tensor | None = None
    # (B,) int64, one per row: the packed row its fused sequence shares with others (train.loader.packing;
    # theworld/model/packing.py); None: each sample a row of its own
    pack_rows: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.input_ids)

    # ------------------------------------------------------------------------------------------- the batch's keys

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> ModelInputs:
        """From a batch's named tensors (field names; the partner's world under PARTNER + its PARTNER_FIELDS name)."""
        partner = {k.removeprefix(PARTNER): v for k, v in tensors.items() if k.startswith(PARTNER)}
        own = {k: v for k, v in tensors.items() if not k.startswith(PARTNER)}
        odd = [k for k in own if k not in TENSOR_FIELDS] + [PARTNER + k for k in partner if k not in PARTNER_FIELDS]
        if odd:
            raise ValueError(f"batch key {odd[0]!r} is no model input ({', '.join(sorted(TENSOR_FIELDS))})")
        return cls(**own, partner=partner or None)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors of this batch (the inverse of `from_tensors`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in TENSOR_FIELDS}
        out = {k: v for k, v in out.items() if v is not None}
        return {**out, **{PARTNER + k: v for k, v in (self.partner or {}).items()}}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInputs:
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        changes = {k: move(v) for k, v in self.to_tensors().items() if not k.startswith(PARTNER)}
        partner = {k: move(v) for k, v in self.partner.items()} if self.partner else self.partner
        return dataclasses.replace(self, **changes, partner=partner)

    # ------------------------------------------------------------------------------------------- derived batches

    def own_world(self) -> ModelInputs:
        """What the model is given: this batch without its partners' worlds."""
        return dataclasses.replace(self, partner=None, paired=None)

    def partner_world(self) -> ModelInputs:
        """Each row with its partner's world (the shuffled-world loss and samples)."""
        return dataclasses.replace(self.own_world(), **(self.partner or {}))

    def with_inputs(self, **inputs) -> ModelInputs:
        """These rows (their text) with other world inputs, image inputs or noise seeds."""
        if odd := [
            k
            for k in inputs
            if k
            not in (*WORLD, *IMAGE, "use_world", "use_rollout", "noise_seeds", "rollout_seeds", "rollout_questions")
        ]:
            raise ValueError(f"{odd[0]!r} is no world or image input")
        return dataclasses.replace(self, **inputs)

    def behind(self, prompt: ModelInputs) -> ModelInputs:
        """This batch's world and image inputs behind `prompt`'s text (a prompt-only batch of the same rows)."""
        return dataclasses.replace(
            self.own_world(),
            input_ids=prompt.input_ids,
            attention_mask=prompt.attention_mask,
            labels=prompt.labels,
            pack_rows=prompt.pack_rows,
        )


TENSOR_FIELDS = frozenset((*TEXT, *WORLD, *IMAGE, "rollout_seeds", "rollout_questions", "paired", "pack_rows"))


def text_batch(items: Sequence[Encoded], pad_id: int, **inputs) -> ModelInputs:
    """Tokenised rows right-padded to the longest (padding is masked out and IGNOREd); `inputs`: their world and image
    inputs."""
    n = max(len(e.input_ids) for e in items)
    # numpy fills a row from a Python list several times faster than torch.tensor builds one
    ids = np.full((len(items), n), pad_id, dtype=np.int64)
    labels = np.full((len(items), n), IGNORE, dtype=np.int64)
    mask = np.zeros((len(items), n), dtype=np.int64)
    for i, e in enumerate(items):
        k = len(e.input_ids)
        ids[i, :k] = e.input_ids
        labels[i, :k] = e.labels
        mask[i, :k] = 1
    return ModelInputs(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(labels), **inputs)


def prompt_only(prefixes: Sequence[Sequence[int]], pad_id: int, **inputs) -> ModelInputs:
    """Right-padded prompt rows (each the token ids generation or scoring continues: `ChatFormatter.prefix`), without
    labels; `inputs`: their world and image inputs."""
    text = text_batch([Encoded(list(p), [IGNORE] * len(p)) for p in prefixes], pad_id, **inputs)
    return dataclasses.replace(text, labels=None)
