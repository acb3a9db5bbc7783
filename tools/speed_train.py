"""Training benchmark: is everything but the model's own compute close to free?

    python -m tools.speed_train [--json] [--cases tiny,heavy] [--steps 1] [--rounds N] [--threads N] [--workers N]
                                [--samples N] [--batch N]

Per case, all measured side by side in one run, on the same batches:
  data_overhead         steady-state step time fed by the real cache loader (workers, collation, copies) / step
                        time on the same batches already staged in memory. Target <= 1.05. Single steps,
                        staged and fed alternately, on one loader; data_overhead_ci95 is a bootstrap interval
                        over those pairs (this VM's steps scatter, so one ratio means little without it).
  cache_speedup         step time with live VAE + SigLIP encoding (frozen, as the reference run did) / step time
                        from the cache, same model, both on staged batches.
  loader_samples_per_s  the cache loader alone, and how many times faster it is than training consumes samples.
  rss_mb                memory (PSS of the main process + loader workers) early in an epoch and at its last batch,
                        for two epochs: it must not grow with the number of samples read.
  padding_fraction      padding positions / positions the model computes (world + text) over an epoch: the
                        most that length-aware batching could save.
The tiny_s3 case is the tiny one reading the same cache from an S3 server (moto's, started on 127.0.0.1 in this
process: `--cases tiny,tiny_s3` puts the two side by side), its shards staged into an empty shard cache as they are
first read.
The tiny_buckets case is the tiny one on an aspect-ratio bucketed cache (image.resize: bucket at 96 px: latent grids
8x16, 12x12, 16x8; synthetic scenes stretched to 2:1, 1:1, 1:2 and 4:3), so the world-token count changes from batch
to batch. Caches are built once with the precompute command (train/ does not import precompute/; a process forked
from tools/ranks.py's server) under cache/bench/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import torch

from theworld import cache_format as cf
from theworld.cache_format.settings import DEFAULT_LOCAL_DIR
from theworld.core import atomic
from theworld.core.config import load_config
from theworld.embedded import synthetic, tiny
from tools import ranks
from tools.threads import add_threads, apply_threads
from train import components
from train.config import TrainConfig
from train.data import cache as data
from train.data import loader as data_loader
from train.data import order
from train.step import LoopState, optimization_step

BENCH_ROOT = Path("cache/bench")
HEAVY = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    sliding_window=512,
)
CASES = {
    # name: (gemma, resolution, samples, global batch, micro batch, loader workers: one is 8-120x faster than
    # training needs here, and every extra process takes CPU from the 2-core training threads; rounds: a single
    # step on this VM scatters +-7%, so the tiny case takes 150 pairs to pin its mean ratio to about +-1%)
    "tiny": ("tiny", 64, 5120, 32, 32, 1, 150),  # 64 world tokens, the embedded demo's model
    "heavy": ("heavy", 128, 768, 16, 16, 1, 40),  # 256 world tokens, 4 layers of hidden 256
    "tiny_buckets": ("tiny", 96, 5120, 32, 32, 1, 150),  # 128-144 world tokens, three latent shapes
    "tiny_s3": ("tiny", 64, 5120, 32, 32, 1, 150),  # the tiny case's cache read from an S3 server on 127.0.0.1
}
BUCKETED = {"tiny_buckets"}
REMOTE = {"tiny_s3": "tiny"}  # case -> the case whose cache it reads from object storage


def _gemma_path(name: str) -> str:
    if name == "tiny":
        return "tiny"
    path = tiny.models_root() / "bench-heavy-gemma3"
    if not path.exists():
        with atomic.folder(path, lambda tmp: f"no space left on device building the heavy Gemma 3 in {tmp}") as tmp:
            tiny.build_tiny_gemma(tmp, **HEAVY)
    return str(path)


def _bucket_source(out: Path, resolution: int, samples: int) -> Path:
    """A folder source of synthetic scenes stretched to 2:1, 1:1, 1:2 and 4:3 (written once)."""
    if (out / "captions.jsonl").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    sizes = [
        (2 * resolution, resolution),
        (resolution, resolution),
        (resolution, 2 * resolution),
        (4 * resolution // 3, resolution),
    ]
    lines = []
    for i in range(samples):
        img, caption = synthetic.scene(0, i, size=resolution)
        img.resize(sizes[i % len(sizes)]).save(out / f"{i:06d}.png")
        lines.append(json.dumps({"image": f"{i:06d}.png", "caption": caption}))
    atomic.write_text(out / "captions.jsonl", "\n".join(lines) + "\n")
    return out


def ensure_cache(root: Path, case: str, gemma: str, resolution: int, samples: int) -> Path:
    out = Path(root) / f"{case}-{resolution}px-{samples}"
    if not (out / cf.MANIFEST).is_file():
        if case in BUCKETED:
            src = _bucket_source(Path(root) / f"{case}-source-{resolution}px-{samples}", resolution, samples)
            source = ["source.type=folder", f"source.path={src}", "image.resize=bucket"]
        else:
            source = ["source.type=synthetic", f"source.num_samples={samples}"]
        sets = [
            f"output_dir={out}",
            f"model.gemma={gemma}",
            "model.vae=tiny",
            "model.dtype=float32",
            f"image.resolution={resolution}",
            *source,
            "cache.siglip=true",
            "cache.dtype=float32",
            "shard_size=128",
            "num_workers=1",
        ]
        _precompute([a for kv in sets for a in ("--set", kv)])
    return out


def _precompute(args: list[str]) -> None:
    """`python -m precompute.cosmos_latents ARGS` in a process of its own, forked from tools/ranks.py's server (which
    imported the command once: no interpreter start per cache), with this process's environment and torch threads."""
    done = ranks.call("precompute.cosmos_latents", args, dict(os.environ), Path.cwd())
    if done.returncode:
        raise SystemExit(f"error: building a bench cache failed ({done.returncode}):\n{done.stderr[-3000:]}")


@contextlib.contextmanager
def s3_copy(cache: Path) -> Iterator[tuple[str, str]]:
    """(URL, an empty shard cache folder) of `cache` copied into an S3 server (moto's, the dev extra) started on
    127.0.0.1 in this process for the case, reached through the standard AWS environment as a user's would be."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        if fs.exists("bench"):  # moto keeps buckets per process, not per server: an earlier case's, in this process
            fs.rm("bench", recursive=True)
            fs.invalidate_cache()
        if not fs.exists("bench"):
            fs.mkdir("bench")
        for p in sorted(cache.rglob("*")):
            if p.is_file() and not p.name.startswith("."):
                fs.put_file(str(p), f"bench/cache/{p.relative_to(cache)}")
        with tempfile.TemporaryDirectory() as shard_cache:
            yield "s3://bench/cache", shard_cache
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rss_mb() -> float:
    """Memory of this process and its children (the loader workers), as PSS: pages shared after fork count once."""
    me = psutil.Process()
    total = 0
    for p in [me] + me.children(recursive=True):
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total / 2**20


def _steps(c, state, batches, accum) -> list[float]:
    """Per-step seconds of optimization_step over staged micro-batches."""
    times = []
    for i in range(0, len(batches), accum):
        t = time.perf_counter()
        optimization_step(c, state, batches[i : i + accum])
        times.append(time.perf_counter() - t)
    return times


def _fed_steps(c, state, it, n_steps, accum) -> list[float]:
    """Per-step seconds including waiting for and receiving the batches from a loader iterator (the real path)."""
    times = []
    for _ in range(n_steps):
        t = time.perf_counter()
        micro = [next(it) for _ in range(accum)]
        optimization_step(c, state, micro)
        times.append(time.perf_counter() - t)
    return times


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def round_quartiles(ratios: list[float]) -> list[float]:
    """The quartiles of the rounds' ratios, inside the range measured: the default ("exclusive") method extrapolates
    past it with few rounds, to below 0 for two rounds far apart."""
    return [round(q, 3) for q in statistics.quantiles(ratios, n=4, method="inclusive")]


def _ratio_ci95(fed: list[float], staged: list[float], resamples: int = 2000) -> list[float]:
    """95% bootstrap interval of mean(fed) / mean(staged), resampling whole rounds (a round's two sides together)."""
    fed_r, staged_r = np.asarray(fed), np.asarray(staged)
    rounds = len(fed_r)
    pick = np.random.default_rng(0).integers(0, rounds, size=(resamples, rounds))
    ratios = fed_r[pick].mean(axis=1) / staged_r[pick].mean(axis=1)
    return [round(float(q), 3) for q in np.quantile(ratios, [0.025, 0.975])]


def bench_case(
    case: str,
    steps: int = 1,
    warmup: int = 3,
    samples: int | None = None,
    root: Path = BENCH_ROOT,
    rounds: int | None = None,
    workers: int | None = None,
    batch: int | None = None,
) -> dict:
    gemma_name, res, default_samples, gbs, mbs, default_workers, default_rounds = CASES[case]
    gbs, mbs = (batch, batch) if batch else (gbs, mbs)
    rounds = rounds or default_rounds
    workers = default_workers if workers is None else workers
    gemma = _gemma_path(gemma_name)
    cache = ensure_cache(root, REMOTE.get(case, case), gemma, res, samples or default_samples)
    remote = s3_copy(cache) if case in REMOTE else contextlib.nullcontext((str(cache), DEFAULT_LOCAL_DIR))
    with tempfile.TemporaryDirectory() as out, remote as (cache_url, shard_cache):
        cfg = load_config(
            TrainConfig,
            None,
            [
                f"model.gemma={gemma}",
                "model.vae=tiny",
                "model.dtype=float32",
                f"image.resolution={res}",
                f"image.resize={'bucket' if case in BUCKETED else 'crop'}",
                f"cache_dir={cache_url}",
                f"storage.local_dir={shard_cache}",
                f"output_dir={out}",
                "trackers=[]",
                "resume=null",
                "train.eval.samples=16",
                f"train.global_batch_size={gbs}",
                f"train.micro_batch_size={mbs}",
                f"train.loader.num_workers={workers}",
                f"train.max_steps={10 * steps}",
                "train.lr_schedule.warmup_steps=0",
                "train.optimizer.lr=1e-4",
            ],
        )
        reader, inputs = data.open_cache(cfg)
        launch = components.resolve_launch(cfg)
        acc = components.make_accelerator(cfg, launch)
        accum = launch.accum
        c = components.build(cfg, acc, accum)
        ctx = data_loader.DataContext.build(cfg, reader, inputs, c.processor)
        state = LoopState()
        n = warmup + rounds * steps
        per_epoch = order.steps_per_epoch(np.bincount(ctx.buckets[ctx.train_indices]), gbs)
        if n > per_epoch:
            raise SystemExit(
                f"error: {n} steps (warm-up + rounds x steps) do not fit in one epoch of {per_epoch}: "
                "use more --samples or fewer --rounds"
            )
        staged = list(data_loader.build_train_loader(cfg, ctx, 0, 1, epoch=0))[: n * accum]
        # cached path: short staged and loader-fed blocks over the same batches, alternated so that the drift and
        # bursts of a shared machine land on both sides alike. One loader serves every fed block: its worker runs
        # while fed steps run and is idle (its prefetch queue full) while staged steps run, as in a real epoch.
        it = iter(data_loader.build_train_loader(cfg, ctx, 0, 1, epoch=0))
        _fed_steps(c, state, it, warmup, accum)  # worker start, allocator and kernel caches: not steady state
        _steps(c, state, staged[: warmup * accum], accum)
        round_staged, round_fed = [], []  # mean step seconds of each round's two blocks (all of `steps` steps)
        for r in range(rounds):
            lo = (warmup + r * steps) * accum
            round_staged.append(_mean(_steps(c, state, staged[lo : lo + steps * accum], accum)))
            round_fed.append(_mean(_fed_steps(c, state, it, steps, accum)))
        del it
        step_s, fed_s = _mean(round_staged), _mean(round_fed)
        ratios = [f / s for f, s in zip(round_fed, round_staged)]
        # live path, same model and samples: frozen VAE and SigLIP run inside every step
        live_plan = data.InputSources(cached_latents=False, cached_siglip=False, flip=False, members=(cf.IMAGE,))
        live_reader = cf.CacheReader(cfg.cache_dir, members=live_plan.members, settings=cfg.storage)
        live_ctx = data_loader.DataContext(
            live_reader, live_plan, ctx.formatter, ctx.image_processor, ctx.train_indices, ctx.eval_indices, ctx.buckets
        )
        live = list(data_loader.build_train_loader(cfg, live_ctx, 0, 1, epoch=0))[: (warmup + steps) * accum]
        t_live = _steps(c, state, live, accum)[warmup:]
        loader = _loader_and_memory(cfg, ctx, c.raw.projector)
        # world tokens per training sample (one figure for a square cache, the mean over samples with buckets)
        hw = reader.latent_hw[ctx.train_indices]
        world = (hw[:, 0] // c.raw.projector.pool) * (hw[:, 1] // c.raw.projector.pool)
    return {
        "case": case,
        "world_tokens": int(world[0]) if (world == world[0]).all() else round(float(world.mean()), 1),
        "latent_shapes": len(np.unique(hw, axis=0)),
        "hidden": c.raw.gemma.config.text_config.hidden_size,
        "layers": c.raw.gemma.config.text_config.num_hidden_layers,
        "global_batch": gbs,
        "workers": workers,
        "threads": torch.get_num_threads(),
        "steps_per_block": steps,
        "rounds": rounds,
        "step_ms_staged": round(1000 * step_s, 2),
        "step_ms_fed": round(1000 * fed_s, 2),
        "data_overhead": round(fed_s / step_s, 3),
        "data_overhead_ci95": _ratio_ci95(round_fed, round_staged),
        "data_overhead_round_quartiles": round_quartiles(ratios),
        "step_ms_live_encoding": round(1000 * _mean(t_live), 2),
        "cache_speedup": round(_mean(t_live) / step_s, 2),
        "train_samples_per_s": round(gbs / step_s, 1),
        **loader,
        "loader_vs_training": round(loader["loader_samples_per_s"] / (gbs / step_s), 2),
    }


def _loader_and_memory(cfg, ctx, projector) -> dict:
    """The loader alone over two full epochs: samples/s, RSS early in each epoch and at its end, and the share of
    the positions the model computes that are padding (the most length-aware batching could save)."""
    rss, seen, t_total, pad, computed = [], 0, 0.0, 0, 0
    for epoch in range(2):
        loader = data_loader.build_train_loader(cfg, ctx, 0, 1, epoch=epoch)
        it = iter(loader)
        next(it)  # worker start-up is not throughput
        last = len(loader) - 2  # index of the final batch in the loop below: workers still alive
        t = time.perf_counter()
        for i, batch in enumerate(it):
            seen += batch.size
            if i in (1, last):
                rss.append(_rss_mb())
            if epoch == 0:
                inputs = batch.to("cpu")
                mask = inputs.attention_mask
                pad += int(mask.numel() - mask.sum())
                # positions the model computes for the world: its tokens and the two markers around them
                computed += mask.numel() + len(mask) * projector.num_tokens(*inputs.latent_mean.shape[-2:])
        t_total += time.perf_counter() - t
        del it, loader
    return {
        "loader_samples_per_s": round(seen / t_total, 1),
        "rss_mb_epoch1_start": round(rss[0]),
        "rss_mb_epoch1_end": round(rss[1]),
        "rss_mb_epoch2_start": round(rss[2]),
        "rss_mb_epoch2_end": round(rss[3]),
        "rss_growth_mb": round(rss[3] - rss[0], 1),
        "padding_fraction": round(pad / computed, 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.speed_train", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of one line per case")
    p.add_argument("--cases", default="tiny,heavy,tiny_buckets")
    p.add_argument("--steps", type=int, default=1, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first block")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="staged/fed block pairs for data_overhead (default: per case, tiny and tiny_buckets 150, heavy 40)",
    )
    p.add_argument("--samples", type=int, default=None, help="cache size (default: per case)")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch, one micro-batch (default: per case; small ones make a smoke run on a small cache)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="loader worker processes (train.loader.num_workers; default: per case, 1; 0 loads in the training "
        "process, between steps)",
    )
    p.add_argument("--root", default=str(BENCH_ROOT), help="where the bench caches are kept")
    add_threads(
        p,
        "torch threads of the training step (train.hardware.cpu_threads; 0: torch's default). The loader worker needs "
        "a core of its own, as it has next to a GPU: on a 2-core CPU that is --threads 1",
    )
    args = p.parse_args(argv)
    apply_threads(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            print(f"error: unknown case {case!r} (known: {', '.join(CASES)})", file=sys.stderr)
            return 2
        rows.append(
            bench_case(
                case, args.steps, args.warmup, args.samples, Path(args.root), args.rounds, args.workers, args.batch
            )
        )
        if not args.json:
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        print(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
