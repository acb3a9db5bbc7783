"""tools/speed_real.py: a smoke run at tiny sizes, so the benchmark cannot rot. Figures are checked for
sanity, not speed: speed targets live in the benchmark's own output (docs/performance.md)."""

from __future__ import annotations

import pytest

from tests.conftest import bench_json, positive


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
        positive(live, "step_ms", "samples_per_s", "cache_speedup")
        assert live["cache_speedup"] == round(live["step_ms"] / cached["step_ms"], 2)
        assert "cache_speedup" not in cached
    positive(out["rows"][-1], "images_per_s")
    # FLOPs: 2 * params * tokens dominates and grows linearly with the sequence (plus attention's quadratic term)
    assert lm_flops(TINY, 200) > 2 * lm_flops(TINY, 100) > 0
