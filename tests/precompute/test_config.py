"""precompute/config.py: the precompute config's defaults and checks."""

from __future__ import annotations


def test_the_shipped_demo_size_belongs_to_the_synthetic_source_only():
    from precompute.config import load
    from tests.conftest import ROOT

    shipped = ROOT / "configs" / "precompute.yaml"
    assert load(str(shipped)).source.num_samples == 4096  # the demo is unchanged
    other = load(str(shipped), ["source.type=parquet", "source.path=x.parquet"])
    assert other.source.num_samples is None  # every row, as the docs say, not the demo's 4096
