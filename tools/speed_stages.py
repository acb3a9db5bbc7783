"""Stages 3 and 4 at real size on one GPU: peak memory and samples/s, plain and with FSDP host offload.

    python -m tools.speed_stages [--configs configs/real/stage3.yaml,configs/real/stage4.yaml] [--modes plain,offload]
                                 [--steps 3] [--micro-batch N] [--json] [--fork]

Each row runs in a process of its own (a clean peak, an out-of-memory that ends only its row): the trainer's own
optimisation step (`train.step.optimization_step` on `train.components.build`'s components, one process) on the config's
architecture with random weights (`tools.memory_plan.build_world`: no download), on synthetic micro-batches that carry
live pixels for each encoder that trains. `plain` is one unsharded process, everything on the GPU; `offload` is
`train.hardware.sharding: fsdp` with `train.hardware.cpu_offload: true`. Each row has samples/s over the timed steps
(after one warm-up step), the peak GPU memory (`max_memory_allocated`; on a CPU, none), the peak host memory of the
process, and tools.memory_plan's estimate for the same mode next to them. Any config runs: `configs/stage3.yaml` (the
tiny models) is the CPU smoke test."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from theworld.model.arch import latent_side
from tools import ranks
from tools.speed_real import text_inputs

MODES = {"plain": [], "offload": ["train.hardware.sharding=fsdp", "train.hardware.cpu_offload=true"]}
MEMORY_MODE = {"plain": "ddp", "offload": "fsdp_offload"}  # tools.memory_plan's column for each (one GPU)


def micro_batch(model, cfg, b: int):
    """A micro-batch of the shapes a training run feeds: cached latents and SigLIP features for frozen encoders,
    live uint8 images (VAE) and normalised pixels (SigLIP) for the ones that train."""
    from train.data.batches import Batch

    gc = model.gemma.config
    mm = gc.mm_tokens_per_image
    g = torch.Generator().manual_seed(0)
    x = text_inputs(b, mm, gc.boi_token_index, gc.image_token_index, gc.eoi_token_index, g)
    r = cfg.image.resolution
    if not cfg.freeze.vae:
        x = x.with_inputs(images=torch.randint(0, 256, (b, 3, r, r), dtype=torch.uint8, generator=g))
    else:
        z = model.world_encoder.vae.config.z_dim
        mean = torch.randn(b, z, 1, latent_side(r), latent_side(r), generator=g)
        x = x.with_inputs(latent_mean=mean, latent_logvar=torch.randn(mean.shape, generator=g) - 4)
    if not cfg.freeze.vision:
        side = gc.vision_config.image_size
        x = x.with_inputs(pixel_values=torch.rand(b, 3, side, side, generator=g) * 2 - 1)
    else:
        x = x.with_inputs(siglip=torch.randn(b, mm, gc.get_text_config().hidden_size, generator=g))
    return Batch.of(x)  # b * ANSWER_TOKENS answer tokens


def _host_peak() -> int | None:
    try:
        return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    except (OSError, IndexError):
        return None


def row(config: str, mode: str, steps: int, micro: int | None) -> dict:
    """One (config, mode) row, in this process."""
    from theworld.core.config import load_config
    from tools import memory_plan as memory
    from train import components
    from train.config import TrainConfig
    from train.step import LoopState, optimization_step

    sets = [
        "trackers=[]",
        f"output_dir={tempfile.mkdtemp(prefix='bench_stages-')}",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
        *MODES[mode],
    ]
    cfg = load_config(TrainConfig, config, sets)
    micro = micro or load_config(TrainConfig, config).train.max_micro_batch_size
    cfg.train.global_batch_size = cfg.train.micro_batch_size = micro
    out = {
        "case": "stage_step",
        "config": config,
        "mode": mode,
        "micro_batch": micro,
        "mixed_precision": cfg.train.hardware.mixed_precision,
        "gradient_checkpointing": cfg.train.hardware.activation_checkpointing.mode != "none",
        "activation_checkpointing": vars(cfg.train.hardware.activation_checkpointing),
    }
    plan = memory.estimate(cfg, 1, 80.0)
    out["estimate_gpu_gib"] = round(plan["per_gpu_bytes"][MEMORY_MODE[mode]]["total"] / 2**30, 2)
    if mode == "offload":
        out["estimate_host_gib"] = round(plan["host_bytes_per_process"]["fsdp_offload"] / 2**30, 2)
    accelerator = components.make_accelerator(cfg)
    model = components.ready_for_training(memory.build_world(cfg, "cpu"), cfg)
    device = accelerator.device
    try:
        c = components.build(cfg, accelerator, 1, built=(model, None))
        batch, state, times = micro_batch(c.raw, cfg, micro), LoopState(), []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps + 1):  # the first step (allocations, lazy initialisation) is not timed
            t = time.perf_counter()
            optimization_step(c, state, [batch])
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError:
        return {**out, "error": "out of memory"}
    step_s = sum(times[1:]) / steps
    out.update(
        sharding=c.sharding,
        step_s=round(step_s, 3),
        samples_per_s=round(micro / step_s, 3),
        loss_finite=state.last_loss is not None,
    )
    if device.type == "cuda":
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["device"] = torch.cuda.get_device_name()
    peak = _host_peak()
    out["peak_host_gib"] = round(peak / 2**30, 2) if peak else None
    return out


def _unloadable(config: str) -> str | None:
    """Why `config` cannot be read as a training config (one line), or None."""
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from train.config import TrainConfig

    try:
        load_config(TrainConfig, config)
    except UserError as e:
        return f"error: {e}"
    return None


def _error_row(config: str, mode: str, error: str) -> dict:
    return {"case": "stage_step", "config": config, "mode": mode, "error": error[:300]}


def _row_process(config: str, mode: str, args: argparse.Namespace) -> dict:
    """One row in a process of its own: its figures, or its last stderr line as the reason it could not run."""
    row_args = ["--row", config, mode, "--steps", str(args.steps), "--micro-batch", str(args.micro_batch)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.fork:
        r = ranks.call("tools.speed_stages", row_args, env, Path.cwd())
    else:
        r = subprocess.run(
            [sys.executable, "-m", "tools.speed_stages", *row_args], capture_output=True, text=True, env=env
        )
    lines = r.stdout.strip().splitlines()
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    return _error_row(config, mode, (r.stderr.strip().splitlines() or ["no output"])[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.speed_stages", description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="configs/real/stage3.yaml,configs/real/stage4.yaml")
    p.add_argument("--modes", default="plain,offload", help="comma-separated: plain, offload")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=0, help="0: the config's train.max_micro_batch_size")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--fork",
        action="store_true",
        help="each row a process forked from tools/ranks.py's server, which imported the commands once (a smoke run: "
        "no interpreter start per row; its peak host memory leaves out the ~0.1 GiB of imports only the server read)",
    )
    p.add_argument("--row", nargs=2, metavar=("CONFIG", "MODE"), help=argparse.SUPPRESS)  # one row, in this process
    args = p.parse_args(argv)
    if args.row:
        print(json.dumps(row(*args.row, args.steps, args.micro_batch or None)))
        return 0
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or args.steps < 1:
        p.error(f"--modes takes {', '.join(MODES)}; --steps must be >= 1")
    rows = []
    for config in args.configs.split(","):
        unloadable = _unloadable(config)  # no process started only to fail at reading its config
        for mode in modes:
            rows.append(_error_row(config, mode, unloadable) if unloadable else _row_process(config, mode, args))
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
