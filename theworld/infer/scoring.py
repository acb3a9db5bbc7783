"""Multiple-choice scoring of a trained stage, as a library (`python -m theworld.evaluate` is its command line).

Each choice is scored by the summed log-probability of its answer tokens (the choice and the model turn's
<end_of_turn>, the tokens training supervises) after the question; the highest wins (ties: the first).
The shuffled-world score gives item i the world latents of item i-1 (the first gets the last one's). Accuracies come
with a 95% Wilson interval, overall and per category. Data formats: theworld/infer/benchmarks.py.
"""
from __future__ import annotations

import math

import torch

from theworld import images as imagelib
from theworld.infer import benchmarks
from theworld.text import ChatFormatter, collate_text


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


class Scorer:
    """Choice log-likelihoods for items, with each item's own world and with item i-1's."""

    def __init__(self, model, processor, image_cfg, items: list[benchmarks.Item]):
        self.model, self.items, self.image_cfg = model, items, image_cfg
        self.processor, self.formatter = processor, ChatFormatter(processor)
        self.device = next(model.parameters()).device

    def _load(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        return imagelib.for_model(imagelib.to_bytes(image), self.image_cfg.resolution, self.image_cfg.resize,
                                  self.processor.image_processor)

    @torch.no_grad()
    def score(self, indices: list[int]) -> list[tuple[list[float], list[float]]]:
        """For each item index: (choice scores, choice scores with item i-1's world latents)."""
        model, items, n = self.model, self.items, len(self.items)
        worlds = sorted({i for i in indices} | {(i - 1) % n for i in indices})
        loaded = [self._load(items[i].images[0])[0] for i in worlds]
        latents: list = [None] * len(worlds)  # per world: (mean, logvar); a bucketed model's grids differ in shape
        for group in imagelib.same_shape_groups([tuple(p.shape) for p in loaded]):
            m, lv = model.world_latents(torch.stack([loaded[k] for k in group]).to(self.device), None, None)
            for j, k in enumerate(group):
                latents[k] = (m[j], None if lv is None else lv[j])
        at = {i: k for k, i in enumerate(worlds)}
        rows, own, other, image_rows = [], [], [], []
        for i in indices:
            it = items[i]
            for choice in it.choices:
                rows.append(self.formatter.encode(it.question, choice, images=len(it.images)))
                own.append(at[i])
                other.append(at[(i - 1) % n])
                image_rows.append(i)
        pv = {i: torch.stack([self._load(im)[1] for im in items[i].images]) for i in indices}
        feats = {i: model.image_features(v.to(self.device), None) for i, v in pv.items()}
        text = {k: v.to(self.device) for k, v in collate_text(rows, self.formatter.pad_id).items()}

        def logprobs(world_of_row: list[int]) -> torch.Tensor:
            """Each row's answer log-probability with its world; one forward per latent grid shape."""
            out = torch.empty(len(rows), device=self.device)
            shapes = [tuple(latents[w][0].shape) for w in world_of_row]
            for sel in imagelib.same_shape_groups(shapes):
                idx = torch.tensor(sel, device=self.device)
                logvar = [latents[world_of_row[r]][1] for r in sel]
                out[idx] = model.answer_logprobs(
                    **{k: v[idx] for k, v in text.items()},
                    latent_mean=torch.stack([latents[world_of_row[r]][0] for r in sel]),
                    latent_logvar=None if logvar[0] is None else torch.stack(logvar),
                    siglip=torch.cat([feats[image_rows[r]] for r in sel])).float()
            return out

        a, b = logprobs(own), logprobs(other)
        out, lo = [], 0
        for i in indices:
            k = len(items[i].choices)
            out.append((a[lo:lo + k].tolist(), b[lo:lo + k].tolist()))
            lo += k
        return out


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda j: (scores[j], -j))


def tally(items: list[benchmarks.Item], indices: list[int], scores) -> list[dict]:
    return [{"item": items[i].name, "category": items[i].category, "answer": items[i].answer,
             "pred": _argmax(a), "pred_shuffled_world": _argmax(b)} for i, (a, b) in zip(indices, scores)]


def summarize(records: list[dict]) -> dict:
    def stats(rs: list[dict]) -> dict:
        n = len(rs)
        k = sum(r["pred"] == r["answer"] for r in rs)
        ks = sum(r["pred_shuffled_world"] == r["answer"] for r in rs)
        return {"n": n, "accuracy": k / n if n else 0.0, "accuracy_ci95": wilson(k, n),
                "accuracy_shuffled_world": ks / n if n else 0.0, "accuracy_shuffled_world_ci95": wilson(ks, n)}

    out = stats(records)
    cats = sorted({r["category"] for r in records if r["category"] is not None})
    if cats:
        out["categories"] = {c: stats([r for r in records if r["category"] == c]) for c in cats}
    return out


def evaluate(model, processor, image_cfg, items: list[benchmarks.Item], batch_size: int = 8,
             progress=None) -> list[dict]:
    """Per-item records (answer, prediction, prediction with the shuffled world) for all items, `batch_size` items
    per forward."""
    scorer = Scorer(model, processor, image_cfg, items)
    records = []
    for lo in range(0, len(items), batch_size):
        idx = list(range(lo, min(lo + batch_size, len(items))))
        records += tally(items, idx, scorer.score(idx))
        if progress:
            progress(len(records))
    return records


def format_report(summary: dict) -> str:
    ci = lambda c: f"[{c[0]:.3f}, {c[1]:.3f}]"  # noqa: E731
    lines = [f"n {summary['n']}",
             f"accuracy                {summary['accuracy']:.4f} {ci(summary['accuracy_ci95'])}",
             f"accuracy_shuffled_world {summary['accuracy_shuffled_world']:.4f} "
             f"{ci(summary['accuracy_shuffled_world_ci95'])}   (95% Wilson intervals)"]
    if "categories" in summary:
        width = max(8, *(len(c) for c in summary["categories"]))
        lines.append(f"{'category':<{width}}  {'n':>5}  {'accuracy':>8}  {'shuffled_world':>14}")
        for c, s in summary["categories"].items():
            lines.append(f"{c:<{width}}  {s['n']:>5}  {s['accuracy']:>8.4f}  {s['accuracy_shuffled_world']:>14.4f}")
    return "\n".join(lines)
