"""The windowed shard order (cache_shuffle_window, train/data/order.py): a pure function of (seed, epoch) that reads
a window of shards at a time, so exact resume and 1 process == N hold as for the global order."""

from __future__ import annotations

import numpy as np
import pytest

from train.data.order import epoch_batches, epoch_order, rank_indices

SHARDS = np.repeat(np.arange(40), 25)  # 40 shards of 25 samples
TRAIN = np.arange(1000)[np.arange(1000) % 7 != 3]  # some samples held out


def test_windowed_order_reads_a_window_of_shards_at_a_time_and_is_a_pure_function_of_seed_and_epoch():
    shards = SHARDS[TRAIN]
    for epoch in range(3):
        order = epoch_order(TRAIN, 5, epoch, shards, window=4)
        assert sorted(order.tolist()) == TRAIN.tolist()  # every training sample once
        assert np.array_equal(order, epoch_order(TRAIN, 5, epoch, shards, window=4))
        # consecutive blocks of the order are whole windows: 4 shards' samples each, none seen before or after
        seen, pos = set(), 0
        while pos < len(order):
            window: set[int] = set()
            block = []
            while pos < len(order) and (len(window) < 4 or SHARDS[order[pos]] in window):
                window.add(int(SHARDS[order[pos]]))
                block.append(int(order[pos]))
                pos += 1
            assert not window & seen
            seen |= window
            assert sorted(block) == [i for i in TRAIN.tolist() if SHARDS[i] in window]
        # shuffled within the window, not shard after shard
        assert (np.diff(SHARDS[order[:80]]) != 0).sum() > 20
    a, b = epoch_order(TRAIN, 5, 0, shards, 4), epoch_order(TRAIN, 5, 1, shards, 4)
    assert not np.array_equal(a, b) and not np.array_equal(a, epoch_order(TRAIN, 6, 0, shards, 4))
    # window 0 is the global order of earlier releases
    assert np.array_equal(epoch_order(TRAIN, 5, 0, shards, 0), epoch_order(TRAIN, 5, 0))


@pytest.mark.parametrize("window", [1, 4, 64])
def test_windowed_order_one_process_equals_n_and_resumes_exactly(window):
    shards = SHARDS[TRAIN]
    one = rank_indices(TRAIN, 7, 2, 16, 0, 1, shards=shards, window=window)
    for n in (2, 4):
        parts = [
            rank_indices(TRAIN, 7, 2, 16, r, n, shards=shards, window=window).reshape(-1, 16 // n) for r in range(n)
        ]
        assert np.array_equal(np.concatenate(parts, axis=1).reshape(-1), one)
    tail = rank_indices(TRAIN, 7, 2, 16, 1, 2, start_batch=5, shards=shards, window=window)
    full = rank_indices(TRAIN, 7, 2, 16, 1, 2, shards=shards, window=window)
    assert np.array_equal(tail, full[5 * 8 :])
    batches = epoch_batches(TRAIN, 7, 2, 16, shards=shards, window=window)
    assert np.array_equal(batches.reshape(-1), one)
    # the batches walk the windowed order (one latent shape: batch b is order[b*G:(b+1)*G])
    order = epoch_order(TRAIN, 7, 2, shards, window)
    assert np.array_equal(one, order[: len(one)])


def test_a_window_of_shards_downloads_a_cache_4x_the_shard_budget_about_once():
    """An LRU shard cache of 10 shards (a quarter of the 40): the windowed order (window 4) fetches each shard once
    per epoch, the global order nearly once per sample."""

    def fetches(order: np.ndarray, budget: int) -> int:
        cache: dict[int, int] = {}
        n = 0
        for t, i in enumerate(order.tolist()):
            s = int(SHARDS[i])
            if s not in cache:
                n += 1
                if len(cache) >= budget:
                    del cache[min(cache, key=cache.get)]
            cache[s] = t
        return n

    shards = SHARDS[TRAIN]
    assert fetches(epoch_order(TRAIN, 1, 0, shards, window=4), 10) == 40
    assert fetches(epoch_order(TRAIN, 1, 0), 10) > 400


def test_cache_shuffle_window_is_a_config_key_that_leaves_earlier_runs_hashes_alone():
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from train.config import TrainConfig, run_hash

    base = load_config(TrainConfig, None, [])
    assert run_hash(load_config(TrainConfig, None, ["cache_shuffle_window=0"])) == run_hash(base)
    assert run_hash(load_config(TrainConfig, None, ["cache_prefetch_shards=5"])) == run_hash(base)  # neutral
    assert run_hash(load_config(TrainConfig, None, ["cache_shuffle_window=8"])) != run_hash(base)  # other numbers
    with pytest.raises(UserError, match="config key 'cache_shuffle_window': must be >= 0, got -1"):
        load_config(TrainConfig, None, ["cache_shuffle_window=-1"])
