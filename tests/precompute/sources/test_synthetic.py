"""The synthetic listing: the index is the identity (its key), entries clip at the end, a load is a PNG scene."""

from __future__ import annotations

import io

from PIL import Image

from precompute.sources.synthetic import SyntheticListing
from theworld.embedded import synthetic


def test_keys_name_the_seed_and_the_index_and_a_range_stops_at_the_end():
    listing = SyntheticListing(seed=7, num_samples=5, resolution=16)
    assert len(listing) == 5
    entries = listing.entries(3, 10)
    assert [e.key for e in entries] == ["synthetic-7-00000003", "synthetic-7-00000004"]
    assert [e.source for e in entries] == ["synthetic:3", "synthetic:4"]
    assert all(e.prompt == synthetic.PROMPT and e.error is None for e in entries)
    assert listing.entries(5, 8) == []


def test_a_load_is_the_scene_of_its_seed_and_index_as_png_at_the_resolution():
    listing = SyntheticListing(seed=1, num_samples=3, resolution=24)
    a, b = listing.entries(0, 2)
    image, caption, prompt, meta = listing.load(b)
    img = Image.open(io.BytesIO(image))
    assert img.format == "PNG" and img.size == (24, 24) and meta == {} and prompt == synthetic.PROMPT
    want_img, want_caption = synthetic.scene(1, 1, size=24)
    assert caption == want_caption and img.convert("RGB").tobytes() == want_img.convert("RGB").tobytes()
    assert listing.load(b) == listing.load(b) and listing.load(a).image != image


def test_another_seed_gives_other_keys_and_scenes():
    one, two = SyntheticListing(1, 2, 16), SyntheticListing(2, 2, 16)
    assert one.entries(0, 1)[0].key != two.entries(0, 1)[0].key
    assert one.load(one.entries(0, 1)[0]).image != two.load(two.entries(0, 1)[0]).image
