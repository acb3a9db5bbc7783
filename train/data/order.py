"""Sample order: each epoch's global batches, each process's slice, and the per-sample flip and
noise seeds.

Everything that decides which sample goes where is a pure function of (seed, epoch, step), so a run's data is the same
whatever the number of processes, and resuming at step s reads exactly the batches an uninterrupted run reads there:

- eval split: the `train.eval.samples` samples with the smallest sha256(key) are held out (independent of shard layout;
  theworld/cache_format/held_out.py);
- epoch order: a permutation of the training samples seeded from (seed, epoch) (with `storage.shuffle_window` W > 0: a
  permutation of the shards, cut into windows of W shards, and the samples of each window shuffled among themselves
  by a permutation keyed by (seed, epoch, window) and evaluated at any position alone, so an epoch reads W shards at
  a time and a cache larger than the node's shard cache is downloaded once), walked in order, each sample going to
  its latent shape's (bucket's) list; each time a list reaches G samples they become the next global batch, and what
  is left in the lists at the end is dropped. With one shape (a square cache) global batch b is order[b*G:(b+1)*G].
  Step s is global batch s % steps_per_epoch of epoch s // steps_per_epoch;
- with train.loader.group_by_length (`LengthGroups`): each window of `window` consecutive global batches of a bucket
  keeps its samples but sorts them by (number of images, token length, longest first) before cutting them into
  batches, whose order within the window is then shuffled (seeded by seed, epoch, bucket, window): samples of similar
  length and of one modality share a batch, as LLaVA's group_by_modality_length has them;
- process r of W takes the r-th contiguous slice (G/W samples) of each global batch, in micro-batches of M, so every
  micro-batch holds one latent shape.

`rank_indices` is the definition: it builds the epoch's permutation and every global batch (8 bytes a sample). The
windowed order of one cache gives the same indices without an array over every sample: of one latent shape at the
process's positions alone (`windowed_rank_indices`), of several shapes or grouped by length walked a window of shards
at a time, each bucket's list carried from window to window and the batches numbered from the shards' counts of each
bucket (`bucketed_rank_indices`). The global order (W = 0) and a mixture's draw order over every sample. A process's
share lives in a numpy array (8 bytes a sample of it), shared by forked loader workers without copying.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from theworld import cache_format as cf
from theworld.cache_format.held_out import Kept, check_held_out, nth_kept
from theworld.core.errors import UserError


def seed_of(*parts) -> int:
    """A 63-bit seed that is a pure function of `parts` (e.g. a purpose name, the run seed, an epoch, an index)."""
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little") >> 1


def bucket_ids(reader: cf.CacheReader) -> np.ndarray:
    """(N,) int32: each sample's bucket, numbered in (h, w) order of the cache's latent shapes (one shape: a
    read-only view of one 0, no memory per sample)."""
    hw = reader.latent_hw
    # one shape (every square cache): no sort over the whole index, and a broadcast (a large cache's) no pass either:
    # comparing it would make an (N, 2) array (2.8 GB at DataComp-1B)
    if not len(hw) or hw.strides[0] == 0 or (hw == hw[0]).all():
        return np.broadcast_to(np.int32(0), len(hw))
    return np.unique(hw, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int32)


def several_shapes(buckets: np.ndarray) -> bool:
    """Whether `buckets` (bucket_ids') number more than one latent shape: a one-shape cache's broadcast answers
    without a pass over every sample (seconds at DataComp-1B)."""
    return buckets.strides != (0,) and bool(buckets.any())


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed_of("order", seed, epoch))).numpy()


def shards_of(reader, indices: np.ndarray) -> np.ndarray:
    """(len(indices),) int32: the shard of each sample index, shards numbered across the caches of a mixture
    (train.data.mixture.MixedReader), found among the shards' first samples: no array over every sample (4 bytes a
    sample, 5.6 GB at DataComp-1B, made by every process at every epoch's start)."""
    # the last shard starting at or before the index: an empty shard starts where the next one does
    firsts = reader.shard_starts[:-1]
    return (np.searchsorted(firsts, np.asarray(indices, dtype=np.int64), side="right") - 1).astype(np.int32)


def shard_bytes(reader, shards: list[int]) -> int:
    """The bytes of these shards together, numbered across a mixture's caches as `shards_of` numbers them."""
    locate = getattr(reader, "locate_shard", lambda shard: (reader, shard))  # a mixture's, or one cache's own
    return sum(int(r.shard_table.bytes[i]) for r, i in map(locate, shards))


def _windowed(shards: np.ndarray, seed: int, epoch: int, window: int, chunk: int = 1 << 20) -> np.ndarray:
    """A permutation of positions 0..len(shards)-1: the shards in a (seed, epoch) order, cut into windows of `window`
    shards, each window's positions (in ascending order) shuffled (MosaicML Streaming's block shuffle) by
    `_window_shuffle`, which is evaluated at any position alone: `windowed_rank_indices` computes one process's share
    of this order without it."""
    ids, inverse = np.unique(shards, return_inverse=True)
    place = np.empty(len(ids), dtype=np.int64)
    place[_shard_order(len(ids), seed, epoch)] = np.arange(len(ids))
    of = place[inverse.reshape(-1)] // window
    by_window = np.argsort(of, kind="stable")  # grouped by window, ascending within each
    bounds = np.concatenate([[0], np.cumsum(np.bincount(of, minlength=-(-len(ids) // window)))])
    out = np.empty(len(shards), dtype=np.int64)
    for lo in range(0, len(shards), chunk):  # the shuffle's temporaries a chunk at a time
        t = np.arange(lo, min(lo + chunk, len(shards)))
        k = np.searchsorted(bounds, t, side="right") - 1
        out[t] = by_window[bounds[k] + _window_shuffle(t - bounds[k], bounds[k + 1] - bounds[k], k, seed, epoch)]
    return out


def _shard_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed_of("shards", seed, epoch))).numpy()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 in which every output bit depends on every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _window_shuffle(j: np.ndarray, n: np.ndarray, k: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Where position j of window k (of n samples) takes its sample from: a permutation of [0, n) per window, keyed
    by (seed, epoch, k), evaluated elementwise (4 Feistel rounds over the smallest [0, 4^h) holding n, walked back
    into [0, n)), so a process computes the positions it reads and nothing else."""
    j, n = np.asarray(j, np.uint64), np.asarray(n, np.uint64)
    base = np.uint64(seed_of("window", seed, epoch))
    keys = [_mix(base ^ _mix(np.asarray(k, np.uint64) * np.uint64(4) + np.uint64(r + 1))) for r in range(4)]
    h = ((np.frexp(np.maximum(n, 2) - 1)[1] + 1) // 2).astype(np.uint64)  # half the bits of n - 1, at least 1
    mask = (np.uint64(1) << h) - np.uint64(1)

    def rounds(x: np.ndarray, sel) -> np.ndarray:
        left, right, m = x >> h[sel], x & mask[sel], mask[sel]
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key[sel]) & m)
        return (left << h[sel]) | right

    y = rounds(j, slice(None))
    while (out := np.flatnonzero(y >= n)).size:  # cycle walking: a bijection of [0, 4^h) restricted to [0, n)
        y[out] = rounds(y[out], out)
    return y.astype(np.int64)


@dataclass(frozen=True)
class _Windows:
    """One cache's windowed order of an epoch at shard level: its training samples (all but `held`) laid out as the
    shards that hold some, in the (seed, epoch) order, cut into windows of `window` shards, each window's in ascending
    order (`_windowed`'s layout, from the shards' sizes alone)."""

    starts: np.ndarray  # (S + 1,) the first sample of each shard (samples are in shard order)
    held: np.ndarray  # the held-out samples, sorted
    lost: np.ndarray  # (S,) held-out samples of each shard
    counts: np.ndarray  # (S,) training samples of each shard
    flat: np.ndarray  # the shards that hold training samples, window after window
    window: int

    @classmethod
    def of(cls, starts: np.ndarray, held_out: np.ndarray, seed: int, epoch: int, window: int) -> _Windows:
        return cls.groups(starts, held_out, seed, epoch, window, 1)[0]

    @classmethod
    def groups(
        cls, starts: np.ndarray, held_out: np.ndarray, seed: int, epoch: int, window: int, groups: int
    ) -> list[_Windows]:
        """One layout per group of storage.node_groups: group g holds the shards at positions g, g + groups, ... of
        the epoch's shard order, in windows of window // groups shards (the per-shard arrays are shared)."""
        held, lost, counts = _training_counts(starts, held_out)
        ids = np.flatnonzero(counts > 0)  # the shards that hold training samples, as np.unique gives _windowed
        ids = ids[_shard_order(len(ids), seed, epoch)]
        starts, w = np.asarray(starts, dtype=np.int64), window // groups
        out = []
        for g in range(groups):
            mine = ids[g::groups]
            flat = mine[np.lexsort((mine, np.arange(len(mine)) // w))]  # each window's shards in ascending order
            out.append(cls(starts, held, lost, counts, flat, w))
        return out

    @property
    def ends(self) -> np.ndarray:
        """Training samples up to each shard of `flat`, windows in order."""
        return np.cumsum(self.counts[self.flat])

    @property
    def offsets(self) -> np.ndarray:
        """(K + 1,) the epoch position where each window starts, and the epoch's size."""
        last = np.minimum(np.arange(self.window, len(self.flat) + self.window, self.window), len(self.flat)) - 1
        return np.concatenate([[0], self.ends[last]])

    def samples(self, k: int, seed: int, epoch: int) -> np.ndarray:
        """Window k's training samples in the epoch's order: its shards' samples in cache order, shuffled by
        `_window_shuffle`."""
        shards = self.flat[k * self.window : (k + 1) * self.window]
        sizes = self.starts[shards + 1] - self.starts[shards]
        x = np.arange(int(sizes.sum())) + np.repeat(self.starts[shards] - (np.cumsum(sizes) - sizes), sizes)
        if self.lost[shards].any():
            at = np.minimum(np.searchsorted(self.held, x), len(self.held) - 1)
            x = x[self.held[at] != x]
        n = len(x)
        return x[_window_shuffle(np.arange(n), np.full(n, n), np.full(n, k), seed, epoch)]


def _training_counts(starts: np.ndarray, held_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the held-out samples sorted, each shard's held-out samples, each shard's training samples)."""
    held = np.sort(np.asarray(held_out, dtype=np.int64))
    lost = np.bincount(np.searchsorted(starts, held, side="right") - 1, minlength=len(starts) - 1)
    return held, lost, np.diff(starts) - lost


def grouped_steps(starts: np.ndarray, held_out: np.ndarray, global_batch: int, groups: int) -> int:
    """Global batches per epoch of the windowed order in `groups` node groups (storage.node_groups): each group gives
    global_batch / groups samples of every batch from its own shards, so an epoch lasts while the smallest group
    does; counted from the smallest shards a group can get, the same for every epoch."""
    counts = np.sort(_training_counts(starts, held_out)[2])
    counts = counts[counts > 0]
    return int(counts[: len(counts) // groups].sum()) // (global_batch // groups)


def windowed_rank_indices(
    starts: np.ndarray,
    held_out: np.ndarray,
    seed: int,
    epoch: int,
    global_batch: int,
    rank: int,
    world_size: int,
    start_batch: int,
    window: int,
    chunk: int = 1 << 20,
    groups: int = 1,
) -> np.ndarray:
    """`rank_indices` of the windowed order over one cache's training samples (all but `held_out`) of one latent
    shape, computed at this process's positions alone: memory is the shards' arrays and this process's share (in
    pieces of `chunk`), never an array over every sample (a DataComp-1B cache holds 1.4B). `starts`: (S + 1,) the
    first sample of each shard (samples are in shard order).

    `groups` > 1 (storage.node_groups): global batch b is `groups` equal parts, part g the positions
    b * global_batch / groups ... of group g's own windowed order (`_Windows.groups`), so the processes whose
    slices fall in part g read only group g's shards; the order depends on `groups`, never on the number of
    processes."""
    lays = _Windows.groups(starts, held_out, seed, epoch, window, groups)
    part = global_batch // groups
    if groups == 1:
        n_batches = int(lays[0].offsets[-1]) // global_batch  # a leftover short batch is dropped
    else:
        n_batches = grouped_steps(starts, held_out, global_batch, groups)
    per = global_batch // world_size
    columns = rank_offset(global_batch, rank, world_size) + np.arange(per)  # this slice's places in a batch
    batches, step = np.arange(start_batch, n_batches), max(1, chunk // per)
    out = np.empty((len(batches), per), dtype=np.int64)
    for b in range(0, len(batches), step):
        for g in np.unique(columns // part).tolist():
            mine = np.flatnonzero(columns // part == g)
            p = batches[b : b + step, None] * part + columns[mine] % part
            out[b : b + step, mine] = _sample_at(lays[g], p.reshape(-1), seed, epoch, g, groups).reshape(p.shape)
    return out.reshape(-1)


def _sample_at(lay: _Windows, p: np.ndarray, seed: int, epoch: int, group: int, groups: int) -> np.ndarray:
    """The samples at positions `p` of group `group`'s windowed order (its window k shuffled by the key
    k * groups + group: one group's keys are those of the order without groups)."""
    flat, counts, ends, offsets = lay.flat, lay.counts, lay.ends, lay.offsets
    k = np.searchsorted(offsets, p, side="right") - 1
    r = offsets[k] + _window_shuffle(p - offsets[k], offsets[k + 1] - offsets[k], k * groups + group, seed, epoch)
    i = np.searchsorted(ends, r, side="right")  # flat[i]: the shard holding the epoch's training sample r
    q = flat[i]
    u = r - (ends[i] - counts[q])  # r is shard q's u-th training sample
    x = lay.starts[q] + u  # its sample, where the shard holds none out
    some = np.flatnonzero(lay.lost[q])
    x[some] = nth_kept(u[some], lay.held, lay.starts[q[some]])
    return x


def bucketed_rank_indices(
    starts: np.ndarray,
    held_out: np.ndarray,
    buckets: np.ndarray,
    seed: int,
    epoch: int,
    global_batch: int,
    rank: int,
    world_size: int,
    start_batch: int,
    window: int,
    groups: LengthGroups | None = None,
    chunk: int = 1 << 16,
) -> np.ndarray:
    """`rank_indices` of the windowed order over one cache's training samples (all but `held_out`) of several latent
    shapes (`buckets`: each sample's, as `bucket_ids` numbers them) and/or grouped by length, walked a window of shards
    at a time: memory is one window's samples, each shard's and window's count of each bucket (counted in pieces of
    `chunk` samples), a group window of batches per bucket and this process's share, never an array over every sample.
    The walk starts at the window where the earliest sample of a batch (or group window) still to read falls: the
    shards' counts number every batch that ends before it."""
    lay = _Windows.of(starts, held_out, seed, epoch, window)
    cum = _window_counts(lay, buckets, chunk)  # (K + 1, B): each bucket's training samples before each window
    steps = (cum // global_batch).sum(1)  # the global batches that end before each window
    out = np.empty((max(0, int(steps[-1]) - start_batch), global_batch // world_size), dtype=np.int64)
    if not len(out):
        return out.reshape(-1)
    k = int(np.searchsorted(steps, start_batch, side="right")) - 1  # global batch start_batch ends in window k
    g = groups.window if groups is not None else 1
    # each bucket's first sample kept (in its list): where the group window of its first batch ending in window k or
    # later begins; the walk starts at the earliest window holding one
    first = cum[k] // global_batch // g * g * global_batch
    k0 = min([k] + [int(np.searchsorted(cum[:, b], first[b], side="right")) - 1 for b in range(cum.shape[1])])
    walk = _Walk(out, start_batch, rank_offset(global_batch, rank, world_size), groups, seed, epoch)
    walk.begin(cum[k0], int(steps[k0]), first, global_batch)
    for w in range(k0, len(cum) - 1):
        x = lay.samples(w, seed, epoch)
        walk.window(x, np.asarray(buckets[x], dtype=np.int64))
    walk.finish()
    return out.reshape(-1)


def _window_counts(lay: _Windows, buckets: np.ndarray, chunk: int) -> np.ndarray:
    """(K + 1, B): each bucket's training samples in the windows before each window (and in all of them)."""
    table = _shard_bucket_counts(lay, buckets, chunk)
    per = np.zeros((0, table.shape[1]), dtype=np.int64)
    if len(lay.flat):
        per = np.add.reduceat(table[lay.flat], np.arange(0, len(lay.flat), lay.window), axis=0)
    return np.concatenate([np.zeros((1, table.shape[1]), dtype=np.int64), np.cumsum(per, axis=0)])


def _shard_bucket_counts(lay: _Windows, buckets: np.ndarray, chunk: int) -> np.ndarray:
    """(S, B): each shard's training samples of each bucket, counted a piece of about `chunk` samples at a time."""
    if not several_shapes(buckets):
        return lay.counts[:, None]
    nb, starts, sizes = int(buckets.max()) + 1, lay.starts, np.diff(lay.starts)
    table = np.zeros((len(sizes), nb), dtype=np.int64)
    lo = 0
    while lo < len(sizes):
        hi = min(len(sizes), max(lo + 1, int(np.searchsorted(starts, starts[lo] + chunk, side="right")) - 1))
        local = np.repeat(np.arange(hi - lo, dtype=np.int64), sizes[lo:hi]) * nb + buckets[starts[lo] : starts[hi]]
        table[lo:hi] = np.bincount(local, minlength=(hi - lo) * nb).reshape(-1, nb)
        lo = hi
    np.subtract.at(table, (np.searchsorted(starts, lay.held, side="right") - 1, buckets[lay.held]), 1)
    return table


class _Walk:
    """`bucketed_rank_indices`' walk over the windows: each bucket's list, its batches' global numbers (by where each
    batch's last sample falls), and its rows of this process's share, written as each group window completes."""

    def __init__(self, out: np.ndarray, start: int, lo: int, groups: LengthGroups | None, seed: int, epoch: int):
        self.out, self.start, self.lo, self.groups, self.seed, self.epoch = out, start, lo, groups, seed, epoch

    def begin(self, seen: np.ndarray, steps: int, first: np.ndarray, global_batch: int) -> None:
        """`seen`: each bucket's samples before the first window walked; `steps`: the global batches ending there;
        `first`: each bucket's first sample kept (the start of a group window)."""
        self.seen, self.steps, self.first, self.g = seen.copy(), steps, first, global_batch
        self.done = first // global_batch  # each bucket's batches before its kept ones
        self.kept = [np.zeros(0, dtype=np.int64) for _ in first]  # samples from the bucket's current group window
        self.slots = [np.zeros(0, dtype=np.int64) for _ in first]  # that group window's batches' global numbers

    def window(self, x: np.ndarray, of: np.ndarray) -> None:
        """One window's samples `x` in the epoch's order, `of` their buckets."""
        by = np.argsort(of, kind="stable")  # each bucket's positions in the window, ascending
        at = np.split(by, np.cumsum(np.bincount(of, minlength=len(self.seen)))[:-1])
        pos = [self.seen[b] + np.arange(len(at[b])) for b in range(len(at))]  # where in its bucket's list
        ends = [(p + 1) % self.g == 0 for p in pos]
        where = np.concatenate([a[e] for a, e in zip(at, ends)])  # the batches ending in this window
        number = np.empty(len(where), dtype=np.int64)
        number[np.argsort(where)] = self.steps + np.arange(len(where))
        self.steps += len(where)
        mine = np.split(number, np.cumsum([int(e.sum()) for e in ends])[:-1])
        for b in np.flatnonzero([len(a) for a in at]).tolist():
            keep = pos[b] >= self.first[b]
            self.kept[b] = np.concatenate([self.kept[b], x[at[b][keep]]])
            self.slots[b] = np.concatenate([self.slots[b], mine[b][keep[ends[b]]]])
            self.seen[b] += len(at[b])
            self._emit(b, len(self.slots[b]) // self._gw * self._gw)

    @property
    def _gw(self) -> int:
        return self.groups.window if self.groups is not None else 1

    def finish(self) -> None:
        """The last (short) group window of each bucket; a bucket's leftover samples (< G) are dropped."""
        for b in range(len(self.slots)):
            self._emit(b, len(self.slots[b]))

    def _emit(self, b: int, m: int) -> None:
        """Bucket b's next m batches (whole group windows, or its last) into this process's share."""
        if not m:
            return
        rows = self.kept[b][: m * self.g].reshape(m, self.g)
        if self.groups is not None:
            rows = self.groups.batches(rows, self.seed, self.epoch, b, int(self.done[b]))
        slots = self.slots[b][:m]
        keep = slots >= self.start
        self.out[slots[keep] - self.start] = rows[keep, self.lo : self.lo + self.out.shape[1]]
        self.kept[b], self.slots[b], self.done[b] = self.kept[b][m * self.g :], self.slots[b][m:], self.done[b] + m


def epoch_permutation(n: int, seed: int, epoch: int, shards: np.ndarray | None = None, window: int = 0) -> np.ndarray:
    """The epoch's order of n training samples (positions): global, or windowed (`shards`: each one's shard)."""
    return _permutation(n, seed, epoch) if not window else _windowed(np.asarray(shards), seed, epoch, window)


def epoch_order(
    train_indices: np.ndarray, seed: int, epoch: int, shards: np.ndarray | None = None, window: int = 0
) -> np.ndarray:
    perm = epoch_permutation(len(train_indices), seed, epoch, shards, window)
    return np.asarray(train_indices, dtype=np.int64)[perm]


@dataclass(frozen=True)
class LengthGroups:
    """What train.loader.group_by_length sorts by: each sample's token length and number of images (arrays over the
    reader's indices), and the window of consecutive global batches it sorts within."""

    lengths: np.ndarray
    images: np.ndarray
    window: int

    def batches(self, samples: np.ndarray, seed: int, epoch: int, bucket: int, first: int = 0) -> np.ndarray:
        """(n, G) global batches of one bucket, their samples regrouped by length within each window. `first`: the
        bucket's batch number of samples[0] in its epoch (a multiple of `window`), which seeds each window's shuffle."""
        n, g = samples.shape
        out = np.empty_like(samples)
        for lo in range(0, n, self.window):
            chunk = samples[lo : lo + self.window].reshape(-1)
            # int64 before negating: a large cache's lengths are uint16 (loader.index_lengths)
            by_length = chunk[np.lexsort((-self.lengths[chunk].astype(np.int64), self.images[chunk]))].reshape(-1, g)
            shuffle = _permutation(len(by_length), seed_of("group", seed, bucket, first + lo), epoch)
            out[lo : lo + self.window] = by_length[shuffle]
        return out


def epoch_batches(
    train_indices: np.ndarray,
    seed: int,
    epoch: int,
    global_batch: int,
    buckets: np.ndarray | None = None,
    groups: LengthGroups | None = None,
    shards: np.ndarray | None = None,
    window: int = 0,
) -> np.ndarray:
    """(steps_per_epoch, G) global batches of `epoch`, each of one bucket (`buckets[i]` is train_indices[i]'s).

    The epoch's permutation is walked in order and each sample appended to its bucket's list; whenever a list holds G
    samples they form the next batch. So batches are ordered by where their last sample falls in the permutation (each
    bucket's batches spread over the epoch), a bucket's leftover (< G samples) is dropped for this epoch, and with one
    bucket batch b is order[b*G:(b+1)*G]. `groups`: samples regrouped by length within windows of a bucket's batches.
    `shards` (train_indices[i]'s shard) and `window`: the windowed order.
    """
    perm = epoch_permutation(len(train_indices), seed, epoch, shards, window)
    order = np.asarray(train_indices, dtype=np.int64)[perm]
    of = np.zeros(len(order), dtype=np.int32) if buckets is None else np.asarray(buckets)[perm]
    rows, ends = [np.zeros((0, global_batch), dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for k in np.unique(of):
        pos = np.flatnonzero(of == k)
        full = len(pos) // global_batch * global_batch
        batches = order[pos[:full]].reshape(-1, global_batch)
        rows.append(batches if groups is None else groups.batches(batches, seed, epoch, int(k)))
        ends.append(pos[global_batch - 1 : full : global_batch])
    return np.concatenate(rows)[np.argsort(np.concatenate(ends), kind="stable")]


def check_sizes(cfg, reader: cf.CacheReader, train_indices: np.ndarray, world_size: int, draw=None) -> int:
    """Steps per epoch from the cache's index alone (before any model loads), or a one-line error naming the key.
    `draw`: a mixture's train.mixture.Draw, whose epochs hold other samples than `train_indices`."""
    n_eval = cfg.train.eval.samples
    if draw is None:
        check_held_out(n_eval, len(reader))
    if n_eval == 1 or 0 < n_eval < world_size:  # each process takes a share; a shuffled world is another sample's
        raise UserError(
            f"config key 'train.eval.samples': {n_eval} is too few for {world_size} process(es) (the "
            f"shuffled-world loss takes each held-out sample's world from another one): use 0 (no eval) "
            f"or at least {max(2, world_size)}"
        )
    if cfg.storage.node_groups > 1:
        held = train_indices.held if isinstance(train_indices, Kept) else None
        if held is None or several_shapes(bucket_ids(reader)):
            raise UserError(
                "config key 'storage.node_groups': orders the training samples of one cache of one latent shape "
                f"(cache {reader.cache_dir} has several, or trains on part of it): leave node_groups at 1"
            )
        groups, g = cfg.storage.node_groups, cfg.train.global_batch_size
        if not (steps := grouped_steps(reader.shard_starts, held, g, groups)):
            raise UserError(
                f"config key 'storage.node_groups': {groups} groups of the cache's shards hold too few samples for "
                f"a global batch of {g}"
            )
        return steps
    if draw is not None:
        sizes = draw.bucket_sizes(bucket_ids(reader))
    elif several_shapes(ids := bucket_ids(reader)):
        sizes = np.bincount(ids[np.asarray(train_indices)])
    else:  # one latent shape: no array over every training sample
        sizes = len(train_indices)
    return steps_per_epoch(sizes, cfg.train.global_batch_size)


def steps_per_epoch(bucket_sizes: np.ndarray | int, global_batch: int) -> int:
    """Whole global batches per epoch from the training samples of each bucket (an int: one bucket)."""
    sizes = np.atleast_1d(bucket_sizes)
    steps = int((sizes // global_batch).sum())
    if not steps:
        where = (
            f"the {int(sizes.sum())} training samples"
            if len(sizes) == 1
            else f"the training samples of every latent shape (largest: {int(sizes.max())})"
        )
        raise UserError(f"config key 'train.global_batch_size': {global_batch} is more than {where}")
    return steps


def total_steps(train, per_epoch: int) -> int:
    """The run's length: train.max_steps, or with train.epochs > 0 (which wins) that many epochs of `per_epoch`
    steps, rounded up to a whole step (0.5 epochs of 5 steps: 3)."""
    if not train.epochs:
        return train.max_steps
    return max(1, math.ceil(round(train.epochs * per_epoch, 6)))  # round: 0.1 * 30 is 3.0000000000000004


def rank_offset(global_batch: int, rank: int, world_size: int) -> int:
    """Where process `rank`'s contiguous slice of a global batch starts."""
    return rank * (global_batch // world_size)


def rank_indices(
    train_indices: np.ndarray,
    seed: int,
    epoch: int,
    global_batch: int,
    rank: int,
    world_size: int,
    start_batch: int = 0,
    buckets: np.ndarray | None = None,
    groups: LengthGroups | None = None,
    shards: np.ndarray | None = None,
    window: int = 0,
) -> np.ndarray:
    """This process's samples for global batches [start_batch, end of epoch) of `epoch`, in consumption order."""
    batches = epoch_batches(train_indices, seed, epoch, global_batch, buckets, groups, shards=shards, window=window)
    lo = rank_offset(global_batch, rank, world_size)
    return batches[start_batch:, lo : lo + global_batch // world_size].reshape(-1)


def flip_of(seed: int, epoch: int, index: int) -> bool:
    return seed_of("flip", seed, epoch, index) & 1 == 1


def noise_seeds(seed: int, step: int, first: int, n: int) -> list[int]:
    """Latent-sampling seeds of the samples at positions [first, first + n) of a step's global batch: a pure function
    of (seed, step, position), so neither resuming nor the process count or accumulation changes a sample's noise."""
    return [seed_of("noise", seed, step, i) for i in range(first, first + n)]


def eval_partners(latent_hw: np.ndarray) -> np.ndarray:
    """For held-out samples in key order with latent shapes (n, 2): each one's partner, the next sample of the same
    shape (cyclically), whose world it takes for the shuffled-world loss; itself when it is its shape's only one."""
    partners = np.arange(len(latent_hw))
    shapes = np.unique(latent_hw, axis=0, return_inverse=True)[1].reshape(-1) if len(latent_hw) else partners
    for k in np.unique(shapes):
        pos = np.flatnonzero(shapes == k)
        partners[pos] = np.roll(pos, -1)
    return partners
