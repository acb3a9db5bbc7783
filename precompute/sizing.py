"""`python -m precompute.cosmos_latents --config CFG --plan`: what a cache will hold and weigh, before any encoding.

No model weights are loaded. Tensor members are sized from the config alone: latent channels from the VAE's config,
image-token features (mm_tokens x hidden) from Gemma's config, each serialised empty to get its exact safetensors
size. Configs come from the saved tiny models, a local folder, the local Hugging Face cache (offline), or, for the
public checkpoints the project targets, the table in theworld/model/arch.py. The latent grid and the variable members
(image bytes, caption, json) are measured on up to PLAN_SAMPLES source entries spread evenly over the source,
prepared exactly as the run prepares them (decode, resize or bucket, PNG for formats kept as PNG).
"""

from __future__ import annotations

import json
import math
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from precompute import sources
from precompute.config import PrecomputeConfig
from precompute.sources import urls
from theworld import cache_format as cf
from theworld.cache_format.index import parts_of
from theworld.core.errors import UserError, one_line
from theworld.model import encoders
from theworld.model.arch import KNOWN_GEMMA, KNOWN_VAE, latent_side

PLAN_SAMPLES = 64
# The encode rate the plan's time line uses: precompute end to end at 512 px through the real Wan 2.1 VAE on one
# H100 (bf16, batch 32, compile: true, 8 decode workers), docs/performance.md, "Precompute" table, case real512,
# commit 5171566. Another resolution, model or GPU runs at another rate.
IMAGES_PER_S_PER_GPU = 252.1
# Rollouts (world.num_world_steps > 0) are timed by the transformer's arithmetic, not a measurement: no GPU run of the
# real Video2World pipeline exists here. FLOPs per denoising pass from the transformer's sizes (below), at an ASSUMED
# sustained rate: 40 % of an H100's dense bf16 peak (989 TFLOP/s). `python -m tools.speed_precompute --cases rollout` on
# the target GPU measures the real rate.
ASSUMED_GPU_FLOPS = 0.4 * 989e12
# A rollout this small (the tiny pipeline) is timed on one sample on this machine's device instead; on a CPU, a larger
# one is priced at the rate this CPU does float32 matrix products (measured), an upper bound of the transformer's.
MEASURE_BELOW_FLOPS = 1e11
# The Video2World transformers' sizes (CosmosTransformer3DModel config: heads, head_dim, layers, mlp_ratio), for the
# public checkpoints when their config is not in the local Hugging Face cache.
KNOWN_TRANSFORMERS = {
    "nvidia/Cosmos-Predict2-2B-Video2World": {
        "num_attention_heads": 16,
        "attention_head_dim": 128,
        "num_layers": 28,
        "mlp_ratio": 4.0,
    },
    "nvidia/Cosmos-Predict2-14B-Video2World": {
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "num_layers": 36,
        "mlp_ratio": 4.0,
    },
}
TEXT_TOKENS = 512  # the pipeline's max_sequence_length: every pass cross-attends to this many prompt tokens
GPUS_PER_NODE = 8
OBJECTS_PER_SHARD = 3  # shards/shard-N.tar, its sidecar shards/shard-N.json, errors/shard-N.jsonl
OBJECTS_PER_CACHE = 4  # manifest.json, errors.jsonl, precompute.json, the shard table (shard-index/shards.safetensors)


def objects(shards: int, shard_size: int) -> int:
    """The objects a cache of `shards` shards of `shard_size` samples holds: each shard's, the cache's own, and its
    shard-index parts (index.parts_of)."""
    return OBJECTS_PER_SHARD * shards + OBJECTS_PER_CACHE + parts_of(shards, shard_size)


def _local_config(key: str, path: str, subfolder: str | None = None) -> dict | None:
    """config.json of a local folder, or of a hub id already in the local Hugging Face cache (no download); one that
    is not a JSON object is refused naming `key` and the file, as loading the model would be."""
    p = Path(path) / (subfolder or "") / "config.json"
    if not p.is_file():
        try:
            from huggingface_hub import hf_hub_download

            p = Path(hf_hub_download(path, "config.json", subfolder=subfolder, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached (or not a hub id): the caller falls back to the table
            return None
    try:
        config = json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(
            f"{key}: cannot load {path!r}: {p} is not valid JSON ({type(e).__name__}: {one_line(e)[:120]})"
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"{key}: cannot load {path!r}: {p} holds a JSON {type(config).__name__}, not a model config")
    return config


def _count(
    config: dict, file_key: str, where: str, spec: str, default: int | None = None, key: str = "model.gemma"
) -> int:
    """A positive integer field of a model config (`where`: "text_config." for a nested one)."""
    section = config.get(where.rstrip("."), {}) if where else config
    value = section.get(file_key, default) if isinstance(section, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{key}: cannot load {spec!r}: its config.json has no usable {where}{file_key} (got {value!r})")
    return value


def siglip_size(spec: str) -> tuple[int, int]:
    """(image tokens, hidden size) of Gemma's multimodal-projector output for model.gemma `spec`."""
    config = _local_config("model.gemma", encoders.resolve_gemma(spec))
    if config is not None:
        return (
            _count(config, "mm_tokens_per_image", "", spec, default=256),
            _count(config, "hidden_size", "text_config.", spec),
        )
    if spec in KNOWN_GEMMA:
        return KNOWN_GEMMA[spec].mm_tokens, KNOWN_GEMMA[spec].hidden_size
    raise UserError(
        f"model.gemma: no config for {spec!r} offline (a local folder, the Hugging Face cache, or one "
        f"of {', '.join(KNOWN_GEMMA)})"
    )


def latent_channels(spec: str) -> int:
    if spec in KNOWN_VAE and not Path(spec).exists():
        return KNOWN_VAE[spec]
    config = _local_config("model.vae", *encoders.resolve_vae(spec))
    if config is None:
        raise UserError(
            f"model.vae: no config for {spec!r} offline (a local folder, the Hugging Face cache, or one "
            f"of {', '.join(KNOWN_VAE)})"
        )
    return _count(config, "z_dim", "", spec, default=16, key="model.vae")


def _member(size: float) -> float:
    """Bytes a member of `size` takes in a tar: a 512-byte header, the data padded to 512."""
    return tarfile.BLOCKSIZE + math.ceil(size / tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


# The plan measures a member by writing one (zeros): a tensor this large per sample is a broken config, not a cache
# (the real models': 16 x 64 x 64 latents, 256 x 2560 SigLIP features).
MAX_VALUES = 1 << 26  # the largest image any source accepts (images.MAX_PIXELS) gives a third of it


def _zeros(shape: tuple[int, ...], key: str, what: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if math.prod(shape) > MAX_VALUES:
        raise UserError(
            f"{key}: its {what} would hold {math.prod(shape):,} values per sample ({' x '.join(map(str, shape))}), "
            f"more than any model this plans for ({MAX_VALUES:,}): check its config.json"
        )
    return torch.zeros(shape, dtype=dtype)


def _latent_bytes(channels: int, hw: tuple[int, int], cfg: PrecomputeConfig) -> int:
    t = _zeros((channels, 1 + cfg.world.num_world_steps, *hw), "model.vae", "latent")
    return len(cf.latent_blob(t, None if cfg.cache.latents == "mean" else t.clone(), cf.DTYPES[cfg.cache.dtype]))


def transformer_sizes(spec: str) -> dict:
    """The Video2World transformer's config for model.vae `spec` (a local or cached config, else the table above),
    refused in one line when the spec has no Video2World transformer."""
    from theworld.model import rollout

    if spec in KNOWN_TRANSFORMERS and not Path(spec).exists():
        return KNOWN_TRANSFORMERS[spec]
    path = encoders.pretrained(spec, encoders.tiny.TINY_ROLLOUT_DIR)[0]
    config = _local_config("model.vae", path, "transformer")
    if config is None:
        if Path(spec).is_dir() or spec in KNOWN_VAE:  # a VAE alone, or a pipeline of another kind
            raise rollout.no_transformer(spec, "no transformer/config.json")
        raise UserError(
            f"model.vae: no Video2World transformer config for {spec!r} offline (a local folder, the Hugging Face "
            f"cache, or one of {', '.join(KNOWN_TRANSFORMERS)})"
        )
    if config.get("_class_name", rollout.TRANSFORMER_CLASS) != rollout.TRANSFORMER_CLASS:
        raise rollout.no_transformer(spec, f"its transformer is a {config.get('_class_name')}")
    return {k: config.get(k, v) for k, v in KNOWN_TRANSFORMERS["nvidia/Cosmos-Predict2-2B-Video2World"].items()}


def rollout_flops(sizes: dict, frames: int, hw: tuple[int, int], inference_steps: int, guidance: bool) -> float:
    """FLOPs of one sample's rollout: passes x layers x tokens x (projections and MLP: 2 x (4 + 2 + 2 x mlp_ratio)
    h^2 per token; self-attention 4 T h; cross-attention 4 x TEXT_TOKENS x h), tokens T = frames x (h/2) x (w/2)."""
    h = sizes["num_attention_heads"] * sizes["attention_head_dim"]
    tokens = frames * (hw[0] // 2) * (hw[1] // 2)
    per_token = 2 * (6 + 2 * sizes["mlp_ratio"]) * h * h + 4 * tokens * h + 4 * TEXT_TOKENS * h
    passes = inference_steps * (2 if guidance else 1)
    return passes * sizes["num_layers"] * tokens * per_token


def _timed_rollout(cfg: PrecomputeConfig, hw: tuple[int, int], device: str) -> float:
    """Seconds per sample of rollouts at latent grid `hw` on `device`, in a batch of the run's batch_size as
    precompute rolls them out (after a warm-up one of one sample)."""
    import time

    from theworld.model.arch import VAE_FACTOR
    from theworld.model.rollout import Rollout

    vae = encoders.load_vae(cfg.model.vae, cfg.model.dtype)
    rollout = Rollout.load(cfg.model.vae, cfg.model.dtype, vae, cfg.world.num_world_steps, cfg.world.rollout)
    rollout = rollout.to(device)
    batch = min(cfg.batch_size, 32)
    pixels = torch.zeros(batch, 3, hw[0] * VAE_FACTOR, hw[1] * VAE_FACTOR, dtype=torch.uint8, device=device)
    rollout(pixels[:1], [0])
    t = time.perf_counter()
    rollout(pixels, list(range(batch)))
    return (time.perf_counter() - t) / batch


def _cpu_flops() -> float:
    """This CPU's float32 matrix-product rate (FLOP/s), on the threads torch uses."""
    import time

    a = torch.randn(512, 512)
    a @ a
    t, n = time.perf_counter(), 8
    for _ in range(n):
        a @ a
    return n * 2 * 512**3 / (time.perf_counter() - t)


def rollout_seconds(cfg: PrecomputeConfig, flops: float, hw: tuple[int, int]) -> tuple[float, str, str]:
    """(seconds per sample, "GPU" or "CPU", what the figure rests on) for rollouts on the device precompute uses
    here: a GPU when torch sees one, else the CPU. Never an H100's rate for a CPU's work."""
    gpu = torch.cuda.is_available()
    device = "GPU" if gpu else "CPU"
    if flops < MEASURE_BELOW_FLOPS:
        seconds = _timed_rollout(cfg, hw, "cuda" if gpu else "cpu")
        return seconds, device, f"measured: a batch of rollouts timed on this machine's {device}"
    if gpu:
        # plus the pipeline's VAE pass over the conditioning video (the image repeated to 1 + 4N frames)
        seconds = flops / ASSUMED_GPU_FLOPS + (1 + 4 * cfg.world.num_world_steps) / IMAGES_PER_S_PER_GPU
        return (
            seconds,
            device,
            (
                f"an ESTIMATE at an assumed {ASSUMED_GPU_FLOPS / 1e12:.0f} TFLOP/s, 40 % of an H100's bf16 peak; "
                "python -m tools.speed_precompute --cases rollout measures it"
            ),
        )
    rate = _cpu_flops()
    return (
        flops / rate,
        device,
        (
            f"an ESTIMATE, no GPU here: at this CPU's measured {rate / 1e9:.0f} GFLOP/s of float32 matrix products, a "
            "lower bound; on a GPU the figure is far smaller"
        ),
    )


def _sig(x: float) -> float:
    """Three significant digits: a small figure stays a figure, never a rounded 0."""
    return float(f"{x:.3g}")


def _measure(cfg: PrecomputeConfig, listing: sources.Listing) -> dict:
    """Mean tar bytes of the variable members over up to PLAN_SAMPLES usable entries spread over the source, and the
    latent grids (h, w) met."""
    from precompute.entry_dataset import EntryDataset

    n = len(listing)
    positions = sorted({i * n // min(n, PLAN_SAMPLES) for i in range(min(n, PLAN_SAMPLES))})
    dataset = EntryDataset(listing, cfg)
    got = {"image": [], "txt": [], "json": [], "hw": [], "errors": 0, "reasons": Counter()}
    for pos in positions:
        item = dataset[pos]
        if item["error"] is not None:
            got["errors"] += 1
            got["reasons"][item["error"]] += 1
            continue
        got["txt"].append(_member(len(item["caption"].encode())))
        got["json"].append(_member(len(json.dumps(item["meta"], sort_keys=True).encode())))
        got["hw"].append((latent_side(item["pixels"].shape[1]), latent_side(item["pixels"].shape[2])))
        if cfg.cache.images:
            got["image"].append(_member(len(item["image"])))
    got["sampled"] = len(positions)
    return got


def estimate(cfg: PrecomputeConfig) -> dict:
    """Entries, shards and bytes per sample by member, and totals for the whole source."""
    cfg.validate_paths()
    urls_plan = None
    with tempfile.TemporaryDirectory() as tmp:  # indexed sources list (and a urls source downloads) into scratch
        if cfg.source.type == "urls":  # a sample of rows downloaded, not the table
            listing, urls_plan = urls.plan_sample(cfg.source, Path(tmp), PLAN_SAMPLES)
        else:
            listing = sources.open_source(cfg.source, cfg.seed, cfg.image.resolution, index_dir=Path(tmp))
        if not len(listing):
            raise UserError(f"config key 'source.path': no samples found in {cfg.source.path or cfg.source.name}")
        got = _measure(cfg, listing)
    n = urls_plan["rows"] if urls_plan else len(listing)
    if not got["hw"]:
        reasons = "; ".join(f"{k} x{n}" if n > 1 else k for k, n in got["reasons"].most_common(3))
        more = f"; and {len(got['reasons']) - 3} other reasons" if len(got["reasons"]) > 3 else ""
        raise UserError(
            f"--plan: none of the {got['sampled']} sampled entries of the source is usable: {reasons}{more}"
        )
    channels = latent_channels(cfg.model.vae)
    latent = sum(_member(_latent_bytes(channels, hw, cfg)) for hw in got["hw"]) / len(got["hw"])
    members = {"latent": latent, "latent_flip": latent if cfg.cache.flip else 0.0}
    if cfg.cache.siglip:
        tokens, hidden = siglip_size(cfg.model.gemma)
        feats = _zeros((tokens, hidden), "model.gemma", "SigLIP features", cf.DTYPES[cfg.cache.dtype])
        members["siglip"] = _member(len(st_save({"features": feats})))
    else:
        members["siglip"] = 0.0
    members["image"] = sum(got["image"]) / len(got["image"]) if got["image"] else 0.0
    members["txt"] = sum(got["txt"]) / len(got["txt"])
    members["json"] = sum(got["json"]) / len(got["json"])
    per_sample = sum(members.values())
    shards = -(-n // cfg.shard_size)  # integers: a float quotient is wrong beyond 2**53 entries
    end = 2 * tarfile.BLOCKSIZE + tarfile.RECORDSIZE / 2  # end-of-archive blocks, then padding to a record (mean)
    # a urls source's failed downloads are rows without a sample: its totals count the usable share of the sample
    usable = round(n * (1 - got["errors"] / got["sampled"])) if urls_plan else n
    gpu_hours = usable / IMAGES_PER_S_PER_GPU / 3600
    extra = {}
    steps = cfg.world.num_world_steps
    if steps:
        r = cfg.world.rollout
        hw = max(got["hw"], key=lambda g: g[0] * g[1])
        flops = rollout_flops(
            transformer_sizes(cfg.model.vae), 1 + steps, hw, r.inference_steps, r.guidance_scale > 1.0
        )
        seconds, device, basis = rollout_seconds(cfg, flops, hw)
        rollout_hours = usable * seconds / 3600
        extra["rollout"] = {
            "world_steps": steps,
            "latent_frames": 1 + steps,
            "transformer_passes_per_sample": r.inference_steps * (2 if r.guidance_scale > 1.0 else 1),
            "tflops_per_sample": _sig(flops / 1e12),
            "seconds_per_sample": _sig(seconds),
            "device": device,
            "hours": _sig(rollout_hours),
            "basis": basis,
        }
        if device == "GPU":
            gpu_hours += rollout_hours
    if urls_plan:
        extra["urls"] = {
            "table_rows": urls_plan["table_rows"],
            "usable_share": round(1 - got["errors"] / got["sampled"], 4),
            "staging_bytes": round(urls_plan["staging_bytes"] / got["sampled"] * n),
        }
    return {
        "source": {"type": cfg.source.type, "path": cfg.source.path or cfg.source.name},
        "entries": n,
        "shards": shards,
        "shard_size": cfg.shard_size,
        "sampled": got["sampled"],
        "sampled_unusable": got["errors"],
        "latent_grids": sorted(set(got["hw"])),
        "latents": cfg.cache.latents,
        "dtype": cfg.cache.dtype,
        "bytes_per_sample": {k: round(v) for k, v in members.items()},
        "bytes_per_sample_total": round(per_sample),
        "bytes_total": round(per_sample) * usable + round(end) * shards,
        "samples": usable,
        "objects": objects(shards, cfg.shard_size),
        "gpu_hours": round(gpu_hours, 1),
        "node_hours": round(gpu_hours / GPUS_PER_NODE, 1),
        **extra,
    }


def _human(b: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"):
        if b < 1000 or unit == "YB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1000
    return ""


def _hours(h: float) -> str:
    return f"{h:g}" if h >= 0.1 or h == 0 else f"{h:.2g}"  # a small figure keeps its digits: never "0"


def report(p: dict) -> str:
    """The plan as text: the source, then a line per member, then the totals."""
    src = p["source"]
    lines = [
        f"source: {src['type']}" + (f" {src['path']}" if src["type"] != "synthetic" else ""),
        f"entries: {p['entries']} in {p['shards']} shards of {p['shard_size']} (sampled {p['sampled']}, "
        f"{p['sampled_unusable']} unusable; unusable entries take no space)",
        f"latent grids (h x w) met: {', '.join(f'{h}x{w}' for h, w in p['latent_grids'])}; cache dtype "
        f"{p['dtype']}, latents {p['latents']}"
        + (
            f", {p['rollout']['latent_frames']} latent frames (world steps {p['rollout']['world_steps']})"
            if "rollout" in p
            else ""
        ),
        "bytes per sample (tar member with header):",
    ]
    for name, b in p["bytes_per_sample"].items():
        if b:
            lines.append(f"  {name:<12} {_human(b):>10}   x {p['samples']} = {_human(b * p['samples'])}")
    lines.append(f"  {'total':<12} {_human(p['bytes_per_sample_total']):>10}")
    lines.append(f"total for the whole source: {_human(p['bytes_total'])} ({p['bytes_total']} bytes)")
    if "urls" in p:
        u = p["urls"]
        rows = f"{p['entries']} rows" + (
            f" (extrapolated from a table of {u['table_rows']})" if p["entries"] > u["table_rows"] else ""
        )
        lines.append(
            f"download (img2dataset, measured on {p['sampled']} rows): {rows}, {u['usable_share']:.1%} usable = "
            f"{p['samples']} samples; staging folder {_human(u['staging_bytes'])}"
        )
    lines.append(
        f"objects: {p['objects']} ({p['shards']} shards x {OBJECTS_PER_SHARD}: tar, sidecar, error file; plus "
        f"manifest.json, errors.jsonl, precompute.json, the shard table and a shard-index part per "
        f"{cf.PART_SAMPLES} samples; a "
        "cache in a bucket adds one shard-records object per precompute process)"
    )
    if "rollout" in p:
        r = p["rollout"]
        where = "included in the GPU time below" if r["device"] == "GPU" else "not in the GPU time below"
        lines.append(
            f"rollouts: {r['transformer_passes_per_sample']} transformer passes per sample, {r['tflops_per_sample']:g} "
            f"TFLOP = {r['seconds_per_sample']:g} s per sample on a {r['device']}, {_hours(r['hours'])} "
            f"{r['device']}-hours for {p['samples']} samples ({r['basis']}; {where})"
        )
    lines.append(
        f"encode time: {p['gpu_hours']:g} GPU-hours = {p['node_hours']:g} node-hours on {GPUS_PER_NODE}-GPU nodes at "
        f"{IMAGES_PER_S_PER_GPU} images/s per GPU (measured: H100, 512 px, real Wan 2.1 VAE; docs/performance.md)"
    )
    return "\n".join(lines)
