"""Real-size benchmark (GPU): Gemma 3 4B + the Wan 2.1 VAE architectures with random weights.

    python -m tools.speed_real [--json] [--rows stage1,vae] [--micro-batch 4,8] [--pool 1,2] [--steps 10]
                               [--compile no|yes|both] [--checkpointing no|yes|both] [--attn sdpa|flex_attention]
                               [--encoding cached|live|both]

Random weights are fine for speed. Rows: stage-1 steps (projector trains; frozen bf16 Gemma) for each pool,
checkpointing, compile (train.hardware.compile) and micro-batch asked for, with the language model's attention kernel
(train.hardware.attention): samples/s, peak memory, and MFU against the language model's forward + activation-backward
FLOPs. `cached` steps read latents and SigLIP features staged on the GPU (what the cache gives); `live` steps encode 512
px images through the frozen VAE and 896 px pixels through the frozen SigLIP tower inside every step (the reference run,
and the trainer's fallback), and carry `cache_speedup` = live step time / cached step time of the same row. The VAE
encoder at 512 px in bf16 as precompute runs it (eager, channels-last, compiled): images/s. `--sizes tiny` runs the same
code at toy sizes (CPU smoke test; no MFU there)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from theworld.core.device import default_device
from theworld.model import gemma3
from theworld.model.arch import ANSWER_TOKENS, REAL, TEXT_TOKENS, TINY, gemma_config, latent_side
from theworld.model.encoders import WorldEncoder, _quiet_hf
from theworld.model.inputs import ModelInputs
from theworld.model.objective import IGNORE
from theworld.model.projector import WorldProjector
from theworld.model.world import TheWorld, compile_language_layers
from train.components import set_language_attention

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def build_gemma(sizes: dict, device: torch.device, attn: str = "sdpa"):
    """Gemma 3 at `sizes` with random weights, frozen, in bf16 (built once; every row shares it)."""
    from transformers import Gemma3ForConditionalGeneration

    with torch.device(device):
        gemma = Gemma3ForConditionalGeneration(gemma_config(sizes)).to(torch.bfloat16).eval()
    set_language_attention(gemma, attn)
    return gemma.requires_grad_(False)


def build(sizes: dict, gemma, pool: int, device: torch.device) -> TheWorld:
    """Stage 1: a fresh trainable projector at `pool` on the shared frozen Gemma and a frozen bf16 VAE."""
    from diffusers import AutoencoderKLWan

    with torch.device(device):
        vae = AutoencoderKLWan(**sizes["vae"]).to(torch.bfloat16).eval()
    encoder = WorldEncoder(vae)
    proj = WorldProjector(sizes["text"]["hidden_size"], encoder.latents_mean, encoder.latents_std, pool=pool).to(device)
    model = TheWorld(gemma, encoder, proj)
    model.requires_grad_(False)
    proj.requires_grad_(True)
    return model


def text_inputs(b: int, mm: int, boi: int, image: int, eoi: int, g: torch.Generator) -> ModelInputs:
    """Token ids, mask and labels of `b` samples: TEXT_TOKENS of text with one image block (boi, `mm` image tokens,
    eoi) after the first 8, the last ANSWER_TOKENS labelled; text ids below every special id."""
    ids = torch.randint(0, min(boi, image, eoi), (b, TEXT_TOKENS + mm + 2), generator=g)
    ids[:, 8], ids[:, 9 : 9 + mm], ids[:, 9 + mm] = boi, image, eoi
    labels = torch.full_like(ids, IGNORE)
    labels[:, -ANSWER_TOKENS:] = ids[:, -ANSWER_TOKENS:]
    return ModelInputs(ids, torch.ones_like(ids), labels)


def batch(sizes: dict, b: int, device: torch.device, live: bool = False) -> ModelInputs:
    """A stage-1 micro-batch: cached world inputs (latents, SigLIP features) or, `live`, the pixels they come from
    (uint8 images for the VAE as the loader gives them, normalised pixel_values for SigLIP)."""
    vocab, h = sizes["text"]["vocab_size"], sizes["text"]["hidden_size"]
    mm, lat, res = sizes["mm_tokens"], latent_side(sizes["resolution"]), sizes["resolution"]
    g = torch.Generator().manual_seed(0)
    out = text_inputs(b, mm, vocab - 3, vocab - 1, vocab - 2, g)  # gemma_config's boi, image and eoi ids
    if live:
        side = sizes["vision"]["image_size"]
        images = torch.randint(0, 256, (b, 3, res, res), dtype=torch.uint8, generator=g)
        out = out.with_inputs(images=images, pixel_values=torch.rand(b, 3, side, side, generator=g) * 2 - 1)
    else:
        mean = torch.randn(b, 16, 1, lat, lat, generator=g)
        logvar = torch.randn(b, 16, 1, lat, lat, generator=g) - 4
        out = out.with_inputs(latent_mean=mean, latent_logvar=logvar, siglip=torch.randn(b, mm, h, generator=g))
    return out.to(device)


def lm_flops(sizes: dict, seq: int) -> float:
    """Forward FLOPs of the language model over one sequence (matmuls + attention; lm_head on answer tokens only);
    the activation backward of frozen weights costs the same again (dX only, no dW)."""
    t = sizes["text"]
    h, hd, nh, kv, ff = (
        t["hidden_size"],
        t["head_dim"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        t["intermediate_size"],
    )
    per_layer_params = h * hd * (nh + 2 * kv) + nh * hd * h + 3 * h * ff
    n = t["num_hidden_layers"]
    n_global = gemma3.layer_types(n).count("full_attention")
    ctx_local = min(seq, t["sliding_window"])
    attn = 2 * 2 * nh * hd * (seq * seq / 2 * n_global + seq * ctx_local / 2 * (n - n_global))
    return 2 * per_layer_params * n * seq + attn + 2 * h * t["vocab_size"] * ANSWER_TOKENS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_row(
    sizes: dict,
    gemma,
    pool: int,
    ckpt: bool,
    micro: int,
    steps: int,
    device: torch.device,
    compiled: bool = False,
    live: bool = False,
) -> dict:
    model = build(sizes, gemma, pool, device)
    model.gradient_checkpointing(ckpt)
    model.train()
    opt = torch.optim.AdamW(model.projector.parameters(), lr=1e-4)
    x = batch(sizes, micro, device, live)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps + 2):  # two warm-up steps (compilation happens there)
        _sync(device)
        t = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t)
    step_s = sum(times[2:]) / steps
    world = model.projector.num_tokens(latent_side(sizes["resolution"]), latent_side(sizes["resolution"]))
    seq = x.input_ids.shape[1] + world
    flops = 2 * lm_flops(sizes, seq) * micro
    row = {
        "case": "stage1_step",
        "pool": pool,
        "world_tokens": world - 2,
        "seq_len": seq,
        "gradient_checkpointing": ckpt,
        "compiled": compiled,
        "attn": gemma.config.text_config._attn_implementation,
        "encoding": "live" if live else "cached",
        "micro_batch": micro,
        "step_ms": round(1000 * step_s, 1),
        "samples_per_s": round(micro / step_s, 2),
        "tflops_per_s": round(flops / step_s / 1e12, 1),
    }
    if device.type == "cuda":
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in torch.cuda.get_device_name()), None)
        row["mfu"] = round(flops / step_s / 1e12 / peak, 3) if peak else None
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


@torch.no_grad()
def vae_rows(sizes: dict, batch_size: int, steps: int, device: torch.device) -> list[dict]:
    """The VAE encoder as precompute runs it: eager, with channels-last conv weights (GPU), and compiled as well
    (precompute's `compile: true`); each row's max deviation from the eager output."""
    from diffusers import AutoencoderKLWan

    with torch.device(device):
        enc = WorldEncoder(AutoencoderKLWan(**sizes["vae"]).to(torch.bfloat16).eval())
    r = sizes["resolution"]
    g = torch.Generator().manual_seed(0)  # smooth images (upsampled noise): activations closer to photos'
    pixels = F.interpolate(torch.rand(batch_size, 3, r // 8, r // 8, generator=g), size=r, mode="bilinear") * 255
    pixels = pixels.to(torch.uint8).to(device)
    rows, ref = [], None
    for variant, channels_last, compiled in (
        ("eager", False, False),
        ("channels_last", True, False),
        ("channels_last+compile", True, True),
    ):
        if channels_last and device.type != "cuda":
            continue
        enc.optimize_for_inference(channels_last=channels_last, compile=compiled)
        t = time.perf_counter()
        out = enc(pixels)[0].float()
        _sync(device)
        first_s = time.perf_counter() - t
        ref = out if ref is None else ref
        t = time.perf_counter()
        for _ in range(steps):
            enc(pixels)
        _sync(device)
        dt = (time.perf_counter() - t) / steps
        rows.append(
            {
                "case": "precompute_vae_encode",
                "variant": variant,
                "resolution": r,
                "batch": batch_size,
                "dtype": "bfloat16",
                "images_per_s": round(batch_size / dt, 1),
                "first_call_s": round(first_s, 1),
                "max_abs_diff_vs_eager": round((out - ref).abs().max().item(), 5),
            }
        )
    return rows


def stage1_rows(sizes: dict, args, device: torch.device) -> list[dict]:
    """Stage-1 step rows for every (compiled, micro-batch, pool, checkpointing) asked for, on one shared Gemma."""
    gemma = build_gemma(sizes, device, args.attn)
    both = {"no": [False], "yes": [True], "both": [False, True]}
    encodings = {"cached": [False], "live": [True], "both": [False, True]}[args.encoding]
    micros, pools = [int(m) for m in args.micro_batch.split(",")], [int(p) for p in args.pool.split(",")]
    rows = []
    for compiled in both[args.compile]:
        if compiled:
            compile_language_layers(gemma)  # once: every row shares this Gemma
        # encoding varies fastest: a live row comes right after the cached row of the same settings, if asked for
        for micro, pool, ckpt, live in itertools.product(micros, pools, both[args.checkpointing], encodings):
            try:
                row = step_row(sizes, gemma, pool, ckpt, micro, args.steps, device, compiled, live)
            except torch.OutOfMemoryError:
                row = {
                    "case": "stage1_step",
                    "pool": pool,
                    "gradient_checkpointing": ckpt,
                    "compiled": compiled,
                    "attn": args.attn,
                    "encoding": "live" if live else "cached",
                    "micro_batch": micro,
                    "error": "out of memory",
                }
                torch.cuda.empty_cache()
            prev = rows[-1] if rows else {}
            if live and prev.get("encoding") == "cached" and "step_ms" in prev and "step_ms" in row:
                row["cache_speedup"] = round(row["step_ms"] / prev["step_ms"], 2)
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.speed_real", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--sizes", choices=["real", "tiny"], default="real")
    p.add_argument("--micro-batch", default="4", help="comma-separated micro-batch sizes, one set of rows each")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--compile",
        choices=["no", "yes", "both"],
        default="both",
        help="torch.compile the decoder layers (train.hardware.compile) for the stage-1 rows",
    )
    p.add_argument("--pool", default="1,2", help="comma-separated world.pool values")
    p.add_argument("--checkpointing", choices=["no", "yes", "both"], default="both")
    p.add_argument(
        "--attn",
        choices=["sdpa", "flex_attention", "eager"],
        default="sdpa",
        help="the language model's attention kernel (train.hardware.attention)",
    )
    p.add_argument(
        "--encoding",
        choices=["cached", "live", "both"],
        default="both",
        help="stage-1 world inputs: cached latents + SigLIP features, live VAE + SigLIP encoding in every "
        "step, or both (live rows then carry cache_speedup)",
    )
    p.add_argument("--vae-batch", type=int, default=16, help="batch of the VAE encoder rows")
    p.add_argument("--rows", default="stage1,vae", help="which rows: stage1, vae, or both (comma-separated)")
    args = p.parse_args(argv)
    device = default_device()
    if args.sizes == "real" and device.type != "cuda":
        print(
            "error: tools.speed_real at real sizes needs a CUDA GPU (use --sizes tiny for a CPU smoke run)",
            file=sys.stderr,
        )
        return 2
    sizes = REAL if args.sizes == "real" else TINY
    _quiet_hf()
    kinds = set(args.rows.split(","))
    rows = stage1_rows(sizes, args, device) if "stage1" in kinds else []
    if "vae" in kinds:
        vae = vae_rows(sizes, args.vae_batch, args.steps, device)
        rows += vae
        for row in vae if not args.json else ():
            print(json.dumps(row), flush=True)
    if args.json:
        print(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "attn_implementation": args.attn,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
