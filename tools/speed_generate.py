"""Generation benchmark: what the KV cache buys, and how `TheWorld.generate`'s loop compares with Gemma 3's own.

    python -m tools.speed_generate [--new-tokens 64] [--repeats 3] [--batch 1] [--json]
    python -m tools.speed_generate --real [--sizes real|tiny] [--pool 1]      (real sizes: a GPU)

Default (CPU is enough): the embedded tiny TheWorld on a synthetic scene (world tokens, image tokens, prompt). For
cache on and off (`use_cache=False` recomputes the whole sequence at every step), the time for N new tokens divided
by the time for 1: about N with no cache would mean the prefix dominates; the cache keeps it far below that.
Generation never stops early here (no stop token), so every run makes exactly N tokens.
`--real`: Gemma 3 4B + Wan VAE sizes with random bf16 weights (tools.speed_real's builders): tokens/s of our
generation loop against `Gemma3ForConditionalGeneration.generate` on the same text-only prompt (greedy, exactly N
tokens), and of our loop on the full fused prefix (world + image tokens). `--sizes tiny` runs that path at toy sizes
(a smoke test; no figures worth quoting).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from theworld.core.device import default_device
from theworld.infer import generate as gen
from theworld.model.arch import REAL, TINY
from tools.speed_real import _sync, batch, build, build_gemma
from tools.threads import add_threads, apply_threads


def _timed(fn, repeats: int, device: torch.device) -> float:
    """Best of `repeats` wall-clock seconds (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def _decode(model, fused: dict, n: int, use_cache: bool) -> list[list[int]]:
    return gen.decode(model, fused, n, gen.Sampler(False, 1.0, 1.0, None, "cpu"), [], 0, use_cache)


def cache_rows(model, fused: dict, new_tokens: int, repeats: int, device: torch.device) -> list[dict]:
    rows = []
    for use_cache in (True, False):
        one = _timed(lambda use_cache=use_cache: _decode(model, fused, 1, use_cache), repeats, device)
        many = _timed(lambda use_cache=use_cache: _decode(model, fused, new_tokens, use_cache), repeats, device)
        rows.append(
            {
                "case": "cache" if use_cache else "no_cache",
                "prefix_tokens": fused["inputs_embeds"].shape[1],
                "batch": fused["inputs_embeds"].shape[0],
                "new_tokens": new_tokens,
                "t1_ms": round(1000 * one, 1),
                f"t{new_tokens}_ms": round(1000 * many, 1),
                "ratio": round(many / one, 2),
            }
        )
    return rows


def tiny_fused(batch_size: int):
    from theworld.embedded import synthetic
    from theworld.model.config import ModelConfig, WorldConfig
    from theworld.model.world import TheWorld

    model, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig())
    model.eval()
    images = [synthetic.scene(7, i)[0] for i in range(batch_size)]
    with torch.no_grad():
        fused = gen.left_align(model.embed_inputs(gen.prepare(model, images, [synthetic.PROMPT] * batch_size)))
    return model, fused


def text_only(model, ids: torch.Tensor) -> dict:
    """Fused inputs of a text-only prompt: what Gemma's own generate sees, in our loop's form."""
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return {
        "inputs_embeds": model.gemma.get_input_embeddings()(ids),
        "attention_mask": torch.ones_like(ids),
        "position_ids": pos,
        "token_type_ids": torch.zeros_like(ids),
    }


@torch.no_grad()
def real_rows(
    sizes: dict, pool: int, batch_size: int, new_tokens: int, repeats: int, device: torch.device
) -> list[dict]:
    gemma = build_gemma(sizes, device)
    model = build(sizes, gemma, pool, device).eval()
    x = batch(sizes, batch_size, device)
    ids = x.input_ids.masked_fill(x.input_ids >= sizes["text"]["vocab_size"] - 3, 0)  # text only
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        ours = _timed(lambda: _decode(model, text_only(model, ids), new_tokens, True), repeats, device)
        theirs = _timed(
            lambda: gemma.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            ),
            repeats,
            device,
        )
        fused = gen.left_align(model.embed_inputs(x))
        full = _timed(lambda: _decode(model, fused, new_tokens, True), repeats, device)
    tps = lambda s: round(batch_size * new_tokens / s, 1)
    return [
        {
            "case": "text_only",
            "prompt_tokens": ids.shape[1],
            "batch": batch_size,
            "new_tokens": new_tokens,
            "ours_tokens_per_s": tps(ours),
            "gemma_generate_tokens_per_s": tps(theirs),
            "ours_over_gemma": round(theirs / ours, 3),
        },
        {
            "case": "fused_prefix",
            "prefix_tokens": fused["inputs_embeds"].shape[1],
            "batch": batch_size,
            "new_tokens": new_tokens,
            "ours_tokens_per_s": tps(full),
        },
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.speed_generate", description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    add_threads(p)
    p.add_argument("--real", action="store_true", help="real-size random Gemma 3 4B: ours vs Gemma's generate")
    p.add_argument("--sizes", choices=("real", "tiny"), default="real", help="with --real")
    p.add_argument("--pool", type=int, default=1, help="with --real: world-token pooling")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    apply_threads(args)
    device = default_device()
    if args.real:
        rows = real_rows(
            REAL if args.sizes == "real" else TINY, args.pool, args.batch, args.new_tokens, args.repeats, device
        )
    else:
        model, fused = tiny_fused(args.batch)
        rows = cache_rows(
            model.to(device), {k: v.to(device) for k, v in fused.items()}, args.new_tokens, args.repeats, device
        )
    machine = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps({**machine, "rows": rows}))
    else:
        print("  ".join(f"{k}={v}" for k, v in machine.items()))
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
