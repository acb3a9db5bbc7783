"""Multiple-choice scoring speed: one prefix per item and world (the default) against every choice's whole sequence.

    python -m tools.speed_eval [--json] [--cases demo,real_shaped] [--items 8] [--batch 4] [--repeats 2]

Each case scores the same items both ways in one run (own world and shuffled world, as theworld.evaluate does) and
reports items/s of each and their ratio (`speedup`, wall-clock; `speedup_cpu_time`, the same from this process's CPU
time, which other processes on the same cores do not move); the largest difference between the two ways' scores is
printed with them.
- `demo`: the embedded tiny model on the synthetic demo set (4 choices; the Scorer, image loading included).
- `real_shaped`: the prefix of a real stage (1,026 world tokens as at pool 2 from 512 px, 256 image tokens, a question
  of the benchmark layout's length), 4 choices of 3 to 6 answer tokens, on a Gemma 3 of Gemma 3 4B's layer pattern,
  sliding window and vocabulary with a small hidden size and random weights (tools.speed_real's builders), cached
  latents and SigLIP features. `--sizes tiny` shrinks it to toy sizes (a smoke test; no figures worth quoting).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

from theworld.core.device import default_device
from theworld.infer import prefix_scoring
from theworld.model.arch import TINY
from theworld.model.inputs import ModelInputs, text_batch
from theworld.model.objective import IGNORE
from theworld.model.text import Encoded
from tools.speed_real import _sync, batch, build, build_gemma
from tools.threads import add_threads, apply_threads

CHOICES = 4
SMALL = {
    "text": {
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 1024,
        "vocab_size": 262208,
        "query_pre_attn_scalar": 32,
    },
    # 16 x 16 patches pool to the 256 image tokens (the tower never runs: SigLIP features are given)
    "vision": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 64,
        "patch_size": 4,
    },
    "mm_tokens": 256,
    "resolution": 512,
    "vae": TINY["vae"],
}
SIZES = {"small": SMALL, "tiny": TINY}


def _best(fn, repeats: int, device: torch.device) -> tuple[dict, object]:
    """({"wall": best wall-clock seconds, "cpu": best CPU seconds of this process} over `repeats` calls after one
    warm-up call, the last result). CPU time stays put when other processes share the cores, as on a shared CPU
    machine, where wall-clock time does not."""
    out = fn()
    best = {"wall": float("inf"), "cpu": float("inf")}
    for _ in range(repeats):
        _sync(device)
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        _sync(device)
        best = {"wall": min(best["wall"], time.perf_counter() - t), "cpu": min(best["cpu"], time.process_time() - c)}
    return best, out


def _row(name: str, n_items: int, t_shared: dict, t_whole: dict, diff: float, **facts) -> dict:
    return {
        "case": name,
        **facts,
        "items": n_items,
        "choices": CHOICES,
        "items_per_s_shared": round(n_items / t_shared["wall"], 2),
        "items_per_s_unshared": round(n_items / t_whole["wall"], 2),
        "speedup": round(t_whole["wall"] / t_shared["wall"], 2),
        "speedup_cpu_time": round(t_whole["cpu"] / t_shared["cpu"], 2),
        "max_abs_score_diff": diff,
    }


def demo_case(n_items: int, batch_size: int, repeats: int, device: torch.device) -> dict:
    from theworld.infer import benchmark_items
    from theworld.infer.scoring import Scorer
    from theworld.model.config import ModelConfig, WorldConfig
    from theworld.model.world import TheWorld

    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig())
    model = model.to(device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        benchmark_items.make_synthetic(f"{tmp}/items.jsonl", n_items, choices=CHOICES)
        items = benchmark_items.read(f"{tmp}/items.jsonl")

        def run(shared: bool):  # own and shuffled world, theworld.evaluate's default conditions
            scorer = Scorer(model, processor, model.image_config, items, shared_prefix=shared)
            return [
                s
                for lo in range(0, n_items, batch_size)
                for s in scorer.score(list(range(lo, min(lo + batch_size, n_items))))
            ]

        t_shared, a = _best(lambda: run(True), repeats, device)
        t_whole, b = _best(lambda: run(False), repeats, device)
    diff = max(abs(x - y) for sa, sb in zip(a, b) for c in sa for x, y in zip(sa[c], sb[c]))
    prefix = model.formatter.prefix(items[0].question)
    return _row("demo", n_items, t_shared, t_whole, diff, prefix_tokens=len(prefix) + model.projector.num_tokens(8, 8))


def _items(sizes: dict, n: int, device: torch.device) -> tuple[list[list[int]], list[Encoded], ModelInputs]:
    """`n` prefixes of the benchmark token layout (one image block) and CHOICES answers of 3..6 tokens each, with
    cached world and image inputs per prefix."""
    x = batch(sizes, n, device)
    g = torch.Generator().manual_seed(1)
    prefixes = [row.tolist() for row in x.input_ids[:, :-8]]  # the question part of the layout, no answer
    end = sizes["text"]["vocab_size"] - 4  # a text id standing for <end_of_turn>
    rows = []
    for p in prefixes:
        for k in range(CHOICES):
            answer = torch.randint(0, end, (2 + k,), generator=g).tolist() + [end]
            rows.append(Encoded(p + answer, [IGNORE] * len(p) + answer))
    return prefixes, rows, x


@torch.no_grad()
def real_shaped_case(sizes: dict, n_items: int, batch_size: int, repeats: int, device: torch.device) -> dict:
    model = build(sizes, build_gemma(sizes, device), pool=2, device=device).eval()
    if device.type != "cuda":
        model.float()  # bf16 matmuls are slow and coarse on a CPU
    model.latent_mode = "mean"
    prefixes, rows, world = _items(sizes, n_items, device)
    owner = [j for j in range(n_items) for _ in range(CHOICES)]
    shuffled = [(j - 1) % n_items for j in range(n_items)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def run(shared: bool) -> list[float]:
        out = []
        for lo in range(0, n_items, batch_size):
            idx = list(range(lo, min(lo + batch_size, n_items)))
            for worlds in (idx, [shuffled[j] for j in idx]):  # own world, then item i-1's
                mean, logvar = world.latent_mean[worlds], world.latent_logvar[worlds]
                siglip = world.siglip[idx]
                sel = [r for r, o in enumerate(owner) if o in idx]
                with autocast:
                    if shared:
                        local = [idx.index(owner[r]) for r in sel]
                        s = prefix_scoring.answer_logprobs(
                            model,
                            [prefixes[j] for j in idx],
                            [rows[r] for r in sel],
                            local,
                            siglip.flatten(0, 1),
                            latent_mean=mean,
                            latent_logvar=logvar,
                        )
                    else:
                        text = text_batch([rows[r] for r in sel], 0).to(device)
                        rep = torch.tensor([idx.index(owner[r]) for r in sel], device=device)
                        s = model.answer_logprobs(
                            text.with_inputs(
                                latent_mean=mean[rep], latent_logvar=logvar[rep], siglip=siglip[rep].flatten(0, 1)
                            )
                        )
                out += s.tolist()
        return out

    t_shared, a = _best(lambda: run(True), repeats, device)
    t_whole, b = _best(lambda: run(False), repeats, device)
    world_tokens = model.projector.num_tokens(sizes["resolution"] // 8, sizes["resolution"] // 8)
    return _row(
        "real_shaped",
        n_items,
        t_shared,
        t_whole,
        max(abs(x - y) for x, y in zip(a, b)),
        world_tokens=world_tokens,
        image_tokens=sizes["mm_tokens"],
        prefix_tokens=len(prefixes[0]) + world_tokens,
        hidden_size=sizes["text"]["hidden_size"],
        layers=sizes["text"]["num_hidden_layers"],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.speed_eval", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--cases", default="demo,real_shaped", help="comma-separated: demo, real_shaped")
    p.add_argument("--sizes", choices=sorted(SIZES), default="small", help="the real_shaped case's model sizes")
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="items per scoring call")
    p.add_argument("--repeats", type=int, default=2)
    add_threads(p)
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if not set(cases) <= {"demo", "real_shaped"} or args.items < 2 or args.batch < 1 or args.repeats < 1:
        print(
            "error: tools.speed_eval: --cases from demo,real_shaped; --items >= 2, --batch and --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    apply_threads(args)
    device = default_device()
    rows = []
    for case in cases:
        row = (
            demo_case(args.items, args.batch, args.repeats, device)
            if case == "demo"
            else real_shaped_case(SIZES[args.sizes], args.items, args.batch, args.repeats, device)
        )
        rows.append(row)
        if not args.json:
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    machine = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps({**machine, "cases": {r.pop("case"): r for r in rows}}))
    else:
        print("  ".join(f"{k}={v}" for k, v in machine.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
