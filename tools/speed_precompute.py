"""Precompute benchmark: how close the full pipeline gets to the encoder alone, and what the cache format costs.

    python -m tools.speed_precompute [--json] [--n N] [--cases tiny,jpeg256]
    python -m tools.speed_precompute --cases real512 --n 1024    # GPU: the real-size Wan VAE (random weights) in bf16
    python -m tools.speed_precompute --cases rollout --n 16       # world rollouts of the tiny Video2World pipeline

For each case, measured side by side in one run on the same images:
  pipeline_efficiency   encode-only time on pre-decoded uint8 tensors / full `run()` time (decode, resize, encode,
                        serialise, write; model loading excluded). 1.0 means the encoder is the only cost.
  host_ms_per_image     one worker's decode+resize, and the serialisation of a sample (latents to safetensors + tar
                        member bytes), per image.
  bytes_overhead        bytes per cached sample / bytes of its payload (latent tensors, image, caption, json) - 1.
Case rollout (theworld/model/rollout.py, the tiny default at 64 px, 2 world steps, the pipeline's default 35 denoising
steps with guidance): rollouts_per_s, and step_ratio_cached_to_live = the time of a stage-1 training step (forward
and backward, projector trainable) on cached rollout latents / the time of the same step rolling out live from the
images, both measured in this run on the same batch: what the cache buys.
A last row writes real-size samples (512 px: latents 16x1x64x64 in bfloat16, a 512 px JPEG) to measure the format's
overhead at the size it is used at, without needing the real VAE.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image, ImageFilter

from precompute.config import PrecomputeConfig, SourceConfig
from precompute.entry_dataset import EntryDataset
from precompute.pipeline import encode_latents, run
from precompute.sources import open_listing
from theworld import cache_format as cf
from theworld.core.device import default_device
from theworld.embedded import synthetic
from theworld.model import encoders, images
from theworld.model.config import ImageConfig, ModelConfig
from tools.threads import add_threads, apply_threads


def _jpeg_folder(root: Path, n: int, size: tuple[int, int] = (1024, 768)) -> None:
    """n photo-sized JPEGs (synthetic scenes blown up, blurred and noised so they compress like photos)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        img, caption = synthetic.scene(1, i, size=256)
        img = img.resize(size, Image.BICUBIC).filter(ImageFilter.GaussianBlur(2))
        noise = Image.effect_noise(size, 24).convert("RGB")
        img = Image.blend(img, noise, 0.15)
        img.save(root / f"{i:05d}.jpg", quality=90)
        lines.append(json.dumps({"image": f"{i:05d}.jpg", "caption": caption}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")


def _real_vae(path: Path) -> str:
    """The real Wan 2.1 VAE architecture (`AutoencoderKLWan()`, 127M params) with random weights, saved like a
    downloaded one so the pipeline loads it through the same from_pretrained path."""
    from diffusers import AutoencoderKLWan

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        AutoencoderKLWan().to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _config(case: str, work: Path, n: int, workers: int = 0) -> PrecomputeConfig:
    common = dict(model=ModelConfig(gemma="tiny", vae="tiny", dtype="float32"), shard_size=128, num_workers=1)
    if case == "real512":
        if not torch.cuda.is_available():
            raise SystemExit("error: case real512 needs a CUDA GPU")
        _jpeg_folder(work / "jpegs512", n)
        workers = workers or min(8, os.cpu_count() or 1)
        return PrecomputeConfig(
            model=ModelConfig(gemma="tiny", vae=_real_vae(work / "vae-real"), dtype="bfloat16"),
            image=ImageConfig(resolution=512),
            output_dir=str(work / "cache-real512"),
            source=SourceConfig(type="folder", path=str(work / "jpegs512")),
            shard_size=256,
            batch_size=32,
            num_workers=workers,
            compile=True,
        )
    if case == "tiny":
        return PrecomputeConfig(
            **common,
            image=ImageConfig(resolution=64),
            output_dir=str(work / "cache-tiny"),
            source=SourceConfig(type="synthetic", num_samples=n),
            batch_size=64,
        )
    if case == "jpeg256":
        _jpeg_folder(work / "jpegs", n)
        return PrecomputeConfig(
            **common,
            image=ImageConfig(resolution=256),
            output_dir=str(work / "cache-jpeg"),
            source=SourceConfig(type="folder", path=str(work / "jpegs")),
            batch_size=16,
        )
    raise SystemExit(f"unknown case {case!r} (tiny, jpeg256, real512)")


def _timed(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def bench_case(case: str, work: Path, n: int, workers: int = 0) -> dict:
    cfg = _config(case, work, n, workers)
    listing = open_listing(
        cfg.source.type,
        cfg.source.path,
        cfg.source.num_samples,
        cfg.seed,
        cfg.source.prompt,
        index_dir=Path(cfg.output_dir) / cf.INDEX_DIR,
        resolution=cfg.image.resolution,
    )
    entries = listing.entries(0, len(listing))
    dataset = EntryDataset(listing, cfg)
    # Host work of one worker: decode + resize, in this process, image by image.
    t_prep, items = _timed(lambda: [dataset[i] for i in range(len(entries))])
    device = default_device()
    encoder = encoders.WorldEncoder(encoders.load_vae(cfg.model.vae, cfg.model.dtype)).to(device).eval()
    encoder.optimize_for_inference(channels_last=device.type == "cuda", compile=cfg.compile)  # as run() does
    # Encode-only: the pixels already sit on the device, so this is the encoder's own speed.
    pixels = torch.stack([it["pixels"] for it in items]).to(device)
    encode_latents(encoder, pixels[: cfg.batch_size], cfg)  # warm-up (allocations, compilation); waits for the device
    t_enc, latents = _timed(
        lambda: [
            encode_latents(encoder, pixels[a : a + cfg.batch_size], cfg) for a in range(0, len(pixels), cfg.batch_size)
        ]
    )
    encoder = pixels = None  # drop the references: the device memory is free for what follows
    mean = torch.cat([m for m, _ in latents])
    logvar = torch.cat([v for _, v in latents])
    samples = [
        cf.Sample(
            key=e.key,
            caption=it["caption"],
            meta=it["meta"],
            mean=mean[i],
            logvar=logvar[i],
            image=it.get("image"),
        )
        for i, (e, it) in enumerate(zip(entries, items))
    ]
    t_ser, encoded = _timed(lambda: [cf.encode_sample(s, cfg.cache.dtype) for s in samples])
    # The full pipeline on the same images (model loading is outside its timer). Its summary lines go to stderr:
    # stdout is this benchmark's figures alone, so `--json` output parses as it is.
    with contextlib.redirect_stdout(sys.stderr):
        summary = run(cfg)["summary"]
    manifest = cf.load_manifest(cfg.output_dir)
    payload = sum(len(v) for members in encoded for v in members.values()) / len(encoded)
    per_sample = manifest["bytes"] / manifest["num_samples"]
    return {
        "case": case,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "images": n,
        "resolution": cfg.image.resolution,
        "batch_size": cfg.batch_size,
        "num_workers": cfg.num_workers,
        "threads": torch.get_num_threads(),
        "encode_only_images_per_s": round(n / t_enc, 1),
        "pipeline_images_per_s": summary["images_per_s"],
        "pipeline_efficiency": round((t_enc / n) / (summary["encode_seconds"] / n), 3),
        "pipeline_seconds": {"total": summary["encode_seconds"], **summary["seconds_rank0"]},
        "host_ms_per_image_decode_resize": round(1000 * t_prep / n, 3),
        "host_ms_per_image_serialise": round(1000 * t_ser / n, 3),
        "bytes_per_sample": round(per_sample),
        "payload_bytes_per_sample": round(payload),
        "bytes_overhead": round(per_sample / payload - 1, 4),
    }


def bench_rollout(n: int, steps: int = 2, batch: int = 4, repeats: int = 3, inference_steps: int = 35) -> dict:
    """Rollouts per second, and a cached training step's time over a live-rollout one's (see the module doc)."""
    from theworld.model.config import RolloutConfig, WorldConfig
    from theworld.model.inputs import text_batch
    from theworld.model.rollout import observed_and_predicted, sample_seeds
    from theworld.model.world import TheWorld

    world = WorldConfig(num_world_steps=steps, rollout=RolloutConfig(inference_steps=inference_steps))
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), world)
    scenes = [synthetic.scene(4, i) for i in range(max(n, batch))]
    pixels = torch.stack([images.to_uint8_tensor(img) for img, _ in scenes])
    seeds = sample_seeds(0, [f"bench-{i}" for i in range(len(pixels))])
    with torch.no_grad():
        observed_and_predicted(model.world_encoder, model.rollout, pixels[:1], seeds[:1])  # warm-up
        t_roll, rolled = _timed(
            lambda: [
                observed_and_predicted(model.world_encoder, model.rollout, pixels[a : a + batch], seeds[a : a + batch])
                for a in range(0, n, batch)
            ]
        )
    fmt = model.formatter
    text = text_batch([fmt.encode(synthetic.PROMPT, cap) for _, cap in scenes[:batch]], fmt.pad_id)
    pv = torch.stack([images.siglip_pixels(processor.image_processor, img) for img, _ in scenes[:batch]])
    mean, logvar = rolled[0]
    cached = text.with_inputs(latent_mean=mean, latent_logvar=logvar, pixel_values=pv)
    live = text.with_inputs(images=pixels[:batch], pixel_values=pv, rollout_seeds=torch.tensor(seeds[:batch]))

    def step(inputs) -> None:
        model.zero_grad(set_to_none=True)
        model(inputs).loss.backward()

    times = {"cached": [], "live": []}
    step(cached), step(live)  # warm-up
    for _ in range(repeats):  # interleaved, so a change in the machine's load hits both alike
        for name, inputs in (("cached", cached), ("live", live)):
            times[name].append(_timed(step, inputs)[0])
    cached_s, live_s = (sorted(times[k])[len(times[k]) // 2] for k in ("cached", "live"))
    r = world.rollout
    return {
        "case": "rollout",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "rollouts": n,
        "resolution": pixels.shape[-1],
        "world_steps": steps,
        "inference_steps": r.inference_steps,
        "guidance_scale": r.guidance_scale,
        "batch_size": batch,
        "rollouts_per_s": round(n / t_roll, 3),
        "cached_step_ms": round(1000 * cached_s, 1),
        "live_step_ms": round(1000 * live_s, 1),
        "step_ratio_cached_to_live": round(cached_s / live_s, 4),
    }


def bench_draft_decode(n: int = 16) -> dict:
    """JPEG draft-mode decoding vs a full decode of a 1024x768 photo, both to a 256 px input."""
    with tempfile.TemporaryDirectory() as tmp:
        _jpeg_folder(Path(tmp), n)
        blobs = [p.read_bytes() for p in sorted(Path(tmp).glob("*.jpg"))]
    t_full, _ = _timed(lambda: [images.resize(images.decode(b), 256)[0] for b in blobs])
    t_draft, _ = _timed(lambda: [images.resize(images.decode(b, draft_size=256), 256)[0] for b in blobs])
    return {
        "case": "jpeg_draft_decode",
        "full_ms": round(1000 * t_full / n, 2),
        "draft_ms": round(1000 * t_draft / n, 2),
        "speedup": round(t_full / t_draft, 2),
    }


def bench_real_size_format(work: Path, n: int = 32) -> dict:
    """Format overhead at real size: 512 px -> latents (16, 1, 64, 64) in bfloat16, plus a 512 px JPEG."""
    img, caption = synthetic.scene(2, 0, size=512)
    buf = io.BytesIO()
    img.filter(ImageFilter.GaussianBlur(1)).save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    g = torch.Generator().manual_seed(0)
    rows = []
    for keep_image in (True, False):
        samples = [
            (
                f"s{i:05d}",
                cf.encode_sample(
                    cf.Sample(
                        key=f"s{i:05d}",
                        caption=caption,
                        meta={
                            "prompt": synthetic.PROMPT,
                            "original_size": [512, 512],
                            "crop_box": [0, 0, 512, 512],
                            "flip": False,
                        },
                        mean=torch.randn(16, 1, 64, 64, generator=g),
                        logvar=torch.randn(16, 1, 64, 64, generator=g),
                        image=jpeg if keep_image else None,
                    ),
                    "bfloat16",
                ),
            )
            for i in range(n)
        ]
        side = cf.write_shard(work / f"real-{keep_image}", 0, samples)
        payload = sum(len(v) for _, m in samples for v in m.values()) / n
        raw = 2 * 16 * 64 * 64 * 2  # the two tensors' bytes alone
        rows.append(
            {
                "case": f"real_size_format{'' if keep_image else '_no_images'}",
                "bytes_per_sample": round(side["bytes"] / n),
                "payload_bytes_per_sample": round(payload),
                "raw_tensor_bytes": raw,
                "bytes_overhead": round(side["bytes"] / n / payload - 1, 4),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.speed_precompute", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--n", type=int, default=1024, help="images per case (jpeg256 uses n/16: its encoder is 60x slower)")
    p.add_argument("--cases", default="tiny,jpeg256")
    p.add_argument("--workers", type=int, default=0, help="decode workers of real512 (0: min(8, CPU count))")
    add_threads(
        p,
        "torch threads for the encoder (0: torch's default). On a small CPU the decode workers share the cores with "
        "the encoder; --threads 1 with one worker gives each its own core",
    )
    args = p.parse_args(argv)
    apply_threads(args)
    encoders._quiet_hf()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for case in args.cases.split(","):
            if case == "rollout":  # a rollout is ~1000x an encode: n/64 of them
                rows.append(bench_rollout(max(4, args.n // 64)))
            else:
                n = args.n if case in ("tiny", "real512") else max(8, args.n // 16)
                rows.append(bench_case(case, work, n, args.workers))
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
        rows.append(bench_draft_decode())
        rows += bench_real_size_format(work)
    if args.json:
        print(json.dumps({"rows": rows}, indent=1))
    else:
        for r in rows[len(args.cases.split(",")) :]:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
