"""train/data/loader.py: the start-of-run text passes (train.loader.max_length's truncation report,
train.loader.group_by_length's lengths) read every sample's text of a cache held whole, and none of a large one (read
a part at a time: theworld/cache_format/sample_index.py), whose lengths come from its shard table and whose report
reads a seeded draw of its training samples."""

from __future__ import annotations

import numpy as np

from tests.conftest import base_args
from theworld.cache_format import sample_index


def _context(cache, tmp_path, monkeypatch, lazy: bool):
    from transformers import AutoProcessor

    from theworld.core.config import load_config
    from theworld.model.encoders import resolve_gemma
    from train.config import TrainConfig
    from train.data import cache as data
    from train.data import loader

    if lazy:
        monkeypatch.setattr(sample_index, "LAZY_BYTES", 0)
    sets = ["train.loader.group_by_length=true", "train.loader.max_length=40"]
    cfg = load_config(TrainConfig, None, [a for a in base_args(cache, tmp_path / "run") if a != "--set"] + sets)
    reader, plan = data.open_cache(cfg)
    reads = []
    raw = reader.raw
    monkeypatch.setattr(reader, "raw", lambda i: reads.append(i) or raw(i))  # counts the tar reads
    monkeypatch.setattr(loader, "TEXT_SAMPLE", 10)
    ctx = loader.DataContext.build(cfg, reader, plan, AutoProcessor.from_pretrained(resolve_gemma("tiny")))
    return reader, ctx, reads


def test_a_large_cache_groups_by_its_index_text_bytes_and_reports_truncation_from_a_draw(cache, tmp_path, monkeypatch):
    reader, ctx, reads = _context(cache, tmp_path, monkeypatch, lazy=True)
    assert reader.lazy and len(ctx.train_indices) == 80
    # 10 training samples read for the report, and the first sample's check: not one read per sample
    assert len(reads) == 11 and set(reads[1:]) <= set(ctx.train_indices.tolist())
    assert "of 10 training samples (a draw from the 80 of this cache" in ctx.truncation
    np.testing.assert_array_equal(ctx.groups.lengths, reader.text_bytes())
    assert ctx.groups.images.tolist() == [1] * len(reader)
    sizes = [sum(len(v) for k, v in raw.items() if k in ("txt", "json")) for raw in map(reader.raw, range(5))]
    assert ctx.groups.lengths[:5].tolist() == sizes  # what the caption and json members hold


def test_a_cache_held_whole_reads_every_text_as_before(cache, tmp_path, monkeypatch):
    reader, ctx, reads = _context(cache, tmp_path, monkeypatch, lazy=False)
    assert not reader.lazy and len(reads) >= 80 + len(reader)  # the report's pass and the lengths' pass
    assert ctx.truncation.endswith("of 80 training samples") and ctx.groups.images.max() >= 1
