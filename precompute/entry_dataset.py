"""The precompute loader's worker side: listing entries -> uint8 pixels (+ Gemma pixel values, the kept image bytes),
or the reason an entry failed; `collate` stacks a batch's good samples per input shape. Used by the precompute run,
its `--plan` sizing and its benchmark."""

from __future__ import annotations

import io

import torch
from torch.utils.data import Dataset

from precompute import sources
from precompute.config import PrecomputeConfig
from theworld import cache_format as cf
from theworld.core.errors import one_line
from theworld.model import images


class EntryDataset(Dataset):
    """Items by global source position; entries are built one cache shard at a time from the listing (in the worker
    that reads them), so no process holds more than a shard's worth of Entry objects."""

    def __init__(self, listing: sources.Listing, cfg: PrecomputeConfig, image_processor=None):
        self.listing = listing
        self.cfg, self.image_processor = cfg, image_processor
        self._shard, self._entries = -1, []

    def __len__(self) -> int:
        return len(self.listing)

    def _entry(self, pos: int) -> sources.Entry:
        shard = pos // self.cfg.shard_size
        if shard != self._shard:  # batches arrive in shard order, so each shard is built once per worker
            lo = shard * self.cfg.shard_size
            self._shard, self._entries = shard, self.listing.entries(lo, lo + self.cfg.shard_size)
        return self._entries[pos - self._shard * self.cfg.shard_size]

    def __getitem__(self, pos: int) -> dict:
        e = self._entry(pos)
        item = {"pos": pos, "error": e.error, "key": e.key, "source": e.source}
        if e.error is None:
            try:
                item.update(self._prepare(e))
            except (images.BadImage, sources.SourceError) as err:
                item["error"] = one_line(err)
            except (OSError, UnicodeDecodeError) as err:
                item["error"] = f"cannot read: {type(err).__name__}: {one_line(err)}"
        return item

    def _prepare(self, e: sources.Entry) -> dict:
        data, caption, prompt, source_meta = self.listing.load(e)
        meta = {"prompt": prompt, "source": e.source, "flip": self.cfg.cache.flip, **source_meta}
        pixels, geometry = images.load_for_vae(data, self.cfg.image.resolution, self.cfg.image.resize)
        meta.update(geometry)
        out = {"pixels": pixels, "caption": caption, "meta": meta}
        if self.cfg.cache.images or self.image_processor is not None:
            img = None
            if cf.image_bytes_hint(data) is None:  # bmp/tiff/gif...: keep what the VAE saw, full size, as PNG
                img = images.decode(data)  # (the same pixels on a live decode)
                buf = io.BytesIO()
                img.save(buf, format="PNG")
                data = buf.getvalue()
            if self.cfg.cache.images:
                out["image"] = data
            if self.image_processor is not None:  # SigLIP sees the whole upright picture, as Gemma's processor does
                img = img or images.decode(data)
                out["pixel_values"] = images.siglip_pixels(self.image_processor, img)
        return out


def collate(batch: list[dict]) -> dict:
    """In the loader worker: the good samples' pixels (and SigLIP inputs) stacked into one tensor per input shape, so
    the pin-memory thread pins one buffer per shape and the copy to the GPU is asynchronous. (Stacking in the main
    process made one pageable tensor out of many pinned ones: a synchronous copy, after paying for the pinning.)

    "pixels" is [(positions among the good samples, (n, 3, H, W) uint8)], one entry per aspect-ratio bucket."""
    good = [b for b in batch if b["error"] is None]
    out = {"items": batch, "pixels": []}
    if good and "pixel_values" in good[0]:
        out["pixel_values"] = torch.stack([b.pop("pixel_values") for b in good])
    for shape in sorted({tuple(b["pixels"].shape) for b in good}):
        rows = [j for j, b in enumerate(good) if tuple(b["pixels"].shape) == shape]
        out["pixels"].append((torch.tensor(rows), torch.stack([good[j]["pixels"] for j in rows])))
    for b in good:
        del b["pixels"]
    return out
