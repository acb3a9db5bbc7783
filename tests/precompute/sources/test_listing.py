"""precompute/sources/listing.py: the listing every source gives (source.num_samples counts usable entries, the split
across ranks, a source path of the wrong kind). Moved from tests/test_sources.py."""

from __future__ import annotations

import json

from precompute import cosmos_latents, pipeline, sources
from precompute.sources.listing import Truncated
from precompute.sources.synthetic import SyntheticListing
from tests._precompute_helpers import cli_args, gradient, jpeg_bytes, make_cfg, read_cache_plain
from tests._source_helpers import chat_item, txt_folder
from theworld import cache_format as cf
from theworld.core import atomic


def test_num_samples_keeps_the_first_n_usable_entries_of_any_source(tmp_path):
    src = tmp_path / "src"
    txt_folder(src, 5)
    lines = [
        "{bad",
        json.dumps({"image": "img000.png", "caption": "a"}),
        json.dumps({"image": "x.png"}),
        json.dumps({"image": "img001.png", "caption": "b"}),
        json.dumps({"image": "img002.png", "caption": "c"}),
    ]
    (src / "captions.jsonl").write_text("\n".join(lines))
    listing = sources.open_listing("folder", str(src), 2, 0, "p", index_dir=tmp_path / "i")
    assert [(e.key, e.error is None) for e in listing.entries(0, 10)] == [
        ("line-1", False),
        ("img000_png", True),
        ("line-3", False),
        ("img001_png", True),
    ]
    from tests._precompute_helpers import wds_source

    wds_source(tmp_path / "w", tars=3, per_tar=2, no_caption=(0, 1))
    listing = sources.open_listing("webdataset", str(tmp_path / "w"), 3, 0, "p", index_dir=tmp_path / "j")
    assert [e.key for e in listing.entries(0, 10)] == ["000000000", "000000001", "000010000", "000010001"]
    assert len(sources.open_listing("webdataset", str(tmp_path / "w"), 100, 0, "p", index_dir=tmp_path / "j")) == 6


def test_num_samples_counts_what_loads_in_every_source(tmp_path, fake_vae, monkeypatch):
    """Rows without image bytes, missing or empty captions, control strings, zero-byte or non-image files are not
    counted: N usable entries give N samples (pixel decoding aside); the cut is recorded and reused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    img = jpeg_bytes(gradient(20, 20))
    images = [None, img, b"", img, b"not an image", img, img, img]
    captions = ["a", "b", "c", " ", "e", "f <end_of_turn>", "g", "h"]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "caption": captions}), tmp_path / "p.parquet")
    out = tmp_path / "c"
    result = pipeline.run(make_cfg(out, "source.type=parquet", f"source.path={tmp_path}/p.parquet", n=2))
    assert result["num_samples"] == 2 and result["num_errors"] == 5  # rows 1 and 6 kept; 0, 2-5 recorded
    assert list(read_cache_plain(out)) == ["p-000000001", "p-000000006"]
    # a folder: an image without its .txt, a blank caption, a zero-byte image
    src = tmp_path / "src"
    txt_folder(src, 6)
    (src / "img000.txt").unlink()
    (src / "img001.txt").write_text("  ")
    (src / "img002.png").write_bytes(b"")
    listing = sources.open_listing("folder", str(src), 2, 0, "p", index_dir=tmp_path / "i")
    assert len(listing) == 5  # img003 and img004
    loads = []
    monkeypatch.setattr(sources.Listing, "usable", lambda self, e: loads.append(e) or True)
    again = sources.open_listing("folder", str(src), 2, 0, "p", index_dir=tmp_path / "i")
    assert len(again) == 5 and loads == []  # the recorded cut


def test_llava_and_parquet_listings_split_across_ranks(tmp_path):
    """Two ranks (threads meeting at a barrier): rank 0 writes the listing once, both read the same order."""
    import threading

    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "chat.json").write_text(json.dumps([chat_item(i) for i in range(5)] + [chat_item(2)]))
    img = jpeg_bytes(gradient(20, 20))
    pq.write_table(
        pa.table(
            {"uid": ["a", "b", "a", "c"], "image": pa.array([img] * 4, pa.binary()), "text": ["1", "2", "3", "4"]}
        ),
        tmp_path / "p.parquet",
        row_group_size=2,
    )
    for kind, path in (("llava", tmp_path / "chat.json"), ("parquet", tmp_path / "p.parquet")):
        reference = sources.list_entries(kind, str(path), None, 0, "p")
        listings, barrier, writes = {}, threading.Barrier(2), []
        real = cf.atomic_write_bytes  # every listing file goes through it (atomic_write_json included)
        recording = lambda p, data: (writes.append((threading.current_thread().name, p.name)), real(p, data))[1]
        atomic.write_bytes = cf.atomic_write_bytes = cf.layout.atomic_write_bytes = recording
        try:

            def rank(r: int) -> None:
                listings[r] = sources.open_listing(
                    kind,
                    str(path),
                    None,
                    0,
                    "p",
                    index_dir=tmp_path / f"idx-{kind}",
                    rank=r,
                    world=2,
                    barrier=barrier.wait,
                )

            threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
            [t.start() for t in threads], [t.join() for t in threads]
        finally:
            atomic.write_bytes = cf.atomic_write_bytes = cf.layout.atomic_write_bytes = real
        assert writes and all(name == "rank0" for name, _ in writes)
        assert sum(e.error is not None for e in reference) == 1
        for listing in listings.values():
            assert [(e.key, e.source, e.error) for e in listing.entries(0, 10)] == [
                (e.key, e.source, e.error) for e in reference
            ]


def test_a_source_path_of_the_wrong_kind_is_named(tmp_path, capsys):
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    for kind, path, words in [
        ("folder", tmp_path / "f.txt", "is a file, not a folder"),
        ("llava", tmp_path, "is a folder, not a file"),
        ("folder", tmp_path / "loop1", f"folder not found: {tmp_path / 'loop1'} (a symlink loop)"),
        ("folder", tmp_path / ("x" * 5000), "(File name too long)"),
    ]:
        assert cosmos_latents.main(cli_args(tmp_path / "c", f"source.type={kind}", f"source.path={path}")) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err


def test_num_samples_cut_meets_the_barrier_on_every_rank_even_when_the_record_exists(tmp_path):
    """Rank 1 starting after rank 0 wrote num_samples.json used to skip the barrier, so it ran one collective ahead
    (into shard writing before rank 0 had made errors/)."""
    calls = {0: 0, 1: 0}

    def barrier_for(rank):
        def barrier():
            calls[rank] += 1

        return barrier

    inner = SyntheticListing(0, 10, 16)
    first = Truncated(inner, 4, tmp_path, rank=0, barrier=barrier_for(0))
    late = Truncated(inner, 4, tmp_path, rank=1, barrier=barrier_for(1))
    assert (tmp_path / Truncated.RECORD).is_file()
    assert calls == {0: 1, 1: 1}
    assert len(first) == len(late) == 4
    rerun = Truncated(inner, 4, tmp_path, rank=0, barrier=barrier_for(0))  # a rerun reads the record, still meets it
    assert len(rerun) == 4 and calls[0] == 2
