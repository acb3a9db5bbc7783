"""tools/speed_index.py: its synthetic index opens as a cache and its figures are consistent, at tiny sizes, so the
benchmark cannot rot (timings are checked for sanity, not speed)."""

from __future__ import annotations

from theworld import cache_format as cf
from theworld.cache_format import index
from tools.speed_index import PER_SHARD, _write, run


def test_the_synthetic_index_opens_as_a_cache_with_distinct_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "PART_SAMPLES", 2 * PER_SHARD)
    _write(tmp_path / "c", 3)
    reader = cf.CacheReader(tmp_path / "c")
    assert len(reader) == 3 * PER_SHARD and reader.manifest["num_shards"] == 3
    assert len(set(reader._index.keys().tolist())) == 3 * PER_SHARD and reader.shard_of(2 * PER_SHARD) == 2


def test_the_figures_show_the_narrow_part_and_the_lazy_open(monkeypatch):
    r = run(3, 2, order_shards=5)
    p = r["part"]
    # DataComp-style 32-byte keys and 3 members: 32 + 3 x 16 spans + 3 x 8 crc32 + 16 shape bytes as first written;
    # 32 + 3 x 8 + 3 x 4 narrow, plus the safetensors header
    assert (p["members"], p["key_bytes"], p["wide_per_sample"]) == (3, 32, 120.0)
    assert 68 <= p["narrow_part_per_sample"] < 70 and 2 < p["table_per_sample"] < 3
    assert (r["lazy"]["samples"], r["whole"]["samples"]) == (3 * PER_SHARD, 2 * PER_SHARD)
    assert r["lazy"]["open_held_mb"] < r["whole"]["open_held_mb"]
    assert r["datacomp"]["narrow_index_gb"] < r["datacomp"]["wide_index_gb"]
    # the held-out split: the same from the candidates (no part loaded) as by the full pass (every part loaded)
    s = r["split"]
    assert (s["candidates_parts_loaded"], s["full_pass_parts_loaded"]) == (0, 1)
    # times are figures here, not behaviour: at 3 shards either may be the faster (the first pays first-time costs)
    assert s["candidates_s"] > 0 and s["full_pass_s"] > 0 and r["sha256_per_million_s"] > 0
    assert 250 < p["candidates_per_part_kb"] < 300  # 4,096 x (32-byte digest, 8-byte index, 32-byte key)
    # one process's windowed order: the same indices at its positions alone, without arrays over every sample
    o = r["order"]
    assert o["samples"] == 3 * PER_SHARD and o["share"] == (3 * PER_SHARD - 256) // 256 * 32
    assert o["windowed_peak_mb"] < o["every_peak_mb"] / 4 and o["windowed_s"] > 0
    f = r["full_size_order"]
    assert (f["shards"], f["share"]) == (5, (5 * PER_SHARD - 256) // 256 * 32) and f["s"] > 0
