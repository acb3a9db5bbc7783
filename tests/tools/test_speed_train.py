"""tools/speed_train.py: a smoke run at tiny sizes, so the benchmark cannot rot. Figures are checked for
sanity, not speed: speed targets live in the benchmark's own output (docs/performance.md). Batches of 4 (--batch) let
the caches be small and the steps short: the training steps and precomputing the caches are a smoke run's time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import bench_json, positive


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path]:
    """One run of the three tiny cases (rows and the caches' root), shared by the smoke tests: one step per block, two
    rounds, one torch thread (an xdist worker's count, and the caches' precompute's: tiny tensors gain nothing from a
    second, which spins)."""
    tmp = tmp_path_factory.mktemp("speed_train")
    args = ["--steps", "1", "--warmup", "1", "--rounds", "2", "--batch", "4", "--samples", "48", "--threads", "1"]
    out = bench_json(
        ["tools.speed_train", "--cases", "tiny,tiny_s3,tiny_buckets", *args, "--root", str(tmp / "caches")], tmp
    )
    return {r["case"]: r for r in out["rows"]}, tmp / "caches"


@pytest.mark.slow
def test_train_bench_smoke(smoke):
    rows, caches = smoke
    row, s3 = rows["tiny"], rows["tiny_s3"]
    # the same cache read from an S3 server on 127.0.0.1 (one cache built: tiny_s3 reads tiny's)
    assert s3["case"] == "tiny_s3" and s3["data_overhead"] > 0 and s3["loader_samples_per_s"] > 0
    assert sorted(p.name for p in caches.iterdir()) == [
        "tiny-64px-48",
        "tiny_buckets-96px-48",
        "tiny_buckets-source-96px-48",
    ]
    positive(
        row,
        "step_ms_staged",
        "step_ms_fed",
        "data_overhead",
        "step_ms_live_encoding",
        "cache_speedup",
        "loader_samples_per_s",
        "loader_vs_training",
        "rss_mb_epoch1_start",
        "rss_mb_epoch2_end",
    )
    assert row["world_tokens"] == 64 and row["steps_per_block"] == 1 and row["rounds"] == 2 and row["global_batch"] == 4
    assert len(row["data_overhead_round_quartiles"]) == 3 and all(r > 0 for r in row["data_overhead_round_quartiles"])
    assert 0 <= row["padding_fraction"] < 0.5
    lo, hi = row["data_overhead_ci95"]
    assert 0 < lo <= row["data_overhead"] <= hi


def test_round_quartiles_stay_inside_the_rounds_measured():
    from tools.speed_train import round_quartiles

    assert round_quartiles([1.0, 6.0]) == [2.25, 3.5, 4.75]  # the default method: [-0.25, 3.5, 7.25]
    assert round_quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == [2.0, 3.0, 4.0]


def test_data_overhead_interval_brackets_the_true_ratio():
    import numpy as np

    from tools.speed_train import _ratio_ci95

    staged = list(np.linspace(0.1, 0.2, 50))
    assert _ratio_ci95([1.1 * t for t in staged], staged) == [1.1, 1.1]  # no noise: no width
    rng = np.random.default_rng(1)
    noisy_staged = 0.1 * (1 + 0.07 * rng.standard_normal(400))
    noisy_fed = 0.104 * (1 + 0.07 * rng.standard_normal(400))
    lo, hi = _ratio_ci95(list(noisy_fed), list(noisy_staged))
    assert lo < 1.04 < hi and hi - lo < 0.03


@pytest.mark.slow
def test_train_bench_bucketed_smoke(smoke):
    row = smoke[0]["tiny_buckets"]
    positive(
        row,
        "step_ms_staged",
        "step_ms_fed",
        "data_overhead",
        "step_ms_live_encoding",
        "loader_samples_per_s",
        "rss_mb_epoch1_start",
        "rss_mb_epoch2_end",
    )
    # 96 px buckets: latent grids 8x16 (128 tokens), 12x12 (144), 16x8 (128), a quarter of the images square
    assert row["latent_shapes"] == 3 and 128 < row["world_tokens"] < 144
    assert 0 <= row["padding_fraction"] < 0.5
