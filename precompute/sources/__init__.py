"""Sources: a fixed, documented order of entries, each with a stable key taken from the source (never a position).

Each source is a `Listing`, one module each (synthetic, folder, webdataset, llava, parquet, urls, hf): `len(listing)`
entries in the source's order, `listing.entries(lo, hi)` builds the `Entry` objects of one range (one cache shard) on
demand, so memory follows shard_size, not dataset size, and `listing.load(entry)` returns the entry's (image bytes,
caption, prompt, meta).
Shard i of the cache = entries [i*S, (i+1)*S) of the order, so the order must never depend on the machine. An entry
already known to be unusable (a bad caption line, a missing member, a duplicate key) stays in the order as an error
entry, so each shard's errors are a deterministic function of the source. `load` runs in DataLoader workers.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from precompute.config import SourceConfig
from precompute.sources.content import SourceError
from precompute.sources.folder import IMAGE_SUFFIXES, folder_listing, image_paths, walk_images
from precompute.sources.hf import hf_listing
from precompute.sources.listing import Entry, Listing, Loaded, Truncated
from precompute.sources.llava import LlavaListing
from precompute.sources.parquet import ParquetListing
from precompute.sources.synthetic import SyntheticListing
from precompute.sources.urls import UrlsListing
from precompute.sources.webdataset import WebdatasetListing

__all__ = [
    "Entry",
    "IMAGE_SUFFIXES",
    "Listing",
    "Loaded",
    "SourceError",
    "image_paths",
    "list_entries",
    "open_listing",
    "open_source",
    "walk_images",
]


def open_listing(
    source_type: str,
    path: str | None,
    num_samples: int | None,
    seed: int,
    prompt: str,
    *,
    index_dir: Path,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
    resolution: int = 64,
    image_root: str | None = None,
    columns: dict | None = None,
) -> Listing:
    """The source's order; webdataset, parquet and llava sources are indexed into `index_dir` by all processes
    together (a collective call). `num_samples` is the synthetic source's size, and for the others the number of
    usable entries to keep (None or 0: all; `Truncated` says what counts as usable). `columns`: parquet's
    {image, caption, prompt} column names."""
    if source_type == "synthetic":
        return SyntheticListing(seed, num_samples, resolution)
    if source_type == "folder":
        listing = folder_listing(path, prompt, index_dir, rank)
    elif source_type == "llava":
        listing = LlavaListing(path, image_root, index_dir, rank, barrier)
    elif source_type == "parquet":
        listing = ParquetListing(
            path, prompt, index_dir, columns or dict.fromkeys(("image", "caption", "prompt")), rank, barrier
        )
    else:
        listing = WebdatasetListing(path, prompt, index_dir, rank, world, barrier)
    return Truncated(listing, num_samples, index_dir, rank, barrier) if num_samples else listing


def open_source(source: SourceConfig, seed: int, resolution: int, staging: Path | None = None, **collective) -> Listing:
    """`open_listing` for a config's `source` section (`collective`: index_dir, rank, world, barrier). A urls source
    is staged into `staging` (default: source.staging_dir, else a `staging` folder beside index_dir)."""
    columns = {"image": source.image_column, "caption": source.caption_column, "prompt": source.prompt_column}
    if source.type == "hf":
        index_dir = Path(collective["index_dir"])
        rank, barrier = collective.get("rank", 0), collective.get("barrier", lambda: None)
        listing = hf_listing(
            source.name,
            source.split or "train",
            bool(source.streaming),
            source.num_samples,
            source.prompt,
            index_dir,
            columns,
            rank,
            barrier,
        )
        return Truncated(listing, source.num_samples, index_dir, rank, barrier) if source.num_samples else listing
    if source.type == "urls":
        index_dir = Path(collective["index_dir"])
        return UrlsListing(
            source.path,
            source.prompt,
            index_dir,
            staging or (Path(source.staging_dir) if source.staging_dir else index_dir.parent / "staging"),
            {"url": source.url_column, "caption": source.caption_column, "id_": source.id_column},
            source.img2dataset,
            source.num_samples,
            rank=collective.get("rank", 0),
            barrier=collective.get("barrier", lambda: None),
        )
    return open_listing(
        source.type,
        source.path,
        source.num_samples,
        seed,
        source.prompt,
        resolution=resolution,
        image_root=source.image_root,
        columns=columns,
        **collective,
    )


def list_entries(source_type: str, path: str | None, num_samples: int | None, seed: int, prompt: str) -> list[Entry]:
    """Every entry of the source at once (tests, small sources); precompute itself uses `open_listing`.
    A webdataset source is indexed into a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        listing = open_listing(source_type, path, num_samples, seed, prompt, index_dir=Path(tmp))
        return listing.entries(0, len(listing))
