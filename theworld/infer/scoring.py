"""Multiple-choice evaluation of a trained stage, as a library (`python -m theworld.evaluate` is its command line).

Two protocols (docs/inference.md):
- `loglik`: each choice is scored by the summed log-probability of its answer tokens (the choice and the model turn's
  <end_of_turn>, the tokens training supervises) after the question; the highest wins (ties: the first). The prefix
  (world, image and question tokens) runs once per item and condition (theworld/infer/prefix_scoring.py);
  `shared_prefix=False` runs every choice's whole sequence instead (the same scores, for checking);
- `generate`: the model answers the lettered prompt greedily and the letter is read back (theworld/infer/letters.py);
  an answer with no readable letter is wrong and counted as unparsed.
Every item is evaluated under each condition asked for (theworld/infer/baselines.py): the model with its own world,
with the shuffled world (item i gets item i-1's world latents, the first gets the last one's), and the baselines.
Accuracies come with a 95% Wilson interval, overall and per category; each baseline also with the model's paired
difference to it and an exact McNemar p-value. Data formats: theworld/infer/benchmark_items.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from theworld.infer import benchmark_items, letters, prefix_scoring, stats
from theworld.infer.baselines import (
    MODEL,
    SHUFFLED,
    BaseGemma,
    Condition,
    InitProjector,
    applied,
    world_inputs,
)
from theworld.infer.generate import Sampler, decode, decode_text, left_align, stop_ids
from theworld.infer.stats import wilson
from theworld.model import images as imagelib
from theworld.model.inputs import prompt_only, text_batch
from theworld.model.text import ChatFormatter

PROTOCOLS = ("generate", "loglik")
NO_CATEGORY = "(no category)"


class Scorer:
    """Choice log-likelihoods (loglik) or generated answers (generate) for items, under each condition."""

    def __init__(
        self,
        model,
        processor,
        image_cfg,
        items: list[benchmark_items.Item],
        init: InitProjector | None = None,
        shared_prefix: bool = True,
        max_new_tokens: int = 16,
        base: BaseGemma | None = None,
    ):
        self.model, self.items, self.image_cfg, self.init, self.base = model, items, image_cfg, init, base
        self.processor, self.formatter = processor, ChatFormatter(processor)
        self.device = model.input_device
        self.shared_prefix, self.max_new_tokens = shared_prefix, max_new_tokens

    def _load(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        return imagelib.for_model(
            imagelib.to_bytes(image), self.image_cfg.resolution, self.image_cfg.resize, self.processor.image_processor
        )

    def _worlds(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
        """World latents (mean, logvar) of every item in play (each item's own and item i-1's), and where each is.
        A bucketed model's worlds of several shapes are encoded one shape at a time (`_Latents`)."""
        n = len(self.items)
        worlds = sorted(set(indices) | {(i - 1) % n for i in indices})
        loaded = [self._load(self.items[i].images[0])[0] for i in worlds]
        at = {i: k for k, i in enumerate(worlds)}
        questions = [self.items[i].question for i in worlds]  # each world rolls out on its own item's question
        groups = imagelib.same_shape_groups([tuple(p.shape) for p in loaded])
        if len(groups) == 1:
            mean, logvar = self.model.world_latents(
                torch.stack(loaded).to(self.device), None, None, rollout_questions=questions
            )
            return mean, logvar, at
        means, logvars = [None] * len(worlds), [None] * len(worlds)
        for group in groups:
            m, lv = self.model.world_latents(
                torch.stack([loaded[k] for k in group]).to(self.device),
                None,
                None,
                rollout_questions=[questions[k] for k in group],
            )
            for j, k in enumerate(group):
                means[k], logvars[k] = m[j], lv[j]
        return _Latents(means), _Latents(logvars), at

    def _shape_groups(self, indices: list[int]) -> list[list[int]]:
        """`indices` grouped by (input shape of the item's world, of item i-1's): within a group every row's own
        world has one shape and its shuffled partner one shape, so each condition runs as one batch."""
        n, cfg = len(self.items), self.image_cfg
        size = lambda i: imagelib.input_size(self.items[i].images[0], cfg.resolution, cfg.resize)
        groups = imagelib.same_shape_groups([(size(i), size((i - 1) % n)) for i in indices])
        return [[indices[k] for k in g] for g in groups]

    def _by_shape(self, run, indices: list[int], conds) -> list:
        """`run(indices, conds)` once per shape group (see `_shape_groups`), results in `indices` order."""
        groups = self._shape_groups(indices)
        if len(groups) == 1:
            return run(indices, conds)
        got = {}
        for g in groups:
            got.update(zip(g, run(g, conds)))
        return [got[i] for i in indices]

    def _features(self, indices: list[int]) -> dict[int, torch.Tensor]:
        """Image-token features of each item's images, in order."""
        pv = {i: torch.stack([self._load(im)[1] for im in self.items[i].images]) for i in indices}
        return {i: self.model.image_features(v.to(self.device), None) for i, v in pv.items()}

    def _rows(self, rows: list[int], at: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.items)
        own = torch.tensor([at[i] for i in rows], device=self.device)
        return own, torch.tensor([at[(i - 1) % n] for i in rows], device=self.device)

    @torch.no_grad()
    def score(self, indices: list[int], conds: list[Condition] = (MODEL, SHUFFLED)) -> list[dict[str, list[float]]]:
        """For each item index: {condition name: choice scores}."""
        return self._by_shape(self._score, indices, conds)

    def _score(self, indices: list[int], conds: list[Condition]) -> list[dict[str, list[float]]]:
        items = self.items
        mean, logvar, at = self._worlds(indices)
        feats = self._features(indices)
        enc, row_item = [], []
        for i in indices:
            for choice in items[i].choices:
                enc.append(self.formatter.encode(items[i].question, choice, images=len(items[i].images)))
                row_item.append(i)
        if self.shared_prefix:  # one prefix per item and condition, every choice from its KV cache
            prefixes = [self.formatter.prefix(items[i].question, images=len(items[i].images)) for i in indices]
            owner = [indices.index(i) for i in row_item]
            siglip = torch.cat([feats[i] for i in indices])
            own, previous = self._rows(indices, at)
        else:  # every choice's whole sequence
            text = text_batch(enc, self.formatter.pad_id).to(self.device)
            siglip = torch.cat([feats[i] for i in row_item])
            own, previous = self._rows(row_item, at)
        per_cond = {}
        for cond in conds:
            with applied(self.model, cond, self.init, self.base):
                world = world_inputs(self.model, cond, mean, logvar, own, previous)
                scores = (
                    prefix_scoring.answer_logprobs(self.model, prefixes, enc, owner, siglip, **world)
                    if self.shared_prefix
                    else self.model.answer_logprobs(text.with_inputs(**world, siglip=siglip))
                )
                per_cond[cond.name] = scores.tolist()
        out, lo = [], 0
        for i in indices:
            k = len(items[i].choices)
            out.append({c: s[lo : lo + k] for c, s in per_cond.items()})
            lo += k
        return out

    @torch.no_grad()
    def answer(self, indices: list[int], conds: list[Condition] = (MODEL, SHUFFLED)) -> list[dict[str, str]]:
        """For each item index: {condition name: the greedy answer to its lettered prompt} (KV cache)."""
        return self._by_shape(self._answer, indices, conds)

    def _answer(self, indices: list[int], conds: list[Condition]) -> list[dict[str, str]]:
        model, items = self.model, self.items
        mean, logvar, at = self._worlds(indices)
        feats = self._features(indices)
        prompts = [letters.mc_prompt(items[i].question, items[i].choices, items[i].prompt) for i in indices]
        ids = [self.formatter.prefix(p, images=len(items[i].images)) for p, i in zip(prompts, indices)]
        siglip = torch.cat([feats[i] for i in indices])
        text = prompt_only(ids, self.formatter.pad_id).to(self.device)
        own, previous = self._rows(indices, at)
        tok, stop = self.processor.tokenizer, stop_ids(model)
        sampler = Sampler(False, 1.0, 1.0, None, self.device)
        per_cond = {}
        for cond in conds:
            with applied(model, cond, self.init, self.base):
                world = world_inputs(model, cond, mean, logvar, own, previous)
                fused = left_align(model.embed_inputs(text.with_inputs(**world, siglip=siglip)))
                new = decode(model, fused, self.max_new_tokens, sampler, stop, tok.pad_token_id)
            per_cond[cond.name] = [decode_text(tok, r) for r in new]
        return [{c: texts[k] for c, texts in per_cond.items()} for k in range(len(indices))]


class _Latents:
    """Per-world latents of several grid shapes (a bucketed model's), indexed like one tensor by rows that share a
    shape (`Scorer._by_shape` makes every batch so)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.dtype = tensors[0].dtype

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.tensors[k] for k in rows.tolist()])

    def dim(self) -> int:
        return self.tensors[0].dim() + 1


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda j: (scores[j], -j))


def tally(
    items: list[benchmark_items.Item], indices: list[int], outputs: list[dict], protocol: str = "loglik"
) -> list[dict]:
    """Per-item records: answer, `preds` (condition -> chosen index, None when no letter could be read), `outputs`
    (condition -> choice scores or generated text); `pred` / `pred_shuffled_world` are the first two conditions'."""
    records = []
    for i, out in zip(indices, outputs):
        n = len(items[i].choices)
        preds = {c: _argmax(v) if protocol == "loglik" else letters.read_letter(v, n) for c, v in out.items()}
        records.append(
            {
                "item": items[i].name,
                "category": items[i].category,
                "answer": items[i].answer,
                "pred": preds[MODEL.name],
                "pred_shuffled_world": preds[SHUFFLED.name],
                "preds": preds,
                "outputs": out,
            }
        )
    return records


def default_protocol(items: list[benchmark_items.Item], generate: bool = True) -> str:
    """`generate` for items that all carry the benchmark's own prompt (BLINK), else `loglik` (JSONL and synthetic
    items were never asked in a lettered form); `generate=False` where generation cannot run (FSDP in training)."""
    return "generate" if generate and all(it.prompt for it in items) else "loglik"


@dataclass
class Tally:
    """What accuracies are computed from, as counts that add up over batches and processes: items, right answers
    with the own and the shuffled world, unparsed answers (generate), and per baseline (right, right only by the
    model, right only by the baseline)."""

    n: int = 0
    right: int = 0
    right_shuffled: int = 0
    unparsed: int = 0
    unparsed_shuffled: int = 0
    paired: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, records: list[dict], baselines: list[str] = ()) -> Tally:
        t = cls(paired={b: [0, 0, 0] for b in baselines})
        for r in records:
            right = r["pred"] == r["answer"]
            t.n += 1
            t.right += right
            t.right_shuffled += r["pred_shuffled_world"] == r["answer"]
            t.unparsed += r["pred"] is None
            t.unparsed_shuffled += r["pred_shuffled_world"] is None
            for b, c in t.paired.items():
                other = r["preds"][b] == r["answer"]
                c[0], c[1], c[2] = c[0] + other, c[1] + (right and not other), c[2] + (other and not right)
        return t

    def vector(self) -> list[int]:
        head = [self.n, self.right, self.right_shuffled, self.unparsed, self.unparsed_shuffled]
        return head + [x for c in self.paired.values() for x in c]

    @classmethod
    def from_vector(cls, v: list[int], baselines: list[str]) -> Tally:
        return cls(*v[:5], {b: list(v[5 + 3 * j : 8 + 3 * j]) for j, b in enumerate(baselines)})

    def accuracies(self) -> dict:
        n = self.n
        return {
            "n": n,
            "accuracy": self.right / n if n else 0.0,
            "accuracy_ci95": wilson(self.right, n),
            "accuracy_shuffled_world": self.right_shuffled / n if n else 0.0,
            "accuracy_shuffled_world_ci95": wilson(self.right_shuffled, n),
        }

    def baseline(self, name: str) -> dict:
        """The baseline's accuracy with its interval, and the model's paired difference to it (stats.paired)."""
        return stats.paired_counts(self.n, *self.paired[name])


def summarize(records: list[dict], baselines: list[str] = (), protocol: str | None = None) -> dict:
    """Accuracies overall and per category (items without one under NO_CATEGORY), unparsed answers (generate), and
    each baseline against the model on the same items."""
    t = Tally.of(records, baselines)
    out = t.accuracies()
    if protocol is not None:
        out["protocol"] = protocol
    if protocol == "generate":
        out["unparsed"], out["unparsed_shuffled_world"] = t.unparsed, t.unparsed_shuffled
    cats = sorted({r["category"] for r in records if r["category"] is not None})
    if cats:
        rows = cats + ([NO_CATEGORY] if any(r["category"] is None for r in records) else [])
        out["categories"] = {
            c: Tally.of([r for r in records if (r["category"] or NO_CATEGORY) == c]).accuracies() for c in rows
        }
    if baselines:
        out["baselines"] = {b: t.baseline(b) for b in baselines}
    return out


def evaluate(
    model,
    processor,
    image_cfg,
    items: list[benchmark_items.Item],
    batch_size: int = 8,
    progress=None,
    *,
    protocol: str = "loglik",
    conds: list[Condition] = (MODEL, SHUFFLED),
    init: InitProjector | None = None,
    shared_prefix: bool = True,
    max_new_tokens: int = 16,
    base: BaseGemma | None = None,
) -> list[dict]:
    """Per-item records (see `tally`) for all items, `batch_size` items per forward; `progress(records)` with each
    batch's records as they are done."""
    scorer = Scorer(model, processor, image_cfg, items, init, shared_prefix, max_new_tokens, base)
    run = scorer.score if protocol == "loglik" else scorer.answer
    records = []
    for lo in range(0, len(items), batch_size):
        idx = list(range(lo, min(lo + batch_size, len(items))))
        batch = tally(items, idx, run(idx, list(conds)), protocol)
        records += batch
        if progress:
            progress(batch)
    return records


def format_report(summary: dict) -> str:
    ci = lambda c: f"[{c[0]:.3f}, {c[1]:.3f}]"
    lines = [
        f"n {summary['n']}" + (f"   protocol {summary['protocol']}" if "protocol" in summary else ""),
        f"accuracy                {summary['accuracy']:.4f} {ci(summary['accuracy_ci95'])}",
        (
            f"accuracy_shuffled_world {summary['accuracy_shuffled_world']:.4f} "
            f"{ci(summary['accuracy_shuffled_world_ci95'])}   (95% Wilson intervals)"
        ),
    ]
    if "unparsed" in summary:
        lines.append(
            f"unparsed                {summary['unparsed']} (shuffled world {summary['unparsed_shuffled_world']})"
            "   (no readable letter: counted wrong)"
        )
    if "categories" in summary:
        width = max(8, *(len(c) for c in summary["categories"]))
        lines.append(f"{'category':<{width}}  {'n':>5}  {'accuracy':>8}  {'shuffled_world':>14}")
        for c, s in summary["categories"].items():
            lines.append(f"{c:<{width}}  {s['n']:>5}  {s['accuracy']:>8.4f}  {s['accuracy_shuffled_world']:>14.4f}")
    if summary.get("baselines"):
        width = max(8, *(len(b) for b in summary["baselines"]))
        lines.append(
            f"{'baseline':<{width}}  {'accuracy':>8}  {'95% interval':>14}  {'model - it':>10}  {'p (McNemar)':>11}"
        )
        for b, s in summary["baselines"].items():
            lines.append(
                f"{b:<{width}}  {s['accuracy']:>8.4f}  {ci(s['accuracy_ci95']):>14}  "
                f"{s['difference']:>+10.4f}  {s['p_value']:>11.4g}"
            )
    return "\n".join(lines)
