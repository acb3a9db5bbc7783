"""theworld/cache_format/held_out.py: the held-out split is a pure function of the sample keys (the eval_samples keys
with the smallest sha256), whatever the order of the samples in the cache."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from theworld.cache_format.held_out import split
from theworld.core.errors import UserError


class _Keys:  # what split reads of a CacheReader
    def __init__(self, keys: list[str]):
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, i: int) -> str:
        return self.keys[i]


def test_the_held_out_keys_are_those_with_the_smallest_sha256_in_any_layout():
    keys = [f"sample-{i:03d}" for i in range(50)]
    expected = sorted(sorted(keys, key=lambda k: hashlib.sha256(k.encode()).digest())[:7])
    for order in range(3):
        shuffled = keys[:]
        random.Random(order).shuffle(shuffled)
        train, held = split(_Keys(shuffled), 7)
        assert [shuffled[i] for i in held] == expected  # in key order
        assert list(train) == [i for i in range(50) if shuffled[i] not in expected]  # in cache order
        assert train.dtype == held.dtype == np.int64


def test_holding_out_every_sample_is_one_line():
    with pytest.raises(
        UserError, match=r"^config key 'train.eval.samples': 5 leaves nothing to train on \(5 samples\)$"
    ):
        split(_Keys([f"k{i}" for i in range(5)]), 5)
