"""precompute/sources/webdataset.py: WebDataset / img2dataset tar shards (keys repeated inside a tar, a folder of tars).
Moved from tests/test_sources.py."""

from __future__ import annotations

from tests._precompute_helpers import gradient, jpeg_bytes
from tests._source_helpers import listing_of, write_tar


def test_a_key_repeated_inside_one_tar_keeps_the_first_sample(tmp_path):
    img = jpeg_bytes(gradient(20, 20))
    tar = write_tar(
        tmp_path / "00000.tar",
        [
            ("a", "jpg", img),
            ("a", "txt", b"first a"),
            ("b", "jpg", img),
            ("b", "txt", b"b"),
            ("a", "jpg", img),
            ("a", "txt", b"second a"),
            ("c", "jpg", img),
            ("c", "txt", b"c1"),
            ("c", "txt", b"c2"),
        ],
    )
    listing = listing_of("webdataset", tar, tmp_path)
    entries = listing.entries(0, len(listing))
    assert [(e.source, e.error) for e in entries] == [
        ("00000.tar:a", None),
        ("00000.tar:b", None),
        ("00000.tar:a", "duplicate key: 'a' (first used by 00000.tar:a)"),
        ("00000.tar:c", None),
        ("00000.tar:c", "duplicate key: 'c' (first used by 00000.tar:c)"),
    ]
    assert listing.load(entries[0]).caption == "first a" and listing.load(entries[3]).caption == "c1"
    # webdataset's own reader starts a new sample where the key changes, as the listing does (a member repeated
    # within a sample, like c.txt above, is an error there)
    import webdataset as wds

    tar = write_tar(
        tmp_path / "00001.tar",
        [
            ("a", "jpg", img),
            ("a", "txt", b"first a"),
            ("b", "jpg", img),
            ("b", "txt", b"b"),
            ("a", "jpg", img),
            ("a", "txt", b"second a"),
        ],
    )
    assert [s["txt"] for s in wds.WebDataset(str(tar), shardshuffle=False)] == [b"first a", b"b", b"second a"]


def test_webdataset_path_may_be_a_folder_of_tars(tmp_path):
    from tests._precompute_helpers import wds_source

    wds_source(tmp_path / "w", tars=3, per_tar=2)
    (tmp_path / "w" / "notes.txt").write_text("not a shard")
    listing = listing_of("webdataset", tmp_path / "w", tmp_path)
    assert [e.source for e in listing.entries(0, 6)] == [
        f"{j:05d}.tar:{j:05d}{i:04d}" for j in range(3) for i in range(2)
    ]
