"""Weighted mixtures of caches (`data: [{cache, weight}, ...]`): several caches read as one index, and each epoch's
draw from them by weight.

`MixedReader` concatenates the caches' samples (global index = the cache's offset + its own index) and answers the
part of `CacheReader`'s interface training uses, so the split, the order, the dataset and the collation need not know
whether there is one cache or several.

Each epoch holds as many samples as the caches' training samples together (N). Cache c gets a quota of
round(N x weight_c / sum of weights) of them (largest remainders, so the quotas add up to N), spread over its latent
shapes in proportion to their sizes. A (cache, shape) group whose quota is below its size gives a seeded random subset,
a different one each epoch; one whose quota is above its size repeats: whole seeded permutations of it, then part of
one more. The quotas are the same every epoch, so the number of global batches per epoch is too, and the draw is a pure
function of (seed, epoch): resuming and the process count do not change it. The epoch's order is then made from the
drawn samples as from one cache's (`order.epoch_batches`), over every drawn sample.

With weight `samples` on every cache (`cfg.joined`: a dataset precomputed in parts) there is no draw: each epoch holds
every training sample once, the caches read as one cache whose shards are theirs one after another, so the order is
one cache's (a window of shards at a time, `storage.node_groups` included), computed without an array over every
sample.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from theworld import cache_format as cf
from theworld.core.errors import UserError
from train.data.order import seed_of


class MixedReader:
    """Several CacheReaders as one index (see the module docstring); picklable for loader workers. It holds arrays over
    the caches' shards, never one over every sample (1.4B at DataComp-1B, whose plan trains on the mixture of its
    nodes' parts)."""

    def __init__(self, readers: list[cf.CacheReader]):
        self.readers = readers
        sizes = [len(r) for r in readers]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.cache_of = CacheOf(self.offsets)
        # the shards numbered across the caches (order.shards_of): each one's first sample, then the mixture's size
        firsts = [r.shard_starts[:-1] + o for r, o in zip(readers, self.offsets)]
        self.shard_starts = np.concatenate([*firsts, self.offsets[-1:]]).astype(np.int64)
        self.shard_offsets = np.concatenate([[0], np.cumsum([len(f) for f in firsts])]).astype(np.int64)
        self.cache_dir = readers[0].cache_dir  # for messages that name "the cache"; each reader names its own
        self.manifest = readers[0].manifest

    def locate(self, index: int) -> tuple[cf.CacheReader, int]:
        """The cache that mixture sample `index` comes from, and its index there."""
        c = int(self.cache_of[index])
        return self.readers[c], int(index - self.offsets[c])

    @property
    def latent_hw(self) -> np.ndarray:
        """(N, 2): each sample's latent (h, w); a read-only broadcast where every cache has the same single shape."""
        hws = [r.latent_hw for r in self.readers if len(r)]
        if hws and all(h.strides[0] == 0 and np.array_equal(h[:1], hws[0][:1]) for h in hws):
            return np.broadcast_to(hws[0][:1], (len(self), 2))
        return np.concatenate([r.latent_hw for r in self.readers]).reshape(-1, 2)

    @property
    def lazy(self) -> bool:
        """Whether a cache is read a part at a time (start-of-run passes then read no text)."""
        return any(getattr(r, "lazy", False) for r in self.readers)

    @property
    def remote(self):
        """A cache's RemoteCache where one is at a URL (read-ahead stages its shards: `stage`), else None."""
        return next((r.remote for r in self.readers if r.remote is not None), None)

    def locate_shard(self, shard: int) -> tuple[cf.CacheReader, int]:
        """The cache of mixture shard `shard` (numbered across the caches, as order.shards_of numbers them) and its
        number there."""
        c = int(np.searchsorted(self.shard_offsets, shard, side="right")) - 1
        return self.readers[c], int(shard - self.shard_offsets[c])

    def stage(self, shard: int, ahead: bool = False) -> None:
        """CacheReader.stage of mixture shard `shard`."""
        reader, local = self.locate_shard(shard)
        reader.stage(local, ahead)

    def text_bytes(self) -> Concatenated:
        """Each sample's caption and json bytes (CacheReader.text_bytes), the caches' own arrays not copied."""
        return Concatenated([r.text_bytes() for r in self.readers], self.offsets)

    @property
    def members(self) -> tuple[str, ...] | None:
        return self.readers[0].members

    @members.setter
    def members(self, value: tuple[str, ...] | None) -> None:
        for r in self.readers:
            r.members = value

    @property
    def checksummed(self) -> bool:
        return all(r.checksummed for r in self.readers)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def key(self, index: int) -> str:
        reader, i = self.locate(index)
        return reader.key(i)

    def keys_digest(self) -> str:
        """sha256 (16 hex digits) of the caches' own key digests, in order."""
        return hashlib.sha256("\n".join(r.keys_digest() for r in self.readers).encode()).hexdigest()[:16]

    def raw(self, index: int) -> dict[str, bytes]:
        reader, i = self.locate(index)
        return reader.raw(i)

    def text(self, index: int) -> cf.Sample:
        reader, i = self.locate(index)
        return reader.text(i)

    def decode(self, index: int, members: dict[str, bytes], tensors: bool = True) -> cf.Sample:
        reader, i = self.locate(index)
        return reader.decode(i, members, tensors)

    def sample(self, index: int, tensors: bool = True) -> cf.Sample:
        reader, i = self.locate(index)
        return reader.sample(i, tensors)

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def damaged(self, index: int, what: str):
        reader, i = self.locate(index)
        return reader.damaged(i, what)


class CacheOf:
    """Which cache each mixture sample comes from, indexed like the (N,) int32 array it stands for (an int or an array
    of indices) without holding it: found among the caches' offsets."""

    def __init__(self, offsets: np.ndarray):
        self.offsets = offsets

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, indices):
        found = np.searchsorted(self.offsets[1:], np.asarray(indices, dtype=np.int64), side="right")
        return found.astype(np.int32) if np.ndim(found) else int(found)


class Concatenated:
    """Per-sample arrays of the caches one after another, indexed like their concatenation (an int or an array of
    indices) without copying them: a lazily read cache's `text_bytes` is a view of its node's shard table, and a copy
    of the parts' would be 2 bytes a sample in every process (2.8 GB at DataComp-1B)."""

    def __init__(self, arrays: list[np.ndarray], offsets: np.ndarray):
        self.arrays, self.offsets = arrays, offsets
        self.dtype = np.result_type(*arrays)
        self.shape = (int(offsets[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, indices):
        at = np.asarray(indices, dtype=np.int64)
        cache = np.searchsorted(self.offsets[1:], at, side="right")
        if not at.ndim:
            return self.arrays[cache][at - self.offsets[cache]]
        out = np.empty(at.shape, self.dtype)
        for c in np.unique(cache).tolist():  # one fancy index per cache
            mine = cache == c
            out[mine] = self.arrays[c][at[mine] - self.offsets[c]]
        return out


def named(reader: cf.CacheReader) -> str:
    """A cache as its config names it: its URL, or its folder (a cache at a URL is read from a stand-in folder)."""
    return reader.remote.url if reader.remote is not None else str(reader.cache_dir)


def partner_groups(reader, indices: np.ndarray) -> np.ndarray:
    """What the shuffled-world eval pairs within: the latent shape, and in a mixture the cache too."""
    hw = reader.latent_hw[indices]
    if not isinstance(reader, MixedReader):
        return hw
    return np.column_stack([reader.cache_of[indices], hw])


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers proportional to `shares` that add up to `total` (Hamilton's method; ties to the first)."""
    exact = np.asarray(shares, dtype=np.float64) * total / np.sum(shares)
    out = np.floor(exact).astype(np.int64)
    rest = np.argsort(-(exact - out), kind="stable")[: total - int(out.sum())]
    out[rest] += 1
    return out


@dataclass
class Draw:
    """Each epoch's samples of a mixture: `groups` (global training indices of one cache and latent shape each),
    their per-epoch `quotas`, and the cache of each group."""

    groups: list[np.ndarray]
    quotas: np.ndarray
    group_cache: np.ndarray
    cache_quotas: np.ndarray  # per cache
    cache_sizes: np.ndarray  # training samples per cache

    @classmethod
    def build(cls, reader: MixedReader, train_indices: np.ndarray, weights: list[float], buckets: np.ndarray) -> Draw:
        """`buckets[i]`: sample i's latent shape id (order.bucket_ids)."""
        train_indices = np.asarray(train_indices)  # a draw by weight is made over every training sample
        cache = reader.cache_of[train_indices]
        sizes = np.bincount(cache, minlength=len(reader.readers))
        cache_quotas = largest_remainder(np.asarray(weights), len(train_indices))
        for c in np.flatnonzero(cache_quotas == 0):  # a weight too small against the others' to draw one sample
            least = float(np.sum(weights)) / len(train_indices)
            raise UserError(
                f"config key 'data': cache {reader.readers[c].cache_dir}'s weight {weights[c]:g} gives it none of "
                f"the {len(train_indices)} samples of an epoch (its share {weights[c] / np.sum(weights):.2g}); "
                f"give it a weight of at least {least:.3g} against the others, or leave it out"
            )
        groups, quotas, group_cache = [], [], []
        for c in range(len(reader.readers)):
            mine = train_indices[cache == c]
            shapes, of = np.unique(buckets[mine], return_inverse=True)
            per_shape = largest_remainder(np.bincount(of.reshape(-1)), int(cache_quotas[c]))
            for k in range(len(shapes)):
                groups.append(mine[of.reshape(-1) == k])
                quotas.append(int(per_shape[k]))
                group_cache.append(c)
        return cls(groups, np.array(quotas, dtype=np.int64), np.array(group_cache), cache_quotas, sizes)

    def epoch(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's drawn samples (global indices, with repeats), group after group; order.epoch_batches shuffles
        them."""
        out = []
        for g, (members, quota) in enumerate(zip(self.groups, self.quotas.tolist())):
            if quota == len(members):
                out.append(members)
                continue
            rounds = -(-quota // len(members))
            perms = [
                torch.randperm(
                    len(members), generator=torch.Generator().manual_seed(seed_of("mix", seed, epoch, g, r))
                ).numpy()
                for r in range(rounds)
            ]
            out.append(members[np.concatenate(perms)[:quota]])
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def bucket_sizes(self, buckets: np.ndarray) -> np.ndarray:
        """Samples per latent shape in every epoch's draw (the same each epoch)."""
        shape_of_group = [int(buckets[g[0]]) for g in self.groups]
        return np.bincount(shape_of_group, weights=self.quotas, minlength=int(buckets.max(initial=0)) + 1).astype(
            np.int64
        )

    def describe(self, reader: MixedReader, weights: list[float]) -> str:
        """The start line: each cache's training samples, share and effective epochs per epoch of the mixture."""
        total = float(np.sum(weights))
        parts = [
            f"{named(r)} {int(n)} samples, share {w / total:.1%}, {q / max(int(n), 1):.2f} epochs"
            for r, n, w, q in zip(reader.readers, self.cache_sizes, weights, self.cache_quotas)
        ]
        return "mixture per epoch: " + "; ".join(parts)
