"""`train.benchmarks: [FILE, ...]`: multiple-choice benchmarks scored at every eval (theworld/infer/scoring.py), logged as
`bench/<name>/accuracy` and `bench/<name>/accuracy_shuffled_world` (name: the file's stem, or the folder's name).

Every process scores its share of the items (item i goes to process i % world_size) and the counts are summed; every
process runs the same number of forward passes (a process with no items left scores one and discards it), so a
sharded model's collectives stay matched.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from theworld.infer import benchmarks
from theworld.errors import UserError
from theworld.infer.scoring import Scorer, tally
from train import preempt

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.optim import Components


def _name(path: str) -> str:
    p = Path(path)
    return p.name if p.is_dir() else p.stem


class BenchmarkEval:
    def __init__(self, sets: dict[str, list[benchmarks.Item]], batch_rows: int):
        self.sets, self.batch_rows = sets, batch_rows

    @classmethod
    def load(cls, cfg: TrainConfig) -> "BenchmarkEval | None":
        """Read and check every file before any model loads; items whose images do not decode are left out."""
        if not cfg.train.benchmarks:
            return None
        sets = {}
        for path in cfg.train.benchmarks:
            name = _name(path)
            if name in sets:
                raise UserError(f"config key 'train.benchmarks': two benchmarks named {name!r}; rename one file")
            try:
                items = benchmarks.read(path)
            except UserError as e:
                raise UserError(f"config key 'train.benchmarks': {e}") from None
            bad = {s["item"] for s in benchmarks.unreadable(items)}
            if bad:
                print(f"benchmark {name}: {len(bad)} item(s) with unreadable images left out", file=sys.stderr)
            sets[name] = [it for it in items if it.name not in bad]
            if not sets[name]:
                raise UserError(f"config key 'train.benchmarks': {path} has no item with readable images")
        return cls(sets, max(2, cfg.train.eval_batch_size or cfg.train.micro_batch_size))

    def run(self, components: Components) -> dict:
        model, accelerator = components.raw, components.accelerator
        was_training, mode = model.training, model.latent_mode
        model.eval()
        model.latent_mode = "mean"
        out = {}
        try:
            for name, items in self.sets.items():
                counts = self._counts(components, items)
                if components.world_size > 1:
                    counts = accelerator.reduce(counts, reduction="sum")
                n, k, ks = (int(x) for x in counts.tolist())
                out.update({f"bench/{name}/n": n, f"bench/{name}/accuracy": k / max(n, 1),
                            f"bench/{name}/accuracy_shuffled_world": ks / max(n, 1)})
        finally:
            model.latent_mode = mode
            model.train(was_training)
        return out

    def _counts(self, components: Components, items: list[benchmarks.Item]) -> torch.Tensor:
        """(items, correct, correct with the shuffled world) over this process's share."""
        scorer = Scorer(components.raw, components.processor, components.cfg.image, items)
        per_batch = max(1, self.batch_rows // max(len(it.choices) for it in items))
        mine = list(range(components.rank, len(items), components.world_size))
        steps = math.ceil(math.ceil(len(items) / components.world_size) / per_batch)
        counts = torch.zeros(3, dtype=torch.float64, device=components.accelerator.device)
        for s in range(steps):
            preempt.poll()  # the same `steps` on every process
            idx = mine[s * per_batch:(s + 1) * per_batch]
            with components.accelerator.autocast():
                scores = scorer.score(idx or [0])
            for r in tally(items, idx, scores):  # no records for the stand-in batch
                counts += torch.tensor([1, r["pred"] == r["answer"], r["pred_shuffled_world"] == r["answer"]],
                                       dtype=torch.float64, device=counts.device)
        return counts
