"""Caption evaluation: the stage describes each image (greedy, KV cache) with its own world and with the shuffled
world (image i gets image i-1's world latents, the first the last one's), and the captions are scored against the
references by BLEU-4, ROUGE-L and CIDEr as pycocoevalcap computes them (corpus-level; CIDEr's document frequencies
come from the evaluated set's references, as in the COCO caption evaluation).

Tokenisation: lower case, words of letters and digits, punctuation dropped; a plain regular expression instead of
pycocoevalcap's PTBTokenizer, which needs Java (as METEOR and SPICE do, which are left out for that reason).

JSONL, one item per line: `{"image": path relative to the file, "captions": str or [str, ...]}`; or a latent cache's
held-out split: the samples the trainer holds out for its eval (theworld/cache_format/held_out.py, with the run's
`train.eval.samples`), each with its stored image, its caption as the reference and its own prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from theworld.core.errors import UserError
from theworld.infer.benchmark_items import _bad, jsonl_records
from theworld.model import images as imagelib
from theworld.model.config import DEFAULT_PROMPT

KEYS = ("image", "captions")
METRICS = ("bleu4", "rouge_l", "cider")


@dataclass
class Item:
    name: str  # "file.jsonl:12", for messages
    images: list  # one path: its world latents and its image tokens
    captions: list[str]  # the references
    prompt: str | None = None  # the item's own prompt (a cache sample's); None: the one the run trained with


def _item(rec: dict, name: str, root: Path) -> Item:
    unknown = [k for k in rec if k not in KEYS]
    if unknown:
        raise UserError(f"{name}: unknown key {unknown[0]!r} (a caption item has image and captions)")
    image, refs = rec.get("image"), rec.get("captions")
    if not isinstance(image, str) or not image:
        raise _bad(name, "image", "missing, or not a path")
    refs = [refs] if isinstance(refs, str) else refs
    if not refs or not isinstance(refs, list) or not all(isinstance(c, str) and c.strip() for c in refs):
        raise _bad(name, "captions", "missing, or not a non-empty string (or list of them)")
    path = root / image
    try:
        found = path.is_file()
    except OSError as e:
        raise _bad(name, "image", f"cannot use {path} ({e.strerror})") from None
    if not found:
        raise _bad(name, "image", f"no such file {path}")
    return Item(name, [path], list(refs))


def read(path: str | Path) -> list[Item]:
    p = Path(path)
    if problem := imagelib.path_problem(p):  # never opened: a FIFO would block
        raise UserError(f"{p}: {problem.replace('not an image file', 'not a data file')}")
    items = [_item(rec, name, p.parent) for name, rec in jsonl_records(p)]
    if not items:
        raise UserError(f"{p}: no items")
    return items


def read_cache(path: str | Path, split: str, stage: Path) -> list[Item]:
    """The held-out samples of the cache at `path` (a folder or a URL) for the run whose stage folder is `stage`."""
    from theworld import cache_format as cf
    from theworld.cache_format.held_out import split as held_out  # the trainer's own split
    from theworld.model import stage_layout as layout

    if split != "val":
        raise UserError(f"--split {split}: a cache has one held-out split, val (the trainer's eval samples)")
    train = layout.read_yaml(stage).get("train") or {}
    section = train.get("eval") if isinstance(train.get("eval"), dict) else {}
    # EvalConfig's default for a config that leaves it out; train.eval.samples in stages of earlier releases
    eval_samples = section.get("samples", train.get("eval_samples", 256))
    if not isinstance(eval_samples, int) or eval_samples < 1:
        raise UserError(f"{stage / layout.CONFIG}: train.eval.samples is {eval_samples!r}: the run held nothing out")
    reader = cf.CacheReader(path)
    _, held = held_out(reader, eval_samples)
    items = []
    for i in held.tolist():
        s = reader.sample(i, tensors=False)
        if s.image is None:
            raise UserError(f"--data {path}: the cache holds no images (precompute with cache.images: true)")
        items.append(Item(f"{path}:{s.key}", [s.image], [s.caption], s.prompt))
    return items


def tokens(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def scores(references: list[list[str]], hypotheses: list[str]) -> dict[str, float]:
    """Corpus BLEU-4, ROUGE-L and CIDEr of one hypothesis per item against its references (pycocoevalcap)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    gts = {i: [tokens(r) for r in refs] for i, refs in enumerate(references)}
    res = {i: [tokens(h)] for i, h in enumerate(hypotheses)}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    rouge, _ = Rouge().compute_score(gts, res)
    cider, _ = Cider().compute_score(gts, res)
    return {"bleu4": float(bleu[3]), "rouge_l": float(rouge), "cider": float(cider)}


def evaluate(
    model,
    processor,
    items: list[Item],
    batch_size: int = 8,
    progress=None,
    *,
    max_new_tokens: int = 64,
    prompt: str = DEFAULT_PROMPT,
) -> list[dict]:
    """Per-item records: item, references, the caption with its own world and with the shuffled world."""
    n, records = len(items), []
    for lo in range(0, n, batch_size):
        idx = list(range(lo, min(lo + batch_size, n)))
        prompts = [items[i].prompt or prompt for i in idx]
        own = model.generate([items[i].images[0] for i in idx], prompts, max_new_tokens=max_new_tokens)
        other = model.generate(
            [items[i].images[0] for i in idx],
            prompts,
            max_new_tokens=max_new_tokens,
            world_images=[items[(i - 1) % n].images[0] for i in idx],
        )
        batch = [
            {
                "item": items[i].name,
                "references": items[i].captions,
                "prompt": p,
                "outputs": {"model": a, "shuffled_world": b},
            }
            for i, p, a, b in zip(idx, prompts, own, other)
        ]
        records += batch
        if progress:
            progress(batch)
    return records


def summarize(records: list[dict]) -> dict:
    refs = [r["references"] for r in records]
    own = scores(refs, [r["outputs"]["model"] for r in records])
    other = scores(refs, [r["outputs"]["shuffled_world"] for r in records])
    return {"n": len(records), "task": "caption", **own, **{f"{k}_shuffled_world": v for k, v in other.items()}}


def format_report(summary: dict) -> str:
    lines = [f"n {summary['n']}   captions", f"{'metric':<8}  {'model':>8}  {'shuffled_world':>14}"]
    for k in METRICS:
        lines.append(f"{k:<8}  {summary[k]:>8.4f}  {summary[k + '_shuffled_world']:>14.4f}")
    return "\n".join(lines)
