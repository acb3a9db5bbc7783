"""`train.eval.alignment: true`: how the world tokens sit against Gemma's embedding space at every eval (the original
code's projection-alignment view). On the first held-out batch: `align/world_norm` (mean L2 norm of the world block's
vectors), `align/vocab_norm` (of Gemma's input embeddings as Gemma feeds them, times its embedding scale),
`align/nearest_cosine` (each world vector's largest cosine with any vocabulary row, averaged) and `align/rank`
(effective rank of the world vectors: exp of the entropy of their singular values). The 2-D PCA of the world vectors
with a sample of vocabulary rows goes to `<output_dir>/alignment/step-<N>.json`, which train.report draws."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from theworld.cache_format.layout import atomic_write_json
from train.sharding import root_gathered

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from train.components import Components
    from train.metrics import Metrics
    from train.step import LoopState

FOLDER = "alignment"
VOCAB_SAMPLE = 512  # vocabulary rows drawn in the picture (the first ones by a fixed permutation)


def vocabulary(model) -> torch.Tensor:
    """Gemma's input embedding table as the language model receives it (Gemma scales its embeddings by sqrt(H))."""
    embed = model.gemma.get_input_embeddings()
    scale = getattr(embed, "embed_scale", 1.0)
    return embed.weight.detach().float() * (scale.float() if torch.is_tensor(scale) else scale)


def stats(world: torch.Tensor, vocab: torch.Tensor, chunk: int = 4096) -> dict:
    """The metrics of world vectors (N, H) against vocabulary rows (V, H)."""
    w = torch.nn.functional.normalize(world, dim=-1)
    best = torch.full((len(world),), -1.0, device=world.device)
    for lo in range(0, len(vocab), chunk):
        best = torch.maximum(best, (w @ torch.nn.functional.normalize(vocab[lo : lo + chunk], dim=-1).T).amax(-1))
    s = torch.linalg.svdvals(world - world.mean(0))
    p = s / s.sum().clamp(min=1e-12)
    return {
        "align/world_norm": float(world.norm(dim=-1).mean()),
        "align/vocab_norm": float(vocab.norm(dim=-1).mean()),
        "align/nearest_cosine": float(best.mean()),
        "align/rank": float(torch.exp(-(p * p.clamp(min=1e-12).log()).sum())),
    }


def pca(world: torch.Tensor, vocab: torch.Tensor) -> dict:
    """World vectors and vocabulary rows in the plane of the top two principal axes of both together."""
    both = torch.cat([world, vocab])
    centre = both.mean(0)
    _, _, v = torch.linalg.svd(both - centre, full_matrices=False)
    xy = lambda x: ((x - centre) @ v[:2].T).tolist()
    return {"world": xy(world), "vocab": xy(vocab)}


class Alignment:
    def __init__(self, loader: DataLoader, output_dir: str, main: bool):
        self.loader, self.output_dir, self.main = loader, output_dir, main

    @torch.no_grad()
    def run(self, components: Components) -> dict:
        model, device = components.raw, components.accelerator.device
        inputs = next(iter(self.loader)).to(device).own_world()
        with model.evaluating(), root_gathered(model), components.accelerator.autocast():
            mean, logvar = model.world_latents(
                inputs.images, inputs.latent_mean, inputs.latent_logvar, inputs.rollout_seeds
            )
            world = model.projector(mean, logvar, "mean", None, None).float().flatten(0, 1)
            vocab = vocabulary(model)
        g = torch.Generator().manual_seed(0)
        rows = torch.randperm(len(vocab), generator=g)[:VOCAB_SAMPLE].to(vocab.device)
        self.picture = pca(world, vocab[rows])
        return stats(world, vocab)

    def log(self, metrics: Metrics, state: LoopState, results: dict) -> None:
        metrics.log({"step": state.step, **results})
        if self.main:
            folder = Path(self.output_dir) / FOLDER
            folder.mkdir(exist_ok=True)
            atomic_write_json(folder / f"step-{state.step}.json", {"step": state.step, **self.picture})
