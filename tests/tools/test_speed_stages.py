"""tools/speed_stages.py: a smoke run at tiny sizes, so the benchmark cannot rot. Figures are checked for
sanity, not speed: speed targets live in the benchmark's own output (docs/performance.md)."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, bench_json, positive


@pytest.mark.slow
def test_stage_bench_rows_at_tiny_sizes(tmp_path):
    """The one-GPU stage 3/4 benchmark's code path (the trainer's own step, plain and FSDP-offloaded, one process per
    row, forked: no interpreter start each) on the tiny stage-3 config; a row that cannot run is recorded with its
    reason instead of ending the run."""
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
            "--fork",
        ],
        tmp_path,
    )
    assert [(r["config"], r["mode"]) for r in rows] == [
        (c, m) for c in (stage3, str(tmp_path / "missing.yaml")) for m in ("plain", "offload")
    ]
    plain, offload = rows[0], rows[1]
    for r in (plain, offload):
        assert "error" not in r and r["loss_finite"] and r["micro_batch"] == 2
        positive(r, "samples_per_s", "estimate_gpu_gib", "peak_host_gib")
    assert plain["sharding"] == "sharding ddp (1 process)"
    assert "over 1 process(es); parameters, gradients and optimizer state offloaded" in offload["sharding"]
    positive(offload, "estimate_host_gib")
    assert all("missing.yaml" in r["error"] for r in rows[2:])
