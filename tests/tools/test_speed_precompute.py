"""tools/speed_precompute.py: a smoke run at tiny sizes, so the benchmark cannot rot. Figures are checked for
sanity, not speed: speed targets live in the benchmark's own output (docs/performance.md)."""

from __future__ import annotations

import pytest

from tests.conftest import bench_json, positive


@pytest.mark.slow
def test_precompute_bench_smoke(tmp_path):
    rows = {r["case"]: r for r in bench_json(["tools.speed_precompute", "--n", "64"], tmp_path)["rows"]}
    assert set(rows) == {"tiny", "jpeg256", "jpeg_draft_decode", "real_size_format", "real_size_format_no_images"}
    for case in ("tiny", "jpeg256"):
        positive(
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
    positive(rows["jpeg_draft_decode"], "full_ms", "draft_ms", "speedup")
