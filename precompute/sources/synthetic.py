"""Synthetic scenes: index 0..num_samples-1, key "synthetic-<seed>-<index:08d>" (the index *is* the identity)."""

from __future__ import annotations

import io

from precompute.sources.listing import Entry, Listing, Loaded
from theworld.embedded import synthetic


class SyntheticListing(Listing):
    def __init__(self, seed: int, num_samples: int, resolution: int):
        self.seed, self.n, self.resolution, self.duplicates = seed, num_samples, resolution, {}

    def __len__(self) -> int:
        return self.n

    def _raw(self, lo: int, hi: int) -> list[Entry]:
        return [
            Entry(
                key=f"synthetic-{self.seed}-{i:08d}",
                source=f"synthetic:{i}",
                prompt=synthetic.PROMPT,
                loc=(self.seed, i),
            )
            for i in range(lo, hi)
        ]

    def _load(self, entry: Entry) -> Loaded:
        img, caption = synthetic.scene(*entry.loc, size=self.resolution)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return Loaded(buf.getvalue(), caption, entry.prompt, {})
