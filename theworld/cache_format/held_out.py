"""The held-out split of a cache: the samples the trainer evaluates on and never trains on, which inference
(`theworld.evaluate --task caption --data CACHE_DIR`) scores too. A pure function of the sample keys, so it does not
depend on the shard layout, the number of processes or the run.

The training samples are the rest, kept as `Kept`: the held-out indices and the cache's size, not an array over every
sample (8 bytes a sample: 11 GB a process at DataComp-1B's 1.4B).

The keys with the smallest sha256 are read from the shard table's candidates (index.Candidates: each index part's
smallest, written with the index), so a cache of any size splits without hashing its keys or loading a part; a cache
written before them, or more eval samples than a part keeps, hash every key once (the full pass, logged).
"""

from __future__ import annotations

import numpy as np

from theworld.cache_format import index
from theworld.cache_format.reader import CacheReader
from theworld.core import log
from theworld.core.errors import UserError

_log = log.get(__name__)
FULL_PASS_CHUNK = 1 << 20  # keys hashed at a time by the full pass: memory bounded by the keys, not their digests


class Kept:
    """The samples [0, n) less the held-out ones, in cache order: indexed (an int, a slice, an array of positions)
    as the int64 array it stands for, without holding it. np.asarray(kept) builds that array, for the orders that need
    one over every sample (a mixture, several latent shapes, length grouping)."""

    dtype, ndim = np.dtype(np.int64), 1

    def __init__(self, n: int, held: np.ndarray):
        self.n, self.held = n, np.unique(np.asarray(held, dtype=np.int64))

    def __len__(self) -> int:
        return self.n - len(self.held)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __iter__(self):
        return iter(np.asarray(self).tolist())

    def __getitem__(self, key):
        if isinstance(key, slice):
            return nth_kept(np.arange(*key.indices(len(self)), dtype=np.int64), self.held)
        key = np.asarray(key)
        positions = np.flatnonzero(key) if key.dtype == bool else key.astype(np.int64)
        if ((positions < -len(self)) | (positions >= len(self))).any():
            raise IndexError(f"index {key} is out of range for {len(self)} training samples")
        kept = nth_kept(positions % max(len(self), 1), self.held)
        return int(kept) if kept.ndim == 0 else kept

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        keep = np.ones(self.n, dtype=bool)
        keep[self.held] = False
        return np.flatnonzero(keep).astype(dtype or np.int64)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


def nth_kept(u: np.ndarray, held: np.ndarray, first: np.ndarray | int = 0) -> np.ndarray:
    """The u-th sample (from 0) at or after `first` that is not in `held` (sorted): the fixed point of counting the
    held-out samples up to a guess and stepping over them."""
    x = first + u
    while True:
        nxt = first + u + np.searchsorted(held, x, side="right") - np.searchsorted(held, first)
        if np.array_equal(nxt, x):
            return x
        x = nxt


def split(reader: CacheReader, eval_samples: int) -> tuple[Kept, np.ndarray]:
    """(train indices, eval indices): the eval_samples keys with the smallest sha256 are held out. Train indices in
    cache order (`Kept`), eval indices in key order."""
    return split_parts([reader], eval_samples)


def split_parts(readers: list[CacheReader], eval_samples: int) -> tuple[Kept, np.ndarray]:
    """`split` of the caches of one dataset read as one (their samples one after another): the eval_samples keys of
    smallest sha256 among all of theirs, as one cache of the same samples holds them out, found among each one's own
    smallest."""
    offsets = np.cumsum([0] + [len(r) for r in readers])
    check_held_out(eval_samples, int(offsets[-1]))
    found = [_smallest(r, min(eval_samples, len(r))) for r in readers]
    held = np.concatenate([np.asarray(i, dtype=np.int64) + o for (i, _), o in zip(found, offsets.tolist())])
    keys = np.concatenate([np.asarray(k) for _, k in found])
    pick = index.smallest(index.key_digests(keys), eval_samples)
    held, keys = held[pick], keys[pick]
    held = held[np.argsort(keys, kind="stable")]
    return Kept(int(offsets[-1]), held), held


def _smallest(reader: CacheReader, eval_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample indices, keys) of the eval_samples smallest sha256(key), from the candidates where they hold them."""
    c = reader.held_out_candidates()
    if c is not None and eval_samples <= c.per_part:
        return np.asarray(c.index[:eval_samples]), np.asarray(c.keys[:eval_samples])
    n = len(reader)
    why = (
        "no held-out candidates in this cache's shard table (written before them; a cache written now has them)"
        if c is None
        else f"train.eval.samples {eval_samples} is above the {c.per_part} candidates a part of its shard table keeps"
    )
    _log.info(f"cache {reader.cache_dir}: hashing {n:,} keys for the held-out split: {why}")
    return _full_pass(reader.key_array(), eval_samples)


def _full_pass(keys: np.ndarray, eval_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """The smallest over every key: each chunk's, joined as the index joins its parts' candidates."""
    starts = np.arange(0, len(keys), FULL_PASS_CHUNK)
    chunks = [index.Candidates.of(keys[lo : lo + FULL_PASS_CHUNK], eval_samples) for lo in starts.tolist()]
    c = index.Candidates.join(chunks, starts)
    return c.index[:eval_samples], c.keys[:eval_samples]


def check_held_out(eval_samples: int, num_samples: int) -> None:
    if eval_samples >= num_samples:
        raise UserError(
            f"config key 'train.eval.samples': {eval_samples} leaves nothing to train on ({num_samples} samples)"
        )
