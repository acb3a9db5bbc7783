"""train/data/order.py's length grouping (train.loader.group_by_length): a pure function of (seed, epoch, step) that
keeps each window's samples, puts similar lengths (and one modality) together, splits over processes as the plain
order does and resumes at any step."""

from __future__ import annotations

import numpy as np

from train.data.order import LengthGroups, epoch_batches, rank_indices

TRAIN = np.arange(1000, 1480)  # reader indices of the training samples
RNG = np.random.default_rng(0)
LENGTHS = np.zeros(1500, dtype=np.int64)
LENGTHS[TRAIN] = np.minimum(RNG.lognormal(5.5, 0.8, size=len(TRAIN)).astype(np.int64) + 40, 4000)
IMAGES = np.zeros(1500, dtype=np.int64)
IMAGES[TRAIN] = RNG.choice([0, 1, 2], size=len(TRAIN), p=[0.3, 0.6, 0.1])
GROUPS = LengthGroups(LENGTHS, IMAGES, window=16)


def _padding(batches: np.ndarray) -> float:
    """The share of padding when each global batch is padded to its longest sample."""
    lengths = LENGTHS[batches]
    return 1 - lengths.sum() / (lengths.max(1).sum() * batches.shape[1])


def test_grouped_batches_keep_each_windows_samples_and_put_similar_lengths_together():
    buckets = RNG.choice(2, size=len(TRAIN), p=[0.8, 0.2])
    for epoch in (0, 1):
        plain = epoch_batches(TRAIN, 3, epoch, 8, buckets)
        grouped = epoch_batches(TRAIN, 3, epoch, 8, buckets, GROUPS)
        assert grouped.shape == plain.shape
        assert np.array_equal(grouped, epoch_batches(TRAIN, 3, epoch, 8, buckets, GROUPS))  # deterministic
        of = buckets[grouped - 1000]
        assert (of == of[:, :1]).all()  # still one bucket a batch
        for k in (0, 1):  # each window of a bucket's batches holds the plain order's samples
            mine, theirs = grouped[of[:, 0] == k], plain[buckets[plain[:, 0] - 1000] == k]
            for lo in range(0, len(mine), GROUPS.window):
                assert set(mine[lo : lo + GROUPS.window].ravel()) == set(theirs[lo : lo + GROUPS.window].ravel())
        assert _padding(grouped) < 0.6 * _padding(plain)
        # modality first: a batch of images and no images only where a window's modality changes
        mixed = (IMAGES[grouped].min(1) != IMAGES[grouped].max(1)).mean()
        assert mixed < 0.5 * (IMAGES[plain].min(1) != IMAGES[plain].max(1)).mean()
    assert not np.array_equal(epoch_batches(TRAIN, 3, 0, 8, None, GROUPS), epoch_batches(TRAIN, 3, 1, 8, None, GROUPS))


def test_grouped_order_splits_over_processes_and_resumes_at_any_step():
    grouped = epoch_batches(TRAIN, 5, 2, 8, None, GROUPS)
    for world in (1, 2, 4):
        shares = [rank_indices(TRAIN, 5, 2, 8, r, world, 0, None, GROUPS).reshape(-1, 8 // world) for r in range(world)]
        assert np.array_equal(np.concatenate(shares, axis=1), grouped)  # 1 process == N processes
        for start in (0, 7, 31):  # resuming at step `start` reads what the uninterrupted run reads there
            tail = rank_indices(TRAIN, 5, 2, 8, world - 1, world, start, None, GROUPS)
            assert np.array_equal(tail, shares[-1][start:].ravel())
    # within a global batch, longest first within each modality: a process's micro-batches hold similar lengths
    sort_key = IMAGES[grouped] * 10_000 - LENGTHS[grouped]
    assert (np.diff(sort_key, axis=1) >= 0).all()
