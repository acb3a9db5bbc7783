"""tools/speed_generate.py: a smoke run at tiny sizes, so the benchmark cannot rot. Figures are checked for
sanity, not speed: speed targets live in the benchmark's own output (docs/performance.md)."""

from __future__ import annotations

import pytest

from tests.conftest import bench_json, positive


@pytest.mark.slow
def test_generate_bench_smoke(tmp_path):
    out = bench_json(["tools.speed_generate", "--new-tokens", "4", "--repeats", "1"], tmp_path)
    rows = {r["case"]: r for r in out["rows"]}
    assert set(rows) == {"cache", "no_cache"}
    for r in rows.values():
        positive(r, "t1_ms", "t4_ms", "ratio")
        assert r["new_tokens"] == 4 and r["prefix_tokens"] > 64  # world tokens, image tokens, prompt
        assert abs(r["ratio"] - r["t4_ms"] / r["t1_ms"]) < 0.01 + 0.01 * r["ratio"]  # (the times are rounded)


@pytest.mark.slow
def test_generate_bench_real_path_at_toy_sizes(tmp_path):
    """The GPU comparison (our loop vs Gemma's generate, text-only; our loop on the fused prefix) runs on CPU."""
    out = bench_json(
        ["tools.speed_generate", "--real", "--sizes", "tiny", "--new-tokens", "3", "--repeats", "1"], tmp_path
    )
    rows = {r["case"]: r for r in out["rows"]}
    positive(rows["text_only"], "ours_tokens_per_s", "gemma_generate_tokens_per_s", "ours_over_gemma")
    positive(rows["fused_prefix"], "ours_tokens_per_s")
    assert rows["fused_prefix"]["prefix_tokens"] > rows["text_only"]["prompt_tokens"]
