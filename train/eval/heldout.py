"""The held-out loss of every eval: `eval_loss`, `eval_loss_shuffled_world` and their gap over the run's held-out
split; with a `data:` mixture also per cache (`data/<cache name>/eval_loss`, ...), and per `train.eval.sets` entry
(`<set name>/eval_loss`, ...). The run's own split alone feeds the plateau rule (train/eval/plateau.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from theworld.cache_format.held_out import split
from theworld.model import objective
from train import preempt, sharding
from train.data import cache as data
from train.data import loader as loaders
from train.data.mixture import MixedReader
from train.data.order import bucket_ids
from train.eval import plateau

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from theworld.cache_format import CacheReader
    from train.components import Components
    from train.config import EvalSet, TrainConfig
    from train.metrics import Metrics
    from train.step import LoopState


@torch.no_grad()
def evaluate(components: Components, loader: DataLoader) -> dict:
    """eval_loss and eval_loss_shuffled_world (each held-out sample with the world of its partner: the next held-out
    sample of the same latent shape in key order, `order.eval_partners`; the same pairs whatever the process count),
    per answer token over the whole held-out split (all processes). World latents use the posterior mean. The only
    held-out sample of its shape has no partner: it counts towards eval_loss only."""
    model, accelerator = components.raw, components.accelerator
    sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # loss, tokens, shuffled loss, its tokens
    # agreed before the first forward: under FSDP every forward is a collective, so all processes run as many
    extra = sharding.missing_forwards(components.sharded, len(loader), accelerator.device)
    inputs = None
    with model.evaluating():
        for batch in loader:
            preempt.poll()  # every process polls len(loader) + extra times: as often as the longest share
            inputs = batch.to(accelerator.device)
            paired = bool(inputs.paired.all())  # a batch holds one latent shape: all paired, or its only one
            with accelerator.autocast():
                a = model(inputs.own_world())
                b = model(inputs.partner_world())  # also when unpaired: every process makes two forwards per batch
            sums[:2] += torch.tensor([float(a.loss_sum), a.num_tokens], dtype=torch.float64, device=accelerator.device)
            if paired:
                sums[2:] += torch.tensor(
                    [float(b.loss_sum), b.num_tokens], dtype=torch.float64, device=accelerator.device
                )
        for _ in range(extra):
            preempt.poll()
            model(inputs.own_world())  # results unused: only the collectives count
            model(inputs.own_world())
    if components.world_size > 1:
        sums = accelerator.reduce(sums, reduction="sum")
    loss, shuffled = (objective.per_token(float(sums[k]), float(sums[k + 1])) for k in (0, 2))
    return {
        "eval_loss": loss,
        "eval_loss_shuffled_world": shuffled,
        "eval_gap": shuffled - loss,
        "eval_tokens": int(sums[1]),
    }


@dataclass
class Split:
    prefix: str  # "": the run's held-out split; "<name>/": a mixture's cache or an eval set
    loader: DataLoader


@dataclass
class OpenSet:
    """A `train.eval.sets` entry with its cache opened (before any model loads) and the samples it evaluates."""

    entry: EvalSet
    reader: CacheReader
    inputs: data.InputSources
    indices: np.ndarray  # in key order, as the run's held-out split

    @classmethod
    def of(cls, cfg: TrainConfig, entry: EvalSet) -> OpenSet:
        """The set's cache, checked as the run's own is (open_cache: layout, texts, fingerprint fields)."""
        reader, inputs = data.open_cache(dataclasses.replace(cfg, cache_dir=entry.cache, data=[]))
        n = len(reader)
        if entry.samples and entry.samples < n:
            held = split(reader, entry.samples)[1]
        else:
            held = np.array(sorted(range(n), key=reader.key), dtype=np.int64)
        return cls(entry, reader, inputs, held)


def mixture_parts(cfg: TrainConfig, ctx: loaders.DataContext) -> list[tuple[str, np.ndarray]]:
    """A `data:` mixture's held-out split per cache: (its folder's name, or its position where names repeat; its
    held-out indices). [] for one cache, and for parts of one dataset (weight `samples`: cfg.joined), whose losses
    apart would evaluate every held-out sample twice to tell random parts apart."""
    if not isinstance(ctx.reader, MixedReader) or cfg.joined:
        return []
    names = [Path(cache.rstrip("/")).name for cache, _ in cfg.caches()]
    names = [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]
    of = ctx.reader.cache_of[ctx.eval_indices]
    return [(name, ctx.eval_indices[of == i]) for i, name in enumerate(names) if (of == i).any()]


def build(
    cfg: TrainConfig, ctx: loaders.DataContext, sets: list[OpenSet], rank: int, world_size: int
) -> HeldOutLoss | None:
    """The run's held-out split, a mixture's caches apart (`data/<name>/`) and each eval set (`<name>/`); None when
    there is nothing to evaluate."""
    parts = [("", ctx)] if len(ctx.eval_indices) else []
    parts += [(f"data/{name}/", dataclasses.replace(ctx, eval_indices=idx)) for name, idx in mixture_parts(cfg, ctx)]
    for s in sets:
        sub = dataclasses.replace(
            ctx, reader=s.reader, inputs=s.inputs, eval_indices=s.indices, buckets=bucket_ids(s.reader), draw=None
        )
        parts.append((f"{s.entry.name}/", sub))
    splits = [Split(prefix, loaders.build_eval_loader(cfg, c, rank, world_size)) for prefix, c in parts]
    return HeldOutLoss(cfg, splits) if splits else None


class HeldOutLoss:
    """`evaluate` over each split; logs one eval line (the run's split first, then the others by prefix) and the
    plateau rule's verdict."""

    def __init__(self, cfg, splits: list[Split]):
        self.cfg, self.splits = cfg, splits

    def run(self, components: Components) -> dict:
        out = {}
        for s in self.splits:
            out.update({s.prefix + k: v for k, v in evaluate(components, s.loader).items()})
        return out

    def log(self, metrics: Metrics, state: LoopState, results: dict) -> None:
        cfg = self.cfg.train.eval
        own = {k: v for k, v in results.items() if "/" not in k}
        was_flat, flat = state.plateau_step is not None, {}
        if own:
            flat = plateau.record(state, cfg.plateau, cfg.every, self.cfg.train.max_steps, own["eval_loss"])
        state.last_eval = {"step": state.step, **own, **flat, **{k: v for k, v in results.items() if "/" in k}}
        metrics.log(state.last_eval)
        if state.plateau_step is not None and not was_flat:
            metrics.message(
                f"step {state.step}: the eval loss has plateaued (less than "
                f"{cfg.plateau.min_improvement:.1%} better over the last evals)"
                + ("; stopping: train.eval.stop_on_plateau" if cfg.stop_on_plateau else "")
            )
