"""Checkpoint benchmark: how long a save holds the training loop, gathered vs sharded vs asynchronous.

    python -m tools.speed_checkpoint [--json] [--steps 6] [--samples 64] [--model heavy|tiny]

Three runs of stage 3 (vision and language train; the speed_train `heavy` Gemma 3, 4 layers of hidden 256) under
FSDP on two CPU processes (gloo; tools/ranks.py: each a fork of a process that imported train.loop once, with
the environment accelerate's launch gives it), saving after every step, side by side in one run:
  gathered  train.checkpoint.sharded: false, every tensor gathered to the main process, which writes it alone
  sharded   each process writes its own shard through torch.distributed.checkpoint
  async     the same shards copied to host memory and written in the background (train.checkpoint.async)
and per layout the mean time a save held the loop (metrics.jsonl's `checkpoint_s`; the run's last save, after the
last log line, is not counted) and how many times less than the gathered save that is. Target: async >= 5x less.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

from tools import ranks
from tools.speed_train import BENCH_ROOT, _gemma_path, ensure_cache

LAYOUTS = {
    "gathered": {"train.checkpoint.sharded": "false"},
    "sharded": {},
    "async": {"train.checkpoint.async": "true"},
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cache: Path, gemma: str, out: Path, steps: int, extra: dict) -> list[float]:
    """One two-process run; the seconds each logged save held the loop."""
    sets = {
        "cache_dir": cache,
        "output_dir": out,
        "model.gemma": gemma,
        "model.dtype": "float32",
        "image.resolution": 128,
        "freeze.vision": "false",
        "freeze.language": "false",
        "train.hardware.sharding": "fsdp",
        "train.max_steps": steps,
        "train.global_batch_size": 4,
        "train.eval.samples": 4,
        "train.eval.every": 0,
        "train.eval.captions": 0,
        "train.loader.num_workers": 0,
        "train.logging.every": 1,
        "train.checkpoint.every": 1,
        "train.checkpoint.keep_last": 2,
        "trackers": "[]",
        **extra,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "THEWORLD_LOG_LEVEL": "warning"}
    done = ranks.run("train.loop", args, env, Path.cwd(), _port())
    if done.returncode:
        raise SystemExit(f"error: the {out.name} run failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m["checkpoint_s"] for m in lines if "checkpoint_s" in m]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools.speed_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="the figures as one JSON object on stdout")
    p.add_argument("--steps", type=int, default=6, help="steps per run, a save after each (default 6)")
    p.add_argument("--samples", type=int, default=64, help="samples in the benchmark cache (default 64)")
    p.add_argument(
        "--model", choices=("heavy", "tiny"), default="heavy", help="the Gemma 3 (default heavy; tiny: a smoke run)"
    )
    args = p.parse_args(argv)
    gemma = _gemma_path(args.model)
    cache = ensure_cache(BENCH_ROOT, args.model, gemma, 128, args.samples)
    saves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in LAYOUTS.items():
            saves[name] = run(cache, gemma, Path(tmp) / name, args.steps, extra)
    block = {name: statistics.mean(s) for name, s in saves.items()}
    result = {
        "block_s": block,
        "saves": {name: len(s) for name, s in saves.items()},
        "less_than_gathered": {name: block["gathered"] / b for name, b in block.items()},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"time a save holds the loop: stage 3 ({args.model} Gemma 3), FSDP on 2 CPU processes, mean over saves")
    print(f"{'layout':10} {'block_s':>9} {'saves':>6} {'x less than gathered':>21}")
    for name in LAYOUTS:
        print(f"{name:10} {block[name]:9.4f} {len(saves[name]):6d} {result['less_than_gathered'][name]:21.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
