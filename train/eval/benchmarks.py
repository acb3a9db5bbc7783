"""`train.eval.benchmarks: [FILE or {path, protocol, baselines}, ...]`: multiple-choice benchmarks evaluated at every
eval (theworld/infer/scoring.py), logged as `bench/<name>/accuracy`, `bench/<name>/accuracy_shuffled_world` (and
`unparsed` under the generate protocol; `bench/<name>/<baseline>/accuracy`, `.../difference`, `.../p_value` per
baseline) and printed with the eval lines (name: the file's stem, or the folder's name).

Every process evaluates its share of the items (item i goes to process i % world_size) and the counts are summed;
every process runs the same number of forward passes (a process with no items left runs one and discards it), so a
sharded model's collectives stay matched.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from theworld.core.errors import UserError
from theworld.infer import baselines, benchmark_items
from theworld.infer.scoring import Scorer, Tally, default_protocol, tally
from train import preempt
from train.config import BenchmarkEntry

if TYPE_CHECKING:
    from train.components import Components
    from train.config import TrainConfig
    from train.metrics import Metrics
    from train.step import LoopState


def _name(path: str) -> str:
    p = Path(path)
    return p.name if p.is_dir() else p.stem


@dataclass
class BenchmarkSet:
    items: list[benchmark_items.Item]
    protocol: str  # generate or loglik
    baselines: list[str]


class BenchmarkEval:
    def __init__(self, sets: dict[str, BenchmarkSet], eval_batch_size: int = 0):
        self.sets, self.eval_batch_size = sets, eval_batch_size

    @classmethod
    def load(cls, cfg: TrainConfig) -> BenchmarkEval | None:
        """Read and check every file before any model loads; items whose images do not decode are left out."""
        if not cfg.train.eval.benchmarks:
            return None
        sets = {}
        for entry in cfg.train.eval.benchmarks:
            entry = entry if isinstance(entry, BenchmarkEntry) else BenchmarkEntry(entry)
            name = _name(entry.path)
            if name in sets:
                raise UserError(f"config key 'train.eval.benchmarks': two benchmarks named {name!r}; rename one file")
            names = entry.names(cfg.world.num_world_steps)
            if "base_gemma" in names:
                raise UserError(
                    "config key 'train.eval.benchmarks': base_gemma loads the base model once more; score it after "
                    "training with theworld.evaluate --baselines base_gemma (no_world is the stage's own Gemma)"
                )
            if cfg.train.hardware.sharding == "fsdp" and ("init_projector" in names or entry.protocol == "generate"):
                # the baseline swaps weights FSDP shards; generation stops when every row is done, which differs
                # between processes, and FSDP's collectives need every process in every forward
                raise UserError(
                    "config key 'train.eval.benchmarks': the init_projector baseline and the generate "
                    "protocol need train.hardware.sharding: ddp"
                )
            try:
                items = benchmark_items.read(entry.path)
            except UserError as e:
                raise UserError(f"config key 'train.eval.benchmarks': {e}") from None
            bad = {s["item"] for s in benchmark_items.unreadable(items)}
            if bad:
                print(f"benchmark {name}: {len(bad)} item(s) with unreadable images left out", file=sys.stderr)
            items = [it for it in items if it.name not in bad]
            if not items:
                raise UserError(f"config key 'train.eval.benchmarks': {entry.path} has no item with readable images")
            protocol = (
                entry.protocol
                if entry.protocol != "auto"
                else default_protocol(items, generate=cfg.train.hardware.sharding != "fsdp")
            )
            sets[name] = BenchmarkSet(items, protocol, names)
        return cls(sets, cfg.train.eval.batch_size)

    def run(self, components: Components) -> dict:
        model, accelerator = components.raw, components.accelerator
        # resolved by now (micro_batch_size: auto is a number once the run knows its process count)
        rows = max(2, self.eval_batch_size or int(components.cfg.train.micro_batch_size))
        out = {}
        with model.evaluating():
            for name, bset in self.sets.items():
                init = (
                    baselines.InitProjector(model, components.cfg.world, components.cfg.seed)
                    if "init_projector" in bset.baselines
                    else None
                )
                counts = self._counts(components, bset, rows, init)
                if components.world_size > 1:
                    counts = accelerator.reduce(counts, reduction="sum")
                out.update(_metrics(name, bset, [int(x) for x in counts.tolist()]))
        return out

    def log(self, metrics: Metrics, state: LoopState, results: dict) -> None:
        metrics.log({"step": state.step, **results})
        for line in lines(results):  # with the eval line: the figures people wait for
            metrics.message(line)

    def _counts(self, components: Components, bset: BenchmarkSet, rows: int, init) -> torch.Tensor:
        """This process's share as `Tally.vector()`."""
        items = bset.items
        conds = baselines.conditions(bset.baselines)
        scorer = Scorer(components.raw, components.processor, components.cfg.image, items, init)
        run = scorer.score if bset.protocol == "loglik" else scorer.answer
        per_batch = max(1, rows // max(len(it.choices) for it in items)) if bset.protocol == "loglik" else rows
        mine = list(range(components.rank, len(items), components.world_size))
        steps = math.ceil(math.ceil(len(items) / components.world_size) / per_batch)
        counts = torch.zeros(len(Tally(paired={b: [0] * 3 for b in bset.baselines}).vector()), dtype=torch.float64)
        counts = counts.to(components.accelerator.device)
        for s in range(steps):
            preempt.poll()  # the same `steps` on every process
            idx = mine[s * per_batch : (s + 1) * per_batch]
            with components.accelerator.autocast():
                outputs = run(idx or [0], conds)
            records = tally(items, idx, outputs, bset.protocol)  # no records for the stand-in batch
            counts += torch.tensor(
                Tally.of(records, bset.baselines).vector(), dtype=torch.float64, device=counts.device
            )
        return counts


def _metrics(name: str, bset: BenchmarkSet, counts: list[int]) -> dict:
    t = Tally.from_vector(counts, bset.baselines)
    acc = t.accuracies()
    out = {
        f"bench/{name}/n": t.n,
        f"bench/{name}/accuracy": acc["accuracy"],
        f"bench/{name}/accuracy_shuffled_world": acc["accuracy_shuffled_world"],
    }
    if bset.protocol == "generate":
        out[f"bench/{name}/unparsed"] = t.unparsed
    for b in bset.baselines:
        paired = t.baseline(b)
        out.update({f"bench/{name}/{b}/{k}": paired[k] for k in ("accuracy", "difference", "p_value")})
    return out


def lines(results: dict) -> list[str]:
    """One console line per benchmark from `run`'s results."""
    names = sorted({k.split("/")[1] for k in results if k.startswith("bench/")})
    out = []
    for name in names:
        r = {k.removeprefix(f"bench/{name}/"): v for k, v in results.items() if k.startswith(f"bench/{name}/")}
        text = (
            f"benchmark {name}: n {r['n']}, accuracy {r['accuracy']:.4f}, "
            f"accuracy_shuffled_world {r['accuracy_shuffled_world']:.4f}"
        )
        if "unparsed" in r:
            text += f", unparsed {r['unparsed']}"
        for key in sorted(k for k in r if k.endswith("/accuracy")):
            b = key.removesuffix("/accuracy")
            text += f", {b} {r[key]:.4f} (p {r[b + '/p_value']:.3g})"
        out.append(text)
    return out
