"""The precompute loader's worker side: an entry becomes VAE pixels (and kept image bytes), or the one-line reason
it failed; `collate` stacks the good samples per input shape."""

from __future__ import annotations

import io

import torch
from PIL import Image

from precompute.entry_dataset import EntryDataset, collate
from precompute.sources.listing import Entry, Listing, Loaded
from tests._precompute_helpers import make_cfg, png_bytes


def _picture(w: int, h: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 90)).save(buf, format=fmt)
    return buf.getvalue()


class _Listing(Listing):
    """Entries whose loc is the image bytes; an entry whose loc is an exception raises it on load."""

    def __init__(self, items: list):
        self.items, self.duplicates, self.built = items, {}, []

    def __len__(self) -> int:
        return len(self.items)

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        self.built.append((lo, hi))
        return [
            Entry(f"k{i}", f"s{i}", error=x if isinstance(x, str) else None, loc=(x,))
            for i, x in zip(range(lo, hi), self.items[lo:hi])
        ]

    def _load(self, entry: Entry) -> Loaded:
        if isinstance(entry.loc[0], BaseException):
            raise entry.loc[0]
        return Loaded(entry.loc[0], f"caption of {entry.key}", "the prompt", {"url": entry.source})


def test_a_good_entry_is_its_pixels_caption_meta_and_kept_bytes(tmp_path):
    png = png_bytes(Image.new("RGB", (40, 40), (10, 20, 30)))
    ds = EntryDataset(_Listing([png]), make_cfg(tmp_path, res=32))
    item = ds[0]
    assert item["error"] is None and item["key"] == "k0" and item["caption"] == "caption of k0"
    assert item["pixels"].shape == (3, 32, 32) and item["pixels"].dtype == torch.uint8
    assert item["pixels"][:, 0, 0].tolist() == [10, 20, 30] and item["image"] == png  # PNG kept as it came
    assert item["meta"]["prompt"] == "the prompt" and item["meta"]["url"] == "s0" and item["meta"]["flip"] is False
    assert "pixel_values" not in item
    assert "image" not in EntryDataset(_Listing([png]), make_cfg(tmp_path, "cache.images=false"))[0]


def test_a_bmp_is_kept_as_the_png_of_the_same_pixels(tmp_path):
    item = EntryDataset(_Listing([_picture(32, 32, "BMP")]), make_cfg(tmp_path, res=32))[0]
    kept = Image.open(io.BytesIO(item["image"]))
    assert kept.format == "PNG" and kept.size == (32, 32) and kept.getpixel((0, 0)) == (200, 30, 90)


def test_failures_are_one_line_reasons_and_the_listings_own_errors_pass_through(tmp_path):
    items = [
        "duplicate key k0",
        b"not an image",
        OSError("disk gone\nsecond line"),
        UnicodeDecodeError("utf-8", b"", 0, 1, "x"),
    ]
    ds = EntryDataset(_Listing(items), make_cfg(tmp_path))
    errors = [ds[i]["error"] for i in range(4)]
    assert errors[0] == "duplicate key k0"
    assert errors[1] and "\n" not in errors[1]
    assert errors[2].startswith("cannot read: OSError: disk gone") and "\n" not in errors[2]
    assert errors[3].startswith("cannot read: UnicodeDecodeError")
    assert all("pixels" not in ds[i] for i in range(4))


def test_entries_are_built_once_per_shard_in_the_worker(tmp_path):
    listing = _Listing([_picture(8, 8)] * 5)
    ds = EntryDataset(listing, make_cfg(tmp_path, shard=2))
    assert [ds[i]["key"] for i in (0, 1, 2, 3, 4)] == ["k0", "k1", "k2", "k3", "k4"]
    assert listing.built == [(0, 2), (2, 4), (4, 5)] and len(ds) == 5


def test_collate_stacks_the_good_samples_per_shape_and_keeps_every_item(tmp_path):
    cfg = make_cfg(tmp_path, "image.resize=bucket", res=32)
    ds = EntryDataset(_Listing([_picture(64, 32), b"bad", _picture(32, 32), _picture(64, 32)]), cfg)
    batch = collate([ds[i] for i in range(4)])
    assert [b["key"] for b in batch["items"]] == ["k0", "k1", "k2", "k3"]
    assert all("pixels" not in b for b in batch["items"])
    groups = {tuple(t.shape[1:]): rows.tolist() for rows, t in batch["pixels"]}
    wide = [s for s in groups if s[2] > s[1]]
    assert len(groups) == 2 and groups[wide[0]] == [0, 2] and groups[(3, 32, 32)] == [1]  # positions among the good
    assert "pixel_values" not in batch
    assert collate([ds[1]]) == {"items": [ds[1]], "pixels": []}
