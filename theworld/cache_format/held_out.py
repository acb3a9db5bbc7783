"""The held-out split of a cache: the samples the trainer evaluates on and never trains on, which inference
(`theworld.evaluate --task caption --data CACHE_DIR`) scores too. A pure function of the sample keys, so it does not
depend on the shard layout, the number of processes or the run.
"""

from __future__ import annotations

import hashlib

import numpy as np

from theworld.cache_format.reader import CacheReader
from theworld.core.errors import UserError


def split(reader: CacheReader, eval_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, eval indices): the eval_samples keys with the smallest sha256 are held out. Train indices in
    cache order, eval indices in key order."""
    n = len(reader)
    check_held_out(eval_samples, n)
    ranked = sorted(range(n), key=lambda i: hashlib.sha256(reader.key(i).encode()).digest())
    held = np.array(sorted(ranked[:eval_samples], key=reader.key), dtype=np.int64)
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep).astype(np.int64), held


def check_held_out(eval_samples: int, num_samples: int) -> None:
    if eval_samples >= num_samples:
        raise UserError(
            f"config key 'train.eval.samples': {eval_samples} leaves nothing to train on ({num_samples} samples)"
        )
