"""precompute.sizing: `--plan`'s rollout time is for the device precompute uses here, measured or stated, and never
a rounded "0 hours"."""

from __future__ import annotations

import torch

from precompute import sizing
from tests._precompute_helpers import make_cfg

ROLL = ["world.num_world_steps=1", "world.rollout.inference_steps=1", "batch_size=4"]


def test_a_small_rollout_is_timed_on_this_machines_device_and_kept_apart_from_gpu_time(tmp_path):
    plain = sizing.estimate(make_cfg(tmp_path / "c", n=6))
    plan = sizing.estimate(make_cfg(tmp_path / "c", *ROLL, n=6))
    r = plan["rollout"]
    device = "GPU" if torch.cuda.is_available() else "CPU"
    assert r["device"] == device and r["basis"].startswith("measured") and r["seconds_per_sample"] > 0
    assert r["hours"] > 0 and abs(r["hours"] - r["seconds_per_sample"] * plan["samples"] / 3600) <= 0.01 * r["hours"]
    line = next(ln for ln in sizing.report(plan).splitlines() if ln.startswith("rollouts:"))
    assert f"on a {device}, " in line and f" {device}-hours for 6 samples" in line and " 0 " not in line, line
    if device == "CPU":  # CPU time is not GPU time
        assert plan["gpu_hours"] == plain["gpu_hours"] and "not in the GPU time below" in line


def test_a_large_rollout_without_a_gpu_is_priced_at_this_cpus_measured_rate_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = make_cfg(__import__("pathlib").Path("/nonexistent"), "world.num_world_steps=2", n=4)
    flops = 900e12
    seconds, device, basis = sizing.rollout_seconds(cfg, flops, (64, 64))
    assert device == "CPU" and "ESTIMATE, no GPU here" in basis and "GFLOP/s" in basis
    assert seconds > flops / sizing.ASSUMED_GPU_FLOPS * 10  # a CPU is not priced at an H100's rate
