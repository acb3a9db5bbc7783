"""Smoke runs of both benchmarks at tiny sizes, so they cannot rot. Figures are checked for sanity, not speed:
speed targets live in the benchmarks' own output (docs/performance.md), never in timed tests."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import ROOT, bench_json


def _positive(row: dict, *keys: str) -> None:
    for k in keys:
        assert isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0, (k, row[k])


@pytest.mark.slow
def test_train_bench_smoke(tmp_path):
    rows = bench_json(
        [
            "tools.speed_train",
            "--cases",
            "tiny,tiny_s3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--samples",
            "176",
            "--root",
            str(tmp_path / "caches"),
        ],
        tmp_path,
    )["rows"]
    row, s3 = rows
    # the same cache read from an S3 server on 127.0.0.1 (one cache built: tiny_s3 reads tiny's)
    assert s3["case"] == "tiny_s3" and s3["data_overhead"] > 0 and s3["loader_samples_per_s"] > 0
    assert sorted(p.name for p in (tmp_path / "caches").iterdir()) == ["tiny-64px-176"]
    _positive(
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
    assert row["world_tokens"] == 64 and row["steps_per_block"] == 2 and row["rounds"] == 2
    assert len(row["data_overhead_round_quartiles"]) == 3 and all(r > 0 for r in row["data_overhead_round_quartiles"])
    assert 0 <= row["padding_fraction"] < 0.5
    lo, hi = row["data_overhead_ci95"]
    assert 0 < lo <= row["data_overhead"] <= hi


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
def test_precompute_bench_smoke(tmp_path):
    rows = {r["case"]: r for r in bench_json(["tools.speed_precompute", "--n", "128"], tmp_path)["rows"]}
    assert set(rows) == {"tiny", "jpeg256", "jpeg_draft_decode", "real_size_format", "real_size_format_no_images"}
    for case in ("tiny", "jpeg256"):
        _positive(
            rows[case],
            "pipeline_efficiency",
            "encode_only_images_per_s",
            "pipeline_images_per_s",
            "host_ms_per_image_decode_resize",
            "host_ms_per_image_serialise",
            "bytes_per_sample",
        )
    # the format's own overhead at real size is deterministic (tar headers, safetensors headers, json): <= 5%
    for case in ("real_size_format", "real_size_format_no_images"):
        assert 0 < rows[case]["bytes_overhead"] <= 0.05, rows[case]
    _positive(rows["jpeg_draft_decode"], "full_ms", "draft_ms", "speedup")


@pytest.mark.slow
def test_real_size_bench_code_path_at_toy_sizes(tmp_path):
    """The GPU benchmark's code (model at given sizes, FLOP count, VAE rate) runs end to end at toy sizes on CPU."""
    from theworld.model.arch import TINY
    from tools.speed_real import lm_flops

    out = bench_json(
        [
            "tools.speed_real",
            "--sizes",
            "tiny",
            "--steps",
            "1",
            "--vae-batch",
            "2",
            "--micro-batch",
            "2",
            "--compile",
            "no",
        ],
        tmp_path,
    )
    steps = [r for r in out["rows"] if r["case"] == "stage1_step"]
    assert [(r["pool"], r["gradient_checkpointing"], r["encoding"]) for r in steps] == [
        (pool, ckpt, enc) for pool in (1, 2) for ckpt in (False, True) for enc in ("cached", "live")
    ]
    assert [r["world_tokens"] for r in steps] == [64] * 4 + [16] * 4
    for cached, live in zip(steps[::2], steps[1::2]):
        _positive(live, "step_ms", "samples_per_s", "cache_speedup")
        assert live["cache_speedup"] == round(live["step_ms"] / cached["step_ms"], 2)
        assert "cache_speedup" not in cached
    _positive(out["rows"][-1], "images_per_s")
    # FLOPs: 2 * params * tokens dominates and grows linearly with the sequence (plus attention's quadratic term)
    assert lm_flops(TINY, 200) > 2 * lm_flops(TINY, 100) > 0


@pytest.mark.slow
def test_train_bench_bucketed_smoke(tmp_path):
    rows = bench_json(
        [
            "tools.speed_train",
            "--cases",
            "tiny_buckets",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--samples",
            "192",
            "--root",
            str(tmp_path / "caches"),
        ],
        tmp_path,
    )["rows"]
    (row,) = rows
    _positive(
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


@pytest.mark.slow
def test_generate_bench_smoke(tmp_path):
    out = bench_json(["tools.speed_generate", "--new-tokens", "4", "--repeats", "1"], tmp_path)
    rows = {r["case"]: r for r in out["rows"]}
    assert set(rows) == {"cache", "no_cache"}
    for r in rows.values():
        _positive(r, "t1_ms", "t4_ms", "ratio")
        assert r["new_tokens"] == 4 and r["prefix_tokens"] > 64  # world tokens, image tokens, prompt
        assert abs(r["ratio"] - r["t4_ms"] / r["t1_ms"]) < 0.01 + 0.01 * r["ratio"]  # (the times are rounded)


@pytest.mark.slow
def test_generate_bench_real_path_at_toy_sizes(tmp_path):
    """The GPU comparison (our loop vs Gemma's generate, text-only; our loop on the fused prefix) runs on CPU."""
    out = bench_json(
        ["tools.speed_generate", "--real", "--sizes", "tiny", "--new-tokens", "3", "--repeats", "1"], tmp_path
    )
    rows = {r["case"]: r for r in out["rows"]}
    _positive(rows["text_only"], "ours_tokens_per_s", "gemma_generate_tokens_per_s", "ours_over_gemma")
    _positive(rows["fused_prefix"], "ours_tokens_per_s")
    assert rows["fused_prefix"]["prefix_tokens"] > rows["text_only"]["prompt_tokens"]


@pytest.mark.slow
def test_stage_bench_rows_at_tiny_sizes(tmp_path):
    """The one-GPU stage 3/4 benchmark's code path (the trainer's own step, plain and FSDP-offloaded, one process per
    row) on the tiny stage-3 config; a row that cannot run is recorded with its reason instead of ending the run."""
    stage3 = str(ROOT / "configs" / "stage3.yaml")
    rows = bench_json(
        [
            "tools.speed_stages",
            "--configs",
            f"{stage3},{tmp_path / 'missing.yaml'}",
            "--steps",
            "1",
            "--micro-batch",
            "2",
        ],
        tmp_path,
    )
    assert [(r["config"], r["mode"]) for r in rows] == [
        (c, m) for c in (stage3, str(tmp_path / "missing.yaml")) for m in ("plain", "offload")
    ]
    plain, offload = rows[0], rows[1]
    for r in (plain, offload):
        assert "error" not in r and r["loss_finite"] and r["micro_batch"] == 2
        _positive(r, "samples_per_s", "estimate_gpu_gib", "peak_host_gib")
    assert plain["sharding"] == "sharding ddp (1 process)"
    assert "over 1 process(es); parameters, gradients and optimizer state offloaded" in offload["sharding"]
    _positive(offload, "estimate_host_gib")
    assert all("missing.yaml" in r["error"] for r in rows[2:])


def test_eval_bench_smoke(capsys):
    """tools.speed_eval at toy sizes, in process: both cases score the same items both ways and agree."""
    from tools.speed_eval import main

    assert main(["--json", "--sizes", "tiny", "--items", "2", "--batch", "2", "--repeats", "1"]) == 0
    cases = json.loads(capsys.readouterr().out)["cases"]
    assert set(cases) == {"demo", "real_shaped"}
    for row in cases.values():
        _positive(row, "items_per_s_shared", "items_per_s_unshared", "speedup", "speedup_cpu_time")
        assert row["items"] == 2 and row["choices"] == 4 and row["max_abs_score_diff"] < 1e-4
    assert cases["real_shaped"]["world_tokens"] == 18 and cases["real_shaped"]["image_tokens"] == 4


@pytest.mark.slow
def test_packing_bench_smoke(capsys):
    """tools.speed_packing on 32 conversations: plain and packed train on the same samples and tokens, packing leaves
    less padding than plain, grouping less than plain too; the lengths follow the model of LLaVA-Instruct-150K."""
    from tools.speed_packing import answer_tokens, main

    assert 150 < answer_tokens("detail") < answer_tokens("complex_reasoning") < 250  # from the files' sizes
    assert main(["--json", "--samples", "32", "--micro-batch", "4", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows, shape = out["layouts"], out["shape"]
    assert set(rows) == {"plain", "grouped", "packed", "grouped+packed"} and shape["world_tokens"] == 66
    for row in rows.values():
        _positive(row, "tokens_per_s", "tokens_per_cpu_s", "speedup", "speedup_cpu")
        assert row["samples"] == 32 and row["micro_batches"] == 8
    assert rows["packed"]["real_tokens"] == rows["plain"]["real_tokens"] == rows["grouped"]["real_tokens"]
    assert rows["packed"]["padding_share"] < rows["grouped"]["padding_share"] < rows["plain"]["padding_share"]
    assert shape["text_tokens"]["p10"] < shape["text_tokens"]["p90"] / 2  # a wide spread of lengths


@pytest.mark.parametrize("tool", ["speed_precompute", "speed_train", "speed_eval", "speed_generate", "speed_packing"])
@pytest.mark.parametrize("threads", ["-1", "two"])
def test_a_bad_thread_count_is_one_line_exit_2(tool, threads, capsys):
    """Every speed tool's --threads is tools/threads.py's: a count below 0 is refused before anything runs (torch
    raised a traceback from set_num_threads(-1) before)."""
    import importlib

    main = importlib.import_module(f"tools.{tool}").main
    with pytest.raises(SystemExit) as e:
        main(["--threads", threads])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith(f"tools.{tool}: error: argument --threads"), err
    assert "whole number >= 0" in err[-1] or "invalid" in err[-1]
