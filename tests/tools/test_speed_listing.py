"""tools/speed_listing.py: its source and its in-process measurement at tiny sizes, so the benchmark cannot rot (the
timings are checked for sanity, not speed)."""

from __future__ import annotations

from tools.speed_listing import make_source, measure


def test_the_listing_benchmark_lists_every_entry_of_its_source_and_reuses_it(tmp_path):
    pattern = make_source(tmp_path / "wds", tars=3, per_tar=4)
    assert pattern == f"{tmp_path / 'wds'}/{{00000..00002}}.tar" and len(list((tmp_path / "wds").glob("*.tar"))) == 3
    before = (tmp_path / "wds" / "00000.tar").stat().st_mtime_ns
    assert make_source(tmp_path / "wds", tars=3, per_tar=4) == pattern  # a rerun keeps the tars it built
    assert (tmp_path / "wds" / "00000.tar").stat().st_mtime_ns == before
    first = measure(pattern, str(tmp_path / "index"), shard_size=4)
    again = measure(pattern, str(tmp_path / "index"), shard_size=4)  # the index reused
    for row in (first, again):
        assert row["entries"] == 12 and row["listing_s"] >= 0 and row["shard_entries_ms"] >= 0, row
    assert any((tmp_path / "index").iterdir())
