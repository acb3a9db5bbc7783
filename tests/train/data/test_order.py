"""train/data/order.py: length grouping (train.loader.group_by_length: keeps each window's samples, puts similar
lengths and one modality together) and the windowed shard order (storage.shuffle_window: a window of shards at a
time); both pure functions of (seed, epoch, step), so 1 process == N and resume at any step hold."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from train.data.mixture import MixedReader
from train.data.order import (
    LengthGroups,
    epoch_batches,
    epoch_order,
    grouped_steps,
    rank_indices,
    shards_of,
    windowed_rank_indices,
)

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


SHARDS = np.repeat(np.arange(40), 25)  # 40 shards of 25 samples
WTRAIN = np.arange(1000)[np.arange(1000) % 7 != 3]  # some samples held out


def test_windowed_order_reads_a_window_of_shards_at_a_time_and_is_a_pure_function_of_seed_and_epoch():
    shards = SHARDS[WTRAIN]
    for epoch in range(3):
        order = epoch_order(WTRAIN, 5, epoch, shards, window=4)
        assert sorted(order.tolist()) == WTRAIN.tolist()  # every training sample once
        assert np.array_equal(order, epoch_order(WTRAIN, 5, epoch, shards, window=4))
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
            assert sorted(block) == [i for i in WTRAIN.tolist() if SHARDS[i] in window]
        # shuffled within the window, not shard after shard
        assert (np.diff(SHARDS[order[:80]]) != 0).sum() > 20
    a, b = epoch_order(WTRAIN, 5, 0, shards, 4), epoch_order(WTRAIN, 5, 1, shards, 4)
    assert not np.array_equal(a, b) and not np.array_equal(a, epoch_order(WTRAIN, 6, 0, shards, 4))
    # window 0 is the global order of earlier releases
    assert np.array_equal(epoch_order(WTRAIN, 5, 0, shards, 0), epoch_order(WTRAIN, 5, 0))


@pytest.mark.parametrize("window", [1, 4, 64])
def test_windowed_order_one_process_equals_n_and_resumes_exactly(window):
    shards = SHARDS[WTRAIN]
    one = rank_indices(WTRAIN, 7, 2, 16, 0, 1, shards=shards, window=window)
    for n in (2, 4):
        parts = [
            rank_indices(WTRAIN, 7, 2, 16, r, n, shards=shards, window=window).reshape(-1, 16 // n) for r in range(n)
        ]
        assert np.array_equal(np.concatenate(parts, axis=1).reshape(-1), one)
    tail = rank_indices(WTRAIN, 7, 2, 16, 1, 2, start_batch=5, shards=shards, window=window)
    full = rank_indices(WTRAIN, 7, 2, 16, 1, 2, shards=shards, window=window)
    assert np.array_equal(tail, full[5 * 8 :])
    batches = epoch_batches(WTRAIN, 7, 2, 16, shards=shards, window=window)
    assert np.array_equal(batches.reshape(-1), one)
    # the batches walk the windowed order (one latent shape: batch b is order[b*G:(b+1)*G])
    order = epoch_order(WTRAIN, 7, 2, shards, window)
    assert np.array_equal(one, order[: len(one)])


def test_the_windowed_order_at_one_process_positions_is_rank_indices_over_every_layout():
    """Shards of 0 to 29 samples (some empty, some wholly held out), held-out samples anywhere, windows of 1 to 8
    shards, 1 or 2 processes, any start: the same indices as rank_indices over the training samples."""
    rng = np.random.default_rng(1)
    for _ in range(60):
        counts = rng.integers(0, 30, int(rng.integers(1, 40)))
        counts[rng.integers(0, len(counts))] += 9
        starts = np.concatenate([[0], np.cumsum(counts)])
        held = np.sort(rng.choice(int(starts[-1]), int(rng.integers(0, 9)), replace=False))
        train = np.setdiff1d(np.arange(starts[-1]), held)
        shards = np.repeat(np.arange(len(counts)), counts)[train]
        g, window, world = int(rng.choice([2, 4, 8])), int(rng.integers(1, 9)), int(rng.choice([1, 2]))
        for rank in range(world):
            for start in (0, 1, 3):
                want = rank_indices(train, 7, 3, g, rank, world, start, shards=shards, window=window)
                got = windowed_rank_indices(starts, held, 7, 3, g, rank, world, start, window)
                assert np.array_equal(got, want)


def test_the_windowed_order_at_one_process_positions_holds_no_array_over_every_sample():
    """8M samples in 8,192 shards on 8 processes, in pieces of 16k positions: numpy's peak is this process's share
    (8 MB of indices) and one piece's temporaries, where rank_indices holds arrays of every sample's (64 MB each)."""
    starts = np.arange(8193, dtype=np.int64) * 1024
    held = np.arange(7, starts[-1], 8191)
    tracemalloc.start()
    got = windowed_rank_indices(starts, held, 1, 0, 256, 3, 8, 0, 4, chunk=1 << 14)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(got) == (starts[-1] - len(held)) // 256 * 32 and len(np.unique(got)) == len(got)
    assert not np.isin(got, held).any()
    assert peak < 1.5 * got.nbytes  # the share and one piece, nothing of 64 MB
    tracemalloc.start()  # in four node groups: their layouts share the per-shard arrays
    grouped = windowed_rank_indices(starts, held, 1, 0, 256, 3, 8, 0, 4, chunk=1 << 14, groups=4)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(grouped) > 0.99 * len(got) and peak < 1.5 * grouped.nbytes


def test_node_groups_split_each_window_s_shards_between_the_nodes_and_one_process_equals_n():
    """storage.node_groups 2: each half of a global batch comes from its own half of the epoch's shards, so two nodes
    (here one process each) read disjoint shards and together every shard once; 1, 2 and 4 processes give the same
    batches, a resume the same tail, and no sample comes twice in an epoch."""
    counts = np.full(40, 25)
    counts[[3, 17]] = [7, 0]  # a short shard and an empty one
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    held = np.arange(5, starts[-1], 97)
    args = (3, 1, 16)  # seed, epoch, global batch

    def order(rank: int, world: int, start: int = 0) -> np.ndarray:
        return windowed_rank_indices(starts, held, *args, rank, world, start, 4, groups=2)

    one = order(0, 1)
    steps = grouped_steps(starts, held, 16, 2)
    assert len(one) == steps * 16 and len(np.unique(one)) == len(one) and not np.isin(one, held).any()
    # counted from the smallest shards either group could get, an epoch drops under three shards' worth here
    assert len(one) > starts[-1] - len(held) - 3 * 25
    for world in (2, 4):
        parts = [order(r, world).reshape(-1, 16 // world) for r in range(world)]
        assert np.array_equal(np.concatenate(parts, axis=1).reshape(-1), one)
    assert np.array_equal(order(1, 2, start=5), order(1, 2)[5 * 8 :])
    node = [set((np.searchsorted(starts, order(r, 2), side="right") - 1).tolist()) for r in range(2)]
    assert not node[0] & node[1] and len(node[0] | node[1]) >= 36  # of the 39 with samples: less what the epoch drops
    # three groups of a batch of 12 over 3 and 4 processes: slices that straddle two parts, and small pieces
    three = windowed_rank_indices(starts, held, 3, 1, 12, 0, 1, 0, 6, groups=3)
    for world in (3, 4):
        parts = [
            windowed_rank_indices(starts, held, 3, 1, 12, r, world, 0, 6, chunk=8, groups=3).reshape(-1, 12 // world)
            for r in range(world)
        ]
        assert np.array_equal(np.concatenate(parts, axis=1).reshape(-1), three)
    # one group is the order without groups
    assert np.array_equal(windowed_rank_indices(starts, held, *args, 0, 1, 0, 4, groups=1), order_without(starts, held))
    assert not np.array_equal(one, order_without(starts, held))


def order_without(starts: np.ndarray, held: np.ndarray) -> np.ndarray:
    return windowed_rank_indices(starts, held, 3, 1, 16, 0, 1, 0, 4)


class _Cache:
    """What MixedReader reads of a CacheReader: its shards' first samples and one latent shape."""

    cache_dir, manifest = "cache", {}

    def __init__(self, counts: list[int]):
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.latent_hw = np.broadcast_to(np.array([[8, 8]], dtype=np.int32), (len(self), 2))

    def __len__(self) -> int:
        return int(self.shard_starts[-1])


def test_each_samples_shard_is_found_without_an_array_over_every_sample():
    """shards_of: each sample's shard, numbered across a mixture's caches, empty shards included (a shard whose
    every image failed); numpy's peak is the answer and the shards' first samples, not 4 bytes a sample."""
    a, b = [3, 0, 2, 0, 4], [0, 5, 1]
    every = np.repeat(np.arange(8), a + b)  # shards 0-4 of the first cache, 5-7 of the second
    mixture = MixedReader([_Cache(a), _Cache(b)])
    indices = np.random.default_rng(0).permutation(len(every))
    assert np.array_equal(shards_of(mixture, indices), every[indices])
    assert np.array_equal(shards_of(_Cache(a), np.arange(9)), np.repeat(np.arange(5), a))
    large = _Cache([1 << 20] * 1024)  # 1G samples
    tracemalloc.start()
    got = shards_of(large, np.array([0, (1 << 20) - 1, 1 << 20, (1 << 30) - 1]))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got.tolist() == [0, 0, 1, 1023] and peak < 1 << 16


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

    shards = SHARDS[WTRAIN]
    assert fetches(epoch_order(WTRAIN, 1, 0, shards, window=4), 10) == 40
    assert fetches(epoch_order(WTRAIN, 1, 0), 10) > 400


def test_storage_shuffle_window_is_a_config_key_that_leaves_earlier_runs_hashes_alone():
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from train.config import TrainConfig, run_hash

    base = load_config(TrainConfig, None, [])
    assert run_hash(load_config(TrainConfig, None, ["storage.shuffle_window=0"])) == run_hash(base)
    assert run_hash(load_config(TrainConfig, None, ["storage.prefetch_shards=5"])) == run_hash(base)  # neutral
    windowed = run_hash(load_config(TrainConfig, None, ["storage.shuffle_window=8"]))
    assert windowed != run_hash(base)  # other numbers
    # a run started with the earlier top-level key records the same hash, so it resumes under the new key
    assert run_hash(load_config(TrainConfig, None, ["cache_shuffle_window=8"])) == windowed
    with pytest.raises(UserError, match="config key 'storage.shuffle_window': must be >= 0, got -1"):
        load_config(TrainConfig, None, ["storage.shuffle_window=-1"])


def test_storage_node_groups_changes_the_hash_only_when_set_and_is_checked_before_anything_loads():
    from theworld.core.config import load_config
    from theworld.core.errors import UserError
    from train.config import TrainConfig, run_hash

    windowed = ["storage.shuffle_window=8"]
    base = run_hash(load_config(TrainConfig, None, windowed))
    assert run_hash(load_config(TrainConfig, None, [*windowed, "storage.node_groups=1"])) == base
    assert run_hash(load_config(TrainConfig, None, [*windowed, "storage.node_groups=2"])) != base
    bad = {
        "storage.node_groups=0": "must be >= 1, got 0",
        "storage.node_groups=3": "storage.shuffle_window (8) must be a positive multiple of it",
        "storage.node_groups=8 train.global_batch_size=12": "global_batch_size 12 does not split into 8 equal parts",
        "storage.node_groups=2 train.loader.group_by_length=true": "train.loader.group_by_length orders",
    }
    for sets, want in bad.items():
        with pytest.raises(UserError) as e:
            load_config(TrainConfig, None, [*windowed, *sets.split()])
        assert want in str(e.value) and "'storage.node_groups'" in str(e.value) and "\n" not in str(e.value)


def test_global_batches_hold_one_bucket_and_a_square_cache_keeps_the_plain_order():
    from train.data.order import epoch_batches, epoch_order, rank_indices, steps_per_epoch

    train = np.arange(1000, 1200)
    buckets = np.random.default_rng(0).choice(4, size=200, p=[0.5, 0.3, 0.15, 0.05])
    sizes = np.bincount(buckets)
    for epoch in (0, 1, 2):
        batches = epoch_batches(train, 7, epoch, 8, buckets)
        assert batches.shape == (steps_per_epoch(sizes, 8), 8) == (int((sizes // 8).sum()), 8)
        of = buckets[batches - 1000]
        assert (of == of[:, :1]).all()  # one bucket per global batch
        assert len(set(batches.ravel().tolist())) == batches.size  # no sample twice
        for k in range(4):  # each bucket loses fewer than G samples
            assert sizes[k] - (of[:, 0] == k).sum() * 8 < 8
        assert len(set(of[:, 0].tolist())) > 1
        # a pure function of (seed, epoch); processes split each global batch; resuming reads the tail
        assert np.array_equal(batches, epoch_batches(train, 7, epoch, 8, buckets))
        two = [rank_indices(train, 7, epoch, 8, r, 2, 0, buckets).reshape(-1, 4) for r in range(2)]
        assert np.array_equal(np.concatenate(two, axis=1), batches)
        tail = rank_indices(train, 7, epoch, 8, 1, 2, 5, buckets)
        assert np.array_equal(tail, two[1][5:].ravel())
    assert not np.array_equal(epoch_batches(train, 7, 0, 8, buckets), epoch_batches(train, 7, 1, 8, buckets))
    # one bucket: global batch b is order[b*G:(b+1)*G], as for a square cache
    one = epoch_batches(train, 7, 3, 16, np.zeros(200, dtype=np.int32))
    assert np.array_equal(one, epoch_order(train, 7, 3)[:192].reshape(12, 16))
    assert np.array_equal(one, epoch_batches(train, 7, 3, 16))


def test_too_few_samples_in_every_bucket_is_a_one_line_error():
    from theworld.core.errors import UserError
    from train.data.order import steps_per_epoch

    with pytest.raises(
        UserError,
        match="train.global_batch_size': 8 is more than the training samples of every "
        r"latent shape \(largest: 7\)",
    ):
        steps_per_epoch(np.array([7, 5, 3]), 8)
    assert steps_per_epoch(np.array([8, 5, 17]), 8) == 3


def _random_cache(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, held-out, buckets) of a small cache: shards of 0 to 29 samples, a few held out, 1 to 3 latent shapes
    in random proportions."""
    counts = rng.integers(0, 30, int(rng.integers(1, 25)))
    counts[rng.integers(0, len(counts))] += 9
    starts = np.concatenate([[0], np.cumsum(counts)])
    n = int(starts[-1])
    held = rng.choice(n, int(rng.integers(0, 9)), replace=False)
    shapes = int(rng.integers(1, 4))
    buckets = rng.choice(shapes, n, p=rng.dirichlet(np.ones(shapes))).astype(np.int32)
    return starts, held, buckets


def test_the_windowed_order_of_several_shapes_and_length_groups_walked_a_window_at_a_time_is_rank_indices():
    """Random caches of 1 to 3 latent shapes, with and without length grouping (group windows of 1 to 4 batches),
    shuffle windows of 1, 2, 3 and more shards than the cache has, 1, 2 or 4 processes, every rank, from the first,
    a middle, the last and past the last batch, several seeds and epochs: bucketed_rank_indices is rank_indices."""
    from train.data.order import bucketed_rank_indices

    rng = np.random.default_rng(2)
    for _ in range(120):
        starts, held, buckets = _random_cache(rng)
        n = int(starts[-1])
        groups = None
        if rng.random() < 0.5:
            groups = LengthGroups(rng.integers(1, 50, n), rng.integers(0, 3, n), int(rng.integers(1, 5)))
        train = np.setdiff1d(np.arange(n), held)
        shards = np.repeat(np.arange(len(starts) - 1), np.diff(starts))[train]
        g, window = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 3, 50]))
        world = int(rng.choice([w for w in (1, 2, 4) if g % w == 0]))
        seed, epoch = int(rng.integers(0, 100)), int(rng.integers(0, 5))
        for rank in range(world):
            whole = rank_indices(train, seed, epoch, g, rank, world, 0, buckets[train], groups, shards, window)
            steps = len(whole) // (g // world)
            for start in sorted({0, 1, steps // 2, max(steps - 1, 0), steps + 2}):
                got = bucketed_rank_indices(starts, held, buckets, seed, epoch, g, rank, world, start, window, groups)
                assert np.array_equal(got, whole[start * (g // world) :]), (starts, held, g, window, rank, start)


def test_one_shape_grouped_by_length_walks_a_broadcast_of_buckets():
    """A square cache's buckets are a broadcast of one 0 (bucket_ids): grouped by length, the walk counts its shards
    without reading it."""
    from train.data.order import bucketed_rank_indices

    starts, held = np.arange(0, 1001, 25), np.arange(3, 1000, 7)
    train = np.setdiff1d(np.arange(1000), held)
    buckets = np.broadcast_to(np.int32(0), 1000)
    groups = LengthGroups(LENGTHS[500:], IMAGES[500:], window=4)
    for rank, start in ((0, 0), (1, 9), (1, 26)):
        want = rank_indices(train, 4, 1, 16, rank, 2, start, None, groups, train // 25, window=3)
        assert np.array_equal(bucketed_rank_indices(starts, held, buckets, 4, 1, 16, rank, 2, start, 3, groups), want)


def _peak(f, *args) -> tuple[np.ndarray, int]:
    tracemalloc.start()
    try:
        out = f(*args)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_walk_holds_a_window_of_shards_where_rank_indices_holds_arrays_over_every_sample():
    """2,000 shards of 500 samples (1M), 2 latent shapes, length grouping, one process of 4: numpy's peak (tracemalloc)
    of the walk is its share (2 MB) and a window's arrays; rank_indices' is its arrays over every sample."""
    from train.data.order import bucketed_rank_indices

    rng = np.random.default_rng(3)
    starts, held = np.arange(2001, dtype=np.int64) * 500, np.sort(rng.choice(1_000_000, 64, replace=False))
    buckets = rng.choice(2, 1_000_000, p=[0.7, 0.3]).astype(np.int32)
    groups = LengthGroups(rng.integers(1, 4000, 1_000_000).astype(np.uint16), np.ones(1_000_000, np.uint8), 8)
    args = (5, 1, 64, 2, 4, 100, 8, groups)
    train = np.setdiff1d(np.arange(1_000_000), held)  # the reference's inputs, built before its peak is taken
    shards, of = train // 500, buckets[train]
    got, ours = _peak(bucketed_rank_indices, starts, held, buckets, *args)
    want, theirs = _peak(rank_indices, train, *args[:6], of, groups, shards, args[6])
    assert np.array_equal(got, want)
    print(
        f"numpy peak for one process's share ({got.nbytes / 1e6:.1f} MB): walked {ours / 1e6:.1f} MB, "
        f"rank_indices {theirs / 1e6:.1f} MB"
    )
    assert ours < theirs / 5 and ours < 2 * got.nbytes
