"""Padding share and real tokens/s of plain, length-grouped and packed batches, side by side in one run.

    python -m tools.speed_packing [--json] [--samples 128] [--repeats 1] [--threads 1]

It writes a llava conversation cache (through precompute, with the tiny models) whose text lengths follow
LLaVA-Instruct-150K's, then trains stage 3's way on it (the language model trains; world latents and SigLIP features
from the cache) for one epoch in each layout, the same epoch order for plain and packed: the loader's micro-batches
are made first, then forward and backward are timed over them. Figures per layout: padding share (padding slots over
all token slots the language model runs on), real tokens/s (non-padding fused tokens, world block included, per second
of forward + backward; wall-clock and this process's CPU time, which other processes on the same cores do not move),
and each one's ratio to plain.

Where the length distribution comes from (the data set itself cannot be downloaded here, so it is modelled from
published figures):
- LLaVA-Instruct-150K has three parts (LLaVA paper, Liu et al. 2023, section 3): 58K conversations, 23K detailed
  descriptions, 77K complex-reasoning answers; the samples here are drawn in those proportions;
- each part's mean text length comes from the size of its JSON file as the dataset card lists it (conversation_58k.json
  126 MB, detail_23k.json 20.5 MB, complex_reasoning_77k.json 79.6 MB): bytes per sample less the JSON keys, at 4
  characters a token (an assumption: English text through a SentencePiece vocabulary);
- detailed descriptions and complex reasoning are one question and one answer; a conversation has 1 + Poisson(2)
  question-answer turns, at most 8 (an assumption: the card gives no turn histogram); answers vary log-normally
  (sigma 0.6) around their part's mean, questions are 8-30 tokens.
The texts are words of the tiny tokenizer's vocabulary (one token each), so token counts are as drawn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tools.threads import add_threads, apply_threads

# part: (samples, bytes of its JSON file, question tokens (low, high)); LLaVA paper section 3 and the dataset card
PARTS = {
    "conversation": (58_000, 126.0e6, (8, 20)),
    "detail": (23_000, 20.5e6, (8, 16)),
    "complex_reasoning": (77_000, 79.6e6, (15, 30)),
}
JSON_BYTES = 120  # a sample's id, image and keys
MESSAGE_BYTES = 40  # a message's {"from": ..., "value": ...}
CHARS_PER_TOKEN = 4.0
MEAN_TURNS = {"conversation": 3.0, "detail": 1.0, "complex_reasoning": 1.0}
LAYOUTS = {
    "plain": {},
    "grouped": {"train.loader.group_by_length": "true"},
    "packed": {"train.loader.packing": "true"},
    "grouped+packed": {"train.loader.group_by_length": "true", "train.loader.packing": "true"},
}


def answer_tokens(part: str) -> float:
    """A part's mean answer length in tokens, from its bytes per sample."""
    samples, size, (q_lo, q_hi) = PARTS[part]
    turns = MEAN_TURNS[part]
    text_tokens = (size / samples - JSON_BYTES - 2 * turns * MESSAGE_BYTES) / CHARS_PER_TOKEN
    return text_tokens / turns - (q_lo + q_hi) / 2


def conversations(n: int, seed: int = 0) -> list[list[tuple[str, str]]]:
    """`n` conversations ((question, answer) turns) with LLaVA-Instruct-150K's mix of parts and lengths."""
    from theworld.embedded import synthetic

    rng = np.random.default_rng(seed)
    words = np.array(synthetic.VOCABULARY)
    counts = np.array([PARTS[p][0] for p in PARTS], dtype=float)
    out = []
    for part in rng.choice(list(PARTS), size=n, p=counts / counts.sum()):
        turns = min(8, 1 + rng.poisson(2)) if part == "conversation" else 1
        mean, (q_lo, q_hi) = answer_tokens(part), PARTS[part][2]
        text = lambda k: " ".join(rng.choice(words, size=max(1, int(k))))  # noqa: E731
        out.append([(text(rng.integers(q_lo, q_hi + 1)), text(rng.lognormal(np.log(mean), 0.6))) for _ in range(turns)])
    return out


def write_cache(root: Path, n: int, resolution: int) -> Path:
    """A llava cache of `n` samples (synthetic scenes at `resolution` px, SigLIP features cached)."""
    from precompute.config import load as load_pre
    from precompute.pipeline import run
    from theworld.embedded import synthetic

    items = []
    for i, turns in enumerate(conversations(n)):
        synthetic.scene(0, i, resolution)[0].save(root / f"{i}.png")
        conv = [{"from": f, "value": v} for q, a in turns for f, v in (("human", q), ("gpt", a))]
        conv[0]["value"] = "<image>\n" + conv[0]["value"]
        items.append({"id": f"item{i}", "image": f"{i}.png", "conversations": conv})
    (root / "chat.json").write_text(json.dumps(items))
    out = root / "cache"
    sets = ["source.type=llava", f"source.path={root / 'chat.json'}", f"source.num_samples={n}", f"output_dir={out}"]
    sets += [f"image.resolution={resolution}", "shard_size=128", "batch_size=32", "num_workers=0"]
    sets += ["model.dtype=float32"]
    run(load_pre(str(Path(__file__).parent.parent / "configs" / "precompute.yaml"), sets))
    return out


def micro_batches(cfg) -> tuple[list, object]:
    """(this layout's micro-batches of one epoch, the model), built as train.loop builds them (one process)."""
    from theworld.cache_format.held_out import split
    from train.components import build_model
    from train.data.cache import open_cache
    from train.data.loader import DataContext, build_train_loader

    reader, inputs = open_cache(cfg)
    model, processor = build_model(cfg)
    ctx = DataContext.build(cfg, reader, inputs, processor, split(reader, cfg.train.eval.samples))
    return list(build_train_loader(cfg, ctx, 0, 1, 0)), model


def layout_tokens(batch, n_world: int) -> tuple[int, int]:
    """(real fused tokens, token slots the language model runs on) of a micro-batch."""
    from theworld.model.packing import padding_share

    lengths = (batch.attention_mask.sum(1) + n_world).tolist()
    rows = None if batch.pack_rows is None else batch.pack_rows.tolist()
    real = sum(lengths)
    return real, round(real / (1 - padding_share(lengths, rows)))


def measure(cfg, repeats: int) -> dict:
    """Padding share and real tokens/s of forward + backward over one epoch's micro-batches (best of `repeats`)."""
    batches, model = micro_batches(cfg)
    inputs = [b.to("cpu") for b in batches]
    params = [p for p in model.parameters() if p.requires_grad]
    n_world = model.projector.num_tokens(*inputs[0].latent_mean.shape[-2:])
    real = slots = 0
    for x in inputs:
        r, s = layout_tokens(x, n_world)
        real, slots = real + r, slots + s

    def epoch() -> None:
        for x in inputs:
            model(x).loss.backward()
            for p in params:
                p.grad = None

    model(inputs[0]).loss.backward()  # warm-up
    for p in params:
        p.grad = None
    best = {"wall": float("inf"), "cpu": float("inf")}
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        epoch()
        best = {"wall": min(best["wall"], time.perf_counter() - t), "cpu": min(best["cpu"], time.process_time() - c)}
    return {
        "micro_batches": len(inputs),
        "samples": sum(x.size for x in inputs),
        "real_tokens": real,
        "padding_share": 1 - real / slots,
        "tokens_per_s": real / best["wall"],
        "tokens_per_cpu_s": real / best["cpu"],
    }


def sample_lengths_summary(cache: Path, cfg) -> dict:
    """Percentiles of the cache's text lengths in tokens (as the formatter encodes them)."""
    from theworld import cache_format as cf
    from theworld.model.encoders import load_gemma
    from theworld.model.text import ChatFormatter
    from train.data.loader import sample_lengths

    fmt = ChatFormatter(load_gemma("tiny", "float32")[1], max_length=cfg.train.loader.max_length or None)
    lengths = sample_lengths(fmt, cf.CacheReader(cache))[0]
    return {f"p{q}": int(np.percentile(lengths, q)) for q in (10, 50, 90, 99)} | {"mean": float(lengths.mean())}


def main(argv: list[str] | None = None) -> int:
    from theworld.core.config import load_config
    from train.config import TrainConfig

    p = argparse.ArgumentParser(prog="tools.speed_packing", description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=128, help="conversations in the cache (default 128)")
    p.add_argument("--resolution", type=int, default=64, help="image side in pixels (64: 66 world tokens)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per forward (default 8)")
    p.add_argument("--pack-length", type=int, default=2048, help="train.loader.pack_length (default 2048)")
    p.add_argument("--max-length", type=int, default=2048, help="train.loader.max_length (default 2048)")
    p.add_argument("--repeats", type=int, default=1, help="timed epochs per layout, best kept (default 1)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    add_threads(p, "torch intra-op threads for the timed forward and backward (0: torch's default)")
    args = p.parse_args(argv)
    apply_threads(args)
    torch.manual_seed(0)
    # --json: stdout holds the figures alone (precompute's and the loader's lines go to stderr)
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory() as tmp:
        cache = write_cache(Path(tmp), args.samples, args.resolution)
        base = {
            "cache_dir": cache,
            "output_dir": Path(tmp) / "run",
            "init_from": "null",
            "model.dtype": "float32",
            "image.resolution": args.resolution,
            "freeze.language": "false",  # stage 3: the language model trains
            "train.global_batch_size": args.micro_batch * 4,
            "train.micro_batch_size": args.micro_batch,
            "train.eval.samples": 0,
            "train.loader.num_workers": 0,
            "train.loader.max_length": args.max_length,
            "train.loader.pack_length": args.pack_length,
            "trackers": "[]",
        }
        stage3 = Path(__file__).parent.parent / "configs" / "stage3.yaml"
        config = lambda extra: load_config(  # noqa: E731
            TrainConfig, stage3, [f"{k}={v}" for k, v in {**base, **extra}.items()]
        )
        lengths = sample_lengths_summary(cache, config({}))
        rows = {}
        for name, extra in LAYOUTS.items():
            rows[name] = measure(config(extra), args.repeats)
            print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    plain = rows["plain"]
    for r in rows.values():
        r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r["speedup_cpu"] = r["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
    shape = {
        "samples": args.samples,
        "micro_batch": args.micro_batch,
        "pack_length": args.pack_length,
        "world_tokens": (args.resolution // 8) ** 2 + 2,
        "text_tokens": lengths,
    }
    if args.json:
        print(json.dumps({"shape": shape, "layouts": rows}, indent=1))
        return 0
    print(
        f"{args.samples} llava-instruct-shaped conversations, text tokens p10/p50/p90/p99 {lengths['p10']}/"
        f"{lengths['p50']}/{lengths['p90']}/{lengths['p99']} (mean {lengths['mean']:.0f}) + {shape['world_tokens']} "
        f"world tokens; micro-batch {args.micro_batch}, pack_length {args.pack_length}, stage 3 (language trains)"
    )
    print(f"{'layout':16} {'padding':>8} {'tokens/s':>10} {'x plain':>8} {'tok/cpu-s':>10} {'x plain':>8}")
    for name, r in rows.items():
        print(
            f"{name:16} {r['padding_share']:8.1%} {r['tokens_per_s']:10.0f} {r['speedup']:8.2f} "
            f"{r['tokens_per_cpu_s']:10.0f} {r['speedup_cpu']:8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
